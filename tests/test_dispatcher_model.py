"""The dispatcher's phase table (dispatcher.model), table-tested: every legal change is
taken and published, every other is refused with the phase left as it was."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from gpu_slicer.dispatcher.errors import DispatchError, IllegalTransition
from gpu_slicer.dispatcher.model import TRANSITIONS, Phase, TurnConfig, check_transition
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica

# One turn as the loop walks it (module docstring of dispatcher.model), and the detours.
WALKS = [
    ["acquiring", "waking", "serving", "sleeping", "releasing", "idle"],
    ["acquiring", "recovering", "waking", "loading", "serving", "grace", "sleeping"],
    ["acquiring", "waking", "loading", "loading", "serving", "loading", "serving"],
    ["acquiring", "acquiring", "backoff", "acquiring", "idle", "idle", "backoff", "idle"],
    ["acquiring", "sleeping", "releasing", "idle", "backoff"],  # ended before the wake
]


@asynccontextmanager
async def _loop(tmp_path: Path) -> AsyncIterator[TurnLoop]:
    """A turn loop that is never run (the tests move its phase themselves)."""
    store = Store(tmp_path / "state", "pool-a")
    try:
        async with Replica("http://127.0.0.1:9") as replica:
            yield TurnLoop(store, replica, TurnConfig(workload="v"))
    finally:
        store.close()


def test_the_phases_are_the_states_status_shows() -> None:
    assert [p.value for p in Phase] == [
        "idle", "backoff", "acquiring", "recovering", "waking", "loading", "serving", "grace",
        "sleeping", "releasing",
    ]  # fmt: skip
    assert set(TRANSITIONS) == set(Phase)


@pytest.mark.parametrize("old,new", list(itertools.product(Phase, Phase)))
def test_check_transition_follows_the_table(old: Phase, new: Phase) -> None:
    if new in TRANSITIONS[old]:
        assert check_transition(old, new) is (new is not old)
    else:
        with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
            check_transition(old, new)


def test_every_phase_of_a_held_turn_can_end_it() -> None:
    """Whatever ends a granted turn (an error, cancellation), sleep and release follow."""
    for p in (Phase.ACQUIRING, Phase.RECOVERING, Phase.WAKING, Phase.LOADING, Phase.SERVING,
              Phase.GRACE):  # fmt: skip
        assert Phase.SLEEPING in TRANSITIONS[p]
    assert TRANSITIONS[Phase.SLEEPING] == {Phase.RELEASING}
    assert TRANSITIONS[Phase.RELEASING] == {Phase.IDLE}


@pytest.mark.parametrize("walk", WALKS)
async def test_the_loop_publishes_each_change_once(tmp_path: Path, walk: list[str]) -> None:
    async with _loop(tmp_path) as loop:
        sub = loop.subscribe()
        for name in walk:
            loop._enter(Phase(name))
        assert loop.phase == Phase(walk[-1])
        assert loop.status()["state"] == walk[-1]
        got = [sub._buf.popleft() for _ in range(len(sub._buf))]
    assert got[0]["event"] == "subscribed" and got[0]["phase"] == "idle"
    changes = [(e["previous"], e["phase"]) for e in got[1:]]
    expected = [(a, b) for a, b in itertools.pairwise(["idle", *walk]) if a != b]
    assert changes == expected
    assert [e["seq"] for e in got[1:]] == list(range(1, len(expected) + 1))


async def test_an_illegal_change_leaves_the_loop_as_it_was(tmp_path: Path) -> None:
    async with _loop(tmp_path) as loop:
        sub = loop.subscribe()
        loop._enter(Phase.ACQUIRING)
        for bad in (Phase.SERVING, Phase.RELEASING, Phase.GRACE, Phase.LOADING):
            with pytest.raises(IllegalTransition) as info:
                loop._enter(bad)
            assert isinstance(info.value, DispatchError)
            assert loop.phase == Phase.ACQUIRING
        assert [e["event"] for e in sub._buf] == ["subscribed", "phase"]
