"""A line from slicerd that breaks the protocol (a malformed line, a reply nobody asked
for: `proto.RemoteProtocolError`) costs the dispatcher its connection, never its turn
loop: the turn in hand ends as every turn does (vLLM put to sleep), the connection is
dropped, the failure is published, and the next turn, on a new connection, serves what
waits. In process: a turn loop over the fake vLLM and a fake slicerd whose session fails
at one call, as the real client's does (every later call on that connection raises the
same error; a new connection works).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from gpu_slicer.slicer.client import Turn
from tests.test_dispatcher_model import FakeSlicer, store_and_r1
from tests.test_dispatcher_vllm import FakeVllm

BAD = "malformed line from slicerd: 'GRANTED?? 7'"


class BreakingSlicer(FakeSlicer):
    """A `FakeSlicer` whose session fails once, at the call `where` (``acquire``,
    ``release``, or ``event``: the read of slicerd's lines during a turn)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.failed: str | None = None  # the failure every call of this connection raises
        self.tripped = False
        self.connects = self.closes = 0

    async def connect(self) -> Any:
        self.connects += 1
        self.failed = None
        return self

    def _call(self, here: str) -> None:
        if self.failed is None and here == self.where and not self.tripped:
            self.tripped, self.failed = True, BAD
        if self.failed is not None:
            raise proto.RemoteProtocolError(proto.ErrorCode.BAD_REQUEST, self.failed)

    async def acquire(self, workload: str, wait: float | None = None, early: int = 0) -> Turn:
        self._call("acquire")
        return await super().acquire(workload, wait)

    async def release(self, turn: Turn, park: str = "lazy", used: bool = True) -> dict[str, str]:
        self._call("release")
        return await super().release(turn, park, used)

    async def next_message(self, timeout: float | None = None) -> Any:
        self._call("event")
        await trio.sleep_forever()

    async def aclose(self) -> None:
        self.closes += 1


@pytest.mark.parametrize("early", [0, 1 << 30], ids=["plain", "early"])
@pytest.mark.parametrize("where", ["acquire", "event", "release"])
async def test_a_line_that_breaks_the_protocol_drops_the_connection_not_the_loop(
    tmp_path: Path, autojump_clock: Any, where: str, early: int
) -> None:
    """``early``: every ACQUIRE asks for an early start (``early=``), none comes."""
    fake, slicer = FakeVllm(), BreakingSlicer(where)
    store, ckpt = store_and_r1(tmp_path)
    got: list[dict[str, Any]] = []
    try:
        async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
            cfg = TurnConfig(workload="v", early_start=early)
            loop = TurnLoop(store, r, cfg, connect=slicer.connect)
            loop.publish("r1", str(ckpt))
            with trio.fail_after(120), loop.subscribe() as sub:
                async with trio.open_nursery() as nursery:
                    await nursery.start(loop.run)

                    async def record() -> None:
                        async for e in sub:
                            got.append(e)

                    nursery.start_soon(record)
                    for k in range(2):
                        p = await loop.accept("completion", {"prompt": [k], "max_tokens": 2})
                        result = await loop.wait_result(p.id, 60)
                        assert result.status == "done", result
                    nursery.cancel_scope.cancel()
    finally:
        store.close()
    assert slicer.tripped
    assert slicer.connects == 2 and slicer.closes >= 1  # dropped, then a new connection
    # Every turn granted was released or ended with its connection, vLLM asleep after it.
    assert fake.calls.count("POST /sleep") >= slicer.granted - (where == "acquire")
    told = [e for e in got if BAD in str(e.get("error", ""))]
    assert told, [e for e in got if e["event"] != "phase"]
    assert loop.phase.value in ("idle", "backoff")
