"""Regressions of an attacker review of PID-namespace translation and elimination (R1).

Each test replays one of the review's repro scripts (/tmp/work/r1/ns16) in-process, on
the real server with `tests/inproc.py`'s fakes and virtual time, and asserts what the
user sees: a REGISTER refused and nothing registered, the right processes handed to
cuda-checkpoint, a park that is not verified, a workload kept after a restart.

- F1: a peer whose PID namespace cannot be read at accept (it exited; its child kept the
  socket), or whose pid was reused at accept or after it: its `pid=` are not slicerd's.
- F2: by elimination, a forked child with the device node open but no CUDA context
  (`--get-state` says "none") is not handed to the tool (its lock would fail the park).
- F3: a checkpoint-parked workload's budget is not room for another's memory.
- F5: after a restart by elimination, a journaled `registered` workload that holds the
  GPU (it was holding its turn) is kept, not dropped.
- L2: a process translated from a pod's number is checked again before it is tracked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer import pidns, procs, server
from gpu_slicer.slicer.readings import Outcome
from gpu_slicer.slicer.state import Limits
from tests.inproc import UID, GiB, Proc, Stack, inproc_server

BOUND = 60  # virtual seconds
BLIND: dict[str, Any] = {"census": "elimination"}
POD = 7
GONE = 5555  # the connector's pid, as SO_PEERCRED reads it after it exited
HOST_JOB = 4000  # a process of slicerd's namespace, holding GPU memory


def fields(line: str) -> dict[str, str]:
    reply = proto.parse_server_line(line.encode())
    assert isinstance(reply, proto.Ok), line
    return dict(reply.fields)


def peer_is(monkeypatch: pytest.MonkeyPatch, pid: int) -> None:
    """Every connection's SO_PEERCRED reads pid `pid` (the process that connected)."""
    monkeypatch.setattr(server, "peer_credentials", lambda sock: (pid, UID, UID))
    # The socketpair's real connector is this test process: a kernel without SO_PEERPIDFD.
    monkeypatch.setattr(server, "peer_pidfd", lambda sock: None)


def device_node_opened_on_alloc(s: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process has the GPU's device node open from its first allocation on (a CUDA
    context), also while its memory is checkpointed to the host (what `fuser` says)."""
    opened: set[int] = set()
    load = s.gpu.load

    def load_and_open(pid: int, nbytes: int, gpu: int = 0) -> None:
        opened.add(pid)
        load(pid, nbytes, gpu)

    monkeypatch.setattr(s.gpu, "device_node", lambda i: f"/dev/nvidia{i}", raising=False)
    monkeypatch.setattr(s.gpu, "load", load_and_open)
    monkeypatch.setattr(s.host, "holding", lambda pids, path: [p for p in pids if p in opened])


def host_job(s: Stack) -> None:
    s.host.spawn(HOST_JOB)
    s.gpu.load(HOST_JOB, 2 * GiB)


# ---- F1: the connector's namespace, read at accept -------------------------------------


@pytest.mark.parametrize(
    "line", [f"REGISTER evil pid={HOST_JOB} park=cooperative", "REGISTER evil pid=self"]
)
async def test_a_connector_that_exited_before_accept_gets_no_pid_trusted(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, line: str
) -> None:
    """R1 run_dead_connector.py: a pod process connects, forks, exits; its child sends
    REGISTER naming a host pid. The connector's namespace could not be read: it was
    taken as slicerd's, and the host process was registered (and could be SIGKILLed)."""
    peer_is(monkeypatch, GONE)  # not in the process table: it is gone at accept
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, prepare=host_job) as s:
            c = s.connect()
            reply = await c.ask(line)
            assert reply.startswith("ERR no-such-process"), reply
            assert f"PID namespace of the connecting process (pid {GONE})" in reply
            assert (await s.status())["workloads"] == []
            assert s.host.killed == []


async def test_a_connector_pid_reused_during_accept_gets_no_pid_trusted(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connector (a pod's) exits while it is accepted and a host process takes its
    pid: the namespace read is the newcomer's (slicerd's), so it is not trusted."""
    peer_is(monkeypatch, GONE)
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, prepare=host_job) as s:
            s.host.spawn(GONE, start=1000)
            s.host.enter(GONE, POD, 1)
            looked = s.host.namespace_of

            def reused_under_the_look(pid: int) -> int | None:
                if pid == GONE and s.host.procs[GONE].start == 1000:
                    s.host.procs[GONE] = Proc(1, 2000)  # a host process with its pid now
                    del s.host.ns[GONE]
                return looked(pid)

            monkeypatch.setattr(s.host, "namespace_of", reused_under_the_look)
            c = s.connect()
            reply = await c.ask(f"REGISTER evil pid={HOST_JOB}")
            assert reply.startswith("ERR no-such-process"), reply
            assert "could not be read when it connected" in reply
            assert (await s.status())["workloads"] == []


@pytest.mark.parametrize("in_pod", [True, False])
async def test_pid_self_from_a_peer_that_exited_since_accept_names_nobody(
    tmp_path: Path,
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    in_pod: bool,
) -> None:
    """The connector (in a pod, or in slicerd's namespace) registers `pid=self` after it
    exited and its pid went to another process: that one is not the peer, nor tracked."""
    peer_is(monkeypatch, GONE)
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, prepare=host_job) as s:
            s.host.spawn(GONE, start=1000)
            if in_pod:
                s.host.enter(GONE, POD, 1)
            c = await s.client()  # accepted: its namespace and start time are read
            s.host.procs[GONE] = Proc(1, 2000)  # exited; a host process took its pid
            s.host.ns.pop(GONE, None)
            for line in ("REGISTER evil pid=self", "REGISTER evil"):
                reply = await c.ask(line)
                assert reply.startswith("ERR no-such-process"), reply
                assert f"connecting process (pid {GONE}) has exited" in reply
            assert (await s.status())["workloads"] == []


def test_an_unreadable_namespace_link_falls_back_to_the_nspid_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slicerd that may not read another uid's ns link (no ptrace rights) still tells
    a process of its own namespace (one NSpid number) from a pod's (two or more)."""
    real = pidns.namespace_of
    monkeypatch.setattr(
        pidns, "namespace_of", lambda pid, proc="/proc": real(pid) if pid == "self" else None
    )
    own = procs.own_namespace()
    assert own is not None
    assert procs.namespace_of(os.getpid()) == own
    monkeypatch.setattr(pidns, "nspids", lambda pid, proc="/proc": [2005, 5])
    assert procs.namespace_of(os.getpid()) is None  # a pod's: not guessed


# ---- L2: translated, then checked again ------------------------------------------------


async def test_a_translated_process_replaced_before_registration_is_refused(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """The pod's 5 exits right after its number is translated and a host process takes
    slicerd's pid of it: the host process is not registered."""
    me = os.getpid()
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            s.host.spawn(me)
            s.host.enter(me, POD, 1)
            s.host.spawn(2005)
            s.host.enter(2005, POD, 5)
            translate = s.host.translate

            def then_reused(ns_pid: int, ns: int) -> int | None:
                pid = translate(ns_pid, ns)
                if pid == 2005:
                    s.host.procs[2005] = Proc(1, 1000)  # same start tick, another process
                    del s.host.ns[2005]
                return pid

            s.host.translate = then_reused  # type: ignore[method-assign]
            c = await s.client()
            reply = await c.ask("REGISTER w pid=5")
            assert reply == f"ERR no-such-process -- no live process 5 in pid:[{POD}]", reply
            assert (await s.status())["workloads"] == []


# ---- F2: forked children without a CUDA context ----------------------------------------


async def test_a_forked_child_without_cuda_is_not_handed_to_the_tool(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R1 elim_forkchild.py: a's data loader 112 inherited the device node but has no
    CUDA context; locking it fails, so handing it to cuda-checkpoint FAULTed a."""
    asked: list[int] = []
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, **BLIND) as s:
            monkeypatch.setattr(s.gpu, "device_node", lambda i: f"/dev/nvidia{i}", raising=False)
            s.parker.states[112] = "none"
            get_state, park = s.parker.get_state, s.parker.park

            async def counted(pid: int, timeout: float) -> str:
                asked.append(pid)
                return await get_state(pid, timeout)

            async def lock_fails_without_cuda(pids: list[int], timeout: float) -> Outcome:
                if 112 in pids:
                    s.parker.parks.append(pids)
                    return Outcome(False, "tool-failed", "lock of 112: no CUDA context")
                return await park(pids, timeout)

            monkeypatch.setattr(s.parker, "get_state", counted)
            monkeypatch.setattr(s.parker, "park", lock_fails_without_cuda)
            s.host.spawn(101)
            s.host.spawn(111, ppid=101)
            s.host.spawn(112, ppid=111)
            s.host.spawn(102)
            reg_a, reg_b = await s.client(), await s.client()
            assert (await reg_a.ask("REGISTER a pid=111")).startswith("OK workload=a")
            reply = await reg_b.ask("REGISTER b pid=102 park=cooperative")
            assert reply.startswith("OK workload=b")
            da, db = await s.client(), await s.client()
            for turn in (1, 3):
                assert fields(await da.ask("ACQUIRE a"))["turn"] == str(turn)
                s.gpu.load(111, 10 * GiB)
                assert fields(await da.ask(f"RELEASE a turn={turn}"))["parked"] == "0"
                assert fields(await db.ask("ACQUIRE b wait=30"))["turn"] == str(turn + 1)
                assert fields(await db.ask(f"RELEASE b turn={turn + 1}"))["parked"] == "0"
            assert s.parker.parks == [[111], [111]]
            st = await s.status()
            assert [(w["name"], w["faults"]) for w in st["workloads"]] == [("a", 0), ("b", 0)]
            # The driver is asked once per process, not at every park.
            assert sorted(asked) == [111, 112]


# ---- F3: a checkpointed workload's budget is not room for others -----------------------


async def test_a_checkpointed_workloads_budget_does_not_cover_anothers_memory(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R1 elim_borrow.py: A (cooperative, parked_max 4 GiB) releases with 8 GiB still on
    the GPU while B (checkpointed, parked_max 4 GiB) waits. B's memory is on the host:
    its budget counted as room, A's park was verified, and B was restored over A's."""
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, Limits(fault_kill_after=1000.0), **BLIND) as s:
            device_node_opened_on_alloc(s, monkeypatch)
            s.host.spawn(201)  # B
            s.host.spawn(202)  # A
            reg_b, reg_a = await s.client(), await s.client()
            reply = await reg_b.ask("REGISTER B pid=201 park=checkpoint parked_max=4GiB")
            assert reply.startswith("OK workload=B")
            db = await s.client()
            assert fields(await db.ask("ACQUIRE B"))["turn"] == "1"
            s.gpu.load(201, 10 * GiB)
            assert fields(await db.ask("RELEASE B turn=1"))["parked"] == "0"  # stays resident
            reply = await reg_a.ask("REGISTER A pid=202 park=cooperative parked_max=4GiB")
            assert reply.startswith("OK workload=A")
            da = await s.client()
            assert fields(await da.ask("ACQUIRE A"))["turn"] == "2"
            assert s.parker.parks == [[201]] and (await s.workload("B"))["state"] == "parked"
            s.gpu.load(202, 12 * GiB)
            await db.send("ACQUIRE B wait=10")
            assert await da.line() == "WAITING A turn=2 waiters=1"
            s.gpu.load(202, 8 * GiB)  # A "sleeps" but keeps 8 GiB, over its 4 GiB
            reply = await da.ask("RELEASE A turn=2 park=now")
            assert reply.startswith("ERR park-failed"), reply
            fault = await reg_a.next_push("FAULT")
            assert fault.startswith("FAULT A turn=2 reason=still-resident"), fault
            assert (await db.line()).startswith("ERR timeout")
            assert s.parker.restores == []  # B never came back beside A's 8 GiB
            assert 201 not in s.gpu.mem[0]


# ---- F5: a journaled `registered` workload holding its turn ----------------------------


def journaled(name: str, pid: int, state: str, **entry: Any) -> dict[str, Any]:
    return {
        "name": name,
        "gpu": 0,
        "pid": pid,
        "start_time": 1000,
        "tree": True,
        "park": "checkpoint",
        "parked_max": 0,
        "owner_uid": UID,
        "state": state,
        **entry,
    }


def a_parked_b_holding(s: Stack) -> None:
    """R1 restart_elim.py as the killed daemon left it: A checkpointed (memory on the
    host), B journaled `registered` but granted a turn (not journaled) and training."""
    s.host.spawn(301)
    s.host.spawn(302)
    s.gpu.host_mem[301] = 10 * GiB
    s.parker.states[301] = "checkpointed"
    s.gpu.load(302, 10 * GiB)


async def test_after_a_restart_a_registered_workload_holding_the_gpu_is_kept(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    entries = [
        journaled("A", 301, "parked", parked_procs=[[301, 1000]], parked_bytes=10 * GiB),
        journaled("B", 302, "registered"),
    ]
    with trio.fail_after(BOUND):
        async with inproc_server(
            tmp_path, entries=entries, prepare=a_parked_b_holding, **BLIND
        ) as s:
            st = await s.status()  # the journal is adopted before anyone is served
            assert [w["name"] for w in st["workloads"]] == ["A", "B"]
            # Adopted with its memory on the GPU and no registrant: B is checkpointed.
            st = await s.until(lambda st: st["workloads"][1]["state"] != "parking")
            assert [(w["name"], w["state"]) for w in st["workloads"]] == [
                ("A", "parked"),
                ("B", "parked"),
            ]
            assert s.parker.parks == [[302]]
            # A's next turn brings A back; B's memory is on the host.
            reg_a = await s.client()
            assert (await reg_a.ask("REGISTER A pid=301")).startswith("OK workload=A")
            da = await s.client()
            granted = fields(await da.ask("ACQUIRE A wait=20"))
            assert granted["restored"] == "1"
            assert s.parker.parks == [[302]] and s.parker.restores == [[301]]
            assert set(s.gpu.mem[0]) == {301}
