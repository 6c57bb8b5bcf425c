"""Starting an op on a GPU, as `SlicerState` decides it: the `Op` record put on the GPU
and the effects the server then performs (`slicer.gpuops` performs them).

Pure helpers over the records of `slicer.model`, also for the reaper a workload gets and
its kill deadline. Every number they need (the next op id, a timeout, who may be asked)
is handed in; what to start, and when, stays in `SlicerState._reconcile`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_slicer.slicer import policy, rescue
from gpu_slicer.slicer.effects import (
    ConnId,
    Effect,
    Kill,
    Park,
    Persist,
    Reap,
    Recover,
    Restore,
    Verify,
)
from gpu_slicer.slicer.model import Gpu, Op, OpKind, ParkStage, Waiter, Workload, WState
from gpu_slicer.slicer.views import event


def running(gpus: Iterable[Gpu], op_id: int, kind: OpKind) -> tuple[Gpu, Op] | None:
    """The GPU running op `op_id` of `kind`, and the op; None when it ended or never was
    (a result that comes late, or twice, changes nothing)."""
    for gpu in gpus:
        if gpu.op is not None and gpu.op.op_id == op_id and gpu.op.kind is kind:
            return gpu, gpu.op
    return None


def reap(w: Workload, kill_after: float | None, now: float) -> Reap:
    """The reaper of `w`'s processes; `kill_after`: its kill deadline starts now."""
    if kill_after is not None:
        w.kill_at, w.killed_at = now + kill_after, None
    return Reap(
        wid=w.wid,
        workload=w.name,
        gpu=w.gpu,
        pid=w.pid,
        start_time=w.start_time,
        tree=w.tree,
        kill_after=kill_after,
    )


def kill_if_due(w: Workload, alive: bool, holders: tuple[int, ...], now: float) -> list[Effect]:
    """The Kill of a faulted `w`'s GPU processes `holders`, once `policy.kill_due`."""
    if w.state is not WState.FAULTED:
        return []
    if not policy.kill_due(w.kill_at, w.killed_at, alive, holders, now):
        return []
    w.killed_at = now
    return [Kill(w.wid, w.name, holders)]


def kill_survivors(
    w: Workload, survivors: tuple[int, ...], kill_after: float, now: float
) -> list[Effect]:
    """The Kill of an orphan `w`'s `survivors` (processes once of its tree, its
    registered process dead) once they have lived `kill_after` seconds since first
    reported: nobody is left to park, restore or stop them, and their memory must not
    block the GPU for good. Its own deadline: a faulted one's may have passed already."""
    if w.orphan_since is None:
        w.orphan_since, w.killed_at = now, None
        return [event("orphaned", w, now, pids=list(survivors), kill_after=kill_after)]
    if not policy.kill_due(w.orphan_since + kill_after, w.killed_at, True, survivors, now):
        return []
    again, w.killed_at = w.killed_at is not None, now
    if again:  # the last SIGKILL did not end them: sent again, said once
        return [Kill(w.wid, w.name, survivors)]
    waited = round(now - w.orphan_since, 1)
    text = f"orphan of {w.name} killed after {waited:g} s"
    return [
        Kill(w.wid, w.name, survivors),
        event("orphan-killed", w, now, pids=list(survivors), after=waited, text=text),
    ]


def start_park(
    gpu: Gpu,
    w: Workload,
    op_id: int,
    asker: ConnId | None,
    timeout: float,
    now: float,
    freeze_need: int | None = None,
    early: Waiter | None = None,
) -> list[Effect]:
    """Start parking `w` on `gpu` as op `op_id`; `asker`: who may park it itself;
    `freeze_need`: freeze it instead when that many bytes are free (`slicer.fit`), for the
    early start of waiter `early` when set (`slicer.early`: the checkpoint follows)."""
    frozen = w.state is WState.FROZEN
    w.to(WState.PARKING)
    op = Op(OpKind.PARK, op_id, w, reply_conn=w.park_reply, early=early)
    unattended = w.holder_died and w.park == "cooperative"
    w.must_park, w.park_reply, w.holder_died = False, None, False
    gpu.op = op
    fx: list[Effect] = [
        # Lazy: no process is checkpointed yet; the pids the tool will act on are
        # journaled (not lazily) by `SlicerState.park_started` before it runs.
        Persist(lazy=True),
        event("parking", w, now),
    ]
    if frozen:
        # Locked already (frozen): checkpoint what it holds; its own park is long done.
        op.stage = ParkStage.CHECKPOINT
        fx.append(Park(op_id, w.wid, w.name, gpu.index, "checkpoint", w.parked_max, locked=True))
        return fx
    if freeze_need is not None and not unattended:
        fx.append(
            Park(op_id, w.wid, w.name, gpu.index, "freeze", w.parked_max, need=freeze_need,
                 early=early is not None)
        )  # fmt: skip
        return fx
    # Its holder died mid-turn: what the backend sees now may be half a wake. The
    # registrant parks it (vLLM serialises a sleep after a wake in flight), else
    # cuda-checkpoint, else the backend's word is all there is.
    return fx + rescue.start(op, gpu.index, unattended, asker, timeout, now)


def start_recover(gpu: Gpu, w: Workload, op_id: int, now: float) -> list[Effect]:
    """Start settling the recovering `w` on `gpu` as op `op_id`."""
    op = Op(OpKind.RECOVER, op_id, w)
    gpu.op = op
    return [
        event("recovering", w, now, intent=w.recover),
        Recover(
            op.op_id,
            w.wid,
            w.name,
            gpu.index,
            str(w.recover),
            w.op_procs,
            w.parked_max,
            (w.pid, int(w.start_time)),
        ),
    ]


def start_verify(gpu: Gpu, w: Workload, op_id: int) -> list[Effect]:
    """Start reading `gpu` (and, for a checkpointed `w`, its free room) as op `op_id`."""
    checkpointed = w.state is WState.PARKED and bool(w.parked_procs)
    need = w.parked_bytes if checkpointed else 0
    op = Op(OpKind.VERIFY, op_id, w, need=need)
    gpu.op = op
    return [Verify(op.op_id, gpu.index, w.wid, need)]


def start_thaw(gpu: Gpu, w: Workload, op_id: int, now: float) -> list[Effect]:
    """Start thawing the frozen `w` on `gpu` as op `op_id` (unlock: nothing moves)."""
    w.to(WState.RESTORING)
    op = Op(OpKind.RESTORE, op_id, w)
    gpu.op = op
    return [
        # Lazy: the freeze on disk (a park over the same locked processes) leads recovery
        # to the driver, whose states say which end the thaw reached (`slicer.journal`).
        Persist(lazy=True),
        event("thawing", w, now),
        Restore(
            op.op_id,
            w.wid,
            w.name,
            gpu.index,
            w.frozen_procs,
            0,
            thaw=True,
            root=(w.pid, int(w.start_time)),
        ),
    ]


def start_restore(gpu: Gpu, w: Workload, op_id: int, now: float) -> list[Effect]:
    """Start restoring the parked `w` on `gpu` as op `op_id`."""
    w.to(WState.RESTORING)
    op = Op(OpKind.RESTORE, op_id, w)
    gpu.op = op
    return [
        Persist(),
        event("restoring", w, now),
        Restore(
            op=op.op_id,
            wid=w.wid,
            workload=w.name,
            gpu=gpu.index,
            procs=w.parked_procs,
            nbytes=w.parked_bytes,
            root=(w.pid, int(w.start_time)),
        ),
    ]
