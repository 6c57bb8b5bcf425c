"""After a failed control call, assume nothing: read the replica back before serving.

A ``POST /sleep`` that fails at a turn's end used to leave the dispatcher believing the
replica asleep with its weights kept. slicerd then finds the replica's memory still on
the GPU and has its launcher park it (``PARK``), at the launcher's own ``--sleep-level``:
at 2 the weights are discarded, and the next turn woke the replica without a load and
served other words under the revision's label. Here the real stack (slicerd on the fake
GPU, a trainer that wants the GPU, the vLLM stub under ``slicer-launch vllm`` at sleep
level 1 and 2, the real dispatcher, plain and with early starts) fails one ``/sleep``,
one ``/wake_up`` (after it acted: the answer is lost, as when the caller's wait ran out)
or a load, and checks that the next request gets the revision's own text.

Every wait is event-driven and bounded (long-polls, lines the processes print, WATCH),
under ``trio.fail_after``; every stack asserts zero GPU overlaps.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio

from tests.harness import Stack, running_stack, workload
from tests.procs import Proc, free_port, spawn
from tests.test_dispatcher import dispatcher, publish, result_of, trainer, versions
from tests.test_dispatcher_early import WEIGHTS, publish_sized
from tests.test_dispatcher_sleep_levels import assert_real

pytestmark = pytest.mark.integration


@asynccontextmanager
async def launched(stack: Stack, *launcher: str) -> AsyncIterator[tuple[Proc, str]]:
    """The vLLM stub as workload "v" under ``slicer-launch vllm`` (``launcher``: its
    flags), ready (booted, slept, released); (its process, its URL)."""
    port = free_port()
    argv = [sys.executable, "-m", "gpu_slicer.launcher.main", "vllm", "--workload", "v"]
    argv += ["--socket", stack.socket, "--ready-file", str(stack.base / "ready"), *launcher]
    argv += ["--", sys.executable, "-m", "stubs.vllm_stub", "serve", "m", "--port", str(port)]
    argv += ["--fake-workload", "v", "--tokens-per-s", "20000"]
    async with spawn(stack, "launcher", argv) as lw:
        await lw.line(lambda s: "]: ready" in s)
        yield lw, f"http://127.0.0.1:{port}"
        lw.proc.send_signal(signal.SIGTERM)
        assert await lw.wait() == 0, lw.output()


def text(answer: dict[str, Any]) -> str:
    t: str = answer["choices"][0]["text"]
    return t


@dataclass
class Faulted:
    """The stack under test: slicerd, the launched stub (``lw``, its fault route
    ``stub``), the dispatcher (``d``, its API ``http``) and a trainer already granted."""

    stack: Stack
    lw: Proc
    stub: httpx.AsyncClient
    d: Proc
    http: httpx.AsyncClient
    early: str

    async def publish(self, rev: str) -> None:
        """Publish ``rev``, with weight files that ``--early-start auto`` can measure
        where early starts are on (so it starts early)."""
        if self.early == "auto":
            await publish_sized(self.stack, self.http, rev, WEIGHTS)
        else:
            await publish(self.stack, self.http, rev)


@asynccontextmanager
async def faulted(level: str, early: str, *more: str) -> AsyncIterator[Faulted]:
    """:class:`Faulted` with the launcher at ``--sleep-level level`` and the dispatcher
    at ``--early-start early`` (no lazy sleep: every turn ends asleep; ``more``: its
    other flags); asserts zero overlaps on the way out."""
    async with (
        running_stack() as stack,
        launched(stack, "--sleep-level", level) as (lw, url),
        httpx.AsyncClient(base_url=url, timeout=10) as stub,
    ):
        flags = ["--no-lazy-sleep", "--early-start", early, "--base-revision", "", *more]
        async with (
            dispatcher(stack, url, *flags) as (d, http),
            spawn(stack, "trainer", trainer(stack, 100_000, 0.05)),
        ):
            await stack.until(lambda st: (workload(st, "trainer") or {}).get("grants", 0) > 0)
            yield Faulted(stack, lw, stub, d, http, early)
        assert stack.overlaps() == 0


@pytest.mark.parametrize("early", ["off", "auto"])
@pytest.mark.parametrize("level", ["1", "2"])
async def test_a_failed_sleep_never_serves_other_weights_under_the_label(
    level: str, early: str
) -> None:
    with trio.fail_after(120):
        async with faulted(level, early) as f:
            d, http, fault, stack = f.d, f.http, f.stub, f.stack
            await f.publish("r1")
            body = {"prompt": "the same words", "max_tokens": 8, "seed": 3}
            first = (await http.post("/v1/completions", json=body)).json()
            assert versions(first) == {"r1"}, first
            # The next sleep fails; slicerd then has the launcher park the replica.
            await fault.post("/_stub/fault", json={"fail_sleep": 1})
            parked = lambda st: (workload(st, "v") or {}).get("parks", 0)  # noqa: E731
            before = parked(await stack.status())
            r = await http.post("/v1/completions", json={**body, "max_tokens": 4})
            assert r.status_code == 200, r.text
            await d.line(lambda s: "sleep (level" in s and "failed" in s)
            await stack.until(lambda st: parked(st) > before)  # parked by its launcher
            again = await http.post("/v1/completions", json=body)
            assert again.status_code == 200, again.text
            assert versions(again.json()) == {"r1"}
            assert text(again.json()) == text(first), (first, again.json())
            assert any("read the replica back after a failed call" in s for s in d.lines)


# What the stub logs when the fault fired (on the launcher's output).
FIRED = {"wake": "wake failed after it acted", "load": "failed, weights broken"}


@pytest.mark.parametrize("early", ["off", "auto"])
@pytest.mark.parametrize("level", ["1", "2"])
@pytest.mark.parametrize("fault", ["wake", "load"])
async def test_a_failed_wake_or_load_never_serves_other_weights_under_the_label(
    fault: str, level: str, early: str
) -> None:
    with trio.fail_after(120):
        async with faulted(level, early) as f:
            got: dict[str, dict[str, Any]] = {}

            async def sample(prompt: str) -> None:
                r = await f.http.post("/v1/samples", json={"prompt": prompt, "max_tokens": 4})
                assert r.status_code == 202, r.text
                got[prompt] = await result_of(f.http, r.json()["id"])
                assert got[prompt]["status"] == "done", got[prompt]

            await f.publish("r1")
            await sample("warm up")
            assert_real(got["warm up"]["result"], "warm up", "r1")
            mark, want = len(f.lw.lines), "r1"
            if fault == "wake":  # the next wake acts, and its answer is lost
                await f.stub.post("/_stub/fault", json={"fail_wake": 1})
            else:  # the load of r2 fails: the weights are broken until a load works
                await f.stub.post("/_stub/fault", json={"fail_reload": True})
                await f.publish("r2")
                want = "r2"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample, "the same words")
                await f.lw.line(lambda s: FIRED[fault] in s, mark)
                if fault == "load":
                    await f.stub.post("/_stub/fault", json={"fail_reload": False})
            assert_real(got["the same words"]["result"], "the same words", want)
            if fault == "wake":
                assert any("read the replica back after a failed call" in s for s in f.d.lines)


@pytest.mark.parametrize("level", ["1", "2"])
async def test_a_failed_weights_wake_leaves_no_weights_on_the_gpu(level: str) -> None:
    # The dispatcher sleeps at level 2, so its next wake is the weights' alone; that wake
    # acts and its answer is lost: vLLM is half-woken (the weights on the GPU, the KV
    # cache not), which it calls sleeping. A /sleep then did nothing, the launcher's park
    # too, the weights passed as parked (under parked_max) and the trainer ran beside them.
    with trio.fail_after(120):
        async with faulted(level, "off", "--sleep-level", "2") as f:
            grants = lambda st: (workload(st, "trainer") or {}).get("grants", 0)  # noqa: E731
            await f.publish("r1")
            body = {"prompt": "the same words", "max_tokens": 4}
            first = (await f.http.post("/v1/completions", json=body)).json()
            assert versions(first) == {"r1"}, first
            await f.stub.post("/_stub/fault", json={"fail_wake": 1})
            mark, got = len(f.lw.lines), []

            async def again() -> None:
                got.append((await f.http.post("/v1/completions", json=body)).json())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(again)
                await f.lw.line(lambda s: FIRED["wake"] in s, mark)
                await f.d.line(lambda s: "turn failed (" in s)  # logged once it was released
                before = grants(await f.stack.status())
                await f.stack.until(lambda st: grants(st) > before)  # the trainer ran again
            # The sleep that ended the failed turn was one: vLLM slept the weights (a
            # /sleep of a half-woken vLLM is "already sleeping", a no-op that left them).
            fired = next(i for i, s in enumerate(f.lw.lines) if i >= mark and FIRED["wake"] in s)
            slept = [s for s in f.lw.lines[fired:] if "slept level=" in s or "already sleep" in s]
            assert "stub: slept level=2" in slept[0], f.lw.output()
            assert versions(got[0]) == {"r1"} and text(got[0]) == text(first), got
            assert any("woke the replica whole" in s for s in f.d.lines), f.d.output()
