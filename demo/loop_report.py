"""The loop demo's report: slicerd's view (turns, parks, restores, from WATCH events),
the dispatcher's view of the sampler (vLLM wake, weight load and sleep, from its event
stream, ``GET /v1/events``),
the sampling client's outcomes, and the PNG chart (`demo.chart`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from demo.chart import PARK, RESTORE, SLEEP, WAKE_LOAD, Bar, ChartsMissing, write_chart
from demo.loop import EVENTS_FILE, describe
from demo.proc import Recording
from demo.report import (
    _ms_stats,
    analyze,
    common_problems,
    relative,
    render_failure,
    render_stats,
    render_timeline,
    render_turns,
)
from stubs.fakegpu import Ledger

NAMES = ["trainer", "sampler"]
_SPANS = {"woke": "wake", "load_end": "load", "slept": "sleep"}  # event -> span kind


def vllm_phases(events: Path) -> dict[str, list[dict[str, Any]]]:
    """The sampler's wake, load and sleep spans, from the dispatcher's events (JSON
    lines of ``GET /v1/events``), on the monotonic clock (the daemon's): each event is
    published as its phase ends (``t``), with its duration; failed ones are left out."""
    out: dict[str, list[dict[str, Any]]] = {"wake": [], "load": [], "sleep": []}
    if not events.exists():
        return out
    for line in events.read_text(errors="replace").splitlines():
        e = json.loads(line)
        kind = _SPANS.get(e["event"])
        if kind is None or e.get("ok") is False:
            continue
        end, secs = float(e["t"]), float(e["duration_s"])
        out[kind].append({"workload": "sampler", "start": end - secs, "end": end,
                          "ms": round(secs * 1000)})  # fmt: skip
    return out


def wasted_turns(events: Path) -> int:
    """The sampler's wasted turns (the dispatcher's ``released`` events that say
    ``wasted``: granted after a park, nothing loaded or served)."""
    if not events.exists():
        return 0
    lines = events.read_text(errors="replace").splitlines()
    return sum(1 for e in map(json.loads, lines) if e["event"] == "released" and e.get("wasted"))


def build_loop_report(
    opts: argparse.Namespace, rec: Recording, ledger: Ledger | None, base: Path
) -> dict[str, Any]:
    """Everything the loop demo shows, as one JSON-able dict; `ok` and `problems` decide."""
    phases = vllm_phases(base / EVENTS_FILE)
    overlay = [("w", phases["wake"] + phases["load"]), ("s", phases["sleep"])]
    a = analyze(rec, NAMES, overlay)
    overlaps = ledger.overlaps() if ledger is not None else None  # None: a real GPU
    problems = common_problems(a, overlaps or 0)
    expected = opts.revisions * opts.requests
    client = rec.client
    served = client.served() if client is not None else 0
    per_revision: dict[str, int] = {}
    if client is not None:
        for o in client.outcomes:
            per_revision[o.revision] = per_revision.get(o.revision, 0) + (o.status == "done")
        problems += [f"request {p}" for p in client.problems(expected)]
    else:
        problems.append("the sampling client did not run")
    if served != expected:
        problems.append(f"only {served} of {expected} requests were served with their revision")
    for name, rc in rec.exit_codes.items():
        if rc != 0:
            problems.append(f"{name} exited with {rc}")
    if rec.daemon_rc not in (0, None):
        problems.append(f"slicerd exited with {rec.daemon_rc}")
    if a["handoffs"] < 2:
        problems.append(f"only {a['handoffs']} handoffs: nothing was demonstrated")
    r = relative(a)
    t0 = a["t0"]
    vllm = {
        k: [{**s, "start": round(s["start"] - t0, 3), "end": round(s["end"] - t0, 3)} for s in v]
        for k, v in phases.items()
    }
    return {
        "ok": not problems,
        "problems": problems,
        "mode": "loop",
        "config": {
            "real": bool(opts.real),
            "revisions": opts.revisions,
            "requests": opts.requests,
            "capacity": opts.capacity,
            "bytes": opts.bytes,
            "bandwidth": opts.bandwidth,
            "work": opts.work,
        },
        "summary": describe(opts),
        **r,
        "vllm": vllm,
        "vllm_stats": {k: _ms_stats([s["ms"] for s in v]) for k, v in phases.items()},
        "requests": {"expected": expected, "served": served, "per_revision": per_revision},
        "trainer_parks": a["stats"]["trainer"]["park"]["count"],
        "wasted_turns": wasted_turns(base / EVENTS_FILE),
        "overlaps": overlaps,
        "overlap_log": ledger.overlap_log() if ledger is not None else [],
        "exit_codes": rec.exit_codes,
        "daemon_exit_code": rec.daemon_rc,
        "png": None,
        "dir": str(base),
    }


def _overlaps(r: dict[str, Any]) -> str:
    return "n/a (real GPU)" if r["overlaps"] is None else str(r["overlaps"])


def title(r: dict[str, Any]) -> str:
    """The chart's title line."""
    q = r["requests"]
    return (
        f"gpu-slicer demo: overlaps {_overlaps(r)}, GPU busy {r['busy_fraction'] * 100:.1f}%, "
        f"served {q['served']}/{q['expected']} with their revision"
    )


def write_png(r: dict[str, Any], path: Path) -> None:
    """Draw the report's timeline into `path`; record path and size in `r["png"]`. Without
    matplotlib (the `charts` extra) one line on stderr says so, and `r["png"]` stays None."""
    bars: dict[str, list[Bar]] = {n: [] for n in NAMES}
    for t in r["turns"]:
        end = r["window_s"] if t["end"] is None else t["end"]
        bars.setdefault(t["workload"], []).append((t["start"], end, "held"))
    for kind, spans in ((PARK, r["parks"]), (RESTORE, r["restores"])):
        for s in spans:
            end = r["window_s"] if s["end"] is None else s["end"]
            bars.setdefault(s["workload"], []).append((s["start"], end, kind))
    for s in r["vllm"]["wake"] + r["vllm"]["load"]:
        bars["sampler"].append((s["start"], s["end"], WAKE_LOAD))
    for s in r["vllm"]["sleep"]:
        bars["sampler"].append((s["start"], s["end"], SLEEP))
    try:
        width, height = write_chart(path, title(r), list(bars.items()), r["window_s"])
    except ChartsMissing as e:
        print(f"demo: no chart written: {e}", file=sys.stderr)
        return
    r["png"] = {"path": str(path), "width": width, "height": height}


def render_loop(r: dict[str, Any]) -> str:
    """The human report of the loop demo."""
    q = r["requests"]
    per = ", ".join(f"{rev} {n}" for rev, n in q["per_revision"].items())
    labels = {"wake": "vLLM wake", "load": "load rev", "sleep": "vLLM sleep"}
    extra = [("sampler", labels[k], s) for k, s in r["vllm_stats"].items()]
    out = [
        f"{r['summary']}; {r['window_s']:.2f} s from the first grant",
        "",
        *render_timeline(
            r,
            "'#' holds the GPU, 'p' park (memory to host), 'r' restore (back to the GPU); "
            "inside the sampler's turns 'w' is vLLM wake + weight load, 's' vLLM sleep",
        ),
        "",
        *render_turns(r),
        "",
        *render_stats(r, extra),
        "  (slicerd parks the sampler by verifying it slept: park=cooperative)",
        "",
        f"handoffs: {r['handoffs']}; trainer parks: {r['trainer_parks']}; wasted turns: "
        f"{r['wasted_turns']} (granted after a park, nothing loaded or served)",
        f"GPU busy: {r['busy_fraction'] * 100:.1f}% of the run held by the trainer or the sampler "
        "(the rest: park, restore, granting, idle)",
        f"overlaps: {_overlaps(r)}",
        f"requests per revision served with it: {per or '-'}",
    ]
    if r["png"] is not None:
        png = r["png"]
        out.append(f"chart: {png['path']} ({png['width']}x{png['height']} PNG)")
    if r["ok"]:
        out.append(f"OK: every request was served with its revision: {q['served']}/{q['expected']}")
    else:
        out.append(f"requests served with their revision: {q['served']}/{q['expected']}")
        out += render_failure(r)
    return "\n".join(out)
