"""Contract cases: sleep levels, wake (whole and partial), pause modes, requests held
until the wake and requests running when the sleep lands (see ``contract``)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
import trio

from vllm_tier.contract import (
    Obs,
    Side,
    case,
    complete,
    err,
    metric,
    sleep_states,
)
from vllm_tier.servers import MODEL_NAME

# -- sleep, wake, pause -------------------------------------------------------------


async def _held(http: httpx.AsyncClient, release: Callable[[], Awaitable[httpx.Response]]) -> Obs:
    """Send a completion, see that it is held for a second, then ``release`` it."""
    got: list[httpx.Response] = []
    answered = trio.Event()
    async with trio.open_nursery() as n:

        async def send() -> None:
            got.append(await complete(http))
            answered.set()

        n.start_soon(send)
        with trio.move_on_after(1.0):
            await answered.wait()
        held = not got
        gauges = (
            await metric(http, "vllm:num_requests_running"),
            await metric(http, "vllm:num_requests_waiting"),
        )
        rel = await release()
    return {
        "held": held,
        "gauges_while_held": gauges,
        "release": (rel.status_code, rel.json()),
        "served": got[0].status_code,
        "finish": got[0].json()["choices"][0]["finish_reason"],
    }


@case
async def case_sleep_holds_requests_until_wake(s: Side) -> Obs:
    r1 = await s.dev.post("/sleep", params={"level": 1})
    r2 = await s.dev.post("/sleep", params={"level": 1})
    sleeping = (await s.dev.get("/is_sleeping")).json()
    paused = (await s.dev.get("/is_paused")).json()
    health = (await s.dev.get("/health")).status_code
    asleep_states = await sleep_states(s.dev)
    held = await _held(s.dev, lambda: s.dev.post("/wake_up"))
    woke = (await s.dev.get("/is_sleeping")).json()
    return {
        "sleep": (r1.status_code, r1.json()),
        "twice": (r2.status_code, r2.json()),
        "is_sleeping": sleeping,
        "is_paused": paused,
        "health": health,
        **held,
        "after_wake": woke,
        "sleep_state_asleep": asleep_states,
        "sleep_state_awake": await sleep_states(s.dev),
    }


@case
async def case_wake_tags(s: Side) -> Obs:
    a = await s.dev.post("/wake_up")
    b = await s.dev.post("/wake_up", params={"tags": "bogus"})
    return {"awake": (a.status_code, a.json()), "bogus": (b.status_code, b.json())}


@case
async def case_pause_keep_holds_until_resume(s: Side) -> Obs:
    p = await s.dev.post("/pause", params={"mode": "keep"})
    is_paused = (await s.dev.get("/is_paused")).json()
    held = await _held(s.dev, lambda: s.dev.post("/resume"))
    return {
        "pause": (p.status_code, p.json()),
        "is_paused": is_paused,
        **held,
        "after": (await s.dev.get("/is_paused")).json(),
    }


async def _pause_then_new_request(s: Side, mode: str) -> Obs:
    p = await s.dev.post("/pause", params={"mode": mode})
    out: Obs = {"pause": (p.status_code, p.json())}
    got: list[httpx.Response] = []
    answered = trio.Event()
    async with trio.open_nursery() as n:

        async def send() -> None:
            got.append(await complete(s.dev))
            answered.set()

        n.start_soon(send)
        with trio.move_on_after(1.0):
            await answered.wait()
        out["answered_while_paused"] = err(got[0]) if got else None
        await s.dev.post("/resume")
    if out["answered_while_paused"] is None:
        out["after_resume"] = got[0].status_code
    return out


@case
async def case_pause_abort_then_new_request(s: Side) -> Obs:
    return await _pause_then_new_request(s, "abort")


@case
async def case_pause_wait_then_new_request(s: Side) -> Obs:
    return await _pause_then_new_request(s, "wait")


HOLD_AFTER = 2


async def _sleep_under_a_request(s: Side, mode: str, seed: int) -> Obs:
    """Stream n=8 x 120 tokens; once every choice has a token, ``/sleep?level=1&mode=MODE``
    then ``/wake_up``; what each choice got.

    With ``mode=abort`` the request carries the xarg ``tier_hold_after`` (``hold.py``):
    past its first ``HOLD_AFTER`` tokens it stays running and cannot end by itself, and
    the sleep is sent once every choice has them, so the sleep lands on a running request
    whatever the machine's load (without it the real CPU engine could finish all 120
    tokens first) and each choice ends with exactly ``HOLD_AFTER`` tokens. ``mode=keep``
    needs no hold: a request that ends before the sleep sees the same outcome as one the
    sleep freezes."""
    body = {
        "model": MODEL_NAME,
        "prompt": "hello",
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": seed,
        "n": 8,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    before = 1  # tokens every choice has when the sleep is sent
    if mode == "abort":
        before = HOLD_AFTER
        body["vllm_xargs"] = {"tier_hold_after": HOLD_AFTER}
    tokens: dict[int, int] = {}
    finish: dict[int, str] = {}

    def take(line: str) -> None:
        if line.startswith("data: {"):
            for ch in json.loads(line.removeprefix("data: "))["choices"]:
                tokens[ch["index"]] = tokens.get(ch["index"], 0) + len(ch["token_ids"] or [])
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]

    async with s.dev.stream("POST", "/v1/completions", json=body) as r:
        lines = r.aiter_lines()
        async for line in lines:
            take(line)
            if len(tokens) == 8 and min(tokens.values()) >= before:
                break
        slept = await s.dev.post("/sleep", params={"level": 1, "mode": mode})
        woke = await s.dev.post("/wake_up")
        async for line in lines:
            take(line)
        status = r.status_code
    return {
        "status": status,
        "sleep": slept.status_code,
        "wake": woke.status_code,
        "finish": sorted(set(finish.values())),
        "choices_ended": len(finish),
        "tokens_per_choice": sorted(set(tokens.values())),  # abort: [HOLD_AFTER]
        "cut_short": all(0 < n < 120 for n in tokens.values()) and len(tokens) == 8,
    }


@case
async def case_sleep_keep_freezes_a_running_request(s: Side) -> Obs:
    return await _sleep_under_a_request(s, "keep", seed=2)


@case
async def case_sleep_abort_ends_a_running_request(s: Side) -> Obs:
    return await _sleep_under_a_request(s, "abort", seed=1)


@case
async def case_sleep_level_0_is_a_pause(s: Side) -> Obs:
    r = await s.dev.post("/sleep", params={"level": 0})
    states = await sleep_states(s.dev)
    flags = ((await s.dev.get("/is_sleeping")).json(), (await s.dev.get("/is_paused")).json())
    held = await _held(s.dev, lambda: s.dev.post("/resume"))  # /resume ends a level 0
    after = ((await s.dev.get("/is_sleeping")).json(), (await s.dev.get("/is_paused")).json())
    return {
        "sleep": (r.status_code, r.json()),
        "states": states,
        "flags": flags,
        **held,
        "after_resume": after,
    }


@case
async def case_sleep_level_2_state(s: Side) -> Obs:
    r = await s.dev.post("/sleep", params={"level": 2})
    states = await sleep_states(s.dev)
    w = await s.dev.post("/wake_up")
    # Level 2 drops the weights on a GPU (the stub too); the CPU worker keeps them.
    # Either way the weights must be reloaded: reload the base for the next cases.
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(s.models / "base")}}
    rl = await s.dev.post("/collective_rpc", json=rpc)
    return {
        "sleep": (r.status_code, r.json()),
        "states": states,
        "wake": (w.status_code, w.json()),
        "reload": rl.status_code,
        "serves": (await complete(s.dev)).status_code,
    }


@case
async def case_partial_wake_keeps_requests_held(s: Side) -> Obs:
    await s.dev.post("/sleep", params={"level": 1})
    part = await s.dev.post("/wake_up", params={"tags": "weights"})
    flags = (await s.dev.get("/is_sleeping")).json()
    held = await _held(s.dev, lambda: s.dev.post("/wake_up", params={"tags": "kv_cache"}))
    return {"partial": (part.status_code, part.json()), "is_sleeping": flags, **held}


@case
async def case_wake_ends_a_pause(s: Side) -> Obs:
    p = await s.dev.post("/pause", params={"mode": "keep"})
    flags = ((await s.dev.get("/is_sleeping")).json(), (await s.dev.get("/is_paused")).json())
    held = await _held(s.dev, lambda: s.dev.post("/wake_up"))
    return {
        "pause": p.status_code,
        "flags_while_paused": flags,
        **held,
        "paused_after": (await s.dev.get("/is_paused")).json(),
    }
