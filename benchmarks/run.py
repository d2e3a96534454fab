"""Run every benchmark and write a report for this machine.

Each ``benchmarks/bench_*.py`` runs as a subprocess with ``--json``, one after another,
each with its own empty Triton cache and a time limit; a benchmark that fails or runs out
of time is recorded as such and the others still run. Written to ``--out``
(``docs/benchmarks`` by default), named after the machine (``--slug`` to choose):

- ``<slug>.json``: every result, the command line, exit status, time and console output
  of each benchmark, and the machine (CPU model, cores, RAM, GPU, Python, Triton, torch,
  anyio and aiocompile versions, git commit, date, load average);
- ``<slug>.md``: tables of the results and their ratios, with the charts below;
- ``<slug>-throughput.png``, ``<slug>-throughput-heavy.png``, ``<slug>-loop-lag.png``,
  ``<slug>-dispatch.png``, ``<slug>-startup-memory.png``.

``--quick`` runs fewer repeats (the full run takes about 25 minutes on 2 CPUs). ``--only a,b`` runs some
benchmarks again and keeps the others' results from the existing JSON file. ``--render``
rewrites the markdown and charts from the JSON file without running anything (with
``--slug``, another machine's: a report made where matplotlib is missing gets its charts).
Benchmarks that need what the machine lacks are skipped, with the reason: torch_compile
needs torch (it measures on the GPU where torch sees one, else on the CPU).

    python benchmarks/run.py [--quick] [--out docs/benchmarks] [--slug NAME] [--only throughput,dispatch]
        [--render]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Bench:
    """How to run one benchmark script: its arguments, full and quick, and its time limit."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    timeout: float = 600.0
    quick_timeout: float = 300.0
    needs: str | None = None  # "cuda": torch with a CUDA GPU; "torch": torch; "c++": a C++ compiler on PATH
    quick_flag_if_offered: bool = False  # pass --quick when the script's --help offers it


_CONTENTION_WAYS = ("aiocompile,aiocompile[workers=12],aiocompile[workers=8],aiocompile[nice=0],aiocompile[pin],"
                    "ProcessPoolExecutor")

# In the order they run; any other bench_*.py found in benchmarks/ runs after them with
# just --json.
KNOWN = [
    # Two rounds at least: aiocompile's second knows the first's compile times. The mixed
    # set's wall time is about its longest compile's, which alone varies by 20% from one
    # run to the next on a shared machine: more rounds for a steadier median.
    Bench("throughput", "bench_throughput.py", ("--repeat", "6"), ("--repeat", "4"), 1800, 600),
    Bench("throughput_heavy", "bench_throughput.py", ("--set", "heavy", "--repeat", "3"),
          ("--set", "heavy", "--repeat", "2", "--ways", "aiocompile,serial triton.compile,ProcessPoolExecutor"),
          1800, 600),
    # A first run on a fresh machine: no compile history, the order from predictions alone,
    # beside the stdlib pool, each round's longest compile timed alone after it.
    Bench("first_run", "bench_throughput.py",
          ("--set", "adds_matmuls", "--first-run", "--alone", "1", "--repeat", "5", "--ways",
           "aiocompile,ProcessPoolExecutor"),
          ("--set", "adds_matmuls", "--first-run", "--alone", "1", "--repeat", "3", "--ways",
           "aiocompile,ProcessPoolExecutor"), 1800, 600),
    # How compiles slow each other down, and what fewer workers, niceness or pinning do to it.
    Bench("contention", "bench_throughput.py",
          ("--set", "adds_matmuls", "--alone", "1", "--repeat", "4", "--ways", _CONTENTION_WAYS),
          ("--set", "adds_matmuls", "--alone", "1", "--repeat", "2", "--ways", _CONTENTION_WAYS), 1800, 900),
    Bench("dispatch", "bench_dispatch.py", (), ("--rounds", "4"), 300, 120),
    Bench("loop_lag", "bench_loop_lag.py", (), (), 600, 300),
    Bench("startup", "bench_startup.py", ("--repeat", "3"), ("--repeat", "1"), 900, 300),
    Bench("memory", "bench_memory.py", ("--repeat", "3"), ("--repeat", "1"), 900, 300),
    Bench("cache", "bench_cache.py", (), (), 600, 300),
    Bench("crash", "bench_crash.py", (), (), 300, 120),
    Bench("metrics", "bench_metrics.py", (), ("--rounds", "3"), 300, 120),
    Bench("build", "bench_build.py", (), (), 900, 300),
    Bench("fleet", "bench_fleet.py", (), (), 1200, 600),
    Bench("serving", "bench_serving.py", (), (), 1200, 400, quick_flag_if_offered=True),
    # 32 units at -O2 take about 80 s one after another on 2 CPUs: four ways, two rounds.
    Bench("native", "bench_native.py", ("--repeat", "2"), ("--repeat", "1"), 1800, 900, needs="c++"),
    Bench("torch_compile", "bench_torch_compile.py", ("--repeat", "3"), ("--repeat", "1"), 2400, 900,
          needs="torch"),
    Bench("autotune", "bench_autotune.py", ("--repeat", "3"), ("--repeat", "1"), 2400, 900, needs="cuda"),
    Bench("maxautotune", "bench_maxautotune.py", ("--repeat", "3"), ("--repeat", "1"), 1800, 600, needs="cuda"),
    # CPU or GPU, whichever torch sees: Inductor compiles C++ for the CPU.
    Bench("background", "bench_background.py", ("--repeat", "3"), ("--repeat", "1"), 3600, 1800),
]


# -- the machine ------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_version() -> str | None:
    """aiocompile's version from its source, where it runs uninstalled (on ``PYTHONPATH``)."""
    try:
        with open(os.path.join(ROOT, "aiocompile", "__init__.py"), encoding="utf-8") as f:
            found = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None


def _probe_torch() -> dict[str, Any]:
    """torch's version and the GPU, asked in a subprocess (importing torch costs a second,
    and initialising CUDA here would be inherited by nothing but still costs memory)."""
    code = ("import json, torch; cuda = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
            "'cuda': cuda, 'gpu': torch.cuda.get_device_name() if cuda else None, "
            "'gpus': torch.cuda.device_count() if cuda else 0}))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        found: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return found
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return {"torch": None, "cuda": False, "gpu": None, "gpus": 0}


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _commit(changed: str | None) -> dict[str, Any]:
    """The commit measured. ``AIOCOMPILE_GIT_COMMIT`` names it where the checkout's own
    git metadata is missing or stale (a copy of the working tree sent to another machine);
    then whether aiocompile/ had uncommitted changes is not known (None)."""
    given = os.environ.get("AIOCOMPILE_GIT_COMMIT")
    if given:
        return {"git_commit": given, "aiocompile_modified": None}
    return {"git_commit": _git("rev-parse", "--short", "HEAD"), "aiocompile_modified": bool(changed)}


def describe_machine() -> dict[str, Any]:
    cpu_model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram_gib = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    torch_info = _probe_torch()
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", "aiocompile")
    return {
        "cpu_model": cpu_model,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": ram_gib,
        "gpu": torch_info.get("gpu"),
        "gpus": torch_info.get("gpus", 0),
        "cuda": bool(torch_info.get("cuda")),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "triton": _version("triton"),
        "torch": torch_info.get("torch") or _version("torch"),
        "anyio": _version("anyio"),
        "aiocompile": _version("aiocompile") or _source_version(),
        **_commit(changed),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def slug_of(machine: dict[str, Any]) -> str:
    """``nvidia-h200-16cpu`` on a GPU machine, ``amd-epyc-2cpu`` without one."""
    name = machine["gpu"] or machine["cpu_model"]
    name = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*$|\d+-core", " ", name, flags=re.IGNORECASE)
    words = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{words[:40].strip('-') or 'machine'}-{machine['cpus']}cpu"


# -- running ----------------------------------------------------------------------------------

def plan(only: set[str] | None) -> list[Bench]:
    benches = list(KNOWN)
    known_scripts = {b.script for b in KNOWN}
    for path in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        script = os.path.basename(path)
        if script not in known_scripts:
            benches.append(Bench(script[len("bench_"):-len(".py")], script))
    benches = [b for b in benches if os.path.exists(os.path.join(HERE, b.script))]
    if only is not None:
        unknown = only - {b.name for b in benches}
        if unknown:
            raise SystemExit(f"no such benchmark: {', '.join(sorted(unknown))} "
                             f"(there are: {', '.join(b.name for b in benches)})")
        benches = [b for b in benches if b.name in only]
    return benches


def _offers_quick(script: str) -> bool:
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, script), "--help"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=_env(tempfile.gettempdir()))
    except subprocess.TimeoutExpired:
        return False
    return "--quick" in proc.stdout


def _env(triton_cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    env["TRITON_CACHE_DIR"] = triton_cache
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    env["PYTHONUNBUFFERED"] = "1"
    return env


class OtherWork:
    """Adds up the CPU time of the processes that are not the benchmark's, sampling
    ``/proc`` a few times a second while it runs: other work on a shared machine, which
    makes every figure noisier.

    A process is the benchmark's if it descends from the benchmark's process (or from this
    one), as seen in any sample. Only each process's own user and system time is counted
    (a parent's total for reaped children would count them twice), so a process that lives
    less than a sampling period is missed: the result is a lower bound.
    """

    def __init__(self, root: int) -> None:
        self.ours = {root, os.getpid()}
        self.seen: dict[int, int] = {}
        self.other_ticks = 0
        self.started = time.monotonic()
        with open("/proc/uptime") as f:
            self.boot_ticks_at_start = float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")
        self.sample(first=True)

    def sample(self, first: bool = False) -> None:
        stats: dict[int, tuple[int, int, int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue  # gone since the listing
            rest = text[text.rfind(")") + 2:].split()
            stats[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[19]))
        grew = True
        while grew:  # descendants of ours, however deep, in this snapshot
            grew = False
            for pid, (ppid, _, _) in stats.items():
                if ppid in self.ours and pid not in self.ours:
                    self.ours.add(pid)
                    grew = True
        for pid, (_, ticks, start) in stats.items():
            if pid in self.ours:
                continue
            if pid in self.seen:
                self.other_ticks += max(0, ticks - self.seen[pid])
            elif not first and start >= self.boot_ticks_at_start:
                self.other_ticks += ticks  # started while the benchmark ran
            self.seen[pid] = ticks

    def share(self) -> float:
        """Other processes' CPU time as a share of all the machine's CPU time so far."""
        seconds = self.other_ticks / os.sysconf("SC_CLK_TCK")
        return seconds / max(1e-9, (time.monotonic() - self.started) * (os.cpu_count() or 1))


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def run_one(bench: Bench, quick: bool, machine: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {"script": f"benchmarks/{bench.script}"}
    if bench.needs == "cuda" and not machine["cuda"]:
        entry.update(status="skipped", reason="needs torch with a CUDA GPU")
        return entry
    if bench.needs == "c++" and not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        entry.update(status="skipped", reason="needs a C++ compiler (c++, g++ or clang++ on PATH)")
    if bench.needs == "torch" and not machine["torch"]:
        entry.update(status="skipped", reason="needs torch")
        return entry
    args = list(bench.quick_args if quick else bench.args)
    if quick and bench.quick_flag_if_offered and _offers_quick(bench.script):
        args.append("--quick")
    timeout = bench.quick_timeout if quick else bench.timeout
    scratch = tempfile.mkdtemp(prefix=f"bench-{bench.name}-")
    out_json = os.path.join(scratch, "result.json")
    cache = os.path.join(scratch, "triton-cache")
    os.mkdir(cache)
    command = [sys.executable, os.path.join("benchmarks", bench.script), *args, "--json", out_json]
    entry["command"] = shlex.join(["python", os.path.join("benchmarks", bench.script), *args, "--json", "out.json"])
    entry["timeout_s"] = timeout
    entry["load_before"] = [round(x, 2) for x in os.getloadavg()]
    entry["git_commit"] = machine.get("git_commit")  # --only runs may measure later commits than the rest
    stdout_path, stderr_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
    started = time.monotonic()
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        # A session of its own, so that on a timeout the benchmark and every process it
        # started (pools, fork servers) go together.
        proc = subprocess.Popen(command, cwd=ROOT, env=_env(cache), stdout=out, stderr=err, start_new_session=True)
        others = OtherWork(proc.pid)
        timed_out = False
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                others.sample()
                if time.monotonic() - started > timeout:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
                    break
    entry["seconds"] = round(time.monotonic() - started, 1)
    entry["other_processes_cpu_share"] = round(others.share(), 3)
    entry["load_after"] = [round(x, 2) for x in os.getloadavg()]
    entry["returncode"] = rc
    with open(stdout_path, errors="replace") as f:
        entry["stdout"] = _tail(f.read(), 20000)
    with open(stderr_path, errors="replace") as f:
        stderr = f.read()
    result = None
    if os.path.exists(out_json):
        try:
            with open(out_json) as f:
                result = json.load(f)
        except ValueError as exc:
            stderr += f"\n(the JSON it wrote does not parse: {exc})"
    if timed_out:
        entry.update(status="timeout", reason=f"ran past {timeout:.0f} s and was killed")
    elif rc != 0:
        entry.update(status="failed", reason=f"exit status {rc}")
    elif result is None:
        entry.update(status="failed", reason="wrote no JSON")
    else:
        entry["status"] = "ok"
    if entry["status"] != "ok":
        entry["stderr"] = _tail(stderr, 6000)
    entry["result"] = result
    entry["finished_at"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    shutil.rmtree(scratch, ignore_errors=True)
    return entry


# -- the report ---------------------------------------------------------------------------------

def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]], digits: int | list[int] = 2) -> str:
    """A markdown table; ``digits``: decimals for floats, for all columns or per column."""
    per_column = digits if isinstance(digits, list) else [digits] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(v, d) for v, d in zip(row, per_column)) + " |")
    return "\n".join(lines)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        items: list[tuple[str, Any]] = []
        for key, sub in value.items():
            items += _flatten(sub, f"{prefix}.{key}" if prefix else str(key))
        return items
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value) and len(value) <= 8:
            return [(prefix, ", ".join(_fmt(v) for v in value))]
        items = []
        for index, sub in enumerate(value[:20]):
            items += _flatten(sub, f"{prefix}[{index}]")
        return items
    return [(prefix, value)]


def render_generic(result: Any) -> str:
    rows = _flatten(result)
    text = _table(["field", "value"], [[k, v] for k, v in rows[:80]], digits=3)
    if len(rows) > 80:
        text += f"\n\n({len(rows) - 80} more fields in the JSON file)"
    return text


def render_columns(result: Any) -> str:
    """Side-by-side tables for any dict whose values are dicts of numbers (one column per
    way of doing something, one row per measurement); empty if there is none."""
    tables = []

    def scalar(value: Any) -> bool:
        return isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= 24)

    def walk(value: Any, depth: int) -> None:
        if not isinstance(value, dict) or depth > 2:
            return
        columns = {k: v for k, v in value.items()
                   if isinstance(v, dict) and sum(isinstance(x, (int, float)) for x in v.values()) >= 2}
        if len(columns) >= 2:
            keys: list[str] = []
            for sub in columns.values():
                keys += [k for k, x in sub.items() if scalar(x) and k not in keys]
            rows = [[k] + [sub.get(k) for sub in columns.values()] for k in keys]
            tables.append(_table([""] + list(columns), rows))
        for key, sub in value.items():
            if key not in columns:
                walk(sub, depth + 1)

    walk(result, 0)
    return "\n\n".join(tables)


_SET_TEXT = {
    "mixed": "the mixed set: 10 matmuls, one of them long, among 54 short row-wise kernels, in a shuffled order",
    "heavy": "the matmul-heavy set: 28 matmuls interleaved with 36 row-wise kernels",
    "adds_matmuls": "32 vector adds and 18 matmuls of several tile sizes, the longest compile 34th in the order given",
}


def render_rounds(r: dict[str, Any]) -> str:
    """Every round of every way: wall, against the round's own lower bound (its longest
    compile timed alone after it), how much the longest compiles were slowed beside the
    others, and the rank correlation of the predicted and measured compile times."""
    rows = []
    for round_ in r.get("rounds", []):
        bound = round_.get("lower_bound_s")
        for way, entry in round_["ways"].items():
            rows.append([round_["round"], way, entry["wall_s"], bound, entry.get("wall_over_bound"),
                         entry.get("slowdown"), entry.get("spearman"),
                         "yes" if entry.get("costs_known") else "no"])
    if not rows:
        return ""
    return ("Every round:\n\n" + _table(["round", "way", "wall s", "lower bound s", "wall / bound",
                                        "longest slowed", "rank correlation", "costs known before"], rows))


def render_throughput(r: dict[str, Any]) -> str:
    kind = r.get("set", "heavy")  # reports from before there were two sets compiled the heavy one
    parts = [f"{r['kernels']} distinct kernels for `{r['target']}` ({_SET_TEXT.get(kind, kind)}), "
             f"W = {r['workers']} workers, median of {r['repeat']} rounds (Triton {r.get('triton', '?')})."]
    single = r.get("single")
    if single:
        parts.append(f"Single compiles (serially, in a warm process): sum {single['sum_s']:.2f} s, longest "
                     f"{single['longest_s']:.2f} s (`{single['longest_label']}`); lower bound max(sum / W, longest) "
                     f"= **{r['lower_bound_s']:.2f} s**.")
    rows = []
    for way, row in r["ways"].items():
        if not row.get("available", True):
            rows.append([way, "unavailable: " + row.get("reason", ""), None, None, None, None, None])
            continue
        if "wall_s" not in row:
            rows.append([way, "failed: " + row.get("error", "?"), None, None, None, None, None])
            continue
        walls = row.get("walls_s") or [row["wall_s"]]
        rows.append([way, row["wall_s"], f"{min(walls):.2f}-{max(walls):.2f}", row.get("ratio_to_aiocompile"),
                     row.get("efficiency"), row.get("wall_over_bound"), row.get("compile_s_in_workers")])
    parts.append(_table(["way", "wall s", "rounds s", "ratio to aiocompile", "parallel efficiency",
                         "wall / lower bound", "compile s summed where run"], rows))
    parts.append("Parallel efficiency = (sum of single compile times / W) / wall. The last column adds up each "
                 "compile's own time as measured where it ran (worker, thread or this process): above the serial "
                 "sum when compiles slow each other down.")
    if single:
        slowed = [f"{way} {row['compile_s_in_workers'] / single['sum_s']:.2f}x" for way, row in r["ways"].items()
                  if row.get("compile_s_in_workers") and way != "serial triton.compile"]
        if slowed:
            parts.append("Side by side, the compiles took this much longer than one at a time (compile s summed "
                         "where run / serial sum): " + ", ".join(slowed) + ".")
    base = r["ways"].get("aiocompile", {})
    cold, warm = base.get("nothing_known_s"), base.get("costs_known_s")
    if cold is not None or warm is not None:
        def fmt(value: float | None) -> str:
            if value is None:
                return "not run"
            bound = r.get("lower_bound_s")
            return f"{value:.2f} s" + (f" ({value / bound:.2f}x the lower bound)" if bound else "")
        if r.get("first_run"):
            parts.append(f"Every aiocompile round started with no compile history: the order came from the "
                         f"predicted costs alone: {fmt(cold)}.")
        else:
            parts.append(f"aiocompile's first round knows no compile times and orders the kernels by their "
                         f"predicted cost: {fmt(cold)}. Later rounds read the earlier rounds' times "
                         f"(`cost_history`): {fmt(warm)}.")
    rounds = render_rounds(r)
    if rounds:
        parts.append(rounds)
    return "\n\n".join(parts)


def render_loop_lag(throughput: dict[str, Any] | None, loop_lag: dict[str, Any] | None) -> str:
    parts = []
    if throughput:
        rows = [[way, row["lag"]["p50_ms"], row["lag"]["p99_ms"], row["lag"]["max_ms"], row["lag"]["over_10ms"],
                 row["lag"]["ticks"]]
                for way, row in throughput["ways"].items() if "lag" in row]
        parts.append(f"A 1 ms ticker in the event loop while the {throughput['kernels']} kernels compile "
                     "(throughput benchmark), "
                     "lateness over every tick of every round:")
        parts.append(_table(["way", "p50 ms", "p99 ms", "max ms", "ticks > 10 ms", "ticks"], rows))
    if loop_lag:
        rows = [[name, row.get("wall_s"), row.get("p50_ms"), row.get("p99_ms"), row.get("max_ms"),
                 row.get("over_10ms")]
                for name, row in loop_lag.items() if isinstance(row, dict) and "p99_ms" in row]
        if rows:
            parts.append(f"`bench_loop_lag.py`: 32 kernels{' compiled and loaded' if loop_lag.get('gpu') else ''}:")
            parts.append(_table(["way", "wall s", "p50 ms", "p99 ms", "max ms", "ticks > 10 ms"], rows))
        bursts = loop_lag.get("bursts")
        if bursts:
            parts.append(render_bursts(bursts))
    return "\n\n".join(parts)


def render_bursts(b: dict[str, Any]) -> str:
    names = {"many_calls": f"{b['calls']} concurrent calls",
             "large_result": f"one {b['large_result_bytes'] >> 20} MB result"}
    rows = []
    for burst, label in names.items():
        for way, rounds in b.get(burst, {}).items():
            for index, r in enumerate(rounds, 1):
                rows.append([label, way, index, r["wall_s"], r["p99_ms"], r["max_ms"], r["max_without_gc_ms"],
                             r["gc_longest_ms"]])
    return (f"Bursts, {b['workers']} warm workers in each pool, {b['rounds']} rounds of each, alternating; then as "
            "many rounds after `gc.freeze()`. `max w/o gc` takes the garbage collector's pauses (measured with "
            "`gc.callbacks`) out of each tick; `gc max` is the longest pause in the round:\n\n"
            + _table(["burst", "way", "round", "wall s", "p99 ms", "max ms", "max w/o gc ms", "gc max ms"], rows))


def render_dispatch(r: dict[str, Any]) -> str:
    rows = [[way, row["p50_us"], row["p99_us"], row["mean_us"], row["p50_vs_fastest"]]
            for way, row in r["results"].items()]
    rows.sort(key=lambda row: row[1])
    return (f"Round trip of a trivial job (`abs(-1)`), one warm worker each, {r['calls_per_way']} calls per way "
            "in interleaved rounds:\n\n"
            + _table(["way", "p50 µs", "p99 µs", "mean µs", "p50 / fastest"], rows, digits=[0, 1, 1, 1, 2]))


def render_startup(r: dict[str, Any]) -> str:
    results = r["results"]
    base = results.get("ProcessPoolExecutor forkserver") or next(iter(results.values()))
    rows = [[name, row["first_kernel"], row["first_kernel"] / base["first_kernel"], row["on_demand"],
             row["on_demand"] / base["on_demand"], row["on_demand_run"]] for name, row in results.items()]
    return (f"`bench_startup.py`, median of {r.get('repeat', '?')} fresh interpreters (ratios against the stdlib "
            "pool with forkserver):\n\n"
            + _table(["pool", "program start to 1st kernel s", "ratio", "kernel on a new worker s", "ratio",
                      "of which compiling s"], rows, digits=[0, 3, 2, 3, 2, 3]))


def render_memory(r: dict[str, Any]) -> str:
    rows = [[way, row["import_s"], row["import_kernels_s"], row["pool_ready_s"], row["first_compile_s"],
             row["worker_rss_mib"], row["worker_pss_mib"], row["worker_uss_mib"], row["pool_pss_mib"]]
            for way, row in r["results"].items()]
    return (f"`bench_memory.py`: {r['workers']} workers, median of {r['repeat']} fresh interpreters. Import: the "
            "pool's library (kernels and Triton: "
            + ", ".join(f"{row['import_kernels_s']:.2f} s" for row in r["results"].values())
            + "); pool ready: until each worker has run a tiny compile; first compile: one matmul on the ready "
            "pool. Memory after 16 compiles, in MiB: per worker (median), and the whole pool's PSS (workers and "
            "any fork server).\n\n"
            + _table(["pool", "import s", "+ kernels s", "pool ready s", "first compile s", "worker RSS",
                      "worker PSS", "worker USS", "pool PSS"], rows, digits=[0, 3, 3, 3, 3, 0, 0, 0, 0]))


def render_cache(r: dict[str, Any]) -> str:
    results = r["results"]
    base = results["triton.compile, warm Triton cache"]["p50_us"]
    rows = [[name, results[name]["p50_us"], results[name]["p95_us"], results[name]["p99_us"],
             results[name]["p50_us"] / base]
            for name in ("memory hit", "disk hit", "triton.compile, warm Triton cache") if name in results]
    cold, warm = results.get("1000 concurrent, cold", {}), results.get("1000 concurrent, warm", {})
    return (_table(["request", "p50 µs", "p95 µs", "p99 µs", "p50 / triton.compile"], rows, digits=[0, 1, 1, 1, 3])
            + f"\n\n1000 concurrent identical requests: cold {_fmt(cold.get('total_ms'), 0)} ms "
            f"({cold.get('compiles', '?')} compile), warm {_fmt(warm.get('total_ms'), 1)} ms.")


def render_crash(r: dict[str, Any]) -> str:
    rows = [[name, row["death_to_work_again_ms"], row["innocent_reruns"], row["innocent_failures"], row["wall_s"],
             row["poison"]] for name, row in r["results"].items()]
    return (f"One poison job among {2 * r['workers']} innocent {r['seconds']:g} s jobs, {r['workers']} workers:\n\n"
            + _table(["pool", "death to work again ms", "innocents re-run", "innocents failed", "wall s",
                      "poison job ends with"], rows, digits=[0, 1, 0, 0, 2, 0]))


def render_metrics(r: dict[str, Any]) -> str:
    rows = [[name, row["p50_us"], row.get("p90_us"), row["mean_us"], row.get("p50_vs_off")]
            for name, row in r["results"].items()]
    return (f"Round trip of a trivial job with aiocompile's metrics off and on, {r['calls_per_mode']} calls each:\n\n"
            + _table(["mode", "p50 µs", "p90 µs", "mean µs", "p50 / off"], rows, digits=[0, 1, 1, 1, 2]))


def render_build(r: dict[str, Any]) -> str:
    results = r["results"]
    serial = next((row["wall"] for name, row in results.items() if name.startswith("serial")), None)
    rows = [[name, row["wall"], serial / row["wall"] if serial else None, row.get("kernels")]
            for name, row in results.items()]
    return (f"Pre-building the example set for `{r['targets']}`, cold (fresh interpreter and cache each), "
            f"{r['workers']} workers:\n\n" + _table(["way", "wall s", "speed-up over serial", "kernels"], rows))


def render_native(r: dict[str, Any]) -> str:
    results = r["results"]
    serial = results["serial"]["wall"]
    pool = next(row["wall"] for name, row in results.items() if name.startswith("ProcessPoolExecutor"))
    rows = [[name, row["wall"], serial / row["wall"], row["wall"] / pool, row.get("parent_cpu"), row.get("lag_max_ms"),
             row.get("lag_p99_ms")] for name, row in results.items()]
    return (f"{r['units']} generated C++ translation units ({r['lines_min']} to {r['lines_max']} lines) built into "
            f"shared libraries by `{r['command']}`, {r['workers']} workers, median of {r['repeat']} round(s), pools "
            "started inside the timed region:\n\n"
            + _table(["way", "wall s", "speed-up over serial", "wall / stdlib pool", "this process's CPU s",
                      "loop lag max ms", "loop lag p99 ms"], rows))


def render_fleet(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"Skipped: {r['skipped']}."
    parts = []
    for title, group, first in (("Shared Redis cache, two processes with empty local caches", "shared cache",
                                 "empty server (first machine)"),
                                ("The same set through aiocompile's own pool and a Dask LocalCluster", "pool",
                                 "aiocompile's own pool")):
        runs = r.get(group) or {}
        base = (runs.get(first) or {}).get("wall")
        rows = [[name, row["wall"], row["wall"] / base if base else None, row.get("compiles"), row.get("shared_hits"),
                 row.get("cluster_start")] for name, row in runs.items()]
        parts.append(f"{title} ({r['targets']}, {r['workers']} workers):\n\n"
                     + _table(["way", "wall s", f"/ {first}", "compiles", "shared hits", "cluster start s"], rows))
    return "\n\n".join(parts)


def render_torch_compile(runs: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for run in runs:
        group = (run.get("device_kind", "cuda"), run["scenario"], run["model"])
        groups.setdefault(group, {}).setdefault(run["mode"], []).append(run["seconds"])
    rows = []
    for (device, scenario, model), modes in groups.items():
        stock = sorted(modes.get("stock", []))
        ours = sorted(modes.get("aiocompile", []))
        med = lambda v: v[len(v) // 2] if v else None  # noqa: E731
        rows.append([device, scenario, model, med(stock), med(ours),
                     med(ours) / med(stock) if stock and ours else None])  # type: ignore[operator]
    return _table(["device", "scenario", "model", "stock Inductor s", "with aiocompile s", "ratio"], rows)


def render_autotune(runs: list[dict[str, Any]]) -> str:
    rows = []
    for case in dict.fromkeys(run["case"] for run in runs):
        of = [run for run in runs if run["case"] == case]

        def med(mode: str, of: list[dict[str, Any]] = of) -> float | None:
            values = sorted(run["seconds"] for run in of if run["mode"] == mode)
            return values[len(values) // 2] if values else None

        triton, cold, warm = med("triton"), med("aiocompile"), med("aiocompile-warm")
        choice = max((run.get("vs_triton_choice", 0.0) for run in of if run["mode"] != "triton"), default=None)
        launch = max((run["launch_compiles"] + run["launch_benchmarks"] for run in of if run["mode"] != "triton"),
                     default=None)
        rows.append([case, of[0]["configs"], triton, cold, cold / triton if cold and triton else None, warm,
                     warm / triton if warm and triton else None, choice, launch])
    return _table(["kernel", "configs", "Triton first launch s", "autotune()+launch s", "ratio", "warmed s", "ratio",
                   "choice vs Triton's", "compiles+benchmarks after"], rows)


def render_background(r: dict[str, Any]) -> str:
    summary = r["summary"]
    device = r["runs"][0]["device"] if r.get("runs") else r.get("device")
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    rows = []
    for way in ("stock", "stock_pool", "subprocess", "cold", "server", "server_quiet", "server_package",
                "export_thread"):
        row = summary.get(way)
        if row is None:
            continue
        rows.append([way, ms(row["idle_p50"]), ms(row["idle_p99"]), ms(row["first_call"]), ms(row["during_p99"]),
                     row["calls_while_compiling"], row.get("start_up"), row["to_compiled"],
                     row.get("compiled_from_start"), row["parent_cpu"], row["matches_eager"]])
    text = (f"Two transformer blocks (d=256, 4 heads, batch 4 x 128) on {device}, median of {r['repeat']} fresh "
            f"processes, a call every {r['pause'] * 1e3:.0f} ms; public API only (`stock_pool`: Inductor's pool "
            "started before the clock; `server`: `aiocompile.torch.warm()` before the clock):\n\n"
            + _table(["way", "eager p50 ms", "eager p99 ms", "first call ms", "eager p99 while compiling ms",
                      "calls while compiling", "start-up before the clock s", "to compiled s",
                      "compiled from the program's start s", "serving process CPU s", "outputs equal"], rows, 1)
            + "\n")
    ratios = summary.get("ratios")
    if ratios:
        text += "\n" + "; ".join(f"{name.replace('_', ' ')} {value:.2f}" for name, value in ratios.items()) + ".\n"
    return text


RENDERERS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "throughput": ("Compile throughput: 64 kernels, five ways", render_throughput),
    "throughput_heavy": ("Compile throughput: the matmul-heavy set", render_throughput),
    "first_run": ("A first run: 50 kernels, no compile history", render_throughput),
    "contention": ("Contention: compiles side by side, fewer workers, niceness, pinning", render_throughput),
    "dispatch": ("Dispatch round trip", render_dispatch),
    "startup": ("Start-up", render_startup),
    "memory": ("Cold start and worker memory", render_memory),
    "cache": ("Cache hits", render_cache),
    "crash": ("Crash recovery", render_crash),
    "metrics": ("What measuring costs", render_metrics),
    "build": ("Pre-building the example set", render_build),
    "native": ("C++ translation units into shared libraries", render_native),
    "fleet": ("A fleet: shared Redis cache, Dask cluster", render_fleet),
    "torch_compile": ("torch.compile with and without aiocompile", render_torch_compile),
    "autotune": ("Autotuning's first launch: Triton against autotune()", render_autotune),
    "background": ("Compiling in the background while serving", render_background),
}


def _png(figure: Any, path: str) -> str:
    figure.savefig(path, dpi=110)
    return os.path.basename(path)


def _grouped_barh(ax: Any, names: list[str], series: list[tuple[str, list[float], str]], unit: str) -> None:
    """One group of horizontal bars per name (first name on top), one bar per series,
    each labelled with its value, on a log scale."""
    height = 0.8 / len(series)
    for k, (label, values, colour) in enumerate(series):
        ys = [len(names) - 1 - i + 0.4 - height * (k + 0.5) for i in range(len(names))]
        ax.barh(ys, values, height, color=colour, label=label)
        for y, value in zip(ys, values):
            ax.text(value, y, f" {value:,.1f} {unit}" if value < 100 else f" {value:,.0f} {unit}", va="center",
                    fontsize=8)
    ax.set_yticks(range(len(names)), names[::-1])
    ax.set_xscale("log")
    low = min(v for _, values, _ in series for v in values if v > 0)
    high = max(v for _, values, _ in series for v in values)
    ax.set_xlim(low / 3, high * 8)
    ax.legend(loc="lower right", fontsize=8)


_AIOCOMPILE_BLUE, _GREY = "#1f77b4", "#9a9a9a"


def chart_throughput(Figure: Any, tp: dict[str, Any]) -> Any:
    ways = []
    for way, row in tp["ways"].items():
        if "wall_s" not in row:
            continue
        if way == "aiocompile" and row.get("costs_known_s"):
            ways.append(("aiocompile, all rounds", row))
            # the rounds that started the longest compiles first, from the first round's times
            ways.append(("aiocompile, times known", {"wall_s": row["costs_known_s"],
                                                     "ratio_to_aiocompile": row["costs_known_s"] / row["wall_s"]}))
        else:
            ways.append((way, row))
    fig = Figure(figsize=(8, 0.55 * len(ways) + 1.6))
    ax = fig.add_subplot()
    names = [w for w, _ in ways][::-1]
    walls = [r["wall_s"] for _, r in ways][::-1]
    ax.barh(names, walls, color=[_AIOCOMPILE_BLUE if n.startswith("aiocompile") else _GREY for n in names])
    for y, (name, wall) in enumerate(zip(names, walls)):
        ratio = dict(ways)[name].get("ratio_to_aiocompile")
        ax.text(wall, y, f" {wall:.1f} s" + (f" ({ratio:.2f}x)" if ratio else ""), va="center", fontsize=9)
    if tp.get("lower_bound_s"):
        ax.axvline(tp["lower_bound_s"], color="#d62728", linestyle="--", linewidth=1.2,
                   label=f"lower bound {tp['lower_bound_s']:.1f} s = max(sum of single compiles / W, longest)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(0, max(walls + [tp.get("lower_bound_s") or 0]) * 1.3)
    ax.set_ylim(-1.2, len(names) - 0.5)  # room for the legend under the bars
    ax.set_xlabel("wall time, s (lower is better)")
    ax.set_title(f"{tp['kernels']} kernels ({tp.get('set', 'heavy')} set) for {tp['target']}, {tp['workers']} "
                 f"workers, {tp['cpus']} CPUs")
    return fig


def chart_loop_lag(Figure: Any, tp: dict[str, Any]) -> Any:
    ways = [(w, r) for w, r in tp["ways"].items() if "lag" in r]
    fig = Figure(figsize=(8, 0.75 * len(ways) + 1.6))
    ax = fig.add_subplot()
    _grouped_barh(ax, [w for w, _ in ways], [("p99", [r["lag"]["p99_ms"] for _, r in ways], _AIOCOMPILE_BLUE),
                                             ("max", [r["lag"]["max_ms"] for _, r in ways], "#ff7f0e")], "ms")
    ax.set_xlabel("lateness of a 1 ms ticker, ms (log scale, lower is better)")
    ax.set_title("event-loop lag while the kernels compile")
    return fig


def chart_dispatch(Figure: Any, dispatch: dict[str, Any]) -> Any:
    rows = list(dispatch["results"].items())
    fig = Figure(figsize=(8, 0.75 * len(rows) + 1.6))
    ax = fig.add_subplot()
    _grouped_barh(ax, [n for n, _ in rows], [("p50", [r["p50_us"] for _, r in rows], _AIOCOMPILE_BLUE),
                                             ("p99", [r["p99_us"] for _, r in rows], _GREY)], "µs")
    ax.set_xlabel("round trip of a trivial job, µs (log scale, lower is better)")
    ax.set_title(f"dispatch, one warm worker each, {dispatch['cpus']} CPUs")
    return fig


def chart_memory(Figure: Any, memory: dict[str, Any]) -> Any:
    rows = list(memory["results"].items())
    names = [n for n, _ in rows]
    fig = Figure(figsize=(10, 3.6))
    left, right = fig.subplots(1, 2)
    x = range(len(rows))
    width = 0.27
    for offset, key, label in ((-width, "import_s", "import"), (0.0, "pool_ready_s", "pool ready"),
                               (width, "first_compile_s", "first compile")):
        bars = left.bar([i + offset for i in x], [r[key] for _, r in rows], width, label=label)
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    left.set_xticks(list(x), names, fontsize=8)
    left.set_ylabel("seconds")
    left.set_title(f"cold start, {memory['workers']} workers")
    for offset, key, label in ((-width, "worker_rss_mib", "worker RSS"), (0.0, "worker_pss_mib", "worker PSS"),
                               (width, "pool_pss_mib", "whole pool PSS")):
        bars = right.bar([i + offset for i in x], [r[key] or 0.0 for _, r in rows], width, label=label)
        right.bar_label(bars, fmt="%.0f", fontsize=7)
    right.set_xticks(list(x), names, fontsize=8)
    right.set_ylabel("MiB")
    right.set_title("memory after 16 compiles")
    for axis in (left, right):
        axis.set_ylim(0, axis.get_ylim()[1] * 1.25)
        axis.legend(fontsize=8, ncol=3, loc="upper center")
    return fig


# chart name -> (the benchmark it draws, how, the file's suffix)
CHARTS = {
    "throughput": ("throughput", chart_throughput, "throughput"),
    "throughput_heavy": ("throughput_heavy", chart_throughput, "throughput-heavy"),
    "loop_lag": ("throughput", chart_loop_lag, "loop-lag"),
    "dispatch": ("dispatch", chart_dispatch, "dispatch"),
    "memory": ("memory", chart_memory, "startup-memory"),
}


def charts(report: dict[str, Any], out: str, slug: str) -> dict[str, str] | None:
    """The PNGs, drawn with matplotlib's Figure API (no pyplot, no display); None without
    matplotlib. A chart that cannot be drawn from its results is left out, with a warning."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    made: dict[str, str] = {}
    # A benchmark that failed may still have written results (some of its ways did run).
    results = {name: e["result"] for name, e in report["benchmarks"].items() if e.get("result")}
    for chart, (bench, draw, suffix) in CHARTS.items():
        if bench not in results:
            continue
        try:
            fig = draw(Figure, results[bench])
            fig.tight_layout()
            made[chart] = _png(fig, os.path.join(out, f"{slug}-{suffix}.png"))
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
            print(f"warning: no {chart} chart ({type(exc).__name__}: {exc})", file=sys.stderr)
    return made


def render_markdown(report: dict[str, Any], images: dict[str, str] | None) -> str:
    m = report["machine"]
    benches = report["benchmarks"]
    lines = [f"# Benchmarks: {report['slug']}", ""]
    lines.append(f"Written by `{report['command']}` on {m['date']}; every benchmark's output and result is in "
                 f"[{report['slug']}.json]({report['slug']}.json).")
    if images is None:
        lines += ["", "(No charts: matplotlib is not installed here. `python benchmarks/run.py --render --slug "
                  f"{report['slug']}` draws them from the JSON file on a machine that has it.)"]
        images = {}
    lines.append("")
    lines.append(_table(["", ""], [
        ["CPU", f"{m['cpu_model']}, {m['cpus']} CPUs ({m['cpus_usable']} usable)"],
        ["RAM", f"{m['ram_gib']} GiB"],
        ["GPU", f"{m['gpu']} x{m['gpus']}" if m["gpu"] else "none"],
        ["OS", m["os"]],
        ["Python / Triton / torch / anyio", f"{m['python']} / {m['triton']} / {m['torch'] or '-'} / {m['anyio']}"],
        ["aiocompile", f"{m['aiocompile']} at {m['git_commit']}"
                       + (" (with uncommitted changes to aiocompile/)" if m["aiocompile_modified"] else "")
                       + (" (the latest run's; each benchmark's own is under Runs)" if len(
                           {e.get("git_commit") for e in benches.values() if e.get("git_commit")}) > 1 else "")],
    ]))
    lines += ["", "## Runs", ""]
    rows = []
    position = {bench.name: index for index, bench in enumerate(KNOWN)}
    for name, e in sorted(benches.items(), key=lambda item: position.get(item[0], len(position))):
        load = e.get("load_before")
        share = e.get("other_processes_cpu_share")
        rows.append([name, e["status"] + (f": {e['reason']}" if e.get("reason") and e["status"] != "ok" else ""),
                     e.get("git_commit") or m["git_commit"] or "-",
                     e.get("seconds"), f"`{e['command']}`" if e.get("command") else "-",
                     "/".join(_fmt(x) for x in load) if load else "-",
                     f"{share * 100:.0f}%" if share is not None else "-"])
    lines.append(_table(["benchmark", "status", "commit", "seconds", "command", "load average before (1/5/15 min)",
                         "CPU used by other processes"], rows, digits=1))
    lines.append("")
    lines.append("The last column is the share of the machine's CPU time, while the benchmark ran, that went to "
                 "processes other than the benchmark's own (at least that much: short-lived ones are missed): "
                 "other work on a shared machine, which makes every figure of that benchmark noisier. "
                 "aiocompile's workers run at a lower priority (`worker_nice`), so they yield to such work more "
                 "than the other pools' workers do.")
    results = {name: e["result"] for name, e in benches.items() if e.get("result")}

    def section(title: str, body: str, image: str | None = None) -> None:
        lines.extend(["", f"## {title}", "", body])
        if image:
            lines.extend(["", f"![{title}]({image})"])

    def safe(name: str, render: Callable[[Any], str]) -> str:
        try:
            return render(results[name])
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError) as exc:
            return (f"(this benchmark's JSON has a shape the report does not know: {type(exc).__name__}: {exc}; "
                    "all of it:)\n\n" + render_generic(results[name]))

    order = ["throughput", "loop_lag", "throughput_heavy", "first_run", "contention", "dispatch", "startup", "memory"]
    order += [name for name in benches if name not in order]
    for name in order:
        if name == "loop_lag":
            if "throughput" in results or "loop_lag" in results:
                try:
                    body = render_loop_lag(results.get("throughput"), results.get("loop_lag"))
                except (KeyError, TypeError, ValueError) as exc:
                    body = f"(unexpected shape: {exc})\n\n" + render_generic(results.get("loop_lag"))
                section("Event-loop lag while compiling", body, images.get("loop_lag"))
            continue
        if name not in results:
            continue
        if name in RENDERERS:
            title, render = RENDERERS[name]
            section(title, safe(name, render), images.get(name))
        else:  # a benchmark this report does not know: its numbers side by side, and what it printed
            body = render_columns(results[name]) or render_generic(results[name])
            printed = benches[name].get("stdout", "").strip()
            if printed:
                body += f"\n\n`{benches[name]['script']}` printed:\n\n```text\n{printed[-4000:]}\n```"
            section(name.replace("_", " ").capitalize(), body)
    failed = {name: e for name, e in benches.items() if e["status"] in ("failed", "timeout")}
    if failed:
        lines += ["", "## Failures", ""]
        for name, e in failed.items():
            lines += [f"### {name}: {e['reason']}", "", "```", (e.get("stderr") or "").strip()[-3000:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(report: dict[str, Any], out: str) -> list[str]:
    slug = report["slug"]
    json_path = os.path.join(out, f"{slug}.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(json_path + ".tmp", json_path)
    images = charts(report, out, slug)
    md_path = os.path.join(out, f"{slug}.md")
    with open(md_path, "w") as f:
        f.write(render_markdown(report, images))
    return [json_path, md_path] + [os.path.join(out, image) for image in (images or {}).values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    parser.add_argument("--slug", help="the report's name (default: from the GPU or CPU model and the CPU count)")
    parser.add_argument("--only", help="comma-separated benchmark names to run; the others' results are kept")
    parser.add_argument("--render", action="store_true", help="only rewrite the markdown and charts from the JSON")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    machine = {} if args.render and args.slug else describe_machine()
    slug = args.slug or slug_of(machine)
    json_path = os.path.join(args.out, f"{slug}.json")
    previous: dict[str, Any] | None = None
    if os.path.exists(json_path) and (args.only or args.render):
        with open(json_path) as f:
            previous = json.load(f)
    if args.render:
        if previous is None:
            raise SystemExit(f"no {json_path} to render")
        for path in write_report(previous, args.out):
            print(f"wrote {path}")
        return
    only = {n for n in args.only.split(",") if n} if args.only else None
    benches = plan(only)
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "")
    report: dict[str, Any] = {"slug": slug, "command": command, "quick": args.quick, "machine": machine,
                              "benchmarks": dict(previous["benchmarks"]) if previous else {}}
    if previous:
        # Results kept from an earlier run were measured at that run's commit.
        for entry in report["benchmarks"].values():
            entry.setdefault("git_commit", previous.get("machine", {}).get("git_commit"))
    if previous and only:
        report["command"] = previous.get("command", command) + f" (then --only {args.only})"
    started = time.monotonic()
    print(f"{len(benches)} benchmarks on {slug}: {', '.join(b.name for b in benches)}", flush=True)
    for bench in benches:
        print(f"\n== {bench.name} ({bench.script})", flush=True)
        entry = run_one(bench, args.quick, machine)
        report["benchmarks"][bench.name] = entry
        print(entry.get("stdout", "").rstrip()[-6000:])
        print(f"-> {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason") else "")
              + (f" in {entry['seconds']} s" if "seconds" in entry else ""), flush=True)
        if entry["status"] in ("failed", "timeout"):
            print(entry.get("stderr", "")[-2000:], flush=True)
        report["total_seconds"] = round(time.monotonic() - started, 1)
        write_report(report, args.out)  # after each benchmark, so that an interrupted run keeps what it did
    paths = write_report(report, args.out)
    print(f"\nall done in {time.monotonic() - started:.0f} s:")
    for path in paths:
        print(f"wrote {path}")
    failed = [name for name, e in report["benchmarks"].items() if e["status"] in ("failed", "timeout")]
    if failed:
        print(f"failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
