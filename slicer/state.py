"""The one pure state machine that owns every GPU turn.

Every method is synchronous, takes `now` (monotonic seconds) where time matters, and
returns the effects the server must perform, in order. A refused request raises a
`RequestError` before anything changes. Promotion of the next waiter happens in exactly
one place, `_reconcile`; every other method only frees, queues or records results and
then calls it (llm-d's Yield vs reconcile). See `slicer.model` for the transition table.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpu_slicer.slicer import errors
from gpu_slicer.slicer.effects import (
    AskPark,
    ConnId,
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
    SendFault,
    SendWaiting,
    Verify,
)
from gpu_slicer.slicer.model import (
    RESIDENT,
    Conn,
    Gpu,
    Holder,
    Ident,
    Op,
    OpKind,
    ParkStage,
    Waiter,
    Workload,
    WState,
)


@dataclass(frozen=True)
class Limits:
    """Bounds the state machine enforces (each refusal is `LimitReached`)."""

    max_workloads: int = 256
    max_queue: int = 4096
    fault_kill_after: float = 60.0
    recheck_every: float = 0.5
    adopt_grace: float = 60.0
    registrant_park_timeout: float = 60.0


@dataclass(frozen=True)
class ProcessInfo:
    """What the server learned of a registering process (pid, start time, owner)."""

    pid: int
    start_time: float
    uid: int


def _idents(raw: Any) -> tuple[Ident, ...]:
    """Journaled [[pid, start], ...] as idents (anything malformed is skipped)."""
    out: list[Ident] = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, list) and len(item) == 2:
            out.append((int(item[0]), int(item[1])))
    return tuple(out)


class SlicerState:
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
        self.totals = {"grants": 0, "parks": 0, "restores": 0, "faults": 0}

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

    def _holding(self, conn: ConnId) -> Gpu | None:
        for gpu in self.gpus.values():
            if gpu.holder is not None and gpu.holder.conn == conn:
                return gpu
        return None

    # ---- connections -----------------------------------------------------------------

    def connect(self, conn: ConnId, uid: int, pid: int, trusted: bool = False) -> None:
        """Record a new connection and its peer credentials (`trusted`: its peer is in
        the configured `allow_group`)."""
        self.conns[conn] = Conn(uid=uid, pid=pid, trusted=trusted)

    def conn_closed(self, conn: ConnId, now: float) -> list[Effect]:
        """A connection closed: drop its wait, end its turn, end its registrations."""
        info = self.conns.pop(conn, None)
        if info is None:
            return []
        fx: list[Effect] = []
        touched: set[int] = set()
        if info.waiting_on is not None:
            gpu = self.gpus[info.waiting_on]
            self._unqueue(gpu, gpu.queue[conn])
            touched.add(gpu.index)
        held = self._holding(conn)
        if held is not None:
            w = self._end_turn(held, now, fx, reason="holder-closed")
            # Its state may be dirty: park it before anyone else is granted, and do not
            # trust what the backend sees right now (a wake may still be under way).
            w.must_park = w.holder_died = True
            touched.add(held.index)
        for w in [w for w in self.registered.values() if w.registrant == conn]:
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
    ) -> list[Effect]:
        """REGISTER: create the workload (or adopt an orphan of the same processes).

        `sharing`: the wids of tracked workloads whose process trees overlap the new one's
        (measured by the server); a process belongs to at most one workload."""
        peer = self.conns[conn]
        if peer.uid != 0 and peer.uid != proc.uid:
            raise errors.Forbidden(f"uid {peer.uid} may not register pid {proc.pid}")
        if name in self.registered:
            raise errors.Exists(f"workload {name} is registered by another connection")
        if gpu_index not in self.gpus:
            raise errors.UnknownGpu(f"no GPU {gpu_index}")
        adopt = self._find_orphan(name, proc)
        if adopt is not None and adopt.gpu != gpu_index:
            adopt = None  # the same processes on another GPU: not an adoption, a clash
        taken = [self.by_wid(wid) for wid in sharing if adopt is None or wid != adopt.wid]
        if owners := sorted(w.name for w in taken if w is not None):
            raise errors.InUse(
                f"pid {proc.pid} (or a process of its tree) already belongs to workload {owners[0]}"
            )
        if adopt is None and len(self.registered) + len(self.orphans) >= self.limits.max_workloads:
            raise errors.LimitReached(f"at most {self.limits.max_workloads} workloads")
        fx: list[Effect] = []
        if adopt is not None:
            w = self.orphans.pop(adopt.wid)
            w.registrant, w.tree, w.park, w.parked_max = conn, tree, park, parked_max
            w.owner_uid, w.fallback, w.ask = proc.uid, fallback, ask
            event = "adopted"
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
            )
            if resident_bytes > parked_max:
                w.to(WState.IDLE)
                others = [x for x in self._on_gpu(self.gpus[gpu_index]) if x.state in RESIDENT]
                # The newcomer is parked at once; whoever was resident first stays.
                w.must_park = bool(others)
            event = "registered"
        self.registered[name] = w
        fx.append(Reply(conn, {"workload": name, "gpu": str(w.gpu), "state": str(w.state)}))
        fx.append(self._event(event, w, now, pid=w.pid))
        fx.append(Persist())
        fx += self._reconcile(self.gpus[w.gpu], now)
        return fx

    def acquire(self, conn: ConnId, name: str, now: float) -> list[Effect]:
        """ACQUIRE: queue `conn` for a turn of workload `name` (FIFO per GPU)."""
        peer = self.conns[conn]
        if peer.waiting_on is not None or self._holding(conn) is not None:
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
        gpu.queue[conn] = Waiter(conn=conn, workload=w, since=now)
        gpu.waiting[w.wid] = gpu.waiting.get(w.wid, 0) + 1
        peer.waiting_on = gpu.index
        fx: list[Effect] = [self._event("queued", w, now, position=len(gpu.queue))]
        fx += self._notify_waiting(gpu)
        fx += self._reconcile(gpu, now)
        return fx

    def wait_expired(self, conn: ConnId, now: float) -> list[Effect]:
        """The ACQUIRE `wait=` of `conn` ran out: unqueue it and answer `timeout`."""
        peer = self.conns.get(conn)
        if peer is None or peer.waiting_on is None:
            return []
        gpu = self.gpus[peer.waiting_on]
        waiter = gpu.queue[conn]
        self._unqueue(gpu, waiter)
        waited = int((now - waiter.since) * 1000)
        fx: list[Effect] = [Deny(conn, errors.Timeout(f"not granted within {waited} ms"))]
        return fx + self._reconcile(gpu, now)

    def release(
        self, conn: ConnId, name: str, turn: int, park_now: bool, now: float
    ) -> list[Effect]:
        """RELEASE: end the turn `conn` holds; park lazily (or now) and promote."""
        gpu = self._holding(conn)
        holder = gpu.holder if gpu is not None else None
        if gpu is None or holder is None or holder.turn != turn or holder.workload.name != name:
            raise errors.NotHolder(f"this connection does not hold turn {turn} of {name}")
        fx: list[Effect] = []
        w = self._end_turn(gpu, now, fx, reason="released")
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

    def _take_op(self, op_id: int, kind: OpKind) -> tuple[Gpu, Op] | None:
        for gpu in self.gpus.values():
            if gpu.op is not None and gpu.op.op_id == op_id and gpu.op.kind is kind:
                op, gpu.op = gpu.op, None
                return gpu, op
        return None

    def park_started(self, op_id: int, procs: tuple[Ident, ...], nbytes: int) -> list[Effect]:
        """The server is about to run cuda-checkpoint on `procs` (holding `nbytes`) for
        park `op_id`: journal them first, so that a restart knows whom to ask."""
        gpu = self.gpus.get(self._op_gpu(op_id, OpKind.PARK), None)
        if gpu is None or gpu.op is None:
            return []
        w = gpu.op.workload
        w.op_procs, w.op_bytes = procs, nbytes
        return [Persist()]

    def park_deferred(self, op_id: int, why: str, now: float) -> list[Effect]:
        """The processes of park `op_id` could not be journaled (full disk): the tool
        must not run (a crash would leave checkpointed processes nobody knows of). The
        workload stays resident and must park; the GPU stays taken until it can."""
        index = self._op_gpu(op_id, OpKind.PARK)
        if index < 0:
            return []
        gpu = self.gpus[index]
        assert gpu.op is not None
        op, gpu.op = gpu.op, None
        w = op.workload
        w.to(WState.IDLE)
        w.op_procs, w.op_bytes = (), 0
        w.must_park, w.park_reply = True, op.reply_conn
        return [
            self._event("park-deferred", w, now, reason=why),
            Recheck(gpu.index, self.limits.recheck_every),
        ]

    def _op_gpu(self, op_id: int, kind: OpKind) -> int:
        for gpu in self.gpus.values():
            if gpu.op is not None and gpu.op.op_id == op_id and gpu.op.kind is kind:
                return gpu.index
        return -1

    def park_done(
        self,
        op_id: int,
        ok: bool,
        ms: int,
        moved: int,
        procs: tuple[Ident, ...],
        reason: str,
        text: str,
        now: float,
    ) -> list[Effect]:
        """A Park effect finished (verified through the backend when `ok`); `procs` are
        the processes checkpointed, which a restore must bring back."""
        index = self._op_gpu(op_id, OpKind.PARK)
        if index < 0:
            return []
        gpu = self.gpus[index]
        assert gpu.op is not None
        op = gpu.op
        if not ok and op.workload.park == "cooperative" and op.stage is not ParkStage.CHECKPOINT:
            # A cooperative workload nobody parked: ask its registrant, then fall back.
            return self._cooperative_next(op, reason, text, now)
        gpu.op = None
        w = op.workload
        w.op_procs, w.op_bytes = (), 0
        fx: list[Effect] = []
        if ok:
            w.to(WState.PARKED)
            w.parks += 1
            self.totals["parks"] += 1
            w.last_park_ms, w.parked_bytes, w.parked_procs = ms, moved, procs
            how = "checkpoint" if procs else "cooperative"
            fx += [self._event("parked", w, now, park_ms=ms, bytes=moved, how=how), Persist()]
            if op.reply_conn is not None:
                fx.append(Reply(op.reply_conn, {"parked": "1", "park_ms": str(ms)}))
            if w.detached:
                fx.append(self._reap(w, kill_after=None))
        else:
            fx += self._fault(w, reason, text or f"park failed: {reason}", now)
            if op.reply_conn is not None:
                fx.append(Deny(op.reply_conn, errors.ParkFailed(f"park of {w.name}: {reason}")))
        return fx + self._reconcile(gpu, now)

    def _cooperative_next(self, op: Op, reason: str, text: str, now: float) -> list[Effect]:
        # The op stays on the GPU through its stages: nobody is granted meanwhile.
        w = op.workload
        if op.stage is ParkStage.VERIFY and (asked := self._ask(op, now, reason)) is not None:
            return asked
        if w.fallback == "checkpoint":
            return self._checkpoint_fallback(op, now, reason)
        gpu = self.gpus[w.gpu]
        gpu.op = None
        fx = self._fault(w, reason, text or f"park failed: {reason}", now)
        if op.reply_conn is not None:
            fx.append(Deny(op.reply_conn, errors.ParkFailed(f"park of {w.name}: {reason}")))
        return fx + self._reconcile(gpu, now)

    def _unanswerable_asks(self, now: float) -> list[Effect]:
        # A PARK whose workload lost its registrant: nobody is left to answer it.
        fx: list[Effect] = []
        for gpu in self.gpus.values():
            op = gpu.op
            if op is not None and op.stage is ParkStage.ASK and op.workload.detached:
                fx += self._after_ask(op, False, now)
        return fx

    def _ask(self, op: Op, now: float, reason: str) -> list[Effect] | None:
        w = op.workload
        asker = w.registrant if w.ask and w.registrant in self.conns else None
        if asker is None:
            return None
        op.stage = ParkStage.ASK
        timeout = self.limits.registrant_park_timeout
        return [
            self._event("park-asked", w, now, reason=reason, timeout_s=timeout),
            AskPark(op.op_id, asker, w.name, w.last_turn, timeout),
        ]

    def _checkpoint_fallback(self, op: Op, now: float, reason: str) -> list[Effect]:
        w = op.workload
        op.stage = ParkStage.CHECKPOINT
        return [
            self._event("park-fallback", w, now, reason=reason),
            Park(op.op_id, w.wid, w.name, w.gpu, "checkpoint", w.parked_max),
        ]

    def _after_ask(self, op: Op, answered: bool, now: float) -> list[Effect]:
        # A confirmed park is verified through the backend. Without a confirmation the
        # workload may be mid-transition (a wake its dead holder left in flight): where
        # allowed, cuda-checkpoint it, since a locked process runs no CUDA work whatever
        # it was doing; else the backend alone decides.
        w = op.workload
        if not answered and w.fallback == "checkpoint":
            return self._checkpoint_fallback(op, now, "not-parked-by-registrant")
        op.stage = ParkStage.REVERIFY
        return [Park(op.op_id, w.wid, w.name, w.gpu, "cooperative", w.parked_max)]

    def parked_answer(
        self, conn: ConnId, name: str, turn: int, ok: bool, now: float
    ) -> list[Effect]:
        """PARKED from the registrant: it parked its workload (or, `ok` False, could not)
        after a PARK; the backend verifies it either way."""
        w = self.registered.get(name)
        if w is None:
            raise errors.UnknownWorkload(f"no workload {name}")
        if w.registrant != conn:
            raise errors.NotRegistrant(f"only the registrant of {name} answers its PARK")
        op = self.gpus[w.gpu].op
        if (
            op is None
            or op.kind is not OpKind.PARK
            or op.workload is not w
            or op.stage is not ParkStage.ASK
            or turn != w.last_turn
        ):
            raise errors.NotAsked(f"no PARK of {name} turn={turn} is pending")
        fx: list[Effect] = [Reply(conn), self._event("park-answered", w, now, ok=ok)]
        return fx + self._after_ask(op, ok, now)

    def ask_expired(self, op_id: int, now: float) -> list[Effect]:
        """The registrant did not answer the PARK of op `op_id` in time."""
        index = self._op_gpu(op_id, OpKind.PARK)
        op = self.gpus[index].op if index >= 0 else None
        if op is None or op.stage is not ParkStage.ASK:
            return []
        return [self._event("park-ask-expired", op.workload, now), *self._after_ask(op, False, now)]

    def recover_done(
        self,
        op_id: int,
        result: str,
        procs: tuple[Ident, ...],
        reason: str,
        text: str,
        now: float,
    ) -> list[Effect]:
        """A Recover effect finished: `result` is "parked" (`procs` are checkpointed),
        "resident" (the processes run, memory on the device), "gone" (no process of it
        lives) or "fault" (the driver reports a failure, or a tool never ended)."""
        taken = self._take_op(op_id, OpKind.RECOVER)
        if taken is None:
            return []
        gpu, op = taken
        w = op.workload
        intent, w.recover = w.recover, None
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
        fx += [self._event("recovered", w, now, intent=intent, result=result), Persist()]
        if w.detached and w.state is WState.PARKED:
            fx.append(self._reap(w, kill_after=None))
        return fx + self._reconcile(gpu, now)

    def restore_done(
        self, op_id: int, ok: bool, ms: int, reason: str, text: str, now: float
    ) -> list[Effect]:
        """A Restore effect finished."""
        taken = self._take_op(op_id, OpKind.RESTORE)
        if taken is None:
            return []
        gpu, op = taken
        w = op.workload
        fx: list[Effect] = []
        if not ok:
            waiters = [x for x in gpu.queue.values() if x.workload is w]
            for waiter in waiters:
                self._unqueue(gpu, waiter)
            fx += self._fault(w, reason, text or f"restore failed: {reason}", now)
            for waiter in waiters:
                fx.append(Deny(waiter.conn, errors.RestoreFailed(f"{w.name}: {reason}")))
            return fx + self._reconcile(gpu, now)
        w.restores += 1
        self.totals["restores"] += 1
        w.last_restore_ms, w.parked_bytes, w.parked_procs = ms, 0, ()
        fx.append(Persist())
        head = gpu.head()
        if head is not None and head.workload is w and gpu.holder is None:
            granted = self._grant(gpu, head, restored=True, now=now)
            return [*fx, self._event("restored", w, now, restore_ms=ms), *granted]
        w.to(WState.IDLE)
        fx.append(self._event("restored", w, now, restore_ms=ms))
        return fx + self._reconcile(gpu, now)

    def verified(self, op_id: int, blockers: list[dict[str, Any]], now: float) -> list[Effect]:
        """A Verify effect finished; `blockers` lists what else holds the GPU (or room)."""
        taken = self._take_op(op_id, OpKind.VERIFY)
        if taken is None:
            return []
        gpu, op = taken
        if blockers:
            gpu.foreign = blockers
            return [Recheck(gpu.index, self.limits.recheck_every)]
        gpu.foreign = []
        return self._reconcile(gpu, now, verified=op.workload)

    def recheck(self, gpu_index: int, now: float) -> list[Effect]:
        """Try again to promote on a GPU that was blocked by foreign memory."""
        return self._reconcile(self.gpus[gpu_index], now)

    def memory_report(
        self, wid: int, alive: bool, nbytes: int, now: float
    ) -> tuple[list[Effect], bool]:
        """The reaper's view of a faulted or orphaned workload's processes.

        Returns the effects and whether the reaper may stop: it stops once the record is
        gone, and the record is dropped (then the GPU promotes) once the registration
        ended and the processes are dead or, when faulted, hold no GPU memory.
        """
        w = self.orphans.get(wid)
        if w is None:
            # Registered (again): a reaper of a faulted one goes on (its kill deadline);
            # any other stops, and a new one starts if the registration ends again.
            live = self.by_wid(wid)
            return [], live is None or live.state is not WState.FAULTED
        gone = not alive or (w.state is WState.FAULTED and nbytes == 0)
        if w.state not in (WState.FAULTED, WState.PARKED) or not gone:
            return [], False
        del self.orphans[wid]
        fx: list[Effect] = [self._event("forgotten", w, now), Persist()]
        return fx + self._reconcile(self.gpus[w.gpu], now), True

    # ---- restart ---------------------------------------------------------------------

    def adopt_journal(self, entries: list[dict[str, Any]], now: float) -> list[Effect]:
        """Load journaled workloads whose processes still live, as orphans awaiting a
        re-REGISTER; then mark every GPU clean and promote.

        Each entry carries the server's fresh measurement: `alive` and `resident_bytes`.
        """
        fx: list[Effect] = []
        for e in entries:
            if not e.get("alive") or int(e["gpu"]) not in self.gpus:
                continue
            w = Workload(
                wid=next(self._wids),
                name=str(e["name"]),
                gpu=int(e["gpu"]),
                pid=int(e["pid"]),
                start_time=float(e["start_time"]),
                tree=bool(e["tree"]),
                park=str(e["park"]),
                parked_max=int(e["parked_max"]),
                owner_uid=int(e["owner_uid"]),
                registrant=None,
                parks=int(e.get("parks", 0)),
                restores=int(e.get("restores", 0)),
                faults=int(e.get("faults", 0)),
                parked_bytes=int(e.get("parked_bytes", 0)),
                parked_procs=_idents(e.get("parked_procs")),
                fallback=str(e.get("fallback", "none")),
                ask=bool(e.get("ask", False)),
            )
            state, op_procs = e.get("state"), _idents(e.get("op_procs"))
            if state == WState.FAULTED:
                w.state, w.fault_reason = WState.FAULTED, str(e.get("fault_reason"))
                fx.append(self._reap(w, kill_after=self.limits.fault_kill_after))
            elif state == WState.PARKING and op_procs:
                # The tool may have run (or still run) on these: ask the driver.
                w.state, w.recover = WState.PARKING, "park"
                w.op_procs, w.op_bytes = op_procs, int(e.get("op_bytes", 0))
            elif state in (WState.PARKED, WState.RESTORING) and w.parked_procs:
                w.state = WState(str(state))
                w.recover = "restore" if state == WState.RESTORING else "park"
                w.op_procs = w.parked_procs
            elif int(e["resident_bytes"]) > w.parked_max:
                w.state = WState.IDLE
                if w.park == "cooperative":
                    w.hold_until = now + self.limits.adopt_grace
                    fx.append(Recheck(w.gpu, self.limits.adopt_grace))
            elif e.get("state") in (WState.PARKED, WState.PARKING, WState.RESTORING):
                w.state = WState.PARKED
                fx.append(self._reap(w, kill_after=None))
            else:
                continue
            self.orphans[w.wid] = w
            fx.append(self._event("recovered", w, now))
        for gpu in self.gpus.values():
            gpu.dirty = False
        fx.append(Persist())
        for gpu in self.gpus.values():
            fx += self._reconcile(gpu, now)
        return fx

    def journal(self) -> list[dict[str, Any]]:
        """What a restarted daemon needs to know: every tracked workload's processes."""
        return [
            {
                "name": w.name,
                "gpu": w.gpu,
                "pid": w.pid,
                "start_time": w.start_time,
                "tree": w.tree,
                "park": w.park,
                "parked_max": w.parked_max,
                "owner_uid": w.owner_uid,
                "state": str(w.state),
                "parked_bytes": w.parked_bytes,
                "parked_procs": [list(p) for p in w.parked_procs],
                "op_procs": [list(p) for p in w.op_procs],
                "op_bytes": w.op_bytes,
                "fallback": w.fallback,
                "ask": w.ask,
                "parks": w.parks,
                "restores": w.restores,
                "faults": w.faults,
                "fault_reason": w.fault_reason,
            }
            for w in self.workloads()
        ]

    def status(self) -> dict[str, Any]:
        """The GPUs, workloads and totals, as STATUS reports them (the server adds pids,
        version and uptime)."""
        gpus = []
        for gpu in self.gpus.values():
            residents = [w for w in self._on_gpu(gpu) if w.state in RESIDENT]
            holder = gpu.holder
            gpus.append(
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "resident": residents[0].name if residents else None,
                    "holder": (
                        {"workload": holder.workload.name, "turn": holder.turn}
                        if holder is not None
                        else None
                    ),
                    "queue": [x.workload.name for x in gpu.queue.values()],
                    "grants": gpu.grants,
                    "busy": str(gpu.op.kind) if gpu.op is not None else None,
                    "stage": (
                        str(gpu.op.stage)
                        if gpu.op is not None and gpu.op.kind is OpKind.PARK
                        else None
                    ),
                    "dirty": gpu.dirty,
                    "foreign": list(gpu.foreign),
                }
            )
        workloads = []
        for w in self.workloads():
            reg = self.conns.get(w.registrant) if w.registrant is not None else None
            workloads.append(
                {
                    "name": w.name,
                    "gpu": w.gpu,
                    "state": str(w.state),
                    "turn": w.turn,
                    "park": w.park,
                    "parked_max": w.parked_max,
                    "pid": w.pid,
                    "registrant": {"pid": reg.pid, "uid": reg.uid} if reg else None,
                    "parks": w.parks,
                    "restores": w.restores,
                    "faults": w.faults,
                    "grants": w.grants,
                    "last_park_ms": w.last_park_ms,
                    "last_restore_ms": w.last_restore_ms,
                    "parked_bytes": w.parked_bytes,
                    "parked_pids": [p for p, _ in w.parked_procs],
                    "fallback": w.fallback,
                    "ask": w.ask,
                    "recovering": w.recover,
                    "fault_reason": w.fault_reason,
                }
            )
        return {"gpus": gpus, "workloads": workloads, "totals": dict(self.totals)}

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

    def _event(self, kind: str, w: Workload, now: float, **extra: Any) -> Emit:
        body = {"event": kind, "t": round(now, 6), "workload": w.name, "gpu": w.gpu}
        body["turn"] = w.turn
        body["state"] = str(w.state)
        body.update(extra)
        return Emit(body)

    def _unqueue(self, gpu: Gpu, waiter: Waiter) -> None:
        if gpu.queue.pop(waiter.conn, None) is not None:
            left = gpu.waiting[waiter.workload.wid] - 1
            if left:
                gpu.waiting[waiter.workload.wid] = left
            else:
                del gpu.waiting[waiter.workload.wid]
        peer = self.conns.get(waiter.conn)
        if peer is not None:
            peer.waiting_on = None
        if self._others_waiting(gpu) == 0:
            # WAITING goes out on every change from zero to non-zero during a turn.
            gpu.waiting_sent = False

    def _others_waiting(self, gpu: Gpu) -> int:
        mine = gpu.holder.workload.wid if gpu.holder is not None else None
        return len(gpu.waiting) - (1 if mine in gpu.waiting else 0)

    def _notify_waiting(self, gpu: Gpu) -> list[Effect]:
        holder = gpu.holder
        if holder is None or gpu.waiting_sent:
            return []
        n = self._others_waiting(gpu)
        if n == 0:
            return []
        gpu.waiting_sent = True
        return [SendWaiting(holder.conn, holder.workload.name, holder.turn, n)]

    def _end_turn(self, gpu: Gpu, now: float, fx: list[Effect], reason: str) -> Workload:
        assert gpu.holder is not None
        holder, gpu.holder = gpu.holder, None
        w = holder.workload
        w.to(WState.IDLE)
        fx.append(self._event("released", w, now, how=reason, turn_ended=holder.turn))
        w.turn = None
        return w

    def _end_registration(self, w: Workload, now: float, fx: list[Effect]) -> None:
        gpu = self.gpus[w.gpu]
        for waiter in [x for x in gpu.queue.values() if x.workload is w]:
            self._unqueue(gpu, waiter)
            fx.append(Deny(waiter.conn, errors.Gone(f"workload {w.name} was unregistered")))
        if gpu.holder is not None and gpu.holder.workload is w:
            self._end_turn(gpu, now, fx, reason="unregistered")
        del self.registered[w.name]
        w.registrant = None
        fx.append(self._event("unregistered", w, now))
        fx.append(Persist())
        if w.state is WState.REGISTERED:
            return
        self.orphans[w.wid] = w
        if w.state is WState.PARKED:
            fx.append(self._reap(w, kill_after=None))
        # IDLE orphans are parked by _reconcile; PARKING/RESTORING finish first; a FAULTED
        # one already has its reaper.

    def _reap(self, w: Workload, kill_after: float | None) -> Reap:
        return Reap(
            wid=w.wid,
            workload=w.name,
            gpu=w.gpu,
            pid=w.pid,
            start_time=w.start_time,
            tree=w.tree,
            kill_after=kill_after,
        )

    def _fault(self, w: Workload, reason: str, text: str, now: float) -> list[Effect]:
        w.to(WState.FAULTED)
        w.faults += 1
        w.fault_reason = reason
        self.totals["faults"] += 1
        fx: list[Effect] = [self._event("fault", w, now, reason=reason), Persist()]
        if w.registrant is not None:
            fx.append(SendFault(w.registrant, w.name, w.last_turn, reason, text))
        gpu = self.gpus[w.gpu]
        for waiter in [x for x in gpu.queue.values() if x.workload is w]:
            self._unqueue(gpu, waiter)
            fx.append(Deny(waiter.conn, errors.Faulted(f"workload {w.name} faulted: {reason}")))
        fx.append(self._reap(w, kill_after=self.limits.fault_kill_after))
        return fx

    def _start_park(self, gpu: Gpu, w: Workload, now: float) -> list[Effect]:
        w.to(WState.PARKING)
        op = Op(OpKind.PARK, next(self._ops), w, reply_conn=w.park_reply)
        unattended = w.holder_died and w.park == "cooperative"
        w.must_park, w.park_reply, w.holder_died = False, None, False
        gpu.op = op
        fx: list[Effect] = [
            Persist(),  # a restart mid-park must know the processes may be checkpointed
            self._event("parking", w, now),
        ]
        if unattended:
            # Its holder died mid-turn: what the backend sees now may be half a wake.
            # The registrant parks it (vLLM serialises a sleep after a wake in flight),
            # else cuda-checkpoint, else the backend's word is all there is.
            if (asked := self._ask(op, now, "holder-closed")) is not None:
                return fx + asked
            if w.fallback == "checkpoint":
                return fx + self._checkpoint_fallback(op, now, "holder-closed")
        return [
            *fx,
            Park(
                op=op.op_id,
                wid=w.wid,
                workload=w.name,
                gpu=gpu.index,
                mode=w.park,
                parked_max=w.parked_max,
            ),
        ]

    def _grant(self, gpu: Gpu, waiter: Waiter, restored: bool, now: float) -> list[Effect]:
        self._unqueue(gpu, waiter)
        w = waiter.workload
        turn = next(self._turns)
        w.to(WState.ACTIVE)
        w.turn = w.last_turn = turn
        w.grants += 1
        gpu.grants += 1
        self.totals["grants"] += 1
        gpu.holder = Holder(conn=waiter.conn, workload=w, turn=turn, since=now)
        gpu.waiting_sent = False
        waited = max(0, int((now - waiter.since) * 1000))
        fx: list[Effect] = [
            Grant(waiter.conn, w.name, turn, restored, waited),
            self._event("granted", w, now, waited_ms=waited, restored=restored),
        ]
        return fx + self._notify_waiting(gpu)

    def _reconcile(self, gpu: Gpu, now: float, verified: Workload | None = None) -> list[Effect]:
        """The one place that parks for, restores for and grants to the queue head."""
        if gpu.op is not None or gpu.dirty:
            return []
        on_gpu = self._on_gpu(gpu)
        for w in on_gpu:
            if w.recover is not None:
                # A restart interrupted this one's park or restore: settle it first.
                op = Op(OpKind.RECOVER, next(self._ops), w)
                gpu.op = op
                return [
                    self._event("recovering", w, now, intent=w.recover),
                    Recover(
                        op.op_id,
                        w.wid,
                        w.name,
                        gpu.index,
                        w.recover,
                        w.op_procs,
                        w.parked_max,
                        (w.pid, int(w.start_time)),
                    ),
                ]
        residents = [w for w in on_gpu if w.state in RESIDENT]
        holder_w = gpu.holder.workload if gpu.holder is not None else None
        head = gpu.head()
        head_w = head.workload if head is not None else None
        idle = [w for w in residents if w.state is WState.IDLE]
        # Dirty or abandoned workloads first, then whoever stands between the head and
        # the GPU (or crowds it next to another resident).
        held = [w for w in idle if w.detached and w.hold_until > now]
        if held:
            # The GPU stays taken until it is adopted or its grace ends: look again then.
            return [Recheck(gpu.index, max(0.01, min(w.hold_until for w in held) - now))]
        for w in idle:
            if w.must_park or w.detached:
                return self._start_park(gpu, w, now)
        for w in idle:
            crowded = len(residents) > 1 and w is not holder_w
            if w is not head_w and (head_w is not None or crowded):
                return self._start_park(gpu, w, now)
        if any(w.state is WState.FAULTED for w in residents):
            return []
        if gpu.holder is not None or head is None or head_w is None:
            return []
        checkpointed = head_w.state is WState.PARKED and bool(head_w.parked_procs)
        if verified is not head_w:
            op = Op(OpKind.VERIFY, next(self._ops), head_w)
            gpu.op = op
            need = head_w.parked_bytes if checkpointed else 0
            return [Verify(op.op_id, gpu.index, head_w.wid, need)]
        if checkpointed:
            head_w.to(WState.RESTORING)
            op = Op(OpKind.RESTORE, next(self._ops), head_w)
            gpu.op = op
            return [
                Persist(),
                self._event("restoring", head_w, now),
                Restore(
                    op=op.op_id,
                    wid=head_w.wid,
                    workload=head_w.name,
                    gpu=gpu.index,
                    procs=head_w.parked_procs,
                    nbytes=head_w.parked_bytes,
                ),
            ]
        return self._grant(gpu, head, restored=head_w.state is WState.PARKED, now=now)
