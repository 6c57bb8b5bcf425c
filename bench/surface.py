"""The user's surface, measured: a slicerd metrics scrape, and one PING per client kind.

    .venv/bin/python bench/surface.py [--scrapes 300] [--pings 2000] [--workloads 1,32,200]
        [--json]

Starts its own slicerd (fake GPU, `--metrics-listen` on a free port) through the test
doubles' stack harness, and measures with `time.perf_counter_ns`:

1. scrape: ``GET /metrics`` over a fresh connection each time (the listener closes each
   one after its answer), with W workloads registered (each a sleeper process
   of its own) and each having taken one turn, so every labelled series has W children;
   median and p99 in ms, and the body size. The figure is what one scrape costs the
   daemon's event loop plus two socket hops (the collector runs on the loop).
2. ping: PING round trips on one connection with the blocking `Slicer`, the trio
   `AsyncSlicer` and the asyncio `AsyncioSlicer`; median and p99 in µs, and each async
   client's median over the blocking one's (the transport's own cost on top of the
   daemon's); and the blocking client's PINGs again while another client scrapes
   without pause (with the most workloads): what scraping costs the daemon's clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the product and stubs importable
    sys.path.insert(0, str(ROOT))

from bench.script import run_script  # noqa: E402
from gpu_slicer.slicer.client import AsyncioSlicer, AsyncSlicer, Slicer  # noqa: E402
from stubs.measure import percentile  # noqa: E402
from stubs.proc import free_port  # noqa: E402
from stubs.stack import Stack, running_stack_sync  # noqa: E402


def _stats(ns: list[int], scale: float) -> dict[str, float]:
    xs = sorted(v / scale for v in ns)
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}


def _scrape(port: int) -> bytes:
    # A raw socket, not httpx: a new httpx client per request costs tens of ms of its own
    # (its TLS context), which would swamp the daemon's figure.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
        chunks = []
        while data := c.recv(65536):
            chunks.append(data)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"scrape failed: {head[:80]!r}")
    return body


def _scrape_until(port: int, stop: threading.Event) -> None:
    while not stop.is_set():
        _scrape(port)


def _scrapes(port: int, n: int) -> tuple[dict[str, float], int]:
    took: list[int] = []
    size = 0
    for _ in range(n):
        t0 = time.perf_counter_ns()
        size = len(_scrape(port))
        took.append(time.perf_counter_ns() - t0)
    return _stats(took, 1e6), size


async def _register(stack: Stack, count: int, first: int) -> list[AsyncSlicer]:
    # One connection per workload, each takes (and lazily ends) one turn: every labelled
    # series then has a child per workload.
    conns = []
    for i in range(first, first + count):
        c = await stack.client()
        await c.register(f"w{i}", gpu=0, pid=stack.sleeper(), park="cooperative")
        async with c.turn():
            pass
        conns.append(c)
    return conns


def _blocking_pings(sock: str, n: int) -> list[int]:
    with Slicer(sock) as s:
        took = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            s.ping()
            took.append(time.perf_counter_ns() - t0)
    return took


async def _async_pings(
    client: type[AsyncSlicer] | type[AsyncioSlicer], sock: str, n: int
) -> list[int]:
    # The same code under trio and asyncio: the two clients have one API.
    async with await client.connect(sock) as s:
        took = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            await s.ping()
            took.append(time.perf_counter_ns() - t0)
    return took


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both measurements; the result as a dict (printed by `main`)."""
    port = free_port()
    levels = sorted({int(w) for w in args.workloads.split(",")})
    out: dict[str, Any] = {"scrape": [], "ping": {}}
    with running_stack_sync(
        "--metrics-listen", f"127.0.0.1:{port}", gpus=1, log_level="warning"
    ) as stack:

        async def measure() -> None:
            conns: list[AsyncSlicer] = []
            try:
                for level in levels:
                    conns += await _register(stack, level - len(conns), len(conns))
                    st, size = await trio.to_thread.run_sync(_scrapes, port, args.scrapes)
                    out["scrape"].append({"workloads": level, "ms": st, "bytes": size})
                sock, n = stack.socket, args.pings
                blocking = await trio.to_thread.run_sync(_blocking_pings, sock, n)
                out["ping"]["blocking"] = _stats(blocking, 1e3)
                # The same PINGs while another client scrapes without pause: what a
                # scrape's work on the daemon's loop costs everyone else.
                async with trio.open_nursery() as nursery:
                    stop = threading.Event()
                    nursery.start_soon(trio.to_thread.run_sync, _scrape_until, port, stop)
                    try:
                        during = await trio.to_thread.run_sync(_blocking_pings, sock, n)
                    finally:
                        stop.set()
                out["ping_during_scrapes"] = _stats(during, 1e3)
                out["ping"]["trio"] = _stats(await _async_pings(AsyncSlicer, sock, n), 1e3)
                aio = await trio.to_thread.run_sync(
                    asyncio.run, _async_pings(AsyncioSlicer, sock, n)
                )
                out["ping"]["asyncio"] = _stats(aio, 1e3)
            finally:
                for c in conns:
                    await c.aclose()

        trio.run(measure)
    base = out["ping"]["blocking"]["p50"]
    for kind in ("trio", "asyncio"):
        out["ping"][kind]["over_blocking"] = out["ping"][kind]["p50"] / base
    return out


def main() -> int:
    """Parse the options, measure, print a table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--workloads", default="1,32,200", help="comma-separated levels")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print("slicerd GET /metrics (fresh connection each)")
    print(f"  {'workloads':>9} {'p50 ms':>8} {'p99 ms':>8} {'bytes':>9}")
    for row in res["scrape"]:
        ms = row["ms"]
        print(f"  {row['workloads']:>9} {ms['p50']:>8.2f} {ms['p99']:>8.2f} {row['bytes']:>9}")
    st = res["ping_during_scrapes"]
    print(f"  PING while another client scrapes: p50 {st['p50']:.1f} us, p99 {st['p99']:.1f} us")
    print("PING round trip on one connection")
    print(f"  {'client':>9} {'p50 us':>8} {'p99 us':>8} {'p50 / blocking':>15}")
    for kind, st in res["ping"].items():
        ratio = f"{st['over_blocking']:.2f}x" if "over_blocking" in st else "1.00x"
        print(f"  {kind:>9} {st['p50']:>8.1f} {st['p99']:>8.1f} {ratio:>15}")
    return 0


if __name__ == "__main__":
    run_script(main)
