"""HTTP/1.1 heads, sans-IO: a request head parsed and checked, a response head framed.

The lean server (:mod:`dispatcher.httpserver`) reads bytes and calls these; nothing here
does IO. A request head is refused (:class:`Reject`, its status to answer with) when it
is malformed (400), too large (431: over :data:`MAX_HEAD_BYTES` or :data:`MAX_HEADERS`
fields), frames its body ambiguously (400: both ``Content-Length`` and
``Transfer-Encoding``, conflicting or malformed lengths, chunked not last or twice, a
chunked HTTP/1.0 request), uses a transfer coding other than chunked (501), an
expectation other than ``100-continue`` (417) or an HTTP version other than 1.x (505).
Header names are lowercased; a value with a control character or a line break, a folded
line, or a space before a colon is malformed (the request-smuggling vectors). Such a
refusal answers OpenAI's JSON error body (:func:`simple_response`), as every answer of
the dispatcher's front does.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

__all__ = [
    "CHUNKED",
    "LENGTH",
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "NONE",
    "UNTIL_CLOSE",
    "Reject",
    "Request",
    "chunk_size",
    "error_json",
    "parse_request",
    "response_head",
    "simple_response",
]

MAX_HEAD_BYTES = 64 << 10  # request line and header fields (and, apart, a chunked trailer)
MAX_HEADERS = 100
NONE, LENGTH, CHUNKED, UNTIL_CLOSE = range(4)  # how a response body is framed

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
_FIELD = re.compile(rb"(" + _TOKEN + rb"):([\t\x20-\x7e\x80-\xff]*)")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
_FRAMING = frozenset([b"content-length", b"transfer-encoding", b"connection", b"expect", b"host"])
_PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


class Reject(Exception):
    """A request refused before any app saw it: answer ``status``, then close."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class Request:
    """A parsed request head: the ASGI fields, and how its body is framed."""

    __slots__ = ("chunked", "continue_", "headers", "http10", "keep", "length", "method",
                 "path", "query", "raw_path")  # fmt: skip

    def __init__(self) -> None:
        self.method = ""
        self.http10 = False
        self.raw_path = self.query = b""
        self.path = ""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunked = False  # else the body is `length` bytes
        self.length = 0
        self.keep = True  # the client allows another request on this connection
        self.continue_ = False  # it waits for "100 Continue" before sending its body


def parse_request(head: bytes) -> Request:
    """The request in ``head`` (its bytes up to, not including, the blank line)."""
    lines = head.split(b"\r\n")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        raise Reject(400, "malformed request line")
    method, target, major, minor = m.groups()
    if major != b"1":
        raise Reject(505 if major > b"1" else 400, "unsupported HTTP version")
    if len(lines) > MAX_HEADERS + 1:
        raise Reject(431, "too many header fields")
    req = Request()
    req.http10 = http10 = minor == b"0"
    headers = req.headers
    lengths: list[bytes] = []
    codings: list[bytes] = []
    connection = b""
    expect = None
    hosts = 0
    for line in lines[1:]:
        fm = _FIELD.fullmatch(line)
        if fm is None:
            raise Reject(400, "malformed header field")
        name = fm[1].lower()
        value = fm[2].strip(b" \t")
        headers.append((name, value))
        if name in _FRAMING:
            if name == b"content-length":
                lengths += value.split(b",")
            elif name == b"transfer-encoding":
                codings += value.lower().split(b",")
            elif name == b"connection":
                connection += b"," + value.lower()
            elif name == b"expect":
                expect = value.lower()
            else:
                hosts += 1
    if hosts > 1 or (hosts == 0 and not http10):
        raise Reject(400, "a request needs one Host header field")
    if codings:
        if lengths:
            raise Reject(400, "both Content-Length and Transfer-Encoding")
        if http10:
            raise Reject(400, "Transfer-Encoding in an HTTP/1.0 request")
        codings = [c.strip(b" \t") for c in codings]
        if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
            raise Reject(400, "the last transfer coding must be chunked, once")
        if len(codings) > 1:
            raise Reject(501, "transfer codings other than chunked")
        req.chunked = True
    elif lengths:
        values = {v.strip(b" \t") for v in lengths}
        value = values.pop()
        if values or not value.isdigit() or len(value) > 18:
            raise Reject(400, "malformed or conflicting Content-Length")
        req.length = int(value)
    if connection:
        tokens = {t.strip(b" \t") for t in connection.split(b",")}
        req.keep = b"keep-alive" in tokens if http10 else b"close" not in tokens
    else:
        req.keep = not http10
    if expect is not None and not http10:
        if expect != b"100-continue":
            raise Reject(417, "unknown expectation")
        req.continue_ = req.chunked or req.length > 0
    if target.startswith(b"/"):
        pass
    elif target.startswith((b"http://", b"https://")):
        slash = target.find(b"/", target.index(b"//") + 2)
        target = target[slash:] if slash >= 0 else b"/"
    elif not (target == b"*" and method == b"OPTIONS"):
        raise Reject(400, "malformed request target")
    req.raw_path, _, req.query = target.partition(b"?")
    path = req.raw_path.decode("ascii")
    req.path = unquote(path) if "%" in path else path
    req.method = method.decode("ascii")
    return req


def chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (extensions ignored); ValueError when malformed."""
    size = line.split(b";", 1)[0].strip(b" \t")
    if not _HEX.fullmatch(size):
        raise ValueError("malformed chunk size")
    return int(size, 16)


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not isinstance(status, int) or not 100 <= status <= 999:
            raise ValueError(f"bad response status {status!r}")
        status = int(status)
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES.get(status, b""))
    return line


def error_json(status: int, message: str) -> bytes:
    """OpenAI's error body ``{"error": {"message", "type", "param": null, "code"}}`` for
    an answer given by ``status`` alone; type and code come from the status's phrase
    (431: ``RequestHeaderFieldsTooLargeError``, ``request_header_fields_too_large``)."""
    words = re.findall(r"[A-Za-z]+", _PHRASES.get(status, b"Error").decode())
    typ = "".join(w[:1].upper() + w[1:] for w in words)
    typ = typ if typ.endswith("Error") else typ + "Error"
    code = "_".join(w.lower() for w in words)
    body = {"error": {"message": message, "type": typ, "param": None, "code": code}}
    return json.dumps(body, separators=(",", ":")).encode()


def simple_response(status: int, why: str = "") -> bytes:
    """A whole JSON error response (:func:`error_json`; ``why``, else the status's
    phrase, is its message), closing the connection."""
    body = error_json(status, why or _PHRASES.get(status, b"Error").decode())
    return _status_line(status) + (
        b"content-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%b" % (len(body), body)
    )


def response_head(
    status: int, headers: Any, *, head_only: bool, http10: bool, keep: bool
) -> tuple[bytes, int, int, bool]:
    """(head, framing, Content-Length or -1, keep) for an ASGI response start.

    The app's ``content-length`` is kept (normalized); its ``transfer-encoding`` and
    ``connection`` are ours to set (its ``connection: close`` is honoured). A body of
    unknown length is chunked, or for HTTP/1.0 ends with the connection; a HEAD, 1xx,
    204 or 304 response has none. ``keep`` false (or the app's close) says close."""
    parts = [_status_line(status)]
    length = -1
    kept = 0
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-length":
            if not value.strip().isdigit():
                raise ValueError(f"bad Content-Length {value!r}")
            length = int(value)
            continue
        if lname == b"transfer-encoding":
            continue
        if lname == b"connection":
            keep = keep and b"close" not in value.lower()
            continue
        parts += (name, b": ", value, b"\r\n")
        kept += 1
    if head_only or status < 200 or status in (204, 304):
        framing = NONE
    elif length >= 0:
        framing = LENGTH
    elif http10:
        framing, keep = UNTIL_CLOSE, False
    else:
        framing = CHUNKED
    if length >= 0:
        parts.append(b"content-length: %d\r\n" % length)
    elif framing == CHUNKED:
        parts.append(b"transfer-encoding: chunked\r\n")
    if not keep:
        parts.append(b"connection: close\r\n")
    elif http10:
        parts.append(b"connection: keep-alive\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(parts) - 3 * kept  # the CRLFs we wrote: no more may be in there
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise ValueError("a line break in a response header")
    return head, framing, length, keep
