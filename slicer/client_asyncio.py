"""The asyncio client of slicerd: `AsyncioSlicer`, a transport over one `proto.ClientSession`.

Import it from `gpu_slicer.slicer.client`, whose docstring says what the clients share
(methods, exceptions, timeouts). It is `client_trio.AsyncSlicer` call for call, under
asyncio: a timeout raises `TimeoutError`, and a task cancelled while it waits abandons its
call as a timeout does (the late reply is dropped; a turn granted to an abandoned ACQUIRE
is released as soon as it is granted: a task of the client reads for it, and `aclose`
cancels it and waits for it).

How it differs inside, and why. asyncio's `StreamWriter.write` hands every byte to the
transport at once (it never blocks and cannot be cut off), so each request line is
written whole, in the session's order, at the moment it is taken from
`ClientSession.data_to_send`: no send lock is needed, and a line written by a task that is
cancelled right after still goes out. Only `drain` (flow control) waits; it is bounded by
`WRITE_TIMEOUT`. What trio shields (the RELEASE ending a turn) runs here as a task of its
own that the caller waits for even when it is cancelled again (`_shielded`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Self, TypeVar

from gpu_slicer import proto
from gpu_slicer.proto import ClientError, Turn, Unreachable
from gpu_slicer.slicer.client_async import AsyncCalls
from gpu_slicer.slicer.client_common import (
    RECV_SIZE,
    RELEASE_TIMEOUT,
    WRITE_TIMEOUT,
    release_stuck,
)

__all__ = ["AsyncioSlicer"]

T = TypeVar("T")


class AsyncioSlicer(AsyncCalls):
    """An asyncio connection to slicerd: ``async with await AsyncioSlicer.connect() as s``.

    The same calls as `AsyncSlicer` (trio) and `Slicer` (blocking), awaited. Tasks may
    share one connection: requests are pipelined, and whichever task waits reads for all
    (one reader at a time, in turn); `release_timeout` (`RELEASE_TIMEOUT`) bounds the
    release at the end of `turn`. Made from a connected stream pair (`connect` opens one).
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        workload: str | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.release_timeout = RELEASE_TIMEOUT
        self._session = proto.ClientSession(workload)
        self._recv_lock = asyncio.Lock()
        self._reader_task: asyncio.Task[None] | None = None  # `_read_until_answered`

    @classmethod
    async def _open(cls, where: str, workload: str | None, timeout: float) -> Self:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(where)
        return cls(reader, writer, workload)

    async def _close(self) -> None:
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
        # Aborted, not closed: `close` keeps the transport open until what it buffered is
        # written, which a stopped daemon never reads (then `wait_closed` never returns).
        # Nothing buffered is worth writing once the connection ends.
        self._writer.transport.abort()
        if task is not None:
            await asyncio.wait([task])  # raises only the caller's own cancellation
        with contextlib.suppress(OSError):  # a reset connection is closed all the same
            await self._writer.wait_closed()

    async def _send(self, make: Callable[[], proto.Call[T]]) -> proto.Call[T]:
        call = make()
        self._send_owed()
        return call

    async def _flush(self) -> None:
        self._send_owed()  # never suspends: no cancellation can cut it off

    def _send_owed(self) -> None:
        # Synchronous, so whole and in order whatever happens to the calling task next.
        if self._session.has_data_to_send:
            self._writer.write(self._session.data_to_send())

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(WRITE_TIMEOUT):
                await self._writer.drain()
        except TimeoutError:  # only ours: a caller's own deadline arrives as a cancellation
            self._session.connection_lost(f"a request line blocked for {WRITE_TIMEOUT:g} s")
        except OSError as e:
            self._session.connection_lost(f"connection lost: {e}")

    async def _receive(self) -> bytes | bytearray | None:
        try:
            return await self._reader.read(RECV_SIZE)
        except OSError as e:
            self._session.connection_lost(f"connection lost: {e}")
            return None

    async def _close_now(self) -> None:
        self._writer.transport.abort()  # as in `_close`: a stopped daemon reads nothing

    async def _within(self, timeout: float | None, work: Callable[[], Awaitable[T]]) -> T:
        async with asyncio.timeout(None if timeout is None else max(0.0, timeout)):
            return await work()

    async def _reply(self, call: proto.Call[Any]) -> None:
        await self._drain()
        await super()._reply(call)

    def _watch_late_grant(self) -> None:
        # Called where a call was abandoned: an ACQUIRE given up may still be granted, and
        # slicerd counts that turn as ours until the grant is read. Read for it now, not
        # at the next call (which may be minutes of the caller's work away).
        if self._session.has_abandoned_acquire and (
            self._reader_task is None or self._reader_task.done()
        ):
            self._reader_task = asyncio.get_running_loop().create_task(
                self._read_until_answered(), name="slicer: read for an abandoned ACQUIRE"
            )

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        if await _shielded(self._release_within(t, park, loud)) and loud:
            raise Unreachable(release_stuck(self.release_timeout))

    async def _release_within(self, t: Turn, park: str, loud: bool) -> bool:
        # True when the release got no reply in time (the connection is then closed).
        try:
            async with asyncio.timeout(self.release_timeout):
                await self.release(t, park)
        except TimeoutError:
            await self.aclose()
            return True
        except (ClientError, proto.ProtocolError) as e:
            if self._preempted(t, e):
                return False
            if loud:
                raise
            # The body's own exception (or cancellation) is what the caller must see, not
            # the daemon's death found by the release.
            if self._session.failed:
                await self.aclose()
        return False


async def _shielded(work: Coroutine[Any, Any, T]) -> T:
    # trio's CancelScope(shield=True): `work` runs to its end even when the caller is
    # cancelled meanwhile (the cancellation is raised after). A RELEASE held back behind
    # an abandoned ACQUIRE is not written yet, and an abandoned held call never is: were
    # the release abandoned, the turn would stay held.
    inner = asyncio.ensure_future(work)
    cancelled = False
    while not inner.done():
        try:
            await asyncio.shield(inner)
        except asyncio.CancelledError:
            cancelled = cancelled or not inner.done()
        except BaseException:
            pass  # `inner`'s own outcome, raised below
    if cancelled:
        if not inner.cancelled():
            inner.exception()  # taken, so asyncio does not log it as never retrieved
        raise asyncio.CancelledError
    return inner.result()
