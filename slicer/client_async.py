"""The awaited calls both async clients share, written once over their transport.

`client_trio.AsyncSlicer` and `client_asyncio.AsyncioSlicer` differ only in how bytes move
and how a wait is bounded or shielded: each implements `_call` (send one request, wait for
its reply at most ``timeout``, abandon it on the way out if it did not get one),
`next_message` and `_end_turn` (the shielded, bounded RELEASE at the end of a turn). The
requests themselves (`ping` ... `watch`) and the shape of `turn` live here, so the two
loops offer the same API by construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from gpu_slicer import proto
from gpu_slicer.proto import ClientError, Faulted, Turn
from gpu_slicer.slicer.client_common import REPLY_TIMEOUT, SessionView

__all__ = ["AsyncCalls"]

T = TypeVar("T")


class AsyncCalls(SessionView):
    """The public awaited calls of a slicerd connection, over the transport's `_call`."""

    async def _call(self, make: Callable[[], proto.Call[T]], timeout: float | None) -> T:
        raise NotImplementedError  # each transport's own

    async def next_message(self, timeout: float | None = None) -> proto.ServerMessage:
        """The next non-reply line (queued ones first); None `timeout` waits forever."""
        raise NotImplementedError  # each transport's own

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        raise NotImplementedError  # each transport's own

    async def request(self, req: proto.Request, timeout: float | None = REPLY_TIMEOUT) -> proto.Ok:
        """Send `req` and wait (at most `timeout`, None = forever) for its reply."""
        return await self._call(lambda: self._session.send(req), timeout)

    async def ping(self) -> None:
        """PING."""
        await self._call(self._session.ping, REPLY_TIMEOUT)

    async def register(self, name: str | None = None, **kw: Any) -> dict[str, str]:
        """REGISTER (keywords: gpu, pid, tree, park, parked_max, fallback, ask); `name`
        becomes the default workload of later calls."""
        return await self._call(lambda: self._session.register(name, **kw), REPLY_TIMEOUT)

    async def acquire(self, name: str | None = None, wait: float | None = None) -> Turn:
        """ACQUIRE: wait until granted (or `wait` seconds: ClientError timeout)."""
        return await self._call(lambda: self._session.acquire(name, wait), None)

    async def release(self, t: Turn, park: str = "lazy") -> dict[str, str]:
        """RELEASE the turn `t` (`park` "lazy" or "now")."""
        return await self._call(lambda: self._session.release(t, park), None)

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
        normally, `Unreachable` is raised. An ACQUIRE that raises `Faulted` with a granted
        turn releases that turn before the `Faulted` goes on."""
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
        try:
            yield t
            finished = True
        finally:
            await self._end_turn(t, park, loud=finished)
