"""The trio client of slicerd: `AsyncSlicer`, a transport over one `proto.ClientSession`.

Import it from `gpu_slicer.slicer.client`, whose docstring says what both clients share
(methods, exceptions, timeouts); `Slicer` there is the blocking twin.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from typing import TypeVar

import trio

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

__all__ = ["WRITE_TIMEOUT", "AsyncSlicer"]

T = TypeVar("T")


def _bound(timeout: float | None) -> contextlib.AbstractContextManager[trio.CancelScope]:
    return trio.fail_after(math.inf if timeout is None else timeout)


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

    @classmethod
    async def connect(
        cls, path: str | None = None, workload: str | None = None, timeout: float = 30.0
    ) -> AsyncSlicer:
        """Connect to the daemon's socket; `workload` defaults to $SLICER_WORKLOAD."""
        where = socket_path(path)
        try:
            with trio.fail_after(timeout):
                stream = await trio.open_unix_socket(where)
        except (OSError, trio.TooSlowError) as e:
            raise Unreachable(f"cannot connect to {where}: {str(e) or 'timed out'}") from e
        return cls(stream, workload or os.environ.get("SLICER_WORKLOAD"))

    @classmethod
    async def from_env(cls) -> AsyncSlicer:
        """Connect using SLICER_SOCKET and SLICER_WORKLOAD (set by slicer-launch)."""
        return await cls.connect()

    async def __aenter__(self) -> AsyncSlicer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the daemon then ends our turn and registrations)."""
        self._session.connection_lost("the client closed the connection")
        await self._stream.aclose()

    async def _pump(self, ready: Callable[[], bool]) -> None:
        # One reader at a time; trio.Lock is fair, so a task whose reply another task
        # read gets the lock next, sees `ready` and returns without reading.
        while not ready() and not self._session.failed:
            try:
                async with self._recv_lock:
                    if ready() or self._session.failed:
                        return
                    try:
                        data = await self._stream.receive_some(RECV_SIZE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        self._session.connection_lost(f"connection lost: {e}")
                        return
                    if data:
                        self._session.receive_data(data)
                    else:
                        self._session.receive_eof()
            finally:
                # Whoever read a grant nobody waits for writes its RELEASE now (and the
                # calls held behind it), outside the read lock.
                await self._flush()

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

    async def _call(self, make: Callable[[], proto.Call[T]], timeout: float | None) -> T:
        async with self._send_lock:
            await trio.lowlevel.checkpoint_if_cancelled()  # nothing sent for a cancelled caller
            call = make()
            await self._write(self._session.data_to_send())
        try:
            with _bound(timeout):
                await self._pump(lambda: call.done)
        except BaseException:
            call.abandon()  # its reply is dropped; a turn it was granted is given back
            await self._flush()
            raise
        return call.result()

    async def next_message(self, timeout: float | None = None) -> proto.ServerMessage:
        """The next non-reply line (queued ones first); None `timeout` waits forever."""
        with _bound(timeout):
            while (msg := self._session.next_event()) is None:
                await self._pump(lambda: bool(self._session.events))
        return msg

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.release_timeout) as bound:
                await self.release(t, park)
            if bound.cancelled_caught:
                await self.aclose()
                if loud:
                    raise Unreachable(release_stuck(self.release_timeout))
