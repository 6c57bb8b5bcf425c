"""The HTTP front's own cost: server CPU per request, the lean server against hypercorn.

One sequential keep-alive client (stdlib ``http.client``) sends ``--requests`` small POSTs
to a tiny route; the server runs in its own process and its CPU time (psutil, user +
system) over the run, divided by the requests, is its cost per request. Both servers
serve the same apps: a tiny Starlette app (``starlette``) and a bare ASGI app (``raw``,
the server's cost alone). Rounds alternate between the servers; the medians and their
ratio are printed. No figure here is asserted anywhere.

    .venv/bin/python bench/httpfront.py [--requests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

import psutil

SERVERS = ("lean", "hypercorn")
APPS = ("starlette", "raw")
BODY = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()


def _apps() -> dict[str, Any]:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def status(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"ok": True, "bytes": len(body)})

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # hypercorn asks; answer it like an app with none
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = b'{"ok":true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"11")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return {"starlette": Starlette(routes=[Route("/status", status, methods=["POST"])]),
            "raw": raw}  # fmt: skip


def serve(server: str, app_name: str, port: int) -> None:
    """The server process: serve ``app_name`` with ``server`` on 127.0.0.1:port."""
    import trio

    app = _apps()[app_name]
    stop = trio.Event()
    bind = f"127.0.0.1:{port}"
    if server == "lean":
        from gpu_slicer.dispatcher.httpserver import serve_asgi

        front: Any = partial(serve_asgi, app, bind, stop, grace=1.0)
    else:
        from hypercorn.config import Config
        from hypercorn.trio import serve as hypercorn_serve

        conf = Config()
        conf.bind = [bind]
        conf.accesslog = None
        conf.loglevel = "WARNING"
        front = partial(hypercorn_serve, app, conf, shutdown_trigger=stop.wait)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(front)
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the bench closes stdin
            stop.set()

    trio.run(main)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(server: str, app_name: str, requests: int) -> float:
    """Server CPU microseconds per request for one run."""
    port = _free_port()
    argv = [sys.executable, __file__, "--serve", server, app_name, str(port)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"content-type": "application/json"}
        for _ in range(50):  # warm up: imports, caches, the connection
            conn.request("POST", "/status", BODY, headers)
            conn.getresponse().read()
        ps = psutil.Process(proc.pid)
        before = ps.cpu_times()
        for _ in range(requests):
            conn.request("POST", "/status", BODY, headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
        after = ps.cpu_times()
        conn.close()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    cpu = (after.user - before.user) + (after.system - before.system)
    return cpu / requests * 1e6


def main() -> None:
    """Print the median server CPU per request of each server and app, and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", nargs=3, metavar=("SERVER", "APP", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]))
        return
    print(f"# {args.requests} sequential keep-alive POSTs per run, {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip
    for app_name in APPS:
        runs: dict[str, list[float]] = {s: [] for s in SERVERS}
        t0 = time.monotonic()
        for _ in range(args.rounds):
            for server in SERVERS:
                runs[server].append(measure(server, app_name, args.requests))
        med = {s: statistics.median(v) for s, v in runs.items()}
        for s in SERVERS:
            figures = " ".join(f"{x:.0f}" for x in runs[s])
            print(f"{app_name:9} {s:9} server CPU/request median {med[s]:7.0f} us  ({figures})")
        print(f"{app_name:9} lean/hypercorn CPU ratio {med['lean'] / med['hypercorn']:.2f} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
