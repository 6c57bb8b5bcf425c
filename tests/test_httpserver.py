"""The lean HTTP/1.1 server (dispatcher.httpserver) in process, over real sockets.

httpx is the client for what clients normally do; raw trio sockets for what only a
hostile or odd client does (pipelining, bad framing, half a head, leaving mid-stream).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher import httpconn
from gpu_slicer.dispatcher.httphead import MAX_HEAD_BYTES
from gpu_slicer.dispatcher.httpserver import serve_asgi

GET = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"


class App:
    """A raw ASGI app: /echo answers the request it saw (JSON, with a Content-Length),
    /stream sends "one", waits for `go`, sends "two"; /hold waits for http.disconnect
    (or forever); /fail raises before answering, /fail-late after starting."""

    def __init__(self) -> None:
        self.go = trio.Event()
        self.disconnected = trio.Event()
        self.holding = trio.Event()
        self.cancelled = trio.Event()
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        path = scope["path"]
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            assert message["type"] == "http.request", message
            chunks.append(message["body"])
            more = message["more_body"]
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"one\n", "more_body": True})
            await self.go.wait()
            await send({"type": "http.response.body", "body": b"two\n"})
        elif path == "/hold":
            self.holding.set()
            try:
                assert (await receive())["type"] == "http.disconnect"
                self.disconnected.set()
            except trio.Cancelled:
                self.cancelled.set()
                raise
        elif path == "/fail":
            raise RuntimeError("boom")
        elif path == "/fail-late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise RuntimeError("boom")
        else:
            body = json.dumps(
                {
                    "method": scope["method"],
                    "path": path,
                    "query": scope["query_string"].decode(),
                    "body": b"".join(chunks).decode(),
                    "pieces": len([c for c in chunks if c]),
                    "version": scope["http_version"],
                }
            ).encode()
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", b"%d" % len(body))]  # fmt: skip
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def running(
    app: Any, bind: str = "127.0.0.1:0", grace: float = 5.0
) -> AsyncIterator[tuple[str, trio.Event]]:
    """`app` served on `bind`; (the bound address, the shutdown event)."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        (where,) = await nursery.start(partial(serve_asgi, app, bind, shutdown, grace=grace))
        yield where, shutdown
        shutdown.set()


def port_of(where: str) -> int:
    return int(where.rsplit(":", 1)[1])


class Raw:
    """A raw client connection that reads whole responses."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def more(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buf += data
        return bool(data)

    async def eof(self) -> bool:
        """Whether the server closes the connection (after what is left unread)."""
        while await self.more():
            pass
        return True

    async def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of the next response (a 1xx too)."""
        while b"\r\n\r\n" not in self.buf:
            assert await self.more(), f"closed mid-head: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"{name} twice"
            headers[name.lower()] = value.strip()
        assert not ("content-length" in headers and "transfer-encoding" in headers)
        if head_only or status < 200 or status in (204, 304):
            return status, headers, b""
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                assert await self.more()
            body, self.buf = self.buf[:n], self.buf[n:]
            return status, headers, body
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                while b"\r\n" not in self.buf:
                    assert await self.more()
                size_line, self.buf = self.buf.split(b"\r\n", 1)
                size = int(size_line, 16)
                while len(self.buf) < size + 2:
                    assert await self.more()
                body, self.buf = body + self.buf[:size], self.buf[size + 2 :]
                if size == 0:
                    return status, headers, body
        await self.eof()
        body, self.buf = self.buf, b""
        return status, headers, body


@asynccontextmanager
async def raw(where: str) -> AsyncIterator[Raw]:
    async with await trio.open_tcp_stream("127.0.0.1", port_of(where)) as s:
        yield Raw(s)


async def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    app = App()
    with trio.fail_after(30):
        async with running(app) as (where, _), httpx.AsyncClient(base_url=where) as http:
            for i in range(50):
                r = await http.post(f"/echo?i={i}", content=b"x" * i)
                assert r.status_code == 200
                assert r.json()["body"] == "x" * i and r.json()["query"] == f"i={i}"
    assert len({s["client"] for s in app.scopes}) == 1  # one connection, one client port
    assert app.scopes[0]["server"][0] == "127.0.0.1"
    assert {s["asgi"]["version"] for s in app.scopes} == {"3.0"}


async def test_pipelined_requests_are_answered_in_order() -> None:
    with trio.fail_after(10):
        async with running(App()) as (where, _), raw(where) as c:
            reqs = [b"POST /echo?n=%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (i, i)
                    for i in range(5)]  # fmt: skip
            await c.stream.send_all(b"".join(reqs))
            for i in range(5):
                status, _, body = await c.response()
                assert status == 200 and json.loads(body)["query"] == f"n={i}"
                assert json.loads(body)["body"] == str(i)


async def test_a_chunked_body_reaches_the_app_as_it_streams_in() -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for p in (b"hello ", b"chunked ", b"world"):
            yield p

    with trio.fail_after(10):
        async with running(App()) as (where, _):
            async with httpx.AsyncClient(base_url=where) as http:
                r = await http.post("/echo", content=pieces())
            assert r.request.headers["transfer-encoding"] == "chunked"
            assert r.json()["body"] == "hello chunked world"
            async with raw(where) as c:  # sizes in hex, an extension, a trailer
                await c.stream.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\n"
                                        b"a;ext=1\r\n0123456789\r\n")  # fmt: skip
                await c.stream.send_all(b"3\r\nabc\r\n0\r\nX-Trailer: t\r\n\r\n")
                status, _, body = await c.response()
                assert status == 200 and json.loads(body)["body"] == "0123456789abc"
                assert json.loads(body)["pieces"] >= 2  # handed over before it was whole


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    with trio.fail_after(10):
        async with running(App()) as (where, _), raw(where) as c:
            await c.stream.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                    b"Expect: 100-continue\r\n\r\n")  # fmt: skip
            assert (await c.response())[0] == 100
            await c.stream.send_all(b"hello")
            status, _, body = await c.response()
            assert status == 200 and json.loads(body)["body"] == "hello"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1 extra\r\nHost: x\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /echo HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
         400),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\nabc", 400),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: magic\r\n\r\n", 417),
    ],
    ids=["head-over-64KiB", "101-headers", "garbage", "request-line", "header-name",
         "folded", "no-host", "http2", "conflicting-lengths", "negative-length",
         "length-and-chunked", "gzip-coding", "chunked-not-last", "expectation"],
)  # fmt: skip
async def test_a_bad_request_is_refused_and_the_connection_closed(
    request_bytes: bytes, status: int
) -> None:
    app = App()
    with trio.fail_after(10):
        async with running(app) as (where, _), raw(where) as c:
            await c.stream.send_all(request_bytes)
            got, headers, _ = await c.response()
            assert got == status and headers["connection"] == "close"
            assert await c.eof()
    assert app.scopes == []  # the app never saw it


async def test_a_bad_chunk_ends_the_body_with_a_disconnect() -> None:
    seen: list[dict[str, Any]] = []

    async def reader(scope: Any, receive: Any, send: Any) -> None:
        while (m := await receive())["type"] == "http.request" and m["more_body"]:
            seen.append(m)
        seen.append(m)
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"bad body"})

    with trio.fail_after(10):
        async with running(reader) as (where, _), raw(where) as c:
            await c.stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                    b"\r\n\r\n3\r\nabc\r\nzz\r\n")  # fmt: skip
            status, headers, body = await c.response()
            assert (status, body) == (400, b"bad body") and headers["connection"] == "close"
            assert await c.eof()
    assert seen[0]["body"] == b"abc" and seen[-1]["type"] == "http.disconnect"


async def test_a_streaming_response_arrives_chunk_by_chunk() -> None:
    app = App()
    with trio.fail_after(10):
        async with running(app) as (where, _), httpx.AsyncClient(base_url=where) as http:
            async with http.stream("GET", "/stream") as r:
                assert r.headers["transfer-encoding"] == "chunked"
                lines = r.aiter_lines()
                assert await lines.__anext__() == "one"  # before the stream ended
                app.go.set()
                assert [line async for line in lines] == ["two"]
            assert (await http.get("/echo")).status_code == 200  # the connection goes on


async def test_a_client_that_leaves_is_told_to_the_app_as_disconnect() -> None:
    app = App()
    with trio.fail_after(10):
        async with running(app) as (where, _):
            async with raw(where) as c:
                await c.stream.send_all(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
                await app.holding.wait()
            await app.disconnected.wait()


async def test_head_has_the_length_and_no_body_and_the_connection_goes_on() -> None:
    with trio.fail_after(10):
        async with running(App()) as (where, _), raw(where) as c:
            await c.stream.send_all(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n" + GET)
            status, headers, _ = await c.response(head_only=True)
            assert status == 200 and int(headers["content-length"]) > 0
            status, _, body = await c.response()  # the body was not sent: this is next
            assert status == 200 and json.loads(body)["method"] == "GET"


async def test_http_1_0_closes_unless_asked_to_keep_alive() -> None:
    app = App()
    app.go.set()
    with trio.fail_after(10):
        async with running(app) as (where, _):
            async with raw(where) as c:
                await c.stream.send_all(b"GET /echo HTTP/1.0\r\n\r\n")
                status, _, body = await c.response()
                assert status == 200 and json.loads(body)["version"] == "1.0"
                assert await c.eof()
            async with raw(where) as c:
                ka = b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
                await c.stream.send_all(ka + ka)
                for _ in range(2):
                    status, headers, _ = await c.response()
                    assert status == 200 and headers["connection"] == "keep-alive"
            async with raw(where) as c:  # no length known: the body ends with the connection
                await c.stream.send_all(b"GET /stream HTTP/1.0\r\n\r\n")
                status, headers, body = await c.response()
                assert (status, body) == (200, b"one\ntwo\n")
                assert "transfer-encoding" not in headers and headers["connection"] == "close"


async def test_connection_close_from_the_client_is_honoured() -> None:
    with trio.fail_after(10):
        async with running(App()) as (where, _), raw(where) as c:
            await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status, headers, _ = await c.response()
            assert status == 200 and headers["connection"] == "close"
            assert await c.eof()


async def test_an_app_error_answers_500_before_the_response_and_closes_after() -> None:
    with trio.fail_after(10):
        async with running(App()) as (where, _):
            async with raw(where) as c:
                await c.stream.send_all(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await c.response())[0] == 500
                assert await c.eof()
            async with raw(where) as c:
                await c.stream.send_all(b"GET /fail-late HTTP/1.1\r\nHost: x\r\n\r\n")
                assert await c.eof()  # the head went out, then the connection was cut
                assert c.buf.startswith(b"HTTP/1.1 200 ")
            async with httpx.AsyncClient(base_url=where) as http:  # the server serves on
                assert (await http.get("/echo")).status_code == 200


async def test_shutdown_closes_idle_connections_and_gives_open_requests_grace() -> None:
    app = App()
    with trio.fail_after(20):
        async with (
            running(app, grace=1.0) as (where, shutdown),
            raw(where) as idle,
            raw(where) as busy,
        ):
            await idle.stream.send_all(GET)
            assert (await idle.response())[0] == 200
            await busy.stream.send_all(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
            await app.holding.wait()
            t0 = trio.current_time()
            shutdown.set()
            assert await idle.eof()  # closed at once, not after the grace
            assert not app.cancelled.is_set()
            with pytest.raises(OSError):  # no new connection is accepted
                await trio.open_tcp_stream("127.0.0.1", port_of(where))
            await app.cancelled.wait()  # the long-poll is cut once the grace is over
            assert trio.current_time() - t0 >= 1.0
            assert await busy.eof()


async def test_a_unix_socket_bind(tmp_path: Path) -> None:
    path = tmp_path / "front.sock"
    path.touch()  # not a socket: left alone, so the bind fails
    with trio.fail_after(10):
        with pytest.RaisesGroup(OSError):  # from the nursery that started it
            async with running(App(), f"unix:{path}"):
                pass
        path.unlink()
        async with running(App(), f"unix:{path}") as (where, _):
            assert where == f"http://unix:{path}"
            transport = httpx.AsyncHTTPTransport(uds=str(path))
            async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
                r = await http.get("/echo")
                assert r.status_code == 200 and r.json()["method"] == "GET"


async def test_slow_clients_are_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HEAD_TIMEOUT_S", "IDLE_TIMEOUT_S", "BODY_STALL_S"):
        monkeypatch.setattr(httpconn, name, 0.3)
    monkeypatch.setattr(httpconn, "REAP_EVERY_S", 0.05)
    with trio.fail_after(10):
        async with running(App()) as (where, _):
            async with raw(where) as c:  # half a head, then nothing
                await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost:")
                assert await c.eof()
            async with raw(where) as c:  # a request, then idle
                await c.stream.send_all(GET)
                assert (await c.response())[0] == 200
                assert await c.eof()
            async with raw(where) as c:  # a body that stops coming
                await c.stream.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\n"
                                        b"Content-Length: 10\r\n\r\nabc")  # fmt: skip
                assert await c.eof()


async def test_many_concurrent_connections() -> None:
    with trio.fail_after(60):
        async with running(App()) as (where, _):

            async def one(i: int) -> None:
                async with raw(where) as c:
                    await c.stream.send_all(b"GET /echo?%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
                    status, _, body = await c.response()
                    assert status == 200 and json.loads(body)["query"] == str(i)

            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(one, i)


async def test_a_starlette_stream_ends_when_its_reader_leaves() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    ended = trio.Event()

    async def events(request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            try:
                yield b"first\n"
                await trio.sleep_forever()  # an event stream with nothing more to say
            finally:
                ended.set()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    app = Starlette(routes=[Route("/events", events)])
    with trio.fail_after(10):
        async with running(app) as (where, _):
            async with raw(where) as c:
                await c.stream.send_all(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
                while b"first" not in c.buf:
                    assert await c.more()
            await ended.wait()  # the reader left: the response was cancelled


async def test_a_client_that_stops_reading_a_response_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpconn, "SEND_STALL_S", 0.3)
    monkeypatch.setattr(httpconn, "REAP_EVERY_S", 0.05)
    cut = trio.Event()

    async def flood(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        except trio.Cancelled:
            cut.set()
            raise

    with trio.fail_after(20):
        async with running(flood) as (where, _), raw(where) as c:
            await c.stream.send_all(GET)  # and never reads
            await cut.wait()
