"""`make demo` end to end (real slicerd, launcher, vLLM stub, dispatcher, trainer stubs on
the fake GPU, short runs), and the PNG encoder and font the chart is drawn with."""

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

from gpu_slicer.slicer.demo_font import GLYPH_H, GLYPH_W, glyph, text_width
from gpu_slicer.slicer.demo_png import BACKGROUND, Canvas, encode_png

ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from gpu_slicer.slicer.demo import main; sys.exit(main(sys.argv[1:]))"


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
        [sys.executable, "-c", RUN, "--mode", "trainers", "--trainers", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--trainers" in proc.stderr


def read_png(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed IDAT of a PNG; asserts its structure (signature,
    IHDR first: 8-bit RGB, no interlace; every CRC; IEND last)."""
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
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    return width, height, raw


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
    assert all(r["vllm_stats"][k]["count"] >= 1 for k in ("wake", "load", "sleep"))
    assert 0 < r["busy_fraction"] < 1
    # The PNG is there, valid, of the size the report declares.
    assert r["png"]["path"] == str(png)
    width, height, raw = read_png(png)
    assert (width, height) == (r["png"]["width"], r["png"]["height"])
    assert len(raw) == height * (1 + 3 * width)
    assert all(raw[y * (1 + 3 * width)] == 0 for y in range(height))  # filter 0


@pytest.mark.integration
def test_real_mode_says_what_is_missing_and_starts_nothing(tmp_path: Path) -> None:
    pytest.importorskip("pynvml")
    from gpu_slicer.slicer.demo_real import missing

    lacking = missing(None)
    assert any(line.startswith("--model") for line in lacking)
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "--real", "--keep", str(tmp_path / "run")],
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


def test_png_encoder_round_trips_pixels(tmp_path: Path) -> None:
    c = Canvas(7, 3)
    c.rect(1, 1, 2, 1, (10, 20, 30))
    c.rect(5, 0, 9, 9, (200, 0, 1))  # clipped at the edges
    path = tmp_path / "x.png"
    path.write_bytes(c.png())
    width, height, raw = read_png(path)
    assert (width, height) == (7, 3) and len(raw) == 3 * (1 + 7 * 3)
    rows = [raw[y * 22 + 1 : (y + 1) * 22] for y in range(3)]
    px = [[tuple(row[x * 3 : x * 3 + 3]) for x in range(7)] for row in rows]
    assert px[1][1] == px[1][2] == (10, 20, 30)
    assert px[0][0] == px[2][0] == BACKGROUND
    assert all(px[y][x] == (200, 0, 1) for y in range(3) for x in (5, 6))
    with pytest.raises(ValueError):
        encode_png(2, 2, b"\x00" * 11)


def test_font_labels_draw_where_their_glyphs_say() -> None:
    scale = 2
    c = Canvas(80, 20)
    end = c.text(3, 2, "L1", (0, 0, 0), scale=scale)
    assert end == 3 + text_width("L1", scale) == 3 + (2 * 6 - 1) * scale

    def ink(x: int, y: int) -> bool:
        return c.pixel(x, y) != BACKGROUND

    # 'L': the left column is set on all seven rows, the bottom row across, nothing else.
    for row in range(GLYPH_H):
        for col in range(GLYPH_W):
            want = col == 0 or row == GLYPH_H - 1
            for dy in range(scale):
                for dx in range(scale):
                    assert ink(3 + col * scale + dx, 2 + row * scale + dy) == want, (row, col)
    # '1' starts one glyph plus one spacing column later; its stem is the middle column.
    x1 = 3 + (GLYPH_W + 1) * scale
    assert not any(ink(x1 - scale + dx, y) for dx in range(scale) for y in range(20))
    assert all(ink(x1 + 2 * scale, 2 + row * scale) for row in range(GLYPH_H))
    assert not any(ink(x, y) for x in range(80) for y in (0, 1, 2 + GLYPH_H * scale))
    assert glyph("a") == glyph("A") and glyph("s") != glyph("S")
    assert glyph("~") == glyph("?")  # what the font lacks


def test_client_counts_only_results_of_exactly_their_revision() -> None:
    from gpu_slicer.slicer.demo_client import ClientReport, Outcome, check

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
