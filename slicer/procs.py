"""Process identity from /proc: (pid, start time) pairs, ancestry, trees, kills.

A process is always named by its pid *and* its start time (clock ticks since boot, field
22 of /proc/PID/stat), so a reused pid is never mistaken for the process we registered.
Reading /proc directly keeps the hot path (verify before every grant) in microseconds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

Ident = tuple[int, int]


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start ticks) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ")".
    fields = raw[raw.rfind(b")") + 2 :].split()
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[19])


def start_time(pid: int) -> int | None:
    """The start time of live process `pid`, or None when there is none (or a zombie)."""
    st = _stat(pid)
    return None if st is None else st[1]


def owner_uid(pid: int) -> int | None:
    """The real uid owning process `pid`, or None."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def groups(pid: int) -> set[int]:
    """The supplementary group ids of process `pid` (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def alive(ident: Ident) -> bool:
    """True while the process named by (pid, start time) lives."""
    return start_time(ident[0]) == ident[1]


def ancestry(pid: int, limit: int = 64) -> Iterator[Ident]:
    """`pid` itself, then each of its ancestors, as (pid, start time)."""
    for _ in range(limit):
        st = _stat(pid)
        if st is None:
            return
        yield pid, st[1]
        if st[0] <= 1:
            return
        pid = st[0]


def children_map() -> dict[int, list[int]]:
    """ppid -> child pids, from one pass over /proc (share it across many `tree` calls)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out.setdefault(st[0], []).append(int(name))
    return out


def tree(
    ident: Ident, descendants: bool = True, children: dict[int, list[int]] | None = None
) -> list[int]:
    """The live pids of the process and (optionally) all its descendants."""
    if not alive(ident):
        return []
    pids = [ident[0]]
    if descendants:
        kids = children if children is not None else children_map()
        i = 0
        while i < len(pids):
            pids += kids.get(pids[i], [])
            i += 1
    return pids


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> int:
    """Send `sig` to each pid; returns how many were signalled."""
    n = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            n += 1
        except ProcessLookupError:
            pass
    return n
