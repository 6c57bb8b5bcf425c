"""Attribute the device memory the backend reports to workloads, or call it foreign.

A process belongs to a workload when it is the workload's registered process, or (with
`tree=1`) a descendant of it, or a descendant of a process once seen in its tree
(`members`: a child whose parent died, reparented, is still the workload's). Ancestry is
read from /proc per process that holds memory, so the cost grows with GPU processes (a
handful), not with every process on the node.
The census measures; what it means (what blocks a grant, whether a park held) is decided by
the state machine (`slicer.policy`).

Elimination (`eliminate`, config `census`): where the backend's pids are not in slicerd's
PID namespace (slicerd in a pod; NVML reports host pids) nothing can be attributed by pid.
Then the GPU's total is compared with what the workloads may hold: each workload the state
machine holds to a budget may hold that much; the rest (`suspect`) may hold anything. The
excess over the budgets is charged in full to *every* suspect (each one could hold all of
it), so a park is verified only if the GPU as a whole is within budget; with no suspect
the excess is `unattributed` and blocks grants. Which it is, per state, is the table
`ELIMINATION` (`held_to` reads it), which names every state a workload can be in, so that
a new state cannot slip through as nobody's memory (a frozen workload once did: its memory
read as unattributed and wedged the GPU). What this can and cannot see is in README.md
("PID namespaces"): it never under-counts the GPU as a whole (a suspect's bytes are a
lower bound on what it holds), it cannot say which process holds the excess, and a
workload may exceed its own budget by what the others leave unused (a checkpointed one
leaves nothing: its budget is 0).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from gpu_slicer.slicer import procs
from gpu_slicer.slicer.model import Workload, WState
from gpu_slicer.slicer.readings import Census

__all__ = ["ELIMINATION", "Census", "Held", "Root", "eliminate", "held_to", "take"]


class Held(enum.Enum):
    """How a census by elimination holds a workload: to a budget, or not at all."""

    ANY = "any"  # a suspect: it may hold anything now, and is charged the excess
    BUDGET = "budget"  # at most its budget (`held_to`), however the bytes are spread


ELIMINATION: dict[WState, Held] = {
    WState.REGISTERED: Held.BUDGET,  # never granted (what it held at REGISTER made it IDLE)
    WState.ACTIVE: Held.ANY,  # its turn: it allocates what it wants
    WState.IDLE: Held.ANY,  # released lazily (or dirty, or an early start abandoned)
    WState.PARKING: Held.ANY,  # a park, freeze or residue checkpoint in flight
    WState.PARKED: Held.BUDGET,  # parked_max; 0 when checkpointed (nothing on the device)
    WState.RESTORING: Held.ANY,  # a restore or thaw in flight
    WState.FAULTED: Held.ANY,  # a failed move: whatever it holds stays
    WState.FROZEN: Held.BUDGET,  # locked, runs nothing: exactly what it held when frozen
}


def held_to(w: Workload) -> tuple[bool, int]:
    """(suspect, budget) of `w` for a census by elimination (`ELIMINATION`): a frozen
    workload's memory is its own, the bytes the freeze measured, as it can neither grow
    nor shrink while locked; a checkpointed one holds nothing on the device."""
    if ELIMINATION[w.state] is Held.ANY:
        return True, w.parked_max
    if w.state is WState.FROZEN:
        return False, w.frozen_bytes
    if w.state is WState.PARKED and w.parked_procs:
        return False, 0
    return False, w.parked_max


@dataclass(frozen=True, slots=True)
class Root:
    """A workload's registered process, as the census needs it."""

    wid: int
    pid: int
    start_time: int
    tree: bool
    # For elimination: the budget it is held to, and whether it may hold more right now.
    parked_max: int = 0
    suspect: bool = False


def take(
    gpu_procs: dict[int, int],
    roots: list[Root],
    ancestry: Callable[[int], Iterator[procs.Ident]] = procs.ancestry,
    members: Mapping[procs.Ident, int] | None = None,
) -> Census:
    """Attribute `gpu_procs` (pid -> device bytes on one GPU) to `roots`, reading each
    process's ancestry with `ancestry` (/proc unless told otherwise). `members`: processes
    seen before in the tree of a `tree=1` root (ident -> its wid), whose descendants stay
    that workload's after their parent died; the chain that led to a tree root is
    returned in `Census.members`."""
    by_ident = {(r.pid, r.start_time): r for r in roots}
    tree_roots = {r.wid: r for r in roots if r.tree}
    out = Census()
    for pid, nbytes in gpu_procs.items():
        owner: Root | None = None
        chain: list[procs.Ident] = []
        for depth, ident in enumerate(ancestry(pid)):
            root = by_ident.get(ident)
            if root is not None and (root.tree or depth == 0):
                owner = root
                break
            # A root is matched first: a process that registered itself is its own.
            if members and (wid := members.get(ident)) is not None and wid in tree_roots:
                owner = tree_roots[wid]
                break
            if root is None:  # another workload's tree=0 root is never this one's member
                chain.append(ident)
        if owner is None:
            out.foreign[pid] = nbytes
            continue
        if owner.tree and chain:
            out.members.setdefault(owner.wid, []).extend(chain)
        out.bytes_by_wid[owner.wid] = out.bytes_by_wid.get(owner.wid, 0) + nbytes
        out.pids_by_wid.setdefault(owner.wid, []).append(pid)
    return out


def eliminate(gpu_procs: dict[int, int], roots: list[Root]) -> Census:
    """Attribute `gpu_procs` (backend pid -> device bytes on one GPU, pids of a namespace
    slicerd cannot read) to `roots` by elimination (module docstring)."""
    total = sum(gpu_procs.values())
    allowed = sum(r.parked_max for r in roots if not r.suspect)
    excess = max(0, total - allowed)
    out = Census()
    suspects = [r for r in roots if r.suspect]
    for r in suspects:
        if excess:
            out.bytes_by_wid[r.wid] = excess
    if excess and not suspects:
        out.unattributed = excess
        out.unattributed_pids = sorted(gpu_procs)
    return out
