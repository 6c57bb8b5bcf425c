"""One process, one workload: a REGISTER naming a process (or a tree holding one) that
already belongs to another live or orphaned workload is refused with `in-use`, and nothing
changes; the workload's own launcher re-registering its processes still adopts them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from gpu_slicer.slicer.client import ClientError
from tests.harness import GiB, Stack, running_stack

pytestmark = pytest.mark.integration

PARENT = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def tree(stack: Stack) -> tuple[subprocess.Popen[str], int]:
    """A parent process and its child (both sleeping); the child holds 8 GiB."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], env=stack.env, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.stdout.close()
    stack.ledger.alloc(child, 0, 8 * GiB, tag="weights", workload="a")
    return parent, child


async def refused(stack: Stack, name: str, **kw: object) -> str:
    async with await stack.client() as c:
        with pytest.raises(ClientError) as e:
            await c.register(name, **kw)
    assert e.value.code == "in-use", e.value
    return e.value.text


async def test_a_process_of_a_live_workload_cannot_be_registered_again() -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            parent, child = tree(stack)
            try:
                async with await stack.client() as reg_a:
                    await reg_a.register("a", pid=parent.pid)  # tree=1: the child counts
                    before = await stack.status()
                    # The child is a's; a tree that holds a's root is a's too.
                    text = await refused(stack, "b", pid=child)
                    assert "already belongs to workload a" in text
                    await refused(stack, "b", pid=child, tree=False)
                    outer = stack.sleeper()
                    await refused(stack, "c", pid=parent.pid)
                    after = await stack.status()
                    assert [w["name"] for w in after["workloads"]] == ["a"]
                    assert after["workloads"] == before["workloads"]
                    assert outer  # a process outside a's tree registers as usual
                    async with await stack.client() as reg_d:
                        await reg_d.register("d", pid=outer)
                    # An orphan still owns its processes: only its own name adopts them.
                    async with await stack.client() as holder:
                        t = await holder.acquire("a")
                        await holder.release(t)  # idle: resident
                await stack.until(lambda st: st["workloads"][0]["state"] == "parked")
                await refused(stack, "b", pid=child)
                async with await stack.client() as again:
                    reply = await again.register("a", pid=parent.pid)
                    assert reply["state"] == "parked"  # adopted, not refused
            finally:
                parent.kill()
                parent.wait(10)
                subprocess.run(["kill", "-9", str(child)], check=False)
            assert stack.overlaps() == 0
