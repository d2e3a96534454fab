"""The serving example under a burst of requests for kernels it has not seen: compiling
through aiocompile, and compiling with ``triton.compile`` in its event loop.

For each mode, ``examples/serve.py`` is started (uvicorn on loopback, an empty Triton cache
of its own) and, once it answers, 22 kernels it has not compiled (softmax and layer norm,
block sizes 16 to 16384) are asked for at once, each by three concurrent requests for
different row lengths. Meanwhile a client asks for ``/healthz`` every 10 ms, one request
after another. Reported per mode: health-check latency (p50, p99, max), how many checks
were answered while the burst ran, the burst's wall time and the kernel requests' latency;
then the ratios of the in-loop figures to aiocompile's.

    python benchmarks/bench_serving.py [--workers N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE = os.path.join(ROOT, "examples", "serve.py")

BLOCKS = [1 << n for n in range(4, 15)]
# Three row lengths per block size, all of them specialised to that block.
BURST = [(endpoint, cols) for endpoint in ("softmax", "layernorm") for block in BLOCKS
         for cols in (block, block * 3 // 4 + 1, block // 2 + 1)]
HEALTH_PERIOD = 0.010


def percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


class Server:
    """``examples/serve.py`` in a process of its own, on a free loopback port."""

    def __init__(self, mode: str, workers: int | None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._cache = tempfile.TemporaryDirectory(prefix="aiocompile-serving-")
        self._log = tempfile.TemporaryFile()
        env = {**os.environ, "TRITON_CACHE_DIR": self._cache.name,
               "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        args = [sys.executable, SERVE, "--port", str(port), "--mode", mode, "--log-level", "warning"]
        if workers is not None:
            args += ["--workers", str(workers)]
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    async def ready(self, client, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if (await client.get(self.url + "/healthz", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the server did not answer in {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._cache.cleanup()


async def burst(mode: str, workers: int | None) -> dict:
    import httpx

    server = Server(mode, workers)
    try:
        async with httpx.AsyncClient(timeout=300) as health_client, httpx.AsyncClient(timeout=300) as client:
            await server.ready(health_client)
            health: list[tuple[float, float]] = []
            done = asyncio.Event()

            async def health_checks() -> None:
                while not done.is_set():
                    sent = time.perf_counter()
                    response = await health_client.get(server.url + "/healthz")
                    health.append((sent, time.perf_counter() - sent))
                    response.raise_for_status()
                    await asyncio.sleep(HEALTH_PERIOD)

            async def ask(endpoint: str, cols: int) -> tuple[float, dict]:
                sent = time.perf_counter()
                response = await client.get(f"{server.url}/{endpoint}", params={"cols": cols})
                latency = time.perf_counter() - sent
                if response.status_code != 200:
                    raise RuntimeError(f"/{endpoint}?cols={cols}: {response.status_code} {response.text}")
                return latency, response.json()

            checking = asyncio.create_task(health_checks())
            await asyncio.sleep(0.3)
            started = time.perf_counter()
            answers = await asyncio.gather(*(ask(endpoint, cols) for endpoint, cols in BURST))
            ended = time.perf_counter()
            done.set()
            await checking
            metrics = (await client.get(server.url + "/metrics")).text
    finally:
        server.stop()

    latencies = sorted(latency for _, latency in health)
    requests = sorted(latency for latency, _ in answers)
    bodies = [body for _, body in answers]
    keys = {(body["kernel"], body["block"]): body["key"] for body in bodies}
    compiled_in_pool = None
    if mode == "aiocompile":
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                if sample.name == "aiocompile_requests_total" and sample.labels["outcome"] == "compiled":
                    compiled_in_pool = int(sample.value)
    return {
        "target": bodies[0]["target"],
        "launched": bodies[0]["launched"],
        "kernels": len(keys),
        "requests": len(bodies),
        "compiles": sum(1 for body in bodies if body["outcome"] == "compiled"),
        "compiled_per_metrics": compiled_in_pool,
        "burst_s": ended - started,
        "health_checks": len(latencies),
        "health_during_burst": sum(1 for sent, _ in health if started <= sent <= ended),
        "health_p50_ms": percentile(latencies, 0.50) * 1000,
        "health_p99_ms": percentile(latencies, 0.99) * 1000,
        "health_max_ms": latencies[-1] * 1000,
        "request_p50_ms": percentile(requests, 0.50) * 1000,
        "request_max_ms": requests[-1] * 1000,
        "keys": {f"{name}/{block}": key for (name, block), key in sorted(keys.items())},
    }


ROWS = [
    ("health check p50 ms", "health_p50_ms", "{:.1f}"),
    ("health check p99 ms", "health_p99_ms", "{:.1f}"),
    ("health check max ms", "health_max_ms", "{:.1f}"),
    ("health checks during burst", "health_during_burst", "{:d}"),
    ("burst wall s", "burst_s", "{:.2f}"),
    ("kernel request p50 ms", "request_p50_ms", "{:.0f}"),
    ("kernel request max ms", "request_max_ms", "{:.0f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, help="the pool's worker processes (default: one per CPU)")
    parser.add_argument("--json")
    options = parser.parse_args()

    report: dict = {"cpus": os.cpu_count(), "workers": options.workers, "requests": len(BURST)}
    for mode in ("aiocompile", "loop"):
        report[mode] = asyncio.run(burst(mode, options.workers))
    pooled, in_loop = report["aiocompile"], report["loop"]
    if pooled["keys"] != in_loop["keys"]:
        raise RuntimeError("the two modes compiled different kernels")
    report["ratios"] = {field: (in_loop[field] / pooled[field] if pooled[field] else None) for _, field, _ in ROWS}

    print(f"{len(BURST)} requests for {pooled['kernels']} new kernels at once, target {pooled['target']}"
          f"{' (launched)' if pooled['launched'] else ''}, {report['cpus']} CPUs, "
          f"compiled in the pool: {pooled['compiled_per_metrics']}, in the loop: {in_loop['compiles']}")
    print(f"{'':<28}{'aiocompile':>12}{'in the loop':>13}{'ratio':>9}")
    for label, field, form in ROWS:
        ratio = report["ratios"][field]
        print(f"{label:<28}{form.format(pooled[field]):>12}{form.format(in_loop[field]):>13}"
              f"{'' if ratio is None else f'{ratio:.2f}':>9}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
