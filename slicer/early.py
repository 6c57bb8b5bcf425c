"""Early starts: the queue head begins what fits while the workload before it is parked.

A switch from a trainer to a vLLM replica moves the trainer's working set to host memory
(seconds at host-link speed), and only then does the replica wake and load its weights
(seconds more: reading a checkpoint). The two need not wait for each other: a locked
process runs no CUDA work, and the host link is full duplex. A waiter that asked
``ACQUIRE <w> early=N`` (N: the bytes of its first stage; vLLM: its weights) gets an
*early start* when

- it is the queue head, asked early and was not told yet (`Waiter.early_sent`);
- its workload parked itself (cooperative, PARKED, nothing checkpointed: it needs no
  restore by the slicer before it runs) and may be cuda-checkpointed by the slicer
  (``fallback=checkpoint|residue``): should the early start be abandoned, the slicer can
  still park it, whatever state it is left in;
- the workload in its way is idle, lockable and parked the plain way (not dirty: no dead
  holder, no ``park=now``, no preemption), and no other workload of the GPU may run;
- config ``early_start`` is on, and memory is attributed by pid (under elimination the
  head's extra bytes would be charged to the workload being parked: `slicer.gpuops`
  declines the freeze there).

The outgoing workload is then parked in two steps: a *freeze* (its processes locked; the
op reads the GPU's free bytes first and declines unless they cover N plus
``fit_headroom``: then it is parked the usual way), then a checkpoint of what it locked
(`slicer.policy.next_move`: a frozen workload in the way of a head whose need is unknown
is parked). Between the two the slicer journals the head's early start and sends it
``EARLY <w> bytes=N``: the head may use N bytes now (vLLM: ``wake_up?tags=weights`` and
the weight load) while the checkpoint moves the outgoing workload off. The grant follows
as always, after the verified park. Turns stay exclusive: the outgoing workload is
locked while the head's early stage runs, so at most one workload runs, and the free
check keeps resident bytes within capacity.

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

from gpu_slicer.slicer.effects import ConnId, Effect, Persist, SendEarly
from gpu_slicer.slicer.fit import lockable
from gpu_slicer.slicer.model import RESIDENT, Gpu, Waiter, Workload, WState
from gpu_slicer.slicer.records import Limits
from gpu_slicer.slicer.views import event

__all__ = ["abandon", "send", "wanted"]

# The fallbacks that let the slicer checkpoint a cooperative workload (`slicer.rescue`).
_CHECKPOINTABLE = ("checkpoint", "residue")


def wanted(
    limits: Limits, gpu: Gpu, w: Workload, on_gpu: list[Workload]
) -> tuple[int, ConnId] | None:
    """(the free bytes a freeze of `w` must find, the waiter it is for) when `w`, in the
    way of `gpu`'s queue head, should be frozen for the head's early start and then
    checkpointed; None when it is parked the usual way."""
    if not limits.early_start or w.state is not WState.IDLE or not lockable(w):
        return None
    if w.detached or w.holder_died or w.must_park:
        return None
    head = gpu.head()
    if head is None or head.workload is w or head.early <= 0 or head.early_sent:
        return None
    h = head.workload
    if h.state is not WState.PARKED or h.parked_procs or h.park != "cooperative":
        return None
    if h.fallback not in _CHECKPOINTABLE:
        return None
    others = [x for x in on_gpu if x is not w and x is not h]
    if any(x.state in RESIDENT or x.state in (WState.PARKING, WState.RESTORING) for x in others):
        return None  # someone else may run beside the head's early stage
    return head.early + limits.fit_headroom, head.conn


def send(gpu: Gpu, conn: ConnId | None, outgoing: Workload, now: float) -> list[Effect]:
    """The early start of waiter `conn`, once `outgoing` is frozen for it: journaled first
    (a restart parks a workload that may hold early memory), then ``EARLY``. Nothing when
    `conn` is no longer the head or was told already."""
    head = gpu.head()
    if conn is None or head is None or head.conn != conn or head.early_sent:
        return []
    head.early_sent = True
    h = head.workload
    h.early = head.early
    return [
        Persist(),
        SendEarly(conn, h.name, head.early),
        event("early", h, now, bytes=head.early, behind=outgoing.name),
    ]


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
