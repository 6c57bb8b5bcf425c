"""The lean HTTP/1.1 server's deadlines (dispatcher.httpconn) against keep-alive clients.

The one thing a front must never do is close a connection without an answer after it
read a well-formed request; an idle connection may close only before any byte of a new
request was read. Time is trio's MockClock, moved by hand once every task is blocked
(the sockets are real), so a deadline passes exactly where a test says.
"""

from __future__ import annotations

import json
import select
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from gpu_slicer.dispatcher import httpconn
from tests.test_httpserver import GET, App, Raw, raw, running

ROUNDS = 24  # each a coin toss of trio's scheduler: a bug shows with odds 1 - 2**-24


async def test_a_request_that_comes_as_the_idle_timeout_sweeps_is_answered(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The keep-alive race on the server's side: the request's bytes and the sweep that
    finds the connection idle past its timeout wake in the same scheduler pass, in an
    order trio picks at random. Once the request is read it is always answered."""
    with trio.fail_after(ROUNDS * (httpconn.IDLE_TIMEOUT_S + 10)):  # in mock time
        async with running(App()) as (where, _), raw(where) as c:
            for i in range(ROUNDS):
                await c.stream.send_all(GET)
                assert (await c.response())[0] == 200, f"round {i}"
                await trio.testing.wait_all_tasks_blocked()  # the server waits, idle
                mock_clock.jump(httpconn.IDLE_TIMEOUT_S + 0.5)
                await c.stream.send_all(GET)  # read in the pass that sweeps
                assert (await c.response())[0] == 200, f"round {i}"


async def test_keep_alive_connections_outlive_idle_gaps_under_the_timeout(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Bursts of concurrent POSTs on 4 keep-alive connections (4 clients, one each) with
    idle gaps of 0.5-74.5 s between them: every request is answered, on the same 4
    connections throughout; after a gap past the idle timeout the clients reconnect
    and are answered too."""
    app = App()
    gaps = [1.0, 30.0, 70.0, 74.0, 5.0, 60.0, 74.5, 0.5, 2.0, 45.0]
    # One connection a client, and none dropped by the client's own (real time) expiry.
    limits = httpx.Limits(max_connections=1, keepalive_expiry=3600)
    with trio.fail_after(10_000):  # in mock time
        async with running(app) as (where, _), AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(httpx.AsyncClient(base_url=where, limits=limits))
                for _ in range(4)
            ]

            async def post(http: httpx.AsyncClient, i: int) -> None:
                r = await http.post("/echo", params={"i": i}, json={"n": i})
                assert r.status_code == 200 and r.json()["query"] == f"i={i}"

            async def burst(base: int) -> None:
                async with trio.open_nursery() as nursery:
                    for i, http in enumerate(clients):
                        nursery.start_soon(post, http, base + i)

            await burst(0)
            for n, gap in enumerate(gaps, 1):
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(gap)
                await burst(4 * n)
            assert len({s["client"] for s in app.scopes}) == 4
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(httpconn.IDLE_TIMEOUT_S + 2)
            await trio.testing.wait_all_tasks_blocked()  # the idle ones are closed now
            await burst(1000)
    assert len({s["client"] for s in app.scopes}) == 8
    assert len(app.scopes) == 4 * (len(gaps) + 2)


async def test_a_body_trickle_is_bounded_overall(mock_clock: trio.testing.MockClock) -> None:
    """A body that makes progress (a byte every 50 s, under the 60 s stall) but is not
    whole 300 s after its first wait ends: the app is told ``http.disconnect``, and its
    answer goes out before the connection closes."""
    seen: list[str] = []
    done = trio.Event()

    async def reader(scope: Any, receive: Any, send: Any) -> None:
        while (m := await receive())["type"] == "http.request" and m["more_body"]:
            pass
        seen.append(m["type"])
        done.set()
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"body timed out"})

    with trio.fail_after(10_000):  # in mock time
        async with running(reader) as (where, _), raw(where) as c:
            await c.stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            t0 = trio.current_time()
            while True:
                await c.stream.send_all(b"x")
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(50.0)
                await trio.testing.wait_all_tasks_blocked()
                if done.is_set():
                    break
                assert trio.current_time() - t0 <= httpconn.BODY_TIMEOUT_S
            elapsed = trio.current_time() - t0
            status, _, body = await c.response()
            assert (status, body) == (400, b"body timed out")
            assert await c.eof()
    assert seen == ["http.disconnect"]
    assert httpconn.BODY_TIMEOUT_S < elapsed <= httpconn.BODY_TIMEOUT_S + 50


def _readable(c: Raw) -> bool:
    """Whether the server sent something or closed (without waiting)."""
    return bool(select.select([c.stream.socket.fileno()], [], [], 0)[0])


async def test_a_head_trickle_is_bounded_overall(mock_clock: trio.testing.MockClock) -> None:
    """A head that keeps coming, a byte every 10 s, is cut 30 s after its first byte
    (not before), unanswered, and the app never sees it."""
    app = App()
    with trio.fail_after(10_000):  # in mock time
        async with running(app) as (where, _), raw(where) as c:
            for i in range(4):  # at 0, 10, 20 and 30 s: one byte, the head not whole
                await c.stream.send_all(GET[i : i + 1])
                await trio.testing.wait_all_tasks_blocked()
                assert not _readable(c), f"cut at {10 * i} s"
                mock_clock.jump(httpconn.HEAD_TIMEOUT_S / 3)
            await trio.testing.wait_all_tasks_blocked()  # at 40 s
            assert _readable(c) and await c.eof() and c.buf == b""
    assert app.scopes == []


@pytest.mark.parametrize("head", [b"GET /echo HTTP/1.1\nHost: x\n\n",
                                  b"GET /echo HTTP/1.1\r\nHost: x\n\r\n"],
                         ids=["all-bare-LF", "last-field-bare-LF"])  # fmt: skip
async def test_a_head_ending_in_bare_lf_is_refused_at_once(
    head: bytes, autojump_clock: trio.testing.MockClock
) -> None:
    """Answered 400 at once, not left to wait out the 30 s head timeout."""
    app = App()
    with trio.fail_after(5):  # in mock time, which jumps to the next deadline when idle
        async with running(app) as (where, _), raw(where) as c:
            await c.stream.send_all(head)
            status, headers, _ = await c.response()
            assert status == 400 and headers["connection"] == "close"
            assert await c.eof()
    assert app.scopes == []


async def test_a_long_running_request_is_not_cut_by_any_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A request the app takes 10 minutes to answer (a long-poll), on a connection that
    served requests before, is answered: no deadline of an earlier wait is left armed."""
    release = trio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if scope["path"] == "/slow":
            await release.wait()
        body = json.dumps({"path": scope["path"]}).encode()
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    with trio.fail_after(10_000):  # in mock time
        async with running(slow) as (where, _), raw(where) as c:
            await c.stream.send_all(b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(20.0)  # a body waited for, then sent
            await c.stream.send_all(b"{}")
            assert (await c.response())[0] == 200
            await c.stream.send_all(b"POST /slow HTTP/1.1\r\nHost: x\r\n")
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(20.0)  # a head in two pieces
            await c.stream.send_all(b"Content-Length: 0\r\n\r\n")
            for _ in range(10):
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(60.0)
            release.set()
            status, _, body = await c.response()
            assert status == 200 and json.loads(body) == {"path": "/slow"}
