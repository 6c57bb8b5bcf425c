"""Whether the replica must be recovered, and a replica that is not the one we loaded.

The turn loop (:mod:`dispatcher.turns`) recovers its replica (one bare
``finish_weight_update``, the version unknown until a whole load; VLLM_API.md) before
the next load whenever :attr:`Recovery.needed`: on first sight, after a broken load or a
replica error, and whenever the replica may not be the one loaded any more.

That last case is a replica restarted at the same URL (its launcher restarted: a new
process serving its boot weights under ``"default"``). Believing the old revision
loaded, the dispatcher would send, every result would be refused by the commit rule
(``weight_version``), and the turn would never end. It is found three ways, each cheap
and bounded:

* :meth:`Recovery.check`, at the start of each turn while a revision is loaded: one
  ``GET /weight_info``; another label means recover now, before waking and loading;
* the probe between turns (:func:`dispatcher.probe.probe_replica`): the same label read,
  and a replica that fails its probe may come back anew (:meth:`Recovery.forget`);
* mid-turn, ``sending.MAX_WEIGHT_REFUSALS`` results in a row refused for their weights
  (:meth:`Recovery.foreign`, through Serving's ``on_foreign``).

Each forgets the loaded version (:meth:`Replica.forget
<dispatcher.vllm.Replica.forget>`), marks the recovery needed and ends a held turn as a
replica error (its requests stay pending); other weights are the problem ``replica
serves weights other than REV`` (the ``weights`` check of :mod:`dispatcher.health`),
which :meth:`Recovery.refresh` clears once a load succeeded or nothing is pending.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpu_slicer.dispatcher.errors import ReplicaError
from gpu_slicer.dispatcher.health import Check, Health, foreign_weights
from gpu_slicer.dispatcher.model import TurnState
from gpu_slicer.dispatcher.vllm import CONTROL_TIMEOUT_S, Replica

__all__ = ["Recovery"]

log = logging.getLogger("dispatcher.turns")


class Recovery:
    """The recover flag of one replica and what sets it (module docstring).

    ``current()`` is the turn held now (None between turns), ``signal()`` wakes the
    serving loop (so a turn marked failed ends at once), ``workload`` names the
    workload in words."""

    def __init__(
        self,
        replica: Replica,
        health: Health,
        workload: str,
        *,
        current: Callable[[], TurnState | None],
        signal: Callable[[], None],
    ) -> None:
        self.replica = replica
        self.health = health
        self.workload = workload
        self._current = current
        self._signal = signal
        self.needed = True  # first sight of the replica
        self._told: TurnState | None = None  # a turn ended for a reason already told

    def forget(self, why: str, *, end_turn: bool = True) -> None:
        """The replica may not be the one loaded (``why``): forget its version, recover
        it before the next load, and end a held turn as a replica error (``end_turn``)."""
        self.needed = True
        self.replica.forget()
        cur = self._current()
        if end_turn and cur is not None and not cur.replica_failed:
            cur.replica_failed = why
            self._signal()

    def foreign(self, wanted: str, how: str, *, end_turn: bool = True) -> None:
        """The replica serves weights other than ``wanted``, the revision we loaded
        (``how`` we know, for the log): the ``weights`` problem, then :meth:`forget`."""
        url = self.replica.base_url
        log.warning("replica %s serves weights other than %s (%s): not the replica we "
                    "loaded; recovering it and loading %s again", url, wanted, how,
                    wanted)  # fmt: skip
        self.health.fail(Check.WEIGHTS, foreign_weights(url, wanted))
        if end_turn:
            self._told = self._current()  # told as weights, not as "replica unhealthy"
        self.forget(f"weights other than {wanted}: {how}", end_turn=end_turn)

    def workload_lost(self) -> None:
        """slicerd lists no such workload while a turn is held: its launcher is gone and
        slicerd dropped the turn, so it ends at once (the problem is the workload's)."""
        cur = self._current()
        if cur is not None and not cur.replica_failed:
            log.warning("turn %d: workload %s left slicerd during the turn; ending it",
                        cur.turn.turn, self.workload)  # fmt: skip
            self._told = cur
            cur.replica_failed = f"workload {self.workload} left slicerd during the turn"
            self._signal()

    def told(self, cur: TurnState) -> bool:
        """Whether ``cur`` was ended for a reason already told (not "replica unhealthy");
        asked once, at the end of the turn."""
        told, self._told = self._told is cur, None
        return told

    async def check(self, turn: int) -> None:
        """At the start of turn ``turn``, while a revision is loaded and no recovery is
        due: one ``GET /weight_info``; another label marks the recovery needed. Raises
        ReplicaError when the replica does not answer (it is forgotten: what answers
        there next may be a new process)."""
        known = self.replica.known_version
        if known is None or self.needed:
            return
        try:
            label = await self.replica.weight_version(CONTROL_TIMEOUT_S)
        except ReplicaError as e:
            self.forget(str(e), end_turn=False)
            raise
        if label != known:
            how = f"GET /weight_info says {label!r} at the start of turn {turn}"
            self.foreign(known, how, end_turn=False)

    def refresh(self, pending: bool) -> None:
        """The ``weights`` check clears once a whole load succeeded since, or once nothing
        is ``pending`` (nothing is served from the other weights; the next turn recovers
        the replica anyway)."""
        if self.health.state(Check.WEIGHTS) is False and (
            self.replica.known_version is not None or not pending
        ):
            self.health.ok(Check.WEIGHTS)
