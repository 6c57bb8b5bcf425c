"""`slicer-dispatch --early-start` (`dispatcher.early`) with the real processes: slicerd,
the launcher with the vLLM stub, the dispatcher, and a trainer (a sleeper holding 30 GiB,
park=checkpoint). While slicerd checkpoints the trainer, the dispatcher is told EARLY and
wakes the weights and loads the revision; the KV cache waits for the grant, and every
result comes from the revision's whole weights. The trainer's checkpoint is held with
the fake GPU's hang injection, so the overlap is observed, never timed. With a revision
whose weight files cannot be measured (``auto``) or ``--early-start off`` the turn goes
as before."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import trio

from gpu_slicer.slicer.client import AsyncSlicer, Turn
from tests.harness import GiB, Stack, queue_is, running_stack, state_of, workload
from tests.procs import Proc
from tests.test_dispatcher import dispatcher, replica, result_of, status, stop
from tests.test_dispatcher_sleep_levels import L2_WAKE, assert_real, posts, released

pytestmark = pytest.mark.integration

WEIGHTS = 2 * GiB  # the vLLM stub's default --weights-bytes
CONTEXT = 512 * 1024**2  # ... and --context-bytes


async def publish_sized(stack: Stack, http: httpx.AsyncClient, rev: str, nbytes: int) -> None:
    """Save "weights" of `rev` (revision.txt, and a sparse model.safetensors of `nbytes`:
    what `--early-start auto` measures) and publish them."""
    path = stack.base / "ckpt" / rev
    path.mkdir(parents=True)
    (path / "revision.txt").write_text(rev)
    if nbytes:
        with open(path / "model.safetensors", "wb") as f:
            os.truncate(f.fileno(), nbytes)
    r = await http.post("/v1/revisions", json={"revision": rev, "path": str(path)})
    assert r.status_code == 201, r.text


def device_bytes(stack: Stack, label: str) -> int:
    """The on-device bytes of every process the fake GPU labels `label`."""
    return sum(p.on_device for p in stack.ledger.processes(0) if p.workload == label)


async def trainer_holding(stack: Stack) -> tuple[int, AsyncSlicer, Turn]:
    """A trainer (30 GiB, park=checkpoint) that holds the GPU: pid, connection, turn."""
    pt = stack.sleeper(30 * GiB, label="trainer")
    rt = await stack.client()
    await rt.register("trainer", pid=pt)
    return pt, rt, await rt.acquire("trainer")


async def one_sample(http: httpx.AsyncClient, prompt: str) -> str:
    r = await http.post("/v1/samples", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def first_turn(stack: Stack, d: Proc, http: httpx.AsyncClient) -> None:
    """The dispatcher's first turn (revision r0), with nobody in the way: granted at once
    (no early start); it recovers the replica on first sight, loads and serves r0, sleeps
    it and releases."""
    await publish_sized(stack, http, "r0", WEIGHTS)
    mark = len(d.lines)
    got = await result_of(http, await one_sample(http, "warm-up"))
    assert got["status"] == "done", got
    await released(d, mark)
    assert (await status(http))["counters"]["early_starts"] == 0


async def test_the_weights_load_while_the_trainer_is_checkpointed() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack, replica(stack) as (lw, url):
            flags = ("--no-lazy-sleep", "--turn-seconds", "5")
            async with dispatcher(stack, url, *flags) as (d, http):  # --early-start auto
                await first_turn(stack, d, http)
                pt, rt, tt = await trainer_holding(stack)
                await publish_sized(stack, http, "r1", WEIGHTS)
                stack.ledger.inject(pt, "checkpoint", hang=True)
                smark = len(lw.lines)
                sid = await one_sample(http, "early prompt")
                await stack.until(queue_is(["v"]))
                await rt.release(tt)
                await d.line(lambda s: "early start: loaded revision r1" in s)
                # The replica's weights are loaded beside the locked trainer; its KV
                # cache is still asleep and nothing was granted or sent.
                assert stack.ledger.state(pt) == "locked"
                st = await stack.status()
                assert workload(st, "trainer")["state"] == "parking"  # type: ignore[index]
                assert workload(st, "v")["early"] == WEIGHTS  # type: ignore[index]
                assert st["gpus"][0]["holder"] is None
                assert device_bytes(stack, "v") == CONTEXT + WEIGHTS
                assert (await status(http))["state"] == "preparing"
                assert stack.overlaps() == 0
                stack.ledger.clear_injection(pt)
                got = await result_of(http, sid)
                assert got["status"] == "done", got
                assert_real(got["result"], "early prompt", "r1")
                await lw.line(lambda s: "POST /v1/completions" in s, smark)  # logged after
                calls = posts(lw, smark)
                # After the level-1 sleep of r0: the weights come back, the load replaces
                # them, and only the grant wakes the KV cache; the first send comes after.
                assert calls[: len(L2_WAKE) + 1] == [*L2_WAKE, "POST /v1/completions 200"], calls
                c = (await status(http))["counters"]
                assert (c["early_starts"], c["early_failed"], c["loads"]) == (1, 0, 2), c
                await rt.aclose()
            assert stack.overlaps() == 0


@pytest.mark.parametrize("why", ["unmeasured", "off"])
async def test_without_an_early_start_the_turn_wakes_after_the_grant(why: str) -> None:
    with trio.fail_after(90):
        async with running_stack() as stack, replica(stack) as (lw, url):
            flags: tuple[str, ...] = ("--no-lazy-sleep",)
            if why == "off":
                flags += ("--early-start", "off")
            async with dispatcher(stack, url, *flags) as (d, http):
                await first_turn(stack, d, http)
                _pt, rt, tt = await trainer_holding(stack)
                await publish_sized(stack, http, "r1", WEIGHTS if why == "off" else 0)
                smark = len(lw.lines)
                sid = await one_sample(http, "late prompt")
                await stack.until(queue_is(["v"]))
                await rt.release(tt)
                got = await result_of(http, sid)
                assert got["status"] == "done"
                assert_real(got["result"], "late prompt", "r1")
                await lw.line(lambda s: "POST /v1/completions" in s, smark)
                assert posts(lw, smark)[0] == "POST /wake_up 200"  # a whole wake, granted
                assert (await status(http))["counters"]["early_starts"] == 0
                assert (await stack.status())["totals"]["earlies"] == 0
                await rt.aclose()
            assert stack.overlaps() == 0


async def test_an_early_load_that_fails_is_redone_in_the_turn() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack, replica(stack) as (_lw, url):
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            async with fault, dispatcher(stack, url, "--no-lazy-sleep") as (d, http):
                await first_turn(stack, d, http)
                pt, rt, tt = await trainer_holding(stack)
                await publish_sized(stack, http, "r1", WEIGHTS)
                stack.ledger.inject(pt, "checkpoint", hang=True)
                await fault.post("/_stub/fault", json={"fail_reload": True})
                sid = await one_sample(http, "retried prompt")
                await stack.until(queue_is(["v"]))
                await rt.release(tt)
                await d.line(lambda s: "early start failed" in s)
                await fault.post("/_stub/fault", json={"fail_reload": False})
                stack.ledger.clear_injection(pt)
                got = await result_of(http, sid)
                assert got["status"] == "done"
                assert_real(got["result"], "retried prompt", "r1")
                c = (await status(http))["counters"]
                assert (c["early_starts"], c["early_failed"]) == (1, 1), c
                await rt.aclose()
            assert stack.overlaps() == 0


async def test_a_dispatcher_killed_in_its_early_stage_leaves_nothing_running() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack, replica(stack) as (lw, url):
            async with dispatcher(stack, url, "--no-lazy-sleep") as (d, http):
                await first_turn(stack, d, http)
                pt, rt, tt = await trainer_holding(stack)
                await publish_sized(stack, http, "r1", WEIGHTS)
                stack.ledger.inject(pt, "checkpoint", hang=True)
                sid = await one_sample(http, "kept prompt")
                await stack.until(queue_is(["v"]))
                await rt.release(tt)
                await d.line(lambda s: "early start: loaded revision r1" in s)
                d.proc.kill()  # weights woken and loaded, KV cache asleep, no turn held
                assert await d.wait() == -signal.SIGKILL
            await stack.until(state_of("v", "idle"))  # abandoned: dirty, parked first
            stack.ledger.clear_injection(pt)
            tt = await rt.acquire("trainer")
            # slicerd checkpointed the replica (its launcher's sleep would be a no-op on a
            # half-woken vLLM): nothing of it runs beside the trainer.
            assert not any("slicerd asks to park v" in s for s in lw.lines)
            v = workload(await stack.status(), "v")
            assert v is not None and v["state"] == "parked" and v["parked_pids"], v
            assert tt.restored and stack.overlaps() == 0
            await rt.release(tt)
            async with dispatcher(stack, url, "--no-lazy-sleep") as (d2, http2):
                got = await result_of(http2, sid)  # restored, recovered, woken, loaded whole
                assert got["status"] == "done", got
                assert_real(got["result"], "kept prompt", "r1")
                await stop(d2)
            await rt.aclose()
            assert stack.overlaps() == 0
