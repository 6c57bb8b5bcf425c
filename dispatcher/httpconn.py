"""One HTTP/1.1 connection of the lean server (:mod:`dispatcher.httpserver`), and the
state its connections share (:class:`Front`).

A connection reads a request head (checked by :mod:`dispatcher.httphead`), runs the ASGI
app on it with ``receive``/``send``, and goes on while keep-alive allows. Its waits are
bounded by deadlines (:data:`HEAD_TIMEOUT_S`, :data:`IDLE_TIMEOUT_S`, :data:`BODY_STALL_S`,
:data:`BODY_TIMEOUT_S`, :data:`SEND_STALL_S`) that :meth:`Front.reap` checks once a second
for all connections (a cancel scope per wait would cost more than the rest of a request).
A read past its deadline is woken as if the client had closed (the head's wait ends the
connection, the body's tells the app ``http.disconnect``), and only while it still waits:
a read the kernel has already woken with data goes on, so a connection is never closed
after bytes of a new request were read from it. A write past its deadline cancels the
connection (its app included). The idle timeout is long (75 s, more than the 5 s that
httpx and most clients keep an idle connection): closing an idle connection races with a
request the client may be sending on it, which clients retry only when idempotent.
The request body goes to the app piece by piece as it arrives. Once it is whole,
``receive()`` waits on the socket, so a client that leaves is told as
``http.disconnect`` (and a streaming response ends with its reader); data that comes
meanwhile (the next pipelined request, bounded) is kept.
A response with a ``Content-Length`` is written in one write with its head; one without
is chunked (HTTP/1.0: ends with the connection) and its head goes out at once.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Any

import trio

from gpu_slicer.dispatcher import httphead as h

__all__ = [
    "BODY_STALL_S",
    "BODY_TIMEOUT_S",
    "HEAD_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "SEND_STALL_S",
    "Front",
]

log = logging.getLogger("dispatcher.httpserver")

HEAD_TIMEOUT_S = 30.0  # from a request head's first byte to its end
IDLE_TIMEOUT_S = 75.0  # a connection with no request in it
BODY_STALL_S = 60.0  # a request body read that gets no byte
BODY_TIMEOUT_S = 300.0  # a whole request body, from the first wait for it
SEND_STALL_S = 60.0  # a response write the client does not take
REAP_EVERY_S = 1.0  # how often the deadlines above are checked
LINGER_S = 2.0  # after the last response, for the client to read it before we close
LINGER_BYTES = 8 << 20
RECV_BYTES = 64 << 10
MAX_CHUNK_LINE = 4096
_ASGI = {"version": "3.0", "spec_version": "2.3"}  # < 2.4: starlette listens for disconnect
_INF = math.inf
_SOCKET_ERRORS = (OSError, trio.ClosedResourceError)


class _BodyError(Exception):
    """The request body cannot be read on: the app gets http.disconnect."""


class Front:
    """What the connections of one server share: the app, whether it is closing, the
    connections themselves."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.closing = False
        self.conns: set[_Conn] = set()

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one accepted connection until it ends; never raises (but Cancelled)."""
        try:
            conn = _Conn(self, stream.socket)
            self.conns.add(conn)
            try:
                await conn.serve()
            finally:
                self.conns.discard(conn)
        except Exception as e:  # one connection's trouble never ends the server
            log.debug("connection: %r", e)
        finally:
            await trio.aclose_forcefully(stream)

    async def reap(self) -> None:
        """Forever: once a second, :meth:`sweep`."""
        while True:
            await trio.sleep(REAP_EVERY_S)
            self.sweep(trio.current_time())

    def sweep(self, now: float) -> None:
        """Cut off the connections whose wait is past its deadline at ``now``: a write is
        cancelled with its connection; a read is woken as if the client had closed, only
        if it is still blocked (one the kernel has woken with data goes on)."""
        for conn in self.conns:
            if conn.write_by < now:
                conn.scope.cancel()
            elif conn.read_by < now:
                conn.timed_out = True
                trio.lowlevel.notify_closing(conn.sock)

    def close_idle(self) -> None:
        """From now on: no new request; the idle connections close at once (those with a
        request just arrived on them serve it first, then close)."""
        self.closing = True
        for conn in self.conns:
            if conn.idle:
                trio.lowlevel.notify_closing(conn.sock)


class _Conn:
    def __init__(self, server: Front, sock: trio.socket.SocketType) -> None:
        self.server = server
        self.sock = sock
        self.scope = trio.CancelScope()
        self.read_by = self.write_by = _INF  # deadlines of the waits under way
        self.body_by = _INF  # the request body's overall deadline, once it is waited for
        self.timed_out = False  # a read was woken by its deadline
        self.idle = False  # waiting for a request: shutdown closes it at once
        self.buf = bytearray()
        self.eof = False  # the client closed its side (or reset)
        self.gone = False  # a write failed: nothing more is written
        self.answered = False  # this request was answered: linger before closing
        self.recv_scope: trio.CancelScope | None = None
        # The request being served (set again by _serve for each one):
        self.req = h.Request()
        self.left = 0  # body bytes still to read (of this chunk, when chunked)
        self.chunk_state = 0  # 0: at a chunk-size line, 1: in data, 2: at data's CRLF
        self.body_done = self.delivered = self.body_failed = False
        self.started = self.complete = self.keep = False
        self.framing = h.NONE
        self.resp_left = -1  # response bytes still to write, -1: no Content-Length
        self.pending_head = b""  # a response head to write with the first body
        if sock.family == socket.AF_UNIX:
            self.client: Any = None
            self.sockname: Any = None
        else:
            self.client = tuple(sock.getpeername()[:2])
            self.sockname = tuple(sock.getsockname()[:2])

    async def serve(self) -> None:
        with self.scope:
            while await self._one():
                pass
            if self.answered and not self.eof and not self.gone:
                await self._linger()
        if self.scope.cancelled_caught or self.timed_out:
            log.debug("connection from %s: timed out", self.client)

    async def _one(self) -> bool:
        """Serve one request; whether the connection may carry another."""
        try:
            end = await self._read_head()
            if end is None:
                return False
            head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            req = h.parse_request(head)
        except h.Reject as e:
            self.read_by = _INF  # the head's deadline must not cut the answer's linger
            log.debug("request from %s refused (%d): %s", self.client, e.status, e)
            await self._write(h.simple_response(e.status, str(e)))
            self.answered = True
            return False
        return await self._serve(req)

    async def _recv(self) -> bytes:
        try:
            data: bytes = await self.sock.recv(RECV_BYTES)
        except _SOCKET_ERRORS:
            data = b""
        if not data:
            self.eof = True
        return data

    async def _read_head(self) -> int | None:
        self.answered = False
        buf = self.buf
        if not buf:
            if self.eof or self.server.closing:
                return None
            # Idle: the sweep and close_idle may wake this recv (notify_closing: it
            # returns b"" as at EOF) but never cancel it, so bytes it has read are served.
            self.idle = True
            self.read_by = trio.current_time() + IDLE_TIMEOUT_S
            try:
                data = await self._recv()
            finally:
                self.idle = False
            self.read_by = _INF
            if not data:
                return None
            buf += data
        scan = 0
        while True:
            while buf.startswith(b"\r\n"):  # empty lines before a request are ignored
                del buf[:2]
                scan = 0
            end = buf.find(b"\r\n\r\n", scan)
            if end >= 0:
                break
            if len(buf) > h.MAX_HEAD_BYTES:
                raise h.Reject(431, "request head too large")
            if buf.find(b"\n\n", scan) >= 0 or buf.find(b"\n\r\n", scan) >= 0:
                # No CRLF CRLF yet, so a line of this head ends in a bare LF.
                raise h.Reject(400, "a request head line ends in a bare LF")
            scan = max(0, len(buf) - 3)
            if self.read_by == _INF:
                self.read_by = trio.current_time() + HEAD_TIMEOUT_S
            data = await self._recv()
            if not data:
                return None  # gone mid-head: nobody to answer
            buf += data
        self.read_by = _INF
        if end > h.MAX_HEAD_BYTES:
            raise h.Reject(431, "request head too large")
        return end

    async def _serve(self, req: h.Request) -> bool:
        self.req = req
        self.left = req.length
        self.chunk_state = 0
        self.body_done = not req.chunked and req.length == 0
        self.delivered = self.body_failed = self.started = self.complete = False
        self.pending_head = b""
        self.body_by = _INF
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": "1.0" if req.http10 else "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.raw_path,
            "query_string": req.query,
            "root_path": "",
            "headers": req.headers,
            "client": self.client,
            "server": self.sockname,
        }
        try:
            await self.server.app(scope, self._receive, self._send)
        except Exception:
            if self.gone or self.eof:
                log.debug("%s %s: app ended after the client left", req.method, req.path)
            else:
                log.exception("%s %s: app failed", req.method, req.path)
            self.complete = False
        if not self.complete:
            if not self.started or self.pending_head:
                await self._write(h.simple_response(500, "internal error: the app failed"))
                self.answered = True
            return False  # a response cut short: the connection cannot carry another
        if not self.body_done and not req.chunked and len(self.buf) >= self.left:
            del self.buf[: self.left]  # the unread rest of a body that is all here
            self.body_done = True
        return self.keep and self.body_done and not self.body_failed and not self.gone

    # -- receive -------------------------------------------------------------------

    async def _receive(self) -> dict[str, Any]:
        if self.delivered or self.body_failed:
            if not (self.eof or self.gone or self.complete or self.body_failed):
                await self._wait_disconnect()
            return {"type": "http.disconnect"}
        if self.body_done:
            self.delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if self.req.continue_:
            self.req.continue_ = False
            if not self.started:
                await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await (self._chunk() if self.req.chunked else self._plain())
        except _BodyError as e:
            log.debug("request body from %s: %s", self.client, e)
            self.body_failed = True
            return {"type": "http.disconnect"}
        self.delivered = self.body_done
        return {"type": "http.request", "body": body, "more_body": not self.body_done}

    async def _fill(self) -> bytes:
        now = trio.current_time()
        if self.body_by == _INF:
            self.body_by = now + BODY_TIMEOUT_S
        self.read_by = min(now + BODY_STALL_S, self.body_by)
        data = await self._recv()
        self.read_by = _INF
        if not data:
            raise _BodyError("timed out mid-body" if self.timed_out else "closed mid-body")
        return data

    async def _plain(self) -> bytes:
        buf = self.buf
        if not buf:
            data = await self._fill()
            if len(data) <= self.left:
                self.left -= len(data)
                self.body_done = self.left == 0
                return data
            buf += data
        n = min(self.left, len(buf))
        body = bytes(buf[:n])
        del buf[:n]
        self.left -= n
        self.body_done = self.left == 0
        return body

    async def _chunk(self) -> bytes:
        buf = self.buf
        while True:
            if self.chunk_state == 1:
                if not buf:
                    buf += await self._fill()
                n = min(self.left, len(buf))
                body = bytes(buf[:n])
                del buf[:n]
                self.left -= n
                if self.left == 0:
                    self.chunk_state = 2
                return body
            if self.chunk_state == 2:
                while len(buf) < 2:
                    buf += await self._fill()
                if buf[:2] != b"\r\n":
                    raise _BodyError("a chunk without its CRLF")
                del buf[:2]
                self.chunk_state = 0
            try:
                self.left = h.chunk_size(await self._line(MAX_CHUNK_LINE))
            except ValueError as e:
                raise _BodyError(str(e)) from None
            if self.left:
                self.chunk_state = 1
                continue
            trailer = 0
            while line := await self._line(h.MAX_HEAD_BYTES):  # the trailer, discarded
                trailer += len(line) + 2
                if trailer > h.MAX_HEAD_BYTES:
                    raise _BodyError("chunked trailer too large")
            self.body_done = True
            return b""

    async def _line(self, limit: int) -> bytes:
        buf = self.buf
        while (i := buf.find(b"\r\n")) < 0:
            if len(buf) > limit:
                raise _BodyError("line too long in a chunked body")
            buf += await self._fill()
        line = bytes(buf[:i])
        del buf[: i + 2]
        return line

    async def _wait_disconnect(self) -> None:
        # The body is whole: read on (the next pipelined request, bounded) until the
        # client leaves or the response is complete (then _send cancels this).
        with trio.CancelScope() as scope:
            self.recv_scope = scope
            try:
                while len(self.buf) <= h.MAX_HEAD_BYTES:
                    data = await self._recv()
                    if not data:
                        return
                    self.buf += data
                await trio.sleep_forever()
            finally:
                self.recv_scope = None

    # -- send ----------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started or self.complete:
                raise RuntimeError("http.response.body outside a response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if not more:
                self.complete = True
                if self.recv_scope is not None:
                    self.recv_scope.cancel()
            framing = self.framing
            if framing == h.LENGTH:
                self.resp_left -= len(body)
                if self.resp_left < 0:
                    raise RuntimeError("response body longer than its Content-Length")
                if not more and self.resp_left:
                    self.keep = False  # shorter than it said: the client must see the end
                out = body
            elif framing == h.CHUNKED:
                out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
                if not more:
                    out += b"0\r\n\r\n"
            elif framing == h.UNTIL_CLOSE:
                out = body
            else:
                out = b""
            if self.pending_head:
                out = self.pending_head + out
                self.pending_head = b""
            if out:
                await self._write(out)
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            req = self.req
            # Another request only once this one's body is all read (or all here).
            keep = req.keep and not self.server.closing
            keep = keep and (self.body_done or (not req.chunked and len(self.buf) >= self.left))
            head, self.framing, self.resp_left, self.keep = h.response_head(
                message["status"],
                message.get("headers", ()),
                head_only=req.method == "HEAD",
                http10=req.http10,
                keep=keep,
            )
            self.started = self.answered = True
            if self.resp_left >= 0:
                self.pending_head = head  # written with the body: one write, one packet
            else:
                await self._write(head)  # a stream: its reader gets the status at once
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    async def _write(self, data: bytes) -> None:
        if self.gone:
            return
        sock = self.sock
        self.write_by = trio.current_time() + SEND_STALL_S
        try:
            sent = await sock.send(data)
            if sent < len(data):
                view = memoryview(data)
                while sent < len(view):
                    self.write_by = trio.current_time() + SEND_STALL_S  # it made progress
                    sent += await sock.send(view[sent:])
        except _SOCKET_ERRORS:
            self._lost()
        except BaseException:
            self._lost()  # cut short (cancelled): what reached the client is unknown
            raise
        finally:
            self.write_by = _INF

    def _lost(self) -> None:
        self.gone = True
        if self.recv_scope is not None:
            self.recv_scope.cancel()

    async def _linger(self) -> None:
        # Close gently: a close with unread input resets the connection, which can
        # destroy the response just written before the client has read it.
        with trio.move_on_after(LINGER_S):
            try:
                self.sock.shutdown(socket.SHUT_WR)
                got = 0
                while got < LINGER_BYTES:
                    data = await self.sock.recv(RECV_BYTES)
                    if not data:
                        break
                    got += len(data)
            except _SOCKET_ERRORS:
                pass
