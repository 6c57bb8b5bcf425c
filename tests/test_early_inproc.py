"""Early starts in the real server, in-process (`tests/inproc.py`, virtual time): the
census decides. By pids, a head that asked ``early=`` is told EARLY once the workload in
its way is locked, and granted after its checkpoint; by elimination (slicerd in a pod) its
early bytes would be charged to the workload being parked, so the freeze is declined and
the park goes as without (no EARLY)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from gpu_slicer import proto
from tests.inproc import GiB, inproc_server

BOUND = 60  # virtual seconds


def fields(line: str) -> dict[str, str]:
    reply = proto.parse_server_line(line.encode())
    assert isinstance(reply, proto.Ok), line
    return dict(reply.fields)


@pytest.mark.parametrize("census", ["pids", "elimination"])
async def test_the_census_decides_whether_a_head_starts_early(
    tmp_path: Path, autojump_clock: trio.abc.Clock, census: str
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, census=census) as s:
            s.host.spawn(101)  # a: a trainer (checkpoint)
            s.host.spawn(102)  # b: a replica (cooperative, may be checkpointed)
            reg_a, reg_b = await s.client(), await s.client()
            await reg_a.ask("REGISTER a pid=101")
            await reg_b.ask(
                "REGISTER b pid=102 park=cooperative parked_max=1GiB fallback=checkpoint"
            )
            da, db = await s.client(), await s.client()
            t = fields(await db.ask("ACQUIRE b"))["turn"]  # b runs once and parks itself
            await db.ask(f"RELEASE b turn={t}")
            t = fields(await da.ask("ACQUIRE a"))["turn"]
            s.gpu.load(101, 30 * GiB)  # a trains
            await db.send(f"ACQUIRE b early={4 * GiB}")
            assert await da.line() == f"WAITING a turn={t} waiters=1"
            await da.send(f"RELEASE a turn={t}")
            first = await db.line()
            if census == "pids":
                assert first == f"EARLY b bytes={4 * GiB}"
                first = await db.line()
            granted = fields(first)
            if census == "pids":  # locked first (then EARLY), checkpointed before the grant
                assert s.parker.actions == [("lock", [101]), ("checkpoint", [101])]
            else:
                assert s.parker.actions == [] and s.parker.parks == [[101]]
            assert granted["restored"] == "1"
            assert fields(await da.line())["parked"] == "1"
            st = await s.status()
            assert st["totals"]["earlies"] == (1 if census == "pids" else 0)
            assert st["census"] == census
            a = await s.workload("a")
            assert a["state"] == "parked" and a["parked_pids"] == [101]
