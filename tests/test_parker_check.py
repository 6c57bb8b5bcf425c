"""slicerd checks its parker before anyone depends on it (issue 40, item 3).

``slicerd --cuda-checkpoint /no/such/tool`` used to start with a warning that named
``$CWD/cuda-checkpoint``, accept ``park=checkpoint`` workloads and kill the trainer at
its first handoff (FAULT lock-failed rc=127). Now STATUS says why the parker cannot run,
a REGISTER that needs it is refused with the path looked up and the fix, nobody is
registered or faulted, a workload that parks itself is served, and a tool installed
later is found at the next REGISTER that needs it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from gpu_slicer.slicer.client import ClientError
from stubs.stack import FAKE_BACKEND, TOOL
from tests.harness import running_stack, workload

pytestmark = pytest.mark.integration

GiB = 1 << 30


async def test_a_missing_cuda_checkpoint_refuses_what_needs_it_and_kills_nobody(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        missing = str(tmp_path / "tools" / "cuda-checkpoint")
        backend = (*FAKE_BACKEND[:2], "--cuda-checkpoint", missing)
        async with running_stack(backend=backend) as stack:
            st = await stack.status()
            check = st["parker_check"]
            assert check["ok"] is False and check["kind"] == "cli", check
            assert missing in check["error"] and "--cuda-checkpoint" in check["error"], check

            async with await stack.client() as c:
                trainer = stack.sleeper()
                with pytest.raises(ClientError) as e:
                    await c.register("trainer", pid=trainer)  # park=checkpoint, the default
                assert e.value.code == "parker-unavailable", e.value
                assert missing in e.value.text, e.value.text
                for fallback in ("checkpoint", "residue"):
                    with pytest.raises(ClientError) as e:
                        await c.register("v", pid=stack.sleeper(), park="cooperative",
                                         fallback=fallback)  # fmt: skip
                    assert e.value.code == "parker-unavailable", e.value
                st = await stack.status()
                assert workload(st, "trainer") is None and workload(st, "v") is None, st

                # A workload that parks itself needs no parker: served, parked, granted.
                coop = stack.sleeper()
                await c.register("coop", pid=coop, park="cooperative", fallback="none",
                                 parked_max="1GiB")  # fmt: skip
                turn = await c.acquire("coop", wait=20)
                stack.ledger.alloc(coop, 0, 8 * GiB, tag="weights", workload="coop")
                stack.ledger.free(coop)
                await c.release(turn, park="now")
                st = await stack.status()
                coop_w = workload(st, "coop")
                assert coop_w is not None and coop_w["state"] != "faulted", coop_w

                # The tool installed where it was looked up: the next REGISTER finds it.
                (tmp_path / "tools").mkdir()
                os.symlink(TOOL, missing)
                await c.register("trainer", pid=trainer)
                stack.ledger.alloc(trainer, 0, 30 * GiB, tag="weights", workload="trainer")
                st = await stack.status()
                assert st["parker_check"]["ok"] is True, st["parker_check"]
                turn = await c.acquire("trainer")
                await c.release(turn, park="now")
                assert (workload(await stack.status(), "trainer") or {})["state"] == "parked"
                assert all(w["faults"] == 0 for w in (await stack.status())["workloads"])
                assert stack.overlaps() == 0
