"""Early starts in the pure state machine (`slicer.early`), driven like tests/test_state.py:
the freeze that makes room for an early start, EARLY between the lock and the checkpoint,
the grant after the verified park, and an early start abandoned (wait= expiry, a closed
connection, the registration's end, a restart) parked before anyone else is granted."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_slicer.slicer import restart
from gpu_slicer.slicer.early import wanted
from gpu_slicer.slicer.effects import Emit, Grant, Park, Persist
from gpu_slicer.slicer.model import Gpu, Waiter, Workload, WState
from gpu_slicer.slicer.readings import Outcome, ParkReport
from gpu_slicer.slicer.records import Limits
from tests.test_state import (
    D1,
    D2,
    GIB,
    PIDS,
    RA,
    RB,
    USER,
    Driver,
    _restart,
    fresh,
    journal_entry,
)

EARLY = 16 * GIB


def driver(limits: Limits | None = None, fallback: str = "checkpoint") -> Driver:
    """`a` a trainer (park=checkpoint) that holds the GPU, and `b` a vLLM-like replica
    (cooperative, parked_max 1 GiB) that ran once and parked itself: b's next ACQUIRE can
    start early. D1 acquires a, D2 acquires b."""
    d = Driver(fresh(limits or Limits(fit_headroom=GIB)))
    for conn in (RA, RB):
        d.connect(conn, uid=USER, pid=900 + conn)
    for conn in (D1, D2):
        d.connect(conn, uid=0)
    d.register(RA, "a")
    d.register(RB, "b", park="cooperative", parked_max=GIB, fallback=fallback)
    d.acquire(D2, "b")
    d.release(D2, "b")
    d.acquire(D1, "a")  # b, idle, is in the way: parked (it holds nothing: parked itself)
    d.park_done()
    assert (d.state("a"), d.state("b")) == ("active", "parked")
    return d


def ask_early(d: Driver, nbytes: int = EARLY) -> list[tuple[Any, ...]]:
    return d.run(lambda now: d.sm.acquire(D2, "b", now, nbytes))


def frozen(d: Driver, e: Park) -> list[tuple[Any, ...]]:
    """Finish freeze `e` as the server would: its process locked, its bytes kept."""
    procs = ((PIDS[e.workload], 1),)
    report = ParkReport(5, 50 * GIB, procs, Outcome(True), (True,), 50 * GIB, frozen=True)
    return d.run(lambda now: d.sm.park_done(e.op, report, now))


def early_sent(d: Driver) -> None:
    """b asks early while a holds; a's release freezes a, b is told EARLY, a's checkpoint
    is queued (not done)."""
    ask_early(d)
    d.release(D1, "a")
    e = d.parks.popleft()
    assert (e.workload, e.mode, e.need, e.early) == ("a", "freeze", EARLY + GIB, True)
    out = frozen(d, e)
    assert ("EARLY", D2, "b", EARLY) in out
    assert not [x for x in out if x[0] == "grant"]  # the grant waits for the park
    c = d.parks[0]
    assert (c.workload, c.mode, c.locked) == ("a", "checkpoint", True)
    assert d.record("b")["early"] == EARLY


def test_early_comes_between_the_lock_and_the_checkpoint_and_the_grant_after_the_park() -> None:
    d = driver()
    early_sent(d)
    assert d.state("a") == "parking" and d.state("b") == "parked"
    out = d.park_done()  # the checkpoint of the locked trainer
    assert ("grant", D2, "b", d.turns[D2], True) in out
    assert d.state("a") == "parked" and d.record("b")["early"] == 0
    st = d.sm.status()["totals"]
    assert st["earlies"] == 1 and st["freezes"] == 1


def test_the_release_is_answered_once_the_trainer_is_locked() -> None:
    d = driver()
    ask_early(d)
    d.release(D1, "a")
    out = frozen(d, d.parks.popleft())
    assert ("released", D1, 1) in out


@pytest.mark.parametrize("how", ["wait-expired", "closed"])
def test_an_abandoned_early_start_is_parked_by_checkpoint_before_any_grant(how: str) -> None:
    d = driver()
    early_sent(d)
    out = d.expire(D2) if how == "wait-expired" else d.close(D2)
    assert d.state("b") == "idle" and d.record("b")["early"] == EARLY
    if how == "wait-expired":
        assert ("deny", D2, "Timeout") in out
    d.acquire(D1, "a")  # the trainer asks again while its own checkpoint runs
    d.park_done()  # a's checkpoint ends: b, dirty, is parked first (no registrant asks)
    e = d.parks.popleft()
    assert (e.workload, e.mode) == ("b", "checkpoint")  # its holder's word is not trusted
    assert not d.restores  # a waits: nothing restored or granted beside b
    d.parks.appendleft(e)
    d.park_done()
    assert d.state("b") == "parked" and d.record("b")["early"] == 0
    assert d.record("b")["parked_pids"] == [PIDS["b"]]
    r = d.restores[0]
    assert r.workload == "a"
    events = [x.body for x in d.effects if isinstance(x, Emit)]
    assert any(b["event"] == "early-abandoned" and b["reason"] == how for b in events)


def test_an_abandoned_early_start_is_checkpointed_without_asking_its_registrant() -> None:
    d = Driver(fresh(Limits(fit_headroom=GIB)))
    for conn in (RA, RB):
        d.connect(conn, uid=USER, pid=900 + conn)
    for conn in (D1, D2):
        d.connect(conn, uid=0)
    d.register(RA, "a")
    d.register(RB, "b", park="cooperative", parked_max=GIB, fallback="checkpoint", ask=True)
    d.acquire(D2, "b")
    d.release(D2, "b")
    d.acquire(D1, "a")
    d.park_done()
    early_sent(d)
    d.close(D2)
    d.park_done()
    # A half-woken vLLM's sleep does nothing (and its weights may fit in parked_max):
    # its launcher is not asked, slicerd checkpoints it.
    assert not d.asks
    e = d.parks.popleft()
    assert (e.workload, e.mode) == ("b", "checkpoint")


def test_the_registration_ending_during_an_early_start_parks_the_orphan() -> None:
    d = driver()
    early_sent(d)
    out = d.unregister(RB, "b")
    assert ("deny", D2, "Gone") in out
    d.park_done()  # a's checkpoint
    e = d.parks.popleft()
    assert (e.workload, e.mode) == ("b", "checkpoint")


def test_the_waiter_that_leaves_before_the_lock_ends_gets_nothing() -> None:
    d = driver()
    ask_early(d)
    d.release(D1, "a")
    e = d.parks.popleft()
    d.expire(D2)  # gone while the freeze runs: not told, nothing to abandon
    out = frozen(d, e)
    assert not [x for x in out if x[0] == "EARLY"]
    assert d.state("b") == "parked" and d.state("a") == "frozen"


@pytest.mark.parametrize("why", ["off", "no-fallback", "zero", "park-now"])
def test_no_early_start(why: str) -> None:
    limits = Limits(fit_headroom=GIB, early_start=why != "off")
    d = driver(limits, fallback="none" if why == "no-fallback" else "checkpoint")
    ask_early(d, 0 if why == "zero" else EARLY)
    d.release(D1, "a", park_now=why == "park-now")
    e = d.parks.popleft()
    assert (e.workload, e.mode, e.early) == ("a", "checkpoint", False)


def test_wanted_rules() -> None:
    on = Limits(fit_headroom=GIB)

    def wl(wid: int, state: WState, park: str, fallback: str = "checkpoint") -> Workload:
        w = Workload(wid, f"w{wid}", 0, 100 + wid, 0.0, True, park, GIB, 0, 1, fallback=fallback)
        w.state = state
        return w

    out, head = wl(1, WState.IDLE, "checkpoint"), wl(2, WState.PARKED, "cooperative")
    gpu = Gpu(0, "GPU-0")
    gpu.queue[9] = Waiter(conn=9, workload=head, since=0.0, early=EARLY)
    assert wanted(on, gpu, out, [out, head]) == (EARLY + GIB, gpu.queue[9])
    head.parked_procs = ((102, 1),)  # its residue is checkpointed: a restore comes first
    assert wanted(on, gpu, out, [out, head]) is None
    head.parked_procs = ()
    other = wl(3, WState.IDLE, "checkpoint")  # another resident may run beside the head
    assert wanted(on, gpu, out, [out, head, other]) is None
    other.state = WState.FROZEN  # a frozen one runs nothing
    assert wanted(on, gpu, out, [out, head, other]) == (EARLY + GIB, gpu.queue[9])
    gpu.queue[9].early_sent = True  # told already
    assert wanted(on, gpu, out, [out, head]) is None
    gpu.queue[9].early_sent = False
    coop = wl(4, WState.IDLE, "cooperative", "checkpoint")  # an awake replica in the way:
    assert wanted(on, gpu, coop, [coop, head]) is None  # its launcher sleeps it (cheaper)
    head.fallback = "residue"  # its residue is checkpointed at every park: a restore first
    assert wanted(on, gpu, out, [out, head]) is None
    head.fallback = "checkpoint"
    head.state = WState.REGISTERED  # never ran
    assert wanted(on, gpu, out, [out, head]) is None


def test_a_journaled_early_start_resumes_dirty_and_held_for_its_launcher() -> None:
    e = journal_entry(park="cooperative", parked_max=GIB, state="parked", early=EARLY)
    e |= {"alive": True, "resident_bytes": 0}  # nothing seen yet: a wake may be in flight
    back = restart.resumed(e, 7)
    assert back is not None and back.then == "hold"
    w = back.workload
    assert (w.state, w.early, w.must_park, w.holder_died) == (WState.IDLE, EARLY, True, True)
    assert restart.journal_entries([w])[0]["early"] == EARLY
    plain = restart.resumed(journal_entry(park="cooperative", parked_max=GIB, state="parked")
                            | {"alive": True, "resident_bytes": 0}, 8)  # fmt: skip
    assert plain is not None and plain.workload.state is WState.PARKED


def test_a_new_acquire_during_the_freeze_is_another_waiter_and_gets_no_early() -> None:
    d = driver()
    ask_early(d)
    d.release(D1, "a")
    e = d.parks.popleft()  # the freeze was checked for EARLY bytes
    d.expire(D2)
    ask_early(d, 500 * GIB)  # the same connection asks again, for far more
    out = frozen(d, e)
    assert not [x for x in out if x[0] == "EARLY"]
    assert d.record("b")["early"] == 0


def test_a_deferred_checkpoint_of_a_frozen_trainer_keeps_it_frozen_and_locked() -> None:
    d = driver()
    early_sent(d)
    c = d.parks.popleft()
    d.run(lambda now: d.sm.park_started(c.op, ((PIDS["a"], 1),), 50 * GIB))
    fx, go = d.sm.park_journaled(c.op, False, d.now)  # a full disk: the tool may not run
    d.apply(fx)
    assert not go and d.state("a") == "frozen"  # still locked: never "idle"
    assert d.record("a")["frozen_pids"] == [PIDS["a"]]
    d.recheck(0)  # the disk has room again
    again = d.parks.popleft()
    assert (again.workload, again.mode, again.locked) == ("a", "checkpoint", True)


def test_an_early_start_the_journal_could_not_record_is_never_used() -> None:
    d = driver()
    early_sent(d)
    out = d.run(lambda now: d.sm.early_unsent(D2, now))  # the server did not send EARLY
    assert out == [] and d.record("b")["early"] == 0
    events = [x.body["event"] for x in d.effects if isinstance(x, Emit)]
    assert "early-unsent" in events
    d.expire(D2)  # nothing was told, nothing to abandon: b stays parked
    assert d.state("b") == "parked"


def test_the_grant_after_an_early_start_writes_the_journal_again() -> None:
    d = driver()
    early_sent(d)
    before = len(d.effects)
    d.park_done()
    after = d.effects[before:]
    grant = next(i for i, x in enumerate(after) if isinstance(x, Grant))
    assert any(isinstance(x, Persist) and x.lazy for x in after[grant:])
    assert restart.journal_entries([d.sm.registered["b"]])[0]["early"] == 0


def test_a_restart_during_an_abandoned_early_start_park_keeps_it_dirty() -> None:
    e = journal_entry(park="cooperative", parked_max=GIB, state="parking", early=EARLY,
                      op_procs=[[PIDS["b"], 1]], fallback="checkpoint")  # fmt: skip
    back = restart.resumed(e | {"alive": True, "resident_bytes": GIB}, 7)
    assert back is not None and back.workload.recover == "park"
    assert back.workload.early == EARLY  # recovery finds it running: still dirty


def test_recovery_that_finds_an_abandoned_early_start_running_parks_it_by_checkpoint() -> None:
    e = journal_entry(name="b", pid=PIDS["b"], park="cooperative", parked_max=GIB,
                      state="parking", early=EARLY, op_procs=[[PIDS["b"], 1]],
                      fallback="checkpoint", ask=True)  # fmt: skip
    d, _ = _restart([e | {"alive": True, "resident_bytes": EARLY}])
    d.recover_done("resident")  # the driver says running: its park never started
    w = d.sm.orphans[next(iter(d.sm.orphans))]
    assert (w.state, w.early, w.must_park, w.holder_died) == (WState.IDLE, EARLY, True, True)
    d.register(RB, "b", park="cooperative", parked_max=GIB, fallback="checkpoint", ask=True)
    d.acquire(D1, "b")  # adopted, still dirty: checkpointed (its launcher not asked)
    assert not d.asks
    p = d.parks.popleft()
    assert (p.workload, p.mode) == ("b", "checkpoint")
