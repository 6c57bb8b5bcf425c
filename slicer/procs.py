"""Process identity from /proc: (pid, start time) pairs, ancestry, trees, kills.

A process is always named by its pid *and* its start time (clock ticks since boot, field
22 of /proc/PID/stat), so a reused pid is never mistaken for the process we registered.
Reading /proc directly keeps the hot path (verify before every grant) in microseconds.
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from typing import Protocol

from gpu_slicer.slicer import pidns

Ident = tuple[int, int]


class ProcessTable(Protocol):
    """What the server reads of (and does to) the node's processes: this module itself,
    or a test's table of made-up processes (the server's `host`)."""

    HAS_CHILDREN_FILES: bool

    def start_time(self, pid: int) -> int | None:
        """The start time of live process `pid`, or None."""
        ...

    def owner_uid(self, pid: int) -> int | None:
        """The real uid owning `pid`, or None."""
        ...

    def groups(self, pid: int) -> set[int]:
        """The supplementary group ids of `pid`."""
        ...

    def alive(self, ident: Ident) -> bool:
        """True while the process named by (pid, start time) lives."""
        ...

    def ancestry(self, pid: int, limit: int = 64) -> Iterator[Ident]:
        """`pid`, then each of its ancestors."""
        ...

    def tree(
        self, ident: Ident, descendants: bool = True, children: dict[int, list[int]] | None = None
    ) -> list[int]:
        """The live pids of the process and (optionally) its descendants."""
        ...

    def children_map(self) -> dict[int, list[int]]:
        """ppid -> child pids."""
        ...

    def kill_pids(self, pids: list[int], sig: int = signal.SIGKILL) -> int:
        """Send `sig` to each pid; how many were signalled."""
        ...

    def tool_runs(self, tool: str, pids: set[int]) -> dict[int, int]:
        """Live runs of `tool` acting on one of `pids`: tool pid -> target pid."""
        ...

    def namespace_of(self, pid: int) -> int | None:
        """The PID namespace (its inode) of process `pid`, or None when unreadable."""
        ...

    def own_namespace(self) -> int | None:
        """slicerd's own PID namespace, or None when unreadable."""
        ...

    def translate(self, ns_pid: int, ns: int) -> int | None:
        """The pid, here, of the process that is `ns_pid` in namespace `ns` and lives in
        it (`slicer.pidns.translate`); None when there is none."""
        ...

    def nspid(self, pid: int) -> int | None:
        """Process `pid`'s number in its own PID namespace (the last `NSpid` number)."""
        ...

    def holding(self, pids: list[int], path: str) -> list[int]:
        """Those of `pids` that have file `path` (a GPU's device node) open."""
        ...


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
    """The real uid owning process `pid`, or None (also for a thread id: /proc answers
    for those too, but a thread is never a process to register or to checkpoint)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:") and int(line.split()[1]) != pid:
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
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


def children_of(pid: int) -> list[int] | None:
    """The child pids of `pid` from /proc/PID/task/*/children, or None where the kernel
    lacks that file (CONFIG_PROC_CHILDREN): reading a tree this way costs its size, not
    a pass over every process of the node."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread just ended
            return None
        except OSError:
            continue
    return out


def tree(
    ident: Ident, descendants: bool = True, children: dict[int, list[int]] | None = None
) -> list[int]:
    """The live pids of the process and (optionally) all its descendants (from
    `children`, else from the per-process children files, else one /proc pass)."""
    if not alive(ident):
        return []
    pids = [ident[0]]
    if descendants:
        i = 0
        while i < len(pids):
            kids = children.get(pids[i], []) if children is not None else children_of(pids[i])
            if kids is None:
                return tree(ident, descendants, children_map())
            pids += kids if children is not None else [k for k in kids if _stat(k) is not None]
            i += 1
    return pids


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> int:
    """Send `sig` to each pid; returns how many were signalled. One that may not be
    signalled (EPERM: another user's, another namespace's) is skipped, not the rest."""
    n = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            n += 1
        except ProcessLookupError:
            pass
        except PermissionError:
            pass  # counted out: the caller sees fewer signalled than asked
    return n


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def tool_runs(tool: str, pids: set[int]) -> dict[int, int]:
    """Live runs of the executable `tool` (matched by its file name among the first two
    argv words, so a script run by its interpreter counts) that act on one of `pids`:
    tool pid -> target pid. One pass over /proc; used only at recovery."""
    name = os.path.basename(tool)
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        argv = _cmdline(int(entry))
        if not any(os.path.basename(a) == name for a in argv[:2]) or "--pid" not in argv:
            continue
        i = argv.index("--pid")
        target = argv[i + 1] if i + 1 < len(argv) else ""
        if target.isdigit() and int(target) in pids and start_time(int(entry)) is not None:
            out[int(entry)] = int(target)
    return out


# Whether this kernel has /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN).
def namespace_of(pid: int) -> int | None:
    """The PID namespace (its inode) of process `pid`, or None when unreadable."""
    ns = pidns.namespace_of(pid)
    if ns is None:
        # The link needs ptrace rights over `pid` (a non-root slicerd, another uid); its
        # world-readable NSpid line still tells whether it lives in /proc's namespace.
        numbers = pidns.nspids(pid)
        if numbers is not None and len(numbers) == 1:
            return pidns.namespace_of("self")
    return ns


def own_namespace() -> int | None:
    """This process's PID namespace, or None when /proc cannot tell."""
    return pidns.namespace_of("self")


def translate(ns_pid: int, ns: int) -> int | None:
    """The pid, here, of the process that is `ns_pid` in PID namespace `ns`."""
    return pidns.translate(ns_pid, ns)


def nspid(pid: int) -> int | None:
    """Process `pid`'s number in its own PID namespace, or None when it is gone."""
    numbers = pidns.nspids(pid)
    return numbers[-1] if numbers else None


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    # A device node is the same device whatever path (or mount namespace: another
    # container of the pod) opened it; a plain file (the fake GPU's) is its inode.
    if stat.S_ISCHR(a.st_mode) and stat.S_ISCHR(b.st_mode):
        return a.st_rdev == b.st_rdev
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holding(pids: list[int], path: str) -> list[int]:
    """Those of `pids` with `path` open (/proc/PID/fd; what `fuser` reads), in order."""
    try:
        target = os.stat(path)
    except OSError:
        return []
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if _same_file(os.stat(f"/proc/{pid}/fd/{fd}"), target):
                    out.append(pid)
                    break
            except OSError:
                continue
    return out


HAS_CHILDREN_FILES = children_of(os.getpid()) is not None
