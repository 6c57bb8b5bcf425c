"""A step's fan-out at once: 20,000 samples through the batch route are journaled, served
and committed, with bounded memory and nothing timed out (issue 14, item 4).

The replica is the vLLM stub in fast mode (``--tokens-per-s inf``: every token at once;
``--http-server lean``), so the dispatcher, not the replica, carries the load. Nothing
here is timed: the figures are the bench's (``bench/dispatch.py``, its burst phase); the
test is bounded by ``trio.fail_after`` only.
"""

from __future__ import annotations

from typing import Any

import httpx
import psutil
import pytest
import trio

from tests.harness import running_stack
from tests.test_dispatcher import dispatcher, publish, replica, status, stop, versions

pytestmark = pytest.mark.integration

BURST = 20_000
BATCH = 2_000  # requests per POST /v1/samples/batch: ten calls, all in flight at once
RSS_GROWTH_BOUND = 300 * 2**20  # generous: catches growth per request, not a cache
RSS_EVERY_S = 0.05
FAST = ("--tokens-per-s", "inf", "--http-server", "lean")


def sample_body(i: int) -> dict[str, Any]:
    """A short sample (one token), its text naming its index."""
    return {"prompt": f"burst {i}", "max_tokens": 1, "return_weight_versions": True}


async def submit(http: httpx.AsyncClient, first: int, count: int) -> list[str]:
    """Submit samples ``first .. first+count-1`` in one batch call; their ids in order."""
    body = {"requests": [sample_body(i) for i in range(first, first + count)]}
    r = await http.post("/v1/samples/batch", json=body)
    assert r.status_code == 202, r.text[:500]
    samples = r.json()["samples"]
    assert len(samples) == count
    assert all(s["status"] == "pending" and s["revision"] == "r1" for s in samples)
    return [s["id"] for s in samples]


async def results(http: httpx.AsyncClient, ids: list[str], wait: float) -> list[dict[str, Any]]:
    """``POST /v1/samples/results`` until none of ``ids`` is pending (``wait`` 0: once)."""
    out: dict[str, dict[str, Any]] = {}
    left = ids
    while left:
        r = await http.post("/v1/samples/results", json={"ids": left, "wait": wait})
        assert r.status_code == 200, r.text[:500]
        got = r.json()["results"]
        assert [x["id"] for x in got] == left  # in the order asked
        out.update((x["id"], x) for x in got if x["status"] != "pending")
        if wait == 0:
            return [out.get(i, {"id": i, "status": "pending"}) for i in ids]
        left = [i for i in left if i not in out]
    return [out[i] for i in ids]


class PeakRss:
    """The highest RSS of a process seen by :meth:`run` (sampling: the bound is on the
    peak, which no single later reading shows)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.start = self.peak = self.proc.memory_info().rss

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            await trio.sleep(RSS_EVERY_S)


def assert_done_for_r1(got: list[dict[str, Any]], ids: list[str]) -> None:
    assert [x["id"] for x in got] == ids
    bad = [x for x in got if x["status"] != "done" or x["revision"] != "r1"]
    assert not bad, f"{len(bad)} not done for r1, e.g. {bad[0]}"
    assert all(versions(x["result"]) == {"r1"} for x in got)


async def test_a_burst_of_20000_is_journaled_served_and_committed_in_bounded_memory() -> None:
    with trio.fail_after(900):
        async with running_stack() as stack, replica(stack, "cooperative", *FAST) as (_, url):
            async with dispatcher(stack, url) as (d, http):
                await publish(stack, http, "r1")
                before = await status(http)
                rss = PeakRss(d.proc.pid)
                ids: dict[int, list[str]] = {}
                got: dict[int, list[dict[str, Any]]] = {}

                async def one(first: int) -> None:
                    ids[first] = await submit(http, first, BATCH)
                    got[first] = await results(http, ids[first], wait=20)

                async with trio.open_nursery() as sampler:
                    sampler.start_soon(rss.run)
                    async with trio.open_nursery() as nursery:
                        for first in range(0, BURST, BATCH):
                            nursery.start_soon(one, first)
                    sampler.cancel_scope.cancel()

                every = [i for first in sorted(ids) for i in ids[first]]
                assert len(set(every)) == BURST
                for first in ids:
                    assert_done_for_r1(got[first], ids[first])
                after = await status(http)
                b, a = before["counters"], after["counters"]
                assert a["commits"] - b["commits"] == BURST
                for name in ("expired", "send_errors", "turn_errors"):
                    assert a[name] == b[name] == 0, (name, a)
                assert not a["rejects"], a["rejects"]  # no weight check ran out of time
                assert after["counts"]["pending"] == 0 and after["counts"]["failed"] == 0
                growth = rss.peak - rss.start
                assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.0f} MiB"
                await stop(d)

            # Committed means journaled: a restarted dispatcher still has every result.
            async with dispatcher(stack, url) as (d, http):
                for first in range(0, BURST, BATCH):
                    assert_done_for_r1(await results(http, ids[first], wait=0), ids[first])
                await stop(d)
            assert stack.overlaps() == 0
