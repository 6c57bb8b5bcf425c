"""Fit-aware turns: the switch with the trainer frozen beside vLLM, against parking, at
0.6B; the busy fraction they give at 8B @ 55 GB/s with a small vLLM.

    .venv/bin/python bench/fit.py [--config bench/scenarios.toml] [--model 0.6B]
        [--util 0.9] [--revisions N] [--big 8B@55 | --big none] [--big-util U]
        [--json] [--json-file FILE]

Method
------
The loop of bench/efficiency.py (its ``run_loop``, with the flags below: slicerd with
READY=1 awaited, the vLLM stub under ``slicer-launch vllm --park cooperative``,
``slicer-dispatch``, the trainer stub publishing one revision per step, a client sending
each revision's requests), at the model's sizes of bench/scenarios.toml (0.6B: weights
1.2 GB, trainer 16 bytes/param = 8.9 GiB, a 141 GiB fake GPU, vLLM at ``--util`` of it),
at each link of the file, twice in one run:

- **on**: slicerd ``--fit-aware --fit-headroom 1GiB``, ``slicer-dispatch
  --lazy-sleep-always``: vLLM is left awake at every turn's end, and slicerd freezes
  whichever workload is not running (lock: no CUDA work, its memory stays) and thaws it
  at its next turn (unlock); no bytes move once both have run.
- **off**: today's defaults: the trainer parked by checkpoint (its working set over the
  link each way), vLLM slept at each turn's end (by the dispatcher, or by its launcher
  at slicerd's request after a lazy release), woken at the next; its weights woken and
  loaded during the trainer's park where they fit beside it (early starts,
  ``--early-start`` the weights' bytes: the revisions the trainer stub saves hold no
  weight files for ``auto`` to measure).

Both with ``--parker driver`` (the long-lived helper on the fake ``libcuda.so.1``: no CLI
start, no cuInit per switch) and the dispatcher's other defaults (``--sleep-level auto``).

Time scaling as bench/efficiency.py does it: the fake link runs at k x the real link and
every modelled duration is divided by k; real-equivalent = what was measured, plus (k-1)
x the modelled share (checkpoint bytes / fake link, the weight load). The vLLM stub's
sleep and wake move nothing: a level-1 sleep of real vLLM copies its weights to host and
its wake copies them back, so each adds weights / link (level 2 adds nothing). The
locks and unlocks of the fakes (the fake libcuda's transactions on the ledger, through
slicerd's helper) are counted as measured, like every fixed cost; the row "handover less
the fakes' lock" leaves their own time out (what a real driver's lock and unlock take is
not modelled here: it waits for in-flight CUDA work, none at a turn's end).

Per switch (slicerd's WATCH events, CLOCK_MONOTONIC, and the dispatcher's ``GET
/v1/events``): from the moment the GPU could change hands (the later of the outgoing
workload's end of useful work and the incoming one's ACQUIRE; the sampler's useful work
ends at its last send, before any sleep) to the incoming one's grant: the **handover**
(park or freeze, sleep, restore or thaw, grant). T>S then goes on to the sampler's first
send: the wake, the weight load (a new revision each step, loaded in both modes, so
reported apart: not a cost of the GPU handover) and the rest. Bytes moved: checkpoint
bytes (slicerd's ``parked`` events, and their restores) and the modelled vLLM level-1
copies; checkpoint calls by operation from ``FAKEGPU_CC_LOG``. The first switch each way
(cold: the sampler's first wake, the trainer's first park) and the trainer's last
release (``park=now``: it exits) are left out in both modes. Each run is checked: every
request served, the trainer exited 0, 0 overlaps on the fake GPU's ledger, and (on)
slicerd froze. No figure is asserted; the verdict compares the on-mode handover (p50 and
p99, every link) with the target: under 50 ms real-equivalent at 0.6B (issue 18).

Busy fraction at 8B @ 55 GB/s (``--big``)
-----------------------------------------
At 8B the trainer (16 bytes/param: 119 GiB) and vLLM at the model's 0.9 of 141 GiB
cannot both be resident, so every switch of bench/efficiency.py moves the trainer's
working set over the link each way. Here vLLM gets ``--big-util``, by default the largest
``--gpu-memory-utilization`` (in hundredths) that leaves the trainer and ``fit-headroom``
room (`fit_util`: the vLLM stub takes util x capacity for its context, weights and KV
cache; 0.14 of 141 GiB: 21.2 GB, a KV cache of 4.7 GB instead of 120 GB). That is a real
trade (fewer concurrent sequences, shorter contexts), and the new weights are still
loaded at every step. The same two modes run, both with that small vLLM, so the lever is
the only difference (the off mode moves the same bytes as bench/efficiency.py's 8B @ 55
row: a slept vLLM's KV cache is dropped, not copied). The busy fraction of each run is
bench/efficiency.py's (its ``analyze``: "busy (real-equiv.)"), given the sampler turns
with the ends it leaves open (`completed_turns`: a lazy turn end, vLLM left awake, slept
nothing; a skipped wake copied nothing). Verdict: the on-mode busy fraction >= 90%
real-equivalent (issue 18); the handover table and bytes are as above.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make bench/slicer/stubs importable
    sys.path.insert(0, str(ROOT))

from bench.efficiency import (  # noqa: E402
    DISPATCHER_FLAGS,
    Run,
    SamplerTurn,
    Scenario,
    analyze,
    dispatcher_options,
    fmt_ms,
    load_scenarios,
    run_loop,
    sampler_turns,
    stats,
)

TARGET_MS = 50.0
HEADROOM = "1GiB"
HEADROOM_BYTES = 1 << 30
BIG = "8B@55"  # --big: the model and link of the busy-fraction scenario
BUSY_TARGET = 0.9  # issue 18: busy fraction (real-equivalent) at 8B @ 55 GB/s
COMMAND = ".venv/bin/python bench/fit.py"  # what `make bench` runs
MODES = {
    "on": (["--fit-aware", "--fit-headroom", HEADROOM], ["--lazy-sleep-always"]),
    "off": ([], []),
}


async def run_mode(s: Scenario, mode: str) -> dict[str, Any]:
    """One loop of `s` with `mode`'s daemon and dispatcher flags: its raw records and
    the checks (STATUS totals, overlaps)."""
    dflags, pflags = MODES[mode]
    # sleep_level "": the dispatcher's own default (auto), no flag.
    run = await run_loop(s, parker="driver", sleep_level="", daemon_flags=dflags,
                         dispatcher_flags=pflags)  # fmt: skip
    return {"run": run, "totals": run.totals, "overlaps": run.overlaps}


def _last(ts: list[float], hi: float) -> float | None:
    return max((t for t in ts if t <= hi), default=None)


def switches(run: Run, s: Scenario) -> list[dict[str, Any]]:
    """Every switch of `run` between the trainer and the sampler, real-equivalent seconds
    (module docstring), split into ``out`` (the outgoing workload frozen or parked),
    ``between`` (slicerd's steps up to the incoming one's thaw or restore) and ``in``
    (that thaw or restore, and the grant), with the bytes it moved and the checkpoint
    calls inside it."""
    ev = sorted((e for e in run.events if e["t"] >= run.t_start - 1), key=lambda e: e["t"])

    def times(who: str, kind: str) -> list[float]:
        return [float(e["t"]) for e in ev if e["workload"] == who and e["event"] == kind]

    def first(who: str, kinds: tuple[str, ...], lo: float, hi: float) -> float | None:
        return next((float(e["t"]) for e in ev if e["workload"] == who and e["event"] in kinds
                     and lo <= e["t"] <= hi), None)  # fmt: skip

    t_rel, t_q, t_grant = times("trainer", "released"), times("trainer", "queued"), \
        times("trainer", "granted")  # fmt: skip
    s_q = times("sampler", "queued")
    parks = [e for e in ev if e["event"] == "parked"]
    restores = [e for e in ev if e["event"] == "restored"]
    k, link = s.k, s.link

    def moved(lo: float, hi: float) -> tuple[int, int, int, Counter[str]]:
        """(bytes checkpointed, bytes restored, launcher-driven vLLM sleeps, checkpoint
        calls) in [lo, hi]."""
        out_b, in_b, sleeps = 0, 0, 0
        for p in parks:
            if lo <= p["t"] <= hi:
                if p.get("how") == "checkpoint":
                    out_b += int(p.get("bytes", 0))
                elif p["workload"] == "sampler":
                    sleeps += 1  # its launcher slept it (level 1: the launcher's default)
        for r in restores:
            if lo <= r["t"] <= hi:
                before = [p for p in parks if p["workload"] == r["workload"] and p["t"] < r["t"]]
                if before and before[-1].get("how") == "checkpoint":
                    in_b += int(before[-1].get("bytes", 0))
        ops = Counter(c.op for c in run.cc if lo - 0.005 <= c.end <= hi + 0.005)
        return out_b, in_b, sleeps, ops

    def handover(out_w: str, in_w: str, start: float, grant: float, slept: int
                 ) -> dict[str, Any]:  # fmt: skip
        out_b, in_b, sleeps, ops = moved(start, grant)
        t_out = first(out_w, ("frozen", "parked"), start, grant) or start
        t_in = first(in_w, ("thawing", "restoring"), t_out, grant) or grant
        # Real vLLM's level-1 sleep copies the weights to host: the dispatcher's (`slept`:
        # 1 at level 1, 0 at level 2, -1 none), else its launcher's at slicerd's request
        # (a cooperative park after a slept turn is that sleep verified, not another).
        copies = slept if slept >= 0 else min(sleeps, 1)
        fake = sum(c.duration for c in run.cc if c.op in ("lock", "unlock")
                   and start - 0.005 <= c.end <= grant + 0.005)  # fmt: skip
        parts = {
            "out": (t_out - start) + out_b / (link * k) * (k - 1) + copies * s.weights / link,
            "between": t_in - t_out,
            "in": (grant - t_in) + in_b / (link * k) * (k - 1),
        }
        return {**parts, "handover": sum(parts.values()), "ckpt_bytes": out_b + in_b,
                "vllm_copy_bytes": copies * s.weights, "ops": dict(ops),
                "fake_lock": fake, "net": sum(parts.values()) - fake}  # fmt: skip

    nums = [e.get("turn") for e in run.devents if e["event"] == "granted"]
    skipped = {e.get("turn") for e in run.devents if e["event"] == "woke" and e.get("skipped")}
    last_rel = max(t_rel, default=math.inf)
    out: list[dict[str, Any]] = []
    for i, (st, n) in enumerate(zip(sampler_turns(run), nums, strict=False)):
        if st.serving is None:
            continue
        # T>S: the trainer's release (or the sampler's ACQUIRE, if later) -> its grant.
        rel = _last(t_rel, st.granted)
        if rel is not None and st.granted < last_rel:
            start = max(rel, _last(s_q, st.granted) or rel)
            h = handover("trainer", "sampler", start, st.granted, 0)
            load = st.load + (s.load_s / k) * (k - 1) if st.load > 0 else 0.0
            copy_in = st.wake > 0 and st.wake_copies and n not in skipped  # level-1 wake
            wake = st.wake + (s.weights / link if copy_in else 0.0)
            after = (st.serving - st.granted) - st.load - st.wake + wake
            h["vllm_copy_bytes"] += s.weights * copy_in
            out.append({**h, "dir": "T>S", "i": i, "load": load, "after": after,
                        "last": rel >= last_rel})  # fmt: skip
        # S>T: the sampler's last send done (before its sleep) -> the trainer's grant.
        g = next((t for t in t_grant if t >= st.released), None)
        if g is None:
            continue
        end = st.serve_end if st.serve_end is not None else st.released
        start = max(end, _last(t_q, g) or end)
        slept = (st.sleep_level == 1) if st.sleep > 0 and st.serve_end is not None else -1
        h = handover("sampler", "trainer", start, g, int(slept))
        out.append({**h, "dir": "S>T", "i": i, "load": 0.0, "after": 0.0, "last": False})
    return out


def summarize(raw: dict[str, Any], s: Scenario) -> dict[str, Any]:
    """Medians and p99s (real-equivalent ms) of the warm switches of one run, its checks."""
    run: Run = raw["run"]
    sw = switches(run, s)
    firsts = {d: min((x["i"] for x in sw if x["dir"] == d), default=-1) for d in ("T>S", "S>T")}
    warm = [x for x in sw if x["i"] != firsts[x["dir"]] and not x["last"]]
    out: dict[str, Any] = {"checks": {
        "served": run.served, "expected": run.expected, "trainer_rc": run.trainer_rc,
        "overlaps": raw["overlaps"], "freezes": int(raw["totals"].get("freezes", 0)),
        "thaws": int(raw["totals"].get("thaws", 0)), "parks": int(raw["totals"].get("parks", 0)),
    }}  # fmt: skip
    for d in ("T>S", "S>T", "all"):
        sel = [x for x in warm if d in ("all", x["dir"])]
        ops: Counter[str] = Counter()
        for x in sel:
            ops.update(x["ops"])
        out[d] = {
            "n": len(sel),
            **{
                p: stats([x[p] * 1e3 for x in sel])
                for p in ("handover", "out", "between", "in", "fake_lock", "net")
            },
            "load": stats([x["load"] * 1e3 for x in sel if x["dir"] == "T>S"]),
            "after": stats([x["after"] * 1e3 for x in sel if x["dir"] == "T>S"]),
            "switch": stats([(x["handover"] + x["after"]) * 1e3 for x in sel]),
            "ckpt_bytes": sum(x["ckpt_bytes"] for x in sel),
            "vllm_copy_bytes": sum(x["vllm_copy_bytes"] for x in sel),
            "ops": dict(ops),
        }
    return out


def ok(r: dict[str, Any], mode: str) -> bool:
    c = r["checks"]
    did = c["freezes"] > 0 and c["thaws"] > 0 if mode == "on" else True
    return (c["served"] == c["expected"] and c["trainer_rc"] == 0 and c["overlaps"] == 0
            and did)  # fmt: skip


def verdict(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(PASS or MISS, the figure) of the target: on-mode handover under 50 ms at 0.6B."""
    worst50 = max(r["on"]["all"]["handover"]["p50"] for r in rows)
    worst99 = max(r["on"]["all"]["handover"]["p99"] for r in rows)
    good = all(ok(r[m], m) for r in rows for m in ("on", "off"))
    v = ("PASS" if worst99 < TARGET_MS else "PASS at p50, MISS at p99" if worst50 < TARGET_MS
         else "MISS") if good else "MISS (a run did not do its work)"  # fmt: skip
    figs = "; ".join(
        f"{r['scenario']}: {fmt_ms(r['on']['all']['handover']['p50'])} /"
        f" {fmt_ms(r['on']['all']['handover']['p99'])} ms (less the fakes' lock+unlock"
        f" {fmt_ms(r['on']['all']['net']['p50'])} / {fmt_ms(r['on']['all']['net']['p99'])};"
        f" off"
        f" {fmt_ms(r['off']['all']['handover']['p50'])} ms)" for r in rows)  # fmt: skip
    return v, f"handover p50 / p99 with fit-aware turns: {figs}"


def fit_util(s: Scenario) -> float:
    """The largest vLLM ``--gpu-memory-utilization`` (in hundredths) at which `s`'s trainer
    and an awake vLLM are both resident with HEADROOM spare (the vLLM stub takes util x
    capacity: its context, the weights and a KV cache of the rest); 0.0 when that leaves
    vLLM no KV cache."""
    util = math.floor((s.capacity - s.trainer - HEADROOM_BYTES) / s.capacity * 100) / 100
    return util if int(util * s.capacity) - s.weights - s.context > 0 else 0.0


def completed_turns(run: Run) -> list[SamplerTurn]:
    """``sampler_turns(run)`` with the ends it leaves open, for bench/efficiency.py's
    ``analyze``: a turn that ended without a sleep (a lazy release: vLLM left awake)
    served until slicerd's release (as `switches` counts it) and slept nothing, unless
    its launcher slept it at slicerd's request before the next grant (level 1: the
    launcher's default); a wake that found vLLM awake (``skipped``) copied nothing."""
    turns = sampler_turns(run)
    nums = [e.get("turn") for e in run.devents if e["event"] == "granted"]
    skipped = {e.get("turn") for e in run.devents if e["event"] == "woke" and e.get("skipped")}
    sleeps = [float(e["t"]) for e in run.events if e["workload"] == "sampler"
              and e["event"] == "parked" and e.get("how") != "checkpoint"]  # fmt: skip
    for i, (st, n) in enumerate(zip(turns, nums, strict=False)):
        if n in skipped:
            st.wake_copies = False
        if st.serving is not None and st.serve_end is None:
            nxt = turns[i + 1].granted if i + 1 < len(turns) else math.inf
            st.serve_end, st.sleep = st.released, 0.0
            st.sleep_level = 1 if any(st.released <= x <= nxt for x in sleeps) else 0
    return turns


def busy(run: Run, s: Scenario) -> dict[str, Any]:
    """bench/efficiency.py's busy fractions of `run` (its ``analyze``: "busy
    (real-equiv.)", "at the bound", "at the floor", "measured") and its real-equivalent
    switches."""
    a = analyze(run, s, completed_turns(run))
    keys = ("busy_real", "busy_bound", "busy_floor", "busy_measured", "wall_s", "wall_real_s",
            "idle_s", "useful_trainer_s", "useful_sampler_s", "sampler_turns")  # fmt: skip
    return {**{k: a[k] for k in keys},
            "switch_total": {d: a["switches"][d]["total"] for d in ("T>S", "S>T")},
            "switch_bound": {d: a["switches"][d]["bound"] for d in ("T>S", "S>T")}}  # fmt: skip


def big_verdict(big: dict[str, Any]) -> tuple[str, str]:
    """(PASS or MISS, the figure) of the target: busy >= 90% real-equivalent at 8B @ 55
    GB/s, with fit-aware turns and vLLM at `big`'s small ``--gpu-memory-utilization``."""
    row = big["row"]
    on, off = row["on"]["busy"], row["off"]["busy"]
    good = ok(row["on"], "on") and ok(row["off"], "off")
    v = ("PASS" if on["busy_real"] >= BUSY_TARGET else "MISS") if good else \
        "MISS (a run did not do its work)"  # fmt: skip
    fig = (f"{row['scenario']}, vLLM --gpu-memory-utilization {big['util']:g} (KV cache"
           f" {big['kv_gb']:.1f} GB instead of {big['kv_default_gb']:.1f} GB at"
           f" {big['util_default']:g}): busy {on['busy_real'] * 100:.1f}% with fit-aware turns"
           f" (at the bound {on['busy_bound'] * 100:.1f}%), {off['busy_real'] * 100:.1f}%"
           f" without (same vLLM; at the bound {off['busy_bound'] * 100:.1f}%, at the floor"
           f" {off['busy_floor'] * 100:.1f}%: early starts overlap the weights' load with the"
           " trainer's park); handover p50 /"
           f" p99 {fmt_ms(row['on']['all']['handover']['p50'])} /"
           f" {fmt_ms(row['on']['all']['handover']['p99'])} ms (off"
           f" {fmt_ms(row['off']['all']['handover']['p50'])} /"
           f" {fmt_ms(row['off']['all']['handover']['p99'])} ms); the new weights still load"
           " at every step")  # fmt: skip
    return v, fig


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def row_lines(r: dict[str, Any]) -> list[str]:
    """The on / off table of one scenario's row (report)."""
    L: list[str] = []
    L.append(f"\n{r['scenario']}:")
    L.append(f"  {'':34}{'on (fit-aware)':>22}{'off (park+sleep)':>22}{'off/on':>8}")
    for d in ("T>S", "S>T"):
        on, off = r["on"][d], r["off"][d]
        parts = [
            ("handover p50 / p99", "handover"),
            (" out: frozen / parked", "out"),
            (" slicerd between", "between"),
            (" in: thaw / restore, grant", "in"),
            (" of it the fakes' lock+unlock", "fake_lock"),
            (" handover less the fakes' lock", "net"),
        ]
        if d == "T>S":
            parts += [("grant -> first send, no load", "after")]
            parts += [("weight load (apart)", "load")]
        parts += [("switch (no load) p50 / p99", "switch")]
        for label, key in parts:
            a, b = on[key], off[key]
            ratio = b["p50"] / a["p50"] if a["p50"] > 0 else math.nan
            L.append(
                f"  {d} {label:30}{fmt_ms(a['p50']) + ' / ' + fmt_ms(a['p99']):>22}"
                f"{fmt_ms(b['p50']) + ' / ' + fmt_ms(b['p99']):>22}{ratio:>7.1f}x"
            )
        L.append(f"  {d} {'bytes: checkpoint + vLLM copies':30}"
                 f"{gb(on['ckpt_bytes']) + ' + ' + gb(on['vllm_copy_bytes']):>22}"
                 f"{gb(off['ckpt_bytes']) + ' + ' + gb(off['vllm_copy_bytes']):>22}"
                 f"   ({on['n']} / {off['n']} switches)")  # fmt: skip
    for m in ("on", "off"):
        c, ops = r[m]["checks"], r[m]["all"]["ops"]
        L.append(f"  {m}: served {c['served']}/{c['expected']}, trainer rc {c['trainer_rc']},"
                 f" overlaps {c['overlaps']}, freezes {c['freezes']}, thaws {c['thaws']},"
                 f" parks {c['parks']}; checkpoint calls in the switches"
                 f" {dict(sorted(ops.items())) or '{}'}; {r[m]['run_s']:.0f} s"
                 + ("" if ok(r[m], m) else "  <- INCOMPLETE"))  # fmt: skip
    return L


def big_lines(big: dict[str, Any]) -> list[str]:
    """The busy-fraction scenario's part of the report: its settings, its on / off table,
    bench/efficiency.py's busy fractions."""
    row = big["row"]
    L = [f"\nbusy fraction at {row['scenario']} with fit-aware turns (trainer"
         f" {big['trainer_gib']:.1f} GiB, weights {big['weights_gb']:.1f} GB, vLLM"
         f" --gpu-memory-utilization {big['util']:g} = {big['vllm_gb']:.1f} GB: a KV cache of"
         f" {big['kv_gb']:.1f} GB instead of {big['kv_default_gb']:.1f} GB at"
         f" {big['util_default']:g}, fewer concurrent sequences; headroom {HEADROOM}, time"
         f" scale k={big['k']:g}, {big['revisions']} steps; off: the same vLLM, today's"
         " defaults; the new weights load at every step in both)"]  # fmt: skip
    L += row_lines(row)
    on, off = row["on"]["busy"], row["off"]["busy"]
    L.append(f"  {'(bench/efficiency.py analyze)':34}{'on (fit-aware)':>22}"
             f"{'off (park+sleep)':>22}")  # fmt: skip
    for label, key in (("busy (real-equiv.)", "busy_real"),
                       ("busy at the bound (estimate)", "busy_bound"),
                       ("busy at the floor (estimate)", "busy_floor"),
                       ("busy (measured, scaled run)", "busy_measured")):  # fmt: skip
        L.append(f"  {label:34}{on[key] * 100:>21.1f}%{off[key] * 100:>21.1f}%")
    for d in ("T>S", "S>T"):
        a, b = on["switch_total"][d], off["switch_total"][d]
        L.append(f"  {d + ' switch (real-equiv., load in)':34}"
                 f"{fmt_ms(a['p50']) + ' / ' + fmt_ms(a['p99']):>22}"
                 f"{fmt_ms(b['p50']) + ' / ' + fmt_ms(b['p99']):>22}")  # fmt: skip
    return L


def report(res: dict[str, Any]) -> str:
    """The text report (what `make bench` puts in BENCHMARKS.md)."""
    L = [f"fit-aware turns at {res['model']} (trainer {res['trainer_gib']:.1f} GiB, weights"
         f" {res['weights_gb']:.1f} GB, GPU {res['capacity_gib']:.0f} GiB, vLLM"
         f" --gpu-memory-utilization {res['util']:g}, headroom {HEADROOM}, time scale"
         f" k={res['k']:g}, {res['revisions']} steps; real-equivalent ms; first switch each"
         " way and the trainer's exit left out)"]  # fmt: skip
    for r in res["rows"]:
        L += row_lines(r)
    big = res.get("big")
    if big:
        L += big_lines(big)
    v, fig = res["verdict"], res["figure"]
    L.append(f"\n{os.cpu_count()} CPUs, load average {res['load'][0]:g} before, {res['load'][1]:g}"
             f" after; {res['total_s']:.0f} s in all")  # fmt: skip
    L.append(
        f"\nverdict: {v}: handover under {TARGET_MS:g} ms real-equivalent at {res['model']} ({fig})"
    )
    if big:
        L.append(f"verdict: {big['verdict']}: busy fraction >= {BUSY_TARGET * 100:g}%"
                 f" real-equivalent at {big['row']['scenario']} ({big['figure']})")  # fmt: skip
    return "\n".join(L)


async def run_row(s: Scenario, with_busy: bool = False) -> dict[str, Any]:
    """Both modes of `s`, one after the other: its row (`with_busy`: with bench/
    efficiency.py's busy fractions of each run)."""
    row: dict[str, Any] = {"scenario": s.name, "link_gbps": s.link_gbps}
    for mode in ("on", "off"):
        t0 = time.monotonic()
        raw = await run_mode(s, mode)
        r = summarize(raw, s)
        if with_busy:
            r["busy"] = busy(raw["run"], s)
        r["run_s"] = time.monotonic() - t0
        print(f"  {s.name} {mode}: handover p50 {fmt_ms(r['all']['handover']['p50'])} ms,"
              + (f" busy {r['busy']['busy_real'] * 100:.1f}%," if with_busy else "")
              + f" {r['run_s']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
        row[mode] = r
    return row


async def run_big(every: list[Scenario], args: argparse.Namespace) -> dict[str, Any]:
    """The busy-fraction scenario (``--big MODEL@LINK``): vLLM at ``--big-util`` (default
    `fit_util`: the largest that leaves the trainer room), fit-aware turns on and off."""
    model, _, link = args.big.partition("@")
    base = next((s for s in every if s.model == model and f"{s.link_gbps:g}" == link), None)
    if base is None:
        raise SystemExit(f"fit bench: no model {model!r} at link {link!r} in {args.config}")
    util = args.big_util or fit_util(base)
    if not util or base.capacity - int(util * base.capacity) < base.trainer + HEADROOM_BYTES:
        raise SystemExit(f"fit bench: at {base.name} the trainer cannot stay beside vLLM"
                         f" with a KV cache (--big-util {util:g})")  # fmt: skip
    s = dataclasses.replace(base, util=util, revisions=args.revisions or base.revisions)
    big: dict[str, Any] = {
        "util": util, "util_default": base.util, "k": s.k, "revisions": s.revisions,
        "trainer_gib": s.trainer / (1 << 30), "weights_gb": s.weights / 1e9,
        "vllm_gb": int(util * s.capacity) / 1e9, "kv_gb": s.kv / 1e9,
        "kv_default_gb": base.kv / 1e9, "target": BUSY_TARGET,
        "row": await run_row(s, with_busy=True),
    }  # fmt: skip
    big["verdict"], big["figure"] = big_verdict(big)
    return big


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    # The dispatcher options this checkout has (run_loop passes --early-start the weights'
    # bytes where it exists: the revisions the trainer stub saves hold no weight files).
    DISPATCHER_FLAGS.update(dispatcher_options())
    every, _ = load_scenarios(Path(args.config))
    scen = [dataclasses.replace(s, util=args.util if args.util else s.util,
                                revisions=args.revisions or s.revisions)
            for s in every if s.model == args.model]  # fmt: skip
    if not scen:
        raise SystemExit(f"fit bench: no model {args.model!r} in {args.config}")
    s0 = scen[0]
    if s0.capacity - int(s0.util * s0.capacity) < s0.trainer + (1 << 30):
        print("fit bench: the trainer does not fit beside vLLM at this --util: nothing will"
              " be frozen", file=sys.stderr)  # fmt: skip
    rows = [await run_row(s) for s in scen]
    res = {"model": s0.model, "trainer_gib": s0.trainer / (1 << 30), "weights_gb": s0.weights / 1e9,
           "capacity_gib": s0.capacity / (1 << 30), "util": s0.util, "k": s0.k,
           "revisions": s0.revisions, "rows": rows, "target_ms": TARGET_MS,
           "command": COMMAND}  # fmt: skip
    res["verdict"], res["figure"] = verdict(rows)
    if args.big.lower() not in ("", "none"):
        res["big"] = await run_big(every, args)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "bench" / "scenarios.toml"))
    ap.add_argument("--model", default="0.6B", help="a [[model]] name of the config")
    ap.add_argument("--util", type=float, default=0.0,
                    help="vLLM --gpu-memory-utilization (default: the model's)")  # fmt: skip
    ap.add_argument("--revisions", type=int, default=10, help="trainer steps (0: the model's)")
    ap.add_argument("--big", default=BIG, metavar="MODEL@LINK",
                    help="the busy-fraction scenario (%(default)s; none: skip it)")  # fmt: skip
    ap.add_argument("--big-util", type=float, default=0.0,
                    help="its vLLM --gpu-memory-utilization (default: the largest that"
                         " leaves the trainer room)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--json-file", metavar="FILE", help="also write the JSON object here")
    args = ap.parse_args()
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    res = trio.run(run_all, args)
    res["total_s"] = time.monotonic() - t0
    res["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(res, sort_keys=True))
    print(json.dumps(res, sort_keys=True) if args.json else report(res))
    rows = res["rows"] + ([res["big"]["row"]] if res.get("big") else [])
    good = all(ok(r[m], m) for r in rows for m in ("on", "off"))
    return 0 if good else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
