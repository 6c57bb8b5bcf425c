"""Recovery of a park or restore that a dead daemon left behind.

Theory of operation
-------------------
The journal names, for a workload caught mid-park, mid-restore or parked by
cuda-checkpoint, the exact processes (pid and start time) handed to the tool, before the
tool ran. A restarted daemon settles each such workload before anything else happens on
its GPU:

1. Processes that no longer live are dropped; none left is "gone" when the workload's
   root died too, and a fault (`restore-no-process`) when it lives on without the
   checkpointed processes it needs back (a park intent: nothing was moved, "resident").
2. A cuda-checkpoint that the dead daemon started on one of them may still run: it is
   waited for (bounded), never started again beside it and never killed. One that
   outlives the bound is a fault (the driver's state is unknown while it runs).
3. The driver is asked for each process's real state (`--get-state`); a transient
   checkpointing/restoring state is asked again until it settles (bounded).
4. The journaled intent is finished or rolled back, whichever needs no guess:

       park intent:    all running (or without CUDA)  -> "resident" (nothing moved yet)
                       otherwise: running -> lock, checkpoint; locked -> checkpoint
                                                       -> "parked"
       restore intent: all checkpointed (or without CUDA) -> "parked" (restore never ran)
                       some checkpointed: roll back (running -> lock; checkpoint the
                         rest) -> "parked": the next grant's restore checks free memory
                         first, which a restore here could not
                       none checkpointed: locked -> unlock -> "resident"

   Any process in `failed`, or any step that fails, is a "fault": the tool itself
   failed, and the GPU stays taken as for any failed park.

The caller verifies "parked" through the GPU backend, as after any park.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from gpu_slicer.slicer import procs
from gpu_slicer.slicer.park import CheckpointParker, Outcome

Ident = tuple[int, int]
POLL = 0.1  # waiting for a leftover tool, or for a transient driver state


@dataclass(frozen=True)
class Recovered:
    """How recovery settled one workload (see the module docstring)."""

    result: str  # parked | resident | gone | fault
    procs: tuple[Ident, ...] = ()  # the checkpointed processes, for "parked"
    reason: str = ""
    text: str = ""


def _fault(reason: str, text: str) -> Recovered:
    return Recovered("fault", (), reason, text)


async def recover(
    parker: CheckpointParker,
    intent: str,
    journaled: tuple[Ident, ...],
    timeout: float,
    root: Ident = (0, 0),
) -> Recovered:
    """Settle `journaled` (the processes of one workload whose registered process is
    `root`) for `intent`, within `timeout` of waiting (a leftover tool too)."""
    live = [p for p in journaled if procs.alive(p)]
    if not live:
        if not procs.alive(root):
            return Recovered("gone")
        if intent == "park":
            return Recovered("resident")  # they died before anything was moved
        return _fault("restore-no-process", "none of its checkpointed processes lives")
    pids = {pid for pid, _ in live}
    with trio.move_on_after(timeout):
        while runs := procs.tool_runs(parker.path, pids):
            await trio.sleep(POLL)
    if runs:
        text = ", ".join(f"tool pid {t} on pid {p}" for t, p in sorted(runs.items()))
        return _fault("tool-still-running", f"cuda-checkpoint still running: {text}")
    states: dict[int, str] = {}
    with trio.move_on_after(timeout):
        for pid in sorted(pids):
            while (state := await parker.get_state(pid, timeout)) in ("checkpointing", "restoring"):
                await trio.sleep(POLL)
            states[pid] = state
    if len(states) < len(pids):
        return _fault("get-state-timeout", "the driver's state did not settle in time")
    for pid, state in states.items():
        if state == "failed" or state.startswith("error"):
            return _fault("recover-failed", f"pid {pid} is {state}")
    cuda = {pid: st for pid, st in states.items() if st != "none"}
    if intent == "park":
        return await _finish_park(parker, live, cuda, timeout)
    return await _finish_restore(parker, live, cuda, timeout)


async def _finish_park(
    parker: CheckpointParker, live: list[Ident], cuda: dict[int, str], timeout: float
) -> Recovered:
    if all(st == "running" for st in cuda.values()):
        return Recovered("resident")
    out = await _two_steps(parker, cuda, ("running", "lock"), "checkpoint", timeout)
    if not out.ok:
        return _fault(out.reason, out.text)
    return Recovered("parked", tuple(p for p in live if p[0] in cuda))


async def _finish_restore(
    parker: CheckpointParker, live: list[Ident], cuda: dict[int, str], timeout: float
) -> Recovered:
    if cuda and all(st == "checkpointed" for st in cuda.values()):
        return Recovered("parked", tuple(p for p in live if p[0] in cuda))
    if any(st == "checkpointed" for st in cuda.values()):
        out = await _two_steps(parker, cuda, ("running", "lock"), "checkpoint", timeout)
        if not out.ok:
            return _fault(out.reason, out.text)
        return Recovered("parked", tuple(p for p in live if p[0] in cuda))
    out = await _two_steps(parker, cuda, ("checkpointed", "restore"), "unlock", timeout)
    if not out.ok:
        return _fault(out.reason, out.text)
    return Recovered("resident")


async def _two_steps(
    parker: CheckpointParker,
    cuda: dict[int, str],
    first: tuple[str, str],
    then: str,
    timeout: float,
) -> Outcome:
    """`first` = (state, action): that action on the processes in that state; then
    `then` on them and on the `locked` ones (where the first step already ended). On an
    r550 tool (no --action) `--toggle` does both steps, and a locked process is stuck."""
    state, action = first
    start = [p for p, st in cuda.items() if st == state]
    locked = [p for p, st in cuda.items() if st == "locked"]
    if not parker.has_action:
        if locked:
            return Outcome(False, "recover-failed", f"pids {locked} are locked; no --action")
        return await parker.act_toggle(start, timeout) if start else Outcome(True)
    out = await parker.act(start, action, timeout) if start else Outcome(True)
    if out.ok and start + locked:
        out = await parker.act(start + locked, then, timeout)
    return out
