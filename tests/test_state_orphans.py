"""What a workload started outlives it: survivors are its own, then killed.

A `tree=1` workload's processes that hold GPU memory are remembered by the census
(`census.take` returns the chain from each GPU process up to its root; `Attribution`
keeps it). A process started in a session of its own (out of reach of the launcher's
keeper) outlives a SIGKILLed registrant, is reparented out of the tree, and is still
attributed to the workload by that memory, so its memory never turns foreign. The
reaper reports those `survivors` of an orphan whose registered process is dead; the
state machine says `orphaned`, kills them `fault_kill_after` later (`orphan-killed`:
`orphan of W killed after N s`), again if a kill fails, and forgets the workload once they
are gone. Pure: no processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gpu_slicer.slicer import census, policy
from gpu_slicer.slicer.census import Root
from gpu_slicer.slicer.effects import Emit, Kill
from tests.test_state import D1, KILL_AFTER, RA, Driver, fresh, setup

# ---- the census remembers and attributes -------------------------------------------------

ROOT = (100, 1)  # a launcher (tree=1), workload 7
API, CORE = (200, 2), (300, 3)  # its vLLM: the API server and the engine core (GPU)
INIT = (1, 0)


def chains(parents: dict[tuple[int, int], tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """pid -> its ancestry (itself first) under the parent map `parents`."""
    out = {}
    for ident in parents:
        chain = [ident]
        while chain[-1] in parents:
            chain.append(parents[chain[-1]])
        out[ident[0]] = chain
    return out


def ancestry_of(
    parents: dict[tuple[int, int], tuple[int, int]],
) -> Callable[[int], Iterator[tuple[int, int]]]:
    table = chains(parents)

    def ancestry(pid: int) -> Iterator[tuple[int, int]]:
        yield from table[pid]

    return ancestry


def test_the_chain_to_a_tree_root_is_returned_as_its_members() -> None:
    tree = ancestry_of({CORE: API, API: ROOT, ROOT: INIT})
    out = census.take({CORE[0]: 5}, [Root(7, *ROOT, tree=True)], tree)
    assert out.of(7) == 5 and out.members == {7: [CORE, API]}
    # A tree=0 root keeps nothing (only its own process is its own).
    out = census.take({ROOT[0]: 5}, [Root(7, *ROOT, tree=False)], ancestry_of({ROOT: INIT}))
    assert out.of(7) == 5 and out.members == {}


def test_a_reparented_member_stays_its_workloads_and_others_stay_foreign() -> None:
    orphaned = ancestry_of({CORE: INIT, (400, 4): INIT})  # the root died: reparented
    roots = [Root(7, *ROOT, tree=True)]
    before = census.take({CORE[0]: 5, 400: 1}, roots, orphaned)
    assert before.foreign == {CORE[0]: 5, 400: 1}  # unknown: foreign, as before
    out = census.take({CORE[0]: 5, 400: 1}, roots, orphaned, members={CORE: 7})
    assert out.of(7) == 5 and out.pids_by_wid == {7: [CORE[0]]} and out.foreign == {400: 1}
    # A member whose workload is no root (forgotten) or not a tree root is nobody's.
    assert census.take({CORE[0]: 5}, [], orphaned, members={CORE: 7}).foreign == {CORE[0]: 5}
    flat = [Root(7, *ROOT, tree=False)]
    assert census.take({CORE[0]: 5}, flat, orphaned, members={CORE: 7}).of(7) == 0
    # A pid reused by another process (another start time) is not the member.
    reused = ancestry_of({(CORE[0], 99): INIT})
    assert census.take({CORE[0]: 5}, roots, reused, members={CORE: 7}).of(7) == 0


def test_a_registered_process_is_its_own_before_any_member() -> None:
    # The engine core registered itself (workload 8) under a launcher remembered for 7.
    tree = ancestry_of({CORE: API, API: ROOT, ROOT: INIT})
    roots = [Root(7, *ROOT, tree=True), Root(8, *CORE, tree=False)]
    out = census.take({CORE[0]: 5}, roots, tree, members={CORE: 7})
    assert out.of(8) == 5 and out.of(7) == 0


def test_another_workloads_tree0_root_is_never_in_a_chain() -> None:
    # X registered itself (tree=0, workload 9) under a member S of 7; X's GPU child Y is
    # 7's by ancestry (X's tree=0 claims X alone), but X never becomes 7's member.
    s, x, y = (500, 5), (600, 6), (700, 7)
    tree = ancestry_of({y: x, x: s, s: INIT})
    roots = [Root(7, *ROOT, tree=True), Root(9, *x, tree=False)]
    out = census.take({y[0]: 5, x[0]: 1}, roots, tree, members={s: 7})
    assert out.of(7) == 5 and out.of(9) == 1 and out.members == {7: [y]}


# ---- the state machine kills an orphan's survivors ----------------------------------------


@pytest.fixture
def d() -> Driver:
    drv = Driver(fresh())
    setup(drv)
    return drv


def _parked_orphan(d: Driver) -> int:
    d.acquire(D1, "a")
    d.release(D1, "a", park_now=True)
    d.park_done()
    d.close(RA)  # its launcher is SIGKILLed: the registration ends
    return d.wid("a")


def test_an_orphans_survivors_are_killed_after_fault_kill_after_then_it_is_forgotten(
    d: Driver,
) -> None:
    wid = _parked_orphan(d)
    fx, done = d.sm.memory_report(wid, False, 0, d.now, survivors=(41, 42))
    assert not done and [e.body["event"] for e in fx if isinstance(e, Emit)] == ["orphaned"]
    assert fx[0].body["pids"] == [41, 42] and fx[0].body["kill_after"] == KILL_AFTER
    assert d.sm.memory_report(wid, False, 0, d.now + 1, survivors=(41, 42)) == ([], False)
    fx, done = d.sm.memory_report(wid, False, 0, d.now + KILL_AFTER, survivors=(41, 42))
    assert not done and Kill(wid, "a", (41, 42)) in fx
    (killed,) = [e.body for e in fx if isinstance(e, Emit)]
    assert killed["event"] == "orphan-killed" and killed["after"] == KILL_AFTER
    assert killed["text"] == f"orphan of a killed after {KILL_AFTER:g} s"
    # Killed once; forgotten only once they are gone.
    later = d.now + KILL_AFTER + 1
    assert d.sm.memory_report(wid, False, 0, later, survivors=(41,)) == ([], False)
    # One that outlives the kill by KILL_RETRY_S (it failed: EPERM) is killed again,
    # without a second event.
    again = d.now + KILL_AFTER + policy.KILL_RETRY_S
    fx, done = d.sm.memory_report(wid, False, 0, again, survivors=(41,))
    assert not done and fx == [Kill(wid, "a", (41,))], fx
    fx, done = d.sm.memory_report(wid, False, 0, again + 1)
    assert done and d.sm.by_wid(wid) is None
    assert [e.body["event"] for e in fx if isinstance(e, Emit)] == ["forgotten"]


def test_survivors_of_a_live_root_are_not_killed(d: Driver) -> None:
    wid = _parked_orphan(d)  # the registrant closed; the registered process lives on
    for t in (0, KILL_AFTER, 2 * KILL_AFTER):
        assert d.sm.memory_report(wid, True, 0, d.now + t, survivors=(41,)) == ([], False)


def test_an_orphan_with_no_survivors_is_forgotten_at_once(d: Driver) -> None:
    wid = _parked_orphan(d)
    _fx, done = d.sm.memory_report(wid, False, 0, d.now)
    assert done and d.sm.by_wid(wid) is None
