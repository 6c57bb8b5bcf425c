"""The dispatcher's records and the phases of its turn loop.

Everything here is plain data: no I/O, no trio, no clock. The other modules import it
and it imports none of them but :mod:`dispatcher.errors`, so the imports of the package
run one way: ``errors <- model <- core <- store <- journal <- serve <- turns <- http
<- main`` (``events`` imports none of them).

Phases (theory of operation)
----------------------------
The turn loop (:class:`~dispatcher.turns.TurnLoop`) is always in exactly one
:class:`Phase`. ``GET /status`` shows it as ``state`` and ``GET /v1/events`` publishes
every change of it. One turn, while anything is pending::

    IDLE/BACKOFF -> ACQUIRING -> [PREPARING ->] [RECOVERING ->] WAKING
                 -> (LOADING | SERVING)* -> [GRACE ->] SLEEPING -> RELEASING -> IDLE

* ``IDLE``: nothing pending (or a turn just ended). ``BACKOFF``: a turn failed, or every
  pending revision's load is backed off; no turn is asked for meanwhile.
* ``ACQUIRING``: ACQUIRE sent, waiting for slicerd's grant; not granted within
  ``acquire_wait`` asks again, an error backs off, and nothing pending any more idles.
* ``PREPARING``: still waiting for the grant, but slicerd sent ``EARLY`` (an early start,
  :mod:`dispatcher.early`): the weights are woken and loaded while the workload before
  us is checkpointed; the KV cache waits for the grant.
* ``RECOVERING`` (first sight of the replica, or after a broken load or a replica
  error), then ``WAKING``: the turn is held.
* ``LOADING`` a revision whole (never with a send in flight) and ``SERVING`` its
  requests alternate as revisions change; ``GRACE``: sends still in flight get
  ``turn_grace``.
* ``SLEEPING`` then ``RELEASING`` end every granted turn, whatever ended it (even
  cancellation): so every phase after the grant may go to ``SLEEPING``.

:data:`TRANSITIONS` is the whole table; :func:`check_transition` is the one check every
change goes through, and raises :class:`~dispatcher.errors.IllegalTransition` before
anything changes.
"""

from __future__ import annotations

import array
import json
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from gpu_slicer.dispatcher.errors import IllegalTransition

if TYPE_CHECKING:
    from gpu_slicer.slicer.client import Turn

__all__ = [
    "MAX_LOAD_FAILURES",
    "MAX_SEND_ERRORS",
    "SLEEP_LEVELS",
    "TRANSITIONS",
    "WEIGHT_CHECKS",
    "Counters",
    "LoadBackoff",
    "Pending",
    "Phase",
    "Result",
    "Revision",
    "TurnConfig",
    "TurnState",
    "check_transition",
]

WEIGHT_CHECKS = ("spans", "label")  # --weight-check: see "Two ways" in dispatcher.core
SLEEP_LEVELS = ("auto", "1", "2")  # --sleep-level: see core.sleep_level
MAX_SEND_ERRORS = 3  # unexpected errors sending one request before it is failed
MAX_LOAD_FAILURES = 3  # refused loads of one revision in a row before its requests fail


class Phase(StrEnum):
    """Where the turn loop is (module docstring); the value is ``/status``'s ``state``."""

    IDLE = "idle"
    BACKOFF = "backoff"
    ACQUIRING = "acquiring"
    PREPARING = "preparing"
    RECOVERING = "recovering"
    WAKING = "waking"
    LOADING = "loading"
    SERVING = "serving"
    GRACE = "grace"
    SLEEPING = "sleeping"
    RELEASING = "releasing"


_IN_TURN = {Phase.RECOVERING, Phase.WAKING, Phase.LOADING, Phase.SERVING, Phase.GRACE}

_AFTER_ACQUIRE = frozenset(
    {Phase.IDLE, Phase.BACKOFF, Phase.ACQUIRING, Phase.PREPARING, Phase.RECOVERING}
    | {Phase.WAKING, Phase.SLEEPING}
)

#: The legal phase changes: ``TRANSITIONS[old]`` holds every ``new`` allowed after
#: ``old``. A phase listed after itself may be entered again (no change, no event).
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.IDLE, Phase.BACKOFF, Phase.ACQUIRING}),
    Phase.BACKOFF: frozenset({Phase.IDLE, Phase.BACKOFF, Phase.ACQUIRING}),
    Phase.ACQUIRING: _AFTER_ACQUIRE,
    # An early start: what follows is what follows ACQUIRING (granted, or not).
    Phase.PREPARING: _AFTER_ACQUIRE,
    Phase.RECOVERING: frozenset({Phase.WAKING, Phase.SLEEPING}),
    # RELEASING straight from a turn's phases: a lazy release (--lazy-sleep) leaves vLLM
    # awake when nobody else asked for the GPU.
    Phase.WAKING: frozenset({Phase.LOADING, Phase.SERVING, Phase.SLEEPING, Phase.RELEASING}),
    Phase.LOADING: frozenset({Phase.LOADING, Phase.SERVING, Phase.SLEEPING, Phase.RELEASING}),
    Phase.SERVING: frozenset({Phase.LOADING, Phase.GRACE, Phase.SLEEPING, Phase.RELEASING}),
    Phase.GRACE: frozenset({Phase.SLEEPING, Phase.RELEASING}),
    Phase.SLEEPING: frozenset({Phase.RELEASING}),
    Phase.RELEASING: frozenset({Phase.IDLE}),
}
assert all(Phase.SLEEPING in TRANSITIONS[p] for p in _IN_TURN)  # a held turn always ends


def check_transition(old: Phase, new: Phase) -> bool:
    """Whether ``old -> new`` changes the phase (False: ``new`` is ``old`` again).

    Raises :class:`~dispatcher.errors.IllegalTransition` naming both when the table
    (:data:`TRANSITIONS`) has no such move."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"the turn loop cannot go from {old.value} to {new.value}")
    return new is not old


@dataclass(frozen=True)
class TurnConfig:
    """What the loop was told (the ``slicer-dispatch`` options)."""

    workload: str
    socket: str | None = None
    model: str | None = None  # served model name sent to vLLM; None: vLLM's default
    turn_seconds: float = 30.0
    turn_grace: float = 10.0
    sample_deadline: float = 3600.0
    concurrency: int = 64
    max_idle_connections: int = 32  # slicer-dispatch --max-idle-connections (dispatcher.vllm)
    # The revision that names the weights the replica booted with (slicer-dispatch
    # --base-revision, "base" there; None here: an embedded loop publishes nothing itself).
    base_revision: str | None = None
    acquire_wait: float = 60.0
    wake_timeout: float = 300.0
    load_timeout: float = 1800.0
    sleep_timeout: float = 300.0
    weight_check: str = "spans"  # one of WEIGHT_CHECKS
    max_send_errors: int = MAX_SEND_ERRORS
    max_load_failures: int = MAX_LOAD_FAILURES
    # Pool mode: the longest wait between two loads of a revision this replica's vLLM
    # refused (slicer-dispatch --load-backoff-max; core.load_retry_delay).
    load_backoff_max: float = 900.0
    check_revision_paths: bool = True  # publish refuses a path that is no checkpoint dir
    batch_prompts: int = 1  # completion samples per send (dispatcher.serve); 1: one each
    sleep_level: str = "auto"  # one of SLEEP_LEVELS: vLLM's sleep level at a turn's end
    # A turn nobody waited on ends without a sleep (slicer-dispatch --lazy-sleep, on by
    # default there; off here, so an embedded loop keeps sleeping at every turn's end).
    lazy_sleep: bool = False
    # ... also when another workload waited (--lazy-sleep-always): slicerd decides, by
    # freezing it beside the next (fit_aware) or having its launcher sleep it.
    lazy_always: bool = False
    # Early starts (slicer-dispatch --early-start, `dispatcher.early`): the bytes ACQUIRE
    # asks for with early= (0: never; None: the weight files of the revision to load, auto).
    early_start: int | None = 0

    def __post_init__(self) -> None:
        if self.weight_check not in WEIGHT_CHECKS:
            raise ValueError(
                f"weight_check must be one of {WEIGHT_CHECKS}, got {self.weight_check!r}"
            )
        if self.sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {self.sleep_level!r}")
        if self.early_start is not None and self.early_start < 0:
            raise ValueError(f"early_start must be >= 0 bytes or None, got {self.early_start!r}")
        for name in ("max_send_errors", "max_load_failures", "batch_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Revision:
    """A published weight revision: its name and the checkpoint directory to load."""

    name: str
    path: str
    published_at: float


@dataclass
class Pending:
    """One accepted request that has no result yet (see :mod:`dispatcher.store`)."""

    id: str
    pool: str
    revision: str
    kind: str  # "completion" | "chat"
    params: dict[str, Any]  # the OpenAI body minus prompt/messages/stream/model/revision
    prompt: array.array[int] | bytes | None  # token ids, or the UTF-8 text prompt
    messages: bytes | None  # compact JSON of the chat messages (kind == "chat")
    accepted_at: float  # wall clock, time.time()
    deadline: float  # wall clock
    attempts: int
    # core.batch_key's cache ("": not computed yet); no part of the request itself.
    batch_key: str = field(default="", init=False, repr=False, compare=False)


@dataclass(frozen=True)
class Result:
    """What :meth:`Store.get <dispatcher.store.Store.get>` knows about a sample id.

    ``raw`` is the result's body (done) as the bytes vLLM returned, stored as they came:
    the front answers with them as-is; :attr:`body` parses them, once, when asked."""

    id: str
    status: str  # "pending" | "done" | "failed"
    raw: bytes | None
    error: str | None
    revision: str
    pool: str

    @cached_property
    def body(self) -> dict[str, Any] | None:
        """The result's body as JSON (parsed from :attr:`raw` on first use), else None."""
        body: dict[str, Any] | None = None if self.raw is None else json.loads(self.raw)
        return body


@dataclass
class Counters:
    """Monotonic counters for /status and /metrics."""

    turns: int = 0
    turn_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    sends: int = 0  # HTTP sends of generation requests (a batch of prompts is one)
    batched_samples: int = 0  # samples sent in a batch of more than one prompt
    commits: int = 0
    expired: int = 0
    refused_by_replica: int = 0
    send_errors: int = 0
    sleeps_level1: int = 0  # turns ended with vLLM sleep level 1 (weights to host RAM)
    sleeps_level2: int = 0  # ... level 2 (weights dropped; the next wake loads them)
    lazy_releases: int = 0  # turns ended without a sleep: nobody else wanted the GPU
    wakes_skipped: int = 0  # turns that found the replica still awake: no wake, no load
    early_starts: int = 0  # EARLY received: weights woken (and loaded) before the grant
    early_failed: int = 0  # early starts whose wake or load failed (the turn redoes them)
    # Granted turns that did no work (loaded nothing, served nothing) although the replica
    # had to be woken for them (a park of the other workload was paid): the figure that
    # must stay 0.
    wasted_turns: int = 0
    rejects: Counter[str] = field(default_factory=Counter)


@dataclass
class LoadBackoff:
    """Failed loads of one revision in a row (clocks are trio's)."""

    failures: int = 0  # every failed load: the backoff grows with each
    refused: int = 0  # of them, refused by a healthy replica (the revision's fault)
    retry_at: float = 0.0
    delay: float = 0.0  # the wait chosen at the last failure (core.load_retry_delay)
    error: str = ""


@dataclass
class TurnState:
    """The held turn as the loop sees it (clocks are trio's)."""

    turn: Turn
    waiting_seen_at: float | None = None  # trio clock
    serving_since: float | None = None  # trio clock
    replica_failed: str | None = None
    load_broke: bool = False  # a load broke in this turn: the next one recovers first
    # Work done in the turn: a whole load (an early start's too), or an answer the replica
    # gave that counts (a committed result, a request it refused for good). None of it,
    # the replica woken for the turn: a wasted turn (Counters.wasted_turns).
    worked: bool = False
    wake_skipped: bool = False  # found still awake after a lazy release: nobody paid a park
    load_failures_at_ask: int = 0  # Counters.load_failures when the turn was asked for
