"""After a failed control call, assume nothing: read the replica back before serving.

A ``POST /sleep`` that fails at a turn's end used to leave the dispatcher believing the
replica asleep with its weights kept. slicerd then finds the replica's memory still on
the GPU and has its launcher park it (``PARK``), at the launcher's own ``--sleep-level``:
at 2 the weights are discarded, and the next turn woke the replica without a load and
served other words under the revision's label. Here the real stack (slicerd on the fake
GPU, a trainer that wants the GPU, the vLLM stub under ``slicer-launch vllm`` at sleep
level 1 and 2, the real dispatcher, plain and with early starts) fails one ``/sleep``
and checks that the next request gets the revision's own text.

Every wait is event-driven and bounded (long-polls, lines the processes print, WATCH),
under ``trio.fail_after``; every stack asserts zero GPU overlaps.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from tests.harness import Stack, running_stack, workload
from tests.procs import Proc, free_port, spawn
from tests.test_dispatcher import dispatcher, publish, trainer, versions
from tests.test_dispatcher_early import WEIGHTS, publish_sized

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


@pytest.mark.parametrize("early", ["off", "auto"])
@pytest.mark.parametrize("level", ["1", "2"])
async def test_a_failed_sleep_never_serves_other_weights_under_the_label(
    level: str, early: str
) -> None:
    with trio.fail_after(120):
        async with (
            running_stack() as stack,
            launched(stack, "--sleep-level", level) as (_, url),
            httpx.AsyncClient(base_url=url, timeout=10) as fault,
        ):
            flags = ["--no-lazy-sleep", "--early-start", early, "--base-revision", ""]
            async with (
                dispatcher(stack, url, *flags) as (d, http),
                spawn(stack, "trainer", trainer(stack, 100_000, 0.05)),
            ):
                await stack.until(lambda st: (workload(st, "trainer") or {}).get("grants", 0) > 0)
                if early == "auto":  # weight files that auto can measure: it starts early
                    await publish_sized(stack, http, "r1", WEIGHTS)
                else:
                    await publish(stack, http, "r1")
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
            assert stack.overlaps() == 0
