"""What one replica serves in one turn: the capacity it offers the pool when it asks.

Waking a replica parks its trainer, so a replica asks for a turn only when the pool's
backlog is more than the replicas already holding or asking for one cover
(:data:`~dispatcher.poolscripts.WANT`). What one covers is what it serves in one turn:
its measured rate (results a second while it has sends in flight) times the turn's
length, never less than its concurrency slots. Before any measurement it is the slots,
as before; a replica with no measurement of its own takes the median of the rates the
pool's other replicas report (replicas of a pool serve one model on like GPUs).

:class:`ServiceRate` is pure (the clock is passed in): the pool link feeds it at each
step of a held turn and closes the turn's window at its end.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

__all__ = ["MIN_RESULTS", "ServiceRate", "pool_rate", "turn_capacity"]

#: Results a turn must finish before its rate counts: a turn of a few requests measures
#: their latency, not what the replica can serve.
MIN_RESULTS = 8
_MIN_BUSY_S = 0.05
_WEIGHT = 0.5  # of the newest turn in the running estimate


class ServiceRate:
    """Results a second this replica finishes while it has sends in flight, over its
    turns (a running mean weighted toward the last ones); None until measured."""

    def __init__(self) -> None:
        self.per_s: float | None = None
        self._busy = 0.0
        self._done = 0
        self._last: tuple[float, int] | None = None  # (time, results so far) at the last step

    def step(self, now: float, in_flight: int, done_total: int) -> None:
        """At a step of a held turn: ``in_flight`` sends still running, ``done_total``
        results this replica stored so far (a counter that only grows)."""
        if self._last is not None:
            t, done = self._last
            finished = max(0, done_total - done)
            # The span since the last step was busy if a send ran all through it (one
            # still runs) or ended in it.
            if in_flight > 0 or finished > 0:
                self._busy += max(0.0, now - t)
                self._done += finished
        self._last = (now, done_total)

    def turn_ended(self, now: float, done_total: int) -> None:
        """At a turn's end: fold the turn into the estimate, when it finished enough to say
        what the replica can serve. Results stored since the last step (the grace, when
        the sends in flight end) count with the time they took: counted without it they
        would make the replica look faster than it is, and wake too few."""
        self.step(now, 0, done_total)
        if self._done >= MIN_RESULTS and self._busy >= _MIN_BUSY_S:
            sample = self._done / self._busy
            old = self.per_s
            self.per_s = sample if old is None else (1 - _WEIGHT) * old + _WEIGHT * sample
        self._busy, self._done, self._last = 0.0, 0, None


def pool_rate(reported: Iterable[object]) -> float | None:
    """The median of the rates other replicas report (finite numbers > 0 only: reports
    are written by other processes, maybe other releases); None when none does."""
    rates = [
        float(r)
        for r in reported
        if isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) and r > 0
    ]
    return statistics.median(rates) if rates else None


def turn_capacity(slots: int, rate: float | None, turn_seconds: float) -> int:
    """Requests one turn of this replica serves: ``rate`` x ``turn_seconds``, at least
    its ``slots`` (its concurrency); the slots alone while nothing is measured."""
    if rate is None:
        return slots
    return max(slots, min(10**9, math.floor(rate * turn_seconds)))
