"""The Python modules of a compiled graph (Inductor's wrapper and its kernels' modules),
compiled to code objects in the worker, so that the serving process's load runs them
rather than compiling their source.

Inductor loads each of those modules by compiling its source (``compile()``), one call of
C that holds the interpreter lock throughout: for GPT-2's wrapper on a GPU host, 12 ms in
which the serving process's event loop could not run. The worker has compiled and loaded
the same sources; :func:`collect` gives the code of those it loaded during a job, by the
digest of their source, as ``marshal`` bytes (worker and serving process run one
interpreter). :func:`used` makes Inductor's loader, while a load runs here, take the code
whose digest matches a module's source, unmarshalled (a fraction of the compile), and
compile any other source as before; its file name is the module's path here.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import hashlib
import marshal
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["collect", "mark", "used"]


def mark() -> int:
    """Where the modules a job loads from now on begin (in the worker)."""
    from torch._inductor.codecache import PyCodeCache

    return len(PyCodeCache.modules)


def collect(since: int) -> dict[bytes, bytes]:
    """The code of the modules Inductor loaded in this process since ``mark()`` answered
    ``since``, marshalled, by their source's digest (in the worker). A module loaded
    before (the same kernel in an earlier job) is not among them: the serving process
    compiles it, as it would without this."""
    from torch._inductor.codecache import PyCodeCache

    codes = {}
    for module in PyCodeCache.modules[since:]:
        path = getattr(module, "__file__", None)
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError:
            continue
        codes[_digest(source)] = marshal.dumps(compile(source, path, "exec", dont_inherit=True))
    return codes


def _digest(source: bytes) -> bytes:
    return hashlib.blake2b(source, digest_size=20).digest()


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the loader is used only once installed")


class _Loader:
    """Inductor's module loader while loads with codes run, shared by them: installed by
    the first, given back by the last (other threads' loads keep compiling what has no
    code; a load that began inside ends with Inductor's own, kept)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: dict[bytes, bytes] = {}
        self.users = 0
        self.original: Callable[..., Any] = _unset

    def load(self, key: str, path: str, *args: Any, **kwargs: Any) -> types.ModuleType:
        from torch._inductor.runtime import compile_tasks

        with open(path, "rb") as f:
            code = self.codes.get(_digest(f.read()))
        if code is None:
            return self.original(key, path, *args, **kwargs)
        # As Inductor's own loader makes the module, from the worker's code.
        module = types.ModuleType(f"{compile_tasks.__name__}.{key}")
        module.__file__ = path
        module.key = key  # type: ignore[attr-defined]
        exec(_refiled(marshal.loads(code), path), module.__dict__, module.__dict__)  # noqa: S102
        if kwargs.get("set_sys_modules", args[0] if args else True):
            sys.modules[module.__name__] = module
        return module


_LOADER = _Loader()


@contextmanager
def used(codes: Mapping[bytes, bytes]) -> Iterator[None]:
    """Inductor's loads in this process use ``codes`` (``collect``'s) while inside."""
    if not codes:
        yield
        return
    from torch._inductor import codecache

    if not callable(getattr(codecache, "_reload_python_module", None)):
        yield  # a torch that loads its modules another way: they are compiled here
        return
    with _LOADER.lock:
        if _LOADER.users == 0:
            _LOADER.original = codecache._reload_python_module
            codecache._reload_python_module = _LOADER.load
        _LOADER.users += 1
        _LOADER.codes.update(codes)
    try:
        yield
    finally:
        with _LOADER.lock:
            _LOADER.users -= 1
            if _LOADER.users == 0 and codecache._reload_python_module == _LOADER.load:
                codecache._reload_python_module = _LOADER.original
                _LOADER.codes.clear()


def _refiled(code: types.CodeType, path: str) -> types.CodeType:
    """``code`` with ``path`` as its file, its nested functions' too (the worker's cache
    directory may be another than this process's)."""
    if code.co_filename == path:
        return code
    consts = tuple(_refiled(const, path) if isinstance(const, types.CodeType) else const
                   for const in code.co_consts)
    return code.replace(co_filename=path, co_consts=consts)
