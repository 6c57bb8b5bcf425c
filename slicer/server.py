"""The trio server: Unix socket, framing, peer credentials, and the effects executor.

The server decides nothing. It parses a line, asks `SlicerState`, and performs the effects
it gets back in order: replies and events go into each connection's bounded outbox (a
client that stops reading is dropped, never waited for); parks, restores and recoveries
run as tasks, one GPU never waiting for another; verification reads the GPU backend inline.
What it measures (a census of a GPU, how a tool run ended, which processes live, the
driver's state of each) goes back to `SlicerState` as readings (`slicer.readings`); the
state machine decides what they mean, also whether a connection is admitted and when a
faulted workload is killed. The GPU backend, the parker, the process table (`host`) and
the clock are injected, so tests run this very code in-process.

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
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.proto import Err, ErrorCode, Fault, Ok, Waiting
from gpu_slicer.slicer import __version__, census, errors, procs, recovery
from gpu_slicer.slicer.config import Config
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
    SendFault,
    SendWaiting,
    Verify,
)
from gpu_slicer.slicer.gpu import GpuBackend
from gpu_slicer.slicer.journal import Journal, JournalError
from gpu_slicer.slicer.park import Parker
from gpu_slicer.slicer.readings import (
    Census,
    Outcome,
    ParkReport,
    RecoverReport,
    RestoreReport,
    Unreadable,
)
from gpu_slicer.slicer.state import ProcessInfo, SlicerState

log = logging.getLogger("slicer.server")

OUTBOX = 1024  # lines; a watcher further behind than this is dropped
MAX_BACKLOG = 64  # requests pipelined behind one that waits
RESUME_BUDGET = 16  # pipelined requests resumed before the loop yields to other tasks
REAP_EVERY = 0.25
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
}


def _now() -> float:
    # The state machine's clock: event timestamps are CLOCK_MONOTONIC seconds, which a
    # client on the same node can compare with its own time.monotonic() (trio's clock
    # carries a random offset). Timers and deadlines still use trio's clock.
    return time.monotonic()


def error_code(error: errors.RequestError) -> ErrorCode:
    """The wire code of a refusal (the protocol edge)."""
    return _CODES.get(type(error), ErrorCode.BAD_REQUEST)


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class Connection:
    """One client: its stream, outbox, and the request it is waiting on."""

    def __init__(self, cid: int, stream: trio.SocketStream, pid: int, uid: int) -> None:
        self.cid, self.stream, self.pid, self.uid = cid, stream, pid, uid
        self.outbox, self._inbox = trio.open_memory_channel[bytes](OUTBOX)
        self.pending = False
        self.backlog: deque[bytes] = deque()
        self.watching = False
        self.wait_scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None
        self.dropped = ""
        self.closing = False  # its reader ended: nothing of its pipeline runs any more
        self.queued = 0  # lines in the outbox or being written by the writer

    def send(self, data: bytes) -> None:
        """Send one line now if the socket takes it, else queue it for the writer; drop
        the connection when its outbox is full."""
        if self.dropped:
            return
        if self.queued == 0:
            # Nothing is queued, so writing directly keeps the order and saves the trip
            # through the writer task (most replies leave here, within microseconds).
            try:
                sent = os.write(self.stream.socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.drop("peer closed")
                return
            if sent == len(data):
                return
            data = data[sent:]
        try:
            self.outbox.send_nowait(data)
            self.queued += 1
        except trio.WouldBlock:
            self.drop("client stopped reading")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the connection is closing; its handler cleans up

    def drop(self, why: str) -> None:
        """Close the connection from our side."""
        if not self.dropped:
            self.dropped = why
            log.warning("dropping connection %d (pid %d): %s", self.cid, self.pid, why)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    async def writer(self, write_timeout: float) -> None:
        """Send queued lines, batching whatever is ready; drop on a stuck peer."""
        async with self._inbox:
            async for first in self._inbox:
                batch = [first]
                while True:
                    try:
                        batch.append(self._inbox.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                with trio.move_on_after(write_timeout) as cs:
                    try:
                        await self.stream.send_all(b"".join(batch))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self.drop("peer closed")
                        return
                self.queued -= len(batch)
                if cs.cancelled_caught:
                    self.drop(f"write blocked for {write_timeout}s")
                    return


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
        # op id -> (token, what): who performs the GPU operation in flight.
        self._owners: dict[int, tuple[object, str]] = {}
        self._asks: dict[int, trio.CancelScope] = {}
        self.journal_error: str | None = None
        self._journal_retrying = False
        self._children: tuple[float, dict[int, list[int]]] = (-1.0, {})

    # ---- lifecycle -------------------------------------------------------------------

    async def run(
        self,
        listener: trio.SocketListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Recover from the journal, then serve `listener` until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            note = await self.parker.probe()
            if note:
                log.warning("%s", note)
            self._recover()
            await nursery.start(trio.serve_listeners, self._handle, [listener])
            task_status.started()

    def _recover(self) -> None:
        entries = self._entries
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
            roots = [
                census.Root(i, int(e["pid"]), int(e["start_time"]), bool(e["tree"]))
                for i, e in enumerate(group)
            ]
            try:
                taken = census.take(self.backend.processes(gpu), roots, self.host.ancestry)
            except Exception as ex:
                log.error("cannot read GPU %d during recovery: %s", gpu, ex)
                for e in group:
                    e["resident_bytes"] = None  # unread (the state machine decides)
                continue
            for i, e in enumerate(group):
                e["resident_bytes"] = taken.of(i)
        log.info("recovered %d journaled workloads", sum(1 for e in entries if e["alive"]))
        self._apply(self.sm.adopt_journal(entries, self._clock()))

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
            with trio.move_on_after(1):
                await stream.send_all(proto.encode(Err(ErrorCode.LIMIT, text=str(refused))))
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()
            return
        conn = Connection(cid, stream, pid, uid)
        self.conns[conn.cid] = conn
        flush = False
        try:
            async with trio.open_nursery() as n:
                conn.nursery = n
                n.start_soon(conn.writer, self.cfg.write_timeout)
                flush = await self._reader(conn)
                conn.closing = True
                conn.backlog.clear()
                if flush:
                    conn.outbox.close()  # the writer sends what is queued, then ends
                else:
                    n.cancel_scope.cancel()
            if flush and not conn.dropped:
                await self._linger(stream)
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

    @staticmethod
    async def _linger(stream: trio.SocketStream) -> None:
        # Closing with unread input makes the kernel send RST, which can destroy the ERR
        # we just sent: half-close, then discard input briefly (bounded) before closing.
        with trio.move_on_after(1):
            try:
                await stream.send_eof()
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _reader(self, conn: Connection) -> bool:
        """Read lines until EOF (False) or a line too long (True: flush the ERR, close)."""
        buf = proto.LineBuffer()
        while True:
            try:
                data = await conn.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            if not data:
                return False
            try:
                lines = buf.feed(data)
            except proto.LineTooLong as e:
                conn.send(proto.encode(Err.from_error(e)))
                return True
            for i, line in enumerate(lines):
                if conn.watching:
                    break  # a WATCH stream takes no more requests
                if conn.pending or conn.backlog:
                    # Behind a request that waits: the rest of what arrived is queued at
                    # once, in order, so a resume never finds a half-read pipeline.
                    rest = lines[i:]
                    if len(conn.backlog) + len(rest) > MAX_BACKLOG:
                        conn.drop(f"more than {MAX_BACKLOG} requests pipelined")
                        return False
                    conn.backlog.extend(rest)
                    break
                self._dispatch(conn, line)
                if i + 1 < len(lines) and not conn.pending:
                    # One connection's burst never holds the loop: every other connection
                    # (and the watchdog) gets its turn between two of its answered lines.
                    await trio.lowlevel.checkpoint()

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
                    fx = self._register(conn, req, now)
                case proto.Acquire():
                    conn.pending = True
                    fx = self.sm.acquire(conn.cid, req.workload, now)
                    if req.wait is not None:
                        # The scope exists before the effects run, so a grant among them
                        # cancels it (a stale timer must never expire a later ACQUIRE of
                        # the same connection); its task starts once they ran.
                        scope = trio.CancelScope(deadline=trio.current_time() + req.wait)
                        conn.wait_scope = scope
                case proto.Release():
                    conn.pending = True
                    park_now = req.park is proto.ReleasePark.NOW
                    fx = self.sm.release(conn.cid, req.workload, req.turn, park_now, now)
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

    def _register(self, conn: Connection, req: proto.Register, now: float) -> list[Effect]:
        gpu = self.sm.resolve_gpu(req.gpu)
        pid = req.pid if req.pid is not None else conn.pid
        start, uid = self.host.start_time(pid), self.host.owner_uid(pid)
        if start is None or uid is None:
            raise errors.NoSuchProcess(f"no live process {pid}")
        info = ProcessInfo(pid=pid, start_time=start, uid=uid)
        # Measure what the new workload already holds (before it is known, its memory
        # would read as foreign): a probe root with a wid no workload has.
        probe = [census.Root(0, pid, start, req.tree)]
        taken = census.take(self.backend.processes(gpu), probe, self.host.ancestry)
        return self.sm.register(
            conn.cid,
            req.workload,
            gpu,
            info,
            req.tree,
            str(req.park),
            req.parked_max,
            taken.of(0),
            now,
            fallback=str(req.fallback),
            sharing=self._sharing((pid, start), req.tree),
            ask=req.ask,
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
        frames, budget = self._frames, RESUME_BUDGET
        try:
            while True:
                while self._work:
                    e = self._work.popleft()
                    try:
                        self._perform(e)
                    except Exception as ex:
                        log.exception("performing %s failed", type(e).__name__)
                        self._work.extend(self._failed(e, ex))
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
        match e:
            case Grant():
                fields = {
                    "turn": str(e.turn),
                    "restored": "1" if e.restored else "0",
                    "waited_ms": str(e.waited_ms),
                }
                self._reply(e.conn, proto.encode(Ok(fields)))
            case Reply():
                self._reply(e.conn, proto.encode(Ok(e.fields)))
            case Deny():
                self._reply(e.conn, proto.encode(Err(error_code(e.error), text=str(e.error))))
            case Verify():
                token = self._own(e.op, "verify")
                try:
                    seen, free = self._read_gpu(e)
                    self._work.extend(self.sm.verified(e.op, seen, self._clock(), free))
                finally:
                    self._disown(e.op, token)
            case Park() if e.mode == "cooperative":
                self._end_ask(e.op)
                token = self._own(e.op, "verify-parked")
                try:
                    self._work.extend(self._verify_parked(e))  # nothing to move: no task
                finally:
                    self._disown(e.op, token)
            case Park():
                self._end_ask(e.op)
                nursery.start_soon(self._park, e, self._own(e.op, "park-task"))
            case Restore():
                nursery.start_soon(self._restore, e, self._own(e.op, "restore-task"))
            case Recover():
                nursery.start_soon(self._recover_op, e, self._own(e.op, "recover-task"))
            case AskPark():
                token = self._own(e.op, "registrant")
                scope = trio.CancelScope()
                self._asks[e.op] = scope
                nursery.start_soon(self._ask_timer, e, token, scope)
                if (c := self.conns.get(e.conn)) is not None:
                    log.info("asking the registrant of %s to park it", e.workload)
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
            case Reap():
                nursery.start_soon(self._reap, e)
            case Kill():
                # Only the processes that hold the GPU (the state machine chose them).
                n = self.host.kill_pids(list(e.pids))
                log.error("killed %d GPU processes of faulted workload %s", n, e.workload)
            case Emit():
                self._broadcast(e.body)
            case Persist():
                # Journaled before any later reply of this batch leaves (a grant must
                # never reach a client before the park it follows is on disk).
                self._persist()

    def _failed(self, e: Effect, ex: Exception) -> list[Effect]:
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

    def _own(self, op: int, what: str) -> object:
        token = object()
        self._owners[op] = (token, what)
        return token

    def _disown(self, op: int, token: object) -> None:
        if self._owners.get(op, (None, ""))[0] is token:
            del self._owners[op]

    def _report(self, op: int, token: object, call: Callable[[], list[Effect]]) -> None:
        """Feed a task's result to the state machine; the task stays the op's owner
        until the result is in."""
        try:
            self._apply(call())
        except Exception:
            log.exception("reporting the result of op %d failed", op)
        finally:
            self._disown(op, token)

    def _end_ask(self, op: int) -> None:
        if (scope := self._asks.pop(op, None)) is not None:
            scope.cancel()

    def _persist(self) -> None:
        try:
            self.journal.save(self.sm.journal())
        except JournalError as e:
            if self.journal_error is None:
                log.error("%s; serving from memory, retrying every %.0f s", e, JOURNAL_RETRY)
            self.journal_error = str(e)
            if not self._journal_retrying and self._nursery is not None:
                self._journal_retrying = True
                self._nursery.start_soon(self._journal_retry)
            return
        if self.journal_error is not None:
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

    def _roots(self, gpu: int) -> list[census.Root]:
        return [
            census.Root(w.wid, w.pid, int(w.start_time), w.tree)
            for w in self.sm.workloads()
            if w.gpu == gpu
        ]

    def _census(self, gpu: int) -> Census:
        return census.take(self.backend.processes(gpu), self._roots(gpu), self.host.ancestry)

    def _bytes_of(self, gpu: int, wid: int, reason: str) -> int | Unreadable:
        """Workload `wid`'s device bytes on `gpu` now, or why they could not be read."""
        try:
            return self._census(gpu).of(wid)
        except Exception as ex:
            return Unreadable(reason, str(ex)[:300])

    def _read_gpu(self, e: Verify) -> tuple[Census | Unreadable, int | None]:
        """The census of `e.gpu` and, when the grant needs room, its free bytes."""
        try:
            seen = self._census(e.gpu)
            return seen, (self.backend.free_bytes(e.gpu) if e.need else None)
        except Exception as ex:
            log.error("GPU %d cannot be verified: %s", e.gpu, ex)
            return Unreadable("backend-error", str(ex)[:200]), None

    def _ms_since(self, t0: float) -> int:
        return int((self._clock() - t0) * 1000)

    async def _park(self, e: Park, token: object) -> None:
        t0 = self._clock()
        before, error = 0, ""
        parked: tuple[procs.Ident, ...] = ()
        tool: Outcome | None = None
        alive: tuple[bool, ...] = ()
        try:
            seen = self._census(e.gpu)
            before = seen.of(e.wid)
            pids = seen.pids_by_wid.get(e.wid, [])
            parked = tuple((p, st) for p in pids if (st := self.host.start_time(p)) is not None)
            if parked:
                # Journaled before the tool runs: a daemon killed from here on finds the
                # processes in the journal and asks the driver how far the park got.
                self._apply(self.sm.park_started(e.op, parked, before))
                durable = self.journal_error is None
                fx, go = self.sm.park_journaled(e.op, durable, self._clock())
                if not go:
                    self._report(e.op, token, lambda: fx)
                    return
                tool = await self.parker.park([p for p, _ in parked], self.cfg.park_timeout)
                alive = tuple(self.host.alive(p) for p in parked)
        except Exception as ex:
            error = str(ex)[:300]
        after = self._bytes_of(e.gpu, e.wid, "park-error")
        report = ParkReport(self._ms_since(t0), before, parked, tool, alive, after, error)
        self._report(e.op, token, lambda: self.sm.park_done(e.op, report, self._clock()))

    def _verify_parked(self, e: Park) -> list[Effect]:
        """A cooperative park: the workload freed the GPU itself; it is checked through
        the backend, never on its word."""
        t0 = self._clock()
        after = self._bytes_of(e.gpu, e.wid, "park-error")
        report = ParkReport(ms=self._ms_since(t0), after=after)
        return self.sm.park_done(e.op, report, self._clock())

    async def _restore(self, e: Restore, token: object) -> None:
        t0 = self._clock()
        live = tuple((p, st) for p, st in e.procs if self.host.start_time(p) == st)
        tool: Outcome | None = None
        error = ""
        try:
            if live:
                tool = await self.parker.restore([p for p, _ in live], self.cfg.restore_timeout)
        except Exception as ex:
            error = str(ex)[:300]
        report = RestoreReport(ms=self._ms_since(t0), live=live, tool=tool, error=error)
        self._report(e.op, token, lambda: self.sm.restore_done(e.op, report, self._clock()))

    async def _recover_op(self, e: Recover, token: object) -> None:
        bound = max(self.cfg.park_timeout, self.cfg.restore_timeout)
        try:
            reading = await recovery.read(self.parker, e.procs, bound, e.root, self.host)
            plan = self.sm.recovery_plan(e.op, reading)
            steps = await recovery.perform(self.parker, plan.steps, bound)
            after = self._bytes_of(e.gpu, e.wid, "recover-error")
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
        self._report(e.op, token, lambda: self.sm.recover_done(e.op, report, self._clock()))

    async def _ask_timer(self, e: AskPark, token: object, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(e.timeout)
        if scope.cancelled_caught:
            self._disown(e.op, token)  # answered: the op went on without this timer
            return
        self._asks.pop(e.op, None)
        self._report(e.op, token, lambda: self.sm.ask_expired(e.op, self._clock()))

    async def _recheck(self, e: Recheck, due: float) -> None:
        await trio.sleep_until(due)
        if self._recheck_due.get(e.gpu) == due:
            del self._recheck_due[e.gpu]
        try:
            self._apply(self.sm.recheck(e.gpu, self._clock()))
        except Exception:  # a timer must never take the daemon down
            log.exception("recheck of GPU %d failed", e.gpu)

    async def _reap(self, e: Reap) -> None:
        # Reads and reports until the state machine says stop; it decides what the
        # readings mean, and when a faulted workload's processes are killed (`Kill`).
        ident = (e.pid, int(e.start_time))
        while True:
            alive = self.host.alive(ident)
            nbytes: int | None = None  # unread: the GPU stays taken
            holders: tuple[int, ...] = ()
            try:
                taken = self._census(e.gpu)
                nbytes, holders = taken.of(e.wid), tuple(taken.pids_by_wid.get(e.wid, []))
            except Exception:
                pass
            try:
                fx, done = self.sm.memory_report(e.wid, alive, nbytes, self._clock(), holders)
                self._apply(fx)
            except Exception:  # a reaper must never take the daemon down
                log.exception("reaping %s failed", e.workload)
                done = False
            if done:
                return
            await trio.sleep(REAP_EVERY)

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

    def status(self) -> dict[str, Any]:
        """The STATUS body: version, uptime, GPUs (with who performs the operation in
        flight), workloads (with live pids), journal health, totals."""
        body = self.sm.status()
        workloads = self.sm.workloads()
        children = self._children_map() if any(w.tree for w in workloads) else {}
        for entry, w in zip(body["workloads"], workloads, strict=True):
            entry["pids"] = self.host.tree((w.pid, int(w.start_time)), w.tree, children)
        for entry in body["gpus"]:
            op = self.sm.gpus[entry["index"]].op
            owner = self._owners.get(op.op_id) if op is not None else None
            entry["op_owner"] = owner[1] if owner is not None else None
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "connections": len(self.conns),
            "tools_running": self.parker.runner.running,
            "journal": {
                "path": str(self.journal.path),
                "ok": self.journal_error is None,
                "error": self.journal_error,
            },
            **body,
        }


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
