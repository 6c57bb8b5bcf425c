"""The queue and turn bookkeeping of one GPU, as `SlicerState` does it.

Pure helpers over the records of `slicer.model`: who holds a turn, taking a waiter off a
queue, the WAITING notice a holder gets, ending a turn. They change only the records they
are handed (and the connections map passed in); they never promote: that stays in
`SlicerState._reconcile`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpu_slicer.slicer.effects import ConnId, Effect, SendWaiting
from gpu_slicer.slicer.model import Conn, Gpu, Waiter, Workload, WState
from gpu_slicer.slicer.views import event


def holding(gpus: Iterable[Gpu], conn: ConnId) -> Gpu | None:
    """The GPU whose turn `conn` holds, if any."""
    for gpu in gpus:
        if gpu.holder is not None and gpu.holder.conn == conn:
            return gpu
    return None


def unqueue(gpu: Gpu, waiter: Waiter, conns: Mapping[ConnId, Conn]) -> None:
    """Take `waiter` off `gpu`'s queue, and its connection (in `conns`) off waiting."""
    if gpu.queue.pop(waiter.conn, None) is not None:
        left = gpu.waiting[waiter.workload.wid] - 1
        if left:
            gpu.waiting[waiter.workload.wid] = left
        else:
            del gpu.waiting[waiter.workload.wid]
            waiter.workload.restored = False  # restored for nobody now
    peer = conns.get(waiter.conn)
    if peer is not None:
        peer.waiting_on = None
    if others_waiting(gpu) == 0:
        # WAITING goes out on every change from zero to non-zero during a turn.
        gpu.waiting_sent = False


def others_waiting(gpu: Gpu) -> int:
    """How many workloads other than the holder's wait on `gpu`."""
    mine = gpu.holder.workload.wid if gpu.holder is not None else None
    return len(gpu.waiting) - (1 if mine in gpu.waiting else 0)


def notify_waiting(gpu: Gpu) -> list[Effect]:
    """The WAITING notice `gpu`'s holder is owed now (others wait, none sent this turn)."""
    holder = gpu.holder
    if holder is None or gpu.waiting_sent:
        return []
    n = others_waiting(gpu)
    if n == 0:
        return []
    gpu.waiting_sent = True
    return [SendWaiting(holder.conn, holder.workload.name, holder.turn, n)]


def end_turn(gpu: Gpu, now: float, fx: list[Effect], reason: str, **extra: bool) -> Workload:
    """End the turn held on `gpu` (its workload goes idle), appending its event to `fx`
    (with `extra` fields: a RELEASE's ``used`` and ``wasted``); returns the workload."""
    assert gpu.holder is not None
    holder = gpu.holder
    w = holder.workload
    w.to(WState.IDLE)
    gpu.holder = None
    fx.append(event("released", w, now, how=reason, turn_ended=holder.turn, **extra))
    w.turn = None
    return w
