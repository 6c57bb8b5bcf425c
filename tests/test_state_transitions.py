"""Every transition checks the table before it changes anything.

For each kind of move (a grant, a turn's end, a park's, restore's or recovery's result, a
deferred park, a rescue park that gives up), the workload it moves is put in a state the
table does not allow that move from; the call must raise `IllegalTransition` and leave the
machine exactly as it was (STATUS, the journal, connections, queues, the turn and op
counters), and the same call must succeed once the workload is put back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpu_slicer.slicer import errors
from gpu_slicer.slicer.effects import Effect, Park, Restore, Verify
from gpu_slicer.slicer.model import WState
from gpu_slicer.slicer.readings import Census, Outcome, ParkReport, RecoverReport, RestoreReport
from gpu_slicer.slicer.state import SlicerState
from tests.test_state import (
    D1,
    D2,
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
)
from tests.test_state_policy import HALF

PROC = ((PIDS["a"], 1),)


def snapshot(sm: SlicerState) -> tuple[Any, ...]:
    return (
        sm.status(),
        sm.journal(),
        {c: (x.uid, x.waiting_on, x.trusted) for c, x in sm.conns.items()},
        dict(sm._per_uid),
        repr(sm._turns),
        repr(sm._ops),
        [(g.index, list(g.queue), dict(g.waiting), g.waiting_sent, g.op) for g in sm.gpus.values()],
    )


def one(fx: list[Effect], kind: type[Any]) -> Any:
    (e,) = [e for e in fx if isinstance(e, kind)]
    return e


def driver() -> Driver:
    d = Driver(fresh())
    setup(d)
    return d


# Each case prepares a machine and returns (the workload to corrupt, the call to try).
Case = Callable[[Driver], tuple[str, Callable[[], list[Effect]]]]


def grant(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    verify = one(d.sm.acquire(D1, "a", d.now), Verify)  # left unanswered
    return "a", lambda: d.sm.verified(verify.op, Census(), d.now)


def release(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    return "a", lambda: d.sm.release(D1, "a", 1, False, d.now)


def holder_closes(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    return "a", lambda: d.sm.conn_closed(D1, d.now)


def registrant_closes(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    d.acquire(D1, "a")  # held by D1, registered by RA
    d.acquire(D2, "a")
    return "a", lambda: d.sm.conn_closed(RA, d.now)


def unregister(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    d.acquire(D1, "a")
    return "a", lambda: d.sm.unregister(RA, "a", d.now)


def _parking(d: Driver) -> Park:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")
    return d.parks.popleft()


def park_held(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    park = _parking(d)
    return "a", lambda: d.sm.park_done(park.op, d.park_report(park, True), d.now)


def park_failed(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    park = _parking(d)
    report = d.park_report(park, False, "lock-failed")
    return "a", lambda: d.sm.park_done(park.op, report, d.now)


def park_deferred(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    park = _parking(d)
    d.sm.park_started(park.op, PROC, MOVED)
    return "a", lambda: d.sm.park_journaled(park.op, False, d.now)[0]


def rescue_gives_up(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    d.unregister(RA, "a")
    d.register(RA, "a", park="cooperative", parked_max=GIB)  # no ask, no fallback
    park = _parking(d)
    report = ParkReport(7, after=2 * GIB)
    return "a", lambda: d.sm.park_done(park.op, report, d.now)


def _restoring(d: Driver) -> Restore:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    d.acquire(D2, "a")
    return d.restores.popleft()


def restore_held(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    restore = _restoring(d)
    report = RestoreReport(9, PROC, Outcome(True))
    return "a", lambda: d.sm.restore_done(restore.op, report, d.now)


def restore_failed(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    restore = _restoring(d)
    report = RestoreReport(9, PROC, Outcome(False, "restore-failed", "x"))
    return "a", lambda: d.sm.restore_done(restore.op, report, d.now)


def _recovering(d: Driver) -> int:
    d.sm = SlicerState(GPUS)
    for conn in (RA, RB):
        d.connect(conn, uid=USER)
    entry = journal_entry(
        state="parking", op_procs=[[100, 1], [101, 1]], op_bytes=MOVED, resident_bytes=MOVED
    )
    d.run(lambda now: d.sm.adopt_journal([entry], now))
    return int(d.recovers.popleft().op)


def recovered_parked(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    op = _recovering(d)
    return "a", lambda: d.sm.recover_done(op, RecoverReport(HALF, Outcome(True), 0), d.now)


def recovered_fault(d: Driver) -> tuple[str, Callable[[], list[Effect]]]:
    op = _recovering(d)
    return "a", lambda: d.sm.recover_done(op, RecoverReport(error="boom"), d.now)


CASES: list[Case] = [
    grant,
    release,
    holder_closes,
    registrant_closes,
    unregister,
    park_held,
    park_failed,
    park_deferred,
    rescue_gives_up,
    restore_held,
    restore_failed,
    recovered_parked,
    recovered_fault,
]
# A state each move is never allowed from (FAULTED is terminal; PARKING never becomes
# ACTIVE without a restore or a grant's verify).
BAD = {"grant": WState.PARKING}


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_an_illegal_move_raises_and_changes_nothing(case: Case) -> None:
    d = driver()
    name, call = case(d)
    (w,) = [w for w in d.sm.workloads() if w.name == name]
    good, w.state = w.state, BAD.get(case.__name__, WState.FAULTED)
    before = snapshot(d.sm)
    with pytest.raises(errors.IllegalTransition):
        call()
    assert snapshot(d.sm) == before
    w.state = good
    call()  # once put back, the very same call goes through
