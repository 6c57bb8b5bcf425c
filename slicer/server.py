"""The trio server: Unix socket, dispatch, and the effects executor.

The server decides nothing. It parses a line, asks `SlicerState`, and performs the effects
it gets back in order: replies and events go into each connection's bounded outbox (a
client that stops reading is dropped, never waited for); parks, restores and recoveries
run as tasks, one GPU never waiting for another; verification reads the GPU backend inline.
What it measures (a census of a GPU, how a tool run ended, which processes live, the
driver's state of each) goes back to `SlicerState` as readings (`slicer.readings`); the
state machine decides what they mean, also whether a connection is admitted and when a
faulted workload is killed. The GPU backend, the parker, the process table (`host`) and
the clock are injected, so tests run this very code in-process. One connection's I/O
(credentials, framing, outbox) is `slicer.connection`; the GPU operations and what they
measure are `slicer.gpuops`. Journal records that must precede what follows are written
inline; the others once per batch, behind its replies, by a worker thread (which records
may wait is argued in `slicer.journal`). One batch reads each GPU's backend at most once
between grants (a park verified and the grant it lets through share the reading), and a
grant check may reuse a clean reading younger than `verify_reuse_ms` (`slicer.reuse`).

No client can stall it: effects are performed by one loop (never by recursion), requests a
connection pipelined behind a waiting one are resumed by that loop, a connection yields to
the others after every line it sends, and connections are limited per uid with room kept
for root. Every GPU operation in flight has an *owner* (the task or inline step performing
it), which always reports a result, also when it fails; STATUS shows it (`op_owner`).
"""

from __future__ import annotations

import grp
import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.proto import Err, ErrorCode, Fault, Ok, Waiting
from gpu_slicer.slicer import __version__, errors, policy, procs
from gpu_slicer.slicer.config import Config
from gpu_slicer.slicer.connection import (
    Connection,
    linger,
    peer_credentials,
    peer_pidfd,
    pidfd_names,
    reader,
)
from gpu_slicer.slicer.effects import (
    AskPark,
    Deny,
    Effect,
    Emit,
    Grant,
    Kill,
    Park,
    Persist,
    Reap,
    Recheck,
    Recover,
    Reply,
    Restore,
    SendEarly,
    SendFault,
    SendPreempted,
    SendWaiting,
    Verify,
)
from gpu_slicer.slicer.gpu import GpuBackend
from gpu_slicer.slicer.gpuops import GpuOps
from gpu_slicer.slicer.journal import Journal, JournalError
from gpu_slicer.slicer.park import CHECK_TIMEOUT, Parker, ParkerCheck
from gpu_slicer.slicer.state import SlicerState

log = logging.getLogger("slicer.server")

RESUME_BUDGET = 16  # pipelined requests resumed before the loop yields to other tasks
JOURNAL_RETRY = 1.0  # seconds between attempts to write a journal that failed to write
CHILDREN_TTL = 0.1  # a whole-/proc children map is shared this long (fallback path only)

_CODES: dict[type[errors.RequestError], ErrorCode] = {
    errors.UnknownWorkload: ErrorCode.UNKNOWN_WORKLOAD,
    errors.Exists: ErrorCode.EXISTS,
    errors.Forbidden: ErrorCode.FORBIDDEN,
    errors.NoSuchProcess: ErrorCode.NO_SUCH_PROCESS,
    errors.UnknownGpu: ErrorCode.UNKNOWN_GPU,
    errors.Busy: ErrorCode.BUSY,
    errors.Timeout: ErrorCode.TIMEOUT,
    errors.Faulted: ErrorCode.FAULTED,
    errors.Gone: ErrorCode.GONE,
    errors.RestoreFailed: ErrorCode.RESTORE_FAILED,
    errors.NotHolder: ErrorCode.NOT_HOLDER,
    errors.NotRegistrant: ErrorCode.NOT_REGISTRANT,
    errors.ParkFailed: ErrorCode.PARK_FAILED,
    errors.LimitReached: ErrorCode.LIMIT,
    errors.InUse: ErrorCode.IN_USE,
    errors.NotAsked: ErrorCode.NOT_ASKED,
    errors.NoParker: ErrorCode.PARKER_UNAVAILABLE,
}


def _now() -> float:
    # The state machine's clock: event timestamps are CLOCK_MONOTONIC seconds, which a
    # client on the same node can compare with its own time.monotonic() (trio's clock
    # carries a random offset). Timers and deadlines still use trio's clock.
    return time.monotonic()


def error_code(error: errors.RequestError) -> ErrorCode:
    """The wire code of a refusal (the protocol edge)."""
    return _CODES.get(type(error), ErrorCode.BAD_REQUEST)


class Server:
    """Serves the protocol for one `SlicerState` and performs its effects."""

    def __init__(
        self,
        cfg: Config,
        sm: SlicerState,
        backend: GpuBackend,
        parker: Parker,
        journal: Journal,
        entries: list[dict[str, Any]] | None = None,
        *,
        host: procs.ProcessTable = procs,
        clock: Callable[[], float] = _now,
    ) -> None:
        self.cfg, self.sm, self.backend, self.parker, self.journal = (
            cfg,
            sm,
            backend,
            parker,
            journal,
        )
        # The node's processes (/proc) and the state machine's clock; tests inject both.
        self.host, self._clock = host, clock
        self.conns: dict[int, Connection] = {}
        self.watchers: set[Connection] = set()
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._recheck_due: dict[int, float] = {}  # gpu -> when its recheck timer fires
        self.started = time.monotonic()
        self._allow_gid = grp.getgrnam(cfg.allow_group).gr_gid if cfg.allow_group else None
        self._entries = entries or []
        self._work: deque[Effect] = deque()
        self._resume: deque[Connection] = deque()
        self._frames: list[deque[Connection]] = []
        self._applying = False
        self._continuing = False
        self._asks: dict[int, trio.CancelScope] = {}
        self.journal_error: str | None = None
        self._journal_retrying = False
        # Write-behind (lazy `Persist`): a lazy record is not on disk yet; whether the
        # writer task runs; the newest document number that failed to write.
        self._lazy = False
        self._writing = False
        self._failed_seq = 0
        self._children: tuple[float, dict[int, list[int]]] = (-1.0, {})
        # Called with each WATCH event performed, watched or not (`slicer.metrics`).
        self.on_event: Callable[[dict[str, Any]], None] | None = None
        # Whether the parker can run (checked at start, and again by a REGISTER that
        # needs it while it cannot: `_register_after_check`); one check at a time.
        self.parker_check = ParkerCheck(parker.kind, parker.path, True)
        self._parker_lock = trio.Lock()
        self._ops = GpuOps(
            cfg,
            sm,
            backend,
            parker,
            host,
            clock,
            self._apply,
            lambda: self.journal_error is None,
        )

    # ---- lifecycle -------------------------------------------------------------------

    async def run(
        self,
        listener: trio.SocketListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Recover from the journal, then serve `listener` until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._parker_checked(await self.parker.check())
                if self.parker_check.ok and not self.parker.has_action:
                    log.warning("driver lacks --action: using --toggle")
                self._ops.recover(self._entries)
                nursery.start_soon(self._ops.watch_members)
                await nursery.start(trio.serve_listeners, self._handle, [listener])
                task_status.started()
        finally:
            self._nursery = None
            if self._lazy:
                self._persist()  # a clean stop leaves the journal current

    # ---- connections -----------------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            pid, uid, gid = peer_credentials(stream.socket)
        except OSError:
            await stream.aclose()
            return
        trusted = self._in_allow_group(pid, gid)
        cid = next(self._ids)
        try:
            self.sm.connect(cid, uid, pid, trusted=trusted)
        except errors.LimitReached as refused:
            # The client may write its first request after this answer: closing at once
            # would fail that write (EPIPE) and hide the ERR behind a broken pipe, so the
            # refusal lingers (half-closed, input discarded, bounded) like any ERR that
            # ends a connection.
            try:
                with trio.move_on_after(1):
                    await stream.send_all(proto.encode(Err(ErrorCode.LIMIT, text=str(refused))))
                    await linger(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await stream.aclose()
            return
        conn = Connection(cid, stream, pid, uid)
        if pid > 0:
            # Read between two looks at its start time, and (where the kernel gives a
            # pidfd of the connector) only while the connector itself still has that pid:
            # a peer that exited, or whose pid was reused, has no namespace, and gets no
            # pid= trusted (`Attribution.resolve_pid`).
            pidfd = peer_pidfd(stream.socket)
            try:
                start = self.host.start_time(pid)
                ns = self.host.namespace_of(pid)
                same = start is not None and self.host.start_time(pid) == start
                if same and (pidfd is None or pidfd_names(pidfd, pid)):
                    conn.pidns, conn.peer_start = ns, start
            finally:
                if pidfd is not None:
                    os.close(pidfd)
        self.conns[conn.cid] = conn
        flush = False
        try:
            async with trio.open_nursery() as n:
                conn.nursery = n
                n.start_soon(conn.writer, self.cfg.write_timeout)
                flush = await reader(conn, self._dispatch)
                conn.closing = True
                conn.backlog.clear()
                if flush:
                    conn.outbox.close()  # the writer sends what is queued, then ends
                else:
                    n.cancel_scope.cancel()
            if flush and not conn.dropped:
                await linger(stream)
        except Exception:
            # One connection's trouble must never take the daemon (and every turn) down.
            log.exception("connection %d (pid %d) failed", conn.cid, pid)
        finally:
            conn.closing = True
            conn.backlog.clear()
            if conn.wait_scope is not None:
                conn.wait_scope.cancel()
            del self.conns[conn.cid]
            self.watchers.discard(conn)
            try:
                self._apply(self.sm.conn_closed(conn.cid, self._clock()))
            except Exception:
                log.exception("closing connection %d failed", conn.cid)
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    def _in_allow_group(self, pid: int, gid: int) -> bool:
        if self._allow_gid is None:
            return False
        return gid == self._allow_gid or self._allow_gid in self.host.groups(pid)

    def _dispatch(self, conn: Connection, line: bytes) -> None:
        scope: trio.CancelScope | None = None
        try:
            req = proto.parse_request(line)
        except proto.ProtocolError as e:
            conn.send(proto.encode(Err.from_error(e)))
            return
        now = self._clock()
        fx: list[Effect] = []
        try:
            match req:
                case proto.Hello():
                    conn.send(proto.encode(Ok({"proto": "1", "server": f"slicer/{__version__}"})))
                case proto.Ping():
                    conn.send(b"OK\n")
                case proto.Register():
                    conn.pending = True
                    if self._parker_recheck_due(req):
                        assert self._nursery is not None
                        self._nursery.start_soon(self._register_after_check, conn, req)
                        return  # answered once the check ended (bounded); nothing changed
                    fx = self._ops.register(conn, req, now, self.parker_check.error or "")
                case proto.Acquire():
                    conn.pending = True
                    fx = self.sm.acquire(conn.cid, req.workload, now, req.early)
                    if req.wait is not None:
                        # The scope exists before the effects run, so a grant among them
                        # cancels it (a stale timer must never expire a later ACQUIRE of
                        # the same connection); its task starts once they ran.
                        scope = trio.CancelScope(deadline=trio.current_time() + req.wait)
                        conn.wait_scope = scope
                case proto.Release():
                    conn.pending = True
                    park_now = req.park is proto.ReleasePark.NOW
                    fx = self.sm.release(
                        conn.cid, req.workload, req.turn, park_now, now, used=req.used
                    )
                case proto.Unregister():
                    conn.pending = True
                    fx = self.sm.unregister(conn.cid, req.workload, now)
                case proto.Parked():
                    conn.pending = True
                    fx = self.sm.parked_answer(conn.cid, req.workload, req.turn, req.ok, now)
                case proto.Status():
                    conn.send(proto.encode(Ok(body=self.status())))
                case proto.Watch():
                    conn.watching = True
                    conn.backlog.clear()  # a WATCH stream takes no more requests
                    conn.send(b"OK\n")
                    self.watchers.add(conn)
        except errors.RequestError as e:
            conn.pending = False
            conn.send(proto.encode(Err(error_code(e), text=str(e))))
            return
        except Exception as e:
            # A bug must cost this one request, never the connection's place in line
            # or the daemon: the state machine validates before it changes anything.
            log.exception("request %r of connection %d failed", line[:80], conn.cid)
            conn.pending = False
            conn.send(proto.encode(Err(ErrorCode.INTERNAL, text=f"{type(e).__name__}: {e}")))
            return
        self._apply(fx)  # always, once the state machine changed: before anything else
        if scope is not None and conn.wait_scope is scope and self._nursery is not None:
            self._nursery.start_soon(self._wait_timer, conn, scope)

    # ---- the parker's check -------------------------------------------------------------

    def _parker_checked(self, why: str) -> None:
        was = self.parker_check
        self.parker_check = ParkerCheck(self.parker.kind, self.parker.path, not why, why or None)
        if why and (was.ok or was.error != why):
            log.warning("parker cannot run: %s; REGISTERs that need it are refused", why)
        elif not why and not was.ok:
            log.warning("parker %s at %s runs now", self.parker.kind, self.parker.path)

    def _parker_recheck_due(self, req: proto.Register) -> bool:
        # Only while it cannot run, only for a REGISTER that needs it, and only when what
        # the last check found may have changed (the tool installed since): cheap (a PATH
        # lookup and a stat) while nothing changed, one bounded check when it did.
        if self.parker_check.ok or not policy.parker_needed(str(req.park), str(req.fallback)):
            return False
        return self.parker.changed()

    async def _check_parker(self) -> None:
        async with self._parker_lock:  # REGISTERs that came meanwhile share the check
            if not self.parker_check.ok and self.parker.changed():
                self._parker_checked(await self.parker.check(CHECK_TIMEOUT))

    async def _register_after_check(self, conn: Connection, req: proto.Register) -> None:
        """A REGISTER that needs the parker while it could not run: check it again
        (bounded), then register as `_dispatch` would, with the new verdict."""
        await self._check_parker()
        if self.conns.get(conn.cid) is not conn or conn.closing:
            return
        try:
            fx = self._ops.register(conn, req, self._clock(), self.parker_check.error or "")
        except errors.RequestError as e:
            self._reply(conn.cid, proto.encode(Err(error_code(e), text=str(e))))
            self._apply([])  # the connection's pipelined requests go on
            return
        except Exception as e:
            log.exception("REGISTER %s of connection %d failed", req.workload, conn.cid)
            text = f"{type(e).__name__}: {e}"
            self._reply(conn.cid, proto.encode(Err(ErrorCode.INTERNAL, text=text)))
            self._apply([])
            return
        self._apply(fx)

    async def _wait_timer(self, conn: Connection, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep_forever()
        if scope.cancelled_caught and conn.wait_scope is scope:
            conn.wait_scope = None
            self._apply(self.sm.wait_expired(conn.cid, self._clock()))

    # ---- effects ---------------------------------------------------------------------

    def _reply(self, cid: int, data: bytes) -> None:
        conn = self.conns.get(cid)
        if conn is None:
            return
        conn.send(data)
        conn.pending = False
        if conn.wait_scope is not None:
            conn.wait_scope.cancel()
            conn.wait_scope = None
        if conn.backlog and not conn.closing:
            self._resume.append(conn)

    def _apply(self, fx: list[Effect]) -> None:
        """Perform effects in order (Verify feeds its result back in place).

        A call made while effects are being performed only queues: one loop performs
        everything, then resumes, one request at a time, the connections whose pipelined
        requests may go on. However long a chain of requests, nothing recurses: the
        order is that of a depth-first walk (the connections a request resumed go before
        the rest of its own connection's pipeline), kept on an explicit stack of frames.
        """
        self._work.extend(fx)
        if self._applying:
            return
        self._applying = True
        self._ops.batch = {}
        frames, budget = self._frames, RESUME_BUDGET
        try:
            while True:
                while self._work:
                    e = self._work.popleft()
                    try:
                        self._perform(e)
                    except Exception as ex:
                        log.exception("performing %s failed", type(e).__name__)
                        self._work.extend(self._ops.failed(e, ex))
                if self._resume:
                    frames.append(self._resume)
                    self._resume = deque()
                while frames and not frames[-1]:
                    frames.pop()
                if not frames:
                    return
                if budget == 0:
                    # A burst of resumed pipelines (one event answering many waiters)
                    # must not hold the loop: the rest goes on after a checkpoint.
                    self._continue_later()
                    return
                conn = frames[-1][0]
                runnable = not (conn.pending or conn.closing or conn.dropped or conn.watching)
                if conn.backlog and runnable and conn.cid in self.conns:
                    budget -= 1
                    self._dispatch(conn, conn.backlog.popleft())
                else:
                    frames[-1].popleft()
        finally:
            self._applying = False
            self._ops.batch = None
            if self._lazy and not self._writing:
                self._write_behind()

    def _continue_later(self) -> None:
        if self._continuing or self._nursery is None:
            return
        self._continuing = True

        async def _go_on() -> None:
            await trio.lowlevel.checkpoint()
            self._continuing = False
            self._apply([])

        self._nursery.start_soon(_go_on)

    def _perform(self, e: Effect) -> None:
        nursery = self._nursery
        assert nursery is not None
        self._ops.reuse.performed(e)  # what it makes stale is never reused (`slicer.reuse`)
        match e:
            case Grant():
                fields = {
                    "turn": str(e.turn),
                    "restored": "1" if e.restored else "0",
                    "waited_ms": str(e.waited_ms),
                }
                self._reply(e.conn, proto.encode(Ok(fields)))
                self._ops.batch = {}  # the grantee may use its GPU from now on
            case Reply():
                self._reply(e.conn, proto.encode(Ok(e.fields)))
            case Deny():
                self._reply(e.conn, proto.encode(Err(error_code(e.error), text=str(e.error))))
            case Verify():
                token = self._ops.own(e.op, "verify")
                try:
                    self._work.extend(self._ops.verify(e))
                finally:
                    self._ops.disown(e.op, token)
            case Park() if e.mode == "cooperative":
                self._end_ask(e.op)
                token = self._ops.own(e.op, "verify-parked")
                try:
                    self._work.extend(self._ops.verify_parked(e))  # nothing to move: no task
                finally:
                    self._ops.disown(e.op, token)
            case Park():
                self._end_ask(e.op)
                nursery.start_soon(self._ops.park, e, self._ops.own(e.op, "park-task"))
            case Restore():
                nursery.start_soon(self._ops.restore, e, self._ops.own(e.op, "restore-task"))
            case Recover():
                nursery.start_soon(self._ops.recover_op, e, self._ops.own(e.op, "recover-task"))
            case AskPark():
                token = self._ops.own(e.op, "registrant")
                scope = trio.CancelScope()
                self._asks[e.op] = scope
                nursery.start_soon(self._ask_timer, e, token, scope)
                if (c := self.conns.get(e.conn)) is not None:
                    log.info("asking the registrant of %s to park it: %s", e.workload, e.why)
                    ms = int(e.timeout * 1000)
                    c.send(proto.encode(proto.ParkAsk(e.workload, e.turn, ms)))
            case Recheck():
                # One timer per GPU, the earliest asked for (a later one is covered: the
                # state machine asks again for whatever is still due after it).
                due = trio.current_time() + e.delay
                if due < self._recheck_due.get(e.gpu, math.inf):
                    self._recheck_due[e.gpu] = due
                    nursery.start_soon(self._recheck, e, due)
            case SendFault():
                log.error("FAULT %s turn=%d reason=%s: %s", e.workload, e.turn, e.reason, e.text)
                if (c := self.conns.get(e.conn)) is not None:
                    c.send(proto.encode(Fault(e.workload, e.turn, e.reason, e.text)))
            case SendWaiting():
                if (c := self.conns.get(e.conn)) is not None:
                    c.send(proto.encode(Waiting(e.workload, e.turn, e.waiters)))
            case SendEarly():
                if self.journal_error is not None:
                    # Not on disk: a restart would not know the head may hold early memory.
                    log.warning("early start of %s not sent: the journal is not written",
                                e.workload)  # fmt: skip
                    self._work.extend(self.sm.early_unsent(e.conn, self._clock()))
                elif (c := self.conns.get(e.conn)) is not None:
                    log.info("early start of %s: %d bytes", e.workload, e.nbytes)
                    c.send(proto.encode(proto.Early(e.workload, e.nbytes)))
                    if c.wait_scope is not None:  # its grant follows the park: keep waiting
                        c.wait_scope.deadline = max(
                            c.wait_scope.deadline, trio.current_time() + e.hold
                        )
            case SendPreempted():
                log.warning("preempted %s turn=%d (held past its max_turn)", e.workload, e.turn)
                if (c := self.conns.get(e.conn)) is not None:
                    c.send(proto.encode(proto.Preempted(e.workload, e.turn)))
            case Reap():
                nursery.start_soon(self._ops.reap, e)
            case Kill():
                # The processes the state machine chose: a faulted workload's that hold
                # the GPU, or an orphan's survivors (`Attribution.survivors`).
                n = self.host.kill_pids(list(e.pids))
                self._ops.batch = {}  # what the batch read of the GPUs is stale now
                log.error("killed %d processes of workload %s (faulted, or an orphan's "
                          "survivors)", n, e.workload)  # fmt: skip
            case Emit():
                if self.on_event is not None:
                    self.on_event(e.body)
                self._broadcast(e.body)
            case Persist() if e.lazy:
                self._lazy = True  # written once after the batch (`_write_behind`)
            case Persist():
                # Journaled before any later effect and reply of this batch (a restore
                # or a checkpointed park is on disk before the grant that follows it).
                self._persist()

    def _end_ask(self, op: int) -> None:
        if (scope := self._asks.pop(op, None)) is not None:
            scope.cancel()

    def _persist(self) -> None:
        # Inline: on disk before this returns (waits for a write-behind in flight).
        self._lazy = False
        seq = self.journal.next_seq()
        try:
            written = self.journal.write(self.journal.encode(self.sm.journal()), seq)
        except JournalError as e:
            self._journal_failed(e, seq)
            return
        self._journal_written(written)

    def _write_behind(self) -> None:
        # After a batch with lazy records, whose replies are queued already.
        if self._nursery is None:
            self._persist()
            return
        self._writing = True
        self._nursery.start_soon(self._writer)

    async def _writer(self) -> None:
        # One document for every batch since the last: encoded after those batches'
        # replies left (a checkpoint lets the connections' writers go first), written by a
        # worker thread where it is fsynced (the fsyncs hold no loop), else inline (cheap,
        # and no thread under a test's fake clock).
        try:
            while self._lazy:
                await trio.lowlevel.checkpoint()
                if not self._lazy:
                    break  # an inline save came first
                self._lazy = False
                data, seq = self.journal.encode(self.sm.journal()), self.journal.next_seq()
                try:
                    if self.journal.fsync:
                        written = await trio.to_thread.run_sync(self.journal.write, data, seq)
                    else:
                        written = self.journal.write(data, seq)
                except JournalError as e:
                    self._journal_failed(e, seq)
                else:
                    self._journal_written(written)
        finally:
            self._writing = False

    def _journal_failed(self, e: JournalError, seq: int) -> None:
        self._failed_seq = max(self._failed_seq, seq)
        if self.journal_error is None:
            log.error("%s; serving from memory, retrying every %.0f s", e, JOURNAL_RETRY)
        self.journal_error = str(e)
        if not self._journal_retrying and self._nursery is not None:
            self._journal_retrying = True
            self._nursery.start_soon(self._journal_retry)

    def _journal_written(self, seq: int) -> None:
        # Only a document at least as new as the last that failed clears the error.
        if self.journal_error is not None and seq >= self._failed_seq:
            log.warning("journal %s written again", self.journal.path)
            self.journal_error = None

    async def _journal_retry(self) -> None:
        try:
            while self.journal_error is not None:
                await trio.sleep(JOURNAL_RETRY)
                self._persist()
        finally:
            self._journal_retrying = False

    def _broadcast(self, body: dict[str, Any]) -> None:
        if not self.watchers:
            return
        line = proto.encode(proto.Event(body))
        for c in list(self.watchers):
            c.send(line)

    async def _ask_timer(self, e: AskPark, token: object, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(e.timeout)
        if scope.cancelled_caught:
            self._ops.disown(e.op, token)  # answered: the op went on without this timer
            return
        self._asks.pop(e.op, None)
        self._ops.report(e.op, token, lambda: self.sm.ask_expired(e.op, self._clock()))

    async def _recheck(self, e: Recheck, due: float) -> None:
        await trio.sleep_until(due)
        if self._recheck_due.get(e.gpu) == due:
            del self._recheck_due[e.gpu]
        try:
            self._apply(self.sm.recheck(e.gpu, self._clock()))
        except Exception:  # a timer must never take the daemon down
            log.exception("recheck of GPU %d failed", e.gpu)

    # ---- status ----------------------------------------------------------------------

    def _children_map(self) -> dict[int, list[int]] | None:
        # Only where the kernel lacks /proc/PID/task/TID/children: then one whole-/proc
        # pass is shared by every STATUS within CHILDREN_TTL, so a flood of STATUS costs
        # one pass per interval, not one per request.
        if self.host.HAS_CHILDREN_FILES:
            return None
        at, kids = self._children
        now = time.monotonic()
        if now - at > CHILDREN_TTL:
            kids = self.host.children_map()
            self._children = (now, kids)
        return kids

    @property
    def ops(self) -> GpuOps:
        """The GPU operations and measurements (the metrics read GPUs through it)."""
        return self._ops

    def status(self) -> dict[str, Any]:
        """The STATUS body: version, uptime, GPUs (with who performs the operation in
        flight), workloads (with live pids), journal health, totals."""
        body = self.sm.status()
        workloads = self.sm.workloads()
        children = self._children_map() if any(w.tree for w in workloads) else {}
        for entry, w in zip(body["workloads"], workloads, strict=True):
            entry["pids"] = self.host.tree((w.pid, int(w.start_time)), w.tree, children)
            # Those seen holding its GPU memory (and their parents up to its root), in its
            # tree or not any more: killed if they outlive its registered process.
            entry["gpu_pids"] = self._ops.attr.survivors(w.wid) if w.tree else []
        for entry in body["gpus"]:
            op = self.sm.gpus[entry["index"]].op
            owner = self._ops.owners.get(op.op_id) if op is not None else None
            entry["op_owner"] = owner[1] if owner is not None else None
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "connections": len(self.conns),
            "tools_running": self.parker.runner.running,
            "parker": self.parker.kind,  # cuda-checkpoint CLI, or the driver API's helper
            # Whether it can run: {kind, path, ok, error} (a REGISTER that needs it is
            # refused while it cannot).
            "parker_check": self.parker_check.body(),
            # How device memory is attributed: by the backend's pids, or by elimination.
            "census": self._ops.attr.census,
            "journal": {
                "path": str(self.journal.path),
                "ok": self.journal_error is None,
                "error": self.journal_error,
            },
            **body,
        }
