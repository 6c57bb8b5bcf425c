"""REGISTER from a peer in another PID namespace, in the real server, in-process.

The peer of every connection is this test process (SO_PEERCRED of a socketpair);
`FakeHost.enter` puts it in a made-up namespace ("a pod", `POD`) with its own number
there, so the server must read each `pid=` it sends in that namespace. Also: the
numbers survive a restart in the journal (`slicer.restart`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from gpu_slicer.slicer import restart, server
from gpu_slicer.slicer.model import Workload, WState
from tests.inproc import UID, Stack, inproc_server

BOUND = 60  # virtual seconds
POD, OTHER_POD = 7, 8
ME = os.getpid()


def in_pod(s: Stack) -> None:
    """The test process (every connection's peer) is pid 1 of namespace POD; the pod
    has pid 5 (slicerd's 2005, with a child 2006 = 6) and another pod a pid 5 too."""
    s.host.spawn(ME)
    s.host.enter(ME, POD, 1)
    s.host.spawn(2005)
    s.host.enter(2005, POD, 5)
    s.host.spawn(2006, ppid=2005)
    s.host.enter(2006, POD, 6)
    s.host.spawn(3005)
    s.host.enter(3005, OTHER_POD, 5)
    s.host.spawn(4000)  # a process of slicerd's namespace: nothing the pod can name


async def numbers(s: Stack, name: str) -> tuple[int, int | None, int | None]:
    w = await s.workload(name)
    return w["pid"], w["ns_pid"], w["pidns"]


async def test_a_pid_from_a_pod_is_read_in_the_pods_namespace(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            in_pod(s)
            c = await s.client()
            assert (await c.ask("REGISTER w pid=5 tree=0")).startswith("OK workload=w")
            # The pod's 5, not the other pod's 5, nor slicerd's own pid 5.
            assert await numbers(s, "w") == (2005, 5, POD)
            assert (await c.ask("REGISTER k pid=6")).startswith("OK workload=k")
            assert await numbers(s, "k") == (2006, 6, POD)


@pytest.mark.parametrize("asked", [9, 4000, 2005, 3005])
async def test_a_pid_that_names_nothing_in_the_pod_is_refused_and_changes_nothing(
    tmp_path: Path, autojump_clock: trio.abc.Clock, asked: int
) -> None:
    """9: nobody; 4000 and 2005: slicerd's numbers (of a host process, of the pod's 5);
    3005: the other pod's 5 by slicerd's number."""
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            in_pod(s)
            c = await s.client()
            reply = await c.ask(f"REGISTER w pid={asked}")
            assert reply.startswith(f"ERR no-such-process -- no process {asked} "), reply
            assert f"pid:[{POD}]" in reply
            assert (await s.status())["workloads"] == []
            # The connection is fine: a good REGISTER after it works.
            assert (await c.ask("REGISTER w pid=5")).startswith("OK workload=w")


@pytest.mark.parametrize("line", ["REGISTER me pid=self tree=0", "REGISTER me tree=0"])
async def test_self_or_no_pid_is_the_peer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, line: str
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            in_pod(s)
            c = await s.client()
            assert (await c.ask(line)).startswith("OK workload=me")
            assert await numbers(s, "me") == (ME, 1, POD)


async def test_a_peer_in_slicerds_namespace_is_unchanged(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            s.host.spawn(ME)  # in slicerd's namespace: pids are slicerd's
            s.host.spawn(4000)
            c = await s.client()
            assert (await c.ask("REGISTER w pid=4000")).startswith("OK workload=w")
            assert (await c.ask("REGISTER me pid=self tree=0")).startswith("OK workload=me")
            assert await numbers(s, "w") == (4000, None, None)
            assert await numbers(s, "me") == (ME, None, None)


def as_uid(monkeypatch: pytest.MonkeyPatch, uid: int, pid: int = ME) -> None:
    """Every connection's SO_PEERCRED reads (pid, uid, uid)."""
    monkeypatch.setattr(server, "peer_credentials", lambda sock: (pid, uid, uid))
    if pid != ME:  # another connector than this test process: no pidfd names it
        monkeypatch.setattr(server, "peer_pidfd", lambda sock: None)


async def test_the_uid_rule_applies_to_the_translated_process(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = 4321 if UID == 0 else UID
    as_uid(monkeypatch, user)
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            in_pod(s)
            s.host.procs[ME].uid = user
            s.host.procs[2005].uid = user  # the pod's 5 is the user's
            s.host.procs[2006].uid = user + 1  # the pod's 6 is somebody else's
            s.host.procs[3005].uid = user + 1
            c = await s.client()
            assert await c.ask("REGISTER x pid=6") == (
                f"ERR forbidden -- uid {user} may not register pid 6 (pid 2006 to slicerd)"
            )
            assert (await c.ask("REGISTER w pid=5 tree=0")).startswith("OK workload=w")
            assert [w["name"] for w in (await s.status())["workloads"]] == ["w"]


async def test_errors_name_the_number_the_peer_sent(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            in_pod(s)
            c = await s.client()
            assert (await c.ask("REGISTER w pid=5")).startswith("OK workload=w")
            # 6 is in 5's tree: the pod's number first, slicerd's beside it.
            assert await c.ask("REGISTER k pid=6") == (
                "ERR in-use -- pid 6 (pid 2006 to slicerd) (or a process of its tree) "
                "already belongs to workload w"
            )


async def test_a_peer_slicerd_cannot_see_is_refused(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SO_PEERCRED reads pid 0 for a peer in a namespace slicerd cannot see into."""
    as_uid(monkeypatch, UID, pid=0)
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            s.host.spawn(4000)
            c = await s.client()
            for line in ("REGISTER w pid=4000", "REGISTER w pid=self", "REGISTER w"):
                reply = await c.ask(line)
                assert reply.startswith("ERR no-such-process"), reply
                assert "not visible in slicerd's PID namespace" in reply
            assert (await s.status())["workloads"] == []


# ---- the journal ---------------------------------------------------------------------


def _workload(**kw: Any) -> Workload:
    return Workload(1, "w", 0, 2005, 1000.0, True, "checkpoint", 0, UID, None, WState.PARKED, **kw)


@pytest.mark.parametrize(("ns_pid", "pidns"), [(5, POD), (None, None)])
def test_the_journal_keeps_both_numbers(ns_pid: int | None, pidns: int | None) -> None:
    (entry,) = restart.journal_entries([_workload(ns_pid=ns_pid, pidns=pidns)])
    back = restart.resumed({**entry, "alive": True, "resident_bytes": 0}, 1)
    assert back is not None
    assert (back.workload.pid, back.workload.ns_pid, back.workload.pidns) == (2005, ns_pid, pidns)


@pytest.mark.parametrize("damaged", ["5", 5.0, True, [5], {"n": 5}, -3, 0])
def test_a_damaged_number_in_the_journal_is_dropped_not_fatal(damaged: Any) -> None:
    (entry,) = restart.journal_entries([_workload(ns_pid=5, pidns=POD)])
    for key in ("ns_pid", "pidns"):
        back = restart.resumed({**entry, key: damaged, "alive": True, "resident_bytes": 0}, 1)
        assert back is not None and back.workload.state is WState.PARKED
        assert getattr(back.workload, key) is None
        assert back.workload.pid == 2005


def journaled(**entry: Any) -> dict[str, Any]:
    """A parked workload "w" (the pod's 5, slicerd's 2005), as a dead daemon left it."""
    return {
        "name": "w",
        "gpu": 0,
        "pid": 2005,
        "start_time": 1000,
        "tree": True,
        "park": "checkpoint",
        "parked_max": 0,
        "owner_uid": UID,
        "state": "parked",
        **entry,
    }


@pytest.mark.parametrize(
    ("entry", "shown"),
    [
        ({"ns_pid": 5, "pidns": POD}, (2005, 5, POD)),
        ({"ns_pid": "x", "pidns": None}, (2005, None, None)),
    ],
)
async def test_a_restarted_daemon_shows_the_journaled_numbers(
    tmp_path: Path,
    autojump_clock: trio.abc.Clock,
    entry: dict[str, Any],
    shown: tuple[int, int | None, int | None],
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, entries=[journaled(**entry)], prepare=in_pod) as s:
            st = await s.until(lambda st: st["workloads"] and st["workloads"][0]["state"])
            assert st["workloads"][0]["state"] == "parked"
            assert await numbers(s, "w") == shown
