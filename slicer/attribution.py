"""Whose GPU memory is whose, and which process a peer's pid names.

Two questions of the server that depend on PID namespaces (README, "PID namespaces"):

- *Which process does `pid=N` name?* A peer in another PID namespace (a pod) has every
  number it sends read in its namespace and translated into slicerd's (`resolve_pid`);
  the kernel already gives the peer's own pid in slicerd's namespace (SO_PEERCRED).
- *Whose is the memory the GPU backend reports?* By the backend's pids where slicerd can
  read them (`census = pids`: `census.take`), else by elimination against the workloads'
  budgets (`census.eliminate`: slicerd in a pod, NVML speaking host pids). Elimination
  is sharpened by the one per-process fact a pod can read: a CUDA context keeps the GPU's
  device node open (`/dev/nvidiaN`), so a workload none of whose processes has it open
  holds nothing there, and the processes that have it open are the ones to checkpoint.

A process once seen in a `tree=1` workload's tree stays that workload's (`survivors`): a
child outlives a SIGKILLed parent (one started in a session of its own, out of reach of
the launcher's keeper), is reparented and leaves the tree, and its memory must not turn
into foreign memory that blocks every grant; the state machine kills it once the
workload is an orphan (`SlicerState.memory_report`). The memory is this daemon's alone:
a restarted slicerd has not seen them (a process is seen at a census: every grant
check, park and reaper look, and `MEMBERS_EVERY` for the GPUs of tree workloads).
"""

from __future__ import annotations

import logging
from typing import Any

from gpu_slicer.slicer import census, errors, procs
from gpu_slicer.slicer.config import Config
from gpu_slicer.slicer.gpu import GpuBackend, device_node_of, pid_namespace_of
from gpu_slicer.slicer.model import WState
from gpu_slicer.slicer.park import Parker
from gpu_slicer.slicer.readings import Census
from gpu_slicer.slicer.state import SlicerState

log = logging.getLogger("slicer.server")

MEMBERS_MAX = 4096  # remembered processes of all workloads (pruned of the dead beyond it)


def census_mode(asked: str, backend_ns: int | None, own_ns: int | None) -> tuple[str, str]:
    """The census to run (`pids` or `elimination`) for config `census` = `asked`, and
    why: `auto` eliminates when the backend's pids are another namespace's than ours."""
    if asked != "auto":
        return asked, f"census = {asked}"
    if backend_ns is None or own_ns is None or backend_ns == own_ns:
        return "pids", "the GPU backend's pids are slicerd's PID namespace's"
    return "elimination", (
        f"the GPU backend's pids are PID namespace pid:[{backend_ns}]'s, slicerd runs in "
        f"pid:[{own_ns}] and cannot read them"
    )


class Attribution:
    """The census mode of this daemon and the pid questions that depend on namespaces."""

    def __init__(
        self, cfg: Config, sm: SlicerState, backend: GpuBackend, host: procs.ProcessTable
    ) -> None:
        self.sm, self.backend, self.host = sm, backend, host
        self.own_ns = host.own_namespace()
        self.census, why = census_mode(cfg.census, pid_namespace_of(backend), self.own_ns)
        self.blind = self.census == "elimination"
        # (pid, start time) -> whether the driver knows CUDA state for it (`cuda_only`).
        self._cuda: dict[procs.Ident, bool] = {}
        # (gpu, pid) -> start time of a process seen with the GPU's device node open.
        self._holders: dict[tuple[int, int], int] = {}
        # (pid, start time) -> wid: processes seen in a tree=1 workload's tree (by pids:
        # from a GPU process up to the root; by elimination: those with the node open).
        self._members: dict[procs.Ident, int] = {}
        self._by_wid: dict[int, set[procs.Ident]] = {}  # the same, by workload
        self._changed: set[int] = set()  # wids with a process newly remembered
        # Only the unusual mode is worth a line at start (a failed start prints one line).
        (log.info if self.blind else log.debug)("census by %s (%s)", self.census, why)
        if self.blind and cfg.foreign == "ignore":
            log.warning(
                "foreign=ignore cannot be honoured by elimination: memory beyond the "
                "workloads' budgets blocks grants (README, PID namespaces)"
            )

    # ---- pids a peer sends -----------------------------------------------------------

    def resolve_pid(
        self, peer: int, peer_start: int | None, peer_ns: int | None, asked: int | None
    ) -> tuple[int, int | None, int | None]:
        """The pid `asked` (None: the peer itself) names, in slicerd's PID namespace, for
        a peer of pid `peer` (slicerd's number, started at `peer_start`) in namespace
        `peer_ns` (both read at accept); with the number and namespace the peer used when
        those are not slicerd's."""
        if peer <= 0:
            # SO_PEERCRED gives 0 for a peer whose namespace slicerd cannot see into.
            raise errors.NoSuchProcess(
                "the connecting process is not visible in slicerd's PID namespace; run "
                "slicerd in the host's PID namespace (hostPID) or in the workload's pod "
                "(shareProcessNamespace)"
            )
        if peer_ns is None:
            # Fail closed: a peer that exited before its namespace was read (its child
            # holding the socket) must not have its pods' numbers read as slicerd's.
            raise errors.NoSuchProcess(
                f"the PID namespace of the connecting process (pid {peer}) could not be "
                "read when it connected (it had exited, or slicerd may not read /proc): "
                "connect from the process that registers"
            )
        if asked is None and peer_start is not None and self.host.start_time(peer) != peer_start:
            raise errors.NoSuchProcess(
                f"the connecting process (pid {peer}) has exited: pid=self names nobody"
            )
        if peer_ns == self.own_ns:
            return (asked if asked is not None else peer), None, None
        if asked is None:
            return peer, self.host.nspid(peer), peer_ns
        pid = self.host.translate(asked, peer_ns)
        if pid is None:
            raise errors.NoSuchProcess(
                f"no process {asked} in the sender's PID namespace pid:[{peer_ns}] (a pid= "
                "is read in the namespace of the connection that sends it; a process in a "
                "namespace nested inside it cannot be named)"
            )
        return pid, asked, peer_ns

    def still(self, pid: int, ns: int, ns_pid: int | None) -> bool:
        """Whether `pid` is still the process numbered `ns_pid` in namespace `ns`."""
        return self.host.namespace_of(pid) == ns and (
            ns_pid is None or self.host.nspid(pid) == ns_pid
        )

    # ---- whose memory ----------------------------------------------------------------

    def roots(self, gpu: int) -> list[census.Root]:
        """The census roots of the workloads on `gpu`. By elimination, a suspect none of
        whose processes has the GPU's device node open holds nothing there: it is
        cleared, held to a budget of 0."""
        out = []
        for w in self.sm.workloads():
            if w.gpu != gpu:
                continue
            suspect, budget = census.held_to(w)  # every state's row (`census.ELIMINATION`)
            ident = (w.pid, int(w.start_time))
            if suspect and self.blind and not self.holds_gpu(ident, w.tree, gpu, w.wid):
                suspect, budget = False, 0
            out.append(census.Root(w.wid, w.pid, int(w.start_time), w.tree, budget, suspect))
        return out

    def journal_roots(self, gpu: int, entries: list[dict[str, Any]]) -> list[census.Root]:
        """Census roots (wid: the entry's index) of journaled workloads after a restart.
        Grants are not journaled, so by elimination a `registered` one whose processes
        have the GPU open may have been holding its turn: a suspect too."""
        out = []
        for i, e in enumerate(entries):
            ident, tree = (int(e["pid"]), int(e["start_time"])), bool(e["tree"])
            state = e.get("state")
            suspect = state not in (WState.PARKED, WState.REGISTERED)
            budget = int(e["parked_max"])
            if self.blind:
                if state == WState.PARKED and e.get("parked_procs"):
                    budget = 0  # checkpointed
                holds = self.holds_gpu(ident, tree, gpu)
                suspect = holds and (suspect or state == WState.REGISTERED)
                budget = budget if holds else 0
            out.append(census.Root(i, ident[0], ident[1], tree, budget, suspect))
        return out

    def holds_gpu(self, ident: procs.Ident, tree: bool, gpu: int, wid: int | None = None) -> bool:
        """Whether a process of the tree of `ident` (or a `survivor` of workload `wid`)
        may hold memory on `gpu`: has its device node open (anyone may, where the backend
        names no device node)."""
        node = device_node_of(self.backend, gpu)
        if node is None:
            return True
        pids = self._tree_of(ident, tree, wid)
        # Reading a process's open files costs ~5 us a file (a vLLM engine has hundreds)
        # and this runs at every grant check: a process seen holding the node is taken
        # to hold it until it exits (a CUDA context keeps it open; if it closed it, the
        # error is an over-count, never an under-count), and the scan stops at the first.
        for p in pids:
            if (start := self._holders.get((gpu, p))) is not None:
                if start == self.host.start_time(p):
                    return True
                del self._holders[(gpu, p)]
        for p in pids:
            if self.host.holding([p], node):
                start = self.host.start_time(p)
                if start is not None:
                    if len(self._holders) >= 4096:
                        self._holders.clear()
                    self._holders[(gpu, p)] = start
                    if wid is not None and tree:
                        self._remember(wid, [(p, start)])
                return True
        return False

    def _tree_of(self, ident: procs.Ident, tree: bool, wid: int | None) -> list[int]:
        pids = self.host.tree(ident, tree)
        if wid is not None and tree:
            pids += [p for p in self.survivors(wid) if p not in pids]
        return pids

    def survivors(self, wid: int) -> list[int]:
        """The live processes once seen in workload `wid`'s tree, whether or not they are
        in it now (a child whose parent died is reparented out of it). Never one that is
        another tracked workload's now: its registered process, or in its tree (a process
        that registered itself after it left, say), so that no kill of them reaches it."""
        idents = self._by_wid.get(wid, set())
        for ident in [i for i in idents if self.host.start_time(i[0]) != i[1]]:
            self._forget(ident)
        others = {(w.pid, int(w.start_time)): w.tree for w in self.sm.workloads() if w.wid != wid}
        out = []
        for pid, _start in self._by_wid.get(wid, set()):
            owned = any(
                a in others and (others[a] or depth == 0)
                for depth, a in enumerate(self.host.ancestry(pid))
            )
            if not owned:
                out.append(pid)
        return sorted(out)

    def _forget(self, ident: procs.Ident) -> None:
        wid = self._members.pop(ident, None)
        if wid is None:
            return
        idents = self._by_wid.get(wid, set())
        idents.discard(ident)
        if not idents:
            self._by_wid.pop(wid, None)

    def _remember(self, wid: int, idents: list[procs.Ident]) -> None:
        if len(self._members) + len(idents) > MEMBERS_MAX:
            live = {
                i: w
                for i, w in self._members.items()
                if self.sm.by_wid(w) is not None and self.host.start_time(i[0]) == i[1]
            }
            # Still full of live ones: the oldest half goes (a bound, not a belief).
            if len(live) > MEMBERS_MAX // 2:
                live = dict(list(live.items())[len(live) // 2 :])
            self._members, self._by_wid = live, {}
            for i, w in live.items():
                self._by_wid.setdefault(w, set()).add(i)
        for ident in idents:
            if self._members.get(ident) != wid:
                self._forget(ident)
                self._members[ident] = wid
                self._by_wid.setdefault(wid, set()).add(ident)
                self._changed.add(wid)

    def changed(self) -> set[int]:
        """The workloads with a process remembered since the last call."""
        out, self._changed = self._changed, set()
        return out

    def attribute(
        self, seen: dict[int, int], roots: list[census.Root], remember: bool = True
    ) -> Census:
        """Attribute one GPU's reading to `roots` by this daemon's census; with
        `remember` (roots whose wids are workloads', not a journal's indexes), the
        processes that led to a tree root stay its workload's (`survivors`)."""
        if self.blind:
            return census.eliminate(seen, roots)
        members = self._members if remember else None
        if remember:
            # A process that registered itself is its own workload's, whoever saw it first.
            for r in roots:
                if self._members.get((r.pid, r.start_time)) not in (None, r.wid):
                    self._forget((r.pid, r.start_time))
        out = census.take(seen, roots, self.host.ancestry, members)
        for wid, idents in out.members.items() if remember else ():
            self._remember(wid, idents)
        return out

    def newcomer(self, seen: dict[int, int], gpu: int, ident: procs.Ident, tree: bool) -> int:
        """The device bytes a registering process (tree) already holds on `gpu`."""
        pid, start = ident
        if not self.blind:
            # A probe root with a wid no workload has (before it is known, its memory
            # would read as foreign).
            return census.take(seen, [census.Root(0, pid, start, tree)], self.host.ancestry).of(0)
        # By elimination: a newcomer none of whose processes has the GPU open holds
        # nothing there; one that has is a suspect beside the others, so that it is the
        # one parked, never an innocent holder.
        if not self.holds_gpu(ident, tree, gpu):
            return 0
        roots = [*self.roots(gpu), census.Root(0, pid, start, tree, 0, True)]
        return census.eliminate(seen, roots).of(0)

    async def cuda_only(
        self, candidates: tuple[procs.Ident, ...], parker: Parker, timeout: float
    ) -> tuple[procs.Ident, ...]:
        """By elimination, those of `candidates` (processes with the GPU open) that the
        driver says have CUDA state: a forked child (a data loader) inherits the device
        node but not the context, and locking it would fail the park. `--get-state` is
        slow on real hardware, so each process is asked once; an unclear answer keeps it
        (the tool decides)."""
        out = []
        for ident in candidates:
            known = self._cuda.get(ident)
            if known is None:
                known = await parker.get_state(ident[0], timeout) != "none"
                if len(self._cuda) >= 4096:
                    self._cuda.clear()  # processes come and go: keep the cache bounded
                self._cuda[ident] = known
            if known:
                out.append(ident)
        return tuple(out)

    def gpu_pids(self, gpu: int, wid: int, seen: Census) -> list[int]:
        """The processes of workload `wid` that hold a context on `gpu`: per the
        backend's pids, or (elimination) those of its tree with the GPU's device node
        open, every process of its tree when the backend names no device node."""
        if not self.blind:
            return seen.pids_by_wid.get(wid, [])
        w = self.sm.by_wid(wid)
        if w is None:
            return []
        tree = self._tree_of((w.pid, int(w.start_time)), w.tree, w.wid)
        node = device_node_of(self.backend, gpu)
        return tree if node is None else self.host.holding(tree, node)
