"""Pickling a job for a worker that has not imported the parent's ``__main__``.

Functions and classes are pickled by reference (module and name). Workers never run the
parent's main script, so a reference into ``__main__`` (a script or a notebook cell) cannot
be resolved there: such objects are pickled by value with ``cloudpickle`` when it is
installed, and otherwise refused here, at submit time, with an error that says what to do.

A job whose function is itself defined in ``__main__`` (``run(f, x)`` from a script or a
notebook) is the common case of those, and the same function is sent again and again. Its
by-value pickle is made once and kept beside the function (weakly); a worker keeps the
function it loaded from those bytes, under their digest. For the pool's own workers the
bytes go apart from the job (``dumps_apart``): the job is a call of ``call_defined`` with the
digest as its first argument, and the pool sends each worker a definition once, as it sends
the environment (``Definitions``). For any other executor the job carries the bytes itself
(``dumps``). The kept pickle is made again when the function no longer matches it: another
code object, defaults or closure cells, or a global it refers to bound to another object (a
notebook cell that sets ``scale = 3``). A global object changed in place (an item added to
a dict) after the first send is not seen: as in a worker that imported the script once.
"""

from __future__ import annotations

import collections
import hashlib
import io
import pickle
import types
import weakref
from typing import Any, NamedTuple


class _MainReference(Exception):
    def __init__(self, obj: object) -> None:
        self.obj = obj


class _StrictPickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            raise _MainReference(obj)
        return NotImplemented


Definition = tuple[bytes, bytes]
"""A __main__ function's digest and by-value pickle, sent once to each worker that runs it."""


def dumps(obj: object) -> bytes:
    """Pickle ``obj`` for a worker. Raises ``TypeError`` if that cannot be done."""
    return _dumps(obj, apart=False)[0]


def dumps_apart(obj: object, buffers: list[pickle.PickleBuffer] | None = None) -> tuple[bytes, Definition | None]:
    """``dumps`` for the pool's own workers: a job whose function is from __main__ names it
    by digest, and its definition comes back apart, for the pool to send each worker once
    (``Definitions``); None for every other job. With ``buffers``, the large values that
    offer themselves out of band (:func:`out_of_band`) are appended there rather than
    copied into the pickle, to be sent beside it."""
    return _dumps(obj, apart=True, buffers=buffers)


OUT_OF_BAND_MIN = 256 * 1024
"""The smallest value :func:`out_of_band` offers as a buffer of its own."""


def out_of_band(data: bytes | memoryview) -> Any:
    """``data`` as a class's ``__reduce_ex__`` gives it for pickle protocol 5: a large value
    becomes a buffer, which the pool's own jobs carry beside their pickle, uncopied (a
    model's weights: copying them into the pickle held the interpreter lock 14 ms for 30
    MB); pickled any other way it is copied in as usual; a small one is ``bytes``.
    :func:`as_bytes` takes it back."""
    if type(data) is bytes:
        return pickle.PickleBuffer(data) if len(data) >= OUT_OF_BAND_MIN else data
    return pickle.PickleBuffer(data) if memoryview(data).nbytes >= OUT_OF_BAND_MIN else bytes(data)


def as_bytes(data: Any) -> bytes:
    """What :func:`out_of_band` was given, as ``bytes`` again (in a worker, a copy of the
    received buffer)."""
    return data if type(data) is bytes else bytes(data)


def _dumps(obj: object, *, apart: bool,
           buffers: list[pickle.PickleBuffer] | None = None) -> tuple[bytes, Definition | None]:
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is types.FunctionType \
            and obj[0].__module__ == "__main__":
        shipped = _with_main_function_kept(obj, apart, buffers)
        return shipped if shipped is not None else (_dumps_carefully(obj), None)
    return _dumps_plain(obj, buffers), None


def _dumps_plain(obj: object, buffers: list[pickle.PickleBuffer] | None = None) -> bytes:
    # The C pickler alone first: the Python-level hook below costs a call per pickled
    # object, and most jobs refer to nothing in __main__. A reference to __main__ would
    # show in the bytes as its name; such bytes (or any failure) take the careful way.
    # (The careful way copies every value into the pickle: it is rare.)
    try:
        fast = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL,
                            buffer_callback=None if buffers is None else buffers.append)
    except Exception:
        pass
    else:
        if b"__main__" not in fast:
            return fast
        # The name may be data (a pickle carried as a bytes value: a background compile's
        # model): look at the objects themselves, writing nowhere, and keep these bytes if
        # none is from __main__. Pickling again into a buffer copied every large value a
        # second time, holding the interpreter lock (a model's weights: 10 to 24 ms).
        try:
            _StrictPickler(_Nowhere(), protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=_elsewhere).dump(obj)
        except Exception:  # noqa: BLE001 - a reference to __main__ (or any failure): the careful way
            pass
        else:
            return fast
    if buffers:
        buffers.clear()  # the careful way keeps every value in the pickle
    return _dumps_carefully(obj)


def _elsewhere(buffer: pickle.PickleBuffer) -> None:
    """A pickler's ``buffer_callback`` that keeps nothing: the buffer is out of band."""


class _Nowhere:
    """A file that keeps nothing: a pickler hands a large value to ``write`` as it is,
    uncopied."""

    @staticmethod
    def write(data: Any) -> int:
        return len(data)


def _dumps_carefully(obj: object) -> bytes:
    buffer = io.BytesIO()
    try:
        _StrictPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()
    except _MainReference as ref:
        main_obj = ref.obj
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"the job cannot be sent to a worker process: {exc}") from exc
    try:
        import cloudpickle
    except ImportError:
        name = getattr(main_obj, "__qualname__", repr(main_obj))
        raise TypeError(
            f"{name!r} is defined in __main__ (a script or a notebook cell), which worker "
            "processes do not import; move it into an importable module, or install "
            "cloudpickle to send it by value"
        ) from None
    try:
        data: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"the job cannot be sent to a worker process: {exc}") from exc
    return data


# --- a function from __main__, pickled by value once --------------------------------------

_MISSING = object()
# Argument types that cannot refer to __main__: such arguments need no look.
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), complex})


class _Kept(NamedTuple):
    """A __main__ function's by-value pickle, and what it was made from."""

    code: types.CodeType
    defaults: tuple[Any, ...] | None
    kwdefaults: dict[str, Any] | None
    cells: tuple[Any, ...]
    globals: tuple[tuple[str, Any], ...]
    digest: bytes
    blob: bytes

    def matches(self, fn: types.FunctionType) -> bool:
        # Looked at on every run() of the function: loops only where there is something
        # to look at (most such functions close over nothing).
        if fn.__code__ is not self.code or fn.__defaults__ is not self.defaults \
                or fn.__kwdefaults__ is not self.kwdefaults:
            return False
        if self.cells and not all(now is then for now, then in zip(_cells(fn), self.cells, strict=True)):
            return False
        if self.globals:
            namespace = fn.__globals__
            for name, value in self.globals:
                if namespace.get(name, _MISSING) is not value:
                    return False
        return True


class _ByDigest:
    """Pickles as a call that finds the function in the worker's memory, or loads it."""

    __slots__ = ("kept",)

    def __init__(self, kept: _Kept) -> None:
        self.kept = kept

    def __reduce__(self) -> tuple[Any, tuple[bytes, bytes]]:
        return load_main_function, (self.kept.digest, self.kept.blob)


_kept: weakref.WeakKeyDictionary[types.FunctionType, _Kept] = weakref.WeakKeyDictionary()


def _with_main_function_kept(obj: object, apart: bool,
                             buffers: list[pickle.PickleBuffer] | None = None) -> tuple[bytes, Definition] | None:
    """``obj`` pickled with its __main__ function sent through the kept pickle, and the
    function's definition; None where ``obj`` is not a job of that kind (or refers to
    __main__ elsewhere too). ``apart``: the job names the function by digest alone, for a
    worker sent the definition apart; else it carries the pickle, loaded once per worker."""
    if not (isinstance(obj, tuple) and len(obj) == 3):
        return None
    fn, args, kwargs = obj
    if not (isinstance(fn, types.FunctionType) and fn.__module__ == "__main__"):
        return None
    if not (all(type(arg) in _PLAIN for arg in args) and all(type(arg) in _PLAIN for arg in kwargs.values())):
        try:
            rest = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=_elsewhere)
        except Exception:
            return None
        if b"__main__" in rest:
            return None
    kept = _kept.get(fn)
    if kept is None or not kept.matches(fn):
        try:
            import cloudpickle
        except ImportError:
            return None
        code = fn.__code__
        try:
            blob = cloudpickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return None
        namespace = fn.__globals__
        names = sorted(name for name in _global_names(code) if name in namespace)
        kept = _Kept(code, fn.__defaults__, fn.__kwdefaults__, _cells(fn),
                     tuple((name, namespace[name]) for name in names),
                     hashlib.blake2b(blob, digest_size=16).digest(), blob)
        _kept[fn] = kept
    if apart:
        # The job is a call of ``call_defined``, pickled by reference, with the digest as
        # its first argument: no Python-level reduce on each job's way.
        job: tuple[Any, tuple[Any, ...], dict[str, Any]] = (call_defined, (kept.digest, *args), kwargs)
    else:
        job = (_ByDigest(kept), args, kwargs)
    return pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL,
                        buffer_callback=None if buffers is None else buffers.append), (kept.digest, kept.blob)


def _cells(fn: types.FunctionType) -> tuple[Any, ...]:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            values.append(_MISSING)
    return tuple(values)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


# In a worker: the functions loaded from kept pickles, by digest, the newest last.
_loaded: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
_LOADED_MAX = 256


def load_main_function(digest: bytes, blob: bytes) -> Any:
    """The function that ``blob`` holds: loaded once per worker, then found by digest."""
    fn = _loaded.get(digest)
    if fn is None:
        fn = pickle.loads(blob)
        _loaded[digest] = fn
        if len(_loaded) > _LOADED_MAX:
            _loaded.popitem(last=False)
    return fn


# In a worker of the pool: the definitions it was sent, by digest, in the order they came.
# The pool keeps the same list for it (``Definitions``), so neither side needs to ask.
DEFINED_MAX = 256
_defined: collections.OrderedDict[bytes, Any] = collections.OrderedDict()


class _Undefinable:
    """A definition that could not be loaded: each job that names it fails with why."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def define(digest: bytes, blob: bytes) -> None:
    """Keep the function that ``blob`` holds under ``digest`` (in a worker, before the job
    that came with it), forgetting the oldest beyond ``DEFINED_MAX`` as the pool does."""
    try:
        _defined[digest] = pickle.loads(blob)
    except Exception as exc:  # noqa: BLE001 - the jobs that name it fail with it
        _defined[digest] = _Undefinable(exc)
    while len(_defined) > DEFINED_MAX:
        _defined.popitem(last=False)


def call_defined(digest: bytes, /, *args: Any, **kwargs: Any) -> Any:
    """Call the function defined under ``digest`` (a job ``dumps_apart`` made)."""
    return defined_function(digest)(*args, **kwargs)


def defined_function(digest: bytes) -> Any:
    """The function defined under ``digest`` (``define``)."""
    fn = _defined.get(digest)
    if fn is None:  # pragma: no cover - the pool sends each definition before its first job
        raise RuntimeError("the job's function was not sent to this worker")
    if isinstance(fn, _Undefinable):
        raise fn.error
    return fn


class Definitions:
    """What one worker has been sent, in the parent: the digests, oldest first, bounded
    as the worker bounds them, so that both sides forget the same ones."""

    __slots__ = ("_digests",)

    def __init__(self) -> None:
        self._digests: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def to_send(self, definition: Definition | None) -> Definition | None:
        """``definition`` if the worker has yet to be sent it (noting that it will be),
        else None."""
        if definition is None or (definition[0] in self._digests):
            return None
        self._digests[definition[0]] = None
        while len(self._digests) > DEFINED_MAX:
            self._digests.popitem(last=False)
        return definition
