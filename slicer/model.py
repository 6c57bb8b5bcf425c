"""The records the state machine keeps: workloads, GPUs, waiters, holders, operations.

Theory of operation (the transition table)
------------------------------------------
A workload is *resident* while its GPU memory is on the device: ACTIVE (a connection holds
its turn), IDLE (released, nobody else wanted the GPU yet) or FAULTED (a park or restore
failed: the GPU stays taken until its processes are gone). PARKING and RESTORING are the
two moves between device and host; only one move runs per GPU at a time. PARKED means the
backend verified it holds at most `parked_max` bytes. REGISTERED is "never granted and not
resident": granting it needs no restore.

    REGISTERED -> ACTIVE (granted)         | IDLE (already holds memory at REGISTER)
    ACTIVE     -> IDLE (lazy release)      | PARKING (release now, holder died, registrant
                                             left) | FAULTED
    IDLE       -> ACTIVE (re-acquire)      | PARKING (someone else is at the queue head)
    PARKING    -> PARKED | FAULTED         | IDLE (recovery: the interrupted park never
                                             touched the processes)
    PARKED     -> RESTORING (checkpointed) | ACTIVE (cooperative: the workload restores
                                             itself when granted) | IDLE (recovery: the
                                             processes were found running) | FAULTED
                                             (recovery: the driver reports them failed)
    RESTORING  -> ACTIVE | IDLE (its waiter left meanwhile, or recovery finished the
                  restore) | PARKED (recovery: the restore never started) | FAULTED
    FAULTED    -> (terminal: the record is dropped when its processes hold no GPU memory)

Any other change raises `IllegalTransition` and leaves the record as it was.

A cooperative workload is parked by whoever holds its turn (the dispatcher sleeps vLLM).
When nobody can (the holder died), the park op goes through stages (`ParkStage`): VERIFY
what the backend sees; ASK the registrant to park it (`PARK` event) within a bound;
REVERIFY; then CHECKPOINT it as a fallback where the workload allows it; FAULT only when
all of that failed. A checkpoint-parked workload (its `parked_procs` is not empty) is
restored with cuda-checkpoint before its next grant, whatever its park mode.

After a restart, a workload journaled in the middle of a park or restore, or parked with
checkpointed processes, is *recovering*: its GPU runs one RECOVER op for it (the server
asks the driver for each process's real state and finishes or rolls back the op) before
anything else happens on that GPU.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from gpu_slicer.slicer.effects import ConnId
from gpu_slicer.slicer.errors import IllegalTransition

Ident = tuple[int, int]  # (pid, start time in clock ticks): a process, never a pid alone


class WState(enum.StrEnum):
    """A workload's state, as STATUS reports it."""

    REGISTERED = "registered"
    ACTIVE = "active"
    IDLE = "idle"
    PARKING = "parking"
    PARKED = "parked"
    RESTORING = "restoring"
    FAULTED = "faulted"
    # Resident but locked (cuda-checkpoint lock): no CUDA work runs, its memory stays
    # (fit-aware turns, `slicer.fit`); thawed (unlock) at its next turn.
    FROZEN = "frozen"


TRANSITIONS: dict[WState, frozenset[WState]] = {
    WState.REGISTERED: frozenset({WState.ACTIVE, WState.IDLE}),
    WState.ACTIVE: frozenset({WState.IDLE, WState.PARKING, WState.FAULTED}),
    WState.IDLE: frozenset({WState.ACTIVE, WState.PARKING}),
    WState.PARKING: frozenset({WState.PARKED, WState.FAULTED, WState.IDLE, WState.FROZEN}),
    WState.PARKED: frozenset({WState.RESTORING, WState.ACTIVE, WState.IDLE, WState.FAULTED}),
    WState.RESTORING: frozenset({WState.ACTIVE, WState.IDLE, WState.PARKED, WState.FAULTED}),
    WState.FROZEN: frozenset({WState.RESTORING, WState.PARKING, WState.FAULTED}),
    WState.FAULTED: frozenset(),
}

RESIDENT = frozenset({WState.ACTIVE, WState.IDLE, WState.FAULTED})


@dataclass(eq=False)
class Workload:
    """One registered (or orphaned, still-tracked) workload."""

    wid: int
    name: str
    gpu: int
    pid: int
    start_time: float
    tree: bool
    park: str
    parked_max: int
    owner_uid: int
    registrant: ConnId | None
    state: WState = WState.REGISTERED
    # The registered process's pid in the registrant's PID namespace and that namespace's
    # inode, when it is not slicerd's (a pod); `pid` is always slicerd's number.
    ns_pid: int | None = None
    pidns: int | None = None
    turn: int | None = None
    parks: int = 0
    restores: int = 0
    faults: int = 0
    grants: int = 0
    last_park_ms: int | None = None
    last_restore_ms: int | None = None
    parked_bytes: int = 0
    # The least a cooperative park of it left on the GPU (a slept vLLM's CUDA context):
    # a later park by its holder that leaves clearly more proved nothing (a sleep that did
    # nothing, a half-woken vLLM), even under parked_max (`ParkResults._above_floor`).
    # None until its first cooperative park; a park by its registrant (which wakes it
    # fully before it sleeps it) sets it anew, so a residue that grew for good costs one
    # such park. Journaled (a restart keeps it).
    parked_floor: int | None = None
    # The (pid, start time) of each process checkpointed by the last park: what a restore
    # must bring back. Empty for a cooperative park (the workload freed the GPU itself).
    parked_procs: tuple[Ident, ...] = ()
    # The processes a freeze locked (fit-aware turns): what a thaw unlocks; and the device
    # bytes they held then (locked, they neither grow nor shrink: a census by elimination
    # holds a frozen workload to them, `slicer.census.held_to`).
    frozen_procs: tuple[Ident, ...] = ()
    frozen_bytes: int = 0
    freezes: int = 0
    # What cooperative workloads may fall back to when they cannot park themselves.
    fallback: str = "none"
    # The registrant answers PARK events (it can park the workload itself).
    ask: bool = False
    # Opt-in preemption (park=checkpoint only): a turn held longer than this while
    # another workload waits is taken back (`slicer.preempt`); None: never.
    max_turn: float | None = None
    preemptions: int = 0
    # Turns its holder released as `used=0` (no work done in them), and those of them a
    # park or restore was paid for (`Holder.paid`): wasted turns.
    unused_turns: int = 0
    wasted_turns: int = 0
    preempted_turn: int = 0  # the last turn taken back (a late RELEASE of it is told so)
    # A checkpoint park in flight: the processes handed to the tool and the bytes they
    # held, journaled before the tool runs so that a restarted daemon knows whom to ask.
    op_procs: tuple[Ident, ...] = ()
    op_bytes: int = 0
    # Set by a restart: "park" or "restore", the journaled intent that recovery finishes
    # or rolls back before anything else happens on the GPU.
    recover: str | None = None
    fault_reason: str | None = None
    last_turn: int = 0
    # Set when the turn ended in a way that leaves the state dirty (RELEASE park=now, a
    # holder that was not the registrant died): park before anything else happens.
    must_park: bool = False
    # The turn ended because its holder's connection closed (it died mid-turn).
    holder_died: bool = False
    # The RELEASE waiting for this workload's park to answer it.
    park_reply: ConnId | None = None
    # A recovered, still-resident cooperative orphan is left alone until then, so that
    # its launcher can re-REGISTER and adopt it (slicerd cannot park it itself).
    hold_until: float = 0.0
    # A restore brought its memory back for the waiter at the queue head: its grant
    # says restored=1 (cleared by that grant, or when nobody of it waits any more).
    restored: bool = False
    # Bytes it was told it may use before its grant (an early start, `slicer.early`):
    # set when EARLY is sent, cleared by its grant or by the park that follows an early
    # start abandoned; journaled, so a restart parks it before granting anyone else.
    early: int = 0
    # A faulted workload's GPU processes are killed at this (monotonic) time; when the
    # last SIGKILL went out (None: none yet). It is sent again while they still hold the
    # GPU `policy.KILL_RETRY_S` later: a kill that failed (EPERM, a pid namespace) must
    # not leave the GPU taken for good.
    kill_at: float | None = None
    killed_at: float | None = None
    # An orphan whose registered process died with processes once of its tree alive
    # (`Attribution.survivors`): since when (monotonic); they are killed
    # `fault_kill_after` later (`SlicerState.memory_report`).
    orphan_since: float | None = None

    @property
    def detached(self) -> bool:
        """True once the registration ended while the processes still need tracking."""
        return self.registrant is None

    def check(self, new: WState) -> None:
        """Raise `IllegalTransition` unless the table allows moving to `new`; a caller
        checks every move it will make before it changes anything."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"workload {self.name}: {self.state} -> {new} is not allowed")

    def to(self, new: WState) -> None:
        """Move to `new` if the table allows it; otherwise raise and change nothing."""
        self.check(new)
        self.state = new


@dataclass(slots=True)
class Waiter:
    """A connection queued for a turn of `workload`."""

    conn: ConnId
    workload: Workload
    since: float
    early: int = 0  # ACQUIRE early=: bytes it can start with before its grant
    early_sent: bool = False  # EARLY went out to it


@dataclass(slots=True)
class Holder:
    """The connection holding the GPU's current turn."""

    conn: ConnId
    workload: Workload
    turn: int
    since: float
    # A park (of anyone, on this GPU, while someone waited) or a restore of it came before
    # this grant: a turn released `used=0` is then a wasted turn, not only an unused one.
    paid: bool = False


class OpKind(enum.StrEnum):
    """The one slow thing a GPU may have in flight."""

    PARK = "park"
    RESTORE = "restore"
    VERIFY = "verify"
    RECOVER = "recover"


class ParkStage(enum.StrEnum):
    """Where a park op stands (see the theory of operation above)."""

    VERIFY = "verify"  # the backend is read (cooperative), or the tool runs (checkpoint)
    ASK = "ask"  # the registrant was sent PARK and has not answered yet
    REVERIFY = "reverify"  # after the registrant's answer (or its silence)
    CHECKPOINT = "checkpoint"  # the cuda-checkpoint fallback of a cooperative workload


@dataclass(slots=True)
class Op:
    """An operation in flight on one GPU; results name it by `op_id`."""

    kind: OpKind
    op_id: int
    workload: Workload
    reply_conn: ConnId | None = None
    stage: ParkStage = ParkStage.VERIFY
    why: str | None = None  # a park that asked its registrant: why (STATUS park_reason)
    need: int = 0  # a VERIFY op: the free bytes the grant needs (a restore's)
    # A freeze for this waiter's early start (`slicer.early`): EARLY goes to it alone, and
    # only while it is the queue head (a re-ACQUIRE is another waiter, asking anew).
    early: Waiter | None = None


@dataclass
class Gpu:
    """One GPU: its holder, its FIFO queue, its operation in flight."""

    index: int
    uuid: str
    holder: Holder | None = None
    queue: OrderedDict[ConnId, Waiter] = field(default_factory=OrderedDict)
    op: Op | None = None
    grants: int = 0
    foreign: list[dict[str, int | str]] = field(default_factory=list)
    dirty: bool = True
    waiting_sent: bool = False
    parked_since_grant: bool = False  # a park held since the last grant (`Holder.paid`)
    # waiters per workload id, kept with the queue so WAITING counts are O(1)
    waiting: dict[int, int] = field(default_factory=dict)

    def head(self) -> Waiter | None:
        """The first waiter, or None."""
        return next(iter(self.queue.values()), None)


@dataclass(slots=True)
class Conn:
    """What the state machine knows of one client connection."""

    uid: int
    pid: int
    waiting_on: int | None = None
    # In config `allow_group`: may take turns of any workload (never register others'
    # processes, which stays root's or the owner's right).
    trusted: bool = False
