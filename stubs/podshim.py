"""A pod container's parent outside the pod: its exit ends every process of the container.

    python -I -S podshim.py MARKER PIDNS INIT FD BOUND -- nsenter ... (as `stubs.pods` runs it)

What containerd's shim and runc do for a container of a pod with
``shareProcessNamespace: true`` (`stubs.pods` explains the marker): start the container
(here nsenter, which enters the pod), wait for it, and once it has exited, however it
ended, SIGKILL every process of the pod's PID namespace (inode PIDNS, leaving out its init,
host pid INIT) whose environment holds ``STUBS_POD_CONTAINER=MARKER``, and their
descendants; rescan until none is left, then wait until each is reaped; all within BOUND
seconds. FD is the container's pid pipe, which only nsenter's shell writes: closed here.
The exit status is nsenter's (a signal re-raised).

Run by path with ``-I -S``: no import of the project, nothing but the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
import time

ENV = "STUBS_POD_CONTAINER"
POLL_S = 0.005  # between scans: the killed need a moment to exit and be reaped


def _stat(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat`` after ``pid (comm)``: [state, ppid, ...]; None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def started(pid: int) -> bytes | None:
    """PID's start time (clock ticks after boot), or None when it is gone."""
    st = _stat(pid)
    return None if st is None else st[19]


def members(mark: bytes, pidns: int, init: int) -> dict[int, bytes]:
    """The container's live processes (pid: start time): marked, or descended (by PPid)
    from a marked one that still lives."""
    procs: dict[int, tuple[int, bytes, bool]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == init:
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != pidns:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        st = _stat(int(entry))
        if st is not None and st[0] != b"Z":
            procs[int(entry)] = (int(st[1]), st[19], mark in env)
    mine = {p for p, (_, _, marked) in procs.items() if marked}
    while more := {p for p, (ppid, _, _) in procs.items() if ppid in mine} - mine:
        mine |= more
    return {p: procs[p][1] for p in mine}


def kill_all(mark: bytes, pidns: int, init: int, deadline: float) -> None:
    """SIGKILL the container's processes until none is left, then wait for their reaping
    (both until `deadline`, `time.monotonic()`)."""
    killed: dict[int, bytes] = {}
    while time.monotonic() < deadline:
        found = members(mark, pidns, init)
        if not found:
            break
        for pid, start in found.items():
            try:
                pfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if started(pid) == start:  # checked after the open: not a reused pid
                    signal.pidfd_send_signal(pfd, signal.SIGKILL)
                    killed[pid] = start
            except OSError:
                pass
            finally:
                os.close(pfd)
        time.sleep(POLL_S)
    while killed and time.monotonic() < deadline:
        killed = {p: s for p, s in killed.items() if started(p) == s}
        time.sleep(POLL_S)
    # A process of the container killed by another hand first (a launcher's keeper kills
    # its replica's group as the launcher dies) was a zombie at the scan, which cannot be
    # told from another container's (no environ): wait for the pod's init to reap the
    # zombies it has adopted, as it does at once.
    while time.monotonic() < deadline and adopted_zombies(init):
        time.sleep(POLL_S)


def adopted_zombies(init: int) -> list[int]:
    """Zombies whose parent is the pod's init (host pid `init`): not reaped yet."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] == b"Z" and int(st[1]) == init:
                out.append(int(entry))
    return out


def exit_as(status: int) -> None:
    """Exit with the wait status `status` of a child: its code, or its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    """Start ``argv[5:]`` (after an optional ``--``), wait, end the container, exit."""
    marker, pidns, init, fd, bound = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    command = argv[5:]
    if command[:1] == ["--"]:
        command = command[1:]
    child = os.fork()
    if child == 0:
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    os.close(fd)
    status = os.waitpid(child, 0)[1]
    mark = f"\0{ENV}={marker}\0".encode()
    kill_all(mark, pidns, init, time.monotonic() + float(bound))
    exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
