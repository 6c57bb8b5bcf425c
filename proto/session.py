"""The client side of one slicerd connection, sans-IO in the manner of h11.

A `ClientSession` never touches a socket. A transport asks it for a request's call,
writes what `data_to_send` returns, and feeds it whatever bytes it reads; the session says
which request each reply answers, what else arrived, and which exception a failure is. The
sync and trio clients (`gpu_slicer.slicer.client`) are such transports; an asyncio one is
as thin.

Theory of operation
-------------------
The server answers the requests of one connection in the order they were sent, each with
exactly one ``OK`` or ``ERR`` line, however long one of them waits (an ACQUIRE). Replies
are therefore matched to requests by position alone: `send` encodes a request and appends
its `Call` to a FIFO of pending calls, `data_to_send` hands out the lines in that same
order (the transport writes them so, under one writer at a time), and each reply completes
the oldest pending call. Requests may be pipelined.

``FAULT``, ``WAITING``, ``PARK`` and ``EVENT`` lines are not replies: they may arrive at
any moment and are queued, in order, in `events` for whoever reads the connection. A
``FAULT <w>`` also marks each call pending at that moment whose request names workload
``w`` (REGISTER, ACQUIRE, RELEASE, PARKED, UNREGISTER): its `Call.result` raises `Faulted`
once its reply has been read (the reply is consumed first, so the next reply still goes
to the next call). A FAULT of another workload, or a request that names none (PING,
STATUS), is left alone.

A call whose caller stopped waiting (a timeout, a cancellation) is `Call.abandon`ed: it
stays pending, its reply still arrives and is dropped with the call, so the connection
stays in step. One reply is not dropped: the grant of an abandoned ACQUIRE, which the
daemon counts as a turn this connection holds. The session then owes a ``RELEASE`` of that
turn (``park=lazy``), handed out by the next `data_to_send`, whose reply is dropped too.
Being sans-IO, it can only do so once the grant was read: until then the daemon counts
the turn as this connection's. `has_abandoned_acquire` tells a transport to keep reading
(the async clients do, in a task of their own).
Until the abandoned ACQUIRE is answered, an ACQUIRE sent meanwhile (and every call after
it) is held back, out of `data_to_send`: written behind the grant it would be answered
``ERR busy``; it goes out behind the owed RELEASE. A held call that is abandoned is never
written. A transport writes `data_to_send` after each call it makes, each `receive_data`
and each `Call.abandon`.

Failures. ``ERR`` becomes `ClientError` with the wire code, raised by `Call.result`. A
lost connection (`connection_lost`, `receive_eof`) fails every pending call and every
later `send` with `Unreachable`. A line the session cannot read puts the stream out of
step (was it a reply? to which call?) and fails the session for good with
`RemoteProtocolError`: every pending call, every later `send` and `receive_data` (the
lines before it in the same data are taken first). Such lines are a malformed line, a
line over the limit, and a reply while no call is pending (an ``ERR`` then is the server
refusing the connection, such as ``ERR limit``, and fails it as that `ClientError`). One
line is not malformed: a well-formed line whose verb is unknown (upper case, not ``OK`` or
``ERR``) is an event of a newer server (the contract: events may come at any time and are
never replies), and is skipped (counted in `skipped`).
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gpu_slicer.proto.client_errors import ClientError, Faulted, Unreachable
from gpu_slicer.proto.codec import encode
from gpu_slicer.proto.errors import ErrorCode, LineTooLong, ProtocolError, RemoteProtocolError
from gpu_slicer.proto.framing import LineBuffer
from gpu_slicer.proto.messages import (
    Acquire,
    Err,
    Fault,
    Ok,
    Parked,
    ParkFallback,
    ParkMode,
    Ping,
    Preempted,
    Register,
    Release,
    ReleasePark,
    Reply,
    Request,
    ServerMessage,
    Status,
    Unregister,
    Watch,
)
from gpu_slicer.proto.replies import parse_server_line
from gpu_slicer.proto.values import MAX_SERVER_LINE, parse_size

__all__ = ["Call", "ClientSession", "Turn"]

T = TypeVar("T")
Failure = Callable[[], Exception]
MAX_PREEMPTED = 1024  # PREEMPTED turns a session remembers (ClientSession.preempted)
_VERB = re.compile(rb"[A-Z][A-Z0-9_]{0,63}")


@dataclass(frozen=True)
class Turn:
    """A granted turn: ACQUIRE's ``OK turn=T restored=0|1 waited_ms=N``."""

    workload: str
    turn: int
    restored: bool
    waited_ms: int


class Call(Generic[T]):
    """One request of a session: `line` is its encoded request (the session hands it out
    through `data_to_send`); once `done` (its reply was read, or the connection failed),
    `result()` is the reply's value or raises."""

    def __init__(
        self,
        request: Request,
        line: bytes,
        convert: Callable[[Ok], T],
        session: ClientSession | None = None,
    ) -> None:
        self.request = request
        self.line = line
        self.reply: Reply | None = None
        self.fault: Fault | None = None  # the first FAULT that arrived while it waited
        self._convert = convert
        self._failure: Failure | None = None
        self._session = session
        self._abandoned = False
        self._delivered = False  # result() was asked: the caller has the outcome

    def __repr__(self) -> str:
        return f"<Call {self.line[:60]!r} reply={self.reply!r} fault={self.fault!r}>"

    @property
    def done(self) -> bool:
        """The reply was read, or no reply can come any more."""
        return self.reply is not None or self._failure is not None

    @property
    def abandoned(self) -> bool:
        """Its caller stopped waiting (`abandon`)."""
        return self._abandoned

    def abandon(self) -> None:
        """The caller stopped waiting for the reply (a timeout, a cancellation). The reply
        is dropped when it comes; a turn the ACQUIRE was (or is later) granted is released
        by the session once that grant is read (module docstring): the transport writes
        `data_to_send` next, and reads while `ClientSession.has_abandoned_acquire` if it
        wants the turn back before its next call. A call still held back is never
        written. No effect once `result` was asked for."""
        if self._abandoned or self._delivered or self._session is None:
            return
        self._abandoned = True
        self._session._on_abandon(self)

    def granted(self) -> Turn | None:
        """The turn an ACQUIRE's ``OK`` granted, FAULT or not (a `Faulted` result still
        leaves that turn held by the connection, to be released); None for any other
        request or reply, or before the reply."""
        if not isinstance(self.request, Acquire) or not isinstance(self.reply, Ok):
            return None
        try:
            return _turn(self.request.workload, self.reply)
        except (KeyError, ValueError):
            return None

    def result(self) -> T:
        """The reply's value (a dict of its fields, a `Turn`, a STATUS body, or None).

        Raises `Faulted` when a FAULT of the workload the request names arrived before
        the reply, `ClientError` on ERR, `Unreachable` when the connection was lost first,
        `RemoteProtocolError` for a malformed reply, and `ProtocolError` (internal) when
        the call is not done yet.
        """
        if self._failure is not None:
            self._delivered = True
            raise self._failure()
        reply = self.reply
        if reply is None:
            raise ProtocolError(ErrorCode.INTERNAL, f"{_verb(self.request)}: no reply yet")
        self._delivered = True
        if self.fault is not None:
            raise Faulted(self.fault, reply)
        if isinstance(reply, Err):
            raise ClientError(str(reply.code), reply.text)
        try:
            return self._convert(reply)
        except (KeyError, ValueError, TypeError) as exc:
            raise RemoteProtocolError(
                ErrorCode.BAD_ARGUMENT, f"{_verb(self.request)}: unexpected reply {reply}: {exc}"
            ) from None

    def _fail(self, failure: Failure) -> None:
        if not self.done:
            self._failure = failure


class ClientSession:
    """The protocol state of one client connection (module docstring).

    `workload` is the name a request uses when it is given none (set by `register`);
    `events` holds the non-reply lines not yet taken; `on_event`, when set, is called with
    each of them once the data that brought it was taken (synchronously: it must not
    block; what it raises goes to `receive_data`'s caller); `skipped` counts the
    lines of unknown verbs that were skipped (module docstring).
    """

    def __init__(self, workload: str | None = None, max_line: int = MAX_SERVER_LINE) -> None:
        self.workload = workload
        self.events: deque[ServerMessage] = deque()
        self.on_event: Callable[[ServerMessage], None] | None = None
        self.skipped = 0
        # (workload, turn) of every PREEMPTED seen (the events may have been taken): a
        # release of such a turn answered not-holder ended a turn already over.
        self.preempted: set[tuple[str, int]] = set()
        self._buffer = LineBuffer(max_line)
        self._pending: deque[Call[Any]] = deque()  # in the order their lines go out
        self._outbox: deque[Call[Any]] = deque()  # pending, line not handed out yet
        self._held: deque[Call[Any]] = deque()  # behind an abandoned ACQUIRE, not pending
        self._failure: Failure | None = None

    @property
    def pending(self) -> int:
        """How many calls wait for their reply (abandoned and held-back ones included)."""
        return len(self._pending) + len(self._held)

    @property
    def has_data_to_send(self) -> bool:
        """`data_to_send` has lines to hand out."""
        return bool(self._outbox)

    def data_to_send(self) -> bytes:
        """The request lines to write now, in order: those of the calls made since the
        last time, the RELEASE owed for an abandoned ACQUIRE's grant, and calls no longer
        held back (module docstring). Write them whole, before any line taken later."""
        data = b"".join(call.line for call in self._outbox)
        self._outbox.clear()
        return data

    @property
    def has_abandoned_acquire(self) -> bool:
        """An abandoned ACQUIRE still waits for its reply: should it be a grant, the daemon
        counts that turn as this connection's until the grant is read (and its RELEASE,
        then owed, written). A transport that wants the turn given back as soon as it is
        granted reads the connection until this is False."""
        return self._acquire_abandoned()

    @property
    def failed(self) -> bool:
        """No reply can come any more: the connection was lost or is out of step."""
        return self._failure is not None

    # -- requests ----------------------------------------------------------------------

    def send(self, request: Request) -> Call[Ok]:
        """Any request; its call's result is the `Ok` itself. Raises `ProtocolError` for
        a request that cannot be encoded (nothing is then pending) and the session's
        failure once it failed."""
        return self._send(request, _ok)

    def ping(self) -> Call[None]:
        """``PING``."""
        return self._send(Ping(), _none)

    def register(
        self,
        name: str | None = None,
        *,
        gpu: int | str | None = None,
        pid: int | None = None,
        tree: bool = True,
        park: str = "checkpoint",
        parked_max: int | str = 0,
        fallback: str = "none",
        ask: bool = False,
        max_turn: float | None = None,
    ) -> Call[dict[str, str]]:
        """``REGISTER``; `name` also becomes the session's `workload`. `parked_max` may
        be a size text (``4GiB``); `park` and `fallback` are the wire words; `max_turn`
        (seconds) opts into preemption."""
        name = self._name(name)
        self.workload = name
        size = parse_size(parked_max) if isinstance(parked_max, str) else parked_max
        req = Register(
            name,
            gpu=None if gpu is None else str(gpu),
            pid=pid,
            tree=tree,
            park=ParkMode(park),
            parked_max=size,
            fallback=ParkFallback(fallback),
            ask=ask,
            max_turn=max_turn,
        )
        return self._send(req, _fields)

    def acquire(
        self, name: str | None = None, wait: float | None = None, early: int = 0
    ) -> Call[Turn]:
        """``ACQUIRE``: its result is the granted `Turn` (`wait` None: no bound; `early`
        bytes: ask for an early start, announced by an `Early` event before the grant)."""
        name = self._name(name)
        return self._send(Acquire(name, wait, early), lambda ok: _turn(name, ok))

    def release(self, turn: Turn, park: str = "lazy", used: bool = True) -> Call[dict[str, str]]:
        """``RELEASE`` of `turn` (``park`` ``lazy`` or ``now``; `used` False: no work was
        done in it, so slicerd counts it as unused, or wasted when a park was paid)."""
        return self._send(Release(turn.workload, turn.turn, ReleasePark(park), used), _fields)

    def parked(self, name: str, turn: int, ok: bool = True) -> Call[None]:
        """``PARKED``: the registrant's answer to a ``PARK`` (`ok` False: it could not)."""
        return self._send(Parked(name, turn, ok), _none)

    def unregister(self, name: str | None = None) -> Call[None]:
        """``UNREGISTER``."""
        return self._send(Unregister(self._name(name)), _none)

    def status(self) -> Call[dict[str, Any]]:
        """``STATUS``: its result is the JSON body."""
        return self._send(Status(), _body)

    def watch(self) -> Call[None]:
        """``WATCH``: after its reply every line is an ``EVENT`` (queued in `events`)."""
        return self._send(Watch(), _none)

    def _name(self, name: str | None) -> str:
        name = name or self.workload
        if not name:
            raise ClientError("bad-request", "no workload name (set SLICER_WORKLOAD)")
        return name

    def _send(self, request: Request, convert: Callable[[Ok], T]) -> Call[T]:
        if self._failure is not None:
            raise self._failure()
        call = Call(request, encode(request), convert, self)
        if self._held or (isinstance(request, Acquire) and self._acquire_abandoned()):
            self._held.append(call)
        else:
            self._queue(call)
        return call

    def _queue(self, call: Call[Any]) -> None:
        self._pending.append(call)
        self._outbox.append(call)

    def _acquire_abandoned(self) -> bool:
        # An abandoned ACQUIRE still to be answered: its grant may come first.
        return any(c.abandoned and isinstance(c.request, Acquire) for c in self._pending)

    def _on_abandon(self, call: Call[Any]) -> None:
        if call in self._held:
            self._held.remove(call)  # never written, so nothing will answer it
        elif call.done:
            self._settle(call)

    def _settle(self, call: Call[Any]) -> None:
        # An abandoned call's outcome is nobody's, except a granted turn: slicerd counts
        # it as held by this connection, so give it back.
        turn = call.granted()
        if turn is not None and self._failure is None:
            release = Release(turn.workload, turn.turn)
            owed: Call[Any] = Call(release, encode(release), _fields, self)
            owed._abandoned = True
            self._queue(owed)

    def _answered(self, call: Call[Any]) -> None:
        if call.abandoned:
            self._settle(call)
        if self._held and not self._acquire_abandoned():
            while self._held:
                self._queue(self._held.popleft())

    # -- what arrives ------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray) -> list[ServerMessage]:
        """Take bytes read from the connection: complete the calls their replies answer
        and queue (and return) the other lines they complete.

        Raises the session's failure when it failed, now or before: `RemoteProtocolError`
        for a line it cannot read (the lines before it were taken), `ClientError` for an
        ``ERR`` that answers no request (module docstring). `on_event` is called once all
        of `data` was taken: an exception it raises goes on to the caller, and the
        session is in step all the same (each reply went to its call, each line is in
        `events`; the messages after the one whose callback raised are not passed to it).
        """
        if self._failure is not None:
            raise self._failure()
        try:
            lines = self._buffer.feed(bytes(data))
        except LineTooLong as exc:
            self._break(_remote(exc.code, f"from the server: {exc.message}"))
            raise self._failure_now() from None
        new: list[ServerMessage] = []
        for raw in lines:
            self._take(raw, new)
            if self._failure is not None:
                break
        # Only now: a callback raising in the middle of the lines would lose the rest,
        # and the next reply would answer the wrong call.
        if self.on_event is not None:
            for msg in new:
                self.on_event(msg)
        if self._failure is not None:
            raise self._failure_now()
        return new

    def receive_eof(self) -> None:
        """The daemon closed the connection."""
        self.connection_lost("the daemon closed the connection")

    def connection_lost(self, text: str) -> None:
        """The connection is gone (`text` says why): every pending and later call fails
        with `Unreachable`. A session that failed already keeps its first failure."""
        self._break(lambda: Unreachable(text))

    def next_event(self) -> ServerMessage | None:
        """The oldest queued non-reply line; None when there is none yet. Raises the
        session's failure when it failed and nothing is queued."""
        if self.events:
            return self.events.popleft()
        if self._failure is not None:
            raise self._failure()
        return None

    def _take(self, raw: bytes, new: list[ServerMessage]) -> None:
        try:
            msg = parse_server_line(raw)
        except ProtocolError as exc:
            if exc.code == ErrorCode.UNKNOWN_VERB and _unknown_event(raw):
                self.skipped += 1  # a newer server's event: never a reply, so still in step
                return
            what = "reply" if _is_reply(raw) else "line"
            self._break(_remote(exc.code, f"a malformed {what} from the server: {exc.message}"))
            return
        if isinstance(msg, Ok | Err):
            if self._pending:
                call = self._pending.popleft()
                call.reply = msg
                self._answered(call)
            elif isinstance(msg, Err):
                code, text = str(msg.code), msg.text
                self._break(lambda: ClientError(code, text))
            else:
                self._break(_remote(ErrorCode.INTERNAL, f"a reply that answers no request: {msg}"))
            return
        if isinstance(msg, Fault):
            for call in itertools.chain(self._pending, self._held):
                if call.fault is None and _names(call.request) == msg.workload:
                    call.fault = msg
        if isinstance(msg, Preempted):
            if len(self.preempted) >= MAX_PREEMPTED:
                self.preempted.clear()  # bounded: only a turn still being ended matters
            self.preempted.add((msg.workload, msg.turn))
        self.events.append(msg)
        new.append(msg)

    def _break(self, failure: Failure) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        for call in itertools.chain(self._pending, self._held):
            call._fail(failure)
        self._pending.clear()
        self._held.clear()
        self._outbox.clear()

    def _failure_now(self) -> Exception:
        assert self._failure is not None
        return self._failure()


def _verb(request: Request) -> str:
    return type(request).__name__.upper()


def _names(request: Request) -> str | None:
    if isinstance(request, Register | Acquire | Release | Parked | Unregister):
        return request.workload
    return None


def _is_reply(raw: bytes) -> bool:
    verb = raw.rstrip(b"\r").partition(b" ")[0]
    return verb in (b"OK", b"ERR")


def _unknown_event(raw: bytes) -> bool:
    # parse_server_line said unknown-verb: the line decoded, it is not blank, and its
    # first token (nothing before it: " OK" is malformed) is no server verb it knows.
    verb = raw.rstrip(b"\r").partition(b" ")[0]
    return _VERB.fullmatch(verb) is not None


def _remote(code: ErrorCode, text: str) -> Failure:
    return lambda: RemoteProtocolError(code, text)


def _ok(ok: Ok) -> Ok:
    return ok


def _none(ok: Ok) -> None:
    return None


def _fields(ok: Ok) -> dict[str, str]:
    return ok.fields


def _body(ok: Ok) -> dict[str, Any]:
    if not isinstance(ok.body, dict):
        raise TypeError("the reply has no JSON object body")
    return ok.body


def _turn(name: str, ok: Ok) -> Turn:
    f = ok.fields
    return Turn(name, int(f["turn"]), f.get("restored") == "1", int(f.get("waited_ms", "0")))
