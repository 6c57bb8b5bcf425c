"""The clients against a scripted peer: events between replies, FAULT in step. The blocking
`Slicer` talks to a thread over a Unix socket; `AsyncSlicer` to a trio task over memory
streams, with the same calls and the same exceptions."""

from __future__ import annotations

import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, ClientError, Faulted, Slicer, Turn, Unreachable


@pytest.fixture
def scripted() -> Iterator[tuple[str, list[bytes]]]:
    """A one-connection Unix server that answers each request line with the next script
    entry; returns its path and the script list to fill."""
    path = str(Path(tempfile.mkdtemp()) / "s.sock")
    script: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rb") as f:
            for answer in script:
                if not f.readline():
                    return
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
    with pytest.raises(Unreachable):
        Slicer("/nonexistent/slicer.sock")


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


async def scripted_peer(stream: trio.abc.Stream, script: list[bytes], delay: float = 0) -> None:
    """Answer each request line read from `stream` with the next script entry (after
    `delay` virtual seconds)."""
    buf = proto.LineBuffer()
    for answer in script:
        while not (lines := buf.feed(await stream.receive_some())):
            pass
        assert len(lines) == 1, lines
        await trio.sleep(delay)
        await stream.send_all(answer)


async def test_async_fault_before_a_reply_raises_faulted_like_the_blocking_one() -> None:
    with trio.fail_after(5):
        ours, theirs = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as n, AsyncSlicer(ours, "w") as s:
            n.start_soon(scripted_peer, theirs, FAULT_SCRIPT)
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
        ours, theirs = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as n, AsyncSlicer(ours) as s:
            grant = b"OK turn=9 restored=0 waited_ms=0\n"
            n.start_soon(scripted_peer, theirs, [grant, b"OK\n"], 10)
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
