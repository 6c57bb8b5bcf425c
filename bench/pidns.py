"""PID namespaces, measured: what a pod's REGISTER and an elimination grant check cost.

    .venv/bin/python bench/pidns.py [--runs 200] [--extra 0,1000] [--json]

Run as root (it starts a "pod": ``unshare --pid --fork --mount-proc``). Measures with
`time.perf_counter_ns` on this machine's real /proc:

1. translate: `slicer.pidns.translate` of a pod's pid 1 into slicerd's namespace (what a
   REGISTER from a pod pays once), with the node's processes plus E extra sleepers (one
   pass over /proc: it grows with the node's process count); median and p99 in ms.
2. grant check: the attribution a grant check runs per GPU reading, by pids
   (`census.take` over the GPU's 2 processes, reading their ancestry from /proc) and by
   elimination (`Attribution.holds_gpu` over a suspect's tree of 6 processes with 100
   open files each, the second of them holding the GPU's device node, plus
   `census.eliminate`): the first check scans the open files up to the holder, later
   ones find it cached; median and p99 in µs, elimination's median over pids', and what
   a full scan of the tree's open files costs (a park's `gpu_pids`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the product and stubs importable
    sys.path.insert(0, str(ROOT))

from gpu_slicer.slicer import census, pidns, procs  # noqa: E402
from gpu_slicer.slicer.attribution import Attribution  # noqa: E402
from gpu_slicer.slicer.config import Config  # noqa: E402
from gpu_slicer.slicer.gpu import GpuBackend  # noqa: E402
from gpu_slicer.slicer.state import SlicerState  # noqa: E402
from stubs.measure import percentile  # noqa: E402

# Each child opens 100 files (one of them the device node when told) and waits.
CHILD = """
import os, sys, time
fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(100)]
if sys.argv[1]:
    fds.append(os.open(sys.argv[1], os.O_RDONLY))
print("ready", flush=True)
sys.stdin.read()
"""


def _timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def _summary(us: list[float], scale: float = 1.0) -> dict[str, float]:
    return {
        "median": round(percentile(us, 50) / scale, 3),
        "p99": round(percentile(us, 99) / scale, 3),
    }


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _translate(runs: int, extra: int) -> dict[str, Any]:
    pod = _start(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "600"])
    sleepers = [_start(["sleep", "600"]) for _ in range(extra)]
    try:
        kids: list[str] = []
        while not kids:  # unshare forks its child at once; bounded by the test of time
            kids = Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split()
        ns = pidns.namespace_of(int(kids[0]))
        assert ns is not None
        assert pidns.translate(1, ns) == int(kids[0])
        n = sum(1 for e in os.listdir("/proc") if e.isdigit())
        return {"processes": n, **_summary(_timed(lambda: pidns.translate(1, ns), runs), 1e3)}
    finally:
        for p in [pod, *sleepers]:
            p.kill()
            p.wait()


def _grant_check(runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        node = os.path.join(tmp, "nvidia0")
        Path(node).touch()
        argv = [sys.executable, "-c", CHILD]
        tree = [_start([*argv, node if i == 1 else ""]) for i in range(6)]
        try:
            for p in tree:
                assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            pids = [p.pid for p in tree]
            seen = {pids[1]: 40 << 30, 999_999: 1 << 30}  # a workload's and a foreign one
            me = (os.getpid(), procs.start_time(os.getpid()) or 0)
            roots = [census.Root(1, me[0], me[1], True)]
            by_pid = _timed(lambda: census.take(seen, roots, procs.ancestry), runs)

            class _Backend:  # only what elimination asks of a backend here
                def device_node(self, index: int) -> str:
                    return node

            class _Host:  # /proc, but the tree as slicerd would walk it: the 6 processes
                def __getattr__(self, name: str) -> Any:
                    return getattr(procs, name)

                def tree(self, ident: procs.Ident, descendants: bool = True) -> list[int]:
                    return list(pids)

            host = cast(procs.ProcessTable, _Host())
            backend = cast(GpuBackend, _Backend())
            cfg = Config(census="elimination")
            attr = Attribution(cfg, SlicerState([(0, "GPU-0")]), backend, host)

            def eliminate(cached: bool) -> None:
                if not cached:
                    attr._holders.clear()
                holds = attr.holds_gpu(me, True, 0)
                budgets = [census.Root(1, me[0], me[1], True, 1 << 30, holds)]
                census.eliminate(seen, budgets)

            first = _timed(lambda: eliminate(False), runs)
            later = _timed(lambda: eliminate(True), runs)
            scan = _timed(lambda: procs.holding(pids, node), runs)
            pm = percentile(by_pid, 50)
            return {
                "pids_us": _summary(by_pid),
                "elimination_first_us": _summary(first),
                "elimination_us": _summary(later),
                "full_scan_us": _summary(scan),
                "elimination_over_pids": round(percentile(later, 50) / pm, 2),
            }
        finally:
            for p in tree:
                p.kill()
                p.wait()


def main() -> None:
    """Run both measurements and print them (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--extra", default="0,1000", help="extra sleeper counts for translate")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"translate_ms": []}
    for extra in (int(x) for x in args.extra.split(",")):
        out["translate_ms"].append({"extra": extra, **_translate(args.runs, extra)})
    out["grant_check"] = _grant_check(args.runs)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for row in out["translate_ms"]:
        print(
            f"translate (REGISTER from a pod), {row['processes']} processes: "
            f"median {row['median']} ms, p99 {row['p99']} ms"
        )
    g = out["grant_check"]
    print(f"grant check by pids: median {g['pids_us']['median']} us, p99 {g['pids_us']['p99']} us")
    first, later, scan = g["elimination_first_us"], g["elimination_us"], g["full_scan_us"]
    print(
        "grant check by elimination (6-process tree, 100 fds each, the 2nd holds the node): "
        f"first median {first['median']} us (scan to the holder), then median "
        f"{later['median']} us, p99 {later['p99']} us (holder cached): "
        f"{g['elimination_over_pids']}x pids' median; a full scan of the tree "
        f"{scan['median']} us"
    )


if __name__ == "__main__":
    main()
