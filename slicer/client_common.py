"""What slicerd's client transports share: where the daemon listens and how long to wait.

`gpu_slicer.slicer.client` re-exports the public names; the transports (`client.Slicer`,
`client_trio.AsyncSlicer`, `client_asyncio.AsyncioSlicer`) import them from here, so none
imports another.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from gpu_slicer import proto
from gpu_slicer.slicer.config import DEFAULT_SOCKET

__all__ = [
    "RECV_SIZE",
    "RELEASE_TIMEOUT",
    "REPLY_TIMEOUT",
    "WRITE_TIMEOUT",
    "SessionView",
    "release_stuck",
    "socket_path",
]

REPLY_TIMEOUT = 30.0
"""Default bound (seconds) on the reply to a request that is answered at once."""
RELEASE_TIMEOUT = 600.0
"""Bound (seconds) on the RELEASE at the end of `turn()` (each client's `release_timeout`).
A RELEASE waits for a park of the workload when the daemon parks it there (``park=now``,
or a waiter needs the room): with the default limits at most the registrant's answer
(60 s) then cuda-checkpoint (120 s). Past the bound the daemon is taken as stuck and the
connection is closed (the daemon then ends the turn, if it still can)."""
RECV_SIZE = 65536
"""Bytes asked of the socket per read."""
WRITE_TIMEOUT = 10.0
"""Bound (seconds) on writing request lines (the async clients): a write only blocks while
the daemon reads nothing; past it the connection is taken as lost."""


def socket_path(path: str | None = None) -> str:
    """The socket to use: explicit, else $SLICER_SOCKET, else the system default."""
    return path or os.environ.get("SLICER_SOCKET") or DEFAULT_SOCKET


def release_stuck(bound: float) -> str:
    """The `Unreachable` text when the RELEASE ending a turn got no reply within `bound` s."""
    return f"no reply to RELEASE within {bound:g} s: the connection was closed"


class SessionView:
    """The session's state as both transports show it (written once, here)."""

    _session: proto.ClientSession

    @property
    def workload(self) -> str | None:
        """The name used when a call is given none (set by `register`)."""
        return self._session.workload

    @workload.setter
    def workload(self, name: str | None) -> None:
        self._session.workload = name

    def _preempted(self, t: proto.Turn, error: Exception) -> bool:
        # A release refused because slicerd took the turn back (PREEMPTED came first):
        # the turn is over as the `with` block meant it to be; nothing is wrong.
        code = getattr(error, "code", None)
        taken = (t.workload, t.turn) in self._session.preempted
        return code == proto.ErrorCode.NOT_HOLDER and taken

    @property
    def events(self) -> deque[proto.ServerMessage]:
        """Non-reply lines received and not yet taken by `next_message`."""
        return self._session.events

    @property
    def on_event(self) -> Callable[[proto.ServerMessage], None] | None:
        """Called with each non-reply line as it arrives (must not block)."""
        return self._session.on_event

    @on_event.setter
    def on_event(self, fn: Callable[[proto.ServerMessage], None] | None) -> None:
        self._session.on_event = fn
