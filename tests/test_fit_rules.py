"""The fit-aware rules (`slicer.fit`), pure: who may be frozen, and what the head needs."""

from __future__ import annotations

import pytest

from gpu_slicer.slicer.fit import freeze_need, known_need, lockable
from gpu_slicer.slicer.model import Gpu, Waiter, Workload, WState
from gpu_slicer.slicer.records import Limits

GIB = 1024**3
ON = Limits(fit_aware=True, fit_headroom=GIB)


def wl(wid: int, state: WState, park: str = "checkpoint", fallback: str = "none") -> Workload:
    w = Workload(wid, f"w{wid}", 0, 100 + wid, 0.0, True, park, 0, 0, 1, fallback=fallback)
    w.state = state
    return w


def gpu_with_head(head: Workload) -> Gpu:
    gpu = Gpu(0, "GPU-0")
    gpu.queue[9] = Waiter(conn=9, workload=head, since=0.0)
    gpu.waiting[head.wid] = 1
    return gpu


@pytest.mark.parametrize(
    ("park", "fallback", "expected"),
    [
        ("checkpoint", "none", True),
        ("cooperative", "checkpoint", True),
        ("cooperative", "residue", True),
        ("cooperative", "none", False),  # slicerd may not lock it
    ],
)
def test_lockable(park: str, fallback: str, expected: bool) -> None:
    assert lockable(wl(1, WState.IDLE, park, fallback)) is expected


def test_known_need() -> None:
    parked = wl(2, WState.PARKED)
    parked.parked_procs, parked.parked_bytes = ((202, 1),), 30 * GIB
    assert known_need(parked) == 30 * GIB
    assert known_need(wl(3, WState.PARKED)) is None  # parked itself: its wake is unknown
    assert known_need(wl(4, WState.REGISTERED)) is None  # never ran
    for s in (WState.FROZEN, WState.IDLE, WState.ACTIVE):
        assert known_need(wl(5, s)) == 0  # its memory is on the GPU already


def test_freeze_need_adds_the_headroom_and_refuses_what_must_park() -> None:
    out, head = wl(1, WState.IDLE), wl(2, WState.FROZEN)
    gpu = gpu_with_head(head)
    assert freeze_need(ON, gpu, out) == GIB
    assert freeze_need(Limits(), gpu, out) is None  # fit_aware off
    out.must_park = True  # RELEASE park=now, a preemption, its registrant's close
    assert freeze_need(ON, gpu, out) is None
    out.must_park, out.holder_died = False, True
    assert freeze_need(ON, gpu, out) is None
    out.holder_died = False
    assert freeze_need(ON, gpu_with_head(wl(3, WState.REGISTERED)), out) is None
    assert freeze_need(ON, gpu_with_head(out), out) is None  # the head itself
    coop = wl(4, WState.IDLE, "cooperative", "none")
    assert freeze_need(ON, gpu, coop) is None
