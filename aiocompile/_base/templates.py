"""The code of Jinja templates, compiled once for aiocompile's processes.

Inductor makes some of its kernel templates as their modules are imported
(``torch/_inductor/kernel/mm_grouped.py``, ``flex/flex_attention.py``: 21 of them in all),
and Jinja compiles each template's Python source with one ``compile()`` call, which holds
the interpreter lock throughout: up to 8.3 ms in a quiet process, 10 to 17 ms beside a
compile on 2 CPUs. In the serving process, the thread that imports what loading a compiled
version needs held the event loop that long.

Jinja leaves a hook for it (``Environment._compile``, "an internal hook that can be
overridden to hook a different compile method in"). :func:`install` wraps it: the code of
a template compiled by one of aiocompile's processes is written to aiocompile's bytecode
directory (:func:`.bytecode.directory`), keyed by the interpreter's magic number, the
template's file name and its source; a later compile of the same template, in any process,
reads it (unmarshalling a template's code takes a fraction of a millisecond). In a fork
server and its workers every compile goes through it (``everywhere``); in the serving
process only those of aiocompile's own threads inside :func:`reading` (the load's imports,
which come after a worker's): the program's own templates are compiled as Jinja would.
A file that cannot be read, or is not a template's code, is compiled again and rewritten.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType
from typing import Any

from aiocompile._base import bytecode, pyc

__all__ = ["install", "reading"]

_local = threading.local()
_lock = threading.Lock()
_state: dict[str, Any] = {"original": None, "everywhere": False}


def install(everywhere: bool = False) -> bool:
    """Wrap Jinja's compile hook in this process, once (``everywhere``: for every thread,
    as in aiocompile's own processes); False where Jinja is not installed or there is no
    bytecode directory."""
    if bytecode.directory() is None:
        return False
    try:
        import jinja2
    except ImportError:
        return False
    with _lock:
        _state["everywhere"] = _state["everywhere"] or everywhere
        if _state["original"] is None:
            _state["original"] = jinja2.Environment._compile
            setattr(jinja2.Environment, "_compile", _compile)  # noqa: B010 - Jinja's hook, replaced on its class
    return True


@contextmanager
def reading() -> Iterator[None]:
    """Templates compiled by this thread meanwhile go through the cache (:func:`install`
    first)."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def _compile(environment: Any, source: str, filename: str) -> CodeType:
    original = _state["original"]
    if not (_state["everywhere"] or getattr(_local, "on", False)):
        return original(environment, source, filename)
    root = bytecode.directory()
    if root is None:
        return original(environment, source, filename)
    key = hashlib.sha256(importlib.util.MAGIC_NUMBER + filename.encode("utf-8", "surrogatepass") + b"\0"
                         + source.encode("utf-8", "surrogatepass")).hexdigest()
    path = os.path.join(root, "templates", key[:2], key + ".code")
    try:
        with open(path, "rb") as file:
            code = marshal.loads(file.read())
        if isinstance(code, CodeType) and code.co_filename == filename:
            return code
    except (OSError, ValueError, EOFError, TypeError):
        pass
    code = original(environment, source, filename)
    pyc.write(path, marshal.dumps(code))  # whole or not at all
    return code
