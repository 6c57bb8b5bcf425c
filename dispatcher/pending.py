"""The in-memory index of a store's pending requests: by id, per revision, by deadline.

Apart from :mod:`dispatcher.store` because it is memory only (no SQLite): the store
changes it only after a commit returned, and answers every pending query of the turn
loop from it, so the loop never reads the disk for them.
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Callable, Iterator

from gpu_slicer.dispatcher.model import Pending

__all__ = ["PendingIndex", "PendingView"]


class PendingIndex:
    """Pending requests in acceptance order, by id and per revision, with a deadline heap
    and the count of token ids their prompts hold.

    ``by_id`` is read directly by the store's hot lookups; change it only through
    :meth:`add` and :meth:`remove`."""

    def __init__(self) -> None:
        # id -> Pending in acceptance order; per revision the same, for the turn loop.
        self.by_id: dict[str, Pending] = {}
        self._by_rev: dict[str, dict[str, Pending]] = {}
        # Lazy-deletion heap of (deadline, seq, id): expire() is O(expired log n).
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = 0
        self.tokens = 0  # token ids held in pending prompts

    def add(self, p: Pending) -> None:
        """Index ``p`` (pending from now on)."""
        self.by_id[p.id] = p
        self._by_rev.setdefault(p.revision, {})[p.id] = p
        self._seq += 1
        heapq.heappush(self._deadlines, (p.deadline, self._seq, p.id))
        if isinstance(p.prompt, array.array):
            self.tokens += len(p.prompt)

    def remove(self, sid: str) -> Pending | None:
        """Unindex ``sid`` (finished); the request, or None when it was not pending."""
        p = self.by_id.pop(sid, None)
        if p is None:
            return None
        per_rev = self._by_rev[p.revision]
        del per_rev[sid]
        if not per_rev:
            del self._by_rev[p.revision]
        if isinstance(p.prompt, array.array):
            self.tokens -= len(p.prompt)
        return p

    def pending(self, revision: str | None = None) -> list[Pending]:
        """Pending requests (of ``revision``, or all) in acceptance order."""
        if revision is None:
            return list(self.by_id.values())
        return list(self._by_rev.get(revision, {}).values())

    def iter_pending(self, revision: str) -> Iterator[Pending]:
        """The pending requests of ``revision`` in acceptance order, without a copy."""
        return iter(self._by_rev.get(revision, {}).values())

    def count(self, revision: str) -> int:
        """How many requests of ``revision`` are pending (O(1))."""
        return len(self._by_rev.get(revision, ()))

    def revisions(self) -> list[str]:
        """Revisions that have pending requests, the one waiting longest first."""

        def oldest(rev: str) -> float:
            return next(iter(self._by_rev[rev].values())).accepted_at

        return sorted(self._by_rev, key=oldest)

    def due(self, now: float) -> list[Pending]:
        """Take the pending requests whose deadline is at or before ``now`` off the heap
        (they stay indexed: :meth:`remove` them once their failure is journaled)."""
        due: list[Pending] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, sid = heapq.heappop(self._deadlines)
            p = self.by_id.get(sid)
            if p is not None:  # finished ones are left in the heap and skipped here
                due.append(p)
        return due

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pending request (wall clock), or None."""
        while self._deadlines and self._deadlines[0][2] not in self.by_id:
            heapq.heappop(self._deadlines)  # finished: lazily deleted here
        return self._deadlines[0][0] if self._deadlines else None

    def keep_due(self, due: list[Pending]) -> None:
        """Put ``due`` (from :meth:`due`) back on the heap: their failure was not written,
        and the next :meth:`due` returns them again instead of forgetting them."""
        for p in due:
            heapq.heappush(self._deadlines, (p.deadline, 0, p.id))


class PendingView:
    """The read side of a store's pending index (``self._index``), shared by the SQLite
    store (every pending request of its pool) and the pool store (this replica's claims)."""

    _index: PendingIndex
    # Set by the turn loop (explain_loads): why the weights of a revision would not load.
    _load_error: Callable[[str], str | None] | None = None

    def explain_loads(self, why: Callable[[str], str | None]) -> None:
        """Name, in the error of a request that misses its deadline, the last failed
        load of its revision's weights: ``why(revision)`` (None: no load of it failed)."""
        self._load_error = why

    def load_error(self, revision: str) -> str | None:
        """The last failed load of ``revision`` as :meth:`explain_loads` tells it."""
        return None if self._load_error is None else self._load_error(revision)

    def pending(self, revision: str | None = None) -> list[Pending]:
        """Pending requests (of ``revision``, or all) in acceptance order."""
        return self._index.pending(revision)

    def iter_pending(self, revision: str) -> Iterator[Pending]:
        """The pending requests of ``revision`` in acceptance order, without a copy (do
        not change the store while iterating)."""
        return self._index.iter_pending(revision)

    def pending_count(self, revision: str) -> int:
        """How many requests of ``revision`` are pending (O(1): no copy)."""
        return self._index.count(revision)

    def pending_revisions(self) -> list[str]:
        """Revisions that have pending requests, the one waiting longest first."""
        return self._index.revisions()

    def is_pending(self, id: str) -> bool:
        """Whether ``id`` is still pending (cheap: in memory)."""
        return id in self._index.by_id

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pending request (wall clock), or None."""
        return self._index.next_deadline()

    def pending_token_bytes(self) -> tuple[int, int]:
        """(token ids held in pending prompts, bytes of their arrays' buffers)."""
        tokens = self._index.tokens
        return tokens, tokens * 4
