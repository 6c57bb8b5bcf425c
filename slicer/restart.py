"""How a restarted daemon rebuilds its records: journal entries out, and back in.

`journal_entries` is what `SlicerState.journal()` writes: every tracked workload's
processes and where its park or restore stood. `resumed` reads one entry back, with the
server's fresh measurement of it (`alive`, `resident_bytes`), and decides the state the
workload resumes in:

    faulted                               -> FAULTED, reaped (and killed after the deadline)
    parking with journaled tool processes -> recovering a "park" (ask the driver first)
    parked/restoring with checkpointed    -> recovering a "park" / "restore"
    an early start under way               -> IDLE, dirty: parked before any grant (held for
                                             its launcher first)
    memory on the device (or unreadable)  -> IDLE (a cooperative one held for its launcher)
    parked/parking/restoring otherwise    -> PARKED (nothing of it on the device)
    anything else                         -> forgotten
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpu_slicer.slicer.model import Ident, Workload, WState


@dataclass(frozen=True, slots=True)
class Resumed:
    """A workload rebuilt from the journal, and what follows: "reap" (watch its
    processes), "reap-kill" (and kill them after the fault deadline), "hold" (a resident
    cooperative orphan left for its launcher to adopt) or "" (nothing)."""

    workload: Workload
    then: str = ""


def _idents(raw: Any) -> tuple[Ident, ...]:
    """Journaled [[pid, start], ...] as idents (anything malformed is skipped)."""
    out: list[Ident] = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, list) and len(item) == 2:
            out.append((int(item[0]), int(item[1])))
    return tuple(out)


def _opt_int(value: Any) -> int | None:
    # Journals before PID namespaces had neither key; a damaged value is dropped, not fatal
    # (it is only shown in STATUS).
    return value if type(value) is int and value > 0 else None  # pids and inodes are > 0


def _opt_bytes(value: Any) -> int | None:
    # A journal of before the parked floor has none: learnt again at the next park.
    return value if type(value) is int and value >= 0 else None


def resumed(e: dict[str, Any], wid: int) -> Resumed | None:
    """The workload entry `e` resumes as (see the table above), or None to forget it.
    An unreadable `resident_bytes` (None) counts as memory on the device: the workload
    is parked before anything is granted."""
    if not e.get("alive"):
        return None
    w = Workload(
        wid=wid,
        name=str(e["name"]),
        gpu=int(e["gpu"]),
        pid=int(e["pid"]),
        start_time=float(e["start_time"]),
        tree=bool(e["tree"]),
        park=str(e["park"]),
        parked_max=int(e["parked_max"]),
        owner_uid=int(e["owner_uid"]),
        registrant=None,
        parks=int(e.get("parks", 0)),
        restores=int(e.get("restores", 0)),
        faults=int(e.get("faults", 0)),
        parked_bytes=int(e.get("parked_bytes", 0)),
        # Journaled: a restart must not take its next holder park, unchecked, for a floor.
        parked_floor=_opt_bytes(e.get("parked_floor")),
        parked_procs=_idents(e.get("parked_procs")),
        fallback=str(e.get("fallback", "none")),
        ask=bool(e.get("ask", False)),
        ns_pid=_opt_int(e.get("ns_pid")),
        pidns=_opt_int(e.get("pidns")),
    )
    state, op_procs = e.get("state"), _idents(e.get("op_procs"))
    early = _opt_int(e.get("early"))
    if state == WState.FAULTED:
        w.state, w.fault_reason = WState.FAULTED, str(e.get("fault_reason"))
        return Resumed(w, "reap-kill")
    if state == WState.PARKING and op_procs:
        # The tool may have run (or still run) on these: ask the driver.
        w.state, w.recover = WState.PARKING, "park"
        w.op_procs, w.op_bytes = op_procs, int(e.get("op_bytes", 0))
        w.early = early or 0  # an abandoned early start's park: recovery keeps it dirty
        return Resumed(w)
    if early and w.park == "cooperative" and not w.parked_procs:
        # An early start (`slicer.early`) was under way: it may hold memory, a wake may be
        # in flight; whatever the GPU shows now, it is parked by cuda-checkpoint before
        # anyone else is granted.
        w.state, w.early = WState.IDLE, early
        w.must_park = w.holder_died = True
        return Resumed(w, "hold")
    if state in (WState.PARKED, WState.RESTORING) and w.parked_procs:
        w.state = WState(str(state))
        w.recover = "restore" if state == WState.RESTORING else "park"
        w.op_procs = w.parked_procs
        return Resumed(w)
    if (resident := e.get("resident_bytes")) is None or int(resident) > w.parked_max:
        w.state = WState.IDLE
        return Resumed(w, "hold" if w.park == "cooperative" else "")
    if state in (WState.PARKED, WState.PARKING, WState.RESTORING):
        w.state = WState.PARKED
        return Resumed(w, "reap")
    return None


def journal_entries(workloads: Iterable[Workload]) -> list[dict[str, Any]]:
    """What a restarted daemon needs to know: every tracked workload's processes."""
    return [_entry(w) for w in workloads]


def _entry(w: Workload) -> dict[str, Any]:
    # A frozen workload (fit-aware turns) is journaled as a park in flight over its
    # locked processes, a thaw in flight as a restore: a restart finishes the park
    # (checkpoint what is locked) or the thaw (unlock), and never forgets a lock.
    state, parked, op_procs = str(w.state), w.parked_procs, w.op_procs
    if w.state is WState.FROZEN:
        state, op_procs = str(WState.PARKING), w.frozen_procs
    elif w.state is WState.RESTORING and w.frozen_procs:
        parked = w.frozen_procs
    return {
        "name": w.name,
        "gpu": w.gpu,
        "pid": w.pid,
        "start_time": w.start_time,
        "tree": w.tree,
        "park": w.park,
        "parked_max": w.parked_max,
        "owner_uid": w.owner_uid,
        "state": state,
        "parked_bytes": w.parked_bytes,
        "parked_procs": [list(p) for p in parked],
        "op_procs": [list(p) for p in op_procs],
        "op_bytes": w.op_bytes,
        "fallback": w.fallback,
        "ask": w.ask,
        "ns_pid": w.ns_pid,
        "pidns": w.pidns,
        "parks": w.parks,
        "restores": w.restores,
        "faults": w.faults,
        "fault_reason": w.fault_reason,
        "early": w.early,
        **({} if w.parked_floor is None else {"parked_floor": w.parked_floor}),
    }
