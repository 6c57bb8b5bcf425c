"""What slicerd's client transports share: where the daemon listens and how long to wait.

`gpu_slicer.slicer.client` re-exports the public names; the transports (`client.Slicer`,
`client_trio.AsyncSlicer`, `client_asyncio.AsyncioSlicer`) import them from here, so none
imports another.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpu_slicer import proto
from gpu_slicer.slicer.config import DEFAULT_SOCKET

__all__ = [
    "HOLD_WARN",
    "RECV_SIZE",
    "RELEASE_TIMEOUT",
    "REPLY_TIMEOUT",
    "WRITE_TIMEOUT",
    "HoldWatch",
    "SessionView",
    "release_stuck",
    "socket_path",
]

log = logging.getLogger("slicer.client")

HOLD_WARN = 300.0
"""Seconds a `turn()` may be held while another workload waits for its GPU before the
client logs a warning (each client's `hold_warn`; None: never). A turn held while its
holder waits for work that itself needs the GPU (sampling from a dispatcher on the same
GPU inside the trainer's own turn) never ends: the warning names the turn and the waiters."""
HOLD_CHECK_TIMEOUT = 5.0  # the STATUS a hold check asks, over a connection of its own
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
    # Seconds a `turn()` is held while others wait before a warning is logged
    # (`HOLD_WARN`; None: never), and the socket it asks STATUS at (None: never asks).
    hold_warn: float | None = HOLD_WARN
    path: str | None = None

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


class HoldWatch:
    """While turn `t` is held, asks slicerd at `path` every `after` seconds whether another
    workload waits for the holder's GPU, and logs one warning naming them. A daemon thread
    with a connection of its own: the holder's code may be blocked (the case this is for),
    and a sync client reads nothing while its `with` body runs. `stop` when the turn ends."""

    def __init__(self, path: str | None, t: proto.Turn, after: float | None) -> None:
        self.t, self.after, self.path = t, after, path
        self.since = time.monotonic()
        self.warned = ""  # the warning logged, once
        self._stop = threading.Event()
        if after is not None and after > 0 and path is not None:
            name = f"slicer-hold-watch-{t.workload}-{t.turn}"
            threading.Thread(target=self._run, name=name, daemon=True).start()

    def stop(self) -> None:
        """The turn ended: no check and no warning from now on."""
        self._stop.set()

    def _run(self) -> None:
        assert self.after is not None and self.path is not None
        while not self._stop.wait(self.after):
            try:
                waiters = _waiters(status(self.path, HOLD_CHECK_TIMEOUT), self.t.workload)
            except (OSError, proto.ProtocolError, proto.ClientError) as e:
                log.debug("hold check of turn %d of %s: %s", self.t.turn, self.t.workload, e)
                continue
            if waiters and not self._stop.is_set():
                self.warned = (
                    f"holding turn {self.t.turn} of {self.t.workload} for "
                    f"{time.monotonic() - self.since:.0f} s while {', '.join(waiters)} "
                    "wait(s) for its GPU. If this code now waits for work that needs the "
                    "GPU (sampling from a dispatcher on the same GPU), that work cannot be "
                    "served inside this turn: release the turn first"
                )
                log.warning("%s", self.warned)
                return


def _waiters(st: dict[str, Any], workload: str) -> list[str]:
    # The queue of the GPU `workload` holds (STATUS `gpus[].holder`), others only.
    for gpu in st.get("gpus", []):
        holder = gpu.get("holder") or {}
        if holder.get("workload") == workload:
            return [str(n) for n in gpu.get("queue", []) if n != workload]
    return []


def status(path: str, timeout: float) -> dict[str, Any]:
    """One STATUS over a blocking connection of its own, bounded by `timeout` per step
    (`OSError`, `TimeoutError` included, when slicerd cannot be asked)."""
    session = proto.ClientSession(None)
    call = session.status()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(session.data_to_send())
        while not call.done:
            data = sock.recv(RECV_SIZE)
            if not data:
                session.receive_eof()
            else:
                session.receive_data(data)
    return call.result()
