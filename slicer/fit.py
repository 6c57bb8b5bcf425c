"""Fit-aware turns: freeze the outgoing workload instead of parking it, when the next fits.

With config ``fit_aware = true``, a workload that must make room for the queue head is
*frozen* instead of parked when the head's memory is known and fits beside it: its
processes are locked (``cuda-checkpoint --action lock``, or the driver API's lock), so no
CUDA work of it runs while its memory stays where it is, and it is thawed (unlocked) at
its next turn. No bytes move. The head's memory is known when it is frozen or resident
itself (its bytes are on the GPU already: it needs nothing) or a ``park=checkpoint``
workload parked by checkpoint (its restore needs its parked bytes); a head that never
ran, or a cooperative one that parked itself (a slept vLLM: its wake allocates weights
and KV cache; with ``fallback=residue`` only its residue was checkpointed), needs an
unknown amount, and the outgoing workload is parked as before. Only a workload that
holds more than its ``parked_max`` is frozen (a slept vLLM is parked the usual way: its
need at the next wake would be unknown), so a frozen one is always whole and awake.

Whether it fits is measured by the op that freezes: the GPU's free bytes must cover the
head's need plus ``fit_headroom``; otherwise the op declines and the workload is parked
the usual way. A frozen workload in the way of a head whose need is unknown, or for whom
the GPU has no room, is parked (checkpoint of its locked processes) before that head is
served. Turns stay exclusive: at most one workload *runs* on a GPU (frozen ones are
locked), and resident bytes never exceed capacity (the free check before each freeze,
thaw and restore). A restart finds a frozen workload's processes locked and finishes
them as an interrupted park (journaled as one), so a crash never leaves one frozen and
forgotten.

Only workloads slicerd may lock are frozen: ``park=checkpoint``, or a cooperative one
whose registration allows slicerd's cuda-checkpoint (``fallback=checkpoint|residue``),
such as a vLLM replica its dispatcher left awake (it keeps its weights and CUDA graphs).
"""

from __future__ import annotations

from gpu_slicer.slicer.model import Gpu, Workload, WState
from gpu_slicer.slicer.records import Limits

__all__ = ["freeze_need", "known_need", "lockable"]


def lockable(w: Workload) -> bool:
    """Whether slicerd may lock `w`'s processes (and so freeze it)."""
    return w.park == "checkpoint" or w.fallback in ("checkpoint", "residue")


def known_need(h: Workload) -> int | None:
    """The device bytes `h` needs to be granted, when known: 0 for a frozen or resident
    one (its memory is on the GPU), its parked bytes for a checkpoint-parked one; else
    None (it never ran, or parked itself: what its wake allocates is not known)."""
    if h.state in (WState.FROZEN, WState.IDLE, WState.ACTIVE):
        return 0  # frozen only while it held more than parked_max: awake, whole
    if h.state is WState.PARKED and h.parked_procs and h.park == "checkpoint":
        return h.parked_bytes
    # A cooperative one parked itself: its wake allocates what it needs (its checkpointed
    # residue, fallback=residue, is not all of it).
    return None


def freeze_need(limits: Limits, gpu: Gpu, w: Workload) -> int | None:
    """The free bytes (headroom included) that let `w` be frozen instead of parked to
    make room for `gpu`'s queue head, or None when it must be parked."""
    if not limits.fit_aware or w.state is not WState.IDLE or not lockable(w):
        return None
    if w.detached or w.holder_died or w.must_park:
        return None  # parked as it asked (or as its end demands), never frozen
    head = gpu.head()
    if head is None or head.workload is w:
        return None
    need = known_need(head.workload)
    return None if need is None else need + limits.fit_headroom
