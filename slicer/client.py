"""Clients of slicerd: `AsyncSlicer` for trio programs, `Slicer` for plain blocking code.

Both speak the protocol through `proto` and share one rule: a request's reply is the next
`OK`/`ERR` line; `FAULT`, `WAITING` and `EVENT` lines that arrive before it are queued in
`events` (and passed to `on_event`). A trainer needs two lines:

    s = Slicer.from_env()                 # SLICER_SOCKET / SLICER_WORKLOAD from slicer-launch
    with s.turn():                        # blocks until granted, always releases
        train_step()
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.slicer.config import DEFAULT_SOCKET
from gpu_slicer.slicer.errors import SlicerError


class ClientError(SlicerError):
    """The daemon answered ERR; `code` is the wire code."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}" if text else code)
        self.code, self.text = code, text


class Unreachable(ClientError):
    """The daemon's socket cannot be reached (or the connection dropped)."""

    def __init__(self, text: str) -> None:
        super().__init__("unreachable", text)


class Faulted(ClientError):
    """A FAULT line arrived for our workload: its processes must stop."""

    def __init__(self, fault: proto.Fault) -> None:
        super().__init__("fault", f"{fault.workload} turn={fault.turn} {fault.reason}")
        self.fault = fault


@dataclass(frozen=True)
class Turn:
    """A granted turn."""

    workload: str
    turn: int
    restored: bool
    waited_ms: int


def socket_path(path: str | None = None) -> str:
    """The socket to use: explicit, else $SLICER_SOCKET, else the system default."""
    return path or os.environ.get("SLICER_SOCKET") or DEFAULT_SOCKET


def _ok_or_raise(msg: proto.Reply) -> proto.Ok:
    if isinstance(msg, proto.Err):
        raise ClientError(str(msg.code), msg.text)
    return msg


def _register_req(name: str, **kw: Any) -> proto.Register:
    if "park" in kw:
        kw["park"] = proto.ParkMode(kw["park"])
    if "fallback" in kw:
        kw["fallback"] = proto.ParkFallback(kw["fallback"])
    if isinstance(kw.get("parked_max"), str):
        kw["parked_max"] = proto.parse_size(kw["parked_max"])
    if kw.get("gpu") is not None:
        kw["gpu"] = str(kw["gpu"])
    return proto.Register(name, **kw)


def _turn(name: str, ok: proto.Ok) -> Turn:
    f = ok.fields
    return Turn(name, int(f["turn"]), f.get("restored") == "1", int(f.get("waited_ms", 0)))


class AsyncSlicer:
    """A trio connection to slicerd. Use `async with await AsyncSlicer.connect(...)`."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buf = proto.LineBuffer(proto.MAX_SERVER_LINE)
        self._lines: deque[bytes] = deque()
        self.events: deque[proto.ServerMessage] = deque()
        self.on_event: Callable[[proto.ServerMessage], None] | None = None
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, path: str | None = None) -> AsyncSlicer:
        """Connect to the daemon's socket."""
        where = socket_path(path)
        try:
            stream = await trio.open_unix_socket(where)
        except OSError as e:
            raise Unreachable(f"cannot connect to {where}: {e}") from e
        return cls(stream)

    async def __aenter__(self) -> AsyncSlicer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the daemon then ends our turn and registrations)."""
        await self._stream.aclose()

    async def _line(self) -> proto.ServerMessage:
        while not self._lines:
            try:
                data = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise Unreachable(f"connection lost: {e}") from e
            if not data:
                raise Unreachable("the daemon closed the connection")
            self._lines.extend(self._buf.feed(data))
        return proto.parse_server_line(self._lines.popleft())

    async def next_message(self) -> proto.ServerMessage:
        """The next line of any kind (queued events first)."""
        if self.events:
            return self.events.popleft()
        return await self._line()

    async def request(self, req: proto.Request) -> proto.Ok:
        """Send `req`, queue events until its reply; raise ClientError on ERR."""
        async with self._lock:
            try:
                await self._stream.send_all(proto.encode(req))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise Unreachable(f"connection lost: {e}") from e
            while True:
                msg = await self._line()
                if isinstance(msg, proto.Ok | proto.Err):
                    return _ok_or_raise(msg)
                self.events.append(msg)
                if self.on_event is not None:
                    self.on_event(msg)

    async def ping(self) -> None:
        """PING."""
        await self.request(proto.Ping())

    async def register(self, name: str, **kw: Any) -> dict[str, str]:
        """REGISTER (keywords: gpu, pid, tree, park, parked_max, fallback, ask)."""
        return (await self.request(_register_req(name, **kw))).fields

    async def acquire(self, name: str, wait: float | None = None) -> Turn:
        """ACQUIRE: block until granted."""
        return _turn(name, await self.request(proto.Acquire(name, wait)))

    async def release(self, name: str, turn: int, park: str = "lazy") -> dict[str, str]:
        """RELEASE turn `turn`."""
        return (await self.request(proto.Release(name, turn, proto.ReleasePark(park)))).fields

    async def unregister(self, name: str) -> None:
        """UNREGISTER."""
        await self.request(proto.Unregister(name))

    async def parked(self, name: str, turn: int, ok: bool = True) -> None:
        """PARKED: answer a PARK event (`ok` False: this registrant could not park it)."""
        await self.request(proto.Parked(name, turn, ok))

    async def send(self, req: proto.Request) -> None:
        """Send `req` without reading its reply: for a connection whose one reader task
        (see `next_message`) takes the reply like any other line."""
        try:
            await self._stream.send_all(proto.encode(req))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise Unreachable(f"connection lost: {e}") from e

    async def status(self) -> dict[str, Any]:
        """STATUS as a dict."""
        body = (await self.request(proto.Status())).body
        assert isinstance(body, dict)
        return body

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        """WATCH, then yield each event body."""
        await self.request(proto.Watch())
        while True:
            msg = await self.next_message()
            if isinstance(msg, proto.Event):
                yield msg.body


class Slicer:
    """A blocking connection to slicerd, for plain training loops and tools."""

    def __init__(
        self, path: str | None = None, workload: str | None = None, timeout: float = 30.0
    ) -> None:
        self.path = socket_path(path)
        self.workload = workload or os.environ.get("SLICER_WORKLOAD")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as e:
            self._sock.close()
            raise Unreachable(f"cannot connect to {self.path}: {e}") from e
        self._buf = proto.LineBuffer(proto.MAX_SERVER_LINE)
        self._lines: deque[bytes] = deque()
        self.events: deque[proto.ServerMessage] = deque()

    @classmethod
    def from_env(cls) -> Slicer:
        """Connect using SLICER_SOCKET and SLICER_WORKLOAD (set by slicer-launch)."""
        return cls()

    def __enter__(self) -> Slicer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def _line(self, timeout: float | None) -> proto.ServerMessage:
        self._sock.settimeout(timeout)
        while not self._lines:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                raise
            except OSError as e:
                raise Unreachable(f"connection lost: {e}") from e
            if not data:
                raise Unreachable("the daemon closed the connection")
            self._lines.extend(self._buf.feed(data))
        return proto.parse_server_line(self._lines.popleft())

    def next_message(self, timeout: float | None = None) -> proto.ServerMessage:
        """The next line of any kind (queued events first); None `timeout` waits forever."""
        if self.events:
            return self.events.popleft()
        return self._line(timeout)

    def request(self, req: proto.Request, timeout: float | None = 30.0) -> proto.Ok:
        """Send `req` and wait (at most `timeout`, None = forever) for its reply."""
        try:
            self._sock.sendall(proto.encode(req))
        except OSError as e:
            raise Unreachable(f"connection lost: {e}") from e
        fault: proto.Fault | None = None
        while True:
            msg = self._line(timeout)
            if isinstance(msg, proto.Ok | proto.Err):
                # The reply is consumed before a FAULT is raised, so the connection stays
                # in step (the next request reads its own reply).
                if fault is not None:
                    raise Faulted(fault)
                return _ok_or_raise(msg)
            self.events.append(msg)
            if isinstance(msg, proto.Fault):
                fault = msg

    def _name(self, name: str | None) -> str:
        name = name or self.workload
        if not name:
            raise ClientError("bad-request", "no workload name (set SLICER_WORKLOAD)")
        return name

    def register(self, name: str | None = None, **kw: Any) -> dict[str, str]:
        """REGISTER (keywords: gpu, pid, tree, park, parked_max, fallback, ask)."""
        name = self._name(name)
        self.workload = name
        return self.request(_register_req(name, **kw)).fields

    def acquire(self, name: str | None = None, wait: float | None = None) -> Turn:
        """ACQUIRE: block until granted (or `wait` seconds: ClientError timeout)."""
        name = self._name(name)
        return _turn(name, self.request(proto.Acquire(name, wait), timeout=None))

    def release(self, t: Turn, park: str = "lazy") -> dict[str, str]:
        """RELEASE the turn `t`."""
        req = proto.Release(t.workload, t.turn, proto.ReleasePark(park))
        return self.request(req, timeout=None).fields

    def status(self) -> dict[str, Any]:
        """STATUS as a dict."""
        body = self.request(proto.Status()).body
        assert isinstance(body, dict)
        return body

    @contextlib.contextmanager
    def turn(
        self, name: str | None = None, wait: float | None = None, park: str = "lazy"
    ) -> Iterator[Turn]:
        """Hold a turn for the `with` body; released on the way out, exceptions included."""
        t = self.acquire(name, wait)
        try:
            yield t
        finally:
            self.release(t, park)
