"""Parked means parked, checked: a replica counts as parked only when its memory is gone
(or checkpointed), never because it says it sleeps and what it still holds is under a
size threshold.

A holder (a dispatcher) that dies between its two wakes (``/wake_up?tags=weights`` done,
``tags=kv_cache`` not) leaves vLLM half-woken: it says it is sleeping (part of it is), so
a plain ``/sleep`` does nothing, and its weights (2 GiB in the stub) fit under the
launcher's ``parked_max`` (4 GiB). Here the real stack (slicerd on the fake GPU, the vLLM
stub under ``slicer-launch vllm`` at sleep level 1 and 2) checks that the workload granted
next runs alone: it puts 60 GiB on the GPU and the ledger counts no overlap.

Every wait is event-driven and bounded (lines the processes print, WATCH), under
``trio.fail_after``; every stack asserts zero GPU overlaps.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.harness import Stack, running_stack, workload
from tests.test_assume_nothing import launched

pytestmark = pytest.mark.integration


async def granted_alone(stack: Stack) -> None:
    """Another workload ("t") is granted the GPU and takes 60 GiB of it: the ledger must
    see nobody else resident (what a park that did not hold would leave)."""
    async with await stack.client() as t:
        pid = stack.sleeper()
        await t.register("t", pid=pid, park="cooperative", parked_max="1GiB")
        got = await t.acquire("t")
        stack.ledger.alloc(pid, 0, 60 << 30, tag="weights", workload="t")
        assert stack.overlaps() == 0, stack.ledger.overlap_log()
        stack.ledger.free(pid)
        await t.release(got)


async def half_woken(stack: Stack, http: httpx.AsyncClient) -> None:
    """Take v's turn as its dispatcher would, wake its weights only, and die (the
    connection closes mid-turn: slicerd asks v's launcher to park it)."""
    async with await stack.client() as holder:
        turn = await holder.acquire("v")
        r = await http.post("/wake_up?tags=weights")
        assert r.status_code == 200 and r.json()["status"] == "sleeping", r.text
        assert (await http.get("/is_sleeping")).json()["is_sleeping"] is True
        assert turn.turn > 0


@pytest.mark.parametrize("level", ["1", "2"])
async def test_a_half_woken_replica_is_never_taken_for_parked(level: str) -> None:
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            launched(stack, "--sleep-level", level) as (lw, url),
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            await half_woken(stack, http)
            await granted_alone(stack)
            assert "waking it fully, then sleeping it" in lw.output()
            v = workload(await stack.status(), "v") or {}
            assert v["state"] == "parked" and v["faults"] == 0, v
            assert stack.overlaps() == 0


async def test_a_park_never_sleeps_a_replica_deeper_than_it_was_found() -> None:
    # Its holder loaded weights, slept the replica at level 1 (weights kept in host
    # memory, as it believes) and died before its RELEASE. The launcher runs at
    # --sleep-level 2: its park must not discard the weights behind the holder's back
    # (a dispatcher that keeps that belief wakes plainly and serves them).
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            launched(stack, "--sleep-level", "2") as (lw, url),
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            body = {"prompt": "the same words", "max_tokens": 8, "seed": 3}
            (stack.base / "r1").mkdir()
            (stack.base / "r1" / "revision.txt").write_text("r1")
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(stack.base / "r1")}}
            async with await stack.client() as holder:
                await holder.acquire("v")
                assert (await http.post("/wake_up")).status_code == 200
                assert (await http.post("/collective_rpc", json=rpc)).status_code == 200
                first = (await http.post("/v1/completions", json=body)).json()
                assert (await http.post("/sleep?level=1")).status_code == 200
            await granted_alone(stack)  # parked by its launcher first
            assert "sleeping it at level 1 again, not deeper" in lw.output()
            async with await stack.client() as holder:
                turn = await holder.acquire("v")
                assert (await http.post("/wake_up")).status_code == 200
                again = (await http.post("/v1/completions", json=body)).json()
                assert (await http.post("/sleep?level=1")).status_code == 200
                await holder.release(turn, park="now")
            assert again["choices"][0]["text"] == first["choices"][0]["text"], (first, again)
            assert stack.overlaps() == 0


async def test_a_holders_sleep_that_freed_nothing_is_not_a_park() -> None:
    # A live holder (a client whose KV-cache wake broke) leaves the replica half-woken,
    # sleeps it (vLLM: a no-op 200, it says it is sleeping already) and RELEASEs
    # park=now. Its weights (2 GiB) fit under the launcher's parked_max (4 GiB), so by
    # size alone it counted as parked and the next workload ran beside them. slicerd holds
    # it to the least residue a park of it left (its parked floor, learnt at the boot
    # park): it asks the launcher (which wakes it fully, then sleeps it), and only then
    # grants.
    gib = 1 << 30
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            launched(stack) as (lw, url),
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            v = workload(await stack.status(), "v") or {}
            floor = v["parked_floor"]
            assert isinstance(floor, int) and floor < gib, v  # the boot park's residue
            async with await stack.client() as holder:
                turn = await holder.acquire("v")
                r = await http.post("/wake_up?tags=weights")
                assert r.status_code == 200 and r.json()["status"] == "sleeping", r.text
                r = await http.post("/sleep?level=1")  # a no-op: vLLM says it sleeps
                assert r.status_code == 200, r.text
                await holder.release(turn, park="now")
            await granted_alone(stack)
            assert "waking it fully, then sleeping it" in lw.output()
            assert "more on the GPU than its parked floor" in lw.output()
            v = workload(await stack.status(), "v") or {}
            assert v["state"] == "parked" and v["faults"] == 0, v
            assert v["parked_floor"] == floor, v
            assert stack.overlaps() == 0
