"""Fault paths against the real daemon: dead holders, failed and hung parks, restarts,
foreign processes, slow GPUs, unprivileged peers, clients that stop reading."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import psutil
import pytest
import trio

from gpu_slicer.slicer.client import ClientError, Unreachable
from tests.harness import GiB, cc_log, next_fault, queue_is, running_stack, state_of, workload

pytestmark = pytest.mark.integration


async def test_dead_holder_is_parked_before_the_next_grant() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pa, pb = stack.sleeper(30 * GiB, label="a"), stack.sleeper()
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=pa)
            await reg_b.register("b", pid=pb)
            dispatcher = await stack.client()
            await dispatcher.acquire("a")
            waiter = await stack.client()
            async with trio.open_nursery() as n:
                got = []

                async def wait_b() -> None:
                    got.append(await waiter.acquire("b"))

                n.start_soon(wait_b)
                await stack.until(queue_is(["b"]))
                await dispatcher.aclose()  # dies mid-turn, never releases
            # b was granted only after a's processes were checkpointed
            assert stack.ledger.state(pa) == "checkpointed"
            assert got[0].turn == 2
            st = await stack.status()
            assert workload(st, "a")["state"] == "parked"  # type: ignore[index]
            assert st["gpus"][0]["holder"]["workload"] == "b"
            for c in (reg_a, reg_b, waiter):
                await c.aclose()
            assert stack.overlaps() == 0


async def test_failed_park_faults_keeps_gpu_and_kills_after_deadline() -> None:
    with trio.fail_after(60):
        async with running_stack("--fault-kill-after", "1") as stack:
            pa, pb = stack.sleeper(30 * GiB, label="a"), stack.sleeper()
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=pa)
            await reg_b.register("b", pid=pb)
            holder = await stack.client()
            t = await holder.acquire("a")
            stack.ledger.inject(pa, "lock")
            waiter = await stack.client()
            async with trio.open_nursery() as n:
                granted = trio.Event()

                async def wait_b() -> None:
                    await waiter.acquire("b")
                    granted.set()

                n.start_soon(wait_b)
                await stack.until(queue_is(["b"]))
                with pytest.raises(ClientError) as e:
                    await holder.release(t)
                assert e.value.code == "park-failed"
                fault = await next_fault(reg_a)
                assert (fault.workload, fault.turn, fault.reason) == ("a", t.turn, "lock-failed")
                st = await stack.status()
                assert st["gpus"][0]["resident"] == "a"
                assert workload(st, "a")["state"] == "faulted"  # type: ignore[index]
                assert st["gpus"][0]["queue"] == ["b"] and not granted.is_set()
                # a faulted workload gets no turn
                with pytest.raises(ClientError) as e:
                    await holder.acquire("a")
                assert e.value.code == "faulted"
                # the registrant goes away but its process keeps the memory: the daemon
                # kills it after fault_kill_after, then grants b
                await reg_a.aclose()
                await granted.wait()
            proc = next(p for p in stack.children if p.pid == pa)
            assert proc.wait(timeout=5) == -signal.SIGKILL
            for c in (reg_b, holder, waiter):
                await c.aclose()
            assert stack.overlaps() == 0


async def test_hung_park_faults_at_timeout_without_killing_the_tool() -> None:
    with trio.fail_after(60):
        async with running_stack("--park-timeout", "1") as stack:
            pa, pb = stack.sleeper(30 * GiB, label="a"), stack.sleeper()
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=pa)
            await reg_b.register("b", pid=pb)
            t = await reg_a.acquire("a")
            stack.ledger.inject(pa, "checkpoint", hang=True)
            waiter = await stack.client()
            async with trio.open_nursery() as n:
                n.start_soon(waiter.acquire, "b")
                await stack.until(queue_is(["b"]))
                with pytest.raises(ClientError) as e:
                    await reg_a.release(t)
                assert e.value.code == "park-failed"
                fault = await next_fault(reg_a)
                assert fault.reason == "checkpoint-timeout"
                st = await stack.status()
                assert st["tools_running"] == 1  # the tool was not killed
                assert st["gpus"][0]["resident"] == "a" and st["gpus"][0]["queue"] == ["b"]
                tools = [
                    p
                    for p in psutil.process_iter(["cmdline"])
                    if "cuda-checkpoint" in " ".join(p.info["cmdline"] or [])
                    and str(pa) in (p.info["cmdline"] or [])
                ]
                assert len(tools) == 1
                stack.ledger.clear_injection(pa)
                await trio.to_thread.run_sync(tools[0].wait, 10)
                # it finished on its own; the workload stays faulted, the GPU taken
                st = await stack.status()
                assert st["tools_running"] == 0
                assert workload(st, "a")["state"] == "faulted"  # type: ignore[index]
                assert st["gpus"][0]["queue"] == ["b"]
                await reg_a.aclose()
                next(p for p in stack.children if p.pid == pa).kill()
            await stack.until(lambda st: st["gpus"][0]["holder"] is not None)
            await reg_b.aclose()
            await waiter.aclose()
            assert stack.overlaps() == 0


async def test_restart_after_sigkill_loses_no_workload() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack:
            pa, pb = stack.sleeper(20 * GiB, label="a"), stack.sleeper()
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=pa)
            await reg_b.register("b", pid=pb)
            ta = await reg_a.acquire("a")
            async with trio.open_nursery() as n:
                n.start_soon(reg_b.acquire, "b")
                await stack.until(queue_is(["b"]))
                await reg_a.release(ta)
            stack.ledger.alloc(pb, 0, 30 * GiB, workload="b")
            assert stack.ledger.state(pa) == "checkpointed"
            await stack.stop(signal.SIGKILL)
            await stack.start()
            # the old connections are gone; clients reconnect and re-register
            with pytest.raises(Unreachable):
                await reg_a.ping()
            await reg_a.aclose()
            await reg_b.aclose()
            st = await stack.until(state_of("b", "parked"))  # b was resident: parked
            assert stack.ledger.state(pb) == "checkpointed"
            assert {w["name"] for w in st["workloads"]} == {"a", "b"}
            reg_a, reg_b = await stack.client(), await stack.client()
            ra = await reg_a.register("a", pid=pa)
            rb = await reg_b.register("b", pid=pb)
            assert ra["state"] == "parked" and rb["state"] == "parked"
            st = await stack.status()
            assert workload(st, "a")["parks"] == 1  # type: ignore[index]
            tb = await reg_b.acquire("b")
            assert tb.restored
            assert stack.ledger.state(pb) == "running"
            await reg_b.release(tb)
            ta = await reg_a.acquire("a")
            assert ta.restored and ta.turn > tb.turn
            await reg_a.aclose()
            await reg_b.aclose()
            assert stack.overlaps() == 0


async def test_foreign_process_blocks_grants_until_it_exits() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            stranger = stack.sleeper(10 * GiB, label="stranger")
            async with await stack.client() as c:
                await c.register("a", pid=stack.sleeper())
                async with trio.open_nursery() as n:
                    got = []

                    async def take() -> None:
                        got.append(await c.acquire("a"))

                    n.start_soon(take)
                    st = await stack.until(lambda st: st["gpus"][0]["foreign"] != [])
                    assert st["gpus"][0]["foreign"] == [{"pid": stranger, "bytes": 10 * GiB}]
                    assert not got
                    next(p for p in stack.children if p.pid == stranger).kill()
                assert got[0].turn == 1
                assert (await stack.status())["gpus"][0]["foreign"] == []
            assert stack.overlaps() == 0


async def test_a_park_on_gpu0_never_delays_gpu1_or_status() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pa = stack.sleeper(30 * GiB, label="a")
            reg = await stack.client()
            await reg.register("a", pid=pa)
            await reg.register("b", pid=stack.sleeper())
            await reg.register("c", gpu=1, pid=stack.sleeper())
            ca, cb, cc = await stack.client(), await stack.client(), await stack.client()
            t = await ca.acquire("a")
            stack.ledger.inject(pa, "checkpoint", hang=True)
            async with trio.open_nursery() as n:
                n.start_soon(cb.acquire, "b")
                await stack.until(queue_is(["b"]))
                n.start_soon(ca.release, t)
                await stack.until(state_of("a", "parking"))
                with trio.fail_after(3):  # while GPU 0's park hangs
                    tc = await cc.acquire("c")
                    st = await stack.status()
                assert st["gpus"][1]["holder"] == {"workload": "c", "turn": tc.turn}
                assert st["gpus"][0]["busy"] == "park"
                stack.ledger.clear_injection(pa)
            st = await stack.status()
            assert st["gpus"][0]["holder"]["workload"] == "b"
            for c in (reg, ca, cb, cc):
                await c.aclose()
            assert stack.overlaps() == 0


UNPRIVILEGED = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rwb")
for line in sys.argv[2:]:
    f.write(line.encode() + b"\n"); f.flush()
    print(f.readline().decode().strip())
"""


SYSTEM_PYTHON = "/usr/bin/python3"  # the venv's interpreter may be unreachable for nobody


def as_nobody(sock: str, *lines: str, group: int | None = None) -> list[str]:
    """Send `lines` to slicerd as uid 65534 (gid `group` when given); its reply lines."""
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", UNPRIVILEGED, sock, *lines],
        user=65534,
        group=group,
        capture_output=True,
        timeout=30,
        check=True,
    )
    return out.stdout.decode().splitlines()


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs /usr/bin/python3")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
async def test_unprivileged_peer_cannot_touch_other_uids() -> None:
    with trio.fail_after(60):
        async with running_stack("--socket-mode", "666") as stack:
            root_pid = stack.sleeper()
            async with await stack.client() as reg:
                await reg.register("rootjob", pid=root_pid)
                lines = as_nobody(
                    stack.socket,
                    f"REGISTER stolen pid={root_pid}",
                    "ACQUIRE rootjob",
                    "UNREGISTER rootjob",
                    "PING",
                )
                assert lines[0].startswith("ERR forbidden")
                assert lines[1].startswith("ERR forbidden")
                assert lines[2].startswith("ERR not-registrant")
                assert lines[3] == "OK"
                st = await stack.status()
                assert [w["name"] for w in st["workloads"]] == ["rootjob"]
            assert stack.overlaps() == 0


async def test_a_client_that_stops_reading_is_dropped() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack:
            lazy = socket.socket(socket.AF_UNIX)
            lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            lazy.connect(stack.socket)
            lazy.sendall(b"WATCH\n")  # ... and never reads again
            async with await stack.client() as c:
                await c.register("w", pid=stack.sleeper())
                for _ in range(3000):
                    t = await c.acquire("w")
                    await c.release(t)
                    if (await c.status())["connections"] == 1:
                        break
                st = await c.status()
                assert st["connections"] == 1  # only us: the lazy watcher was dropped
            lazy.close()
            log = stack.log.read_text() if stack.log else ""
            assert "client stopped reading" in log or "write blocked" in log
            assert stack.overlaps() == 0


async def test_toggle_only_driver_parks_and_restores_with_toggle() -> None:
    with trio.fail_after(60):
        async with running_stack(env={"FAKEGPU_CC_TOGGLE_ONLY": "1"}) as stack:
            pa = stack.sleeper(8 * GiB, label="a")
            async with await stack.client() as c:
                await c.register("a", pid=pa)
                await c.register("b", pid=stack.sleeper())
                t = await c.acquire("a")
                await c.release(t, park="now")
                assert stack.ledger.state(pa) == "checkpointed"
                t = await c.acquire("a")
                assert t.restored and stack.ledger.state(pa) == "running"
            ops = [e["argv"][0] for e in cc_log(stack) if e.get("pid") == pa]
            assert ops == ["--toggle", "--toggle"]
            assert stack.overlaps() == 0


async def test_a_workload_exiting_during_its_park_is_not_a_fault() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pa = stack.sleeper(30 * GiB, label="a")
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=pa)
            await reg_b.register("b", pid=stack.sleeper())
            t = await reg_a.acquire("a")
            stack.ledger.inject(pa, "lock", hang=True)  # the tool blocks on this pid ...
            async with trio.open_nursery() as n:
                got = []

                async def wait_b() -> None:
                    got.append(await reg_b.acquire("b"))

                n.start_soon(wait_b)
                await stack.until(queue_is(["b"]))
                n.start_soon(reg_a.release, t)
                await stack.until(state_of("a", "parking"))
                # ... while the workload's process exits: the driver frees its memory
                next(p for p in stack.children if p.pid == pa).kill()
            st = await stack.status()
            assert got[0].turn == t.turn + 1
            assert st["totals"]["faults"] == 0
            assert workload(st, "a")["state"] == "parked"  # type: ignore[index]
            await reg_a.aclose()
            await reg_b.aclose()
            assert stack.overlaps() == 0


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs /usr/bin/python3")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
async def test_allow_group_lets_members_take_turns_but_not_register_others() -> None:
    import grp

    group = grp.getgrgid(65534).gr_name  # nobody's group ("nogroup" on Debian)
    with trio.fail_after(60):
        async with running_stack("--socket-mode", "666", "--allow-group", group) as stack:
            root_pid = stack.sleeper()
            async with await stack.client() as reg:
                await reg.register("rootjob", pid=root_pid)
                lines = as_nobody(
                    stack.socket,
                    f"REGISTER stolen pid={root_pid}",
                    "ACQUIRE rootjob",
                    "RELEASE rootjob turn=1",
                    group=65534,
                )
                assert lines[0].startswith("ERR forbidden")
                assert lines[1].startswith("OK turn=1")
                assert lines[2].startswith("OK parked=0")
            assert stack.overlaps() == 0
