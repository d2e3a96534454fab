"""Event loops come and go; the scheduler and its processes must not care, nor leak."""

import json
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, alive, child_pids, subprocess_env
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile


async def test_no_process_is_left_after_aclose():
    before = child_pids()
    sched = aiocompile.Scheduler(workers=2)
    await sched.warm("cuda:80")
    started = child_pids() - before
    # The fork server and two workers (and, now and then, a compiler they are running).
    assert set(sched.worker_pids()) <= started and len(started) >= 3
    await sched.aclose()
    assert child_pids() - before == set()
    with pytest.raises(aiocompile.SchedulerClosed):
        await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64}, target="cuda:80")
    await sched.aclose()  # closing twice is fine


async def test_aclose_fails_queued_requests_with_scheduler_closed():
    import anyio

    sched = aiocompile.Scheduler(workers=1)
    errors = []

    async def request(block):
        try:
            await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": block},
                                       target="cuda:80")
        except aiocompile.SchedulerClosed as exc:
            errors.append(exc)

    async with anyio.create_task_group() as group:
        for i in range(4):
            group.start_soon(request, 64 * 2**i)
        await anyio.sleep(0.05)
        await sched.aclose(grace=0)
    # Whatever had not finished when the scheduler closed got SchedulerClosed; nothing hangs.
    stats = sched.statistics()
    assert stats.compiled + len(errors) == 4
    assert stats.in_flight == 0


LOOPS = textwrap.dedent('''
    import asyncio, json, os, sys, threading
    sys.path.insert(0, sys.argv[1])
    import trio, uvloop
    import aiocompile
    from triton_kernels import ADD_SIGNATURE, add_kernel

    def compile_with(block):
        return aiocompile.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": block},
                                         target="cuda:80")

    keys = []
    for block in (64, 128, 64):                       # several asyncio.run() in a row
        keys.append(asyncio.run(compile_with(block)).key)
    keys.append(trio.run(compile_with, 256).key)       # trio
    keys.append(uvloop.run(compile_with(512)).key)    # uvloop

    results = {}
    def in_thread(block):                              # a loop in each of several threads
        results[block] = asyncio.run(compile_with(block)).key
    threads = [threading.Thread(target=in_thread, args=(b,)) for b in (1024, 2048, 64)]
    for t in threads: t.start()
    for t in threads: t.join()

    sched = aiocompile.default_scheduler()
    stats = sched.statistics()
    print(json.dumps({"keys": keys, "threads": results, "compiled": stats.compiled,
                      "cache_hits": stats.cache_hits, "joined": stats.joined,
                      "descendants": sorted(sched.worker_pids())}), flush=True)
''')


def test_default_scheduler_serves_any_event_loop_and_leaves_nothing_at_exit(tmp_path):
    proc = subprocess.run([sys.executable, "-c", LOOPS, str(ROOT / "tests")], capture_output=True, text=True,
                          env=subprocess_env(AIOCOMPILE_WORKERS="2"), timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = result["keys"]
    assert keys[0] == keys[2] and len(set(keys)) == 4
    assert result["threads"]["64"] == keys[0]
    assert result["compiled"] == 6
    assert result["cache_hits"] + result["joined"] == 2
    # The interpreter exited: its workers went with it.
    time.sleep(0.2)
    assert not alive(set(result["descendants"]))


FORK = textwrap.dedent('''
    import asyncio, json, os, sys
    sys.path.insert(0, sys.argv[1])
    import aiocompile
    from triton_kernels import ADD_SIGNATURE, add_kernel

    def compile_with(block):
        return aiocompile.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": block},
                                         target="cuda:80")

    parent_sched = aiocompile.default_scheduler()
    asyncio.run(compile_with(64))
    parent_workers = set(parent_sched.worker_pids())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        report = {}
        try:
            asyncio.run(parent_sched.compile_triton(add_kernel, signature=ADD_SIGNATURE,
                                                    constexprs={"BLOCK": 64}, target="cuda:80"))
        except aiocompile.SchedulerClosed as exc:
            report["parent_scheduler"] = "SchedulerClosed"
        child_sched = aiocompile.default_scheduler()
        report["fresh"] = child_sched is not parent_sched
        report["compiled"] = asyncio.run(compile_with(128)).name
        report["own_workers"] = not (set(child_sched.worker_pids()) & parent_workers)
        os.write(write, json.dumps(report).encode())
        child_sched.close()
        os._exit(0)
    os.waitpid(pid, 0)
    child = json.loads(os.read(read, 65536))
    again = asyncio.run(compile_with(256)).name
    print(json.dumps({"child": child, "parent_after_fork": again,
                      "same_workers": set(parent_sched.worker_pids()) == parent_workers}))
''')


def test_a_forked_child_gets_a_fresh_default_scheduler():
    proc = subprocess.run([sys.executable, "-c", FORK, str(ROOT / "tests")], capture_output=True, text=True,
                          env=subprocess_env(AIOCOMPILE_WORKERS="1"), timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["child"] == {"parent_scheduler": "SchedulerClosed", "fresh": True, "compiled": "add_kernel",
                               "own_workers": True}
    assert result["parent_after_fork"] == "add_kernel" and result["same_workers"]
