"""The disk cache: compiled results that outlive the process, shared by processes.

Layout: ``<dir>/<key[:2]>/<key>.aiok``, one file per key, holding the result's own byte
form (for Triton, ``TritonKernel.to_bytes()``: versioned and checksummed), sealed
(``sealed``) when a secret is set.

- A file is written to a temporary name and renamed into place: a reader sees a whole
  file or none, and processes may write one key at once. Directories are 0700 and files
  0600, whatever the umask: they hold code this process will run.
- Reading a file touches its modification time; when the directory grows past its bound,
  the files touched longest ago are deleted until it is back under 90% of it.
- Nothing that goes wrong with a file fails a request: a file that cannot be read, is not
  trusted or does not decode is a miss, and the kernel is compiled; each is counted, each
  cause logged once at WARNING.
- Trust: a file read here becomes code that runs on the GPU. So the directory and each
  file (regular, no link) must be this user's or root's and writable by no one else; or,
  with a secret (``cache_key``), a file loads only if its seal verifies.
- Size: an entry is read whole (its seal covers all of it, and what is decoded must be
  what was verified), so no file larger than the largest entry kept here
  (``largest_entry``) is read, and no larger result written: whoever can write the
  directory could otherwise make every read of a key allocate as much as they like. With
  a secret, a file without an envelope is refused after its first bytes.

What the cache may do with its directory (``access``), decided when it opens:

===========  ============================================================================
read-write   trusted and writable: read, write, delete files that do not decode, evict
read-only    trusted but not writable here (a directory shipped in an image): read only,
             and nothing is attempted that would fail; a write or delete refused for lack
             of permission moves a read-write cache here too
signed-only  not trusted, but a secret is set: sealed files are read, nothing is written
refused      not trusted and no secret, or not a usable directory: nothing is read or
             written, every kernel is compiled
===========  ============================================================================

All of it runs in the disk cache's own threads, but for the few system calls that decide
``access`` where the cache is made.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

from aiocompile._base.config import CACHE_DIR_ENTRY_BYTES
from aiocompile._cache.sealed import MAGIC, BadSeal, NotSealed, Undecodable, looks_sealed, open_entry, wrap

SUFFIX = ".aiok"
READ_WRITE, READ_ONLY, SIGNED_ONLY, REFUSED = "read-write", "read-only", "signed-only", "refused"

_log = logging.getLogger("aiocompile")
# A write or delete failing with these means that it would fail every time: stop trying.
_NOT_PERMITTED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class _Untrusted(Exception):
    """A file or directory the cache does not trust; ``kind`` names the cause."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def _too_large(size: int, limit: int) -> _Untrusted:
    return _Untrusted("size", f"{size} bytes, larger than the largest entry kept here ({limit} bytes)")


def untrusted(st: os.stat_result) -> _Untrusted | None:
    """Why a file or directory with this status may not be trusted, or None if it may."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return _Untrusted("owner", f"owned by uid {st.st_uid}, neither this user (uid {me}) nor root")
    if st.st_mode & 0o022:
        return _Untrusted("mode", f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def make_private_dir(path: Path) -> bool:
    """Create the directory ``path`` 0700 whatever the umask (its missing parents as
    ``mkdir -p`` would); returns whether it was created here."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return False
    os.chmod(path, 0o700)  # the umask may have taken bits away
    return True


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` as a 0600 file whatever the umask, atomically: a temporary file in
    the same directory, renamed into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o600)  # the umask may have taken bits away
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
    what it wrote, evicted, and could not use (``corrupt``, ``refused``, ``errors``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int | None = None,
        secret: bytes | str | None = None,
        max_entry: int = CACHE_DIR_ENTRY_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.largest_entry = max_entry if max_bytes is None else min(max_entry, max_bytes)
        """No file larger than this is read, and no larger result written."""
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._lock = threading.Lock()
        self._executor = cf.ThreadPoolExecutor(2, thread_name_prefix="aiocompile-disk")
        self._size: int | None = None
        self._trusted_dirs: set[str] = set()
        self._warned: set[str] = set()
        self.writes = 0
        self.evictions = 0
        self.corrupt = 0
        self.refused = 0
        self.errors = 0
        self.access = self._open()

    @property
    def trusted(self) -> bool:
        """The directory passed the ownership test (its files may be read unsealed)."""
        return self.access in (READ_WRITE, READ_ONLY)

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
            make_private_dir(where)
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
        distrust = untrusted(st)
        if distrust is None:
            if os.access(where, os.W_OK | os.X_OK):
                return READ_WRITE
            _log.info("the cache directory %s is read-only here: kernels are read from it, none is added", where)
            return READ_ONLY
        if self._secret is not None:
            _log.info("the cache directory %s is %s: only entries signed with the cache key are read from it, "
                      "and nothing is written to it", where, distrust)
            return SIGNED_ONLY
        _log.warning("refusing the cache directory %s: it is %s, so anyone able to write to it could plant kernels. "
                     "Nothing is read from it or written to it; every kernel is compiled. Use a directory owned by "
                     "this user or root and not writable by group or others (chmod go-w), or sign its entries "
                     "(cache_key, AIOCOMPILE_CACHE_KEY)", where, distrust)
        return REFUSED

    # -- in the disk threads ------------------------------------------------------------------

    def load(self, key: str, decode: Callable[[bytes], Any]) -> tuple[Any, float] | None:
        """The result stored for ``key`` and the seconds decoding it took; None for a miss:
        no file, or one that could not be read, is not trusted or does not decode (counted,
        and logged). Any exception ``decode`` raises makes the file one that does not
        decode; a result whose ``key`` is not ``key`` is another key's."""
        if self.access == REFUSED:
            return None
        path = self.path(key)
        try:
            blob = self._read(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except _Untrusted as exc:
            self._refuse(path, exc)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                self._refuse(path, _Untrusted("link", "a symbolic link"))
            else:
                self._failed("read", path, exc)
            return None
        try:
            result, decoded = open_entry(blob, self._secret, key, decode)
        except NotSealed:
            self._refuse(path, _Untrusted("unsigned", "not signed, and a cache key is set"))
            return None
        except BadSeal as exc:
            if self._secret is None:
                self._reject(path, exc)  # a damaged envelope, nothing to verify: damage
            else:
                self._refuse(path, _Untrusted("signature", str(exc)))
            return None
        except Undecodable as exc:
            self._reject(path, exc.__cause__ or exc)
            return None
        if self.access == READ_WRITE:
            try:
                os.utime(path)  # most recently used
            except OSError:
                pass
        return result, decoded

    def _read(self, path: Path) -> bytes:
        # Opened without following a link, and without waiting for a writer should it be a
        # FIFO; then the very file opened is checked, not whatever the name points to later.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            # Checked before a file object is made of it: Python's refuses a directory
            # with an error, and a directory in an entry's place is untrusted, not a
            # failing disk.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Untrusted("not-a-file", "not a regular file")
            if self._secret is None:
                self._check_dir(path.parent)
                distrust = untrusted(st)
                if distrust is not None:
                    raise distrust
            limit = self.largest_entry
            if st.st_size > limit:
                raise _too_large(st.st_size, limit)
            if self._secret is not None and not looks_sealed(os.pread(fd, len(MAGIC), 0)):
                raise _Untrusted("unsigned", "not signed, and a cache key is set")
            with open(fd, "rb", closefd=False) as f:
                # One byte more than measured: an entry is written whole and renamed into
                # place, so one that grows meanwhile is someone else's doing.
                blob = f.read(st.st_size + 1)
            if len(blob) > st.st_size:
                raise _Untrusted("size", "it grew while it was read")
            return blob
        finally:
            os.close(fd)

    def _check_dir(self, directory: Path) -> None:
        # Once per directory: nobody but this user and root can change a directory that
        # passed, nor the trusted directory it is in.
        name = str(directory)
        with self._lock:
            if name in self._trusted_dirs:
                return
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise _Untrusted("not-a-directory", "in a subdirectory that is not a directory")
        distrust = untrusted(st)
        if distrust is not None:
            raise _Untrusted(distrust.kind, f"in a subdirectory {distrust}")
        with self._lock:
            self._trusted_dirs.add(name)

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
            data = wrap(encode(), self._secret, key)
            if len(data) > self.largest_entry:
                # It would never be read back (see ``_read``).
                self._warn_once("too-large", "results larger than %s bytes are not kept in the cache directory %s "
                                "(cache_dir_entry_bytes; the first: %s, %s bytes)", self.largest_entry,
                                self.directory, path.name, len(data))
                return
            if not make_private_dir(path.parent) and self._secret is None:
                self._check_dir(path.parent)  # no use writing a file nobody would read
            try:
                write_private(path, data)
            except IsADirectoryError as exc:
                # A directory in the entry's place, which a rename cannot replace: it is
                # nobody's entry (and was refused on reading), so it goes, as a file that
                # does not decode would; then the write is tried again.
                _log.debug("removing the directory %s in a cache entry's place", path)
                try:
                    shutil.rmtree(path)
                except OSError:
                    # Counted as the failed write it is: one subdirectory that cannot be
                    # emptied says nothing of the cache directory's own permissions.
                    raise exc from None
                write_private(path, data)
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
            if not sub.is_dir(follow_symlinks=False):
                continue
            for item in os.scandir(sub.path):
                if not item.name.endswith(SUFFIX):
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
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

    def _refuse(self, path: Path, exc: _Untrusted) -> None:
        """The file is not trusted: count it, leave it alone (it may be someone else's)."""
        with self._lock:
            self.refused += 1
        _log.debug("cache file %s is not trusted: %s", path, exc)
        self._warn_once(f"refused:{exc.kind}", "files of the cache directory %s are not trusted and not loaded "
                        "(the first: %s, %s); their kernels are compiled instead", self.directory, path.name, exc)

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
