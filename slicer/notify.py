"""sd_notify by hand: READY=1, WATCHDOG=1, STOPPING=1 to $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket


def sd_notify(message: str) -> bool:
    """Send `message` to systemd; False when not run under a notify-type unit."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(path)
            s.sendall(message.encode())
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Half the systemd watchdog period in seconds, when the watchdog is on for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
