"""The generation path's HTTP/1.1 client (dispatcher/wire.py) through Replica.complete,
against in-process trio servers that misbehave on purpose: keep-alive reuse, servers
that close idle or half-answered connections, chunked and close-delimited bodies,
oversized heads and bodies, a trickling server cut by the caller's bound, concurrency,
and vLLM's error statuses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from gpu_slicer.dispatcher import wire
from gpu_slicer.dispatcher.errors import ReplicaError
from gpu_slicer.dispatcher.vllm import Replica

ANSWER = b'{"object":"text_completion","choices":[{"index":0,"text":"ab"}]}'


def response(body: bytes = ANSWER, status: str = "200 OK", headers: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


class Conn:
    """The server side of one accepted connection."""

    def __init__(self, server: Server, stream: trio.SocketStream, number: int) -> None:
        self.server, self.stream, self.number = server, stream, number
        self.buf = b""

    async def request(self) -> tuple[str, bytes] | None:
        """The next request's head and body; None when the client closed."""
        while b"\r\n\r\n" not in self.buf:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buf += data
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        text = head.decode()
        length = int(text.lower().split("content-length: ", 1)[1].split("\r\n", 1)[0])
        while len(self.buf) < length:
            self.buf += await self.stream.receive_some(65536)
        body, self.buf = self.buf[:length], self.buf[length:]
        self.server.requests.append((self.number, text, body))
        self.server.arrived.set()
        return text, body

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)


class Server:
    """A trio TCP server running ``handler`` on each connection; counts accepts."""

    def __init__(self, handler: Callable[[Conn], Awaitable[None]]) -> None:
        self.handler = handler
        self.accepts = 0
        self.requests: list[tuple[int, str, bytes]] = []  # (connection number, head, body)
        self.arrived = trio.Event()
        self.closed: list[int] = []  # connections whose client side closed

    async def serve(self, stream: trio.SocketStream) -> None:
        self.accepts += 1
        conn = Conn(self, stream, self.accepts)
        try:
            await self.handler(conn)
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()


async def keep_answering(conn: Conn) -> None:
    while await conn.request() is not None:
        await conn.send(response())
    conn.server.closed.append(conn.number)


@asynccontextmanager
async def serving(
    handler: Callable[[Conn], Awaitable[None]], prefix: str = ""
) -> AsyncIterator[tuple[Server, Replica]]:
    server = Server(handler)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            async with Replica(f"http://127.0.0.1:{port}{prefix}") as replica:
                yield server, replica
            nursery.cancel_scope.cancel()


def pool(replica: Replica) -> wire.Pool:
    p = replica._wire
    assert p is not None
    return p


async def test_sequential_requests_share_one_connection() -> None:
    async with serving(keep_answering, prefix="/proxy/") as (server, r):
        for i in range(5):
            raw, out = await r.complete_raw("completion", {"prompt": [i], "max_tokens": 2}, 10)
            assert raw == ANSWER and out["choices"][0]["text"] == "ab"
        assert await r.complete("chat", {"messages": []}, 10) == json.loads(ANSWER)
        assert server.accepts == 1 and pool(r).connects == 1
        _, head, body = server.requests[0]
        assert head.startswith("POST /proxy/v1/completions HTTP/1.1\r\n")
        assert "content-type: application/json" in head.lower()
        assert json.loads(body) == {"prompt": [0], "max_tokens": 2}
        assert server.requests[-1][1].startswith("POST /proxy/v1/chat/completions ")
        assert [n for n, _, _ in server.requests] == [1] * 6


async def test_an_idle_connection_the_server_closed_is_replaced() -> None:
    """The server closes after each answer (no Connection: close, as after uvicorn's
    keep-alive timeout): every request still succeeds, each on a fresh connection."""

    async def once(conn: Conn) -> None:
        if await conn.request() is not None:
            await conn.send(response())

    async with serving(once) as (server, r):
        for _ in range(3):
            await r.complete("completion", {"prompt": [1]}, 10)
        assert server.accepts == 3 and len(server.requests) == 3


async def test_a_request_lost_with_its_idle_connection_is_retried_once() -> None:
    """The server closes a reused connection after reading the request, before any
    byte of an answer (the keep-alive race): sent again on a fresh connection, once."""

    async def drop_second(conn: Conn) -> None:
        await conn.request()
        await conn.send(response())
        if conn.number == 1:
            await conn.request()  # read, then closed unanswered
            return
        await keep_answering(conn)

    async with serving(drop_second) as (server, r):
        await r.complete("completion", {"prompt": [1]}, 10)
        assert (await r.complete("completion", {"prompt": [2]}, 10))["choices"]
        assert [(n, json.loads(b)["prompt"]) for n, _, b in server.requests] == [
            (1, [1]), (1, [2]), (2, [2])
        ]  # fmt: skip

    async def never_answer(conn: Conn) -> None:
        await conn.request()  # a fresh connection closed unanswered: no retry

    async with serving(never_answer) as (server, r):
        with pytest.raises(ReplicaError, match="closed the connection before answering") as e:
            await r.complete("completion", {"prompt": [1]}, 10)
        assert e.value.status is None and len(server.requests) == 1 and server.accepts == 1


async def test_bytes_on_an_idle_connection_are_never_taken_for_an_answer() -> None:
    """A server that writes a 408 on an idle connection (and keeps it open): the next
    request goes on a fresh connection instead of reading the stale 408."""
    sent = trio.Event()

    async def stale_408(conn: Conn) -> None:
        if conn.number > 1:
            return await keep_answering(conn)
        await conn.request()
        await conn.send(response())
        await conn.send(response(b"", "408 Request Timeout"))
        sent.set()
        await keep_answering(conn)

    async with serving(stale_408) as (server, r):
        await r.complete("completion", {}, 10)
        await sent.wait()
        assert (await r.complete("completion", {}, 10))["choices"]
        assert server.accepts == 2 and [n for n, _, _ in server.requests] == [1, 2]


async def test_a_response_cut_mid_body_fails_and_is_not_retried() -> None:
    async def cut(conn: Conn) -> None:
        await conn.request()
        await conn.send(response()[:-10])  # the head and part of the body, then close

    async with serving(cut) as (server, r):
        with pytest.raises(ReplicaError, match="closed the connection after") as e:
            await r.complete("completion", {"prompt": [1]}, 10)
        assert e.value.status is None
        assert len(server.requests) == 1 and not pool(r)._idle


async def test_chunked_and_close_delimited_bodies() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5;ext=1\r\n" + ANSWER[:5] + b"\r\n"
        + f"{len(ANSWER) - 5:x}\r\n".encode() + ANSWER[5:] + b"\r\n"
        b"0\r\nx-trailer: 1\r\n\r\n"
    )  # fmt: skip

    async def answers(conn: Conn) -> None:
        await conn.request()
        await conn.send(chunked)
        await conn.request()
        await conn.send(response(headers="Connection: close\r\n"))
        await conn.request()  # never sent on this connection
        conn.server.closed.append(conn.number)

    async with serving(answers) as (server, r):
        assert (await r.complete_raw("completion", {}, 10))[0] == ANSWER
        assert (await r.complete_raw("completion", {}, 10))[0] == ANSWER
        assert server.accepts == 1  # chunked kept the connection; "close" ended it
        assert not pool(r)._idle

    async def until_close(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\n\r\n" + ANSWER)

    async with serving(until_close) as (server, r):
        assert (await r.complete_raw("completion", {}, 10))[0] == ANSWER
        assert not pool(r)._idle


async def test_oversized_head_and_body_are_refused() -> None:
    async def huge_head(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"a" * (70 << 10) + b"\r\n\r\n")

    async with serving(huge_head) as (_, r):
        with pytest.raises(ReplicaError, match="head over 65536 bytes") as e:
            await r.complete("completion", {}, 10)
        assert e.value.status is None

    async with serving(keep_answering) as (_, r):
        pool(r).max_body = len(ANSWER) - 1
        with pytest.raises(ReplicaError, match=r"over the \d+ limit"):
            await r.complete("completion", {}, 10)


async def test_a_trickling_server_is_cut_by_the_callers_bound() -> None:
    """One byte every 20 ms: each read is quick, the whole answer is not; the call ends
    at its bound and its connection is closed, never reused."""

    async def trickle(conn: Conn) -> None:
        if conn.number > 1:
            return await keep_answering(conn)
        await conn.request()
        for byte in response(b" " * 1000):
            await conn.send(bytes([byte]))
            await trio.sleep(0.02)  # the simulated slow replica, not a wait for an event

    async with serving(trickle) as (server, r):
        start = trio.current_time()
        with pytest.raises(ReplicaError, match=r"no answer within 0\.5 s") as e:
            await r.complete("completion", {}, 0.5)
        assert e.value.status is None and trio.current_time() - start < 5
        assert not pool(r)._idle
        await r.complete("completion", {}, 10)
        assert server.accepts == 2


async def test_concurrent_requests_use_separate_connections() -> None:
    n = 4
    all_in = trio.Event()

    async def hold(conn: Conn) -> None:
        while await conn.request() is not None:
            if len(conn.server.requests) == n:
                all_in.set()
            await all_in.wait()
            await conn.send(response())

    async with serving(hold) as (server, r):
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(r.complete, "completion", {"prompt": [i]}, 10)
        assert server.accepts == n and len(pool(r)._idle) == n
        for _ in range(n):
            await r.complete("completion", {}, 10)
        assert server.accepts == n  # the idle ones were reused


async def test_errors_map_status_and_vllm_message() -> None:
    bodies = [
        response(b'{"error":{"message":"max_tokens must be an integer"}}', "400 Bad Request"),
        response(b'{"detail":"Not Found"}', "404 Not Found"),
        response(b"Internal Server Error", "500 Internal Server Error"),
        response(b"[1, 2]"),
        b"HTTP/1.1 abc\r\n\r\n",
    ]

    async def answers(conn: Conn) -> None:
        while await conn.request() is not None:
            await conn.send(bodies[len(conn.server.requests) - 1])

    async with serving(answers) as (_, r):
        want = [
            (400, "HTTP 400: max_tokens must be an integer"),
            (404, "HTTP 404: Not Found"),
            (500, "HTTP 500: Internal Server Error"),
            (None, "expected a JSON object, got '\\[1, 2\\]'"),
            (None, "malformed status line"),
        ]
        for status, message in want:
            with pytest.raises(ReplicaError, match=message) as e:
                await r.complete("completion", {}, 10)
            assert e.value.status == status
        with pytest.raises(ValueError):
            await r.complete("completion", {"temperature": float("nan")}, 10)


async def test_refused_connection_is_a_replica_error() -> None:
    with trio.fail_after(10):
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()  # nobody listens there now
        async with Replica(f"http://127.0.0.1:{port}") as r:
            with pytest.raises(ReplicaError, match="connect: ") as e:
                await r.complete("completion", {}, 10)
            assert e.value.status is None


def test_only_plain_http_urls_use_the_pool() -> None:
    assert wire.Pool.from_url("https://vllm:8000") is None
    assert wire.Pool.from_url("http://user:pw@vllm:8000") is None
    p = wire.Pool.from_url("http://[::1]:8000/v/")
    assert p is not None and (p.host, p.port, p.prefix) == ("::1", 8000, "/v")
    assert p._host_header == "[::1]:8000"
    d = wire.Pool.from_url("http://vllm")
    assert d is not None and (d.port, d._host_header) == (80, "vllm")
