"""The rules `SlicerState` decides by: pure functions from measurements to verdicts.

Each rule answers one question the server used to answer itself:

- `refusal`: may a new connection of this uid be served (connection limits, room kept for
  root)?
- `next_move`: what is the next step towards granting a GPU to its queue head (settle a
  recovery, park whoever is in the way, verify, restore, grant)?
- `blockers`: what, per a census of the GPU, keeps a workload from being granted it?
- `judge_park`: did a park hold? A process that exited under cuda-checkpoint (a workload
  ending right after its turn) freed its memory with it: it counts as parked, and the
  backend's reading decides.
- `judge_restore`: did a restore hold? Without a live checkpointed process there is
  nothing to bring back, which is never a success.
- `plan_recovery` / `judge_recovery`: how a park or restore that a dead daemon left behind
  is finished or rolled back (the table in `slicer.recovery`), and whether it held.
- `kill_due`: is it time to kill a faulted workload's GPU processes?
- `parker_needed`: does a registration depend on slicerd's parker (cuda-checkpoint or the
  driver API), so that it is refused while the parker cannot run?

Nothing here performs I/O or keeps state; `tests/test_state_policy.py` tables each rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpu_slicer.slicer import fit
from gpu_slicer.slicer.model import RESIDENT, Gpu, Op, Waiter, Workload, WState
from gpu_slicer.slicer.readings import (
    Census,
    Ident,
    Outcome,
    ParkReport,
    RecoverReport,
    RecoveryReading,
    RestoreReport,
    Unreadable,
)

TRANSIENT = ("checkpointing", "restoring")  # driver states recovery asks again about

# ---- connections -----------------------------------------------------------------------


def refusal(
    *, total: int, of_uid: int, uid: int, exempt: bool, most: int, per_uid: int, reserved: int
) -> str:
    """Why a new connection of `uid` is refused ("" when it is not): `total` connections
    are open, `of_uid` of them by this uid; `exempt` peers (root, the allowed group) have
    no per-uid limit."""
    if total >= most:
        return f"at most {most} connections"
    # Room kept for root alone: an operator can always inspect, a root launcher can
    # always re-register, whatever any other uid (allow_group members too) holds.
    reserve = min(reserved, most // 2)
    if uid != 0 and total >= most - reserve:
        return f"at most {most - reserve} connections for uids other than root"
    if not exempt and of_uid >= per_uid:
        return f"at most {per_uid} connections per uid (uid {uid})"
    return ""


def parker_needed(park: str, fallback: str, checkpointed: bool = False) -> str:
    """Why a registration with `park` and `fallback` (adopting a workload whose processes
    are `checkpointed` or locked) needs slicerd's parker, in the REGISTER's words; "" when
    it does not (a workload that parks itself, with no fallback)."""
    if park == "checkpoint":
        return "park=checkpoint"
    if fallback in ("checkpoint", "residue"):
        return f"fallback={fallback}"
    if checkpointed:
        return "its processes are checkpointed (a restore brings them back)"
    return ""


# ---- grants ----------------------------------------------------------------------------


def blockers(
    seen: Census | Unreadable,
    wid: int,
    others: Iterable[Workload],
    *,
    need: int,
    free: int | None,
    foreign_blocks: bool,
) -> list[dict[str, Any]]:
    """What keeps workload `wid` from being granted its GPU, per `seen`: foreign memory
    (when it blocks), any other workload of the GPU above its `parked_max`, and fewer than
    `need` free bytes. An unreadable GPU blocks: nothing is granted on a guess."""
    if isinstance(seen, Unreadable):
        return [{"reason": seen.reason, "error": seen.error}]
    out: list[dict[str, Any]] = []
    if foreign_blocks:
        out += [{"pid": p, "bytes": b} for p, b in sorted(seen.foreign.items())]
    if seen.unattributed:
        # Elimination cannot tell a foreign process from a parked workload that grew: it
        # blocks whatever `foreign` says (README, "PID namespaces").
        pids = ",".join(map(str, seen.unattributed_pids[:16]))
        out.append({"reason": "unattributed", "bytes": seen.unattributed, "host_pids": pids})
    for w in others:
        # A frozen workload is resident on purpose: it runs nothing (fit-aware turns);
        # the room the grant needs is checked apart (`need`).
        if w.wid != wid and w.state is not WState.FROZEN and seen.of(w.wid) > w.parked_max:
            out.append({"workload": w.name, "pid": w.pid, "bytes": seen.of(w.wid)})
    if need and (free is None or free < need):
        out.append({"reason": "no-room", "need": need, "free": free})
    return out


@dataclass(frozen=True, slots=True)
class Move:
    """What `next_move` chose for one GPU: recover, hold (look again after `delay`),
    park, verify, restore or grant workload `w` (the queue head's `waiter` for the last
    three)."""

    kind: str
    w: Workload | None
    waiter: Waiter | None = None
    delay: float = 0.0

    def check(self) -> None:
        """Raise `IllegalTransition` unless the table allows the move's workload to take
        it (checked before anything changes)."""
        target = _TARGETS.get(self.kind)
        if target is not None and self.w is not None:
            self.w.check(target)


_TARGETS = {
    "park": WState.PARKING,
    "restore": WState.RESTORING,
    "thaw": WState.RESTORING,
    "grant": WState.ACTIVE,
}


def next_move(
    gpu: Gpu,
    on_gpu: list[Workload],
    now: float,
    verified: Workload | None,
    answering: Op | None = None,
) -> Move | None:
    """The next step towards granting `gpu` to its queue head, from the workloads
    `on_gpu`; None when there is nothing to do. `verified`: the backend was just read (or
    a restore just ended) for that workload; `answering`: the Verify op whose result this
    is, still on the GPU. SlicerState makes the move; this decides it, changing nothing."""
    if (gpu.op is not None and gpu.op is not answering) or gpu.dirty:
        return None
    for w in on_gpu:
        if w.recover is not None:
            # A restart interrupted this one's park or restore: settle it first.
            return Move("recover", w)
    residents = [w for w in on_gpu if w.state in RESIDENT]
    holder_w = gpu.holder.workload if gpu.holder is not None else None
    head = gpu.head()
    head_w = head.workload if head is not None else None
    idle = [w for w in residents if w.state is WState.IDLE]
    # Dirty or abandoned workloads first, then whoever stands between the head and the
    # GPU (or crowds it next to another resident).
    held = [w for w in idle if w.detached and w.hold_until > now]
    if held:
        # The GPU stays taken until it is adopted or its grace ends: look again then.
        return Move("hold", None, delay=max(0.01, min(w.hold_until for w in held) - now))
    for w in idle:
        if w.must_park or w.detached:
            return Move("park", w)
    for w in on_gpu:
        if w.state is WState.FROZEN and w.detached:
            # Its registration ended: nobody will thaw it; checkpoint what it locked.
            return Move("park", w)
    for w in idle:
        crowded = len(residents) > 1 and w is not holder_w
        if w is not head_w and (head_w is not None or crowded):
            return Move("park", w)
    if any(w.state is WState.FAULTED for w in residents):
        return None  # never granted while a faulted one is resident
    if gpu.holder is not None or head is None or head_w is None:
        return None
    frozen = [w for w in on_gpu if w.state is WState.FROZEN and w is not head_w]
    if frozen and fit.known_need(head_w) is None:
        # The head's need is unknown (it never ran, or parked itself): nothing frozen
        # may stay beside it (`slicer.fit`).
        return Move("park", frozen[0])
    if verified is not head_w:
        return Move("verify", head_w, head)
    if head_w.state is WState.FROZEN:
        return Move("thaw", head_w, head)
    if head_w.state is WState.PARKED and head_w.parked_procs:
        return Move("restore", head_w, head)
    return Move("grant", head_w, head)


# ---- parks and restores ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParkVerdict:
    """Whether a park held; `moved` bytes left the device, `procs` are checkpointed."""

    ok: bool
    reason: str = ""
    text: str = ""
    moved: int = 0
    procs: tuple[Ident, ...] = ()


def judge_park(r: ParkReport, gpu: int, parked_max: int, cooperative: bool) -> ParkVerdict:
    """The verdict on one park: the tool's failure stands while any of its processes
    lives; otherwise the backend decides (at most `parked_max` bytes may stay)."""
    procs = r.procs
    if r.tool is not None and not r.tool.ok:
        if any(r.alive):
            return ParkVerdict(False, r.tool.reason, r.tool.text)
        # The processes exited under the tool (a workload ending right after its turn):
        # the driver freed their memory, so nothing is left to park or to restore.
        procs = ()
    if r.error:
        return ParkVerdict(False, "park-error", r.error)
    if isinstance(r.after, Unreadable):
        return ParkVerdict(False, "park-error", r.after.error)
    if r.after > parked_max:
        when = "at" if cooperative else "after"
        text = f"{r.after} bytes still on GPU {gpu} {when} park (parked_max={parked_max})"
        return ParkVerdict(False, "still-resident", text)
    return ParkVerdict(True, moved=max(0, r.before - r.after), procs=procs)


GONE = "gone"  # judge_restore's reason for a workload whose every process exited


def judge_restore(r: RestoreReport) -> Outcome:
    """The verdict on one restore. A workload whose checkpointed processes and registered
    process all exited (before or under the tool) is ending: reason `GONE`, never a
    fault (its memory went with them); a live root whose processes vanished is."""
    if not r.survivors and not r.root_alive:
        return Outcome(False, GONE, "every process of it exited")
    if r.error:
        return Outcome(False, "restore-error", r.error)
    if not r.live:
        # Never a success: its memory is nowhere to be brought back from.
        return Outcome(False, "restore-no-process", "no parked process of it lives")
    if r.tool is None:
        return Outcome(False, "restore-error", "the tool did not run")
    return r.tool


# ---- recovery ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Recovered:
    """How recovery settled one workload: `result` is parked (`procs` checkpointed),
    resident, gone or fault (`reason`, `text`)."""

    result: str
    procs: tuple[Ident, ...] = ()
    reason: str = ""
    text: str = ""


Step = tuple[str, tuple[int, ...]]  # (cuda-checkpoint action, or "toggle"; pids)


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """The tool steps to perform, in order (stop at the first that fails), and what the
    workload is once all of them succeeded."""

    steps: tuple[Step, ...] = ()
    result: Recovered = Recovered("fault", (), "recover-error", "no plan")


def _fault(reason: str, text: str) -> RecoveryPlan:
    return RecoveryPlan((), Recovered("fault", (), reason, text))


def plan_recovery(intent: str, reading: RecoveryReading) -> RecoveryPlan:
    """How to finish or roll back the journaled `intent` ("park" or "restore") of one
    workload, from the real state of its processes (see `slicer.recovery`)."""
    if not reading.live:
        if not reading.root_alive:
            return RecoveryPlan((), Recovered("gone"))
        if intent == "park":
            return RecoveryPlan((), Recovered("resident"))  # they died before anything moved
        return _fault("restore-no-process", "none of its checkpointed processes lives")
    if reading.tools:
        text = ", ".join(f"tool pid {t} on pid {p}" for t, p in sorted(reading.tools))
        return _fault("tool-still-running", f"cuda-checkpoint still running: {text}")
    pids = sorted({pid for pid, _ in reading.live})
    if any(reading.states.get(pid, TRANSIENT[0]) in TRANSIENT for pid in pids):
        return _fault("get-state-timeout", "the driver's state did not settle in time")
    for pid in pids:
        state = reading.states[pid]
        if state == "failed" or state.startswith("error"):
            return _fault("recover-failed", f"pid {pid} is {state}")
    cuda = {pid: reading.states[pid] for pid in pids if reading.states[pid] != "none"}
    checkpointed = tuple(p for p in reading.live if p[0] in cuda)
    lock_then_checkpoint = (("running", "lock"), "checkpoint")
    if intent == "park":
        if all(st == "running" for st in cuda.values()):
            return RecoveryPlan((), Recovered("resident"))
        return _two_steps(cuda, *lock_then_checkpoint, reading.has_action, "parked", checkpointed)
    if cuda and all(st == "checkpointed" for st in cuda.values()):
        return RecoveryPlan((), Recovered("parked", checkpointed))
    if any(st == "checkpointed" for st in cuda.values()):
        return _two_steps(cuda, *lock_then_checkpoint, reading.has_action, "parked", checkpointed)
    return _two_steps(cuda, ("checkpointed", "restore"), "unlock", reading.has_action, "resident")


def _two_steps(
    cuda: dict[int, str],
    first: tuple[str, str],
    then: str,
    has_action: bool,
    result: str,
    procs: tuple[Ident, ...] = (),
) -> RecoveryPlan:
    # `first` = (state, action): that action on the processes in that state; then `then`
    # on them and on the `locked` ones (where the first step already ended). On an r550
    # tool (no --action) `--toggle` does both steps, and a locked process is stuck.
    state, action = first
    start = tuple(p for p, st in cuda.items() if st == state)
    locked = tuple(p for p, st in cuda.items() if st == "locked")
    done = Recovered(result, procs)
    if not has_action:
        if locked:
            return _fault("recover-failed", f"pids {list(locked)} are locked; no --action")
        return RecoveryPlan((("toggle", start),) if start else (), done)
    steps: list[Step] = [(action, start)] if start else []
    if start + locked:
        steps.append((then, start + locked))
    return RecoveryPlan(tuple(steps), done)


def judge_recovery(intent: str, r: RecoverReport, gpu: int, parked_max: int) -> Recovered:
    """The verdict on one recovery: the plan's result when its steps succeeded, and a
    "parked" result only when the backend agrees."""
    if r.error or r.reading is None:
        return Recovered("fault", (), "recover-error", r.error or "nothing was read")
    plan = plan_recovery(intent, r.reading)
    if plan.steps and not r.steps.ok:
        return Recovered("fault", (), r.steps.reason, r.steps.text)
    done = plan.result
    if done.result == "parked":
        if isinstance(r.after, Unreadable):
            return Recovered("fault", (), "recover-error", r.after.error)
        if r.after > parked_max:
            text = f"{r.after} bytes still on GPU {gpu} after recovery"
            return Recovered("fault", (), "still-resident", text)
    return done


# ---- faults ------------------------------------------------------------------------------


KILL_RETRY_S = 10.0  # a SIGKILL that left its processes holding the GPU is sent again


def kill_due(
    kill_at: float | None,
    killed_at: float | None,
    alive: bool,
    holders: tuple[int, ...],
    now: float,
) -> bool:
    """Kill a faulted workload's GPU processes now? After its deadline, while it lives,
    and only when some process of it holds the GPU (the registrant, say a launcher
    stopping its child, is left to finish its own cleanup); once, unless they still hold
    it `KILL_RETRY_S` after the last kill (that kill failed: EPERM, another namespace)."""
    if kill_at is None or now < kill_at or not alive or not holders:
        return False
    return killed_at is None or now >= killed_at + KILL_RETRY_S
