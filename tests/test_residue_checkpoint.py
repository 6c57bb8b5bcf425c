"""Sleep, then checkpoint what is left (``slicer-launch vllm --park-fallback residue``),
end to end: real slicerd (fake GPU), the vLLM stub under the real launcher, the real
dispatcher and a trainer stub whose working set fits only when the slept replica's
residue (its CUDA context) is off the GPU too. The fake GPU refuses a wake of a
checkpointed process, so a wake before the restore would fail the run."""

from __future__ import annotations

import sys

import pytest
import trio

from tests.harness import cc_log, running_stack, workload
from tests.procs import free_port, spawn
from tests.test_dispatcher import dispatcher, publish, replica_argv, result_of, versions

pytestmark = pytest.mark.integration


async def test_the_residue_is_checkpointed_after_each_sleep_and_restored_before_each_wake() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack:
            port = free_port()
            argv = replica_argv(stack, port, "cooperative")
            cut = argv.index("--")
            argv[cut:cut] = ["--park-fallback", "residue"]
            async with spawn(stack, "launcher", argv) as lw:
                await lw.line(lambda s: "]: ready" in s)
                url = f"http://127.0.0.1:{port}"
                flags = ["--turn-seconds", "0.3", "--turn-grace", "2"]
                # 79.8 GiB of an 80 GiB GPU: it fits only without the 0.5 GiB residue.
                tr = [sys.executable, "-m", "stubs.trainer_stub", "--workload", "trainer"]
                tr += ["--socket", stack.socket, "--bytes", "79.8GiB", "--work", "0.05"]
                tr += ["--steps", "3"]
                async with dispatcher(stack, url, *flags) as (_d, http):
                    await publish(stack, http, "r1")
                    ids = []
                    for i in range(4):
                        r = await http.post("/v1/samples", json={"prompt": f"q{i}"})
                        assert r.status_code == 202, r.text
                        ids.append(r.json()["id"])
                    async with spawn(stack, "trainer", tr) as t:
                        # its pid from the process, not from STATUS: slicerd forgets the
                        # trainer once its 3 steps are done and it has exited
                        trainer_pid = t.proc.pid
                        results = [await result_of(http, sid) for sid in ids]
                        assert await t.wait() == 0, t.output()
                    for got in results:
                        assert got["status"] == "done" and versions(got["result"]) == {"r1"}
                st = await stack.status()
                v = workload(st, "v")
                assert v is not None and v["fallback"] == "residue" and v["state"] != "faulted"
                engine = {e["pid"] for e in cc_log(stack) if e.get("op") == "checkpoint"}
                engine.discard(trainer_pid)
                assert engine, "the residue was never checkpointed"
                ops = [e["op"] for e in cc_log(stack) if e.get("pid") in engine]
                # every checkpoint of the residue is undone (restore, unlock) before the
                # replica's next wake: the runs serve, so no wake met a checkpointed process
                assert ops[:2] == ["lock", "checkpoint"] and "restore" in ops
            assert stack.overlaps() == 0
