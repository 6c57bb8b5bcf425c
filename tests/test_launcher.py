"""`slicer-launch`: a real launcher process against a real slicerd on the fake GPU.

Every wait is event-driven and bounded: WATCH-driven `stack.until`, process exits under
`trio.fail_after`, or lines the child prints on the launcher's stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psutil
import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import ClientError
from tests.harness import Stack, running_stack, state_of, workload
from tests.procs import Proc, free_port, spawn

pytestmark = pytest.mark.integration

IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "


@asynccontextmanager
async def launcher(
    stack: Stack,
    mode: str,
    name: str,
    opts: list[str],
    command: list[str],
    socket_path: str | None = None,
) -> AsyncIterator[Proc]:
    """Start `slicer-launch MODE` for `command`; on the way out, kill whatever is left."""
    argv = [sys.executable, "-m", "gpu_slicer.launcher.main", mode, "--workload", name]
    argv += ["--socket", socket_path or stack.socket, *opts, "--", *command]
    async with spawn(stack, f"launcher {name}", argv) as launched:
        yield launched


@asynccontextmanager
async def spawned(stack: Stack, argv: list[str]) -> AsyncIterator[trio.Process]:
    """A helper process (stdout discarded), killed on the way out if still running."""
    proc = await trio.lowlevel.open_process(argv, env=stack.env, stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.move_on_after(10):
            await proc.wait()


def child_code(code: str) -> list[str]:
    """argv of a python child running `code`."""
    return [sys.executable, "-c", code]


def registered_by(name: str, pid: int) -> Callable[[dict[str, Any]], bool]:
    """Predicate: `name` is registered by the process `pid`."""

    def pred(st: dict[str, Any]) -> bool:
        w = workload(st, name)
        return w is not None and (w.get("registrant") or {}).get("pid") == pid

    return pred


def gone(name: str) -> Callable[[dict[str, Any]], bool]:
    """Predicate: no workload `name`."""
    return lambda st: workload(st, name) is None


def alive(p: psutil.Process) -> bool:
    """`p` runs (a zombie waiting to be reaped by init does not count)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_alive(pgid: int) -> list[int]:
    """Live, non-zombie pids of process group `pgid`."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


# ---- run mode --------------------------------------------------------------------------

REPORT = """
import json, os, sys
from gpu_slicer.slicer.client import Slicer
with Slicer() as s:
    st = s.status()
w = [w for w in st["workloads"] if w["name"] == os.environ["SLICER_WORKLOAD"]][0]
print(json.dumps({"socket": os.environ["SLICER_SOCKET"], "workload": w, "me": os.getpid(),
                  "pgid": os.getpgid(0)}), flush=True)
sys.exit(7)
"""


async def test_run_propagates_exit_code_env_and_registration() -> None:
    with trio.fail_after(30):
        async with running_stack() as stack:
            async with launcher(stack, "run", "job", [], child_code(REPORT)) as lw:
                report = json.loads(await lw.text(lambda s: s.startswith("{")))
                assert await lw.wait() == 7
            assert report["socket"] == stack.socket
            w = report["workload"]
            assert w["name"] == "job" and w["registrant"]["pid"] == lw.proc.pid
            # registered for the launcher's pid with tree=1: the child counts
            assert report["me"] in w["pids"] and lw.proc.pid in w["pids"]
            assert report["pgid"] == report["me"]  # its own process group
            await stack.until(gone("job"))  # the registration ended with the launcher
            assert "exited with code 7" in lw.output()
            assert stack.overlaps() == 0


async def test_run_max_turn_registers_for_preemption_and_cooperative_is_refused() -> None:
    with trio.fail_after(30):
        async with running_stack() as stack:
            opts = ["--max-turn", "90"]
            async with launcher(stack, "run", "job", opts, child_code(REPORT)) as lw:
                report = json.loads(await lw.text(lambda s: s.startswith("{")))
                assert await lw.wait() == 7
            assert report["workload"]["max_turn"] == 90.0
            opts = ["--max-turn", "90", "--park", "cooperative"]
            async with launcher(stack, "run", "coop", opts, child_code(REPORT)) as lw:
                assert await lw.wait() == 64
            assert "--max-turn needs --park checkpoint" in lw.output()
            assert "coop" not in {w["name"] for w in (await stack.status())["workloads"]}
            assert stack.overlaps() == 0


async def test_trainer_under_launcher_takes_turns_with_another_trainer() -> None:
    trainer = [sys.executable, "-m", "stubs.trainer_stub", "--bytes", "30GiB", "--work", "0.05"]
    with trio.fail_after(60):
        async with running_stack() as stack:
            cmd = [*trainer, "--no-register", "--workload", "ta", "--steps", "4"]
            async with launcher(stack, "run", "ta", [], cmd) as lw:
                tb = [*trainer, "--workload", "tb", "--steps", "4", "--socket", stack.socket]
                async with spawned(stack, tb) as other:
                    with trio.fail_after(40):
                        assert await other.wait() == 0
                assert await lw.wait(40) == 0
            steps = [s for s in lw.lines if s.startswith("step")]
            assert len(steps) == 4
            st = await stack.until(gone("ta"))
            assert st["totals"]["grants"] >= 8 and st["totals"]["parks"] >= 1
            assert stack.overlaps() == 0


# a child that takes one turn of the launcher's workload, fills the GPU, releases (lazy:
# it stays resident and idle), then waits
FILL_AND_WAIT = """
import os, sys, time
from gpu_slicer.slicer.client import Slicer
from stubs.fakegpu import Ledger
with Slicer.from_env() as s, s.turn():
    Ledger().alloc(os.getpid(), 0, 30 << 30, tag="weights", workload=s.workload)
print("filled", os.getpid(), flush=True)
time.sleep(600)
"""


async def test_fault_kills_the_child_group_and_the_waiter_is_granted_next() -> None:
    with trio.fail_after(40):
        async with running_stack() as stack:
            async with launcher(stack, "run", "lf", [], child_code(FILL_AND_WAIT)) as lw:
                child = int((await lw.text(lambda s: s.startswith("filled"))).split()[1])
                await stack.until(state_of("lf", "idle"))
                stack.ledger.inject(child, "lock")  # its park will fail
                async with await stack.client() as reg_b, await stack.client() as acq_b:
                    await reg_b.register("b", pid=stack.sleeper())
                    t0 = time.monotonic()
                    async with trio.open_nursery() as n:
                        n.start_soon(acq_b.acquire, "b")
                        rc = await lw.wait(5 + 3)
                        took = time.monotonic() - t0
                    # acquire returned: b was granted once lf's processes were gone
                    st = await stack.status()
                    assert st["gpus"][0]["holder"]["workload"] == "b"
            assert rc == 70 and took < 5 + 3
            assert "reason=lock-failed" in lw.output()
            assert not psutil.pid_exists(child) and group_alive(child) == []
            assert stack.overlaps() == 0


async def test_sigterm_escalates_to_sigkill_and_leaves_no_orphans() -> None:
    grandchild = IGNORE_TERM + "import time; print('grandchild', flush=True); time.sleep(600)"
    code = (
        IGNORE_TERM + "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
        "print('ready', flush=True); time.sleep(600)"
    )
    grace = 1.5
    with trio.fail_after(30):
        async with running_stack() as stack:
            opts = ["--kill-grace", str(grace)]
            async with launcher(stack, "run", "stubborn", opts, child_code(code)) as lw:
                await lw.text(lambda s: s == "ready")
                await lw.text(lambda s: s == "grandchild")
                procs = lw.descendants()
                assert len(procs) == 2
                pgid = os.getpgid(procs[0].pid)
                t0 = time.monotonic()
                lw.proc.send_signal(signal.SIGTERM)
                rc = await lw.wait(grace + 5)
                took = time.monotonic() - t0
            assert rc == 128 + signal.SIGKILL  # the child's code: SIGKILLed after the grace
            assert grace <= took < grace + 3
            assert not any(alive(p) for p in procs)
            assert group_alive(pgid) == []
            assert "SIGKILL" in lw.output()
            await stack.until(gone("stubborn"))
            assert stack.overlaps() == 0


async def test_slicerd_restart_reregisters_and_the_child_keeps_running() -> None:
    code = "import time; print('up', flush=True); time.sleep(600)"
    with trio.fail_after(40):
        async with running_stack() as stack:
            async with launcher(stack, "run", "lr", [], child_code(code)) as lw:
                await lw.text(lambda s: s == "up")
                await stack.until(registered_by("lr", lw.proc.pid))
                (child,) = lw.descendants()
                await stack.stop(signal.SIGKILL)
                await stack.start()
                st = await stack.until(registered_by("lr", lw.proc.pid))
                assert child.pid in workload(st, "lr")["pids"]  # type: ignore[index]
                assert alive(child) and lw.proc.returncode is None
                lw.proc.send_signal(signal.SIGTERM)
                assert await lw.wait() == 128 + signal.SIGTERM  # the child's own death
            assert lw.output().count("registered lr") == 2
            assert "lost slicerd" in lw.output()
            await stack.until(gone("lr"))
            assert stack.overlaps() == 0


async def test_refused_register_exits_78_without_starting_the_child() -> None:
    code = "print('started', flush=True)"
    with trio.fail_after(20):
        async with running_stack() as stack, await stack.client() as holder:
            await holder.register("taken", pid=stack.sleeper())
            async with launcher(stack, "run", "taken", [], child_code(code)) as lw:
                assert await lw.wait() == 78
            assert "refused" in lw.output() and "started" not in lw.lines
            assert stack.overlaps() == 0


# ---- vLLM profile ----------------------------------------------------------------------


def vllm_stub(name: str, port: int, *extra: str) -> list[str]:
    """`vllm serve` as the stub (ledger label = workload name); no --enable-sleep-mode:
    the launcher adds it."""
    stub = [sys.executable, "-m", "stubs.vllm_stub", "serve", "m", "--port", str(port)]
    return [*stub, "--fake-workload", name, *extra]


@asynccontextmanager
async def watching(stack: Stack) -> AsyncIterator[list[dict[str, Any]]]:
    """The WATCH stream's event bodies, collected while the block runs."""
    events: list[dict[str, Any]] = []
    async with await stack.client() as w, trio.open_nursery() as n:
        await w.request(proto.Watch())

        async def collect() -> None:
            while True:
                msg = await w.next_message()
                if isinstance(msg, proto.Event):
                    events.append(msg.body)

        n.start_soon(collect)
        yield events
        n.cancel_scope.cancel()


def holder_is(name: str, turn: int | None = None) -> Callable[[dict[str, Any]], bool]:
    """Predicate: GPU 0's turn is held by `name` (turn `turn` when given)."""

    def pred(st: dict[str, Any]) -> bool:
        h = st["gpus"][0]["holder"]
        return h is not None and h["workload"] == name and turn in (None, h["turn"])

    return pred


async def sampler_turn(stack: Stack, url: str) -> None:
    """What a dispatcher does with a turn: wake, serve one request, sleep, release."""
    async with await stack.client() as c, httpx.AsyncClient(base_url=url, timeout=10) as http:
        t = await c.acquire("v")
        assert (await http.post("/wake_up")).status_code == 200
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        assert (await http.post("/sleep?level=1")).status_code == 200
        await c.release(t)


async def test_vllm_boots_in_a_turn_then_takes_turns_with_a_trainer() -> None:
    port = free_port()
    trainer = [sys.executable, "-m", "stubs.trainer_stub", "--bytes", "30GiB", "--work", "0.05"]
    with trio.fail_after(60):
        async with running_stack() as stack, watching(stack) as events:
            ready = stack.base / "ready"
            opts = ["--ready-file", str(ready)]
            async with launcher(stack, "vllm", "v", opts, vllm_stub("v", port)) as lw:
                t0 = time.monotonic()
                await lw.text(lambda s: "]: ready" in s)
                boot_to_ready = time.monotonic() - t0
                assert ready.read_text().split()[0] == "v"
                mine = [e for e in events if e.get("workload") == "v"]
                kinds = [e["event"] for e in mine]
                granted = kinds.index("granted")
                released = kinds.index("released")
                assert granted < released
                assert mine[granted]["turn"] == mine[released]["turn"]
                order = [
                    "boot turn 1 granted",
                    "stub: healthy",
                    "stub: slept",
                    "released",
                    "]: ready",
                ]
                assert [lw.index(x) for x in order] == sorted(lw.index(x) for x in order)
                assert "--enable-sleep-mode" in lw.output()
                # afterwards: a trainer and the sampler take turns on one GPU
                tb = [*trainer, "--workload", "tb", "--steps", "3", "--socket", stack.socket]
                async with spawned(stack, tb) as other:
                    for _ in range(2):
                        await sampler_turn(stack, f"http://127.0.0.1:{port}")
                    with trio.fail_after(20):
                        assert await other.wait() == 0
                assert stack.overlaps() == 0
                lw.proc.send_signal(signal.SIGTERM)
                assert await lw.wait() == 0  # the stub shuts down cleanly once up
                assert not ready.exists()
            print(f"boot-to-ready under the launcher: {boot_to_ready:.2f} s")
            st = await stack.until(gone("v"))
            assert st["totals"]["grants"] >= 6
            assert stack.overlaps() == 0


async def test_vllm_boot_timeout_leaves_nothing_running() -> None:
    with trio.fail_after(30):
        async with running_stack() as stack, await stack.client() as hog:
            await hog.register("hog", pid=stack.sleeper())
            await hog.acquire("hog")  # and never releases
            ready = stack.base / "ready"
            ready.write_text("stale\n")
            opts = ["--ready-file", str(ready), "--boot-timeout", "0.5"]
            cmd = vllm_stub("v", free_port())
            async with launcher(stack, "vllm", "v", opts, cmd) as lw:
                assert await lw.wait(10) == 75
            assert "boot turn not granted" in lw.output()
            assert "stub:" not in lw.output()  # vLLM never started
            assert not ready.exists()  # the stale marker went at start
            st = await stack.until(gone("v"))
            assert st["gpus"][0]["holder"]["workload"] == "hog"
            assert stack.overlaps() == 0


async def test_vllm_sigterm_during_boot_escalates_and_leaves_no_orphans() -> None:
    grace = 1.5
    with trio.fail_after(30):
        async with running_stack() as stack:
            ready = stack.base / "ready"
            opts = ["--ready-file", str(ready), "--kill-grace", str(grace)]
            cmd = vllm_stub("v", free_port(), "--boot-delay", "60")
            async with launcher(stack, "vllm", "v", opts, cmd) as lw:
                # the API server ignores SIGTERM from its start until it is healthy
                await lw.text(lambda s: "engine core pid=" in s)
                procs = lw.descendants()
                assert len(procs) == 2  # api server + engine core
                await stack.until(holder_is("v"))
                t0 = time.monotonic()
                lw.proc.send_signal(signal.SIGTERM)
                rc = await lw.wait(grace + 5)
                took = time.monotonic() - t0
            assert rc == 128 + signal.SIGKILL and grace <= took < grace + 3
            assert not any(alive(p) for p in procs)
            assert group_alive(procs[0].pid) == []
            assert not ready.exists() and "]: ready" not in lw.output()
            st = await stack.until(gone("v"))
            assert st["gpus"][0]["holder"] is None
            assert stack.overlaps() == 0


async def test_stale_turn_cannot_end_the_boot_turn_of_a_restarted_launcher() -> None:
    with trio.fail_after(40):
        async with running_stack() as stack, await stack.client() as stale:
            port = free_port()
            async with launcher(stack, "vllm", "v", [], vllm_stub("v", port)) as first:
                await first.text(lambda s: "]: ready" in s)
                old = await stale.acquire("v")  # a dispatcher's turn of the first replica
                first.proc.send_signal(signal.SIGTERM)
                assert await first.wait() == 0
            await stack.until(gone("v"))
            cmd = vllm_stub("v", port, "--boot-delay", "1")
            async with launcher(stack, "vllm", "v", [], cmd) as second:
                st = await stack.until(holder_is("v"))
                boot_turn = st["gpus"][0]["holder"]["turn"]
                assert boot_turn > old.turn
                for turn in (old.turn, boot_turn):
                    with pytest.raises(ClientError) as e:
                        await stale.release(dataclasses.replace(old, turn=turn))
                    assert e.value.code == "not-holder"
                assert holder_is("v", boot_turn)(await stack.status())
                await second.text(lambda s: "]: ready" in s)
                assert f"boot turn {boot_turn} released" in second.output()
                second.proc.send_signal(signal.SIGTERM)
                assert await second.wait() == 0
            assert stack.overlaps() == 0


async def test_vllm_fault_stops_the_stub_and_the_waiter_is_granted_next() -> None:
    with trio.fail_after(40):
        async with running_stack() as stack:
            opts = ["--park", "checkpoint"]
            async with launcher(stack, "vllm", "v", opts, vllm_stub("v", free_port())) as lw:
                core = int((await lw.text(lambda s: "engine core pid=" in s)).split("=")[-1])
                await lw.text(lambda s: "]: ready" in s)
                assert stack.ledger.state(core) == "checkpointed"  # parked at release
                stack.ledger.inject(core, "restore")
                async with await stack.client() as d, await stack.client() as b:
                    await b.register("b", pid=stack.sleeper())
                    with pytest.raises(ClientError) as e:
                        await d.acquire("v")
                    assert e.value.code == "restore-failed"
                    t0 = time.monotonic()
                    async with trio.open_nursery() as n:
                        n.start_soon(b.acquire, "b")
                        rc = await lw.wait(5 + 3)
                        took = time.monotonic() - t0
                    assert holder_is("b")(await stack.status())
            assert rc == 70 and took < 5 + 3
            assert "reason=restore-failed" in lw.output()
            assert not psutil.pid_exists(core) or not alive(psutil.Process(core))
            assert stack.overlaps() == 0


async def test_vllm_keeps_serving_across_a_slicerd_restart() -> None:
    port = free_port()
    with trio.fail_after(40):
        async with running_stack() as stack:
            ready = stack.base / "ready"
            opts = ["--ready-file", str(ready)]
            async with launcher(stack, "vllm", "v", opts, vllm_stub("v", port)) as lw:
                await lw.text(lambda s: "]: ready" in s)
                await stack.stop(signal.SIGKILL)
                await stack.start()
                await stack.until(registered_by("v", lw.proc.pid))
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                    assert (await http.get("/health")).status_code == 200
                    assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
                assert ready.exists() and lw.proc.returncode is None
                await sampler_turn(stack, f"http://127.0.0.1:{port}")
                lw.proc.send_signal(signal.SIGTERM)
                assert await lw.wait() == 0
            assert not ready.exists()
            assert stack.overlaps() == 0


async def test_unreachable_slicerd_and_missing_command_exit_codes() -> None:
    with trio.fail_after(20):
        async with running_stack() as stack:
            nobody = str(stack.base / "nobody.sock")
            opts = ["--connect-timeout", "0.3"]
            async with launcher(stack, "run", "u", opts, child_code("pass"), nobody) as lw:
                assert await lw.wait() == 69
            assert "nobody.sock" in lw.output()
            missing = [str(stack.base / "no-such-program")]
            async with launcher(stack, "run", "m", [], missing) as lw:
                assert await lw.wait() == 127
            await stack.until(gone("m"))
            assert stack.overlaps() == 0


async def test_vllm_whose_port_is_taken_fails_fast_and_never_gets_ready() -> None:
    """Another listener on the replica's port (a vLLM a SIGKILLed launcher left behind on
    bare metal) would answer /health and /sleep in the replica's place."""
    with trio.fail_after(30):
        async with running_stack() as stack, trio.open_nursery() as nursery:
            squatter = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = squatter[0].socket.getsockname()[1]
            nursery.start_soon(trio.serve_listeners, lambda s: s.aclose(), squatter)
            ready = stack.base / "ready"
            opts = ["--ready-file", str(ready)]
            async with watching(stack) as events:
                async with launcher(stack, "vllm", "v", opts, vllm_stub("v", port)) as lw:
                    assert await lw.wait(15) == 1
                await stack.until(gone("v"))
            err = [line for line in lw.output().splitlines() if "error:" in line]
            assert err == [
                f"slicer-launch: error: vLLM boot failed: 127.0.0.1:{port} is taken: another "
                "process listens there, and would answer for the replica (stop it (a vLLM "
                "left from an earlier launch?), or give the server another --port)"
            ], lw.output()
            assert "stub:" not in lw.output()  # the server never started
            assert not ready.exists()
            # No boot turn was asked for: nothing was granted, nobody parked.
            assert not [e for e in events if e.get("event") == "grant"], events
            assert (await stack.status())["totals"]["grants"] == 0
            nursery.cancel_scope.cancel()
            assert stack.overlaps() == 0
