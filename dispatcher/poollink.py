"""Pool mode's moving parts: the writer, the watcher, the ticker and the turn hooks.

:class:`PoolLink` ties one :class:`~dispatcher.poolstore.PoolStore` to the turn loop:

* :class:`PoolJournal` is the loop's journal in pool mode (same calls as
  :class:`~dispatcher.journal.Journal`): an accept returns once Redis has the requests;
  results are stored in groups, one script call per round, by one writer task.
* :meth:`PoolLink.top_up` runs at each step of a held turn (:mod:`dispatcher.serve`):
  it claims up to the free concurrency, this replica's loaded revision first. A failed
  Redis call raises :class:`~dispatcher.errors.PoolUnavailable`, which ends the turn
  the usual way (grace, sleep, RELEASE, each bounded).
* :meth:`PoolLink.turn_ended` hands back what the turn claimed and did not finish.
* the watcher reads the pool's ``done`` and ``ev`` streams (``XREAD BLOCK``): a result
  stored by any replica wakes the long-polls waiting for it on this front, new work wakes
  an idle turn loop.
* the ticker, every second: the pool's figures (:meth:`PoolStore.poll
  <dispatcher.poolstore.PoolStore.poll>`: is there work to ask a turn for?), the
  deadlines of the whole pool, the heartbeat of this replica's claims (every quarter of
  ``reclaim_idle``) and this replica's figures for ``slicer-pool status``.

Redis down: every task logs the failure once, keeps its state and tries again on its next
round (the watcher backs off to a second); the front answers 503; nothing ends the
dispatcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from gpu_slicer.dispatcher.errors import DispatchError, NotFound, StoreError
from gpu_slicer.dispatcher.model import Pending, Result
from gpu_slicer.dispatcher.poolconn import CALL_TIMEOUT_S
from gpu_slicer.dispatcher.poolrate import ServiceRate, pool_rate, turn_capacity
from gpu_slicer.dispatcher.poolstore import PoolStore
from gpu_slicer.dispatcher.poolsummary import read_reports
from gpu_slicer.dispatcher.rows import Finish, Staged

__all__ = ["PoolJournal", "PoolLink"]

log = logging.getLogger("dispatcher.pool")

TICK_S = 1.0
REPORT_TTL_S = 30
ASK_TTL_S = 5.0  # a record of asking/holding not refreshed this long is dropped (dead)
MAX_REPORTED_ERROR = 1000  # characters of another replica's load error named in ours
ACQUIRE_WAIT_S = 5.0  # in pool mode ACQUIRE is re-sent this often: the backlog may be gone
_OnStored = Callable[[bool], None]
_OnError = Callable[[StoreError], None]


class PoolJournal:
    """The turn loop's writer in pool mode (the calls of
    :class:`~dispatcher.journal.Journal`). Accepts go to Redis at once, each call one
    script; results are grouped: one writer task stores everything queued in one call."""

    def __init__(self, store: PoolStore) -> None:
        self.store = store
        self.groups = 0
        self.failed_groups = 0
        self._finishes: list[tuple[Finish, _OnStored, _OnError]] = []
        self._queued: set[str] = set()
        self._wake = trio.Event()

    async def accept(self, staged: list[Staged]) -> None:
        """Put ``staged`` in the pool (all or none); returns once Redis has them."""
        if staged:
            await self.store.enqueue(staged)

    def finish(
        self,
        id: str,
        status: str,
        *,
        raw: bytes | None = None,
        error: str | None = None,
        on_stored: _OnStored,
        on_error: _OnError,
    ) -> None:
        """Queue the result of ``id`` (see :meth:`Journal.finish
        <dispatcher.journal.Journal.finish>`)."""
        self._queued.add(id)
        if error is not None:
            error = error.encode("utf-8", "backslashreplace").decode("utf-8")
        self._finishes.append((Finish(id, status, raw, error), on_stored, on_error))
        self._wake.set()

    def attempt(self, p: Pending) -> int:
        """Count one more send of ``p`` (in memory: the pool keeps delivery counts)."""
        p.attempts += 1
        return p.attempts

    def queued(self, id: str) -> bool:
        """Whether a result of ``id`` waits for its commit."""
        return id in self._queued

    def queued_ids(self) -> set[str]:
        """Every id whose result waits for its commit (a copy)."""
        return set(self._queued)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: store what is queued, one call per round; at the end (cancelled)
        what is still queued gets one last bounded try."""
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await self.flush()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                await self.flush()

    async def flush(self) -> None:
        """Store every queued result in one call and tell their callers."""
        group, self._finishes = self._finishes, []
        if not group:
            return
        try:
            stored = await self.store.commit([f for f, _, _ in group])
        except DispatchError as e:
            err = e if isinstance(e, StoreError) else StoreError(str(e))
            self.failed_groups += 1
            log.error("pool %s: storing %d result(s) failed: %s", self.store.pool, len(group), e)
            for f, _, on_error in group:
                self._queued.discard(f.id)
                _tell(on_error, err)
            # Those no longer pending here (their turn ended) would be touched forever and
            # never resent: let them go, to be reclaimed.
            self.store.forget([f.id for f, _, _ in group])
            return
        self.groups += 1
        for (f, on_stored, _), ok in zip(group, stored, strict=True):
            self._queued.discard(f.id)
            _tell(on_stored, ok)


def _tell(callback: Callable[[Any], None], arg: object) -> None:
    try:
        callback(arg)
    except Exception:
        log.exception("after a pool commit")  # one caller's bug must not cost the others


class PoolLink:
    """Pool mode of one dispatcher: ``store`` (its claims), the journal, the tasks."""

    acquire_wait = ACQUIRE_WAIT_S  # ACQUIRE is re-sent this often in pool mode
    hand_back_timeout = CALL_TIMEOUT_S  # what a turn's end spends on handing claims back

    def __init__(
        self, store: PoolStore, concurrency: int, patience: float = 30.0,
        turn_seconds: float = 30.0,
    ) -> None:  # fmt: skip
        self.store = store
        self.journal = PoolJournal(store)
        self.concurrency = concurrency
        self.patience = patience
        self.turn_seconds = turn_seconds
        self.rate = ServiceRate()  # this replica's, measured over its turns
        self._capacity_shown: int | None = None
        self._publish: Callable[..., object] = lambda event, **fields: None
        self._asking = False  # recorded in the pool as asking for (or holding) a turn
        self.empty_turns = 0  # granted turns that found nothing left to claim
        self.replicas: dict[str, dict[str, Any] | None] = {}  # the pool's replica reports
        self._claimed_this_turn = 0
        self._waiters: dict[str, trio.Event] = {}
        self._signal: Callable[[], None] = lambda: None
        self._figures: Callable[[], dict[str, Any]] = dict
        self._avoid: Callable[[], list[str]] = list
        self._last_touch = 0.0
        self._holding = False

    def bind(
        self,
        signal: Callable[[], None],
        figures: Callable[[], dict[str, Any]],
        avoid: Callable[[], list[str]] = list,
        publish: Callable[..., object] | None = None,
    ) -> None:
        """Wake the turn loop with ``signal``; ``figures`` gives this replica's report,
        ``avoid`` the revisions it cannot serve now, ``publish(event, **fields)`` puts an
        event on the dispatcher's stream (``capacity``: what one turn here serves)."""
        self._signal = signal
        self._figures = figures
        self._avoid = avoid
        if publish is not None:
            self._publish = publish

    def capacity(self) -> int:
        """What this replica covers of the pool's backlog when it asks or holds a turn:
        what it serves in one turn (:mod:`dispatcher.poolrate`)."""
        return turn_capacity(self.concurrency, self._rate(), self.turn_seconds)

    def _rate(self) -> float | None:
        if self.rate.per_s is not None:
            return self.rate.per_s
        return pool_rate(
            r.get("rate_per_s") for n, r in self.replicas.items()
            if n != self.store.replica and isinstance(r, dict)
        )  # fmt: skip

    # -- the turn hooks --------------------------------------------------------------

    async def may_ask(self) -> bool:
        """Before asking slicerd for a turn: whether the pool's backlog needs this replica
        too (waking it parks its trainer). False while Redis is down. True when it still
        holds claims (a result that could not be stored at a turn's end): it serves them
        itself, as they are its own until handed back."""
        if self.store.pending() and self.store.conn.down is None:
            self._asking = True
            return True
        try:
            self._asking = await self.store.want(
                self.capacity(), ASK_TTL_S, self.patience, self.avoid()
            )
        except StoreError:
            self._asking = False
        return self._asking

    def avoid(self) -> list[str]:
        """The revisions this replica cannot serve now (its loads backed off)."""
        return self._avoid()

    async def let_go(self) -> None:
        """Not asking for a turn any more (nothing left to serve): say so to the pool."""
        if self._asking and not self._holding:
            self._asking = False
            with contextlib.suppress(StoreError):  # else its record expires after ASK_TTL_S
                await self.store.unwant()

    async def top_up(self, preferred: str | None, avoid: list[str], in_flight: int = 0) -> None:
        """Inside a held turn: claim up to the free concurrency. Raises PoolUnavailable
        when Redis is down (the turn then ends).

        While claimed requests still wait here to be sent, a claim waits until a quarter of
        the concurrency is free: one script call claims many (a call costs about as much
        as a dozen requests' other work)."""
        if not self._holding:
            self._holding = self._asking = True
            self._claimed_this_turn = 0
            await self.store.hold(self.capacity(), ASK_TTL_S, granted=True)
        self.rate.step(trio.current_time(), in_flight, self.store.counts()["done"])
        if self.store.conn.down is not None:
            await self.store.poll()  # a call: raises while Redis is still down
        held = len(self.store.pending())
        free = self.concurrency - held
        if free <= 0 or self.store.claimable_hint <= 0:
            return
        if held > in_flight and free < max(1, self.concurrency // 4):
            return  # work still waits here; claim more in one go a little later
        self._claimed_this_turn += await self.store.claim(preferred, free, avoid)

    async def turn_ended(self) -> None:
        """At a turn's end (shielded by the caller): give back what was not finished."""
        if self._holding and not self._claimed_this_turn:
            self.empty_turns += 1
        if self._holding:
            self.rate.turn_ended(trio.current_time(), self.store.counts()["done"])
        self._holding = self._asking = False
        try:
            # One bound for both calls: the turn's end bound counts CALL_TIMEOUT_S once.
            with trio.fail_after(CALL_TIMEOUT_S):
                n = await self.store.give_back(self.journal.queued_ids())
                await self.store.unwant()
        except (StoreError, trio.TooSlowError) as e:
            why = str(e) or f"no answer within {CALL_TIMEOUT_S:g} s"
            log.error("pool %s: claims not handed back (%s); reclaimed after %g s",
                      self.store.pool, why, self.store.reclaim_idle)  # fmt: skip
            return
        if n:
            log.info("pool %s: handed %d unfinished claim(s) back", self.store.pool, n)

    # -- results from any replica ----------------------------------------------------

    async def wait_result(self, sid: str, timeout: float) -> Result:
        """Sample ``sid`` once finished (by whichever replica), or as it stands after
        ``timeout`` s."""
        [result] = await self.wait_results([sid], timeout)
        return result

    async def wait_results(self, ids: list[str], timeout: float) -> list[Result]:
        """The samples ``ids`` in order once all are finished (by whichever replicas) or
        after ``timeout`` s; NotFound naming the first unknown id. One Redis call reads
        them all, and one more each time the results it waits for may have come."""
        end = trio.current_time() + max(0.0, timeout)
        out = await self.store.lookup_many(ids)
        while True:
            waiting = [i for i, r in enumerate(out) if r.status == "pending"]
            left = end - trio.current_time()
            if not waiting or left <= 0:
                return out
            events = [self._waiters.setdefault(ids[i], trio.Event()) for i in waiting]
            # The done stream wakes us; a notification lost with a Redis restart (or one
            # that came before we waited) costs at most a second.
            try:
                with trio.move_on_after(min(left, 1.0)):
                    for event in events:
                        await event.wait()
            finally:
                for i, event in zip(waiting, events, strict=True):
                    if self._waiters.get(ids[i]) is event and not event.is_set():
                        # No leak for ids whose notification never comes here: the next
                        # wait makes a new event (another waiter's loop does the same).
                        del self._waiters[ids[i]]
            again = await self.store.lookup_many([ids[i] for i in waiting])
            for i, r in zip(waiting, again, strict=True):
                out[i] = r

    # -- the tasks -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer, the watcher and the ticker, until cancelled."""
        try:
            await self.store.refresh_revisions()
        except StoreError as e:
            log.error("pool %s: revisions not read yet (%s); retried every second",
                      self.store.pool, e)  # fmt: skip
        async with trio.open_nursery() as nursery:
            await nursery.start(self.journal.run)
            nursery.start_soon(self._watch)
            nursery.start_soon(self._tick)
            task_status.started()

    async def _watch(self) -> None:
        # Explicit ids, never "$" after the first read: "$" would skip what was added
        # between two reads.
        last: dict[str, bytes] = {}
        while not last:
            try:
                last = {k: await self.store.conn.last_id(k) for k in ("done", "ev")}
            except StoreError:
                await trio.sleep(TICK_S)
        while True:
            try:
                got = await self.store.conn.read_streams(last, 1000)
            except StoreError:
                await trio.sleep(TICK_S)
                continue
            for key, entries in got.items():
                name = key.decode().rsplit(":", 1)[1]
                if entries:
                    last[name] = entries[-1][0]
                if name == "done":
                    for _, fields in entries:
                        sid = fields.get(b"i", b"").decode("utf-8", "replace")
                        event = self._waiters.pop(sid, None)
                        if event is not None:
                            event.set()
                elif entries:
                    if any(f.get(b"e") == b"rev" for _, f in entries):
                        await self._quietly(self.store.refresh_revisions)
                    self.store.claimable_hint = max(self.store.claimable_hint, 1)
                    self._signal()

    async def _tick(self) -> None:
        reported = 0.0
        while True:
            await self._quietly(self.store.poll)
            if self.store.claimable_hint > 0:
                self._signal()
            if self._asking:
                await self._quietly(partial(self.store.hold, self.capacity(), ASK_TTL_S,
                                            granted=self._holding))  # fmt: skip
            await self._quietly(self.store.store_expired)
            await self._quietly(self.store.expire_pool)
            now = time.monotonic()
            due = now - self._last_touch >= self.store.reclaim_idle / 4
            if due and await self._quietly(self.store.touch):
                self._last_touch = now
            if now - reported >= 2 * TICK_S and await self._quietly(self._report):
                reported = now
                await self._quietly(self._read_reports)
            self._show_capacity()
            if not self.store.revisions():
                await self._quietly(self.store.refresh_revisions)
            await self._quietly(self.store.recheck_bad_revisions)
            await trio.sleep(TICK_S)

    async def _quietly(self, call: Callable[[], Any]) -> bool:
        try:
            await call()
        except StoreError:
            return False  # PoolConn logged it once; the next round tries again
        except NotFound:
            return False
        except Exception:
            # A bug in one round (a report that cannot be encoded, a record of an odd
            # shape) must not end the dispatcher: logged, and tried again next round.
            log.exception("pool %s: a ticker step failed", self.store.pool)
            return False
        return True

    def _show_capacity(self) -> None:
        cap = self.capacity()
        if cap != self._capacity_shown:
            self._capacity_shown = cap
            self._publish("capacity", turn_capacity=cap, rate_per_s=self._rate_shown(),
                          measured_here=self.rate.per_s is not None)  # fmt: skip

    def _rate_shown(self) -> float | None:
        rate = self._rate()
        return None if rate is None else round(rate, 3)

    async def _report(self) -> None:
        figures = {
            **self._figures(),
            "rate_per_s": None if self.rate.per_s is None else round(self.rate.per_s, 3),
            "consumer": self.store.consumer,
            "reclaim_idle_s": self.store.reclaim_idle,
            "updated_at": time.time(),
        }
        raw = json.dumps(figures, separators=(",", ":"))
        conn = self.store.conn
        await conn.command("set", f"replica:{self.store.replica}", raw, ex=REPORT_TTL_S)
        await conn.command("sadd", "replicas", [self.store.replica])

    async def _read_reports(self) -> None:
        self.replicas = await read_reports(self.store.conn)

    def load_error(self, revision: str) -> str | None:
        """The failed load of ``revision`` that another replica last reported (its
        report's ``load_backoff``), naming the replica; None when none did."""
        for name, report in sorted(self.replicas.items()):
            if name == self.store.replica or not isinstance(report, dict):
                continue
            backoff = report.get("load_backoff")
            b = backoff.get(revision) if isinstance(backoff, dict) else None
            if isinstance(b, dict) and b.get("error"):
                # Another release's report: its text is cut, whatever its size.
                return f"replica {name}: {str(b['error'])[:MAX_REPORTED_ERROR]}"
        return None

    def status(self) -> dict[str, Any]:
        """Pool mode's part of ``/status``: the link, this replica's claims, the pool."""
        s = self.store
        summary = s.summary
        return {
            "redis": s.conn.health(),
            "consumer": s.consumer,
            "replica": s.replica,
            "reclaim_idle_s": s.reclaim_idle,
            "result_ttl_s": s.result_ttl,
            "claimed_here": len(s.pending()),
            "claims": s.claims,
            "claimed_entries": s.claimed_entries,
            "reclaimed_here": s.reclaimed,
            "returned_here": s.returned,
            "put_aside_here": s.put_aside,
            "duplicates_here": s.duplicates,
            "lost_claims": s.lost_claims,
            "held_back": s.held_back,
            "empty_turns": self.empty_turns,
            # What one turn here serves: covers that much of the backlog when asking.
            "turn_capacity": self.capacity(),
            "rate_per_s": self._rate_shown(),
            "rate_measured_here": self.rate.per_s is not None,
            # Returned and reclaimable entries are in the PEL ("claimed") too.
            "pending": {r: v["unclaimed"] + v["claimed"] for r, v in summary.revisions.items()},
            "revisions": summary.revisions,
            "claimed": summary.claimed,
            "stats": summary.stats,
            "served": summary.served,
            "polled_at": summary.at,
            # Every replica's own figures as it last reported them (None: expired), its
            # loads and load failures included: a path one node cannot read shows here.
            "replicas": self.replicas,
            "bad_revisions": s.bad_revisions,
        }
