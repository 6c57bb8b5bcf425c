"""Opt-in preemption against the real daemon: a holder that never releases, REGISTERed
with ``max_turn=S``, has its turn taken back once S has passed while another workload
waits (it is parked by checkpoint, told ``PREEMPTED``, and restored at its next turn);
without waiters, or without ``max_turn``, nothing is taken back."""

from __future__ import annotations

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, ClientError
from gpu_slicer.slicer.model import Gpu, Holder, Waiter, Workload
from gpu_slicer.slicer.preempt import due_in
from tests.harness import GiB, Stack, cc_log, next_of, running_stack, workload

pytestmark = pytest.mark.integration


async def next_preempted(client: AsyncSlicer) -> proto.Preempted:
    """The next PREEMPTED line on `client` (WAITING hints before it are skipped)."""
    return await next_of(client, proto.Preempted)


async def hog_holds(
    stack: Stack, max_turn: float | None
) -> tuple[int, AsyncSlicer, AsyncSlicer, proto.Turn]:
    """Workload "hog" (a 30 GiB sleeper, REGISTERed with `max_turn`) granted the GPU,
    "other" (an empty sleeper) REGISTERed beside it: (hog's pid, its client, other's
    client, hog's turn)."""
    hog, other = stack.sleeper(30 * GiB, label="hog"), stack.sleeper()
    reg_h, reg_o = await stack.client(), await stack.client()
    await reg_h.register("hog", pid=hog, max_turn=max_turn)
    await reg_o.register("other", pid=other)
    return hog, reg_h, reg_o, await reg_h.acquire("hog")


async def test_a_holder_that_never_releases_is_preempted_parked_and_restored() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            hog, reg_h, reg_o, t = await hog_holds(stack, max_turn=0.5)
            got: list[proto.Turn] = []
            async with trio.open_nursery() as n:

                async def take() -> None:
                    got.append(await reg_o.acquire("other"))

                n.start_soon(take)
                msg = await next_preempted(reg_h)  # the hog never releases
                assert msg == proto.Preempted("hog", t.turn)
            (to,) = got
            assert stack.ledger.state(hog) == "checkpointed"  # parked before the grant
            st = await stack.status()
            assert st["gpus"][0]["holder"]["workload"] == "other"
            w = workload(st, "hog")
            assert w is not None and w["state"] == "parked" and w["preemptions"] == 1
            assert w["max_turn"] == 0.5 and st["totals"]["preemptions"] == 1
            # its late RELEASE is told what happened, and changes nothing
            with pytest.raises(ClientError) as e:
                await reg_h.release(t)
            assert e.value.code == "not-holder" and "preempted" in str(e.value)
            assert (await stack.status())["gpus"][0]["holder"]["workload"] == "other"
            async with trio.open_nursery() as n:
                n.start_soon(reg_o.release, to)
                t2 = await reg_h.acquire("hog")  # the next turn restores it
            assert t2.restored and stack.ledger.state(hog) == "running"
            ops = [e["op"] for e in cc_log(stack) if e.get("pid") == hog]
            assert ops == ["lock", "checkpoint", "restore", "unlock"]
            await reg_h.release(t2)
            await reg_h.aclose()
            await reg_o.aclose()
            assert stack.overlaps() == 0


async def test_nobody_waiting_means_no_preemption_and_an_overdue_turn_goes_at_once() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            hog, reg_h, reg_o, t = await hog_holds(stack, max_turn=0.3)
            # Held well past max_turn with nobody waiting: nothing happens. (Real time
            # passes here on purpose: the daemon's timer is what is under test.)
            await trio.sleep(0.6)
            st = await stack.status()
            assert st["gpus"][0]["holder"]["turn"] == t.turn
            assert workload(st, "hog")["preemptions"] == 0  # type: ignore[index]
            # Once another waits, the turn (held past S already) is taken back at once.
            async with trio.open_nursery() as n:
                n.start_soon(reg_o.acquire, "other")
                assert (await next_preempted(reg_h)).turn == t.turn
            assert stack.ledger.state(hog) == "checkpointed"
            await reg_h.aclose()
            await reg_o.aclose()
            assert stack.overlaps() == 0


async def test_without_max_turn_a_waiter_only_gets_the_holder_a_waiting_hint() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            _, reg_h, reg_o, t = await hog_holds(stack, max_turn=None)
            with pytest.raises(ClientError) as e:
                await reg_o.acquire("other", wait=1.0)
            assert e.value.code == "timeout"
            assert isinstance(await reg_h.next_message(), proto.Waiting)
            st = await stack.status()
            assert st["gpus"][0]["holder"]["turn"] == t.turn and st["totals"]["preemptions"] == 0
            await reg_h.release(t)
            await reg_h.aclose()
            await reg_o.aclose()
            assert stack.overlaps() == 0


def test_max_turn_is_refused_for_a_cooperative_workload_before_it_is_sent() -> None:
    # The server refuses the line too (tests/test_server_basic.py BAD_INPUT).
    session = proto.ClientSession("v")
    with pytest.raises(proto.ProtocolError, match="max_turn needs park=checkpoint"):
        session.register(pid=1, park="cooperative", max_turn=5)
    assert session.data_to_send() == b""


@pytest.mark.parametrize(
    ("since", "max_turn", "park", "waiting", "expected"),
    [
        (0.0, 5.0, "checkpoint", True, 3.0),  # due in 3 s
        (0.0, 1.0, "checkpoint", True, 0.0),  # overdue: now
        (0.0, None, "checkpoint", True, None),  # not opted in
        (0.0, 1.0, "cooperative", True, None),  # the slicer cannot park it itself
        (0.0, 1.0, "checkpoint", False, None),  # nobody else waits
    ],
)
def test_due_in(
    since: float, max_turn: float | None, park: str, waiting: bool, expected: float | None
) -> None:
    def wl(wid: int, name: str) -> Workload:
        return Workload(wid, name, 0, 100 + wid, 0.0, True, park, 0, 0, None, max_turn=max_turn)

    gpu = Gpu(0, "GPU-0")
    holder = wl(1, "hog")
    gpu.holder = Holder(conn=1, workload=holder, turn=1, since=since)
    if waiting:
        other = wl(2, "other")
        gpu.queue[2] = Waiter(conn=2, workload=other, since=1.0)
        gpu.waiting[other.wid] = 1
    assert due_in(gpu, 2.0) == expected


async def test_a_turn_block_whose_turn_was_taken_back_ends_without_an_error() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            hog, other = stack.sleeper(30 * GiB, label="hog"), stack.sleeper()
            reg_h, reg_o = await stack.client(), await stack.client()
            await reg_h.register("hog", pid=hog, max_turn=0.3)
            await reg_o.register("other", pid=other)
            async with trio.open_nursery() as n, reg_h.turn("hog") as t:
                n.start_soon(reg_o.acquire, "other")
                assert (await next_preempted(reg_h)).turn == t.turn
                # the release found the turn taken back: no error, the block is over
            st = await stack.status()
            assert st["gpus"][0]["holder"]["workload"] == "other"
            assert workload(st, "hog")["state"] == "parked"  # type: ignore[index]
            await reg_h.aclose()
            await reg_o.aclose()
            assert stack.overlaps() == 0
