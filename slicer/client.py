"""Clients of slicerd: `Slicer` for plain blocking code, `AsyncSlicer` for trio programs.

Both are thin transports over one sans-IO `proto.ClientSession`, which owns the protocol:
the reply to each request (pipelined ones included), the `FAULT`, `WAITING`, `PARK` and
`EVENT` lines that arrive between replies (queued in `events`, each also passed to
`on_event`), and which exception a failure is. So the two have the same methods with the
same signatures and raise alike: `ClientError` on ERR (`code` is the wire code), `Faulted`
when a FAULT arrived while a request waited (its reply was read first), `Unreachable` when
the daemon cannot be reached or the connection dropped, `proto.RemoteProtocolError` for a
daemon that broke the protocol. A `timeout` that passes raises the transport's own error:
`TimeoutError` (blocking), `trio.TooSlowError` (trio); the request is abandoned in the
session (its late reply is dropped, so the connection stays in step, and a turn its ACQUIRE
was granted meanwhile is released at once: `proto.Call.abandon`). A trainer needs two lines:

    s = Slicer.from_env()                 # SLICER_SOCKET / SLICER_WORKLOAD from slicer-launch
    with s.turn():                        # blocks until granted, always releases
        train_step()

and a trio program ``async with await AsyncSlicer.connect() as s, s.turn(): ...``.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import trio

from gpu_slicer import proto
from gpu_slicer.proto import ClientError, Faulted, Turn, Unreachable
from gpu_slicer.slicer.config import DEFAULT_SOCKET

__all__ = [
    "RELEASE_TIMEOUT",
    "REPLY_TIMEOUT",
    "AsyncSlicer",
    "ClientError",
    "Faulted",
    "Slicer",
    "Turn",
    "Unreachable",
    "socket_path",
]

T = TypeVar("T")
REPLY_TIMEOUT = 30.0
"""Default bound (seconds) on the reply to a request that is answered at once."""
RELEASE_TIMEOUT = 600.0
"""Bound (seconds) on the RELEASE at the end of `turn()` (each client's `release_timeout`).
A RELEASE waits for a park of the workload when the daemon parks it there (``park=now``,
or a waiter needs the room): with the default limits at most the registrant's answer
(60 s) then cuda-checkpoint (120 s). Past the bound the daemon is taken as stuck and the
connection is closed (the daemon then ends the turn, if it still can)."""
RECV_SIZE = 65536
WRITE_TIMEOUT = 10.0  # a request line only blocks while the daemon reads nothing


def socket_path(path: str | None = None) -> str:
    """The socket to use: explicit, else $SLICER_SOCKET, else the system default."""
    return path or os.environ.get("SLICER_SOCKET") or DEFAULT_SOCKET


class Slicer:
    """A blocking connection to slicerd, for plain training loops and tools.

    `workload` (default $SLICER_WORKLOAD) is the name used when a call is given none;
    `timeout` bounds the connect and each write; `release_timeout` (`RELEASE_TIMEOUT`)
    bounds the release at the end of `turn`.
    """

    def __init__(
        self, path: str | None = None, workload: str | None = None, timeout: float = 30.0
    ) -> None:
        self.path = socket_path(path)
        self.timeout = timeout
        self.release_timeout = RELEASE_TIMEOUT
        self._session = proto.ClientSession(workload or os.environ.get("SLICER_WORKLOAD"))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as e:
            self._sock.close()
            raise Unreachable(f"cannot connect to {self.path}: {e}") from e

    @classmethod
    def from_env(cls) -> Slicer:
        """Connect using SLICER_SOCKET and SLICER_WORKLOAD (set by slicer-launch)."""
        return cls()

    def __enter__(self) -> Slicer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (the daemon then ends our turn and registrations)."""
        self._session.connection_lost("the client closed the connection")
        self._sock.close()

    @property
    def workload(self) -> str | None:
        """The name used when a call is given none (set by `register`)."""
        return self._session.workload

    @workload.setter
    def workload(self, name: str | None) -> None:
        self._session.workload = name

    @property
    def events(self) -> deque[proto.ServerMessage]:
        """Non-reply lines received and not yet taken by `next_message`."""
        return self._session.events

    @property
    def on_event(self) -> Callable[[proto.ServerMessage], None] | None:
        """Called with each non-reply line as it arrives (must not block)."""
        return self._session.on_event

    @on_event.setter
    def on_event(self, fn: Callable[[proto.ServerMessage], None] | None) -> None:
        self._session.on_event = fn

    def _read(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(RECV_SIZE)
        except TimeoutError:
            raise
        except OSError as e:
            self._session.connection_lost(f"connection lost: {e}")
            return
        if not data:
            self._session.receive_eof()
            return
        try:
            self._session.receive_data(data)
        finally:
            self._flush()  # what the replies made the session owe (a RELEASE, held calls)

    def _flush(self) -> None:
        data = self._session.data_to_send()
        if not data:
            return
        self._sock.settimeout(self.timeout)
        try:
            self._sock.sendall(data)
        except OSError as e:  # a line cut off leaves the stream unusable
            self._session.connection_lost(f"connection lost: {e}")
            raise Unreachable(f"connection lost: {e}") from e

    def _call(self, call: proto.Call[T], timeout: float | None) -> T:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._flush()
            while not call.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no reply within {timeout:g} s")
                self._read(left)
        except BaseException:
            call.abandon()  # its reply is dropped; a turn it was granted is given back
            raise
        return call.result()

    def next_message(self, timeout: float | None = None) -> proto.ServerMessage:
        """The next non-reply line (queued ones first); None `timeout` waits forever."""
        while (msg := self._session.next_event()) is None:
            self._read(timeout)
        return msg

    def request(self, req: proto.Request, timeout: float | None = REPLY_TIMEOUT) -> proto.Ok:
        """Send `req` and wait (at most `timeout`, None = forever) for its reply."""
        return self._call(self._session.send(req), timeout)

    def ping(self) -> None:
        """PING."""
        self._call(self._session.ping(), REPLY_TIMEOUT)

    def register(self, name: str | None = None, **kw: Any) -> dict[str, str]:
        """REGISTER (keywords: gpu, pid, tree, park, parked_max, fallback, ask); `name`
        becomes the default workload of later calls."""
        return self._call(self._session.register(name, **kw), REPLY_TIMEOUT)

    def acquire(self, name: str | None = None, wait: float | None = None) -> Turn:
        """ACQUIRE: block until granted (or `wait` seconds: ClientError timeout)."""
        return self._call(self._session.acquire(name, wait), None)

    def release(self, t: Turn, park: str = "lazy") -> dict[str, str]:
        """RELEASE the turn `t` (`park` "lazy" or "now")."""
        return self._call(self._session.release(t, park), None)

    def parked(self, name: str, turn: int, ok: bool = True) -> None:
        """PARKED: answer a PARK (`ok` False: this registrant could not park it)."""
        self._call(self._session.parked(name, turn, ok), REPLY_TIMEOUT)

    def unregister(self, name: str | None = None) -> None:
        """UNREGISTER."""
        self._call(self._session.unregister(name), REPLY_TIMEOUT)

    def status(self) -> dict[str, Any]:
        """STATUS as a dict."""
        return self._call(self._session.status(), REPLY_TIMEOUT)

    def watch(self) -> Iterator[dict[str, Any]]:
        """WATCH, then yield each event body, forever."""
        self._call(self._session.watch(), REPLY_TIMEOUT)
        while True:
            msg = self.next_message()
            if isinstance(msg, proto.Event):
                yield msg.body

    @contextlib.contextmanager
    def turn(
        self, name: str | None = None, wait: float | None = None, park: str = "lazy"
    ) -> Iterator[Turn]:
        """Hold a turn for the `with` body; released on the way out, exceptions included.

        The release is bounded by `release_timeout`: past it the connection is closed and,
        when the body ended normally, `Unreachable` is raised. An ACQUIRE that raises
        `Faulted` with a granted turn releases that turn before the `Faulted` goes on."""
        call = self._session.acquire(name, wait)
        try:
            t = self._call(call, None)
        except Faulted:
            if (granted := call.granted()) is not None:
                with contextlib.suppress(ClientError, proto.ProtocolError):
                    self._end_turn(granted, park, loud=False)
            raise
        finished = False
        try:
            yield t
            finished = True
        finally:
            self._end_turn(t, park, loud=finished)

    def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        try:
            self._call(self._session.release(t, park), self.release_timeout)
        except TimeoutError:
            self.close()
            if loud:
                raise Unreachable(_stuck(self.release_timeout)) from None


def _stuck(bound: float) -> str:
    return f"no reply to RELEASE within {bound:g} s: the connection was closed"


def _bound(timeout: float | None) -> contextlib.AbstractContextManager[trio.CancelScope]:
    return trio.fail_after(math.inf if timeout is None else timeout)


class AsyncSlicer:
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

    @property
    def workload(self) -> str | None:
        """The name used when a call is given none (set by `register`)."""
        return self._session.workload

    @workload.setter
    def workload(self, name: str | None) -> None:
        self._session.workload = name

    @property
    def events(self) -> deque[proto.ServerMessage]:
        """Non-reply lines received and not yet taken by `next_message`."""
        return self._session.events

    @property
    def on_event(self) -> Callable[[proto.ServerMessage], None] | None:
        """Called with each non-reply line as it arrives (must not block)."""
        return self._session.on_event

    @on_event.setter
    def on_event(self, fn: Callable[[proto.ServerMessage], None] | None) -> None:
        self._session.on_event = fn

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

        The release is shielded and bounded by `release_timeout`: past it the connection
        is closed and, when the body ended normally, `Unreachable` is raised. An ACQUIRE
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
        try:
            yield t
            finished = True
        finally:
            await self._end_turn(t, park, loud=finished)

    async def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.release_timeout) as bound:
                await self.release(t, park)
            if bound.cancelled_caught:
                await self.aclose()
                if loud:
                    raise Unreachable(_stuck(self.release_timeout))
