"""PID namespaces: which namespace a process lives in, and what its pid is in ours.

A peer in a pod sends pids as its pod sees them. The kernel already translates the
peer's own pid (SO_PEERCRED answers in the reader's namespace); every other number the
peer sends is read in the peer's namespace and translated here: the process whose
`NSpid` line in `/proc/<p>/status` ends with that number *and* whose `/proc/<p>/ns/pid`
is the peer's namespace. A process in a namespace nested inside the peer's (a sandbox
inside the pod) is not translated: its last `NSpid` number is in its own namespace, and
guessing which of the sibling namespaces at that depth the peer meant could name a
process of another pod.

A namespace is named by the inode number of its `ns/pid` link (what `readlink` shows as
`pid:[N]`); the initial (host) namespace has the fixed inode `INIT_PID_NS`.

`proc` is the procfs to read, `/proc` unless told otherwise: the fake GPU reads a host
procfs mounted elsewhere the same way (`stubs.fakegpu`).
"""

from __future__ import annotations

import os

__all__ = ["INIT_PID_NS", "PROC", "namespace_of", "nspids", "own_namespace", "translate"]

PROC = "/proc"
# The kernel's PROC_PID_INIT_INO: the inode of the initial PID namespace on every Linux.
INIT_PID_NS = 0xEFFFFFFC


def namespace_of(pid: int | str, proc: str = PROC) -> int | None:
    """The inode of the PID namespace of process `pid` (`"self"` allowed), or None when
    it is gone or cannot be read."""
    try:
        return os.stat(f"{proc}/{pid}/ns/pid").st_ino
    except (OSError, ValueError):
        return None


def own_namespace() -> int:
    """The inode of this process's PID namespace."""
    ns = namespace_of("self")
    if ns is None:  # /proc unmounted: nothing here can tell namespaces apart
        raise OSError("cannot read /proc/self/ns/pid")
    return ns


def nspids(pid: int | str, proc: str = PROC) -> list[int] | None:
    """The `NSpid` numbers of process `pid`: its pid in `proc`'s namespace first, then in
    each nested namespace down to its own. None when it is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def translate(ns_pid: int, ns: int, proc: str = PROC) -> int | None:
    """The pid, in `proc`'s namespace, of the process that has pid `ns_pid` in PID
    namespace `ns` and lives in it; None when there is none.

    One pass over `proc` (a stat per process, a read only for those in `ns`); REGISTER
    is rare, so the cost (a few ms per thousand processes) is paid only then."""
    try:
        entries = os.listdir(proc)
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit() or namespace_of(entry, proc) != ns:
            continue
        numbers = nspids(entry, proc)
        # Checked again after the read: the pid may have been reused meanwhile by a
        # process of another namespace.
        if numbers and numbers[-1] == ns_pid and namespace_of(entry, proc) == ns:
            return int(entry)
    return None
