"""Wasted turns back the next ACQUIRE off: whatever makes a turn useless, the trainer is
parked a bounded number of times an hour.

In process over the fake vLLM (slicerd faked: every ACQUIRE granted at once), in virtual
time (``autojump_clock``): an hour of a replica whose every wake fails runs in a blink.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
import trio.testing

from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import WASTE_BACKOFF_MAX_S, TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from tests.test_dispatcher_model import FakeSlicer
from tests.test_dispatcher_vllm import FakeVllm

HOUR = 3600.0


class WakeFails(FakeVllm):
    """A replica that answers its probes and refuses every wake (a broken engine)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/wake_up":
            self.calls.append("POST /wake_up")
            return httpx.Response(500, json={"error": {"message": "CUDA error: out of memory"}})
        return super().__call__(request)


async def run_for(
    tmp_path: Path, fake: FakeVllm, slicer: FakeSlicer, seconds: float
) -> dict[str, Any]:
    """Run a whole turn loop over ``fake`` for ``seconds`` (virtual) with one request
    pending; its ``/status`` at the end."""
    store = Store(tmp_path / "state", "pool-a")
    ckpt = tmp_path / "ckpt" / "r1"
    ckpt.mkdir(parents=True)
    (ckpt / "revision.txt").write_text("r1")
    try:
        async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
            cfg = TurnConfig(workload="v", sample_deadline=2 * HOUR)
            loop = TurnLoop(store, r, cfg, connect=slicer.connect)
            loop.publish("r1", str(ckpt))
            async with trio.open_nursery() as nursery:
                await nursery.start(loop.run)
                await loop.accept("completion", {"prompt": "hi", "max_tokens": 4})
                await trio.sleep(seconds)
                st = loop.status()
                nursery.cancel_scope.cancel()
            return st
    finally:
        store.close()


async def test_a_replica_whose_wake_always_fails_costs_a_dozen_turns_an_hour(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    slicer = FakeSlicer()
    st = await run_for(tmp_path, WakeFails(), slicer, HOUR)
    c = st["counters"]
    # 1 s doubling to 300 s: 10 turns in the first 512 s, then one every 300 s (+ the
    # turn errors' own backoff of up to 5 s each).
    assert c["turns"] == slicer.granted == c["wasted_turns"], c
    assert slicer.granted <= 10 + (HOUR - 512) // WASTE_BACKOFF_MAX_S + 1, slicer.granted
    # Each RELEASE tells slicerd so (`used=0`): it counts them against this workload.
    assert slicer.used == [False] * slicer.granted, slicer.used
    assert st["counts"]["pending"] == 1  # nothing is lost meanwhile
    assert st["state"] == "backoff", st["state"]


async def test_a_turn_that_serves_resets_the_backoff(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    slicer = FakeSlicer()
    st = await run_for(tmp_path, FakeVllm(), slicer, 60)
    assert st["counts"]["done"] == 1 and st["counters"]["wasted_turns"] == 0, st
    assert slicer.granted == 1
    assert slicer.used == [True]
