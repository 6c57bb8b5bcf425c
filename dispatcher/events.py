"""The dispatcher's declared event stream (``GET /v1/events``): what it does, as it happens.

Theory of operation
-------------------
The turn loop publishes every phase change and the steps of a turn (granted, woke,
load begin and end, serving, slept, released, each result committed, ...) to one
:class:`EventStream`. Each event is a flat JSON object with a ``seq`` (1, 2, 3, ... for
this process: a gap means lines were lost), ``t`` (``CLOCK_MONOTONIC`` seconds, the clock
of slicerd's WATCH events on the same node), ``time`` (Unix seconds) and ``event`` (its
kind); the kinds and their fields are listed in README.md ("Events"), a stable
interface. The log lines say the same for humans; programs read this.

A subscriber (one ``GET /v1/events``) gets a first line ``subscribed`` holding the loop's
state at that moment (its ``seq`` is the last one published before it), then every event
published after it, in order. Publishing never waits: each subscriber has a buffer of
``EVENT_BUFFER`` events, and one that falls that far behind is dropped from the stream
(the dispatcher never stalls for a slow reader): it still reads what was buffered, then a
last line ``dropped`` (its ``seq`` is that of the first event it missed), and its stream
ends. When the dispatcher stops, every stream ends with a line ``closed``.

:func:`follow_events` is the reader's side, for programs (the demo and benchmarks use it).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import httpx
import trio

__all__ = ["EVENT_BUFFER", "EventStream", "Subscription", "encode", "follow_events"]

EVENT_BUFFER = 4096  # events one subscriber may lag behind before it is dropped


class Subscription:
    """One reader's view of an :class:`EventStream`: an async iterator of events.

    Use it as a context manager (``with stream.subscribe(...) as sub``): leaving it
    unsubscribes, so a reader that goes away costs nothing more."""

    def __init__(self, stream: EventStream, first: dict[str, Any], limit: int) -> None:
        self._stream = stream
        self._buf: deque[dict[str, Any]] = deque([first])
        self._limit = limit
        self._last: dict[str, Any] | None = None  # the line that ends the stream
        self._done = False
        self._exited = False
        self._wakeup = trio.Event()

    def _offer(self, event: dict[str, Any]) -> None:
        if self._last is not None:
            return
        if len(self._buf) >= self._limit:
            self._end(_line(event["seq"], "dropped", buffer=self._limit,
                            reason=f"slow reader: {self._limit} events unread"))  # fmt: skip
        else:
            self._buf.append(event)
        self._wakeup.set()

    def _end(self, last: dict[str, Any]) -> None:
        if self._last is None:
            self._last = last
            self._stream._subscribers.discard(self)
            self._wakeup.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stream._subscribers.discard(self)
        self._buf.clear()
        self._done = True
        if not self._exited:
            self._exited = True
            self._stream._reader_gone()

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            if self._buf:
                return self._buf.popleft()
            if self._done:
                raise StopAsyncIteration
            if self._last is not None:
                self._done = True
                return self._last
            await self._wakeup.wait()
            self._wakeup = trio.Event()


def _line(seq: int, event: str, **fields: Any) -> dict[str, Any]:
    return {"seq": seq, "t": round(time.monotonic(), 6), "time": round(time.time(), 6),
            "event": event, **fields}  # fmt: skip


class EventStream:
    """Fan-out of the dispatcher's events to its subscribers (module docstring)."""

    def __init__(self, buffer: int = EVENT_BUFFER) -> None:
        self._seq = 0
        self._buffer = buffer
        self._subscribers: set[Subscription] = set()
        self._closed = False
        self._readers = 0  # subscriptions not yet exited (their streams may still write)
        self._no_readers = trio.Event()
        self._no_readers.set()

    @property
    def subscribers(self) -> int:
        """How many readers are subscribed now."""
        return len(self._subscribers)

    def publish(self, event: str, **fields: Any) -> dict[str, Any]:
        """Stamp ``event`` (its kind) with ``fields`` and hand it to every subscriber;
        never waits. Returns the event as published."""
        self._seq += 1
        out = _line(self._seq, event, **fields)
        for sub in list(self._subscribers):
            sub._offer(out)
        return out

    def subscribe(self, **state: Any) -> Subscription:
        """A new reader; its first event is ``subscribed`` with ``state`` (the loop's
        state now), then everything published after this call."""
        sub = Subscription(self, _line(self._seq, "subscribed", **state), self._buffer)
        if self._readers == 0:
            self._no_readers = trio.Event()
        self._readers += 1
        if self._closed:
            sub._end(_line(self._seq, "closed"))
        else:
            self._subscribers.add(sub)
        return sub

    def close(self) -> None:
        """End every stream with a ``closed`` line (the dispatcher stops)."""
        self._closed = True
        for sub in list(self._subscribers):
            sub._end(_line(self._seq, "closed"))

    async def aclose(self, grace: float) -> None:
        """:meth:`close`, then wait up to ``grace`` seconds for every reader to have
        read its last line and left."""
        self.close()
        with trio.move_on_after(grace):
            await self._no_readers.wait()

    def _reader_gone(self) -> None:
        self._readers -= 1
        if self._readers == 0:
            self._no_readers.set()


def encode(event: dict[str, Any]) -> bytes:
    """One event as its line of the stream (compact JSON, ASCII, a newline)."""
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


async def follow_events(
    base_url: str,
    on_event: Callable[[dict[str, Any]], None],
    *,
    connect_timeout: float = 10.0,
    task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read ``GET /v1/events`` of the dispatcher at ``base_url`` and call ``on_event``
    with each event (the ``subscribed`` one included) until the stream ends (after its
    ``closed`` or ``dropped`` line, or when the connection closes).

    ``task_status.started`` gets the ``subscribed`` event, so ``await nursery.start(...)``
    returns once every later event will be seen. Raises ``httpx.HTTPError`` when the
    dispatcher cannot be reached (bounded by ``connect_timeout``) or answers an error."""
    timeout = httpx.Timeout(connect_timeout, read=None)
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=timeout) as http,
        http.stream("GET", "/v1/events") as resp,
    ):
        resp.raise_for_status()
        started = ended = False
        try:
            # Read to the end even after the last line: leaving httpx's line iterator
            # half-read leaves its inner generators to the garbage collector.
            async for line in resp.aiter_lines():
                if not line.strip() or ended:
                    continue
                event = json.loads(line)
                on_event(event)
                if not started:
                    started = True
                    task_status.started(event)
                ended = event["event"] in ("dropped", "closed")
        except httpx.HTTPError:
            if not ended:
                raise  # cut off before its last line
