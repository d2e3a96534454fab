"""The shared cache: compiled results in a Redis server, shared by a fleet of machines.

A tier behind the memory cache and ``cache_dir``: read when both miss, before compiling;
written after a compile (and a hit here is written to ``cache_dir`` too). Entries are what
the disk cache's files hold (``sealed``), under ``aiocompile:<key>``: with a secret, an
entry not sealed with it is never loaded, whoever wrote it; without one, anyone able to
write to the server can plant kernels, and the scheduler says so once. An entry lives
``ttl`` seconds after its last write or read; one larger than ``max_entry`` is not written.

The server being down, slow or flapping never fails a compile and never holds one up for
long: every command has a short ``timeout`` (connecting too), redis-py's own retries are
off, and a circuit breaker (``breaker``) stops asking a server that failed several times
in a row, for ``retry_after`` seconds at a time. What cannot be read is a miss; what
cannot be written is left out. Each failure is counted (``statistics().shared_errors``)
and each kind logged once at WARNING.

A read waits for one of the cache's threads, and a server that accepts connections but
never answers holds each thread for a whole ``timeout``. So a read never waits behind
many: at most ``_MAX_QUEUED_READS`` wait (more are misses at once), and the moment the
breaker opens every read still waiting, or still in a thread, is answered a miss (the
thread's late answer is dropped). Reads are counted once each: a hit, a miss, an error, a
damaged or refused entry, or skipped (never asked, or answered before the server did).

All of it runs in the cache's own threads with the synchronous client, never on an event
loop: the request path continues from whichever thread finishes a step, for callers of any
event loop (asyncio, uvloop, trio, several at once) and of none (Inductor's synchronous
compiles). ``redis.asyncio`` ties its connections to one asyncio loop, and would serve
neither trio nor the rest.

The cost history of ``_core.costs`` is kept here too, so that a fresh build machine starts with
the fleet's (``read_costs``, ``write_costs``): a hash ``aiocompile:costs`` of one JSON entry
per compile key, bounded to the newest entries, living ``ttl`` seconds after its last
write. It is read and written from the caller's thread, outside the request path, and
counts in none of the statistics above: a server that fails it is only logged (at DEBUG),
and one left alone by the breaker is not asked.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import json
import logging
import threading
import urllib.parse
from typing import Any, Callable

from aiocompile._cache.breaker import Breaker
from aiocompile._cache.sealed import BadSeal, NotSealed, Undecodable, open_entry, wrap

PREFIX = "aiocompile:"
COSTS = PREFIX + "costs"
_log = logging.getLogger("aiocompile")
# Writes queued beyond this many are dropped: a slow server must not make memory grow.
_MAX_QUEUED_WRITES = 64
# Reads waiting for a thread beyond this many are misses at once: behind a server that
# answers each read just within its timeout, the last would otherwise wait
# (queued / threads) timeouts before its compile could even be queued.
_MAX_QUEUED_READS = 64
_THREADS = 4


class _Found(enum.Enum):
    """What a read of an entry came to: the counter it adds to."""

    HIT = "hits"
    MISS = "misses"
    ERROR = "errors"
    CORRUPT = "corrupt"
    REFUSED = "refused"


class _Read:
    """One lookup, from ``lookup()`` until it is answered: by the thread that reads it, or
    at once by the breaker opening (whichever comes first; the other does nothing)."""

    __slots__ = ("key", "decode", "future")

    def __init__(self, key: str, decode: Callable[[bytes], Any]) -> None:
        self.key = key
        self.decode = decode
        self.future: cf.Future[tuple[Any, float] | None] = cf.Future()


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


class SharedCache:
    """One Redis server as a cache tier: ``lookup`` and ``store`` by key, under the rules
    above. Counts hits, misses, writes, and what it could not do or use."""

    def __init__(
        self,
        url: str,
        *,
        ttl: float | None,
        max_entry: int | None,
        timeout: float,
        retry_after: float,
        secret: bytes | str | None = None,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ImportError("cache_url needs the redis package: pip install 'aiocompile[redis]'") from exc
        self.url = redact(url)
        self._errors_class = redis.RedisError
        self._response_error = redis.ResponseError
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False, health_check_interval=0)
        self._ttl = None if ttl is None else max(1, int(round(ttl)))
        self._max_entry = max_entry
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._breaker = Breaker(failures=3, cooldown=retry_after)
        self._executor = cf.ThreadPoolExecutor(_THREADS, thread_name_prefix="aiocompile-shared")
        self._lock = threading.Lock()
        self._getex = self._ttl is not None
        self._queued_writes = 0
        self._queued_reads = 0
        self._unanswered: set[_Read] = set()
        """Reads not answered yet, waiting for a thread or in one (under ``_lock``)."""
        self._warned: set[str] = set()
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.errors = 0
        self.skipped = 0
        self.corrupt = 0
        self.refused = 0
        if self._secret is None:
            _log.warning("the shared cache %s is not signed: anyone able to write to it can plant kernels that this "
                         "process will run. Set a cache key (cache_key, AIOCOMPILE_CACHE_KEY) on every machine that "
                         "builds or reads it", self.url)

    @property
    def state(self) -> str:
        """The breaker's state: "closed" (in use), "open" (left alone for now), "half-open"."""
        return self._breaker.state

    @property
    def opened(self) -> int:
        return self._breaker.opened

    def close(self, wait: bool = True) -> None:
        """Finish (``wait``) or drop the writes still queued, then let the connections go.
        Reads not answered by then (dropped, or still in a thread) are misses."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        self._cut()
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing what may already be broken
            pass

    # -- called on the request path (any thread) -----------------------------------------

    def lookup(self, key: str, decode: Callable[[bytes], Any]) -> cf.Future[Any] | None:
        """A future of the result stored for ``key`` and the seconds decoding it took, or
        of None for a miss, read in the cache's threads; the future never fails. None, at
        once, when the breaker is open or too many reads wait (counted in ``skipped``):
        compile without waiting."""
        read = _Read(key, decode)
        with self._lock:
            # The queue first: a probe that ``allow()`` lets through must be sent.
            if self._queued_reads >= _MAX_QUEUED_READS or not self._breaker.allow():
                self.skipped += 1
                return None
            # Under the lock with ``allow()``: a breaker opening after it finds this read
            # among the unanswered, and answers it.
            self._queued_reads += 1
            self._unanswered.add(read)
        try:
            self._executor.submit(self._read, read)
        except RuntimeError:  # closed: no thread will read it
            with self._lock:
                self._queued_reads -= 1
                self._unanswered.discard(read)
            self._breaker.dropped()
            return None
        return read.future

    def store(self, key: str, encode: Callable[[], bytes]) -> None:
        """Queue writing ``encode()`` for ``key``. Never raises, never waits: the result
        was answered already, and a copy that cannot be kept is counted, no more."""
        with self._lock:
            if self._queued_writes >= _MAX_QUEUED_WRITES:
                self.skipped += 1
                return
            self._queued_writes += 1
        try:
            self._executor.submit(self._store, key, encode)
        except RuntimeError:  # closed, or the interpreter is exiting: the copy is lost
            with self._lock:
                self._queued_writes -= 1

    # -- the cost history (the caller's thread) ---------------------------------------------

    def read_costs(self) -> dict[str, Any]:
        """The fleet's cost history: each compile key's entry as stored (``_core.costs`` checks
        them); empty when there is none, the server fails, or the breaker is open."""
        if self._breaker.state == "open":
            return {}
        try:
            raw = self._client.hgetall(COSTS)
        except Exception as exc:  # noqa: BLE001 - no history is an order of work, no more
            _log.debug("aiocompile: cannot read the cost history from %s: %s", self.url, exc)
            return {}
        costs: dict[str, Any] = {}
        for key, value in raw.items():
            try:
                costs[key.decode() if isinstance(key, bytes) else str(key)] = json.loads(value)
            except (ValueError, UnicodeDecodeError):
                continue
        return costs

    def write_costs(self, entries: dict[str, list[Any]], limit: int) -> bool:
        """Add ``entries`` to the fleet's cost history, keeping its newest ``limit``
        entries. Returns whether it was written."""
        if self._breaker.state == "open":
            return False
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.hset(COSTS, mapping={key: json.dumps(entry, separators=(",", ":")) for key, entry in entries.items()})
            if self._ttl is not None:
                pipe.expire(COSTS, self._ttl)
            pipe.hlen(COSTS)
            size = pipe.execute()[-1]
            if isinstance(size, int) and size > limit:
                self._trim_costs(limit)
        except Exception as exc:  # noqa: BLE001 - not kept this time, sent with the next save
            _log.debug("aiocompile: cannot write the cost history to %s: %s", self.url, exc)
            return False
        return True

    def _trim_costs(self, limit: int) -> None:
        # Another machine may be adding entries meanwhile: this drops only the oldest of
        # those read, and a later write trims again.
        def when(item: tuple[Any, Any]) -> float:
            try:
                value = json.loads(item[1])[4]
                return float(value) if isinstance(value, (int, float)) else 0.0
            except (ValueError, IndexError, KeyError, TypeError):
                return 0.0  # not an entry: first to go

        entries = sorted(self._client.hgetall(COSTS).items(), key=when)
        oldest = [key for key, _ in entries[:max(0, len(entries) - limit)]]
        if oldest:
            self._client.hdel(COSTS, *oldest)

    # -- in the cache's threads ------------------------------------------------------------------

    def _read(self, read: _Read) -> None:
        with self._lock:
            self._queued_reads -= 1
            if read not in self._unanswered:
                return  # answered already: the breaker opened while it waited
        try:
            blob = self._fetch(read.key)
        except _TooLarge as exc:
            # The server answered; the entry is one no write of ours makes, and is not
            # read (the compile's write, if it fits, replaces it).
            self._breaker.succeeded()
            self._untrusted("size", read.key, f"{exc.size} bytes, more than cache_url_entry_bytes")
            self._answer(read, None, _Found.REFUSED)
            return
        except self._response_error as exc:
            if "WRONGTYPE" not in str(exc):  # (a pipeline names the command before it)
                self._answer(read, None, _Found.ERROR)
                self._failed("read", exc)
                return
            # Something else keeps another type of value under the name: the server
            # answered, and the entry is one not to use (the compile's write replaces it).
            self._breaker.succeeded()
            self._untrusted("type", read.key, "not a string value")
            self._answer(read, None, _Found.REFUSED)
            return
        except Exception as exc:  # noqa: BLE001 - whatever the client raised, it is a miss
            self._answer(read, None, _Found.ERROR)  # before the breaker may answer it as skipped
            self._failed("read", exc)
            return
        self._breaker.succeeded()
        if blob is None:
            self._answer(read, None, _Found.MISS)
            return
        with self._lock:
            if read not in self._unanswered:
                return  # answered meanwhile: no use decoding it
        found, outcome = self._open(read.key, blob if isinstance(blob, bytes) else str(blob).encode(), read.decode)
        self._answer(read, found, outcome)

    def _fetch(self, key: str) -> Any:
        """The bytes stored for ``key`` (None: nothing); raises what the client raised, or
        ``_TooLarge`` for a value larger than any entry written (not read: a planted value
        of hundreds of megabytes would otherwise cost that much memory in each reading
        thread)."""
        name = PREFIX + key
        if self._max_entry is not None:
            # One round trip: the value's length and at most max_entry + 1 of its bytes
            # (a value replaced between the two shows as too long, or fails its seal).
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(name)
            pipe.getrange(name, 0, self._max_entry)
            if self._ttl is not None:
                pipe.expire(name, self._ttl)  # read, and live on
            size, blob = pipe.execute()[:2]
            if size > self._max_entry or len(blob) > self._max_entry:
                raise _TooLarge(max(size, len(blob)))
            return blob if size else None
        if self._getex:
            try:
                return self._client.getex(name, ex=self._ttl)  # read, and live on
            except self._response_error as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                self._getex = False  # a server older than Redis 6.2
        return self._client.get(name)

    def _open(self, key: str, blob: bytes, decode: Callable[[bytes], Any]) -> tuple[tuple[Any, float] | None, _Found]:
        """The result in an entry and the seconds decoding it took, or None when it is not
        trusted or does not decode; never raises."""
        try:
            return open_entry(blob, self._secret, key, decode), _Found.HIT
        except NotSealed:
            self._untrusted("unsigned", key, "not signed, and a cache key is set")
            return None, _Found.REFUSED
        except BadSeal as exc:
            if self._secret is None:
                self._damaged(key, exc)
                return None, _Found.CORRUPT
            self._untrusted("signature", key, str(exc))
            return None, _Found.REFUSED
        except Undecodable as exc:
            self._damaged(key, exc.__cause__ or exc)
            return None, _Found.CORRUPT

    def _answer(self, read: _Read, found: tuple[Any, float] | None, outcome: _Found) -> None:
        """Answer ``read`` and count it, unless the breaker answered it first."""
        with self._lock:
            if read not in self._unanswered:
                return
            self._unanswered.discard(read)
            setattr(self, outcome.value, getattr(self, outcome.value) + 1)
        # Outside the lock: the waiting request goes on from here (its done-callbacks).
        read.future.set_result(found)

    def _cut(self) -> None:
        """The breaker is open (or the cache closed): every read not answered yet is a
        miss, now, rather than after its own timeout (the threads' late answers are
        dropped)."""
        with self._lock:
            reads = list(self._unanswered)
            self._unanswered.clear()
            self.skipped += len(reads)
        for read in reads:
            read.future.set_result(None)

    def _store(self, key: str, encode: Callable[[], bytes]) -> None:
        try:
            data = wrap(encode(), self._secret, key)
            if self._max_entry is not None and len(data) > self._max_entry:
                with self._lock:
                    self.skipped += 1
                return
            if not self._breaker.allow():
                with self._lock:
                    self.skipped += 1
                return
            try:
                self._client.set(PREFIX + key, data, ex=self._ttl)
            except Exception as exc:  # noqa: BLE001 - a copy that cannot be kept is counted, no more
                with self._lock:
                    self.errors += 1
                self._failed("write", exc)
                return
            self._breaker.succeeded()
            with self._lock:
                self.writes += 1
        except Exception:  # noqa: BLE001 - a result that does not encode is not shared, and that is all
            _log.debug("aiocompile: a result could not be encoded for the shared cache", exc_info=True)
        finally:
            with self._lock:
                self._queued_writes -= 1

    # -- what went wrong --------------------------------------------------------------------------

    def _failed(self, operation: str, exc: BaseException) -> None:
        """A call failed (counted by the caller): tell the breaker, and cut the reads if it
        opened."""
        self._breaker.failed()
        if self._breaker.state == "open":
            self._cut()
        _log.debug("shared cache %s at %s failed: %s", operation, self.url, exc, exc_info=exc)
        self._warn_once(f"{operation}:{type(exc).__name__}",
                        "cannot %s the shared cache %s (%s: %s); kernels are compiled, or not shared, instead%s",
                        "read from" if operation == "read" else "write to", self.url, type(exc).__name__, exc,
                        "" if self._breaker.state == "closed" else "; it is left alone for a while")

    def _damaged(self, key: str, exc: BaseException) -> None:
        _log.debug("shared cache entry %s does not decode: %s", key, exc)
        self._warn_once("corrupt", "entries of the shared cache %s do not decode (the first: %s: %s: %s); their "
                        "kernels are compiled instead", self.url, key, type(exc).__name__, exc)

    def _untrusted(self, kind: str, key: str, reason: str) -> None:
        _log.debug("shared cache entry %s is not trusted: %s", key, reason)
        self._warn_once(f"refused:{kind}", "entries of the shared cache %s are not trusted and not loaded (the first: "
                        "%s, %s); their kernels are compiled instead", self.url, key, reason)

    def _warn_once(self, cause: str, message: str, *args: Any) -> None:
        with self._lock:
            if cause in self._warned:
                return
            self._warned.add(cause)
        _log.warning(message, *args)
