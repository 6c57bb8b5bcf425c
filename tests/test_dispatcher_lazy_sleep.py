"""`slicer-dispatch --lazy-sleep` (default): a turn nobody else waited on leaves vLLM awake.

With nobody else asking for the GPU, a turn that runs out of work RELEASEs without a
vLLM sleep, and the next turn finds the replica awake (`GET /is_sleeping`) and skips the
wake: five sequential requests cost one wake, not five wake/sleep cycles. When another
workload asks for the GPU, slicerd parks the idle replica through its launcher (PARK, the
launcher sleeps vLLM, PARKED, verified; cuda-checkpoint as the fallback), and the next
turn reads which sleep it found (`GET /metrics`): level 1 is a plain wake of the kept
weights, level 2 the level-2 wake order with a whole load. A turn that saw WAITING still
sleeps at its end, as before. The processes are the real ones of tests/test_dispatcher.py.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.dispatcher.events import follow_events
from gpu_slicer.dispatcher.vllm import parse_sleep_state
from tests.harness import Stack, event_index, events_until, running_stack, workload
from tests.procs import Proc, free_port, spawn
from tests.test_dispatcher import dispatcher, publish, replica_argv, status, stop, trainer
from tests.test_dispatcher_sleep_levels import L2_WAKE, assert_real, released, stub_posts

pytestmark = pytest.mark.integration


@asynccontextmanager
async def launched(stack: Stack, *launcher: str) -> AsyncIterator[tuple[Proc, str]]:
    """tests/test_dispatcher.py's `replica` (cooperative, asks, falls back to checkpoint),
    with `launcher` flags given to slicer-launch itself (e.g. its --sleep-level)."""
    port = free_port()
    argv = replica_argv(stack, port, "cooperative")
    cut = argv.index("--")
    argv[cut:cut] = ["--park-fallback", "checkpoint", *launcher]
    async with spawn(stack, "launcher", argv) as lw:
        await lw.line(lambda s: "]: ready" in s)
        yield lw, f"http://127.0.0.1:{port}"
        lw.proc.send_signal(signal.SIGTERM)
        assert await lw.wait() == 0, lw.output()


async def one_request(d: Proc, http: httpx.AsyncClient, prompt: str) -> None:
    """One direct request of r1 (its own turn, which ends idle); the text is r1's, whole."""
    mark = len(d.lines)
    body = {"prompt": prompt, "max_tokens": 4, "revision": "r1"}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert_real(r.json(), prompt, "r1")
    await released(d, mark)


def count(calls: list[str], call: str) -> int:
    return sum(c == call for c in calls)


def granted_trainer(e: dict[str, Any]) -> bool:
    return bool(e["event"] == "granted" and e["workload"] == "trainer")


def test_the_sleep_state_is_read_by_name_and_label() -> None:
    labels = 'engine="0",model_name="m"'

    def text(awake: float, l1: float, l2: float) -> str:
        rows = [("awake", awake), ("weights_offloaded", l1), ("discard_all", l2)]
        return "# TYPE vllm:engine_sleep_state gauge\n" + "".join(
            f'vllm:engine_sleep_state{{{labels},sleep_state="{k}"}} {v}\n' for k, v in rows
        )

    assert parse_sleep_state(text(1.0, 0.0, 0.0)) == "awake"
    assert parse_sleep_state(text(0.0, 1.0, 0.0)) == "weights_offloaded"
    assert parse_sleep_state(text(0.0, 0.0, 1.0)) == "discard_all"
    assert parse_sleep_state(text(0.0, 0.0, 0.0)) == "paused"  # a pause: memory untouched
    assert parse_sleep_state(text(0.0, 1.0, 1.0)) is None  # contradicts itself
    assert parse_sleep_state("vllm:num_requests_running 0.0\n") is None  # no such metric


@pytest.mark.parametrize("lazy", [True, False])
async def test_sequential_requests_with_nobody_else_wake_once_and_never_sleep(lazy: bool) -> None:
    with trio.fail_after(90):
        flags = () if lazy else ("--no-lazy-sleep",)
        async with (
            running_stack() as stack,
            launched(stack) as (lw, url),
            dispatcher(stack, url, *flags) as (d, http),
        ):
            await publish(stack, http, "r1")
            smark = len(lw.lines)  # after the launcher's boot sleep
            for k in range(5):
                await one_request(d, http, f"request {k}")
            # the fifth request's own call, or its turn's sleep, is the last the stub logs
            calls = await stub_posts(lw, smark, "/v1/completions" if lazy else "/sleep", 5)
            print(f"stub POSTs of five requests (lazy={lazy}): {calls}")
            wakes, sleeps = (
                count(calls, "POST /wake_up 200"),
                count(calls, "POST /sleep?level=1&mode=abort 200"),
            )
            assert (wakes, sleeps) == ((1, 0) if lazy else (5, 5)), calls
            assert count(calls, "POST /collective_rpc 200") == 1, calls  # one load of r1
            assert count(calls, "POST /v1/completions 200") == 5, calls
            left = sum("left awake (nobody waiting)" in s for s in d.lines)
            assert left == (5 if lazy else 0), d.output()
            st = await status(http)
            c = st["counters"]
            assert (c["turns"], c["loads"]) == (5, 1), c
            assert (c["lazy_releases"], c["wakes_skipped"]) == ((5, 4) if lazy else (0, 0)), c
            assert c["sleeps_level1"] + c["sleeps_level2"] == (0 if lazy else 5), c
            assert st["lazy_sleep"] is lazy and st["state"] == "idle", st
            v = workload(await stack.status(), "v")
            assert v is not None and v["state"] == "idle", v  # RELEASEd resident, either way
            await stop(d)
            assert stack.overlaps() == 0


# The second of two turns nobody waited on, as the event stream tells it: no wake (the
# replica was left awake), no load, no sleep.
LAZY_TURN = [
    ("phase", "acquiring"), ("granted", None), ("phase", "waking"), ("woke", None),
    ("phase", "serving"), ("serving", None), ("committed", None),
    ("phase", "releasing"), ("released", None), ("phase", "idle"),
]  # fmt: skip


async def test_a_lazy_turn_as_the_event_stream_tells_it() -> None:
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            launched(stack) as (_, url),
            dispatcher(stack, url) as (d, http),
        ):
            events: list[dict[str, Any]] = []
            idle_twice = trio.Event()

            def on_event(e: dict[str, Any]) -> None:
                events.append(e)
                ends = [
                    x for x in events if (x["event"], x.get("previous")) == ("phase", "releasing")
                ]
                if len(ends) == 2:
                    idle_twice.set()

            async with trio.open_nursery() as nursery:
                await nursery.start(follow_events, str(http.base_url), on_event)
                await publish(stack, http, "r1")
                await one_request(d, http, "first")
                await one_request(d, http, "second")
                await idle_twice.wait()
                await stop(d)
            grants = [i for i, e in enumerate(events) if e["event"] == "granted"]
            start = grants[1] - 1  # its `phase acquiring`
            second = events[start:]
            kinds = [(e["event"], e.get("phase")) for e in second]
            assert kinds[: len(LAZY_TURN)] == LAZY_TURN, second
            by = {e["event"]: e for e in second}
            assert by["woke"]["skipped"] is True, by["woke"]
            first = [e for e in events[:start] if e["event"] == "released"]
            assert [e["lazy"] for e in first] == [True], first
            assert by["released"]["lazy"] is True and by["released"]["reason"] == "idle"
            assert stack.overlaps() == 0


@pytest.mark.parametrize("level", [1, 2])
async def test_a_trainer_asking_gets_the_awake_replica_slept_by_its_launcher(level: int) -> None:
    """After a lazy release the trainer ACQUIREs: slicerd asks the launcher (PARK), which
    sleeps vLLM at its --sleep-level and answers; verified, the trainer is granted. The
    next request finds vLLM asleep and wakes it by what the launcher's sleep left: level
    1 a plain wake of the kept weights (no load), level 2 the level-2 order with a load."""
    with trio.fail_after(120):
        async with (
            running_stack() as stack,
            launched(stack, "--sleep-level", str(level)) as (lw, url),
            dispatcher(stack, url) as (d, http),
        ):
            await publish(stack, http, "r1")
            await one_request(d, http, "warm up")
            assert any("left awake (nobody waiting)" in s for s in d.lines), d.output()
            await stub_posts(lw, 0, "/v1/completions")  # logged after it was answered
            smark = len(lw.lines)
            async with await stack.client() as watch:
                await watch.request(proto.Watch())
                seen: list[dict[str, Any]] = []
                async with spawn(stack, "trainer", trainer(stack, 1, 0.1)) as tr:
                    await events_until(watch, granted_trainer, seen)
                    assert await tr.wait() == 0, tr.output()
            # Asked, answered, verified parked (by its own sleep: no checkpoint), granted.
            assert event_index(seen, "park-asked", "v") < event_index(seen, "park-answered", "v")
            assert seen[event_index(seen, "park-answered", "v")]["ok"] is True, seen
            # The launcher's line names the real reason: its holder is alive, it released.
            why = lw.lines[await lw.line(lambda s: "slicerd asks to park v" in s)]
            assert "its holder released its turn with it still on the GPU" in why, why
            parked = seen[event_index(seen, "parked", "v")]
            assert parked["how"] == "cooperative", parked
            assert event_index(seen, "park-answered", "v") < event_index(seen, "parked", "v")
            assert event_index(seen, "parked", "v") < event_index(seen, "granted", "trainer")
            assert not any(e["event"] in ("fault", "park-fallback") for e in seen), seen
            assert await stub_posts(lw, smark, "/sleep") == [
                f"POST /sleep?level={level}&mode=abort 200"
            ]
            assert f"parked on slicerd's request: slept (level {level})" in lw.output()
            # Both logs say why it was asked: its turn ended (lazily) with it on the GPU;
            # its holder is alive.
            assert "asks to park v (turn 2): its holder released its turn with it" in lw.output()
            assert "holder is gone" not in lw.output()
            said = "asking the registrant of v to park it: its holder released its turn"
            assert stack.log is not None and said in stack.log.read_text()
            before = (await status(http))["counters"]
            smark = len(lw.lines)
            await one_request(d, http, "after the trainer")
            got = await stub_posts(lw, smark, "/v1/completions")
            calls = [c for c in got if c != "POST /finish_weight_update 500"]
            print(f"the turn after the launcher's level-{level} sleep (stub POSTs): {calls}")
            if level == 1:
                assert calls == ["POST /wake_up 200", "POST /v1/completions 200"], calls
            else:
                assert calls == [*L2_WAKE, "POST /v1/completions 200"], calls
            c = (await status(http))["counters"]
            assert c["loads"] == before["loads"] + (level - 1), c
            assert c["wakes_skipped"] == before["wakes_skipped"], c
            assert c["lazy_releases"] == before["lazy_releases"] + 1, c  # nobody waits again
            await stop(d)
            v = workload(await stack.status(), "v")
            assert v is not None and v["faults"] == 0, v
            assert stack.overlaps() == 0


async def test_a_launcher_that_cannot_sleep_it_in_time_falls_back_to_checkpoint() -> None:
    """The launcher's sleep hangs past slicerd's window: slicerd checkpoints the awake
    replica (its fallback) and grants the trainer; the next turn's grant restores it,
    the dispatcher finds it awake (no wake) and serves r1's text, whole."""
    with trio.fail_after(120):
        async with (
            running_stack("--registrant-park-timeout", "1") as stack,
            launched(stack) as (_, url),
            dispatcher(stack, url) as (d, http),
            httpx.AsyncClient(base_url=url, timeout=10) as fault,
        ):
            await publish(stack, http, "r1")
            await one_request(d, http, "warm up")
            await fault.post("/_stub/fault", json={"hang_sleep": True})
            async with await stack.client() as watch:
                await watch.request(proto.Watch())
                seen: list[dict[str, Any]] = []
                async with spawn(stack, "trainer", trainer(stack, 1, 0.1)) as tr:
                    await events_until(watch, granted_trainer, seen)
                    assert await tr.wait() == 0, tr.output()
            assert event_index(seen, "park-asked", "v") < event_index(seen, "park-fallback", "v")
            parked = seen[event_index(seen, "parked", "v")]
            assert parked["how"] == "checkpoint", parked
            assert event_index(seen, "parked", "v") < event_index(seen, "granted", "trainer")
            assert not any(e["event"] == "fault" for e in seen), seen
            v = workload(await stack.status(), "v")
            assert v is not None and v["state"] == "parked" and v["parked_pids"], v
            before = (await status(http))["counters"]
            mark = len(d.lines)
            await one_request(d, http, "after the checkpoint")
            assert any("restored=1" in s for s in d.lines[mark:]), d.output()
            c = (await status(http))["counters"]
            assert c["wakes_skipped"] == before["wakes_skipped"] + 1, c
            assert c["loads"] == before["loads"], c
            await fault.post("/_stub/fault", json={"hang_sleep": False})
            await stop(d)
            v = workload(await stack.status(), "v")
            assert v is not None and v["faults"] == 0, v
            assert stack.overlaps() == 0


async def test_a_turn_that_saw_waiting_still_sleeps_at_its_end() -> None:
    """With a trainer alternating, every turn sees WAITING: each ends with a sleep (the
    waiter never waits on a launcher's park), lazy or not."""
    with trio.fail_after(120):
        async with running_stack() as stack, launched(stack) as (lw, url):
            async with (
                dispatcher(stack, url) as (d, http),
                httpx.AsyncClient(base_url=url, timeout=10) as fault,
                spawn(stack, "trainer", trainer(stack, 1000, 0.05)) as tr,
            ):
                await publish(stack, http, "r1")
                for k in range(3):
                    mark, smark = len(d.lines), len(lw.lines)
                    # The request is held in vLLM until the trainer is seen waiting.
                    await fault.post("/_stub/fault", json={"hang_requests": True})
                    prompt = f"turn {k}"
                    r = await http.post("/v1/samples", json={"prompt": prompt, "max_tokens": 4})
                    assert r.status_code == 202, r.text
                    await d.line(lambda s: ": WAITING (" in s, mark)
                    await fault.post("/_stub/fault", json={"hang_requests": False})
                    await released(d, mark)
                    calls = await stub_posts(lw, smark, "/sleep")
                    assert calls[-1] == "POST /sleep?level=1&mode=abort 200", calls
                    assert not any("left awake" in s for s in d.lines[mark:]), d.output()
                c = (await status(http))["counters"]
                assert c["lazy_releases"] == 0 and c["sleeps_level1"] == c["turns"] == 3, c
                await stop(d)
                assert tr.proc.returncode is None  # the trainer took turns in between
            assert not any("asks to park" in s for s in lw.lines), lw.output()
            assert stack.overlaps() == 0
