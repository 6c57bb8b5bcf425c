"""Early starts against the real daemon (`slicer.early`): a waiter that asked
``ACQUIRE v early=N`` is told ``EARLY`` once the workload in its way is locked and N bytes
fit beside it; it may allocate them while that workload is checkpointed, and its grant
follows the verified park. An early start abandoned (its connection closed) or cut by a
daemon SIGKILL is parked by cuda-checkpoint before anyone else is granted. The trainer's
checkpoint is held with the fake GPU's hang injection, so every step is observed in
order, never timed; the fake GPU counts two running residents as an overlap (a locked
one runs nothing) and refuses an allocation past capacity."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, Turn
from tests.harness import (
    GiB,
    Stack,
    event_index,
    events_until,
    next_of,
    queue_is,
    running_stack,
    state_of,
    workload,
)

pytestmark = pytest.mark.integration

EARLY = 4 * GiB
CONTEXT = 512 * 1024**2


async def trainer_then_parked_replica(
    stack: Stack,
) -> tuple[int, int, AsyncSlicer, Turn, AsyncSlicer]:
    """`t` (30 GiB, park=checkpoint) holds the GPU; `v` (a replica-like sleeper keeping a
    512 MiB context, cooperative, checkpoint fallback) took one turn and parked itself.
    Returns their pids, t's connection, t's turn and v's registrant (its launcher)."""
    pt, pv = stack.sleeper(30 * GiB, label="t"), stack.sleeper()
    stack.ledger.alloc(pv, 0, CONTEXT, tag="context", workload="v", allowance=CONTEXT)
    rt, rv = await stack.client(), await stack.client()
    await rt.register("t", pid=pt)
    await rv.register("v", pid=pv, park="cooperative", parked_max="1GiB", fallback="checkpoint")
    async with await stack.client() as dv:
        await dv.release(await dv.acquire("v"))
    tt = await rt.acquire("t")  # v, idle, is in the way: verified parked (its context only)
    assert workload(await stack.status(), "v")["state"] == "parked"  # type: ignore[index]
    return pt, pv, rt, tt, rv


async def told_early(stack: Stack, dv: AsyncSlicer, rt: AsyncSlicer, tt: Turn, pt: int) -> Any:
    """v's dispatcher asks early while t holds; t's checkpoint is held (hang injection);
    t releases: returns once v got EARLY (t locked, its checkpoint under way)."""
    stack.ledger.inject(pt, "checkpoint", hang=True)
    await stack.until(queue_is(["v"]))
    reply = await rt.release(tt)  # answered once t is locked: its memory need not wait
    assert reply["parked"] == "1"
    early = await next_of(dv, proto.Early)
    assert (early.workload, early.nbytes) == ("v", EARLY)
    assert stack.ledger.state(pt) == "locked"
    st = await stack.status()
    assert workload(st, "t")["state"] == "parking"  # type: ignore[index]
    assert workload(st, "v")["early"] == EARLY  # type: ignore[index]
    assert st["gpus"][0]["holder"] is None and st["totals"]["earlies"] == 1
    return st


async def test_the_head_runs_its_first_stage_while_the_trainer_is_checkpointed() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pt, pv, rt, tt, rv = await trainer_then_parked_replica(stack)
            before = workload(await stack.status(), "t")
            assert before is not None
            dv = await stack.client()
            granted: list[Turn] = []

            async def acquire() -> None:
                granted.append(await dv.acquire("v", early=EARLY))

            async with trio.open_nursery() as n:
                n.start_soon(acquire)
                await told_early(stack, dv, rt, tt, pt)
                # v's first stage (vLLM: its weights) beside the locked trainer
                stack.ledger.alloc(pv, 0, EARLY, tag="weights", workload="v")
                assert stack.overlaps() == 0 and not granted
                stack.ledger.clear_injection(pt)  # the checkpoint goes on
            (tv,) = granted
            assert stack.ledger.state(pt) == "checkpointed"
            stack.ledger.alloc(pv, 0, 40 * GiB, tag="kv", workload="v")  # the rest, once granted
            for tag in ("kv", "weights"):
                stack.ledger.free(pv, tag)  # its sleep
            await dv.release(tv)
            tt = await rt.acquire("t")
            assert tt.restored and stack.ledger.state(pt) == "running"
            st = await stack.status()
            assert workload(st, "v")["early"] == 0  # type: ignore[index]
            after = workload(st, "t")
            assert after is not None and after["parks"] == before["parks"] + 1  # one park
            assert after["freezes"] == 1 and st["totals"]["earlies"] == 1
            await rt.release(tt)
            for c in (dv, rt, rv):
                await c.aclose()


async def test_no_early_start_when_the_bytes_do_not_fit_beside_the_trainer() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pt, _pv, rt, tt, rv = await trainer_then_parked_replica(stack)
            dv = await stack.client()
            async with trio.open_nursery() as n:
                got: list[Turn] = []

                async def acquire() -> None:
                    got.append(await dv.acquire("v", early=60 * GiB))  # 30 + 60 > 80

                n.start_soon(acquire)
                await stack.until(queue_is(["v"]))
                await rt.release(tt)
            assert got and stack.ledger.state(pt) == "checkpointed"
            assert not [m for m in dv.events if isinstance(m, proto.Early)]
            assert (await stack.status())["totals"]["earlies"] == 0
            for c in (dv, rt, rv):
                await c.aclose()


async def test_an_abandoned_early_start_is_checkpointed_before_the_trainer_runs() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pt, pv, rt, tt, rv = await trainer_then_parked_replica(stack)
            seen: list[dict[str, Any]] = []
            async with await stack.client() as watch:
                await watch.request(proto.Watch())
                dv = await stack.client()
                async with trio.open_nursery() as n:
                    n.start_soon(dv.acquire, "v", None, EARLY)
                    await told_early(stack, dv, rt, tt, pt)
                    stack.ledger.alloc(pv, 0, EARLY, tag="weights", workload="v")
                    n.cancel_scope.cancel()
                await dv.aclose()  # its dispatcher died mid-way: nobody ends the wake
                await stack.until(state_of("v", "idle"))
                stack.ledger.clear_injection(pt)
                ta = await rt.acquire("t")
                await events_until(watch, lambda e: e["event"] == "granted", seen)
            assert ta.restored and stack.ledger.state(pv) == "checkpointed"
            assert event_index(seen, "early-abandoned", "v") < event_index(seen, "parked", "v")
            assert event_index(seen, "parked", "v") < event_index(seen, "granted", "t")
            w = workload(await stack.status(), "v")
            assert w is not None and w["parked_pids"] == [pv] and w["early"] == 0
            await rt.aclose()
            await rv.aclose()


async def test_a_daemon_killed_during_an_early_start_parks_the_head_after_restart() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack:
            pt, pv, rt, tt, rv = await trainer_then_parked_replica(stack)
            dv = await stack.client()
            async with trio.open_nursery() as n:
                n.start_soon(dv.acquire, "v", None, EARLY)
                await told_early(stack, dv, rt, tt, pt)
                n.cancel_scope.cancel()
            await stack.stop(signal.SIGKILL)
            # The wake goes on after the daemon died; the held checkpoint ends too.
            stack.ledger.alloc(pv, 0, EARLY, tag="weights", workload="v")
            stack.ledger.clear_injection(pt)
            for c in (dv, rt, rv):
                await c.aclose()
            await stack.start()
            await stack.until(state_of("t", "parked"))  # recovery finished t's park
            st = await stack.status()
            v = workload(st, "v")
            assert v is not None and v["state"] == "idle" and v["early"] == EARLY
            rv, rt = await stack.client(), await stack.client()
            await rv.register(
                "v", pid=pv, park="cooperative", parked_max="1GiB", fallback="checkpoint"
            )  # its launcher adopts it: still dirty, parked before anyone runs
            await rt.register("t", pid=pt)
            tt = await rt.acquire("t")
            assert tt.restored and stack.ledger.state(pv) == "checkpointed"
            assert stack.ledger.state(pt) == "running"
            await rt.release(tt)
            for c in (rv, rt):
                await c.aclose()
