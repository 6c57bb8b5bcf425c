"""The real server, in-process on virtual time: an orphan's survivors, and never another's.

A `tree=1` workload's GPU process that leaves its tree (a session of its own, reparented
when its parent died) stays the workload's and is killed `fault_kill_after` after the
workload's registered process died; a process that registered itself meanwhile is its
own workload's and is never killed as another's survivor (`Attribution.survivors`).
"""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from gpu_slicer.slicer.state import Limits
from tests.inproc import Client, GiB, Stack, inproc_server

BOUND = 60  # virtual seconds


async def launcher_with_a_gpu_child(s: Stack) -> Client:
    """Registers "a" (pid 101, tree=1) whose child 111 holds 30 GiB, and waits until
    slicerd knows 111 as a's (STATUS gpu_pids); returns a's registrant."""
    s.host.spawn(101)
    s.host.spawn(111, ppid=101)
    s.gpu.load(111, 30 * GiB)
    reg = await s.client()
    assert await reg.ask("REGISTER a pid=101") == "OK workload=a gpu=0 state=idle"
    await s.until(lambda st: st["workloads"][0]["gpu_pids"] == [111])
    return reg


async def test_a_survivor_of_a_dead_root_is_its_workloads_then_killed(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, Limits(fault_kill_after=5.0)) as s:
            watch = await s.watcher()
            reg = await launcher_with_a_gpu_child(s)
            await watch.event("gpu-pids", workload="a", pids=[111])
            # Its root is SIGKILLed; 111 (a session of its own) is reparented to init.
            s.host.procs[111].ppid = 1
            s.host.exit(101)
            await reg.aclose()
            orphaned = await watch.event("orphaned", workload="a")
            assert orphaned["pids"] == [111] and s.host.alive((111, 1000))
            killed = await watch.event("orphan-killed", workload="a")
            assert killed["pids"] == [111] and s.host.killed == [111]
            assert killed["text"] == "orphan of a killed after 5 s"
            await watch.event("forgotten", workload="a")
            # Its memory was a's all along (parked with it), never foreign.
            assert (await s.status())["gpus"][0]["foreign"] == []


async def test_a_process_that_registered_itself_is_never_killed_as_anothers_survivor(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, Limits(fault_kill_after=5.0)) as s:
            reg_a, reg_c = await launcher_with_a_gpu_child(s), await s.client()
            # 111 leaves a's tree (daemonizes) and registers as a workload of its own.
            s.host.procs[111].ppid = 1
            assert (await reg_c.ask("REGISTER c pid=111 tree=0")).startswith("OK workload=c")
            await s.until(lambda st: st["workloads"][0]["gpu_pids"] == [])
            watch = await s.watcher()
            s.host.exit(101)
            await reg_a.aclose()
            await watch.event("forgotten", workload="a")  # no survivors: nothing killed
            await trio.sleep(10)  # past a's fault_kill_after
            assert s.host.killed == [] and s.host.alive((111, 1000))
            c = await s.workload("c")
            assert c["state"] != "faulted", c
