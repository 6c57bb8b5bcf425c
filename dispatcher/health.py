"""What is wrong with the dispatcher's world right now, in words, and since when.

Theory of operation
-------------------
The dispatcher depends on seven things; each is one :class:`Check`, known to be ok, known
to be failing (with a sentence saying how), or not known yet:

==============  ==============================================================  ======
check           failing says                                                    ready?
==============  ==============================================================  ======
``store``       ``store damaged (...)`` / ``store unwritable (...)``            needed
``daemon``      ``daemon unreachable (SOCKET: ...)``                            needed
``workload``    ``workload W is not registered with slicerd (...)``             needed
``replica``     ``replica unhealthy (URL: ...)``                                needed
``weights``     ``replica serves weights other than REV (...)``                 needed
``load``        ``last load error (revision R: ...)``                           no
``gpu``         ``waiting for the GPU: held by W for N s (turn T); ...``         no
==============  ==============================================================  ======

:class:`Health` holds them. Its *problem* is the first failing check in that order (a
dead daemon hides the registration behind it; a load error matters least) with the
wall-clock time it began and how long it has lasted: ``GET /status``'s ``problem``
(:meth:`Health.problem_json`, null when none). A check that keeps failing keeps its
``since``; it clears as soon as the thing works again. Each check has one sentence per
failure, whoever found it (a probe or the turn loop), so a lasting problem keeps its words
and does not flap between two wordings. Every change of the problem is logged (a
warning when one starts, info when it clears) and handed to ``on_change`` (the turn loop
publishes it as the ``problem`` event of ``GET /v1/events``).

*Ready* (``GET /ready``, :func:`ready_endpoint`) means every check marked "needed" is
known to be ok: the store takes writes, the last contact with slicerd worked, slicerd
knows the workload, the replica answers ``/health``, and it serves the weights the
dispatcher loaded. Anything else is 503 with the reason: the problem, or which check has
not been made yet.

``gpu`` fails while the loop has asked for a turn for ``WAIT_PROBLEM_S`` or longer and
slicerd's STATUS (read by the probe) names another workload holding the GPU: the one
silent wait a user can cause (a trainer that samples through the dispatcher from inside
its own turn waits for itself). Its ``N`` is counted when the problem is read.

``weights`` fails when the replica at the URL is not the one the dispatcher loaded: its
``GET /weight_info`` label is not the revision loaded (read by the probe between turns and
by the turn loop after each wake), or ``sending.MAX_WEIGHT_REFUSALS`` results in a row of
a turn carried other weights. That is what a replica restarted by its launcher looks like
(same URL, a new process, the boot weights). The loaded version is then forgotten
(:meth:`Replica.forget <dispatcher.vllm.Replica.forget>`), the turn (if one is held) ends
as a replica error, and the next turn recovers the replica and loads the wanted revision
whole; the check clears once a load succeeded, or once nothing is pending any more.

Who feeds it: the turn loop (:mod:`dispatcher.turns`) reports what each turn learns
(connect, ACQUIRE, recover and wake, a replica failure while serving) and derives the
store's and the loads' checks from :meth:`Store.health <dispatcher.store.Store.health>`
and the load backoff; the probes (:mod:`dispatcher.probe`) ask slicerd and the replica
themselves, so an idle dispatcher knows too.
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

from gpu_slicer.dispatcher.core import parse_model
from gpu_slicer.dispatcher.errors import BadRequest, quoted
from gpu_slicer.dispatcher.oai import error_body
from gpu_slicer.dispatcher.store import REVISION_RE
from gpu_slicer.slicer.client import ClientError

__all__ = [
    "READY_CHECKS",
    "WAIT_PROBLEM_S",
    "Check",
    "Health",
    "Problem",
    "daemon_unreachable",
    "foreign_weights",
    "gpu_held",
    "note_loads",
    "note_store",
    "problem_fields",
    "ready_endpoint",
    "ready_revision",
    "replica_unhealthy",
    "workload_unknown",
]

log = logging.getLogger("dispatcher.health")


class Check(StrEnum):
    """One thing the dispatcher depends on, in the order problems are told."""

    STORE = "store"
    DAEMON = "daemon"
    WORKLOAD = "workload"
    REPLICA = "replica"
    WEIGHTS = "weights"
    LOAD = "load"
    GPU = "gpu"


#: The checks ``GET /ready`` needs known to be ok.
READY_CHECKS = (Check.STORE, Check.DAEMON, Check.WORKLOAD, Check.REPLICA, Check.WEIGHTS)
_NOT_CHECKED = {
    Check.STORE: "the store has not been checked yet",
    Check.DAEMON: "slicerd has not been contacted yet",
    Check.WORKLOAD: "the workload's registration with slicerd has not been checked yet",
    Check.REPLICA: "the replica's health has not been checked yet",
    Check.WEIGHTS: "the replica's weights have not been checked yet",
    Check.LOAD: "no load has been tried yet",
    Check.GPU: "no turn has been asked for yet",
}
#: How long a turn is asked for, the GPU held by another, before ``gpu`` fails.
WAIT_PROBLEM_S = 10.0
_HELD_FOR = "{held_for}"  # in a problem's words: the seconds since ``Problem.held_at``


@dataclass(frozen=True)
class Problem:
    """A failing check: ``what`` in words, since ``since`` (Unix seconds) and ``at``
    (the health clock, trio's unless told otherwise)."""

    check: Check
    what: str
    since: float
    at: float
    held_at: float | None = None  # the health clock that ``{held_for}`` in ``what`` counts from

    def words(self, now: float) -> str:
        """``what`` at ``now`` (the health clock): ``{held_for}`` as whole seconds."""
        if self.held_at is None:
            return self.what
        return self.what.replace(_HELD_FOR, str(round(max(0.0, now - self.held_at))))

    def to_json(self, now: float) -> dict[str, Any]:
        """``{"what", "since": ISO 8601 UTC, "for_s"}`` at ``now`` (the health clock)."""
        since = datetime.fromtimestamp(self.since, UTC).isoformat(timespec="milliseconds")
        return {"what": self.words(now), "since": since,
                "for_s": round(max(0.0, now - self.at), 3)}  # fmt: skip


def daemon_unreachable(socket: str, error: BaseException) -> str:
    """The problem's words for a slicerd at ``socket`` that cannot be reached."""
    text = str(error.text if isinstance(error, ClientError) else error) or type(error).__name__
    text = text.removeprefix(f"cannot connect to {socket}: ")
    return f"daemon unreachable ({socket}: {text}); is slicerd running? (--socket / $SLICER_SOCKET)"


def workload_unknown(workload: str) -> str:
    """The problem's words for a ``workload`` slicerd does not know (one sentence whether
    a STATUS or an ACQUIRE said so: the problem must not flap between two wordings)."""
    return (
        f"workload {workload} is not registered with slicerd (slicerd answers "
        f"unknown-workload); start its launcher (slicer-launch vllm --workload {workload} "
        f"...) or fix --workload"
    )


def foreign_weights(url: str, wanted: str) -> str:
    """The problem's words for the replica at ``url`` serving weights other than the
    revision ``wanted`` that the dispatcher loaded (one sentence, whoever noticed)."""
    return (
        f"replica serves weights other than {wanted} ({url}: a new replica process, or "
        f"weights loaded by someone else); recovering it and loading {wanted} again"
    )


def gpu_held(holder: str, turn: int | None) -> str:
    """The problem's words for a turn asked for while ``holder`` holds the GPU (its
    ``turn``); ``{held_for}`` is filled in when read (:meth:`Problem.words`)."""
    of = f" (turn {turn})" if turn is not None else ""
    return (
        f"waiting for the GPU: held by {holder} for {_HELD_FOR} s{of}; if {holder} sent "
        f"these requests from inside its own turn it waits for itself: release the turn "
        f"before sampling"
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
    problem changes, its check or its words; ``on_state(check)`` whenever a check's state
    (ok, failing, not known) changes, problem or not (the turn loop waits on the replica's
    check before it asks for a turn)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
        on_change: Callable[[Problem | None], None] | None = None,
        on_state: Callable[[Check], None] | None = None,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self._on_change = on_change
        self._on_state = on_state
        self._ok: dict[Check, bool | None] = {c: None for c in Check}
        self._ok[Check.STORE] = True  # the store was opened (its schema written) before us
        self._ok[Check.LOAD] = True
        self._ok[Check.WEIGHTS] = True  # nothing loaded yet: nothing served other weights
        self._ok[Check.GPU] = True  # no turn asked for: no wait
        self._failing: dict[Check, Problem] = {}
        self._current: Problem | None = None

    # -- what the feeders say --------------------------------------------------------

    def ok(self, check: Check) -> None:
        """``check`` works (now): its problem, if any, clears."""
        self._set_state(check, True)
        self._failing.pop(check, None)
        self._changed()

    def fail(self, check: Check, what: str, *, held_at: float | None = None) -> None:
        """``check`` fails, ``what`` saying how; a check already failing keeps its
        ``since`` (the words may change). ``{held_for}`` in ``what`` reads as the whole
        seconds since ``held_at`` (the health clock) whenever the problem is read."""
        self._set_state(check, False)
        old = self._failing.get(check)
        since, at = (old.since, old.at) if old is not None else (self._wall(), self._clock())
        self._failing[check] = Problem(check, what, since, at, held_at)
        self._changed()

    def forget(self, check: Check) -> None:
        """``check`` is not known any more (e.g. the registration, once slicerd is lost)."""
        self._set_state(check, None)
        self._failing.pop(check, None)
        self._changed()

    def _set_state(self, check: Check, state: bool | None) -> None:
        old, self._ok[check] = self._ok[check], state
        if old is not state and self._on_state is not None:
            self._on_state(check)

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
                return self._failing[check].words(self._clock())
        return None

    def _changed(self) -> None:
        new = next((self._failing[c] for c in Check if c in self._failing), None)
        old, self._current = self._current, new
        if (old and (old.check, old.what)) == (new and (new.check, new.what)):
            return
        now = self._clock()
        if new is not None:
            log.warning("problem: %s", new.words(now))
        elif old is not None:
            took = max(0.0, now - old.at)
            log.info("problem cleared after %.1f s: %s", took, old.words(now))
        if self._on_change is not None:
            self._on_change(new)


def problem_fields(problem: Problem | None) -> dict[str, Any]:
    """The fields of the ``problem`` event for ``problem`` (all None: cleared)."""
    if problem is None:
        return {"check": None, "what": None, "since": None}
    since = problem.to_json(problem.at)["since"]
    return {"check": problem.check.value, "what": problem.words(problem.at), "since": since}


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


# -- GET /ready ----------------------------------------------------------------------


class _Readiness(Protocol):
    def not_ready(self, revision: str | None = None) -> str | None: ...


def ready_revision(value: str) -> str:
    """The revision ``GET /ready?revision=VALUE`` asks about: ``VALUE`` itself, or the
    ``REV`` of ``NAME@REV`` (the model ids ``GET /v1/models`` lists; ``NAME`` is not
    checked, as in requests). :class:`BadRequest` (echoing at most 200 characters of
    ``value``) for an empty value, a trailing ``@`` or no valid revision name."""
    if not value:
        raise BadRequest(
            "revision must not be empty: GET /ready?revision=REV (or NAME@REV, as GET "
            "/v1/models lists it)", param="revision"
        )  # fmt: skip
    try:
        revision = parse_model(value)[1] or value
    except BadRequest:
        raise BadRequest(
            f"revision {quoted(value, 200)} ends with '@' but names no revision after it",
            param="revision",
        ) from None
    if not REVISION_RE.fullmatch(revision):
        raise BadRequest(
            f"revision must match {REVISION_RE.pattern} (or be NAME@REV), got "
            f"{quoted(value, 200)}", param="revision"
        )  # fmt: skip
    return revision


def ready_endpoint(loop: _Readiness) -> Callable[[Request], Awaitable[Response]]:
    """The starlette endpoint of ``GET /ready[?revision=R]`` over ``loop`` (its
    ``not_ready(revision)``): 200 ``{"ready": true}``, else 503 ``{"ready": false,
    "reason": ...}``. ``R`` may be ``NAME@REV`` (:func:`ready_revision`); an empty or
    malformed one is a 400 in OpenAI's error format (``param`` ``"revision"``)."""

    async def ready(request: Request) -> Response:
        asked = request.query_params.get("revision")
        try:
            revision = None if asked is None else ready_revision(asked)
        except BadRequest as e:
            return JSONResponse(
                error_body(str(e), "BadRequestError", "bad_request", e.param),
                status_code=400, headers={"cache-control": "no-store"},
            )  # fmt: skip
        reason = loop.not_ready(revision)
        if reason is None:
            return JSONResponse({"ready": True}, headers={"cache-control": "no-store"})
        return JSONResponse(
            {"ready": False, "reason": reason}, status_code=503,
            headers={"cache-control": "no-store"},
        )  # fmt: skip

    return ready
