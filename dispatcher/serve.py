"""Serving inside a held turn: load a revision whole, send pending requests, commit.

:class:`Serving` owns the requests' side of the dispatcher: the sends in flight, their
retry times and error counts, each revision's load backoff, the waiters for results, the
deadlines (:meth:`Serving.expire`) and the broadcast event every wait is woken by
(:meth:`Serving.signal`). :class:`~dispatcher.turns.TurnLoop` owns one and calls
:meth:`Serving.serve` between wake and sleep of each turn it holds; Serving never
acquires, wakes, sleeps or releases, and changes the loop's phase only through the
``enter`` callable it was given (:mod:`dispatcher.model`'s table).

Inside a turn (:meth:`Serving.serve`)::

    loop:  revision = choose()                     core.next_revision, preferring the
                                                   loaded one (no reload)
           _load(revision) as a whole              <= load_timeout, only with no send
                                                   in flight; after a level-2 sleep
                                                   (the turn woke only the weights) it
                                                   then wakes the KV cache and resets
                                                   the prefix cache (wake_timeout)
           fill(): send pending requests of it     <= concurrency at once, each bounded
                                                   by its deadline (dispatcher.sending)
           _judge(): commit only if core.result_ok
                                                   (--weight-check label: after one
                                                   bounded GET /weight_info)
           until nothing is pending, or WAITING was seen and turn_seconds passed since
           serving began, or the replica failed
    grace  sends in flight get turn_grace, then are cancelled (they stay pending)

Every write goes through the loop's :class:`~dispatcher.journal.Journal` (group commit):
a send's count is written with the next group, and a result (done or failed) is queued
and counts (``committed``, waiters woken) only once its group committed. Meanwhile the
sample is not sent again; if the group fails it stays pending and is sent again after
``RETRY_AFTER_S``, like a failed send. The body stored is vLLM's response as it came
(:meth:`Replica.complete_raw <dispatcher.vllm.Replica.complete_raw>`), never re-encoded
(but for the samples of a batch: each part is encoded once, below).

Batched prompts (``TurnConfig.batch_prompts``, ``--batch-prompts N``; default 1: one send
per sample, exactly as described above). With N > 1, :meth:`Sender.fill
<dispatcher.sending.Sender.fill>` packs up to N sendable *completion* samples of the
revision served that share core.batch_key (identical params, the same prompt form: text
or token ids, never mixed) into ONE send, ``prompt`` a list (core.batch_request_body);
``concurrency`` bounds sends, a batch is one. Each member has its own in-flight entry,
all under the batch's one cancel scope: expiring one member cancels the send, and the
others, still pending, go in the next fill. The answer is split by core.split_batch (an
answer whose choices cannot be split counts as reject ``choices`` for every member); each
part is judged by core.result_ok on its own and committed through the journal as its own
bytes (the answer's top-level fields, its own choices renumbered from 0, the whole send's
``usage`` and ``"batch": {"size": K, "position": I}``). A 400/422 cannot say which prompt
is bad: nothing fails; the members are marked to be sent alone and go at once (reject
``batch_refused``), so a bad prompt then fails alone with vLLM's error. A 5xx or no
answer marks the replica failed as for one sample; an unexpected error sends the members
alone from then on. In ``"label"`` mode one ``/weight_info`` read follows each batch
answer. Chat samples are never batched. ``Counters.sends`` counts HTTP sends,
``Counters.batched_samples`` the samples sent in batches.

A rejected or failed send is retried after ``RETRY_AFTER_S``; vLLM's own 400/422 fails
the request for good (retrying cannot help); a 5xx or no answer marks the replica failed,
which ends the turn (and the next one starts with a recovery).

No request can take the loop down: any other error while sending one request (a bug, a
row stored by an older release that cannot be encoded) fails that send only; the request
is retried after ``RETRY_AFTER_S``, and after
``TurnConfig.max_send_errors`` such errors (``model.MAX_SEND_ERRORS``, ``--max-send-errors``) it
is failed with an error that starts with ``SEND_FAILED`` and names the sample, pool,
revision and the last error.

One bad revision cannot stall the others: a failed load backs that revision off on its
own (:func:`~dispatcher.core.load_retry_delay`: from ``LOAD_BACKOFF_MIN_S`` doubling to
``LOAD_BACKOFF_MAX_S``, in pool mode a refusal 4x to ``--load-backoff-max``; :meth:`Serving.choose`
skips it meanwhile, so other revisions are loaded and served), and the turn ends as after
any broken load (the next one recovers the replica first). A load that a replica still
healthy right after refused with an HTTP error is the revision's fault (a path deleted by
a retention policy, unloadable weights); after ``TurnConfig.max_load_failures`` such
refusals in a row (``model.MAX_LOAD_FAILURES``, ``--max-load-failures``) every pending request
of the revision fails with an error that starts with ``LOAD_FAILED`` and names pool,
replica, workload, revision, path and the load error. A load with no answer, or one that
took the replica down, is the replica's fault: it backs off but counts no refusal. A
later request for the revision starts a fresh count (the path may be back).

``TurnConfig.weight_check`` picks how the weights of a result are checked (see
:mod:`dispatcher.core`): ``"spans"`` reads each choice's ``weight_versions`` (vLLM 0.33
and later); ``"label"`` (vLLM releases that ignore ``return_weight_versions``, such as
0.32) makes the sender read ``GET /weight_info`` once after the response, *while the
send still counts as in flight*, so no load can run between the response and the check.
A failed ``/weight_info`` call counts as a failed send (the request stays pending; a 5xx
or no answer marks the replica failed), never as a refusal of the request. The response
body is stored as vLLM returned it either way. In ``"spans"`` mode a response with no
``weight_versions`` in any choice is logged once per loop as an error naming the likely
cause (a vLLM older than 0.33) and the fix (``--weight-check label``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from gpu_slicer.dispatcher.core import (
    LOAD_BACKOFF_MAX_S,
    LOAD_BACKOFF_MIN_S,
    TurnPlan,
    load_retry_delay,
    next_revision,
)
from gpu_slicer.dispatcher.errors import ReplicaError, StoreError
from gpu_slicer.dispatcher.events import EventStream
from gpu_slicer.dispatcher.journal import Journal
from gpu_slicer.dispatcher.model import (
    Counters,
    LoadBackoff,
    Pending,
    Phase,
    Result,
    TurnConfig,
    TurnState,
)
from gpu_slicer.dispatcher.sending import (  # the send side; its names are exported here too
    NO_WEIGHT_VERSIONS_ERROR,
    RETRY_AFTER_S,
    SEND_FAILED,
    Sender,
)
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.vllm import Replica

if TYPE_CHECKING:  # pool mode's modules (coredis) load only when a pool is used
    from gpu_slicer.dispatcher.poollink import PoolJournal, PoolLink

__all__ = [
    "LOAD_BACKOFF_MAX_S",
    "LOAD_BACKOFF_MIN_S",
    "LOAD_FAILED",
    "NO_WEIGHT_VERSIONS_ERROR",
    "RETRY_AFTER_S",
    "SEND_FAILED",
    "Serving",
]

log = logging.getLogger("dispatcher.serve")

LOAD_HEALTH_TIMEOUT_S = 5.0  # the /health probe that tells a refusal from a dead replica
LOAD_FAILED = "load failed"  # how the error of a request failed by its revision starts


class Serving:
    """The requests' side of the dispatcher (module docstring).

    ``counters`` and ``events`` are sinks it reports to; ``enter`` changes the turn
    loop's phase (the loop's own check of the table); ``on_foreign(revision, how)`` is
    told when results keep carrying weights other than the loaded ``revision``
    (:mod:`dispatcher.sending`)."""

    def __init__(
        self,
        store: Store,
        replica: Replica,
        cfg: TurnConfig,
        *,
        counters: Counters,
        events: EventStream,
        enter: Callable[[Phase], None],
        journal: Journal | PoolJournal | None = None,
        on_foreign: Callable[[str, str], None] | None = None,
        pool: PoolLink | None = None,
    ) -> None:
        self.store = store
        self.journal = journal or Journal(store)
        self.pool = pool
        self.replica = replica
        self.cfg = cfg
        self.counters = counters
        self.events = events
        self._enter = enter
        self._changed = trio.Event()
        self._finished: dict[str, trio.Event] = {}
        self._in_flight: dict[str, trio.CancelScope] = {}
        self._retry_at: dict[str, float] = {}
        self._send_errors: dict[str, int] = {}  # id -> unexpected errors of its sends
        self._load_backoff: dict[str, LoadBackoff] = {}  # revision -> its failed loads
        self._alone: set[str] = set()  # ids never batched again (a batch of theirs was refused)
        self._sender = Sender(
            store, self.journal, replica, cfg, counters,
            in_flight=self._in_flight, retry_at=self._retry_at, alone=self._alone,
            send_errors=self._send_errors, signal=self.signal, commit=self._commit,
            fail=self._fail, on_foreign=on_foreign,
        )  # fmt: skip

    # -- waiting ---------------------------------------------------------------------

    def signal(self) -> None:
        """Wake every :meth:`wait_change` (something to do may have changed)."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Wait for the next :meth:`signal`, at most ``timeout`` seconds."""
        event = self._changed
        with trio.move_on_after(max(0.0, timeout)):
            await event.wait()

    async def wait_result(self, id: str, timeout: float) -> Result:
        """The sample ``id`` once it is finished, or as it stands after ``timeout`` s."""
        result = self.store.get(id)
        if result.status == "pending" and timeout > 0:
            event = self._finished.setdefault(id, trio.Event())
            with trio.move_on_after(timeout):
                await event.wait()
            result = self.store.get(id)
        return result

    async def wait_results(self, ids: list[str], timeout: float) -> list[Result]:
        """The samples ``ids`` in order, once every one is finished or ``timeout`` s
        passed; :class:`NotFound` naming the first unknown id, before any wait."""
        results = [self.store.get(id) for id in ids]
        if timeout > 0 and any(r.status == "pending" for r in results):
            with trio.move_on_after(timeout):
                for r in results:
                    if r.status == "pending" and self.store.is_pending(r.id):
                        await self._finished.setdefault(r.id, trio.Event()).wait()
            results = [self.store.get(id) for id in ids]
        return results

    @property
    def in_flight(self) -> int:
        """How many samples are in flight now (each member of a batch counts)."""
        return len(self._in_flight)

    def load_backoff(self, now: float) -> dict[str, dict[str, Any]]:
        """The revisions whose loads are backed off, for ``/status`` (``now``: trio's)."""
        return {
            rev: {
                "failures": b.failures,
                "refused": b.refused,
                "retry_in_s": round(max(0.0, b.retry_at - now), 3),
                "delay_s": b.delay,
                "error": b.error,
            }
            for rev, b in self._load_backoff.items()
        }

    def load_error(self, revision: str) -> str | None:
        """Why this replica could not load ``revision`` (None: no failed load of it since
        its last good one): for the error of a request that misses its deadline."""
        b = self._load_backoff.get(revision)
        if b is None:
            return None
        return f"{b.failures} failed load(s) in a row ({b.refused} refused), the last: {b.error}"

    def expire(self, now: float) -> None:
        """Fail the requests past their deadline at ``now`` (wall clock) and cancel their
        sends. Raises :class:`DispatchError` when the store cannot say which."""
        expired = self.store.expire(now)
        for p in expired:
            self.counters.expired += 1
            scope = self._in_flight.get(p.id)
            if scope is not None:
                scope.cancel()
            error = self.store.deadline_error(p, now)
            log.warning("%s", error + f" (id {p.id})")
            self._failed_event(p, error)
            self._done(p.id)
        if expired:
            self.signal()

    def _failed_event(self, p: Pending, error: str) -> None:
        self.events.publish("failed", id=p.id, revision=p.revision, error=error,
                            pending=self.store.counts()["pending"])  # fmt: skip

    def _done(self, id: str) -> None:
        self._retry_at.pop(id, None)
        self._send_errors.pop(id, None)
        self._alone.discard(id)
        event = self._finished.pop(id, None)
        if event is not None:
            event.set()

    # -- serving ---------------------------------------------------------------------

    def _loadable(self, revision: str, now: float) -> bool:
        """Whether ``revision`` may be served now: loaded, or not backed off."""
        b = self._load_backoff.get(revision)
        return b is None or b.retry_at <= now or revision == self.replica.known_version

    def backed_off(self, now: float) -> list[str]:
        """The revisions whose loads are backed off at ``now`` (trio's clock)."""
        return [r for r in self._load_backoff if not self._loadable(r, now)]

    def load_wait(self, now: float) -> float | None:
        """Seconds until a pending revision may be loaded, when every one is backed off;
        None when one may be served now (or nothing is pending)."""
        revs = self.store.pending_revisions()
        if not revs or any(self._loadable(r, now) for r in revs):
            return None
        return max(0.0, min(self._load_backoff[r].retry_at for r in revs) - now)

    def choose(self, now: float) -> str | None:
        """The revision to work on: core.next_revision over the revisions not backed off,
        unless the loaded one has only requests that wait for a retry while another
        revision has work. None: nothing may be served now."""
        revs = [r for r in self.store.pending_revisions() if self._loadable(r, now)]
        loaded = self.replica.known_version
        want = next_revision(revs, loaded)
        stuck = want is not None and want == loaded and not self._in_flight
        if stuck and not any(
            self._sender.sendable(p, now) for p in self.store.iter_pending(loaded or "")
        ):
            others = [r for r in revs if r != loaded]
            return others[0] if others else want
        return want

    async def serve(self, cur: TurnState) -> str:
        """Load and send in the held turn ``cur`` until it should end; returns why it
        ended ("idle", "waiting", "backoff" or "replica-error")."""
        n = cur.turn.turn
        serving: str | None = None  # the revision served since the last phase change
        async with trio.open_nursery() as sends:
            while True:
                if self.pool is not None and not cur.replica_failed:
                    # Claims only inside the held turn, up to the free concurrency; a
                    # Redis failure raises here and ends the turn.
                    now = trio.current_time()
                    await self.pool.top_up(
                        self.replica.known_version, self.backed_off(now), self.in_flight
                    )
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
                want = self.choose(now)
                if want is None and not self._in_flight:
                    reason = "backoff"  # every pending revision's load is backed off
                    break
                if want is not None and want != self.replica.known_version:
                    if not self._in_flight:  # loads are whole, and never under a send
                        serving = None
                        await self._load(cur, want)
                        continue
                elif want is not None:
                    if serving != want:  # the turn's first, or a load came between
                        serving = want
                        self._enter(Phase.SERVING)
                        self.events.publish("serving", turn=n, revision=want, pending=pending)
                    if cur.serving_since is None:
                        cur.serving_since = now
                        log.info("turn %d: serving revision %s (%d pending)", n, want, pending)
                    self._sender.fill(sends, cur, want, now)
                ends = TurnPlan(self.cfg.turn_seconds).ends_at(
                    cur.serving_since or now, cur.waiting_seen_at
                )
                timeout = RETRY_AFTER_S if ends is None else min(RETRY_AFTER_S, ends - now)
                await self.wait_change(timeout)
            if self._in_flight:
                self._enter(Phase.GRACE)
                log.info("turn %d: ending (%s); %d send(s) in flight get %g s", n, reason,
                         len(self._in_flight), self.cfg.turn_grace)  # fmt: skip
                with trio.move_on_after(self.cfg.turn_grace):
                    while self._in_flight:
                        await self.wait_change(RETRY_AFTER_S)
                if self._in_flight:
                    log.info("turn %d: cancelling %d send(s); they stay pending", n,
                             len(self._in_flight))  # fmt: skip
                sends.cancel_scope.cancel()
        return reason

    async def _load(self, cur: TurnState, revision: str) -> None:
        self._enter(Phase.LOADING)
        try:
            await self.load_whole(cur.turn.turn, revision)
        except ReplicaError:
            cur.load_broke = True
            raise
        cur.worked = True
        if self.replica.kv_asleep:
            await self.wake_kv_cache(cur)

    async def load_whole(self, n: int | None, revision: str) -> None:
        """Load ``revision`` as a whole in turn ``n`` (None: an early start, before the
        grant: :mod:`dispatcher.early`), with its events and counters; a failure backs the
        revision off (module docstring) and raises ReplicaError. The KV cache of a
        level-2 wake stays asleep: the caller wakes it."""
        rev = self.store.revision(revision)
        t0 = time.monotonic()
        when = "early start" if n is None else f"turn {n}"
        at: dict[str, Any] = {"turn": n} if n is not None else {"turn": None, "early": True}
        log.info("%s: loading revision %s from %s", when, revision, rev.path)
        self.events.publish("load_begin", revision=revision, path=rev.path, **at)
        try:
            await self.replica.load(revision, rev.path, self.cfg.load_timeout)
        except ReplicaError as e:
            self._load_end(at, revision, t0, str(e))
            self.counters.load_failures += 1
            # A refusal by a replica still healthy right after is the revision's fault;
            # no answer, or a replica that died with the load, is the replica's.
            refused = e.status is not None and await self.replica.health(LOAD_HEALTH_TIMEOUT_S)
            self._load_failed(revision, rev.path, e, refused)
            raise
        except BaseException as e:  # cancelled (the dispatcher stops): the load is no more
            self._load_end(at, revision, t0, f"{type(e).__name__}: {e}".rstrip(": "))
            raise
        self._load_end(at, revision, t0, None)
        self._load_backoff.pop(revision, None)
        self.counters.loads += 1
        log.info("%s: loaded revision %s in %.3f s", when, revision,
                 time.monotonic() - t0)  # fmt: skip

    async def wake_kv_cache(self, cur: TurnState) -> None:
        """The end of a level-2 wake, once the weights are loaded: wake the KV cache and
        reset the prefix cache. A failure marks the replica failed (the turn ends; the
        weights count as unknown, so the next turn wakes in the same order and loads)."""
        n = cur.turn.turn
        t0 = time.monotonic()
        try:
            await self.replica.wake_kv_cache(self.cfg.wake_timeout)
        except ReplicaError as e:
            log.error("turn %d: waking the KV cache after the load failed: %s", n, e)
            cur.replica_failed = str(e)
            self.signal()
            return
        log.info("turn %d: woke the KV cache in %.3f s (prefix cache reset)", n,
                 time.monotonic() - t0)  # fmt: skip
        self.events.publish("woke", turn=n, duration_s=round(time.monotonic() - t0, 6),
                            tags=["kv_cache"])  # fmt: skip

    def _load_end(self, at: dict[str, Any], revision: str, t0: float, error: str | None) -> None:
        took = round(time.monotonic() - t0, 6)
        extra = {} if error is None else {"error": error}
        self.events.publish("load_end", revision=revision, ok=error is None,
                            duration_s=took, **at, **extra)  # fmt: skip

    def _load_failed(self, revision: str, path: str, e: ReplicaError, refused: bool) -> None:
        """Back ``revision`` off after a failed load; after ``max_load_failures`` refusals
        in a row, fail its pending requests (module docstring)."""
        b = self._load_backoff.setdefault(revision, LoadBackoff())
        b.failures += 1
        b.refused += refused
        b.error = str(e)
        delay = load_retry_delay(b.failures, b.refused, self.pool is not None,
                                 self.cfg.load_backoff_max)  # fmt: skip
        b.delay = delay
        b.retry_at = trio.current_time() + delay
        limit = self.cfg.max_load_failures
        if self.pool is not None:
            # Pool mode: another replica may load it (its node may see the path): the
            # turn's end hands its requests back; this replica reports the failure in
            # the pool's figures and skips the revision while it is backed off.
            log.warning("revision %s: load failed on this replica (%d refused); handed back "
                        "to the pool, tried here again in %.1f s: %s", revision, b.refused,
                        delay, e)  # fmt: skip
            return
        if b.refused < limit:
            log.warning("revision %s: load failed (%d refused of %d allowed); other revisions "
                        "first, this one again in %.1f s: %s", revision, b.refused, limit,
                        delay, e)  # fmt: skip
            return
        msg = (
            f"{LOAD_FAILED}: pool {self.store.pool} revision {revision}: replica "
            f"{self.replica.base_url} (workload {self.cfg.workload}) refused {b.refused} loads "
            f"of {path} in a row; last error: {e}"
        )
        failed = [p for p in self.store.pending(revision) if not self.journal.queued(p.id)]
        log.error("%s; failing its %d pending request(s)", msg, len(failed))
        for p in failed:
            self._fail(p, msg)
        del self._load_backoff[revision]  # a later request starts afresh (the path may be back)

    def _fail(self, p: Pending, error: str) -> None:
        """Fail ``p`` with ``error`` through the journal: once committed it is published
        and its waiters are woken; if the commit failed it stays pending (sent again)."""

        def stored(ok: bool) -> None:
            if ok:
                self._failed_event(p, error)
            self._done(p.id)
            self.signal()

        def not_stored(e: StoreError) -> None:
            log.error("%s: cannot store its failure (%s); tried again later", p.id, e)
            self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
            self.signal()

        self.journal.finish(p.id, "failed", error=error, on_stored=stored, on_error=not_stored)

    def _commit(self, cur: TurnState, p: Pending, raw: bytes) -> None:
        """Store ``raw`` (vLLM's body, as it came) as ``p``'s result through the journal:
        once committed it counts, is published (``committed``) and its waiters are woken;
        if the commit failed, ``p`` stays pending and is sent again later."""
        n = cur.turn.turn

        def stored(ok: bool) -> None:
            if ok:
                self.counters.commits += 1
                self.events.publish("committed", turn=n, id=p.id, revision=p.revision,
                                    commits=self.counters.commits,
                                    pending=self.store.counts()["pending"])  # fmt: skip
            self._done(p.id)
            self.signal()

        def not_stored(e: StoreError) -> None:
            log.error("%s (revision %s): result not stored (%s); stays pending, sent again "
                      "later", p.id, p.revision, e)  # fmt: skip
            self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
            self.signal()

        self.journal.finish(p.id, "done", raw=raw, on_stored=stored, on_error=not_stored)
