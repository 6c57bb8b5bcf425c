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

This module measures (`read`: steps 1 to 3) and performs (`perform`: the tool steps of
step 4); which steps and what they mean is decided by the state machine
(`SlicerState.recovery_plan` and `recover_done`, by the rules of `slicer.policy`).
"""

from __future__ import annotations

import trio

from gpu_slicer.slicer import procs
from gpu_slicer.slicer.park import Parker
from gpu_slicer.slicer.policy import TRANSIENT, Step
from gpu_slicer.slicer.readings import Ident, Outcome, RecoveryReading

POLL = 0.1  # waiting for a leftover tool, or for a transient driver state


async def read(
    parker: Parker,
    journaled: tuple[Ident, ...],
    timeout: float,
    root: Ident = (0, 0),
    host: procs.ProcessTable = procs,
) -> RecoveryReading:
    """The real state of `journaled` (the processes of one workload whose registered
    process is `root`): which live, any cuda-checkpoint a dead daemon left running on them
    (waited for within `timeout`, never started again beside it), then the driver's state
    of each (asked again while transient, within `timeout`)."""
    live = tuple(p for p in journaled if host.alive(p))
    pids = {pid for pid, _ in live}
    runs: dict[int, int] = {}
    states: dict[int, str] = {}
    if pids:
        with trio.move_on_after(timeout):
            while runs := host.tool_runs(parker.path, pids):
                await trio.sleep(POLL)
    if pids and not runs:
        with trio.move_on_after(timeout):
            for pid in sorted(pids):
                while (state := await parker.get_state(pid, timeout)) in TRANSIENT:
                    await trio.sleep(POLL)
                states[pid] = state
    return RecoveryReading(
        live=live,
        root_alive=host.alive(root),
        tools=tuple(sorted(runs.items())),
        states=states,
        has_action=parker.has_action,
    )


async def perform(parker: Parker, steps: tuple[Step, ...], timeout: float) -> Outcome:
    """Run the plan's tool steps in order, each within `timeout`; the first that fails
    ends it."""
    out = Outcome(True)
    for action, pids in steps:
        if action == "toggle":
            out = await parker.act_toggle(list(pids), timeout)
        else:
            out = await parker.act(list(pids), action, timeout)
        if not out.ok:
            return out
    return out
