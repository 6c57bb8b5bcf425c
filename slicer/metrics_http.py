"""The metrics listener: a tiny, bounded HTTP/1.1 responder for ``GET /metrics``.

slicerd is a trio program whose only job is to keep granting turns, so its Prometheus
endpoint is not a web framework but one small loop that can never stall or crash it:

* it answers ``GET /metrics`` (``HEAD`` too) with what ``render()`` returns; any other
  path is 404, any other method 405, a request that is not HTTP 400;
* a request head is at most `MAX_HEAD` bytes (8 KiB: 431 beyond) and must arrive within
  `READ_TIMEOUT` seconds; the answer must be taken within `WRITE_TIMEOUT` seconds; every
  answer says ``Connection: close`` and the connection is closed after it, so a scraper
  that sends nothing, sends garbage or stops reading is dropped, never waited for;
* at most `MAX_CONNECTIONS` connections are served at once; one more is closed at once;
* one connection's failure is logged and costs only that connection.

`serve_metrics` is what slicerd starts. The address is ``HOST:PORT`` (``[::1]:9403`` for
IPv6; port 0 picks a free one); a port that cannot be bound raises `MetricsListenError`
before the daemon reports ready.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from gpu_slicer.slicer.config import parse_listen
from gpu_slicer.slicer.errors import SlicerError

if TYPE_CHECKING:
    from gpu_slicer.slicer.config import Config
    from gpu_slicer.slicer.server import Server

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "READ_TIMEOUT",
    "WRITE_TIMEOUT",
    "MetricsListenError",
    "serve",
    "serve_metrics",
]

log = logging.getLogger("slicer.metrics")

MAX_HEAD = 8 << 10
READ_TIMEOUT = 5.0
WRITE_TIMEOUT = 10.0
MAX_CONNECTIONS = 16
_CLOSE_GRACE = 1.0
_DRAIN = 64 << 10

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


class MetricsListenError(SlicerError):
    """The metrics listener cannot listen on its address (busy port, bad host)."""


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
    render: Callable[[], tuple[bytes, str]],
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `render` (body, content type) at ``http://LISTEN/metrics`` until cancelled;
    `task_status.started` gets the bound (host, port) addresses."""
    host, port = parse_listen(listen)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
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
        log.info("metrics on %s", ", ".join(f"http://{h}:{p}/metrics" for h, p in addresses))
        task_status.started(addresses)


def _address(listener: trio.SocketListener) -> tuple[str, int]:
    name = listener.socket.getsockname()
    return str(name[0]), int(name[1])


class _Responder:
    def __init__(self, render: Callable[[], tuple[bytes, str]]) -> None:
        self.render = render
        self.active = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        # Everything is caught: an exception escaping a handler would cancel
        # serve_listeners and, through the daemon's nursery, every turn.
        if self.active >= MAX_CONNECTIONS:
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
                if len(head) > MAX_HEAD:
                    await _answer(stream, 431, b"request head too large\n")
                    return
                data = await stream.receive_some(MAX_HEAD + 1)
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
            body, ctype = self.render()
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
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with trio.move_on_after(WRITE_TIMEOUT):
        await stream.send_all(data if head_only else data + body)
        # Closing with unread input (the rest of a head too large) resets the connection
        # and may destroy the answer before the peer read it: half-close, then drain a
        # little, bounded, until the peer closes.
        await stream.send_eof()
        with trio.move_on_after(_CLOSE_GRACE):
            drained = 0
            while drained < _DRAIN and (got := await stream.receive_some(_DRAIN)):
                drained += len(got)


async def _close(stream: trio.SocketStream) -> None:
    broken = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)
    shield = trio.CancelScope(shield=True)
    with shield, trio.move_on_after(_CLOSE_GRACE), contextlib.suppress(*broken):
        await stream.aclose()
