"""The dispatcher bench's fast-replica phases: a sustained rate and a burst (issue 14).

``bench/dispatch.py`` runs them on a stack of their own whose replica is the vLLM stub in
fast mode (``--tokens-per-s inf``: every token at once; ``--http-server lean`` where the
lean server is installed), so the figure is the dispatcher's, not the replica's.

sustained
    ``clients`` closed-loop clients: each submits ``batch`` short requests
    (``max_tokens: 1``) in one ``POST /v1/samples/batch``, collects their results with
    ``POST /v1/samples/results`` and only then submits its next batch, ``n`` requests in
    all. Reported: committed requests/s (first submit to last result), the batch round
    trip p50/p99, the dispatcher's CPU per request over the phase.
burst
    ``n`` requests at once (one step's fan-out): every batch is encoded beforehand and all
    of them are sent together, as fast as this process can; each batch's results are
    collected as soon as it was accepted. Reported: the time to accept all (last 202),
    the time to serve all (last result finished), the dispatcher's RSS before and its
    peak (psutil, every ``RSS_EVERY_S``), its CPU per request, and the ``/status``
    counters the phase moved: every request committed, ``expired``, ``send_errors``,
    ``turn_errors`` 0 and no ``rejects`` (no send or weight check ran out of time because
    the loop was busy), nothing left pending or failed.

Both phases also report the CPU per request of the dispatcher, of the replica (the
launcher's descendants: the stub and its engine core) and of this client process: on a
small machine the three share the cores, so their sum bounds the rate.

Every result must be ``done`` for the revision it was submitted for; anything else
raises (the bench then fails with the dispatcher's log).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import psutil
import trio

from stubs.measure import percentile

__all__ = [
    "BATCH_PATH",
    "RESULTS_PATH",
    "RssPeak",
    "burst",
    "collect",
    "counters_moved",
    "cpu_s",
    "encode_batch",
    "submit_batch",
    "summary_ms",
    "sustained",
]

BATCH_PATH = "/v1/samples/batch"
RESULTS_PATH = "/v1/samples/results"
RESULTS_WAIT_S = 30.0  # one long-poll of /v1/samples/results; pending ones are asked again
RSS_EVERY_S = 0.05
COUNTERS = ("commits", "expired", "send_errors", "turn_errors", "sends", "batched_samples",
            "turns", "loads")  # fmt: skip


def summary_ms(samples: list[float]) -> dict[str, float]:
    """n, p50, p90, p99 and max of ``samples`` (seconds) in ms."""
    s = sorted(samples)
    return {
        "n": len(s),
        "p50": round(percentile(s, 50) * 1e3, 3),
        "p90": round(percentile(s, 90) * 1e3, 3),
        "p99": round(percentile(s, 99) * 1e3, 3),
        "max": round(s[-1] * 1e3, 3),
    }


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (all its threads)."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def replica_pids(launcher_pid: int) -> list[int]:
    """The launcher's descendants: the stub's API server and its engine core."""
    return [p.pid for p in psutil.Process(launcher_pid).children(recursive=True)]


class CpuShare:
    """CPU seconds spent during a phase by the dispatcher, the replica and this bench
    process (the three share the machine's cores)."""

    def __init__(self, dispatcher: int, replica: list[int]) -> None:
        self.pids = {"dispatcher": [dispatcher], "replica": replica, "client": [os.getpid()]}
        self.t0 = self._now()

    def _now(self) -> dict[str, float]:
        return {k: sum(cpu_s(p) for p in pids) for k, pids in self.pids.items()}

    def per_request_us(self, n: int) -> dict[str, float]:
        """Each one's CPU since construction, per request, in us."""
        now = self._now()
        return {f"{k}_cpu_us": round((now[k] - self.t0[k]) / n * 1e6, 1) for k in now}


def short(i: int, tag: str) -> dict[str, Any]:
    """A short sample body (one token)."""
    return {"prompt": f"{tag} {i}", "max_tokens": 1, "return_weight_versions": True}


def encode_batch(bodies: list[dict[str, Any]]) -> bytes:
    """The body of one ``POST /v1/samples/batch``."""
    return json.dumps({"requests": bodies}, separators=(",", ":")).encode()


async def submit_batch(http: httpx.AsyncClient, payload: bytes, count: int) -> list[str]:
    """Submit one encoded batch of ``count`` requests; their ids, in order."""
    r = await http.post(BATCH_PATH, content=payload, headers={"content-type": "application/json"})
    if r.status_code == 404 and "samples" not in r.text:
        raise RuntimeError(f"the dispatcher has no POST {BATCH_PATH}: {r.text[:200]}")
    if r.status_code != 202:
        raise RuntimeError(f"batch: HTTP {r.status_code}: {r.text[:300]}")
    samples = r.json()["samples"]
    if len(samples) != count or any(s["status"] != "pending" for s in samples):
        raise RuntimeError(f"batch: {count} sent, answer {json.dumps(samples)[:300]}")
    return [s["id"] for s in samples]


async def collect(
    http: httpx.AsyncClient, ids: list[str], revision: str, timeout: float
) -> list[dict[str, Any]]:
    """Every result of ``ids`` once finished (``/v1/samples/results``, the still pending
    ones asked again), in order; raises unless each is ``done`` for ``revision``."""
    out: dict[str, dict[str, Any]] = {}
    left = ids
    with trio.fail_after(timeout):
        while left:
            r = await http.post(RESULTS_PATH, json={"ids": left, "wait": RESULTS_WAIT_S})
            if r.status_code != 200:
                raise RuntimeError(f"results: HTTP {r.status_code}: {r.text[:300]}")
            results = r.json()["results"]
            if [x["id"] for x in results] != left:
                raise RuntimeError("results: not the ids asked for, in their order")
            for x in results:
                if x["status"] != "pending":
                    out[x["id"]] = x
            left = [i for i in left if i not in out]
    bad = [x for x in out.values() if x["status"] != "done" or x["revision"] != revision]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(ids)} not done for {revision}: {bad[0]}")
    return [out[i] for i in ids]


class RssPeak:
    """The RSS of process ``pid`` before, and its peak while :meth:`run` samples it."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.before = self.peak = self.proc.memory_info().rss
        self.samples = 0

    async def run(self) -> None:
        """Sample every ``RSS_EVERY_S`` until cancelled."""
        while True:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.samples += 1
            await trio.sleep(RSS_EVERY_S)

    def report(self) -> dict[str, Any]:
        """Before, peak and their difference (MiB), and the sample count."""
        return {
            "rss_before_mib": round(self.before / 2**20, 1),
            "rss_peak_mib": round(self.peak / 2**20, 1),
            "rss_growth_mib": round((self.peak - self.before) / 2**20, 1),
            "rss_samples": self.samples,
        }


async def _status(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.get("/status")
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def counters_moved(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a phase added to ``/status``'s counters (``rejects`` by reason)."""
    b, a = before["counters"], after["counters"]
    out: dict[str, Any] = {k: a.get(k, 0) - b.get(k, 0) for k in COUNTERS}
    rejects = Counter(a.get("rejects") or {})
    rejects.subtract(Counter(b.get("rejects") or {}))
    out["rejects"] = {k: v for k, v in rejects.items() if v}
    out["pending_after"] = after["counts"]["pending"]
    out["failed_after"] = after["counts"]["failed"]
    return out


async def _with_rss(pid: int, phase: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    rss = RssPeak(pid)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rss.run)
        await phase()
        nursery.cancel_scope.cancel()
    return rss.report()


async def sustained(
    http: httpx.AsyncClient,
    pid: int,
    replica: list[int],
    *,
    n: int,
    batch: int,
    clients: int,
    revision: str,
) -> dict[str, Any]:
    """The sustained phase (module docstring)."""
    payloads = [
        (encode_batch([short(i, "s") for i in range(k, min(n, k + batch))]), min(batch, n - k))
        for k in range(0, n, batch)
    ]
    left = iter(payloads)
    rounds: list[float] = []

    async def client() -> None:
        for payload, count in left:
            t = time.perf_counter()
            ids = await submit_batch(http, payload, count)
            await collect(http, ids, revision, timeout=300)
            rounds.append(time.perf_counter() - t)

    async def phase() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)

    st0, share = await _status(http), CpuShare(pid, replica)
    t0 = time.perf_counter()
    mem = await _with_rss(pid, phase)
    elapsed = time.perf_counter() - t0
    cpu, st1 = share.per_request_us(n), await _status(http)
    return {
        "requests": n,
        "batch": batch,
        "clients": clients,
        "elapsed_s": round(elapsed, 3),
        "committed_rps": round(n / elapsed, 1),
        "batch_round_ms": summary_ms(rounds),
        "cpu_us_per_request": cpu["dispatcher_cpu_us"],
        "cpu_share_us_per_request": cpu,
        "counters": counters_moved(st0, st1),
        **mem,
    }


async def burst(
    http: httpx.AsyncClient, pid: int, replica: list[int], *, n: int, batch: int, revision: str
) -> dict[str, Any]:
    """The burst phase (module docstring)."""
    payloads = [
        (encode_batch([short(i, "b") for i in range(k, min(n, k + batch))]), min(batch, n - k))
        for k in range(0, n, batch)
    ]
    accepted: list[float] = []
    served: list[float] = []

    async def one(payload: bytes, count: int) -> None:
        ids = await submit_batch(http, payload, count)
        accepted.append(time.perf_counter())
        await collect(http, ids, revision, timeout=600)
        served.append(time.perf_counter())

    async def phase() -> None:
        async with trio.open_nursery() as nursery:
            for payload, count in payloads:
                nursery.start_soon(one, payload, count)

    st0, share = await _status(http), CpuShare(pid, replica)
    t0 = time.perf_counter()
    mem = await _with_rss(pid, phase)
    cpu, st1 = share.per_request_us(n), await _status(http)
    return {
        "requests": n,
        "batch": batch,
        "calls": len(payloads),
        "accept_all_s": round(max(accepted) - t0, 3),
        "serve_all_s": round(max(served) - t0, 3),
        "accept_rps": round(n / (max(accepted) - t0), 1),
        "served_rps": round(n / (max(served) - t0), 1),
        "cpu_us_per_request": cpu["dispatcher_cpu_us"],
        "cpu_share_us_per_request": cpu,
        "counters": counters_moved(st0, st1),
        **mem,
    }


def burst_clean(b: dict[str, Any]) -> bool:
    """Every request of the burst committed and nothing ran out of time or failed."""
    c = b["counters"]
    return (
        c["commits"] == b["requests"]
        and c["expired"] == 0
        and c["send_errors"] == 0
        and c["turn_errors"] == 0
        and not c["rejects"]
        and c["pending_after"] == 0
        and c["failed_after"] == 0
    )
