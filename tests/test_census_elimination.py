"""The census by elimination (`slicer.census.eliminate`) and what it means for grants.

Where slicerd cannot read the backend's pids (a pod; NVML speaks host pids) the GPU's
total is compared with the budgets (`parked_max`) of the workloads held to them; the
excess is charged in full to every suspect, or, with none, is `unattributed` and blocks
every grant whatever `foreign` says. Pure: no process, no socket.
"""

from __future__ import annotations

import pytest

from gpu_slicer.slicer import policy, reuse
from gpu_slicer.slicer.attribution import census_mode
from gpu_slicer.slicer.census import ELIMINATION, Root, eliminate, held_to, take
from gpu_slicer.slicer.model import Workload, WState
from gpu_slicer.slicer.readings import Census

GiB = 1024**3


def parked(wid: int, budget: int) -> Root:
    """A workload the state machine holds to its budget (parked or registered)."""
    return Root(wid, 100 + wid, 1000, True, parked_max=budget)


def suspect(wid: int, budget: int = 0) -> Root:
    """A workload that may hold anything now (the holder, idle, faulted, parking...)."""
    return Root(wid, 100 + wid, 1000, True, parked_max=budget, suspect=True)


@pytest.mark.parametrize(
    ("gpu", "roots", "charged", "unattributed", "pids"),
    [
        # Nothing registered: whatever is on the GPU is nobody's.
        ({}, [], {}, 0, []),
        ({4242: GiB}, [], {}, GiB, [4242]),
        # Only parked workloads, all of it within their budgets together: clean.
        ({7: GiB, 8: GiB}, [parked(1, GiB), parked(2, GiB)], {}, 0, []),
        # ... which holds however the bytes are spread over the host pids.
        ({7: 2 * GiB - 1}, [parked(1, GiB), parked(2, GiB)], {}, 0, []),
        # Over the budgets with no suspect: the excess is unattributed, with every host pid.
        ({9: GiB, 7: 2 * GiB}, [parked(1, GiB), parked(2, GiB)], {}, GiB, [7, 9]),
        # A suspect is charged the whole excess over the others' budgets.
        ({7: 20 * GiB, 8: GiB}, [parked(1, GiB), suspect(2)], {2: 20 * GiB}, 0, []),
        # Within the budgets: a suspect is charged nothing (its park is verified).
        ({7: GiB}, [parked(1, GiB), suspect(2)], {}, 0, []),
        # Two suspects: each could hold all of it, so each is charged all of it.
        ({7: 3 * GiB}, [parked(1, GiB), suspect(2), suspect(3)], {2: 2 * GiB, 3: 2 * GiB}, 0, []),
        # A suspect's own budget does not count towards what may be on the GPU.
        ({7: 3 * GiB}, [parked(1, GiB), suspect(2, 5 * GiB)], {2: 2 * GiB}, 0, []),
        ({7: GiB}, [suspect(2, 5 * GiB)], {2: GiB}, 0, []),
    ],
)
def test_eliminate(
    gpu: dict[int, int],
    roots: list[Root],
    charged: dict[int, int],
    unattributed: int,
    pids: list[int],
) -> None:
    taken = eliminate(gpu, roots)
    assert taken.bytes_by_wid == charged
    assert (taken.unattributed, taken.unattributed_pids) == (unattributed, pids)
    # By elimination nothing is named by pid: no process is foreign or anybody's.
    assert taken.foreign == {} and taken.pids_by_wid == {}


@pytest.mark.parametrize(
    ("asked", "backend_ns", "own_ns", "mode"),
    [
        ("auto", 5, 5, "pids"),  # node mode: NVML's host pids are slicerd's
        ("auto", 4026531836, 4026532999, "elimination"),  # slicerd in a pod
        ("auto", None, 5, "pids"),  # a backend that does not say: as before namespaces
        ("auto", 5, None, "pids"),  # slicerd cannot read its own namespace
        ("pids", 4026531836, 4026532999, "pids"),  # forced: a driver that translates
        ("elimination", 5, 5, "elimination"),  # forced
        ("elimination", None, None, "elimination"),
    ],
)
def test_census_mode(asked: str, backend_ns: int | None, own_ns: int | None, mode: str) -> None:
    got, why = census_mode(asked, backend_ns, own_ns)
    assert got == mode
    assert why  # the log says why
    if mode == "elimination" and asked == "auto":
        assert f"pid:[{backend_ns}]" in why and f"pid:[{own_ns}]" in why


def _w(wid: int, parked_max: int = 0) -> Workload:
    return Workload(wid, f"w{wid}", 0, 100 + wid, 1.0, True, "checkpoint", parked_max, 0, None)


def _unattributed() -> Census:
    return Census(unattributed=3 * GiB, unattributed_pids=[70, 71])


@pytest.mark.parametrize("foreign_blocks", [True, False])
def test_unattributed_memory_blocks_a_grant_even_when_foreign_memory_would_not(
    foreign_blocks: bool,
) -> None:
    block = policy.blockers(
        _unattributed(), 1, [_w(1), _w(2)], need=0, free=None, foreign_blocks=foreign_blocks
    )
    assert block == [{"reason": "unattributed", "bytes": 3 * GiB, "host_pids": "70,71"}]


def test_a_clean_elimination_census_does_not_block() -> None:
    seen = eliminate({7: GiB}, [parked(2, GiB), suspect(1)])
    assert (
        policy.blockers(seen, 1, [_w(1), _w(2, GiB)], need=0, free=None, foreign_blocks=True) == []
    )


def test_a_reading_with_unattributed_memory_is_never_reused_for_a_grant() -> None:
    assert not reuse.clean(_unattributed(), 1, [_w(1), _w(2)])
    assert reuse.clean(Census(), 1, [_w(1), _w(2)])


def test_slicerctl_status_shows_the_pod_number_only_when_a_registrant_is_in_a_pod() -> None:
    from gpu_slicer.slicer.cli import workload_table

    host = {"name": "t", "gpu": 0, "state": "parked", "pids": [41822], "ns_pid": None}
    assert "POD_PID" not in workload_table([host])
    pod = {**host, "name": "p", "pids": [41900], "ns_pid": 3}
    lines = workload_table([host, pod]).splitlines()
    assert "POD_PID" in lines[0].split()
    col = lines[0].split().index("POD_PID")
    assert lines[2].split()[col] == "3" and lines[2].split()[4] == "41900"


# ---- every state a workload can be in, accounted for by every census ---------------------


def test_the_elimination_table_names_every_state() -> None:
    # A state without a row would be nobody's memory by elimination: a frozen workload
    # once was (fit-aware turns under census = elimination wedged the GPU).
    assert set(ELIMINATION) == set(WState)


def _in(state: WState, *, parked_max: int = 0, checkpointed: bool = False) -> Workload:
    w = _w(1, parked_max)
    w.state = state
    if checkpointed:
        w.parked_procs = ((101, 1000),)
    if state is WState.FROZEN:
        w.frozen_procs, w.frozen_bytes = ((101, 1000),), 10 * GiB
    return w


# (the workload, what it may hold on the device in that state, (suspect, budget))
HOLDS: list[tuple[Workload, int, tuple[bool, int]]] = [
    (_in(WState.REGISTERED, parked_max=GiB), GiB, (False, GiB)),
    (_in(WState.ACTIVE), 10 * GiB, (True, 0)),
    (_in(WState.IDLE), 10 * GiB, (True, 0)),
    (_in(WState.PARKING), 10 * GiB, (True, 0)),
    (_in(WState.PARKED, parked_max=GiB), GiB, (False, GiB)),  # slept (cooperative)
    (_in(WState.PARKED, parked_max=GiB, checkpointed=True), 0, (False, 0)),  # or residue
    (_in(WState.RESTORING), 10 * GiB, (True, 0)),
    (_in(WState.FAULTED), 10 * GiB, (True, 0)),
    (_in(WState.FROZEN), 10 * GiB, (False, 10 * GiB)),  # its own, as the freeze measured
]


@pytest.mark.parametrize(("w", "holds", "row"), HOLDS, ids=lambda v: getattr(v, "state", None))
@pytest.mark.parametrize("blind", [False, True], ids=["pids", "elimination"])
def test_what_each_state_may_hold_is_its_own_under_every_census(
    w: Workload, holds: int, row: tuple[bool, int], blind: bool
) -> None:
    assert held_to(w) == row
    suspect, budget = row
    root = Root(w.wid, w.pid, int(w.start_time), w.tree, budget, suspect)
    seen = {w.pid: holds} if holds else {}
    if blind:
        taken = eliminate(seen, [root])
    else:
        taken = take(seen, [root], lambda pid: iter([(pid, int(w.start_time))]))
    assert taken.unattributed == 0 and taken.foreign == {}
    # Its own grant is not blocked by what it holds; another's is only by a workload that
    # must be parked first (resident, above its parked_max), named, never as nobody's.
    assert policy.blockers(taken, w.wid, [w], need=0, free=None, foreign_blocks=True) == []
    block = policy.blockers(taken, 2, [w], need=0, free=None, foreign_blocks=True)
    parked_first = suspect and holds > w.parked_max
    assert block == ([{"workload": w.name, "pid": w.pid, "bytes": holds}] if parked_first else [])


@pytest.mark.parametrize(
    ("w", "extra"),
    [
        (_in(WState.FROZEN), GiB),
        (_in(WState.PARKED, checkpointed=True), GiB),
        (_in(WState.REGISTERED), GiB),
    ],
    ids=["frozen-grew", "checkpointed", "registered"],
)
def test_by_elimination_memory_beyond_a_budget_blocks(w: Workload, extra: int) -> None:
    _suspect, budget = held_to(w)
    root = Root(w.wid, w.pid, int(w.start_time), w.tree, budget, False)
    taken = eliminate({w.pid: budget + extra}, [root])
    assert taken.unattributed == extra
    block = policy.blockers(taken, 2, [w], need=0, free=None, foreign_blocks=False)
    assert block and block[0]["reason"] == "unattributed"
