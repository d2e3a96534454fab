"""What runs in the workers of a foreign executor: a stdlib pool's process, a Dask worker.

Workers find these functions by reference (module and name), so this module imports
nothing heavy, neither Triton nor Dask.

A job carries the submitting process's job environment (``TRITON_*`` and kin, see
``_pool.procs.job_env``) and import path. A stdlib pool's worker is this machine's, and takes
both as they are (``run_in_foreign_worker``). A Dask worker may be another machine's, or
this very process, and ``run_on_dask_worker`` takes them with three differences:

- variables that name something of the submitting machine (``..._DIR``, ``..._PATH``,
  ``..._PATHS``, ``..._HOME``, ``..._VISIBLE_DEVICES``: Triton's cache directory, a ptxas
  path, which GPUs to use) stay behind: the worker keeps its own. The others, those that
  change what the compiler builds (and Triton's key with it), travel, so that the worker
  builds what the submitting process keyed;
- the submitting process's import path goes in front of the worker's own, for the
  directories that exist there, instead of replacing it: the worker's own packages may
  live elsewhere;
- in the submitting process itself (a cluster of threads, ``processes=False``), nothing is
  applied: the environment is already the job's.

And the answer of a Dask job travels as bytes, checksummed (:func:`frame_answer`), never
as live objects for the cluster to hold or to unpickle on the way.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

from aiocompile._pool.child import JobState
from aiocompile._pool.procs import job_env
from aiocompile._pool.protocol import describe_failure

Answer = tuple[bool, Any, float, int, float]

_state = JobState()
_MAGIC = b"AIOCOMPILE-ANSWER\n"
_VERSION = 1
_DIGEST = hashlib.sha256().digest_size
_LOCAL_SUFFIXES = ("_DIR", "_PATH", "_PATHS", "_HOME", "_VISIBLE_DEVICES")


def run_in_foreign_worker(payload: bytes, env: dict[str, str], sys_path: list[str]) -> Answer:
    """What a foreign executor runs: apply the job's environment, run it, time it.

    Returns ``(ok, value, run_time, pid, started_wall)``: ``value`` is the result, or the
    job's exception described by ``describe_failure``; this never raises."""
    return run_payload(payload, lambda: _state.apply(env, sys_path))


def run_payload(payload: bytes, prepare: Callable[[], None] | None = None) -> Answer:
    """Run a job's pickled ``(fn, args, kwargs)`` after ``prepare()`` (its environment);
    ``run_in_foreign_worker``'s answer, and like it never raises."""
    started_wall = time.time()
    started = time.perf_counter()
    try:
        if prepare is not None:
            prepare()
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a job's failure, whatever it is, goes to its caller
        run_time = time.perf_counter() - started
        return False, describe_failure(exc), run_time, os.getpid(), started_wall
    return True, result, time.perf_counter() - started, os.getpid(), started_wall


# -- a Dask worker ------------------------------------------------------------------------------


def origin() -> tuple[str, int]:
    """Where a job is submitted from: this host and process."""
    return socket.gethostname(), os.getpid()


def machine_local(name: str) -> bool:
    """Whether a job variable names something of the submitting machine (module docstring)."""
    return name.endswith(_LOCAL_SUFFIXES)


class _DaskState:
    """A Dask worker's own import path, and what was applied to it last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._own_path: list[str] | None = None
        self._applied: tuple[str, ...] | None = None

    def apply(self, env: dict[str, str], sys_path: list[str]) -> None:
        # Jobs may run in several threads of one worker: one at a time here. What they
        # set is process-wide, which is fine for the jobs of one submitter (the same
        # settings), and why a compile cluster's workers are best given one thread each.
        with self._lock:
            if self._own_path is None:
                self._own_path = list(sys.path)
            wanted_path = tuple(sys_path)
            if wanted_path != self._applied:
                theirs = [p for p in sys_path if p and os.path.isdir(p)]
                sys.path[:] = theirs + [p for p in self._own_path if p not in theirs]
                self._applied = wanted_path
            wanted = {k: v for k, v in env.items() if not machine_local(k)}
            current = {k: v for k, v in job_env().items() if not machine_local(k)}
            if current != wanted:
                for name in current:
                    if name not in wanted:
                        del os.environ[name]
                os.environ.update(wanted)


_dask_state = _DaskState()


def run_on_dask_worker(payload: bytes, env: dict[str, str], sys_path: list[str], submitter: tuple[str, int]) -> bytes:
    """What a Dask worker runs for a job of ``aiocompile.dask``'s executor: the job, in its
    environment (module docstring), its answer framed as bytes. Never raises."""
    here = submitter == origin()
    return frame_answer(run_payload(payload, None if here else lambda: _dask_state.apply(env, sys_path)))


def frame_answer(answer: Answer) -> bytes:
    """A job's answer pickled, behind a magic string, a version and its SHA-256. A result
    that does not pickle becomes its job's failure."""
    try:
        body = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - a result that does not pickle fails its own job
        _, _, run_time, pid, started_wall = answer
        failure = describe_failure(TypeError(f"the job's result cannot be sent back: {exc}"))
        body = pickle.dumps((False, failure, run_time, pid, started_wall), protocol=pickle.HIGHEST_PROTOCOL)
    return _MAGIC + struct.pack("<B", _VERSION) + hashlib.sha256(body).digest() + body


def is_framed(data: Any) -> bool:
    return isinstance(data, bytes) and data.startswith(_MAGIC)


def unframe_answer(data: bytes) -> Answer:
    """What :func:`frame_answer` framed; ``ValueError`` for bytes that were damaged on the
    way, or are no such frame."""
    if not is_framed(data) or len(data) < len(_MAGIC) + 1 + _DIGEST:
        raise ValueError(f"not a framed answer ({type(data).__name__})")
    (version,) = struct.unpack_from("<B", data, len(_MAGIC))
    if version != _VERSION:
        raise ValueError(f"unsupported answer frame version {version}")
    start = len(_MAGIC) + 1
    digest, body = data[start:start + _DIGEST], data[start + _DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("the answer's bytes are corrupted (checksum mismatch)")
    answer: Answer = pickle.loads(body)
    return answer
