"""A server at ``--replica`` that is no vLLM with dev routes: it answers ``GET /health``
with 200 and everything else with 404, as a vLLM started without
``VLLM_SERVER_DEV_MODE=1`` (or another service at that port) does. The dispatcher's probe
must call it unhealthy and ask for no turn (tests/test_no_waste.py, bench/waste.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio

__all__ = ["not_a_vllm"]


async def _one(stream: trio.SocketStream) -> None:
    # One HTTP/1.1 exchange, then close (Connection: close): clients reconnect each time.
    async with stream:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        ok = data.startswith(b"GET /health ")
        head = b"HTTP/1.1 200 OK" if ok else b"HTTP/1.1 404 Not Found"
        body = b"" if ok else b'{"detail":"Not Found"}'
        await stream.send_all(
            head + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )


@asynccontextmanager
async def not_a_vllm() -> AsyncIterator[str]:
    """Serve it on a free loopback port while the block runs; its base URL."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _one, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()
