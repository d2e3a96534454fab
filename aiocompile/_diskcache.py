"""The disk cache: compiled results that outlive the process, shared by processes.

Layout: ``<dir>/<key[:2]>/<key>.aiok``, one file per key, holding the result's own byte
form (for Triton, ``TritonKernel.to_bytes()``: versioned and checksummed).

- A file is written to a temporary name in the same directory and renamed into place, so
  a reader sees a whole file or none, and several processes may write the same key at once
  (the last rename wins; the contents are the same).
- Reading a file touches its modification time; when the directory grows past its bound,
  the files touched longest ago are deleted until it is back under 90% of it.
- Nothing that goes wrong with a file fails a request: a file that cannot be read or does
  not decode is a miss, and the kernel is compiled. Each such file is counted, and each
  cause logged once at WARNING (every file at DEBUG).

What the cache may do with its directory (``access``), decided when it opens:

===========  ============================================================================
read-write   writable: read, write, delete files that do not decode, evict
read-only    not writable here (a directory shipped in an image): read only, and nothing
             is attempted that would fail; a write or delete refused for lack of
             permission moves a read-write cache here too
refused      not a usable directory: nothing is read or written, every kernel is compiled
===========  ============================================================================

All of it runs in the disk cache's own threads, never on an event loop or in the pool's
supervisor thread, but for the few system calls that decide ``access`` where the cache is
made.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

SUFFIX = ".aiok"
READ_WRITE, READ_ONLY, REFUSED = "read-write", "read-only", "refused"

_log = logging.getLogger("aiocompile")
# A write or delete failing with these means that it would fail every time: stop trying.
_NOT_PERMITTED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` atomically: a temporary file in the same directory, renamed into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


class DiskCache:
    """One cache directory: ``load`` and ``store`` by key, under the rules above. Counts
    what it wrote, evicted, and could not use (``corrupt``, ``errors``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._executor = cf.ThreadPoolExecutor(2, thread_name_prefix="aiocompile-disk")
        self._size: int | None = None
        self._warned: set[str] = set()
        self.writes = 0
        self.evictions = 0
        self.corrupt = 0
        self.errors = 0
        self.access = self._open()

    def path(self, key: str) -> Path:
        return self.path_in(self.directory, key)

    @staticmethod
    def path_in(directory: str | os.PathLike[str], key: str) -> Path:
        return Path(directory) / key[:2] / f"{key}{SUFFIX}"

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        return self._executor.submit(fn, *args)

    def close(self, wait: bool = True) -> None:
        """Finish (``wait``) or drop the writes still queued."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def _open(self) -> str:
        where = self.directory
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # it may exist all the same; if it matters, the next step says why
        try:
            st = os.stat(where)
        except OSError as exc:
            _log.warning("cannot use the cache directory %s (%s): nothing is read from it or written to it, "
                         "every kernel is compiled", where, exc.strerror or exc)
            return REFUSED
        if not stat.S_ISDIR(st.st_mode):
            _log.warning("the cache directory %s is not a directory: every kernel is compiled", where)
            return REFUSED
        if os.access(where, os.W_OK | os.X_OK):
            return READ_WRITE
        _log.info("the cache directory %s is read-only here: kernels are read from it, none is added", where)
        return READ_ONLY

    # -- in the disk threads ------------------------------------------------------------------

    def load(self, key: str, decode: Callable[[bytes], Any]) -> tuple[Any, float] | None:
        """The result stored for ``key`` and the seconds decoding it took; None for a miss:
        no file, or one that could not be read or does not decode (counted, and logged).
        Any exception ``decode`` raises makes the file one that does not decode; a result
        whose ``key`` is not ``key`` is another key's."""
        if self.access == REFUSED:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._failed("read", path, exc)
            return None
        started = time.perf_counter()
        try:
            result = decode(data)
            if getattr(result, "key", key) != key:
                raise ValueError("the file holds another key's result")
        except Exception as exc:
            self._reject(path, exc)
            return None
        decoded = time.perf_counter() - started
        if self.access == READ_WRITE:
            try:
                os.utime(path)  # most recently used
            except OSError:
                pass
        return result, decoded

    def store(self, key: str, encode: Callable[[], bytes]) -> None:
        """Queue writing what ``encode()`` returns as the file for ``key``, unless the
        directory is not this process's to write. Never raises: the result was answered
        already, and a copy that cannot be kept is counted and logged, no more."""
        if self.access != READ_WRITE:
            return
        try:
            self._executor.submit(self._store, key, encode)
        except RuntimeError:
            pass  # closed without waiting, or the interpreter is exiting: the copy is lost

    def _store(self, key: str, encode: Callable[[], bytes]) -> None:
        if self.access != READ_WRITE:
            return  # a write refused since this one was queued
        path = self.path(key)
        try:
            data = encode()
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, data)
        except Exception as exc:
            self._failed("write", path, exc)
            return
        with self._lock:
            self.writes += 1
            if self._size is not None:
                self._size += len(data)
            over = self.max_bytes is not None and (self._size is None or self._size > self.max_bytes)
        if over:
            try:
                self.evict()
            except OSError as exc:
                self._failed("write", self.directory, exc)

    def evict(self) -> None:
        """Bring the directory under its bound, least recently used files first."""
        files = []
        total = 0
        for sub in os.scandir(self.directory):
            if not sub.is_dir():
                continue
            for item in os.scandir(sub.path):
                if not item.name.endswith(SUFFIX):
                    continue
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue  # another process evicted it just now
                files.append((st.st_mtime_ns, st.st_size, item.path))
                total += st.st_size
        removed = 0
        if self.max_bytes is not None and total > self.max_bytes:
            goal = int(self.max_bytes * 0.9)
            for _, file_size, file_path in sorted(files):
                if total <= goal or self.access != READ_WRITE:
                    break
                if self._remove(Path(file_path)):
                    removed += 1
                total -= file_size
        with self._lock:
            self._size = total
            self.evictions += removed

    # -- what went wrong ------------------------------------------------------------------------

    def _reject(self, path: Path, exc: BaseException) -> None:
        """The file did not decode: count it and, where the directory is ours to write,
        delete it (the compile that follows writes a good one)."""
        with self._lock:
            self.corrupt += 1
        _log.debug("cache file %s does not decode: %s", path, exc, exc_info=exc)
        self._warn_once("corrupt", "files of the cache directory %s do not decode (the first: %s: %s: %s); "
                        "their kernels are compiled instead", self.directory, path.name, type(exc).__name__, exc)
        if self.access == READ_WRITE:
            self._remove(path)

    def _failed(self, operation: str, path: Path, exc: BaseException) -> None:
        """A read, write or delete failed: count it; one refused for lack of permission
        means the directory is read-only to this process, so stop writing to it."""
        with self._lock:
            self.errors += 1
            stop = (operation != "read" and isinstance(exc, OSError) and exc.errno in _NOT_PERMITTED
                    and self.access == READ_WRITE)
            if stop:
                self.access = READ_ONLY
        _log.debug("cache %s of %s failed: %s", operation, path, exc, exc_info=exc)
        cause = exc.errno if isinstance(exc, OSError) else type(exc).__name__
        then = "nothing more is written to it" if stop else "the kernel is compiled, or not kept, instead"
        self._warn_once(f"{operation}:{cause}", "cannot %s the cache directory %s (the first: %s: %s); %s",
                        "read from" if operation == "read" else "write to", self.directory, path.name, exc, then)

    def _remove(self, path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._failed("delete", path, exc)
            return False

    def _warn_once(self, cause: str, message: str, *args: Any) -> None:
        with self._lock:
            if cause in self._warned:
                return
            self._warned.add(cause)
        _log.warning(message, *args)
