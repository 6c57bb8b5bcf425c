"""`slicer-dispatch --sleep-level auto|1|2`: vLLM's sleep level chosen per turn.

Level 1 copies the weights to host RAM and back; level 2 drops them, and the next wake
must go ``/wake_up?tags=weights``, a whole load, ``/wake_up?tags=kv_cache``,
``/reset_prefix_cache`` before anything is sent (without the load the stub, like vLLM,
serves garbage: ``RANDOM_WEIGHTS``). The integration tests run the real processes of
tests/test_dispatcher.py (slicerd on the fake GPU, the vLLM stub under the launcher, the
dispatcher) and read the order of the stub's calls from its request log.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.core import sleep_level
from gpu_slicer.dispatcher.errors import ReplicaError
from gpu_slicer.dispatcher.vllm import Replica
from stubs.vllm_stub.engine import RANDOM_WEIGHTS
from stubs.vllm_stub.textgen import next_token, prompt_key, tokenize
from tests.harness import running_stack
from tests.procs import Proc, spawn
from tests.test_dispatcher import (
    dispatcher,
    publish,
    replica,
    result_of,
    status,
    stop,
    trainer,
    versions,
)

# These tests sleep at every turn's end: without it a turn nobody waited on would end
# lazily, vLLM left awake (tests/test_dispatcher_lazy_sleep.py).
EVERY_TURN = ("--no-lazy-sleep",)
_CALL = re.compile(r"stub: (GET|POST) (\S+) (\d+) \d")
L2_WAKE = [
    "POST /wake_up?tags=weights 200",
    "POST /collective_rpc 200",
    "POST /update_weight_version 200",
    "POST /reset_prefix_cache 200",
    "POST /wake_up?tags=kv_cache 200",
    "POST /reset_prefix_cache 200",
]


def stub_text(prompt: str, identity: str, max_tokens: int = 4) -> str:
    """The text the stub generates for `prompt` (seed 0, no stop) under weights `identity`."""
    key = prompt_key(tokenize(prompt))
    return "".join(next_token(key, identity, 0, 0, i).text for i in range(max_tokens))


def assert_real(result: dict[str, Any], prompt: str, rev: str) -> None:
    """`result` came from the weights of `rev`, whole: label and text (not garbage)."""
    assert versions(result) == {rev}, result
    text = result["choices"][0]["text"]
    assert text == stub_text(prompt, rev), (text, result)
    assert text != stub_text(prompt, RANDOM_WEIGHTS)


def posts(lw: Proc, start: int = 0) -> list[str]:
    """The stub's POSTs logged from line `start` on, as "POST PATH STATUS", in order
    (GETs left out: health probes and reads may come between turns; so are the test's
    fault switches)."""
    out = []
    for line in lw.lines[start:]:
        m = _CALL.search(line)
        if m and m[1] == "POST" and not m[2].startswith("/_stub/"):  # the test's own
            out.append(f"POST {m[2]} {m[3]}")
    return out


async def stub_posts(lw: Proc, start: int, last: str, n: int = 1) -> list[str]:
    """`posts` from line `start` once the stub has logged `n` POSTs to a path starting
    with `last`: the stub logs a call after answering it, and on the launcher's output,
    so the dispatcher's own line after that call (``released``) may be read first."""
    while sum(c.startswith(f"POST {last}") for c in posts(lw, start)) < n:
        assert not lw.closed, f"{lw.name} ended before {n} POST {last}:\n{lw.output()}"
        await lw.changed.wait()
    return posts(lw, start)


async def released(d: Proc, start: int) -> None:
    """Wait for the dispatcher's next `released` line after line `start`."""
    await d.line(lambda s: ": released (" in s, start)


@pytest.mark.parametrize(
    ("mode", "loaded", "wanted", "newest", "level"),
    [
        ("1", None, set(), None, 1),  # fixed levels whatever the state
        ("1", "r1", {"r2"}, "r2", 1),
        ("2", "r1", {"r1"}, "r1", 2),
        ("auto", "r1", set(), "r1", 1),  # the same weights again: keep them
        ("auto", "r1", {"r1"}, "r2", 1),  # the loaded one is wanted: served first
        ("auto", "r1", {"r1", "r2"}, "r2", 1),
        ("auto", "r1", {"r2"}, "r2", 2),  # only other revisions wanted
        ("auto", "r2", {"r1"}, "r2", 2),  # a pinned older one only
        ("auto", "r1", set(), "r2", 2),  # newer published: unpinned work takes it
        ("auto", None, {"r1"}, "r1", 2),  # nothing known loaded: the wake loads anyway
        ("auto", None, set(), None, 2),
        ("auto", "r1", set(), None, 1),
    ],
)
def test_sleep_level_rule(
    mode: str, loaded: str | None, wanted: set[str], newest: str | None, level: int
) -> None:
    assert sleep_level(mode, loaded, wanted, newest) == level


@pytest.mark.parametrize(
    ("wanted", "newest", "level"),
    [
        (set(), "r3", 2),  # nothing pending, r3 loaded and newest: changing says 2
        ({"r3"}, "r3", 1),  # the loaded revision is still wanted: keep it
        ({"r4"}, "r4", 2),
    ],
)
def test_weights_changing_every_turn_drop_them(wanted: set[str], newest: str, level: int) -> None:
    assert sleep_level("auto", "r3", wanted, newest, changing=True) == level
    assert sleep_level("1", "r3", wanted, newest, changing=True) == 1


@pytest.mark.integration
async def test_auto_drops_the_weights_before_a_new_revision_and_wakes_in_order() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack) as (lw, url):
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            # Every turn ends with a sleep (a turn that saw no WAITING would end lazily).
            flags = ["--turn-seconds", "20", "--turn-grace", "2", "--no-lazy-sleep"]
            async with (
                fault,
                dispatcher(stack, url, *flags) as (d, http),
                spawn(stack, "trainer", trainer(stack, 1000, 0.05)) as tr,
            ):
                revs = ["r1", "r2", "r3"]
                await publish(stack, http, "r1")
                turns: list[list[str]] = []
                for k, rev in enumerate(revs):
                    mark, smark = len(d.lines), len(lw.lines)
                    # The request hangs in the replica so that the next revision is
                    # published inside this turn, as a trainer does between steps.
                    await fault.post("/_stub/fault", json={"hang_requests": True})
                    prompt = f"step {k} prompt"
                    r = await http.post("/v1/samples", json={"prompt": prompt, "max_tokens": 4})
                    assert r.status_code == 202, r.text
                    sid = r.json()["id"]
                    await d.line(lambda s, rev=rev: f"serving revision {rev}" in s, mark)
                    if k + 1 < len(revs):
                        await publish(stack, http, revs[k + 1])
                    await fault.post("/_stub/fault", json={"hang_requests": False})
                    got = await result_of(http, sid)
                    assert got["status"] == "done" and got["revision"] == rev, got
                    assert_real(got["result"], prompt, rev)
                    await released(d, mark)
                    turns.append(await stub_posts(lw, smark, "/sleep"))
                    # Turns 1 and 2: a newer revision is published. Turn 3: none is, but
                    # each turn loaded another revision (r1, r2, r3): the weights are
                    # changing every step, so auto drops them too.
                    assert any("(level 2)" in s for s in d.lines[mark:]), d.output()
                for k, calls in enumerate(turns):
                    print(f"turn {k + 1} (stub POSTs): {calls}")
                # the first wake follows the launcher's level-1 boot sleep: a full wake
                assert "POST /wake_up 200" in turns[0], turns[0]
                assert turns[0][-1] == "POST /sleep?level=2&mode=abort 200", turns[0]
                for calls in turns[1:]:  # after a level-2 sleep: the documented order
                    assert [c for c in calls if c != "POST /finish_weight_update 500"][:7] == [
                        *L2_WAKE,
                        "POST /v1/completions 200",
                    ], calls
                assert turns[1][-1] == "POST /sleep?level=2&mode=abort 200", turns[1]
                assert turns[2][-1] == "POST /sleep?level=2&mode=abort 200", turns[2]
                st = await status(http)
                c = st["counters"]
                assert (c["sleeps_level2"], c["sleeps_level1"], c["turns"]) == (3, 0, 3), c
                assert c["loads"] == 3 and st["sleep_level"] == "auto", st
                await stop(d)
                assert tr.proc.returncode is None  # the trainer took turns in between
            assert stack.overlaps() == 0


async def _sequential(
    d: Proc, http: httpx.AsyncClient, lw: Proc, prompts: list[str]
) -> list[list[str]]:
    """One direct request per turn (each turn ends idle): the stub's POSTs of each turn."""
    turns = []
    for prompt in prompts:
        mark, smark = len(d.lines), len(lw.lines)
        body = {"prompt": prompt, "max_tokens": 4, "revision": "r1"}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert_real(r.json(), prompt, "r1")
        await released(d, mark)
        turns.append(await stub_posts(lw, smark, "/sleep"))
    return turns


@pytest.mark.integration
async def test_level_2_loads_before_serving_in_every_turn() -> None:
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            replica(stack) as (lw, url),
            dispatcher(stack, url, "--sleep-level", "2", *EVERY_TURN) as (d, http),
        ):
            await publish(stack, http, "r1")
            turns = await _sequential(d, http, lw, ["a b", "c d", "e f"])
            for calls in turns[1:]:
                assert calls[: len(L2_WAKE)] == L2_WAKE, calls
            for calls in turns:
                assert calls[-1] == "POST /sleep?level=2&mode=abort 200", calls
            c = (await status(http))["counters"]
            assert c["loads"] == c["turns"] == c["sleeps_level2"] == 3, c
            assert c["sleeps_level1"] == c["wasted_turns"] == 0, c
            await stop(d)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_level_1_keeps_the_weights_and_wakes_whole() -> None:
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            replica(stack) as (lw, url),
            dispatcher(stack, url, "--sleep-level", "1", *EVERY_TURN) as (d, http),
        ):
            await publish(stack, http, "r1")
            turns = await _sequential(d, http, lw, ["a b", "c d"])
            # a newer revision (auto would drop r1 after the next turn) changes nothing
            await publish(stack, http, "r2")
            turns += await _sequential(d, http, lw, ["e f"])
            for calls in turns:
                assert "POST /wake_up 200" in calls and not any("tags=" in x for x in calls)
                assert calls[-1] == "POST /sleep?level=1&mode=abort 200", calls
            assert sum(x == "POST /collective_rpc 200" for t in turns for x in t) == 1
            c = (await status(http))["counters"]
            assert c["loads"] == 1 and c["turns"] == c["sleeps_level1"] == 3, c
            assert c["sleeps_level2"] == 0, c
            assert not any("level=2" in s for s in lw.lines), lw.output()
            await stop(d)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_a_failed_load_after_level_2_serves_nothing_sleeps_and_keeps_requests() -> None:
    with trio.fail_after(60):
        async with (
            running_stack() as stack,
            replica(stack) as (lw, url),
            dispatcher(stack, url, "--sleep-level", "2", *EVERY_TURN) as (d, http),
            httpx.AsyncClient(base_url=url, timeout=10) as fault,
        ):
            await publish(stack, http, "r1")
            await _sequential(d, http, lw, ["warm up"])  # the replica now slept at level 2
            await fault.post("/_stub/fault", json={"fail_reload": True})
            mark, smark = len(d.lines), len(lw.lines)
            r = await http.post("/v1/samples", json={"prompt": "kept", "max_tokens": 4})
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            await d.line(lambda s: ": released (" in s, mark)
            failed = await stub_posts(lw, smark, "/sleep")
            print(f"the failed turn (stub POSTs): {failed}")
            assert failed[:2] == ["POST /wake_up?tags=weights 200", "POST /collective_rpc 500"]
            # The KV cache is woken so that the sleep is one (a partly woken vLLM still
            # counts as sleeping, and /sleep would be a no-op), then level 2 again.
            assert failed[-3:] == [
                "POST /wake_up?tags=kv_cache 200",
                "POST /reset_prefix_cache 200",
                "POST /sleep?level=2&mode=abort 200",
            ], failed
            assert not any("/v1/" in x for x in failed), failed
            assert not any("already sleeping" in s for s in lw.lines[smark:]), lw.output()
            assert any("stub: slept level=2" in s for s in lw.lines[smark:]), lw.output()
            assert any("released" in s for s in d.lines[mark:]), d.output()
            got = (await http.get(f"/v1/samples/{sid}", params={"wait": 0})).json()
            assert got["status"] == "pending", got
            st = await status(http)
            assert st["counters"]["load_failures"] == 1 and st["loaded_revision"] is None, st
            assert st["counters"]["wasted_turns"] == 1, st  # woken, and nothing loaded
            await fault.post("/_stub/fault", json={"fail_reload": False})
            smark = len(lw.lines)
            got = await result_of(http, sid)  # the next turn, after the load's backoff
            assert got["status"] == "done", got
            assert_real(got["result"], "kept", "r1")
            assert (await status(http))["counters"]["wasted_turns"] == 1  # that turn worked
            got_posts = await stub_posts(lw, smark, "/v1/completions")
            after = [x for x in got_posts if x != "POST /finish_weight_update 500"]
            assert after[: len(L2_WAKE)] == L2_WAKE, after
            await stop(d)
            assert stack.overlaps() == 0


async def test_replica_tracks_a_level_2_wake_and_a_failed_kv_wake_forces_a_load() -> None:
    calls: list[str] = []
    kv_fails = True

    def route(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
        if request.url.path == "/wake_up":
            tags = request.url.params.get_list("tags")
            if tags == ["kv_cache"] and kv_fails:
                return httpx.Response(500, json={"error": {"message": "CUDA OOM"}})
            return httpx.Response(200, json={"status": "sleeping" if tags == ["weights"]
                                              else "awake", "tags": tags or None})  # fmt: skip
        return httpx.Response(200, json={"status": "sleeping", "level": 2, "success": True})

    with trio.fail_after(10):
        async with Replica("http://r", transport=httpx.MockTransport(route)) as r:
            r.known_version = "r1"
            await r.sleep(level=2)
            assert (r.known_version, r.dropped, r.kv_asleep) == (None, True, False)
            await r.wake_weights()
            assert r.kv_asleep and r.dropped
            r.known_version, r.dropped = "r1", False  # as a whole load leaves it
            with pytest.raises(ReplicaError, match="CUDA OOM"):
                await r.wake_kv_cache()
            assert (r.known_version, r.dropped) == (None, True)  # the next turn loads
            kv_fails = False
            await r.wake_kv_cache()
            assert not r.kv_asleep
    assert calls == [
        "POST /sleep?level=2&mode=abort",
        "POST /wake_up?tags=weights",
        "POST /wake_up?tags=kv_cache",
        "POST /wake_up?tags=kv_cache",
        "POST /reset_prefix_cache?",
    ]


async def test_a_cancelled_wake_leaves_the_replica_unknown_and_suspected_half_woken(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A turn cut off (slicerd's connection lost) cancels a wake that may go on inside
    # vLLM: nothing it was asked for may be believed, and the weights need a whole load.
    async def route(request: httpx.Request) -> httpx.Response:
        await trio.sleep(60)
        return httpx.Response(200, json={"status": "sleeping"})

    async with Replica("http://r", transport=httpx.MockTransport(route)) as r:
        r.known_version = "r1"
        for wake in (r.wake_weights, r.wake_kv_cache, r.wake):
            r.unknown = False
            with trio.move_on_after(1):
                await wake()
            assert r.unknown and r.half_woken, wake
            r.half_woken = False
        assert (r.known_version, r.dropped) == (None, True)


@pytest.mark.integration
async def test_a_level_2_wake_whose_work_expired_still_sleeps_the_weights() -> None:
    with trio.fail_after(60):
        flags = ("--sleep-level", "2", "--sample-deadline", "2", *EVERY_TURN)
        async with (
            running_stack() as stack,
            replica(stack) as (lw, url),
            dispatcher(stack, url, *flags) as (d, http),
            httpx.AsyncClient(base_url=url, timeout=10) as fault,
        ):
            await publish(stack, http, "r1")
            await _sequential(d, http, lw, ["warm up"])
            await fault.post("/_stub/fault", json={"hang_wake": True})
            mark, smark = len(d.lines), len(lw.lines)
            r = await http.post("/v1/samples", json={"prompt": "late", "max_tokens": 4})
            assert r.status_code == 202, r.text
            await lw.line(lambda s: "wake_up held" in s, smark)  # the wake is under way
            await d.line(lambda s: "deadline exceeded" in s, mark)  # and the work is gone
            await fault.post("/_stub/fault", json={"hang_wake": False})
            await released(d, mark)
            calls = await stub_posts(lw, smark, "/sleep")
            assert calls == [
                "POST /wake_up?tags=weights 200",
                "POST /wake_up?tags=kv_cache 200",
                "POST /reset_prefix_cache 200",
                "POST /sleep?level=2&mode=abort 200",
            ], calls
            assert any("stub: slept level=2" in s for s in lw.lines[smark:]), lw.output()
            st = await status(http)
            assert st["counts"]["failed"] == 1 and st["counters"]["sleeps_level2"] == 2, st
            await stop(d)
            assert stack.overlaps() == 0
