"""The dispatcher's phase table (dispatcher.model), table-tested: every legal change is
taken and published, every other is refused with the phase left as it was; only on the
way out of a turn is a change the table misses taken anyway (the turn must end)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.errors import DispatchError, IllegalTransition
from gpu_slicer.dispatcher.model import TRANSITIONS, Phase, TurnConfig, check_transition
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from gpu_slicer.slicer.client import Turn
from tests.test_dispatcher_vllm import FakeVllm

# One turn as the loop walks it (module docstring of dispatcher.model), and the detours.
WALKS = [
    ["acquiring", "waking", "serving", "sleeping", "releasing", "idle"],
    ["acquiring", "recovering", "waking", "loading", "serving", "grace", "sleeping"],
    ["acquiring", "waking", "loading", "loading", "serving", "loading", "serving"],
    ["acquiring", "acquiring", "backoff", "acquiring", "idle", "idle", "backoff", "idle"],
    ["acquiring", "sleeping", "releasing", "idle", "backoff"],  # ended before the wake
    ["acquiring", "preparing", "waking", "serving"],  # an early start, then granted
    ["acquiring", "preparing", "acquiring", "preparing", "backoff"],  # not granted
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
        "idle", "backoff", "acquiring", "preparing", "recovering", "waking", "loading",
        "serving", "grace", "sleeping", "releasing",
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


class FakeSlicer:
    """The slicerd connection as the turn loop uses it: every ACQUIRE is granted at once
    (turns 1, 2, ...), every RELEASE is recorded, no event ever arrives."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.granted = 0
        self.released: list[int] = []
        self.used: list[bool] = []  # each RELEASE's used=

    async def connect(self) -> Any:
        return self

    async def acquire(self, workload: str, wait: float | None = None) -> Turn:
        self.granted += 1
        return Turn(workload, self.granted, False, 0)

    async def release(self, turn: Turn, park: str = "lazy", used: bool = True) -> dict[str, str]:
        self.released.append(turn.turn)
        self.used.append(used)
        return {}

    async def next_message(self, timeout: float | None = None) -> Any:
        await trio.sleep_forever()

    async def aclose(self) -> None:
        pass


def store_and_r1(tmp_path: Path) -> tuple[Store, Path]:
    """A dispatcher store under ``tmp_path`` and a checkpoint directory for revision r1."""
    ckpt = tmp_path / "ckpt" / "r1"
    ckpt.mkdir(parents=True)
    (ckpt / "revision.txt").write_text("r1")
    return Store(tmp_path / "state", "pool-a"), ckpt


# Each change the end of a turn takes (a turn served to its end goes from serving).
WAY_OUT = [
    (Phase.SERVING, Phase.SLEEPING), (Phase.SLEEPING, Phase.RELEASING),
    (Phase.RELEASING, Phase.IDLE),
]  # fmt: skip


@pytest.mark.parametrize("old,new", WAY_OUT)
async def test_a_table_miss_at_a_turns_end_still_sleeps_releases_and_the_loop_lives(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    old: Phase,
    new: Phase,
) -> None:
    """The table (wrongly) lacks a change the end of a turn takes: each turn still puts
    vLLM to sleep and RELEASEs, the miss is logged at error and published, and the loop
    serves the next turn."""
    monkeypatch.setitem(TRANSITIONS, old, TRANSITIONS[old] - {new})
    fake, slicer = FakeVllm(), FakeSlicer()
    store, ckpt = store_and_r1(tmp_path)
    got: list[dict[str, Any]] = []
    try:
        async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
            loop = TurnLoop(store, r, TurnConfig(workload="v"), connect=slicer.connect)
            loop.publish("r1", str(ckpt))
            with trio.fail_after(20), loop.subscribe() as sub:
                async with trio.open_nursery() as nursery:
                    await nursery.start(loop.run)
                    for _ in range(2):
                        p = await loop.accept("completion", {"prompt": [1], "max_tokens": 2})
                        async for e in sub:  # to the turn's last change, out of releasing
                            got.append(e)
                            if e["event"] == "phase" and e["previous"] == "releasing":
                                break
                        assert loop.store.get(p.id).status == "done"
                    nursery.cancel_scope.cancel()
    finally:
        store.close()
    assert slicer.released == [1, 2]
    assert fake.calls.count("POST /sleep") == 2
    slept = [e for e in got if e["event"] == "slept"]
    assert [e["ok"] for e in slept] == [True, True]
    misses = [e for e in got if e["event"] == "transition_error"]
    assert [(e["previous"], e["phase"]) for e in misses] == [(old.value, new.value)] * 2
    assert all(f"from {old.value} to {new.value}" in e["error"] for e in misses)
    changes = [(e["previous"], e["phase"]) for e in got if e["event"] == "phase"]
    assert changes.count((old.value, new.value)) == 2  # taken all the same, and published
    errors = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 2 and all("cannot go from" in rec.getMessage() for rec in errors)
    assert loop.phase == Phase.IDLE and loop.counters.turns == 2
    assert loop.counters.turn_errors == 0
