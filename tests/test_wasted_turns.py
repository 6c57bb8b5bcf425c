"""slicerd counts wasted turns per workload: a turn released `used=0` after a park (or a
restore) was paid for its grant; an unused turn nobody paid for is counted apart, and a
RELEASE without `used=` counts as used."""

from __future__ import annotations

import pytest
import trio

from tests.harness import GiB, running_stack, workload
from tests.test_server_basic import raw_exchange

pytestmark = pytest.mark.integration


async def test_a_turn_released_unused_after_a_park_is_counted_wasted() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            a_pid, b_pid = stack.sleeper(), stack.sleeper()
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("trainer", pid=a_pid)
            await reg_b.register("sampler", pid=b_pid, parked_max="1GiB")
            ca, cb = await stack.client(), await stack.client()
            t1 = await ca.acquire("trainer")
            stack.ledger.alloc(a_pid, 0, 30 * GiB, workload="trainer")
            turns = {}

            async def take_b() -> None:
                turns["b"] = await cb.acquire("sampler")

            async with trio.open_nursery() as n:
                n.start_soon(take_b)
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["sampler"])
                await ca.release(t1)
            # The trainer was parked for this turn; the sampler did nothing with it.
            await cb.release(turns["b"], used=False)
            st = await stack.status()
            s, t = workload(st, "sampler"), workload(st, "trainer")
            assert s is not None and t is not None
            assert (s["unused_turns"], s["wasted_turns"]) == (1, 1)
            assert (t["unused_turns"], t["wasted_turns"]) == (0, 0)
            assert t["parks"] == 1 and st["totals"]["wasted_turns"] == 1
            # Again, with nobody parked for it (the sampler stayed resident): unused, not
            # wasted; then a used turn changes neither count.
            t3 = await cb.acquire("sampler")
            assert not t3.restored
            await cb.release(t3, used=False)
            await cb.release(await cb.acquire("sampler"))
            st = await stack.status()
            s = workload(st, "sampler")
            assert s is not None and (s["unused_turns"], s["wasted_turns"]) == (2, 1)
            assert st["totals"]["wasted_turns"] == 1
            assert workload(st, "trainer")["parks"] == 1  # type: ignore[index]
            for c in (ca, cb, reg_a, reg_b):
                await c.aclose()
            assert stack.overlaps() == 0


async def test_a_bad_used_value_is_refused_and_ends_no_turn() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, await stack.client() as reg:
            await reg.register("w", pid=stack.sleeper())
            t = await reg.acquire("w")
            replies = await raw_exchange(
                stack.socket, [f"RELEASE w turn={t.turn} used=maybe\n".encode()]
            )
            assert replies[0].startswith(b"ERR bad-argument"), replies
            st = await stack.status()
            assert st["gpus"][0]["holder"] == {"workload": "w", "turn": t.turn}
            assert workload(st, "w")["unused_turns"] == 0  # type: ignore[index]
            await reg.release(t)
