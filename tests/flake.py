"""`make flake`: run the integration tests N times and say which failed, and how often.

    python -m tests.flake --runs 5 [--load] [--jobs 3] [-- PYTEST ARGS...]

Each run is one pytest process over the integration half of the suite (the selection
`make integration` runs, or the tests named after ``--``), with `--jobs` worker processes
as `make integration` has them (``-n``; 0: in this process, serially). With ``--load`` a
busy loop runs on every core for the whole time, so that races which a quiet machine
hides get their chance (a CI runner is seldom quiet). Every run writes a JUnit report;
the summary reads them: per test, how many runs failed it (errors in setup or teardown
count as failures), then the wall time of each run. Exit status 0 only when no test failed
in any run (and every run ended with pytest's own status 0 or 1).

Nothing is retried or skipped: a test that fails once in N runs is a flake to fix at its
root (DEVELOPERS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = "not integration and not fuzz and not chaos"
SELECTION = ["-m", f"not ({FAST})"]
BUSY = "while True: pass"


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes that each keep one core busy, ended on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def failures(report: Path) -> list[str]:
    """The node ids of the tests a JUnit report names as failed or errored."""
    if not report.exists():
        return []
    out: list[str] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            path = case.get("classname", "").replace(".", "/")
            out.append(f"{path}.py::{case.get('name')}")
    return out


def one_run(k: int, jobs: int, extra: Sequence[str], report: Path) -> tuple[int, float]:
    """Run pytest once; its exit status and wall seconds."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += ["-n", str(jobs), "--dist", "worksteal"] if jobs else ["-p", "no:xdist"]
    argv += [f"--junitxml={report}", *(extra or SELECTION)]
    t0 = time.monotonic()
    print(f"flake: run {k}: {' '.join(argv[1:])}", flush=True)
    rc = subprocess.run(argv, cwd=ROOT, check=False).returncode
    return rc, time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m tests.flake", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="how many runs (default 5)")
    ap.add_argument("--load", action="store_true", help="a busy loop on every core meanwhile")
    jobs = int(os.environ.get("JOBS", "3"))
    ap.add_argument("--jobs", type=int, default=jobs, help="xdist workers a run (0: serially)")
    ap.add_argument("pytest_args", nargs="*", help="after --: what to run instead")
    opts = ap.parse_args(argv)
    if opts.runs < 1:
        ap.error("--runs must be at least 1")
    failed: Counter[str] = Counter()
    walls: list[float] = []
    bad_rc: list[tuple[int, int]] = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="flake-"))
        if opts.load:
            stack.enter_context(busy_loops(os.cpu_count() or 1))
        for k in range(1, opts.runs + 1):
            report = Path(tmp) / f"run{k}.xml"
            rc, wall = one_run(k, opts.jobs, opts.pytest_args, report)
            walls.append(wall)
            names = failures(report)
            failed.update(set(names))
            if rc not in (0, 1) or (rc == 1 and not names):
                bad_rc.append((k, rc))
            print(f"flake: run {k}: exit {rc}, {len(names)} failed, {wall:.0f} s", flush=True)
    load = f", a busy loop on each of {os.cpu_count()} cores" if opts.load else ""
    print(f"\nflake: {opts.runs} runs, {opts.jobs or 'no'} workers{load}")
    print("flake: wall s per run: " + ", ".join(f"{w:.0f}" for w in walls))
    for name, n in failed.most_common():
        print(f"  {n}/{opts.runs}  {name}")
    for k, rc in bad_rc:
        print(f"  run {k}: pytest exited {rc} (not a test failure: see its output)")
    if not failed and not bad_rc:
        print("flake: no test failed in any run")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
