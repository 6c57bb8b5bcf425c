"""A sampling pool across three simulated nodes on one real Redis (`stubs.poolnodes`):
each node its own fake GPU, slicerd, trainer stub, vLLM stub under the launcher and
pool-mode dispatcher. Also: one pending request wakes one node's replica, not every
node's (their trainers keep their GPUs), and a revision record no dispatcher can read
takes none down (one node).

Every wait is event-driven and bounded: HTTP long-polls (``POST /v1/samples/results``),
WATCH-driven `Stack.until`, process exits, all under `trio.fail_after`.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.events import follow_events
from gpu_slicer.dispatcher.poolscripts import prefix
from stubs.poolnodes import (
    DISPATCHER,
    TRAINER,
    Node,
    Pool,
    Sample,
    dispatcher_status,
    publish,
    results,
    running_pool,
    submit_many,
    versions,
)
from stubs.redisserver import RedisServer
from stubs.stack import workload

pytestmark = pytest.mark.integration

REVISIONS = ("r1", "r2", "r3", "r4", "r5")
PER_REVISION = 400  # 2,000 requests in all
PINNED = 40  # of each revision's share after the first: pinned to the revision before
KILL_REQUESTS = 240


def check_results(sent: list[Sample], got: dict[str, dict[str, Any]]) -> None:
    """Every request finished once, done, from the weights of its revision."""
    assert len({s.id for s in sent}) == len(sent)
    assert set(got) == {s.id for s in sent}
    for s in sent:
        body = got[s.id]
        assert body["status"] == "done", body
        assert body["revision"] == s.revision, (s, body["revision"])
        assert versions(body["result"]) == {s.revision}, (s, body["result"])


async def test_three_nodes_serve_2000_requests_over_5_revisions(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with trio.fail_after(110), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "0.3", "--turn-grace", "2", "--concurrency", "32"]
        dargs += ["--batch-prompts", "8"]  # 8 prompts a send: the stubs' HTTP is the cost
        async with running_pool(3, redis, trainer_work=(0.05, 0.15, 0.4),
                                dispatch_args=dargs) as pool:  # fmt: skip
            fronts = pool.fronts
            sent: list[Sample] = []
            got: dict[str, dict[str, Any]] = {}

            async def collect(batch: list[Sample]) -> None:
                # long-poll each result through a front other than the one that accepted it
                for k, front in enumerate(fronts):
                    ids = [s.id for s in batch if s.front == fronts[(k + 2) % 3]]
                    got.update(await results(front, ids))

            async with trio.open_nursery() as nursery:
                for k, rev in enumerate(REVISIONS):
                    await publish(fronts[k % 3], rev, pool.base)
                    pinned = PINNED if k else 0
                    batch = await submit_many(fronts, PER_REVISION - pinned, start=len(sent))
                    assert {s.revision for s in batch} == {rev}  # the newest, on every front
                    if pinned:
                        batch += await submit_many(fronts, pinned, revision=REVISIONS[k - 1],
                                                   start=len(sent) + len(batch))  # fmt: skip
                    sent += batch
                    nursery.start_soon(collect, batch)
            assert len(sent) == 2000
            check_results(sent, got)
            stats = pool.stats()
            assert stats["committed"] == 2000, stats
            assert stats["failed"] == stats["duplicates"] == stats["reclaimed"] == 0, stats
            # How the work spreads is the pool's choice, not this test's: a replica asks
            # for a turn while the backlog is more than the others take, and whether its
            # trainer's step ends before they drained it is timing (node2's steps are
            # 0.4 s). Where the pool promises a spread, the next test checks it exactly.
            served = pool.served()
            assert sum(served.values()) == 2000 and set(served) <= set(pool_names(pool))
            st = await dispatcher_status(fronts[0])
            assert st["pool_mode"]["redis"]["reachable"] is True
            for node in pool.nodes:  # every trainer kept training beside its replica
                t = workload(await node.stack.status(), "trainer")
                assert t is not None and t["state"] != "faulted" and t["grants"], (node.name, t)
            assert pool.overlaps() == {"node0": 0, "node1": 0, "node2": 0}
            pool.check_alive()
    print(f"three-node simulation: {time.monotonic() - t0:.1f} s, served {served}")


def pool_names(pool: Pool) -> list[str]:
    return [n.name for n in pool.nodes]


async def test_a_backlog_no_one_replica_takes_wakes_each_for_its_share(tmp_path: Path) -> None:
    """Three requests, three replicas of one slot each (``--concurrency 1``): every replica
    sees a backlog of 3 against what the others cover (0, 1, 2, in whatever order they
    look), so all three ask for a turn (each dispatcher enters ``acquiring``).

    That holds only while no replica has claimed any of it: a replica granted at once
    claims one, and a replica that looks after that sees 2 against the 2 that the other
    two cover, and rightly stays asleep. So each trainer is stopped (SIGSTOP) inside its
    turn before the requests are sent, which holds every grant back until all three have
    asked; then they train on. Who serves how many after that is the grants' order (a
    replica granted late may find the work served by one that finished its first
    request), so only the total is asserted, with every result once."""
    with trio.fail_after(60), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "10", "--turn-grace", "2", "--concurrency", "1"]
        async with running_pool(3, redis, trainer_work=(0.05, 0.15, 0.4), dispatch_args=dargs,
                                stub_args=("--tokens-per-s", "10")) as pool:  # fmt: skip
            fronts = pool.fronts
            await publish(fronts[0], "r1", pool.base)
            asked: set[str] = set()
            all_asked = trio.Event()
            stopped = []
            try:
                async with trio.open_nursery() as nursery:
                    for node in pool.nodes:

                        def seen(ev: dict[str, Any], name: str = node.name) -> None:
                            if ev.get("event") == "phase" and ev.get("phase") == "acquiring":
                                asked.add(name)
                                if len(asked) == len(pool.nodes):
                                    all_asked.set()

                        await nursery.start(follow_events, node.front, seen)
                        stopped.append(await stop_trainer_in_its_turn(node))
                    sent = await submit_many(fronts, 3, max_tokens=30)
                    await all_asked.wait()
                    nursery.cancel_scope.cancel()
            finally:
                for proc in stopped:
                    proc.send_signal(signal.SIGCONT)
            check_results(sent, await results(fronts[1], [s.id for s in sent]))
            assert sum(pool.served().values()) == 3, pool.served()
            assert pool.stats()["duplicates"] == pool.stats()["reclaimed"] == 0
            pool.check_alive()


def trainer_holds(st: dict[str, Any]) -> bool:
    """The node's trainer holds its GPU's turn (not only on it after a lazy release)."""
    return (st["gpus"][0]["holder"] or {}).get("workload") == TRAINER


async def stop_trainer_in_its_turn(node: Node) -> subprocess.Popen[bytes]:
    """SIGSTOP `node`'s trainer while it holds its turn, so that no one else is granted
    until it is let go (SIGCONT): checked from slicerd's STATUS once it is stopped (it
    may have released between the check before and the signal); its process."""
    proc = node.stack.procs[TRAINER]
    while True:
        await node.stack.until(trainer_holds)
        proc.send_signal(signal.SIGSTOP)
        if trainer_holds(await node.stack.status()):
            return proc
        proc.send_signal(signal.SIGCONT)  # between two turns: stop it inside the next


def trainer_after_park(st: dict[str, Any]) -> bool:
    t, v = workload(st, "trainer"), workload(st, "v")
    return bool(t and v and t["state"] == "active" and v["state"] == "parked")


def trainer_turn(st: dict[str, Any]) -> int:
    """The trainer's turn number while it holds one (they count up), else -1."""
    t = workload(st, "trainer")
    assert t is not None
    return -1 if t["turn"] is None else int(t["turn"])


async def until_serving_with_claims(node: Node) -> dict[str, Any]:
    """Wait until `node`'s dispatcher holds claims in a serving turn (checked at each of
    its "committed" events: results are committed only inside a turn); its /status."""
    send, recv = trio.open_memory_channel[dict[str, Any]](math.inf)
    async with trio.open_nursery() as nursery:
        await nursery.start(follow_events, node.front, send.send_nowait)
        async for ev in recv:
            if ev["event"] != "committed":
                continue
            st = await node.status()
            if st["state"] == "serving" and st["pool_mode"]["claimed_here"] > 0:
                nursery.cancel_scope.cancel()
                return st
    raise AssertionError(f"{node.name}: its event stream ended")


async def test_sigkill_mid_turn_claims_are_served_elsewhere(tmp_path: Path) -> None:
    reclaim_idle = 3.0
    with trio.fail_after(100), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "0.5", "--turn-grace", "1", "--concurrency", "16"]
        dargs += ["--reclaim-idle", str(reclaim_idle)]
        async with running_pool(
            3, redis, trainer_work=(0.05, 0.15, 0.4), dispatch_args=dargs,
            stub_args=("--tokens-per-s", "200"),  # 20 tokens: 0.1 s a send, many in flight
            launcher_args=("--park-fallback", "checkpoint"),
        ) as pool:  # fmt: skip
            victim, fronts = pool.nodes[0], pool.fronts
            await publish(fronts[1], "r1", pool.base)
            sent = await submit_many(fronts, KILL_REQUESTS, max_tokens=20)
            t_up = time.monotonic()
            proc = victim.stack.procs[DISPATCHER]
            while True:
                st = await until_serving_with_claims(victim)
                # What it holds as it dies, read while it cannot act (stopped): a loaded
                # machine may run it on to commit them all between its /status and a kill.
                proc.send_signal(signal.SIGSTOP)
                consumer = st["pool_mode"]["consumer"]
                held = pool.claimed(consumer)
                if held:
                    break
                proc.send_signal(signal.SIGCONT)  # it had committed them: its next claims
            assert await victim.kill_dispatcher() == -signal.SIGKILL
            killed_at = time.monotonic()
            got = await results(fronts[1], sorted(held))
            served_in = time.monotonic() - killed_at
            assert all(b["status"] == "done" for b in got.values()), got
            # reclaimed once idle for reclaim_idle, then served in the others' next turns
            # (3.2-7.2 s measured with load average 6 on 2 cores: margin for a slow tick)
            assert served_in < reclaim_idle + 10.0, served_in
            assert not pool.claimed(consumer)

            # its replica was parked (checkpoint fallback) and its trainer goes on training
            ws = await victim.stack.until(trainer_after_park)
            steps = trainer_turn(ws)
            await victim.stack.until(lambda s: trainer_turn(s) >= steps + 2)
            t_trained = time.monotonic()

            survivors = [(fronts[1], fronts[2]), (fronts[2], fronts[1])]
            got = {}
            for accepted_by, poll in survivors:
                got.update(await results(poll, [s.id for s in sent if s.front == accepted_by]))
            got.update(await results(fronts[2], [s.id for s in sent if s.front == fronts[0]]))
            check_results(sent, got)
            stats = pool.stats()
            assert stats["committed"] == KILL_REQUESTS and stats["failed"] == 0, stats
            assert stats["reclaimed"] >= len(held), (stats, len(held))
            served = pool.served()
            assert sum(served.values()) == KILL_REQUESTS, served
            assert served["node1"] > 0 and served["node2"] > 0, served

            # a restarted dispatcher rejoins the pool: its front accepts and answers again
            t_all = time.monotonic()
            await victim.restart_dispatcher()
            t_restarted = time.monotonic()
            more = await submit_many([victim.front], 30, prefix="after", max_tokens=4)
            check_results(more, await results(victim.front, [s.id for s in more]))
            assert pool.overlaps() == {"node0": 0, "node1": 0, "node2": 0}
            pool.check_alive()
    print(f"SIGKILL mid-turn: {len(held)} claims served elsewhere {served_in:.1f} s after; "
          f"claims seen {killed_at - t_up:.1f} s after the submit, trainer stepping "
          f"{t_trained - killed_at:.1f} s after the kill, all served {t_all - t_trained:.1f} s "
          f"later, restart {t_restarted - t_all:.1f} s, "
          f"30 more {time.monotonic() - t_restarted:.1f} s")  # fmt: skip


def replica_settled(st: dict[str, Any]) -> bool:
    """The node's replica neither holds its GPU nor waits for it (a turn asked for has
    come and gone)."""
    gpu = st["gpus"][0]
    return (gpu["holder"] or {}).get("workload") != "v" and "v" not in gpu["queue"]


async def turn_figures(pool: Pool) -> list[tuple[int, int, int, int]]:
    """Per node, once its replica settled: (dispatcher turns, slicerd grants of its
    replica, empty turns, times it held back)."""
    out = []
    for node in pool.nodes:
        v = workload(await node.stack.until(replica_settled), "v")
        st = await node.status()
        assert v is not None
        out.append((st["counters"]["turns"], v["grants"], st["pool_mode"]["empty_turns"],
                    st["pool_mode"]["held_back"]))  # fmt: skip
    return out


async def test_one_pending_request_wakes_one_replica_not_every_node(tmp_path: Path) -> None:
    with trio.fail_after(60), RedisServer(tmp_path / "redis") as redis:
        # The default --ask-patience: 2 x 0.3 + 2 = 2.6 s. A trainer's step of 1 s: the
        # replica that asked first waits up to that long for its turn, and meanwhile
        # the others must not ask too.
        dargs = ["--turn-seconds", "0.3", "--turn-grace", "2", "--concurrency", "16"]
        async with running_pool(3, redis, trainer_work=(1.0,), dispatch_args=dargs) as pool:
            fronts = pool.fronts
            await publish(fronts[0], "r1", pool.base)
            warm = await submit_many(fronts, 30, prefix="w")  # every replica loads r1
            check_results(warm, await results(fronts[0], [s.id for s in warm]))
            for trial in range(3):
                before = await turn_figures(pool)
                [one] = await submit_many([fronts[trial]], 1, prefix=f"one{trial}")
                check_results([one], await results(fronts[(trial + 1) % 3], [one.id]))
                after = await turn_figures(pool)
                d = [tuple(x - y for x, y in zip(a, b, strict=True))
                     for a, b in zip(after, before, strict=True)]  # fmt: skip
                print(f"one request #{trial}: per node (turns, grants, empty turns, held "
                      f"back) {d}")  # fmt: skip
                assert sum(x[2] for x in d) == 0, d  # no replica woken for nothing
                assert sorted(x[0] for x in d) == [0, 0, 1], d  # one turn, one node
                assert sorted(x[1] for x in d) == [0, 0, 1], d  # one grant by slicerd
                woken = next(i for i, x in enumerate(d) if x[1])
                assert d[woken][0] == 1, d
                assert all(x[3] >= 1 for i, x in enumerate(d) if i != woken), d
            pool.check_alive()


async def test_a_burst_one_replica_serves_in_one_turn_wakes_one_replica(tmp_path: Path) -> None:
    """What a replica covers of the backlog is what it serves in one turn (its measured
    rate x --turn-seconds), not its --concurrency: a burst of 33 with 8 slots a replica
    used to wake every node (33 > 8, > 16, > 24); one replica serves it in one turn."""
    with trio.fail_after(90), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "5", "--turn-grace", "2", "--concurrency", "8"]
        async with running_pool(3, redis, trainer_work=(1.0,), dispatch_args=dargs) as pool:
            fronts = pool.fronts
            await publish(fronts[0], "r1", pool.base)
            capacity: dict[str, int] = {}
            known = trio.Event()
            async with trio.open_nursery() as nursery:
                for node in pool.nodes:

                    def seen(ev: dict[str, Any], name: str = node.name) -> None:
                        if ev.get("event") == "capacity":
                            capacity[name] = ev["turn_capacity"]
                            if len(capacity) == 3 and min(capacity.values()) >= 33:
                                known.set()

                    await nursery.start(follow_events, node.front, seen)
                # Turns of 8 or more results measure a rate; the others learn it from
                # the reports (the median of what the others measured).
                warm = await submit_many(fronts, 120, prefix="w")
                check_results(warm, await results(fronts[0], [s.id for s in warm]))
                await known.wait()
                nursery.cancel_scope.cancel()
            before, served = await turn_figures(pool), pool.served()
            burst = await submit_many([fronts[1]], 33, prefix="burst")
            check_results(burst, await results(fronts[2], [s.id for s in burst]))
            after, served_after = await turn_figures(pool), pool.served()
            d = [tuple(x - y for x, y in zip(a, b, strict=True))
                 for a, b in zip(after, before, strict=True)]  # fmt: skip
            print(f"burst of 33: per node (turns, grants, empty turns, held back) {d}; "
                  f"capacity {capacity}")  # fmt: skip
            assert sorted(x[1] for x in d) == [0, 0, 1], d  # one replica woken
            assert sum(x[2] for x in d) == 0, d  # none for nothing
            woken = pool.nodes[next(i for i, x in enumerate(d) if x[1])].name
            assert served_after.get(woken, 0) - served.get(woken, 0) == 33, (served, served_after)
            pool.check_alive()


async def test_an_unreadable_revision_record_takes_no_dispatcher_down(tmp_path: Path) -> None:
    with trio.fail_after(90), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "0.3", "--turn-grace", "1", "--concurrency", "8"]
        async with running_pool(1, redis, dispatch_args=dargs) as pool:
            node = pool.nodes[0]
            await publish(node.front, "r1", pool.base)
            # Another release's record (or a hand edit), announced to every dispatcher.
            redis.command("HSET", prefix(pool.name) + "revs", "r2", "not json")
            redis.command("XADD", prefix(pool.name) + "ev", "*", "e", "rev")
            async with httpx.AsyncClient(base_url=node.front, timeout=30) as http:
                # Naming it makes the front read the pool's revisions once more, now.
                body = {"kind": "completion", "prompt": "x", "max_tokens": 1, "revision": "r2"}
                r = await http.post("/v1/samples", json=body)
                assert r.status_code in (400, 404), r.text
                assert "r2" in r.json()["error"]["message"], r.text
            sent = await submit_many([node.front], 10, revision="r1", prefix="before")
            check_results(sent, await results(node.front, [s.id for s in sent]))
            pool.check_alive()
            # A dispatcher started now reads the same record at its start.
            await node.kill_dispatcher()
            await node.restart_dispatcher()
            more = await submit_many([node.front], 10, prefix="after")
            assert {s.revision for s in more} == {"r1"}  # the newest readable one
            check_results(more, await results(node.front, [s.id for s in more]))
            # Repaired by hand (no event says so) while a request of it waits, accepted
            # by another release's front: read again within a tick, and served.
            key = prefix(pool.name)
            ckpt = pool.base / "ckpt" / "r2"
            ckpt.mkdir(parents=True)
            (ckpt / "revision.txt").write_text("r2")
            record = {"path": str(ckpt), "published_at": time.time(), "seq": 2}
            redis.command("HSET", key + "revs", "r2", json.dumps(record))
            foreign_entry(redis, key, "r2", {"i": "fixed1", **FOREIGN})
            redis.command("XADD", key + "ev", "*", "e", "new")
            got = (await results(node.front, ["fixed1"]))["fixed1"]
            assert got["status"] == "done" and got["revision"] == "r2", got
            assert versions(got["result"]) == {"r2"}, got
            assert (await node.status())["pool_mode"]["bad_revisions"] == {}
            pool.check_alive()


FOREIGN = {"k": "completion", "a": '{"max_tokens": 2}', "d": "3600", "x": "hello"}


def foreign_entry(redis: RedisServer, key: str, rev: str, fields: dict[str, str]) -> None:
    """Add a request to ``rev``'s stream as another release's front might (with what
    ENQUEUE does besides), unannounced (XADD ``ev`` ``new`` announces it)."""
    if not redis.command("EXISTS", key + f"q:{rev}"):
        redis.command("XGROUP", "CREATE", key + f"q:{rev}", "dispatch", "0", "MKSTREAM")
    redis.command("SADD", key + "active", rev)
    eid = redis.command("XADD", key + f"q:{rev}", "*", *[x for kv in fields.items() for x in kv])
    assert isinstance(eid, bytes)
    redis.command("HSET", key + "where", fields["i"], f"{rev} {eid.decode()}")
    redis.command("HINCRBY", key + "unclaimed", rev, "1")


async def test_an_unreadable_request_wakes_the_pool_a_bounded_number_of_times(
    tmp_path: Path,
) -> None:
    """An entry this release cannot read (params that are not JSON, as another release
    could write) used to be handed back and claimed again at once, forever: its node's
    trainer was parked 11 times in 15 s. Now it is read at most 3 times, each after the
    reclaim bound, then failed naming the pool, the field and the reason, and the
    trainer keeps its GPU."""
    with trio.fail_after(60), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "0.3", "--turn-grace", "1", "--concurrency", "8"]
        dargs += ["--reclaim-idle", "3"]  # a reading every 3 s at most
        async with running_pool(1, redis, dispatch_args=dargs) as pool:
            node, key = pool.nodes[0], prefix(pool.name)
            await publish(node.front, "r1", pool.base)
            foreign_entry(redis, key, "r1", {"i": "bad1", **FOREIGN, "a": "not json"})
            before = workload(await node.stack.status(), "trainer") or {}
            redis.command("XADD", key + "ev", "*", "e", "new")  # as ENQUEUE announces it
            got = (await results(node.front, ["bad1"]))["bad1"]
            assert got["status"] == "failed", got
            err = got["error"]["message"] if isinstance(got["error"], dict) else got["error"]
            assert "pool pa" in err and "field 'a'" in err and "in 3 tries" in err, got
            assert pool.stats()["aside"] == 1 and pool.stats()["returned"] == 2
            after = workload(await node.stack.status(), "trainer") or {}
            parks = after.get("parks", 0) - before.get("parks", 0)
            assert parks <= 3, (before, after)  # at most one a reading of the bad entry
            st = await node.status()
            assert st["pool_mode"]["put_aside_here"] == 1, st["pool_mode"]
            # The pool is idle again: a readable request is served as usual.
            sent = await submit_many([node.front], 2, prefix="after")
            check_results(sent, await results(node.front, [s.id for s in sent]))
            print(f"unreadable entry: the trainer was parked {parks} times for it")
            pool.check_alive()
