"""The demo's report: turns, park/restore statistics and the timeline chart, built from
the daemon's WATCH events (see `demo.main`)."""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stubs.fakegpu import Ledger, format_size
from stubs.measure import percentile

if TYPE_CHECKING:
    from demo.proc import Recording

COLUMNS = 80


def _ms_stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "median_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "count": len(values),
        "median_ms": statistics.median(values),
        "p99_ms": percentile(values, 99),
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
            for mark, spans in layers:  # first match wins: overlay, '#', 'r', 'p'
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


def analyze(
    rec: Recording,
    names: list[str] | None = None,
    overlay: list[tuple[str, list[dict[str, Any]]]] | None = None,
) -> dict[str, Any]:
    """The run as seen through slicerd's events, on the daemon's clock (absolute): the
    window [t0, t1] from the first grant to the stop, turns, parks, restores, per-workload
    park/restore statistics, handoffs, busy fraction and the chart rows. `overlay` spans
    (mark, spans) are drawn over a row's own marks (the sampler's vLLM wake and sleep)."""
    events = sorted(rec.events, key=lambda e: float(e["t"]))
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
    if names is None:
        names = sorted({str(e["workload"]) for e in events if e["event"] == "registered"})
    held = 0.0
    for t in turns:
        end = min(t1, t["end"]) if t["end"] is not None else t1
        held += max(0.0, end - max(t0, t["start"]))

    def ms(kind: str, key: str, name: str) -> dict[str, Any]:
        return _ms_stats(
            [int(e[key]) for e in in_run if e["event"] == kind and e["workload"] == name]
        )

    layers = [*(overlay or []), ("#", turns), ("r", restores), ("p", parks)]
    return {
        "events": events,
        "t0": t0,
        "t1": t1,
        "turns": turns,
        "parks": parks,
        "restores": restores,
        "names": names,
        "handoffs": sum(1 for a, b in itertools.pairwise(turns) if a["workload"] != b["workload"]),
        "concurrent": [
            (a["turn"], b["turn"])
            for a, b in itertools.pairwise(turns)
            if a["end"] is None or b["start"] < a["end"]
        ],
        "negative": [
            e
            for e in events
            if e["event"] in ("parked", "restored")
            and int(e.get("park_ms", e.get("restore_ms", -1))) < 0
        ],
        "faults": [e for e in in_run if e["event"] == "fault"],
        "stats": {
            n: {"park": ms("parked", "park_ms", n), "restore": ms("restored", "restore_ms", n)}
            for n in names
        },
        "busy_fraction": round(held / (t1 - t0), 4),
        "rows": _chart(names, layers, t0, t1),
    }


def common_problems(a: dict[str, Any], overlaps: int) -> list[str]:
    """What makes any demo run fail: overlaps, two turns at once, faults, bad figures."""
    problems: list[str] = []
    if overlaps:
        problems.append(f"{overlaps} overlaps on the fake GPU: two workloads were resident at once")
    if a["concurrent"]:
        problems.append(f"turns granted while another was held: {a['concurrent']}")
    if a["faults"]:
        reasons = [e.get("reason") for e in a["faults"]]
        problems.append(f"{len(a['faults'])} faults during the run: {reasons}")
    if a["negative"]:
        problems.append(f"negative park/restore ms: {a['negative']}")
    return problems


def relative(a: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able part of `analyze`'s result, times relative to the first grant."""
    t0 = a["t0"]

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - t0, 3)

    def spans(xs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**s, "start": rel(s["start"]), "end": rel(s["end"])} for s in xs]

    return {
        "window_s": round(a["t1"] - t0, 3),
        "timeline": {
            "columns": COLUMNS,
            "seconds_per_column": round((a["t1"] - t0) / COLUMNS, 4),
            "rows": a["rows"],
        },
        "turns": spans(a["turns"]),
        "parks": spans(a["parks"]),
        "restores": spans(a["restores"]),
        "stats": a["stats"],
        "handoffs": a["handoffs"],
        "busy_fraction": a["busy_fraction"],
        "faults": a["faults"],
        "events": [
            {k: v for k, v in e.items() if k != "_recv"} | {"rel_t": rel(float(e["t"]))}
            for e in a["events"]
        ],
    }


def build_report(
    opts: argparse.Namespace, rec: Recording, ledger: Ledger, base: Path
) -> dict[str, Any]:
    """Everything the trainers demo shows, as one JSON-able dict; `ok` and `problems`
    decide."""
    a = analyze(rec)
    overlaps = ledger.overlaps()
    problems = common_problems(a, overlaps)
    if a["handoffs"] < max(2, opts.min_handoffs):
        problems.append(
            f"only {a['handoffs']} handoffs in {a['t1'] - a['t0']:.1f} s: nothing was demonstrated"
        )
    return {
        "ok": not problems,
        "problems": problems,
        "mode": "trainers",
        "config": {
            "seconds": opts.seconds,
            "trainers": opts.trainers,
            "capacity": opts.capacity,
            "bytes": opts.bytes,
            "bandwidth": opts.bandwidth,
            "work": opts.work,
            "min_handoffs": opts.min_handoffs,
        },
        "extended_s": round(rec.extended_s, 3),
        **relative(a),
        "overlaps": overlaps,
        "overlap_log": ledger.overlap_log(),
        "trainer_exit_codes": rec.exit_codes,
        "daemon_exit_code": rec.daemon_rc,
        "dir": str(base),
    }


def _fmt_ms(v: Any) -> str:
    return "-" if v is None else f"{v:g}"


def render_timeline(r: dict[str, Any], legend: str) -> list[str]:
    """The chart: one row per workload, a seconds axis under it."""
    out = [
        f"timeline ({legend}; {r['timeline']['seconds_per_column'] * 1000:.0f} ms a column)",
    ]
    width = max(len(n) for n in r["timeline"]["rows"]) if r["timeline"]["rows"] else 8
    for name, row in r["timeline"]["rows"].items():
        out.append(f"  {name:<{width}} |{row}|")
    axis = [" "] * (COLUMNS + 8)
    for c in range(0, COLUMNS + 1, 20):
        label = f"{c / COLUMNS * r['window_s']:.1f}s"
        axis[c : c + len(label)] = label
    out.append(f"  {'':<{width}}  {''.join(axis).rstrip()}")
    return out


def render_stats(r: dict[str, Any], extra: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """The park / restore table (slicerd's figures per workload, then `extra` rows)."""
    rows = [(n, op, s) for n, ops in r["stats"].items() for op, s in ops.items()] + extra
    width = max([8, *(len(n) for n, _, _ in rows)])
    opw = max([7, *(len(op) for _, op, _ in rows)])
    out = [
        "park / restore ms",
        f"  {'workload':<{width}}  {'op':<{opw}}  {'count':>5}  {'median':>7}  {'p99':>6}  "
        f"{'max':>6}",
    ]
    for name, op, s in rows:
        out.append(
            f"  {name:<{width}}  {op:<{opw}}  {s['count']:>5}  {_fmt_ms(s['median_ms']):>7}  "
            f"{_fmt_ms(s['p99_ms']):>6}  {_fmt_ms(s['max_ms']):>6}"
        )
    return out


def render_turns(r: dict[str, Any]) -> list[str]:
    """One line per turn."""
    width = max([8, *(len(n) for n in r["timeline"]["rows"])])
    out = [
        "turns",
        f"  {'turn':>4}  {'workload':<{width}}  {'start s':>7}  {'held s':>7}  restored  waited ms",
    ]
    for t in r["turns"]:
        held = "open" if t["end"] is None else f"{t['end'] - t['start']:.3f}"
        out.append(
            f"  {t['turn']:>4}  {t['workload']:<{width}}  {t['start']:>7.3f}  {held:>7}  "
            f"{'yes' if t['restored'] else 'no':<8}  {t['waited_ms']:>9}"
        )
    return out


def render_failure(r: dict[str, Any]) -> list[str]:
    """The problems, framed, with the overlap log."""
    out = ["", "!" * 72, *(f"FAILED: {p}" for p in r["problems"])]
    for o in r.get("overlap_log", []):
        out.append(f"  overlap on gpu {o['gpu']} at {o['time']:.3f}: {', '.join(o['workloads'])}")
    return [*out, "!" * 72]


def render(r: dict[str, Any]) -> str:
    """The human report of the trainers demo."""
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
        *render_timeline(
            r, "'#' holds the GPU, 'p' park (memory to host), 'r' restore (back to the GPU)"
        ),
        "",
        *render_turns(r),
        "",
        *render_stats(r, []),
        "",
        f"handoffs: {r['handoffs']}",
        f"GPU busy: {r['busy_fraction'] * 100:.1f}% of the run held by a trainer "
        "(the rest: park, restore, granting)",
        f"overlaps: {r['overlaps']}",
    ]
    out += ["OK: 0 overlaps"] if r["ok"] else render_failure(r)
    return "\n".join(out)
