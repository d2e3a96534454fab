"""The C++ backend: ``compile_cpp`` arguments -> a shared library built in a worker ->
a ``NativeLibrary``.

The command line, run in a scratch directory of the worker::

    CXX -shared -fPIC -pipe -I<include_dirs>... FLAGS... -o libsource.so source.cpp LIBRARIES... -MMD -MF source.d

The key covers what the library is made of: the source, the flags (response files
expanded), the include directories, the libraries (and the contents of those given as
files, or found by ``-l`` in a ``-L`` directory or ``LIBRARY_PATH``), the contents of every
other file the flags name (linker and version scripts, objects, archives...), the
compiler's environment variables (``CPATH``... see ``_native._compiler.ENVIRONMENT``), the
compiler (its path, identity and version, see ``_native._compiler``) and the contents of
every header the source reads from its include directories (see ``_native._headers``,
``_native._inputs``). Relative paths (include directories, libraries, paths in
``-I``/``-L``/``-include`` flags, files among the flags, paths in response files) are taken
relative to the caller's current directory and made absolute here.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from aiocompile._base import checks
from aiocompile.backends import Request, source_features
from aiocompile.backends._native import _compiler, _run
from aiocompile.backends._native._backend import NativeBackend, Plan, key_of, record_details
from aiocompile.backends._native._compiler import Compiler
from aiocompile.backends._native._headers import Scan, SearchPath, absolute_paths
from aiocompile.backends._native._inputs import expand_response_files, named_files
from aiocompile.backends.cpp import _worker as _cpp_worker
from aiocompile.backends.cpp._library import NativeLibrary

__all__ = ["CppBackend", "CppSpec"]

_FORMAT = 2
"""Part of every key: raised when the command line built here changes (2: response files
expanded, the compiler's environment carried)."""


@dataclass(frozen=True)
class CppSpec:
    """Everything a worker needs to build one library."""

    name: str
    key: str
    target: str
    source: str
    argv: tuple[str, ...]
    compiler: Compiler
    flags: tuple[str, ...]
    include_dirs: tuple[str, ...]
    libraries: tuple[str, ...]
    environment: _run.Environment = ()
    """The compiler's environment variables as keyed (see ``_native._compiler.environment``)."""


@dataclass(frozen=True)
class _Checked:
    source: str
    flags: tuple[str, ...]
    include_dirs: tuple[str, ...]
    libraries: tuple[str, ...]
    compiler: str | None
    name: str | None


def _library_argument(library: str) -> tuple[str, bool]:
    """How ``library`` goes on the command line, and whether it is a file (whose
    contents are keyed): ``m`` -> ``-lm``; ``-lfoo`` as it is; a path made absolute."""
    if library.startswith("-"):
        return library, False
    if os.sep in library or library.endswith((".so", ".a", ".o")) or ".so." in library:
        return os.path.abspath(library), True
    return f"-l{library}", False


class CppBackend(NativeBackend):
    """The C++ backend's state in one scheduler: what it knows of the headers it read."""

    kind = "cpp"
    fields = frozenset({"source", "flags", "include_dirs", "libraries", "compiler", "name"})

    def check(self, *, source: Any = None, flags: Any = (), include_dirs: Any = (), libraries: Any = (),
              compiler: Any = None, name: Any = None) -> _Checked:
        return _Checked(
            source=checks.SOURCE.check("source", source),
            flags=checks.NATIVE_FLAGS.check("flags", flags),
            include_dirs=checks.INCLUDE_DIRS.check("include_dirs", include_dirs),
            libraries=checks.LIBRARIES.check("libraries", libraries),
            compiler=checks.COMPILER.check("compiler", compiler),
            name=checks.NATIVE_NAME.check("name", name),
        )

    def plan(self, checked: _Checked) -> Plan:
        compiler = _compiler.identify(_compiler.find("cpp", checked.compiler))
        cwd = os.getcwd()
        environment = _compiler.environment(cwd)
        include_dirs = tuple(os.path.normpath(os.path.join(cwd, d)) for d in checked.include_dirs)
        libraries, library_files = [], []
        for library in checked.libraries:
            argument, is_file = _library_argument(library)
            libraries.append(argument)
            if is_file:
                library_files.append([argument, self.headers.digest(argument)])
        inputs = named_files(absolute_paths(expand_response_files(checked.flags, cwd), cwd), cwd, self.headers,
                             driver=True, libraries=libraries, library_path=dict(environment)["LIBRARY_PATH"])
        flags = inputs.flags
        search_argv = (*(f"-I{d}" for d in include_dirs), *flags)
        source_digest = hashlib.sha256(checked.source.encode("utf-8", errors="surrogatepass")).hexdigest()
        name = checked.name or f"cpp-{source_digest[:12]}"

        def finish(scan: Scan) -> Request:
            key = key_of({
                "kind": "cpp", "format": _FORMAT, "source": source_digest, "flags": flags,
                "include_dirs": include_dirs, "libraries": libraries, "library_files": library_files,
                "files": inputs.files, "environment": environment, "headers": scan.headers,
                "compiler": [compiler.path, compiler.realpath, compiler.identity],
            })
            argv = (compiler.path, "-shared", "-fPIC", "-pipe", *search_argv, "-o", _cpp_worker.OUTPUT,
                    _cpp_worker.SOURCE, *libraries, "-MMD", "-MF", _cpp_worker.DEPENDENCIES)
            return request(CppSpec(
                name=name, key=key, target=compiler.machine or "host", source=checked.source, argv=argv,
                compiler=compiler, flags=flags, include_dirs=include_dirs, libraries=tuple(libraries),
                environment=environment,
            ))

        return Plan(name=name, search=SearchPath.from_argv(search_argv, environment), finish=finish,
                    dependency_pass=_run.DependencyPass((compiler.path, *search_argv), checked.source, ".cpp",
                                                        environment))


def request(spec: CppSpec) -> Request:
    return Request(
        backend="cpp",
        key=spec.key,
        name=spec.name,
        target=spec.target,
        fn=_cpp_worker.compile_library,
        args=(spec,),
        finish=lambda answer: finish(spec, answer),
        encode=NativeLibrary.to_bytes,
        decode=NativeLibrary.from_bytes,
        size=_size,
        details=record_details,
        features=source_features(spec.source),
    )


def finish(spec: CppSpec, answer: dict[str, Any]) -> NativeLibrary:
    """The parent's last step: the worker's answer -> a ``NativeLibrary``."""
    return NativeLibrary(
        name=spec.name, key=spec.key, target=spec.target, binary=answer["binary"], command=answer["command"],
        compiler=spec.compiler.path, compiler_version=spec.compiler.version,
        compiler_identity=spec.compiler.identity, compile_time=answer["compile_time"],
        stages=tuple(answer["stages"]), diagnostics=answer["diagnostics"],
        dependencies=tuple(answer["dependencies"]), flags=spec.flags, include_dirs=spec.include_dirs,
        libraries=spec.libraries,
    )


def _size(library: NativeLibrary) -> int:
    return library.size


