"""The model-serving example (examples/serve_model.py), run as its users run it: uvicorn in
a process of its own on loopback, its model defined in its own main script. Requests are
answered eagerly while a worker compiles the model, compiled afterwards, equal to eager."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from conftest import ROOT, alive, child_pids, subprocess_env, wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

SERVE = ROOT / "examples" / "serve_model.py"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, **params) -> httpx.Response:
    return httpx.get(url, params=params, timeout=120)


@pytest.mark.timeout(900)
def test_the_service_answers_at_once_and_then_compiled(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = subprocess_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                         AIOCOMPILE_WORKERS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(SERVE), "--port", str(port), "--dim", "32", "--heads", "2",
                                 "--blocks", "1", "--device", "cpu", "--warm", "2x8"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return get(url + "/healthz").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, timeout=120, interval=0.1), log.read_text()

        # Start-up began the compile of 2x8 and did not wait for it: the service answers
        # the shape at once, eagerly.
        status = get(url + "/status").json()
        assert status["model"] == "Transformer" and status["compiling"] == ["f32[2, 8, 32] cpu"], status
        first = get(url + "/predict", batch=2, seq=8, check=1)
        assert first.status_code == 200, first.text
        body = first.json()
        assert (body["shape"], body["served"], body["max_abs_difference"]) == ([2, 8, 32], "eager", 0.0)
        eager_sum = body["sum"]
        # A shape nobody warmed starts its own compile with its first request.
        other = get(url + "/predict", batch=1, seq=4).json()
        assert other["served"] == "eager" and other["state"] in ("compiling", "compiled")

        # Bad input is a 400 saying what is wrong, whatever is compiling.
        for params, words in ((dict(batch=0, seq=8), "batch must be from 1"), (dict(seq=8), "missing"),
                              (dict(batch=2, seq=8, color="red"), "unknown query parameter"),
                              (dict(batch="two", seq=8), "whole number")):
            response = get(url + "/predict", **params)
            assert response.status_code == 400 and words in response.json()["error"], response.text
        assert get(url + "/nowhere").status_code == 404

        def compiled() -> bool:
            shapes = {s["signature"]: s for s in get(url + "/status").json()["shapes"]}
            assert all(s["state"] != "failed" for s in shapes.values()), shapes
            return {"f32[2, 8, 32] cpu", "f32[1, 4, 32] cpu"} <= {sig for sig, s in shapes.items()
                                                                 if s["state"] == "compiled"}

        assert wait_until(compiled, timeout=800, interval=0.5), log.read_text()[-5000:]
        after = get(url + "/predict", batch=2, seq=8, check=1).json()
        assert after["served"] == "compiled" and after["max_abs_difference"] < 1e-4, after
        assert abs(after["sum"] - eager_sum) < 1e-2
        shapes = {s["signature"]: s for s in get(url + "/status").json()["shapes"]}
        warm = shapes["f32[2, 8, 32] cpu"]
        assert warm["eager_calls"] == 1 and warm["compiled_calls"] == 1 and warm["repro"] is None
        assert [stage for stage in warm["stages"]] == ["load", "export", "compile", "trial"]
        # The model class lives in the server's main script: the worker ran that script as
        # a module of its own, not as __main__ (no second server started).
        assert log.read_text().count("Uvicorn running on") == 1
        children = child_pids(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    # uvicorn ends by raising the signal it stopped for again.
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-5000:]
    assert "Application shutdown complete" in log.read_text()
    # Closing the service closed its scheduler: the workers and the fork server are gone.
    assert children and wait_until(lambda: not alive(children), timeout=30), alive(children)
