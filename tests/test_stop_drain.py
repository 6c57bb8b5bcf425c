"""slicerd stopped (SIGTERM) while cuda-checkpoint runs waits for the tool to end.

A cuda-checkpoint killed mid-operation desynchronises the driver, and in a container the
runtime kills whatever the daemon's exit leaves behind (systemd's `KillMode=process` does
not, Kubernetes does): so the daemon lets running tools finish, bounded by
`park_timeout`, before it exits.
"""

from __future__ import annotations

import signal

import pytest
import trio

from gpu_slicer.slicer import procs
from tests.harness import GiB, running_stack, state_of

pytestmark = pytest.mark.integration


async def test_sigterm_during_a_park_exits_only_after_the_tool_ended() -> None:
    with trio.fail_after(90):
        # 16 GiB over a 2 GB/s fake link: the checkpoint takes about 8.6 s.
        async with running_stack(bandwidth="2GB", gpus=1) as stack:
            pid = stack.sleeper()
            async with await stack.client() as reg, await stack.client() as holder:
                await reg.register("t", pid=pid)
                turn = await holder.acquire("t")
                stack.ledger.alloc(pid, 0, 16 * GiB, workload="t")
                async with trio.open_nursery() as n:
                    n.start_soon(holder.release, turn, "now")
                    await stack.until(state_of("t", "parking"))
                    assert stack.proc is not None
                    stack.proc.send_signal(signal.SIGTERM)
                    rc = await trio.to_thread.run_sync(stack.proc.wait)
                    stack.proc = None
                    # Exited by the signal, cleanly, with no tool left behind and the
                    # park complete in the driver.
                    assert rc == 0
                    assert procs.tool_runs("cuda-checkpoint", {pid}) == {}
                    assert stack.ledger.state(pid) == "checkpointed"
                    assert sum(m.on_host for m in stack.ledger.processes(0)) == 16 * GiB
                    n.cancel_scope.cancel()  # the release's reply died with the daemon
            assert stack.overlaps() == 0
