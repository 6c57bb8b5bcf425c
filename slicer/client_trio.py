"""The trio client of slicerd: `AsyncSlicer`, a transport over one `proto.ClientSession`.

Import it from `gpu_slicer.slicer.client`, whose docstring says what both clients share
(methods, exceptions, timeouts); `Slicer` there is the blocking twin.

An ACQUIRE abandoned (its caller cancelled or timed out) may still be granted, and slicerd
counts that turn as this connection's until the grant is read. So the client reads for it
right away, in a trio system task (`trio.lowlevel.spawn_system_task`: no nursery of the
caller's is at hand, and asking for one would change `connect`) that it owns: the task
ends once the ACQUIRE is answered (a grant's RELEASE written), `aclose` cancels it and waits
for it, and it never raises (a failure goes to the session, which every call then raises).

KeyboardInterrupt: trio delivers it at any checkpoint of unprotected code, so one that
arrives between the steps of a call (after its ACQUIRE line was written, before the call was
marked abandoned) may leave that ACQUIRE un-abandoned: nobody reads for its grant, and the
daemon counts that turn as this connection's. A program that catches KeyboardInterrupt
should close the connection (``aclose``, or leave its ``async with``) rather than keep
using it; closing gives back whatever the connection held.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Self, TypeVar

import trio

from gpu_slicer import proto
from gpu_slicer.proto import ClientError, Turn, Unreachable
from gpu_slicer.slicer.client_async import AsyncCalls
from gpu_slicer.slicer.client_common import (
    RECV_SIZE,
    RELEASE_TIMEOUT,
    WRITE_TIMEOUT,
    release_stuck,
)

__all__ = ["WRITE_TIMEOUT", "AsyncSlicer"]

T = TypeVar("T")


class AsyncSlicer(AsyncCalls):
    """A trio connection to slicerd: ``async with await AsyncSlicer.connect(...) as s``.

    The same calls as `Slicer`, awaited. Tasks may share one connection: requests are
    pipelined, and whichever task waits reads for all (one reader at a time, in turn);
    `release_timeout` (`RELEASE_TIMEOUT`) bounds the release at the end of `turn`.
    """

    def __init__(self, stream: trio.abc.Stream, workload: str | None = None) -> None:
        self._stream = stream
        self.release_timeout = RELEASE_TIMEOUT
        self._session = proto.ClientSession(workload)
        self._send_lock = trio.Lock()
        self._recv_lock = trio.Lock()
        self._reader: tuple[trio.CancelScope, trio.Event] | None = None  # _read_for_late_grant

    @classmethod
    async def _open(cls, where: str, workload: str | None, timeout: float) -> Self:
        with trio.move_on_after(timeout):
            return cls(await trio.open_unix_socket(where), workload)
        raise TimeoutError

    async def _close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader[0].cancel()
        try:
            await self._stream.aclose()
        finally:
            if reader is not None:
                with trio.CancelScope(shield=True):  # cancelled, it ends at once
                    await reader[1].wait()

    async def _receive(self) -> bytes | bytearray | None:
        try:
            return await self._stream.receive_some(RECV_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._session.connection_lost(f"connection lost: {e}")
            return None

    async def _close_now(self) -> None:
        await trio.aclose_forcefully(self._stream)

    async def _within(self, timeout: float | None, work: Callable[[], Awaitable[T]]) -> T:
        with trio.fail_after(math.inf if timeout is None else max(0.0, timeout)):
            return await work()

    async def _write(self, data: bytes) -> None:
        # Under the send lock. Once begun, lines are written whole (shielded, bounded):
        # a line cut off would garble the next.
        if not data:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(WRITE_TIMEOUT) as scope:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._session.connection_lost(f"connection lost: {e}")
        if scope.cancelled_caught:
            self._session.connection_lost(f"a request line blocked for {WRITE_TIMEOUT:g} s")

    async def _flush(self) -> None:
        # What the session owes goes out even from a task being cancelled (shielded; the
        # send lock's holder is bounded by WRITE_TIMEOUT).
        if not self._session.has_data_to_send:
            return
        with trio.CancelScope(shield=True):
            async with self._send_lock:
                await self._write(self._session.data_to_send())

    async def _send(self, make: Callable[[], proto.Call[T]]) -> proto.Call[T]:
        async with self._send_lock:
            await trio.lowlevel.checkpoint_if_cancelled()  # nothing sent for a cancelled caller
            call = make()
            await self._write(self._session.data_to_send())
        return call

    def _watch_late_grant(self) -> None:
        # Called where a call was abandoned: an ACQUIRE given up may still be granted, and
        # slicerd counts that turn as ours until the grant is read. Read for it now, not
        # at the next call (which may be minutes of the caller's work away). A trio system
        # task, as no nursery of the caller's is at hand; it belongs to this client: it
        # ends when the ACQUIRE is answered, and `aclose` cancels it and waits for it.
        if self._session.has_abandoned_acquire and self._reader is None:
            self._reader = (trio.CancelScope(), trio.Event())
            trio.lowlevel.spawn_system_task(
                self._read_for_late_grant,
                *self._reader,
                name="slicer: read for an abandoned ACQUIRE",
            )

    async def _read_for_late_grant(self, scope: trio.CancelScope, done: trio.Event) -> None:
        # A system task must not raise (trio would end the whole run): the shared reading
        # raises no Exception, and a BaseException of an `on_event` callback (SystemExit,
        # KeyboardInterrupt) fails the session here. Cancellation ends it as it should.
        try:
            with scope:
                # Its loop is checked again with no checkpoint before `finally`: an ACQUIRE
                # abandoned while `_pump` flushed found this task still running and started
                # none.
                await self._read_until_answered()
        except trio.Cancelled:
            raise
        except BaseException as e:
            with trio.CancelScope(shield=True):
                await self._reader_failed(e)
        finally:
            if self._reader is not None and self._reader[0] is scope:
                self._reader = None
            done.set()

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        with trio.CancelScope(shield=True):
            try:
                with trio.move_on_after(self.release_timeout) as bound:
                    await self.release(t, park)
            except (ClientError, proto.ProtocolError) as e:
                if self._preempted(t, e):
                    return
                if loud:
                    raise
                # The body's own exception (or cancellation) is what the caller must see,
                # not the daemon's death found by the release.
                if self._session.failed:
                    await self.aclose()
                return
            if bound.cancelled_caught:
                await self.aclose()
                if loud:
                    raise Unreachable(release_stuck(self.release_timeout))
