"""The rescue of a cooperative workload that nobody parked (the `ParkStage`s of a park op).

A cooperative workload is parked by whoever holds its turn (the dispatcher sleeps vLLM).
When nobody did (its holder died, or it idles awake while someone else needs the GPU),
the park op moves through stages, and the GPU stays taken throughout:

    VERIFY      the backend is read: parked already? then done
    ASK         its registrant (ask=1) is sent PARK and answers PARKED, within a bound
    REVERIFY    the backend is read again, whatever the answer said
    CHECKPOINT  cuda-checkpoint, where the workload allows it (fallback=checkpoint or
                residue); with fallback=residue also after a park that held, for what
                it left on the GPU (`residue`)

and only when all of that failed is the workload faulted (by `SlicerState`). A holder that
died mid-turn may have left a wake in flight, so the backend's word alone is not trusted
then: the registrant is asked first, else cuda-checkpoint is used. Each function moves the
op to its next stage and returns the effects; nothing here performs I/O.
"""

from __future__ import annotations

from gpu_slicer.slicer.effects import AskPark, ConnId, Effect, Park
from gpu_slicer.slicer.model import Op, ParkStage
from gpu_slicer.slicer.views import event

# The fallbacks that allow the slicer's own cuda-checkpoint of a cooperative workload.
CHECKPOINTABLE = ("checkpoint", "residue")


def start(
    op: Op, gpu: int, unattended: bool, asker: ConnId | None, timeout: float, now: float
) -> list[Effect]:
    """The first stage of park `op` on `gpu`: the plain Park of its mode, unless its
    holder died mid-turn (`unattended`): then ask `asker`, else cuda-checkpoint."""
    w = op.workload
    if unattended:
        if asker is not None:
            return _ask(op, asker, timeout, now, "holder-closed")
        if w.fallback in CHECKPOINTABLE:
            return _checkpoint(op, now, "holder-closed")
    return [Park(op.op_id, w.wid, w.name, gpu, w.park, w.parked_max)]


def next_stage(
    op: Op, asker: ConnId | None, timeout: float, reason: str, now: float
) -> list[Effect] | None:
    """After the backend found the workload still resident (`reason`): ask its
    registrant (once), else fall back to cuda-checkpoint; None when nothing is left to
    try (the caller faults it)."""
    if op.stage is ParkStage.VERIFY and asker is not None:
        return _ask(op, asker, timeout, now, reason)
    if op.workload.fallback in CHECKPOINTABLE:
        return _checkpoint(op, now, reason)
    return None


def after_answer(op: Op, answered: bool, now: float) -> list[Effect]:
    """The registrant answered PARKED (`answered`), or did not in time, or is gone."""
    # A confirmed park is verified through the backend. Without a confirmation the
    # workload may be mid-transition (a wake its dead holder left in flight): where
    # allowed, cuda-checkpoint it, since a locked process runs no CUDA work whatever it
    # was doing; else the backend alone decides.
    w = op.workload
    if not answered and w.fallback in CHECKPOINTABLE:
        return _checkpoint(op, now, "not-parked-by-registrant")
    op.stage = ParkStage.REVERIFY
    return [Park(op.op_id, w.wid, w.name, w.gpu, "cooperative", w.parked_max)]


def residue(op: Op, now: float) -> list[Effect] | None:
    """After a cooperative park that held: with ``fallback=residue``, checkpoint what it
    left on the GPU (a slept vLLM's CUDA context and graphs, a few GiB on large models)
    so that the next workload gets the whole GPU; None otherwise (the park is done). The
    checkpoint comes strictly after the workload's own park (its sleep), and the restore
    that brings it back strictly before its next grant (so before its wake)."""
    if op.workload.fallback != "residue" or op.stage is ParkStage.CHECKPOINT:
        return None
    return _checkpoint(op, now, "residue")


def _ask(op: Op, asker: ConnId, timeout: float, now: float, reason: str) -> list[Effect]:
    w = op.workload
    op.stage = ParkStage.ASK
    if reason == "holder-closed":
        why = "its holder closed its connection mid-turn"
    elif reason == "above-floor":
        why = (
            "its holder parked it, but it left clearly more on the GPU than its parked floor "
            "(a sleep that freed nothing: a half-woken vLLM?), and the GPU is needed"
        )
    else:  # its own park (or a lazy release) left it there
        why = (
            f"its holder released its turn with it still on the GPU ({reason}: a lazy "
            f"release, a sleep that failed, or a park that left memory behind), and the "
            f"GPU is needed"
        )
    op.why = why
    return [
        event("park-asked", w, now, reason=reason, timeout_s=timeout),
        AskPark(op.op_id, asker, w.name, w.last_turn, timeout, why),
    ]


def _checkpoint(op: Op, now: float, reason: str) -> list[Effect]:
    w = op.workload
    op.stage = ParkStage.CHECKPOINT
    return [
        event("park-fallback", w, now, reason=reason),
        Park(op.op_id, w.wid, w.name, w.gpu, "checkpoint", w.parked_max),
    ]
