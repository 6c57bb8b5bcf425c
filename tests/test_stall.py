"""No client can stall or wedge the daemon: long chains of pipelined requests across
connections, a connection flooding STATUS, and one user holding every connection it can.
Against the real daemon over its real socket (the timing is bench/flood.py's, not here)."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import ClientError
from tests.harness import GiB, Stack, running_stack

pytestmark = pytest.mark.integration

SYSTEM_PYTHON = "/usr/bin/python3"  # reachable for uid nobody, unlike the venv's


async def raw(stack: Stack) -> trio.SocketStream:
    return await trio.open_unix_socket(stack.socket)


async def read_lines(stream: trio.SocketStream, n: int) -> list[bytes]:
    buf, lines = proto.LineBuffer(proto.MAX_SERVER_LINE), []
    while len(lines) < n:
        data = await stream.receive_some(65536)
        assert data, f"closed after {len(lines)} of {n} lines: {lines[-3:]}"
        lines += buf.feed(data)
    return lines


async def test_a_long_chain_of_pipelined_turns_across_connections_completes() -> None:
    """600 ACQUIRE/RELEASE pairs pipelined by 20 connections, each release granting the
    next connection's turn: one long chain of resumed requests. Every reply arrives and
    the GPU is left idle with no operation in flight."""
    conns, pairs = 20, 30
    with trio.fail_after(90):
        async with running_stack(gpus=1) as stack:
            async with await stack.client() as reg_w, await stack.client() as reg_b:
                await reg_w.register("w", pid=stack.sleeper())
                await reg_b.register("b", pid=stack.sleeper())
                async with await stack.client() as blocker:
                    t = await blocker.acquire("b")  # turn 1: everyone queues behind it
                    streams = [await raw(stack) for _ in range(conns)]
                    for i, s in enumerate(streams):
                        await s.send_all(b"ACQUIRE w\n")
                        await stack.until(lambda st, n=i + 1: len(st["gpus"][0]["queue"]) == n)
                    # Round robin from turn 2: connection i's k-th turn is 2 + k*conns + i.
                    for i, s in enumerate(streams):
                        lines = []
                        for k in range(pairs):
                            lines.append(f"RELEASE w turn={2 + k * conns + i}\n")
                            if k < pairs - 1:
                                lines.append("ACQUIRE w\n")
                        await s.send_all("".join(lines).encode())
                    await blocker.release(t)
                    for i, s in enumerate(streams):
                        got = await read_lines(s, 2 * pairs)
                        turns = [proto.parse_server_line(x) for x in got[0::2]]
                        assert [m.fields["turn"] for m in turns] == [  # type: ignore[union-attr]
                            str(2 + k * conns + i) for k in range(pairs)
                        ]
                        assert all(x.startswith(b"OK parked=0") for x in got[1::2]), got[:4]
                        await s.aclose()
                st = await stack.status()
                assert st["totals"]["grants"] == 1 + conns * pairs
                gpu = st["gpus"][0]
                assert gpu["busy"] is None and gpu["op_owner"] is None and gpu["holder"] is None
                assert (await stack.status())["uptime_s"] > 0  # still serving
            assert stack.overlaps() == 0


async def test_a_status_flood_never_starves_another_connection() -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            async with await stack.client() as reg:
                await reg.register("w", pid=stack.sleeper())
                flood = await raw(stack)
                await flood.send_all(b"STATUS\n" * 5000)  # and never read a reply
                async with await stack.client() as other:
                    for _ in range(20):
                        await other.ping()  # answered between the flood's lines
                    t = await other.acquire("w")
                    await other.release(t)
                await flood.aclose()
                st = await stack.status()
                assert st["totals"]["grants"] == 1
            assert stack.overlaps() == 0


HOLDER = r"""
import socket, sys
path, n = sys.argv[1], int(sys.argv[2])
socks, out = [], []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(path)
    try:
        s.sendall(b"PING\n")
    except OSError:
        pass  # refused: the ERR line the server sent before closing is still to be read
    try:
        out.append(s.recv(4096).decode().strip() or "EOF")
    except OSError as e:
        out.append(f"{type(e).__name__}")
    socks.append(s)
print("\n".join(out), flush=True)
sys.stdin.readline()  # hold every connection until told
"""


def hold_as(uid: int, sock: str, n: int) -> tuple[subprocess.Popen[str], list[str]]:
    """Open `n` connections as `uid`, each PINGed; they stay open until stdin closes."""
    p = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", HOLDER, sock, str(n)],
        user=uid,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    return p, [p.stdout.readline().strip() for _ in range(n)]


def release(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    p.wait(timeout=20)
    assert p.stdout is not None
    p.stdout.close()


def root_pings(sock: str, n: int) -> list[bytes]:
    socks, out = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(20)
            s.connect(sock)
            s.sendall(b"PING\n")
            out.append(s.recv(4096))
            socks.append(s)
    finally:
        for s in socks:
            s.close()
    return out


async def connections(stack: Stack, n: int) -> None:
    """Until the daemon counts `n` connections (STATUS's own included). Closes are
    noticed a moment after the peer closed: poll, bounded by the test's fail_after."""
    while True:
        try:
            if (await stack.status())["connections"] == n:
                return
        except ClientError as e:  # the table is still full of the closed ones
            assert e.code == "limit", e
        await trio.sleep(0.05)


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs /usr/bin/python3")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
async def test_one_user_cannot_take_every_connection() -> None:
    with trio.fail_after(90):
        conf = Path(tempfile.mkdtemp()) / "slicer.toml"
        conf.write_text(
            "max_connections = 40\nreserved_connections = 10\nmax_connections_per_uid = 25\n"
        )
        async with running_stack("--config", str(conf), "--socket-mode", "666") as stack:
            # One uid: at most 25 connections, then a precise refusal.
            p, replies = await trio.to_thread.run_sync(hold_as, 65534, stack.socket, 27)
            try:
                assert replies[:25] == ["OK"] * 25
                assert all(r.startswith("ERR limit") and "per uid" in r for r in replies[25:])
                # Root (an operator's slicerctl, a root launcher) still gets in, up to the
                # whole table, past the room unprivileged users may fill.
                got = await trio.to_thread.run_sync(root_pings, stack.socket, 15)
                assert got == [b"OK\n"] * 15
                await connections(stack, 25 + 1)  # root's closed ones are forgotten
                # A second user stops where the room kept for root alone begins (40 - 10).
                p2, r2 = await trio.to_thread.run_sync(hold_as, 65533, stack.socket, 6)
                try:
                    assert r2[:5] == ["OK"] * 5
                    assert r2[5].startswith("ERR limit") and "other than root" in r2[5]
                    assert (
                        await trio.to_thread.run_sync(root_pings, stack.socket, 10)
                        == [b"OK\n"] * 10
                    )
                finally:
                    release(p2)
            finally:
                release(p)
            # Every refused or closed connection is forgotten (the closes are noticed a
            # moment later: poll, bounded by fail_after).
            await connections(stack, 1)
            assert stack.overlaps() == 0


async def test_a_refused_connection_gets_its_err_limit_even_when_it_writes_afterwards() -> None:
    """A client writes its first request when it is ready, which may be after slicerd
    refused it: the refusal lingers (half-closed, input discarded), so that write does
    not fail with a broken pipe and the client reads `ERR limit` (a closed socket hid
    it: `slicerctl status` against a full table said "broken pipe" now and then). And a
    refused client that hangs up at once never takes the daemon down."""
    with trio.fail_after(30):
        conf = Path(tempfile.mkdtemp()) / "slicer.toml"
        conf.write_text("max_connections = 3\nreserved_connections = 0\n")
        async with running_stack("--config", str(conf)) as stack:
            held = [await raw(stack) for _ in range(3)]
            for s in held:
                await s.send_all(b"PING\n")
                assert await read_lines(s, 1) == [b"OK"]
            refused = await raw(stack)
            (line,) = await read_lines(refused, 1)
            assert line.startswith(b"ERR limit"), line
            assert await refused.receive_some(4096) == b""  # its answer ends there
            # after the answer and its end: the request is still taken (and discarded)
            await refused.send_all(b"PING\n")
            await refused.aclose()
            for _ in range(50):  # refused clients that hang up before their answer
                s = await raw(stack)
                await s.aclose()
            for s in held:
                await s.aclose()
            await connections(stack, 1)
            assert stack.overlaps() == 0


async def test_a_pipeline_resumed_while_its_connection_lingers_never_wedges_the_gpu() -> None:
    """A RELEASE park=now waiting, an `ACQUIRE wait=` behind it, then a line too long: the
    server answers ERR and lingers; the park ends meanwhile. Nothing of the closing
    connection's pipeline may run then (it would leave a GPU op nobody performs)."""
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            pa = stack.sleeper(4 * GiB, label="a")
            async with await stack.client() as ra, await stack.client() as rb:
                await ra.register("a", pid=pa)
                await rb.register("b", pid=stack.sleeper())
                x = await raw(stack)
                await x.send_all(b"ACQUIRE a\n")
                (granted,) = await read_lines(x, 1)
                assert granted.startswith(b"OK turn=1")
                stack.ledger.inject(pa, "checkpoint", hang=True)
                await x.send_all(b"RELEASE a turn=1 park=now\nACQUIRE a wait=30\n")
                await stack.until(lambda st: st["gpus"][0]["busy"] == "park")
                await x.send_all(b"Y" * 70000)
                (err,) = await read_lines(x, 1)
                assert err.startswith(b"ERR line-too-long")
                stack.ledger.clear_injection(pa, "checkpoint")  # the park ends while it lingers
                async with await stack.client() as other:
                    t = await other.acquire("b")  # the GPU is not wedged
                    st = await stack.status()
                    assert st["gpus"][0]["holder"] == {"workload": "b", "turn": t.turn}
                    await other.release(t)
                await x.aclose()
            assert stack.overlaps() == 0


async def test_a_watch_resumed_from_a_pipeline_takes_no_more_requests() -> None:
    with trio.fail_after(30):
        async with running_stack(gpus=1) as stack:
            async with await stack.client() as reg, await stack.client() as holder:
                await reg.register("a", pid=stack.sleeper())
                await holder.acquire("a")
                s = await raw(stack)
                await s.send_all(b"ACQUIRE a wait=0.2\nWATCH\nPING\nHELLO\n")
                buf, lines = proto.LineBuffer(proto.MAX_SERVER_LINE), []
                while len([x for x in lines if not x.startswith(b"EVENT")]) < 2:
                    lines += buf.feed(await s.receive_some(65536))
                async with await stack.client() as late:
                    await late.register("marker", pid=stack.sleeper())
                    while not any(b'"workload":"marker"' in x for x in lines):
                        lines += buf.feed(await s.receive_some(65536))
                replies = [x for x in lines if not x.startswith(b"EVENT")]
                assert replies[0].startswith(b"ERR timeout") and replies[1] == b"OK", replies
                assert len(replies) == 2, replies  # PING and HELLO after WATCH: not answered
                await s.aclose()
            assert stack.overlaps() == 0


async def test_one_event_answering_many_pipelines_serves_them_all() -> None:
    """30 connections wait for w, each with 20 STATUS pipelined behind; one UNREGISTER
    answers them all: every pipeline is served, in order, while a PING still gets in."""
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            async with await stack.client() as reg, await stack.client() as holder:
                await reg.register("w", pid=stack.sleeper())
                t = await holder.acquire("w")
                streams = [await raw(stack) for _ in range(30)]
                for i, s in enumerate(streams):
                    await s.send_all(b"ACQUIRE w\n" + b"STATUS\n" * 20)
                    await stack.until(lambda st, n=i + 1: len(st["gpus"][0]["queue"]) == n)
                await reg.unregister("w")
                async with await stack.client() as other:
                    await other.ping()
                for s in streams:
                    got = await read_lines(s, 21)
                    assert got[0].startswith(b"ERR gone"), got[0]
                    assert all(x.startswith(b"OK {") for x in got[1:])
                    await s.aclose()
                with pytest.raises(ClientError) as e:
                    await holder.release(t)  # the turn ended with w
                assert e.value.code == "not-holder"
            assert stack.overlaps() == 0
