"""The pool's Redis connection: bounded calls of the pool's scripts, errors mapped.

Every call is bounded (:data:`CALL_TIMEOUT_S`) and every failure of Redis (refused,
reset, timed out, loading its AOF, a script error) is raised as
:class:`~dispatcher.errors.PoolUnavailable`, a :class:`~dispatcher.errors.StoreError`:
the front answers 503 and the turn loop ends its turn and backs off, as for a broken
SQLite store. :attr:`PoolConn.down` holds the last failure until a call works again;
nothing here retries on its own: the callers' loops do, each with its own bound.

Blocking reads (``XREAD BLOCK``, :meth:`PoolConn.read_streams`) use a client of their own,
so a long-poll of the notification streams never holds up a claim or a commit.

The URL is ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`` or ``unix:///PATH[?db=N]``
(:func:`~dispatcher.poolurl.check_url`); a password not in it comes from
``--queue-password-file`` or ``$SLICER_REDIS_PASSWORD`` (:mod:`dispatcher.poolurl`). No
password shows anywhere: :attr:`PoolConn.shown` is the URL redacted, and every error text
is scrubbed of the passwords this connection knows.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import coredis
import trio

from gpu_slicer.dispatcher import poolscripts
from gpu_slicer.dispatcher.errors import (
    DispatchError,
    PoolUnavailable,
    StoreFull,
    UnknownRevision,
)
from gpu_slicer.dispatcher.poolurl import (
    check_url,
    has_password,
    password_from,
    redact,
    scrub,
    url_passwords,
)

__all__ = ["CALL_TIMEOUT_S", "PoolConn", "check_url"]  # check_url: poolurl's

log = logging.getLogger("dispatcher.pool")

CALL_TIMEOUT_S = 5.0  # one script call or command, the network included
CONNECT_TIMEOUT_S = 2.0
_SCRIPTS = ("ENQUEUE", "CLAIM", "POLL", "RETURN", "STRAYS", "TOUCH", "COMMIT", "LOOKUP",
            "EXPIRE_SCAN", "PUBLISH", "WANT", "HOLD", "UNWANT", "UNREADABLE")  # fmt: skip


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else v


class PoolConn:
    """Bounded access to pool ``pool``'s keys in the Redis at ``url`` (module docstring).

    Use as ``async with PoolConn(url, pool) as conn``; nothing connects before the first
    call, so an unreachable Redis at start is a waiting state, not an error. ``password``
    (a ``--queue-password-file``'s) is used when the URL holds none, else
    ``$SLICER_REDIS_PASSWORD``; no password shows in :attr:`shown` or in any error."""

    def __init__(self, url: str, pool: str, password: str | None = None) -> None:
        self.url = check_url(url)
        self.shown = redact(url)
        # A user name alone (redis://USER@HOST, an ACL user) holds no password: the file's
        # or the environment's goes with it.
        self._password = None if has_password(url) else password_from(password)
        self._secrets = [*url_passwords(url), *([self._password] if self._password else [])]
        self.pool = pool
        self.prefix = poolscripts.prefix(pool)
        self.down: str | None = None  # the last failure, until a call works
        self.down_since: float | None = None  # wall clock
        self.calls = 0
        self.failures = 0
        self._client = self._new_client(CALL_TIMEOUT_S)
        # XREAD BLOCK 1000 waits a second on the server: its reads get that much more.
        self._reader = self._new_client(CALL_TIMEOUT_S + 2.0)
        self._scripts: dict[str, Any] = {}

    def _new_client(self, timeout: float) -> coredis.Redis[bytes]:
        extra: dict[str, Any] = {} if self._password is None else {"password": self._password}
        return coredis.Redis.from_url(
            self.url, connect_timeout=CONNECT_TIMEOUT_S, stream_timeout=timeout,
            # A percent-encoded password (what check_url asks for '/', '?' and '#') is
            # sent decoded.
            verify_version=False, decode_components=True, **extra,
        )  # fmt: skip

    def raw_client(self) -> coredis.Redis[bytes]:
        """A new client of this Redis (same URL and password, bounded like the calls)
        for commands of no pool (``SCAN``); the caller enters and closes it."""
        return self._new_client(CALL_TIMEOUT_S)

    def scrub(self, text: str) -> str:
        """``text`` without any password this connection knows."""
        return scrub(text, self._secrets)

    async def __aenter__(self) -> PoolConn:
        await self._client.__aenter__()
        await self._reader.__aenter__()
        self._scripts = {n: self._client.register_script(getattr(poolscripts, n)) for n in _SCRIPTS}
        return self

    async def __aexit__(self, *exc: object) -> None:
        # No cancel scope of ours around these: each client exits a task group it opened
        # in __aenter__, and scopes must nest (closing the pools sends nothing).
        try:
            await self._reader.__aexit__(None, None, None)
        finally:
            await self._client.__aexit__(None, None, None)

    def health(self) -> dict[str, Any]:
        """The Redis link for ``/status``: its URL (no password), whether the last call
        worked, and the failure since when."""
        return {
            "url": self.shown,
            "reachable": self.down is None,
            "error": self.down,
            "down_since": self.down_since,
        }

    def _ok(self) -> None:
        if self.down is not None:
            log.info("redis %s: reachable again (down %.1f s)", self.shown,
                     time.time() - (self.down_since or time.time()))  # fmt: skip
        self.down = None
        self.down_since = None

    def _failed(self, what: str, exc: BaseException) -> PoolUnavailable:
        self.failures += 1
        text = f"redis {self.shown}: {what}: {type(exc).__name__}: {self.scrub(str(exc))}"
        text = text.rstrip(": ")
        if self.down is None:
            log.error("%s", text)
            self.down_since = time.time()
        self.down = text
        return PoolUnavailable(text)

    async def script(self, name: str, *args: Any) -> Any:
        """Run pool script ``name`` (:mod:`dispatcher.poolscripts`) with ARGV prefix,
        ``*args``; bounded. ``UNKNOWNREV`` errors are :class:`UnknownRevision`, ``OOM``
        ones :class:`StoreFull`, the rest :class:`PoolUnavailable`."""
        self.calls += 1
        try:
            with trio.fail_after(CALL_TIMEOUT_S):
                try:
                    out = await self._scripts[name](keys=[], args=[self.prefix, *args])
                except coredis.exceptions.NoScriptError:
                    # coredis loads a missing script itself but drops that load's error:
                    # load it here (one Redis cannot compile then says why), run it again.
                    await self._client.script_load(getattr(poolscripts, name))
                    out = await self._scripts[name](keys=[], args=[self.prefix, *args])
        except coredis.exceptions.ResponseError as e:
            raise self._refused(name, e) from None
        except (coredis.exceptions.RedisError, OSError, trio.TooSlowError) as e:
            raise self._failed(name, e) from None
        self._ok()
        return out

    def _refused(self, name: str, e: coredis.exceptions.ResponseError) -> DispatchError:
        """The error to raise for a script's error reply."""
        text = str(e)
        if text.startswith("UNKNOWNREV "):
            self._ok()
            rev = text.split(" ", 1)[1]
            return UnknownRevision(f"revision {rev!r} is not published in pool {self.pool!r}")
        if text.startswith("LATE"):
            return PoolUnavailable(
                f"redis {self.shown}: {name}: ran after its caller gave up; nothing written"
            )
        if text.startswith("OOM"):
            # Redis at its maxmemory (noeviction): the pool's "disk full". Reachable, so
            # not "down"; the front answers 507 as for a full SQLite disk.
            self._ok()
            return StoreFull(f"redis {self.shown}: {name}: out of memory ({self.scrub(str(e))})")
        return self._failed(name, e)

    async def command(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One plain client call (``"hgetall"``, ``"smembers"``, ``"get"``, ...) with the
        pool's prefix put before the key (the first argument), bounded."""
        self.calls += 1
        try:
            with trio.fail_after(CALL_TIMEOUT_S):
                call = getattr(self._client, method)
                out = await call(self.prefix + args[0], *args[1:], **kwargs)
        except (coredis.exceptions.RedisError, OSError, trio.TooSlowError) as e:
            raise self._failed(method, e) from None
        self._ok()
        return out

    async def last_id(self, key: str) -> bytes:
        """The id of the newest entry of stream ``key`` (prefixed), ``0-0`` if none."""
        got = await self.command("xrevrange", key, count=1)
        return bytes(got[0].identifier) if got else b"0-0"

    async def read_streams(
        self, streams: dict[str, bytes], block_ms: int
    ) -> dict[bytes, list[tuple[bytes, dict[bytes, bytes]]]]:
        """``XREAD BLOCK block_ms`` from ``streams`` (key suffix -> last id seen) on the
        reader's own connection: {key: [(entry id, fields), ...]} of what came after."""
        try:
            with trio.fail_after(CALL_TIMEOUT_S + block_ms / 1000):
                got = await self._reader.xread(
                    {self.prefix + k: v for k, v in streams.items()}, block=block_ms, count=1000
                )
        except (coredis.exceptions.RedisError, OSError, trio.TooSlowError) as e:
            raise self._failed("XREAD", e) from None
        self._ok()
        out: dict[bytes, list[tuple[bytes, dict[bytes, bytes]]]] = {}
        for key, entries in (got or {}).items():
            out[bytes(key)] = [
                (_b(e.identifier), {_b(k): _b(v) for k, v in e.field_values.items()})
                for e in entries
            ]
        return out
