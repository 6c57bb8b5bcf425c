"""A lean keep-alive HTTP/1.1 client for the generation path: JSON POSTs to one replica.

The dispatcher sends every generation request to one ``http://HOST:PORT[/PREFIX]``;
httpx costs over a millisecond of CPU per request on a slow core (its pool scans every
connection per request, h11 parses byte by byte), the dispatcher's whole budget. This
client does the one thing the generation path needs: write one POST on a pooled
connection, read one response (``Content-Length``, chunked, or until close), hand the
connection back. Control calls (sleep, wake, load) stay on httpx.

Rules:

* **No timeouts inside** but the connect bound: the caller bounds each whole call with
  ``trio.fail_after`` (the replica client's invariant 6); nothing here waits otherwise.
* **A connection goes back to the idle pool only in a known state:** the response was
  read completely, nothing followed it, the server did not say ``Connection: close``,
  and the call was neither cancelled nor failed. Every other connection is closed.
* **One retry, only when nothing was read:** a server may close an idle keep-alive
  connection at any moment (uvicorn's keep-alive timeout is 5 s), and the request then
  fails to send or reads EOF before any byte of a response. Only then, and only on a
  reused connection, the request is sent once more on a fresh one. A generation POST
  changes no replica state (it only computes; the dispatcher judges every answer), so a
  repeat in the rare case that the server did read it costs compute, never correctness.
  Once a byte of the response has arrived, nothing is retried.
* **Bounded memory:** the response head is at most 64 KiB, a body at most ``max_body``;
  at most ``max_idle`` connections are kept (the turn loop bounds concurrency).
"""

from __future__ import annotations

import select
from collections.abc import Iterable
from typing import NamedTuple
from urllib.parse import urlsplit

import trio

__all__ = ["MAX_BODY", "MAX_HEAD", "Pool", "Response", "WireError"]

MAX_HEAD = 64 << 10
MAX_BODY = 256 << 20
_READ = 1 << 16
_NO_BODY = frozenset((204, 304))


class WireError(Exception):
    """No usable answer: the connection failed, or the response broke HTTP/1.1 or a limit."""


class _Stale(WireError):
    """The connection ended before any byte of the response (retryable if it was reused)."""


class Response(NamedTuple):
    """One response: status, reason phrase, headers (lower-case names), whole body."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


class _Conn:
    __slots__ = ("buf", "got", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.got = 0  # bytes received for the current request

    def close(self) -> None:
        # Synchronous: it runs in finally blocks of cancelled calls, where awaiting is moot.
        self.stream.socket.close()

    def idle_ok(self) -> bool:
        # Readable while idle means EOF or unsolicited bytes (a 408 before a close): either
        # way the connection's state is not "waiting for our request".
        # poll, not select: a busy dispatcher's descriptors go past select's 1024.
        poller = select.poll()
        try:
            poller.register(self.stream.socket.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    async def fill(self) -> bool:
        """Read more into ``buf``; False at EOF."""
        data = await self.stream.receive_some(_READ)
        self.buf += data
        self.got += len(data)
        return bool(data)


class Pool:
    """Keep-alive connections to one ``http://HOST:PORT``; one request per connection at
    a time. ``prefix`` is the base URL's path, put before every request path."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str = "",
        *,
        max_idle: int = 32,
        max_body: int = MAX_BODY,
        connect_timeout: float | None = None,
    ) -> None:
        self.host, self.port, self.prefix = host, port, prefix.rstrip("/")
        self.max_idle, self.max_body = max_idle, max_body
        self.connect_timeout = connect_timeout
        name = f"[{host}]" if ":" in host else host
        self._host_header = name if port == 80 else f"{name}:{port}"
        self._idle: list[_Conn] = []
        self._closed = False
        self.connects = 0  # connections opened, for tests and benches

    @classmethod
    def from_url(
        cls, url: str, *, max_idle: int = 32, connect_timeout: float | None = None
    ) -> Pool | None:
        """A pool for a plain ``http://host[:port][/prefix]`` URL, else None (https, user
        info, a query: left to httpx)."""
        try:
            u = urlsplit(url)
            port = u.port or 80
        except ValueError:
            return None
        if u.scheme != "http" or not u.hostname or u.username or u.query or u.fragment:
            return None
        return cls(u.hostname, port, u.path, max_idle=max_idle, connect_timeout=connect_timeout)

    def close(self) -> None:
        """Close the idle connections; connections in use close when their call ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def aclose(self) -> None:
        """:meth:`close`, as an async method (a checkpoint)."""
        self.close()
        await trio.lowlevel.checkpoint()

    async def post_json(
        self, path: str, payload: bytes, headers: Iterable[tuple[str, str]] = ()
    ) -> Response:
        """POST ``payload`` (JSON) to ``prefix + path`` with the extra ``headers``; the
        whole response, whatever its status.

        Raises :class:`WireError` when no complete, well-formed response came; a
        cancellation closes the connection in use."""
        if self._closed:
            raise WireError("the connection pool is closed")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"{extra}\r\n"
        ).encode("latin-1")
        request = head + payload
        conn = self._checkout()
        reused = conn is not None
        keep = False
        try:
            if conn is None:
                conn = await self._connect()
            try:
                resp, keep = await self._exchange(conn, request)
            except _Stale:
                if not reused:
                    raise
                conn.close()  # the server closed it while idle: once more on a fresh one
                conn = None
                conn = await self._connect()
                resp, keep = await self._exchange(conn, request)
            return resp
        finally:
            if conn is not None:
                if keep and not self._closed and len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                else:
                    conn.close()

    def _checkout(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()  # the most recent: the least likely to be timed out
            if conn.idle_ok():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        try:
            with trio.fail_after(self.connect_timeout or float("inf")):
                stream = await trio.open_tcp_stream(self.host, self.port)
        except trio.TooSlowError:
            raise WireError(f"connect: no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise WireError(f"connect: {type(exc).__name__}: {exc}") from exc
        self.connects += 1
        return _Conn(stream)

    async def _exchange(self, conn: _Conn, request: bytes) -> tuple[Response, bool]:
        """Send ``request``, read its response; (response, whether ``conn`` is reusable)."""
        try:
            await conn.stream.send_all(request)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__ or exc
            raise _Stale(f"send: {type(cause).__name__}: {cause}") from exc
        conn.got = 0
        try:
            return await self._read(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__ or exc
            if not conn.got and not isinstance(exc, trio.ClosedResourceError):
                raise _Stale(f"receive: {type(cause).__name__}: {cause}") from exc
            raise WireError(f"receive: {type(cause).__name__}: {cause}") from exc

    async def _read(self, conn: _Conn) -> tuple[Response, bool]:
        while True:
            status, reason, headers, version = await self._read_head(conn)
            if not 100 <= status < 200 or status == 101:
                break  # an interim 1xx (100 Continue) precedes the real response
        keep = version == "HTTP/1.1"
        if (tokens := headers.get("connection")) is not None:
            keep = keep and "close" not in {t.strip() for t in tokens.lower().split(",")}
        te = headers.get("transfer-encoding")
        if status in _NO_BODY:
            body = b""
        elif te is not None:
            if te.strip().lower() != "chunked":  # no gzip: never asked for
                raise WireError(f"unsupported transfer-encoding {te[:40]!r}")
            if "content-length" in headers:
                # Both framings (RFC 9112 6.3): a sign of response splitting; read it by
                # chunks, then never trust this connection again.
                keep = False
            body = await self._read_chunked(conn)
        elif "content-length" in headers:
            body = await self._read_length(conn, _content_length(headers["content-length"]))
        else:
            body = await self._read_to_close(conn)
            keep = False
        # Bytes after the response were never asked for: the connection's state is unknown.
        # After an error answer the server may not have read our whole body (it answers
        # early, then reads the rest as a new request): such a connection is not reused.
        keep = keep and not conn.buf and 200 <= status < 300
        return Response(status, reason, headers, body), keep

    async def _read_head(self, conn: _Conn) -> tuple[int, str, dict[str, str], str]:
        buf = conn.buf
        start = 0
        while (end := buf.find(b"\r\n\r\n", start)) < 0:
            if len(buf) > MAX_HEAD:
                raise WireError(f"response head over {MAX_HEAD} bytes")
            start = max(0, len(buf) - 3)
            if not await conn.fill():
                if conn.got:
                    raise WireError("the server closed the connection inside the response head")
                raise _Stale("the server closed the connection before answering")
        if end > MAX_HEAD:
            raise WireError(f"response head over {MAX_HEAD} bytes")
        lines = buf[:end].decode("latin-1").split("\r\n")
        del buf[: end + 4]
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not _digits(code):
            raise WireError(f"malformed status line {lines[0][:100]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise WireError(f"malformed header line {line[:100]!r}")
            name = name.lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        return int(code), reason, headers, version

    async def _read_length(self, conn: _Conn, n: int) -> bytes:
        if n > self.max_body:
            raise WireError(f"response body of {n} bytes is over the {self.max_body} limit")
        buf = conn.buf
        while len(buf) < n:
            if not await conn.fill():
                raise WireError(f"the server closed the connection after {len(buf)} of {n} "
                                "body bytes")  # fmt: skip
        body = bytes(buf[:n])
        del buf[:n]
        return body

    async def _read_line(self, conn: _Conn) -> bytes:
        buf = conn.buf
        while (end := buf.find(b"\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise WireError("chunk header line too long")
            if not await conn.fill():
                raise WireError("the server closed the connection inside a chunked body")
        line = bytes(buf[:end])
        del buf[: end + 2]
        return line

    async def _read_chunked(self, conn: _Conn) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size_field = (await self._read_line(conn)).split(b";", 1)[0].strip()
            if not size_field or size_field.strip(b"0123456789abcdefABCDEF"):
                raise WireError(f"malformed chunk size {size_field[:40]!r}")
            size = int(size_field, 16)
            if size == 0:
                break
            total += size
            if total > self.max_body:
                raise WireError(f"chunked response body over the {self.max_body} limit")
            parts.append(await self._read_length(conn, size))
            if await self._read_line(conn):
                raise WireError("a chunk is not followed by CRLF")
        trailers = 0
        while line := await self._read_line(conn):  # trailers, ignored
            trailers += len(line)
            if trailers > MAX_HEAD:
                raise WireError(f"response trailers over {MAX_HEAD} bytes")
        return b"".join(parts)

    async def _read_to_close(self, conn: _Conn) -> bytes:
        while await conn.fill():
            if len(conn.buf) > self.max_body:
                raise WireError(f"response body over the {self.max_body} limit")
        body = bytes(conn.buf)
        conn.buf.clear()
        return body


def _digits(text: str) -> bool:
    # str.isdigit() is also true for "²" and other non-ASCII digits int() refuses.
    return text.isascii() and text.isdigit()


def _content_length(value: str) -> int:
    # Repeated headers arrive joined ("5, 5"); they must agree.
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1 or not _digits(v := values.pop()):
        raise WireError(f"malformed content-length {value[:40]!r}")
    return int(v)
