"""CPU per generation request of the replica client: httpx (the old path) vs
dispatcher/wire.py (the new one), against a trivial local HTTP/1.1 server.

    .venv/bin/python bench/replica_client.py [--requests 2000] [--rounds 3]

The server runs in a child process (this script with ``--serve``) and answers every POST
at once with a fixed completion; the client sends requests one after another through
``Replica.complete`` and reads this process's CPU time (``time.process_time``) around
each, so the server's own CPU is not counted. Rounds alternate between the two clients
to spread drift over both. Prints the median and p90 microseconds per request and the
ratio; a bench, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from functools import partial

import httpx
import trio

from gpu_slicer.dispatcher.vllm import Replica

ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":" a b c d","finish_reason":"length","weight_versions":[{"version":"r1","start":0,'
    b'"end":4}]}],"usage":{"prompt_tokens":16,"completion_tokens":4,"total_tokens":20}}'
)
BODY = {"model": "m", "prompt": list(range(16)), "max_tokens": 4, "return_weight_versions": True}


async def _serve_one(stream: trio.SocketStream) -> None:
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        f"content-length: {len(ANSWER)}\r\n\r\n"
    ).encode()
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            top, buf = buf.split(b"\r\n\r\n", 1)
            length = 0
            for line in top.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buf) < length:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            buf = buf[length:]
            if b"connection: close" in top.lower():
                await stream.send_all(head.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
                                      + ANSWER)  # fmt: skip
                return
            await stream.send_all(head + ANSWER)
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()


async def serve() -> None:
    """The child: a keep-alive server on a free port, printed on stdout."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _serve_one, 0, host="127.0.0.1"))
        print(listeners[0].socket.getsockname()[1], flush=True)


async def measure(url: str, use_wire: bool, n: int) -> list[float]:
    """CPU microseconds of each of ``n`` sequential ``Replica.complete`` calls."""
    # An explicit httpx transport sends generation requests through httpx, as before wire.
    transport = None if use_wire else httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=32)
    )  # fmt: skip
    cpu = time.process_time
    samples = []
    async with Replica(url, transport=transport) as r:
        for _ in range(50):  # warm: connection, caches
            await r.complete("completion", BODY, 30)
        for _ in range(n):
            t0 = cpu()
            await r.complete("completion", BODY, 30)
            samples.append((cpu() - t0) * 1e6)
    return samples


async def bench(url: str, n: int, rounds: int) -> None:
    results: dict[str, list[float]] = {"httpx": [], "wire": []}
    for _ in range(rounds):
        for name in results:
            results[name] += await measure(url, name == "wire", n)
    med = {}
    for name, samples in results.items():
        samples.sort()
        med[name] = statistics.median(samples)
        p90 = samples[int(len(samples) * 0.9)]
        print(f"{name:5}: median {med[name]:7.1f} us CPU/request, p90 {p90:7.1f} us "
              f"({len(samples)} requests)")  # fmt: skip
    print(f"ratio httpx/wire: {med['httpx'] / med['wire']:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        trio.run(serve)
        return
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        trio.run(bench, f"http://127.0.0.1:{port}", args.requests, args.rounds)
    finally:
        child.terminate()
        child.wait(10)


if __name__ == "__main__":
    main()
