"""A SIGKILLed `slicer-launch` leaves no process of its workload holding the GPU.

The launcher registers itself (``tree=1``); its command is a session of its own, started
with a parent-death signal, so the kernel kills it with the launcher. Its engine core does
not follow (real vLLM 0.32's EngineCore outlives its API server's SIGKILL, measured; the
stub does the same with ``--core-outlives-server``): the launcher's keeper, a process of
its own that sees the launcher's pipe end, SIGKILLs the command's whole process group.
Each test counts the trainer's wait and the processes left; none may overlap on the fake
GPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import psutil
import pytest
import trio

from tests.harness import Stack, running_stack, state_of
from tests.procs import free_port
from tests.test_launcher import alive, child_code, gone, launcher, vllm_stub, watching

pytestmark = pytest.mark.integration

KILL_AFTER = 3.0  # slicerd's fault_kill_after here
CORE = ("--core-outlives-server",)  # as real vLLM 0.32's EngineCore (module docstring)
GRANT_BOUND = KILL_AFTER + 5  # the bound: fault_kill_after plus a few seconds


def stub_procs(port: int) -> list[psutil.Process]:
    """Live processes of the vLLM stub serving ``port`` (its API server and engine core:
    the core's command line names the port through its parent's environment only, so it is
    found as a child)."""
    out: list[psutil.Process] = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        server = "stubs.vllm_stub" in cmd and "gpu_slicer.launcher.main" not in cmd
        if server and str(port) in cmd and alive(p):
            out.append(p)
            out += [c for c in p.children(recursive=True) if alive(c)]
    return out


async def granted_after_kill(stack: Stack, kill: Any) -> float:
    """Register a trainer (holding nothing), call ``kill()``, ACQUIRE, put 8 GiB on the GPU
    in the turn: seconds until the grant."""
    pid = stack.sleeper()
    async with await stack.client() as t:
        await t.register("t", pid=pid, park="cooperative", parked_max="1GiB")
        await kill()
        t0 = time.monotonic()
        turn = await t.acquire("t")
        waited = time.monotonic() - t0
        # It works in its turn, as a trainer does: the fake GPU counts an overlap if
        # anything of the replica is still resident beside it.
        stack.ledger.alloc(pid, 0, 8 << 30, tag="work", workload="t")
        stack.ledger.free(pid)
        await t.release(turn)
    return waited


@pytest.mark.parametrize("when", ["parked", "awake", "parking"])
async def test_a_killed_launcher_takes_its_vllm_with_it_and_the_gpu_grants_again(
    when: str,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(90):
        async with (
            running_stack("--fault-kill-after", str(KILL_AFTER)) as stack,
            launcher(stack, "vllm", "v", [], vllm_stub("v", port, *CORE)) as lw,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            await lw.text(lambda s: "]: ready" in s)  # booted, slept, GPU given back
            procs = stub_procs(port)
            assert len(procs) == 2, procs  # the API server and its engine core
            if when == "awake":  # a lazy release: vLLM left awake, resident, idle
                async with await stack.client() as c:
                    turn = await c.acquire("v")
                    assert (await http.post("/wake_up")).status_code == 200
                    await c.release(turn)
                await stack.until(state_of("v", "idle"))

            async def kill() -> None:
                if when == "parking":  # the launcher's /sleep in flight for t's turn
                    await http.post("/_stub/fault", json={"hang_sleep": True})
                    async with await stack.client() as c:
                        turn = await c.acquire("v")
                        assert (await http.post("/wake_up")).status_code == 200
                        await c.release(turn)
                    async with trio.open_nursery() as n:  # t's ACQUIRE asks for the park
                        n.start_soon(ask_once, stack)
                        await lw.text(lambda s: "sleep held (hang_sleep fault)" in s)
                        n.cancel_scope.cancel()
                    # Both logs say why it is asked: a lazy release, its holder is alive.
                    assert "its holder released its turn with it still on the GPU" in lw.output()
                    assert "holder is gone" not in lw.output()
                    said = "asking the registrant of v to park it: its holder released its turn"
                    assert stack.log is not None and said in stack.log.read_text()
                lw.proc.kill()
                await lw.wait()

            waited = await granted_after_kill(stack, kill)
            st = await stack.until(gone("v"), timeout=GRANT_BOUND)
            # Nothing of the replica is left: the API server died with the launcher, its
            # engine core (which outlives it, as vLLM's) was killed by the keeper.
            await exited(procs, bound=5.0)
            print(f"{when}: granted {waited:.2f} s after the launcher's SIGKILL")
            assert waited < GRANT_BOUND
            assert st["gpus"][0]["foreign"] == []
            assert stack.overlaps() == 0


async def exited(procs: list[psutil.Process], bound: float) -> None:
    """Return once every process of `procs` has exited (a zombie counts: init may never
    reap it); `trio.TooSlowError` after `bound` s."""
    with trio.fail_after(bound):
        for p in procs:
            if not alive(p):
                continue
            try:
                fd = os.pidfd_open(p.pid)  # readable once it has exited, child or not
            except ProcessLookupError:
                continue
            try:
                if alive(p):  # still the same process: psutil checks its start time
                    await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)


async def ask_once(stack: Stack) -> None:
    """Another workload's ACQUIRE (its connection closed when cancelled)."""
    async with await stack.client() as c:
        await c.register("asker", pid=stack.sleeper(), park="cooperative", parked_max="1GiB")
        await c.acquire("asker")


# A child that starts a process of its own session (out of the reach of the launcher's
# keeper, which kills the child's process group) that takes GPU memory in a turn of the
# launcher's workload; the child then releases lazily (the memory stays resident) and
# waits.
ESCAPE = """
import subprocess, sys, time
from gpu_slicer.slicer.client import Slicer
HOLD = (
    "import os, sys, time; from stubs.fakegpu import Ledger; "
    "Ledger().alloc(os.getpid(), 0, 30 << 30, tag='weights', workload=sys.argv[1]); "
    "print('filled', os.getpid(), flush=True); time.sleep(600)"
)
with Slicer.from_env() as s, s.turn():
    g = subprocess.Popen([sys.executable, "-c", HOLD, s.workload], start_new_session=True,
                         stdout=subprocess.PIPE, text=True)
    print(g.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def workload_entry(st: dict[str, Any], name: str) -> dict[str, Any] | None:
    """STATUS's entry of workload ``name``, None when it has none."""
    return next((w for w in st["workloads"] if w["name"] == name), None)


async def test_what_a_workload_started_outside_its_tree_is_killed_after_its_launcher_dies() -> None:
    with trio.fail_after(90):
        async with (
            running_stack("--fault-kill-after", str(KILL_AFTER)) as stack,
            watching(stack) as events,
            launcher(stack, "run", "lf", [], child_code(ESCAPE)) as lw,
        ):
            escaped = int((await lw.text(lambda s: s.startswith("filled"))).split()[1])
            g = psutil.Process(escaped)
            try:
                assert os.getsid(escaped) != os.getsid(lw.proc.pid)
                await stack.until(state_of("lf", "idle"))
                # slicerd has seen it hold lf's memory (a look every 2 s at most): it is lf's.
                await stack.until(
                    lambda st: escaped in (workload_entry(st, "lf") or {}).get("gpu_pids", [])
                )

                async def kill() -> None:
                    lw.proc.kill()
                    await lw.wait()

                waited = await granted_after_kill(stack, kill)
                await stack.until(gone("lf"), timeout=GRANT_BOUND)
                await exited([g], 5)
            finally:
                if alive(g):
                    g.kill()  # the test failed: leave nothing behind
            mine = [e for e in events if e.get("workload") == "lf"]
            kinds = [e["event"] for e in mine]
            assert kinds.index("orphaned") < kinds.index("orphan-killed"), kinds
            killed = mine[kinds.index("orphan-killed")]
            assert killed["pids"] == [escaped], killed
            assert killed["text"].startswith("orphan of lf killed after "), killed
            assert killed["after"] >= KILL_AFTER
            print(
                f"escaped process: granted {waited:.2f} s after the launcher's SIGKILL; "
                f"{killed['text']}"
            )
            assert waited < GRANT_BOUND
            assert stack.overlaps() == 0
