"""The disk cache: compiled results that outlive the process, shared by processes.

Layout: ``<dir>/<key[:2]>/<key>.aiok``, one file per key, holding the result's own byte
form (for Triton, ``TritonKernel.to_bytes()``: versioned and checksummed).

- A file is written to a temporary name in the same directory and renamed into place, so
  a reader sees a whole file or none, and several processes may write the same key at once
  (the last rename wins; the contents are the same).
- A file that does not decode (truncated, corrupted, another format version) is deleted
  and reported as a miss: it is recompiled, never loaded.
- Reading a file touches its modification time; when the directory grows past its bound,
  the files touched longest ago are deleted until it is back under 90% of it.

All of it runs in the disk cache's own threads, never on an event loop or in the pool's
supervisor thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

SUFFIX = ".aiok"


class DiskCache:
    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._executor = cf.ThreadPoolExecutor(2, thread_name_prefix="aiocompile-disk")
        self._size: int | None = None
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.evictions = 0
        self.corrupt = 0

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

    # -- in the disk threads ------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            with self._lock:
                self.misses += 1
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        with self._lock:
            self.hits += 1
        return data

    def reject(self, key: str) -> None:
        """The bytes read for ``key`` did not decode: delete the file, count it."""
        with self._lock:
            self.hits -= 1
            self.misses += 1
            self.corrupt += 1
        self._remove(self.path(key))

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)
        except OSError:
            self._remove(temporary)
            raise
        with self._lock:
            self.writes += 1
            if self._size is not None:
                self._size += len(data)
            over = self.max_bytes is not None and (self._size is None or self._size > self.max_bytes)
        if over:
            self.evict()

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
                    stat = item.stat()
                except FileNotFoundError:
                    continue  # another process evicted it just now
                files.append((stat.st_mtime_ns, stat.st_size, item.path))
                total += stat.st_size
        removed = 0
        if self.max_bytes is not None and total > self.max_bytes:
            goal = int(self.max_bytes * 0.9)
            for _, file_size, file_path in sorted(files):
                if total <= goal:
                    break
                if self._remove(Path(file_path)):
                    removed += 1
                total -= file_size
        with self._lock:
            self._size = total
            self.evictions += removed

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
