"""The messages of the wire protocol as frozen dataclasses.

Requests go from client to server and are answered in order by exactly one `Reply`
(`Ok` or `Err`). `Fault`, `Waiting`, `ParkAsk` and `Event` are unsolicited server lines that may
arrive between replies. Construction does not validate; `proto.encode` does, and
`proto.parse_request` / `proto.parse_server_line` only ever return valid messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from gpu_slicer.proto.errors import ErrorCode, ProtocolError
from gpu_slicer.proto.values import PROTO_VERSION

__all__ = [
    "Acquire",
    "Early",
    "Err",
    "Event",
    "Fault",
    "Hello",
    "Ok",
    "ParkAsk",
    "ParkFallback",
    "ParkMode",
    "Parked",
    "Ping",
    "Register",
    "Release",
    "ReleasePark",
    "Reply",
    "Request",
    "ServerMessage",
    "Status",
    "Unregister",
    "Waiting",
    "Watch",
]


_KNOWN_CODES = frozenset(code.value for code in ErrorCode)


class ParkMode(enum.StrEnum):
    """How a workload is parked: by the slicer (cuda-checkpoint) or by itself."""

    CHECKPOINT = "checkpoint"
    COOPERATIVE = "cooperative"


class ParkFallback(enum.StrEnum):
    """What the slicer may do when a cooperative workload cannot park itself; `residue`
    also checkpoints what every cooperative park leaves on the GPU (a slept vLLM's CUDA
    context and graphs), after the park and before anyone else is granted."""

    NONE = "none"
    CHECKPOINT = "checkpoint"
    RESIDUE = "residue"


class ReleasePark(enum.StrEnum):
    """When RELEASE parks: only once someone else needs the GPU, or before replying."""

    LAZY = "lazy"
    NOW = "now"


# --- requests -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """``HELLO proto=1 [client=NAME]``: optional version handshake."""

    proto: int = PROTO_VERSION
    client: str | None = None


@dataclass(frozen=True, slots=True)
class Ping:
    """``PING``: liveness check, answered ``OK``."""


@dataclass(frozen=True, slots=True)
class Register:
    """``REGISTER <workload> [gpu=] [pid=] [tree=1|0] [park=] [parked_max=] [fallback=]
    [ask=1|0] [max_turn=S]``; `ask`: the registrant answers ``PARK`` events (it can park
    the workload); `max_turn`: a turn held longer than S seconds while another workload
    waits is taken back (``park=checkpoint`` only; see `Preempted`)."""

    workload: str
    gpu: str | None = None
    pid: int | None = None
    tree: bool = True
    park: ParkMode = ParkMode.CHECKPOINT
    parked_max: int = 0
    fallback: ParkFallback = ParkFallback.NONE
    ask: bool = False
    max_turn: float | None = None


@dataclass(frozen=True, slots=True)
class Acquire:
    """``ACQUIRE <workload> [wait=SECONDS] [early=BYTES]``: queue for a turn; `wait` None
    waits forever; `early` (0: none) asks for an early start: the caller can begin with
    that many bytes of GPU memory while the workload before it is still being parked
    (see `Early`)."""

    workload: str
    wait: float | None = None
    early: int = 0


@dataclass(frozen=True, slots=True)
class Release:
    """``RELEASE <workload> turn=T [park=lazy|now] [used=1|0]``: end turn `turn`
    (`used` False: the holder did no work in it, counted as an unused turn, and as a
    wasted one when a park or restore was paid for it)."""

    workload: str
    turn: int
    park: ReleasePark = ReleasePark.LAZY
    used: bool = True


@dataclass(frozen=True, slots=True)
class Parked:
    """``PARKED <workload> turn=T [ok=1|0]``: the registrant's answer to ``PARK``."""

    workload: str
    turn: int
    ok: bool = True


@dataclass(frozen=True, slots=True)
class Unregister:
    """``UNREGISTER <workload>``: end the registration (registrant only)."""

    workload: str


@dataclass(frozen=True, slots=True)
class Status:
    """``STATUS``: answered by ``OK {json}``."""


@dataclass(frozen=True, slots=True)
class Watch:
    """``WATCH``: answered ``OK``, then the connection streams ``EVENT`` lines."""


Request: TypeAlias = (
    Hello | Ping | Register | Acquire | Release | Parked | Unregister | Status | Watch
)


# --- server lines ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ok:
    """``OK [k=v ...]`` or, for STATUS, ``OK {compact json}``; never both."""

    fields: dict[str, str] = field(default_factory=dict)
    body: Any = None


@dataclass(frozen=True, slots=True)
class Err:
    """``ERR <code> [k=v ...] [-- text]``. A known `code` string becomes an `ErrorCode`."""

    code: ErrorCode | str
    fields: dict[str, str] = field(default_factory=dict)
    text: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.code, ErrorCode) and self.code in _KNOWN_CODES:
            object.__setattr__(self, "code", ErrorCode(self.code))

    @classmethod
    def from_error(cls, error: ProtocolError) -> Err:
        """The reply to a request that failed with `error`."""
        return cls(error.code, text=error.message)


@dataclass(frozen=True, slots=True)
class Fault:
    """``FAULT <workload> turn=T reason=R [-- text]``: park/restore failed; `turn` may be 0."""

    workload: str
    turn: int
    reason: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class Waiting:
    """``WAITING <workload> turn=T waiters=N``: others now wait for the holder's GPU."""

    workload: str
    turn: int
    waiters: int


@dataclass(frozen=True, slots=True)
class Early:
    """``EARLY <workload> bytes=N``: to the connection whose ``ACQUIRE ... early=N`` waits at
    the head of the queue: the workload before it is locked (it runs nothing) while the
    slicer parks it, and N bytes are free beside it: the waiter may start the part of its
    work that fits in N bytes (vLLM: wake its weights and load them). The grant follows
    the park; the rest (vLLM: its KV cache) waits for it."""

    workload: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Preempted:
    """``PREEMPTED <workload> turn=T``: to the holder: turn T was taken back (it was held
    past the workload's ``max_turn`` while another workload waited); the slicer parks the
    workload by checkpoint, and its next ACQUIRE restores it."""

    workload: str
    turn: int


@dataclass(frozen=True, slots=True)
class ParkAsk:
    """``PARK <workload> turn=T [timeout_ms=N]``: to the registrant: park your workload
    yourself now (its holder is gone) and answer ``PARKED`` within `timeout_ms`; `turn`
    is its last turn (0: none)."""

    workload: str
    turn: int
    timeout_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """``EVENT {compact json}``: one state change, streamed to WATCH connections."""

    body: dict[str, Any]


Reply: TypeAlias = Ok | Err
ServerMessage: TypeAlias = Ok | Err | Fault | Waiting | Early | Preempted | ParkAsk | Event
