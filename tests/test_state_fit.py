"""Fit-aware turns in the pure state machine (`SlicerState` with `Limits.fit_aware`),
driven like tests/test_state.py: which park each move asks for, and what follows a freeze,
a freeze the GPU has no room for, and a thaw."""

from __future__ import annotations

from typing import Any

from gpu_slicer.slicer.effects import Park, Restore
from gpu_slicer.slicer.readings import Outcome, ParkReport, RestoreReport
from gpu_slicer.slicer.records import Limits
from tests.test_state import D1, D2, GIB, MOVED, PIDS, Driver, fresh, setup


def driver() -> Driver:
    d = Driver(fresh(Limits(fit_aware=True, fit_headroom=GIB)))
    setup(d)
    return d


def frozen(d: Driver, e: Park) -> list[tuple[Any, ...]]:
    """Finish freeze `e` as the server would: its process locked, its bytes kept."""
    procs = ((PIDS[e.workload], 1),)
    report = ParkReport(5, 20 * GIB, procs, Outcome(True), (True,), 20 * GIB, frozen=True)
    return d.run(lambda now: d.sm.park_done(e.op, report, now))


def b_frozen_beside_a(d: Driver) -> None:
    """a runs once and is parked by checkpoint (b's need was unknown); b runs; a's next
    ACQUIRE freezes b (a's need is known: its parked bytes)."""
    d.acquire(D1, "a")
    d.release(D1, "a")
    d.acquire(D2, "b")
    assert d.parks[-1].mode == "checkpoint"  # b never ran: its need is unknown
    d.park_done()
    d.release(D2, "b")
    d.acquire(D1, "a")
    e = d.parks.popleft()
    assert (e.workload, e.mode, e.need) == ("b", "freeze", MOVED + GIB)
    frozen(d, e)


def test_a_freeze_then_room_enough_restores_the_head_beside_it() -> None:
    d = driver()
    b_frozen_beside_a(d)
    assert d.state("b") == "frozen"
    r = d.restores.popleft()  # a's restore (room: the driver's default free bytes)
    assert r.workload == "a" and not r.thaw
    out = d.run(lambda now: d.sm.restore_done(r.op, RestoreReport(9, r.procs, Outcome(True)), now))
    assert ("grant", D1, "a", d.turns[D1], True) in out
    assert d.state("b") == "frozen" and d.record("b")["frozen_pids"] == [PIDS["b"]]


def test_no_room_beside_a_frozen_one_parks_it_first() -> None:
    d = driver()
    d.free[0] = GIB  # less than a's parked bytes
    b_frozen_beside_a(d)
    e = d.parks.popleft()  # the verify found no room: b is checkpointed (locked already)
    assert (e.workload, e.mode, e.locked) == ("b", "checkpoint", True)
    d.free[0] = 1 << 40
    d.parks.appendleft(e)
    d.park_done()
    assert d.state("b") == "parked" and d.record("b")["frozen_pids"] == []
    assert d.restores and d.restores[0].workload == "a"


def test_a_frozen_head_is_thawed_not_restored() -> None:
    d = driver()
    b_frozen_beside_a(d)
    r = d.restores.popleft()
    d.run(lambda now: d.sm.restore_done(r.op, RestoreReport(9, r.procs, Outcome(True)), now))
    d.release(D1, "a")
    d.acquire(D2, "b")  # b is frozen: a (resident) is frozen beside it, b thawed
    e = d.parks.popleft()
    assert (e.workload, e.mode, e.need) == ("a", "freeze", GIB)
    frozen(d, e)
    t: Restore = d.restores.popleft()
    assert t.workload == "b" and t.thaw and t.procs == ((PIDS["b"], 1),)
    out = d.run(lambda now: d.sm.restore_done(t.op, RestoreReport(3, t.procs, Outcome(True)), now))
    assert ("grant", D2, "b", d.turns[D2], False) in out  # its memory never left
    st = d.sm.status()
    assert st["totals"]["freezes"] == 2 and st["totals"]["thaws"] == 1
    assert d.state("a") == "frozen"
