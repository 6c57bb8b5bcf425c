"""Effects: what the state machine asks the server to do.

The state machine never performs I/O; each of its methods returns a list of these, in the
order the server must perform them. Connections are plain integers chosen by the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_slicer.slicer.errors import RequestError

ConnId = int


@dataclass(frozen=True, slots=True)
class Grant:
    """Reply OK to an ACQUIRE: `conn` now holds `turn` of `workload`."""

    conn: ConnId
    workload: str
    turn: int
    restored: bool
    waited_ms: int


@dataclass(frozen=True, slots=True)
class Reply:
    """Reply OK with these fields to the request `conn` is waiting on."""

    conn: ConnId
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Deny:
    """Reply ERR (mapped from `error` at the edge) to the request `conn` is waiting on."""

    conn: ConnId
    error: RequestError


@dataclass(frozen=True, slots=True)
class Park:
    """Park `workload` (its processes) on `gpu`; report what was measured with
    `SlicerState.park_done(op, ParkReport)`."""

    op: int
    wid: int
    workload: str
    gpu: int
    mode: str  # checkpoint, cooperative, or freeze (lock only, if `need` bytes are free)
    parked_max: int
    need: int = 0  # freeze: the free bytes the next workload needs (headroom included)
    locked: bool = False  # checkpoint: the processes are locked already (a frozen one)
    early: bool = False  # freeze: for the queue head's early start (`slicer.early`)


@dataclass(frozen=True, slots=True)
class Restore:
    """Restore `workload` onto `gpu`; report what was measured with
    `SlicerState.restore_done(op, RestoreReport)`."""

    op: int
    wid: int
    workload: str
    gpu: int
    procs: tuple[tuple[int, int], ...]  # (pid, start time) of each checkpointed process
    nbytes: int
    thaw: bool = False  # a frozen workload: unlock only, its memory never left
    root: tuple[int, int] = (0, 0)  # the workload's registered process (pid, start time)


@dataclass(frozen=True, slots=True)
class AskPark:
    """Send `PARK workload turn=T` to the registrant `conn` and, unless it answers first,
    call `SlicerState.ask_expired(op)` after `timeout` seconds. `why`: the reason, in
    words, for the log (the PARK line carries none)."""

    op: int
    conn: ConnId
    workload: str
    turn: int
    timeout: float
    why: str = ""


@dataclass(frozen=True, slots=True)
class Recover:
    """After a restart: read the real state of each journaled process of `workload`
    (waiting, bounded, for any cuda-checkpoint still running on them), perform the steps
    `SlicerState.recovery_plan(op, reading)` names to finish or roll back the journaled
    `intent` ("park" or "restore"), and report with `SlicerState.recover_done(op)`."""

    op: int
    wid: int
    workload: str
    gpu: int
    intent: str
    procs: tuple[tuple[int, int], ...]
    parked_max: int
    root: tuple[int, int] = (0, 0)  # the workload's registered process


@dataclass(frozen=True, slots=True)
class Verify:
    """Read `gpu` through the GPU backend (a census, and its free bytes when `need` is not
    0) for a grant of workload `wid`; report with `SlicerState.verified(op)`."""

    op: int
    gpu: int
    wid: int
    need: int


@dataclass(frozen=True, slots=True)
class Recheck:
    """Call `SlicerState.recheck(gpu)` after `delay` seconds (a blocked GPU polls)."""

    gpu: int
    delay: float


@dataclass(frozen=True, slots=True)
class SendFault:
    """Send `FAULT workload turn=T reason=R -- text` to the registrant `conn`."""

    conn: ConnId
    workload: str
    turn: int
    reason: str
    text: str


@dataclass(frozen=True, slots=True)
class SendPreempted:
    """Send `PREEMPTED workload turn=T` to the holder `conn` whose turn was taken back."""

    conn: ConnId
    workload: str
    turn: int


@dataclass(frozen=True, slots=True)
class SendEarly:
    """Send `EARLY workload bytes=N` to the waiter `conn` (an early start), once the
    journal that records it is on disk (else `SlicerState.early_unsent`); its ACQUIRE's
    `wait=` then runs at least `hold` seconds more (its grant follows the park)."""

    conn: ConnId
    workload: str
    nbytes: int
    hold: float


@dataclass(frozen=True, slots=True)
class SendWaiting:
    """Send `WAITING workload turn=T waiters=N` to the holder `conn`."""

    conn: ConnId
    workload: str
    turn: int
    waiters: int


@dataclass(frozen=True, slots=True)
class Reap:
    """Watch a faulted or orphaned workload's processes: report whether they live, their
    GPU memory and the pids holding it with `SlicerState.memory_report` until it says stop.
    A faulted one's GPU processes are killed (a `Kill` effect) `kill_after` seconds on."""

    wid: int
    workload: str
    gpu: int
    pid: int
    start_time: float
    tree: bool
    kill_after: float | None


@dataclass(frozen=True, slots=True)
class Kill:
    """Kill (SIGKILL) the GPU processes `pids` of the faulted workload `workload`."""

    wid: int
    workload: str
    pids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Emit:
    """Broadcast one `EVENT {json}` to watchers."""

    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Persist:
    """The recovery journal changed: write `SlicerState.journal()`.

    `lazy` False: on disk before any later effect of the batch is performed and before
    any reply of the batch leaves. `lazy` True: written once after the batch, off the
    event loop (write-behind); only for records whose loss in a crash recovery survives
    (`slicer.journal` gives the argument per record kind)."""

    lazy: bool = False


Effect = (
    Grant
    | Reply
    | Deny
    | Park
    | AskPark
    | Recover
    | Restore
    | Verify
    | Recheck
    | SendFault
    | SendPreempted
    | SendEarly
    | SendWaiting
    | Reap
    | Kill
    | Emit
    | Persist
)
