"""The state machine's rescue paths: a cooperative workload nobody parks (registrant-side
park, checkpoint fallback, FAULT), one process per workload, and recovery after a restart.

Driven like tests/test_state.py (same `Driver`): effects summarised as tuples.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpu_slicer.slicer import errors
from gpu_slicer.slicer.model import Workload
from gpu_slicer.slicer.readings import ParkReport
from gpu_slicer.slicer.restart import journal_entries, resumed
from gpu_slicer.slicer.state import SlicerState
from tests.test_state import (
    D1,
    D2,
    D3,
    GIB,
    GPUS,
    MOVED,
    PIDS,
    RA,
    RB,
    USER,
    Driver,
    fresh,
    journal_entry,
    setup,
    snapshot,
)


@pytest.fixture
def d() -> Driver:
    drv = Driver(fresh())
    setup(drv)
    return drv


def coop(d: Driver, *, ask: bool = True, fallback: str = "checkpoint") -> None:
    """Make "a" a cooperative workload (a slept vLLM keeps 1 GiB), registered anew."""
    d.unregister(RA, "a")
    d.register(RA, "a", park="cooperative", parked_max=GIB, ask=ask, fallback=fallback)


def holder_dies_while_b_waits(d: Driver) -> list[tuple[Any, ...]]:
    assert d.acquire(D1, "a") == [("grant", D1, "a", 1, False)]
    assert d.acquire(D2, "b") == [("WAITING", D1, "a", 1, 1)]
    return d.close(D1)


def answer(d: Driver, conn: int, name: str, turn: int, ok: bool = True) -> list[tuple[Any, ...]]:
    return d.run(lambda now: d.sm.parked_answer(conn, name, turn, ok, now))


def test_dead_holder_asks_the_registrant_and_grants_after_its_verified_park(d: Driver) -> None:
    coop(d)
    assert holder_dies_while_b_waits(d) == [("PARK", RA, "a", 1)]
    assert d.gpu(0)["busy"] == "park" and d.gpu(0)["stage"] == "ask"
    # What the registrant reads (STATUS) to say why: PARK has no room for it.
    assert d.gpu(0)["park_reason"] == "its holder closed its connection mid-turn"
    # The registrant's word is checked through the backend before anyone is granted.
    assert answer(d, RA, "a", 1) == [("ok", RA), ("park", "a", "cooperative")]
    assert d.park_done() == [("grant", D2, "b", 2, False)]
    a = d.record("a")
    assert (a["state"], a["parked_pids"], a["faults"]) == ("parked", [], 0)


def test_silent_registrant_falls_back_to_checkpoint_then_restores(d: Driver) -> None:
    coop(d)
    holder_dies_while_b_waits(d)
    (ask,) = d.asks
    # No answer in time: cuda-checkpoint, whatever the backend sees (a wake may be late).
    assert d.run(lambda now: d.sm.ask_expired(ask.op, now)) == [("park", "a", "checkpoint")]
    assert d.park_done() == [("grant", D2, "b", 2, False)]
    assert d.record("a")["parked_pids"] == [PIDS["a"]]
    # A late answer finds nothing to answer; it changes nothing.
    before = snapshot(d.sm)
    with pytest.raises(errors.NotAsked):
        d.sm.parked_answer(RA, "a", 1, True, d.now)
    assert snapshot(d.sm) == before
    # Its next turn restores the checkpoint first, though it parks cooperatively.
    d.release(D2, "b", park_now=True)
    d.park_done()
    assert d.acquire(D3, "a") == [("restore", "a")]
    assert d.restore_done() == [("grant", D3, "a", 3, True)]


def test_registrant_that_cannot_park_and_no_fallback_faults_and_keeps_the_gpu(
    d: Driver,
) -> None:
    coop(d, fallback="none")
    holder_dies_while_b_waits(d)
    assert answer(d, RA, "a", 1, ok=False) == [("ok", RA), ("park", "a", "cooperative")]
    out = d.park_done(ok=False, reason="still-resident")
    assert out == [("FAULT", RA, "a", 1, "still-resident"), ("reap", "a", 60.0)]
    assert d.state("a") == "faulted" and d.state("b") == "registered"


def test_registrant_closing_during_the_ask_falls_back_at_once(d: Driver) -> None:
    coop(d)
    holder_dies_while_b_waits(d)
    out = d.close(RA)
    assert ("park", "a", "checkpoint") in out
    assert d.park_done() == [("reap", "a", None), ("grant", D2, "b", 2, False)]


def test_dead_holder_without_ask_goes_straight_to_checkpoint(d: Driver) -> None:
    coop(d, ask=False)
    assert holder_dies_while_b_waits(d) == [("park", "a", "checkpoint")]
    assert d.park_done() == [("grant", D2, "b", 2, False)]


def test_dead_holder_without_ask_or_fallback_is_verified_only(d: Driver) -> None:
    coop(d, ask=False, fallback="none")
    assert holder_dies_while_b_waits(d) == [("park", "a", "cooperative")]
    assert d.park_done(ok=False, reason="still-resident")[0] == (
        "FAULT",
        RA,
        "a",
        1,
        "still-resident",
    )


def test_idle_replica_left_awake_is_asked_when_someone_else_needs_the_gpu(d: Driver) -> None:
    coop(d)
    d.acquire(D1, "a")
    assert d.release(D1, "a") == [("released", D1, 0)]  # lazy: idle, resident
    assert d.acquire(D2, "b") == [("park", "a", "cooperative")]
    assert d.park_done(ok=False, reason="still-resident") == [("PARK", RA, "a", 1)]
    assert answer(d, RA, "a", 1) == [("ok", RA), ("park", "a", "cooperative")]
    assert d.park_done() == [("grant", D2, "b", 2, False)]


def test_parked_answers_are_refused_precisely_and_change_nothing(d: Driver) -> None:
    coop(d)
    before = snapshot(d.sm)
    with pytest.raises(errors.NotAsked):
        d.sm.parked_answer(RA, "a", 0, True, d.now)  # nothing was asked
    with pytest.raises(errors.UnknownWorkload):
        d.sm.parked_answer(RA, "nope", 0, True, d.now)
    assert snapshot(d.sm) == before
    holder_dies_while_b_waits(d)
    before = snapshot(d.sm)
    with pytest.raises(errors.NotRegistrant):
        d.sm.parked_answer(RB, "a", 1, True, d.now)
    with pytest.raises(errors.NotAsked):
        d.sm.parked_answer(RA, "a", 7, True, d.now)  # another turn
    assert snapshot(d.sm) == before


def test_a_process_belongs_to_one_workload(d: Driver) -> None:
    before = snapshot(d.sm)
    with pytest.raises(errors.InUse, match="already belongs to workload a"):
        d.register(RB, "a2", pid=4242, sharing=(d.wid("a"),))
    assert snapshot(d.sm) == before


def test_park_pids_are_journaled_before_the_tool_runs(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    (park,) = d.parks
    proc = (PIDS["a"], 1)
    assert d.sm.park_started(park.op, (proc,), MOVED) != []
    (a,) = [e for e in d.sm.journal() if e["name"] == "a"]
    assert (a["state"], a["op_procs"], a["op_bytes"]) == ("parking", [list(proc)], MOVED)
    d.park_done()
    (a,) = [e for e in d.sm.journal() if e["name"] == "a"]
    assert (a["state"], a["op_procs"], a["parked_procs"]) == ("parked", [], [list(proc)])


# ---- recovery ----------------------------------------------------------------------------


def restarted(state: str, **entry: Any) -> Driver:
    """A new daemon adopting one journaled workload "a" (gpu 0) in `state`."""
    d = Driver(SlicerState(GPUS))
    for conn in (RA, RB):
        d.connect(conn, uid=USER, pid=900 + conn)
    for conn in (D1, D2):
        d.connect(conn)
    e = journal_entry(state=state, **entry)
    d.recovery_out = d.run(lambda now: d.sm.adopt_journal([e], now))  # type: ignore[attr-defined]
    return d


PROC = [[PIDS["a"], 1]]


@pytest.mark.parametrize(
    ("state", "entry", "intent"),
    [
        ("parking", {"op_procs": PROC, "op_bytes": MOVED}, "park"),
        ("restoring", {"parked_procs": PROC, "parked_bytes": MOVED}, "restore"),
        ("parked", {"parked_procs": PROC, "parked_bytes": MOVED}, "park"),
    ],
)
def test_interrupted_ops_are_recovered_before_anything_else(
    state: str, entry: dict[str, Any], intent: str
) -> None:
    d = restarted(state, **entry)
    assert d.recovery_out == [("recover", "a", intent)]  # type: ignore[attr-defined]
    (rec,) = d.recovers
    assert rec.procs == ((PIDS["a"], 1),)
    # Nobody is granted on that GPU while it recovers; the launcher can re-register.
    d.register(RB, "b")
    assert d.acquire(D2, "b") == []
    assert d.register(RA, "a") == [("registered", RA, "a", state)]
    assert d.gpu(0)["busy"] == "recover"
    # Checkpointed for real: parked with its bytes (b goes first), restored before its
    # next turn.
    assert d.recover_done("parked") == [("grant", D2, "b", 1, False)]
    a = d.record("a")
    assert (a["state"], a["parked_pids"], a["parked_bytes"]) == ("parked", [PIDS["a"]], MOVED)
    assert d.acquire(D1, "a") == [("WAITING", D2, "b", 1, 1)]
    assert d.release(D2, "b") == [("park", "b", "checkpoint")]
    assert d.park_done() == [("released", D2, 1), ("restore", "a")]


def test_recovery_that_finds_the_processes_running_leaves_them_resident() -> None:
    d = restarted("parking", op_procs=PROC, op_bytes=MOVED)
    d.register(RA, "a")
    d.acquire(D1, "a")
    assert d.recover_done("resident") == [("grant", D1, "a", 1, False)]


def test_recovery_of_a_dead_workload_forgets_it() -> None:
    d = restarted("restoring", parked_procs=PROC, parked_bytes=MOVED)
    assert d.recover_done("gone") == [("reap", "a", None)]
    assert d.memory_report("a", False, 0) == []
    assert d.sm.workloads() == []


def test_recovery_failure_faults_and_keeps_the_gpu() -> None:
    d = restarted("parking", op_procs=PROC, op_bytes=MOVED)
    d.register(RA, "a")
    d.register(RB, "b")
    d.acquire(D2, "b")
    out = d.recover_done("fault", reason="recover-failed")
    assert out == [("FAULT", RA, "a", 0, "recover-failed"), ("reap", "a", 60.0)]
    assert d.state("b") == "registered"  # the GPU stays taken


def test_unregister_during_an_ask_moves_on_at_once(d: Driver) -> None:
    coop(d)
    holder_dies_while_b_waits(d)
    out = d.unregister(RA, "a")  # nobody is left to answer the PARK
    assert ("park", "a", "checkpoint") in out


def test_the_same_processes_on_another_gpu_are_in_use_not_adopted(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    d.close(RA)  # a: a parked orphan on GPU 0
    d.connect(RA, uid=USER, pid=900 + RA)
    before = snapshot(d.sm)
    with pytest.raises(errors.InUse):
        d.register(RA, "a", 1, sharing=(d.wid("a"),))  # its pid, GPU 1
    assert snapshot(d.sm) == before
    assert d.register(RA, "a", 0, sharing=(d.wid("a"),)) == [("registered", RA, "a", "parked")]


def test_the_reaper_of_an_adopted_workload_stops(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    out = d.close(RA)
    assert ("reap", "a", None) in out
    wid = d.wid("a")
    d.connect(RA, uid=USER, pid=900 + RA)
    d.register(RA, "a")  # adopted
    assert d.sm.memory_report(wid, True, 0, d.now) == ([], True)


def test_a_held_orphan_asks_to_be_looked_at_again_when_its_grace_ends() -> None:
    d = restarted("parking", op_procs=PROC, op_bytes=MOVED, park="cooperative", parked_max=GIB)
    d.sm.limits = type(d.sm.limits)(adopt_grace=60.0)
    d.now += 10
    out = d.recover_done("resident")
    assert out[:1] == [("recheck", 0)]
    d.now += 30
    rechecks = [e for e in d.apply(d.sm.recheck(0, d.now)) if type(e).__name__ == "Recheck"]
    assert [round(e.delay) for e in rechecks] == [30]  # the rest of its grace, not nothing


# ---- a holder's park that freed nothing (the parked floor) ----------------------------------

MIB = 1 << 20


def replica(d: Driver, *, ask: bool = True, fallback: str = "checkpoint") -> None:
    """Make "a" a cooperative replica whose weights (2 GiB) fit under its parked_max."""
    d.unregister(RA, "a")
    d.register(RA, "a", park="cooperative", parked_max=4 * GIB, ask=ask, fallback=fallback)


def holder_parks_leaving(d: Driver, after: int, blind: bool = False) -> list[tuple[Any, ...]]:
    """a's holder (D1) takes a turn and parks it itself (RELEASE park=now); the backend
    then reads `after` bytes of a on the GPU."""
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    e = d.parks.popleft()
    assert e.mode == "cooperative"
    report = ParkReport(5, after=after, blind=blind)
    return d.run(lambda now: d.sm.park_done(e.op, report, now))


def test_the_first_park_sets_the_parked_floor_and_later_holder_parks_only_lower_it(
    d: Driver,
) -> None:
    replica(d)
    assert d.record("a")["parked_floor"] is None
    assert holder_parks_leaving(d, 300 * MIB) == [("released", D1, 1)]
    assert d.record("a")["parked_floor"] == 300 * MIB
    # Within the slack above the floor: a park; the floor stays (only lowered here).
    assert holder_parks_leaving(d, 700 * MIB) == [("released", D1, 1)]
    assert holder_parks_leaving(d, 250 * MIB) == [("released", D1, 1)]
    assert d.record("a")["parked_floor"] == 250 * MIB


def test_a_holder_park_clearly_above_the_floor_asks_the_registrant_first(d: Driver) -> None:
    replica(d)
    holder_parks_leaving(d, 300 * MIB)
    d.acquire(D1, "a")
    assert d.acquire(D2, "b") == [("WAITING", D1, "a", 2, 1)]
    d.release(D1, "a", park_now=True)
    e = d.parks.popleft()
    # Its holder's sleep did nothing (a half-woken vLLM): 2 GiB left, under parked_max.
    out = d.run(lambda now: d.sm.park_done(e.op, ParkReport(5, after=2 * GIB), now))
    assert out == [("PARK", RA, "a", 2)], out  # nobody granted: its registrant is asked
    assert "parked floor" in d.gpu(0)["park_reason"]
    assert answer(d, RA, "a", 2) == [("ok", RA), ("park", "a", "cooperative")]
    # The registrant's park (it woke it whole, then slept it) is the floor anew.
    e = d.parks.popleft()
    out = d.run(lambda now: d.sm.park_done(e.op, ParkReport(5, after=400 * MIB), now))
    assert out[-1] == ("grant", D2, "b", 3, False), out
    assert d.record("a")["parked_floor"] == 400 * MIB and d.record("a")["faults"] == 0


@pytest.mark.parametrize(
    ("ask", "fallback", "blind"),
    [(False, "checkpoint", False), (True, "none", False), (True, "checkpoint", True)],
)
def test_where_nothing_can_follow_parked_max_alone_decides(
    d: Driver, ask: bool, fallback: str, blind: bool
) -> None:
    # No registrant to ask, no checkpoint to follow, or a census by elimination (its
    # `after` is not its own bytes): the documented threshold, as before.
    replica(d, ask=ask, fallback=fallback)
    holder_parks_leaving(d, 300 * MIB, blind=blind)
    assert holder_parks_leaving(d, 2 * GIB, blind=blind) == [("released", D1, 1)]


def test_the_parked_floor_survives_a_restart_through_the_journal() -> None:
    # Without it, a restarted slicerd would take the next holder park, unchecked, for
    # the floor (a half-woken vLLM's weights included) and grant beside them.
    w = Workload(wid=1, name="v", gpu=0, pid=PIDS["a"], start_time=1.0, tree=True,
                 park="cooperative", parked_max=4 << 30, owner_uid=0, registrant=None,
                 fallback="checkpoint", ask=True)  # fmt: skip
    for floor in (0, 512 << 20, None):
        w.parked_floor = floor
        (entry,) = journal_entries([w])
        back = resumed({**entry, "alive": True}, 7)
        assert back is not None and back.workload.parked_floor == floor, entry
    (entry,) = journal_entries([w])
    assert "parked_floor" not in entry  # a journal an older release can read
