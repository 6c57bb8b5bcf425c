"""Host pids: the fake GPU numbers processes the way NVIDIA's kernel driver does.

The real driver lives in the kernel, so NVML reports every GPU process by its pid in the
host (outermost) PID namespace, whichever namespace asks, while tools such as
``cuda-checkpoint --pid P`` read P in the caller's namespace. The fake driver is a ledger
shared by processes that may sit in different namespaces (a pod is a PID namespace with
its own ``/proc``), so it keys every row by host pid and translates at its edge.

``$FAKEGPU_HOST_PROC`` (default ``/proc``) names a procfs of the host PID namespace, the
fake driver's: a pod simulation bind-mounts the host's ``/proc`` there before mounting its
own. Everything here reads that procfs, so every caller, in any namespace, computes the
same host pid and the same process identity.

A ``HostPid`` is a pid already in the host namespace (a number read from
``Ledger.processes()``, or one ``to_host`` returned): ``to_host`` passes it through, so a
caller translates once and hands the result back to the ledger.
"""

from __future__ import annotations

import os

from gpu_slicer.slicer import pidns
from stubs.fakegpu.model import FakeGpuError

__all__ = ["HostPid", "host_namespace", "host_proc", "process_identity", "to_host"]

ENV = "FAKEGPU_HOST_PROC"
# /proc/<pid>/stat after the ")" that closes comm: field 3 (state) is index 0, so field
# 22 (starttime, clock ticks after boot) is index 19.
_STATE, _STARTTIME = 0, 19
_GONE = (b"Z", b"X", b"x")  # zombie, dead: the driver has freed their memory

# Per (os.getpid(), host procfs): (caller's namespace, host namespace, own host pid).
# A process's own PID namespace never changes (unshare/setns move only its children), so
# this holds until it forks; keying by getpid makes a forked child look again.
_ns_cache: dict[tuple[int, str], tuple[int | None, int | None, int | None]] = {}


class HostPid(int):
    """A pid in the host PID namespace; ``to_host`` returns it unchanged."""

    __slots__ = ()


def host_proc() -> str:
    """The procfs of the host PID namespace: ``$FAKEGPU_HOST_PROC``, else ``/proc``."""
    return os.environ.get(ENV) or pidns.PROC


def _ppid(pid: int, proc: str) -> int | None:
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _procfs_namespace(proc: str) -> int | None:
    """The PID namespace whose processes ``proc`` shows."""
    ns = pidns.namespace_of(1, proc)
    if ns is not None:
        return ns
    # Its pid 1 may be unreadable (a sandbox's init keeps its ns links to itself): any
    # process living in the procfs's namespace will do, and one is among our ancestors
    # (NSpid read through a procfs starts in its namespace: one number means "lives in it").
    try:
        pid: int | None = int(os.readlink(f"{proc}/self"))
    except (OSError, ValueError):
        return None
    for _ in range(128):  # a bound against a corrupt chain; real ones are a few deep
        if not pid:
            return None
        numbers = pidns.nspids(pid, proc)
        if numbers is not None and len(numbers) == 1:
            ns = pidns.namespace_of(pid, proc)
            if ns is not None:
                return ns
        pid = _ppid(pid, proc)
    return None


def _namespaces() -> tuple[int | None, int | None, int | None]:
    proc = host_proc()
    key = (os.getpid(), proc)
    cached = _ns_cache.get(key)
    if cached is None:
        caller, host = pidns.namespace_of("self"), _procfs_namespace(proc)
        own: int | None = os.getpid()
        if caller != host and caller is not None and host is not None:
            try:
                # The host procfs's "self" resolves in that procfs's namespace.
                own = int(os.readlink(f"{proc}/self"))
            except (OSError, ValueError):
                own = None
        cached = _ns_cache[key] = (caller, host, own)
    return cached


def host_namespace() -> int:
    """The inode of the host PID namespace: that of the host procfs's pid 1, or of the
    caller's nearest ancestor living in it when pid 1 cannot be read."""
    ns = _namespaces()[1]
    if ns is None:
        raise FakeGpuError(f"cannot tell the PID namespace of {host_proc()} (set ${ENV})")
    return ns


def to_host(pid: int) -> HostPid:
    """The host pid of ``pid``, a pid in the caller's PID namespace (a ``HostPid`` is
    returned as is). Raises FakeGpuError when no process of the caller's namespace has
    that pid."""
    if isinstance(pid, HostPid):
        return pid
    caller, host, own = _namespaces()
    if caller == host or caller is None or host is None:
        # Same namespace (every bare-metal caller), or nothing to tell them apart with.
        return HostPid(pid)
    if pid == os.getpid() and own is not None:
        return HostPid(own)
    found = pidns.translate(pid, caller, host_proc())
    if found is None:
        raise FakeGpuError(
            f"no process {pid} in this PID namespace (pid:[{caller}]; "
            f"the fake driver's is pid:[{host}] at {host_proc()})"
        )
    return HostPid(found)


def process_identity(pid: int) -> float | None:
    """The start time (clock ticks after boot) of live host pid ``pid``, read from the
    host procfs; None when it is gone, a zombie or dead. (pid, start time) names one
    process for good: a reused pid starts later."""
    try:
        with open(f"{host_proc()}/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    fields = data.rpartition(b")")[2].split()
    if len(fields) <= _STARTTIME or fields[_STATE] in _GONE:
        return None
    return float(fields[_STARTTIME])
