"""The sans-IO client session (proto/session.py), table-driven: requests are sent, server
bytes are fed (whole, and again one byte at a time), replies, events and exceptions are
asserted. No sockets, no trio."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpu_slicer import proto
from gpu_slicer.proto import (
    Call,
    ClientError,
    ClientSession,
    ErrorCode,
    Event,
    Fault,
    Faulted,
    Ok,
    ParkAsk,
    ProtocolError,
    RemoteProtocolError,
    Turn,
    Unreachable,
    Waiting,
)

W1 = Turn("w", 1, False, 0)


@dataclass(frozen=True)
class Raises:
    """An expected exception: its type and wire code."""

    type: type[Exception]
    code: str


def ping(s: ClientSession) -> Call[Any]:
    return s.ping()


def acquire(s: ClientSession) -> Call[Any]:
    return s.acquire("w")


def release(s: ClientSession) -> Call[Any]:
    return s.release(W1)


def status(s: ClientSession) -> Call[Any]:
    return s.status()


def acquire_b(s: ClientSession) -> Call[Any]:
    return s.acquire("b")


def parked(s: ClientSession) -> Call[Any]:
    return s.parked("w", 1)


def unregister(s: ClientSession) -> Call[Any]:
    return s.unregister("w")


def register(s: ClientSession) -> Call[Any]:
    return s.register("w", pid=42, park="cooperative", parked_max="4GiB")


@dataclass
class Case:
    id: str
    calls: list[Callable[[ClientSession], Call[Any]]]
    data: bytes
    results: list[object]  # a call's value, or Raises
    events: list[object] = field(default_factory=list)
    feed: Raises | None = None  # what receive_data raised first
    failed: bool = False


def malformed(
    id: str, calls: list[Callable[[ClientSession], Call[Any]]], data: bytes, code: str
) -> Case:
    """A line the session cannot read: the feed and every pending call raise
    `RemoteProtocolError` with `code`, and the session is failed (out of step)."""
    fails = Raises(RemoteProtocolError, code)
    return Case(id, calls, data, [fails] * len(calls), feed=fails, failed=True)


CASES = [
    Case("ping", [ping], b"OK\n", [None]),
    Case("crlf", [ping], b"OK\r\n", [None]),
    Case(
        "pipelined replies go to their requests in order",
        [register, acquire, status, release],
        b"OK workload=w gpu=0 state=registered\nOK turn=7 restored=1 waited_ms=12\n"
        b'OK {"gpus":[]}\nERR not-holder -- turn 1 is not current\n',
        [
            {"workload": "w", "gpu": "0", "state": "registered"},
            Turn("w", 7, True, 12),
            {"gpus": []},
            Raises(ClientError, "not-holder"),
        ],
    ),
    Case(
        "WAITING then the grant",
        [acquire],
        b"WAITING w turn=3 waiters=1\nOK turn=4 restored=0 waited_ms=0\n",
        [Turn("w", 4, False, 0)],
        events=[Waiting("w", 3, 1)],
    ),
    Case(
        "FAULT mid-request raises Faulted after its OK",
        [acquire],
        b"FAULT w turn=1 reason=restore-failed -- boom\nOK turn=2 restored=1 waited_ms=0\n",
        [Raises(Faulted, "fault")],
        events=[Fault("w", 1, "restore-failed", "boom")],
    ),
    Case(
        "FAULT then ERR: Faulted with the ERR's code",
        [release],
        b"FAULT w turn=1 reason=lock-failed\nERR park-failed -- park of w: lock-failed\n",
        [Raises(Faulted, "park-failed")],
        events=[Fault("w", 1, "lock-failed")],
    ),
    Case(
        "a FAULT marks every call of its workload still pending when it arrives",
        [acquire, release, parked, unregister, ping],
        b"OK turn=1 restored=0 waited_ms=0\nFAULT w turn=1 reason=x\nOK\nOK\nOK\nOK\n",
        [W1, Raises(Faulted, "fault"), Raises(Faulted, "fault"), Raises(Faulted, "fault"), None],
        events=[Fault("w", 1, "x")],
    ),
    Case(
        "a FAULT of another workload leaves this one's grant alone",
        [acquire_b, register, status],
        b"FAULT a turn=3 reason=restore-failed\nOK turn=7 restored=0 waited_ms=5\n"
        b'OK workload=w gpu=0 state=registered\nOK {"gpus":[]}\n',
        [
            Turn("b", 7, False, 5),
            {"workload": "w", "gpu": "0", "state": "registered"},
            {"gpus": []},
        ],
        events=[Fault("a", 3, "restore-failed")],
    ),
    Case(
        "PARK ask and EVENT lines are queued, replies are not",
        [ping],
        b'PARK w turn=1 timeout_ms=500\nEVENT {"event":"granted","turn":2}\nOK\n',
        [None],
        events=[ParkAsk("w", 1, 500), Event({"event": "granted", "turn": 2})],
    ),
    Case(
        "an unknown ERR code stays a string",
        [ping],
        b"ERR brand-new-code -- from a newer server\n",
        [Raises(ClientError, "brand-new-code")],
    ),
    Case(
        "a newer server's event (an unknown verb) is skipped; the call gets its reply",
        [ping],
        b"MIGRATED w turn=3\nBOGUS line -- with text\nOK\n",
        [None],
    ),
    malformed(
        "a malformed event fails the session: every pending call, at once",
        [ping, acquire],
        b"FAULT w\nOK\n",
        "missing-argument",
    ),
    malformed(
        "a malformed reply fails the session, not only its own call",
        [ping, ping],
        b"OK stray-positional\nOK\n",
        "bad-argument",
    ),
    Case(
        "the lines before a malformed one are taken",
        [ping, ping],
        b"OK\nWAITING w turn=1 waiters=1\n\xff\xfe\nOK\n",
        [None, Raises(RemoteProtocolError, "bad-encoding")],
        events=[Waiting("w", 1, 1)],
        feed=Raises(RemoteProtocolError, "bad-encoding"),
        failed=True,
    ),
    malformed("a lower-case verb is no event: malformed", [ping], b"okay\n", "unknown-verb"),
    malformed(
        "an indented OK is not taken for a newer server's event", [ping], b" OK\n", "unknown-verb"
    ),
    malformed("a blank line is malformed", [ping], b"\r\n", "empty"),
    Case(
        "a reply of the wrong shape fails its call",
        [acquire, status],
        b"OK restored=1\nOK ok=1\n",
        [Raises(RemoteProtocolError, "bad-argument"), Raises(RemoteProtocolError, "bad-argument")],
    ),
    Case(
        "a reply to nothing puts the stream out of step",
        [ping],
        b"OK\nOK\n",
        [None],
        feed=Raises(RemoteProtocolError, "internal"),
        failed=True,
    ),
    Case(
        "an ERR to nothing is the server refusing the connection",
        [],
        b"ERR limit -- too many connections\n",
        [],
        feed=Raises(ClientError, "limit"),
        failed=True,
    ),
    malformed(
        "a line over the limit fails every pending call",
        [ping],
        b"EVENT " + b"x" * proto.MAX_SERVER_LINE,
        "line-too-long",
    ),
]


def _check(outcome: object, fn: Callable[[], object]) -> None:
    if isinstance(outcome, Raises):
        with pytest.raises(outcome.type) as e:
            fn()
        code = getattr(e.value, "code", None)
        assert str(code) == outcome.code, e.value
    else:
        assert fn() == outcome


def _chunks(data: bytes, split: str) -> list[bytes]:
    if split == "whole":
        return [data]
    step = 4096 if len(data) > 100_000 else 1
    return [data[i : i + step] for i in range(0, len(data), step)]


@pytest.mark.parametrize("split", ["whole", "bytes"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_session(case: Case, split: str) -> None:
    s = ClientSession()
    calls = [make(s) for make in case.calls]
    assert s.pending == len(calls)
    raised: Exception | None = None
    for chunk in _chunks(case.data, split):
        try:
            s.receive_data(chunk)
        except (ClientError, ProtocolError) as e:
            raised = raised or e
            if s.failed:
                break
    if case.feed is None:
        assert raised is None
    else:
        assert isinstance(raised, case.feed.type), raised
        assert str(getattr(raised, "code", None)) == case.feed.code, raised
    for call, outcome in zip(calls, case.results, strict=True):
        assert call.done
        _check(outcome, call.result)
    assert list(s.events) == case.events
    assert s.failed == case.failed
    assert s.pending == 0


def test_a_failed_session_refuses_every_later_call_at_once() -> None:
    """Out of step after a line it could not read, the session never waits again: a call
    made later raises at once instead of waiting for a reply that is not its own."""
    s = ClientSession("w")
    first = s.ping()
    assert s.data_to_send() == b"PING\n"
    with pytest.raises(RemoteProtocolError) as e:
        s.receive_data(b"GARBAGE\x00 \xc3\n")
    assert e.value.code == ErrorCode.BAD_ENCODING and "from the server" in e.value.message
    with pytest.raises(RemoteProtocolError):
        first.result()
    for later in (s.ping, s.acquire, s.status):
        with pytest.raises(RemoteProtocolError):
            later()
    with pytest.raises(RemoteProtocolError):
        s.receive_data(b"OK\n")  # whatever comes after cannot be matched any more
    with pytest.raises(RemoteProtocolError):
        s.next_event()
    assert s.failed and s.pending == 0 and s.data_to_send() == b""


def test_unknown_verbs_are_counted_not_queued() -> None:
    s = ClientSession("w")
    call = s.acquire()
    assert s.receive_data(b"MIGRATED w turn=3\nNEW_THING x=1\n") == []
    s.receive_data(b"OK turn=4 restored=1 waited_ms=0\n")
    assert call.result() == Turn("w", 4, True, 0)
    assert s.skipped == 2 and not s.events and not s.failed


def test_preempted_is_an_event_for_the_holder() -> None:
    s = ClientSession("w")
    call = s.acquire()
    s.receive_data(b"OK turn=4 restored=0 waited_ms=0\n")
    assert call.result().turn == 4
    assert s.receive_data(b"PREEMPTED w turn=4\n") == [proto.Preempted("w", 4)]
    assert s.next_event() == proto.Preempted("w", 4) and s.skipped == 0


def test_early_is_an_event_before_the_grant_of_an_acquire_that_asked() -> None:
    s = ClientSession("w")
    seen: list[proto.ServerMessage] = []
    s.on_event = seen.append
    call = s.acquire(wait=5, early=4096)
    assert s.data_to_send() == b"ACQUIRE w wait=5.0 early=4096\n"
    assert s.receive_data(b"EARLY w bytes=4096\n") == [proto.Early("w", 4096)]
    assert not call.done and seen == [proto.Early("w", 4096)]
    s.receive_data(b"OK turn=2 restored=1 waited_ms=9\n")
    assert call.result() == Turn("w", 2, True, 9)
    assert s.next_event() == proto.Early("w", 4096) and s.skipped == 0


def test_has_abandoned_acquire_until_its_reply_is_read() -> None:
    """What the async clients read for in the background: an abandoned ACQUIRE not yet
    answered (a grant then owes a RELEASE)."""
    s = ClientSession("w")
    ping, acq = s.ping(), s.acquire()
    s.data_to_send()
    assert not s.has_abandoned_acquire
    ping.abandon()
    assert not s.has_abandoned_acquire  # only an ACQUIRE can be granted late
    acq.abandon()
    assert s.has_abandoned_acquire
    s.receive_data(b"OK\n")
    assert s.has_abandoned_acquire
    s.receive_data(b"OK turn=4 restored=0 waited_ms=0\n")
    assert not s.has_abandoned_acquire
    assert s.data_to_send() == b"RELEASE w turn=4\n"
    refused = s.acquire(wait=1.0)
    s.data_to_send()
    refused.abandon()
    assert s.has_abandoned_acquire
    s.receive_data(b"OK parked=0 park_ms=0\nERR timeout -- no turn within 1 s\n")
    assert not s.has_abandoned_acquire and s.data_to_send() == b"" and s.pending == 0


def test_the_lines_to_write_are_the_requests_encoded() -> None:
    s = ClientSession("w")
    assert s.register(pid=7, ask=True, fallback="checkpoint").line == (
        b"REGISTER w pid=7 fallback=checkpoint ask=1\n"
    )
    assert s.acquire(wait=2.5).line == b"ACQUIRE w wait=2.5\n"
    assert s.release(Turn("w", 3, True, 0), park="now").line == b"RELEASE w turn=3 park=now\n"
    assert s.parked("w", 3, ok=False).line == b"PARKED w turn=3 ok=0\n"
    assert s.unregister().line == b"UNREGISTER w\n"
    assert s.send(proto.Hello()).line == b"HELLO proto=1\n"
    assert s.pending == 6


def test_register_names_the_default_workload() -> None:
    s = ClientSession()
    with pytest.raises(ClientError) as e:
        s.acquire()
    assert e.value.code == "bad-request" and s.pending == 0
    s.register("trainer")
    assert s.workload == "trainer"
    assert s.acquire().line == b"ACQUIRE trainer\n"


def test_a_request_that_cannot_be_encoded_leaves_nothing_pending() -> None:
    s = ClientSession()
    with pytest.raises(ProtocolError) as e:
        s.acquire("bad name")
    assert e.value.code is ErrorCode.BAD_NAME and s.pending == 0
    ping = s.ping()
    s.receive_data(b"OK\n")
    assert ping.result() is None


def test_an_abandoned_call_takes_its_own_late_reply() -> None:
    s = ClientSession()
    slow = s.acquire("w")  # its caller timed out and went on
    fast = s.ping()
    s.receive_data(b"OK turn=5 restored=0 waited_ms=9000\n")
    assert slow.done and not fast.done
    s.receive_data(b"OK\n")
    assert fast.result() is None


def test_result_before_the_reply_is_a_transport_bug() -> None:
    s = ClientSession()
    call = s.ping()
    with pytest.raises(ProtocolError) as e:
        call.result()
    assert e.value.code is ErrorCode.INTERNAL


def test_a_lost_connection_fails_pending_and_later_calls_after_queued_events() -> None:
    s = ClientSession()
    call = s.acquire("w")
    s.receive_data(b"WAITING w turn=1 waiters=2\n")
    s.receive_eof()
    with pytest.raises(Unreachable) as e:
        call.result()
    assert e.value.code == "unreachable" and "closed" in e.value.text
    with pytest.raises(Unreachable):
        s.ping()
    assert s.next_event() == Waiting("w", 1, 2)  # what arrived is still readable
    with pytest.raises(Unreachable):
        s.next_event()
    s.connection_lost("later")  # the first failure stays
    with pytest.raises(Unreachable) as e:
        s.next_event()
    assert "closed" in e.value.text


def test_next_event_is_none_until_a_line_arrives() -> None:
    s = ClientSession()
    assert s.next_event() is None
    s.receive_data(b"FAULT w turn=0 ")
    assert s.next_event() is None
    s.receive_data(b"reason=gone\n")
    assert s.next_event() == Fault("w", 0, "gone")


def test_on_event_sees_each_line_as_it_is_queued() -> None:
    s = ClientSession()
    seen: list[proto.ServerMessage] = []
    s.on_event = seen.append
    s.ping()
    s.receive_data(b"WAITING w turn=1 waiters=1\nOK\nFAULT w turn=1 reason=r\n")
    assert seen == [Waiting("w", 1, 1), Fault("w", 1, "r")] == list(s.events)


def test_an_on_event_callback_that_raises_loses_no_line() -> None:
    """The callback's error goes to the caller, and every line of that data was taken:
    the next reply answers the next call (before the fix the OK after the raising WAITING
    was lost, and the STATUS reply below answered the PING)."""
    s = ClientSession("w")
    ping, status = s.ping(), s.status()
    seen: list[proto.ServerMessage] = []

    def boom(msg: proto.ServerMessage) -> None:
        seen.append(msg)
        raise RuntimeError("callback")

    s.on_event = boom
    with pytest.raises(RuntimeError, match="callback"):
        s.receive_data(b"WAITING w turn=1 waiters=1\nOK\nFAULT w turn=1 reason=r\n")
    assert seen == [Waiting("w", 1, 1)]  # raised at the first; the rest are still queued
    assert list(s.events) == [Waiting("w", 1, 1), Fault("w", 1, "r")]
    assert ping.done and ping.result() is None and not s.failed
    s.on_event = None
    s.receive_data(b'OK {"gpus": []}\n')
    assert status.result() == {"gpus": []} and s.pending == 0


def test_faulted_keeps_the_fault_and_the_reply() -> None:
    s = ClientSession()
    call = s.release(W1)
    s.receive_data(b"FAULT w turn=1 reason=lock-failed -- boom\nOK parked=0 park_ms=3\n")
    with pytest.raises(ClientError) as e:  # a Faulted is a ClientError
        call.result()
    assert isinstance(e.value, Faulted)
    assert e.value.fault == Fault("w", 1, "lock-failed", "boom")
    assert e.value.reply == Ok({"parked": "0", "park_ms": "3"})
    assert str(e.value) == "fault: w turn=1 lock-failed"
    later = s.ping()  # the OK was consumed with the FAULT: the next reply is the PING's
    s.receive_data(b"OK\n")
    assert later.result() is None and not later.fault


# ---- abandoned calls: a late grant is given back ------------------------------------


@dataclass(frozen=True)
class Send:
    """Make a call (it gets the next index)."""

    make: Callable[[ClientSession], Call[Any]]


@dataclass(frozen=True)
class Abandon:
    """The caller of call `index` stops waiting."""

    index: int


@dataclass(frozen=True)
class Feed:
    """Bytes from the server."""

    data: bytes


@dataclass(frozen=True)
class Wrote:
    """What `data_to_send` hands out now."""

    data: bytes


@dataclass(frozen=True)
class Lost:
    """The connection drops."""


Step = Send | Abandon | Feed | Wrote | Lost
GRANT5 = b"OK turn=5 restored=0 waited_ms=900\n"
RELEASED = b"OK parked=0 park_ms=0\n"


@dataclass
class Script:
    id: str
    steps: list[Step]
    results: dict[int, object] = field(default_factory=dict)  # index -> value or Raises
    events: list[object] = field(default_factory=list)


SCRIPTS = [
    Script(
        "an abandoned ACQUIRE's late grant is released, and that reply dropped",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Feed(GRANT5),
            Wrote(b"RELEASE w turn=5\n"),
            Feed(RELEASED),
            Wrote(b""),
        ],
    ),
    Script(
        "so is the grant of an ACQUIRE sent as a plain request",
        [
            Send(lambda s: s.send(proto.Acquire("w", 2.0))),
            Wrote(b"ACQUIRE w wait=2.0\n"),
            Abandon(0),
            Feed(GRANT5),
            Wrote(b"RELEASE w turn=5\n"),
            Feed(RELEASED),
        ],
    ),
    Script(
        "a grant read before its caller gave up is released when it does",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Feed(GRANT5),
            Abandon(0),
            Wrote(b"RELEASE w turn=5\n"),
            Feed(RELEASED),
            Wrote(b""),
        ],
    ),
    Script(
        "an abandoned ACQUIRE's ERR is dropped and nothing is owed",
        [Send(acquire), Wrote(b"ACQUIRE w\n"), Abandon(0), Feed(b"ERR timeout\n"), Wrote(b"")],
    ),
    Script(
        "a grant with a FAULT is released too; the RELEASE's ERR is dropped",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Feed(b"FAULT w turn=4 reason=x\n" + GRANT5),
            Wrote(b"RELEASE w turn=5\n"),
            Feed(b"ERR not-holder\n"),
            Wrote(b""),
        ],
        events=[Fault("w", 4, "x")],
    ),
    Script(
        "an ACQUIRE behind an abandoned one waits, then goes out behind the RELEASE",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Send(acquire),
            Send(ping),
            Wrote(b""),
            Feed(GRANT5),
            Wrote(b"RELEASE w turn=5\nACQUIRE w\nPING\n"),
            Feed(RELEASED + b"OK turn=6 restored=0 waited_ms=0\nOK\n"),
            Wrote(b""),
        ],
        results={1: Turn("w", 6, False, 0), 2: None},
    ),
    Script(
        "behind a refused abandoned ACQUIRE the held one goes out alone",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Send(acquire),
            Wrote(b""),
            Feed(b"ERR timeout\n"),
            Wrote(b"ACQUIRE w\n"),
            Feed(GRANT5),
        ],
        results={1: Turn("w", 5, False, 900)},
    ),
    Script(
        "a request other than ACQUIRE is not held back",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Send(ping),
            Wrote(b"PING\n"),
            Feed(GRANT5 + b"OK\n"),
            Wrote(b"RELEASE w turn=5\n"),
            Feed(RELEASED),
        ],
        results={1: None},
    ),
    Script(
        "a held call that is abandoned is never written",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Send(acquire),
            Abandon(1),
            Feed(b"ERR timeout\n"),
            Wrote(b""),
        ],
    ),
    Script(
        "a FAULT marks a held call of its workload",
        [
            Send(acquire),
            Wrote(b"ACQUIRE w\n"),
            Abandon(0),
            Send(acquire),
            Feed(b"FAULT w turn=0 reason=x\nERR timeout\n"),
            Wrote(b"ACQUIRE w\n"),
            Feed(b"ERR faulted\n"),
        ],
        results={1: Raises(Faulted, "faulted")},
        events=[Fault("w", 0, "x")],
    ),
    Script(
        "a lost connection fails held calls and owes nothing",
        [Send(acquire), Wrote(b"ACQUIRE w\n"), Abandon(0), Send(acquire), Lost(), Wrote(b"")],
        results={1: Raises(Unreachable, "unreachable")},
    ),
]


@pytest.mark.parametrize("split", ["whole", "bytes"])
@pytest.mark.parametrize("script", SCRIPTS, ids=[c.id for c in SCRIPTS])
def test_abandoned_calls(script: Script, split: str) -> None:
    s = ClientSession()
    calls: list[Call[Any]] = []
    for step in script.steps:
        match step:
            case Send(make):
                calls.append(make(s))
            case Abandon(index):
                calls[index].abandon()
                assert calls[index].abandoned
            case Feed(data):
                for chunk in _chunks(data, split):
                    s.receive_data(chunk)
            case Wrote(data):
                assert s.has_data_to_send == bool(data)
                assert s.data_to_send() == data
            case Lost():
                s.connection_lost("gone")
    for index, outcome in script.results.items():
        assert calls[index].done
        _check(outcome, calls[index].result)
    assert list(s.events) == script.events
    assert s.pending == 0 and not s.has_data_to_send


def test_abandoning_after_the_result_was_taken_owes_nothing() -> None:
    s = ClientSession()
    call = s.acquire("w")
    s.receive_data(GRANT5)
    assert call.result() == Turn("w", 5, False, 900)
    call.abandon()  # the caller has its turn: releasing it is the caller's business
    assert not call.abandoned and s.data_to_send() == b"ACQUIRE w\n"


def test_a_faulted_acquire_still_tells_its_granted_turn() -> None:
    s = ClientSession()
    call, ping_ = s.acquire("w"), s.ping()
    s.receive_data(b"FAULT w turn=1 reason=x\n" + GRANT5 + b"OK\n")
    with pytest.raises(Faulted):
        call.result()
    assert call.granted() == Turn("w", 5, False, 900)  # for the caller to release
    assert ping_.granted() is None and ping_.result() is None
    refused = s.acquire("w")
    s.receive_data(b"ERR busy\n")
    assert refused.granted() is None
