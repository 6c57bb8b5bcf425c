"""The metrics listener: a tiny, bounded HTTP/1.1 responder for ``GET /metrics``.

slicerd is a trio program whose only job is to keep granting turns, so its Prometheus
endpoint is not a web framework but one small loop that can never stall or crash it:

* it answers ``GET /metrics`` (``HEAD`` too) with what ``render()`` returns; any other
  path is 404, any other method 405, a request that is not HTTP 400;
* a request head is at most `MAX_HEAD` bytes before its blank line (8 KiB: 431 beyond;
  exactly 8 KiB is served) and must arrive within
  `READ_TIMEOUT` seconds; the answer must be taken within `WRITE_TIMEOUT` seconds; every
  answer says ``Connection: close`` and the connection is closed after it, so a scraper
  that sends nothing, sends garbage or stops reading is dropped, never waited for;
* at most `MAX_CONNECTIONS` connections are served at once; one more is answered 503
  (``Retry-After: 1``, ``Connection: close``) within `BUSY_GRACE` and closed, so a
  scraper kept out by idle connections (a slowloris) sees why, not a reset;
* one connection's failure is logged and costs only that connection.

`serve_metrics` is what slicerd starts. The address is ``HOST:PORT`` (``[::1]:9403`` for
IPv6; port 0 picks a free one); a port that cannot be bound raises `MetricsListenError`
(slicerd exits 69), a host that does not resolve `MetricsAddressError` (a configuration
error: 78), both before the daemon reports ready.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from gpu_slicer.slicer.config import parse_listen
from gpu_slicer.slicer.errors import ConfigError, SlicerError

if TYPE_CHECKING:
    from gpu_slicer.slicer.config import Config
    from gpu_slicer.slicer.server import Server

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "READ_TIMEOUT",
    "WRITE_TIMEOUT",
    "MetricsAddressError",
    "MetricsListenError",
    "serve",
    "serve_metrics",
]

log = logging.getLogger("slicer.metrics")

MAX_HEAD = 8 << 10
READ_TIMEOUT = 5.0
WRITE_TIMEOUT = 10.0
MAX_CONNECTIONS = 16
BUSY_GRACE = 1.0  # seconds an over-the-cap connection gets to take its 503
_CLOSE_GRACE = 1.0
_DRAIN = 64 << 10

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
    500: "Internal Server Error",
}


class MetricsListenError(SlicerError):
    """The metrics listener cannot listen on its address (a busy port, say)."""


class MetricsAddressError(ConfigError):
    """The host of `metrics_listen` does not resolve: the configuration is wrong."""


async def serve_metrics(
    cfg: Config,
    server: Server,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `server`'s metrics (`slicer.metrics`) on `cfg.metrics_listen` until cancelled,
    started with the bound addresses; with no `metrics_listen`, start at once with none."""
    if not cfg.metrics_listen:
        task_status.started([])
        return
    # Imported only when asked for: prometheus-client adds about a tenth of a second to
    # every daemon start (measured with -X importtime).
    from gpu_slicer.slicer.metrics import SlicerMetrics

    metrics = SlicerMetrics(server)
    server.on_event = metrics.event
    await serve(cfg.metrics_listen, metrics.render, task_status=task_status)


async def serve(
    listen: str,
    render: Callable[[], Awaitable[tuple[bytes, str]]],
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `render` (body, content type) at ``http://LISTEN/metrics`` until cancelled;
    `task_status.started` gets the bound (host, port) addresses."""
    host, port = parse_listen(listen)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except socket.gaierror as e:
        raise MetricsAddressError(
            f"metrics_listen {listen}: cannot resolve host {host!r}: {e.strerror or e} "
            "(give an address such as 127.0.0.1:9403, or a name this host resolves)"
        ) from e
    except OSError as e:
        why = e.strerror or str(e)
        hint = (
            "another process holds that port: pick another metrics_listen"
            if e.errno == errno.EADDRINUSE
            else "check metrics_listen"
        )
        raise MetricsListenError(f"metrics_listen {listen}: cannot listen: {why} ({hint})") from e
    addresses = [_address(ln) for ln in listeners]
    responder = _Responder(render)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, responder.handle, listeners)
        urls = (f"http://{_host(h)}:{p}/metrics" for h, p in addresses)
        log.info("metrics on %s", ", ".join(urls))
        task_status.started(addresses)


def _host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _address(listener: trio.SocketListener) -> tuple[str, int]:
    name = listener.socket.getsockname()
    return str(name[0]), int(name[1])


class _Responder:
    def __init__(self, render: Callable[[], Awaitable[tuple[bytes, str]]]) -> None:
        self.render = render
        self.active = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        # Everything is caught: an exception escaping a handler would cancel
        # serve_listeners and, through the daemon's nursery, every turn.
        if self.active >= MAX_CONNECTIONS:
            with trio.move_on_after(BUSY_GRACE), contextlib.suppress(Exception):
                body = b"too many metrics connections at once; retry\n"
                await _answer(stream, 503, body, retry_after=True, grace=BUSY_GRACE / 2)
            await _close(stream)
            return
        self.active += 1
        try:
            await self._serve_one(stream)
        except Exception as e:
            log.debug("metrics connection dropped: %s: %s", type(e).__name__, e)
        finally:
            self.active -= 1
            await _close(stream)

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        head = b""
        with trio.move_on_after(READ_TIMEOUT):
            while b"\r\n\r\n" not in head and b"\n\n" not in head:
                # Without its blank line yet, the head is at least len(head) - 3 bytes
                # (the last three may begin the "\r\n\r\n"): too large only past that.
                if len(head) > MAX_HEAD + 3:
                    await _answer(stream, 431, b"request head too large\n")
                    return
                data = await stream.receive_some(MAX_HEAD + 4)
                if not data:
                    return  # the peer went away before a whole head: nothing to answer
                head += data
        if b"\r\n\r\n" not in head and b"\n\n" not in head:
            return  # a scraper that never finished its head is dropped unanswered
        if len(head.split(b"\n\n")[0].split(b"\r\n\r\n")[0]) > MAX_HEAD:
            await _answer(stream, 431, b"request head too large\n")
            return
        words = head.split(b"\n", 1)[0].rstrip(b"\r").split(b" ")
        if len(words) != 3 or not words[2].startswith(b"HTTP/1."):
            await _answer(stream, 400, b"not an HTTP/1.x request\n")
            return
        method, target = words[0], words[1].split(b"?", 1)[0]
        if target != b"/metrics":
            await _answer(stream, 404, b"only /metrics is served here\n")
            return
        if method not in (b"GET", b"HEAD"):
            await _answer(stream, 405, b"only GET\n", allow=True)
            return
        try:
            body, ctype = await self.render()
        except Exception:
            log.exception("rendering the metrics failed")
            await _answer(stream, 500, b"rendering the metrics failed\n")
            return
        await _answer(stream, 200, body, ctype, head_only=method == b"HEAD")


async def _answer(
    stream: trio.SocketStream,
    status: int,
    body: bytes,
    ctype: str = "text/plain; charset=utf-8",
    *,
    allow: bool = False,
    head_only: bool = False,
    retry_after: bool = False,
    grace: float = _CLOSE_GRACE,
) -> None:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {ctype}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    if allow:
        lines.append("Allow: GET, HEAD")
    if retry_after:
        lines.append("Retry-After: 1")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with trio.move_on_after(WRITE_TIMEOUT):
        await stream.send_all(data if head_only else data + body)
        # Closing with unread input (the rest of a head too large) resets the connection
        # and may destroy the answer before the peer read it: half-close, then drain a
        # little, bounded, until the peer closes.
        await stream.send_eof()
        with trio.move_on_after(grace):
            drained = 0
            while drained < _DRAIN and (got := await stream.receive_some(_DRAIN)):
                drained += len(got)


async def _close(stream: trio.SocketStream) -> None:
    broken = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)
    shield = trio.CancelScope(shield=True)
    with shield, trio.move_on_after(_CLOSE_GRACE), contextlib.suppress(*broken):
        await stream.aclose()
