"""`make demo` end to end: real slicerd, real trainer stubs, the fake GPU, a short run."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from slicer.demo import main; sys.exit(main(sys.argv[1:]))"


def run_demo(*args: str, timeout: float = 45) -> tuple[int, dict[str, Any], str, float]:
    """Run the demo in a subprocess (bounded); its exit code, JSON report, stderr, seconds."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    elapsed = time.monotonic() - t0
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.returncode, report, proc.stderr, elapsed


def test_demo_shows_clean_turns() -> None:
    rc, r, err, elapsed = run_demo("--seconds", "3", "--json")
    why = f"problems={r['problems']}, took {elapsed:.1f} s\nstderr:\n{err}"
    assert rc == 0, why
    assert r["ok"] and r["problems"] == [], why
    assert r["overlaps"] == 0 and r["overlap_log"] == [], why
    assert r["handoffs"] >= 2, why
    assert r["faults"] == [], why
    assert r["dir"] is None  # the temporary directory is gone

    moves = [e for e in r["events"] if e["event"] in ("parked", "restored")]
    assert any(e["event"] == "parked" for e in moves)
    assert any(e["event"] == "restored" for e in moves)
    for e in moves:
        ms = e["park_ms"] if e["event"] == "parked" else e["restore_ms"]
        assert isinstance(ms, int) and ms >= 0, e

    # The chart never shows two trainers holding the GPU in the same column...
    rows = list(r["timeline"]["rows"].values())
    assert len(rows) == 2 and all(len(row) == r["timeline"]["columns"] for row in rows)
    for col in zip(*rows, strict=True):
        assert col.count("#") <= 1, rows
    assert all("#" in row for row in rows), rows  # ...and both trainers held it
    # ...and neither do the turns it is drawn from: each ends before the next begins.
    turns = r["turns"]
    for a, b in itertools.pairwise(turns):
        assert a["end"] is not None and a["end"] <= b["start"], (a, b)
    assert sum(s["park"]["count"] for s in r["stats"].values()) >= 2
    assert 0 < r["busy_fraction"] < 1


def test_demo_refuses_one_trainer() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "--trainers", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--trainers" in proc.stderr
