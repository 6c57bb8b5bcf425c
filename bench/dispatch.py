"""Dispatcher benchmark: added latency, throughput ratio, memory per pending prompt token.

    .venv/bin/python bench/dispatch.py [--requests N] [--clients C] [--json]
        [--pending-tokens 1000000] [--prompt-tokens 2000] [--profile-dispatcher FILE]
        [--sustained 20000] [--route-requests 2000] [--burst 20000] [--batch 500]
        [--batch-clients 4] [--fast-concurrency N] [--batch-prompts 16]

Starts its own slicerd (fake GPU, fresh ledger in a temp dir, READY=1 awaited on a
NOTIFY_SOCKET), the vLLM stub under the real launcher (workload "v") and
``slicer-dispatch``; every child dies with this process (PR_SET_PDEATHSIG) and is
stopped with SIGTERM at the end; the temp dir is removed and no process naming it may
be left (checked).

1. Added latency. N sequential ``POST /v1/completions`` (``max_tokens: 1``) straight to
   the stub while this process holds the replica's GPU turn itself (ACQUIRE "v",
   ``/wake_up``), then N through the dispatcher while it holds a turn. The dispatcher
   ends a turn as soon as nothing is pending, so a *keeper* (a long generation,
   resubmitted before the previous one ends) keeps one request pending in both runs:
   the figure is the per-request cost of the front, the journal and the turn loop, not
   of a GPU handoff. The cold path (one request arriving with no turn held: ACQUIRE,
   wake, serve, sleep, RELEASE) is reported separately. **CPU per request** (target
   <= 1 ms) is the dispatcher process's user+system CPU (all threads) over this
   sequential phase (its warm-up included) divided by its request count; the keeper's
   share (one long generation every 2 s) is in it. The same figure over the
   throughput phase (C clients at once) is printed next to it.
2. Throughput: C closed-loop clients send N requests each way; ratio dispatcher/direct.
3. Memory: a hog workload holds the GPU so no turn can be granted; prompts of token
   ids totalling ``--pending-tokens`` are accepted (``/v1/samples``); the store's own
   figure (``pending_prompt_bytes`` in ``/status``: 4-byte arrays) and the dispatcher
   process's RSS delta (psutil) are divided by the token count. Then the hog releases
   and every pending request must be served.
4. Fast replica (``bench/dispatch_fast.py``): a second stack, the same way, whose stub
   answers at once (``--tokens-per-s inf``, and ``--http-server lean`` where the lean
   server is installed). *Burst*: ``--burst`` requests (max_tokens 1) sent at once
   through ``POST /v1/samples/batch`` in batches of ``--batch``: time to accept and to
   serve all, the dispatcher's RSS before and peak (sampled every 50 ms), and its
   counters (all committed, nothing expired, no send error, no reject, no turn error).
   *Sustained*: ``--batch-clients`` closed-loop clients submit ``--sustained`` requests
   in batches and collect them with ``POST /v1/samples/results``: committed requests/s
   (target >= 2,000). For comparison ``--route-requests`` through ``POST
   /v1/completions`` from C closed-loop clients. ``0`` skips a phase; the dispatcher
   runs with its default ``--concurrency`` unless ``--fast-concurrency`` is given, and
   with ``--batch-prompts`` (default 16: up to 16 samples per request to the stub; 1 is
   one request per sample). Phases 1-3 always run the dispatcher with its defaults.

``--profile-dispatcher FILE`` runs the dispatcher under cProfile (written when it exits
on SIGTERM; the fast stack's dispatcher to ``FILE.fast``): ``python -m pstats FILE``,
then ``sort tottime``, ``stats 30`` (or ``bench/profile_summary.py FILE``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make slicer/stubs importable
    sys.path.insert(0, str(ROOT))

from bench.dispatch_fast import (  # noqa: E402
    burst,
    burst_clean,
    cpu_s,
    replica_pids,
    summary_ms,
    sustained,
)
from gpu_slicer.slicer.client import AsyncSlicer  # noqa: E402
from stubs.proc import die_with_parent, free_port, log_tail  # noqa: E402
from stubs.stack import Stack, running_stack_sync, vllm_stub_argv  # noqa: E402

TARGETS = {
    "added_p50_ms": 2.0,
    "throughput_ratio": 0.8,
    "bytes_per_token": 8.0,
    "cpu_us_per_request": 1000.0,
    "sustained_rps": 2000.0,
}
TOKENS_PER_S = 2000  # the stub's pace: a probe (max_tokens 1) generates for 0.5 ms
BURST_RSS_BOUND_MIB = 300.0  # growth over the burst above which memory is not "bounded"
KEEPER_S = 3.0  # one keeper generates this long; the next is sent KEEPER_S - 1 s later


# ---- the processes -----------------------------------------------------------------


@dataclass
class Env:
    """The running stack (slicerd, the stub under the launcher, the dispatcher)."""

    stack: Stack
    stub_url: str
    disp_url: str
    rcs: dict[str, int | None] = field(default_factory=dict)

    @property
    def base(self) -> Path:
        return self.stack.base

    @property
    def socket(self) -> str:
        return self.stack.socket

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        return self.stack.procs

    def tail(self, name: str) -> str:
        return log_tail(self.stack.log_of(name), 3000)


def orphans(base: Path) -> list[str]:
    """Processes still naming the temp dir on their command line."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(base) in cmd:
            left.append(f"{p.info['pid']}: {cmd[:120]}")
    return left


def lean_server() -> bool:
    """Whether the lean HTTP server (``--http-server lean`` of the stub) is installed."""
    return importlib.util.find_spec("gpu_slicer.dispatcher.httpserver") is not None


def stub_flags(fast: bool) -> list[str]:
    """The stub's pace and front: 2,000 tokens/s, or (fast) at once on the lean server."""
    if not fast:
        return ["--tokens-per-s", str(TOKENS_PER_S)]
    return ["--tokens-per-s", "inf", *(["--http-server", "lean"] if lean_server() else [])]


async def _start_front(
    e: Env, args: argparse.Namespace, stub_port: int, disp_port: int, fast: bool
) -> None:
    """The vLLM stub under the launcher (READY=1), then the dispatcher (listening)."""
    stub = vllm_stub_argv("v", stub_port, *stub_flags(fast), "--max-model-len", "16384")
    await e.stack.launcher("v", stub, park="cooperative", timeout=60, component="launcher")
    prefix = [sys.executable]
    if args.profile_dispatcher:
        out = os.path.abspath(args.profile_dispatcher) + (".fast" if fast else "")
        prefix += ["-m", "cProfile", "-o", out]
    flags = ["--log-level", "warning"]
    if fast and args.fast_concurrency:
        flags += ["--concurrency", str(args.fast_concurrency)]
    if fast:
        flags += ["--batch-prompts", str(args.batch_prompts)]
    await e.stack.dispatcher("v", e.stub_url, disp_port, args=flags, prefix=prefix)


@contextlib.contextmanager
def running(args: argparse.Namespace, fast: bool = False) -> Iterator[Env]:
    """slicerd, the stub under the launcher (``fast``: `stub_flags`), and the dispatcher
    (the stack harness, `stubs.stack`); all stopped with SIGTERM on exit, their codes and
    the count of processes left naming the temp dir in ``rcs``."""
    stub_port, disp_port = free_port(), free_port()
    e: Env | None = None
    try:
        with running_stack_sync(
            tmp_prefix="dispatch-bench-", gpus=1, log_level="info", pdeathsig=True
        ) as stack:
            e = Env(stack, f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{disp_port}")
            trio.run(_start_front, e, args, stub_port, disp_port, fast)
            yield e
    finally:
        if e is not None:
            e.rcs.update(e.stack.rcs)
            e.rcs["orphans"] = len(orphans(e.base))


# ---- the measurements --------------------------------------------------------------


def _probe(i: int) -> dict[str, Any]:
    return {"prompt": f"probe {i}", "max_tokens": 1, "return_weight_versions": True}


async def latency(http: httpx.AsyncClient, n: int, warmup: int) -> list[float]:
    """``n`` sequential completions (after ``warmup`` unmeasured ones), in seconds."""
    out: list[float] = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        r = await http.post("/v1/completions", json=_probe(i))
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"probe {i}: HTTP {r.status_code}: {r.text[:300]}")
        if i >= warmup:
            out.append(dt)
    return out


async def throughput(http: httpx.AsyncClient, n: int, clients: int) -> float:
    """Requests per second of ``clients`` closed-loop clients sending ``n`` in all."""
    left = iter(range(n))

    async def client() -> None:
        for i in left:
            r = await http.post("/v1/completions", json=_probe(i))
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.text[:300]}")

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return n / (time.perf_counter() - t0)


@contextlib.asynccontextmanager
async def keepers(http: httpx.AsyncClient, via_dispatcher: bool) -> AsyncIterator[None]:
    """Keep one long generation pending (a new one before the last ends); on exit,
    stop sending them and wait for the last to finish."""
    body = {"prompt": "keeper", "max_tokens": int(KEEPER_S * TOKENS_PER_S)}
    stop = trio.Event()
    last: list[str] = []

    async def one() -> None:
        if via_dispatcher:
            r = await http.post("/v1/samples", json=body)
            if r.status_code != 202:
                raise RuntimeError(f"keeper: HTTP {r.status_code}: {r.text[:300]}")
            last[:] = [r.json()["id"]]
        else:
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"keeper: HTTP {r.status_code}: {r.text[:300]}")

    async def loop(nursery: trio.Nursery) -> None:
        while not stop.is_set():
            nursery.start_soon(one)
            with trio.move_on_after(KEEPER_S - 1.0):
                await stop.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop, nursery)
        yield
        stop.set()
    for sid in last:  # the dispatcher's last keeper: wait for its result
        await http.get(f"/v1/samples/{sid}", params={"wait": KEEPER_S + 30})


async def until_serving(via: httpx.AsyncClient) -> None:
    """Wait (bounded) until the dispatcher holds a turn and serves."""
    with trio.fail_after(30):
        while (await via.get("/status")).json()["state"] != "serving":
            await trio.sleep(0.01)


async def measure(e: Env, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    n, warm = args.requests, max(10, args.requests // 20)
    disp_pid = e.procs["dispatcher"].pid
    # Idle connections are dropped after 2 s, before the stub's server (hypercorn, like
    # real vLLM's uvicorn) closes them at 5 s: httpx's own 5 s would tie with it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    direct = httpx.AsyncClient(base_url=e.stub_url, timeout=120, limits=limits)
    via = httpx.AsyncClient(base_url=e.disp_url, timeout=120, limits=limits)
    async with direct, via, await AsyncSlicer.connect(e.socket) as sl:
        # 1+2 direct: this process holds the replica's turn and wakes it
        turn = await sl.acquire("v", wait=60)
        (await direct.post("/wake_up")).raise_for_status()
        async with keepers(direct, via_dispatcher=False):
            res["direct_latency_s"] = await latency(direct, n, warm)
            res["direct_rps"] = await throughput(direct, n, args.clients)
        (await direct.post("/sleep", params={"level": 1, "mode": "abort"})).raise_for_status()
        await sl.release(turn)

        # 1+2 through the dispatcher
        await publish_r1(e, via)
        cold = []
        for i in range(5):  # cold: each request is a whole turn (nothing else pending)
            t0 = time.perf_counter()
            (await via.post("/v1/completions", json=_probe(i))).raise_for_status()
            cold.append(time.perf_counter() - t0)
        res["cold_ms"] = summary_ms(cold[1:])  # the first one also loads r1
        async with keepers(via, via_dispatcher=True):
            await until_serving(via)
            c0 = cpu_s(disp_pid)
            res["via_latency_s"] = await latency(via, n, warm)
            c1 = cpu_s(disp_pid)
            res["via_rps"] = await throughput(via, n, args.clients)
            c2 = cpu_s(disp_pid)
            # over the sequential phase (module docstring), warm-up included
            res["dispatcher_cpu_us_per_request"] = round((c1 - c0) / (n + warm) * 1e6, 1)
            res["dispatcher_cpu_us_per_request_concurrent"] = round((c2 - c1) / n * 1e6, 1)

        # 3 memory: a hog holds the GPU; prompts pile up in the dispatcher
        hog_pid = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent
        )
        try:
            async with await AsyncSlicer.connect(e.socket) as hog:
                await hog.register("hog", pid=hog_pid.pid)
                hturn = await hog.acquire("hog", wait=60)
                res["memory"] = await memory(e, via, args)
                await hog.release(hturn, park="now")
                t0 = time.perf_counter()
                with trio.fail_after(120):
                    while (st := (await via.get("/status")).json())["counts"]["pending"]:
                        await trio.sleep(0.1)
                res["memory"]["served_all_s"] = round(time.perf_counter() - t0, 2)
                res["memory"]["counts_after"] = st["counts"]
                res["dispatcher_counters"] = st["counters"]
                await hog.unregister("hog")
        finally:
            hog_pid.kill()
            hog_pid.wait()
    return res


async def memory(e: Env, via: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    proc = psutil.Process(e.procs["dispatcher"].pid)
    st = (await via.get("/status")).json()
    per = args.prompt_tokens
    count = math.ceil(args.pending_tokens / per)
    rng = random.Random(1)
    bodies = [
        {"prompt": [rng.randrange(1, 50000) for _ in range(per)], "max_tokens": 1}
        for _ in range(count)
    ]
    pending0, tokens0 = st["counts"]["pending"], st["pending_prompt_tokens"]
    rss0 = proc.memory_info().rss
    left = iter(bodies)

    async def client() -> None:
        for body in left:
            r = await via.post("/v1/samples", json=body)
            if r.status_code != 202:
                raise RuntimeError(f"sample: HTTP {r.status_code}: {r.text[:300]}")

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(client)
    rss1 = proc.memory_info().rss
    st = (await via.get("/status")).json()
    tokens = st["pending_prompt_tokens"] - tokens0
    return {
        "requests": st["counts"]["pending"] - pending0,
        "tokens": tokens,
        "state_while_held": st["state"],
        "array_bytes": st["pending_prompt_bytes"],
        "array_bytes_per_token": round(st["pending_prompt_bytes"] / max(1, tokens), 3),
        "rss_before_mib": round(rss0 / 2**20, 1),
        "rss_after_mib": round(rss1 / 2**20, 1),
        "rss_delta_bytes_per_token": round((rss1 - rss0) / max(1, tokens), 3),
    }


async def publish_r1(e: Env, via: httpx.AsyncClient) -> None:
    """Publish revision "r1" (a checkpoint dir with its revision.txt)."""
    ckpt = e.base / "ckpt" / "r1"
    ckpt.mkdir(parents=True)
    (ckpt / "revision.txt").write_text("r1")
    r = await via.post("/v1/revisions", json={"revision": "r1", "path": str(ckpt)})
    r.raise_for_status()


async def measure_fast(e: Env, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 4 (module docstring) on the fast stack: burst, sustained, per-request route."""
    res: dict[str, Any] = {"stub_flags": stub_flags(True), "batch_prompts": args.batch_prompts}
    pid = e.procs["dispatcher"].pid
    replica = replica_pids(e.procs["launcher"].pid)
    # Idle connections are dropped after 2 s, before the stub's server (hypercorn, like
    # real vLLM's uvicorn) closes them at 5 s: httpx's own 5 s would tie with it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)

    def client() -> httpx.AsyncClient:
        # One per phase: a POST on a pooled connection that the server's idle timeout
        # closes at that instant fails (HTTP/1.1's keep-alive race, not retried).
        return httpx.AsyncClient(base_url=e.disp_url, timeout=600, limits=limits)

    async with client() as via:
        await publish_r1(e, via)
        # r1 is loaded once and the replica warmed; each phase then starts with no turn
        (await via.post("/v1/completions", json=_probe(0))).raise_for_status()
    if args.burst:
        async with client() as via:
            res["burst"] = await burst(
                via, pid, replica, n=args.burst, batch=args.batch, revision="r1"
            )
    if args.sustained:
        async with client() as via:
            res["sustained"] = await sustained(
                via, pid, replica, n=args.sustained, batch=args.batch, clients=args.batch_clients,
                revision="r1",
            )  # fmt: skip
    if args.route_requests:
        async with client() as via:
            c0 = cpu_s(pid)
            rps = await throughput(via, args.route_requests, args.clients)
            res["route"] = {
                "requests": args.route_requests,
                "clients": args.clients,
                "rps": round(rps, 1),
                "cpu_us_per_request": round((cpu_s(pid) - c0) / args.route_requests * 1e6, 1),
            }
    async with client() as via:
        res["counters"] = (await via.get("/status")).json()["counters"]
    return res


# ---- the report --------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    d, v = raw.pop("direct_latency_s"), raw.pop("via_latency_s")
    ds, vs = summary_ms(d), summary_ms(v)
    added = {k: round(vs[k] - ds[k], 3) for k in ("p50", "p90", "p99")}
    ratio = raw["via_rps"] / raw["direct_rps"]
    mem = raw["memory"]
    bpt = max(mem["array_bytes_per_token"], mem["rss_delta_bytes_per_token"])
    cpu = raw["dispatcher_cpu_us_per_request"]
    fast = raw.get("fast", {})
    verdicts = {
        "added_p50": verdict(added["p50"] <= TARGETS["added_p50_ms"]),
        "throughput_ratio": verdict(ratio >= TARGETS["throughput_ratio"]),
        "bytes_per_token": verdict(bpt <= TARGETS["bytes_per_token"]),
        "cpu_per_request": verdict(cpu <= TARGETS["cpu_us_per_request"]),
    }
    if "sustained" in fast:
        rps = fast["sustained"]["committed_rps"]
        verdicts["sustained_rps"] = verdict(rps >= TARGETS["sustained_rps"])
        if "route" in fast:
            fast["sustained"]["ratio_to_route"] = round(rps / fast["route"]["rps"], 2)
    if "burst" in fast:
        b = fast["burst"]
        verdicts["burst_committed"] = verdict(burst_clean(b))
        verdicts["burst_rss"] = verdict(b["rss_growth_mib"] <= BURST_RSS_BOUND_MIB)
    return {
        **raw,
        "direct_ms": ds,
        "via_ms": vs,
        "added_ms": added,
        "throughput_ratio": round(ratio, 3),
        "direct_rps": round(raw["direct_rps"], 1),
        "via_rps": round(raw["via_rps"], 1),
        "verdicts": verdicts,
    }


def cpu_row(phase: dict[str, Any]) -> str:
    c = phase["cpu_share_us_per_request"]
    return f"{c['dispatcher_cpu_us']} / {c['replica_cpu_us']} / {c['client_cpu_us']} us"


def fast_rows(f: dict[str, Any], vd: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """The report's rows of phase 4 (the fast replica)."""
    if not f:
        return []
    head = " ".join(f["stub_flags"]) + f"; dispatcher --batch-prompts {f.get('batch_prompts', 1)}"
    rows = [("fast replica: stub " + head, "", "", "")]
    if "burst" in f:
        b, c = f["burst"], f["burst"]["counters"]
        rows += [
            (f"burst of {b['requests']} ({b['calls']} batch calls at once)", "", "", ""),
            ("  accepted all in", f"{b['accept_all_s']} s ({b['accept_rps']} req/s)", "", ""),
            ("  served all in", f"{b['serve_all_s']} s ({b['served_rps']} req/s)", "", ""),
            ("  dispatcher RSS before / peak",
             f"{b['rss_before_mib']} / {b['rss_peak_mib']} MiB", "", ""),
            ("  RSS growth", f"{b['rss_growth_mib']} MiB", f"<= {BURST_RSS_BOUND_MIB:g} MiB",
             vd["burst_rss"]),
            ("  committed / expired / send errors",
             f"{c['commits']} / {c['expired']} / {c['send_errors']}", "", ""),
            ("  turn errors / rejects", f"{c['turn_errors']} / {c['rejects'] or 0}", "", ""),
            ("  all committed, none timed out", f"pending {c['pending_after']} failed "
             f"{c['failed_after']}", "all, 0", vd["burst_committed"]),
            ("  CPU per request: dispatcher / replica / client", cpu_row(b), "", ""),
        ]  # fmt: skip
    if "sustained" in f:
        s, br = f["sustained"], f["sustained"]["batch_round_ms"]
        rows += [
            (f"sustained: {s['requests']} in batches of {s['batch']}, {s['clients']} clients",
             "", "", ""),
            ("  committed rate", f"{s['committed_rps']} req/s", ">= 2000", vd["sustained_rps"]),
            ("  batch round trip p50 / p99", f"{br['p50']} / {br['p99']} ms", "", ""),
            ("  CPU per request: dispatcher / replica / client", cpu_row(s), "", ""),
        ]  # fmt: skip
    if "route" in f:
        r = f["route"]
        rows += [
            (f"per-request route: {r['requests']}, {r['clients']} clients",
             f"{r['rps']} req/s", "", ""),
            ("  dispatcher CPU per request", f"{r['cpu_us_per_request']} us", "", ""),
        ]  # fmt: skip
        if "sustained" in f:
            rows.append(("  ratio batch / per-request route",
                         f"{f['sustained']['ratio_to_route']}", "", ""))  # fmt: skip
    return rows


def print_report(res: dict[str, Any]) -> None:
    d, v, a, m = res["direct_ms"], res["via_ms"], res["added_ms"], res["memory"]
    vd = res["verdicts"]
    rows = [
        ("latency direct p50 / p99", f"{d['p50']} / {d['p99']} ms", "", ""),
        ("latency via dispatcher p50 / p99", f"{v['p50']} / {v['p99']} ms", "", ""),
        ("added latency p50", f"{a['p50']} ms", "<= 2 ms", vd["added_p50"]),
        ("added latency p90 / p99", f"{a['p90']} / {a['p99']} ms", "", ""),
        ("dispatcher CPU per request (sequential)",
         f"{res['dispatcher_cpu_us_per_request']} us", "<= 1000 us", vd["cpu_per_request"]),
        ("  same, over the throughput phase",
         f"{res['dispatcher_cpu_us_per_request_concurrent']} us", "", ""),
        ("cold request (whole turn) p50", f"{res['cold_ms']['p50']} ms", "", ""),
        ("throughput direct", f"{res['direct_rps']} req/s", "", ""),
        ("throughput via dispatcher", f"{res['via_rps']} req/s", "", ""),
        ("throughput ratio", f"{res['throughput_ratio']}", ">= 0.8", vd["throughput_ratio"]),
        ("pending held", f"{m['tokens']} tokens in {m['requests']} requests", "", ""),
        ("  array storage per token", f"{m['array_bytes_per_token']} B", "<= 8 B", ""),
        ("  dispatcher RSS delta per token", f"{m['rss_delta_bytes_per_token']} B", "<= 8 B",
         vd["bytes_per_token"]),
        ("  RSS before / after", f"{m['rss_before_mib']} / {m['rss_after_mib']} MiB", "", ""),
        ("  then served all in", f"{m['served_all_s']} s", "", ""),
        *fast_rows(res.get("fast", {}), vd),
    ]  # fmt: skip
    # a section's heading (no figure) does not widen the label column
    w = [max(len(r[i]) for r in rows if r[1]) for i in range(4)]
    print(
        f"dispatcher bench ({res['requests']} requests, {res['clients']} clients, "
        f"python {res['python']}, {res['cpus']} CPUs)"
    )
    for r in rows:
        print(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")
    print(
        f"  exit codes {res['exit_codes']}  checks ok: {res['checks_ok']}  "
        f"total: {res['total_s']} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="measured requests per run")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (throughput)")
    ap.add_argument("--pending-tokens", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="token ids per prompt")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--json-file", metavar="FILE", help="also write the JSON object here")
    ap.add_argument("--profile-dispatcher", metavar="FILE", help="run it under cProfile")
    ap.add_argument(
        "--sustained",
        type=int,
        default=20_000,
        help="fast replica: requests in batches from closed-loop clients (0: skip)",
    )
    ap.add_argument(
        "--route-requests",
        type=int,
        default=2000,
        help="fast replica: requests through POST /v1/completions from --clients clients (0: skip)",
    )
    ap.add_argument(
        "--burst", type=int, default=20_000, help="fast replica: requests at once (0: skip)"
    )
    ap.add_argument("--batch", type=int, default=500, help="requests per batch call")
    ap.add_argument("--batch-clients", type=int, default=4, help="sustained: clients")
    ap.add_argument("--fast-concurrency", type=int, help="fast stack: dispatcher --concurrency")
    ap.add_argument(
        "--batch-prompts",
        type=int,
        default=16,
        help="fast stack: dispatcher --batch-prompts (1: one request per sample)",
    )
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C: the children are stopped and the temp dir removed.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "requests": args.requests,
        "clients": args.clients,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    with running(args) as e:
        try:
            raw = trio.run(measure, e, args)
        except BaseException:
            for name in ("dispatcher", "launcher"):
                print(f"---- {name} log (tail) ----\n{e.tail(name)}", file=sys.stderr)
            raise
    if args.sustained or args.burst or args.route_requests:
        with running(args, fast=True) as f:
            try:
                raw["fast"] = trio.run(measure_fast, f, args)
            except BaseException:
                for name in ("dispatcher", "launcher"):
                    print(f"---- fast {name} log (tail) ----\n{f.tail(name)}", file=sys.stderr)
                raise
        raw["fast"]["exit_codes"] = f.rcs
    res.update(analyse(raw))
    res["exit_codes"] = e.rcs
    res["total_s"] = round(time.perf_counter() - t0, 1)
    counts = res["memory"]["counts_after"]
    res["checks_ok"] = (
        all(e.rcs.get(k) == 0 for k in ("dispatcher", "launcher", "slicerd", "orphans"))
        and counts["pending"] == 0
        and counts["failed"] == 0
        and res["memory"]["state_while_held"] == "acquiring"
        and not e.base.exists()
    )
    if "fast" in res:
        rcs = res["fast"]["exit_codes"]
        ok = all(rcs.get(k) == 0 for k in ("dispatcher", "launcher", "slicerd", "orphans"))
        clean = "burst" not in res["fast"] or burst_clean(res["fast"]["burst"])
        res["checks_ok"] = res["checks_ok"] and ok and clean and not f.base.exists()
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
