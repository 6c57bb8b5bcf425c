"""The census by elimination, in the real server (slicerd in a pod: backend pids unreadable).

`census = "elimination"` is forced: the fake GPU still names pids, and none of them may
be used. Parks are verified by the GPU's total against the workloads' `parked_max`
budgets, cuda-checkpoint is handed the processes of the tree that hold the GPU's device
node open, and memory beyond the budgets with nobody to charge blocks every grant.
In-process (`tests/inproc.py`) on virtual time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.state import Limits
from tests.inproc import Client, GiB, Stack, inproc_server

BOUND = 60  # virtual seconds
MiB = 1024**2
BLIND = {"census": "elimination"}
NODE = "/dev/nvidia0"


def fields(line: str) -> dict[str, str]:
    reply = proto.parse_server_line(line.encode())
    assert isinstance(reply, proto.Ok), line
    return dict(reply.fields)


class DeviceFiles:
    """Which processes have the GPU's device node open (what `fuser /dev/nvidia0` says),
    and the server's questions about it."""

    def __init__(self, s: Stack, monkeypatch: pytest.MonkeyPatch, open_by: set[int]) -> None:
        self.open_by = open_by
        self.asked: list[tuple[list[int], str]] = []
        monkeypatch.setattr(s.gpu, "device_node", lambda i: f"/dev/nvidia{i}", raising=False)
        monkeypatch.setattr(s.host, "holding", self.holding)

    def holding(self, pids: list[int], path: str) -> list[int]:
        self.asked.append((list(pids), path))
        return [p for p in pids if p in self.open_by]


async def pair(s: Stack) -> tuple[Client, Client]:
    """Registers "a" (checkpoint: pid 101, children 111 and 112) and "b" (cooperative,
    parked_max 1 GiB: pid 102), neither holding memory yet; returns their registrants."""
    s.host.spawn(101)
    s.host.spawn(111, ppid=101)
    s.host.spawn(112, ppid=101)
    s.host.spawn(102)
    reg_a, reg_b = await s.client(), await s.client()
    assert await reg_a.ask("REGISTER a pid=101") == "OK workload=a gpu=0 state=registered"
    reply = await reg_b.ask("REGISTER b pid=102 park=cooperative parked_max=1GiB")
    assert reply == "OK workload=b gpu=0 state=registered"
    return reg_a, reg_b


async def test_a_checkpoint_and_a_cooperative_workload_take_turns(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            # Of a's tree only 111 has the device node open: 101 (its launcher) and 112
            # (a data loader) hold no context and must not be handed to the tool.
            files = DeviceFiles(s, monkeypatch, open_by={111, 102})
            await pair(s)
            da, db = await s.client(), await s.client()
            assert fields(await da.ask("ACQUIRE a"))["turn"] == "1"
            s.gpu.load(111, 30 * GiB)  # a trains
            await db.send("ACQUIRE b")
            assert await da.line() == "WAITING a turn=1 waiters=1"
            await da.send("RELEASE a turn=1")
            assert fields(await db.line())["turn"] == "2"
            assert fields(await da.line())["parked"] == "1"
            assert s.parker.parks == [[111]]
            assert ([101, 111, 112], NODE) in files.asked
            a = await s.workload("a")
            # What elimination can see a move: the GPU's excess over b's budget (b might
            # have held up to 1 GiB of the 30), never more than a held.
            assert (a["state"], a["parked_pids"], a["parked_bytes"]) == ("parked", [111], 29 * GiB)
            # b's turn: it wakes, serves, and sleeps down to its context (within budget).
            s.gpu.load(102, 20 * GiB)
            await da.send("ACQUIRE a")
            assert await db.line() == "WAITING b turn=2 waiters=1"
            s.gpu.load(102, 512 * MiB)
            assert fields(await db.ask("RELEASE b turn=2"))["parked"] == "1"
            granted = fields(await da.line())
            assert (granted["turn"], granted["restored"]) == ("3", "1")
            assert s.parker.restores == [[111]] and s.parker.parks == [[111]]
            st = await s.status()
            assert st["census"] == "elimination"
            assert st["gpus"][0]["foreign"] == []
            b = await s.workload("b")
            assert b["state"] == "parked"
            # a's next park hands the tool the same processes: those holding the node.
            await db.send("ACQUIRE b")
            assert await da.line() == "WAITING a turn=3 waiters=1"
            assert fields(await da.ask("RELEASE a turn=3"))["parked"] == "1"
            assert fields(await db.line())["turn"] == "4"
            assert s.parker.parks == [[111], [111]]


async def test_without_a_device_node_the_whole_tree_is_handed_to_the_tool(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            await pair(s)
            da, db = await s.client(), await s.client()
            await da.ask("ACQUIRE a")
            s.gpu.load(111, 30 * GiB)
            await db.send("ACQUIRE b")
            await da.line()  # WAITING
            await da.send("RELEASE a turn=1")
            assert fields(await db.line())["turn"] == "2"
            assert s.parker.parks == [[101, 111, 112]]


async def test_a_cooperative_release_over_the_budgets_faults_and_grants_nobody(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, Limits(fault_kill_after=1000.0), **BLIND) as s:
            _, reg_b = await pair(s)
            da, db = await s.client(), await s.client()
            assert fields(await db.ask("ACQUIRE b"))["turn"] == "1"
            s.gpu.load(102, 20 * GiB)
            await da.send("ACQUIRE a")
            assert await db.line() == "WAITING b turn=1 waiters=1"
            s.gpu.load(102, 3 * GiB)  # vLLM did not sleep all the way: over its 1 GiB
            reply = await db.ask("RELEASE b turn=1")
            assert reply.startswith("ERR park-failed"), reply
            fault = await reg_b.line()
            assert fault.startswith("FAULT b turn=1 reason=still-resident"), fault
            assert f"{3 * GiB} bytes still on GPU 0" in fault
            b = await s.workload("b")
            assert (b["state"], b["fault_reason"]) == ("faulted", "still-resident")
            st = await s.status()
            assert st["gpus"][0]["holder"] is None and st["gpus"][0]["queue"] == ["a"]
            # Nobody is granted while it is there; once b frees it (and is dropped), a is.
            await trio.sleep(5)
            assert (await s.status())["gpus"][0]["holder"] is None
            s.host.exit(102)
            await reg_b.aclose()
            assert fields(await da.line())["turn"] == "2"
            assert [w["name"] for w in (await s.status())["workloads"]] == ["a"]


async def test_memory_that_appears_between_turns_blocks_the_next_grant_until_it_leaves(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            await pair(s)
            da, db = await s.client(), await s.client()
            assert fields(await da.ask("ACQUIRE a"))["turn"] == "1"
            s.gpu.load(111, 30 * GiB)
            # b asks, and gives up while a is being parked: the park goes on, and then
            # nobody holds a turn (a parked, b never granted): both held to their budgets.
            await db.send("ACQUIRE b wait=0.2")
            assert await da.line() == "WAITING a turn=1 waiters=1"
            await da.send("RELEASE a turn=1")
            assert await db.line() == "ERR timeout -- not granted within 200 ms"
            assert fields(await da.line())["parked"] == "1"
            assert (await s.workload("a"))["state"] == "parked"
            s.host.spawn(4242)
            s.gpu.load(4242, GiB)  # nobody's, or a parked workload that grew: alike
            s.host.spawn(4243)
            s.gpu.load(4243, GiB)
            # b's budget (1 GiB) covers one of them, not both: 1 GiB is unattributed.
            dbc = await s.client()
            await dbc.send("ACQUIRE b")
            st = await s.until(lambda st: st["gpus"][0]["foreign"] != [])
            assert st["gpus"][0]["foreign"] == [
                {"reason": "unattributed", "bytes": GiB, "host_pids": "4242,4243"}
            ]
            assert st["gpus"][0]["holder"] is None
            s.host.exit(4242)
            assert fields(await dbc.line())["turn"] == "2"
            assert (await s.status())["gpus"][0]["foreign"] == []


@pytest.mark.parametrize("foreign", ["block", "ignore"])
async def test_foreign_ignore_cannot_wave_through_unattributed_memory(
    tmp_path: Path, autojump_clock: trio.abc.Clock, foreign: str
) -> None:
    limits = Limits(foreign_blocks=foreign == "block")
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, limits, foreign=foreign, **BLIND) as s:
            await pair(s)
            s.host.spawn(4242)
            s.gpu.load(4242, 2 * GiB)
            c = await s.client()
            await c.send("ACQUIRE a")
            st = await s.until(lambda st: st["gpus"][0]["foreign"] != [])
            (block,) = st["gpus"][0]["foreign"]
            assert block["reason"] == "unattributed" and block["bytes"] == GiB
            s.host.exit(4242)
            assert fields(await c.line())["turn"] == "1"


@pytest.mark.parametrize(("census", "shown"), [(BLIND, "elimination"), ({}, "pids")])
async def test_status_says_which_census_runs(
    tmp_path: Path, autojump_clock: trio.abc.Clock, census: dict[str, Any], shown: str
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **census) as s:
            assert (await s.status())["census"] == shown


async def test_a_newcomer_during_anothers_turn_without_the_gpu_open_is_not_resident(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By elimination a newcomer none of whose processes has the GPU's device node open
    holds nothing there, whatever the GPU's total says during another's turn."""
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            DeviceFiles(s, monkeypatch, open_by={111})
            await pair(s)
            da = await s.client()
            assert fields(await da.ask("ACQUIRE a"))["turn"] == "1"
            s.gpu.load(111, 30 * GiB)
            s.host.spawn(103)
            reg_c = await s.client()
            assert await reg_c.ask("REGISTER c pid=103") == "OK workload=c gpu=0 state=registered"
            dc = await s.client()
            await dc.send("ACQUIRE c")
            assert await da.line() == "WAITING a turn=1 waiters=1"
            # a's checkpoint park held and c is granted after it: nothing overlapped.
            assert fields(await da.ask("RELEASE a turn=1 park=now"))["parked"] == "1"
            assert fields(await dc.line())["turn"] == "2"
            assert (await s.workload("a"))["state"] == "parked"


async def test_a_newcomer_that_came_with_memory_is_parked_and_the_holder_is_not_blamed(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer with the GPU open during another's turn is a suspect: it is the one
    parked at once (checkpoint, verified by the driver's word), and the holder's park,
    verified by the GPU's total, holds: no FAULT for either."""
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            DeviceFiles(s, monkeypatch, open_by={111, 103})
            await pair(s)
            da = await s.client()
            assert fields(await da.ask("ACQUIRE a"))["turn"] == "1"
            s.gpu.load(111, 30 * GiB)
            s.host.spawn(103)
            s.gpu.load(103, 5 * GiB)
            reg_c = await s.client()
            assert (await reg_c.ask("REGISTER c pid=103")).startswith("OK workload=c")
            while (await s.workload("c"))["state"] != "parked":
                await trio.sleep(0.05)  # virtual time: the mid-turn park of c runs
            dc = await s.client()
            await dc.send("ACQUIRE c")
            assert await da.line() == "WAITING a turn=1 waiters=1"
            assert fields(await da.ask("RELEASE a turn=1 park=now"))["parked"] == "1"
            granted = fields(await dc.line())
            assert granted["turn"] == "2" and granted["restored"] == "1"
            st = await s.status()
            assert [w["faults"] for w in st["workloads"]] == [0, 0, 0]


async def test_a_workload_that_registers_holding_memory_between_turns_is_resident(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """With nobody's turn on, the excess at REGISTER is the newcomer's (a CUDA context it
    made first): it is idle, granted its own turn, and parked before another's."""
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            await pair(s)
            s.host.spawn(103)
            s.gpu.load(103, 2 * GiB)  # 1 GiB of it fits in b's budget, 1 GiB does not
            reg_c = await s.client()
            assert await reg_c.ask("REGISTER c pid=103") == "OK workload=c gpu=0 state=idle"
            dc = await s.client()
            assert fields(await dc.ask("ACQUIRE c wait=5"))["turn"] == "1"
            assert fields(await dc.ask("RELEASE c turn=1"))["parked"] == "0"
            da = await s.client()
            assert fields(await da.ask("ACQUIRE a wait=5"))["turn"] == "2"
            assert s.parker.parks == [[103]]
            assert (await s.workload("c"))["state"] == "parked"
