"""GPU operations and measurements: the tasks and inline steps the server performs.

Parks, restores and recoveries run as tasks, one GPU never waiting for another; a reaper
reads a workload's processes and memory until the state machine says stop; a census
measures what each workload holds. Every GPU operation in flight has an *owner* (the task
or inline step performing it), which always reports a result, also when it fails. What is
measured goes back to `SlicerState` as readings (`slicer.readings`); the state machine
decides what they mean. A grant check may reuse a clean reading of its GPU younger than
`verify_reuse_ms` (`slicer.reuse` says when, and argues the trade). The server passes in
what these need (its state machine, GPU backend, parker, process table, clock, and how to
apply effects), so nothing here imports it back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.slicer import census, errors, procs, recovery
from gpu_slicer.slicer.attribution import Attribution
from gpu_slicer.slicer.config import Config
from gpu_slicer.slicer.connection import Connection
from gpu_slicer.slicer.effects import AskPark, Effect, Park, Reap, Recover, Restore, Verify
from gpu_slicer.slicer.gpu import GpuBackend
from gpu_slicer.slicer.park import Parker
from gpu_slicer.slicer.readings import (
    Census,
    Outcome,
    ParkReport,
    RecoverReport,
    RestoreReport,
    Unreadable,
)
from gpu_slicer.slicer.reuse import Reuse
from gpu_slicer.slicer.state import ProcessInfo, SlicerState

# The server's logger: slicerd's log lines keep the name they had.
log = logging.getLogger("slicer.server")

REAP_EVERY = 0.25
# How often the GPUs of tree=1 workloads are looked at only to learn which processes hold
# their memory (`Attribution.survivors`), between the looks grants, parks and reapers take.
MEMBERS_EVERY = 2.0
GET_STATE_TIMEOUT = 30.0  # one `--get-state` (seen: up to 7 s on real hardware)


class GpuOps:
    """Performs the server's GPU operations and measurements, each with an owner."""

    def __init__(
        self,
        cfg: Config,
        sm: SlicerState,
        backend: GpuBackend,
        parker: Parker,
        host: procs.ProcessTable,
        clock: Callable[[], float],
        apply: Callable[[list[Effect]], None],
        durable: Callable[[], bool],
    ) -> None:
        self.cfg, self.sm, self.backend, self.parker, self.host = cfg, sm, backend, parker, host
        # `apply` performs effects (the server's one loop); `durable` says whether the
        # journal is being written (a park's pids are journaled before its tool runs).
        self._clock, self._apply, self._durable = clock, apply, durable
        # op id -> (token, what): who performs the GPU operation in flight.
        self.owners: dict[int, tuple[object, str]] = {}
        # While the server performs one batch of effects (nothing awaits, no tool runs in
        # it): GPU index -> the backend's reading, shared by every census of the batch.
        self.batch: dict[int, dict[int, int]] | None = None
        # Clean grant-check readings, reused while young (`slicer.reuse`).
        self.reuse = Reuse(cfg.verify_reuse_ms, sm)
        # Whose memory is whose, and what a peer's pids name (`slicer.attribution`).
        self.attr = Attribution(cfg, sm, backend, host)

    # ---- owners ----------------------------------------------------------------------

    def failed(self, e: Effect, ex: Exception) -> list[Effect]:
        """Results for a GPU operation whose effect could not be performed: its owner
        always reports, so no GPU stays busy with nobody working on it."""
        now, text = self._clock(), f"{type(ex).__name__}: {ex}"[:300]
        try:
            match e:
                case Verify():
                    return self.sm.verified(e.op, Unreadable("server-error", text), now)
                case Park():
                    return self.sm.park_done(e.op, ParkReport(error=text), now)
                case Restore():
                    return self.sm.restore_done(e.op, RestoreReport(error=text), now)
                case Recover():
                    return self.sm.recover_done(e.op, RecoverReport(error=text), now)
                case AskPark():
                    return self.sm.ask_expired(e.op, now)
        except Exception:
            log.exception("reporting the failure of %s failed", type(e).__name__)
        return []

    def own(self, op: int, what: str) -> object:
        """Make `what` the owner of GPU operation `op`; the token it disowns it with."""
        token = object()
        self.owners[op] = (token, what)
        return token

    def disown(self, op: int, token: object) -> None:
        """`token` no longer owns `op` (an owner that came after it is kept)."""
        if self.owners.get(op, (None, ""))[0] is token:
            del self.owners[op]

    def report(self, op: int, token: object, call: Callable[[], list[Effect]]) -> None:
        """Feed a task's result to the state machine; the task stays the op's owner
        until the result is in."""
        try:
            self._apply(call())
        except Exception:
            log.exception("reporting the result of op %d failed", op)
        finally:
            self.disown(op, token)

    # ---- measures --------------------------------------------------------------------

    def recover(self, entries: list[dict[str, Any]]) -> None:
        """Read how the journaled workloads are now (alive? what they hold on their GPU)
        and hand them to the state machine."""
        for e in entries:
            _upgrade_entry(e, self.host)
            ident = (int(e.get("pid", 0)), int(e.get("start_time", 0)))
            e["alive"] = self.host.alive(ident)
            e["resident_bytes"] = 0
        by_gpu: dict[int, list[dict[str, Any]]] = {}
        for e in entries:
            if e["alive"]:
                by_gpu.setdefault(int(e["gpu"]), []).append(e)
        for gpu, group in by_gpu.items():
            roots = self.attr.journal_roots(gpu, group)
            try:
                taken = self.attr.attribute(self.backend.processes(gpu), roots, remember=False)
            except Exception as ex:
                log.error("cannot read GPU %d during recovery: %s", gpu, ex)
                for e in group:
                    e["resident_bytes"] = None  # unread (the state machine decides)
                continue
            for i, e in enumerate(group):
                e["resident_bytes"] = taken.of(i)
        log.info("recovered %d journaled workloads", sum(1 for e in entries if e["alive"]))
        self.reuse.forget()  # adopted workloads: every GPU is read afresh
        self._apply(self.sm.adopt_journal(entries, self._clock()))

    def register(
        self, conn: Connection, req: proto.Register, now: float, parker: str = ""
    ) -> list[Effect]:
        """REGISTER: measure the new workload's process and what it already holds, then
        ask the state machine (`parker`: why the parker cannot run, "" when it can)."""
        gpu = self.sm.resolve_gpu(req.gpu)
        pid, ns_pid, ns = self.attr.resolve_pid(conn.pid, conn.peer_start, conn.pidns, req.pid)
        start, uid = self.host.start_time(pid), self.host.owner_uid(pid)
        if start is None or uid is None:
            raise errors.NoSuchProcess(f"no live process {ns_pid or pid}")
        if ns is not None and not self.attr.still(pid, ns, ns_pid):
            # It exited (and its pid was reused) since it was translated.
            raise errors.NoSuchProcess(f"no live process {ns_pid} in pid:[{ns}]")
        info = ProcessInfo(pid=pid, start_time=start, uid=uid, ns_pid=ns_pid, pidns=ns)
        # Measure what the new workload already holds (before it is known, its memory
        # would read as foreign).
        held = self.attr.newcomer(self.backend.processes(gpu), gpu, (pid, start), req.tree)
        self.reuse.forget(gpu)  # a new workload (or an adopted one) on this GPU
        return self.sm.register(
            conn.cid,
            req.workload,
            gpu,
            info,
            req.tree,
            str(req.park),
            req.parked_max,
            held,
            now,
            fallback=str(req.fallback),
            sharing=self._sharing((pid, start), req.tree),
            ask=req.ask,
            max_turn=req.max_turn,
            parker=parker,
        )

    def _sharing(self, ident: procs.Ident, tree: bool) -> list[int]:
        """The wids of tracked workloads whose process trees overlap the tree of `ident`."""
        host = self.host
        mine = list(host.ancestry(ident[0]))
        out = []
        for w in self.sm.workloads():
            root = (w.pid, int(w.start_time))
            # The new process lies in w's tree, or w's root lies in the new tree.
            inside = any(a == root and (w.tree or depth == 0) for depth, a in enumerate(mine))
            holds = tree and any(a == ident for a in host.ancestry(w.pid)) and host.alive(root)
            if inside or holds:
                out.append(w.wid)
        return out

    def _census(self, gpu: int, roots: list[census.Root] | None = None) -> Census:
        # A park verified and the grant that follows it in one batch read the backend once
        # (the roots are current for each: a workload registered meanwhile is counted).
        batch = self.batch
        seen = batch.get(gpu) if batch is not None else None
        if seen is None:
            seen = self.backend.processes(gpu)
            if batch is not None:
                batch[gpu] = seen
        roots = self.attr.roots(gpu) if roots is None else roots
        taken = self.attr.attribute(seen, roots)
        if taken.foreign or taken.unattributed:
            self.reuse.forget(gpu)  # whoever reads foreign memory: no grant check reuses
        return taken

    def _not_its(self, name: str, gpu: int, after: int | Unreadable) -> int | Unreadable:
        # By elimination the GPU's excess may be another's (a newcomer that came with
        # memory, a resident one beside a frozen one): the driver checkpointed every
        # process of this one that had the GPU open, and says so; what is left over
        # blocks grants as unattributed memory (or is charged to the suspects).
        if self.attr.blind and isinstance(after, int) and after:
            log.warning(
                "%s: checkpointed; %d bytes beyond the budgets stay on GPU %d (not its)",
                name,
                after,
                gpu,
            )
            return 0
        return after

    def _bytes_of(self, gpu: int, wid: int, reason: str) -> int | Unreadable:
        """Workload `wid`'s device bytes on `gpu` now, or why they could not be read."""
        try:
            return self._census(gpu).of(wid)
        except Exception as ex:
            return Unreadable(reason, str(ex)[:300])

    def read_gpu(self, e: Verify) -> tuple[Census | Unreadable, int | None]:
        """The census of `e.gpu` (a clean one younger than `verify_reuse_ms` may be
        reused, `slicer.reuse`) and, when the grant needs room, its free bytes (always
        read)."""
        try:
            roots, now = self.attr.roots(e.gpu), self._clock()
            seen = self.reuse.get(e.gpu, e.wid, roots, now)
            if seen is None:
                seen = self._census(e.gpu, roots)
                self.reuse.keep(e.gpu, e.wid, roots, seen, now)
            return seen, (self.backend.free_bytes(e.gpu) if e.need else None)
        except Exception as ex:
            self.reuse.forget(e.gpu)
            log.error("GPU %d cannot be verified: %s", e.gpu, ex)
            return Unreadable("backend-error", str(ex)[:200]), None

    def verify(self, e: Verify) -> list[Effect]:
        """Perform a grant check: read `e.gpu` and hand the reading to the state machine;
        a reading that refused the grant is never reused."""
        seen, free = self.read_gpu(e)
        fx = self.sm.verified(e.op, seen, self._clock(), free)
        gpu = self.sm.gpus.get(e.gpu)
        if gpu is not None and gpu.foreign:
            self.reuse.forget(e.gpu)
        return fx

    def _ms_since(self, t0: float) -> int:
        return int((self._clock() - t0) * 1000)

    async def park(self, e: Park, token: object) -> None:
        """Park task: move the workload's GPU memory off with the parker and report."""
        t0 = self._clock()
        before, error = 0, ""
        parked: tuple[procs.Ident, ...] = ()
        tool: Outcome | None = None
        alive: tuple[bool, ...] = ()
        try:
            seen = self._census(e.gpu)
            before = seen.of(e.wid)
            pids = self.attr.gpu_pids(e.gpu, e.wid, seen)
            parked = tuple((p, st) for p in pids if (st := self.host.start_time(p)) is not None)
            if parked and self.attr.blind:
                parked = await self.attr.cuda_only(parked, self.parker, GET_STATE_TIMEOUT)
            if e.mode == "freeze" and not self._may_freeze(e, parked, before):
                declined = self._declined(t0)
                self.report(e.op, token, lambda: self.sm.park_done(e.op, declined, self._clock()))
                return
            if parked:
                # Journaled before the tool runs: a daemon killed from here on finds the
                # processes in the journal and asks the driver how far the park got.
                self._apply(self.sm.park_started(e.op, parked, before))
                durable = self._durable()
                fx, go = self.sm.park_journaled(e.op, durable, self._clock())
                if not go:
                    self.report(e.op, token, lambda: fx)
                    return
                tool = await self._park_tool(e, [p for p, _ in parked])
                alive = tuple(self.host.alive(p) for p in parked)
        except Exception as ex:
            error = str(ex)[:300]
        froze = e.mode == "freeze" and not error and tool is not None and tool.ok
        # A freeze that held keeps the memory where it was: nothing to read after it (a
        # failed one is judged like a park, by what the backend sees).
        after: int | Unreadable = 0 if froze else self._bytes_of(e.gpu, e.wid, "park-error")
        if tool is not None and tool.ok:
            after = self._not_its(e.workload, e.gpu, after)
        self.reuse.forget(e.gpu)  # its end changes who is on the GPU
        report = ParkReport(self._ms_since(t0), before, parked, tool, alive, after, error)
        if e.mode == "freeze":
            report = dataclasses.replace(report, frozen=True)
        self.report(e.op, token, lambda: self.sm.park_done(e.op, report, self._clock()))

    def _may_freeze(self, e: Park, parked: tuple[procs.Ident, ...], before: int) -> bool:
        # Fit-aware turns (`slicer.fit`): lock only when the next workload's need fits in
        # what is free now, and there is something to lock (and a lock step to do it).
        # Within parked_max it parked itself (a slept vLLM): frozen, its wake would need
        # memory nobody knows of; it is parked the usual way.
        if not parked or not self.parker.has_action or before <= e.parked_max:
            return False
        if e.early and self.attr.blind:
            # By elimination the head's early bytes would count against this park: park
            # it the usual way (`slicer.early`).
            return False
        if self.attr.blind and any(r.suspect and r.wid != e.wid for r in self.attr.roots(e.gpu)):
            # By elimination what the freeze measures (`before`, its frozen_bytes) is the
            # GPU's whole excess: with another suspect holding memory (a resident head)
            # that would count as this workload's and hide the other's until the thaw.
            log.info("%s: another workload may hold memory on GPU %d (census by "
                     "elimination): park, not freeze", e.workload, e.gpu)  # fmt: skip
            return False
        try:
            free = self.backend.free_bytes(e.gpu)
        except Exception as ex:  # unread: never freeze on a guess
            log.warning("%s: free bytes of GPU %d unreadable (%s): park", e.workload, e.gpu, ex)
            return False
        log.info("%s: %d bytes free on GPU %d, the next needs %d: %s", e.workload, free,
                 e.gpu, e.need, "freeze" if free >= e.need else "park")  # fmt: skip
        return free >= e.need

    def _declined(self, t0: float) -> ParkReport:
        return ParkReport(ms=self._ms_since(t0), after=0, declined=True)

    async def _park_tool(self, e: Park, pids: list[int]) -> Outcome:
        if e.mode == "freeze":
            return await self.parker.act(pids, "lock", self.cfg.park_timeout)
        if e.locked:  # a frozen workload: locked already, checkpoint what it holds
            return await self.parker.act(pids, "checkpoint", self.cfg.park_timeout)
        return await self.parker.park(pids, self.cfg.park_timeout)

    def verify_parked(self, e: Park) -> list[Effect]:
        """A cooperative park: the workload freed the GPU itself; it is checked through
        the backend, never on its word."""
        t0 = self._clock()
        after = self._bytes_of(e.gpu, e.wid, "park-error")
        self.reuse.forget(e.gpu)
        report = ParkReport(ms=self._ms_since(t0), after=after, blind=self.attr.blind)
        return self.sm.park_done(e.op, report, self._clock())

    async def restore(self, e: Restore, token: object) -> None:
        """Restore task: bring the parked processes that still live back and report."""
        t0 = self._clock()
        live = tuple((p, st) for p, st in e.procs if self.host.start_time(p) == st)
        tool: Outcome | None = None
        error = ""
        try:
            if live and e.thaw:  # frozen: its memory never left, unlock it
                pids = [p for p, _ in live]
                tool = await self.parker.act(pids, "unlock", self.cfg.restore_timeout)
            elif live:
                tool = await self.parker.restore([p for p, _ in live], self.cfg.restore_timeout)
        except Exception as ex:
            error = str(ex)[:300]
        self.reuse.forget(e.gpu)
        # Read after the tool: a workload that exited before or under it is ending, not
        # faulted (`policy.judge_restore`).
        survivors = any(self.host.start_time(p) == st for p, st in e.procs)
        root_alive = not e.root[0] or self.host.alive(e.root)
        report = RestoreReport(
            ms=self._ms_since(t0),
            live=live,
            tool=tool,
            error=error,
            survivors=survivors,
            root_alive=root_alive,
        )
        self.report(e.op, token, lambda: self.sm.restore_done(e.op, report, self._clock()))

    async def recover_op(self, e: Recover, token: object) -> None:
        """Recovery task: read how far an interrupted park or restore got, perform the
        plan the state machine makes of it, and report."""
        bound = max(self.cfg.park_timeout, self.cfg.restore_timeout)
        try:
            reading = await recovery.read(self.parker, e.procs, bound, e.root, self.host)
            plan = self.sm.recovery_plan(e.op, reading)
            steps = await recovery.perform(self.parker, plan.steps, bound)
            after = self._bytes_of(e.gpu, e.wid, "recover-error")
            done = plan.result
            if steps.ok and done.result == "parked" and done.procs:
                # Its journaled processes are checkpointed, as a park's would be; a
                # process of it that holds the GPU and is not among them proves nothing.
                holders = self.attr.gpu_pids(e.gpu, e.wid, Census())
                if set(holders) <= {p for p, _ in done.procs}:
                    after = self._not_its(e.workload, e.gpu, after)
            report = RecoverReport(reading, steps, after)
            log.info(
                "recovering %s (%s): %s, steps %s",
                e.workload,
                e.intent,
                plan.result.result,
                "ok" if steps.ok else f"failed: {steps.reason} {steps.text}",
            )
        except Exception as ex:
            report = RecoverReport(error=str(ex)[:300])
        self.reuse.forget(e.gpu)
        self.report(e.op, token, lambda: self.sm.recover_done(e.op, report, self._clock()))

    async def reap(self, e: Reap) -> None:
        """Reaper task: read whether the workload lives and what it holds until the state
        machine says stop."""
        # Reads and reports until the state machine says stop; it decides what the
        # readings mean, and when a faulted workload's processes are killed (`Kill`).
        ident = (e.pid, int(e.start_time))
        while True:
            alive = self.host.alive(ident)
            nbytes: int | None = None  # unread: the GPU stays taken
            holders: tuple[int, ...] = ()
            try:
                taken = self._census(e.gpu)
                nbytes, holders = taken.of(e.wid), tuple(self.attr.gpu_pids(e.gpu, e.wid, taken))
            except Exception:
                pass
            try:
                # Its registered process dead, what it started may live on (reparented).
                survivors = () if alive or not e.tree else tuple(self.attr.survivors(e.wid))
                fx, done = self.sm.memory_report(
                    e.wid, alive, nbytes, self._clock(), holders, survivors
                )
                self._apply(fx)
            except Exception:  # a reaper must never take the daemon down
                log.exception("reaping %s failed", e.workload)
                done = False
            if done:
                return
            await trio.sleep(REAP_EVERY)

    async def watch_members(self) -> None:
        """Look at each GPU that a `tree=1` workload is on every `MEMBERS_EVERY` seconds,
        so that the processes of its tree that hold memory are known before a SIGKILL of
        its root can reparent them out of it (`Attribution.survivors`)."""
        while True:
            await trio.sleep(MEMBERS_EVERY)
            for gpu in sorted({w.gpu for w in self.sm.workloads() if w.tree}):
                try:
                    self._census(gpu)
                except Exception as ex:  # a look that fails is the next one's to take
                    log.debug("membership look at GPU %d failed: %s", gpu, ex)
            try:
                now = self._clock()
                for wid in sorted(self.attr.changed()):
                    self._apply(self.sm.gpu_pids_seen(wid, self.attr.survivors(wid), now))
            except Exception:  # an event lost; never the daemon
                log.exception("announcing the GPU processes of workloads failed")


def _upgrade_entry(e: dict[str, Any], host: procs.ProcessTable = procs) -> None:
    """Journals written before processes were journaled with their start times name
    parked pids alone: pair each still-live one with its start time now."""
    if "parked_procs" not in e and e.get("parked_pids"):
        # Only processes of the workload's tree now, started after its root: a pid that
        # was reused by someone else's process is never taken for ours.
        root = (int(e["pid"]), int(e["start_time"]))
        members = set(host.tree(root, bool(e.get("tree", True))))
        e["parked_procs"] = [
            [p, st]
            for p in map(int, e["parked_pids"])
            if p in members and (st := host.start_time(p)) is not None and st >= root[1]
        ]
