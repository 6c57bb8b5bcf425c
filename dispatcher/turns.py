"""The turn loop of one replica: acquire, wake, load whole, serve, sleep, release.

Theory of operation
-------------------
:class:`TurnLoop` owns one vLLM replica (a :class:`~dispatcher.vllm.Replica`), one
slicerd connection, the loop's :class:`~dispatcher.model.Phase` and its
:class:`~dispatcher.events.EventStream`, one :class:`~dispatcher.journal.Journal` (group
commit of every write; its writer runs in the loop's nursery) and one
:class:`~dispatcher.serve.Serving`, the requests' side, which it calls between wake and
sleep. It never polls: it waits on the
Serving's broadcast event (:meth:`Serving.signal <dispatcher.serve.Serving.signal>`, set
by :meth:`TurnLoop.accept`, by every finished send and by a WAITING event), bounded by one
second so a rejected send is retried and a missed wake-up costs at most a second. A
separate ticker expires deadlines every second (:meth:`Serving.expire
<dispatcher.serve.Serving.expire>`), which cancels the send of an expired request through
that request's own cancel scope.

A turn, while anything is pending (each phase is logged with its duration)::

    ACQUIRE (wait=acquire_wait, then again)       slicerd grants the GPU; with early=N
      [EARLY: recover, wake_weights(), load]      (dispatcher.early) the weights are woken
                                                  and loaded before the grant (PREPARING)
    GET /weight_info  when a revision is loaded   another label: not the replica we
                                                  loaded (restarted), so recover
    recover()  on first sight / after a broken load or a replica error
    GET /is_sleeping  after a lazy release        still awake: no wake (wakes_skipped);
                                                  asleep: GET /metrics says which level
                                                  someone else slept it at
    wake()     <= wake_timeout                    after a level-2 sleep: wake_weights()
                                                  only (/wake_up?tags=weights)
    loop:  revision = core.next_revision(...)     prefer the loaded one (no reload)
           load(revision) as a whole              <= load_timeout, only with no send in flight
                                                  (after wake_weights: then
                                                  /wake_up?tags=kv_cache, /reset_prefix_cache)
           send pending requests of it            <= concurrency at once, each bounded by
                                                     its deadline, committed by result_ok
                                                     (--weight-check label: after one
                                                     bounded GET /weight_info)
           until nothing is pending, or WAITING was seen and turn_seconds passed since
           serving began, or the replica failed
    grace      sends in flight get turn_grace, then are cancelled (they stay pending)
    sleep(level=L, mode=abort)                    <= sleep_timeout, shielded; L from
                                                  --sleep-level (core.sleep_level); a
                                                  level-2 wake cut short first wakes its
                                                  KV cache, so the sleep is no no-op
                                                  (skipped by a lazy release, below)
    RELEASE                                       shielded, bounded

The serving part of a turn (load, send, commit, grace) is :class:`~dispatcher.serve.Serving`;
:class:`TurnLoop` holds the front door, the ticker and the turn's frame. Every phase change
of either goes through :meth:`TurnLoop._enter`, which checks :mod:`dispatcher.model`'s
table and publishes the change (``GET /v1/events``), as are the turn's steps. On the way
out of a turn (sleeping, releasing, idle) a change the table misses is logged, published
as ``transition_error`` and taken anyway: the sleep and RELEASE always happen.

Sleep levels (``--sleep-level auto|1|2``, :func:`~dispatcher.core.sleep_level`): level 1
copies the weights to host RAM and back, level 2 drops them, which wins when the next
wake loads other weights anyway; auto picks 2 exactly then (a newer revision published
that unpinned work takes, or pending requests that want only other revisions, or no
known weights loaded). After a level-2 sleep nothing is sent before a whole load: the
next turn wakes the weights, loads, wakes the KV cache and resets the prefix cache
(:mod:`dispatcher.vllm`); a failed load ends the turn with another level-2 sleep, the
requests still pending. ``/status`` counts ``sleeps_level1`` and ``sleeps_level2``; the
``slept`` event says ``level``.

Lazy sleep (``--lazy-sleep``, :meth:`TurnLoop._lazy`): a turn that ran out of work
(``idle``) without seeing WAITING, with a healthy, fully awake replica, RELEASEs without
the sleep ("left awake (nobody waiting)", ``released`` with ``lazy: true``,
``lazy_releases``). Should another workload ask for the GPU, slicerd parks the idle
replica by the registrant-side park (PARK to the launcher, which sleeps it; verified;
cuda-checkpoint as the fallback; bounded by ``registrant_park_timeout``). The next turn
therefore reads ``GET /is_sleeping`` first: awake, the wake is skipped; asleep,
``GET /metrics`` (:meth:`Replica.sleep_state <dispatcher.vllm.Replica.sleep_state>`)
says what the other sleep left: level 1 (or a pause) a plain wake of the kept weights,
anything else the level-2 order with a whole load.

The end of a turn (sleep, then RELEASE) runs shielded from cancellation, so SIGTERM
during a turn still puts vLLM to sleep and hands the GPU back before the process exits.
Any slicerd or replica failure ends the turn the same way; the requests stay pending and
the loop backs off (0.5 s doubling to 5 s) before it tries again. A store failure (a full
disk, a damaged database) ends it too and backs off longer (to ``STORE_BACKOFF_MAX_S``):
each turn parks the other workload, and a broken store rarely mends within seconds; the
loop lives on, the front answers 503 for what touches the broken part, and ``/status``
says so in ``store``. While every pending revision's load is backed off
(:mod:`dispatcher.serve`) the loop asks for no turn: it waits for the first to be due.

What the loop learns about its world goes to its :class:`~dispatcher.health.Health`
(``/status``'s ``problem``, ``GET /ready``): a connect or ACQUIRE that fails or works
(slicerd reachable? the workload registered?), a recover or wake that fails or works and
a replica failure while serving (the replica), and, every second and at each
``/status``, the store's health and the load backoff (``last load error``).
:func:`~dispatcher.probe.probe` runs in the loop's nursery and asks slicerd (during
turns too: a turn whose workload left slicerd ends at once) and, between turns, the
replica itself, so an idle dispatcher knows too.

When to recover the replica, and a replica that is not the one loaded (its launcher
restarted it: same URL, a new process with its boot weights), is
:class:`~dispatcher.recovery.Recovery`'s: it reads ``/weight_info`` at the start of a
turn, hears from the probe and from the sends' bound on results refused for their
weights, ends a held turn and says ``replica serves weights other than REV``.

A slicerd that cannot be reached (at start or later) is a waiting state, never a crash:
requests are still accepted and journaled, the problem says why nothing is served, and
turns are retried with the backoff above.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from gpu_slicer import proto
from gpu_slicer.dispatcher.checkpoint import check_checkpoint_dir, check_path_text
from gpu_slicer.dispatcher.core import sleep_level
from gpu_slicer.dispatcher.early import EarlyStart
from gpu_slicer.dispatcher.errors import (
    BadRequest,
    DispatchError,
    IllegalTransition,
    ReplicaError,
    StoreError,
    UnknownRevision,
)
from gpu_slicer.dispatcher.events import EventStream, Subscription
from gpu_slicer.dispatcher.health import (
    WAIT_PROBLEM_S,
    Check,
    Health,
    Problem,
    daemon_unreachable,
    gpu_held,
    note_loads,
    note_store,
    problem_fields,
    replica_unhealthy,
    workload_unknown,
)
from gpu_slicer.dispatcher.journal import Journal
from gpu_slicer.dispatcher.model import (
    Counters,
    Pending,
    Phase,
    Result,
    Revision,
    TurnConfig,
    TurnState,
    check_transition,
)
from gpu_slicer.dispatcher.probe import probe
from gpu_slicer.dispatcher.recovery import Recovery
from gpu_slicer.dispatcher.serve import Serving
from gpu_slicer.dispatcher.store import Staged, Store, check_revision_name
from gpu_slicer.dispatcher.vllm import CONTROL_TIMEOUT_S, Replica
from gpu_slicer.slicer.client import AsyncSlicer, ClientError, Turn, socket_path

if TYPE_CHECKING:  # pool mode's modules (coredis) load only when a pool is used
    from gpu_slicer.dispatcher.poollink import PoolJournal, PoolLink

__all__ = ["TurnLoop"]

log = logging.getLogger("dispatcher.turns")

RELEASE_TIMEOUT_S = 30.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 5.0
STORE_BACKOFF_MAX_S = 30.0  # after a turn that a store failure ended
CHANGING_TURNS = 2  # turns in a row that each loaded another revision: "changing" (auto)
# After a wasted turn (granted, the replica woken, and nothing loaded or served) the next
# ACQUIRE waits WASTE_BACKOFF_MIN_S, doubling with each wasted turn in a row up to
# WASTE_BACKOFF_MAX_S: whatever made the turn useless (found or not), it parks the other
# workload at most a dozen times an hour. A turn that works resets it.
WASTE_BACKOFF_MIN_S, WASTE_BACKOFF_MAX_S = 1.0, 300.0
BASE_READ_TIMEOUT_S = 5.0  # asking the replica what it booted with (--base-revision)
_ASKING = frozenset({Phase.ACQUIRING, Phase.PREPARING})


def _leaves(group: BaseExceptionGroup[Exception]) -> list[Exception]:
    """The exceptions in ``group`` and its nested groups, depth first."""
    out: list[Exception] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


async def _connect_default(path: str | None) -> AsyncSlicer:
    return await AsyncSlicer.connect(path)


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 6)


class TurnLoop:
    """The pending queue's front door and the turn loop of one replica.

    ``connect`` makes a new slicerd connection (injectable for tests); the loop keeps one
    connection open across turns and makes a new one after it broke. ``serving`` is the
    requests' side (:class:`~dispatcher.serve.Serving`), ``events`` the declared event
    stream (a new one unless given), ``phase`` where the loop is, ``health`` what is
    wrong with its world (:mod:`dispatcher.health`). ``probe`` runs the health probes
    between turns (default: only with the real slicerd connection, not an injected one).
    """

    def __init__(
        self,
        store: Store,
        replica: Replica,
        cfg: TurnConfig,
        *,
        connect: Callable[[], Awaitable[AsyncSlicer]] | None = None,
        events: EventStream | None = None,
        probe: bool | None = None,
        pool: PoolLink | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.replica = replica
        self.cfg = cfg
        self.counters = Counters()
        # The revision loaded at each of the last turn ends (sleep level auto's "changing").
        self._loaded_at_end: list[str | None] = []
        self.events = events or EventStream()
        self.phase = Phase.IDLE
        self.turn: int | None = None
        self.journal: Journal | PoolJournal = pool.journal if pool else Journal(store)
        self.health = Health(on_change=self._problem_changed, on_state=self._check_changed)
        self.recovery = Recovery(
            replica, self.health, cfg.workload, current=lambda: self._current,
            signal=lambda: self.serving.signal(),
        )  # fmt: skip
        self.serving = Serving(
            store, replica, cfg, counters=self.counters, events=self.events, enter=self._enter,
            journal=self.journal, on_foreign=self.recovery.foreign, pool=pool,
        )  # fmt: skip
        self.early = EarlyStart(
            cfg, store, replica, self.serving, self.recovery, counters=self.counters,
            events=self.events, enter=self._enter, off=pool is not None,
        )  # fmt: skip
        store.explain_loads(self._load_error)
        if pool is not None:
            pool.bind(self.serving.signal, self._figures,
                      lambda: self.serving.backed_off(trio.current_time()),
                      self.events.publish)  # fmt: skip
        self._current: TurnState | None = None
        self._connect = connect or (lambda: _connect_default(cfg.socket))
        self._slicer: AsyncSlicer | None = None
        self._probe = connect is None if probe is None else probe
        self._socket = socket_path(cfg.socket)
        self._asking_since: float | None = None  # trio clock: a turn asked for since
        # Who holds our GPU as slicerd's last STATUS said (workload, turn, first seen at):
        # the "gpu" problem while we ask (the probe reads STATUS).
        self._holder: tuple[str, int | None, float] | None = None
        self._base_done = cfg.base_revision is None  # published, or found needless
        self._wasted_in_a_row = 0
        self._waste_until = 0.0  # trio clock: no ACQUIRE before (after wasted turns)

    def _problem_changed(self, problem: Problem | None) -> None:
        self.events.publish("problem", **problem_fields(problem))

    def _check_changed(self, check: Check) -> None:
        if check is Check.REPLICA:  # the loop may ask for a turn now, or must not
            self.serving.signal()

    def _on_status(self, st: dict[str, Any]) -> None:
        """slicerd's STATUS (from the probe): remember who holds our workload's GPU."""
        mine = next((w for w in st.get("workloads") or [] if isinstance(w, dict)
                     and w.get("name") == self.cfg.workload), None)  # fmt: skip
        gpus = [g for g in st.get("gpus") or [] if isinstance(g, dict)]
        gpu = next((g for g in gpus if mine is not None and g.get("index") == mine.get("gpu")),
                   None)  # fmt: skip
        holder = gpu.get("holder") if gpu is not None else None
        name = holder.get("workload") if isinstance(holder, dict) else None
        if not isinstance(name, str) or name == self.cfg.workload:
            self._holder = None
            self._note_wait()
            return
        assert isinstance(holder, dict)
        turn = holder.get("turn")
        turn = turn if isinstance(turn, int) else None
        if self._holder is None or self._holder[:2] != (name, turn):
            self._holder = (name, turn, trio.current_time())
        self._note_wait()

    def _note_wait(self) -> None:
        """The ``gpu`` check: failing while a turn has been asked for ``WAIT_PROBLEM_S``
        or longer and another workload holds the GPU (its seconds since we saw it hold
        it while asking are counted when read)."""
        now, since, holder = trio.current_time(), self._asking_since, self._holder
        if since is None or holder is None or now - since < WAIT_PROBLEM_S:
            self.health.ok(Check.GPU)
            return
        name, turn, seen = holder
        # Held since we first saw it held, or since we asked: it held the GPU all along.
        self.health.fail(Check.GPU, gpu_held(name, turn), held_at=min(since, seen))

    def _replica_unusable(self) -> bool:
        """Whether a turn would find the replica unusable: while probing, a turn is asked
        for only once the replica answered its last probe (``GET /health``, and its dev
        routes on first sight), so a dead or misconfigured replica parks nobody (a turn
        that finds it dead makes the check fail: at most that one park). Without the
        probe (an injected slicerd connection) the turn itself finds out."""
        return self._probe and self.health.state(Check.REPLICA) is not True

    def _refresh_health(self) -> None:
        """The checks derived from state (store, loads, weights): at every ``/status``,
        ``/ready`` and tick."""
        note_store(self.health, self.store.health())
        pending = set(self.store.pending_revisions())
        note_loads(self.health, self.serving.load_backoff(trio.current_time()), pending)
        self.recovery.refresh(bool(pending))
        self._note_wait()

    def not_ready(self, revision: str | None = None) -> str | None:
        """Why ``GET /ready`` answers 503 (None: ready): the first needed check not known
        to be ok (:meth:`Health.not_ready <dispatcher.health.Health.not_ready>`), else,
        with ``revision``, that it is not published."""
        self._refresh_health()
        reason = self.health.not_ready()
        if reason is not None or revision is None:
            return reason
        try:
            self.store.revision(revision)
        except UnknownRevision:
            return f"revision {revision} is not published"
        except DispatchError as e:
            return f"revision {revision}: {e}"
        return None

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes: checked against :data:`model.TRANSITIONS
        <dispatcher.model.TRANSITIONS>` (raising before anything changed), then published."""
        if check_transition(self.phase, phase):
            previous, self.phase = self.phase, phase
            self._asking(phase)
            self.events.publish("phase", phase=phase.value, previous=previous.value,
                                turn=self.turn)  # fmt: skip

    def _asking(self, phase: Phase) -> None:
        # Since when a turn is asked for (ACQUIRING, PREPARING): the "gpu" problem's clock.
        if phase not in _ASKING:
            self._asking_since = None
            self._note_wait()
        elif self._asking_since is None:
            self._asking_since = trio.current_time()

    def _enter_ending(self, phase: Phase) -> None:
        """:meth:`_enter` for the end of a turn: a change the table misses is logged at error
        and published (``transition_error``), then taken all the same."""
        try:
            self._enter(phase)
        except IllegalTransition as e:
            # A gap in the table must never skip the sleep and RELEASE (the turn would stay
            # held, the other workload parked) nor end the loop: the way out goes on.
            log.error("ending a turn: %s; going on all the same", e)
            previous, self.phase = self.phase, phase
            self._asking(phase)
            self.events.publish("transition_error", phase=phase.value,
                                previous=previous.value, turn=self.turn, error=str(e))  # fmt: skip
            self.events.publish("phase", phase=phase.value, previous=previous.value,
                                turn=self.turn)  # fmt: skip

    @property
    def end_timeout(self) -> float:
        """The most seconds ending a held turn takes (in pool mode handing claims back,
        then sleep, then RELEASE, each bounded)."""
        back = self.pool.hand_back_timeout if self.pool is not None else 0.0
        return back + self.cfg.sleep_timeout + RELEASE_TIMEOUT_S

    def subscribe(self) -> Subscription:
        """A new reader of :attr:`events`; its first event, ``subscribed``, holds the
        loop's state now (``GET /v1/events``)."""
        return self.events.subscribe(
            pool=self.store.pool,
            workload=self.cfg.workload,
            phase=self.phase.value,
            turn=self.turn,
            loaded_revision=self.replica.known_version,
        )

    # -- the front door (called by the HTTP front) -----------------------------------

    async def accept(self, kind: str, body: dict[str, Any]) -> Pending:
        """Validate and journal a request, then wake the loop; returns once its group
        committed (:mod:`dispatcher.journal`). Raises DispatchError (nothing journaled)."""
        try:
            staged = self.store.prepare(kind, body, None, self.cfg.sample_deadline)
        except UnknownRevision:
            if self.pool is None:
                raise
            await self.pool.store.refresh_revisions()  # published on another front?
            staged = self.store.prepare(kind, body, None, self.cfg.sample_deadline)
        await self.journal.accept([staged])
        self.serving.signal()
        return staged.pending

    async def accept_many(self, requests: list[tuple[str, Any]]) -> list[Pending]:
        """Validate every ``(kind, body)`` of ``requests``, then journal them all in one
        group (all or nothing); in order. An invalid one raises its error (BadRequest,
        UnknownRevision) with ``requests[i]: `` before its message, and nothing is
        journaled; so does a failed group (StoreError/StoreFull, unprefixed)."""
        staged: list[Staged] = []
        resolved: dict[str | None, str] = {}  # revision lookups, once per batch
        deadline = self.cfg.sample_deadline
        refreshed = False
        for i, (kind, body) in enumerate(requests):
            if i % 256 == 255:
                # A 10,000-prompt list must not hold the loop for half a second; nothing
                # is journaled before the loop ends, so a cancellation here loses nothing.
                await trio.lowlevel.checkpoint()
            try:
                try:
                    staged.append(self.store.prepare(kind, body, None, deadline, resolved=resolved))
                except UnknownRevision:
                    if self.pool is None or refreshed:
                        raise
                    refreshed = True  # published on another front? read them once
                    await self.pool.store.refresh_revisions()
                    staged.append(self.store.prepare(kind, body, None, deadline, resolved=resolved))
            except (BadRequest, UnknownRevision) as e:
                raise type(e)(f"requests[{i}]: {e}") from None
        await self.journal.accept(staged)
        self.serving.signal()
        return [s.pending for s in staged]

    def publish(self, revision: str, path: str) -> tuple[Revision, bool]:
        """Publish weights ``revision`` at ``path``; (revision, newly published).

        Raises :class:`BadRequest` when ``path`` is not a readable checkpoint directory
        (:mod:`dispatcher.checkpoint`; with ``check_revision_paths`` off, only when it
        is no usable path text), before anything is recorded."""
        check_revision_name(revision)
        if self.cfg.check_revision_paths:
            check_checkpoint_dir(path)
        else:
            check_path_text(path)
        try:
            self.store.revision(revision)
            created = False
        except UnknownRevision:
            created = True
        rev = self.store.publish(revision, path)
        self.serving.signal()
        return rev, created

    async def publish_async(self, revision: str, path: str) -> tuple[Revision, bool]:
        """:meth:`publish`, and in pool mode for the whole pool (Redis)."""
        if self.pool is None:
            return self.publish(revision, path)
        check_revision_name(revision)
        if self.cfg.check_revision_paths:
            check_checkpoint_dir(path)  # readable here; each replica reports its loads
        else:
            check_path_text(path)
        out = await self.pool.store.publish(revision, path)
        self.serving.signal()
        return out

    async def wait_result(self, id: str, timeout: float) -> Result:
        """The sample ``id`` once it is finished, or as it stands after ``timeout`` s."""
        if self.pool is not None:
            return await self.pool.wait_result(id, timeout)
        return await self.serving.wait_result(id, timeout)

    async def wait_results(self, ids: list[str], timeout: float) -> list[Result]:
        """The samples ``ids`` (in order) once all are finished, or after ``timeout`` s;
        NotFound naming an unknown id."""
        if self.pool is not None:
            return await self.pool.wait_results(ids, timeout)
        return await self.serving.wait_results(ids, timeout)

    def status(self) -> dict[str, Any]:
        """The loop's state for ``GET /status``."""
        self._refresh_health()
        cur = self._current
        try:
            newest = self.store.newest()
        except StoreError:
            newest = None  # /status must answer while the store is broken: "store" says so
        tokens, token_bytes = self.store.pending_token_bytes()
        now = trio.current_time()
        return {
            "pool": self.store.pool,
            "workload": self.cfg.workload,
            "replica": self.replica.base_url,
            "weight_check": self.cfg.weight_check,
            "sleep_level": self.cfg.sleep_level,
            "lazy_sleep": self.cfg.lazy_sleep,
            "loaded_revision": self.replica.known_version,
            "newest_revision": newest.name if newest else None,
            "state": self.phase.value,
            "turn": self.turn,
            "waiting_seen": bool(cur and cur.waiting_seen_at is not None),
            "in_flight": self.serving.in_flight,
            "pending": {r: self.store.pending_count(r) for r in self.store.pending_revisions()},
            "counts": self.store.counts(),
            "pending_prompt_tokens": tokens,
            "pending_prompt_bytes": token_bytes,
            "counters": {**vars(self.counters), "rejects": dict(self.counters.rejects)},
            "store": self.store.health(),
            "load_backoff": self.serving.load_backoff(now),
            "problem": self.health.problem_json(),
            **({"pool_mode": self.pool.status()} if self.pool else {}),
        }

    def _load_error(self, revision: str) -> str | None:
        own = self.serving.load_error(revision)
        if own is not None:
            name = self.pool.store.replica if self.pool else self.cfg.workload
            return f"replica {name} (this one): {own}"
        return self.pool.load_error(revision) if self.pool else None

    def _figures(self) -> dict[str, Any]:
        """This replica's figures for the pool's status (pool mode)."""
        c = self.counters
        return {
            "workload": self.cfg.workload,
            "replica_url": self.replica.base_url,
            "state": self.phase.value,
            "turn": self.turn,
            "loaded_revision": self.replica.known_version,
            "claimed": self.store.counts()["pending"],
            "in_flight": self.serving.in_flight,
            "turns": c.turns,
            "turn_errors": c.turn_errors,
            "commits": c.commits,
            "loads": c.loads,
            "load_failures": c.load_failures,
            "load_backoff": self.serving.load_backoff(trio.current_time()),
            "problem": self.health.problem_json(),
        }

    # -- plumbing --------------------------------------------------------------------

    async def _drop_connection(self) -> None:
        if self._slicer is not None:
            slicer, self._slicer = self._slicer, None
            with trio.CancelScope(shield=True):
                await slicer.aclose()

    # -- the tasks -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the journal's writer, the ticker and the turn loop until cancelled (a held
        turn is ended; the writer commits what is still queued)."""
        try:
            async with trio.open_nursery() as nursery:
                if self.pool is not None:
                    await nursery.start(self.pool.run)
                else:
                    await nursery.start(self.journal.run)
                nursery.start_soon(self._ticker)
                if self._probe:
                    nursery.start_soon(
                        partial(probe, self.health, self._connect, self._socket,
                                self.cfg.workload, self.replica,
                                held=lambda: self._current is not None,
                                on_replica_lost=self.recovery.forget,
                                on_workload_lost=self.recovery.workload_lost,
                                on_status=self._on_status)
                    )  # fmt: skip
                # Before the front binds: a step-0 request finds its revision at once.
                await self._publish_base()
                task_status.started()
                await self._loop()
        finally:
            await self._drop_connection()

    def _expire(self) -> bool:
        """Fail the requests past their deadline now; False when the store could not."""
        try:
            self.serving.expire(time.time())
        except DispatchError as e:
            log.error("expire failed (retried in 1 s): %s", e)
            return False
        return True

    async def _ticker(self) -> None:
        """Every second, and at each request's deadline: fail requests past their
        deadline, cancel their sends (``sending.EXPIRE_SLACK_S`` after it, a send's own
        bound would call the replica silent)."""
        while True:
            expired = self._expire()
            try:
                self._refresh_health()
            except DispatchError as e:
                log.error("health refresh failed (retried in 1 s): %s", e)
            wait = 1.0
            # After a failed expire the past deadline is still the next one: waking for it
            # would spin (and log) every few ms while the store fails; a second it is.
            with contextlib.suppress(DispatchError):
                due = self.store.next_deadline() if expired else None
                if due is not None:
                    wait = min(wait, max(0.005, due - time.time()))
            await trio.sleep(wait)

    async def _publish_base(self, timeout: float = BASE_READ_TIMEOUT_S) -> None:
        """Publish ``cfg.base_revision`` as the weights the replica booted with: the model
        directory vLLM names (``GET /v1/models`` ``root``), loaded whole like any revision,
        so that an RL loop's step 0 samples before its first publish. Only while nothing
        at all is published (it must never become the newest over the trainer's weights);
        once. A replica, store or pool that cannot be asked now is asked again at a later
        round; a root that is no checkpoint directory here (a hub name) publishes none,
        said once."""
        name = self.cfg.base_revision
        if self._base_done or name is None:
            return
        try:
            if self.pool is not None:
                await self.pool.store.refresh_revisions()
            if self.store.newest() is not None:  # past step 0 (a restart; the trainer's)
                self._base_done = True
                return
            root = await self.replica.model_root(timeout)
            if self.cfg.check_revision_paths:
                check_checkpoint_dir(root)
            else:
                check_path_text(root)
        except BadRequest as e:
            log.warning("base revision %s not published: vLLM was started with %r, which is "
                        "no checkpoint directory here (%s); publish a revision before the "
                        "first sampling request", name, root, e)  # fmt: skip
            self._base_done = True
            return
        except (DispatchError, OSError) as e:
            log.info("base revision %s: not published yet (%s); tried again", name, e)
            return
        try:
            if self.pool is not None:
                # Another front may publish between the read above and this write: the
                # write is conditional, in Redis, on the pool still having none.
                done = await self.pool.store.publish_first(name, root) is not None
            elif self.store.newest() is None:  # none published during the read of root
                self.store.publish(name, root)
                done = True
            else:
                done = False
        except BadRequest as e:  # published meanwhile (another front) with a path of its own
            log.info("base revision %s: %s; kept as it is", name, e)
        except DispatchError as e:
            log.warning("base revision %s: not published yet (%s); tried again", name, e)
            return
        else:
            log.info("base revision %s: %s", name, f"the weights vLLM booted with ({root})"
                     if done else "not published (another revision came first)")  # fmt: skip
        self._base_done = True
        self.serving.signal()

    async def _loop(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            if self.health.state(Check.REPLICA) is True:  # answers: asking it is quick
                await self._publish_base()
            self._expire()  # a request past its deadline wants no turn (the ticker may lag)
            if not self.store.wants_turn():
                self._enter(Phase.IDLE)
                if self.pool is not None:
                    await self.pool.let_go()
                await self.serving.wait_change(1.0)
                continue
            if self.pool is not None and not await self.pool.may_ask():
                # Other replicas holding or asking for turns cover the pool's backlog:
                # waking this one would park its trainer for nothing.
                self._enter(Phase.IDLE)
                await self.serving.wait_change(1.0)
                continue
            wait = self.serving.load_wait(trio.current_time())
            if wait is None and self._waste_until > trio.current_time():
                wait = self._waste_until - trio.current_time()  # after wasted turns
            if wait is None and self._replica_unusable():
                wait = 1.0  # until the probe says it answers (which signals at once)
            if wait is not None:
                # No turn only to find every revision backed off, the replica dead, or
                # nothing to do again: each would park the other workload for nothing.
                self._enter(Phase.BACKOFF)
                if self.pool is not None:
                    await self.pool.let_go()  # let other replicas cover the pool meanwhile
                await self.serving.wait_change(min(wait, 1.0))
                continue
            failed: list[Exception] = []
            try:
                await self._one_turn()
            except* (ClientError, DispatchError, proto.ProtocolError) as group:
                # A failure inside the turn's nurseries (wake, load, a send) arrives
                # wrapped in an ExceptionGroup; anything else (cancellation, a bug)
                # propagates. A line from slicerd that broke the protocol failed the
                # connection's session: that connection is done, this loop is not.
                failed = _leaves(group)
                if any(isinstance(x, proto.ProtocolError) for x in failed):
                    await self._drop_connection()
            if not failed:
                backoff = BACKOFF_MIN_S
                continue
            self.counters.turn_errors += 1
            self._enter(Phase.BACKOFF)
            if self.pool is not None:
                await self.pool.let_go()  # backing off: let other replicas cover the pool
            lost = [x for x in failed if isinstance(x, ClientError) and x.code == "unreachable"]
            if lost:
                self.health.forget(Check.WORKLOAD)  # a new slicerd may not know it
                self.health.fail(Check.DAEMON, daemon_unreachable(self._socket, lost[0]))
            e = failed[0]
            store = any(isinstance(x, StoreError) for x in failed)
            log.error("turn failed (%s: %s); retrying in %.1f s", type(e).__name__, e, backoff)
            self.events.publish("turn_failed", error=f"{type(e).__name__}: {e}",
                                retry_in_s=backoff)  # fmt: skip
            await trio.sleep(backoff)
            backoff = min(backoff * 2, STORE_BACKOFF_MAX_S if store else BACKOFF_MAX_S)

    async def _one_turn(self) -> None:
        if self._slicer is None:
            self._slicer = await self._connect()
        slicer = self._slicer
        self._enter(Phase.ACQUIRING)
        t0 = time.monotonic()
        loads = self.counters.loads  # an early start's load (before the grant) is work too
        load_failures = self.counters.load_failures
        try:
            wait = self.cfg.acquire_wait
            if self.pool is not None:  # ask again soon: others may serve the backlog first
                wait = min(wait, self.pool.acquire_wait)
            turn = await self._acquire(slicer, wait)
        except ClientError as e:
            if e.code == "timeout":
                self.health.ok(Check.DAEMON)
                self.health.ok(Check.WORKLOAD)  # queued for the GPU: it knows us
                log.info("ACQUIRE %s: not granted within %g s; again", self.cfg.workload,
                         wait)  # fmt: skip
                return
            if e.code == proto.ErrorCode.UNKNOWN_WORKLOAD:
                self.health.ok(Check.DAEMON)
                self.health.fail(Check.WORKLOAD, workload_unknown(self.cfg.workload))
            if e.code == "unreachable":
                await self._drop_connection()
            raise
        except BaseException:
            await self._drop_connection()  # a cut-off request leaves the stream out of step
            raise
        self.health.ok(Check.DAEMON)
        self.health.ok(Check.WORKLOAD)
        cur = TurnState(
            turn, worked=self.counters.loads > loads, load_failures_at_ask=load_failures
        )
        told = [m for m in slicer.events if isinstance(m, proto.Waiting) and m.turn == turn.turn]
        if told:
            cur.waiting_seen_at = trio.current_time()
        slicer.events.clear()
        self._current, self.turn = cur, turn.turn
        self.counters.turns += 1
        log.info("turn %d: granted after %.3f s (restored=%d)", turn.turn,
                 time.monotonic() - t0, turn.restored)  # fmt: skip
        self.events.publish("granted", turn=turn.turn, wait_s=_since(t0),
                            restored=turn.restored)  # fmt: skip
        if told:  # told with the grant: the turn's end window opens now
            log.info("turn %d: WAITING (%d waiter(s))", turn.turn, told[0].waiters)
            self.events.publish("waiting", turn=turn.turn, waiters=told[0].waiters)
        reason = "error"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_events, slicer, cur)
                await self._prepare(cur)
                reason = await self.serving.serve(cur)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._end_turn(slicer, cur, reason)

    async def _acquire(self, slicer: AsyncSlicer, wait: float) -> Turn:
        """ACQUIRE within ``wait`` s, with an early start where one is asked for
        (:mod:`dispatcher.early`): on slicerd's ``EARLY`` the weights are woken and loaded
        while the grant is awaited. Returns the grant once the early stage (if any) is
        over. An ACQUIRE that fails cuts a stage still running off (`EarlyStart.interrupted`)
        instead of waiting on a wake or load that slicerd's lock may hold up."""
        nbytes = await self.early.asked()
        if not nbytes:
            return await slicer.acquire(self.cfg.workload, wait=wait)
        told: list[int] = []
        go, done = trio.Event(), trio.Event()

        def on_event(msg: proto.ServerMessage) -> None:
            if isinstance(msg, proto.Early) and msg.workload == self.cfg.workload and not told:
                told.append(msg.nbytes)
                go.set()

        async def early_stage() -> None:
            await go.wait()
            await self.early.prepare(told[0])
            done.set()

        failure: ClientError | proto.ProtocolError | None = None
        turn: Turn | None = None
        slicer.on_event = on_event
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(early_stage)
                try:
                    turn = await slicer.acquire(self.cfg.workload, wait=wait, early=nbytes)
                except (ClientError, proto.ProtocolError) as e:
                    failure = e
                    if go.is_set() and not done.is_set():
                        self.early.interrupted()
                if failure is not None or not go.is_set():
                    nursery.cancel_scope.cancel()  # no grant, or no early stage to wait for
        finally:
            slicer.on_event = None
        if failure is not None:
            if isinstance(failure, ClientError):
                self.early.refused(failure)
            raise failure
        assert turn is not None
        return turn

    async def _read_events(self, slicer: AsyncSlicer, cur: TurnState) -> None:
        """Read slicerd's lines during the turn: WAITING marks the turn's end window."""
        while True:
            msg = await slicer.next_message()
            if isinstance(msg, proto.Waiting) and msg.turn == cur.turn.turn:
                if cur.waiting_seen_at is None:
                    cur.waiting_seen_at = trio.current_time()
                    log.info("turn %d: WAITING (%d waiter(s))", msg.turn, msg.waiters)
                    self.events.publish("waiting", turn=msg.turn, waiters=msg.waiters)
                    self.serving.signal()
            elif isinstance(msg, proto.Fault):
                log.warning("FAULT for %s (the registrant handles it)", msg.workload)

    async def _prepare(self, cur: TurnState) -> None:
        n = cur.turn.turn
        try:
            await self.recovery.check(n)  # a restarted replica: recover it now
            if self.recovery.needed:
                self._enter(Phase.RECOVERING)
                t0 = time.monotonic()
                await self.replica.recover()
                self.recovery.needed = False
                log.info("turn %d: recovered the replica in %.3f s", n, time.monotonic() - t0)
                self.events.publish("recovered", turn=n, duration_s=_since(t0))
            self._enter(Phase.WAKING)
            t0 = time.monotonic()
            if self.replica.unknown:  # a control call failed: read what it holds first
                found = await self.replica.settle(min(self.cfg.wake_timeout, CONTROL_TIMEOUT_S))
                log.info("turn %d: read the replica back after a failed call: %s", n, found)
                self.events.publish("settled", turn=n, early=False, found=found)
            if self.replica.awake and await self._still_awake(n):
                cur.wake_skipped = True  # nobody was parked for this turn
                self.health.ok(Check.REPLICA)
                return
            if self.replica.kv_asleep and not self.replica.dropped:
                # An early start (or an ACQUIRE that ended after one) woke the weights and
                # loaded them: only the KV cache is left (it marks the turn failed itself).
                await self.serving.wake_kv_cache(cur)
                if cur.replica_failed is None:
                    self.health.ok(Check.REPLICA)
                return
            dropped = self.replica.dropped
            if dropped:
                # Level 2 dropped the weights: wake only them; the load (Serving) comes
                # next, and only then the KV cache; nothing is sent before (the load
                # sets known_version).
                await self.replica.wake_weights(self.cfg.wake_timeout)
            else:
                await self.replica.wake(self.cfg.wake_timeout)
        except ReplicaError as e:
            self.health.fail(Check.REPLICA, replica_unhealthy(self.replica.base_url, e))
            raise
        self.health.ok(Check.REPLICA)
        if dropped:
            log.info("turn %d: woke the weights in %.3f s (after sleep level 2: load, then "
                     "the KV cache)", n, time.monotonic() - t0)  # fmt: skip
            self.events.publish("woke", turn=n, duration_s=_since(t0), tags=["weights"])
        else:
            log.info("turn %d: woke in %.3f s", n, time.monotonic() - t0)
            self.events.publish("woke", turn=n, duration_s=_since(t0), tags=None)

    async def _still_awake(self, n: int) -> bool:
        """After a lazy release (we left the replica awake): is it still? One bounded
        ``GET /is_sleeping`` (a failure raises, as a failed wake does). Awake: the wake is
        skipped (True). Asleep: someone else slept it (slicerd asked its launcher to park
        it); ``GET /metrics`` says at which level, and :meth:`Replica.slept_by_other
        <dispatcher.vllm.Replica.slept_by_other>` records whether the weights survived
        (False: wake as after our own sleep)."""
        t0 = time.monotonic()
        if not await self.replica.is_sleeping(min(self.cfg.wake_timeout, CONTROL_TIMEOUT_S)):
            self.counters.wakes_skipped += 1
            log.info("turn %d: the replica is still awake (left awake at the last turn's "
                     "end): no wake", n)  # fmt: skip
            self.events.publish("woke", turn=n, duration_s=_since(t0), tags=None, skipped=True)
            return True
        state = await self.replica.sleep_state(min(self.cfg.wake_timeout, CONTROL_TIMEOUT_S))
        self.replica.slept_by_other(state)
        kept = "weights kept" if not self.replica.dropped else "weights count as dropped"
        log.info("turn %d: the replica was slept by someone else meanwhile (sleep state %s: "
                 "%s)", n, state, kept)  # fmt: skip
        return False

    # -- ending a turn ---------------------------------------------------------------

    def _sleep_level(self) -> int:
        """The sleep level of this turn's end (:func:`core.sleep_level
        <dispatcher.core.sleep_level>` over the revisions pending requests want: this
        store's, and in pool mode also what the last poll saw claimable in the pool)."""
        mode, loaded = self.cfg.sleep_level, self.replica.known_version
        if mode != "auto":
            return sleep_level(mode, loaded, (), None)
        try:
            wanted = set(self.store.pending_revisions())
            if self.pool is not None:
                wanted |= {
                    rev for rev, f in self.pool.store.summary.revisions.items()
                    if f.get("unclaimed", 0) + f.get("reclaimable", 0) > 0
                }  # fmt: skip
            newest = self.store.newest()
        except Exception as e:  # the sleep must happen whatever the store says
            # What is wanted is unknown: keep what is loaded (level 1), as before auto.
            log.warning("sleep level: pending revisions unknown (%s); level by the weights", e)
            return sleep_level(mode, loaded, (), None)
        # Each of the last CHANGING_TURNS turns loaded a revision other than the one
        # before: the weights change every step, the next wake will load new ones.
        recent = [*self._loaded_at_end[-CHANGING_TURNS:], loaded]
        changing = len(recent) > CHANGING_TURNS and all(
            a is not None and a != b for a, b in itertools.pairwise(recent)
        )
        return sleep_level(mode, loaded, wanted, newest.name if newest else None, changing)

    async def _finish_wake(self, n: int) -> None:
        """Wake the KV cache of a level-2 wake that ended before its load finished (it
        failed, or nothing was left to serve), so the sleep that follows is one: vLLM
        counts as sleeping until fully awake, and a ``/sleep`` then is a no-op that would
        leave the woken weights on the GPU. Nothing is sent in between (known_version is
        None, and the dispatcher owns admission)."""
        t0 = time.monotonic()
        try:
            await self.replica.wake_kv_cache(self.cfg.wake_timeout)
        except ReplicaError as e:
            log.error("turn %d: waking the KV cache before the sleep failed: %s", n, e)
            return
        log.info("turn %d: woke the KV cache in %.3f s (to sleep the unloaded weights)", n,
                 time.monotonic() - t0)  # fmt: skip

    async def _wake_whole(self, n: int) -> None:
        """Before the sleep of a turn in which a wake failed or was cut off
        (:attr:`Replica.half_woken`): wake the replica whole (``POST /wake_up``, every
        tag; a no-op when it is awake). It may be half-woken (the weights without their KV
        cache), which vLLM counts as sleeping: a ``/sleep`` would then be a no-op that
        leaves the weights on the GPU, under a parked-memory bound perhaps. Costs a wake
        only on that failure path; it stays :attr:`Replica.unknown` (read back before the
        next turn sends anything)."""
        t0 = time.monotonic()
        try:
            await self.replica.wake(min(self.cfg.wake_timeout, self.cfg.sleep_timeout))
        except ReplicaError as e:
            log.error("turn %d: waking the replica whole before the sleep failed: %s", n, e)
            return
        log.info("turn %d: woke the replica whole in %.3f s (a wake failed: so that the "
                 "sleep frees everything)", n, time.monotonic() - t0)  # fmt: skip

    def _lazy(self, cur: TurnState, reason: str) -> bool:
        """Whether this turn ends with a lazy release (vLLM left awake): ``--lazy-sleep``,
        the turn ran out of work (``idle``) and saw no WAITING (nobody else asked for the
        GPU), and the replica is healthy: no replica error or broken load, no recovery
        due, fully awake with whole weights this client loaded. Anything else sleeps."""
        r = self.replica
        # --lazy-sleep-always: also when another waits (slicerd then freezes the awake
        # replica where fit-aware turns let it, else has its launcher sleep it).
        unasked = reason == "idle" and cur.waiting_seen_at is None
        anyway = self.cfg.lazy_always and reason in ("idle", "waiting")
        return (
            self.cfg.lazy_sleep and (unasked or anyway)
            and cur.replica_failed is None and not cur.load_broke and not self.recovery.needed
            and r.awake and not r.kv_asleep and not r.dropped and r.known_version is not None
        )  # fmt: skip

    async def _end_turn(self, slicer: AsyncSlicer, cur: TurnState, reason: str) -> None:
        """Sleep the replica (unless :meth:`_lazy`), then RELEASE (runs shielded; every
        step bounded)."""
        n = cur.turn.turn
        level = self._sleep_level()  # before the claims go back: they are what it wants
        self._loaded_at_end = [*self._loaded_at_end[-CHANGING_TURNS:], self.replica.known_version]
        if self.pool is not None:
            await self.pool.turn_ended()  # others may serve them while this one sleeps
        if reason == "replica-error" or cur.load_broke:
            self.recovery.needed = True  # perhaps a new replica process: first sight again
        if not self.recovery.told(cur) and cur.replica_failed:
            url = self.replica.base_url
            self.health.fail(Check.REPLICA, replica_unhealthy(url, cur.replica_failed))
        lazy = self._lazy(cur, reason)
        if lazy:
            # Nobody else wants the GPU: the next turn finds vLLM awake and loaded. If
            # another workload asks meanwhile, slicerd parks it: PARK to the launcher,
            # which sleeps it; verified; cuda-checkpoint as the fallback.
            self.counters.lazy_releases += 1
            log.info("turn %d: left awake (nobody waiting)", n)
        else:
            await self._sleep(n, level)
        wasted = self._count_waste(cur, reason)
        self._enter_ending(Phase.RELEASING)
        released: str | None = "the slicerd connection broke during the turn"
        if self._slicer is slicer:
            try:
                with trio.fail_after(RELEASE_TIMEOUT_S):
                    await slicer.release(cur.turn, used=cur.worked)
                log.info("turn %d: released (%s)", n, reason)
                released = None
            except (ClientError, proto.ProtocolError, trio.TooSlowError) as e:
                log.error("turn %d: RELEASE failed (%s); dropping the connection", n, e)
                released = f"RELEASE failed: {e}"
                await self._drop_connection()
        extra = {} if released is None else {"error": released}
        self.events.publish("released", turn=n, reason=reason, ok=released is None, lazy=lazy,
                            used=cur.worked, wasted=wasted, **extra)  # fmt: skip
        self._current, self.turn = None, None
        self._enter_ending(Phase.IDLE)

    def _count_waste(self, cur: TurnState, reason: str) -> bool:
        """Whether ``cur`` was a wasted turn (nothing loaded or served, and the replica
        had to be woken for it: a park was paid); counts it and backs the next ACQUIRE
        off (``WASTE_BACKOFF_*``), or resets the backoff after a turn that worked."""
        if cur.worked:
            self._wasted_in_a_row = 0
            self._waste_until = 0.0
            return False
        if cur.wake_skipped:
            return False  # found awake after a lazy release: no park was paid for it
        self.counters.wasted_turns += 1
        if self.counters.load_failures > cur.load_failures_at_ask:
            # A failed load: its revision's own backoff (dispatcher.serve) spaces the next
            # tries; other revisions' work must not wait behind it.
            log.warning("turn %d: wasted (a load failed; the revision is backed off)",
                        cur.turn.turn)  # fmt: skip
            return True
        self._wasted_in_a_row += 1
        delay = min(WASTE_BACKOFF_MAX_S, WASTE_BACKOFF_MIN_S * 2 ** (self._wasted_in_a_row - 1))
        self._waste_until = trio.current_time() + delay
        log.warning("turn %d: wasted (ended %s with nothing loaded or served; %d in a row); "
                    "no turn asked for in the next %.0f s", cur.turn.turn, reason,
                    self._wasted_in_a_row, delay)  # fmt: skip
        return True

    async def _sleep(self, n: int, level: int) -> None:
        """The sleep at a turn's end, at ``level`` (a failure is logged and published;
        the RELEASE follows all the same)."""
        self._enter_ending(Phase.SLEEPING)
        t0 = time.monotonic()
        try:
            if self.replica.half_woken:
                await self._wake_whole(n)
            elif self.replica.kv_asleep:
                await self._finish_wake(n)
            await self.replica.sleep(level=level, mode="abort", timeout=self.cfg.sleep_timeout)
            log.info("turn %d: slept the replica (level %d) in %.3f s", n, level,
                     time.monotonic() - t0)  # fmt: skip
            if level == 2:
                self.counters.sleeps_level2 += 1
            else:
                self.counters.sleeps_level1 += 1
            self.events.publish("slept", turn=n, duration_s=_since(t0), ok=True, level=level)
        except ReplicaError as e:
            log.error("turn %d: sleep (level %d) failed: %s", n, level, e)
            self.events.publish("slept", turn=n, duration_s=_since(t0), ok=False, level=level,
                                error=str(e))  # fmt: skip
