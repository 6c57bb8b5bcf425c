"""What watchers and STATUS see of the state machine's records: EVENT bodies, and the
STATUS body (the server adds pids, version, uptime, journal health and who performs each
GPU's operation)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpu_slicer.slicer.effects import ConnId, Emit
from gpu_slicer.slicer.model import RESIDENT, Conn, Gpu, OpKind, Workload


def status_body(
    gpus: Iterable[Gpu],
    workloads: list[Workload],
    conns: Mapping[ConnId, Conn],
    totals: Mapping[str, int],
) -> dict[str, Any]:
    """The GPUs, workloads (live registrations first, then orphans) and totals."""
    gpu_rows = []
    for gpu in gpus:
        residents = [w for w in workloads if w.gpu == gpu.index and w.state in RESIDENT]
        holder = gpu.holder
        gpu_rows.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "resident": residents[0].name if residents else None,
                "holder": (
                    {"workload": holder.workload.name, "turn": holder.turn}
                    if holder is not None
                    else None
                ),
                "queue": [x.workload.name for x in gpu.queue.values()],
                "grants": gpu.grants,
                "busy": str(gpu.op.kind) if gpu.op is not None else None,
                "stage": (
                    str(gpu.op.stage) if gpu.op is not None and gpu.op.kind is OpKind.PARK else None
                ),
                # Why the registrant was asked to park (it reads this: PARK has no room).
                "park_reason": gpu.op.why if gpu.op is not None else None,
                "dirty": gpu.dirty,
                "foreign": list(gpu.foreign),
            }
        )
    rows = []
    for w in workloads:
        reg = conns.get(w.registrant) if w.registrant is not None else None
        rows.append(
            {
                "name": w.name,
                "gpu": w.gpu,
                "state": str(w.state),
                "turn": w.turn,
                "park": w.park,
                "parked_max": w.parked_max,
                "pid": w.pid,
                "ns_pid": w.ns_pid,
                "pidns": w.pidns,
                "registrant": {"pid": reg.pid, "uid": reg.uid} if reg else None,
                "parks": w.parks,
                "restores": w.restores,
                "faults": w.faults,
                "grants": w.grants,
                "last_park_ms": w.last_park_ms,
                "last_restore_ms": w.last_restore_ms,
                "parked_bytes": w.parked_bytes,
                "parked_floor": w.parked_floor,
                "parked_pids": [p for p, _ in w.parked_procs],
                "fallback": w.fallback,
                "ask": w.ask,
                "frozen_pids": [p for p, _ in w.frozen_procs],
                "freezes": w.freezes,
                "early": w.early,
                "max_turn": w.max_turn,
                "preemptions": w.preemptions,
                "unused_turns": w.unused_turns,
                "wasted_turns": w.wasted_turns,
                "recovering": w.recover,
                "fault_reason": w.fault_reason,
            }
        )
    return {"gpus": gpu_rows, "workloads": rows, "totals": dict(totals)}


def event(kind: str, w: Workload, now: float, **extra: Any) -> Emit:
    """One WATCH event about workload `w` (its turn and state as they are now)."""
    body = {"event": kind, "t": round(now, 6), "workload": w.name, "gpu": w.gpu}
    body["turn"] = w.turn
    body["state"] = str(w.state)
    body.update(extra)
    return Emit(body)
