"""Early starts in the real server, in-process (`tests/inproc.py`, virtual time): the
census decides. By pids, a head that asked ``early=`` is told EARLY once the workload in
its way is locked, and granted after its checkpoint; by elimination (slicerd in a pod) its
early bytes would be charged to the workload being parked, so the freeze is declined and
the park goes as without (no EARLY)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.journal import JournalError
from tests.inproc import Client, GiB, Stack, inproc_server

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


async def setup_pair(s: Stack) -> tuple[Client, Client, str]:
    """a (a trainer, 30 GiB) holds the GPU; b (a replica that ran once and parked itself)
    asks early while it waits. a's and b's acquiring connections, and a's turn."""
    s.host.spawn(101)
    s.host.spawn(102)
    reg_a, reg_b = await s.client(), await s.client()
    await reg_a.ask("REGISTER a pid=101")
    await reg_b.ask("REGISTER b pid=102 park=cooperative parked_max=1GiB fallback=checkpoint")
    da, db = await s.client(), await s.client()
    t = fields(await db.ask("ACQUIRE b"))["turn"]
    await db.ask(f"RELEASE b turn={t}")
    t = fields(await da.ask("ACQUIRE a"))["turn"]
    s.gpu.load(101, 30 * GiB)
    return da, db, t


async def test_no_early_start_goes_out_while_the_journal_cannot_be_written(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            da, db, t = await setup_pair(s)
            await db.send(f"ACQUIRE b early={4 * GiB}")
            assert (await da.line()).startswith("WAITING")
            journal, write, act = s.server.journal, s.server.journal.write, s.parker.act
            full = [False]

            def full_disk(data: bytes, seq: int) -> int:
                if full[0]:
                    raise JournalError("No space left on device")
                return write(data, seq)

            async def lock_then_fill(pids: list[int], action: str, timeout: float) -> Any:
                out = await act(pids, action, timeout)
                full[0] = full[0] or action == "lock"  # the disk fills once a is locked
                return out

            monkeypatch.setattr(journal, "write", full_disk)
            monkeypatch.setattr(s.parker, "act", lock_then_fill)
            await da.send(f"RELEASE a turn={t}")
            # EARLY is not sent (a crash would not know of it); a's checkpoint waits for
            # the journal too, a staying frozen (locked) meanwhile.
            st = await s.until(
                lambda st: (
                    not st["journal"]["ok"]
                    and any(w["name"] == "a" and w["state"] == "frozen" for w in st["workloads"])
                )
            )
            assert st["totals"]["earlies"] == 0
            full[0] = False
            granted = fields(await db.line())  # the grant, not EARLY
            assert granted["restored"] == "1"
            # Never locked twice: the deferred checkpoint ran on what the freeze locked.
            assert s.parker.actions == [("lock", [101]), ("checkpoint", [101])]
            b = await s.workload("b")
            assert b["early"] == 0


async def test_early_keeps_the_acquire_waiting_past_its_wait_while_the_park_runs(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            da, db, t = await setup_pair(s)
            act = s.parker.act

            async def slow_checkpoint(pids: list[int], action: str, timeout: float) -> Any:
                if action == "checkpoint":
                    await trio.sleep(20)  # a checkpoint far longer than b's wait=
                return await act(pids, action, timeout)

            monkeypatch.setattr(s.parker, "act", slow_checkpoint)
            await db.send(f"ACQUIRE b wait=5 early={4 * GiB}")
            assert (await da.line()).startswith("WAITING")
            await da.send(f"RELEASE a turn={t}")
            assert await db.line() == f"EARLY b bytes={4 * GiB}"
            granted = fields(await db.line())  # not "ERR timeout" at 5 s: told EARLY
            assert granted["restored"] == "1"
            assert (await s.status())["totals"]["earlies"] == 1
