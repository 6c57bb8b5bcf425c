"""The results of park operations, as `SlicerState` takes them: a part of the one state
machine, kept in a module of its own (`SlicerState` derives from `ParkResults`; one object
owns all turn state, as `slicer.state` says).

A park op reports here: the processes a checkpoint will act on (`park_started`), whether
their journal record is on disk (`park_journaled`), how the park ended (`park_done`: a
freeze that locked its workload, `_frozen`, and the early start it makes room for, a
cooperative workload's next rescue stage, `_cooperative_next`), the registrant's answer to
PARK (`parked_answer`) or its silence (`ask_expired`), and an EARLY the server could not
send (`early_unsent`). Every method is synchronous, pure and returns effects; promotion
stays in `SlicerState._reconcile`.
"""

from __future__ import annotations

from gpu_slicer.slicer import early, errors, opstart, policy, rescue
from gpu_slicer.slicer.effects import ConnId, Deny, Effect, Persist, Recheck, Reply
from gpu_slicer.slicer.model import Conn, Gpu, Ident, Op, OpKind, ParkStage, Workload, WState
from gpu_slicer.slicer.readings import ParkReport
from gpu_slicer.slicer.records import Limits
from gpu_slicer.slicer.views import event

__all__ = ["ParkResults"]


class ParkResults:
    """The park-result methods of `SlicerState` (module docstring)."""

    # What they use of the state machine (set by `SlicerState.__init__`).
    gpus: dict[int, Gpu]
    limits: Limits
    totals: dict[str, int]
    conns: dict[ConnId, Conn]
    registered: dict[str, Workload]

    def _reconcile(self, gpu: Gpu, now: float, verified: Workload | None = None) -> list[Effect]:
        raise NotImplementedError  # `SlicerState._reconcile`

    def _fault(self, w: Workload, reason: str, text: str, now: float) -> list[Effect]:
        raise NotImplementedError  # `SlicerState._fault`

    def park_started(self, op_id: int, procs: tuple[Ident, ...], nbytes: int) -> list[Effect]:
        """The server is about to run cuda-checkpoint on `procs` (holding `nbytes`) for
        park `op_id`: journal them first, so that a restart knows whom to ask."""
        if (found := opstart.running(self.gpus.values(), op_id, OpKind.PARK)) is None:
            return []
        w = found[1].workload
        w.op_procs, w.op_bytes = procs, nbytes
        return [Persist()]

    def park_journaled(self, op_id: int, durable: bool, now: float) -> tuple[list[Effect], bool]:
        """The server wrote the journal `park_started` asked for; `durable`: it is on
        disk. Returns the effects and whether cuda-checkpoint may run now. It may not when
        the journal is not on disk (a crash would leave checkpointed processes nobody
        knows of): the workload stays resident and must park, the GPU stays taken until
        it can."""
        if (found := opstart.running(self.gpus.values(), op_id, OpKind.PARK)) is None:
            return [], False
        if durable:
            return [], True
        gpu, op = found
        w = op.workload
        if w.frozen_procs:
            # Locked already (a freeze, then this checkpoint): it stays frozen, running
            # nothing, and is checkpointed when a head needs the room again.
            w.to(WState.FROZEN)
        else:
            w.to(WState.IDLE)
            w.must_park, w.park_reply = True, op.reply_conn
        gpu.op = None
        w.op_procs, w.op_bytes = (), 0
        return [
            event("park-deferred", w, now, reason="journal-unwritable"),
            Recheck(gpu.index, self.limits.recheck_every),
        ], False

    def park_done(self, op_id: int, report: ParkReport, now: float) -> list[Effect]:
        """A Park effect finished; `report` is what the server measured around it. Whether
        the park held is decided here (`policy.judge_park`); the processes it checkpointed
        are what a restore must bring back."""
        if (found := opstart.running(self.gpus.values(), op_id, OpKind.PARK)) is None:
            return []
        gpu, op = found
        w = op.workload
        if report.declined:
            # Not enough room to freeze it beside the next one: park it the usual way.
            timeout = self.limits.registrant_park_timeout
            declined: list[Effect] = [event("freeze-declined", w, now)]
            return declined + rescue.start(op, gpu.index, False, self._asker(w), timeout, now)
        exited = report.tool is not None and not report.tool.ok and not any(report.alive)
        if report.frozen and not exited:
            return self._frozen(gpu, op, report, now)
        # (Its processes exited under the lock: nothing is left to freeze; judged as a
        # park, by what the backend sees.)
        cooperative = w.park == "cooperative" and op.stage is not ParkStage.CHECKPOINT
        verdict = policy.judge_park(report, gpu.index, w.parked_max, cooperative)
        ok, reason, text, ms = verdict.ok, verdict.reason, verdict.text, report.ms
        if not ok and cooperative:
            # A cooperative workload nobody parked: ask its registrant, then fall back.
            return self._cooperative_next(op, reason, text, now)
        if ok and cooperative and (grew := self._above_floor(op, report)):
            return self._cooperative_next(op, "above-floor", grew, now)
        if ok and cooperative and (more := rescue.residue(op, now)) is not None:
            return more  # the op goes on: checkpoint what the cooperative park left
        w.check(WState.PARKED if ok else WState.FAULTED)
        gpu.op = None
        w.op_procs, w.op_bytes, w.frozen_procs = (), 0, ()
        w.early = 0  # an abandoned early start: its memory is parked (or faulted) now
        fx: list[Effect] = []
        if ok:
            w.to(WState.PARKED)
            w.parks += 1
            self.totals["parks"] += 1
            # Paid for the next grant only when someone waits for the GPU: a holder's own
            # `park=now` with nobody waiting is no cost of a later arrival's turn.
            gpu.parked_since_grant = gpu.parked_since_grant or bool(gpu.queue)
            moved, procs = verdict.moved, verdict.procs
            w.last_park_ms, w.parked_bytes, w.parked_procs = ms, moved, procs
            how = "checkpoint" if procs else "cooperative"
            # Lazy when nothing was checkpointed: recovery measures where its memory is.
            park_record = Persist(lazy=not procs)
            fx += [event("parked", w, now, park_ms=ms, bytes=moved, how=how), park_record]
            if op.reply_conn is not None:
                fx.append(Reply(op.reply_conn, {"parked": "1", "park_ms": str(ms)}))
            if w.detached:
                fx.append(opstart.reap(w, None, now))
        else:
            fx += self._fault(w, reason, text or f"park failed: {reason}", now)
            if op.reply_conn is not None:
                fx.append(Deny(op.reply_conn, errors.ParkFailed(f"park of {w.name}: {reason}")))
        return fx + self._reconcile(gpu, now)

    def _frozen(self, gpu: Gpu, op: Op, report: ParkReport, now: float) -> list[Effect]:
        # A freeze ended: locked, its memory stays (`slicer.fit`); a failed lock faults
        # it like a failed park (the GPU stays taken).
        w = op.workload
        failed = report.tool is not None and not report.tool.ok and any(report.alive)
        if report.error or report.tool is None or failed:
            reason = report.tool.reason if failed and report.tool else "park-error"
            text = (report.tool.text if failed and report.tool else report.error) or reason
            w.check(WState.FAULTED)
            gpu.op = None
            w.op_procs, w.op_bytes = (), 0
            out = self._fault(w, reason, text, now)
            if op.reply_conn is not None:
                out.append(Deny(op.reply_conn, errors.ParkFailed(f"park of {w.name}: {reason}")))
            return out + self._reconcile(gpu, now)
        w.to(WState.FROZEN)
        gpu.op = None
        w.frozen_procs, w.op_procs, w.op_bytes = report.procs, (), 0
        w.frozen_bytes = report.before
        w.freezes += 1
        self.totals["freezes"] += 1
        fx: list[Effect] = [
            event("frozen", w, now, freeze_ms=report.ms, bytes=report.before, early=bool(op.early))
        ]
        # Lazy: the park's tool intent on disk names the same processes (`slicer.journal`).
        fx.append(Persist(lazy=True))
        if op.reply_conn is not None:
            fx.append(Reply(op.reply_conn, {"parked": "1", "park_ms": str(report.ms)}))
        if told := early.send(self.limits, gpu, op.early, w, now):
            self.totals["earlies"] += 1
            fx += told
        return fx + self._reconcile(gpu, now)

    def early_unsent(self, conn: ConnId, now: float) -> list[Effect]:
        """The server did not send `conn` its EARLY: the journal recording the early start
        is not on disk (a crash would not know of it). The waiter waits for its grant as
        any other (`slicer.early`)."""
        peer = self.conns.get(conn)
        if peer is None or peer.waiting_on is None:
            return []
        waiter = self.gpus[peer.waiting_on].queue[conn]
        if not waiter.early_sent:
            return []
        early.unsent(waiter)
        self.totals["earlies"] -= 1  # counted as it was decided: it never went out
        return [event("early-unsent", waiter.workload, now, reason="journal-unwritable")]

    def _above_floor(self, op: Op, report: ParkReport) -> str:
        """Why a cooperative park that held by `parked_max` proves nothing ("" when it
        does), and the workload's parked floor learnt. A holder's park (its own sleep)
        that left clearly more than the workload's least parked residue may be a sleep
        that did nothing: vLLM calls a half-woken replica (weights woken, KV cache not)
        sleeping, and its weights can fit under `parked_max`. Only where its registrant
        can be asked (it wakes the replica fully and sleeps it, and what that leaves is
        the floor anew) and a checkpoint can follow (`fallback=checkpoint`); never by
        elimination (`after` is not its own bytes there). Elsewhere `parked_max` alone
        decides, as documented: nothing could follow but a checkpoint at every turn of a
        residue that grew for good, or a FAULT."""
        w, after = op.workload, report.after
        if report.blind or not isinstance(after, int):
            return ""
        floor, slack = w.parked_floor, self.limits.parked_slack
        askable = w.fallback == "checkpoint" and self._asker(w) is not None
        holders = op.stage is ParkStage.VERIFY
        if holders and askable and floor is not None and after > floor + slack:
            return (f"{after} bytes on GPU {w.gpu} at park, more than its parked floor "
                    f"({floor}) + {slack}: a sleep that freed nothing (a half-woken vLLM?) "
                    "is not a park")  # fmt: skip
        # The registrant's park (REVERIFY) woke it fully first: what it left is the floor.
        w.parked_floor = after if not holders or floor is None else min(floor, after)
        return ""

    def _cooperative_next(self, op: Op, reason: str, text: str, now: float) -> list[Effect]:
        # The op stays on the GPU through its stages: nobody is granted meanwhile.
        w = op.workload
        timeout = self.limits.registrant_park_timeout
        if (fx := rescue.next_stage(op, self._asker(w), timeout, reason, now)) is not None:
            return fx
        gpu = self.gpus[w.gpu]
        w.check(WState.FAULTED)
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
                fx += rescue.after_answer(op, False, now)
        return fx

    def _asker(self, w: Workload) -> ConnId | None:
        # Who can park `w` itself: its connected registrant, if it said ask=1. Not after
        # an early start: a half-woken vLLM's sleep does nothing (`slicer.early`).
        if w.early:
            return None
        return w.registrant if w.ask and w.registrant in self.conns else None

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
        fx: list[Effect] = [Reply(conn), event("park-answered", w, now, ok=ok)]
        return fx + rescue.after_answer(op, ok, now)

    def ask_expired(self, op_id: int, now: float) -> list[Effect]:
        """The registrant did not answer the PARK of op `op_id` in time."""
        found = opstart.running(self.gpus.values(), op_id, OpKind.PARK)
        op = found[1] if found is not None else None
        if op is None or op.stage is not ParkStage.ASK:
            return []
        return [event("park-ask-expired", op.workload, now), *rescue.after_answer(op, False, now)]
