"""`make demo-pool` (``python -m demo --pool``): a sampling pool across three nodes on one
real Redis.

Theory of operation
-------------------
The demo's directory holds a real ``redis-server`` (`stubs.redisserver.RedisServer`: a
private Unix socket, AOF on, ``appendfsync always``). Three simulated nodes
(`stubs.poolnodes.running_pool`) join pool ``demo`` on it; each is what one machine of a
pool runs: its own fake GPU (80 GiB), slicerd, the vLLM stub under ``slicer-launch``
(workload ``v``), a pool-mode ``slicer-dispatch`` in front of it and a trainer stub
(`TRAINER_BYTES`, checkpoint-parked) whose steps take `TRAINER_WORK` seconds, a different length
on each node. So on every node the trainer and the replica take turns on the GPU, and a
pending request is served by whichever replica's trainer is off its GPU.

This process then, for each of ``--revisions`` revisions ``r1``, ``r2``, ...: publishes
it through one front (node k mod 3's dispatcher, ``POST /v1/revisions``), submits
``--requests`` requests through all three fronts (round robin; from the second revision
on a tenth of them pinned to the revision before, so two revisions are pending at once),
and long-polls their results through a front other than the one that accepted each.
The next revision follows once this one's results are all in, or after
`REVISION_GAP_S`, whichever comes first. Every node's slicerd events (WATCH) and its
dispatcher's event stream (``GET /v1/events``: vLLM wake, weight load, sleep) are
recorded meanwhile: each node's trainer starts only once its node's WATCH is subscribed,
so its first grant is in the record, and the record ends in a steady state, once every
trainer holds its GPU again after its replica's last turn (within `STEADY_S`), so every
park and restore of the run is in it. Then each dispatcher's ``GET /status`` is read
(its ``pool_mode``), and the pool's counters straight from Redis.

The report: a timeline with two rows per node (its trainer's turns and its replica's,
``#`` holds the GPU, ``p`` park, ``r`` restore, ``w`` vLLM wake + weight load, ``s``
vLLM sleep; every node's slicerd runs on this machine's monotonic clock, so the rows
share one time axis), a PNG of the same (``--png``; default `DEFAULT_PNG`), a table
per node (turns, handoffs, trainer parks, GPU busy fraction, overlaps) and the pool
summary: requests served per replica, results per revision, lost, failed, duplicates,
reclaimed and returned, turns granted to the replicas per request served (each such turn
parked that node's trainer), and each dispatcher's ``held_back`` (times it did not ask
for a turn because other replicas covered the backlog), ``empty_turns`` (turns that
found nothing left to claim) and ``wasted_turns`` (turns woken for, a trainer parked, in
which nothing was loaded or served: the waste count, printed as ``waste:``).

Exit status 0 only when every request was served once from its revision (none lost,
none failed, no duplicate), every replica served some (when one revision's requests
are more than two replicas' ``--concurrency``: `needs_every_replica`), and on every
node there was no overlap, no fault and no two turns at once; 1 otherwise (the Redis
directory is then kept; the nodes' log tails are printed when the run itself fails).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from demo.chart import PARK, RESTORE, SLEEP, WAKE_LOAD, Bar, ChartsMissing, write_chart
from demo.loop_report import vllm_phases
from demo.proc import DemoError, Interrupted, Recording, on_signal, only, watch
from demo.report import analyze, common_problems, relative, render_failure, render_timeline
from gpu_slicer.dispatcher.events import follow_events
from stubs.poolnodes import (
    REPLICA,
    TRAINER,
    Pool,
    Sample,
    dispatcher_status,
    publish,
    results,
    running_pool,
    submit_many,
    versions,
)
from stubs.redisserver import RedisServer, RedisServerError, find_redis_server

POOL = "demo"
NODES = 3
TRAINER_WORK = (0.1, 0.25, 0.6)  # seconds a training step, node by node
# Beside the awake replica (0.9 x 80 GiB) it does not fit: every handoff parks one side.
TRAINER_BYTES = "10GiB"
CONCURRENCY = 32
DISPATCH_ARGS = ["--turn-seconds", "0.5", "--turn-grace", "2", "--concurrency", str(CONCURRENCY)]
STUB_ARGS = ["--tokens-per-s", "2000"]
MAX_TOKENS = 4
REVISION_GAP_S = 2.0  # the next revision at the latest this long after the last one's
PINNED_SHARE = 0.1  # of a revision's requests (from the second on): pinned to the one before
RUN_BASE_S = 60.0  # the whole run's bound: this plus RUN_PER_REQUEST_S a request
RUN_PER_REQUEST_S = 0.1
STEADY_S = 30.0  # after the last result: every trainer granted again within this
DEFAULT_PNG = "demo-out/pool-timeline.png"
ROW_COLORS = {"trainer": "tab:blue", "replica": "tab:orange"}
EVENTS_FILE = "{node}-dispatcher-events.jsonl"


def missing() -> str:
    """Why the pool demo cannot run here ('' when it can): no redis-server 7."""
    try:
        find_redis_server()
    except RedisServerError as e:
        return str(e)
    return ""


@dataclass
class Run:
    """What one pool run saw."""

    recs: dict[str, Recording] = field(default_factory=dict)  # slicerd events, per node
    sent: list[Sample] = field(default_factory=list)
    got: dict[str, dict[str, Any]] = field(default_factory=dict)
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)  # GET /status
    stats: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    overlaps: dict[str, int] = field(default_factory=dict)
    overlap_log: list[dict[str, Any]] = field(default_factory=list)
    exit_codes: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)


async def _follow(front: str, path: Path, *, task_status: trio.TaskStatus[object]) -> None:
    def keep(event: dict[str, object]) -> None:
        with path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    with contextlib.suppress(httpx.HTTPError):  # a dead dispatcher: the checks say so
        await follow_events(front, keep, task_status=task_status)


async def _drive(opts: argparse.Namespace, pool: Pool, run: Run) -> None:
    """Publish, submit and collect (module docstring)."""
    fronts = pool.fronts

    async def collect(batch: list[Sample], done: trio.Event) -> None:
        for k, front in enumerate(fronts):  # each through a front that did not accept it
            ids = [s.id for s in batch if s.front == fronts[(k + 1) % len(fronts)]]
            run.got.update(await results(front, ids))
        done.set()

    async with trio.open_nursery() as nursery:
        for k in range(opts.revisions):
            rev = f"r{k + 1}"
            await publish(fronts[k % len(fronts)], rev, pool.base)
            run.published.append(rev)
            pinned = round(opts.requests * PINNED_SHARE) if k else 0
            batch = await submit_many(fronts, opts.requests - pinned, max_tokens=MAX_TOKENS,
                                      start=len(run.sent))  # fmt: skip
            if pinned:
                batch += await submit_many(fronts, pinned, revision=run.published[-2],
                                           max_tokens=MAX_TOKENS,
                                           start=len(run.sent) + len(batch))  # fmt: skip
            run.sent += batch
            done = trio.Event()
            nursery.start_soon(collect, batch, done)
            with trio.move_on_after(REVISION_GAP_S):
                await done.wait()


async def _run(opts: argparse.Namespace, base: Path, run: Run) -> None:
    with RedisServer(base / "redis") as redis:
        # No trainer yet: each starts once its node's WATCH is subscribed (`_in_pool`).
        nodes = running_pool(NODES, redis, pool=POOL, trainer_work=TRAINER_WORK,
                             trainer_bytes=TRAINER_BYTES, dispatch_args=DISPATCH_ARGS,
                             stub_args=STUB_ARGS, trainers=False)  # fmt: skip
        async with nodes as pool:
            try:
                await _in_pool(opts, base, pool, run)
            finally:
                for n in pool.nodes:
                    run.exit_codes[n.name] = n.stack.rcs  # filled as the pool stops


async def _in_pool(opts: argparse.Namespace, base: Path, pool: Pool, run: Run) -> None:
    bound = RUN_BASE_S + RUN_PER_REQUEST_S * opts.revisions * opts.requests
    async with trio.open_nursery() as watchers:
        for n in pool.nodes:
            rec = run.recs[n.name] = Recording()
            await watchers.start(watch, n.stack.socket, rec, trio.Event())
            path = base / EVENTS_FILE.format(node=n.name)
            await watchers.start(_follow, n.front, path)
        # Every node's events are recorded from here: its trainer's first grant included.
        for n in pool.nodes:
            n.stack.trainer(TRAINER, n.trainer_args)
        try:
            with trio.fail_after(bound):
                await _drive(opts, pool, run)
        except trio.TooSlowError:
            raise DemoError(f"the requests were not all settled within {bound:.0f} s") from None
        try:
            with trio.fail_after(STEADY_S):
                for rec in run.recs.values():
                    await rec.until(trainer_back)
        except trio.TooSlowError:
            late = [k for k, rec in run.recs.items() if not trainer_back(rec.events)]
            raise DemoError(
                f"the trainers of {late} were not granted their GPU back within {STEADY_S:.0f} s "
                "of the last result"
            ) from None
        for n in pool.nodes:
            run.statuses[n.name] = await dispatcher_status(n.front)
        run.stats, run.served = pool.stats(), pool.served()
        run.overlaps = pool.overlaps()
        for n in pool.nodes:
            run.overlap_log += [{**o, "node": n.name} for o in n.stack.ledger.overlap_log()]
        pool.check_alive()
        stop = time.monotonic()
        for rec in run.recs.values():
            rec.stop_local = stop
        watchers.cancel_scope.cancel()


def trainer_back(events: list[dict[str, Any]]) -> bool:
    """Whether a node's trainer holds its GPU again after the replica's last turn (the
    steady state the recording ends in: every park and restore of the run inside it)."""
    last: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.get("event") in ("granted", "released"):
            last[f"{e['event']} {e.get('workload')}"] = i
    trainer = last.get(f"granted {TRAINER}", -1)
    replica = max(last.get(f"granted {REPLICA}", -1), last.get(f"released {REPLICA}", -1))
    return trainer > replica and trainer > last.get(f"released {TRAINER}", -1)


# ---- the report ------------------------------------------------------------------------


def _label(workload: str) -> str:
    return "replica" if workload == REPLICA else workload


def _merged(run: Run, base: Path) -> tuple[Recording, list[str], list[tuple[str, Any]]]:
    """Every node's events in one recording, workloads named "NODE trainer" / "NODE
    replica" and turn numbers made distinct per node (for the shared timeline only:
    per-node checks use each node's own events); the rows and the vLLM overlay."""
    merged = Recording()
    names: list[str] = []
    wake: list[dict[str, Any]] = []
    sleep: list[dict[str, Any]] = []
    for i, (node, rec) in enumerate(run.recs.items()):
        names += [f"{node} trainer", f"{node} replica"]
        for e in rec.events:
            e2 = {**e, "workload": f"{node} {_label(str(e.get('workload')))}"}
            for key in ("turn", "turn_ended"):
                if isinstance(e.get(key), int):
                    e2[key] = i * 1_000_000 + int(e[key])
            merged.events.append(e2)
        merged.stop_local = rec.stop_local
        phases = vllm_phases(base / EVENTS_FILE.format(node=node))
        who = f"{node} replica"
        wake += [{**s, "workload": who} for s in phases["wake"] + phases["load"]]
        sleep += [{**s, "workload": who} for s in phases["sleep"]]
    return merged, names, [("w", wake), ("s", sleep)]


def _rel(span: dict[str, Any], t0: float) -> dict[str, Any]:
    return {**span, "start": round(span["start"] - t0, 3), "end": round(span["end"] - t0, 3)}


def _node_figures(name: str, rec: Recording, run: Run) -> dict[str, Any]:
    a = analyze(rec, [TRAINER, REPLICA])
    problems = [f"{name}: {p}" for p in common_problems(a, run.overlaps.get(name, 0))]
    turns = {w: sum(1 for t in a["turns"] if t["workload"] == w) for w in (TRAINER, REPLICA)}
    st = run.statuses.get(name, {})
    pm = st.get("pool_mode", {})
    return {
        "trainer_turns": turns[TRAINER],
        "replica_turns": turns[REPLICA],
        "handoffs": a["handoffs"],
        "trainer_parks": a["stats"][TRAINER]["park"]["count"],
        "busy_fraction": a["busy_fraction"],
        "overlaps": run.overlaps.get(name),
        "faults": len(a["faults"]),
        "concurrent_turns": len(a["concurrent"]),
        "held_back": pm.get("held_back"),
        "empty_turns": pm.get("empty_turns"),
        # Granted and woken for (its trainer parked) with nothing loaded or served.
        "wasted_turns": st.get("counters", {}).get("wasted_turns"),
        "turn_capacity": pm.get("turn_capacity"),
        "served": run.served.get(name, 0),
        "exit_codes": run.exit_codes.get(name, {}),
        "problems": problems,
    }


def build_pool_report(opts: argparse.Namespace, run: Run, base: Path) -> dict[str, Any]:
    """Everything the pool demo shows, as one JSON-able dict; `ok` and `problems` decide."""
    problems = list(run.problems)
    nodes = {name: _node_figures(name, rec, run) for name, rec in run.recs.items()}
    for fig in nodes.values():
        problems += fig.pop("problems")
    per_revision: dict[str, int] = {}
    wrong: list[str] = []
    for s in run.sent:
        body = run.got.get(s.id)
        if body is None:
            continue
        ok = (body.get("status") == "done" and body.get("revision") == s.revision
              and versions(body["result"]) == {s.revision})  # fmt: skip
        if ok:
            per_revision[str(s.revision)] = per_revision.get(str(s.revision), 0) + 1
        else:
            wrong.append(f"{s.id} ({s.revision}): {json.dumps(body)[:200]}")
    sent = len(run.sent)
    expected = opts.revisions * opts.requests
    lost = sent - len([s for s in run.sent if s.id in run.got])
    good = sum(per_revision.values())
    stats = run.stats
    if sent != expected:
        problems.append(f"{sent} requests sent, {expected} expected")
    if lost:
        problems.append(f"{lost} requests lost (no result)")
    if wrong:
        problems.append(f"{len(wrong)} results not done from their revision: {wrong[:5]}")
    if stats and stats.get("committed") != sent:
        problems.append(f"the pool committed {stats.get('committed')} results for {sent} requests")
    for key in ("failed", "duplicates"):
        if stats.get(key):
            problems.append(f"the pool counted {stats[key]} {key}")
    idle = [n for n, fig in nodes.items() if not fig["served"]]
    if run.recs and idle and needs_every_replica(opts):
        problems.append(f"replicas that served nothing: {idle}")
    replica_turns = sum(fig["replica_turns"] for fig in nodes.values())
    merged, names, overlay = _merged(run, base)
    a = analyze(merged, names, overlay)
    r = relative(a)
    return {
        "ok": not problems,
        "problems": problems,
        "mode": "pool",
        "config": {
            "nodes": NODES,
            "pool": POOL,
            "revisions": opts.revisions,
            "requests": opts.requests,
            "trainer_work": list(TRAINER_WORK),
            "dispatch_args": DISPATCH_ARGS,
            "stub_args": STUB_ARGS,
        },
        "summary": describe(opts),
        "window_s": r["window_s"],
        "timeline": r["timeline"],
        "turns": r["turns"],
        "parks": r["parks"],
        "restores": r["restores"],
        "vllm": {kind: [_rel(s, a["t0"]) for s in spans] for kind, spans in overlay},
        "nodes": nodes,
        "requests": {
            "expected": expected,
            "sent": sent,
            "results": len(run.got),
            "from_their_revision": good,
            "per_revision": per_revision,
            "lost": lost,
        },
        "pool": {
            "stats": stats,
            "served": run.served,
            "replica_turns": replica_turns,
            "parks_per_request": round(replica_turns / good, 4) if good else None,
            "held_back": sum(fig["held_back"] or 0 for fig in nodes.values()),
            "empty_turns": sum(fig["empty_turns"] or 0 for fig in nodes.values()),
            "wasted_turns": sum(fig["wasted_turns"] or 0 for fig in nodes.values()),
        },
        "overlaps": run.overlaps,
        "overlap_log": run.overlap_log,
        "png": None,
        "dir": str(base),
    }


def needs_every_replica(opts: argparse.Namespace) -> bool:
    """Whether one revision's requests are more than the other replicas' concurrency
    together: only then must every replica serve some (a smaller backlog wakes fewer:
    the others hold back, their trainers train on)."""
    return bool(opts.requests > (NODES - 1) * CONCURRENCY)


def describe(opts: argparse.Namespace) -> str:
    """One line saying what the pool demo runs."""
    steps = "/".join(f"{w:g}" for w in TRAINER_WORK)
    return (
        f"gpu-slicer demo --pool: {NODES} nodes (each its own fake GPU, slicerd, trainer, "
        f"vLLM stub, dispatcher) in pool {POOL!r} on one Redis (AOF, appendfsync always); "
        f"trainer steps {steps} s; {opts.revisions} revisions x {opts.requests} requests "
        "through every front"
    )


def write_pool_png(r: dict[str, Any], path: Path) -> None:
    """The stacked timeline (two tracks per node) into `path`; path and size in
    `r["png"]` (None, with one line on stderr, without matplotlib)."""
    rows: dict[str, list[Bar]] = {name: [] for name in r["timeline"]["rows"]}
    for kind, spans in (("held", r["turns"]), (PARK, r["parks"]), (RESTORE, r["restores"])):
        for s in spans:
            end = r["window_s"] if s["end"] is None else s["end"]
            rows.setdefault(s["workload"], []).append((s["start"], end, kind))
    for mark, kind in (("w", WAKE_LOAD), ("s", SLEEP)):
        for s in r["vllm"].get(mark, []):
            rows.setdefault(s["workload"], []).append((s["start"], s["end"], kind))
    colors = [ROW_COLORS["replica" if n.endswith("replica") else "trainer"] for n in rows]
    legend = [("trainer holds its GPU", ROW_COLORS["trainer"]),
              ("replica holds its GPU", ROW_COLORS["replica"])]  # fmt: skip
    q, p = r["requests"], r["pool"]
    title = (
        f"gpu-slicer pool demo: {len(r['nodes'])} nodes, overlaps "
        f"{sum(v or 0 for v in r['overlaps'].values())}, served {q['from_their_revision']}/"
        f"{q['expected']} from their revision, lost {q['lost']}, "
        f"duplicates {p['stats'].get('duplicates', 0)}"
    )
    try:
        width, height = write_chart(path, title, list(rows.items()), r["window_s"], colors, legend)
    except ChartsMissing as e:
        print(f"demo: no chart written: {e}", file=sys.stderr)
        return
    r["png"] = {"path": str(path), "width": width, "height": height}


def render_pool(r: dict[str, Any]) -> str:
    """The human report of the pool demo."""
    q, p = r["requests"], r["pool"]
    st = p["stats"]
    out = [
        f"{r['summary']}; {r['window_s']:.2f} s from the first grant",
        "",
        *render_timeline(
            r,
            "'#' holds its node's GPU, 'p' park, 'r' restore; in a replica's turns 'w' vLLM "
            "wake + weight load, 's' vLLM sleep",
        ),
        "",
        "per node",
        "  node   trainer turns  replica turns  handoffs  trainer parks  GPU busy  served"
        "  held_back  empty_turns  wasted  overlaps",
    ]
    for name, n in r["nodes"].items():
        out.append(
            f"  {name:<5}  {n['trainer_turns']:>13}  {n['replica_turns']:>13}  "
            f"{n['handoffs']:>8}  {n['trainer_parks']:>13}  {n['busy_fraction'] * 100:>7.1f}%  "
            f"{n['served']:>6}  {n['held_back'] if n['held_back'] is not None else '-':>9}  "
            f"{n['empty_turns'] if n['empty_turns'] is not None else '-':>11}  "
            f"{n['wasted_turns'] if n['wasted_turns'] is not None else '-':>6}  "
            f"{n['overlaps'] if n['overlaps'] is not None else '-':>8}"
        )
    per = ", ".join(f"{rev} {k}" for rev, k in q["per_revision"].items()) or "-"
    served = ", ".join(f"{k} {v}" for k, v in sorted(p["served"].items())) or "-"
    ppr = "-" if p["parks_per_request"] is None else f"{p['parks_per_request']:.3f}"
    out += [
        "",
        "pool summary",
        f"  requests: {q['sent']} sent through {len(r['nodes'])} fronts, {q['results']} results, "
        f"{q['from_their_revision']} from their revision ({per})",
        f"  served per replica: {served}",
        f"  lost {q['lost']}, failed {st.get('failed', 0)}, duplicates "
        f"{st.get('duplicates', 0)}, reclaimed {st.get('reclaimed', 0)}, returned "
        f"{st.get('returned', 0)} (committed {st.get('committed', 0)})",
        f"  turns granted to the replicas: {p['replica_turns']} for {q['from_their_revision']} "
        f"requests: {ppr} parks per request (each parked that node's trainer)",
        f"  held_back {p['held_back']}, empty_turns {p['empty_turns']} (all dispatchers)",
        f"  waste: {p['wasted_turns']} wasted turns of {p['replica_turns']} (a replica woken, "
        "its node's trainer parked, nothing loaded or served)",
        "  overlaps: " + ", ".join(f"{k} {v}" for k, v in r["overlaps"].items()),
    ]
    if r["png"] is not None:
        out.append(f"chart: {r['png']['path']} ({r['png']['width']}x{r['png']['height']} PNG)")
    if r["ok"]:
        by = sum(1 for n in r["nodes"].values() if n["served"])
        out.append(
            f"OK: every request served once from its revision ({q['from_their_revision']}/"
            f"{q['expected']}), by {by} of {len(r['nodes'])} replicas, 0 overlaps on every node"
        )
    else:
        out += render_failure(r)
    return "\n".join(out)


# ---- entry point (from demo.main) ----------------------------------------------------


async def _main(opts: argparse.Namespace, base: Path, run: Run) -> None:
    async with trio.open_nursery() as outer:
        await outer.start(on_signal)
        await _run(opts, base, run)
        outer.cancel_scope.cancel()


def execute_pool(opts: argparse.Namespace, base: Path, keep: bool) -> int:
    """Run the pool demo in `base` and print its report; the demo's exit status."""
    png = Path(DEFAULT_PNG if opts.png == "demo-out/timeline.png" else opts.png).resolve()
    if not opts.json:
        print(f"demo: pool mode, running in {base} ({opts.revisions} revisions x "
              f"{opts.requests} requests over {NODES} nodes) ...", flush=True)  # fmt: skip
    run = Run()
    try:
        try:
            trio.run(_main, opts, base, run)
        except BaseException as e:
            err = only(e)
            if isinstance(err, AssertionError) and "overlaps" in str(err):
                run.problems.append(str(err))  # running_pool's own check, on the way out
            else:
                raise
        report = build_pool_report(opts, run, base)
        write_pool_png(report, png)
        keep = keep or not report["ok"]
    except BaseException as e:
        keep = True
        err = only(e)
        if isinstance(err, KeyboardInterrupt):
            err = Interrupted(signal.SIGINT)
        if isinstance(err, Interrupted):
            keep = bool(opts.keep)
            print(f"demo: {err}", file=sys.stderr)
            return 128 + err.signum
        if not isinstance(err, DemoError):
            print(f"demo: crashed; the Redis directory is kept in {base}", file=sys.stderr)
            raise
        print(f"demo: FAILED: {err}", file=sys.stderr)
        print(f"demo: the Redis directory is kept in {base}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    if not keep:
        report["dir"] = None
    print(json.dumps(report, indent=2) if opts.json else render_pool(report))
    if not report["ok"]:
        print(f"demo: FAILED; the Redis directory and events are kept in {base}", file=sys.stderr)
    return 0 if report["ok"] else 1
