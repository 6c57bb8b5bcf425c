"""Table-driven tests of the pure turn state machine (slicer.state.SlicerState).

A small `Driver` plays the server: it performs effects the way `slicer.server` does and
hands back what a server would have measured (`Verify` is answered in place with a
configurable census and free memory; `Park`/`Restore` are kept so a test completes them,
in order, successfully or not, or all at once with `auto=True`).
Effects are summarised as short tuples so the scenario tables read like a wire trace.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpu_slicer.slicer import errors
from gpu_slicer.slicer.effects import (
    AskPark,
    Deny,
    Effect,
    Emit,
    Grant,
    Park,
    Persist,
    Reap,
    Recheck,
    Recover,
    Reply,
    Restore,
    SendEarly,
    SendFault,
    SendWaiting,
    Verify,
)
from gpu_slicer.slicer.model import TRANSITIONS, Workload, WState
from gpu_slicer.slicer.readings import (
    Census,
    Outcome,
    ParkReport,
    RecoverReport,
    RecoveryReading,
    RestoreReport,
)
from gpu_slicer.slicer.state import Limits, ProcessInfo, SlicerState

GPUS = [(0, "GPU-aaaa-0000"), (1, "GPU-bbbb-1111")]
GIB = 1024**3
PARK_MS = 7
RESTORE_MS = 9
MOVED = 2 * GIB
KILL_AFTER = Limits().fault_kill_after

# Connection ids used throughout: registrants own the processes, dispatchers (root) acquire.
RA, RB, RC = 1, 2, 3  # registrants of "a" (gpu 0), "b" (gpu 0), "c" (gpu 1)
D1, D2, D3, D4, D5, D6 = 11, 12, 13, 14, 15, 16  # root dispatchers
USER = 1000
PIDS = {"a": 100, "b": 200, "c": 300, "d": 400}


def summary(e: Effect) -> tuple[Any, ...] | None:
    """What a client (or the operator) would see of one effect; None for internals."""
    match e:
        case Grant():
            return ("grant", e.conn, e.workload, e.turn, e.restored)
        case Reply() if "parked" in e.fields:
            return ("released", e.conn, int(e.fields["parked"]))
        case Reply() if "state" in e.fields:
            return ("registered", e.conn, e.fields["workload"], e.fields["state"])
        case Reply():
            return ("ok", e.conn)
        case Deny():
            return ("deny", e.conn, type(e.error).__name__)
        case Park():
            return ("park", e.workload, e.mode)
        case Restore():
            return ("restore", e.workload)
        case Recover():
            return ("recover", e.workload, e.intent)
        case AskPark():
            return ("PARK", e.conn, e.workload, e.turn)
        case Recheck():
            return ("recheck", e.gpu)
        case SendFault():
            return ("FAULT", e.conn, e.workload, e.turn, e.reason)
        case SendWaiting():
            return ("WAITING", e.conn, e.workload, e.turn, e.waiters)
        case SendEarly():
            return ("EARLY", e.conn, e.workload, e.nbytes)
        case Reap():
            return ("reap", e.workload, e.kill_after)
        case Emit() | Persist() | Verify():
            return None
    raise AssertionError(f"unknown effect {e!r}")


@dataclass
class Driver:
    """Drives a SlicerState like the server: performs effects, tracks turns and time."""

    sm: SlicerState
    auto: bool = False
    now: float = 10.0
    seen: dict[int, Census] = field(default_factory=dict)  # what each GPU's census shows
    free: dict[int, int] = field(default_factory=dict)  # free bytes per GPU (default: plenty)
    parks: deque[Park] = field(default_factory=deque)
    restores: deque[Restore] = field(default_factory=deque)
    recovers: deque[Recover] = field(default_factory=deque)
    asks: deque[AskPark] = field(default_factory=deque)
    effects: list[Effect] = field(default_factory=list)
    turns: dict[int, int] = field(default_factory=dict)
    all_turns: list[int] = field(default_factory=list)
    _start: Any = field(default_factory=lambda: itertools.count(1))

    # ---- performing effects ------------------------------------------------------------

    def apply(self, fx: list[Effect]) -> list[Effect]:
        """Perform `fx` in order; return every effect performed (cascades included)."""
        done: list[Effect] = []
        work = deque(fx)
        while work or (self.auto and (self.parks or self.restores)):
            if not work:
                # Park/Restore run asynchronously in the server: finish them only once the
                # current batch has been performed.
                if self.parks:
                    work.extend(self._park_done(self.parks.popleft(), True, "", ""))
                else:
                    work.extend(self._restore_done(self.restores.popleft(), True, "", ""))
                continue
            e = work.popleft()
            done.append(e)
            match e:
                case Verify():
                    seen = self.seen.get(e.gpu, Census())
                    free = self.free.get(e.gpu, 1 << 40) if e.need else None
                    work.extend(self.sm.verified(e.op, seen, self.now, free))
                case Park():
                    self.parks.append(e)
                case Restore():
                    self.restores.append(e)
                case Recover():
                    self.recovers.append(e)
                case AskPark():
                    self.asks.append(e)
                case Grant():
                    self.turns[e.conn] = e.turn
                    self.all_turns.append(e.turn)
                case _:
                    pass
        self.effects += done
        return done

    def run(self, call: Callable[[float], list[Effect]]) -> list[tuple[Any, ...]]:
        return [s for s in map(summary, self.apply(call(self.now))) if s is not None]

    def _park_done(self, e: Park, ok: bool, reason: str, text: str) -> list[Effect]:
        return self.sm.park_done(e.op, self.park_report(e, ok, reason, text), self.now)

    def park_report(self, e: Park, ok: bool, reason: str = "", text: str = "") -> ParkReport:
        """What the server would measure: a checkpoint park runs the tool on the
        workload's process (MOVED bytes leave); a cooperative one only reads the backend.
        A failure is the tool's `reason`, or memory left on the device (still-resident)."""
        w = self.sm.by_wid(e.wid)
        assert w is not None
        stays = e.parked_max + 1
        if e.mode == "cooperative":
            return ParkReport(PARK_MS, after=0 if ok else stays)
        procs = ((w.pid, int(w.start_time)),)
        if ok or reason == "still-resident":
            after = 0 if ok else stays
            return ParkReport(PARK_MS, MOVED, procs, Outcome(True), (True,), after)
        return ParkReport(PARK_MS, MOVED, procs, Outcome(False, reason, text), (True,), MOVED)

    def _restore_done(self, e: Restore, ok: bool, reason: str, text: str) -> list[Effect]:
        report = RestoreReport(RESTORE_MS, e.procs, Outcome(ok, reason, text))
        return self.sm.restore_done(e.op, report, self.now)

    # ---- the client side -----------------------------------------------------------------

    def connect(self, conn: int, uid: int = 0, pid: int | None = None) -> None:
        self.sm.connect(conn, uid, pid if pid is not None else 5000 + conn)

    def register(
        self,
        conn: int,
        name: str,
        gpu: int = 0,
        *,
        pid: int | None = None,
        proc_uid: int | None = None,
        start_time: float = 1.0,
        park: str = "checkpoint",
        parked_max: int = 0,
        resident: int = 0,
        fallback: str = "none",
        ask: bool = False,
        sharing: tuple[int, ...] = (),
        parker: str = "",
    ) -> list[tuple[Any, ...]]:
        uid = proc_uid if proc_uid is not None else self.sm.conns[conn].uid
        proc = ProcessInfo(pid if pid is not None else PIDS[name], start_time, uid)
        return self.run(
            lambda now: self.sm.register(
                conn,
                name,
                gpu,
                proc,
                True,
                park,
                parked_max,
                resident,
                now,
                fallback=fallback,
                sharing=sharing,
                ask=ask,
                parker=parker,
            )
        )

    def acquire(self, conn: int, name: str) -> list[tuple[Any, ...]]:
        return self.run(lambda now: self.sm.acquire(conn, name, now))

    def release(
        self, conn: int, name: str, turn: int | None = None, park_now: bool = False
    ) -> list[tuple[Any, ...]]:
        t = self.turns[conn] if turn is None else turn
        return self.run(lambda now: self.sm.release(conn, name, t, park_now, now))

    def close(self, conn: int) -> list[tuple[Any, ...]]:
        return self.run(lambda now: self.sm.conn_closed(conn, now))

    def unregister(self, conn: int, name: str) -> list[tuple[Any, ...]]:
        return self.run(lambda now: self.sm.unregister(conn, name, now))

    def expire(self, conn: int) -> list[tuple[Any, ...]]:
        return self.run(lambda now: self.sm.wait_expired(conn, now))

    def recheck(self, gpu: int) -> list[tuple[Any, ...]]:
        return self.run(lambda now: self.sm.recheck(gpu, now))

    def park_done(self, ok: bool = True, reason: str = "", text: str = "") -> list[tuple[Any, ...]]:
        e = self.parks.popleft()
        return self.run(lambda now: self._park_done(e, ok, reason, text))

    def restore_done(
        self, ok: bool = True, reason: str = "", text: str = ""
    ) -> list[tuple[Any, ...]]:
        e = self.restores.popleft()
        return self.run(lambda now: self._restore_done(e, ok, reason, text))

    def recover_done(self, result: str = "parked", reason: str = "") -> list[tuple[Any, ...]]:
        """Finish the oldest Recover with the driver's state that leads to `result`:
        checkpointed (parked), running (resident), no process left (gone) or failed
        (fault, reason recover-failed)."""
        e = self.recovers.popleft()
        assert result != "fault" or reason in ("", "recover-failed")
        state = {"parked": "checkpointed", "resident": "running", "fault": "failed"}
        if result == "gone":
            reading = RecoveryReading()
        else:
            states = {pid: state[result] for pid, _ in e.procs}
            reading = RecoveryReading(e.procs, True, (), states)
        report = RecoverReport(reading, Outcome(True), 0)
        return self.run(lambda now: self.sm.recover_done(e.op, report, now))

    def memory_report(self, name: str, alive: bool, nbytes: int) -> list[tuple[Any, ...]]:
        wid = self.wid(name)
        return self.run(lambda now: self.sm.memory_report(wid, alive, nbytes, now)[0])

    # ---- looking -------------------------------------------------------------------------

    def wid(self, name: str) -> int:
        found = [w.wid for w in self.sm.workloads() if w.name == name]
        assert len(found) == 1, found
        return found[0]

    def record(self, name: str) -> dict[str, Any]:
        """The one STATUS entry of workload `name`."""
        (w,) = [w for w in self.sm.status()["workloads"] if w["name"] == name]
        return dict(w)

    def state(self, name: str) -> str:
        return str(self.record(name)["state"])

    def gpu(self, index: int) -> dict[str, Any]:
        return dict(self.sm.status()["gpus"][index])


def journal_entry(**over: Any) -> dict[str, Any]:
    """A journal entry of workload "a" (gpu 0, park=checkpoint) as a restarted daemon reads
    it, with the server's fresh measurement; `over` sets the state and the rest."""
    return {
        "name": "a",
        "gpu": 0,
        "pid": PIDS["a"],
        "start_time": 1.0,
        "tree": True,
        "park": "checkpoint",
        "parked_max": 0,
        "owner_uid": USER,
        "state": "idle",
        "alive": True,
        "resident_bytes": 0,
        **over,
    }


def fresh(limits: Limits | None = None) -> SlicerState:
    sm = SlicerState(GPUS, limits)
    sm.adopt_journal([], 0.0)
    return sm


def setup(d: Driver) -> None:
    """Registrants of a, b (gpu 0) and c (gpu 1), all uid 1000; six root dispatchers."""
    for conn in (RA, RB, RC):
        d.connect(conn, uid=USER, pid=900 + conn)
    for conn in (D1, D2, D3, D4, D5, D6):
        d.connect(conn, uid=0)
    assert d.register(RA, "a", 0) == [("registered", RA, "a", "registered")]
    assert d.register(RB, "b", 0) == [("registered", RB, "b", "registered")]
    assert d.register(RC, "c", 1) == [("registered", RC, "c", "registered")]


@pytest.fixture
def d() -> Driver:
    drv = Driver(fresh())
    setup(drv)
    return drv


@pytest.fixture
def auto() -> Driver:
    drv = Driver(fresh(), auto=True)
    setup(drv)
    return drv


def snapshot(sm: SlicerState) -> tuple[Any, ...]:
    return (
        sm.status(),
        sm.journal(),
        {c: (x.uid, x.waiting_on) for c, x in sm.conns.items()},
    )


# ---- the transition table ---------------------------------------------------------------

ALL_PAIRS = [(a, b) for a in WState for b in WState]


def _workload(state: WState) -> Workload:
    w = Workload(1, "w", 0, 1, 1.0, True, "checkpoint", 0, 0, None)
    w.state = state
    return w


@pytest.mark.parametrize(("src", "dst"), [p for p in ALL_PAIRS if p[1] not in TRANSITIONS[p[0]]])
def test_illegal_transition_raises_and_keeps_state(src: WState, dst: WState) -> None:
    w = _workload(src)
    with pytest.raises(errors.IllegalTransition):
        w.to(dst)
    assert w.state is src


@pytest.mark.parametrize(("src", "dst"), [p for p in ALL_PAIRS if p[1] in TRANSITIONS[p[0]]])
def test_legal_transition_moves(src: WState, dst: WState) -> None:
    w = _workload(src)
    w.to(dst)
    assert w.state is dst


def test_faulted_is_terminal_and_table_is_complete() -> None:
    assert set(TRANSITIONS) == set(WState)
    assert TRANSITIONS[WState.FAULTED] == frozenset()


# ---- refused requests change nothing ----------------------------------------------------


def _hold_a(d: Driver) -> None:
    d.acquire(D1, "a")


def _hold_a_again(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a")
    d.acquire(D1, "a")  # turn 2


def _a_waiting(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")


def _fault_a(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")
    d.park_done(ok=False, reason="lock-failed")


REFUSED: list[tuple[str, Callable[[Driver], None], Callable[[Driver], Any], type[Exception]]] = [
    (
        "register-other-uid",
        lambda d: d.connect(21, uid=USER),
        lambda d: d.register(21, "x", pid=77, proc_uid=USER + 1),
        errors.Forbidden,
    ),
    ("register-exists", lambda d: None, lambda d: d.register(D1, "a", pid=555), errors.Exists),
    (
        "register-unknown-gpu",
        lambda d: None,
        lambda d: d.register(D1, "x", 2, pid=555),
        errors.UnknownGpu,
    ),
    ("acquire-unknown", lambda d: None, lambda d: d.acquire(D1, "nope"), errors.UnknownWorkload),
    (
        "acquire-other-uid",
        lambda d: d.connect(21, uid=USER + 1),
        lambda d: d.acquire(21, "a"),
        errors.Forbidden,
    ),
    ("acquire-while-holding", _hold_a, lambda d: d.acquire(D1, "c"), errors.Busy),
    ("acquire-while-waiting", _a_waiting, lambda d: d.acquire(D2, "c"), errors.Busy),
    ("acquire-faulted", _fault_a, lambda d: d.acquire(D3, "a"), errors.Faulted),
    ("release-not-held", lambda d: None, lambda d: d.release(D1, "a", 1), errors.NotHolder),
    ("release-old-turn", _hold_a_again, lambda d: d.release(D1, "a", 1), errors.NotHolder),
    ("release-wrong-turn", _hold_a, lambda d: d.release(D1, "a", 99), errors.NotHolder),
    ("release-wrong-name", _hold_a, lambda d: d.release(D1, "b", 1), errors.NotHolder),
    ("release-other-conn", _hold_a, lambda d: d.release(D2, "a", 1), errors.NotHolder),
    ("release-while-waiting", _a_waiting, lambda d: d.release(D2, "b", 1), errors.NotHolder),
    ("unregister-unknown", lambda d: None, lambda d: d.unregister(RA, "x"), errors.UnknownWorkload),
    (
        "unregister-not-registrant",
        lambda d: None,
        lambda d: d.unregister(RB, "a"),
        errors.NotRegistrant,
    ),
]


@pytest.mark.parametrize(
    ("prepare", "request_", "error"),
    [pytest.param(p, r, e, id=i) for i, p, r, e in REFUSED],
)
def test_refused_request_raises_and_changes_nothing(
    d: Driver,
    prepare: Callable[[Driver], None],
    request_: Callable[[Driver], Any],
    error: type[Exception],
) -> None:
    prepare(d)
    before = snapshot(d.sm)
    with pytest.raises(error):
        request_(d)
    assert snapshot(d.sm) == before


def test_limit_on_workloads() -> None:
    d = Driver(fresh(Limits(max_workloads=2)))
    d.connect(RA, uid=USER)
    d.register(RA, "a")
    d.register(RA, "b")
    before = snapshot(d.sm)
    with pytest.raises(errors.LimitReached):
        d.register(RA, "c", 1)
    assert snapshot(d.sm) == before
    # A freed name makes room again.
    d.unregister(RA, "b")
    assert d.register(RA, "c", 1) == [("registered", RA, "c", "registered")]


def test_limit_on_queue() -> None:
    d = Driver(fresh(Limits(max_queue=2)))
    setup(d)
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.acquire(D3, "a")
    before = snapshot(d.sm)
    with pytest.raises(errors.LimitReached):
        d.acquire(D4, "b")
    assert snapshot(d.sm) == before


def test_root_may_register_and_acquire_any_uid(d: Driver) -> None:
    assert d.register(D1, "x", 1, pid=77, proc_uid=USER + 5) == [
        ("registered", D1, "x", "registered")
    ]
    d.connect(21, uid=USER + 5)
    assert d.acquire(21, "x") == [("grant", 21, "x", 1, False)]


@pytest.mark.parametrize(
    ("token", "index"),
    [(None, 0), ("0", 0), ("1", 1), ("GPU-aaaa-0000", 0), ("GPU-bbbb-1111", 1)],
)
def test_resolve_gpu(token: str | None, index: int) -> None:
    assert fresh().resolve_gpu(token) == index


@pytest.mark.parametrize("token", ["2", "-1", "GPU-cccc", "gpu-aaaa-0000", "", "0x1"])
def test_resolve_gpu_unknown(token: str) -> None:
    with pytest.raises(errors.UnknownGpu):
        fresh().resolve_gpu(token)


# ---- register with memory already on the GPU -------------------------------------------


def test_resident_at_register_is_idle_on_a_free_gpu() -> None:
    d = Driver(fresh())
    d.connect(RA, uid=USER)
    assert d.register(RA, "a", resident=GIB) == [("registered", RA, "a", "idle")]
    assert d.gpu(0)["resident"] == "a"
    d.connect(D1)
    # Already resident: granted without any park or restore.
    assert d.acquire(D1, "a") == [("grant", D1, "a", 1, False)]


def test_resident_at_register_below_parked_max_is_registered() -> None:
    d = Driver(fresh())
    d.connect(RA, uid=USER)
    out = d.register(RA, "a", resident=GIB, parked_max=GIB, park="cooperative")
    assert out == [("registered", RA, "a", "registered")]
    assert d.gpu(0)["resident"] is None


def test_resident_at_register_parked_at_once_when_other_is_active(d: Driver) -> None:
    d.acquire(D1, "a")
    d.connect(21, uid=USER)
    out = d.register(21, "d", resident=GIB)
    assert out == [("registered", 21, "d", "idle"), ("park", "d", "checkpoint")]
    assert d.state("d") == "parking"
    assert d.park_done() == []
    assert d.state("d") == "parked"
    assert d.state("a") == "active"


def test_resident_at_register_parked_at_once_when_other_is_idle(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a")
    assert d.state("a") == "idle"
    d.connect(21, uid=USER)
    out = d.register(21, "d", resident=GIB)
    assert ("park", "d", "checkpoint") in out
    assert ("park", "a", "checkpoint") not in out


# ---- acquire / grant ----------------------------------------------------------------------


def test_uncontended_grant(d: Driver) -> None:
    d.now = 20.0
    assert d.acquire(D1, "a") == [("grant", D1, "a", 1, False)]
    (g,) = [e for e in d.effects if isinstance(e, Grant)]
    assert g.waited_ms == 0
    gpu = d.gpu(0)
    assert gpu["holder"] == {"workload": "a", "turn": 1}
    assert gpu["resident"] == "a"
    assert gpu["grants"] == 1
    assert d.state("a") == "active"
    assert d.sm.status()["totals"]["grants"] == 1


def test_waited_ms_counts_from_acquire(auto: Driver) -> None:
    d = auto
    d.acquire(D1, "a")
    d.now = 11.0
    d.acquire(D2, "b")
    d.now = 13.5
    d.release(D1, "a")
    grant = [e for e in d.effects if isinstance(e, Grant)][-1]
    assert (grant.conn, grant.waited_ms) == (D2, 2500)


def test_fifo_across_two_workloads(auto: Driver) -> None:
    d = auto
    assert d.acquire(D1, "a") == [("grant", D1, "a", 1, False)]
    order = [(D2, "b"), (D3, "a"), (D4, "b"), (D5, "a"), (D6, "b")]
    for conn, name in order:
        d.acquire(conn, name)
    assert d.gpu(0)["queue"] == [name for _, name in order]
    holder, held = D1, "a"
    granted = []
    for _ in order:
        held_before = held
        out = d.release(holder, held)
        (g,) = [s for s in out if s[0] == "grant"]
        granted.append((g[1], g[2]))
        holder, held = g[1], g[2]
        # Every switch parks the previous workload before the next is granted.
        assert out[0] == ("park", held_before, "checkpoint")
    assert granted == order
    a = d.record("a")
    b = d.record("b")
    assert (a["parks"], a["restores"], a["grants"]) == (3, 2, 3)
    assert (b["parks"], b["restores"], b["grants"]) == (2, 2, 3)


def test_waiting_hint_once_with_waiter_count(d: Driver) -> None:
    assert d.acquire(D1, "a") == [("grant", D1, "a", 1, False)]
    # Another connection of the same workload waiting is no reason to hurry.
    assert d.acquire(D2, "a") == []
    assert d.acquire(D3, "b") == [("WAITING", D1, "a", 1, 1)]
    assert d.acquire(D4, "b") == []
    d.connect(21, uid=USER)
    d.register(21, "d", 0, pid=400)
    assert d.acquire(D5, "d") == []
    sent = [e for e in d.effects if isinstance(e, SendWaiting)]
    assert len(sent) == 1


def test_waiting_hint_counts_other_workloads(d: Driver) -> None:
    d.connect(21, uid=USER)
    d.register(21, "d", 0)
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.acquire(D3, "d")
    d.acquire(D4, "a")
    d.release(D1, "a")
    # b's turn starts with d and a waiting: two other workloads.
    out = d.park_done()
    assert out[-2:] == [("grant", D2, "b", 2, False), ("WAITING", D2, "b", 2, 2)]


def test_waiting_hint_sent_when_grant_finds_waiters(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.acquire(D3, "a")
    d.release(D1, "a")
    out = d.park_done()
    assert out[-2:] == [("grant", D2, "b", 2, False), ("WAITING", D2, "b", 2, 1)]


def test_waiting_hint_again_after_waiters_left(d: Driver) -> None:
    d.acquire(D1, "a")
    assert d.acquire(D2, "b") == [("WAITING", D1, "a", 1, 1)]
    assert d.expire(D2) == [("deny", D2, "Timeout")]
    assert d.acquire(D3, "b") == [("WAITING", D1, "a", 1, 1)]


def test_park_failure_answers_waiters_of_the_faulted_workload(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.acquire(D3, "a")
    d.release(D1, "a")
    out = d.park_done(ok=False, reason="lock-failed")
    assert ("deny", D3, "Faulted") in out
    assert d.gpu(0)["queue"] == ["b"]


def test_other_gpu_unaffected_by_park_in_flight(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    assert d.release(D1, "a") == [("park", "a", "checkpoint")]
    assert d.gpu(0)["busy"] == "park"
    assert d.acquire(D3, "c") == [("grant", D3, "c", 2, False)]
    assert d.gpu(1)["holder"] == {"workload": "c", "turn": 2}
    assert d.gpu(0)["holder"] is None
    assert d.park_done()[-1] == ("grant", D2, "b", 3, False)


def test_turn_ids_strictly_increase_across_gpus(auto: Driver) -> None:
    d = auto
    for _ in range(3):
        d.acquire(D1, "a")
        d.acquire(D3, "c")
        d.acquire(D2, "b")
        d.release(D3, "c")
        d.release(D1, "a")
        d.release(D2, "b", park_now=True)
    assert len(d.all_turns) == 9
    assert d.all_turns == sorted(set(d.all_turns))
    assert all(t > 0 for t in d.all_turns)


# ---- scenario tables ----------------------------------------------------------------------
#
# Each step is (action, args...) and the effects it must produce, summarised. Turns held
# are tracked by the driver; "rel" releases the turn the connection holds.

Step = tuple[tuple[Any, ...], list[tuple[Any, ...]] | str]


def perform(d: Driver, action: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    verb, *args = action
    match verb:
        case "acq":
            return d.acquire(*args)
        case "rel":
            return d.release(*args)
        case "rel-now":
            return d.release(*args, park_now=True)
        case "close":
            return d.close(*args)
        case "unreg":
            return d.unregister(*args)
        case "expire":
            return d.expire(*args)
        case "park-ok":
            return d.park_done()
        case "park-fail":
            return d.park_done(ok=False, reason=args[0])
        case "restore-ok":
            return d.restore_done()
        case "restore-fail":
            return d.restore_done(ok=False, reason=args[0])
        case "mem":
            return d.memory_report(*args)
        case "recheck":
            return d.recheck(*args)
        case "state":
            return [("state", args[0], d.state(args[0]))]
        case "block":
            # Processes no workload owns appear on (or leave) the GPU.
            d.seen[args[0]] = Census(foreign={b["pid"]: b["bytes"] for b in args[1]})
            return []
    raise AssertionError(verb)


FOREIGN = [{"pid": 4242, "bytes": GIB}]

SCENARIOS: dict[str, list[Step]] = {
    "lazy-release-nobody-waiting-then-reacquire": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("rel", D1, "a"), [("released", D1, 0)]),
        (("state", "a"), [("state", "a", "idle")]),
        # Idle: still resident, re-acquired with no park and no restore.
        (("acq", D2, "a"), [("grant", D2, "a", 2, False)]),
        (("rel", D2, "a"), [("released", D2, 0)]),
    ],
    "lazy-release-with-waiter-parks-then-restores": [
        # b runs once and idles; a's acquire parks b.
        (("acq", D1, "b"), [("grant", D1, "b", 1, False)]),
        (("rel", D1, "b"), [("released", D1, 0)]),
        (("acq", D2, "a"), [("park", "b", "checkpoint")]),
        (("park-ok",), [("grant", D2, "a", 2, False)]),
        # b waits: the holder hears of it; its lazy release parks a before answering.
        (("acq", D1, "b"), [("WAITING", D2, "a", 2, 1)]),
        (("rel", D2, "a"), [("park", "a", "checkpoint")]),
        (("park-ok",), [("released", D2, 1), ("restore", "b")]),
        (("restore-ok",), [("grant", D1, "b", 3, True)]),
    ],
    "release-park-now-nobody-waiting": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("rel-now", D1, "a"), [("park", "a", "checkpoint")]),
        (("park-ok",), [("released", D1, 1)]),
        (("acq", D1, "a"), [("restore", "a")]),
        (("restore-ok",), [("grant", D1, "a", 2, True)]),
    ],
    "park-failure-keeps-gpu-until-processes-gone": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("rel", D1, "a"), [("park", "a", "checkpoint")]),
        (
            ("park-fail", "lock-timeout"),
            [
                ("FAULT", RA, "a", 1, "lock-timeout"),
                ("reap", "a", KILL_AFTER),
                ("deny", D1, "ParkFailed"),
            ],
        ),
        (("state", "a"), [("state", "a", "faulted")]),
        # Still registered, or the processes still hold memory: nobody is granted.
        (("mem", "a", True, GIB), []),
        (("acq", D3, "c"), [("grant", D3, "c", 2, False)]),
        (("close", RA), []),
        (("mem", "a", True, GIB), []),
        (("mem", "a", True, 0), [("grant", D2, "b", 3, False)]),
    ],
    "park-failure-dead-processes-release-gpu": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("rel-now", D1, "a"), [("park", "a", "checkpoint")]),
        (
            ("park-fail", "still-resident"),
            [
                ("FAULT", RA, "a", 1, "still-resident"),
                ("reap", "a", KILL_AFTER),
                ("deny", D1, "ParkFailed"),
            ],
        ),
        (("mem", "a", False, 0), []),  # registration still live
        (("unreg", RA, "a"), [("ok", RA)]),
        (("mem", "a", False, GIB), [("grant", D2, "b", 2, False)]),
    ],
    "restore-failure-faults-and-denies-waiters": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("rel-now", D1, "a"), [("park", "a", "checkpoint")]),
        (("park-ok",), [("released", D1, 1)]),
        (("acq", D1, "a"), [("restore", "a")]),
        (("acq", D2, "b"), []),
        (
            ("restore-fail", "unlock-failed"),
            [
                ("FAULT", RA, "a", 1, "unlock-failed"),
                ("reap", "a", KILL_AFTER),
                ("deny", D1, "RestoreFailed"),
            ],
        ),
        (("state", "a"), [("state", "a", "faulted")]),
        (("close", RA), []),
        (("mem", "a", False, 0), [("grant", D2, "b", 2, False)]),
    ],
    "holder-close-parks-before-next-grant-same-workload": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "a"), []),
        # A dispatcher died mid-turn: a's state may be dirty, park it even though the next
        # waiter wants a as well.
        (("close", D1), [("park", "a", "checkpoint")]),
        (("park-ok",), [("restore", "a")]),
        (("restore-ok",), [("grant", D2, "a", 2, True)]),
    ],
    "holder-close-parks-before-next-grant-other-workload": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("close", D1), [("park", "a", "checkpoint")]),
        (("park-ok",), [("grant", D2, "b", 2, False)]),
    ],
    "holder-close-nobody-waiting-still-parks": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("close", D1), [("park", "a", "checkpoint")]),
        (("park-ok",), []),
    ],
    "holder-close-park-failure-faults": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("close", D1), [("park", "a", "checkpoint")]),
        (
            ("park-fail", "lock-failed"),
            [("FAULT", RA, "a", 1, "lock-failed"), ("reap", "a", KILL_AFTER)],
        ),
        (("close", RA), []),
        (("mem", "a", True, 0), [("grant", D2, "b", 2, False)]),
    ],
    "registrant-close-while-held-and-waited": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "a"), []),
        (("acq", D3, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("acq", D4, "a"), []),
        # Waiters of a hear it is gone; the resident a is parked before b is granted.
        (("close", RA), [("deny", D2, "Gone"), ("deny", D4, "Gone"), ("park", "a", "checkpoint")]),
        (("park-ok",), [("reap", "a", None), ("grant", D3, "b", 2, False)]),
        (("acq", D2, "a"), "UnknownWorkload"),
        (("mem", "a", False, 0), []),
    ],
    "registrant-close-idle-nobody-waiting": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("rel", D1, "a"), [("released", D1, 0)]),
        (("close", RA), [("park", "a", "checkpoint")]),
        (("park-ok",), [("reap", "a", None)]),
        (("mem", "a", True, 0), []),  # parked and alive: kept for a re-register
        (("mem", "a", False, 0), []),
    ],
    "waiter-timeout": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("acq", D3, "b"), []),
        (("expire", D2), [("deny", D2, "Timeout")]),
        (("expire", D2), []),  # stale: no longer queued
        (("rel", D1, "a"), [("park", "a", "checkpoint")]),
        (("park-ok",), [("released", D1, 1), ("grant", D3, "b", 2, False)]),
        (("expire", D3), []),  # stale: granted meanwhile
        (("expire", 99), []),  # unknown connection
    ],
    "waiter-close-unqueues": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("acq", D2, "b"), [("WAITING", D1, "a", 1, 1)]),
        (("close", D2), []),
        (("rel", D1, "a"), [("released", D1, 0)]),
    ],
    "waiter-leaves-during-its-restore": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("rel-now", D1, "a"), [("park", "a", "checkpoint")]),
        (("park-ok",), [("released", D1, 1)]),
        (("acq", D2, "a"), [("restore", "a")]),
        (("expire", D2), [("deny", D2, "Timeout")]),
        # The restore finishes for nobody: a is idle, re-acquire needs nothing.
        (("restore-ok",), []),
        (("acq", D3, "a"), [("grant", D3, "a", 2, False)]),
    ],
    "registrant-close-during-restore": [
        (("acq", D1, "a"), [("grant", D1, "a", 1, False)]),
        (("rel-now", D1, "a"), [("park", "a", "checkpoint")]),
        (("park-ok",), [("released", D1, 1)]),
        (("acq", D1, "a"), [("restore", "a")]),
        (("acq", D2, "b"), []),
        (("close", RA), [("deny", D1, "Gone")]),
        # Restored for nobody, and its registration is over: parked again before b.
        (("restore-ok",), [("park", "a", "checkpoint")]),
        (("park-ok",), [("reap", "a", None), ("grant", D2, "b", 2, False)]),
    ],
    "foreign-memory-blocks-grant": [
        (("block", 0, FOREIGN), []),
        (("acq", D1, "a"), [("recheck", 0)]),
        (("recheck", 0), [("recheck", 0)]),
        (("acq", D3, "c"), [("grant", D3, "c", 1, False)]),  # other GPU is clean
        (("block", 0, []), []),
        (("recheck", 0), [("grant", D1, "a", 2, False)]),
    ],
}


@pytest.mark.parametrize("steps", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_scenario(d: Driver, steps: list[Step]) -> None:
    for i, (action, expected) in enumerate(steps):
        if isinstance(expected, str):
            with pytest.raises(getattr(errors, expected)):
                perform(d, action)
            continue
        assert perform(d, action) == expected, f"step {i}: {action}"


# ---- details the scenarios do not show ----------------------------------------------------


def test_lazy_release_idle_state_and_counters(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a")
    assert d.state("a") == "idle"
    assert d.gpu(0)["resident"] == "a"
    assert d.gpu(0)["holder"] is None
    totals = {"grants": 1, "parks": 0, "restores": 0, "faults": 0, "preemptions": 0}
    totals |= {"freezes": 0, "thaws": 0, "earlies": 0, "wasted_turns": 0}
    assert d.sm.status()["totals"] == totals
    d.acquire(D2, "a")
    assert not any(isinstance(e, Park | Restore) for e in d.effects)


def test_switch_records_counters_and_timings(auto: Driver) -> None:
    d = auto
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.acquire(D1, "a")
    a = d.record("a")
    assert (a["parks"], a["restores"], a["last_park_ms"], a["last_restore_ms"]) == (
        1,
        1,
        PARK_MS,
        RESTORE_MS,
    )
    assert a["parked_bytes"] == 0
    (restore,) = [e for e in d.effects if isinstance(e, Restore)]
    assert restore.procs == ((PIDS["a"], 1),)
    assert restore.nbytes == MOVED


def test_restore_verifies_room_for_parked_bytes(d: Driver) -> None:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    d.free[0] = 0
    assert d.acquire(D1, "a") == [("recheck", 0)]
    verify = [e for e in d.effects if isinstance(e, Verify)][-1]
    assert verify.need == MOVED
    assert not d.restores
    assert d.state("a") == "parked"


def test_blockers_show_in_status_until_clean(d: Driver) -> None:
    d.seen[0] = Census(foreign={4242: GIB})
    d.acquire(D1, "a")
    gpu = d.gpu(0)
    assert gpu["foreign"] == FOREIGN
    assert gpu["holder"] is None
    assert gpu["queue"] == ["a"]
    assert d.state("a") == "registered"
    d.seen[0] = Census()
    d.recheck(0)
    assert d.gpu(0)["foreign"] == []
    assert d.gpu(0)["holder"] == {"workload": "a", "turn": 1}


def test_park_failure_details(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")
    d.park_done(ok=False, reason="lock-timeout", text="cuda-checkpoint hung")
    assert d.state("a") == "faulted"
    (fault,) = [e for e in d.effects if isinstance(e, SendFault)]
    assert fault.text == "cuda-checkpoint hung"
    (reap,) = [e for e in d.effects if isinstance(e, Reap)]
    assert (reap.pid, reap.kill_after, reap.gpu) == (PIDS["a"], KILL_AFTER, 0)
    (deny,) = [e for e in d.effects if isinstance(e, Deny)]
    assert isinstance(deny.error, errors.ParkFailed)
    gpu = d.gpu(0)
    assert (gpu["resident"], gpu["holder"], gpu["queue"]) == ("a", None, ["b"])
    totals = d.sm.status()["totals"]
    assert (totals["faults"], totals["parks"]) == (1, 0)
    # The releaser's turn is over: it may acquire again (and waits like anyone else).
    assert d.acquire(D1, "b") == []
    # The name is freed when the registration ends and may be registered again at once,
    # even while the faulted processes are still being reaped.
    d.close(RA)
    d.connect(21, uid=USER)
    assert d.register(21, "a", pid=101) == [("registered", 21, "a", "registered")]
    assert d.gpu(0)["holder"] is None


def test_cooperative_park_mode(auto: Driver) -> None:
    d = auto
    d.connect(21, uid=USER)
    d.register(21, "v", 1, pid=500, park="cooperative", parked_max=GIB)
    assert d.acquire(D1, "v") == [("grant", D1, "v", 1, False)]
    out = d.acquire(D2, "c")
    assert out == [("WAITING", D1, "v", 1, 1)]
    out = d.release(D1, "v")
    assert out == [
        ("park", "v", "cooperative"),
        ("released", D1, 1),
        ("grant", D2, "c", 2, False),
    ]
    d.acquire(D1, "v")
    out = d.release(D2, "c")
    assert ("grant", D1, "v", 3, True) in out
    assert not any(isinstance(e, Restore) and e.workload == "v" for e in d.effects)
    v = d.record("v")
    assert (v["parks"], v["restores"]) == (1, 0)


def test_registrant_close_while_parking_finishes_park(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")  # park in flight, its reply pending for D1
    assert d.close(RA) == []
    out = d.park_done()
    assert out == [("released", D1, 1), ("reap", "a", None), ("grant", D2, "b", 2, False)]


def test_releaser_close_while_parking_gets_no_reply(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")
    assert d.close(D1) == []
    assert d.park_done() == [("grant", D2, "b", 2, False)]


def test_unregister_by_registrant(d: Driver) -> None:
    d.acquire(D1, "a")
    d.acquire(D2, "a")
    out = d.unregister(RA, "a")
    assert out == [("ok", RA), ("deny", D2, "Gone"), ("park", "a", "checkpoint")]
    # The holder's turn ended with the registration.
    with pytest.raises(errors.NotHolder):
        d.release(D1, "a")
    # The name may be registered again at once, by another process.
    assert d.register(RA, "a", pid=101) == [("registered", RA, "a", "registered")]


def test_unregister_never_granted_is_forgotten(d: Driver) -> None:
    assert d.unregister(RA, "a") == [("ok", RA)]
    assert [w["name"] for w in d.sm.status()["workloads"]] == ["b", "c"]


# ---- restart: journal and adoption -----------------------------------------------------


def _entries(sm: SlicerState, **measured: tuple[bool, int]) -> list[dict[str, Any]]:
    out = []
    for e in sm.journal():
        alive, resident = measured.get(e["name"], (True, 0))
        out.append({**e, "alive": alive, "resident_bytes": resident})
    return out


def _restart(entries: list[dict[str, Any]]) -> tuple[Driver, list[tuple[Any, ...]]]:
    d = Driver(SlicerState(GPUS))
    for conn in (RA, RB, RC):
        d.connect(conn, uid=USER, pid=900 + conn)
    for conn in (D1, D2, D3):
        d.connect(conn)
    out = d.run(lambda now: d.sm.adopt_journal(entries, now))
    return d, out


def _parked_a_b_idle(d: Driver) -> None:
    d.auto = True
    d.acquire(D1, "a")
    d.acquire(D2, "b")
    d.release(D1, "a")  # a parked, b active
    d.release(D2, "b")  # b idle
    d.auto = False
    assert (d.state("a"), d.state("b"), d.state("c")) == ("parked", "idle", "registered")


def test_new_state_is_dirty_until_journal_adopted() -> None:
    d = Driver(SlicerState(GPUS))
    d.connect(RA, uid=USER)
    d.connect(D1)
    d.register(RA, "a")
    assert d.acquire(D1, "a") == []
    assert d.gpu(0)["dirty"] is True
    out = d.run(lambda now: d.sm.adopt_journal([], now))
    assert out == [("grant", D1, "a", 1, False)]


def test_journal_round_trip_adopts_parked(d: Driver) -> None:
    _parked_a_b_idle(d)
    entries = _entries(d.sm, b=(True, GIB))
    assert {e["name"]: e["state"] for e in entries} == {
        "a": "parked",
        "b": "idle",
        "c": "registered",
    }
    d2, out = _restart(entries)
    # a's checkpointed processes are asked for their real state first (nothing else
    # happens on GPU 0 meanwhile); then b, which still holds memory, is parked; a waits
    # as a parked orphan; c is forgotten.
    assert out == [("recover", "a", "park")]
    assert d2.recover_done() == [("reap", "a", None), ("park", "b", "checkpoint")]
    assert [w.name for w in d2.sm.workloads()] == ["a", "b"]
    assert all(w.detached for w in d2.sm.workloads())
    d2.park_done()
    # Re-register by the same processes adopts the state and counters.
    assert d2.register(RA, "a") == [("registered", RA, "a", "parked")]
    a = d2.record("a")
    assert (a["parks"], a["restores"], a["parked_bytes"]) == (1, 0, MOVED)
    assert a["registrant"] == {"pid": 900 + RA, "uid": USER}
    # And its checkpoint is restored on the next grant.
    assert d2.acquire(D1, "a") == [("restore", "a")]
    (restore,) = d2.restores
    assert (restore.procs, restore.nbytes) == (((PIDS["a"], 1),), MOVED)
    assert d2.restore_done() == [("grant", D1, "a", 1, True)]


def test_journal_reregister_other_process_is_new(d: Driver) -> None:
    _parked_a_b_idle(d)
    d2, _ = _restart(_entries(d.sm))
    d2.recover_done()
    assert d2.register(RA, "a", start_time=2.0) == [("registered", RA, "a", "registered")]
    names = sorted((w.name, w.detached) for w in d2.sm.workloads())
    assert names == [("a", False), ("a", True)]


def test_journal_dead_workload_dropped(d: Driver) -> None:
    _parked_a_b_idle(d)
    d2, out = _restart(_entries(d.sm, a=(False, 0), b=(False, 0)))
    assert out == []
    assert d2.sm.workloads() == []
    assert d2.register(RA, "a") == [("registered", RA, "a", "registered")]


def test_journal_idle_without_memory_dropped(d: Driver) -> None:
    _parked_a_b_idle(d)
    d2, out = _restart(_entries(d.sm, b=(True, 0)))
    assert out == [("recover", "a", "park")]
    assert d2.recover_done() == [("reap", "a", None)]
    assert [w.name for w in d2.sm.workloads()] == ["a"]


def test_journal_faulted_is_reaped_and_blocks_gpu(d: Driver) -> None:
    _fault_a(d)
    entries = _entries(d.sm, a=(True, GIB))
    (a,) = [e for e in entries if e["name"] == "a"]
    assert (a["state"], a["fault_reason"], a["faults"]) == ("faulted", "lock-failed", 1)
    d2, out = _restart(entries)
    assert out == [("reap", "a", KILL_AFTER)]
    d2.register(RB, "b")
    assert d2.acquire(D1, "b") == []
    assert d2.memory_report("a", True, 0) == [("grant", D1, "b", 1, False)]


def test_journal_orphan_parked_dropped_when_dead(d: Driver) -> None:
    _parked_a_b_idle(d)
    d2, _ = _restart(_entries(d.sm, b=(False, 0)))
    d2.recover_done()
    d2.register(RB, "b")
    assert d2.acquire(D1, "b") == [("grant", D1, "b", 1, False)]
    wid = d2.wid("a")
    assert d2.sm.memory_report(wid, True, 0, d2.now) == ([], False)
    fx, done = d2.sm.memory_report(wid, False, 0, d2.now)
    assert done
    assert any(isinstance(e, Persist) for e in fx)
    assert d2.sm.by_wid(wid) is None
    assert d2.sm.memory_report(wid, False, 0, d2.now) == ([], True)


def test_recovered_awake_cooperative_orphan_waits_for_its_launcher() -> None:
    """slicerd cannot park a cooperative workload itself: after a restart a resident one is
    held (GPU taken, nobody granted) until its launcher re-registers, or the grace ends."""
    d = Driver(SlicerState(GPUS))
    for conn in (RA, RB, D1, D2):
        d.connect(conn, uid=USER if conn in (RA, RB) else 0, pid=900 + conn)
    d.run(lambda now: d.sm.adopt_journal([], now))
    d.register(RA, "a", park="cooperative", parked_max=GIB)
    d.register(RB, "b")
    entries = _entries(d.sm, a=(True, 5 * GIB))
    d2, out = _restart(entries)
    assert out == [("recheck", 0), ("recheck", 0)]  # the grace, and the hold's end
    assert d2.state("a") == "idle"
    d2.register(RB, "b")
    assert d2.acquire(D2, "b") == [("recheck", 0)]  # b waits: a is resident and held
    # the launcher comes back in time: a is adopted, still resident, and then parked
    # (verified) for the waiting b like any idle workload
    assert d2.register(RA, "a", park="cooperative", parked_max=GIB) == [
        ("registered", RA, "a", "idle"),
        ("park", "a", "cooperative"),
    ]


def test_recovered_cooperative_orphan_is_parked_after_the_grace() -> None:
    d = Driver(SlicerState(GPUS))
    d.connect(RA, uid=USER, pid=900 + RA)
    d.run(lambda now: d.sm.adopt_journal([], now))
    d.register(RA, "a", park="cooperative", parked_max=GIB)
    d2, _ = _restart(_entries(d.sm, a=(True, 5 * GIB)))
    assert d2.recheck(0) == [("recheck", 0)]  # within the grace: look again at its end
    d2.now += d2.sm.limits.adopt_grace
    assert d2.recheck(0) == [("park", "a", "cooperative")]
