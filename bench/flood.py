"""PING latency on one connection while another floods slicerd with pipelined STATUS.

    python bench/flood.py [--status 5000] [--workloads 8] [--rounds 3]

A real slicerd on a fake GPU; `--workloads` registered workloads (tree=1, each a live
process) give STATUS a realistic body. Per round: PING round trips alone (baseline), then
the same while a second connection sends `--status` STATUS lines in one write and reads
the replies. Prints median, p99 and max of each, the ratio of the medians, and the flood's
STATUS rate; the target is a PING p99 under 50 ms during the flood (issue: "no client
can stall the daemon"). Exit 1 when a reply is wrong, never for a missed target.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.script import run_script  # noqa: E402
from stubs.measure import percentile  # noqa: E402
from stubs.proc import log_tail  # noqa: E402
from stubs.stack import running_stack_sync  # noqa: E402

TARGET_P99_MS = 50.0


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(path)
    return s


def read_lines(s: socket.socket, n: int) -> int:
    """Read `n` lines; how many were OK replies."""
    buf, got, ok = b"", 0, 0
    while got < n:
        data = s.recv(1 << 20)
        if not data:
            raise RuntimeError(f"connection closed after {got} of {n} lines")
        buf += data
        *lines, buf = buf.split(b"\n")
        got += len(lines)
        ok += sum(1 for line in lines if line.startswith(b"OK"))
    return ok


def ping(s: socket.socket) -> float:
    t0 = time.perf_counter()
    s.sendall(b"PING\n")
    if s.recv(64) != b"OK\n":
        raise RuntimeError("PING not answered OK")
    return (time.perf_counter() - t0) * 1000


def one_round(
    sock: str, n_status: int, baseline_pings: int
) -> tuple[list[float], list[float], float]:
    p = connect(sock)
    base = [ping(p) for _ in range(baseline_pings)]
    flood = connect(sock)
    done = threading.Event()
    result: dict[str, float] = {}

    def flooder() -> None:
        t0 = time.perf_counter()
        flood.sendall(b"STATUS\n" * n_status)
        ok = read_lines(flood, n_status)
        result["seconds"] = time.perf_counter() - t0
        result["ok"] = ok
        done.set()

    th = threading.Thread(target=flooder)
    th.start()
    during: list[float] = []
    while not done.is_set():
        during.append(ping(p))
    th.join()
    flood.close()
    p.close()
    if result.get("ok") != n_status:
        raise RuntimeError(f"{result.get('ok')} of {n_status} STATUS replies were OK")
    return base, during, n_status / result["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--status", type=int, default=5000, help="STATUS lines in the flood")
    ap.add_argument("--workloads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-pings", type=int, default=300)
    args = ap.parse_args()
    with running_stack_sync(
        tmp_prefix="slicer-flood-", gpus=1, bandwidth=None, log_level="warning", pdeathsig=True
    ) as stack:
        sock = stack.socket
        regs: list[socket.socket] = []
        try:
            for i in range(args.workloads):
                r = connect(sock)
                r.sendall(f"REGISTER w{i} pid={stack.sleeper()}\n".encode())
                if not r.recv(4096).startswith(b"OK"):
                    raise RuntimeError("REGISTER refused")
                regs.append(r)
            base_all: list[float] = []
            during_all: list[float] = []
            rates = []
            for _ in range(args.rounds):
                base, during, rate = one_round(sock, args.status, args.baseline_pings)
                base_all += base
                during_all += during
                rates.append(rate)
        finally:
            for r in regs:
                r.close()
        rc = stack.stop_sync()
        tail = log_tail(stack.base / "slicerd.log", 3000) if rc else ""
    b50, d50 = statistics.median(base_all), statistics.median(during_all)
    print(f"slicerd flood bench: {args.rounds} rounds, {args.status} pipelined STATUS each, "
          f"{args.workloads} workloads")  # fmt: skip
    print(f"{'PING round trip (ms)':28} {'median':>8} {'p99':>8} {'max':>8} {'n':>6}")
    for name, v in (("alone", base_all), ("during the STATUS flood", during_all)):
        med, p99 = statistics.median(v), percentile(v, 99)
        print(f"{name:28} {med:8.3f} {p99:8.3f} {max(v):8.3f} {len(v):6d}")
    print(f"ratio of medians (flood / alone): {d50 / b50:.2f}")
    print(f"flood: {statistics.median(rates):.0f} STATUS/s (median of rounds)")
    p99 = percentile(during_all, 99)
    verdict = "met" if p99 < TARGET_P99_MS else "MISSED"
    print(f"target: PING p99 during the flood < {TARGET_P99_MS:.0f} ms: {verdict} ({p99:.2f} ms)")
    print(f"slicerd exit code {rc}" + (f"; its log ends:\n{tail}" if tail else ""))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    run_script(main)
