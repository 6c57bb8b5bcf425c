"""Attribute the device memory the backend reports to workloads, or call it foreign.

A process belongs to a workload when it is the workload's registered process, or (with
`tree=1`) a descendant of it. Ancestry is read from /proc per process that holds memory,
so the cost grows with GPU processes (a handful), not with every process on the node.
The census measures; what it means (what blocks a grant, whether a park held) is decided by
the state machine (`slicer.policy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpu_slicer.slicer import procs
from gpu_slicer.slicer.readings import Census

__all__ = ["Census", "Root", "take"]


@dataclass(frozen=True, slots=True)
class Root:
    """A workload's registered process, as the census needs it."""

    wid: int
    pid: int
    start_time: int
    tree: bool


def take(
    gpu_procs: dict[int, int],
    roots: list[Root],
    ancestry: Callable[[int], Iterator[procs.Ident]] = procs.ancestry,
) -> Census:
    """Attribute `gpu_procs` (pid -> device bytes on one GPU) to `roots`, reading each
    process's ancestry with `ancestry` (/proc unless told otherwise)."""
    by_ident = {(r.pid, r.start_time): r for r in roots}
    out = Census()
    for pid, nbytes in gpu_procs.items():
        owner: Root | None = None
        for depth, ident in enumerate(ancestry(pid)):
            root = by_ident.get(ident)
            if root is not None and (root.tree or depth == 0):
                owner = root
                break
        if owner is None:
            out.foreign[pid] = nbytes
            continue
        out.bytes_by_wid[owner.wid] = out.bytes_by_wid.get(owner.wid, 0) + nbytes
        out.pids_by_wid.setdefault(owner.wid, []).append(pid)
    return out
