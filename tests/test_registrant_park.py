"""A cooperative replica survives its dispatcher's death (registrant-side park).

With the shipped vLLM setup (`slicer-launch vllm`: cooperative park, answers PARK, falls
back to cuda-checkpoint) the dispatcher is SIGKILLed in every phase of a turn. slicerd
asks the launcher to park (`PARK`), the launcher sleeps vLLM and answers (`PARKED`),
slicerd verifies through the fake GPU and only then grants the waiting trainer. The
replica is never restarted and the next dispatcher serves every accepted request.

The rescue ladder itself (no answer, a registrant that cannot, no fallback) is driven
with plain clients over real sleeper processes and the real cuda-checkpoint stub.
"""

from __future__ import annotations

import signal
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, ClientError
from tests.harness import GiB, Stack, event_index, events_until, running_stack, workload
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

pytestmark = pytest.mark.integration


PHASES = ["wake", "load", "serve", "sleep"]


async def _into_phase(phase: str, d: Proc, lw: Proc, fault: httpx.AsyncClient) -> None:
    """Wait until the dispatcher's turn is inside `phase` (set up before the samples)."""
    match phase:
        case "wake":
            await lw.line(lambda s: "wake_up held" in s)
        case "load":
            await d.line(lambda s: "loading revision r1" in s)
        case "serve":
            await d.line(lambda s: "serving revision r1" in s)
        case "sleep":
            await lw.line(lambda s: "sleep held" in s)


@pytest.mark.parametrize("phase", PHASES)
async def test_dispatcher_killed_in_any_phase_the_launcher_parks_the_replica(phase: str) -> None:
    with trio.fail_after(120):
        stub = ("--reload-seconds", "3") if phase == "load" else ()
        async with (
            running_stack() as stack,
            replica(stack, "cooperative", *stub) as (lw, url),
            httpx.AsyncClient(base_url=url, timeout=10) as fault,
        ):
            engine = {p.pid for p in lw.descendants()}
            flags = ("--turn-seconds", "60") if phase != "sleep" else ("--turn-seconds", "0.2")
            async with dispatcher(stack, url, *flags) as (d, http):
                await publish(stack, http, "r1")
                if phase == "wake":
                    await fault.post("/_stub/fault", json={"hang_wake": True})
                if phase == "serve":
                    await fault.post("/_stub/fault", json={"hang_requests": True})
                if phase == "sleep":
                    await fault.post("/_stub/fault", json={"hang_sleep": True})
                ids = []
                for i in range(5):
                    r = await http.post("/v1/samples", json={"prompt": f"p{i}", "max_tokens": 4})
                    assert r.status_code == 202, r.text
                    ids.append(r.json()["id"])
                async with (
                    await stack.client() as watch,
                    spawn(stack, "trainer", trainer(stack, 1, 0.3)) as tr,
                ):
                    await watch.request(proto.Watch())
                    seen: list[dict[str, Any]] = []
                    await events_until(
                        watch, lambda e: e["event"] == "queued" and e["workload"] == "trainer", seen
                    )
                    await _into_phase(phase, d, lw, fault)
                    d.proc.kill()
                    assert await d.wait() == -signal.SIGKILL
                    await events_until(watch, lambda e: e["event"] == "park-asked", seen)
                    if phase in ("wake", "sleep"):
                        # The launcher's sleep queues behind the held call; let both go.
                        await fault.post("/_stub/fault", json={"hang_wake": False})
                        await fault.post("/_stub/fault", json={"hang_sleep": False})
                    if phase == "serve":
                        await fault.post("/_stub/fault", json={"hang_requests": False})
                    await events_until(
                        watch,
                        lambda e: e["event"] == "granted" and e["workload"] == "trainer",
                        seen,
                    )
                    why = lw.lines[await lw.line(lambda s: "slicerd asks to park v" in s)]
                    # Killed mid-turn: its holder closed. In the sleep phase the held
                    # sleep may also be the launcher's own, after a lazy release that came
                    # before the trainer queued: its holder released. The line says which.
                    reasons = ["its holder closed its connection mid-turn"]
                    if phase == "sleep":
                        reasons.append("its holder released its turn with it still on the GPU")
                    assert any(r in why for r in reasons), why
                    # Asked, answered, verified parked, and only then the trainer.
                    assert event_index(seen, "park-answered", "v") < event_index(
                        seen, "parked", "v"
                    )
                    assert event_index(seen, "parked", "v") < event_index(
                        seen, "granted", "trainer"
                    )
                    assert not any(e["event"] == "fault" for e in seen), seen
                    assert await tr.wait() == 0
            st = await stack.status()
            v = workload(st, "v")
            assert v is not None and v["faults"] == 0 and v["state"] == "parked", v
            assert "parked on slicerd's request" in lw.output()
            assert "FAULT" not in lw.output()
            # slicerd's log names why it asked (the holder closed mid-turn, or its turn
            # ended with the replica still on the GPU, as when the sleep was held).
            said = "asking the registrant of v to park it: its "
            assert stack.log is not None and said in stack.log.read_text()
            assert {p.pid for p in lw.descendants()} == engine  # never restarted
            async with dispatcher(stack, url) as (d2, http2):
                for sid in ids:
                    got = await result_of(http2, sid)
                    assert got["status"] == "done", got
                    assert versions(got["result"]) == {"r1"}
                assert (await status(http2))["counts"]["pending"] == 0
                await stop(d2)
            assert stack.overlaps() == 0


# ---- the rescue ladder over plain clients --------------------------------------------------


KEEP: list[AsyncSlicer] = []  # connections that must outlive a helper's frame


@pytest.fixture(autouse=True)
async def _close_kept() -> Any:
    yield
    while KEEP:
        await KEEP.pop().aclose()


class Waiter:
    """A raw connection that sent `ACQUIRE t` and reads its grant later."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buf = stream, proto.LineBuffer(proto.MAX_SERVER_LINE)

    async def granted(self) -> proto.Ok:
        lines: list[bytes] = []
        while not lines:
            lines = self.buf.feed(await self.stream.receive_some(4096))
        (line,) = lines
        msg = proto.parse_server_line(line)
        assert isinstance(msg, proto.Ok), msg
        return msg


async def _holder_dies(
    stack: Stack, *, fallback: str
) -> tuple[AsyncSlicer, int, Waiter, proto.ParkAsk]:
    """Workload "v" (20 GiB, cooperative, asks its registrant) held by a connection that
    closes while "t" waits; returns v's registrant, its pid, t's waiter, and the PARK.
    t's registrant stays open until the test ends (`KEEP`)."""
    pv, pt = stack.sleeper(20 * GiB, label="v"), stack.sleeper()
    reg_v, reg_t = await stack.client(), await stack.client()
    await reg_v.register(
        "v", pid=pv, park="cooperative", parked_max=GiB, fallback=fallback, ask=True
    )
    await reg_t.register("t", pid=pt)
    KEEP.append(reg_t)
    holder = await stack.client()
    await holder.acquire("v")
    waiter = Waiter(await trio.open_unix_socket(stack.socket))
    await waiter.stream.send_all(b"ACQUIRE t\n")
    await stack.until(lambda st: st["gpus"][0]["queue"] == ["t"])
    await holder.aclose()  # the dispatcher dies mid-turn
    while not isinstance(msg := await reg_v.next_message(), proto.ParkAsk):
        pass
    return reg_v, pv, waiter, msg


async def test_a_silent_registrant_is_passed_over_for_cuda_checkpoint() -> None:
    with trio.fail_after(60):
        async with running_stack("--registrant-park-timeout", "1", gpus=1) as stack:
            reg_v, pv, waiter, ask = await _holder_dies(stack, fallback="checkpoint")
            assert ask == proto.ParkAsk("v", 1, 1000)  # the registrant's window, 1 s here
            async with waiter.stream:
                await waiter.granted()  # after the fallback's verified checkpoint
                assert stack.ledger.state(pv) == "checkpointed"
                st = await stack.status()
                assert workload(st, "v")["parked_pids"] == [pv]  # type: ignore[index]
                # A late answer is refused precisely and changes nothing.
                with pytest.raises(ClientError) as e:
                    await reg_v.parked("v", 1)
                assert e.value.code == "not-asked"
            async with await stack.client() as holder:
                tv = await holder.acquire("v")  # its checkpoint is restored first
                assert tv.restored and stack.ledger.state(pv) == "running"
                await holder.release(tv)
            await reg_v.aclose()
            assert stack.overlaps() == 0


async def test_a_registrant_that_parks_is_verified_and_nothing_is_checkpointed() -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            reg_v, pv, waiter, ask = await _holder_dies(stack, fallback="checkpoint")
            stack.ledger.free(pv, "weights")  # what vLLM's sleep does to its memory
            await reg_v.parked("v", ask.turn)
            async with waiter.stream:
                await waiter.granted()
                assert stack.ledger.state(pv) == "running"  # no tool touched it
                st = await stack.status()
                assert workload(st, "v")["state"] == "parked"  # type: ignore[index]
            await reg_v.aclose()
            assert stack.overlaps() == 0


async def test_a_registrant_that_cannot_park_without_fallback_faults_and_keeps_the_gpu() -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            reg_v, pv, waiter, ask = await _holder_dies(stack, fallback="none")
            await reg_v.parked("v", ask.turn, ok=False)
            while not isinstance(msg := await reg_v.next_message(), proto.Fault):
                pass
            assert msg.reason == "still-resident"
            st = await stack.status()
            assert workload(st, "v")["state"] == "faulted"  # type: ignore[index]
            assert st["gpus"][0]["holder"] is None  # t is not granted: the GPU stays taken
            await reg_v.aclose()
            next(p for p in stack.children if p.pid == pv).kill()
            async with waiter.stream:
                await waiter.granted()  # once v's processes are gone
            assert stack.overlaps() == 0
