"""The send side of serving: sending pending samples (alone or batched) and judging answers.

:class:`Sender` builds each send (one sample, or a batch of samples sharing
core.batch_key), sends it, splits a batch's answer (core.split_batch), judges each
answer (core.result_ok) and handles a failed send. Apart from :mod:`dispatcher.serve`
because it is the per-request half: :class:`~dispatcher.serve.Serving` owns the state
(in-flight scopes, retry times, the send-alone set, send error counts) and passes it in;
what the sends mean is described in :mod:`dispatcher.serve`'s docstring.

A result refused because its weights are not the revision loaded (reject
``weight_version``, or ``weight_label`` in label mode; the epoch did not change, so no load
of ours came between) means the replica is not the one we loaded: a replica restarted by
its launcher mid-turn serves its boot weights under ``"default"``, and every retry would
be refused again until the request's deadline. After ``MAX_WEIGHT_REFUSALS`` such
refusals in a row in one turn (no commit between), ``on_foreign(revision, how)`` is
called: the turn loop reports it (``replica serves weights other than REV``), ends the
turn as a replica error and recovers the replica and reloads ``REV`` in the next turn.
The requests stay pending. Eight, not one: a single odd answer must not cost a reload,
and eight come within a second under load (or eight seconds for a lone request).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from gpu_slicer.dispatcher.core import (
    batch_key,
    batch_request_body,
    request_body,
    result_ok,
    split_batch,
    weight_versions,
)
from gpu_slicer.dispatcher.errors import DispatchError, ReplicaError
from gpu_slicer.dispatcher.journal import Journal
from gpu_slicer.dispatcher.model import Counters, Pending, TurnConfig, TurnState
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.vllm import CONTROL_TIMEOUT_S, Replica

if TYPE_CHECKING:
    from gpu_slicer.dispatcher.poollink import PoolJournal

__all__ = [
    "MAX_WEIGHT_REFUSALS",
    "NO_WEIGHT_VERSIONS_ERROR",
    "RETRY_AFTER_S",
    "SEND_FAILED",
    "Sender",
]

# A send is bounded by its request's deadline and this much more: the ticker expires the
# request at its deadline (TurnLoop._ticker wakes for it), which cancels the send first,
# so a request that simply ran out of time never reads as a replica that did not answer.
EXPIRE_SLACK_S = 0.5

# The logger of dispatcher.serve, as before the send side moved here (logs are filtered by it).
log = logging.getLogger("dispatcher.serve")

RETRY_AFTER_S = 1.0  # a rejected or failed send is tried again after this
_PERMANENT = (400, 422)  # vLLM refused the request itself: retrying cannot help
MAX_WEIGHT_REFUSALS = 8  # results in a row with other weights: not the replica we loaded
_FOREIGN = ("weight_version", "weight_label")  # the reject reasons that count towards it
SEND_FAILED = "send failed"  # how the error of a request failed by its sends starts
NO_WEIGHT_VERSIONS_ERROR = (
    "replica returned no weight_versions: vLLM older than 0.33 ignores "
    "return_weight_versions, so no result can be committed; start slicer-dispatch with "
    "--weight-check label"
)


def _reject_reason(
    body: dict[str, Any], p: Pending, epoch_at_send: int, epoch_now: int, label: str | None = None
) -> str:
    """Why :func:`core.result_ok` refused ``body`` (a metrics label); ``label`` as there."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != (p.params.get("n") or 1):
        return "choices"
    if any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
        return "aborted"
    if epoch_at_send != epoch_now:
        return "epoch"
    if label is not None:
        return "weight_label"  # the label, or the revision loaded, is another one
    if any(not spans for spans in weight_versions(body)):
        return "no_weight_versions"
    return "weight_version"


def _served(body: dict[str, Any], label: str | None) -> str:
    """The weights ``body`` says it came from, in words (for the log)."""
    if label is not None:
        return f"/weight_info label {label!r}"
    found = sorted({str(s.get("version")) for spans in weight_versions(body) for s in spans
                    if isinstance(s, dict)})  # fmt: skip
    return f"weight_versions {found}" if found else "no weight_versions"


def _no_weight_versions_at_all(body: dict[str, Any]) -> bool:
    """Whether ``body`` has choices but none carries ``weight_versions`` (a vLLM that
    ignores ``return_weight_versions``)."""
    spans = weight_versions(body)
    return bool(spans) and not any(spans)


class Sender:
    """Sends the pending samples of the revision served (module docstring).

    ``in_flight``, ``retry_at``, ``alone`` and ``send_errors`` are :class:`Serving`'s own
    dicts and set, changed here in place; ``signal`` wakes its waits, ``commit`` and
    ``fail`` finish a sample through its journal."""

    def __init__(
        self,
        store: Store,
        journal: Journal | PoolJournal,
        replica: Replica,
        cfg: TurnConfig,
        counters: Counters,
        *,
        in_flight: dict[str, trio.CancelScope],
        retry_at: dict[str, float],
        alone: set[str],
        send_errors: dict[str, int],
        signal: Callable[[], None],
        commit: Callable[[TurnState, Pending, bytes], None],
        fail: Callable[[Pending, str], None],
        on_foreign: Callable[[str, str], None] | None = None,
    ) -> None:
        self.store = store
        self.journal = journal
        self.replica = replica
        self.cfg = cfg
        self.counters = counters
        self._in_flight = in_flight
        self._retry_at = retry_at
        self._alone = alone  # ids never batched again (a batch of theirs was refused)
        self._send_errors = send_errors  # id -> unexpected errors of its sends
        self.signal = signal
        self._commit = commit
        self._fail = fail
        self._sends = 0  # HTTP sends in flight (a batch of prompts is one)
        self._told_no_weight_versions = False  # the error is logged once per loop
        self._on_foreign = on_foreign
        self._refusals: tuple[TurnState | None, int] = (None, 0)  # foreign results in a row

    def sendable(self, p: Pending, now: float, wall: float | None = None) -> bool:
        """Whether ``p`` may be sent at ``now`` (trio's clock) and ``wall`` (Unix time,
        default now): not in flight, not waiting for a retry or for its result's commit,
        and not past its deadline. A request past its deadline has failed for its client
        the moment the deadline passed (``Store.get``), whether or not the ticker has
        journaled that yet (a restart, a full disk): it is never sent afterwards."""
        # A result waiting for its group commit is not sent again (dispatcher.journal).
        return (
            p.id not in self._in_flight
            and self._retry_at.get(p.id, 0.0) <= now
            and not self.journal.queued(p.id)
            and p.deadline > (time.time() if wall is None else wall)
        )

    def fill(self, sends: trio.Nursery, cur: TurnState, revision: str, now: float) -> None:
        free = self.cfg.concurrency - self._sends
        if free <= 0:
            return
        size = self.cfg.batch_prompts
        wall = time.time()
        if size <= 1:
            for p in self.store.iter_pending(revision):
                if free <= 0:
                    break
                if self.sendable(p, now, wall):
                    self._start(sends, cur, [p])
                    free -= 1
            return
        # Up to `free` sends of up to `size` samples; the scan ends after `free * size`
        # sendable ones (those in flight sit at the front), not at the end of the queue.
        groups: dict[str, list[Pending]] = {}
        budget = free * size
        for p in self.store.iter_pending(revision):
            if free <= 0 or budget <= 0:
                break
            if not self.sendable(p, now, wall):
                continue
            budget -= 1
            key = self._batch_key(p)
            if key is None:
                self._start(sends, cur, [p])
                free -= 1
                continue
            group = groups.setdefault(key, [])
            group.append(p)
            if len(group) == size:
                del groups[key]
                self._start(sends, cur, group)
                free -= 1
        for group in groups.values():  # the partial batches, oldest first
            if free <= 0:
                break
            self._start(sends, cur, group)
            free -= 1

    def _batch_key(self, p: Pending) -> str | None:
        """``p``'s core.batch_key, or None when it is sent alone (a chat, a member of a
        refused batch, params that are no JSON)."""
        if p.kind != "completion" or p.prompt is None or p.id in self._alone:
            return None
        try:
            return batch_key(p)
        except (TypeError, ValueError):
            return None

    def _start(self, sends: trio.Nursery, cur: TurnState, ps: list[Pending]) -> None:
        # One scope for the send, under every member: expiring one cancels the send.
        scope = trio.CancelScope()
        for p in ps:
            self._in_flight[p.id] = scope
        self._sends += 1
        sends.start_soon(self._send_group, cur, ps, scope, self.replica.epoch)

    async def _send_group(
        self, cur: TurnState, ps: list[Pending], scope: trio.CancelScope, epoch: int
    ) -> None:
        """Send ``ps`` (one sample, or a batch of them) once in turn ``cur`` under
        ``scope``: :meth:`_send` for one, :meth:`_send_batch` for more."""
        try:
            live = [p for p in ps if self.store.is_pending(p.id)] if len(ps) > 1 else ps
            if len(live) == 1:
                await self._send(cur, live[0], scope, epoch)
            elif live:
                await self._send_batch(cur, live, scope, epoch)
        finally:
            self._sends -= 1
            for p in ps:
                if self._in_flight.get(p.id) is scope:
                    del self._in_flight[p.id]
            self.signal()

    async def _send(self, cur: TurnState, p: Pending, scope: trio.CancelScope, epoch: int) -> None:
        """Send ``p`` once in turn ``cur``; commit the answer only if core.result_ok says
        so. Any error but a cancellation ends this send only (:meth:`_send_error`)."""
        try:
            with scope:
                try:
                    await self._send_once(cur, p, epoch)
                except Exception as e:  # ReplicaError is handled inside: this is the rest
                    self._send_error(p, e)
        finally:
            self._in_flight.pop(p.id, None)
            self.signal()

    async def _send_batch(
        self, cur: TurnState, ps: list[Pending], scope: trio.CancelScope, epoch: int
    ) -> None:
        """:meth:`_send` of a batch: any error but a cancellation ends this send only
        (:meth:`_batch_error`)."""
        with scope:
            try:
                await self._batch_once(cur, ps, epoch)
            except Exception as e:  # ReplicaError is handled inside: this is the rest
                self._batch_error(ps, e)

    async def _send_once(self, cur: TurnState, p: Pending, epoch: int) -> None:
        if not self.store.is_pending(p.id):
            return  # finished (expired) meanwhile
        self.journal.attempt(p)  # written with the next group (dispatcher.journal)
        self.counters.sends += 1
        body = request_body(p, self.cfg.model or "")
        if not self.cfg.model:
            del body["model"]  # vLLM serves its only model
        timeout = max(1.0, p.deadline - time.time()) + EXPIRE_SLACK_S
        try:
            raw, answer = await self.replica.complete_raw(p.kind, body, timeout)
        except ReplicaError as e:
            self._send_failed(cur, p, e)
            return
        label: str | None = None
        if self.cfg.weight_check == "label" and self.store.is_pending(p.id):
            # Still in flight (no load can start): read the served label once.
            bound = min(CONTROL_TIMEOUT_S, max(1.0, p.deadline - time.time()))
            try:
                label = await self.replica.weight_version(bound)
            except ReplicaError as e:
                self._send_failed(cur, p, e, refusal=False)
                return
        self._judge(cur, p, raw, answer, epoch, label)

    async def _batch_once(self, cur: TurnState, ps: list[Pending], epoch: int) -> None:
        """One send of the completion samples ``ps`` (same core.batch_key); the answer is
        split (core.split_batch) and each part judged and committed on its own."""
        k = len(ps)
        for p in ps:
            self.journal.attempt(p)
        self.counters.sends += 1
        self.counters.batched_samples += k
        body = batch_request_body(ps, self.cfg.model or "")
        if not self.cfg.model:
            del body["model"]
        # The latest deadline: an earlier one expires its sample, which cancels the send.
        last = max(p.deadline for p in ps)
        timeout = max(1.0, last - time.time()) + EXPIRE_SLACK_S
        try:
            _, answer = await self.replica.complete_raw("completion", body, timeout)
        except ReplicaError as e:
            self._batch_failed(cur, ps, e)
            return
        label: str | None = None
        if self.cfg.weight_check == "label" and any(self.store.is_pending(p.id) for p in ps):
            # Still in flight (no load can start): one label read for the whole batch.
            bound = min(CONTROL_TIMEOUT_S, max(1.0, last - time.time()))
            try:
                label = await self.replica.weight_version(bound)
            except ReplicaError as e:
                self._batch_failed(cur, ps, e, refusal=False)
                return
        parts = split_batch(answer, k, ps[0].params.get("n") or 1)
        if parts is None:
            self.counters.rejects["choices"] += k
            retry_at = trio.current_time() + RETRY_AFTER_S
            for p in ps:
                self._retry_at[p.id] = retry_at
            log.warning("batch of %d (revision %s, first %s): its choices cannot be split by "
                        "prompt; not committed, they stay pending", k, ps[0].revision,
                        ps[0].id)  # fmt: skip
            return
        for p, part in zip(ps, parts, strict=True):
            own = json.dumps(part, ensure_ascii=False, separators=(",", ":")).encode()
            self._judge(cur, p, own, part, epoch, label)

    def _batch_failed(
        self, cur: TurnState, ps: list[Pending], e: ReplicaError, *, refusal: bool = True
    ) -> None:
        """A batch send (or, ``refusal`` False, its ``/weight_info`` check) failed. vLLM's
        400/422 cannot say which prompt it refused: every member is sent alone at once, so
        a bad one then fails alone with vLLM's own error. Otherwise as :meth:`_send_failed`
        for each member (a 5xx or no answer marks the replica failed)."""
        live = [p for p in ps if self.store.is_pending(p.id)]
        if refusal and e.status in _PERMANENT:
            self.counters.rejects["batch_refused"] += len(live)
            self._alone.update(p.id for p in live)
            log.info("batch of %d (revision %s) refused (HTTP %s: %s); each is sent alone",
                     len(ps), ps[0].revision, e.status, e)  # fmt: skip
            return
        self.counters.rejects["error"] += len(live)
        retry_at = trio.current_time() + RETRY_AFTER_S
        for p in live:
            self._retry_at[p.id] = retry_at
        log.warning("batch of %d (revision %s, first %s): send failed (%s); they stay pending",
                    len(ps), ps[0].revision, ps[0].id, e)  # fmt: skip
        if e.status is None or e.status >= 500:
            cur.replica_failed = str(e)
            self.signal()

    def _batch_error(self, ps: list[Pending], e: Exception) -> None:
        """An unexpected error ended a batch send: its members are sent alone from now on,
        where :meth:`_send_error` counts and bounds each one's errors."""
        self.counters.send_errors += 1
        trace = None if isinstance(e, DispatchError) else e
        log.error("batch of %d (revision %s, first %s) failed (%s: %s); each is sent alone",
                  len(ps), ps[0].revision, ps[0].id, type(e).__name__, e,
                  exc_info=trace)  # fmt: skip
        self._alone.update(p.id for p in ps if self.store.is_pending(p.id))

    def _send_error(self, p: Pending, e: Exception) -> None:
        """An unexpected error ended a send of ``p``: retry it later, and fail it after
        ``max_send_errors`` of them (module docstring)."""
        self.counters.send_errors += 1
        n = self._send_errors[p.id] = self._send_errors.get(p.id, 0) + 1
        what = f"{type(e).__name__}: {e}"
        # A store error is reported by the store; anything else is a bug worth its trace.
        trace = None if isinstance(e, DispatchError) else e
        if n < self.cfg.max_send_errors:
            log.error("%s (revision %s): send %d of %d failed (%s); stays pending", p.id,
                      p.revision, n, self.cfg.max_send_errors, what, exc_info=trace)  # fmt: skip
            self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
            return
        msg = (
            f"{SEND_FAILED}: sample {p.id} (pool {p.pool}, revision {p.revision}) could not "
            f"be sent {n} times; last error: {what}"
        )
        log.error("%s", msg, exc_info=trace)
        self._fail(p, msg)

    def _judge(
        self,
        cur: TurnState,
        p: Pending,
        raw: bytes,
        answer: dict[str, Any],
        epoch: int,
        label: str | None,
    ) -> None:
        """Commit ``answer`` (``raw``: its bytes) as ``p``'s result if core.result_ok says
        so (``label``: the ``/weight_info`` label read after it in label mode, else None)."""
        if not self.store.is_pending(p.id) or self.journal.queued(p.id):
            return
        loaded = self.replica.known_version or ""
        if result_ok(p, answer, loaded, epoch, self.replica.epoch, label):
            self._refusals = (cur, 0)
            cur.worked = True
            self._commit(cur, p, raw)  # as vLLM returned it
            return
        reason = _reject_reason(answer, p, epoch, self.replica.epoch, label)
        self.counters.rejects[reason] += 1
        self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
        if reason in _FOREIGN and loaded:
            turn, n = self._refusals
            n = n + 1 if turn is cur else 1
            self._refusals = (cur, n)
            if n == MAX_WEIGHT_REFUSALS and self._on_foreign is not None:
                how = f"{n} results in a row refused, the last with {_served(answer, label)}"
                self._on_foreign(loaded, how)
        if (
            label is None
            and reason == "no_weight_versions"
            and _no_weight_versions_at_all(answer)
            and not self._told_no_weight_versions
        ):
            self._told_no_weight_versions = True
            log.error("%s", NO_WEIGHT_VERSIONS_ERROR)
        log.warning("%s (revision %s): result not committed (%s); stays pending", p.id,
                    p.revision, reason)  # fmt: skip

    def _send_failed(
        self, cur: TurnState, p: Pending, e: ReplicaError, *, refusal: bool = True
    ) -> None:
        """A send in turn ``cur`` (or, ``refusal`` False, its ``/weight_info`` check)
        failed: retry it later, marking the replica failed on a 5xx or no answer. With
        ``refusal`` vLLM's 400/422 fails the request for good; a failed check never does."""
        if refusal and e.status in _PERMANENT and self.store.is_pending(p.id):
            self.counters.refused_by_replica += 1
            cur.worked = True  # vLLM judged it: the turn was used, if only to say no
            self._fail(p, f"refused by the replica (HTTP {e.status}): {e}")
            return
        self.counters.rejects["error"] += 1
        self._retry_at[p.id] = trio.current_time() + RETRY_AFTER_S
        log.warning("%s: send failed (%s); stays pending", p.id, e)
        if e.status is None or e.status >= 500:
            cur.replica_failed = str(e)
            self.signal()
