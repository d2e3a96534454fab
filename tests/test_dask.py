"""Compiles on a real Dask cluster (``distributed.LocalCluster`` of worker processes with
nannies): real Triton compiles, a worker SIGKILLed in the middle of a batch, a job that
kills every worker it meets, a job past its timeout, a kernel defined in a script's
``__main__``, and ``aiocompile build --dask``."""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import anyio
import jobs
import pytest
from conftest import ROOT, alive, subprocess_env, wait_until
from test_faults import gather
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile
from aiocompile._foreign.remote import unframe_answer
from aiocompile._pool import serialize

distributed = pytest.importorskip("distributed")
aiocompile_dask = pytest.importorskip("aiocompile.dask")


@pytest.fixture(scope="module")
def cluster_client():
    """Two single-threaded worker processes, each under a nanny that restarts it: started
    once for the module (a cluster takes seconds to start).

    A LocalCluster closes the nanny of a worker found down ``lost-worker-timeout`` after
    an earlier death of it (it takes it for lost for good); the tests kill workers over
    and over, so that bound is lifted here, as a cluster of ``dask worker`` processes
    has none."""
    import dask

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                           silence_logs=logging.CRITICAL)
        try:
            with distributed.Client(cluster, set_as_default=False) as client:
                yield client
                # A worker a test killed may still be restarting: closing the cluster
                # then races its registration, so the close waits for both to be up.
                client.wait_for_workers(2, timeout=120)
        finally:
            _close(cluster)


def _close(cluster) -> None:
    """Close a LocalCluster whose workers the tests killed over and over. Closing,
    distributed's ``Cluster`` looks up each removed worker's name by its address in its
    own view of the scheduler; a worker restarted by its nanny can be gone from that view
    already, and the lookup raises ``KeyError`` for its address (two CI runs out of many).
    That comes after the scheduler and the workers are closed: it is let go only then."""
    try:
        cluster.close()
    except KeyError:
        assert cluster.scheduler.status.name == "closed", cluster.scheduler.status
        assert all(worker.status.name == "closed" for worker in cluster.workers.values()), [
            worker.status for worker in cluster.workers.values()]


@pytest.fixture
def dask_client(cluster_client):
    """The module's client, once both workers are up (a worker killed by the test before
    may still be restarting)."""
    cluster_client.wait_for_workers(2, timeout=120)
    return cluster_client


def worker_pids(client):
    return set(client.run(os.getpid).values())


async def in_thread(fn):
    return await anyio.to_thread.run_sync(fn)


def our_tasks(client):
    return [key for keys in client.processing().values() for key in keys if str(key).startswith("aiocompile-")]


async def test_compiles_run_on_the_cluster(dask_client):
    async with aiocompile.Scheduler(executor=dask_client) as sched:
        assert isinstance(sched.port._pool._executor, aiocompile_dask.DaskExecutor)
        kernels = await sched.compile_many([
            {"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": block}, "target": "cuda:80"}
            for block in (64, 128, 256)
        ])
        stats, records = sched.statistics(), sched.records()
    assert [k.constexprs["BLOCK"] for k in kernels] == [64, 128, 256]
    assert all(isinstance(k, aiocompile.TritonKernel) and k.binary for k in kernels)
    assert (stats.compiled, stats.failed, stats.workers) == (3, 0, 2)
    # Compiled in the cluster's worker processes, not here.
    pids = await in_thread(lambda: worker_pids(dask_client))
    assert {r.worker_pid for r in records} <= pids and os.getpid() not in pids


def test_answers_travel_as_checksummed_bytes(dask_client):
    executor = aiocompile_dask.executor(dask_client)
    try:
        payload = serialize.dumps((jobs.echo, ("value",), {}))
        raw = dask_client.submit(executor.job_runner, payload, {}, [], pure=False).result()
        assert isinstance(raw, bytes)
        assert unframe_answer(raw)[:2] == (True, "value")
        with pytest.raises(ValueError, match="corrupted"):
            unframe_answer(raw[:-1] + bytes([raw[-1] ^ 1]))
    finally:
        executor.shutdown()


async def test_job_settings_travel_but_not_this_machines_paths(dask_client, monkeypatch):
    monkeypatch.setenv("TRITON_AIOCOMPILE_TEST_FLAG", "on")
    monkeypatch.setenv("TRITON_AIOCOMPILE_TEST_DIR", "/only/on/the/submitting/machine")
    async with aiocompile.Scheduler(executor=dask_client) as sched:
        assert await sched.run(jobs.getenv, "TRITON_AIOCOMPILE_TEST_FLAG") == "on"
        assert await sched.run(jobs.getenv, "TRITON_AIOCOMPILE_TEST_DIR") is None


async def test_a_worker_killed_mid_batch_costs_nothing_but_a_rerun(dask_client, tmp_path):
    sched = aiocompile.Scheduler(executor=dask_client)
    marks = [tmp_path / f"sleeper-{i}" for i in range(4)]

    async def kill_the_first_sleepers_worker():
        # Its worker has started it: SIGKILL that worker process, for real.
        assert await in_thread(lambda: wait_until(lambda: marks[0].exists() and marks[0].read_text(), 60))
        pid = int(marks[0].read_text().split()[1])
        os.kill(pid, signal.SIGKILL)
        return pid

    try:
        sleepers = [lambda i=i: sched.run(jobs.mark_start_and_end, str(marks[i]), 1.0, i) for i in range(4)]
        compiles = [lambda b=b: sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": b},
                                                     target="cuda:90", num_warps=2)
                    for b in (64, 128, 256, 512)]
        results = await gather(*sleepers, *compiles, kill_the_first_sleepers_worker)
        stats = sched.statistics()
    finally:
        await sched.aclose()
    killed = results[-1]
    assert results[:4] == [0, 1, 2, 3], results
    assert [k.constexprs["BLOCK"] for k in results[4:8]] == [64, 128, 256, 512]
    # Every job ran to its end exactly once; the one whose worker was killed started twice.
    attempts = [mark.read_text().split("\n")[:-1] for mark in marks]
    assert [sum(line.startswith("end") for line in lines) for lines in attempts] == [1, 1, 1, 1]
    assert attempts[0][0] == f"start {killed}" and sum(line.startswith("start") for line in attempts[0]) == 2
    assert all(len(lines) == 2 for lines in attempts[1:])
    assert (stats.compiled, stats.failed, stats.worker_crashes, stats.in_flight) == (8, 0, 1, 0)
    assert stats.retries >= 1
    assert not alive({killed})


async def test_a_poison_job_fails_after_max_crashes_and_innocents_succeed(dask_client):
    sched = aiocompile.Scheduler(executor=dask_client, max_crashes=2)
    try:
        innocents = [lambda i=i: sched.run(jobs.sleep_then, 0.3, i) for i in range(4)]
        results = await gather(lambda: sched.run(jobs.exit_now, 3), *innocents)
        stats = sched.statistics()
        assert await sched.run(jobs.echo, "after") == "after"
    finally:
        await sched.aclose()
    assert isinstance(results[0], aiocompile.WorkerCrashed), results[0]
    assert results[0].kernel_name == "exit_now" and results[0].attempts == 3
    assert results[1:] == [0, 1, 2, 3]
    # One death with others about (a suspect, not yet blamed), then two with it alone.
    assert (stats.worker_crashes, stats.failed, stats.compiled) == (3, 1, 4)
    # Dask retried nothing behind the count: its allowed_failures is 0.
    assert await in_thread(lambda: dask_client.run_on_scheduler(_allowed_failures)) == 0


def _allowed_failures(dask_scheduler=None):
    return dask_scheduler.allowed_failures


async def test_a_timeout_stops_the_task_and_restarts_its_worker(dask_client, tmp_path, caplog):
    # Every logger at every level: the job's future, failed by its timeout, is FINISHED
    # when the stopped task's answer comes, and the stdlib logs "Future ... in unexpected
    # state" at CRITICAL if that answer starts it again.
    caplog.set_level(logging.DEBUG)
    mark = tmp_path / "hung"
    async with aiocompile.Scheduler(executor=dask_client) as sched:
        with anyio.fail_after(60):
            with pytest.raises(aiocompile.JobTimeout, match="restarted"):
                await sched.run(jobs.mark_then_sleep, str(mark), 300, timeout=1.0)
        pid = int(mark.read_text())
        # The compile does not go on holding the cluster: its worker process is gone,
        # and no task of ours is left there.
        assert await in_thread(lambda: wait_until(lambda: not alive({pid}), 60))
        assert await in_thread(lambda: wait_until(lambda: not our_tasks(dask_client), 60))
        assert await gather(*[lambda i=i: sched.run(jobs.sleep_then, 0.2, i) for i in range(2)]) == [0, 1]
        stats = sched.statistics()
    assert (stats.timeouts, stats.worker_crashes, stats.failed) == (1, 0, 1)
    # Ours and the stdlib's (Dask's own scheduler may log, at ERROR, the task whose worker
    # was restarted under it: that is the cluster's account of what was done to it).
    assert [(r.name, r.getMessage()) for r in caplog.records
            if r.levelno >= logging.ERROR and not r.name.startswith("distributed")] == []
    assert not [r for r in caplog.records if "unexpected state" in r.getMessage()]


async def test_aclose_stops_what_still_runs_on_the_cluster(dask_client, tmp_path):
    mark = tmp_path / "running"
    sched = aiocompile.Scheduler(executor=dask_client)
    outcome = {}

    async def outlive():
        try:
            await sched.run(jobs.mark_then_sleep, str(mark), 300)
        except aiocompile.SchedulerClosed as exc:
            outcome["error"] = exc

    with anyio.fail_after(90):
        async with anyio.create_task_group() as group:
            group.start_soon(outlive)
            assert await in_thread(lambda: wait_until(lambda: mark.exists() and mark.read_text(), 60))
            await sched.aclose(grace=0)
    assert isinstance(outcome["error"], aiocompile.SchedulerClosed)
    assert await in_thread(lambda: wait_until(lambda: not alive({int(mark.read_text())}), 60))
    assert await in_thread(lambda: wait_until(lambda: not our_tasks(dask_client), 60))


def test_the_cluster_retries_nothing_behind_our_count(dask_client):
    def set_allowed_failures(value, dask_scheduler=None):
        dask_scheduler.allowed_failures = value

    dask_client.run_on_scheduler(set_allowed_failures, 3)
    with pytest.raises(ValueError, match="allowed_failures"):
        aiocompile_dask.executor(dask_client, configure_cluster=False)
    aiocompile_dask.executor(dask_client).shutdown()  # takes it over
    assert dask_client.run_on_scheduler(_allowed_failures) == 0


def test_executor_arguments_are_checked(dask_client):
    with pytest.raises(TypeError, match="distributed.Client"):
        aiocompile_dask.executor(42)
    with pytest.raises(TypeError, match="resources"):
        aiocompile_dask.executor(dask_client, resources=["compile"])
    with pytest.raises(ValueError, match="resources"):
        aiocompile_dask.executor(dask_client, resources={"compile": 0})

    async def asynchronous_client():
        client = await distributed.Client(dask_client.scheduler.address, asynchronous=True, set_as_default=False)
        try:
            with pytest.raises(ValueError, match="synchronous"):
                aiocompile_dask.executor(client)
        finally:
            await client.close()

    asyncio.run(asynchronous_client())


MAIN_SCRIPT = '''
import asyncio, json, sys
import distributed, triton, triton.language as tl
import aiocompile

@triton.jit
def only_in_main(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 3.0, mask=mask)

def triple(x):
    return 3 * x

async def main(client):
    async with aiocompile.Scheduler(executor=client) as sched:
        kernel = await sched.compile_triton(only_in_main, signature={"x_ptr": "*fp32", "n": "i32"},
                                            constexprs={"BLOCK": 128}, target="cuda:90")
        value = await sched.run(triple, 14)
        records = sched.records()
    return {"name": kernel.name, "binary": len(kernel.binary), "value": value,
            "pids": [r.worker_pid for r in records], "compiled": sched.statistics().compiled}

client = distributed.Client(sys.argv[1], set_as_default=False)
print(json.dumps(asyncio.run(main(client))))
client.close()
'''


def test_a_kernel_defined_in_main_reaches_the_workers(dask_client, tmp_path):
    script = tmp_path / "notebook_like.py"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), dask_client.scheduler.address], capture_output=True,
                          text=True, env=subprocess_env(), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (answer["name"], answer["value"], answer["compiled"]) == ("only_in_main", 42, 2)
    assert answer["binary"] > 1000
    assert set(answer["pids"]) <= worker_pids(dask_client)


KERNEL_SET = '''
import triton
import triton.language as tl

@triton.jit
def scale(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)

KERNELS = [
    {"kernel": scale, "label": f"scale_{block}", "signature": {"x_ptr": "*fp32", "n": "i32"},
     "constexprs": {"BLOCK": block}}
    for block in (64, 128, 256)
]
'''


def test_build_on_the_cluster(dask_client, tmp_path):
    kernel_set = tmp_path / "fleet_kernels.py"
    kernel_set.write_text(textwrap.dedent(KERNEL_SET))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "aiocompile", "build", str(kernel_set), "--target", "cuda:80",
                           "--out", str(out), "--no-progress", "--dask", dask_client.scheduler.address],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"on the Dask cluster at {dask_client.scheduler.address} (2 worker threads)" in proc.stderr
    assert "3 built, 0 failed" in proc.stdout and "scale_256" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["label"] for e in manifest["kernels"]] == ["scale_64", "scale_128", "scale_256"]
    stats = manifest["statistics"]
    assert (stats["compiled"], stats["failed"], stats["workers_started"]) == (3, 0, 0)
    for entry in manifest["kernels"]:
        kernel = aiocompile.TritonKernel.from_bytes((out / entry["file"]).read_bytes())
        assert kernel.key == entry["key"] and kernel.target == "cuda:80"

    quick = subprocess_env(DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s")
    unreachable = subprocess.run([sys.executable, "-m", "aiocompile", "build", str(kernel_set), "--target",
                                  "cuda:80", "--out", str(tmp_path / "none"), "--dask", "tcp://127.0.0.1:9"],
                                 capture_output=True, text=True, env=quick, timeout=120, cwd=ROOT)
    assert unreachable.returncode == 2 and "cannot use the Dask cluster" in unreachable.stderr
