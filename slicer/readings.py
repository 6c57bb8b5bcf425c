"""What the server measures: the inputs of the state machine's decisions.

The server reads the GPU backend, /proc and the cuda-checkpoint tool and hands the state
machine these plain records; the state machine (with the rules of `slicer.policy`) decides
what they mean: whether a park held, whether a process that exited under the tool counts as
parked, what blocks a grant, what recovery does next. Nothing here performs I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Ident = tuple[int, int]  # (pid, start time in clock ticks)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one run of cuda-checkpoint over all of a workload's processes ended."""

    ok: bool
    reason: str = ""
    text: str = ""


@dataclass(slots=True)
class Census:
    """Device bytes per workload id on one GPU, the pids behind them, and the unattributed
    rest (pid -> bytes of processes no workload owns)."""

    bytes_by_wid: dict[int, int] = field(default_factory=dict)
    pids_by_wid: dict[int, list[int]] = field(default_factory=dict)
    foreign: dict[int, int] = field(default_factory=dict)
    # Elimination only (`census.eliminate`): device bytes beyond every workload's budget
    # that no workload may be holding now, and the backend's (host) pids on the GPU.
    unattributed: int = 0
    unattributed_pids: list[int] = field(default_factory=list)
    # By pids only (`census.take`): per tree=1 workload, the processes on the way from a
    # GPU process up to its root (the GPU process included): its members, which stay its
    # own once a dead parent has them reparented out of its tree (`Attribution`).
    members: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def of(self, wid: int) -> int:
        """Device bytes held by workload `wid`."""
        return self.bytes_by_wid.get(wid, 0)


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A measurement that could not be taken: `reason` says which step failed (for
    example `backend-error`), `error` is the text."""

    reason: str
    error: str


@dataclass(frozen=True, slots=True)
class ParkReport:
    """What the server saw around one Park effect.

    `before`: the workload's device bytes before the tool ran (checkpoint parks only);
    `procs`: the processes handed to the tool; `tool`: its outcome, None when it did not
    run; `alive`: after it ran, whether each of `procs` still lives; `after`: the
    workload's device bytes once the park ended; `error`: a step of the park raised.
    """

    ms: int = 0
    before: int = 0
    procs: tuple[Ident, ...] = ()
    tool: Outcome | None = None
    alive: tuple[bool, ...] = ()
    after: int | Unreadable = Unreadable("park-error", "not measured")
    error: str = ""
    # A freeze: `frozen` when it locked the processes; `declined` when the GPU had less
    # free than the next workload needs (nothing was done: the op parks it instead).
    frozen: bool = False
    declined: bool = False
    # `after` is by elimination (census `elimination`): the GPU's total less the other
    # workloads' budgets, not this workload's own bytes.
    blind: bool = False


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What the server saw around one Restore effect: which checkpointed processes still
    lived (`live`, the ones the tool ran on), the tool's outcome (None when it did not run),
    an `error` when a step raised, and, read once the tool ended, whether any of its
    checkpointed processes (`survivors`) or its registered process (`root_alive`) lives."""

    ms: int = 0
    live: tuple[Ident, ...] = ()
    tool: Outcome | None = None
    error: str = ""
    survivors: bool = True
    root_alive: bool = True


@dataclass(frozen=True, slots=True)
class RecoveryReading:
    """The real state of one recovering workload's journaled processes, after a restart.

    `live`: the journaled processes that still live; `root_alive`: whether the workload's
    registered process lives; `tools`: (tool pid, target pid) of each cuda-checkpoint run
    a dead daemon left that was still running after the bounded wait; `states`: the
    driver's state of each live pid (`--get-state`; a pid is missing when its state did not
    settle in time, and nothing is asked while a leftover tool runs); `has_action`: the
    tool knows `--action` (not an r550 driver).
    """

    live: tuple[Ident, ...] = ()
    root_alive: bool = False
    tools: tuple[tuple[int, int], ...] = ()
    states: dict[int, str] = field(default_factory=dict)
    has_action: bool = True


@dataclass(frozen=True, slots=True)
class RecoverReport:
    """What the server saw of one Recover effect: the `reading` the plan was made from
    (None when reading failed, with `error`), how performing the plan's steps went, and
    the workload's device bytes afterwards."""

    reading: RecoveryReading | None = None
    steps: Outcome = Outcome(True)
    after: int | Unreadable = Unreadable("recover-error", "not measured")
    error: str = ""
