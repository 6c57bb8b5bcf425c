"""A lean HTTP/1.1 server for one ASGI 3 app, on trio (:func:`serve_asgi`).

Hypercorn costs about 1.3 ms of CPU a request on a small machine, this server about a
sixth of that (``bench/httpfront.py`` prints both), which matters where the whole
dispatcher's budget is 1 ms a request. It speaks what the dispatcher's front and the
stubs need: HTTP/1.1 and 1.0, keep-alive, sequential pipelining, request bodies by
``Content-Length`` or chunked (handed to the app piece by piece, never buffered whole),
``Expect: 100-continue``, responses by ``Content-Length`` or chunked (each body message
of a streaming response is written at once), ``HEAD``. No TLS, no HTTP/2, no WebSocket,
no lifespan protocol (the apps served here have no lifespan handlers), no ``date`` or
``server`` header. Nothing here is specific to the dispatcher.

Heads are parsed and checked by :mod:`dispatcher.httphead`: a malformed or ambiguous
request (a head line ending in a bare LF included) is answered (400; 431 for a head over
64 KiB or 100 fields; 501 for a transfer coding other than chunked) and its connection
closed. One connection is :mod:`dispatcher.httpconn`; every wait there is bounded: a head
not whole 30 s after its first byte or a keep-alive connection idle 75 s ends the
connection; a request body that gets no byte for 60 s, or is not whole 300 s after its
first wait, ends as ``http.disconnect`` to the app; a response write that makes no
progress for 60 s ends the connection. An idle connection is closed only before any
byte of a next request was read from it (a request read is always served), and its 75 s
are well over what clients keep an idle connection (httpx: 5 s), so a client does not
send on a connection the server is closing. A client that goes away is told to the app
as ``http.disconnect``, so a streaming response ends with its reader. An app error before
the response started answers 500; after, the connection closes. One bad connection is
logged at debug and closed; the server serves on.
"""

from __future__ import annotations

import os
import socket
import stat
from functools import partial
from typing import Any

import trio

from gpu_slicer.dispatcher.httpconn import Front

__all__ = ["BACKLOG", "serve_asgi"]

BACKLOG = socket.SOMAXCONN


async def _listen(bind: str) -> tuple[trio.socket.SocketType, str]:
    if bind.startswith("unix:"):
        path = bind[5:]
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.remove(path)  # a stale socket of a previous run
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = path
    else:
        host, sep, port = bind.replace("[", "").replace("]", "").rpartition(":")
        if not sep or not port.isdigit():
            host, port = bind, "8000"  # as hypercorn reads a bind without a port
        sock = trio.socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
        )
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        address = (host, int(port))
    try:
        await sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        where = f"unix:{name}"
    elif sock.family == socket.AF_INET6:
        where = f"[{name[0]}]:{name[1]}"
    else:
        where = f"{name[0]}:{name[1]}"
    return sock, f"http://{where}"


async def serve_asgi(
    app: Any,
    bind: str,
    shutdown: trio.Event,
    *,
    grace: float,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI 3 ``app`` over HTTP/1.1 on ``bind`` ("HOST:PORT", "[V6]:PORT" or
    "unix:PATH") until ``shutdown`` is set; ``task_status.started`` gets the bound
    address as hypercorn gave it (["http://127.0.0.1:8100"], ["http://unix:/run/x.sock"]).
    A failed bind raises before ``started``.

    Once ``shutdown`` is set the listening socket closes (new connections are refused),
    idle keep-alive connections close, and the requests still open (event streams,
    long-polls) get up to ``grace`` seconds, then are cancelled; it returns when every
    connection is closed. Only the ``http`` scope is served: no lifespan events."""
    sock, where = await _listen(bind)
    listener = trio.SocketListener(sock)
    server = Front(app)
    try:
        async with trio.open_nursery() as handlers:
            async with trio.open_nursery() as accepting:
                serve = partial(trio.serve_listeners, handler_nursery=handlers)
                accepting.start_soon(serve, server.handle, [listener])
                accepting.start_soon(server.reap)
                task_status.started([where])
                await shutdown.wait()
                accepting.cancel_scope.cancel()
            await listener.aclose()
            server.close_idle()
            handlers.cancel_scope.deadline = trio.current_time() + grace
            # The deadlines of the requests left are bounded by grace from here on.
    finally:
        await trio.aclose_forcefully(listener)
