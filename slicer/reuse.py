"""Age-bounded reuse of a clean GPU reading for a grant check (`verify_reuse_ms`).

Before a grant the server reads the GPU through the backend (a census of the processes on
it, `slicer.census`), so that nothing is granted while foreign memory, or a workload that
should be parked, sits on the GPU. That reading is most of an ACQUIRE's cost. A grant check
on GPU g may reuse the last reading of g, for the same workload, when

* it is younger than `verify_reuse_ms` on the daemon's monotonic clock (the server's
  injectable clock: tests run it on virtual time);
* it was *clean*: the GPU held only what the workload being granted may hold, no foreign
  process and no other workload above its `parked_max`. A reading that found foreign or
  unexpected memory, or that refused a grant, is never kept, and forgets what was;
* nothing changed who may be on g since: a grant to another workload, the start and the
  end of a park, restore, recovery or kill, a REGISTER, adoption or unregistration, a
  FAULT, and every other event about a workload of g (all but queued, released and the
  grant to the workload the reading was for) forget the reading of g. The roots the
  census attributed memory to are compared too: a reading is for exactly that set.

The trade: a foreign process that starts allocating within `verify_reuse_ms` of a clean
reading is caught by the next reading instead of this grant's. Every check is racy with a
foreign process by its nature (it may start allocating right after any check), so the
window only adds a bounded stretch, no larger than that race, to it; the next reading
after it (the next grant once the window passed, or after any event above) sees it and
blocks as always. The default, 20 ms, keeps a hot re-ACQUIRE loop (a dispatcher taking
turns of a resident replica back to back) off the backend; 0 reads for every grant.
Free bytes (a grant asking for room) are read for every grant whatever the window.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpu_slicer.slicer.census import Root
from gpu_slicer.slicer.effects import (
    AskPark,
    Effect,
    Emit,
    Grant,
    Kill,
    Park,
    Reap,
    Recover,
    Restore,
    SendFault,
)
from gpu_slicer.slicer.model import Workload
from gpu_slicer.slicer.readings import Census
from gpu_slicer.slicer.state import SlicerState

# Events that change nothing about who may be on the GPU ("granted" is judged apart).
_HARMLESS = frozenset({"queued", "released", "gpu-pids"})


@dataclass(frozen=True, slots=True)
class _Kept:
    wid: int
    at: float
    roots: tuple[Root, ...]
    seen: Census


def clean(seen: Census, wid: int, on_gpu: Iterable[Workload]) -> bool:
    """Whether `seen` shows only what workload `wid` may hold: no foreign process, and
    every other workload of the GPU at most at its `parked_max`."""
    if seen.foreign or seen.unattributed:
        return False
    return all(w.wid == wid or seen.of(w.wid) <= w.parked_max for w in on_gpu)


class Reuse:
    """The last clean grant-check reading of each GPU, kept for `window_ms`."""

    def __init__(self, window_ms: float, sm: SlicerState) -> None:
        self.window = window_ms / 1000.0
        self.sm = sm
        self._kept: dict[int, _Kept] = {}

    def get(self, gpu: int, wid: int, roots: list[Root], now: float) -> Census | None:
        """The reading of `gpu` a grant check for `wid` may reuse now, or None."""
        k = self._kept.get(gpu)
        if k is None:
            return None
        if k.wid != wid or now - k.at >= self.window or k.roots != tuple(roots):
            del self._kept[gpu]
            return None
        return k.seen

    def keep(self, gpu: int, wid: int, roots: list[Root], seen: Census, at: float) -> None:
        """Keep `seen`, read at `at` for a grant check of `wid`, if it is clean."""
        if self.window <= 0:
            return
        if clean(seen, wid, (w for w in self.sm.workloads() if w.gpu == gpu)):
            self._kept[gpu] = _Kept(wid, at, tuple(roots), seen)
        else:
            self._kept.pop(gpu, None)

    def forget(self, gpu: int | None = None) -> None:
        """Forget the reading of `gpu` (of every GPU when None)."""
        if gpu is None:
            self._kept.clear()
        else:
            self._kept.pop(gpu, None)

    def performed(self, e: Effect) -> None:
        """The server is performing `e`: forget what it makes stale."""
        if not self._kept:
            return
        match e:
            case Grant():
                self._granted(e.workload)
            case Emit():
                kind = e.body.get("event")
                if kind == "granted":
                    self._granted(str(e.body.get("workload")))
                elif kind not in _HARMLESS:
                    gpu = e.body.get("gpu")
                    self.forget(gpu if isinstance(gpu, int) else None)
            case Park() | Restore() | Recover() | Reap():
                self.forget(e.gpu)
            case Kill():
                w = self.sm.by_wid(e.wid)
                self.forget(w.gpu if w is not None else None)
            case AskPark() | SendFault():
                self._forget_of(e.workload)

    def _granted(self, name: str) -> None:
        w = self.sm.registered.get(name)
        if w is None:
            self.forget()
            return
        k = self._kept.get(w.gpu)
        if k is not None and k.wid != w.wid:
            del self._kept[w.gpu]

    def _forget_of(self, name: str) -> None:
        w = self.sm.registered.get(name)
        self.forget(w.gpu if w is not None else None)
