"""Pool benchmark: pool mode (Redis) against single-node SQLite mode, the pool's rate with
three replicas, Redis memory per pending prompt token, parks per request.

    .venv/bin/python bench/pool.py [--quick] [--json] [--json-file FILE]
        [--requests N] [--burst M] [--sustained S] [--batch B] [--clients C]
        [--pending-requests K] [--prompt-tokens T] [--trickle-s SECONDS] [--trickle-gap S]

Every Redis is a real ``redis-server`` (`stubs.redisserver.RedisServer`: a private Unix
socket, AOF on, ``appendfsync always``: nothing acknowledged is lost), every node a
`stubs.poolnodes` node (its own fake GPU, slicerd, the vLLM stub under the launcher, the
dispatcher; every process stopped at the end, every directory removed). No figure is
asserted: the report prints medians, p99s and ratios (and PASS / MISS against the
bytes-per-token target only).

a. **Pool vs SQLite, one node.** The same work twice: one node, one replica (the stub at
   2,000 tokens/s, so a ``max_tokens: 1`` request generates for 0.5 ms; on the lean HTTP
   server where installed), no trainer, the dispatcher with ``--batch-prompts 16``;
   first a single-node dispatcher (its queue in SQLite), then one in pool mode (its queue
   in Redis). *Latency*: ``--requests`` sequential ``POST /v1/completions`` while a
   keeper (a long generation, resubmitted before the last one ends: `bench.dispatch`)
   keeps the turn held, so the figure is the per-request cost of the front, the queue
   and the turn loop, not of a GPU handoff; median and p99 of both, the added latency
   and the ratio. *Burst*: ``--burst`` requests at once (``POST /v1/samples/batch`` of
   ``--batch``), collected with ``POST /v1/samples/results``: requests per second from
   the first submit to the last result, both modes and the ratio.
b. **Pool rate, three replicas.** Three nodes, stubs answering at once (``--tokens-per-s
   inf``), no trainers, ``--batch-prompts 16``: ``--clients`` closed-loop clients, each
   through its own front, submit ``--sustained`` requests in batches of ``--batch`` and
   collect each batch's results through the next front; committed requests per second,
   batch round trips, requests served per replica.
c. **Memory per pending prompt token.** A Redis with no replica at all: ``--pending-
   requests`` prompts of ``--prompt-tokens`` random token ids each are enqueued with
   `PoolStore.enqueue` (what a front does once it validated a request); Redis'
   ``used_memory`` before and after (``INFO memory``), divided by the token count
   (target <= 6 bytes: 4 for the packed int32, the rest the stream entry's share, one
   entry a stream node: see bench/pool_sparse.py for the same with holes).
d. **Parks per request.** Three nodes with trainers (steps of 0.1, 0.25 and 0.6 s) and
   a trickle of requests, one every ``--trickle-gap`` s for ``--trickle-s`` s through
   the fronts in turn: turns granted to the replicas (slicerd's ``grants`` of workload
   ``v``; each parks that node's trainer) over requests served, trainer parks, and the
   dispatchers' ``held_back`` (the backlog was covered by another replica: no turn asked)
   and ``empty_turns`` (a turn that found nothing left to claim). One pending request
   should wake one replica, not every node's: the ratio is near 1 or below.

``--quick`` runs every phase at small sizes (the smoke test's run, about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make bench/stubs importable
    sys.path.insert(0, str(ROOT))

from bench.dispatch import keepers, latency, stub_flags, until_serving  # noqa: E402
from bench.dispatch_fast import summary_ms  # noqa: E402
from gpu_slicer.dispatcher.poolconn import PoolConn  # noqa: E402
from gpu_slicer.dispatcher.poolstore import PoolStore  # noqa: E402
from stubs.poolnodes import (  # noqa: E402
    REPLICA,
    TRAINER,
    Pool,
    dispatcher_status,
    publish,
    results,
    running_pool,
    submit_many,
)
from stubs.proc import free_port  # noqa: E402
from stubs.redisserver import RedisServer  # noqa: E402
from stubs.stack import running_stack, vllm_stub_argv, workload  # noqa: E402

# One entry a stream node (what the manifests and stubs.redisserver run): ~5.4 dense,
# and the same with holes (bench/pool_sparse.py); 4.5 was the dense-only target.
BYTES_PER_TOKEN_TARGET = 6.0
POOL = "bench"
# bench.dispatch's pace (its keepers need it), on the lean HTTP server where installed
SLOW_STUB = [*stub_flags(True)[2:], "--tokens-per-s", "2000", "--max-model-len", "16384"]
DISPATCH = ["--log-level", "warning", "--batch-prompts", "16"]
TRAINER_WORK = (0.1, 0.25, 0.6)
TRICKLE_DISPATCH = ["--turn-seconds", "0.5", "--turn-grace", "2", "--concurrency", "32"]
HTTP_TIMEOUT_S = 600.0
QUICK = {
    "requests": 200,
    "burst": 1000,
    "sustained": 2000,
    "pending_requests": 100,
    "trickle_s": 8.0,
}


def _client(front: str) -> httpx.AsyncClient:
    # Idle connections are dropped after 2 s, before the stub's server closes them at 5 s.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
    return httpx.AsyncClient(base_url=front, timeout=HTTP_TIMEOUT_S, limits=limits)


# ---- a: one node, SQLite vs pool -----------------------------------------------------


async def same_work(front: str, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The work of phase a on the dispatcher at `front` (either mode)."""
    await publish(front, "r1", base)
    async with _client(front) as http:
        # r1 loaded once and the replica warmed: nothing of that in the figures
        warm = await http.post("/v1/completions", json={"prompt": "warm", "max_tokens": 1})
        warm.raise_for_status()
        async with keepers(http, via_dispatcher=True):
            await until_serving(http)
            lat = await latency(http, args.requests, max(10, args.requests // 20))
    t0 = time.perf_counter()
    sent = await submit_many([front], args.burst, max_tokens=1, prefix="b")
    accepted = time.perf_counter() - t0
    got = await results(front, [s.id for s in sent])
    elapsed = time.perf_counter() - t0
    done = sum(1 for b in got.values() if b["status"] == "done")
    return {
        "latency_ms": summary_ms(lat),
        "burst": {
            "requests": args.burst,
            "done": done,
            "accept_s": round(accepted, 3),
            "all_s": round(elapsed, 3),
            "rps": round(args.burst / elapsed, 1),
        },
    }


async def sqlite_mode(args: argparse.Namespace) -> dict[str, Any]:
    """Phase a, single-node mode: slicerd, the stub under the launcher, the dispatcher."""
    async with running_stack(gpus=1, tmp_prefix="pool-bench-") as stack:
        port, dport = free_port(), free_port()
        await stack.launcher(REPLICA, vllm_stub_argv(REPLICA, port, *SLOW_STUB),
                             park="cooperative", component="launcher")  # fmt: skip
        await stack.dispatcher(REPLICA, f"http://127.0.0.1:{port}", dport, args=DISPATCH)
        return await same_work(f"http://127.0.0.1:{dport}", stack.base, args)


@asynccontextmanager
async def redis_pool(n: int, **kw: Any) -> AsyncIterator[Pool]:
    """A fresh Redis (in a temporary directory) and `n` nodes of pool `POOL` on it."""
    with (
        tempfile.TemporaryDirectory(prefix="pool-bench-redis-") as tmp,
        RedisServer(Path(tmp)) as redis,
    ):
        async with running_pool(n, redis, pool=POOL, **kw) as pool:
            yield pool


async def pool_mode(args: argparse.Namespace) -> dict[str, Any]:
    """Phase a, pool mode: the same node with its dispatcher in pool `POOL`."""
    async with redis_pool(1, trainers=False, stub_args=SLOW_STUB, dispatch_args=DISPATCH) as pool:
        res = await same_work(pool.fronts[0], pool.base, args)
        res["stats"] = pool.stats()
        return res


# ---- b: three replicas -----------------------------------------------------------------


async def pool_rate(args: argparse.Namespace) -> dict[str, Any]:
    """Phase b (module docstring)."""
    flags = [*stub_flags(True), "--max-model-len", "16384"]
    async with redis_pool(3, trainers=False, stub_args=flags, dispatch_args=DISPATCH) as pool:
        fronts = pool.fronts
        await publish(fronts[0], "r1", pool.base)
        for front in fronts:  # each replica loads r1 before the clock starts
            await results(front, [s.id for s in await submit_many([front], 1, max_tokens=1)])
        left = [args.sustained]
        rounds: list[float] = []

        async def client(k: int) -> None:
            while left[0] > 0:
                n = min(args.batch, left[0])
                left[0] -= n
                t0 = time.perf_counter()
                sent = await submit_many([fronts[k % 3]], n, max_tokens=1, prefix=f"c{k}-")
                await results(fronts[(k + 1) % 3], [s.id for s in sent])
                rounds.append(time.perf_counter() - t0)

        served0 = pool.served()
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(args.clients):
                nursery.start_soon(client, k)
        elapsed = time.perf_counter() - t0
        served = {k: v - served0.get(k, 0) for k, v in pool.served().items()}
        return {
            "requests": args.sustained,
            "batch": args.batch,
            "clients": args.clients,
            "stub_flags": flags,
            "elapsed_s": round(elapsed, 2),
            "committed_rps": round(args.sustained / elapsed, 1),
            "batch_round_ms": summary_ms(rounds),
            "served": served,
            "stats": pool.stats(),
        }


# ---- c: memory -------------------------------------------------------------------------


def _used(redis: RedisServer) -> int:
    return int(redis.info_memory()["used_memory"])


async def memory(args: argparse.Namespace) -> dict[str, Any]:
    """Phase c (module docstring)."""
    rng = random.Random(1)
    per, count, chunk = args.prompt_tokens, args.pending_requests, 50
    with (
        tempfile.TemporaryDirectory(prefix="pool-bench-redis-") as tmp,
        RedisServer(Path(tmp)) as redis,
    ):
        async with PoolConn(redis.url, POOL) as conn:
            store = PoolStore(conn, "bench", consumer="bench")
            ckpt = Path(tmp) / "r1"
            ckpt.mkdir()
            await store.publish("r1", str(ckpt))
            one = store.prepare("completion", {"prompt": [1], "max_tokens": 1}, None, 600)
            await store.enqueue([one])  # the stream and its group exist before we measure
            before = _used(redis)
            for at in range(0, count, chunk):
                staged = [
                    store.prepare("completion", {"max_tokens": 1, "prompt": [
                        rng.randrange(1, 50_000) for _ in range(per)]}, None, 600)
                    for _ in range(min(chunk, count - at))
                ]  # fmt: skip
                await store.enqueue(staged)
            after = _used(redis)
            summary = await store.poll()
    tokens = per * count
    bpt = (after - before) / tokens
    return {
        "requests": count,
        "prompt_tokens": per,
        "tokens": tokens,
        "used_memory_before": before,
        "used_memory_after": after,
        "bytes_per_token": round(bpt, 3),
        "pending_seen": sum(r["unclaimed"] for r in summary.revisions.values()),
        "verdict": "PASS" if bpt <= BYTES_PER_TOKEN_TARGET else "MISS",
    }


# ---- d: parks per request -----------------------------------------------------------


async def _node_counts(pool: Pool) -> dict[str, dict[str, int]]:
    out = {}
    for n in pool.nodes:
        st = await n.stack.status()
        pm = (await dispatcher_status(n.front))["pool_mode"]
        v, t = workload(st, REPLICA) or {}, workload(st, TRAINER) or {}
        out[n.name] = {
            "replica_grants": int(v.get("grants", 0)),
            "trainer_parks": int(t.get("parks", 0)),
            "held_back": int(pm["held_back"]),
            "empty_turns": int(pm["empty_turns"]),
        }
    return out


async def parks_per_request(args: argparse.Namespace) -> dict[str, Any]:
    """Phase d (module docstring)."""
    async with redis_pool(3, trainer_work=TRAINER_WORK, trainer_bytes="10GiB",
                          dispatch_args=TRICKLE_DISPATCH) as pool:  # fmt: skip
        fronts = pool.fronts
        await publish(fronts[0], "r1", pool.base)
        for front in fronts:  # each replica loads r1 before the count starts
            await results(front, [s.id for s in await submit_many([front], 1, max_tokens=1)])
        before = await _node_counts(pool)
        ids: list[str] = []
        n = max(1, round(args.trickle_s / args.trickle_gap))
        start = trio.current_time()
        for i in range(n):
            await trio.sleep_until(start + i * args.trickle_gap)  # the trickle's pace
            sent = await submit_many([fronts[i % 3]], 1, max_tokens=4, prefix="t", start=i)
            ids += [s.id for s in sent]
        got: dict[str, dict[str, Any]] = {}
        for k, front in enumerate(fronts):
            got.update(await results(front, ids[k::3]))
        after = await _node_counts(pool)
        nodes = {k: {f: after[k][f] - before[k][f] for f in after[k]} for k in after}
        done = sum(1 for b in got.values() if b["status"] == "done")
        turns = sum(v["replica_grants"] for v in nodes.values())
        return {
            "requests": n,
            "gap_s": args.trickle_gap,
            "done": done,
            "replica_turns": turns,
            "parks_per_request": round(turns / done, 3) if done else None,
            "trainer_parks": sum(v["trainer_parks"] for v in nodes.values()),
            "held_back": sum(v["held_back"] for v in nodes.values()),
            "empty_turns": sum(v["empty_turns"] for v in nodes.values()),
            "nodes": nodes,
            "served": pool.served(),
        }


# ---- the report ------------------------------------------------------------------------


def analyse(res: dict[str, Any]) -> dict[str, Any]:
    """Added latency and the ratios of phase a."""
    s, p = res["sqlite"], res["pool"]
    sl, pl = s["latency_ms"], p["latency_ms"]
    res["compare"] = {
        "added_ms": {k: round(pl[k] - sl[k], 3) for k in ("p50", "p99")},
        "latency_ratio": {k: round(pl[k] / sl[k], 2) for k in ("p50", "p99")},
        "burst_rps_ratio": round(p["burst"]["rps"] / s["burst"]["rps"], 3),
    }
    return res


def print_report(res: dict[str, Any]) -> None:
    """The human report."""
    s, p, c = res["sqlite"], res["pool"], res["compare"]
    b, m, d = res["rate"], res["memory"], res["trickle"]
    sl, pl = s["latency_ms"], p["latency_ms"]
    served = ", ".join(f"{k} {v}" for k, v in sorted(b["served"].items()))
    rows = [
        (f"a. one node, one replica (stub {' '.join(SLOW_STUB)}), no trainer", "", ""),
        (f"  latency, {sl['n']} sequential, SQLite p50 / p99", f"{sl['p50']} / {sl['p99']} ms",
         ""),
        ("  latency, pool (Redis) p50 / p99", f"{pl['p50']} / {pl['p99']} ms", ""),
        ("  added by the pool p50 / p99", f"{c['added_ms']['p50']} / {c['added_ms']['p99']} ms",
         ""),
        ("  ratio pool / SQLite p50 / p99",
         f"{c['latency_ratio']['p50']} / {c['latency_ratio']['p99']}", ""),
        (f"  burst of {s['burst']['requests']}, SQLite", f"{s['burst']['rps']} req/s",
         f"all in {s['burst']['all_s']} s"),
        (f"  burst of {p['burst']['requests']}, pool", f"{p['burst']['rps']} req/s",
         f"all in {p['burst']['all_s']} s"),
        ("  ratio pool / SQLite", f"{c['burst_rps_ratio']}", ""),
        (f"b. pool, 3 replicas (stub {' '.join(b['stub_flags'][:-2])}), no trainers", "", ""),
        (f"  {b['requests']} in batches of {b['batch']}, {b['clients']} clients",
         f"{b['committed_rps']} req/s", f"in {b['elapsed_s']} s"),
        ("  batch round trip p50 / p99",
         f"{b['batch_round_ms']['p50']} / {b['batch_round_ms']['p99']} ms", ""),
        ("  served per replica", served, ""),
        (f"c. Redis memory, {m['requests']} pending prompts x {m['prompt_tokens']} tokens", "",
         ""),
        ("  used_memory before / after", f"{m['used_memory_before']} / {m['used_memory_after']} B",
         ""),
        ("  per pending prompt token", f"{m['bytes_per_token']} B",
         f"<= {BYTES_PER_TOKEN_TARGET:g} B {m['verdict']}"),
        (f"d. 3 nodes with trainers, 1 request every {d['gap_s']:g} s ({d['requests']})", "", ""),
        ("  turns granted to the replicas / served",
         f"{d['replica_turns']} / {d['done']}", f"{d['parks_per_request']} per request"),
        ("  trainer parks", f"{d['trainer_parks']}", ""),
        ("  held_back / empty_turns", f"{d['held_back']} / {d['empty_turns']}", ""),
    ]  # fmt: skip
    w = [max(len(r[i]) for r in rows if r[1]) for i in range(2)]
    print(f"pool bench (python {res['python']}, {res['cpus']} CPUs"
          + (", --quick" if res["quick"] else "") + ")")  # fmt: skip
    for label, fig, note in rows:
        print(f"  {label:<{w[0]}}  {fig:>{w[1]}}  {note}".rstrip() if fig else f"  {label}")
    print(f"  checks ok: {res['checks_ok']}  total: {res['total_s']} s")


def checks(res: dict[str, Any]) -> bool:
    """Everything was served (no figure is judged here)."""
    a_ok = all(res[k]["burst"]["done"] == res[k]["burst"]["requests"] for k in ("sqlite", "pool"))
    st = res["rate"]["stats"]
    b_ok = (
        st["failed"] == st["duplicates"] == 0
        and sum(res["rate"]["served"].values()) == (res["rate"]["requests"])
    )
    d = res["trickle"]
    return bool(a_ok and b_ok and d["done"] == d["requests"]
                and res["memory"]["pending_seen"] == res["memory"]["requests"] + 1)  # fmt: skip


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase, one after the other (each its own processes)."""
    res: dict[str, Any] = {}
    for name, phase in (("memory", memory), ("sqlite", sqlite_mode), ("pool", pool_mode),
                        ("rate", pool_rate), ("trickle", parks_per_request)):  # fmt: skip
        t0 = time.perf_counter()
        res[name] = await phase(args)
        res[name]["phase_s"] = round(time.perf_counter() - t0, 1)
        print(f"  {name} done in {res[name]['phase_s']} s", file=sys.stderr, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (the smoke test)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--json-file", metavar="FILE", help="also write the JSON object here")
    ap.add_argument("--requests", type=int, default=1000, help="a: sequential requests")
    ap.add_argument("--burst", type=int, default=5000, help="a: requests at once")
    ap.add_argument("--sustained", type=int, default=10_000, help="b: requests in all")
    ap.add_argument("--batch", type=int, default=500, help="requests per batch call")
    ap.add_argument("--clients", type=int, default=3, help="b: closed-loop clients")
    ap.add_argument("--pending-requests", type=int, default=500, help="c: prompts")
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="c: token ids a prompt")
    ap.add_argument("--trickle-s", type=float, default=30.0, help="d: seconds of trickle")
    ap.add_argument("--trickle-gap", type=float, default=0.2, help="d: seconds between requests")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    # SIGTERM unwinds like Ctrl-C: the children are stopped and the temp dirs removed.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    t0 = time.perf_counter()
    res = analyse(trio.run(run_all, args))
    res.update(python=sys.version.split()[0], cpus=os.cpu_count(), quick=args.quick)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    res["checks_ok"] = checks(res)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(res, sort_keys=True))
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print_report(res)
    return 0 if res["checks_ok"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
