"""slicerd SIGKILLed inside a park or a restore: the restarted daemon asks the driver
(the cuda-checkpoint stub) for each journaled process's real state, waits for a tool the
dead daemon left running, and finishes or rolls back the op. Afterwards the workload's
next turn really has its memory on the device, nobody was granted on its GPU before it was
settled, and nothing FAULTed (the tool itself never failed).

Each scenario holds the tool at one step with the stub's `hang` injection, kills the
daemon there, then lets the tool finish, or kills it (SIGKILL leaves the driver state as
it was: the same as a daemon that died before the tool ran), before or after the restart.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import psutil
import pytest
import trio

from gpu_slicer.slicer.client import AsyncSlicer, Unreachable
from tests.harness import GiB, Stack, running_stack, workload

pytestmark = pytest.mark.integration

POLL = 0.02  # the process table has no event to wait on: poll it, bounded by fail_after


def tools_on(pid: int, action: str | None = None) -> list[psutil.Process]:
    """Live cuda-checkpoint processes acting on `pid` (doing `action`, when given)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        tool = any(a.endswith("cuda-checkpoint") for a in argv[:2]) and str(pid) in argv
        if tool and (action is None or action in argv):
            out.append(p)
    return out


async def tool_running(pid: int, action: str) -> psutil.Process:
    """The one cuda-checkpoint doing `action` on `pid`, once it runs (held there by the
    stub's hang injection)."""
    while not (found := tools_on(pid, action)):
        await trio.sleep(POLL)
    (tool,) = found
    return tool


async def tool_gone(tool: psutil.Process) -> None:
    await trio.to_thread.run_sync(tool.wait, 30)


def on_device(stack: Stack, pid: int) -> int:
    return sum(p.on_device for p in stack.ledger.processes(0) if p.pid == pid)


@dataclass(frozen=True)
class Case:
    name: str
    phase: str  # "park" or "restore": which op the daemon dies in
    hang: str  # the tool step held when the daemon dies
    fate: str  # "finishes-after-restart" | "killed" | "ended-before-restart" | "left-running"
    state_at_restart: str  # the driver's state of the process when the daemon restarts


CASES = [
    Case("park-tool-outlives-daemon", "park", "lock", "finishes-after-restart", "running"),
    Case("park-before-tool-acted", "park", "lock", "killed", "running"),
    Case("park-between-lock-and-checkpoint", "park", "checkpoint", "killed", "locked"),
    Case(
        "park-tool-ended-after-daemon", "park", "checkpoint", "ended-before-restart", "checkpointed"
    ),
    Case(
        "restore-tool-outlives-daemon",
        "restore",
        "restore",
        "finishes-after-restart",
        "checkpointed",
    ),
    Case("restore-before-tool-acted", "restore", "restore", "killed", "checkpointed"),
    Case("restore-between-restore-and-unlock", "restore", "unlock", "killed", "locked"),
    Case("restore-tool-ended-after-daemon", "restore", "restore", "ended-before-restart", "locked"),
]


async def _acquire_until_the_daemon_dies(client: AsyncSlicer, name: str) -> None:
    with pytest.raises(Unreachable):
        await client.acquire(name)


async def _die_inside(stack: Stack, case: Case, pa: int, toggle: bool = False) -> int:
    """Register a (20 GiB) and b, drive a into `case.phase` with the tool held at
    `case.hang`, SIGKILL the daemon there, and leave the tool as `case.fate` says."""
    reg_a, reg_b, holder, other = [await stack.client() for _ in range(4)]
    pb = stack.sleeper()
    await reg_a.register("a", pid=pa)
    await reg_b.register("b", pid=pb)
    t = await holder.acquire("a")
    if case.phase == "restore":
        await holder.release(t, park="now")  # a is checkpointed
        assert stack.ledger.state(pa) == "checkpointed"
        stack.ledger.inject(pa, case.hang, hang=True)
        async with trio.open_nursery() as n:
            n.start_soon(_acquire_until_the_daemon_dies, holder, "a")
            tool = await tool_running(pa, "--toggle" if toggle else case.hang)
            if case.hang == "unlock":  # the restore step ran; the unlock is held
                while stack.ledger.state(pa) != "locked":
                    await trio.sleep(POLL)
            await stack.stop(signal.SIGKILL)
    else:
        stack.ledger.inject(pa, case.hang, hang=True)
        await holder.release(t)  # lazy: a stays resident, idle
        async with trio.open_nursery() as n:
            n.start_soon(_acquire_until_the_daemon_dies, other, "b")  # a must park first
            tool = await tool_running(pa, "--toggle" if toggle else case.hang)
            if case.hang == "checkpoint":
                while stack.ledger.state(pa) != "locked":
                    await trio.sleep(POLL)
            await stack.stop(signal.SIGKILL)
    for c in (reg_a, reg_b, holder, other):
        await c.aclose()
    if case.fate == "killed":
        tool.kill()
        await tool_gone(tool)
        stack.ledger.clear_injection(pa)
    elif case.fate == "ended-before-restart":
        stack.ledger.clear_injection(pa)
        await tool_gone(tool)
    assert stack.ledger.state(pa) == case.state_at_restart
    return pb


# An r550 driver (--toggle only): the same recovery with toggles where it can go on.
TOGGLE_CASES = [
    Case("toggle-park-tool-outlives-daemon", "park", "lock", "finishes-after-restart", "running"),
    Case("toggle-restore-before-tool-acted", "restore", "restore", "killed", "checkpointed"),
]
TOGGLE = {"FAKEGPU_CC_TOGGLE_ONLY": "1"}


@pytest.mark.parametrize(
    ("case", "env"),
    [(c, None) for c in CASES] + [(c, TOGGLE) for c in TOGGLE_CASES],
    ids=[c.name for c in CASES + TOGGLE_CASES],
)
async def test_sigkill_inside_a_park_or_restore_is_recovered(
    case: Case, env: dict[str, str] | None
) -> None:
    with trio.fail_after(90):
        async with running_stack(gpus=1, env=env) as stack:
            pa = stack.sleeper(20 * GiB, label="a")
            pb = await _die_inside(stack, case, pa, toggle=env is not None)
            await stack.start()
            if case.fate == "finishes-after-restart":
                # The new daemon waits for the tool the dead one started: never a second
                # tool beside it, nothing else on the GPU meanwhile.
                st = await stack.until(lambda st: st["gpus"][0]["busy"] == "recover")
                assert len(tools_on(pa)) == 1
                stack.ledger.clear_injection(pa)
            # The launchers re-register their workloads; b asks for the GPU at once.
            async with (
                await stack.client() as reg_a,
                await stack.client() as reg_b,
                await stack.client() as cb,
                await stack.client() as ca,
            ):
                await reg_a.register("a", pid=pa)
                await reg_b.register("b", pid=pb)
                tb = await cb.acquire("b")
                # b is granted only once a's memory is off the device, for real.
                st = await stack.status()
                assert workload(st, "a")["state"] == "parked", st  # type: ignore[index]
                assert stack.ledger.state(pa) == "checkpointed"
                assert on_device(stack, pa) == 0
                await cb.release(tb)
                ta = await ca.acquire("a")
                assert stack.ledger.state(pa) == "running"
                assert on_device(stack, pa) == 20 * GiB  # its next turn has its memory back
                st = await stack.status()
                assert st["totals"]["faults"] == 0, st
                assert workload(st, "a")["faults"] == 0  # type: ignore[index]
                await ca.release(ta)
            assert stack.overlaps() == 0


async def test_a_park_tool_that_never_ends_faults_after_the_bound_and_keeps_the_gpu() -> None:
    """A leftover tool that outlives the recovery bound: the driver's state is unknown
    while it runs, so the workload is faulted and the GPU stays taken (never a second
    tool beside it)."""
    with trio.fail_after(60):
        async with running_stack("--park-timeout", "1", "--restore-timeout", "1", gpus=1) as stack:
            pa = stack.sleeper(20 * GiB, label="a")
            # Held at checkpoint (a lock would end at its own --timeout).
            held = Case("never-ends", "park", "checkpoint", "left-running", "locked")
            await _die_inside(stack, held, pa)
            await stack.start()
            reg = await stack.client()
            await reg.register("a", pid=pa)
            st = await stack.until(lambda st: workload(st, "a")["state"] == "faulted")  # type: ignore[index]
            assert workload(st, "a")["fault_reason"] == "tool-still-running"  # type: ignore[index]
            assert len(tools_on(pa)) == 1  # not killed, not doubled
            stack.ledger.clear_injection(pa)
            await tool_gone(tools_on(pa)[0])
            await reg.aclose()
            next(p for p in stack.children if p.pid == pa).kill()
            other = stack.sleeper()
            async with await stack.client() as rb, await stack.client() as cb:
                await rb.register("b", pid=other)
                await cb.acquire("b")  # once a's processes are gone
            assert stack.overlaps() == 0
