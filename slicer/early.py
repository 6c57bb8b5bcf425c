"""Early starts: the queue head begins what fits while the workload before it is parked.

A switch from a trainer to a vLLM replica moves the trainer's working set to host memory
(seconds at host-link speed), and only then does the replica wake and load its weights
(seconds more: reading a checkpoint). The two need not wait for each other: a locked
process runs no CUDA work, and the host link is full duplex. A waiter that asked
``ACQUIRE <w> early=N`` (N: the bytes of its first stage; vLLM: its weights) gets an
*early start* when

- it is the queue head, asked early and was not told yet (`Waiter.early_sent`);
- its workload parked itself (cooperative, PARKED, nothing checkpointed: it needs no
  restore by the slicer before it runs; so never one with ``fallback=residue``, whose
  residue is checkpointed) and may be cuda-checkpointed by the slicer
  (``fallback=checkpoint``): should the early start be abandoned, the slicer can still
  park it, whatever state it is left in;
- the workload in its way is a ``park=checkpoint`` one (a trainer), idle and parked the
  plain way (not dirty: no dead holder, no ``park=now``, no preemption); a cooperative one
  is parked by its own ladder (its launcher's sleep is cheaper than a checkpoint of its
  KV cache); and no other workload of the GPU may run;
- config ``early_start`` is on, and memory is attributed by pid (under elimination the
  head's extra bytes would be charged to the workload being parked: `slicer.gpuops`
  declines the freeze there).

The outgoing workload is then parked in two steps: a *freeze* (its processes locked; the
op reads the GPU's free bytes first and declines unless they cover N plus
``fit_headroom``: then it is parked the usual way), then a checkpoint of what it locked
(`slicer.policy.next_move`: a frozen workload in the way of a head whose need is unknown
is parked). Between the two the slicer journals the head's early start and, once that
is on disk (a journal that cannot be written sends nothing: `SlicerState.early_unsent`),
sends it ``EARLY <w> bytes=N``: the head may use N bytes now (vLLM:
``wake_up?tags=weights`` and the weight load) while the checkpoint moves the outgoing
workload off. EARLY goes to the very waiter the freeze was made for, while it is still the
head (a new ACQUIRE of the same connection is a new waiter, with its own bytes). The grant
follows as always, after the verified park; meanwhile the waiter's ``wait=`` runs on at
least ``early_hold`` (``park_timeout`` + ``fault_kill_after``), so that a bound meant for
a queue does not abandon a start about to be granted. Turns stay exclusive: the outgoing
workload is locked while the head's early stage runs, so at most one workload runs, and
the free check keeps resident bytes within capacity.

An early start abandoned (the waiter left the queue before its grant: ``wait=`` ran out,
its connection closed, the registration ended) leaves the workload holding memory that
nobody verified, perhaps with a wake in flight: it is made dirty (IDLE, must park, its
holder's word not trusted) and parked by cuda-checkpoint before anyone else is granted.
Its registrant is not asked: a vLLM whose weights are awake and KV cache asleep still
counts as sleeping, so its ``/sleep`` does nothing, and a verify could pass it as parked
when its weights fit in ``parked_max``. A restart that finds an early start in the
journal does the same (`slicer.restart`).
"""

from __future__ import annotations

from gpu_slicer.slicer.effects import Effect, Persist, SendEarly
from gpu_slicer.slicer.model import RESIDENT, Gpu, Waiter, Workload, WState
from gpu_slicer.slicer.records import Limits
from gpu_slicer.slicer.views import event

__all__ = ["abandon", "send", "unsent", "wanted"]


def wanted(
    limits: Limits, gpu: Gpu, w: Workload, on_gpu: list[Workload]
) -> tuple[int, Waiter] | None:
    """(the free bytes a freeze of `w` must find, the waiter it is for) when `w`, in the
    way of `gpu`'s queue head, should be frozen for the head's early start and then
    checkpointed; None when it is parked the usual way."""
    if not limits.early_start or w.state is not WState.IDLE or w.park != "checkpoint":
        return None
    if w.detached or w.holder_died or w.must_park:
        return None
    head = gpu.head()
    if head is None or head.workload is w or head.early <= 0 or head.early_sent:
        return None
    h = head.workload
    if h.state is not WState.PARKED or h.parked_procs or h.park != "cooperative":
        return None
    if h.fallback != "checkpoint":
        return None
    others = [x for x in on_gpu if x is not w and x is not h]
    if any(x.state in RESIDENT or x.state in (WState.PARKING, WState.RESTORING) for x in others):
        return None  # someone else may run beside the head's early stage
    return head.early + limits.fit_headroom, head


def send(
    limits: Limits, gpu: Gpu, waiter: Waiter | None, outgoing: Workload, now: float
) -> list[Effect]:
    """The early start of `waiter`, once `outgoing` is frozen for it: journaled first (a
    restart parks a workload that may hold early memory), then ``EARLY``. Nothing when it
    is no longer the head or was told already."""
    if waiter is None or gpu.head() is not waiter or waiter.early_sent:
        return []
    waiter.early_sent = True
    h = waiter.workload
    h.early = waiter.early
    return [
        Persist(),
        SendEarly(waiter.conn, h.name, waiter.early, limits.early_hold),
        event("early", h, now, bytes=waiter.early, behind=outgoing.name),
    ]


def unsent(waiter: Waiter) -> None:
    """The journal that records `waiter`'s early start could not be written, so EARLY was
    not sent: it waits for its grant as any waiter (its workload used no early bytes)."""
    waiter.early_sent = False
    waiter.workload.early = 0


def abandon(waiter: Waiter, now: float, reason: str) -> list[Effect]:
    """`waiter` left the queue without its grant (`reason`); if it had an early start,
    its workload is made dirty and parked before anyone else is granted (module
    docstring). Call before the waiter's workload changes in any other way."""
    w = waiter.workload
    if not waiter.early_sent or w.state is not WState.PARKED:
        return []
    waiter.early_sent = False
    w.to(WState.IDLE)
    w.must_park = w.holder_died = True
    return [Persist(), event("early-abandoned", w, now, reason=reason, bytes=w.early)]
