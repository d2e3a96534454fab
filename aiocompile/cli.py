"""The ``aiocompile`` command: ``build``, ``decisions``, ``report`` (docs/cli.md tells users
each, its output and its exit status).

``build KERNELS --target ... --out DIR`` pre-builds a kernel set (a ``KERNELS`` list of
``compile_many`` specs: Triton entries built once per target, ``"kind": "cpp"`` once for
this machine, ``"kind": "cuda"`` once for its own ``"arch"`` or per target) into DIR,
which is a disk cache: ``Scheduler(cache_dir=DIR)`` finds every kernel there. Beside the
cache files it writes ``manifest.json``, ``costs.json`` and the bare binaries. The build's
scheduler is ``SchedulerConfig.from_env()`` with the options applied; everything it writes
is private to its user, and a DIR it could not write or would not trust stops it before
anything compiles (status 2). A kernel that fails does not stop the others (status 1).

``decisions list|export|import`` carries ``autotune()``'s decisions between cache
directories, under the disk cache's trust rules. ``report EVENTS [--timeline PNG]`` reads
an event log back (``_observe.report``); ``report --repro [DIR]`` lists repro bundles.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from aiocompile._base.config import SETTINGS, SchedulerConfig
from aiocompile._base.target import parse_target
from aiocompile._cache.disk import DiskCache, make_private_dir, write_private
from aiocompile._core.scheduler import Scheduler
from aiocompile._observe import console
from aiocompile.backends.triton._targets import check_target


def _load_kernel_set(spec: str) -> list[dict[str, Any]]:
    path = Path(spec)
    if path.suffix == ".py" or path.is_file():
        if not path.is_file():
            _usage_error(f"no such file: {spec}")
        try:
            module = _import_path(path.resolve())
        except Exception as exc:  # noqa: BLE001 - whatever the file raised: the kernel set cannot be loaded
            _usage_error(f"cannot load {spec}: {_raised(exc)}")
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as exc:
            _usage_error(f"cannot import {spec!r}: {exc}")
        except Exception as exc:  # noqa: BLE001 - as for a file
            _usage_error(f"cannot load {spec}: {_raised(exc)}")
    kernels = getattr(module, "KERNELS", None)
    if not isinstance(kernels, Sequence) or not all(isinstance(k, Mapping) and _kind(k) is not None for k in kernels):
        _usage_error(f"{spec} must define KERNELS, a list of dicts each with a 'kernel' (Triton), or with a 'kind' "
                     "('cpp' or 'cuda') and a 'source'")
    for index, entry in enumerate(kernels):
        missing = [name for name in _NEEDS[_kind(entry) or ""] if name not in entry]
        name = entry.get("label") or entry.get("name") or getattr(entry.get("kernel"), "__name__", None)
        which = f"KERNELS[{index}]" + (f" ({name})" if name else "")
        if missing:
            _usage_error(f"{spec}: {which} has no {' and no '.join(map(repr, missing))}")
        wrong = _wrong_types(entry)
        if wrong:
            _usage_error(f"{spec}: {which}: {wrong}")
        label = entry.get("label")
        if label is not None and (not isinstance(label, str) or label in ("", ".", "..") or "/" in label
                                  or "\\" in label or "\0" in label):
            # A label names the entry's binary file in the output directory, and no other.
            _usage_error(f"{spec}: {which} has the label {label!r}: a label names a file, so it is a non-empty "
                         "string without '/'")
    return [dict(k) for k in kernels]


def _raised(exc: BaseException) -> str:
    """What an exception says and, from its traceback, where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _config_from_env() -> SchedulerConfig:
    try:
        return SchedulerConfig.from_env()
    except (TypeError, ValueError) as exc:  # an AIOCOMPILE_* variable that says nothing it takes
        _usage_error(str(exc))


# What an entry of each kind must hold besides its kernel or source (as compile_many's
# specs of that kind must).
_NEEDS = {"triton": ("signature",), "cpp": (), "cuda": (), "": ()}


def _wrong_types(entry: Mapping[str, Any]) -> str | None:
    """What in an entry is of a type no build takes (an entry is checked before anything
    starts, as its whole kernel set is), or None."""
    if _kind(entry) == "triton":
        from triton.runtime.jit import JITFunction

        kernel = entry["kernel"]
        if not isinstance(kernel, JITFunction):
            return (f"'kernel' must be a @triton.jit function, got {type(kernel).__name__}"
                    + (" (an autotuned kernel is tuned with autotune(), not built)"
                       if isinstance(getattr(kernel, "fn", None), JITFunction) else ""))
        for name in ("signature", "constexprs"):
            if name in entry and entry[name] is not None and not isinstance(entry[name], Mapping):
                return f"{name!r} must be a dict, got {type(entry[name]).__name__}"
    elif not isinstance(entry["source"], str):
        return f"'source' must be the source text (a str), got {type(entry['source']).__name__}"
    return None


def _kind(entry: Mapping[str, Any]) -> str | None:
    """What an entry of KERNELS builds: "triton", "cpp" or "cuda"; None for no entry."""
    kind = entry.get("kind", "triton")
    if kind == "triton":
        return "triton" if "kernel" in entry else None
    return kind if kind in ("cpp", "cuda") and "source" in entry else None


def _native_arch(target: str) -> str:
    """The compile_cuda architecture of a target: cuda:90 -> sm_90, hip:gfx942 -> gfx942."""
    backend, _, arch = target.partition(":")
    return f"sm_{arch}" if backend == "cuda" else arch


def _expand(kernels: list[dict[str, Any]], targets: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(label, compile_many spec) of each compile: a Triton kernel for each target, a C++
    source once, a CUDA source once for its own architectures, or for each target."""
    specs = []
    for entry in kernels:
        kind = _kind(entry)
        spec = dict(entry)
        label = str(spec.pop("label", None) or spec.get("name") or
                    (getattr(spec["kernel"], "__name__", "kernel") if kind == "triton" else kind))
        if kind == "cpp":
            spec.setdefault("name", label)  # in records and errors, rather than one made from the source's hash
        if kind == "cpp" or (kind == "cuda" and "arch" in spec):
            specs.append((label, dict(spec, label=label)))
            continue
        for target in targets:
            built = dict(spec, label=f"{label}@{target}")
            if kind == "triton":
                built["target"] = target
            else:
                built["arch"] = _native_arch(target)
            specs.append((label, built))
    return specs


def _spec_target(spec: Mapping[str, Any]) -> str:
    """What a spec was built for, as its result would say (for a failure's line)."""
    kind = spec.get("kind", "triton")
    if kind == "triton":
        return str(spec["target"])
    if kind == "cpp":
        return "host"
    arch = spec.get("arch", "sm_90")
    archs = [arch] if isinstance(arch, str) else [str(a) for a in arch]
    return f"{'hip' if archs[0].startswith('gfx') else 'cuda'}:{'+'.join(archs)}"


def _images(result: Any) -> dict[str, bytes]:
    """The files a result is written as, by name suffix: one for a Triton kernel or a
    library; one per architecture for cubins and PTX."""
    images: dict[str, bytes] | None = getattr(result, "images", None)
    if images is None or len(images) == 1:
        return {"": result.binary}
    return {f".{name}": data for name, data in images.items()}


def _import_path(path: Path) -> Any:
    # Import the file under its own name when that name finds this very file (workers can
    # then import the kernels by reference); otherwise under a private name (workers are
    # then sent the kernels' source).
    directory, stem = str(path.parent), path.stem
    if stem.isidentifier() and stem not in sys.modules:
        sys.path.insert(0, directory)
        found = importlib.util.find_spec(stem)
        if found is not None and found.origin and Path(found.origin).resolve() == path:
            return importlib.import_module(stem)
        sys.path.remove(directory)
    name = f"aiocompile_kernels_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _target_dir(target: str) -> str:
    return target.replace(":", "-")


def _fmt_size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"


async def _build(args: argparse.Namespace) -> int:
    kernels = _load_kernel_set(args.kernels)
    targets = []
    for text in args.target:
        for part in text.split(","):
            if part.strip():
                try:
                    target = parse_target(part)
                    assert target is not None
                    check_target(target)  # one Triton does not know is refused before any worker starts
                except ValueError as exc:
                    _usage_error(str(exc))
                targets.append(str(target))
    targets = list(dict.fromkeys(targets))
    per_target = [k for k in kernels if _kind(k) == "triton" or (_kind(k) == "cuda" and "arch" not in k)]
    if per_target and not targets:
        _usage_error("--target is needed: some kernels are built for each target (Triton kernels, and CUDA sources "
                     "without an 'arch')")
    out = Path(args.out)
    config = _config_from_env().with_changes(workers=args.workers, timeout=args.timeout,
                                                     start_method=args.start_method, cache_url=args.cache_url)
    executor = _dask_executor(args.dask) if args.dask else None
    specs = _expand(kernels, targets)

    for_what = f"{_count(len(targets), 'target')} ({', '.join(targets)})" if targets else "this machine"
    running = (f"on the Dask cluster at {args.dask} ({_count(executor.capacity(), 'worker thread')})"
               if executor is not None else f"with {_count(config.workers, 'worker')}")
    print(f"aiocompile: building {_count(len(kernels), 'kernel')} for {for_what} {running}", file=sys.stderr)
    started = time.perf_counter()
    try:
        scheduler = Scheduler(config=config, cache_dir=out, event_log=args.events, executor=executor)
    except OSError as exc:  # the event log's file, the one thing it opens at once
        _usage_error(f"cannot write the event log {args.events}: {exc.strerror or exc}")
    async with scheduler as sched:
        access = sched.statistics().disk_access
        if access != "read-write":
            # Kernels compiled into a directory that keeps none of them would be a build
            # that ships nothing.
            _usage_error(f"cannot build into {out}: the directory is {access} for this user (see the warning above)")
        show_progress = not args.no_progress and sys.stderr.isatty()
        try:
            results = await sched.compile_many([spec for _, spec in specs], progress=show_progress,
                                               return_exceptions=True)
        except (TypeError, ValueError) as exc:  # a spec refused as a whole, before any compile
            _usage_error(f"{args.kernels}: {exc}")
        wall = time.perf_counter() - started
        stats = sched.statistics()
        from_cache = {r.key for r in sched.records() if r.outcome in ("disk_hit", "cache_hit", "shared_hit")}
    # Leaving the block waited for every new artifact to be written.

    rows, failures, manifest = [], [], []
    for (label, spec), result in zip(specs, results):
        kind = spec.get("kind", "triton")
        if isinstance(result, BaseException):
            failures.append((label, getattr(result, "target", None) or _spec_target(spec), result))
            continue
        target = result.target
        artifact = DiskCache.path_in(out, result.key)
        make_private_dir(out / "binaries")
        directory = out / "binaries" / _target_dir(target)
        make_private_dir(directory)
        files = {}
        for suffix, data in _images(result).items():
            binary = directory / f"{label}{suffix}.{result.binary_ext}"
            write_private(binary, data)
            files[suffix.lstrip(".")] = str(binary.relative_to(out))
        entry = {
            "label": label, "kind": kind, "kernel": result.name, "target": target, "key": result.key,
            "from_cache": result.key in from_cache, "file": str(artifact.relative_to(out)),
            "binary": next(iter(files.values())), "size": result.size, "compile_time": round(result.compile_time, 6),
        }
        if kind == "triton":
            meta = result.metadata
            entry.update({"binary_size": len(result.binary), "num_warps": meta.get("num_warps"),
                          "num_stages": meta.get("num_stages"), "shared": meta.get("shared"),
                          "triton": result.triton_version})
        else:
            if len(files) > 1:
                entry["images"] = files
            entry.update({"compiler": result.compiler, "compiler_version": result.compiler_version,
                          "command": result.command,
                          "stages": [[stage, round(seconds, 6)] for stage, seconds in result.stages]})
        manifest.append(entry)
        rows.append((label, target, result, result.key in from_cache))

    from aiocompile import __version__

    make_private_dir(out)
    write_private(out / "manifest.json", json.dumps({
        "aiocompile": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "targets": targets, "kernels": manifest, "statistics": stats.to_dict(),
        "wall_time": round(wall, 6),
        "failures": [{"label": label, "target": target, "error": str(exc)} for label, target, exc in failures],
    }, indent=2).encode())

    if args.decisions:
        imported = _import_decisions(out, args.decisions, config.cache_key)
        print(f"{imported} tuning decision(s) imported into {out}", file=sys.stderr)
    status = 1 if failures else 0
    try:
        _print_summary(rows, failures, wall, stats, running, out)
        if args.events:
            print(f"events appended to {args.events} (aiocompile report {args.events})")
    except BrokenPipeError:
        console.stdout_gone()  # read as far as the reader wanted (`| head`): the build is what it was
    return status


def _setting(name: str) -> Any:
    """An argparse type for the configuration field ``name``, checked by that field's rule."""
    rule = SETTINGS[name]

    def parse(text: str) -> Any:
        try:
            return rule.parse(name, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule.describe('leave it out')}, got {text!r}") from None

    parse.__name__ = name
    return parse


def _usage_error(message: str) -> NoReturn:
    # Exit status 2, as argparse gives for a bad command line: the input was wrong, not
    # the work.
    print(f"aiocompile: {message}", file=sys.stderr)
    raise SystemExit(2)


def _report(args: argparse.Namespace) -> int:
    if args.events is None and args.repro is None:
        _usage_error("report needs an event log (EVENTS), --repro, or both")
    if args.events is not None:
        _report_events(args)
    if args.repro is not None:
        _report_bundles(args.repro)
    return 0


def _report_bundles(root: str) -> None:
    from aiocompile._observe.repro import format_bundles, list_bundles

    if not root:
        root = _config_from_env().repro_dir or ""
        if not root:
            _usage_error("repro bundles are switched off (AIOCOMPILE_REPRO_DIR=off); name a directory")
    if Path(root).exists() and not Path(root).is_dir():
        _usage_error(f"not a directory: {root}")
    print(format_bundles(list_bundles(root), root), end="")


def _report_events(args: argparse.Namespace) -> None:
    from aiocompile._observe.report import draw_timeline, read_events, summary_table

    try:
        events = read_events(args.events)
    except FileNotFoundError:
        _usage_error(f"no such file: {args.events}")
    except OSError as exc:
        _usage_error(f"cannot read {args.events}: {exc.strerror or exc}")
    if events.empty:
        skipped = f" ({events.skipped} unreadable line(s) skipped)" if events.skipped else ""
        _usage_error(f"no events in {args.events}{skipped}")
    print(f"aiocompile report: {args.events}")
    print(summary_table(events), end="")
    if args.timeline:
        try:
            draw_timeline(events, args.timeline)
        except (ImportError, ValueError) as exc:
            _usage_error(str(exc))
        except OSError as exc:
            _usage_error(f"cannot write the timeline {args.timeline}: {exc.strerror or exc}")
        print(f"\ntimeline written to {args.timeline}")
    if args.repro is not None:
        print()


def _read_decision_files(files: Sequence[str]) -> list[Any]:
    from aiocompile._tuning.decisions import import_text

    decisions = []
    for name in files:
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text()
            decisions.extend(import_text(text))
        except FileNotFoundError:
            _usage_error(f"no such file: {name}")
        except (OSError, ValueError) as exc:
            _usage_error(f"cannot read decisions from {name}: {exc}")
    return decisions


def _import_decisions(directory: Path, files: Sequence[str], secret: Any) -> int:
    from aiocompile._tuning.decisions import write_all

    decisions = _read_decision_files(files)
    disk = write_all(directory, decisions, secret)
    if disk.access != "read-write" or disk.writes != len(decisions):
        _usage_error(f"could not write the decisions into {directory} (the directory is {disk.access} for this user; "
                     f"{disk.writes} of {len(decisions)} written)")
    return len(decisions)


def _decisions(args: argparse.Namespace) -> int:
    from aiocompile._tuning.decisions import export_text, read_all

    secret = _config_from_env().cache_key
    directory = Path(args.directory)
    if args.action == "import":
        count = _import_decisions(directory, args.files, secret)
        print(f"{count} tuning decision(s) imported into {directory}")
        return 0
    if not directory.is_dir():
        _usage_error(f"no such directory: {directory}")
    decisions, disk = read_all(directory, secret)
    if args.action == "export":
        text = export_text(decisions)
        if args.output in (None, "-"):
            sys.stdout.write(text)
        else:
            make_private_dir(Path(args.output).resolve().parent)
            write_private(Path(args.output), text.encode())
            print(f"{len(decisions)} tuning decision(s) exported to {args.output}", file=sys.stderr)
        return 0
    for decision in decisions:
        tuned = time.strftime("%Y-%m-%d %H:%M", time.localtime(decision.tuned_at)) if decision.tuned_at else "?"
        print(f"{decision.kernel}  key={decision.tuning_key}  on {decision.device_name} (Triton "
              f"{decision.triton_version}, {tuned}): {decision.label}")
    refused = 0 if disk is None else disk.refused + disk.corrupt
    print(f"{len(decisions)} decision(s) in {directory}" + (f"; {refused} file(s) not used" if refused else ""))
    return 0


def _dask_executor(address: str) -> Any:
    try:
        from aiocompile.dask import executor
    except ImportError as exc:
        _usage_error(f"--dask needs Dask's distributed package: pip install 'aiocompile[dask]' ({exc})")
    try:
        return executor(address)
    except (OSError, ValueError, TypeError) as exc:
        _usage_error(f"cannot use the Dask cluster at {address}: {exc}")


def _print_summary(rows: list[Any], failures: list[Any], wall: float, stats: Any, running: str, out: Path) -> None:
    width = max([len(row[0]) for row in rows] + [len(f[0]) for f in failures] + [len("kernel")])
    where = max([len(row[1]) for row in rows] + [len(f[1]) for f in failures] + [11])
    print(f"\n{'kernel':<{width}}  {'target':<{where}} {'compile':>9} {'binary':>10} {'warps':>5} {'stages':>6} "
          f"{'smem':>7}")
    for label, target, kernel, cached in rows:
        meta = getattr(kernel, "metadata", {})  # Triton's; a C++ or CUDA build has none of these
        note = "  (cached)" if cached else ""
        size = sum(len(data) for data in _images(kernel).values())
        print(f"{label:<{width}}  {target:<{where}} {kernel.compile_time * 1000:7.0f}ms {_fmt_size(size):>10} "
              f"{meta.get('num_warps', ''):>5} {meta.get('num_stages', ''):>6} {meta.get('shared', ''):>7}{note}")
    for label, target, exc in failures:
        print(f"{label:<{width}}  {target:<{where}} FAILED   {type(exc).__name__}: {console.failure_line(exc)}")
    compiled = [kernel for _, _, kernel, cached in rows if not cached]
    total = sum(kernel.compile_time for kernel in compiled)
    cached_note = f" ({len(rows) - len(compiled)} of them from the cache)" if len(compiled) < len(rows) else ""
    print(f"\n{len(rows)} built{cached_note}, {len(failures)} failed in {wall:.2f} s wall {running}; "
          f"sum of compile times {total:.2f} s ({total / wall if wall else 0:.1f}x parallel)")
    q, r = stats.queue_wait, stats.run_time
    print(f"queue wait p50 {q.p50 * 1000:.0f} ms, p95 {q.p95 * 1000:.0f} ms; "
          f"worker run time p50 {r.p50 * 1000:.0f} ms, p95 {r.p95 * 1000:.0f} ms, max {r.max * 1000:.0f} ms; "
          f"workers started {stats.workers_started}, crashes {stats.worker_crashes}")
    print(f"cache directory (Scheduler(cache_dir=...)), manifest.json and binaries/ in {out}")


def main(argv: list[str] | None = None) -> int:
    from aiocompile import __version__

    parser = argparse.ArgumentParser(prog="aiocompile", description="Compile GPU kernels in a supervised worker pool.")
    parser.add_argument("--version", action="version", version=f"aiocompile {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="pre-build a kernel set for one or more targets")
    build.add_argument("kernels", help="a Python file or module defining KERNELS")
    build.add_argument("--target", "-t", action="append", default=[],
                       help="target such as cuda:80, cuda:90, hip:gfx942 (repeat, or comma-separate); needed for "
                            "Triton kernels and CUDA sources without an 'arch'")
    build.add_argument("--out", "-o", default="build/kernels", help="output directory (default: build/kernels)")
    build.add_argument("--workers", "-j", type=_setting("workers"), default=None,
                       help="worker processes (default: CPUs)")
    build.add_argument("--timeout", type=_setting("timeout"), default=None, help="per-kernel timeout in seconds")
    build.add_argument("--start-method", choices=["forkserver", "spawn", "fork"], default=None)
    build.add_argument("--no-progress", action="store_true", help="no progress bar (none unless on a terminal)")
    build.add_argument("--dask", metavar="ADDRESS", default=None,
                       help="build on the Dask cluster whose scheduler is at ADDRESS (tcp://host:8786)")
    build.add_argument("--cache-url", type=_setting("cache_url"), default=None, metavar="URL",
                       help="also use the shared cache at URL (redis://host:6379/0; default: AIOCOMPILE_CACHE_URL)")
    build.add_argument("--events", metavar="FILE", default=None,
                       help="append every request's record and worker event to FILE (JSON lines)")
    build.add_argument("--decisions", metavar="FILE", action="append", default=None,
                       help="import autotune() decisions exported from a GPU host into the output directory")
    decisions = commands.add_parser("decisions", help="list, export or import autotune() decisions")
    actions = decisions.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="show the decisions kept in a cache directory")
    listing.add_argument("directory", metavar="DIR", help="a cache directory (cache_dir=)")
    export = actions.add_parser("export", help="write the decisions of a cache directory to a JSON file")
    export.add_argument("directory", metavar="DIR", help="a cache directory (cache_dir=)")
    export.add_argument("--output", "-o", metavar="FILE", default=None, help="the file (default: standard output)")
    into = actions.add_parser("import", help="put exported decisions into a cache directory")
    into.add_argument("directory", metavar="DIR", help="a cache directory (cache_dir=)")
    into.add_argument("files", metavar="FILE", nargs="+", help="files written by export ('-': standard input)")
    report = commands.add_parser("report", help="summarise an event log, draw its timeline, list repro bundles")
    report.add_argument("events", metavar="EVENTS", nargs="?", default=None,
                        help="a JSON-lines event log (event_log=, build --events)")
    report.add_argument("--repro", metavar="DIR", nargs="?", const="", default=None,
                        help="list the repro bundles of failed compiles in DIR (default: the configured root)")
    report.add_argument("--timeline", metavar="PNG", default=None,
                        help="also draw the workers over time into this PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    with console.Console() as printer:
        try:
            if args.command == "build":
                return asyncio.run(_build(args))
            if args.command == "report":
                return _report(args)
            if args.command == "decisions":
                return _decisions(args)
            return 2  # pragma: no cover - argparse requires a command
        except BrokenPipeError:
            # The reader of stdout stopped early (`| head`): what it left unread was not wanted.
            console.stdout_gone()
            return 0
        except KeyboardInterrupt:
            printer.say("aiocompile: interrupted")
            return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
