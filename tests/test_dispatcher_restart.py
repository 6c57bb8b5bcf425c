"""A replica that is not the one the dispatcher loaded is noticed, recovered and reloaded.

A vLLM replica restarted by its launcher keeps its URL but is a new process serving its
boot weights (``/weight_info`` says ``"default"``). Before, the dispatcher believed the
old revision loaded: every result was refused by the commit rule, the turn never ended,
the request waited for its deadline and ``/status`` showed no problem. Here: the restart
between turns is seen at the next turn's start (``GET /weight_info``) and the revision is
reloaded before serving; a restart mid-turn ends the turn after
``sending.MAX_WEIGHT_REFUSALS`` refused results and the next turn reloads; both are told
as the problem ``replica serves weights other than REV``. In process over the fake vLLM
(deterministic: no probes), then end to end with the real launcher restarted on the same
port. Every wait is event-driven and bounded by ``trio.fail_after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from gpu_slicer.dispatcher.events import Subscription
from gpu_slicer.dispatcher.health import foreign_weights
from gpu_slicer.dispatcher.model import TurnConfig, TurnState
from gpu_slicer.dispatcher.sending import MAX_WEIGHT_REFUSALS
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from gpu_slicer.slicer.client import Turn
from tests.harness import running_stack
from tests.procs import free_port
from tests.test_dispatcher import publish, replica, status, stop, stub_reloads, versions
from tests.test_dispatcher_health import dispatcher, ready, until_problem
from tests.test_dispatcher_model import FakeSlicer
from tests.test_dispatcher_vllm import FakeVllm

BODY = {"prompt": [1, 2], "max_tokens": 2}


@asynccontextmanager
async def running_loop(
    tmp_path: Path, fake: FakeVllm
) -> AsyncIterator[tuple[TurnLoop, list[dict[str, Any]]]]:
    """A whole turn loop over ``fake`` (slicerd faked: every ACQUIRE granted) with r1
    published; (loop, every event it publishes, collected as they come)."""
    store = Store(tmp_path / "state", "pool-a")
    ckpt = tmp_path / "ckpt" / "r1"
    ckpt.mkdir(parents=True)
    (ckpt / "revision.txt").write_text("r1")
    got: list[dict[str, Any]] = []

    async def collect(sub: Subscription) -> None:
        async for e in sub:
            got.append(e)

    try:
        async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
            loop = TurnLoop(store, r, TurnConfig(workload="v"), connect=FakeSlicer().connect)
            loop.publish("r1", str(ckpt))
            with loop.subscribe() as sub:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect, sub)
                    await nursery.start(loop.run)
                    yield loop, got
                    nursery.cancel_scope.cancel()
    finally:
        store.close()


async def turn_over(loop: TurnLoop) -> None:
    """Return once no turn is held (at once if none is)."""
    with loop.subscribe() as sub:
        if loop._current is None:
            return
        async for e in sub:
            if e["event"] == "released":
                return


def restart(fake: FakeVllm) -> None:
    """What a replica restarted by its launcher looks like: its boot weights."""
    fake.version = "default"
    fake.loaded_path = None


def problems(got: list[dict[str, Any]]) -> list[str | None]:
    return [e["what"] for e in got if e["event"] == "problem"]


async def test_a_replica_restarted_between_turns_is_reloaded_before_serving(
    tmp_path: Path,
) -> None:
    fake = FakeVllm()
    with trio.fail_after(30):
        async with running_loop(tmp_path, fake) as (loop, got):
            p = await loop.accept("completion", dict(BODY))
            assert (await loop.wait_result(p.id, 10)).status == "done"
            assert loop.replica.known_version == "r1"
            await turn_over(loop)
            restart(fake)
            p = await loop.accept("completion", dict(BODY))
            res = await loop.wait_result(p.id, 10)
            assert res.status == "done", res  # was: pending until its deadline
            assert res.body is not None and versions(res.body) == {"r1"}
            assert fake.calls.count("POST /collective_rpc") == 2  # reloaded whole
            assert "weight_version" not in loop.counters.rejects  # seen before serving
            loop._refresh_health()  # as /status and the ticker do
            assert loop.status()["problem"] is None and loop.not_ready() is None
            await trio.testing.wait_all_tasks_blocked()  # every event collected
    said = problems(got)
    assert foreign_weights("http://vllm", "r1") in said, said
    assert said[-1] is None  # cleared once r1 was loaded again


async def test_a_replica_restarted_mid_turn_ends_the_turn_and_is_reloaded(
    tmp_path: Path,
) -> None:
    fake = FakeVllm()
    n = MAX_WEIGHT_REFUSALS + 1
    with trio.fail_after(30):
        async with running_loop(tmp_path, fake) as (loop, got):
            # The first answer comes from r1, then the replica is a new process.
            fake.on_complete = lambda: (restart(fake), setattr(fake, "on_complete", None))
            ids = [(await loop.accept("completion", dict(BODY))).id for _ in range(n)]
            for id in ids:
                res = await loop.wait_result(id, 10)
                assert res.status == "done", res  # was: pending until its deadline
                assert res.body is not None and versions(res.body) == {"r1"}
            assert loop.counters.rejects["weight_version"] == MAX_WEIGHT_REFUSALS
            assert loop.counters.turn_errors == 0  # ended as a replica error, not a crash
            assert fake.calls.count("POST /collective_rpc") == 2
            loop._refresh_health()
            assert loop.status()["problem"] is None
            await trio.testing.wait_all_tasks_blocked()
    released = [e["reason"] for e in got if e["event"] == "released"]
    assert released[0] == "replica-error", released
    said = problems(got)
    assert foreign_weights("http://vllm", "r1") in said, said
    assert said[-1] is None


@pytest.mark.integration
async def test_a_launcher_restarted_between_turns_serves_the_loaded_revision_again() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            async with dispatcher(stack, url) as (d, http):
                await publish(stack, http, "r1")
                async with replica(stack, port=port):
                    r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
                    assert r.status_code == 200 and versions(r.json()) == {"r1"}, r.text
                # The same command again (systemd's Restart=always): same URL, new process.
                async with replica(stack, port=port) as (lw2, _):
                    with trio.fail_after(40):  # was: no answer until the sample deadline
                        r = await http.post(
                            "/v1/completions", json={"prompt": "b", "max_tokens": 4}
                        )
                    assert r.status_code == 200 and versions(r.json()) == {"r1"}, r.text
                    assert stub_reloads(lw2, "r1") >= 1  # the new process loaded r1 whole
                    st = await until_problem(http, lambda p: p is None)
                    assert st["loaded_revision"] == "r1", st
                    assert st["counters"]["rejects"].get("weight_version", 0) < (
                        MAX_WEIGHT_REFUSALS
                    ), st
                    assert (await ready(http)) == (200, {"ready": True})
                    st = await status(http)
                    assert st["counts"] == {"pending": 0, "done": 2, "failed": 0}, st
                    await stop(d)
            assert stack.overlaps() == 0


async def test_a_workload_that_left_slicerd_ends_the_held_turn(tmp_path: Path) -> None:
    """The probe found slicerd lists no such workload mid-turn (its launcher died and
    slicerd dropped the turn): the turn is marked failed at once, told as the workload's
    problem (not "replica unhealthy"), and the next turn recovers the replica."""
    store = Store(tmp_path / "state", "pool-a")
    try:
        with trio.fail_after(10):
            async with Replica("http://vllm", transport=httpx.MockTransport(FakeVllm())) as r:
                loop = TurnLoop(store, r, TurnConfig(workload="v"))  # never run
                cur = TurnState(Turn("v", 9, False, 0))
                loop._current = cur
                loop.recovery.needed = False
                loop.recovery.workload_lost()
                assert cur.replica_failed == "workload v left slicerd during the turn"
                assert loop.recovery.told(cur) and not loop.recovery.told(cur)  # asked once
                loop._current = None
                r.known_version = "r1"
                loop.recovery.forget("GET /health: ConnectError")  # a failed probe between turns
                assert loop.recovery.needed and r.known_version is None
    finally:
        store.close()
