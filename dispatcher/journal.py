"""Group commit: the dispatcher's writes to its store, one transaction per round.

Theory of operation
-------------------
Every write of the request path goes through one :class:`Journal`: new requests
(:meth:`Journal.accept`), results (:meth:`Journal.finish`, done or failed) and send
counts (:meth:`Journal.attempt`). They are queued in memory; one writer task
(:meth:`Journal.run`, started in the turn loop's nursery) takes *everything* queued and
commits it as one group, :meth:`Store.commit <dispatcher.store.Store.commit>`, a single
SQLite transaction. The writer waits for work on an event, never on a timer: a lone
request is committed in the next scheduling round, and requests that arrive while a
group is being written (the commit runs on the trio thread, so the others queue up
behind it) share the next group. Batching is as wide as the load is.

The acknowledgement rule holds per request: :meth:`Journal.accept` returns only after
the group holding it committed, and a request is indexed (visible as pending) only
then. A group that fails (:class:`~dispatcher.errors.StoreFull`,
:class:`~dispatcher.errors.StoreError`) fails exactly the accepts of that group with
that error (the front answers 507/503; nothing of theirs was journaled), and hands each
of its results to the ``on_error`` its caller gave: the sample stays pending and is sent
again later, like a failed send; it is never marked done in memory. While a result waits
for its commit, :meth:`Journal.queued` is true for its sample (the sender must not send
it again); the writer is outside any turn, so a load or a turn's end cannot lose it.

Send counts are counted in memory (``Pending.attempts``) and written with the next
group, not a transaction of their own: a crash can lose the counts of the sends since
the last group, nothing else (they only bound retries and show in the database).

Without a running writer (:meth:`run` not started, or ended) every call commits at once
(a group of one): the store is then used directly, as tests and tools do. When the
writer ends (the dispatcher stops) it commits what is still queued first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import trio

from gpu_slicer.dispatcher.errors import StoreError
from gpu_slicer.dispatcher.model import Pending
from gpu_slicer.dispatcher.store import Finish, Staged, Store

__all__ = ["Journal"]

log = logging.getLogger("dispatcher.journal")

_T = TypeVar("_T")


class _Ack:
    """The outcome of one :meth:`Journal.accept`: set once its group committed or failed."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: StoreError | None = None


class Journal:
    """The group-commit writer in front of ``store`` (module docstring).

    ``groups`` counts the groups committed, ``failed_groups`` those that failed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.groups = 0
        self.failed_groups = 0
        self._new: list[Staged] = []
        self._acks: list[_Ack] = []  # one per accept() of the requests in _new
        self._finishes: list[Finish] = []
        self._callbacks: list[tuple[Callable[[bool], None], Callable[[StoreError], None]]] = []
        self._queued: set[str] = set()  # ids whose result waits for its commit
        self._attempts: dict[str, int] = {}  # id -> send count not written yet
        self._wake = trio.Event()
        self._running = False

    # -- what callers queue ----------------------------------------------------------

    async def accept(self, staged: list[Staged]) -> None:
        """Journal the requests ``staged`` (:meth:`Store.prepare
        <dispatcher.store.Store.prepare>`) in one group; returns once it committed, and
        raises its :class:`StoreError` (nothing of them journaled) if it failed."""
        if not staged:
            return  # nothing to journal; an empty group would wait for a write forever
        ack = _Ack()
        self._new += staged
        self._acks.append(ack)
        self._kick()
        await ack.done.wait()
        if ack.error is not None:
            raise ack.error

    def finish(
        self,
        id: str,
        status: str,
        *,
        raw: bytes | None = None,
        error: str | None = None,
        on_stored: Callable[[bool], None],
        on_error: Callable[[StoreError], None],
    ) -> None:
        """Queue the result of ``id``: "done" with ``raw`` (vLLM's body) or "failed" with
        ``error``. Once its group committed, ``on_stored(stored)`` is called (False: the
        sample had a result already); if the group failed, ``on_error(e)`` (the sample
        stays pending). Neither is called before this returns, unless no writer runs."""
        self._queued.add(id)
        if error is not None:
            # Any text may reach here (a replica's message with a lone surrogate from a
            # JSON escape): SQLite stores only what encodes as UTF-8.
            error = error.encode("utf-8", "backslashreplace").decode("utf-8")
        self._finishes.append(Finish(id, status, raw, error))
        self._callbacks.append((on_stored, on_error))
        self._kick()

    def attempt(self, p: Pending) -> int:
        """Count one more send of ``p`` (written with the next group); the new count."""
        p.attempts += 1
        self._attempts[p.id] = p.attempts
        return p.attempts

    def queued(self, id: str) -> bool:
        """Whether a result of ``id`` waits for its commit (do not send it again)."""
        return id in self._queued

    # -- the writer ------------------------------------------------------------------

    def _kick(self) -> None:
        if self._running:
            self._wake.set()
        else:
            self.flush()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: commit what is queued, one group per round, until cancelled;
        what is still queued then is committed before it returns."""
        self._running = True
        try:
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                self.flush()
        finally:
            self._running = False
            self.flush()  # synchronous: a cancelled writer still writes its last group

    def flush(self) -> None:
        """Commit everything queued now as one group, and tell its callers."""
        if not (self._new or self._finishes or self._attempts):
            return
        new, self._new = self._new, []
        acks, self._acks = self._acks, []
        finishes, self._finishes = self._finishes, []
        callbacks, self._callbacks = self._callbacks, []
        attempts, self._attempts = self._attempts, {}
        try:
            try:
                stored = self.store.commit(new, finishes, attempts)
            except StoreError:
                raise
            except Exception as bug:
                # Not a store error (say a text SQLite cannot encode): it must neither
                # strand this group's waiters nor end the writer. The group fails whole.
                log.exception("group commit failed unexpectedly")
                raise StoreError(f"group commit failed: {type(bug).__name__}: {bug}") from bug
        except StoreError as e:
            self.failed_groups += 1
            log.error("group commit of %d request(s) and %d result(s) failed: %s",
                      len(new), len(finishes), e)  # fmt: skip
            for id, n in attempts.items():  # newer counts queued meanwhile win
                self._attempts.setdefault(id, n)
            for ack in acks:
                ack.error = e
                ack.done.set()
            for f, (_, on_error) in zip(finishes, callbacks, strict=True):
                self._queued.discard(f.id)
                self._tell(on_error, e)
            return
        self.groups += 1
        for ack in acks:
            ack.done.set()
        for f, ok, (on_stored, _) in zip(finishes, stored, callbacks, strict=True):
            self._queued.discard(f.id)
            self._tell(on_stored, ok)

    @staticmethod
    def _tell(callback: Callable[[_T], None], arg: _T) -> None:
        try:
            callback(arg)
        except Exception:
            # A bug in one caller's follow-up must not cost the others theirs, nor the
            # writer its life: the group is committed either way.
            log.exception("after a group commit")
