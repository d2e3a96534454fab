"""The CUDA (and ROCm) backend: ``compile_cuda`` arguments -> nvcc (or hipcc) in a worker
-> a ``CudaBinary``.

What runs, in a scratch directory of the worker (``FLAGS`` after the include directories;
``-ccbin`` names the host compiler found here unless the flags name one)::

    cubin    nvcc -I... FLAGS -ccbin g++ -cubin -arch=sm_90 -o sm_90.cubin source.cu --time sm_90.time
             (once per architecture: a cubin holds one)
    ptx      nvcc ... -ptx -arch=sm_90 -o sm_90.ptx source.cu --time sm_90.time      (once per architecture)
    fatbin   nvcc ... -fatbin -gencode=arch=compute_80,code=sm_80 ... -o source.fatbin source.cu --time ...
    shared   nvcc ... -shared -Xcompiler -fPIC -gencode=... -o libsource.so source.cu --time ...
    hsaco    HIP_PLATFORM=amd hipcc -I... FLAGS --genco --offload-arch=gfx90a ... -o source.hsaco source.hip
    shared   HIP_PLATFORM=amd hipcc -I... FLAGS -shared -fPIC --offload-arch=gfx90a ... -o libsource.so source.hip

An ``sm_XX`` architecture in a fatbin or a shared library is its machine code; a
``compute_XX`` one is its PTX, which the driver compiles for newer GPUs. For AMD
architectures (``gfx90a``) hipcc runs instead, and ``cubin``, ``fatbin`` and ``hsaco``
all mean a code object (a Clang offload bundle of one per architecture).

hipcc builds for AMD or NVIDIA GPUs as ``HIP_PLATFORM`` says, and where it is unset picks
NVIDIA's whenever it finds nvcc and no ``clang++``: an AMD architecture is then handed to
nvcc, which does not know it. A ``gfx`` architecture is AMD's alone, so hipcc always runs
with ``HIP_PLATFORM=amd`` here, whatever the environment says (another value could only
fail), and is asked what it is with it too: its identity, in the key, is HIP's version
and the Clang under it. The AMD processors that Clang knows are asked once
(``_compiler.amd_processors``): an architecture it does not know (``gfx942`` for Clang 15)
is a ``CompileError`` naming the compiler and its versions, before any worker.

The key covers the source, the architectures, the output, the flags, the include
directories and the headers read from them, the contents of the other files the flags
name, the compiler's environment variables (``CPATH``, ``NVCC_APPEND_FLAGS``... see
``_native._compiler.ENVIRONMENT``), the compiler (path, identity, version) and, for nvcc,
the host compiler. nvcc's ``--options-file``, and a response file passed on to its host
compiler or linker, cannot be keyed and are refused (``ValueError``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiocompile._base import checks
from aiocompile.backends import Request, source_features
from aiocompile.backends._native import _compiler, _run
from aiocompile.backends._native._backend import NativeBackend, Plan, key_of, record_details
from aiocompile.backends._native._compiler import Compiler
from aiocompile.backends._native._headers import Scan, SearchPath, absolute_paths
from aiocompile.backends._native._inputs import named_files, refuse_unkeyable
from aiocompile.backends.cuda import _worker as _cuda_worker
from aiocompile.backends.cuda._binary import CudaBinary
from aiocompile.errors import CompileError

__all__ = ["CudaBackend", "CudaSpec", "Invocation"]

_FORMAT = 3
"""Part of every key: raised when the command lines built here change (2: the compiler's
environment carried; 3: hipcc runs with ``HIP_PLATFORM=amd``)."""

# What nvcc and hipcc add to every command line from the environment: searched for
# include directories and files as the flags are.
_ADDED_FLAGS = {"cuda": ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"), "hip": ("HIPCC_COMPILE_FLAGS_APPEND",)}

_KERNEL_NAME = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")


@dataclass(frozen=True)
class Invocation:
    """One compiler run: the image it makes (an architecture, or the output's name), its
    command line, the file it writes, and nvcc's phase-times file."""

    label: str
    argv: tuple[str, ...]
    output: str
    times: str | None


@dataclass(frozen=True)
class CudaSpec:
    """Everything a worker needs to build one ``compile_cuda`` request."""

    name: str
    key: str
    target: str
    vendor: str
    archs: tuple[str, ...]
    output: str
    source: str
    source_file: str
    invocations: tuple[Invocation, ...]
    compiler: Compiler
    environment: _run.Environment = ()
    """The compiler's environment variables as keyed (see ``_native._compiler.environment``)."""


@dataclass(frozen=True)
class _Checked:
    source: str
    archs: tuple[str, ...]
    output: str
    flags: tuple[str, ...]
    include_dirs: tuple[str, ...]
    compiler: str | None
    name: str | None
    vendor: str


def _words(name: str, value: str | None) -> list[str]:
    try:
        return shlex.split(value or "")
    except ValueError as exc:
        raise ValueError(f"the environment variable {name} cannot be split into flags ({exc}): {value!r}") from None


def _gencode(arch: str) -> str:
    number = arch.split("_", 1)[1]
    code = arch if arch.startswith("sm_") else f"compute_{number}"
    return f"-gencode=arch=compute_{number},code={code}"


def _invocations(base: tuple[str, ...], vendor: str, archs: tuple[str, ...], output: str,
                 source_file: str) -> tuple[Invocation, ...]:
    if vendor == "hip":
        targets = tuple(f"--offload-arch={a}" for a in archs)
        if output == "shared":
            return (Invocation("shared", (*base, "-shared", "-fPIC", *targets, "-o", "libsource.so", source_file),
                               "libsource.so", None),)
        return (Invocation("hsaco", (*base, "--genco", *targets, "-o", "source.hsaco", source_file),
                           "source.hsaco", None),)
    if output in ("cubin", "ptx"):
        return tuple(
            Invocation(arch, (*base, f"-{output}", f"-arch={arch}", "-o", f"{arch}.{output}", source_file,
                              "--time", f"{arch}.time"), f"{arch}.{output}", f"{arch}.time")
            for arch in archs)
    gencodes = tuple(_gencode(a) for a in archs)
    if output == "fatbin":
        return (Invocation("fatbin", (*base, "-fatbin", *gencodes, "-o", "source.fatbin", source_file,
                                      "--time", "fatbin.time"), "source.fatbin", "fatbin.time"),)
    return (Invocation("shared", (*base, "-shared", "-Xcompiler", "-fPIC", *gencodes, "-o", "libsource.so",
                                  source_file, "--time", "shared.time"), "libsource.so", "shared.time"),)


class CudaBackend(NativeBackend):
    """The CUDA backend's state in one scheduler: what it knows of the headers it read."""

    kind = "cuda"
    fields = frozenset({"source", "arch", "output", "flags", "include_dirs", "compiler", "name"})

    def check(self, *, source: Any = None, arch: Any = "sm_90", output: Any = "cubin", flags: Any = (),
              include_dirs: Any = (), compiler: Any = None, name: Any = None) -> _Checked:
        source = checks.SOURCE.check("source", source)
        archs = tuple(dict.fromkeys(checks.GPU_ARCHS.check("arch", arch)))
        output = checks.GPU_OUTPUT.check("output", output)
        vendors = {"hip" if a.startswith("gfx") else "cuda" for a in archs}
        if len(vendors) > 1:
            raise ValueError(f"arch mixes NVIDIA and AMD architectures ({', '.join(archs)}): compile for each apart")
        vendor = vendors.pop()
        if vendor == "hip":
            if output == "ptx":
                raise ValueError("output='ptx' is NVIDIA's; for an AMD architecture use 'hsaco' (a code object) "
                                 "or 'shared'")
            if output in ("cubin", "fatbin"):
                output = "hsaco"
        elif output == "hsaco":
            raise ValueError(f"output='hsaco' is AMD's; for {', '.join(archs)} use 'cubin', 'fatbin', 'ptx' or "
                             "'shared'")
        elif output == "cubin" and any(a.startswith("compute_") for a in archs):
            raise ValueError("a cubin is machine code for one GPU: give sm_XX architectures (a compute_XX one is "
                             "PTX: output='ptx', or 'fatbin' to carry it)")
        flags = checks.NATIVE_FLAGS.check("flags", flags)
        refuse_unkeyable(flags)
        return _Checked(
            source=source, archs=archs, output=output, vendor=vendor, flags=flags,
            include_dirs=checks.INCLUDE_DIRS.check("include_dirs", include_dirs),
            compiler=checks.COMPILER.check("compiler", compiler),
            name=checks.NATIVE_NAME.check("name", name),
        )

    def label(self, spec: Mapping[str, Any]) -> str:
        found = _KERNEL_NAME.search(spec.get("source") or "") if isinstance(spec.get("source"), str) else None
        return str(spec.get("name") or (found.group(1) if found else self.kind))

    def plan(self, checked: _Checked) -> Plan:
        cwd = os.getcwd()
        environment = _compiler.environment(cwd)
        if checked.vendor == "hip":
            environment = tuple((name, "amd" if name == "HIP_PLATFORM" else value) for name, value in environment)
        compiler = _compiler.identify(_compiler.find(checked.vendor, checked.compiler), environment)
        source_digest = hashlib.sha256(checked.source.encode("utf-8", errors="surrogatepass")).hexdigest()
        found_name = _KERNEL_NAME.search(checked.source)
        name = checked.name or (found_name.group(1) if found_name else f"cuda-{source_digest[:12]}")
        if checked.vendor == "hip":
            _refuse_unknown_processors(compiler, environment, checked.archs, name)
        include_dirs = tuple(os.path.normpath(os.path.join(cwd, d)) for d in checked.include_dirs)
        flags = absolute_paths(checked.flags, cwd)
        base = (compiler.path, *(f"-I{d}" for d in include_dirs), *flags)
        host: Compiler | None = None
        if checked.vendor == "cuda" and not any(f in ("-ccbin", "--compiler-bindir") or
                                                f.startswith("--compiler-bindir=") for f in flags):
            # Told explicitly, the host compiler is the one keyed, whatever the worker's PATH.
            found = _compiler.host_compiler()
            if found is not None:
                host = _compiler.identify(found)
                base = (*base, "-ccbin", host.path)
        values = dict(environment)
        added = [word for name in _ADDED_FLAGS.get(checked.vendor, ()) for word in _words(name, values[name])]
        inputs = named_files((*flags, *added), cwd, self.headers, driver=False, library_path=values["LIBRARY_PATH"])
        source_file = "source.cu" if checked.vendor == "cuda" else "source.hip"

        def finish(scan: Scan) -> Request:
            key = key_of({
                "kind": "cuda", "format": _FORMAT, "vendor": checked.vendor, "source": source_digest,
                "archs": sorted(checked.archs), "output": checked.output, "flags": flags, "include_dirs": include_dirs,
                "files": inputs.files, "environment": environment, "headers": scan.headers,
                "compiler": [compiler.path, compiler.realpath, compiler.identity],
                "host": None if host is None else [host.path, host.realpath, host.identity],
            })
            return request(CudaSpec(
                name=name, key=key, target=f"{checked.vendor}:{'+'.join(checked.archs)}", vendor=checked.vendor,
                archs=checked.archs, output=checked.output, source=checked.source, source_file=source_file,
                invocations=_invocations(base, checked.vendor, checked.archs, checked.output, source_file),
                compiler=compiler, environment=environment,
            ))

        # hipcc's -MM for host and device code at once fails where it bundles the
        # dependency files: a code object is device code alone, so is its pass.
        depends = base if checked.vendor == "cuda" or checked.output == "shared" else (
            *base, "--cuda-device-only", *(f"--offload-arch={a}" for a in checked.archs))
        return Plan(name=name, search=SearchPath.from_argv((*base[1:], *added), environment), finish=finish,
                    dependency_pass=_run.DependencyPass(depends, checked.source, os.path.splitext(source_file)[1],
                                                        environment))


def _refuse_unknown_processors(compiler: Compiler, environment: _run.Environment, archs: tuple[str, ...],
                               name: str) -> None:
    """A ``CompileError`` where the compiler lists the AMD processors it knows and one of
    the architectures is not among them (a target ID's features, ``gfx90a:xnack+``, aside)."""
    known = _compiler.amd_processors(compiler, environment)
    if known is None:
        return
    unknown = [arch for arch in archs if arch.split(":", 1)[0] not in known]
    if unknown:
        family = unknown[0].split(":", 1)[0][:-2]  # gfx942 -> gfx9, gfx1201 -> gfx12
        kin = sorted((p for p in known if p[:-2] == family), key=lambda p: (len(p), p))
        knows = f"of {family} it knows {', '.join(kin)}" if kin else f"it knows no {family} processor"
        raise CompileError(
            f"{compiler.summary} does not know {', '.join(unknown)} ({knows}); a newer ROCm (its hipcc and "
            "Clang) builds for more",
            kernel_name=name, target=f"hip:{'+'.join(archs)}",
            command=f"{compiler.path} --target=amdgcn-amd-amdhsa -nogpulib -print-supported-cpus")


def request(spec: CudaSpec) -> Request:
    return Request(
        backend=spec.vendor,
        key=spec.key,
        name=spec.name,
        target=spec.target,
        fn=_cuda_worker.compile_gpu_code,
        args=(spec,),
        finish=lambda answer: finish(spec, answer),
        encode=CudaBinary.to_bytes,
        decode=CudaBinary.from_bytes,
        size=_size,
        details=record_details,
        features=source_features(spec.source),
    )


def finish(spec: CudaSpec, answer: dict[str, Any]) -> CudaBinary:
    """The parent's last step: the worker's answer -> a ``CudaBinary``."""
    return CudaBinary(
        name=spec.name, key=spec.key, target=spec.target, arch=spec.archs, output=spec.output,
        images=answer["images"], command=answer["command"], compiler=spec.compiler.path,
        compiler_version=spec.compiler.version, compiler_identity=spec.compiler.identity,
        compile_time=answer["compile_time"], stages=tuple(answer["stages"]), diagnostics=answer["diagnostics"],
    )


def _size(binary: CudaBinary) -> int:
    return binary.size


