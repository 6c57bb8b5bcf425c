"""The real daemon over a real socket: requests, bad input, turns, connection binding."""

from __future__ import annotations

import contextlib
import dataclasses
import socket

import pytest
import trio

from gpu_slicer.slicer.client import ClientError
from tests.harness import GiB, cc_log, running_stack, workload

pytestmark = pytest.mark.integration


async def raw_exchange(path: str, lines: list[bytes]) -> list[bytes]:
    """Send each line on one connection and collect one reply line per request."""
    out = []
    s = await trio.open_unix_socket(path)
    async with s:
        buf = b""
        for line in lines:
            with contextlib.suppress(trio.BrokenResourceError):
                # A refused connection may be closed before we write: read its ERR anyway.
                await s.send_all(line)
            while b"\n" not in buf:
                try:
                    data = await s.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    out.append(b"<closed>")
                    return out
                buf += data
            reply, buf = buf.split(b"\n", 1)
            out.append(reply)
    return out


BAD_INPUT = [
    (b"\n", b"ERR empty"),
    (b"   \r\n", b"ERR empty"),
    (b"\xff\xfe garbage\n", b"ERR bad-encoding"),
    (b"FROB x\n", b"ERR unknown-verb"),
    (b"ping\n", b"ERR unknown-verb"),
    (b"REGISTER\n", b"ERR missing-argument"),
    (b"REGISTER -bad\n", b"ERR bad-name"),
    (b"REGISTER " + b"a" * 129 + b"\n", b"ERR bad-name"),
    (b"REGISTER w parked_max=11GiB\n", b"ERR bad-argument"),
    (b"REGISTER w park=maybe\n", b"ERR bad-argument"),
    (b"REGISTER w pid=0\n", b"ERR bad-argument"),
    (b"REGISTER w color=blue\n", b"ERR bad-argument"),
    (b"REGISTER w park=cooperative max_turn=5\n", b"ERR bad-argument"),
    (b"REGISTER w max_turn=0\n", b"ERR bad-argument"),
    (b"REGISTER w max_turn=soon\n", b"ERR bad-argument"),
    (b"REGISTER w max_turn=1e9\n", b"ERR bad-argument"),
    (b"ACQUIRE w wait=-1\n", b"ERR bad-argument"),
    (b"RELEASE w\n", b"ERR missing-argument"),
    (b"RELEASE w turn=abc\n", b"ERR bad-argument"),
    (b"HELLO proto=2\n", b"ERR unsupported-proto"),
    (b"ACQUIRE nobody\n", b"ERR unknown-workload"),
    (b"RELEASE nobody turn=3\n", b"ERR not-holder"),
    (b"UNREGISTER nobody\n", b"ERR unknown-workload"),
    (b"REGISTER w gpu=7\n", b"ERR unknown-gpu"),
    (b"REGISTER w gpu=GPU-nope\n", b"ERR unknown-gpu"),
    (b"REGISTER w pid=99999999999\n", b"ERR bad-argument"),
    (b"REGISTER w pid=4000000\n", b"ERR no-such-process"),
]


async def test_bad_input_gets_precise_errors_and_the_connection_survives() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            lines = [line for line, _ in BAD_INPUT] + [b"PING\n"]
            replies = await raw_exchange(stack.socket, lines)
            for (line, want), got in zip(BAD_INPUT, replies, strict=False):
                assert got.startswith(want), (line, got)
            assert replies[-1] == b"OK"  # the same connection still works
            st = await stack.status()
            assert st["workloads"] == []  # bad input changed nothing
            assert stack.overlaps() == 0


async def test_oversized_line_gets_err_and_close() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            replies = await raw_exchange(stack.socket, [b"PING " + b"x" * 5000 + b"\n", b"PING\n"])
            assert replies[0].startswith(b"ERR line-too-long")
            assert replies[1] == b"<closed>"
            # exactly 4096 bytes including the newline is fine
            ok = await raw_exchange(stack.socket, [b"PING" + b" " * 4091 + b"\n"])
            assert ok == [b"OK"]
            async with await stack.client() as c:
                await c.ping()  # the daemon is unaffected
            assert stack.overlaps() == 0


async def test_turns_are_exclusive_fifo_and_parked_with_cuda_checkpoint() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            a_pid = stack.sleeper()
            b_pid = stack.sleeper()
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=a_pid)
            await reg_b.register("b", pid=b_pid, parked_max="1GiB")
            ca, cb = await stack.client(), await stack.client()
            t1 = await ca.acquire("a")
            assert (t1.restored, t1.turn) == (False, 1)
            stack.ledger.alloc(a_pid, 0, 30 * GiB, workload="a")
            granted = trio.Event()
            turns = {}

            async def take_b() -> None:
                turns["b"] = await cb.acquire("b")
                granted.set()

            async with trio.open_nursery() as n:
                n.start_soon(take_b)
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["b"])
                assert not granted.is_set()
                # the holder is told someone waits
                msg = await ca.next_message()
                assert type(msg).__name__ == "Waiting" and msg.waiters == 1
                rel = await ca.release(t1)
                assert rel["parked"] == "1"
            # a was checkpointed by the real tool CLI before b got the GPU
            assert stack.ledger.state(a_pid) == "checkpointed"
            ops = [e["argv"][:2] for e in cc_log(stack) if e.get("pid") == a_pid]
            assert ops == [["--action", "lock"], ["--action", "checkpoint"]]
            assert turns["b"].turn == 2 and not turns["b"].restored
            stack.ledger.alloc(b_pid, 0, 40 * GiB, workload="b")
            # b releases lazily and a comes back: b parked, a restored
            stack.ledger.free(b_pid)
            stack.ledger.alloc(b_pid, 0, 512 << 20, workload="b")  # a slept context
            async with trio.open_nursery() as n:

                async def take_a() -> None:
                    turns["a2"] = await ca.acquire("a")

                n.start_soon(take_a)
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["a"])
                await cb.release(turns["b"])
            assert turns["a2"].restored and turns["a2"].turn == 3
            assert stack.ledger.state(a_pid) == "running"
            st = await stack.status()
            wa = workload(st, "a")
            assert wa is not None and wa["parks"] == 1 and wa["restores"] == 1
            assert st["gpus"][0]["holder"] == {"workload": "a", "turn": 3}
            assert st["totals"]["grants"] == 3
            for c in (ca, cb, reg_a, reg_b):
                await c.aclose()
            assert stack.overlaps() == 0


async def test_stale_release_is_refused_and_changes_nothing() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            async with await stack.client() as reg, await stack.client() as other:
                await reg.register("w", pid=stack.sleeper())
                t = await reg.acquire("w")
                before = await stack.status()
                with pytest.raises(ClientError) as e:
                    await other.release(t)
                assert e.value.code == "not-holder"
                with pytest.raises(ClientError) as e:
                    await reg.release(dataclasses.replace(t, turn=t.turn + 1))
                assert e.value.code == "not-holder"
                after = await stack.status()
                assert after["gpus"] == before["gpus"]
                assert workload(after, "w")["state"] == "active"  # type: ignore[index]
                await reg.release(t)
                with pytest.raises(ClientError) as e:
                    await reg.release(t)  # an old turn id
                assert e.value.code == "not-holder"
            assert stack.overlaps() == 0


async def test_registration_is_bound_to_its_connection() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pid = stack.sleeper()
            first = await stack.client()
            await first.register("w", pid=pid)
            async with await stack.client() as second:
                with pytest.raises(ClientError) as e:
                    await second.register("w", pid=pid)
                assert e.value.code == "exists"
                with pytest.raises(ClientError) as e:
                    await second.unregister("w")
                assert e.value.code == "not-registrant"
                await first.aclose()
                await stack.until(lambda st: workload(st, "w") is None)
                # the name is free again at once
                assert (await second.register("w", pid=pid))["state"] == "registered"
            assert stack.overlaps() == 0


async def test_acquire_wait_expires_and_unqueues() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            async with await stack.client() as a, await stack.client() as b:
                await a.register("a", pid=stack.sleeper())
                await b.register("b", pid=stack.sleeper())
                t = await a.acquire("a")
                with pytest.raises(ClientError) as e:
                    await b.acquire("b", wait=0.2)
                assert e.value.code == "timeout"
                st = await stack.status()
                assert st["gpus"][0]["queue"] == []
                assert st["gpus"][0]["holder"]["turn"] == t.turn
            assert stack.overlaps() == 0


async def test_socket_permissions_and_status_shape() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            import os
            import stat

            mode = stat.S_IMODE(os.stat(stack.socket).st_mode)
            assert mode == 0o660
            st = await stack.status()
            assert {"version", "uptime_s", "gpus", "workloads", "totals"} <= set(st)
            assert [g["index"] for g in st["gpus"]] == [0, 1]
            assert st["gpus"][0]["uuid"].startswith("GPU-")
            assert socket.AF_UNIX  # the daemon only listens on a Unix socket
            assert stack.overlaps() == 0


async def test_limits_answer_err_limit_and_change_nothing() -> None:
    with trio.fail_after(60):
        import contextlib
        import tempfile
        from pathlib import Path

        from gpu_slicer import proto

        conf = Path(tempfile.mkdtemp()) / "slicer.toml"
        conf.write_text("max_connections = 5\nmax_workloads = 1\nmax_queue = 1\n")
        async with running_stack("--config", str(conf)) as stack, contextlib.AsyncExitStack() as cs:
            a, b, c, watcher = [await cs.enter_async_context(await stack.client()) for _ in "abcd"]
            await watcher.request(proto.Watch())
            await a.register("one", pid=stack.sleeper())
            with pytest.raises(ClientError) as e:
                await b.register("two", pid=stack.sleeper())
            assert e.value.code == "limit"
            t = await a.acquire("one")
            async with trio.open_nursery() as n:
                n.start_soon(b.acquire, "one")
                seen = []  # a's own queued and granted events come first, then b's queued
                while seen[-2:] != ["granted", "queued"]:
                    msg = await watcher.next_message()
                    if isinstance(msg, proto.Event):
                        seen.append(msg.body["event"])
                with pytest.raises(ClientError) as e:
                    await c.acquire("one")
                assert e.value.code == "limit"
                # the fifth connection is accepted; a sixth is refused with ERR limit
                e5 = await cs.enter_async_context(await stack.client())
                await e5.ping()
                replies = await raw_exchange(stack.socket, [b"PING\n"])
                assert replies[0].startswith(b"ERR limit")
                await a.release(t)
            st = await c.status()
            assert [w["name"] for w in st["workloads"]] == ["one"]
            assert stack.overlaps() == 0
