"""The turn loop of one replica: acquire, wake, load whole, serve, sleep, release.

Theory of operation
-------------------
:class:`TurnLoop` owns one vLLM replica (a :class:`~dispatcher.vllm.Replica`) and one
slicerd connection. It never polls: it waits on ``_changed`` (a broadcast event set by
:meth:`TurnLoop.accept`, by every finished send and by a WAITING event), bounded by one
second so a rejected send is retried and a missed wake-up costs at most a second. A
separate ticker expires deadlines every second (``Store.expire``) and cancels the send of
an expired request through that request's own cancel scope.

A turn, while anything is pending (each phase is logged with its duration)::

    ACQUIRE (wait=acquire_wait, then again)       slicerd grants the GPU
    recover()  on first sight / after a broken load or a replica error
    wake()     <= wake_timeout
    loop:  revision = core.next_revision(...)     prefer the loaded one (no reload)
           load(revision) as a whole              <= load_timeout, only with no send in flight
           send pending requests of it            <= concurrency at once, each bounded by
                                                     its deadline, committed by result_ok
           until nothing is pending, or WAITING was seen and turn_seconds passed since
           serving began, or the replica failed
    grace      sends in flight get turn_grace, then are cancelled (they stay pending)
    sleep(level=1, mode=abort)                    <= sleep_timeout, shielded
    RELEASE                                       shielded, bounded

The end of a turn (sleep, then RELEASE) runs shielded from cancellation, so SIGTERM
during a turn still puts vLLM to sleep and hands the GPU back before the process exits.
Any slicerd or replica failure ends the turn the same way; the requests stay pending and
the loop backs off (0.5 s doubling to 5 s) before it tries again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

import proto
from dispatcher.core import TurnPlan, next_revision, request_body, result_ok, weight_versions
from dispatcher.errors import DispatchError, NotFound, ReplicaError, UnknownRevision
from dispatcher.store import Pending, Result, Revision, Store
from dispatcher.vllm import Replica
from slicer.client import AsyncSlicer, ClientError, Turn

__all__ = ["Counters", "TurnConfig", "TurnLoop"]

log = logging.getLogger("dispatcher.turns")

RETRY_AFTER_S = 1.0  # a rejected or failed send is tried again after this
RELEASE_TIMEOUT_S = 30.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 5.0
_PERMANENT = (400, 422)  # vLLM refused the request itself: retrying cannot help


@dataclass(frozen=True)
class TurnConfig:
    """What the loop was told (the ``slicer-dispatch`` options)."""

    workload: str
    socket: str | None = None
    model: str | None = None  # served model name sent to vLLM; None: vLLM's default
    turn_seconds: float = 30.0
    turn_grace: float = 10.0
    sample_deadline: float = 3600.0
    concurrency: int = 64
    acquire_wait: float = 60.0
    wake_timeout: float = 300.0
    load_timeout: float = 1800.0
    sleep_timeout: float = 300.0


@dataclass
class Counters:
    """Monotonic counters for /status and /metrics."""

    turns: int = 0
    turn_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    sends: int = 0
    commits: int = 0
    expired: int = 0
    refused_by_replica: int = 0
    rejects: Counter[str] = field(default_factory=Counter)


@dataclass
class _TurnState:
    turn: Turn
    waiting_seen_at: float | None = None  # trio clock
    serving_since: float | None = None  # trio clock
    replica_failed: str | None = None


def _reject_reason(body: dict[str, Any], p: Pending, epoch_at_send: int, epoch_now: int) -> str:
    """Why :func:`core.result_ok` refused ``body`` (a metrics label)."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != (p.params.get("n") or 1):
        return "choices"
    if any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
        return "aborted"
    if epoch_at_send != epoch_now:
        return "epoch"
    if any(not spans for spans in weight_versions(body)):
        return "no_weight_versions"
    return "weight_version"


async def _connect_default(path: str | None) -> AsyncSlicer:
    return await AsyncSlicer.connect(path)


class TurnLoop:
    """The pending queue's front door and the turn loop of one replica.

    ``connect`` makes a new slicerd connection (injectable for tests); the loop keeps one
    connection open across turns and makes a new one after it broke.
    """

    def __init__(
        self,
        store: Store,
        replica: Replica,
        cfg: TurnConfig,
        *,
        connect: Callable[[], Awaitable[AsyncSlicer]] | None = None,
    ) -> None:
        self.store = store
        self.replica = replica
        self.cfg = cfg
        self.counters = Counters()
        self.state = "idle"
        self.turn: int | None = None
        self._connect = connect or (lambda: _connect_default(cfg.socket))
        self._slicer: AsyncSlicer | None = None
        self._needs_recover = True  # first sight of the replica
        self._changed = trio.Event()
        self._finished: dict[str, trio.Event] = {}
        self._in_flight: dict[str, trio.CancelScope] = {}
        self._retry_at: dict[str, float] = {}
        self._current: _TurnState | None = None

    # -- the front door (called by the HTTP front) -----------------------------------

    def accept(self, kind: str, body: dict[str, Any]) -> Pending:
        """Validate and journal a request, then wake the loop. Raises DispatchError."""
        p = self.store.accept(kind, body, None, self.cfg.sample_deadline)
        self._signal()
        return p

    def publish(self, revision: str, path: str) -> tuple[Revision, bool]:
        """Publish weights ``revision`` at ``path``; (revision, newly published)."""
        try:
            self.store.revision(revision)
            created = False
        except UnknownRevision:
            created = True
        rev = self.store.publish(revision, path)
        self._signal()
        return rev, created

    async def wait_result(self, id: str, timeout: float) -> Result:
        """The sample ``id`` once it is finished, or as it stands after ``timeout`` s."""
        result = self.store.get(id)
        if result.status == "pending" and timeout > 0:
            event = self._finished.setdefault(id, trio.Event())
            with trio.move_on_after(timeout):
                await event.wait()
            result = self.store.get(id)
        return result

    def status(self) -> dict[str, Any]:
        """The loop's state for ``GET /status``."""
        cur = self._current
        newest = self.store.newest()
        return {
            "pool": self.store.pool,
            "workload": self.cfg.workload,
            "replica": self.replica.base_url,
            "loaded_revision": self.replica.known_version,
            "newest_revision": newest.name if newest else None,
            "state": self.state,
            "turn": self.turn,
            "waiting_seen": bool(cur and cur.waiting_seen_at is not None),
            "in_flight": len(self._in_flight),
            "pending": {r: len(self.store.pending(r)) for r in self.store.pending_revisions()},
            "counts": self.store.counts(),
            "counters": {**vars(self.counters), "rejects": dict(self.counters.rejects)},
        }

    # -- plumbing --------------------------------------------------------------------

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self, timeout: float) -> None:
        event = self._changed
        with trio.move_on_after(max(0.0, timeout)):
            await event.wait()

    def _done(self, id: str) -> None:
        self._retry_at.pop(id, None)
        event = self._finished.pop(id, None)
        if event is not None:
            event.set()

    async def _drop_connection(self) -> None:
        if self._slicer is not None:
            slicer, self._slicer = self._slicer, None
            with trio.CancelScope(shield=True):
                await slicer.aclose()

    # -- the tasks -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the ticker and the turn loop until cancelled (a held turn is ended)."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._ticker)
                task_status.started()
                await self._loop()
        finally:
            await self._drop_connection()

    async def _ticker(self) -> None:
        """Every second: fail requests past their deadline, cancel their sends."""
        while True:
            try:
                expired = self.store.expire(time.time())
            except DispatchError as e:
                log.error("expire failed (retried in 1 s): %s", e)
                expired = []
            for p in expired:
                self.counters.expired += 1
                scope = self._in_flight.get(p.id)
                if scope is not None:
                    scope.cancel()
                log.warning("%s", self.store.deadline_error(p, time.time()) + f" (id {p.id})")
                self._done(p.id)
            if expired:
                self._signal()
            await trio.sleep(1.0)

    async def _loop(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            if not self.store.counts()["pending"]:
                self.state = "idle"
                await self._wait_change(1.0)
                continue
            try:
                await self._one_turn()
                backoff = BACKOFF_MIN_S
            except (ClientError, DispatchError) as e:
                self.counters.turn_errors += 1
                self.state = "backoff"
                log.error("turn failed (%s: %s); retrying in %.1f s", type(e).__name__, e, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _one_turn(self) -> None:
        if self._slicer is None:
            self._slicer = await self._connect()
        slicer = self._slicer
        self.state = "acquiring"
        t0 = time.monotonic()
        try:
            turn = await slicer.acquire(self.cfg.workload, wait=self.cfg.acquire_wait)
        except ClientError as e:
            if e.code == "timeout":
                log.info("ACQUIRE %s: not granted within %g s; again", self.cfg.workload,
                         self.cfg.acquire_wait)  # fmt: skip
                return
            if e.code == "unreachable":
                await self._drop_connection()
            raise
        except BaseException:
            await self._drop_connection()  # a cut-off request leaves the stream out of step
            raise
        cur = _TurnState(turn)
        if any(isinstance(m, proto.Waiting) and m.turn == turn.turn for m in slicer.events):
            cur.waiting_seen_at = trio.current_time()
        slicer.events.clear()
        self._current, self.turn = cur, turn.turn
        self.counters.turns += 1
        log.info("turn %d: granted after %.3f s (restored=%d)", turn.turn,
                 time.monotonic() - t0, turn.restored)  # fmt: skip
        reason = "error"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_events, slicer, cur)
                await self._prepare(cur)
                reason = await self._serve(cur)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._end_turn(slicer, cur, reason)

    async def _read_events(self, slicer: AsyncSlicer, cur: _TurnState) -> None:
        """Read slicerd's lines during the turn: WAITING marks the turn's end window."""
        while True:
            msg = await slicer.next_message()
            if isinstance(msg, proto.Waiting) and msg.turn == cur.turn.turn:
                if cur.waiting_seen_at is None:
                    cur.waiting_seen_at = trio.current_time()
                    log.info("turn %d: WAITING (%d waiter(s))", msg.turn, msg.waiters)
                    self._signal()
            elif isinstance(msg, proto.Fault):
                log.warning("FAULT for %s (the registrant handles it)", msg.workload)

    async def _prepare(self, cur: _TurnState) -> None:
        if self._needs_recover:
            self.state = "recovering"
            t0 = time.monotonic()
            await self.replica.recover()
            self._needs_recover = False
            log.info("turn %d: recovered the replica in %.3f s", cur.turn.turn,
                     time.monotonic() - t0)  # fmt: skip
        self.state = "waking"
        t0 = time.monotonic()
        await self.replica.wake(self.cfg.wake_timeout)
        log.info("turn %d: woke in %.3f s", cur.turn.turn, time.monotonic() - t0)

    # -- serving ---------------------------------------------------------------------

    def _sendable(self, p: Pending, now: float) -> bool:
        return p.id not in self._in_flight and self._retry_at.get(p.id, 0.0) <= now

    def _choose(self, now: float) -> str | None:
        """The revision to work on: core.next_revision, unless the loaded one has only
        requests that wait for a retry while another revision has work."""
        revs = self.store.pending_revisions()
        loaded = self.replica.known_version
        want = next_revision(revs, loaded)
        stuck = want is not None and want == loaded and not self._in_flight
        if stuck and not any(self._sendable(p, now) for p in self.store.pending(loaded)):
            others = [r for r in revs if r != loaded]
            return others[0] if others else want
        return want

    async def _serve(self, cur: _TurnState) -> str:
        """Load and send until the turn should end; returns why it ended."""
        n = cur.turn.turn
        async with trio.open_nursery() as sends:
            while True:
                now = trio.current_time()
                pending = self.store.counts()["pending"]
                if cur.replica_failed:
                    reason = "replica-error"
                    break
                if cur.serving_since is not None and TurnPlan.should_end(
                    now, cur.serving_since, cur.waiting_seen_at, pending, self.cfg.turn_seconds
                ):
                    reason = "idle" if pending == 0 else "waiting"
                    break
                if pending == 0:
                    reason = "idle"
                    break
                want = self._choose(now)
                if want is not None and want != self.replica.known_version:
                    if not self._in_flight:  # loads are whole, and never under a send
                        await self._load(cur, want)
                        continue
                elif want is not None:
                    if cur.serving_since is None:
                        cur.serving_since = now
                        self.state = "serving"
                        log.info("turn %d: serving revision %s (%d pending)", n, want, pending)
                    self._fill(sends, want, now)
                ends = TurnPlan(self.cfg.turn_seconds).ends_at(
                    cur.serving_since or now, cur.waiting_seen_at
                )
                timeout = RETRY_AFTER_S if ends is None else min(RETRY_AFTER_S, ends - now)
                await self._wait_change(timeout)
            if self._in_flight:
                self.state = "grace"
                log.info("turn %d: ending (%s); %d send(s) in flight get %g s", n, reason,
                         len(self._in_flight), self.cfg.turn_grace)  # fmt: skip
                with trio.move_on_after(self.cfg.turn_grace):
                    while self._in_flight:
                        await self._wait_change(RETRY_AFTER_S)
                if self._in_flight:
                    log.info("turn %d: cancelling %d send(s); they stay pending", n,
                             len(self._in_flight))  # fmt: skip
                sends.cancel_scope.cancel()
        return reason

    async def _load(self, cur: _TurnState, revision: str) -> None:
        self.state = "loading"
        rev = self.store.revision(revision)
        t0 = time.monotonic()
        log.info("turn %d: loading revision %s from %s", cur.turn.turn, revision, rev.path)
        try:
            await self.replica.load(revision, rev.path, self.cfg.load_timeout)
        except ReplicaError:
            self.counters.load_failures += 1
            self._needs_recover = True
            raise
        self.counters.loads += 1
        log.info("turn %d: loaded revision %s in %.3f s", cur.turn.turn, revision,
                 time.monotonic() - t0)  # fmt: skip

    def _fill(self, sends: trio.Nursery, revision: str, now: float) -> None:
        free = self.cfg.concurrency - len(self._in_flight)
        if free <= 0:
            return
        for p in self.store.pending(revision):
            if free <= 0:
                break
            if self._sendable(p, now):
                scope = trio.CancelScope()
                self._in_flight[p.id] = scope
                sends.start_soon(self._send, p, scope, self.replica.epoch)
                free -= 1

    async def _send(self, p: Pending, scope: trio.CancelScope, epoch: int) -> None:
        """Send ``p`` once; commit the answer only if core.result_ok says so."""
        try:
            with scope:
                try:
                    self.store.attempt(p.id)
                except NotFound:
                    return  # finished (expired) meanwhile
                self.counters.sends += 1
                body = request_body(p, self.cfg.model or "")
                if not self.cfg.model:
                    del body["model"]  # vLLM serves its only model
                timeout = max(1.0, p.deadline - time.time())
                try:
                    answer = await self.replica.complete(p.kind, body, timeout)
                except ReplicaError as e:
                    self._send_failed(p, e)
                    return
                self._judge(p, answer, epoch)
        finally:
            self._in_flight.pop(p.id, None)
            self._signal()

    def _judge(self, p: Pending, answer: dict[str, Any], epoch: int) -> None:
        if not self.store.is_pending(p.id):
            return
        loaded = self.replica.known_version or ""
        if result_ok(p, answer, loaded, epoch, self.replica.epoch):
            self.store.complete(p.id, answer)
            self.counters.commits += 1
            self._done(p.id)
            return
        reason = _reject_reason(answer, p, epoch, self.replica.epoch)
        self.counters.rejects[reason] += 1
        self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
        log.warning("%s (revision %s): result not committed (%s); stays pending", p.id,
                    p.revision, reason)  # fmt: skip

    def _send_failed(self, p: Pending, e: ReplicaError) -> None:
        if e.status in _PERMANENT and self.store.is_pending(p.id):
            self.counters.refused_by_replica += 1
            self.store.fail(p.id, f"refused by the replica (HTTP {e.status}): {e}")
            self._done(p.id)
            return
        self.counters.rejects["error"] += 1
        self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
        log.warning("%s: send failed (%s); stays pending", p.id, e)
        if (e.status is None or e.status >= 500) and self._current is not None:
            self._current.replica_failed = str(e)
            self._signal()

    # -- ending a turn ---------------------------------------------------------------

    async def _end_turn(self, slicer: AsyncSlicer, cur: _TurnState, reason: str) -> None:
        """Sleep the replica, then RELEASE (runs shielded; every step bounded)."""
        n = cur.turn.turn
        if reason == "replica-error":
            self._needs_recover = True  # perhaps a new replica process: first sight again
        self.state = "sleeping"
        t0 = time.monotonic()
        try:
            await self.replica.sleep(level=1, mode="abort", timeout=self.cfg.sleep_timeout)
            log.info("turn %d: slept the replica in %.3f s", n, time.monotonic() - t0)
        except ReplicaError as e:
            log.error("turn %d: sleep failed: %s", n, e)
        self.state = "releasing"
        if self._slicer is slicer:
            try:
                with trio.fail_after(RELEASE_TIMEOUT_S):
                    await slicer.release(self.cfg.workload, n)
                log.info("turn %d: released (%s)", n, reason)
            except (ClientError, trio.TooSlowError) as e:
                log.error("turn %d: RELEASE failed (%s); dropping the connection", n, e)
                await self._drop_connection()
        self._current, self.turn = None, None
        self.state = "idle"
