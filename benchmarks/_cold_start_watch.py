"""What ran beside a slow eager call or a stalled loop, for ``bench_cold_start.py``'s
diagnostics: every thread's stacks (:class:`StallSampler`, which needs the interpreter
lock to look), each thread's time on a CPU read from ``/proc`` by a process of its own
(:class:`ThreadTimes`, which takes nothing from the measured process), where the CPUs
went until compiled answers came, this process's threads and every process it started
(:class:`ProcessTimes`, read the same way), and long C calls
(:func:`long_calls`, which slows the threads it watches). Times are seconds since
``origin`` (the benchmark program's start, ``time.perf_counter``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

__all__ = ["ProcessTimes", "StallSampler", "ThreadTimes", "long_calls"]


def long_calls(threshold: float, found: list[tuple[float, float, str, str]], origin: float) -> None:
    """Have every thread started from now on note its C calls that last ``threshold``
    seconds or more and run no Python meanwhile: (began, from the program's start; length;
    thread; the call and the Python frames it was made from). Such a call holds the
    interpreter lock throughout unless it lets it go, so these are what can stall the loop
    from another thread (waits, which let it go, are left out)."""
    import sys
    import threading

    waits = {"acquire", "get", "recv", "recv_into", "poll", "select", "read", "readinto", "sleep", "waitpid",
             "accept", "wait", "communicate", "result", "join", "synchronize"}

    def profile_of_thread() -> object:
        began: list[tuple[float, int]] = []
        python_calls = [0]

        def profile(frame: object, event: str, arg: object) -> None:
            if event == "call":
                python_calls[0] += 1
            elif event == "c_call":
                began.append((time.perf_counter(), python_calls[0]))
            elif event in ("c_return", "c_exception") and began:
                start, calls = began.pop()
                length = time.perf_counter() - start
                if length >= threshold and calls == python_calls[0] and getattr(arg, "__name__", "") not in waits:
                    where = _where(frame, 5, lines=False)
                    name = getattr(arg, "__qualname__", None) or repr(arg)[:60]
                    found.append((start - origin, length, threading.current_thread().name,
                                  f"{name} <- {' <- '.join(where)}"))
        return profile

    def start(frame: object, event: str, arg: object) -> None:
        # threading.setprofile's function is the first call's: give the thread its own.
        sys.setprofile(profile_of_thread())  # type: ignore[arg-type]

    threading.setprofile(start)


def _where(frame: object, depth: int, *, lines: bool) -> list[str]:
    """The innermost ``depth`` frames from ``frame`` out, ``file:function`` (and
    ``:line``); without lines, importlib's frozen frames are skipped."""
    where: list[str] = []
    while frame is not None and len(where) < depth:
        code = frame.f_code  # type: ignore[attr-defined]
        if lines:
            where.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")  # type: ignore[attr-defined]
        elif not code.co_filename.startswith("<frozen"):
            where.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back  # type: ignore[attr-defined]
    return where


class StallSampler:
    """A thread that looks at the loop's ticker every millisecond and, when the ticker is
    ``late`` seconds late, notes every thread's Python stack: the loop's thread shows the
    call it is in (its own work, or a C call waiting for a lock, the GPU or the interpreter
    lock), the others what they run. Its own wake-ups come late too when another thread
    holds the interpreter lock throughout, which it notes as its own longest wait."""

    _IDLE = ("threading.py", "selectors.py", "queue.py", "thread.py", "connection.py", "base_events.py")

    def __init__(self, origin: float, late: float, call_late: float = 0.0) -> None:
        import threading

        self.origin = origin
        self.late = late or float("inf")
        self.beat = time.perf_counter()
        self.stalls: dict[float, dict] = {}
        # With ``call_late``: an eager call in progress (when it began, or None) noted once
        # it has run that long, every thread's stack with it.
        self.call_late = call_late
        self.call_began: float | None = None
        self.slow_calls: dict[float, list] = {}
        self.stop = False
        self._main = threading.main_thread().ident
        threading.Thread(target=self._run, name="bench-sampler", daemon=True).start()

    def _run(self) -> None:

        looked = time.perf_counter()
        while not self.stop:
            time.sleep(0.001)
            now = time.perf_counter()
            own_wait, looked = now - looked - 0.001, now
            call_began = self.call_began
            if self.call_late and call_began is not None and now - call_began >= self.call_late \
                    and len(self.slow_calls) < 60 and len(self.slow_calls.get(call_began, ())) < 2:
                self.slow_calls.setdefault(call_began, []).append((now - call_began, self._sample()))
            beat = self.beat
            if now - beat < self.late:
                continue
            stall = self.stalls.setdefault(beat, {"own_wait": 0.0, "samples": []})
            stall["own_wait"] = max(stall["own_wait"], own_wait)
            stall["late"] = now - beat
            if len(stall["samples"]) >= 3 or len(self.stalls) > 40:
                continue
            stall["samples"].append((now - self.origin, self._sample()))

    def _sample(self) -> list[str]:
        """Every other thread's innermost frames; the idle ones left out."""
        import sys
        import threading

        names = {thread.ident: thread.name for thread in threading.enumerate()}
        sample = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            where = _where(frame, 6, lines=True)
            if ident != self._main and where and where[0].split(":")[0] in self._IDLE:
                continue
            sample.append(f"{'LOOP' if ident == self._main else names.get(ident, ident)}: {' <- '.join(where)}")
        return sample

    def report(self) -> str:
        lines = []
        for beat, stall in sorted(self.stalls.items(), key=lambda item: -item[1]["late"])[:8]:
            lines.append(f"  stall from {beat - self.origin:.2f} s, {stall['late'] * 1e3:.0f} ms; the sampler's own "
                         f"longest wait for the lock {stall['own_wait'] * 1e3:.0f} ms")
            for at, sample in stall["samples"][:2]:
                lines.append(f"    at {at:.2f} s:")
                lines.extend(f"      {line}" for line in sample)
        for began, samples in sorted(self.slow_calls.items()):
            for into, sample in samples:
                lines.append(f"  eager call from {began - self.origin:.2f} s, {into * 1e3:.1f} ms into it:")
                lines.extend(f"      {line}" for line in sample)
        return "\n".join(lines)


_SIDECAR = """
import os, signal, sys, time
pid, out = int(sys.argv[1]), sys.argv[2]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
rows = []
tasks = f"/proc/{pid}/task"
try:
    while os.path.exists(f"/proc/{pid}") and len(rows) < 4_000_000:
        now = time.monotonic()
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/schedstat") as f:
                    run, wait, _ = f.read().split()
            except OSError:
                continue
            rows.append(f"{now:.6f} {tid} {run} {wait}")
        time.sleep(0.0005)
finally:
    with open(out, "w") as f:
        f.write("\\n".join(rows))
"""


class _Sidecar:
    """A process of its own that reads ``/proc`` for this one and writes what it read to a
    file (``script``, given this process's pid and the file's path), and the names of this
    process's threads by their native ids (the loop's thread as ``LOOP``)."""

    def __init__(self, origin: float, script: str, prefix: str) -> None:
        import threading

        self.origin = origin
        handle, self.path = tempfile.mkstemp(prefix=prefix)
        os.close(handle)
        self.names: dict[int, str] = {threading.main_thread().native_id: "LOOP"}  # type: ignore[dict-item]
        self.process = subprocess.Popen([sys.executable, "-c", script, str(os.getpid()), self.path])

    def note_names(self) -> None:
        import threading

        for thread in threading.enumerate():
            if thread.native_id is not None and thread.native_id not in self.names:
                self.names[thread.native_id] = thread.name


class ThreadTimes(_Sidecar):
    """Each thread's time on a CPU and waiting for one, read every half millisecond by a
    process of its own from ``/proc/PID/task/*/schedstat`` (Linux): that process takes
    nothing from this one, not even the interpreter lock, so it sees what a sampler in
    this process could not, what ran while an eager call was slow."""

    def __init__(self, origin: float) -> None:
        super().__init__(origin, _SIDECAR, "bench-thread-times-")

    def report(self, calls: list[tuple[float, float]]) -> list[str]:
        """For each (began, length) call, perf_counter seconds: every thread that was on a
        CPU for 0.1 ms or more during it, and the loop's thread's wait for a CPU."""
        self.process.terminate()
        self.process.wait(10)
        samples: dict[int, list[tuple[float, int, int]]] = {}
        with open(self.path) as rows:
            for row in rows:
                at, tid, run, wait = row.split()
                samples.setdefault(int(tid), []).append((float(at), int(run), int(wait)))
        os.unlink(self.path)

        def at_time(series: list[tuple[float, int, int]], when: float) -> tuple[int, int]:
            import bisect

            i = bisect.bisect_right(series, (when, 1 << 62, 0)) - 1
            return series[max(i, 0)][1:]

        lines = []
        for began, length in calls:
            parts = []
            for tid, series in samples.items():
                run0, wait0 = at_time(series, began)
                run1, wait1 = at_time(series, began + length + 0.0005)
                name = self.names.get(tid, f"tid {tid}")
                if run1 - run0 >= 100_000 or name == "LOOP":
                    part = f"{name} {(run1 - run0) / 1e6:.2f}"
                    if name == "LOOP":
                        part += f" (waited for a CPU {(wait1 - wait0) / 1e6:.2f})"
                    parts.append(part)
            lines.append(f"{began - self.origin:6.2f} s, {length * 1e3:.2f} ms: on a CPU (ms): "
                         + ", ".join(sorted(parts)))
        return lines


_TREE_SIDECAR = """
import os, signal, sys, time
pid, out, me = int(sys.argv[1]), sys.argv[2], os.getpid()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
tick = os.sysconf("SC_CLK_TCK")
rows, named = [], set()
try:
    while os.path.exists(f"/proc/{pid}") and len(rows) < 4_000_000:
        now = time.monotonic()
        parents = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            parents[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, stat)
        tree, todo = set(), [pid]
        while todo:
            one = todo.pop()
            tree.add(one)
            todo.extend(child for child, (parent, _, _) in parents.items() if parent == one and child not in tree)
        for one in tree:
            if one not in parents:
                continue
            parent, cpu, stat = parents[one]
            if one not in named:
                try:
                    with open(f"/proc/{one}/cmdline", "rb") as f:
                        line = " ".join(f.read().replace(b"\\0", b" ").decode("utf-8", "replace").split())
                except OSError:
                    line = ""
                comm = stat[stat.find("(") + 1:stat.rfind(")")]
                rows.append(f"N {one} {parent} {comm} {line[:200]}")
                named.add(one)
            rows.append(f"P {now:.6f} {one} {cpu:.2f}")
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    rows.append(f"T {now:.6f} {tid} {f.read().split()[0]}")
            except OSError:
                continue
        time.sleep(0.05)
finally:
    with open(out, "w") as f:
        f.write("\\n".join(rows))
"""

COMPILERS = frozenset({"cc1plus", "cc1", "as", "ld", "collect2", "g++", "gcc", "c++", "cc", "nvcc", "ptxas",
                       "cicc", "fatbinary", "nvlink", "clang", "clang++", "lld", "ld.lld"})
"""The commands counted as compilers (a ``comm`` of ``/proc``)."""


class ProcessTimes(_Sidecar):
    """Where the CPUs went from the program's start until a moment (compiled answers): this
    process's threads (by their ``threading`` names, the loop's thread as ``LOOP``) and
    every process it started, directly or not, by what each is (aiocompile's fork server,
    its workers, compilers, other processes), and what was left idle. Read every 50 ms by a
    process of its own from ``/proc`` (Linux): a process that lived less than that, or the
    last 50 ms of one, can be missed, so the compilers' share is a little low."""

    def __init__(self, origin: float) -> None:
        super().__init__(origin, _TREE_SIDECAR, "bench-process-times-")

    def report(self, until: float) -> list[str]:
        """Where the CPUs went from the program's start until ``until`` (perf_counter
        seconds): one line for this process's threads, one for the processes it started."""
        self.process.terminate()
        self.process.wait(10)
        kinds: dict[int, tuple[int, str, str]] = {}
        cpu: dict[int, float] = {}
        threads: dict[int, float] = {}
        with open(self.path) as rows:
            for row in rows:
                parts = row.rstrip("\n").split(" ", 4)
                if parts[0] == "N":
                    kinds[int(parts[1])] = (int(parts[2]), parts[3], parts[4] if len(parts) > 4 else "")
                elif float(parts[1]) <= until:
                    if parts[0] == "P":
                        cpu[int(parts[2])] = float(parts[3])
                    else:
                        threads[int(parts[2])] = int(parts[3]) / 1e9
        os.unlink(self.path)
        me = os.getpid()

        def kind(pid: int) -> str:
            parent, comm, line = kinds.get(pid, (0, "", ""))
            if comm in COMPILERS:
                return "compilers"
            if "aiocompile._pool.zygote" in line:
                return "workers" if "aiocompile._pool.zygote" in kinds.get(parent, (0, "", ""))[2] else "fork server"
            return "other processes"

        by_kind: dict[str, list[float]] = {}
        for pid, seconds in cpu.items():
            if pid != me:
                by_kind.setdefault(kind(pid), []).append(seconds)
        by_thread: dict[str, float] = {}
        for tid, seconds in threads.items():
            name = self.names.get(tid, "other threads")
            by_thread[name] = by_thread.get(name, 0.0) + seconds
        span = until - self.origin
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        used = sum(threads.values()) + sum(sum(values) for values in by_kind.values())
        mine = ", ".join(f"{name} {seconds:.1f}" for name, seconds in
                         sorted(by_thread.items(), key=lambda item: -item[1]) if seconds >= 0.05)
        started = ", ".join(f"{name} {sum(values):.1f} ({len(values)})" for name, values in
                            sorted(by_kind.items(), key=lambda item: -sum(item[1])))
        return [f"CPU seconds in the first {span:.1f} s ({cpus} CPUs, {cpus * span:.1f} CPU-s): used {used:.1f}, "
                f"left idle {max(0.0, cpus * span - used):.1f}",
                f"this process {sum(threads.values()):.1f}: {mine}",
                f"processes it started (how many): {started or 'none'}"]
