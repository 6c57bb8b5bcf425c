"""The real server code, in-process, on virtual time: turns, hints, faults, kills, recovery.

Each test runs `slicer.server.Server` over the real state machine with a fake GPU, a fake
cuda-checkpoint and a made-up process table (`tests/inproc.py`), and speaks the wire
protocol over socketpairs. No child process is started, so the whole file runs in well
under a second of real time (`make unit`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gpu_slicer import proto
from gpu_slicer.slicer.readings import Outcome
from gpu_slicer.slicer.state import Limits
from tests.inproc import UID, Client, GiB, Stack, inproc_server

BOUND = 60  # virtual seconds: every test is bounded, none comes near it


def fields(line: str) -> dict[str, str]:
    reply = proto.parse_server_line(line.encode())
    assert isinstance(reply, proto.Ok), line
    return dict(reply.fields)


async def two_workloads(s: Stack) -> Client:
    """Registers "a" (pid 101 with a child 111 holding 30 GiB) and "b" (pid 102, none),
    each by a registrant of its own; returns a's."""
    s.host.spawn(101)
    s.host.spawn(111, ppid=101)
    s.host.spawn(102)
    s.gpu.load(111, 30 * GiB)
    reg_a, reg_b = await s.client(), await s.client()
    assert await reg_a.ask("REGISTER a pid=101") == "OK workload=a gpu=0 state=idle"
    assert await reg_b.ask("REGISTER b pid=102") == "OK workload=b gpu=0 state=registered"
    return reg_a


async def test_a_grant_follows_the_verified_park_of_the_previous_holder(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            await two_workloads(s)
            d1, d2 = await s.client(), await s.client()
            assert await d1.ask("ACQUIRE a") == "OK turn=1 restored=0 waited_ms=0"
            await d2.send("ACQUIRE b")
            assert await d1.line() == "WAITING a turn=1 waiters=1"
            # Only the holder of turn 1 ends it.
            d3 = await s.client()
            assert (await d3.ask("RELEASE a turn=1")).startswith("ERR not-holder")
            await d1.send("RELEASE a turn=1")
            granted = fields(await d2.line())
            # b's turn began only once a's process was checkpointed off the device.
            assert s.parker.parks == [[111]]
            assert s.gpu.resident() == set()
            assert granted["turn"] == "2" and granted["restored"] == "0"
            assert int(granted["waited_ms"]) in (499, 500)  # the tool's 0.5 s
            released = fields(await d1.line())
            assert released["parked"] == "1" and int(released["park_ms"]) in (499, 500)
            a = await s.workload("a")
            assert (a["state"], a["parked_pids"], a["parked_bytes"]) == ("parked", [111], 30 * GiB)
            # a's next turn: b's lazy release parks b (no memory: nothing to move), then a
            # is restored, and granted as restored.
            await d1.send("ACQUIRE a")
            assert await d2.line() == "WAITING b turn=2 waiters=1"
            assert fields(await d2.ask("RELEASE b turn=2")) == {"parked": "1", "park_ms": "0"}
            assert fields(await d1.line())["restored"] == "1"
            assert s.parker.restores == [[111]] and s.gpu.resident() == {111}


async def test_waiting_is_sent_once_per_turn(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            await two_workloads(s)
            watch = await s.watcher()
            d1, d2, d3, d4 = [await s.client() for _ in range(4)]
            assert fields(await d1.ask("ACQUIRE a"))["turn"] == "1"
            await d2.send("ACQUIRE a")  # the same workload waiting is no reason to hurry
            await watch.event("queued", workload="a")
            await d3.send("ACQUIRE b")
            await watch.event("queued", workload="b")
            await d4.send("ACQUIRE b")
            await watch.event("queued", workload="b")
            assert await d1.line() == "WAITING a turn=1 waiters=1"
            assert await d1.ask("PING") == "OK"  # no second WAITING in this turn


async def test_acquire_wait_runs_out_on_virtual_time(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            await two_workloads(s)
            d1, d2 = await s.client(), await s.client()
            await d1.ask("ACQUIRE a")
            t0 = trio.current_time()
            assert await d2.ask("ACQUIRE b wait=2") == "ERR timeout -- not granted within 2000 ms"
            assert trio.current_time() - t0 == pytest.approx(2.0)
            assert (await s.status())["gpus"][0]["queue"] == []


async def test_a_failed_park_faults_keeps_the_gpu_and_kills_after_the_deadline(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, Limits(fault_kill_after=5.0)) as s:
            reg = await two_workloads(s)
            s.parker.park_outcome = Outcome(False, "lock-failed", "pid 111: rc=1 boom")
            d1, d2 = await s.client(), await s.client()
            await d1.ask("ACQUIRE a")
            await d2.send("ACQUIRE b")
            await d1.line()  # WAITING
            await d1.send("RELEASE a turn=1")
            assert await d1.line() == "ERR park-failed -- park of a: lock-failed"
            assert await reg.line() == "FAULT a turn=1 reason=lock-failed -- pid 111: rc=1 boom"
            faulted_at = trio.current_time()
            a = await s.workload("a")
            assert (a["state"], a["fault_reason"]) == ("faulted", "lock-failed")
            assert (await s.status())["gpus"][0]["queue"] == ["b"]  # the GPU stays taken
            # Only the process holding the GPU is killed, once the deadline has passed;
            # the registered process (a launcher, say) is left to clean up.
            await s.host.kill_seen.wait()
            assert trio.current_time() - faulted_at >= 5.0
            assert s.host.killed == [111] and s.host.alive((101, 1000))
            # Its registration ended and its memory is gone: the record is dropped and
            # b, waiting all along, is granted.
            await reg.aclose()
            assert fields(await d2.line())["turn"] == "2"
            assert [w["name"] for w in (await s.status())["workloads"]] == ["b"]


async def test_processes_that_exit_under_the_tool_count_as_parked(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            await two_workloads(s)

            def exits(pids: list[int]) -> None:
                for pid in pids:
                    s.host.exit(pid)  # the workload ends right after its turn

            s.parker.on_park = exits
            s.parker.park_outcome = Outcome(False, "checkpoint-failed", "pid 111: no such process")
            d1, d2 = await s.client(), await s.client()
            await d1.ask("ACQUIRE a")
            await d2.send("ACQUIRE b")
            await d1.line()  # WAITING
            await d1.send("RELEASE a turn=1")
            assert fields(await d2.line())["turn"] == "2"
            assert fields(await d1.line())["parked"] == "1"
            a = await s.workload("a")
            assert (a["state"], a["parked_pids"], a["faults"]) == ("parked", [], 0)
            # Nothing to bring back: its next turn needs no restore.
            await d1.send("ACQUIRE a")
            await d2.line()  # WAITING
            await d2.ask("RELEASE b turn=2")
            assert fields(await d1.line())["restored"] == "1"
            assert s.parker.restores == []


async def test_foreign_memory_blocks_a_grant_until_it_leaves(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            await two_workloads(s)
            s.host.spawn(4242)
            s.gpu.load(4242, GiB)  # nobody's process
            watch = await s.watcher()
            d1 = await s.client()
            await d1.send("ACQUIRE b")
            await watch.event("parked", workload="a")  # b's verify ran right after it
            gpu = (await s.status())["gpus"][0]
            assert gpu["foreign"] == [{"pid": 4242, "bytes": GiB}] and gpu["holder"] is None
            s.host.exit(4242)
            assert fields(await d1.line())["turn"] == "1"  # a parked first, then b granted
            assert s.parker.parks == [[111]]


async def test_connection_limits_are_the_state_machines(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    limits = Limits(max_connections=3, reserved_connections=0)
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, limits) as s:
            first = [await s.client() for _ in range(3)]
            refused = s.connect()
            assert await refused.line() == "ERR limit -- at most 3 connections"
            await first[0].aclose()
            await trio.testing.wait_all_tasks_blocked()  # the server saw it close
            assert await (await s.client()).ask("PING") == "OK"  # its slot was freed


def journaled(state: str, **entry: Any) -> dict[str, Any]:
    """A journal entry of workload "a" (pid 101, child 111), as a dead daemon left it."""
    return {
        "name": "a",
        "gpu": 0,
        "pid": 101,
        "start_time": 1000,
        "tree": True,
        "park": "checkpoint",
        "parked_max": 0,
        "owner_uid": UID,
        "state": state,
        **entry,
    }


def a_lives(s: Stack, nbytes: int = 0) -> None:
    s.host.spawn(101)
    s.host.spawn(111, ppid=101)
    if nbytes:
        s.gpu.load(111, nbytes)


@pytest.mark.parametrize(
    ("driver_state", "result", "parks"),
    [
        # The dead daemon's park got through: nothing is run again, a is parked.
        ("checkpointed", "parked", []),
        # It never touched the processes: a is resident, and parked by this daemon.
        ("running", "parked", [[111]]),
        # The driver reports a failure: a is faulted, the GPU stays taken.
        ("failed", "faulted", []),
    ],
)
async def test_an_interrupted_park_is_settled_from_the_drivers_state(
    tmp_path: Path,
    autojump_clock: trio.abc.Clock,
    driver_state: str,
    result: str,
    parks: list[list[int]],
) -> None:
    entry = journaled("parking", op_procs=[[111, 1000]], op_bytes=30 * GiB)

    def prepare(s: Stack) -> None:
        a_lives(s, 0 if driver_state == "checkpointed" else 30 * GiB)
        s.parker.states[111] = driver_state

    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, entries=[entry], prepare=prepare) as s:
            await s.until(lambda st: st["workloads"][0]["state"] in ("parked", "faulted"))
            a = await s.workload("a")
            assert a["state"] == result
            assert s.parker.parks == parks
            assert s.parker.actions == []  # nothing was half-done: no step to finish


@pytest.mark.parametrize(("unreadable", "kept"), [(False, []), (True, ["a"])])
async def test_unreadable_memory_at_recovery_counts_as_resident(
    tmp_path: Path, autojump_clock: trio.abc.Clock, unreadable: bool, kept: list[str]
) -> None:
    """A journaled idle workload without memory is forgotten; when the GPU cannot be read
    at restart, its memory is unknown: it is kept and parked before any grant."""

    def prepare(s: Stack) -> None:
        a_lives(s)
        s.gpu.fail_reads = 1 if unreadable else 0

    with trio.fail_after(BOUND):
        entries = [journaled("idle")]
        async with inproc_server(tmp_path, entries=entries, prepare=prepare) as s:
            st = await s.until(lambda st: all(w["state"] == "parked" for w in st["workloads"]))
            assert [w["name"] for w in st["workloads"]] == kept
