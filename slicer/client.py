"""Clients of slicerd: `Slicer` for plain blocking code, `AsyncioSlicer` for asyncio
programs (veRL, OpenRLHF, SkyRL, ...), `AsyncSlicer` for trio programs.

All three are thin transports over one sans-IO `proto.ClientSession`, which owns the
protocol: the reply to each request (pipelined ones included), the `FAULT`, `WAITING`,
`PARK` and `EVENT` lines that arrive between replies (queued in `events`, each also passed
to `on_event`), and which exception a failure is. So they have the same methods with the
same signatures and raise alike: `ClientError` on ERR (`code` is the wire code), `Faulted`
when a FAULT arrived while a request waited (its reply was read first), `Unreachable` when
the daemon cannot be reached or the connection dropped, `proto.RemoteProtocolError` for a
daemon that broke the protocol (a line it cannot read: the connection is then out of step,
so it is closed and every later call raises the same at once). A `timeout` that passes
raises the loop's own error: `TimeoutError` (blocking and asyncio), `trio.TooSlowError`
(trio); the request is abandoned in the session (its late reply is dropped, so the
connection stays in step: `proto.Call.abandon`). An async task cancelled while it waits
abandons its call the same way.

An abandoned ACQUIRE stays queued in slicerd (the protocol cannot withdraw it), and slicerd
counts its late grant as a turn of this connection until the client reads that grant and
RELEASEs it. The async clients read for it in the background as soon as the ACQUIRE is
abandoned (a task the client owns, a trio system task; `aclose` ends it), so the turn is
given back as soon as it is granted. The blocking `Slicer` has no background reader: it
gives the turn back at its next call (or `close`), so a blocking program that gives up an
ACQUIRE and then computes holds the GPU meanwhile. To give up without that, bound the wait
in slicerd instead: ``acquire(wait=S)`` / ``turn(wait=S)`` (``ERR timeout``, nothing late),
or make another call, or close. A trainer needs two lines:

    s = Slicer.from_env()                 # SLICER_SOCKET / SLICER_WORKLOAD from slicer-launch
    with s.turn():                        # blocks until granted, always releases
        train_step()

under asyncio ``async with await AsyncioSlicer.from_env() as s, s.turn(): ...``, and under
trio the same with `AsyncSlicer`. Code that may run under either loop (a library) calls
`connect_async`, which picks the client of the running loop.

This module is where all are imported from: `Slicer` lives here, `AsyncSlicer` in
`client_trio`, `AsyncioSlicer` in `client_asyncio`, and what they share (`socket_path`, the
timeouts) in `client_common`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import sniffio

from gpu_slicer import proto
from gpu_slicer.proto import ClientError, Faulted, Turn, Unreachable
from gpu_slicer.slicer.client_common import (
    HOLD_WARN,
    RECV_SIZE,
    RELEASE_TIMEOUT,
    REPLY_TIMEOUT,
    HoldWatch,
    SessionView,
    release_stuck,
    socket_path,
)
from gpu_slicer.slicer.client_common import WRITE_TIMEOUT as WRITE_TIMEOUT
from gpu_slicer.slicer.client_trio import AsyncSlicer

if TYPE_CHECKING:
    from gpu_slicer.slicer.client_asyncio import AsyncioSlicer

__all__ = [
    "HOLD_WARN",
    "RELEASE_TIMEOUT",
    "REPLY_TIMEOUT",
    "AsyncSlicer",
    "AsyncioSlicer",
    "ClientError",
    "Faulted",
    "Slicer",
    "Turn",
    "Unreachable",
    "connect_async",
    "socket_path",
]

T = TypeVar("T")


def __getattr__(name: str) -> Any:
    # Imported on first use: asyncio adds 0.1-0.2 s to the start of every blocking
    # trainer and CLI (measured here), which never use it.
    if name == "AsyncioSlicer":
        from gpu_slicer.slicer.client_asyncio import AsyncioSlicer

        return AsyncioSlicer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def connect_async(
    path: str | None = None, workload: str | None = None, timeout: float = 30.0
) -> AsyncSlicer | AsyncioSlicer:
    """`AsyncSlicer.connect` under trio, `AsyncioSlicer.connect` under asyncio (the
    running loop, as sniffio tells it): for code that may run under either."""
    library = sniffio.current_async_library()
    if library == "trio":
        return await AsyncSlicer.connect(path, workload, timeout)
    if library == "asyncio":
        from gpu_slicer.slicer.client_asyncio import AsyncioSlicer

        return await AsyncioSlicer.connect(path, workload, timeout)
    raise RuntimeError(f"no slicerd client for the {library} event loop (trio or asyncio)")


class Slicer(SessionView):
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

    def _read(self, timeout: float | None) -> None:
        # Below 0 reads as 0: a poll (settimeout(0) is non-blocking mode, whose "nothing
        # yet" is BlockingIOError, and a negative one is refused with ValueError).
        self._sock.settimeout(None if timeout is None else max(0.0, timeout))
        try:
            data = self._sock.recv(RECV_SIZE)
        except TimeoutError:
            raise
        except BlockingIOError:
            raise TimeoutError("no data within 0 s") from None
        except OSError as e:
            self._session.connection_lost(f"connection lost: {e}")
            return
        if not data:
            self._session.receive_eof()
            return
        try:
            self._session.receive_data(data)
        finally:
            if self._session.failed:
                # Out of step for good (a line it could not read): closing lets the daemon
                # end what this connection held, instead of at `close`.
                self._sock.close()
            else:
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
        """REGISTER (keywords: gpu, pid, tree, park, parked_max, fallback, ask,
        max_turn); `name` becomes the default workload of later calls."""
        return self._call(self._session.register(name, **kw), REPLY_TIMEOUT)

    def acquire(self, name: str | None = None, wait: float | None = None, early: int = 0) -> Turn:
        """ACQUIRE: block until granted (or `wait` seconds: ClientError timeout); `early`
        bytes ask for an early start (the `proto.Early` event; see `on_event`)."""
        return self._call(self._session.acquire(name, wait, early), None)

    def release(self, t: Turn, park: str = "lazy", used: bool = True) -> dict[str, str]:
        """RELEASE the turn `t` (`park` "lazy" or "now"; `used` False: no work done in it,
        counted by slicerd as an unused turn, or a wasted one when a park was paid)."""
        return self._call(self._session.release(t, park, used), None)

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
        when the body ended normally, `Unreachable` is raised. When the body raised, a
        release that fails (the daemon died meanwhile: `Unreachable`) does not replace its
        exception: it goes on (a failed connection is closed). An ACQUIRE that raises
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
        watch = HoldWatch(self.path, t, self.hold_warn)
        try:
            yield t
            finished = True
        finally:
            watch.stop()
            self._end_turn(t, park, loud=finished)

    def _end_turn(self, t: Turn, park: str, loud: bool) -> None:
        try:
            self._call(self._session.release(t, park), self.release_timeout)
        except TimeoutError:
            self.close()
            if loud:
                raise Unreachable(release_stuck(self.release_timeout)) from None
        except (ClientError, proto.ProtocolError) as e:
            if self._preempted(t, e):
                return
            if loud:
                raise
            # The body's own exception (KeyboardInterrupt included) is what the caller must
            # see, not the daemon's death found by the release.
            if self._session.failed:
                self.close()
