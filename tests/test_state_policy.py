"""The decisions the server used to make, now the state machine's: tabled, pure, no I/O.

Each table feeds `slicer.policy` (or `SlicerState`) what a server would have measured and
checks the verdict: who is admitted, what blocks a grant, whether a park or restore held
(a process that exited under the tool counts as parked), how recovery finishes or rolls
back an interrupted operation, when a faulted workload is killed, and what unreadable
memory means after a restart.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpu_slicer.slicer import errors, policy
from gpu_slicer.slicer.effects import Kill, Park
from gpu_slicer.slicer.model import Workload
from gpu_slicer.slicer.readings import (
    Census,
    Outcome,
    ParkReport,
    RecoverReport,
    RecoveryReading,
    RestoreReport,
    Unreadable,
)
from gpu_slicer.slicer.state import Limits, SlicerState
from tests.test_state import (
    D1,
    D2,
    D3,
    GIB,
    GPUS,
    KILL_AFTER,
    MOVED,
    PIDS,
    RA,
    USER,
    Driver,
    fresh,
    journal_entry,
    setup,
    snapshot,
)

# ---- admission -------------------------------------------------------------------------

LIMITS = {"most": 10, "per_uid": 3, "reserved": 2}


@pytest.mark.parametrize(
    ("total", "of_uid", "uid", "exempt", "why"),
    [
        (0, 0, USER, False, ""),
        (2, 2, USER, False, ""),
        (3, 3, USER, False, f"at most 3 connections per uid (uid {USER})"),
        (3, 3, USER, True, ""),  # the allowed group has no per-uid limit
        (8, 0, USER, True, "at most 8 connections for uids other than root"),  # root's room
        (8, 8, 0, True, ""),
        (9, 9, 0, True, ""),
        (10, 10, 0, True, "at most 10 connections"),
    ],
)
def test_refusal(total: int, of_uid: int, uid: int, exempt: bool, why: str) -> None:
    got = policy.refusal(total=total, of_uid=of_uid, uid=uid, exempt=exempt, **LIMITS)
    assert got == why


def test_a_refused_connection_changes_nothing_and_a_closed_one_frees_its_slot() -> None:
    sm = fresh(Limits(max_connections=10, max_connections_per_uid=2, reserved_connections=2))
    sm.connect(1, USER, 100)
    sm.connect(2, USER, 101)
    before = snapshot(sm)
    with pytest.raises(errors.LimitReached, match="at most 2 connections per uid"):
        sm.connect(3, USER, 102)
    assert snapshot(sm) == before
    sm.connect(3, USER, 102, trusted=True)  # exempt
    sm.connect(4, 0, 1)  # root
    sm.conn_closed(1, 0.0)
    sm.conn_closed(3, 0.0)
    sm.connect(5, USER, 103)  # a slot of this uid is free again


# ---- what blocks a grant -------------------------------------------------------------------


def _w(wid: int, name: str, parked_max: int = 0) -> Workload:
    return Workload(wid, name, 0, 100 + wid, 1.0, True, "checkpoint", parked_max, USER, None)


OTHERS = [_w(1, "a"), _w(2, "v", parked_max=GIB)]


@pytest.mark.parametrize(
    ("seen", "need", "free", "foreign_blocks", "blocked"),
    [
        (Census(), 0, None, True, []),
        (Census(foreign={7: GIB}), 0, None, True, [{"pid": 7, "bytes": GIB}]),
        (Census(foreign={7: GIB}), 0, None, False, []),  # config foreign = "ignore"
        # the workload asking may hold memory; another one only up to its parked_max
        (Census(bytes_by_wid={1: GIB}), 0, None, True, []),
        (Census(bytes_by_wid={2: GIB}), 0, None, True, []),
        (
            Census(bytes_by_wid={2: GIB + 1}),
            0,
            None,
            True,
            [{"workload": "v", "pid": 102, "bytes": GIB + 1}],
        ),
        (Census(), MOVED, MOVED, True, []),
        (
            Census(),
            MOVED,
            MOVED - 1,
            True,
            [{"reason": "no-room", "need": MOVED, "free": MOVED - 1}],
        ),
        (
            Unreadable("backend-error", "NVML: unknown"),
            0,
            None,
            True,
            [{"reason": "backend-error", "error": "NVML: unknown"}],
        ),
    ],
)
def test_blockers(
    seen: Census | Unreadable,
    need: int,
    free: int | None,
    foreign_blocks: bool,
    blocked: list[dict[str, Any]],
) -> None:
    got = policy.blockers(seen, 1, OTHERS, need=need, free=free, foreign_blocks=foreign_blocks)
    assert got == blocked


def test_foreign_memory_is_ignored_when_the_config_says_so() -> None:
    d = Driver(fresh(Limits(foreign_blocks=False)))
    setup(d)
    d.seen[0] = Census(foreign={4242: GIB})
    assert d.acquire(D1, "a") == [("grant", D1, "a", 1, False)]


def test_an_unreadable_gpu_blocks_and_is_looked_at_again(d: Driver) -> None:
    d.seen[0] = Unreadable("backend-error", "NVML: unknown")  # type: ignore[assignment]
    assert d.acquire(D1, "a") == [("recheck", 0)]
    assert d.gpu(0)["foreign"] == [{"reason": "backend-error", "error": "NVML: unknown"}]
    d.seen[0] = Census()
    assert d.recheck(0) == [("grant", D1, "a", 1, False)]


@pytest.fixture
def d() -> Driver:
    drv = Driver(fresh())
    setup(drv)
    return drv


# ---- did a park hold? ------------------------------------------------------------------------

PROC = ((PIDS["a"], 1),)
FAILED = Outcome(False, "checkpoint-failed", "pid 100: rc=1 boom")


@pytest.mark.parametrize(
    ("report", "cooperative", "verdict"),
    [
        (
            ParkReport(7, MOVED, PROC, Outcome(True), (True,), 0),
            False,
            policy.ParkVerdict(True, moved=MOVED, procs=PROC),
        ),
        # the tool failed on a live process: its reason stands
        (
            ParkReport(7, MOVED, PROC, FAILED, (True,), MOVED),
            False,
            policy.ParkVerdict(False, "checkpoint-failed", "pid 100: rc=1 boom"),
        ),
        # ... it failed because the process exited: parked, nothing to restore
        (
            ParkReport(7, MOVED, PROC, FAILED, (False,), 0),
            False,
            policy.ParkVerdict(True, moved=MOVED, procs=()),
        ),
        # ... and yet memory stayed (another process of it): the backend decides
        (
            ParkReport(7, MOVED, PROC, FAILED, (False,), GIB),
            False,
            policy.ParkVerdict(
                False, "still-resident", f"{GIB} bytes still on GPU 0 after park (parked_max=0)"
            ),
        ),
        (
            ParkReport(7, after=2 * GIB),
            True,
            policy.ParkVerdict(
                False,
                "still-resident",
                f"{2 * GIB} bytes still on GPU 0 at park (parked_max={GIB})",
            ),
        ),
        (ParkReport(7, after=GIB), True, policy.ParkVerdict(True)),  # a slept vLLM keeps 1 GiB
        (ParkReport(7, error="boom"), False, policy.ParkVerdict(False, "park-error", "boom")),
        (
            ParkReport(7, MOVED, PROC, Outcome(True), (True,), Unreadable("park-error", "NVML")),
            False,
            policy.ParkVerdict(False, "park-error", "NVML"),
        ),
    ],
)
def test_judge_park(report: ParkReport, cooperative: bool, verdict: policy.ParkVerdict) -> None:
    parked_max = GIB if cooperative else 0
    assert policy.judge_park(report, 0, parked_max, cooperative) == verdict


def test_processes_that_exit_under_the_tool_leave_a_parked_workload_with_nothing_to_restore(
    d: Driver,
) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")
    park: Park = d.parks.popleft()
    exited = ParkReport(7, MOVED, PROC, FAILED, (False,), 0)
    out = d.run(lambda now: d.sm.park_done(park.op, exited, now))
    assert out == [("released", D1, 1), ("grant", D2, "b", 2, False)]
    a = d.record("a")
    assert (a["state"], a["parked_pids"], a["faults"]) == ("parked", [], 0)
    d.release(D2, "b", park_now=True)
    d.park_done()
    assert d.acquire(D3, "a") == [("grant", D3, "a", 3, True)]  # no restore first


# ---- did a restore hold? ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("report", "outcome"),
    [
        (RestoreReport(9, PROC, Outcome(True)), Outcome(True)),
        (
            RestoreReport(9, PROC, Outcome(False, "unlock-failed", "x")),
            Outcome(False, "unlock-failed", "x"),
        ),
        (
            RestoreReport(9, (), None),
            Outcome(False, "restore-no-process", "no parked process of it lives"),
        ),
        (RestoreReport(9, PROC, None, "boom"), Outcome(False, "restore-error", "boom")),
        # Every process exited, its root too: before the tool, under it (the tool's
        # failure or a raised step), or right after it: ending, not a fault.
        (
            RestoreReport(9, (), None, survivors=False, root_alive=False),
            Outcome(False, policy.GONE, "every process of it exited"),
        ),
        (
            RestoreReport(9, PROC, Outcome(False, "restore-failed", "x"), "", False, False),
            Outcome(False, policy.GONE, "every process of it exited"),
        ),
        (
            RestoreReport(9, PROC, None, "boom", survivors=False, root_alive=False),
            Outcome(False, policy.GONE, "every process of it exited"),
        ),
        # A live root whose checkpointed processes vanished: a real fault.
        (
            RestoreReport(9, (), None, survivors=False, root_alive=True),
            Outcome(False, "restore-no-process", "no parked process of it lives"),
        ),
        # Its processes live on without the root (a dead launcher's orphans): restored.
        (RestoreReport(9, PROC, Outcome(True), root_alive=False), Outcome(True)),
    ],
)
def test_judge_restore(report: RestoreReport, outcome: Outcome) -> None:
    assert policy.judge_restore(report) == outcome


def test_a_restore_without_a_live_process_faults_and_denies_its_waiter(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    assert d.acquire(D2, "a") == [("restore", "a")]
    restore = d.restores.popleft()
    out = d.run(lambda now: d.sm.restore_done(restore.op, RestoreReport(9), now))
    assert out == [
        ("FAULT", RA, "a", 1, "restore-no-process"),
        ("reap", "a", KILL_AFTER),
        ("deny", D2, "RestoreFailed"),
    ]


def test_a_restore_whose_workload_exited_denies_its_waiter_and_serves_the_next(d: Driver) -> None:
    # A pod's containers stop in no order: the parked trainer's processes are gone when
    # the replica's RELEASE makes its waiter the head (before its EOF is read).
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    assert d.acquire(D2, "a") == [("restore", "a")]
    assert d.acquire(D3, "b") == []
    restore = d.restores.popleft()
    gone = RestoreReport(9, (), None, survivors=False, root_alive=False)
    out = d.run(lambda now: d.sm.restore_done(restore.op, gone, now))
    assert out == [("deny", D2, "Gone"), ("grant", D3, "b", 2, False)]
    a = d.record("a")
    assert (a["state"], a["parked_pids"], a["faults"]) == ("parked", [], 0)


def test_a_restore_that_finds_an_unregistered_workload_gone_lets_its_reaper_forget_it(
    d: Driver,
) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    d.acquire(D2, "a")
    restore = d.restores.popleft()
    d.close(RA)  # the registration ends while the restore runs: an orphan, still restoring
    gone = RestoreReport(9, (), None, survivors=False, root_alive=False)
    out = d.run(lambda now: d.sm.restore_done(restore.op, gone, now))
    assert out == [("reap", "a", None)]  # its waiter was denied when it closed
    assert d.memory_report("a", False, 0) == []
    assert d.sm.by_wid(restore.wid) is None and not d.sm.orphans  # forgotten


# ---- recovery --------------------------------------------------------------------------------

P1, P2 = (100, 1), (101, 1)


def reading(states: dict[int, str], live: tuple[Any, ...] = (P1, P2), **kw: Any) -> RecoveryReading:
    return RecoveryReading(live, True, states=states, **kw)


RECOVERY: list[
    tuple[str, str, RecoveryReading, list[tuple[str, tuple[int, ...]]], policy.Recovered]
] = [
    ("no-live-root-dead", "park", RecoveryReading(), [], policy.Recovered("gone")),
    (
        "no-live-root-alive-park",
        "park",
        RecoveryReading((), True),
        [],
        policy.Recovered("resident"),
    ),
    (
        "no-live-root-alive-restore",
        "restore",
        RecoveryReading((), True),
        [],
        policy.Recovered(
            "fault", (), "restore-no-process", "none of its checkpointed processes lives"
        ),
    ),
    (
        "leftover-tool",
        "park",
        reading({}, tools=((900, 100),)),
        [],
        policy.Recovered(
            "fault",
            (),
            "tool-still-running",
            "cuda-checkpoint still running: tool pid 900 on pid 100",
        ),
    ),
    (
        "state-unsettled",
        "park",
        reading({100: "running"}),
        [],
        policy.Recovered(
            "fault", (), "get-state-timeout", "the driver's state did not settle in time"
        ),
    ),
    (
        "driver-failed",
        "restore",
        reading({100: "running", 101: "failed"}),
        [],
        policy.Recovered("fault", (), "recover-failed", "pid 101 is failed"),
    ),
    (
        "park-never-started",
        "park",
        reading({100: "running", 101: "none"}),
        [],
        policy.Recovered("resident"),
    ),
    (
        "park-half-done",
        "park",
        reading({100: "checkpointed", 101: "running"}),
        [("lock", (101,)), ("checkpoint", (101,))],
        policy.Recovered("parked", (P1, P2)),
    ),
    (
        "park-locked",
        "park",
        reading({100: "locked", 101: "none"}),
        [("checkpoint", (100,))],
        policy.Recovered("parked", (P1,)),
    ),
    (
        "restore-never-started",
        "restore",
        reading({100: "checkpointed", 101: "checkpointed"}),
        [],
        policy.Recovered("parked", (P1, P2)),
    ),
    (
        "restore-half-done-rolls-back",
        "restore",
        reading({100: "checkpointed", 101: "running"}),
        [("lock", (101,)), ("checkpoint", (101,))],
        policy.Recovered("parked", (P1, P2)),
    ),
    (
        "restore-almost-done",
        "restore",
        reading({100: "locked", 101: "running"}),
        [("unlock", (100,))],
        policy.Recovered("resident"),
    ),
    (
        "restore-done",
        "restore",
        reading({100: "running", 101: "running"}),
        [],
        policy.Recovered("resident"),
    ),
    (
        "r550-toggle",
        "park",
        reading({100: "running", 101: "running"}, has_action=False),
        [],
        policy.Recovered("resident"),
    ),
    (
        "r550-half-done",
        "restore",
        reading({100: "checkpointed", 101: "running"}, has_action=False),
        [("toggle", (101,))],
        policy.Recovered("parked", (P1, P2)),
    ),
    (
        "r550-locked-is-stuck",
        "park",
        reading({100: "locked", 101: "running"}, has_action=False),
        [],
        policy.Recovered("fault", (), "recover-failed", "pids [100] are locked; no --action"),
    ),
]


@pytest.mark.parametrize(
    ("intent", "read", "steps", "result"),
    [pytest.param(*row[1:], id=row[0]) for row in RECOVERY],
)
def test_plan_recovery(
    intent: str,
    read: RecoveryReading,
    steps: list[tuple[str, tuple[int, ...]]],
    result: policy.Recovered,
) -> None:
    plan = policy.plan_recovery(intent, read)
    assert (list(plan.steps), plan.result) == (steps, result)


HALF = reading({100: "checkpointed", 101: "running"})


@pytest.mark.parametrize(
    ("report", "result"),
    [
        (RecoverReport(HALF, Outcome(True), 0), policy.Recovered("parked", (P1, P2))),
        (
            RecoverReport(HALF, Outcome(False, "lock-timeout", "lock of pid 101 still running"), 0),
            policy.Recovered("fault", (), "lock-timeout", "lock of pid 101 still running"),
        ),
        (
            RecoverReport(HALF, Outcome(True), GIB),
            policy.Recovered(
                "fault", (), "still-resident", f"{GIB} bytes still on GPU 0 after recovery"
            ),
        ),
        (
            RecoverReport(HALF, Outcome(True), Unreadable("recover-error", "NVML")),
            policy.Recovered("fault", (), "recover-error", "NVML"),
        ),
        # a resident result is not checked against the device: its memory is meant to be there
        (
            RecoverReport(
                reading({100: "running", 101: "running"}),
                Outcome(True),
                Unreadable("recover-error", "NVML"),
            ),
            policy.Recovered("resident"),
        ),
        (RecoverReport(error="boom"), policy.Recovered("fault", (), "recover-error", "boom")),
    ],
)
def test_judge_recovery(report: RecoverReport, result: policy.Recovered) -> None:
    assert policy.judge_recovery("park", report, 0, 0) == result


def test_the_state_machine_hands_out_the_plan_of_its_recovery_op() -> None:
    d = Driver(SlicerState(GPUS))
    e = journal_entry(
        state="parking", op_procs=[[100, 1], [101, 1]], op_bytes=MOVED, resident_bytes=MOVED
    )
    d.run(lambda now: d.sm.adopt_journal([e], now))
    (rec,) = d.recovers
    before = snapshot(d.sm)
    plan = d.sm.recovery_plan(rec.op, HALF)
    assert snapshot(d.sm) == before  # asking changes nothing
    assert plan.steps == (("lock", (101,)), ("checkpoint", (101,)))
    assert d.sm.recovery_plan(rec.op + 99, HALF).steps == ()  # no such op: nothing to run
    out = d.run(lambda now: d.sm.recover_done(rec.op, RecoverReport(HALF, Outcome(True), 0), now))
    assert out == [("reap", "a", None)]
    assert d.record("a")["parked_pids"] == [100, 101]


@pytest.mark.parametrize(
    ("resident", "out"),
    [(0, []), (None, [("park", "a", "checkpoint")]), (GIB, [("park", "a", "checkpoint")])],
)
def test_unreadable_memory_at_restart_counts_as_resident(
    resident: int | None, out: list[tuple[Any, ...]]
) -> None:
    """The server could not read the GPU (None): an idle workload's memory is unknown, so
    it is kept and parked before anything is granted, as if it held memory (a readable 0
    bytes drops it)."""
    entry = journal_entry(resident_bytes=resident)
    d = Driver(SlicerState(GPUS))
    assert d.run(lambda now: d.sm.adopt_journal([entry], now)) == out


# ---- when a faulted workload is killed -------------------------------------------------------


@pytest.mark.parametrize(
    ("kill_at", "killed_at", "alive", "holders", "now", "due"),
    [
        (10.0, None, True, (111,), 9.9, False),
        (10.0, None, True, (111,), 10.0, True),
        (10.0, 10.0, True, (111,), 11.0, False),  # once...
        (10.0, 10.0, True, (111,), 10.0 + policy.KILL_RETRY_S, True),  # ...unless it failed
        (10.0, None, False, (111,), 11.0, False),  # dead already
        (10.0, None, True, (), 11.0, False),  # nothing holds the GPU: nothing to kill
        (None, None, True, (111,), 1e9, False),  # never (a parked orphan)
    ],
)
def test_kill_due(
    kill_at: float | None,
    killed_at: float | None,
    alive: bool,
    holders: tuple[int, ...],
    now: float,
    due: bool,
) -> None:
    assert policy.kill_due(kill_at, killed_at, alive, holders, now) is due


def test_a_faulted_workload_is_killed_once_after_fault_kill_after(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")
    faulted_at = d.now
    d.park_done(ok=False, reason="lock-failed")
    wid = d.wid("a")
    holders = (PIDS["a"] + 1,)

    def report(at: float) -> list[Any]:
        fx, done = d.sm.memory_report(wid, True, GIB, at, holders)
        assert not done
        return [e for e in fx if isinstance(e, Kill)]

    assert report(faulted_at + KILL_AFTER - 0.1) == []
    assert report(faulted_at + KILL_AFTER) == [Kill(wid, "a", holders)]
    assert report(faulted_at + KILL_AFTER + 1) == []
    # Still holding the GPU KILL_RETRY_S after the kill (it failed: EPERM): sent again.
    assert report(faulted_at + KILL_AFTER + policy.KILL_RETRY_S) == [Kill(wid, "a", holders)]
    # Unreadable memory keeps the GPU taken even once the registration ends.
    d.close(RA)
    assert d.sm.memory_report(wid, True, None, d.now)[1] is False
    fx, done = d.sm.memory_report(wid, True, 0, d.now)
    assert done
    d.apply(fx)  # the record is dropped: the GPU promotes
    assert d.gpu(0)["holder"] == {"workload": "b", "turn": 2}


# ---- one promotion site -------------------------------------------------------------------


def test_a_restore_grants_through_the_one_promotion_site(d: Driver) -> None:
    """A restore that ends does not grant by itself: the promotion site first parks
    whatever became resident meanwhile, then grants, still as restored."""
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    assert d.acquire(D2, "a") == [("restore", "a")]
    d.connect(21, uid=USER)
    # A process that already holds memory registers while the restore runs.
    assert d.register(21, "d", pid=PIDS["d"], resident=GIB) == [("registered", 21, "d", "idle")]
    assert d.restore_done() == [("park", "d", "checkpoint")]
    assert d.park_done() == [("grant", D2, "a", 2, True)]


def test_a_restore_for_a_waiter_that_left_grants_nobody_and_restores_nothing_later(
    d: Driver,
) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    d.acquire(D2, "a")
    d.expire(D2)
    assert d.restore_done() == []
    assert d.acquire(D3, "a") == [("grant", D3, "a", 2, False)]  # resident already


# ---- does a registration need the parker? -------------------------------------------------


@pytest.mark.parametrize(
    ("park", "fallback", "checkpointed", "why"),
    [
        ("checkpoint", "none", False, "park=checkpoint"),
        ("cooperative", "checkpoint", False, "fallback=checkpoint"),
        ("cooperative", "residue", False, "fallback=residue"),
        ("cooperative", "none", False, ""),
        (
            "cooperative",
            "none",
            True,
            "its processes are checkpointed (a restore brings them back)",
        ),
    ],
)
def test_parker_needed(park: str, fallback: str, checkpointed: bool, why: str) -> None:
    assert policy.parker_needed(park, fallback, checkpointed) == why


def test_a_registration_that_needs_a_parker_that_cannot_run_is_refused_and_changes_nothing(
    d: Driver,
) -> None:
    before = [w.name for w in d.sm.workloads()]
    cannot = "cuda-checkpoint not found: looked for '/no/such/tool'"
    for park, fallback in (("checkpoint", "none"), ("cooperative", "checkpoint")):
        with pytest.raises(errors.NoParker) as e:
            d.register(RA, "d", park=park, fallback=fallback, parker=cannot)
        assert "/no/such/tool" in str(e.value) and "REGISTER d" in str(e.value)
        assert [w.name for w in d.sm.workloads()] == before
    # A workload that parks itself, with no fallback, needs no parker.
    got = d.register(RA, "d", park="cooperative", fallback="none", parker=cannot)
    assert got == [("registered", RA, "d", "registered")]
    assert d.state("d") == "registered"
