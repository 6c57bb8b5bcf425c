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
    PARKING    -> PARKED | FAULTED
    PARKED     -> RESTORING (checkpoint)   | ACTIVE (cooperative: the workload restores
                                             itself when granted)
    RESTORING  -> ACTIVE | IDLE (its waiter left meanwhile) | FAULTED
    FAULTED    -> (terminal: the record is dropped when its processes hold no GPU memory)

Any other change raises `IllegalTransition` and leaves the record as it was.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from slicer.effects import ConnId
from slicer.errors import IllegalTransition


class WState(enum.StrEnum):
    """A workload's state, as STATUS reports it."""

    REGISTERED = "registered"
    ACTIVE = "active"
    IDLE = "idle"
    PARKING = "parking"
    PARKED = "parked"
    RESTORING = "restoring"
    FAULTED = "faulted"


TRANSITIONS: dict[WState, frozenset[WState]] = {
    WState.REGISTERED: frozenset({WState.ACTIVE, WState.IDLE}),
    WState.ACTIVE: frozenset({WState.IDLE, WState.PARKING, WState.FAULTED}),
    WState.IDLE: frozenset({WState.ACTIVE, WState.PARKING}),
    WState.PARKING: frozenset({WState.PARKED, WState.FAULTED}),
    WState.PARKED: frozenset({WState.RESTORING, WState.ACTIVE}),
    WState.RESTORING: frozenset({WState.ACTIVE, WState.IDLE, WState.FAULTED}),
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
    turn: int | None = None
    parks: int = 0
    restores: int = 0
    faults: int = 0
    grants: int = 0
    last_park_ms: int | None = None
    last_restore_ms: int | None = None
    parked_bytes: int = 0
    parked_pids: tuple[int, ...] = ()
    fault_reason: str | None = None
    last_turn: int = 0
    # Set when the turn ended in a way that leaves the state dirty (RELEASE park=now, a
    # holder that was not the registrant died): park before anything else happens.
    must_park: bool = False
    # The RELEASE waiting for this workload's park to answer it.
    park_reply: ConnId | None = None
    # A recovered, still-resident cooperative orphan is left alone until then, so that
    # its launcher can re-REGISTER and adopt it (slicerd cannot park it itself).
    hold_until: float = 0.0

    @property
    def detached(self) -> bool:
        """True once the registration ended while the processes still need tracking."""
        return self.registrant is None

    def to(self, new: WState) -> None:
        """Move to `new` if the table allows it; otherwise raise and change nothing."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"workload {self.name}: {self.state} -> {new} is not allowed")
        self.state = new


@dataclass(slots=True)
class Waiter:
    """A connection queued for a turn of `workload`."""

    conn: ConnId
    workload: Workload
    since: float


@dataclass(slots=True)
class Holder:
    """The connection holding the GPU's current turn."""

    conn: ConnId
    workload: Workload
    turn: int
    since: float


class OpKind(enum.StrEnum):
    """The one slow thing a GPU may have in flight."""

    PARK = "park"
    RESTORE = "restore"
    VERIFY = "verify"


@dataclass(slots=True)
class Op:
    """An operation in flight on one GPU; results name it by `op_id`."""

    kind: OpKind
    op_id: int
    workload: Workload
    reply_conn: ConnId | None = None


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
