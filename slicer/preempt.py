"""Opt-in preemption: taking a turn back from a holder that keeps it too long.

A workload REGISTERed with ``max_turn=S`` (``park=checkpoint`` only: the slicer can park
it without its help) agrees that a turn it holds longer than S seconds *while another
workload waits on its GPU* is taken back. Then `SlicerState` ends the turn as if it had
been released with ``park=now`` (reason ``preempted``), tells the holder ``PREEMPTED W
turn=T``, and goes on as after any release: the workload is parked by checkpoint (lock,
which waits for its submitted CUDA work, then checkpoint) before the next waiter is
granted. Its CPU threads run on; CUDA calls block until its next ACQUIRE restores it. A
park that fails is a FAULT, as always.

Nobody waiting, nothing happens: S bounds how long a holder may keep *others* waiting,
not how long it may work. The clock starts at the grant. A cooperative workload (it
parks itself, through its holder) gets ``WAITING`` hints only.

`due_in` is the rule (pure); `SlicerState` asks it whenever it reconciles a GPU and sets
a timer (`Recheck`) for the moment it names.
"""

from __future__ import annotations

from gpu_slicer.slicer.model import Gpu
from gpu_slicer.slicer.queueing import others_waiting

__all__ = ["due_in"]


def due_in(gpu: Gpu, now: float) -> float | None:
    """Seconds until `gpu`'s holder may be preempted (0.0: now), or None when it may not
    be: no holder, no ``max_turn``, not parked by checkpoint, or no other workload
    waits."""
    holder = gpu.holder
    if holder is None:
        return None
    w = holder.workload
    if w.max_turn is None or w.park != "checkpoint" or others_waiting(gpu) == 0:
        return None
    return max(0.0, holder.since + w.max_turn - now)
