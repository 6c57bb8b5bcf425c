"""The awaited calls both async clients share, written once over their transport.

`client_trio.AsyncSlicer` and `client_asyncio.AsyncioSlicer` differ only in how bytes move
and how a wait is bounded or shielded: each implements `_open` (the stream pair behind
`connect`), `_close`, `_send` (write one request), `_flush` (write what the session owes,
even from a cancelled task), `_receive`, `_close_now`, `_within` (bound a wait), the start
of the late-grant reader and `_end_turn` (the shielded, bounded RELEASE at the end of a
turn). What a call does with them lives here: `connect`, `aclose`, `_call` (send, wait for
the reply at most ``timeout``, abandon it on the way out if it got none), the one-reader
`_pump`, `next_message`, the requests themselves (`ping` ... `watch`) and the shape of
`turn`, so the two loops offer the same API and the same reading by construction.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Self, TypeVar

from gpu_slicer import proto
from gpu_slicer.proto import ClientError, Faulted, Turn, Unreachable
from gpu_slicer.slicer.client_common import REPLY_TIMEOUT, HoldWatch, SessionView, socket_path

__all__ = ["AsyncCalls"]

T = TypeVar("T")


class AsyncCalls(SessionView):
    """The public awaited calls of a slicerd connection, over the transport's I/O."""

    _recv_lock: contextlib.AbstractAsyncContextManager[Any]  # a fair lock of the loop's

    @classmethod
    async def connect(
        cls, path: str | None = None, workload: str | None = None, timeout: float = 30.0
    ) -> Self:
        """Connect to the daemon's socket; `workload` defaults to $SLICER_WORKLOAD."""
        where = socket_path(path)
        try:
            c = await cls._open(where, workload or os.environ.get("SLICER_WORKLOAD"), timeout)
        except OSError as e:  # TimeoutError included
            raise Unreachable(f"cannot connect to {where}: {str(e) or 'timed out'}") from e
        c.path = where
        return c

    @classmethod
    async def from_env(cls) -> Self:
        """Connect using SLICER_SOCKET and SLICER_WORKLOAD (set by slicer-launch)."""
        return await cls.connect()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the daemon then ends our turn and registrations), and
        end the client's background reader, if one runs."""
        self._session.connection_lost("the client closed the connection")
        await self._close()

    # Each transport's own I/O.

    @classmethod
    async def _open(cls, where: str, workload: str | None, timeout: float) -> Self:
        # Raises OSError (TimeoutError past `timeout`) when it cannot connect.
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError  # the stream and the background reader, waited for

    async def _send(self, make: Callable[[], proto.Call[T]]) -> proto.Call[T]:
        raise NotImplementedError  # make the call and write its line, whole and in order

    async def _flush(self) -> None:
        raise NotImplementedError  # what the session owes, written even when cancelled

    async def _receive(self) -> bytes | bytearray | None:
        raise NotImplementedError  # None: the connection was lost (the session knows)

    async def _close_now(self) -> None:
        raise NotImplementedError  # the session failed: drop the connection at once

    async def _within(self, timeout: float | None, work: Callable[[], Awaitable[T]]) -> T:
        # `work()` bounded by `timeout` (None: forever; below 0 as 0). Made inside, once it
        # can be awaited: a coroutine made before a bound that raises is never awaited.
        raise NotImplementedError

    async def _reply(self, call: proto.Call[Any]) -> None:
        await self._pump(lambda: call.done)

    def _watch_late_grant(self) -> None:
        raise NotImplementedError  # start `_read_for_late_grant` unless it runs

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        raise NotImplementedError

    async def _call(self, make: Callable[[], proto.Call[T]], timeout: float | None) -> T:
        call = await self._send(make)
        try:
            await self._within(timeout, lambda: self._reply(call))
        except BaseException:
            call.abandon()  # its reply is dropped; a turn it was granted is given back
            await self._flush()
            self._watch_late_grant()
            raise
        return call.result()

    async def _pump(self, ready: Callable[[], bool]) -> None:
        # One reader at a time; both loops' locks are fair (FIFO), so a task whose reply
        # another task read gets the lock next, sees `ready` and returns without reading.
        while not ready() and not self._session.failed:
            try:
                async with self._recv_lock:
                    if ready() or self._session.failed:
                        return
                    data = await self._receive()
                    if data is None:
                        return
                    try:
                        if data:
                            self._session.receive_data(data)
                        else:
                            self._session.receive_eof()
                    finally:
                        if self._session.failed:
                            await self._close_now()  # the daemon ends what we held now
            finally:
                # Whoever read a grant nobody waits for writes its RELEASE now (and the
                # calls held behind it), outside the read lock.
                await self._flush()

    async def _read_until_answered(self) -> None:
        # The late-grant reader's work: reads for every task of this client (it shares the
        # read lock) until the abandoned ACQUIRE is answered; `_pump` then writes the
        # RELEASE of a grant. It never raises: errors go to the session, which every call
        # then raises (nobody awaits the reader, and a trio system task must not raise).
        try:
            while self._session.has_abandoned_acquire and not self._session.failed:
                await self._pump(lambda: not self._session.has_abandoned_acquire)
        except Exception as e:  # the session's failure, or an `on_event` callback's error
            await self._reader_failed(e)

    async def _reader_failed(self, e: BaseException) -> None:
        # Nobody reads for the abandoned ACQUIRE any more: fail the session (a failure it
        # had stays first) and close, so the daemon ends a late grant instead of holding
        # it as this connection's turn.
        self._session.connection_lost(f"the client's background reader failed: {e!r}")
        await self._close_now()

    async def next_message(self, timeout: float | None = None) -> proto.ServerMessage:
        """The next non-reply line (queued ones first); None `timeout` waits forever."""
        return await self._within(timeout, self._next_event)

    async def _next_event(self) -> proto.ServerMessage:
        while (msg := self._session.next_event()) is None:
            await self._pump(lambda: bool(self._session.events))
        return msg

    async def request(self, req: proto.Request, timeout: float | None = REPLY_TIMEOUT) -> proto.Ok:
        """Send `req` and wait (at most `timeout`, None = forever) for its reply."""
        return await self._call(lambda: self._session.send(req), timeout)

    async def ping(self) -> None:
        """PING."""
        await self._call(self._session.ping, REPLY_TIMEOUT)

    async def register(self, name: str | None = None, **kw: Any) -> dict[str, str]:
        """REGISTER (keywords: gpu, pid, tree, park, parked_max, fallback, ask,
        max_turn); `name` becomes the default workload of later calls."""
        return await self._call(lambda: self._session.register(name, **kw), REPLY_TIMEOUT)

    async def acquire(
        self, name: str | None = None, wait: float | None = None, early: int = 0
    ) -> Turn:
        """ACQUIRE: wait until granted (or `wait` seconds: ClientError timeout); `early`
        bytes ask for an early start (an `proto.Early` event, before the grant, says
        they may be used: see `on_event`)."""
        return await self._call(lambda: self._session.acquire(name, wait, early), None)

    async def release(self, t: Turn, park: str = "lazy", used: bool = True) -> dict[str, str]:
        """RELEASE the turn `t` (`park` "lazy" or "now"; `used` False: no work done in it,
        counted by slicerd as an unused turn, or a wasted one when a park was paid)."""
        return await self._call(lambda: self._session.release(t, park, used), None)

    async def parked(self, name: str, turn: int, ok: bool = True) -> None:
        """PARKED: answer a PARK (`ok` False: this registrant could not park it)."""
        await self._call(lambda: self._session.parked(name, turn, ok), REPLY_TIMEOUT)

    async def unregister(self, name: str | None = None) -> None:
        """UNREGISTER."""
        await self._call(lambda: self._session.unregister(name), REPLY_TIMEOUT)

    async def status(self) -> dict[str, Any]:
        """STATUS as a dict."""
        return await self._call(self._session.status, REPLY_TIMEOUT)

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        """WATCH, then yield each event body, forever."""
        await self._call(self._session.watch, REPLY_TIMEOUT)
        while True:
            msg = await self.next_message()
            if isinstance(msg, proto.Event):
                yield msg.body

    @contextlib.asynccontextmanager
    async def turn(
        self, name: str | None = None, wait: float | None = None, park: str = "lazy"
    ) -> AsyncIterator[Turn]:
        """Hold a turn for the `async with` body; released on the way out, exceptions and
        cancellation included.

        The release is shielded (a cancellation waits for it to end) and bounded by
        `release_timeout`: past it the connection is closed and, when the body ended
        normally, `Unreachable` is raised. When the body raised or was cancelled, a release
        that fails (the daemon died meanwhile: `Unreachable`) does not replace that
        exception or cancellation: it goes on (a failed connection is closed). An ACQUIRE
        that raises `Faulted` with a granted turn releases that turn before the `Faulted`
        goes on."""
        made: list[proto.Call[Turn]] = []

        def make() -> proto.Call[Turn]:
            made.append(self._session.acquire(name, wait))
            return made[-1]

        try:
            t = await self._call(make, None)
        except Faulted:
            if (granted := made[-1].granted()) is not None:
                with contextlib.suppress(ClientError, proto.ProtocolError):
                    await self._end_turn(granted, park, loud=False)
            raise
        finished = False
        watch = HoldWatch(self.path, t, self.hold_warn)
        try:
            yield t
            finished = True
        finally:
            watch.stop()
            await self._end_turn(t, park, loud=finished)
