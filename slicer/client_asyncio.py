"""The asyncio client of slicerd: `AsyncioSlicer`, a transport over one `proto.ClientSession`.

Import it from `gpu_slicer.slicer.client`, whose docstring says what the clients share
(methods, exceptions, timeouts). It is `client_trio.AsyncSlicer` call for call, under
asyncio: a timeout raises `TimeoutError`, and a task cancelled while it waits abandons its
call as a timeout does (the late reply is dropped; a turn granted to an abandoned ACQUIRE
is released).

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
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gpu_slicer import proto
from gpu_slicer.proto import Turn, Unreachable
from gpu_slicer.slicer.client_async import AsyncCalls
from gpu_slicer.slicer.client_common import (
    RECV_SIZE,
    RELEASE_TIMEOUT,
    WRITE_TIMEOUT,
    release_stuck,
    socket_path,
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

    @classmethod
    async def connect(
        cls, path: str | None = None, workload: str | None = None, timeout: float = 30.0
    ) -> AsyncioSlicer:
        """Connect to the daemon's socket; `workload` defaults to $SLICER_WORKLOAD."""
        where = socket_path(path)
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(where)
        except OSError as e:  # TimeoutError included
            raise Unreachable(f"cannot connect to {where}: {str(e) or 'timed out'}") from e
        return cls(reader, writer, workload or os.environ.get("SLICER_WORKLOAD"))

    @classmethod
    async def from_env(cls) -> AsyncioSlicer:
        """Connect using SLICER_SOCKET and SLICER_WORKLOAD (set by slicer-launch)."""
        return await cls.connect()

    async def __aenter__(self) -> AsyncioSlicer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the daemon then ends our turn and registrations)."""
        self._session.connection_lost("the client closed the connection")
        self._writer.close()
        with contextlib.suppress(OSError):  # a reset connection is closed all the same
            await self._writer.wait_closed()

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

    async def _pump(self, ready: Callable[[], bool]) -> None:
        # One reader at a time; asyncio.Lock is fair (FIFO), so a task whose reply another
        # task read gets the lock next, sees `ready` and returns without reading.
        while not ready() and not self._session.failed:
            try:
                async with self._recv_lock:
                    if ready() or self._session.failed:
                        return
                    try:
                        data = await self._reader.read(RECV_SIZE)
                    except OSError as e:
                        self._session.connection_lost(f"connection lost: {e}")
                        return
                    if data:
                        self._session.receive_data(data)
                    else:
                        self._session.receive_eof()
            finally:
                # Whoever read a grant nobody waits for writes its RELEASE now (and the
                # calls held behind it).
                self._send_owed()

    async def _call(self, make: Callable[[], proto.Call[T]], timeout: float | None) -> T:
        call = make()
        self._send_owed()
        try:
            async with asyncio.timeout(timeout):
                await self._drain()
                await self._pump(lambda: call.done)
        except BaseException:
            call.abandon()  # its reply is dropped; a turn it was granted is given back
            self._send_owed()
            raise
        return call.result()

    async def next_message(self, timeout: float | None = None) -> proto.ServerMessage:
        """The next non-reply line (queued ones first); None `timeout` waits forever."""
        async with asyncio.timeout(timeout):
            while (msg := self._session.next_event()) is None:
                await self._pump(lambda: bool(self._session.events))
        return msg

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        if await _shielded(self._release_within(t, park)) and loud:
            raise Unreachable(release_stuck(self.release_timeout))

    async def _release_within(self, t: Turn, park: str) -> bool:
        # True when the release got no reply in time (the connection is then closed).
        try:
            async with asyncio.timeout(self.release_timeout):
                await self.release(t, park)
        except TimeoutError:
            await self.aclose()
            return True
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
