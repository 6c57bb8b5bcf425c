"""What is wrong with the dispatcher's world right now, in words, and since when.

Theory of operation
-------------------
The dispatcher depends on five things; each is one :class:`Check`, known to be ok, known
to be failing (with a sentence saying how), or not known yet:

==============  ==============================================================  ======
check           failing says                                                    ready?
==============  ==============================================================  ======
``store``       ``store damaged (...)`` / ``store unwritable (...)``            needed
``daemon``      ``daemon unreachable (SOCKET: ...)``                            needed
``workload``    ``workload W is not registered with slicerd (...)``             needed
``replica``     ``replica unhealthy (URL: ...)``                                needed
``load``        ``last load error (revision R: ...)``                           no
==============  ==============================================================  ======

:class:`Health` holds them. Its *problem* is the first failing check in that order (a
dead daemon hides the registration behind it; a load error matters least) with the
wall-clock time it began and how long it has lasted: ``GET /status``'s ``problem``
(:meth:`Health.problem_json`, null when none). A check that keeps failing keeps its
``since``; it clears as soon as the thing works again. Every change of the problem is
logged (a warning when one starts, info when it clears) and handed to ``on_change``
(the turn loop publishes it as the ``problem`` event of ``GET /v1/events``).

*Ready* (``GET /ready``, :func:`ready_endpoint`) means every check marked "needed" is
known to be ok: the store takes writes, the last contact with slicerd worked, slicerd
knows the workload, and the replica answers ``/health``. Anything else is 503 with the
reason: the problem, or which check has not been made yet.

Who feeds it: the turn loop (:mod:`dispatcher.turns`) reports what each turn learns
(connect, ACQUIRE, recover and wake, a replica failure while serving) and derives the
store's and the loads' checks from :meth:`Store.health <dispatcher.store.Store.health>`
and the load backoff; between turns :func:`probe` asks slicerd (one STATUS over a
connection of its own: reachable, and is the workload registered?) and the replica
(``GET /health``), every ``PROBE_INTERVAL_S`` while all is well and sooner (from
``PROBE_RETRY_MIN_S``, doubling) while something fails. Every probe is bounded by
``PROBE_TIMEOUT_S``; nothing here waits unbounded or starts a task of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, ClientError

__all__ = [
    "PROBE_INTERVAL_S",
    "PROBE_RETRY_MIN_S",
    "PROBE_TIMEOUT_S",
    "READY_CHECKS",
    "Check",
    "Health",
    "Problem",
    "daemon_unreachable",
    "note_loads",
    "note_store",
    "probe",
    "problem_fields",
    "ready_endpoint",
    "replica_unhealthy",
    "workload_unknown",
]

log = logging.getLogger("dispatcher.health")

PROBE_INTERVAL_S = 5.0  # between probes while every check is ok
PROBE_RETRY_MIN_S = 0.5  # the first retry after a probe found a problem (doubling)
PROBE_TIMEOUT_S = 5.0  # one probe of slicerd or of the replica, as a whole


class Check(StrEnum):
    """One thing the dispatcher depends on, in the order problems are told."""

    STORE = "store"
    DAEMON = "daemon"
    WORKLOAD = "workload"
    REPLICA = "replica"
    LOAD = "load"


#: The checks ``GET /ready`` needs known to be ok.
READY_CHECKS = (Check.STORE, Check.DAEMON, Check.WORKLOAD, Check.REPLICA)
_NOT_CHECKED = {
    Check.STORE: "the store has not been checked yet",
    Check.DAEMON: "slicerd has not been contacted yet",
    Check.WORKLOAD: "the workload's registration with slicerd has not been checked yet",
    Check.REPLICA: "the replica's health has not been checked yet",
    Check.LOAD: "no load has been tried yet",
}


@dataclass(frozen=True)
class Problem:
    """A failing check: ``what`` in words, since ``since`` (Unix seconds) and ``at``
    (the health clock, trio's unless told otherwise)."""

    check: Check
    what: str
    since: float
    at: float

    def to_json(self, now: float) -> dict[str, Any]:
        """``{"what", "since": ISO 8601 UTC, "for_s"}`` at ``now`` (the health clock)."""
        since = datetime.fromtimestamp(self.since, UTC).isoformat(timespec="milliseconds")
        return {"what": self.what, "since": since, "for_s": round(max(0.0, now - self.at), 3)}


def daemon_unreachable(socket: str, error: BaseException) -> str:
    """The problem's words for a slicerd at ``socket`` that cannot be reached."""
    text = str(error.text if isinstance(error, ClientError) else error) or type(error).__name__
    text = text.removeprefix(f"cannot connect to {socket}: ")
    return f"daemon unreachable ({socket}: {text}); is slicerd running? (--socket / $SLICER_SOCKET)"


def workload_unknown(workload: str, how: str) -> str:
    """The problem's words for a ``workload`` slicerd does not know (``how`` it said so)."""
    return (
        f"workload {workload} is not registered with slicerd ({how}); start its launcher "
        f"(slicer-launch vllm --workload {workload} ...) or fix --workload"
    )


def replica_unhealthy(url: str, error: BaseException | str) -> str:
    """The problem's words for the replica at ``url`` failing with ``error``."""
    text = str(error).replace(url, "") or type(error).__name__
    return f"replica unhealthy ({url}: {text})"


class Health:
    """The checks and the current problem (module docstring).

    ``clock`` measures how long a problem lasts (trio's clock by default, so
    ``autojump_clock`` tests run it), ``wall`` says when it began (``time.time``);
    ``on_change(problem)`` is called with the new problem (None: cleared) whenever the
    problem changes, its check or its words."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
        on_change: Callable[[Problem | None], None] | None = None,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self._on_change = on_change
        self._ok: dict[Check, bool | None] = {c: None for c in Check}
        self._ok[Check.STORE] = True  # the store was opened (its schema written) before us
        self._ok[Check.LOAD] = True
        self._failing: dict[Check, Problem] = {}
        self._current: Problem | None = None

    # -- what the feeders say --------------------------------------------------------

    def ok(self, check: Check) -> None:
        """``check`` works (now): its problem, if any, clears."""
        self._ok[check] = True
        self._failing.pop(check, None)
        self._changed()

    def fail(self, check: Check, what: str) -> None:
        """``check`` fails, ``what`` saying how; a check already failing keeps its
        ``since`` (the words may change)."""
        self._ok[check] = False
        old = self._failing.get(check)
        since, at = (old.since, old.at) if old is not None else (self._wall(), self._clock())
        self._failing[check] = Problem(check, what, since, at)
        self._changed()

    def forget(self, check: Check) -> None:
        """``check`` is not known any more (e.g. the registration, once slicerd is lost)."""
        self._ok[check] = None
        self._failing.pop(check, None)
        self._changed()

    def set(self, check: Check, what: str | None) -> None:
        """:meth:`ok` when ``what`` is None, else :meth:`fail` with it."""
        if what is None:
            self.ok(check)
        else:
            self.fail(check, what)

    # -- what readers see ------------------------------------------------------------

    def state(self, check: Check) -> bool | None:
        """True ok, False failing, None not known yet."""
        return self._ok[check]

    @property
    def problem(self) -> Problem | None:
        """The current problem: the first failing check (module docstring), or None."""
        return self._current

    def problem_json(self) -> dict[str, Any] | None:
        """``/status``'s ``problem``: ``{"what", "since", "for_s"}`` or None."""
        p = self._current
        return None if p is None else p.to_json(self._clock())

    def not_ready(self) -> str | None:
        """Why ``GET /ready`` says no (the first needed check not known to be ok), or
        None when ready."""
        for check in READY_CHECKS:
            state = self._ok[check]
            if state is None:
                return _NOT_CHECKED[check]
            if state is False:
                return self._failing[check].what
        return None

    def _changed(self) -> None:
        new = next((self._failing[c] for c in Check if c in self._failing), None)
        old, self._current = self._current, new
        if (old and (old.check, old.what)) == (new and (new.check, new.what)):
            return
        if new is not None:
            log.warning("problem: %s", new.what)
        elif old is not None:
            took = max(0.0, self._clock() - old.at)
            log.info("problem cleared after %.1f s: %s", took, old.what)
        if self._on_change is not None:
            self._on_change(new)


def problem_fields(problem: Problem | None) -> dict[str, Any]:
    """The fields of the ``problem`` event for ``problem`` (all None: cleared)."""
    if problem is None:
        return {"check": None, "what": None, "since": None}
    since = problem.to_json(problem.at)["since"]
    return {"check": problem.check.value, "what": problem.what, "since": since}


def note_store(health: Health, store_health: dict[str, Any]) -> None:
    """The store check from :meth:`Store.health <dispatcher.store.Store.health>`."""
    if store_health["damaged"]:
        health.fail(Check.STORE, f"store damaged ({store_health['error']})")
    elif store_health["error"]:
        health.fail(Check.STORE, f"store unwritable ({store_health['error']})")
    else:
        health.ok(Check.STORE)


def note_loads(health: Health, backoff: dict[str, dict[str, Any]], pending: set[str]) -> None:
    """The load check from the load backoff (:meth:`Serving.load_backoff
    <dispatcher.serve.Serving.load_backoff>`): failing while a revision that still has
    pending requests is backed off after a failed load (naming the one that retries
    last); ok once it loaded, or once nothing waits for it any more."""
    failed = {r: b for r, b in backoff.items() if r in pending}
    if not failed:
        health.ok(Check.LOAD)
        return
    rev = max(failed, key=lambda r: float(failed[r]["retry_in_s"]))
    health.fail(Check.LOAD, f"last load error (revision {rev}: {failed[rev]['error']})")


# -- probes between turns ------------------------------------------------------------


async def probe_daemon(
    health: Health, connect: Callable[[], Awaitable[AsyncSlicer]], socket: str, workload: str
) -> None:
    """One STATUS over a new slicerd connection (bounded by ``PROBE_TIMEOUT_S``): is
    slicerd reachable, and does it know ``workload``?"""
    try:
        with trio.fail_after(PROBE_TIMEOUT_S):
            slicer = await connect()
            try:
                st = await slicer.status()
            finally:
                with trio.CancelScope(shield=True):
                    await slicer.aclose()
    except ClientError as e:
        if e.code != "unreachable":  # it answered, if only with a refusal: reachable
            health.ok(Check.DAEMON)
            return
        health.forget(Check.WORKLOAD)
        health.fail(Check.DAEMON, daemon_unreachable(socket, e))
        return
    except (OSError, trio.TooSlowError, proto.ProtocolError) as e:
        health.forget(Check.WORKLOAD)
        why = "no answer to STATUS" if isinstance(e, trio.TooSlowError) else e
        health.fail(Check.DAEMON, daemon_unreachable(socket, Exception(why)))
        return
    health.ok(Check.DAEMON)
    names = {w.get("name") for w in st.get("workloads") or [] if isinstance(w, dict)}
    if workload in names:
        health.ok(Check.WORKLOAD)
    else:
        health.fail(Check.WORKLOAD, workload_unknown(workload, "its STATUS lists no such workload"))


class _Replica(Protocol):
    base_url: str

    async def check_health(self, timeout: float) -> str | None: ...


async def probe_replica(health: Health, replica: _Replica) -> None:
    """One ``GET /health`` of ``replica`` (bounded by ``PROBE_TIMEOUT_S``)."""
    error = await replica.check_health(PROBE_TIMEOUT_S)
    health.set(Check.REPLICA, None if error is None else replica_unhealthy(replica.base_url, error))


async def probe(
    health: Health,
    connect: Callable[[], Awaitable[AsyncSlicer]],
    socket: str,
    workload: str,
    replica: _Replica,
    *,
    skip: Callable[[], bool] = lambda: False,
) -> None:
    """Probe slicerd and the replica forever: every ``PROBE_INTERVAL_S`` while every
    check is ok, from ``PROBE_RETRY_MIN_S`` doubling while one fails or is not known.
    ``skip()`` true (a turn is held: the turn itself is the evidence) skips a round."""
    retry = PROBE_RETRY_MIN_S
    probed = (Check.DAEMON, Check.WORKLOAD, Check.REPLICA)
    while True:
        if not skip():
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(probe_daemon, health, connect, socket, workload)
                    nursery.start_soon(probe_replica, health, replica)
            except Exception:
                # A bug in a probe must never take the turn loop down with it.
                log.exception("health probe failed (tried again in %.1f s)", PROBE_INTERVAL_S)
        if all(health.state(c) for c in probed):
            wait, retry = PROBE_INTERVAL_S, PROBE_RETRY_MIN_S
        else:
            wait, retry = retry, min(retry * 2, PROBE_INTERVAL_S)
        await trio.sleep(wait)


# -- GET /ready ----------------------------------------------------------------------


class _Readiness(Protocol):
    def not_ready(self, revision: str | None = None) -> str | None: ...


def ready_endpoint(loop: _Readiness) -> Callable[[Request], Awaitable[Response]]:
    """The starlette endpoint of ``GET /ready[?revision=R]`` over ``loop`` (its
    ``not_ready(revision)``): 200 ``{"ready": true}``, else 503 ``{"ready": false,
    "reason": ...}``."""

    async def ready(request: Request) -> Response:
        reason = loop.not_ready(request.query_params.get("revision"))
        if reason is None:
            return JSONResponse({"ready": True}, headers={"cache-control": "no-store"})
        return JSONResponse(
            {"ready": False, "reason": reason}, status_code=503,
            headers={"cache-control": "no-store"},
        )  # fmt: skip

    return ready
