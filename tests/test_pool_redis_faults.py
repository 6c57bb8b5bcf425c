"""Pool mode when its Redis fails: a dependency, never a silent single point of failure.

Each test runs one simulated node (a real slicerd on a fake GPU, the vLLM stub under the
launcher, a trainer stub, a pool-mode `slicer-dispatch` as a subprocess) against a real
`redis-server` (`stubs.redisserver`, AOF with ``appendfsync always``), and breaks Redis:

* SIGKILL while requests are pending and a turn serves, then a restart from its AOF:
  every request acknowledged before the kill gets exactly one result, from its revision;
  the requests sent meanwhile got 503 naming Redis; the dispatcher lives on.
* SIGSTOP (unreachable: connections hang) while a turn serves and a trainer waits: the
  turn ends and the GPU goes back to the trainer within one turn's bound, the front
  answers 503 (bounded by the pool's call bound) and ``/ready`` 503 naming Redis, the
  dispatcher takes no turns meanwhile; after SIGCONT service resumes on its own.
* no Redis at all when the dispatcher starts: it starts, answers 503, and serves once
  Redis is up.
* a bad ``--queue`` URL, or a ``--reclaim-idle`` under 3 s (no heartbeat could keep a
  claim): exit 64 in one line, before anything starts.

Every wait is an event (HTTP answers and long-polls, process lines, slicerd's WATCH via
`stack.until`), bounded by `trio.fail_after`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.poolconn import CALL_TIMEOUT_S
from stubs.redisserver import RedisServer
from tests.clitable import assert_one_line, module_argv, run_cli
from tests.harness import Stack, running_stack, workload
from tests.procs import Proc, free_port, spawn
from tests.test_dispatcher import publish, replica, result_of, status, stop, trainer, versions

pytestmark = pytest.mark.integration

POOL = "pa"
# A slow replica (8 tokens at 40 tokens/s: 0.2 s a request) so that requests are still
# pending, and some in flight, when Redis fails mid-turn.
SLOW = ("--tokens-per-s", "40")
# Small bounds, so the tests take seconds: the claims a dispatcher could not hand back
# while Redis was down are reclaimed 4 s after their last touch.
FLAGS = ("--turn-seconds", "0.3", "--turn-grace", "1", "--concurrency", "4",
         "--reclaim-idle", "4")  # fmt: skip
TURN_SECONDS, TURN_GRACE = 0.3, 1.0
SERVING = {"waking", "loading", "serving", "grace"}  # the dispatcher's phases inside a turn


@asynccontextmanager
async def pool_dispatcher(
    stack: Stack, url: str, queue: str, *flags: str
) -> AsyncIterator[tuple[Proc, httpx.AsyncClient]]:
    """A pool-mode `slicer-dispatch` of pool POOL for workload "v", listening."""
    port = free_port()
    argv = [sys.executable, "-m", "gpu_slicer.dispatcher.main", "--workload", "v",
            "--replica", url, "--socket", stack.socket, "--listen", f"127.0.0.1:{port}",
            "--queue", queue, "--pool", POOL, *FLAGS, *flags]  # fmt: skip
    async with (
        spawn(stack, "dispatcher", argv) as d,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http,
    ):
        await d.line(lambda s: s.startswith("listening on"))
        yield d, http


async def submit(http: httpx.AsyncClient, i: int, revision: str | None = None) -> httpx.Response:
    """POST one completion sample (8 tokens), pinned to ``revision`` if given."""
    body: dict[str, Any] = {"prompt": f"q{i}", "max_tokens": 8}
    if revision is not None:
        body["revision"] = revision
    return await http.post("/v1/samples", json=body)


def assert_redis_503(r: httpx.Response) -> None:
    """A 503 whose message names Redis (what an operator must look at)."""
    assert r.status_code == 503, (r.status_code, r.text)
    assert "redis" in r.json()["error"]["message"].lower(), r.text


def redis_hash(redis: RedisServer, key: str) -> dict[str, int]:
    """Pool hash ``key`` (``stats``, ``served``) read straight from Redis."""
    flat = redis.command("HGETALL", f"slicer:pool:{{{POOL}}}:{key}")
    assert isinstance(flat, list)
    return {k.decode(): int(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


def pool_pending(redis: RedisServer) -> int:
    """Requests still pending anywhere in the pool (the id -> entry index)."""
    n = redis.command("HLEN", f"slicer:pool:{{{POOL}}}:where")
    assert isinstance(n, int)
    return n


def holder(st: dict[str, Any]) -> str | None:
    """The workload holding GPU 0 in a slicerd STATUS."""
    h = st["gpus"][0]["holder"]
    return None if h is None else str(h["workload"])


async def all_served(
    http: httpx.AsyncClient,
    expected: dict[str, str],
    timeout: float = 60,
    redis: RedisServer | None = None,
) -> None:
    """Every sample of ``expected`` (id -> revision) is done, from that revision. If one
    is not, the front's pool status (and with ``redis``, the pool's claims) is shown."""
    for sid, rev in expected.items():
        try:
            got = await result_of(http, sid, timeout)
        except trio.TooSlowError:
            print(f"{sid} still pending; pool status:", (await status(http))["pool_mode"])
            if redis is not None:
                print("pool pending:", redis.command("HGETALL", f"slicer:pool:{{{POOL}}}:where"))
                for q in ("r1", "r2"):
                    key = f"slicer:pool:{{{POOL}}}:q:{q}"
                    print(q, "claims:", redis.command("XPENDING", key, "dispatch", "-", "+", "50"))
            raise
        assert got["status"] == "done", got
        assert got["revision"] == rev, got
        assert versions(got["result"]) == {rev}, got


async def test_sigkill_redis_mid_turn_then_restart_from_aof_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    with trio.fail_after(180), RedisServer(tmp_path / "redis") as redis:
        async with running_stack() as stack:
            await sigkill_scenario(stack, redis)
            assert stack.overlaps() == 0


async def sigkill_scenario(stack: Stack, redis: RedisServer) -> None:
    """SIGKILL Redis mid-turn and restart it (the test above)."""
    async with (
        replica(stack, "cooperative", *SLOW) as (_, url),
        pool_dispatcher(stack, url, redis.url) as (d, http),
        spawn(stack, "trainer", trainer(stack, 100_000, 0.05)) as tr,
    ):
        acked: dict[str, str] = {}  # id -> revision, answered 202 before the kill
        for rev in ("r1", "r2"):
            await publish(stack, http, rev)
            for i in range(15):
                pinned = "r1" if i % 3 == 0 else None  # else the newest: rev
                r = await submit(http, len(acked), pinned)
                assert r.status_code == 202, r.text
                acked[r.json()["id"]] = pinned or rev
        await d.line(lambda s: "serving revision" in s, start=len(d.lines))  # a turn serves now
        redis.kill()  # mid-turn: sends in flight, their commits to come
        for i in range(3):  # nothing is acknowledged while Redis is gone
            assert_redis_503(await submit(http, 100 + i))
        assert_redis_503(await http.get(f"/v1/samples/{next(iter(acked))}"))
        assert d.proc.returncode is None
        redis.restart()  # from its AOF: everything acknowledged was fsynced
        await all_served(http, acked, redis=redis)
        # Exactly one result each: every acknowledged request committed once, none
        # failed, nothing left pending (duplicates, if any, were dropped).
        stats = redis_hash(redis, "stats")
        assert stats.get("committed") == len(acked), stats
        assert stats.get("failed", 0) == 0, stats
        assert sum(redis_hash(redis, "served").values()) == len(acked)
        assert pool_pending(redis) == 0
        r = await submit(http, 200)  # and the front accepts again
        assert r.status_code == 202, r.text
        await all_served(http, {r.json()["id"]: "r2"})
        assert d.proc.returncode is None and tr.proc.returncode is None
        await stop(d)


def trainer_steps(tr: Proc) -> int:
    """Steps the trainer stub has begun (its "step K turn T" lines)."""
    return sum(1 for s in tr.lines if s.startswith("step "))


async def test_redis_unreachable_gives_every_gpu_back_and_service_resumes_on_its_own(
    tmp_path: Path,
) -> None:
    with trio.fail_after(240), RedisServer(tmp_path / "redis") as redis:
        async with contextlib.AsyncExitStack() as nodes:
            both = [await nodes.enter_async_context(node(redis, f"node{k}")) for k in (0, 1)]
            await pause_scenario(both, redis)
            for n in both:
                await stop(n.d)
                assert n.stack.overlaps() == 0


@dataclass
class Node:
    """One simulated node of the pool: slicerd, replica, dispatcher, trainer."""

    stack: Stack
    d: Proc
    http: httpx.AsyncClient
    tr: Proc


@asynccontextmanager
async def node(redis: RedisServer, name: str) -> AsyncIterator[Node]:
    """A node whose dispatcher is consumer ``name`` of pool POOL, its trainer running."""
    async with (
        running_stack() as stack,
        replica(stack, "cooperative", *SLOW) as (_, url),
        pool_dispatcher(stack, url, redis.url, "--consumer", name) as (d, http),
        spawn(stack, "trainer", trainer(stack, 100_000, 0.05)) as tr,
    ):
        yield Node(stack, d, http, tr)


# Pausing mid-turn to the trainer's grant: the turn's own end (turn seconds, grace) plus
# one hung Redis call inside the turn and one at its end (hand back), each cut at
# CALL_TIMEOUT_S; then sleep and RELEASE (fast here), with a margin for a slow machine.
GPU_BACK_BOUND_S = TURN_SECONDS + TURN_GRACE + 2 * CALL_TIMEOUT_S + 5.0


async def pause_scenario(nodes: list[Node], redis: RedisServer) -> None:
    """SIGSTOP Redis mid-turn, then SIGCONT (the test above)."""
    first = nodes[0]
    await publish(first.stack, first.http, "r1")
    acked: dict[str, str] = {}
    for i in range(60):
        r = await submit(nodes[i % 2].http, i)  # any front accepts for the pool
        assert r.status_code == 202, r.text
        acked[r.json()["id"]] = "r1"
    await first.d.line(lambda s: "serving revision" in s, start=len(first.d.lines))
    redis.pause()  # unreachable: every call hangs until its bound
    paused_at = trio.current_time()
    grants, turns, steps, back = [0, 0], [0, 0], [0, 0], [0.0, 0.0]

    async def gpu_back(k: int) -> None:
        n = nodes[k]
        st = await n.stack.until(lambda st: holder(st) == "trainer", timeout=GPU_BACK_BOUND_S)
        back[k] = round(trio.current_time() - paused_at, 2)
        dst = await status(n.http)  # the dispatcher's turn is over
        assert dst["state"] not in SERVING | {"sleeping"}, dst["state"]
        grants[k] = workload(st, "v")["grants"]  # type: ignore[index]
        turns[k] = dst["counters"]["turns"]
        steps[k] = trainer_steps(n.tr)

    # Every node's GPU goes back to its trainer within one turn's bound.
    with trio.fail_after(GPU_BACK_BOUND_S):
        async with trio.open_nursery() as nursery:
            for k in range(len(nodes)):
                nursery.start_soon(gpu_back, k)

    async def refused(n: Node) -> None:
        # The front accepts nothing while Redis cannot say it has the request: 503,
        # once the pool's call bound ran out (CALL_TIMEOUT_S), naming Redis.
        with trio.fail_after(CALL_TIMEOUT_S + 5.0):
            assert_redis_503(await submit(n.http, 100))
        r = await n.http.get("/ready")
        assert r.status_code == 503 and "redis" in r.json()["reason"], r.text
        assert "redis" in (await status(n.http))["pool_mode"]["redis"]["error"]

    async with trio.open_nursery() as nursery:
        for n in nodes:
            nursery.start_soon(refused, n)
    # The trainers keep their GPUs: their steps go on, and no dispatcher takes more than
    # one turn meanwhile (say, one whose claims still waited for their commit).
    for n, s0, g0, t0 in zip(nodes, steps, grants, turns, strict=True):
        while trainer_steps(n.tr) < s0 + 20:
            await n.tr.changed.wait()
        assert workload(await n.stack.status(), "v")["grants"] <= g0 + 1  # type: ignore[index]
        assert (await status(n.http))["counters"]["turns"] <= t0 + 1
        assert n.d.proc.returncode is None
    outage = trio.current_time() - paused_at
    print(f"GPUs back to their trainers {back} s after the pause; outage {outage:.2f} s")
    redis.resume()
    # Service resumes by itself: what was pending is served, new requests too.
    await all_served(nodes[1].http, acked, redis=redis)
    late: dict[str, str] = {}
    for n in nodes:
        r = await submit(n.http, 200)
        assert r.status_code == 202, r.text
        late[r.json()["id"]] = "r1"
    await all_served(first.http, late)
    for n in nodes:
        r = await n.http.get("/ready")
        assert r.status_code == 200, r.text
        assert n.d.proc.returncode is None and n.tr.proc.returncode is None
    # One result per request: those acknowledged, and perhaps the two answered 503 while
    # Redis hung: an ENQUEUE cut by the call bound may still run once Redis resumes (a
    # timed-out call's outcome is unknown). What is still pending can only be those, and
    # they are served too.
    leftover = redis.command("HKEYS", f"slicer:pool:{{{POOL}}}:where")
    assert isinstance(leftover, list) and len(leftover) <= len(nodes), leftover
    assert not {k.decode() for k in leftover} & (acked.keys() | late.keys())
    await all_served(first.http, {k.decode(): "r1" for k in leftover}, redis=redis)
    stats = redis_hash(redis, "stats")
    want = len(acked) + len(late)
    assert want <= stats.get("committed", 0) <= want + len(nodes), stats
    assert stats.get("failed", 0) == 0, stats
    assert pool_pending(redis) == 0


async def test_a_dispatcher_started_before_redis_answers_503_then_serves_once_it_is_up(
    tmp_path: Path,
) -> None:
    redis = RedisServer(tmp_path / "redis")  # not started: nothing listens on its socket
    try:
        with trio.fail_after(120):
            async with running_stack() as stack:
                await late_redis_scenario(stack, redis)
                assert stack.overlaps() == 0
    finally:
        redis.close()


async def late_redis_scenario(stack: Stack, redis: RedisServer) -> None:
    """Start the dispatcher with no Redis, then start Redis (the test above)."""
    async with (
        replica(stack, "cooperative") as (_, url),
        pool_dispatcher(stack, url, redis.url) as (d, http),
    ):
        # It started (listening) and waits: every call to the pool is refused with 503.
        assert_redis_503(await submit(http, 0))
        ckpt = stack.base / "early-r1"  # publish() below saves its own copy
        ckpt.mkdir()
        (ckpt / "revision.txt").write_text("r1")
        assert_redis_503(
            await http.post("/v1/revisions", json={"revision": "r1", "path": str(ckpt)})
        )
        r = await http.get("/ready")
        assert r.status_code == 503 and "redis" in r.json()["reason"], r.text
        assert (await status(http))["pool_mode"]["redis"]["reachable"] is False
        assert d.proc.returncode is None
        redis.start()
        await publish(stack, http, "r1")  # the first call that reaches it
        ids = {}
        for i in range(5):
            r = await submit(http, i)
            assert r.status_code == 202, r.text
            ids[r.json()["id"]] = "r1"
        await all_served(http, ids)
        r = await http.get("/ready")
        assert r.status_code == 200, r.text
        assert (await status(http))["pool_mode"]["redis"]["reachable"] is True
        await stop(d)


@pytest.mark.parametrize(
    ("queue", "why"),
    [
        ("http://x", r"'http://x' is not redis://HOST\[:PORT\]\[/DB\] nor unix:///PATH"),
        ("unix://", r"'unix://' names no socket path"),
        ("redis://h:99999", r"'redis://h:99999': Port out of range"),
        ("redis:///0", r"'redis:///0' names no host"),
        ("redis://h/x", r"'redis://h/x': the database must be a number, got 'x'"),
    ],
    ids=["not redis", "unix without path", "port out of range", "no host", "bad db"],
)
def test_a_bad_queue_url_exits_64_in_one_line(tmp_path: Path, queue: str, why: str) -> None:
    argv = ["--workload", "w", "--replica", "http://127.0.0.1:9", "--socket",
            str(tmp_path / "none.sock"), "--queue", queue, "--pool", POOL]  # fmt: skip
    r = run_cli(module_argv("slicer-dispatch", *argv))
    assert_one_line(r, 64, rf"^slicer-dispatch: error: Invalid value for '--queue': {why}.* "
                    r"\(see 'slicer-dispatch --help'\)$")  # fmt: skip


def test_a_reclaim_idle_under_3_s_exits_64_in_one_line(tmp_path: Path) -> None:
    argv = ["--workload", "w", "--replica", "http://127.0.0.1:9", "--socket",
            str(tmp_path / "none.sock"), "--listen", f"127.0.0.1:{free_port()}",
            "--queue", f"unix://{tmp_path / 'none.redis'}", "--pool", POOL,
            "--reclaim-idle", "1"]  # fmt: skip
    r = run_cli(module_argv("slicer-dispatch", *argv), timeout=30)
    assert_one_line(r, 64, r"^slicer-dispatch: error: Invalid value for '--reclaim-idle': "
                    r"1 s is shorter than 3 s: .* \(see 'slicer-dispatch --help'\)$")  # fmt: skip
