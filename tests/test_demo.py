"""`make demo` end to end (`python -m demo`: real slicerd, launcher, vLLM stub, dispatcher,
trainer stubs on the fake GPU, short runs), and the timeline chart (matplotlib)."""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ["-m", "demo"]  # as `make demo` runs it, from the checkout's root
# The chart's colours (matplotlib's tab10: demo/chart.py), and its empty track's grey.
TRAINER, SAMPLER = (31, 119, 180), (255, 127, 14)
PARK, RESTORE = (214, 39, 40), (44, 160, 44)
VLLM_SLEEP, VLLM_WAKE_LOAD = (227, 119, 194), (23, 190, 207)
TRACK = (240, 240, 240)


def run_demo(*args: str, timeout: float = 45) -> tuple[int, dict[str, Any], str, float]:
    """Run the demo in a subprocess (bounded); its exit code, JSON report, stderr, seconds."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *RUN, *args],
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


@pytest.mark.integration
def test_demo_shows_clean_turns() -> None:
    rc, r, err, elapsed = run_demo("--mode", "trainers", "--seconds", "3", "--json")
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


@pytest.mark.integration
def test_demo_refuses_one_trainer() -> None:
    proc = subprocess.run(
        [sys.executable, *RUN, "--mode", "trainers", "--trainers", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--trainers" in proc.stderr


def read_png(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed IDAT of a PNG; asserts its structure (signature,
    IHDR first: 8-bit RGB or RGBA, no interlace; every CRC; IEND last; one valid filter
    byte before each row)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks.append((tag, body))
        pos += 12 + n
    assert pos == len(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, comp, filt, interlace) == (8, 0, 0, 0) and color in (2, 6)
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    stride = 1 + (3 if color == 2 else 4) * width
    assert len(raw) == height * stride
    assert all(raw[y * stride] <= 4 for y in range(height))  # a PNG row filter type
    return width, height, raw


def colours(path: Path) -> set[tuple[int, int, int]]:
    """The RGB colours of a PNG's pixels (decoded by Pillow, matplotlib's own PNG writer)."""
    from PIL import Image

    with Image.open(path) as im:
        found = im.convert("RGB").getcolors(maxcolors=1 << 24) or []
    return {(c[0], c[1], c[2]) for _, c in found if isinstance(c, tuple)}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_loop_demo_serves_every_request_with_its_revision(tmp_path: Path) -> None:
    png = tmp_path / "chart" / "timeline.png"
    args = ("--revisions", "2", "--requests", "20", "--png", str(png), "--json")
    rc, r, err, elapsed = run_demo(*args, timeout=55)
    why = f"problems={r['problems']}, took {elapsed:.1f} s\nstderr:\n{err}"
    assert rc == 0, why
    assert r["ok"] and r["problems"] == [] and r["mode"] == "loop", why
    assert r["overlaps"] == 0 and r["overlap_log"] == [] and r["faults"] == [], why
    assert r["requests"] == {
        "expected": 40,
        "served": 40,
        "per_revision": {"rev-1": 20, "rev-2": 20},
    }, why
    assert r["exit_codes"] == {"trainer": 0, "dispatcher": 0, "sampler": 0}, why
    assert r["dir"] is None
    assert elapsed < 40, why
    # Both workloads held the GPU, never two at once; the trainer was parked for the
    # sampler (cuda-checkpoint) and the sampler's vLLM was woken, loaded and slept.
    rows = r["timeline"]["rows"]
    assert set(rows) == {"trainer", "sampler"} and all("#" in row for row in rows.values())
    turns = r["turns"]
    for a, b in itertools.pairwise(turns):
        assert a["end"] is not None and a["end"] <= b["start"], (a, b)
    assert r["handoffs"] >= 2 and r["stats"]["trainer"]["park"]["count"] >= 1
    # Every park of the trainer bought the sampler a turn it used (the dispatcher's count).
    assert r["trainer_parks"] == r["stats"]["trainer"]["park"]["count"], why
    assert r["wasted_turns"] == 0, why
    assert all(r["vllm_stats"][k]["count"] >= 1 for k in ("wake", "load", "sleep"))
    assert 0 < r["busy_fraction"] < 1
    # The PNG is there, valid, of the size the report declares.
    assert r["png"]["path"] == str(png)
    width, height, _ = read_png(png)
    assert (width, height) == (r["png"]["width"], r["png"]["height"])
    # It shows both workloads' turns, slicerd's park and restore, and the sampler's vLLM
    # wake + load and sleep, each in its legend's colour.
    assert {TRAINER, SAMPLER, PARK, RESTORE, VLLM_SLEEP, VLLM_WAKE_LOAD} <= colours(png)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_demo_k8s_runs_the_loop_with_the_job_in_a_pod(tmp_path: Path) -> None:
    # `make demo-k8s`: node mode, the launcher, dispatcher and trainer in a simulated pod.
    png = tmp_path / "timeline.png"
    args = ("--pods", "--revisions", "2", "--requests", "10", "--png", str(png), "--json")
    rc, r, err, elapsed = run_demo(*args, timeout=55)
    why = f"problems={r['problems']}, took {elapsed:.1f} s\nstderr:\n{err}"
    assert rc == 0, why
    assert r["ok"] and r["problems"] == [] and r["mode"] == "loop", why
    assert "node mode" in r["summary"], r["summary"]
    assert r["overlaps"] == 0 and r["overlap_log"] == [] and r["faults"] == [], why
    assert r["requests"]["served"] == r["requests"]["expected"] == 20, why
    assert r["exit_codes"] == {"trainer": 0, "dispatcher": 0, "sampler": 0}, why
    assert r["handoffs"] >= 2 and r["stats"]["trainer"]["park"]["count"] >= 1, why
    assert r["dir"] is None


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_demo_pool_serves_every_request_once_across_three_nodes(tmp_path: Path) -> None:
    # `make demo-pool`: three nodes (fake GPU, slicerd, trainer, replica, dispatcher each)
    # on one real Redis; a small run: 2 revisions x 40 requests through every front.
    png = tmp_path / "pool.png"
    args = ("--pool", "--revisions", "2", "--requests", "40", "--png", str(png), "--json")
    rc, r, err, elapsed = run_demo(*args, timeout=110)
    why = f"problems={r['problems']}, took {elapsed:.1f} s\nstderr:\n{err}"
    assert rc == 0, why
    assert r["ok"] and r["problems"] == [] and r["mode"] == "pool", why
    q, pool = r["requests"], r["pool"]
    # every request served once, from its own revision (the second one's pinned share
    # from the first), none lost, none failed, none duplicated
    assert q["sent"] == q["results"] == q["from_their_revision"] == 80 and q["lost"] == 0, why
    assert q["per_revision"] == {"r1": 44, "r2": 36}, why
    assert pool["stats"]["committed"] == 80, why
    assert pool["stats"]["failed"] == pool["stats"]["duplicates"] == 0, why
    assert sum(pool["served"].values()) == 80 and set(pool["served"]) <= {"node0", "node1", "node2"}
    # per node: no overlap on its GPU, its turns one at a time, the dispatcher's figures
    assert r["overlaps"] == {"node0": 0, "node1": 0, "node2": 0} and r["overlap_log"] == [], why
    assert set(r["nodes"]) == {"node0", "node1", "node2"}
    for name, n in r["nodes"].items():
        assert n["faults"] == n["concurrent_turns"] == 0, (name, n)
        assert n["trainer_turns"] >= 1, (name, n)
        assert isinstance(n["held_back"], int) and isinstance(n["empty_turns"], int), (name, n)
        assert isinstance(n["wasted_turns"], int) and n["turn_capacity"] >= 1, (name, n)
    # parks per request: the replicas' turns (each parks a trainer) over requests served
    assert 1 <= pool["replica_turns"] <= 80, why
    assert pool["parks_per_request"] == round(pool["replica_turns"] / 80, 4)
    assert pool["wasted_turns"] == sum(n["wasted_turns"] for n in r["nodes"].values()), why
    # the timeline: two rows per node, a replica's '#' never beside its own trainer's
    rows = r["timeline"]["rows"]
    assert list(rows) == [f"node{i} {w}" for i in range(3) for w in ("trainer", "replica")]
    for i in range(3):
        for a, b in zip(rows[f"node{i} trainer"], rows[f"node{i} replica"], strict=True):
            assert not (a == "#" and b == "#"), rows
    assert any("#" in rows[f"node{i} replica"] for i in range(3)), rows
    assert r["dir"] is None
    width, height, _ = read_png(png)
    assert (width, height) == (r["png"]["width"], r["png"]["height"])
    assert {TRAINER, SAMPLER} <= colours(png)  # trainers' and replicas' turns, drawn


@pytest.mark.integration
def test_real_mode_says_what_is_missing_and_starts_nothing(tmp_path: Path) -> None:
    pytest.importorskip("pynvml")
    from demo.real import missing

    lacking = missing(None)
    assert any(line.startswith("--model") for line in lacking)
    proc = subprocess.run(
        [sys.executable, *RUN, "--real", "--keep", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    for line in lacking:
        assert line in proc.stderr
    assert "nothing was started" in proc.stderr
    assert not (tmp_path / "run").exists()  # not even its directory


def test_chart_draws_each_span_where_the_report_says(tmp_path: Path) -> None:
    import numpy as np

    from demo.chart import chart, write_chart

    rows = [
        ("trainer", [(0.0, 2.0, "held"), (2.0, 3.0, "park"), (7.0, 8.0, "restore")]),
        ("sampler", [(3.5, 6.5, "held"), (3.5, 4.0, "vLLM wake + load"), (6.0, 6.5, "vLLM sleep")]),
    ]
    fig = chart("gpu-slicer demo: overlaps 0", rows, 10.0)
    (ax,) = fig.axes
    assert fig.get_suptitle() == "gpu-slicer demo: overlaps 0"
    assert ax.get_xlabel() == "seconds since the first grant" and ax.get_ylabel() == "workload"
    assert ax.get_xlim() == (0.0, 10.0)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["trainer", "sampler"]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "trainer holds the GPU",
        "sampler holds the GPU",
        "park",
        "restore",
        "vLLM sleep",
        "vLLM wake + load",
    ]
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())  # type: ignore[attr-defined]

    def at(t: float, row: int) -> tuple[int, int, int]:
        x, y = ax.transData.transform((t, row))  # display pixels, origin bottom left
        r, g, b, _ = rgba[rgba.shape[0] - 1 - round(y), round(x)]
        return int(r), int(g), int(b)

    assert at(1.0, 0) == TRAINER and at(2.5, 0) == PARK and at(7.5, 0) == RESTORE
    assert at(5.0, 1) == SAMPLER and at(3.7, 1) == VLLM_WAKE_LOAD and at(6.2, 1) == VLLM_SLEEP
    assert at(5.0, 0) == at(1.0, 1) == TRACK  # nobody's: the empty track
    path = tmp_path / "out" / "timeline.png"
    width, height = write_chart(path, "t", rows, 10.0)
    assert read_png(path)[:2] == (width, height) and width >= 800
    assert [p.name for p in path.parent.iterdir()] == ["timeline.png"]  # no temporary left
    assert {TRAINER, SAMPLER, PARK, RESTORE, VLLM_SLEEP, VLLM_WAKE_LOAD} <= colours(path)


def test_chart_legend_names_only_the_phases_it_draws() -> None:
    from demo.chart import chart

    # Two trainers (the demo's --mode trainers): no vLLM, so no vLLM phase in the legend.
    rows = [
        ("trainer-a", [(0.0, 2.0, "held"), (2.0, 3.0, "park")]),
        ("trainer-b", [(3.5, 6.5, "held"), (3.0, 3.5, "restore")]),
    ]
    (legend,) = chart("t", rows, 10.0).legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "trainer-a holds the GPU",
        "trainer-b holds the GPU",
        "park",
        "restore",
    ]


def test_without_matplotlib_the_report_says_the_chart_needs_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from demo.loop_report import write_png

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it fails
    r: dict[str, Any] = {
        "turns": [{"workload": "trainer", "start": 0.0, "end": 1.0}],
        "parks": [],
        "restores": [],
        "vllm": {"wake": [], "load": [], "sleep": []},
        "window_s": 2.0,
        "overlaps": 0,
        "busy_fraction": 0.5,
        "requests": {"served": 1, "expected": 1},
        "png": None,
    }
    write_png(r, tmp_path / "timeline.png")
    assert r["png"] is None and not (tmp_path / "timeline.png").exists()
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "`charts` extra" in err, err


def test_client_counts_only_results_of_exactly_their_revision() -> None:
    from demo.client import ClientReport, Outcome, check

    def done(revision: str, *choices: list[str]) -> dict[str, Any]:
        wv = [{"weight_versions": [{"version": v} for v in c]} for c in choices]
        return {"status": "done", "revision": revision, "result": {"choices": wv}}

    cases = [
        (done("rev-1", ["rev-1"], ["rev-1", "rev-1"]), "done"),
        (done("rev-1", ["rev-1"], ["rev-2"]), "mismatch"),  # one choice from other weights
        (done("rev-1", ["rev-1", "rev-2"]), "mismatch"),  # weights swapped mid-choice
        (done("rev-1", []), "mismatch"),  # nobody vouched for the weights
        (done("rev-1"), "mismatch"),  # no choices
        (done("rev-2", ["rev-2"]), "mismatch"),  # ran as another revision
        ({"status": "failed", "revision": "rev-1", "error": "deadline exceeded"}, "failed"),
    ]
    report = ClientReport()
    for i, (body, want) in enumerate(cases):
        o = Outcome("rev-1", i, id=f"smp-{i}", status="pending")
        check(o, body)
        assert o.status == want, (i, o)
        report.outcomes.append(o)
    report.outcomes.append(Outcome("rev-1", 99, id="smp-99", status="pending", detail="lost"))
    assert report.served() == 1
    problems = report.problems(expected=len(cases) + 1)
    assert len(problems) == len(cases)  # every request but the good one, one line each
    assert any("smp-99" in p and "pending" in p for p in problems)
    assert report.problems(expected=100)[-1] == "8 requests sent, 100 expected"
