"""The clients against a scripted peer: events between replies, FAULT in step. The blocking
`Slicer` talks to a thread over a Unix socket; `AsyncSlicer` to a trio task over memory
streams, with the same calls and the same exceptions."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import trio
import trio.testing

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, ClientError, Faulted, Slicer, Turn, Unreachable
from gpu_slicer.slicer.offload import Offloader, cooperative_turn
from tests.harness import running_stack

T = TypeVar("T")


@pytest.fixture
def scripted() -> Iterator[tuple[str, list[bytes]]]:
    """A one-connection Unix server that answers each request line with the next script
    entry; returns its path and the script list to fill."""
    with script_server([]) as served:
        yield served


@contextlib.contextmanager
def script_server(seen: list[bytes]) -> Iterator[tuple[str, list[bytes]]]:
    """The `scripted` server; each request line it reads is appended to `seen`."""
    path = str(Path(tempfile.mkdtemp()) / "s.sock")
    script: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rb") as f:
            for answer in script:
                if not (line := f.readline()):
                    return
                seen.append(line)
                conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield path, script
    t.join(5)
    srv.close()


def test_fault_before_a_reply_keeps_the_connection_in_step(
    scripted: tuple[str, list[bytes]],
) -> None:
    path, script = scripted
    script += [
        b"WAITING w turn=1 waiters=1\nFAULT w turn=1 reason=lock-failed -- boom\n"
        b"ERR park-failed -- park of w: lock-failed\n",
        b"OK\n",
    ]
    with Slicer(path, "w", timeout=5) as s:
        with pytest.raises(Faulted) as e:
            s.request(proto.Release("w", 1))
        assert e.value.fault.reason == "lock-failed"
        assert [type(m).__name__ for m in s.events] == ["Waiting", "Fault"]
        s.request(proto.Ping())  # reads its own OK, not the ERR of the RELEASE


def test_err_reply_raises_client_error_with_code(scripted: tuple[str, list[bytes]]) -> None:
    path, script = scripted
    script += [b"ERR not-holder -- this connection does not hold turn 3 of w\n"]
    with Slicer(path, "w", timeout=5) as s, pytest.raises(ClientError) as e:
        s.request(proto.Release("w", 3))
    assert e.value.code == "not-holder" and "turn 3" in e.value.text


def test_unreachable_socket() -> None:
    with pytest.raises(Unreachable) as e:
        Slicer("/nonexistent/slicer.sock")
    # The error says what to check, as the CLIs do; `text` stays the server's own words.
    assert "/nonexistent/slicer.sock" in str(e.value) and "$SLICER_SOCKET" in str(e.value)
    assert e.value.hint and "SLICER_SOCKET" not in e.value.text


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("exists", "the launcher already registered it"),
        ("unknown-workload", "$SLICER_WORKLOAD"),
        ("not-registrant", "the launcher"),
    ],
)
def test_a_refusal_a_library_user_meets_first_carries_the_clis_hint(code: str, says: str) -> None:
    e = ClientError(code, "the server's words")
    assert e.code == code and e.text == "the server's words" and says in e.hint
    assert str(e) == f"{code}: the server's words ({e.hint})"
    assert str(ClientError("busy", "x")) == "busy: x" and ClientError("busy", "x").hint == ""


def test_the_two_clients_have_the_same_calls() -> None:
    import inspect

    calls = ["request", "next_message", "ping", "register", "acquire", "release", "parked"]
    calls += ["unregister", "status", "watch", "turn"]
    for name in calls:
        sync, async_ = getattr(Slicer, name), getattr(AsyncSlicer, name)
        # The parameters, annotations included; only the return types differ (awaited).
        assert inspect.signature(sync).parameters == inspect.signature(async_).parameters, name


FAULT_SCRIPT = [
    b"WAITING w turn=1 waiters=1\nFAULT w turn=1 reason=lock-failed -- boom\n"
    b"ERR park-failed -- park of w: lock-failed\n",
    b"OK\n",
]


async def scripted_peer(
    stream: trio.abc.Stream,
    script: list[bytes],
    delay: float = 0,
    seen: list[bytes] | None = None,
) -> None:
    """Answer each request line read from `stream` with the next script entry (after
    `delay` virtual seconds); each line read is appended to `seen`."""
    buf = proto.LineBuffer()
    for answer in script:
        while not (lines := buf.feed(await stream.receive_some())):
            pass
        assert len(lines) == 1, lines
        if seen is not None:
            seen += lines
        await trio.sleep(delay)
        await stream.send_all(answer)


@contextlib.asynccontextmanager
async def scripted_async(
    script: list[bytes],
    workload: str | None = "w",
    delay: float = 0,
    seen: list[bytes] | None = None,
) -> AsyncIterator[tuple[AsyncSlicer, trio.Nursery, trio.abc.Stream]]:
    """An `AsyncSlicer` for `workload` over a memory stream whose far end (also yielded) is
    answered by `scripted_peer` in the nursery (yielded: a peer left waiting is cancelled
    there); the client is closed, then the peer waited for, on the way out."""
    ours, theirs = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as n, AsyncSlicer(ours, workload) as s:
        n.start_soon(scripted_peer, theirs, script, delay, seen)
        yield s, n, theirs


async def test_async_fault_before_a_reply_raises_faulted_like_the_blocking_one() -> None:
    with trio.fail_after(5):
        async with scripted_async(FAULT_SCRIPT) as (s, _, _):
            with pytest.raises(Faulted) as e:
                await s.release(Turn("w", 1, False, 0))
            assert e.value.fault.reason == "lock-failed" and e.value.code == "park-failed"
            assert [type(m).__name__ for m in s.events] == ["Waiting", "Fault"]
            await s.ping()  # reads its own OK, not the ERR of the RELEASE


def test_sync_fault_has_the_same_code_and_fault(scripted: tuple[str, list[bytes]]) -> None:
    path, script = scripted
    script += FAULT_SCRIPT
    with Slicer(path, "w", timeout=5) as s:
        with pytest.raises(Faulted) as e:
            s.release(Turn("w", 1, False, 0))
        assert e.value.fault.reason == "lock-failed" and e.value.code == "park-failed"
        s.ping()


async def test_a_reply_read_by_another_task_reaches_its_caller() -> None:
    """A registrant: one task reads FAULT/PARK lines, another answers a PARK; whichever
    reads the PARKED reply, the answering task gets it and the reader gets the FAULT."""
    with trio.fail_after(5):
        ours, theirs = trio.testing.memory_stream_pair()
        async with AsyncSlicer(ours, "v") as s, trio.open_nursery() as n:
            await theirs.send_all(b"PARK v turn=3 timeout_ms=1000\n")
            got: list[proto.ServerMessage] = []

            async def reader() -> None:
                while True:
                    got.append(await s.next_message())

            n.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [proto.ParkAsk("v", 3, 1000)]
            answer = b"ERR not-asked -- too late\nFAULT v turn=3 reason=still-resident\n"
            n.start_soon(scripted_peer, theirs, [answer])
            with pytest.raises(ClientError) as e:
                await s.parked("v", 3)
            assert e.value.code == "not-asked" and not isinstance(e.value, Faulted)
            await trio.testing.wait_all_tasks_blocked()
            assert got[1:] == [proto.Fault("v", 3, "still-resident")]
            n.cancel_scope.cancel()


async def test_a_timed_out_request_keeps_the_connection_in_step(autojump_clock: object) -> None:
    with trio.fail_after(600):
        grant = b"OK turn=9 restored=0 waited_ms=0\n"
        async with scripted_async([grant, b"OK\n"], None, 10) as (s, _, _):
            with pytest.raises(trio.TooSlowError):
                await s.request(proto.Acquire("w"), timeout=1)
            await s.ping()  # the late grant went to the ACQUIRE, the OK to the PING
            assert not s.events


async def test_async_lost_connection_is_unreachable() -> None:
    with trio.fail_after(5):
        ours, theirs = trio.testing.memory_stream_pair()
        async with AsyncSlicer(ours) as s:
            await theirs.aclose()
            with pytest.raises(Unreachable):
                await s.status()
            with pytest.raises(Unreachable):
                await s.next_message()


# ---- a line the client cannot read: the session fails for good ----------------------

GARBLED = b"FAULT w turn=1 reason=\xff\xfe\n"  # not UTF-8: was it a reply? nobody knows


def test_sync_a_garbled_line_fails_every_later_call_at_once_and_closes() -> None:
    """Before the fix the PING's abandoned call kept its place and the next call waited out
    its whole timeout (30 s) for a reply that would never be its own."""
    lines: list[bytes] = []
    path = str(Path(tempfile.mkdtemp()) / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    closed = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rb") as f:
            while line := f.readline():
                lines.append(line)
                conn.sendall(GARBLED)
        closed.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with Slicer(path, "w", timeout=5) as s:
            with pytest.raises(proto.RemoteProtocolError) as e:
                s.ping()
            assert e.value.code == proto.ErrorCode.BAD_ENCODING
            assert closed.wait(5)  # the client closed the connection itself
            for later in (s.ping, s.status, lambda: s.acquire(wait=1.0)):
                with pytest.raises(proto.RemoteProtocolError):
                    later()  # at once: nothing is even written
        assert lines == [b"PING\n"]
    finally:
        t.join(5)
        srv.close()


async def test_async_a_garbled_line_fails_every_later_call_at_once_and_closes(
    autojump_clock: object,
) -> None:
    with trio.fail_after(600):
        async with scripted_async([GARBLED]) as (s, _, theirs):
            with pytest.raises(proto.RemoteProtocolError):
                await s.ping()
            start = trio.current_time()
            for later in (s.ping, s.status, lambda: s.acquire(wait=1.0)):
                with pytest.raises(proto.RemoteProtocolError):
                    await later()
            assert trio.current_time() == start  # no wait, not even a virtual one
            assert await theirs.receive_some() == b""  # closed by the client itself


def test_sync_an_unknown_event_verb_is_skipped(scripted: tuple[str, list[bytes]]) -> None:
    """A newer server's event (an unknown verb) between replies changes nothing."""
    path, script = scripted
    script += [b"MIGRATED w turn=3\nOK\n", b"OK\n"]
    with Slicer(path, "w", timeout=5) as s:
        s.ping()
        s.ping()
        assert not s.events


# ---- a turn nobody waits for any more is given back --------------------------------

GRANT4 = b"OK turn=4 restored=0 waited_ms=0\n"
RELEASED = b"OK parked=0 park_ms=0\n"


async def read_lines(stream: trio.abc.Stream, buf: proto.LineBuffer, n: int = 1) -> list[bytes]:
    """At least `n` request lines from `stream`."""
    lines: list[bytes] = []
    while len(lines) < n:
        lines += buf.feed(await stream.receive_some())
    return lines


def test_sync_timed_out_acquire_s_late_grant_is_released_at_the_next_io() -> None:
    seen: list[bytes] = []
    with script_server(seen) as (path, script):
        script += [b"", GRANT4 + b"OK\n", RELEASED, b"OK\n"]
        with Slicer(path, "w", timeout=5) as s:
            with pytest.raises(TimeoutError):
                s.request(proto.Acquire("w"), timeout=0.05)
            s.ping()  # reads the late grant, then its own OK; the RELEASE goes out
            s.ping()  # its own OK, not the RELEASE's
            assert not s.events
    assert seen == [b"ACQUIRE w\n", b"PING\n", b"RELEASE w turn=4\n", b"PING\n"]


async def test_a_cancelled_acquire_s_late_grant_is_released_by_the_reader(
    autojump_clock: object,
) -> None:
    with trio.fail_after(600):
        ours, theirs = trio.testing.memory_stream_pair()
        buf = proto.LineBuffer()
        async with AsyncSlicer(ours, "w") as s, trio.open_nursery() as n:
            with trio.move_on_after(1):
                await s.acquire()
            assert await read_lines(theirs, buf) == [b"ACQUIRE w"]
            got: list[proto.ServerMessage] = []

            async def reader() -> None:
                while True:
                    got.append(await s.next_message())

            n.start_soon(reader)
            await theirs.send_all(GRANT4)
            # The reader task wrote it, with no call of ours in flight.
            assert await read_lines(theirs, buf) == [b"RELEASE w turn=4"]
            await theirs.send_all(RELEASED)
            n.start_soon(scripted_peer, theirs, [b"OK\n"])
            await s.ping()  # its own OK, not the RELEASE's
            assert got == []
            n.cancel_scope.cancel()


async def test_an_acquire_behind_a_cancelled_one_goes_out_behind_its_release(
    autojump_clock: object,
) -> None:
    """Written before the late grant, the second ACQUIRE would be answered ERR busy."""
    with trio.fail_after(600):
        ours, theirs = trio.testing.memory_stream_pair()
        buf = proto.LineBuffer()
        got: list[Turn] = []
        async with AsyncSlicer(ours, "w") as s, trio.open_nursery() as n:
            with trio.move_on_after(1):
                await s.acquire()
            assert await read_lines(theirs, buf) == [b"ACQUIRE w"]

            async def again() -> None:
                got.append(await s.acquire(wait=5.0))

            n.start_soon(again)
            await trio.testing.wait_all_tasks_blocked()
            await theirs.send_all(GRANT4)
            lines = await read_lines(theirs, buf, 2)
            assert lines == [b"RELEASE w turn=4", b"ACQUIRE w wait=5.0"]
            await theirs.send_all(RELEASED + b"OK turn=5 restored=1 waited_ms=3\n")
        assert got == [Turn("w", 5, True, 3)]


def test_sync_turn_of_b_is_not_faulted_by_a_fault_of_a() -> None:
    seen: list[bytes] = []
    with script_server(seen) as (path, script):
        script += [b"FAULT a turn=3 reason=restore-failed\nOK turn=7 restored=0 waited_ms=0\n"]
        script += [RELEASED]
        with Slicer(path, "a", timeout=5) as s:
            with s.turn("b") as t:
                assert t == Turn("b", 7, False, 0)
            assert [m.workload for m in s.events if isinstance(m, proto.Fault)] == ["a"]
    assert seen == [b"ACQUIRE b\n", b"RELEASE b turn=7\n"]


FAULTED_GRANT = b"FAULT w turn=3 reason=x\n" + GRANT4


def test_sync_turn_releases_a_grant_that_came_with_a_fault() -> None:
    seen: list[bytes] = []
    with script_server(seen) as (path, script):
        script += [FAULTED_GRANT, RELEASED, b"OK\n"]
        with Slicer(path, "w", timeout=5) as s:
            with pytest.raises(Faulted), s.turn():
                pytest.fail("the body of a faulted turn never runs")
            s.ping()  # in step: the RELEASE's reply was its own
    assert seen == [b"ACQUIRE w\n", b"RELEASE w turn=4\n", b"PING\n"]


async def test_async_turn_releases_a_grant_that_came_with_a_fault() -> None:
    with trio.fail_after(5):
        seen: list[bytes] = []
        async with scripted_async([FAULTED_GRANT, RELEASED, b"OK\n"], seen=seen) as (s, _, _):
            with pytest.raises(Faulted):
                async with s.turn():
                    pytest.fail("the body of a faulted turn never runs")
            await s.ping()
        assert seen == [b"ACQUIRE w", b"RELEASE w turn=4", b"PING"]


class Boom(Exception):
    """Raised inside a turn."""


async def test_async_turn_release_that_never_ends_closes_the_connection(
    autojump_clock: object,
) -> None:
    with trio.fail_after(600):
        async with scripted_async([GRANT4, b"", GRANT4, b""]) as (s, n, _):
            s.release_timeout = 30
            start = trio.current_time()
            with pytest.raises(Unreachable) as e:
                async with s.turn():
                    pass
            assert "RELEASE" in e.value.text and trio.current_time() - start >= 30
            with pytest.raises(Unreachable):
                await s.ping()
            n.cancel_scope.cancel()
        async with scripted_async([GRANT4, b""]) as (s, n, _):
            s.release_timeout = 30
            with pytest.raises(Boom):  # the body's exception goes on
                async with s.turn():
                    raise Boom
            with pytest.raises(Unreachable):
                await s.ping()
            n.cancel_scope.cancel()


def test_sync_turn_release_that_never_ends_closes_the_connection() -> None:
    with script_server([]) as (path, script):
        script += [GRANT4, b"", b""]  # the RELEASE gets no answer; the socket stays open
        with Slicer(path, "w", timeout=5) as s:
            s.release_timeout = 0.05
            with pytest.raises(Unreachable) as e, s.turn():
                pass
            assert "RELEASE" in e.value.text
            with pytest.raises(Unreachable):
                s.ping()


def test_cooperative_turn_release_that_never_ends_closes_the_connection() -> None:
    calls: list[str] = []

    class Model:  # what cooperative_turn asks of an Offloader
        offloaded = False

        def restore(self, device: object) -> None:
            calls.append("restore")

        def offload(self) -> None:
            calls.append("offload")

    with script_server([]) as (path, script):
        script += [GRANT4, b"", b""]  # the RELEASE gets no answer; the socket stays open
        with Slicer(path, "w", timeout=5) as s:
            s.release_timeout = 0.05
            with (
                pytest.raises(Unreachable) as e,
                cooperative_turn(s, cast(Offloader, Model()), "cpu"),
            ):
                pass
            assert "RELEASE" in e.value.text and calls == ["offload"]  # offloaded first
            with pytest.raises(Unreachable):
                s.ping()


class Stop(BaseException):
    """Neither an Exception nor a cancellation: as KeyboardInterrupt or SystemExit."""


@pytest.mark.parametrize("error", [RuntimeError, Stop])
async def test_a_callback_raising_in_the_late_grant_reader_fails_the_session_and_closes(
    autojump_clock: object, error: type[BaseException]
) -> None:
    """The background reader of an abandoned ACQUIRE cannot go on once `on_event` raised:
    it fails the session and closes the connection, so the daemon ends a late grant rather
    than count it as this connection's turn; no BaseException escapes its trio system task
    (before the fix: the socket stayed open, and `Stop` crashed the trio run)."""
    with trio.fail_after(600):
        ours, theirs = trio.testing.memory_stream_pair()
        buf = proto.LineBuffer()
        async with AsyncSlicer(ours, "w") as s:
            with trio.move_on_after(1):
                await s.acquire()
            assert await read_lines(theirs, buf) == [b"ACQUIRE w"]

            def boom(msg: proto.ServerMessage) -> None:
                raise error("callback")

            s.on_event = boom
            await theirs.send_all(b"WAITING w turn=1 waiters=1\n")
            assert await theirs.receive_some() == b""  # closed by the client
            with pytest.raises(Unreachable):
                await s.ping()


def _listening() -> tuple[socket.socket, str]:
    # A peer that accepts nothing and reads nothing: connects succeed (the backlog).
    path = str(Path(tempfile.mkdtemp()) / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    return srv, path


def test_sync_a_negative_timeout_is_a_timeout() -> None:
    """Below 0 reads as 0 (a poll): `TimeoutError`, as every other timeout (before the
    fix: ValueError from settimeout, and 0 lost the connection)."""
    srv, path = _listening()
    with srv, Slicer(path, "w", timeout=5) as s:
        for timeout in (-1.0, 0.0):
            with pytest.raises(TimeoutError):
                s.next_message(timeout=timeout)
        with pytest.raises(TimeoutError):
            s.request(proto.Ping(), timeout=-1)


async def test_async_a_negative_timeout_is_too_slow() -> None:
    """`trio.TooSlowError`, as every other timeout of the trio client, and no coroutine
    left never awaited (a RuntimeWarning: an error under filterwarnings=error)."""
    with trio.fail_after(5):
        async with scripted_async([]) as (s, n, _):
            with pytest.raises(trio.TooSlowError):
                await s.next_message(timeout=-1)
            with pytest.raises(trio.TooSlowError):
                await s.request(proto.Ping(), timeout=-1)
            n.cancel_scope.cancel()


# ---- against the real daemon -------------------------------------------------------


def _holder(st: dict[str, Any]) -> dict[str, Any] | None:
    h = st["gpus"][0]["holder"]
    return h if isinstance(h, dict) else None


@pytest.mark.integration
async def test_a_timed_out_acquire_does_not_leave_its_client_busy() -> None:
    """The blocking client's ACQUIRE times out while another workload holds the GPU; the
    daemon grants it once the holder releases; the same client's next ACQUIRE is granted
    (the late turn was given back), not refused ERR busy."""

    def run(fn: Callable[..., T], *args: Any, **kw: Any) -> Awaitable[T]:
        return trio.to_thread.run_sync(functools.partial(fn, *args, **kw), abandon_on_cancel=True)

    with trio.fail_after(60):
        async with running_stack() as stack, await stack.client() as h:
            await h.register("h", pid=stack.sleeper(), park="cooperative")
            c = await run(Slicer, stack.socket, "c", 10.0)
            try:
                await run(c.register, pid=stack.sleeper(), park="cooperative")
                held = await h.acquire(wait=20.0)
                with pytest.raises(TimeoutError):
                    await run(c.request, proto.Acquire("c"), timeout=0.2)
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["c"])
                await h.release(held)
                st = await stack.until(lambda st: (_holder(st) or {}).get("workload") == "c")
                late = _holder(st)["turn"]  # type: ignore[index]  # held by nobody who knows
                t = await run(c.acquire, wait=20.0)
                assert t.workload == "c" and t.turn > late
                assert _holder(await stack.status()) == {"workload": "c", "turn": t.turn}
                await run(c.release, t)
            finally:
                c.close()
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_sync_a_turn_whose_daemon_dies_mid_body_raises_the_body_s_error() -> None:
    """slicerd SIGKILLed during the body, which then raises: that error goes on, not the
    `Unreachable` the release met (before the fix it replaced the body's error, and a
    KeyboardInterrupt with it)."""
    with trio.fail_after(60):
        async with running_stack() as stack:
            pid, token = stack.sleeper(), trio.lowlevel.current_trio_token()

            def main() -> None:
                with Slicer(stack.socket, "w", timeout=10) as s:
                    s.register(pid=pid, park="cooperative")
                    with pytest.raises(Boom), s.turn(wait=20.0):
                        trio.from_thread.run(stack.stop, signal.SIGKILL, trio_token=token)
                        raise Boom
                    with pytest.raises(Unreachable):
                        s.ping()  # the connection was failed and closed

            await trio.to_thread.run_sync(main, abandon_on_cancel=True)
            assert stack.overlaps() == 0


class _Warned(logging.Handler):
    """Collects the client's warnings and signals the first one across threads."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.first.set()


@pytest.mark.integration
async def test_a_turn_held_while_another_waits_logs_one_warning_naming_the_waiter() -> None:
    """A trainer that samples through the dispatcher inside its own turn waits for itself;
    its client says so: the blocking client's body is blocked (it reads nothing), and the
    warning still comes, once, naming the turn and the workload that waits."""
    warned = _Warned()
    logger = logging.getLogger("slicer.client")
    logger.addHandler(warned)
    try:
        with trio.fail_after(60):
            async with running_stack() as stack, await stack.client() as sampler:
                await sampler.register("sampler", pid=stack.sleeper(), park="cooperative")
                pid = stack.sleeper()
                entered = threading.Event()

                def trainer() -> int:
                    with Slicer(stack.socket, "trainer", timeout=10) as s:
                        s.register(pid=pid, park="cooperative")
                        s.hold_warn = 0.2
                        with s.turn(wait=20.0) as t:
                            entered.set()
                            # Blocked, as on a sampling call that needs this very GPU.
                            assert warned.first.wait(30), "no warning while the sampler waited"
                        return t.turn

                async with trio.open_nursery() as n:
                    result: list[int] = []

                    async def run_trainer() -> None:
                        result.append(await trio.to_thread.run_sync(trainer))

                    n.start_soon(run_trainer)
                    await stack.until(lambda st: (_holder(st) or {}).get("workload") == "trainer")
                    assert not warned.lines  # nobody waits yet: checks found no waiter
                    granted = await sampler.acquire(wait=30.0)  # after the trainer's release
                    await sampler.release(granted)
                turn = result[0]
                assert len(warned.lines) == 1, warned.lines
                line = warned.lines[0]
                assert f"holding turn {turn} of trainer" in line and "sampler" in line
                assert "release the turn first" in line
                assert stack.overlaps() == 0
    finally:
        logger.removeHandler(warned)
