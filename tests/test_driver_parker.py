"""The driver-API parker against the real daemon: slicerd's checkpoint helper calls the
fake libcuda (built here with gcc; its checkpoint functions act on the fake GPU ledger as
the cuda-checkpoint stub does) through ctypes. Parks and restores, failures and hangs,
a helper that dies, a daemon SIGKILLed while its helper works, and the choice of parker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from gpu_slicer.slicer.ckpthelper import MODULE
from gpu_slicer.slicer.client import AsyncSlicer, ClientError, Unreachable
from stubs import fakecuda
from tests.harness import (
    GiB,
    Stack,
    cc_log,
    next_fault,
    queue_is,
    running_stack,
    state_of,
    workload,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake driver library with the checkpoint API (r570-like)."""
    return fakecuda.build(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture(scope="session")
def libcuda_r550(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake driver library without the checkpoint API (r550-like)."""
    return fakecuda.build(tmp_path_factory.mktemp("fakecuda550"), checkpoint_api=False)


def helpers(state_dir: Path) -> list[psutil.Process]:
    """Live checkpoint helpers started for `state_dir`."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if MODULE in argv and str(state_dir) in argv and p.status() != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


async def log_says(path: Path, text: str) -> None:
    """Return once `text` is in the log at `path` (bounded by the caller; a log line has
    no event, so the file is read every 50 ms)."""
    while not (path.exists() and text in path.read_text(errors="replace")):
        await trio.sleep(0.05)


async def in_flight(stack: Any, n: int) -> None:
    """Return once STATUS shows `n` driver calls in flight (bounded by the caller; a call
    starting sends no WATCH event, so STATUS is read every 50 ms)."""
    while (await stack.status())["tools_running"] != n:
        await trio.sleep(0.05)


async def a_and_b(stack: Stack) -> tuple[int, int, AsyncSlicer, AsyncSlicer]:
    """Workload "a" (a 30 GiB sleeper) and "b" (an empty one), each REGISTERed on a client
    of its own: (pid a, pid b, client a, client b)."""
    pa, pb = stack.sleeper(30 * GiB, label="a"), stack.sleeper()
    reg_a, reg_b = await stack.client(), await stack.client()
    await reg_a.register("a", pid=pa)
    await reg_b.register("b", pid=pb)
    return pa, pb, reg_a, reg_b


def cli_runs(stack: Any) -> list[dict[str, Any]]:
    """The cuda-checkpoint CLI's invocations (the lib's calls are logged with via=lib)."""
    return [e for e in cc_log(stack) if e.get("via", "cli") == "cli"]


async def test_parks_and_restores_through_the_helper_with_no_cli_run(libcuda: Path) -> None:
    with trio.fail_after(60):
        async with running_stack("--parker", "driver", "--libcuda", str(libcuda)) as stack:
            st = await stack.status()
            assert st["parker"] == "driver"
            (helper,) = helpers(stack.base / "state")
            pa, pb, reg_a, reg_b = await a_and_b(stack)
            for i in range(3):
                ta = await reg_a.acquire("a")
                await reg_a.release(ta)
                tb = await reg_b.acquire("b")  # a is parked first: lock + checkpoint
                assert stack.ledger.state(pa) == "checkpointed"
                if i == 0:
                    stack.ledger.alloc(pb, 0, 20 * GiB, workload="b")
                await reg_b.release(tb)
            ta = await reg_a.acquire("a")  # restore + unlock, b parked first
            assert ta.restored and stack.ledger.state(pa) == "running"
            assert stack.ledger.state(pb) == "checkpointed"
            ops = [e["op"] for e in cc_log(stack) if e.get("via") == "lib" and e["pid"] == pa]
            assert ops[:4] == ["lock", "checkpoint", "restore", "unlock"]
            assert cli_runs(stack) == []  # no cuda-checkpoint launch at all
            assert helpers(stack.base / "state") == [helper]  # one helper, all along
            st = await stack.status()
            assert workload(st, "a")["parks"] >= 3  # type: ignore[index]
            await reg_a.aclose()
            await reg_b.aclose()
            assert stack.overlaps() == 0


async def test_a_failed_lock_faults_and_keeps_the_gpu(libcuda: Path) -> None:
    with trio.fail_after(60):
        flags = ("--parker", "driver", "--libcuda", str(libcuda), "--fault-kill-after", "30")
        async with running_stack(*flags) as stack:
            pa, _, reg_a, reg_b = await a_and_b(stack)
            t = await reg_a.acquire("a")
            stack.ledger.inject(pa, "lock")
            waiter = await stack.client()
            async with trio.open_nursery() as n:
                n.start_soon(waiter.acquire, "b")
                await stack.until(queue_is(["b"]))
                with pytest.raises(ClientError) as e:
                    await reg_a.release(t)
                assert e.value.code == "park-failed"
                fault = await next_fault(reg_a)
                assert fault.reason == "lock-failed"
                assert "CUDA_ERROR" in fault.text
                st = await stack.status()
                assert workload(st, "a")["state"] == "faulted"  # type: ignore[index]
                assert st["gpus"][0]["queue"] == ["b"]  # the GPU stays taken
                await reg_a.aclose()
                next(p for p in stack.children if p.pid == pa).kill()
            await stack.until(lambda st: st["gpus"][0]["holder"] is not None)
            await reg_b.aclose()
            await waiter.aclose()
            assert stack.overlaps() == 0


async def test_a_hung_checkpoint_times_out_and_the_helper_is_not_killed(libcuda: Path) -> None:
    with trio.fail_after(60):
        flags = ("--parker", "driver", "--libcuda", str(libcuda), "--park-timeout", "1")
        async with running_stack(*flags) as stack:
            pa, _, reg_a, reg_b = await a_and_b(stack)
            (helper,) = helpers(stack.base / "state")
            t = await reg_a.acquire("a")
            stack.ledger.inject(pa, "checkpoint", hang=True)
            waiter = await stack.client()
            async with trio.open_nursery() as n:
                n.start_soon(waiter.acquire, "b")
                await stack.until(queue_is(["b"]))
                with pytest.raises(ClientError):
                    await reg_a.release(t)
                fault = await next_fault(reg_a)
                assert fault.reason == "checkpoint-timeout"
                st = await stack.status()
                assert st["tools_running"] == 1  # the call is still in the driver
                assert helper.is_running()
                stack.ledger.clear_injection(pa)
                # it ends on its own; its late answer is read, the helper lives on
                await log_says(stack.log, f"checkpoint of pid {pa} ended after its bound: ok")
                st = await stack.status()
                assert st["tools_running"] == 0
                assert workload(st, "a")["state"] == "faulted"  # type: ignore[index]
                assert helpers(stack.base / "state") == [helper]
                await reg_a.aclose()
                next(p for p in stack.children if p.pid == pa).kill()
            await stack.until(lambda st: st["gpus"][0]["holder"] is not None)
            await reg_b.aclose()
            await waiter.aclose()
            assert stack.overlaps() == 0


async def test_a_helper_that_dies_mid_call_faults_and_the_next_starts_a_new_one(
    libcuda: Path,
) -> None:
    with trio.fail_after(60):
        async with running_stack("--parker", "driver", "--libcuda", str(libcuda)) as stack:
            pa, pb, pc = stack.sleeper(10 * GiB, label="a"), stack.sleeper(), stack.sleeper()
            regs = [await stack.client() for _ in range(3)]
            for reg, name, pid in zip(regs, "abc", (pa, pb, pc), strict=True):
                await reg.register(name, pid=pid)
            (first,) = helpers(stack.base / "state")
            t = await regs[0].acquire("a")
            stack.ledger.inject(pa, "lock", hang=True)
            got: list[Any] = []
            async with trio.open_nursery() as n:

                async def acquire_b() -> None:
                    got.append(await regs[1].acquire("b"))

                n.start_soon(acquire_b)
                await stack.until(queue_is(["b"]))

                async def release() -> None:
                    with pytest.raises(ClientError):
                        await regs[0].release(t)

                n.start_soon(release)
                await in_flight(stack, 1)
                first.kill()  # dies with the call in flight: its result is unknown
                fault = await next_fault(regs[0])
                assert fault.reason == "lock-failed"
                assert "checkpoint helper ended" in fault.text
                await regs[0].aclose()
                next(p for p in stack.children if p.pid == pa).kill()
            # b got the GPU once a's processes were gone; b's own park needs a new helper
            (tb,) = got
            stack.ledger.alloc(pb, 0, 10 * GiB, workload="b")
            await regs[1].release(tb)
            tc = await regs[2].acquire("c")
            assert stack.ledger.state(pb) == "checkpointed"
            (second,) = helpers(stack.base / "state")
            assert second.pid != first.pid
            await regs[2].release(tc)
            for reg in regs[1:]:
                await reg.aclose()
            assert stack.overlaps() == 0


async def test_a_daemon_killed_mid_park_waits_for_its_leftover_helper(libcuda: Path) -> None:
    with trio.fail_after(90):
        async with running_stack("--parker", "driver", "--libcuda", str(libcuda)) as stack:
            pa, _, reg_a, reg_b = await a_and_b(stack)
            ta = await reg_a.acquire("a")
            stack.ledger.inject(pa, "lock", hang=True)

            async def cut_off(call: Callable[[], Awaitable[Any]]) -> None:
                with pytest.raises((ClientError, Unreachable)):
                    await call()  # the daemon dies under it

            async with trio.open_nursery() as n:
                n.start_soon(cut_off, partial(reg_b.acquire, "b"))
                await stack.until(queue_is(["b"]))
                n.start_soon(cut_off, partial(reg_a.release, ta))
                await in_flight(stack, 1)
                (leftover,) = helpers(stack.base / "state")
                await stack.stop(signal.SIGKILL)
            await reg_a.aclose()
            await reg_b.aclose()
            assert leftover.is_running()  # its input ended; its call has not
            async with trio.open_nursery() as n:
                n.start_soon(stack.start)
                # the new daemon waits for the leftover before it recovers anything
                await log_says(stack.base / "slicerd.log", "of a previous slicerd to end")
                assert stack.ledger.state(pa) == "running"  # the lock is still in the driver
                stack.ledger.clear_injection(pa)
            await trio.to_thread.run_sync(leftover.wait, 20)
            st = await stack.until(state_of("a", "parked"))  # recovery finished the park
            assert stack.ledger.state(pa) == "checkpointed"
            assert st["parker"] == "driver"
            (fresh,) = helpers(stack.base / "state")
            assert fresh.pid != leftover.pid
            reg_a = await stack.client()
            await reg_a.register("a", pid=pa)
            ta = await reg_a.acquire("a")
            assert ta.restored and stack.ledger.state(pa) == "running"
            await reg_a.aclose()
            assert stack.overlaps() == 0


async def test_auto_takes_the_driver_api_only_where_the_library_has_it(
    libcuda: Path, libcuda_r550: Path, tmp_path: Path
) -> None:
    with trio.fail_after(60):
        async with running_stack("--parker", "auto", "--libcuda", str(libcuda)) as stack:
            assert (await stack.status())["parker"] == "driver"
        async with running_stack("--parker", "auto", "--libcuda", str(libcuda_r550)) as stack:
            assert (await stack.status())["parker"] == "cli"
            assert "lacks cuCheckpointProcessLock" in stack.log.read_text()  # type: ignore[union-attr]
        missing = str(tmp_path / "nowhere" / "libcuda.so.1")
        async with running_stack("--parker", "auto", "--libcuda", missing) as stack:
            st = await stack.status()
            assert st["parker"] == "cli" and helpers(stack.base / "state") == []


def test_parker_driver_without_the_api_refuses_to_start(libcuda_r550: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "gpu_slicer.slicer.daemon", "--gpu-backend", "fake"]
    argv += ["--socket", str(tmp_path / "s"), "--state-dir", str(tmp_path / "state")]
    argv += ["--parker", "driver", "--libcuda", str(libcuda_r550)]
    env = {**os.environ, "FAKEGPU_DIR": str(tmp_path / "gpu")}
    from stubs.fakegpu import Ledger

    Ledger.init(tmp_path / "gpu", 1, 80 * GiB)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 69, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "parker = driver" in last and "lacks cuCheckpointProcessLock" in last
    assert not (tmp_path / "s").exists()


NOISY_DRIVER = r"""
#include <stdio.h>
int cuInit(unsigned f){ (void)f; printf("noisy-driver: init banner\n"); fflush(stdout); return 0; }
int cuDriverGetVersion(int *v){ *v = 12080; return 0; }
int cuGetErrorName(int e, const char **s){ (void)e; *s = "X"; return 0; }
int cuGetErrorString(int e, const char **s){ (void)e; *s = "x"; return 0; }
int cuCheckpointProcessLock(int p, void *a){ (void)p; (void)a; puts("locking"); return 0; }
int cuCheckpointProcessCheckpoint(int p, void *a){ (void)p; (void)a; return 0; }
int cuCheckpointProcessRestore(int p, void *a){ (void)p; (void)a; return 0; }
int cuCheckpointProcessUnlock(int p, void *a){ (void)p; (void)a; return 0; }
int cuCheckpointProcessGetState(int p, int *s){ (void)p; *s = 0; return 0; }
"""


async def test_a_driver_library_that_prints_to_stdout_cannot_corrupt_the_answers(
    tmp_path: Path,
) -> None:
    src, lib = tmp_path / "noisy.c", tmp_path / "libnoisy.so"
    src.write_text(NOISY_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    with trio.fail_after(60):
        async with running_stack("--parker", "driver", "--libcuda", str(lib)) as stack:
            st = await stack.status()  # it started: the banner was not its ready line
            assert st["parker"] == "driver"
            pid = stack.sleeper()
            async with await stack.client() as c:
                await c.register("a", pid=pid)
                t = await c.acquire("a")
                await c.release(t, park="now")  # a lock that prints: still answered
            assert "noisy-driver: init banner" in stack.log.read_text()  # type: ignore[union-attr]
            assert stack.overlaps() == 0
