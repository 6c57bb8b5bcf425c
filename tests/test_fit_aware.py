"""Fit-aware turns against the real daemon (``--fit-aware``): when the next workload's
memory is known and fits beside the outgoing one, the outgoing one is frozen (locked:
no CUDA work runs, its memory stays) and thawed (unlocked) at its next turn, so no
bytes move; a workload whose need is unknown, or a GPU without room, parks as before; a
restart finishes a freeze as a park. The fake GPU counts two *running* residents as an
overlap (a locked one is frozen), and refuses any allocation past capacity."""

from __future__ import annotations

import signal
from typing import Any

import psutil
import pytest
import trio

from gpu_slicer.slicer.client import AsyncSlicer
from tests.harness import GiB, cc_log, running_stack, state_of, workload

pytestmark = pytest.mark.integration

Census = tuple[str, ...]  # slicerd's --census flags


@pytest.fixture(params=["pids", "elimination"])
def census(request: pytest.FixtureRequest) -> Census:
    """Every test under both censuses: by the backend's pids, and by elimination (what
    `census = auto` picks in pod mode, where slicerd cannot read the backend's pids)."""
    return ("--census", str(request.param))


def sleeper(stack: Any, nbytes: int = 0, label: str | None = None) -> int:
    """A workload's process holding GPU 0's device node open (a CUDA context's), so that
    a census by elimination sees it may hold memory there. Those that hold nothing yet
    are registered before any other holds memory: by elimination a newcomer with the GPU
    open beside a resident workload is a suspect too (README, "PID namespaces")."""
    pid: int = stack.sleeper(nbytes, label=label, node=True)
    return pid


async def registered(stack: Any, *named: tuple[str, int]) -> list[AsyncSlicer]:
    """A registrant for each (name, bytes held) in order, each a sleeper of its own."""
    out = []
    for name, nbytes in named:
        r = await stack.client()
        await r.register(name, pid=sleeper(stack, nbytes, label=name if nbytes else None))
        out.append(r)
    return out


def ops_of(stack: Any, pid: int, since: int = 0) -> list[str]:
    """The checkpoint steps run on `pid` (CLI or library), from log entry `since` on."""
    return [e["op"] for e in cc_log(stack)[since:] if e.get("pid") == pid]


async def turn(client: AsyncSlicer, name: str) -> Any:
    """One whole turn of `name`: ACQUIRE, then RELEASE (lazy); the grant."""
    t = await client.acquire(name)
    await client.release(t)
    return t


async def a_then_b(stack: Any) -> tuple[int, int, AsyncSlicer, AsyncSlicer]:
    """a (30 GiB) takes a turn, then b (which never ran, so a is parked by checkpoint)
    takes one and allocates 20 GiB: both have run. Their pids and registrants."""
    rb, ra = await registered(stack, ("b", 0), ("a", 30 * GiB))
    pa, pb = stack.children[-1].pid, stack.children[-2].pid
    await turn(ra, "a")
    tb = await rb.acquire("b")
    stack.ledger.alloc(pb, 0, 20 * GiB, workload="b")
    await rb.release(tb)
    return pa, pb, ra, rb


async def test_two_that_fit_alternate_by_freeze_and_thaw_and_move_nothing(census: Census) -> None:
    with trio.fail_after(60):
        async with running_stack("--fit-aware", "--fit-headroom", "1GiB", *census) as stack:
            rb, ra = await registered(stack, ("b", 0), ("a", 30 * GiB))
            pa, pb = stack.children[-1].pid, stack.children[-2].pid
            await turn(ra, "a")
            tb = await rb.acquire("b")  # b never ran: its need is unknown, a is parked
            assert stack.ledger.state(pa) == "checkpointed"
            stack.ledger.alloc(pb, 0, 20 * GiB, workload="b")
            await rb.release(tb)
            ta = await ra.acquire("a")  # a needs its 30 GiB back: b is frozen beside it
            assert ta.restored and stack.ledger.state(pb) == "locked"
            st = await stack.status()
            assert st["census"] == census[1]
            assert workload(st, "b")["state"] == "frozen"  # type: ignore[index]
            assert workload(st, "b")["frozen_pids"] == [pb]  # type: ignore[index]
            await ra.release(ta)
            mark = len(cc_log(stack))
            for _ in range(3):
                tb = await turn(rb, "b")  # a frozen, b thawed
                assert not tb.restored  # its memory never left
                assert stack.ledger.state(pa) == "locked"
                ta = await turn(ra, "a")
                assert stack.ledger.state(pb) == "locked"
            # from then on only locks and unlocks: no byte moved either way
            assert set(ops_of(stack, pa, mark)) == {"lock", "unlock"}
            assert set(ops_of(stack, pb, mark)) == {"lock", "unlock"}
            st = await stack.status()
            assert st["totals"]["freezes"] >= 6 and st["totals"]["thaws"] >= 6
            assert workload(st, "a")["parks"] == 1  # type: ignore[index]
            await ra.aclose()
            await rb.aclose()
            assert stack.overlaps() == 0


async def test_no_room_parks_and_an_unknown_newcomer_parks_the_frozen_one(census: Census) -> None:
    with trio.fail_after(60):
        async with running_stack("--fit-aware", "--fit-headroom", "1GiB", *census) as stack:
            rb, rc, ra = await registered(stack, ("b", 0), ("c", 0), ("a", 50 * GiB))
            pb, pa = stack.children[-3].pid, stack.children[-1].pid
            await turn(ra, "a")
            tb = await rb.acquire("b")
            stack.ledger.alloc(pb, 0, 40 * GiB, workload="b")  # 50 + 40 > 80: no fit
            await rb.release(tb)
            ta = await ra.acquire("a")
            assert ta.restored
            assert stack.ledger.state(pb) == "checkpointed"  # parked, never frozen
            await ra.release(ta)
            tb = await rb.acquire("b")  # b restored; a (50 GiB) does not fit beside: parked
            assert tb.restored and stack.ledger.state(pa) == "checkpointed"
            stack.ledger.free(pb)  # b shrinks to 10 GiB: now a fits beside it
            stack.ledger.alloc(pb, 0, 10 * GiB, workload="b")
            await rb.release(tb)
            ta = await ra.acquire("a")
            assert stack.ledger.state(pb) == "locked"  # frozen this time
            await ra.release(ta)
            tc = await rc.acquire("c")  # c never ran: nothing may stay frozen beside it
            st = await stack.status()
            assert all(w["state"] != "frozen" for w in st["workloads"]), st["workloads"]
            assert stack.ledger.state(pa) == "checkpointed"
            assert stack.ledger.state(pb) == "checkpointed"
            assert ops_of(stack, pb)[-1] == "checkpoint"  # locked already: checkpoint only
            await rc.release(tc)
            for r in (ra, rb, rc):
                await r.aclose()
            assert stack.overlaps() == 0


async def test_a_restart_finishes_a_freeze_as_a_park(census: Census) -> None:
    with trio.fail_after(90):
        async with running_stack("--fit-aware", "--fit-headroom", "1GiB", *census) as stack:
            _pa, pb, ra, rb = await a_then_b(stack)
            await turn(ra, "a")  # b frozen
            assert stack.ledger.state(pb) == "locked"
            await stack.stop(signal.SIGKILL)
            await ra.aclose()
            await rb.aclose()
            await stack.start()
            await stack.until(state_of("b", "parked"))  # the lock was not forgotten
            assert stack.ledger.state(pb) == "checkpointed"
            rb = await stack.client()
            await rb.register("b", pid=pb)
            tb = await rb.acquire("b")
            assert tb.restored and stack.ledger.state(pb) == "running"
            await rb.release(tb)
            await rb.aclose()
            assert stack.overlaps() == 0


@pytest.mark.parametrize("always", [True, False])
async def test_the_rl_loop_moves_no_bytes_once_warm_and_a_slept_replica_is_never_frozen(
    always: bool, census: Census
) -> None:
    """The whole loop: vLLM (40% of the GPU) under the launcher, a 30 GiB trainer. With the
    dispatcher leaving vLLM awake at every turn's end (--lazy-sleep-always) slicerd freezes
    whichever is not running: once both have run, no byte moves and vLLM never sleeps.
    Without it the dispatcher sleeps vLLM whenever the trainer waits: a slept vLLM is never
    frozen (its wake would allocate beside a frozen trainer), the trainer is parked."""
    from tests.procs import free_port, spawn
    from tests.test_dispatcher import dispatcher, publish, replica_argv, result_of, trainer

    with trio.fail_after(120):
        async with running_stack("--fit-aware", "--fit-headroom", "1GiB", *census) as stack:
            port = free_port()
            argv = [*replica_argv(stack, port, "cooperative"), "--gpu-memory-utilization", "0.4"]
            async with spawn(stack, "launcher", argv) as lw:
                await lw.line(lambda s: "]: ready" in s)
                url = f"http://127.0.0.1:{port}"
                flags = ["--turn-seconds", "0.3", "--turn-grace", "2"]
                flags += ["--lazy-sleep-always"] if always else []
                async with dispatcher(stack, url, *flags) as (_d, http):
                    await publish(stack, http, "r1")
                    async with spawn(stack, "trainer", trainer(stack, 1000, 0.05)) as tr:
                        await tr.line(lambda s: s.startswith("step"))  # it holds 30 GiB
                        for rnd in range(5):
                            ids = []
                            for i in range(3):
                                body = {"prompt": f"q{rnd}-{i}", "max_tokens": 4}
                                r = await http.post("/v1/samples", json=body)
                                assert r.status_code == 202, r.text
                                ids.append(r.json()["id"])
                            for sid in ids:
                                got = await result_of(http, sid)
                                assert got["status"] == "done", got
                            if rnd == 1:
                                mark = len(cc_log(stack))
                        st = await stack.status()
                        steps = {e["op"] for e in cc_log(stack)[mark:]}
                v, trained = workload(st, "v"), workload(st, "trainer")
                assert v is not None and trained is not None and v["faults"] == 0
                after_boot = lw.output().split("]: ready")[-1]
                if always:
                    assert st["totals"]["freezes"] >= 4 and st["totals"]["thaws"] >= 4, st
                    assert steps == {"lock", "unlock"}, steps  # nothing moved after warm-up
                    assert "POST /sleep" not in after_boot
                else:
                    assert v["freezes"] == 0  # slept at each turn's end: parked, not frozen
                    assert "checkpoint" in steps and "POST /sleep" in after_boot
            assert stack.overlaps() == 0


async def test_a_frozen_workload_whose_registration_ends_is_parked_not_left_locked(
    census: Census,
) -> None:
    with trio.fail_after(60):
        async with running_stack("--fit-aware", "--fit-headroom", "1GiB", *census) as stack:
            _pa, pb, ra, rb = await a_then_b(stack)
            await turn(ra, "a")  # b frozen beside a
            assert stack.ledger.state(pb) == "locked"
            await rb.aclose()  # nobody will ever thaw b: its locked processes are parked
            st = await stack.until(state_of("b", "parked"))
            assert stack.ledger.state(pb) == "checkpointed"
            assert workload(st, "b")["frozen_pids"] == []  # type: ignore[index]
            await ra.aclose()
            assert stack.overlaps() == 0


async def test_a_thaw_cut_by_a_daemon_kill_is_finished_as_an_unlock(census: Census) -> None:
    with trio.fail_after(90):
        env = {"FAKEGPU_HANG_MAX": "2"}  # the hung unlock gives up by itself, still locked
        async with running_stack(
            "--fit-aware", "--fit-headroom", "1GiB", *census, env=env
        ) as stack:
            pa, pb, ra, rb = await a_then_b(stack)
            await turn(ra, "a")  # b frozen
            stack.ledger.inject(pb, "unlock", hang=True)
            async with trio.open_nursery() as n:

                async def cut_off() -> None:
                    with pytest.raises(Exception):  # noqa: B017 (the daemon dies under it)
                        await rb.acquire("b")

                n.start_soon(cut_off)
                await stack.until(state_of("b", "restoring"))  # the thaw's unlock hangs
                await stack.stop(signal.SIGKILL)
            await ra.aclose()
            await rb.aclose()
            tools = [
                p
                for p in psutil.process_iter(["cmdline"])
                if "cuda-checkpoint" in " ".join(p.info["cmdline"] or [])
                and str(pb) in (p.info["cmdline"] or [])
            ]
            for tool in tools:
                await trio.to_thread.run_sync(tool.wait, 20)  # it gave up: b still locked
            assert stack.ledger.state(pb) == "locked"
            stack.ledger.clear_injection(pb)
            await stack.start()
            rb = await stack.client()
            await rb.register("b", pid=pb)
            tb = await rb.acquire("b")  # recovered as an interrupted restore: unlocked
            assert stack.ledger.state(pb) == "running" and stack.ledger.state(pa) != "running"
            await rb.release(tb)
            await rb.aclose()
            assert stack.overlaps() == 0


async def test_a_restart_during_a_thaw_settles_it_by_what_the_driver_says(census: Census) -> None:
    with trio.fail_after(90):
        async with running_stack("--fit-aware", "--fit-headroom", "1GiB", *census) as stack:
            pa, pb, ra, rb = await a_then_b(stack)
            await turn(ra, "a")  # b frozen beside a
            assert stack.ledger.state(pb) == "locked"
            stack.ledger.inject(pb, "unlock", hang=True)
            async with trio.open_nursery() as n:
                n.start_soon(rb.acquire, "b")  # a is frozen, b's thaw hangs in its unlock
                await stack.until(state_of("b", "restoring"))
                n.cancel_scope.cancel()  # before the kill: the ACQUIRE would fail with it
            await stack.stop(signal.SIGKILL)
            await ra.aclose()
            await rb.aclose()
            stack.ledger.clear_injection(pb)
            await stack.start()
            # Whichever record the crash left (the freeze, or the thaw started: both are
            # written lazily), the driver's states settle it: a, still locked, is
            # checkpointed (the park under way); b is checkpointed too, unlocked first or
            # not (an orphan now: parked before anyone is granted).
            await stack.until(lambda st: (workload(st, "a") or {}).get("state") == "parked"
                              and (workload(st, "b") or {}).get("state") == "parked")  # fmt: skip
            assert stack.ledger.state(pa) == "checkpointed"
            assert stack.ledger.state(pb) == "checkpointed"
            ops = [op for op in ops_of(stack, pb) if op != "get-state"]  # recovery's reads
            assert ops[-1] == "checkpoint" and "restore" not in ops, ops
            rb = await stack.client()
            await rb.register("b", pid=pb)
            tb = await rb.acquire("b")
            assert tb.restored and stack.ledger.state(pb) == "running"
            await rb.release(tb)
            await rb.aclose()
            assert stack.overlaps() == 0
