"""The one pure state machine that owns every GPU turn.

Every method is synchronous, takes `now` (monotonic seconds) where time matters, and
returns the effects the server must perform, in order. A refused request raises a
`RequestError` before anything changes. Promotion of the next waiter happens in exactly
one place, `_reconcile`; every other method only frees, queues or records results and
then calls it (llm-d's Yield vs reconcile). See `slicer.model` for the transition table:
every move is checked against it before anything changes, so an illegal one raises
`IllegalTransition` and leaves the machine as it was.

The server only measures and performs effects. What its measurements mean is decided
here, by the rules of `slicer.policy`: it hands in a census of a GPU (`verified`), what it
saw around a park or restore (`park_done`, `restore_done`), the real state of a recovering
workload's processes (`recovery_plan`, `recover_done`), a reaper's reading
(`memory_report`), a new connection's credentials (`connect`).

Around this class, by concept, all pure: `slicer.parking` (its base class: the results of
park ops, the freeze of an early start and the registrant's answers), `slicer.policy` (the
rules, and the choice of the next move on a GPU), `slicer.rescue` (the stages of a
cooperative park nobody did), `slicer.restart` (journal entries out and back in),
`slicer.views` (STATUS and EVENT bodies), `slicer.queueing` (queue and turn bookkeeping of
one GPU), `slicer.opstart` (starting an op on a GPU, and a workload's reaper),
`slicer.records` (`Limits`, `ProcessInfo`, re-exported here).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from gpu_slicer.slicer import early, errors, fit, opstart, policy, preempt, restart, views
from gpu_slicer.slicer.effects import (
    ConnId,
    Deny,
    Effect,
    Grant,
    Persist,
    Recheck,
    Reply,
    SendFault,
    SendPreempted,
)
from gpu_slicer.slicer.model import (
    RESIDENT,
    Conn,
    Gpu,
    Holder,
    OpKind,
    Waiter,
    Workload,
    WState,
)
from gpu_slicer.slicer.parking import ParkResults
from gpu_slicer.slicer.queueing import end_turn, holding, notify_waiting, unqueue
from gpu_slicer.slicer.readings import (
    Census,
    RecoverReport,
    RecoveryReading,
    RestoreReport,
    Unreadable,
)
from gpu_slicer.slicer.records import Limits, ProcessInfo
from gpu_slicer.slicer.views import event

__all__ = ["Limits", "ProcessInfo", "SlicerState"]


class SlicerState(ParkResults):
    """All turn state of one node: GPUs, workloads, queues, turns and faults."""

    def __init__(self, gpus: Iterable[tuple[int, str]], limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.gpus: dict[int, Gpu] = {i: Gpu(index=i, uuid=u) for i, u in gpus}
        self.registered: dict[str, Workload] = {}
        self.orphans: dict[int, Workload] = {}
        self.conns: dict[ConnId, Conn] = {}
        self._turns = itertools.count(1)
        self._ops = itertools.count(1)
        self._wids = itertools.count(1)
        self.totals = {"grants": 0, "parks": 0, "restores": 0, "faults": 0, "preemptions": 0}
        self.totals |= {"freezes": 0, "thaws": 0, "earlies": 0, "wasted_turns": 0}
        self._per_uid: dict[int, int] = {}

    # ---- lookups ---------------------------------------------------------------------

    def resolve_gpu(self, token: str | None) -> int:
        """Map a REGISTER `gpu=` token (index or UUID) to an index, or raise UnknownGpu."""
        if token is None:
            token = "0"
        if token.isdigit() and int(token) in self.gpus:
            return int(token)
        for gpu in self.gpus.values():
            if gpu.uuid == token:
                return gpu.index
        raise errors.UnknownGpu(f"no GPU {token!r} on this node")

    def workloads(self) -> list[Workload]:
        """Every tracked workload: live registrations first, then orphans."""
        return [*self.registered.values(), *self.orphans.values()]

    def by_wid(self, wid: int) -> Workload | None:
        """The workload with internal id `wid`, registered or orphaned."""
        for w in self.workloads():
            if w.wid == wid:
                return w
        return None

    def _on_gpu(self, gpu: Gpu) -> list[Workload]:
        return [w for w in self.workloads() if w.gpu == gpu.index]

    # ---- connections -----------------------------------------------------------------

    def connect(self, conn: ConnId, uid: int, pid: int, trusted: bool = False) -> None:
        """Record a new connection and its peer credentials (`trusted`: its peer is in
        the configured `allow_group`); `LimitReached` when the connection limits refuse
        it (then nothing is recorded)."""
        lim = self.limits
        why = policy.refusal(
            total=len(self.conns),
            of_uid=self._per_uid.get(uid, 0),
            uid=uid,
            exempt=uid == 0 or trusted,
            most=lim.max_connections,
            per_uid=lim.max_connections_per_uid,
            reserved=lim.reserved_connections,
        )
        if why:
            raise errors.LimitReached(why)
        self.conns[conn] = Conn(uid=uid, pid=pid, trusted=trusted)
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1

    def conn_closed(self, conn: ConnId, now: float) -> list[Effect]:
        """A connection closed: drop its wait, end its turn, end its registrations."""
        info = self.conns.get(conn)
        if info is None:
            return []
        ended = [w for w in self.registered.values() if w.registrant == conn]
        for gpu in self.gpus.values():
            if gpu.holder is not None and (gpu.holder.conn == conn or gpu.holder.workload in ended):
                gpu.holder.workload.check(WState.IDLE)  # every turn it ends, before any change
        del self.conns[conn]
        if (left := self._per_uid.get(info.uid, 0) - 1) > 0:
            self._per_uid[info.uid] = left
        else:
            self._per_uid.pop(info.uid, None)
        fx: list[Effect] = []
        touched: set[int] = set()
        if info.waiting_on is not None:
            gpu = self.gpus[info.waiting_on]
            waiter = gpu.queue[conn]
            fx += early.abandon(waiter, now, "closed")
            unqueue(gpu, waiter, self.conns)
            touched.add(gpu.index)
        held = holding(self.gpus.values(), conn)
        if held is not None:
            w = end_turn(held, now, fx, reason="holder-closed")
            # Its state may be dirty: park it before anyone else is granted, and do not
            # trust what the backend sees right now (a wake may still be under way).
            w.must_park = w.holder_died = True
            touched.add(held.index)
        for w in ended:
            touched.add(w.gpu)
            self._end_registration(w, now, fx)
        for gpu in self.gpus.values():
            if gpu.op is not None and gpu.op.reply_conn == conn:
                gpu.op.reply_conn = None
        for w in self.workloads():
            if w.park_reply == conn:
                w.park_reply = None
        fx += self._unanswerable_asks(now)
        for index in sorted(touched):
            fx += self._reconcile(self.gpus[index], now)
        return fx

    # ---- requests --------------------------------------------------------------------

    def register(
        self,
        conn: ConnId,
        name: str,
        gpu_index: int,
        proc: ProcessInfo,
        tree: bool,
        park: str,
        parked_max: int,
        resident_bytes: int,
        now: float,
        fallback: str = "none",
        sharing: Iterable[int] = (),
        ask: bool = False,
        max_turn: float | None = None,
        parker: str = "",
    ) -> list[Effect]:
        """REGISTER: create the workload (or adopt an orphan of the same processes).

        `sharing`: the wids of tracked workloads whose process trees overlap the new one's
        (measured by the server); a process belongs to at most one workload. `parker`:
        why slicerd's parker cannot run ("" when it can): a registration that needs it
        (`policy.parker_needed`) is refused, so that nobody depends on a tool that fails
        at the first park."""
        peer = self.conns[conn]
        # The number the peer sent first: a pod's registrant knows its own numbers.
        named = f"{proc.ns_pid} (pid {proc.pid} to slicerd)" if proc.ns_pid else str(proc.pid)
        if peer.uid != 0 and peer.uid != proc.uid:
            raise errors.Forbidden(f"uid {peer.uid} may not register pid {named}")
        if name in self.registered:
            raise errors.Exists(f"workload {name} is registered by another connection")
        if gpu_index not in self.gpus:
            raise errors.UnknownGpu(f"no GPU {gpu_index}")
        adopt = self._find_orphan(name, proc)
        if adopt is not None and adopt.gpu != gpu_index:
            adopt = None  # the same processes on another GPU: not an adoption, a clash
        locked = adopt is not None and bool(adopt.parked_procs or adopt.frozen_procs)
        if parker and (why := policy.parker_needed(park, fallback, locked)):
            raise errors.NoParker(f"REGISTER {name}: {why} needs slicerd's parker: {parker}")
        taken = [self.by_wid(wid) for wid in sharing if adopt is None or wid != adopt.wid]
        if owners := sorted(w.name for w in taken if w is not None):
            raise errors.InUse(
                f"pid {named} (or a process of its tree) already belongs to workload {owners[0]}"
            )
        if adopt is None and len(self.registered) + len(self.orphans) >= self.limits.max_workloads:
            raise errors.LimitReached(f"at most {self.limits.max_workloads} workloads")
        fx: list[Effect] = []
        if adopt is not None:
            w = self.orphans.pop(adopt.wid)
            w.registrant, w.tree, w.park, w.parked_max = conn, tree, park, parked_max
            w.owner_uid, w.fallback, w.ask = proc.uid, fallback, ask
            w.max_turn = max_turn
            w.ns_pid, w.pidns = proc.ns_pid, proc.pidns
            kind = "adopted"
        else:
            w = Workload(
                wid=next(self._wids),
                name=name,
                gpu=gpu_index,
                pid=proc.pid,
                start_time=proc.start_time,
                tree=tree,
                park=park,
                parked_max=parked_max,
                owner_uid=proc.uid,
                registrant=conn,
                fallback=fallback,
                ask=ask,
                max_turn=max_turn,
                ns_pid=proc.ns_pid,
                pidns=proc.pidns,
            )
            if resident_bytes > parked_max:
                w.to(WState.IDLE)
                others = [
                    x
                    for x in self._on_gpu(self.gpus[gpu_index])
                    if x.state in RESIDENT or x.state is WState.FROZEN
                ]
                # The newcomer is parked at once; whoever was resident first stays.
                w.must_park = bool(others)
            kind = "registered"
        self.registered[name] = w
        fx.append(Reply(conn, {"workload": name, "gpu": str(w.gpu), "state": str(w.state)}))
        fx.append(event(kind, w, now, pid=w.pid))
        fx.append(Persist())
        fx += self._reconcile(self.gpus[w.gpu], now)
        return fx

    def acquire(self, conn: ConnId, name: str, now: float, early_bytes: int = 0) -> list[Effect]:
        """ACQUIRE: queue `conn` for a turn of workload `name` (FIFO per GPU); `early_bytes`
        (``early=``): what it can start with before its grant (`slicer.early`)."""
        peer = self.conns[conn]
        if peer.waiting_on is not None or holding(self.gpus.values(), conn) is not None:
            raise errors.Busy("this connection already holds or waits for a turn")
        w = self.registered.get(name)
        if w is None:
            raise errors.UnknownWorkload(f"no workload {name}")
        if not self._may_use(peer, w):
            raise errors.Forbidden(f"uid {peer.uid} may not use workload {name}")
        if w.state is WState.FAULTED:
            raise errors.Faulted(f"workload {name} is faulted: {w.fault_reason}")
        gpu = self.gpus[w.gpu]
        if len(gpu.queue) >= self.limits.max_queue:
            raise errors.LimitReached(f"at most {self.limits.max_queue} waiters per GPU")
        gpu.queue[conn] = Waiter(conn=conn, workload=w, since=now, early=early_bytes)
        gpu.waiting[w.wid] = gpu.waiting.get(w.wid, 0) + 1
        peer.waiting_on = gpu.index
        fx: list[Effect] = [event("queued", w, now, position=len(gpu.queue))]
        fx += notify_waiting(gpu)
        fx += self._reconcile(gpu, now)
        return fx

    def wait_expired(self, conn: ConnId, now: float) -> list[Effect]:
        """The ACQUIRE `wait=` of `conn` ran out: unqueue it and answer `timeout`."""
        peer = self.conns.get(conn)
        if peer is None or peer.waiting_on is None:
            return []
        gpu = self.gpus[peer.waiting_on]
        waiter = gpu.queue[conn]
        fx: list[Effect] = early.abandon(waiter, now, "wait-expired")
        unqueue(gpu, waiter, self.conns)
        waited = int((now - waiter.since) * 1000)
        fx.append(Deny(conn, errors.Timeout(f"not granted within {waited} ms")))
        return fx + self._reconcile(gpu, now)

    def release(
        self, conn: ConnId, name: str, turn: int, park_now: bool, now: float, used: bool = True
    ) -> list[Effect]:
        """RELEASE: end the turn `conn` holds; park lazily (or now) and promote. `used`
        False: its holder did no work in it, an unused turn; a wasted one when a park or
        restore was paid for its grant (counted per workload, in STATUS and metrics)."""
        gpu = holding(self.gpus.values(), conn)
        holder = gpu.holder if gpu is not None else None
        if gpu is None or holder is None or holder.turn != turn or holder.workload.name != name:
            w = self.registered.get(name)
            if w is not None and w.preempted_turn == turn and turn:
                raise errors.NotHolder(
                    f"turn {turn} of {name} was preempted (held past its max_turn while "
                    "another workload waited); ACQUIRE again"
                )
            raise errors.NotHolder(f"this connection does not hold turn {turn} of {name}")
        fx: list[Effect] = []
        wasted = not used and holder.paid
        w = end_turn(gpu, now, fx, reason="released", used=used, wasted=wasted)
        w.unused_turns += not used
        w.wasted_turns += wasted
        self.totals["wasted_turns"] += wasted
        w.must_park = park_now
        w.park_reply = conn
        fx += self._reconcile(gpu, now)
        if w.park_reply == conn and not w.must_park:
            # No park started for it: it stays resident and idle (lazy park).
            w.park_reply = None
            fx.append(Reply(conn, {"parked": "0", "park_ms": "0"}))
        return fx

    def unregister(self, conn: ConnId, name: str, now: float) -> list[Effect]:
        """UNREGISTER from the registrant: same effect as the registrant's close."""
        w = self.registered.get(name)
        if w is None:
            raise errors.UnknownWorkload(f"no workload {name}")
        if w.registrant != conn:
            raise errors.NotRegistrant(f"only the registrant may unregister {name}")
        fx: list[Effect] = [Reply(conn)]
        self._end_registration(w, now, fx)
        fx += self._unanswerable_asks(now)
        return fx + self._reconcile(self.gpus[w.gpu], now)

    # ---- results of effects ----------------------------------------------------------

    def recovery_plan(self, op_id: int, reading: RecoveryReading) -> policy.RecoveryPlan:
        """The cuda-checkpoint steps that finish or roll back recovery op `op_id`, from
        `reading` (`policy.plan_recovery`); asking changes nothing."""
        found = opstart.running(self.gpus.values(), op_id, OpKind.RECOVER)
        if found is None:
            return policy.RecoveryPlan()
        return policy.plan_recovery(str(found[1].workload.recover), reading)

    def recover_done(self, op_id: int, report: RecoverReport, now: float) -> list[Effect]:
        """A Recover effect finished. From `report` (the reading its plan was made from,
        how the plan's steps went, the bytes left on the device) the workload is judged
        (`policy.judge_recovery`): "parked" (its processes are checkpointed), "resident"
        (they run, memory on the device), "gone" (no process of it lives) or "fault" (the
        driver reports a failure, a tool never ended, or memory stayed)."""
        if (found := opstart.running(self.gpus.values(), op_id, OpKind.RECOVER)) is None:
            return []
        gpu, op = found
        w = op.workload
        intent = str(w.recover)
        judged = policy.judge_recovery(intent, report, gpu.index, w.parked_max)
        result, procs, reason, text = judged.result, judged.procs, judged.reason, judged.text
        target = {"parked": WState.PARKED, "gone": WState.PARKED, "resident": WState.IDLE}
        to = target.get(result, WState.FAULTED)
        if not (to is WState.PARKED and w.state is WState.PARKED):  # a parked one may stay
            w.check(to)
        gpu.op = None
        w.recover = None
        if result == "resident" and w.early:
            # The park of an abandoned early start never ran: still dirty (`slicer.early`).
            w.must_park = w.holder_died = True
        else:
            w.early = 0
        nbytes = w.op_bytes if intent == "park" and w.op_bytes else w.parked_bytes
        w.op_procs, w.op_bytes = (), 0
        fx: list[Effect] = []
        if result in ("parked", "gone"):
            if w.state is not WState.PARKED:
                w.to(WState.PARKED)
            w.parked_procs, w.parked_bytes = procs, nbytes if procs else 0
        elif result == "resident":
            w.to(WState.IDLE)
            w.parked_procs, w.parked_bytes = (), 0
            if w.detached and w.park == "cooperative":
                w.hold_until = now + self.limits.adopt_grace
                fx.append(Recheck(w.gpu, self.limits.adopt_grace))
        else:
            fx += self._fault(w, reason, text or f"recovery failed: {reason}", now)
        fx += [event("recovered", w, now, intent=intent, result=result), Persist()]
        if w.detached and w.state is WState.PARKED:
            fx.append(opstart.reap(w, None, now))
        return fx + self._reconcile(gpu, now)

    def restore_done(self, op_id: int, report: RestoreReport, now: float) -> list[Effect]:
        """A Restore effect finished; `report` is what the server saw. Whether it held is
        decided here (`policy.judge_restore`). A restored workload is idle until
        `_reconcile` grants it to the waiter it was restored for (if still there)."""
        if (found := opstart.running(self.gpus.values(), op_id, OpKind.RESTORE)) is None:
            return []
        gpu, op = found
        w = op.workload
        out = policy.judge_restore(report)
        reason, text = out.reason, out.text
        ending = not out.ok and reason == policy.GONE
        w.check(WState.IDLE if out.ok else WState.PARKED if ending else WState.FAULTED)
        gpu.op = None
        fx: list[Effect] = []
        if ending:
            # Every process of it exited (a pod's containers are stopped in no order):
            # nothing of it is on the GPU or anywhere to restore from. Its waiters are
            # denied, its closing connection unregisters it, the next waiter is served.
            waiters = [x for x in gpu.queue.values() if x.workload is w]
            for waiter in waiters:
                unqueue(gpu, waiter, self.conns)
            w.to(WState.PARKED)
            w.parked_procs, w.parked_bytes, w.frozen_procs = (), 0, ()
            fx += [Persist(), event("gone", w, now, restore_ms=report.ms)]
            for waiter in waiters:
                fx.append(Deny(waiter.conn, errors.Gone(f"workload {w.name}: {text}")))
            if w.detached:  # unregistered during the restore: its reaper forgets it
                fx.append(opstart.reap(w, None, now))
            return fx + self._reconcile(gpu, now)
        if not out.ok:
            waiters = [x for x in gpu.queue.values() if x.workload is w]
            for waiter in waiters:
                unqueue(gpu, waiter, self.conns)
            fx += self._fault(w, reason, text or f"restore failed: {reason}", now)
            for waiter in waiters:
                fx.append(Deny(waiter.conn, errors.RestoreFailed(f"{w.name}: {reason}")))
            return fx + self._reconcile(gpu, now)
        w.to(WState.IDLE)
        if w.frozen_procs:  # a thaw: unlocked, its memory never left
            w.frozen_procs = ()
            self.totals["thaws"] += 1
            fx += [Persist(lazy=True), event("thawed", w, now, thaw_ms=report.ms)]
            return fx + self._reconcile(gpu, now, verified=w)
        w.restores += 1
        self.totals["restores"] += 1
        w.last_restore_ms, w.parked_bytes, w.parked_procs = report.ms, 0, ()
        # Lazy: the restore intent on disk leads recovery to the same end (all running).
        fx += [Persist(lazy=True), event("restored", w, now, restore_ms=report.ms)]
        # Verified before the restore began: granted without another look, as restored
        # (the grant says so also when something crowding the GPU is parked first).
        head = gpu.head()
        w.restored = head is not None and head.workload is w
        return fx + self._reconcile(gpu, now, verified=w)

    def verified(
        self, op_id: int, seen: Census | Unreadable, now: float, free: int | None = None
    ) -> list[Effect]:
        """A Verify effect finished: `seen` is the census of the GPU (or why it could not
        be read), `free` its free bytes (read when the Verify asked for room). What blocks
        the grant is decided here (`policy.blockers`) and shown in STATUS until clean."""
        if (found := opstart.running(self.gpus.values(), op_id, OpKind.VERIFY)) is None:
            return []
        gpu, op = found
        block = policy.blockers(
            seen,
            op.workload.wid,
            self._on_gpu(gpu),
            need=op.need,
            free=free,
            foreign_blocks=self.limits.foreign_blocks,
        )
        frozen = [w for w in self._on_gpu(gpu) if w.state is WState.FROZEN]
        frozen = [w for w in frozen if w is not op.workload]
        if block and frozen and all(b.get("reason") == "no-room" for b in block):
            # No room beside a frozen one: park it (checkpoint) first (`slicer.fit`).
            gpu.op, gpu.foreign = None, []
            return self._make(gpu, policy.Move("park", frozen[0]), now)
        if block:
            gpu.op, gpu.foreign = None, block
            return [Recheck(gpu.index, self.limits.recheck_every)]
        move = policy.next_move(gpu, self._on_gpu(gpu), now, op.workload, answering=op)
        if move is not None:
            move.check()  # before the op is taken: an illegal move changes nothing
        gpu.op, gpu.foreign = None, []
        return self._make(gpu, move, now) if move is not None else []

    def recheck(self, gpu_index: int, now: float) -> list[Effect]:
        """Try again to promote on a GPU that was blocked by foreign memory."""
        return self._reconcile(self.gpus[gpu_index], now)

    def memory_report(
        self,
        wid: int,
        alive: bool,
        nbytes: int | None,
        now: float,
        holders: tuple[int, ...] = (),
        survivors: tuple[int, ...] = (),
    ) -> tuple[list[Effect], bool]:
        """The reaper's view of a faulted or orphaned workload's processes: whether its
        registered process lives, its device bytes (None: unreadable, which keeps the GPU
        taken), the pids holding them and, once its registered process is dead, the
        `survivors`: processes once of its tree that still live (started in a session of
        their own, reparented when it died). An orphan's survivors are killed
        `fault_kill_after` after they are first reported (nobody is left to park,
        restore or stop them), and it is forgotten only once they are gone.

        Returns the effects and whether the reaper may stop: it stops once the record is
        gone, and the record is dropped (then the GPU promotes) once the registration
        ended and the processes are dead or, when faulted, hold no GPU memory. A faulted
        workload's GPU processes are killed once its `fault_kill_after` has passed
        (`policy.kill_due`).
        """
        w = self.orphans.get(wid)
        if w is None:
            # Registered (again): a reaper of a faulted one goes on (its kill deadline);
            # any other stops, and a new one starts if the registration ends again.
            live = self.by_wid(wid)
            if live is None or live.state is not WState.FAULTED:
                return [], True
            return opstart.kill_if_due(live, alive, holders, now), False
        if not alive and survivors and w.state in (WState.FAULTED, WState.PARKED, WState.IDLE):
            return opstart.kill_survivors(w, survivors, self.limits.fault_kill_after, now), False
        gone = not alive or (w.state is WState.FAULTED and nbytes == 0)
        if w.state not in (WState.FAULTED, WState.PARKED) or not gone:
            return opstart.kill_if_due(w, alive, holders, now), False
        del self.orphans[wid]
        fx: list[Effect] = [event("forgotten", w, now), Persist()]
        return fx + self._reconcile(self.gpus[w.gpu], now), True

    def gpu_pids_seen(self, wid: int, pids: list[int], now: float) -> list[Effect]:
        """The census learned a process of workload `wid`'s tree that holds GPU memory:
        `pids` are all those it knows alive (STATUS `gpu_pids`), which stay the
        workload's if its registered process dies (`memory_report`). WATCH `gpu-pids`."""
        w = self.by_wid(wid)
        if w is None:
            return []
        return [event("gpu-pids", w, now, pids=pids)]

    # ---- restart ---------------------------------------------------------------------

    def adopt_journal(self, entries: list[dict[str, Any]], now: float) -> list[Effect]:
        """Load journaled workloads whose processes still live, as orphans awaiting a
        re-REGISTER (`restart.resumed` decides each one's state); then mark every GPU
        clean and promote.

        Each entry carries the server's fresh measurement: `alive` and `resident_bytes`
        (None when the GPU could not be read: unknown memory counts as resident, so it is
        parked before any grant).
        """
        fx: list[Effect] = []
        for e in entries:
            if int(e["gpu"]) not in self.gpus:
                continue
            back = restart.resumed(e, next(self._wids))
            if back is None:
                continue
            w = back.workload
            if back.then in ("reap", "reap-kill"):
                kill_after = self.limits.fault_kill_after if back.then == "reap-kill" else None
                fx.append(opstart.reap(w, kill_after, now))
            elif back.then == "hold":
                w.hold_until = now + self.limits.adopt_grace
                fx.append(Recheck(w.gpu, self.limits.adopt_grace))
            self.orphans[w.wid] = w
            fx.append(event("recovered", w, now))
        for gpu in self.gpus.values():
            gpu.dirty = False
        fx.append(Persist())
        for gpu in self.gpus.values():
            fx += self._reconcile(gpu, now)
        return fx

    def journal(self) -> list[dict[str, Any]]:
        """What a restarted daemon needs to know: every tracked workload's processes."""
        return restart.journal_entries(self.workloads())

    def status(self) -> dict[str, Any]:
        """The GPUs, workloads and totals, as STATUS reports them (the server adds pids,
        version and uptime)."""
        return views.status_body(self.gpus.values(), self.workloads(), self.conns, self.totals)

    # ---- internals -------------------------------------------------------------------

    def _may_use(self, peer: Conn, w: Workload) -> bool:
        # Root, the allowed group, the processes' owner, or the uid that registered it.
        if peer.uid == 0 or peer.trusted or peer.uid == w.owner_uid:
            return True
        registrant = self.conns.get(w.registrant) if w.registrant is not None else None
        return registrant is not None and registrant.uid == peer.uid

    def _find_orphan(self, name: str, proc: ProcessInfo) -> Workload | None:
        for w in self.orphans.values():
            if w.name == name and w.pid == proc.pid and w.start_time == proc.start_time:
                return w
        return None

    def _end_registration(self, w: Workload, now: float, fx: list[Effect]) -> None:
        gpu = self.gpus[w.gpu]
        if gpu.holder is not None and gpu.holder.workload is w:
            w.check(WState.IDLE)  # its turn ends too: checked before anything changes
        for waiter in [x for x in gpu.queue.values() if x.workload is w]:
            fx += early.abandon(waiter, now, "unregistered")
            unqueue(gpu, waiter, self.conns)
            fx.append(Deny(waiter.conn, errors.Gone(f"workload {w.name} was unregistered")))
        if gpu.holder is not None and gpu.holder.workload is w:
            end_turn(gpu, now, fx, reason="unregistered")
        del self.registered[w.name]
        w.registrant = None
        fx.append(event("unregistered", w, now))
        fx.append(Persist())
        if w.state is WState.REGISTERED:
            return
        self.orphans[w.wid] = w
        if w.state is WState.PARKED:
            fx.append(opstart.reap(w, None, now))
        # IDLE and FROZEN orphans are parked by _reconcile; PARKING/RESTORING finish
        # first; a FAULTED one already has its reaper.

    def _fault(self, w: Workload, reason: str, text: str, now: float) -> list[Effect]:
        w.to(WState.FAULTED)
        w.faults += 1
        w.fault_reason = reason
        self.totals["faults"] += 1
        fx: list[Effect] = [event("fault", w, now, reason=reason), Persist()]
        if w.registrant is not None:
            fx.append(SendFault(w.registrant, w.name, w.last_turn, reason, text))
        gpu = self.gpus[w.gpu]
        for waiter in [x for x in gpu.queue.values() if x.workload is w]:
            unqueue(gpu, waiter, self.conns)
            fx.append(Deny(waiter.conn, errors.Faulted(f"workload {w.name} faulted: {reason}")))
        fx.append(opstart.reap(w, self.limits.fault_kill_after, now))
        return fx

    def _grant(self, gpu: Gpu, waiter: Waiter, now: float) -> list[Effect]:
        w = waiter.workload
        # Parked (it restores itself, cooperative) or restored for this waiter by us.
        restored = w.state is WState.PARKED or w.restored
        w.to(WState.ACTIVE)
        w.restored = False
        # Granted after an early start: the journal's record of it goes (lazily: a crash
        # before that write parks the replica once, needlessly, never wrongly).
        told, w.early = w.early, 0
        unqueue(gpu, waiter, self.conns)
        turn = next(self._turns)
        w.turn = w.last_turn = turn
        w.grants += 1
        gpu.grants += 1
        self.totals["grants"] += 1
        paid, gpu.parked_since_grant = restored or gpu.parked_since_grant, False
        gpu.holder = Holder(conn=waiter.conn, workload=w, turn=turn, since=now, paid=paid)
        gpu.waiting_sent = False
        waited = max(0, int((now - waiter.since) * 1000))
        fx: list[Effect] = [
            Grant(waiter.conn, w.name, turn, restored, waited),
            event("granted", w, now, waited_ms=waited, restored=restored),
        ]
        if told:
            fx.append(Persist(lazy=True))
        return fx + notify_waiting(gpu)

    def _reconcile(self, gpu: Gpu, now: float, verified: Workload | None = None) -> list[Effect]:
        """The one place that parks for, restores for and grants to the queue head (after
        settling a recovering workload). It decides (`_decide`, which changes nothing),
        checks the move against the transition table, then makes it. `verified`: the
        backend was just read (or a restore just ended) for that workload."""
        fx: list[Effect] = []
        left = preempt.due_in(gpu, now)
        if left is not None and left <= 0 and gpu.op is None:
            fx += self._preempt(gpu, now)
        elif left is not None and gpu.op is None:
            fx.append(Recheck(gpu.index, max(left, 0.01)))  # look again when it is due
        # (With an op in flight its end reconciles, and preempts then if due.)
        move = policy.next_move(gpu, self._on_gpu(gpu), now, verified)
        return fx + (self._make(gpu, move, now) if move is not None else [])

    def _preempt(self, gpu: Gpu, now: float) -> list[Effect]:
        # The turn ends as a RELEASE park=now would end it; the park that follows is a
        # checkpoint park like any other (`slicer.preempt`).
        holder = gpu.holder
        assert holder is not None
        w = holder.workload
        w.check(WState.IDLE)
        fx: list[Effect] = []
        held_ms = int((now - holder.since) * 1000)
        end_turn(gpu, now, fx, reason="preempted")
        w.must_park = True
        w.preemptions += 1
        w.preempted_turn = holder.turn
        self.totals["preemptions"] += 1
        fx.append(SendPreempted(holder.conn, w.name, holder.turn))
        what = {"turn_ended": holder.turn, "held_ms": held_ms, "max_turn": w.max_turn}
        fx.append(event("preempted", w, now, **what))
        return fx

    def _make(self, gpu: Gpu, move: policy.Move, now: float) -> list[Effect]:
        move.check()
        w = move.w
        if w is None:
            return [Recheck(gpu.index, move.delay)]
        match move.kind:
            case "recover":
                return opstart.start_recover(gpu, w, next(self._ops), now)
            case "park":
                timeout = self.limits.registrant_park_timeout
                need, for_early = fit.freeze_need(self.limits, gpu, w), None
                if need is None and (start := early.wanted(self.limits, gpu, w, self._on_gpu(gpu))):
                    need, for_early = start  # (bytes, the head's Waiter)
                asker = self._asker(w)
                op_id = next(self._ops)
                return opstart.start_park(gpu, w, op_id, asker, timeout, now, need, for_early)
            case "thaw":
                return opstart.start_thaw(gpu, w, next(self._ops), now)
            case "verify":
                return opstart.start_verify(gpu, w, next(self._ops))
            case "restore":
                return opstart.start_restore(gpu, w, next(self._ops), now)
        assert move.waiter is not None
        return self._grant(gpu, move.waiter, now)
