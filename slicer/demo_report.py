"""The demo's report: turns, park/restore statistics and the timeline chart, built from
the daemon's WATCH events (see `slicer.demo`)."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stubs.fakegpu import Ledger, format_size

if TYPE_CHECKING:
    from slicer.demo import Recording

COLUMNS = 80


def _percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms_stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "median_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "count": len(values),
        "median_ms": statistics.median(values),
        "p99_ms": _percentile(values, 99),
        "max_ms": max(values),
    }


def _spans(events: list[dict[str, Any]], start: str, ends: tuple[str, ...]) -> list[dict[str, Any]]:
    """Intervals from a `start` event of a workload to its next `ends` event."""
    out: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    for e in events:
        w = str(e["workload"])
        if e["event"] == start:
            open_[w] = {"workload": w, "start": float(e["t"]), "end": None, "ms": None}
        elif e["event"] in ends and w in open_:
            span = open_.pop(w)
            span["end"] = float(e["t"])
            span["ok"] = e["event"] != "fault"
            span["ms"] = e.get("park_ms", e.get("restore_ms"))
            out.append(span)
    out += open_.values()
    return sorted(out, key=lambda s: s["start"])


def _turns(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    turns: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "granted":
            turns[int(e["turn"])] = {
                "turn": int(e["turn"]),
                "workload": str(e["workload"]),
                "start": float(e["t"]),
                "end": None,
                "restored": bool(e.get("restored")),
                "waited_ms": int(e.get("waited_ms", 0)),
            }
        elif e["event"] == "released" and e.get("turn_ended") in turns:
            turns[int(e["turn_ended"])]["end"] = float(e["t"])
    return sorted(turns.values(), key=lambda t: t["turn"])


def _chart(
    names: list[str], layers: list[tuple[str, list[dict[str, Any]]]], t0: float, t1: float
) -> dict[str, str]:
    """One row per workload; each column shows the state at its middle instant."""
    dt = (t1 - t0) / COLUMNS
    rows: dict[str, str] = {}
    for name in names:
        cells = []
        for c in range(COLUMNS):
            at = t0 + (c + 0.5) * dt
            ch = "."
            for mark, spans in layers:  # first match wins: '#' over 'r' over 'p'
                if any(
                    s["workload"] == name
                    and s["start"] <= at < (t1 if s["end"] is None else s["end"])
                    for s in spans
                ):
                    ch = mark
                    break
            cells.append(ch)
        rows[name] = "".join(cells)
    return rows


def build_report(
    opts: argparse.Namespace, rec: Recording, ledger: Ledger, base: Path
) -> dict[str, Any]:
    """Everything the demo shows, as one JSON-able dict; `ok` and `problems` decide."""
    events = sorted(rec.events, key=lambda e: float(e["t"]))
    problems: list[str] = []
    # Daemon clock -> local clock: the smallest (arrival - t) is the best offset estimate.
    offset = min((e["_recv"] - float(e["t"]) for e in events), default=0.0)
    grants = [e for e in events if e["event"] == "granted"]
    t0 = float(grants[0]["t"]) if grants else 0.0
    t1 = (rec.stop_local - offset) if rec.stop_local is not None else t0
    t1 = max(t1, t0 + 1e-6)
    in_run = [e for e in events if float(e["t"]) <= t1]
    turns = [t for t in _turns(events) if t["start"] <= t1]
    parks = [s for s in _spans(events, "parking", ("parked", "fault")) if s["start"] <= t1]
    restores = [s for s in _spans(events, "restoring", ("restored", "fault")) if s["start"] <= t1]
    names = sorted({str(e["workload"]) for e in events if e["event"] == "registered"})

    held = 0.0
    for t in turns:
        end = min(t1, t["end"]) if t["end"] is not None else t1
        held += max(0.0, end - max(t0, t["start"]))
    handoffs = sum(1 for a, b in itertools.pairwise(turns) if a["workload"] != b["workload"])
    concurrent = [
        (a["turn"], b["turn"])
        for a, b in itertools.pairwise(turns)
        if a["end"] is None or b["start"] < a["end"]
    ]
    negative = [
        e
        for e in events
        if e["event"] in ("parked", "restored")
        and int(e.get("park_ms", e.get("restore_ms", -1))) < 0
    ]
    faults = [e for e in in_run if e["event"] == "fault"]
    stats = {
        name: {
            "park": _ms_stats(
                [
                    int(e["park_ms"])
                    for e in in_run
                    if e["event"] == "parked" and e["workload"] == name
                ]
            ),
            "restore": _ms_stats(
                [
                    int(e["restore_ms"])
                    for e in in_run
                    if e["event"] == "restored" and e["workload"] == name
                ]
            ),
        }
        for name in names
    }
    overlaps = ledger.overlaps()
    if overlaps:
        problems.append(f"{overlaps} overlaps on the fake GPU: two workloads were resident at once")
    if concurrent:
        problems.append(f"turns granted while another was held: {concurrent}")
    if handoffs < max(2, opts.min_handoffs):
        problems.append(f"only {handoffs} handoffs in {t1 - t0:.1f} s: nothing was demonstrated")
    if faults:
        problems.append(f"{len(faults)} faults during the run: {[e.get('reason') for e in faults]}")
    if negative:
        problems.append(f"negative park/restore ms: {negative}")
    rows = _chart(names, [("#", turns), ("r", restores), ("p", parks)], t0, t1)

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - t0, 3)

    return {
        "ok": not problems,
        "problems": problems,
        "config": {
            "seconds": opts.seconds,
            "trainers": opts.trainers,
            "capacity": opts.capacity,
            "bytes": opts.bytes,
            "bandwidth": opts.bandwidth,
            "work": opts.work,
            "min_handoffs": opts.min_handoffs,
        },
        "window_s": round(t1 - t0, 3),
        "extended_s": round(rec.extended_s, 3),
        "timeline": {
            "columns": COLUMNS,
            "seconds_per_column": round((t1 - t0) / COLUMNS, 4),
            "rows": rows,
        },
        "turns": [{**t, "start": rel(t["start"]), "end": rel(t["end"])} for t in turns],
        "parks": [{**s, "start": rel(s["start"]), "end": rel(s["end"])} for s in parks],
        "restores": [{**s, "start": rel(s["start"]), "end": rel(s["end"])} for s in restores],
        "stats": stats,
        "handoffs": handoffs,
        "busy_fraction": round(held / (t1 - t0), 4),
        "overlaps": overlaps,
        "overlap_log": ledger.overlap_log(),
        "faults": faults,
        "events": [
            {k: v for k, v in e.items() if k != "_recv"} | {"rel_t": rel(float(e["t"]))}
            for e in events
        ],
        "trainer_exit_codes": rec.exit_codes,
        "daemon_exit_code": rec.daemon_rc,
        "dir": str(base),
    }


def _fmt_ms(v: Any) -> str:
    return "-" if v is None else f"{v:g}"


def render(r: dict[str, Any]) -> str:
    """The human report."""
    cfg = r["config"]
    out = [
        f"gpu-slicer demo: {cfg['trainers']} trainers x {format_size(cfg['bytes'])} on one "
        f"{format_size(cfg['capacity'])} fake GPU, {cfg['work']:g} s steps, "
        f"cuda-checkpoint at {cfg['bandwidth']}/s, {r['window_s']:.2f} s from the first grant"
        + (
            f" (extended {r['extended_s']:.1f} s to see the handoffs)"
            if r["extended_s"] > 0.05
            else ""
        ),
        "",
        "timeline ('#' holds the GPU, 'p' parking, 'r' restoring; "
        f"{r['timeline']['seconds_per_column'] * 1000:.0f} ms a column)",
    ]
    width = max(len(n) for n in r["timeline"]["rows"]) if r["timeline"]["rows"] else 8
    for name, row in r["timeline"]["rows"].items():
        out.append(f"  {name:<{width}} |{row}|")
    axis = [" "] * (COLUMNS + 8)
    for c in range(0, COLUMNS + 1, 20):
        label = f"{c / COLUMNS * r['window_s']:.1f}s"
        axis[c : c + len(label)] = label
    out.append(f"  {'':<{width}}  {''.join(axis).rstrip()}")
    out += [
        "",
        "turns",
        f"  {'turn':>4}  {'workload':<{width}}  {'start s':>7}  {'held s':>7}  restored  waited ms",
    ]
    for t in r["turns"]:
        held = "open" if t["end"] is None else f"{t['end'] - t['start']:.3f}"
        out.append(
            f"  {t['turn']:>4}  {t['workload']:<{width}}  {t['start']:>7.3f}  {held:>7}  "
            f"{'yes' if t['restored'] else 'no':<8}  {t['waited_ms']:>9}"
        )
    out += [
        "",
        "park / restore ms",
        f"  {'workload':<{width}}  {'op':<7}  {'count':>5}  {'median':>7}  {'p99':>6}  {'max':>6}",
    ]
    for name, ops in r["stats"].items():
        for op, s in ops.items():
            out.append(
                f"  {name:<{width}}  {op:<7}  {s['count']:>5}  {_fmt_ms(s['median_ms']):>7}  "
                f"{_fmt_ms(s['p99_ms']):>6}  {_fmt_ms(s['max_ms']):>6}"
            )
    out += [
        "",
        f"handoffs: {r['handoffs']}",
        f"GPU busy: {r['busy_fraction'] * 100:.1f}% of the run held by a trainer "
        "(the rest: parking, restoring, granting)",
        f"overlaps: {r['overlaps']}",
    ]
    if r["ok"]:
        out.append("OK: 0 overlaps")
    else:
        out.append("")
        out.append("!" * 72)
        out += [f"FAILED: {p}" for p in r["problems"]]
        for o in r["overlap_log"]:
            out.append(
                f"  overlap on gpu {o['gpu']} at {o['time']:.3f}: {', '.join(o['workloads'])}"
            )
        out.append("!" * 72)
    return "\n".join(out)
