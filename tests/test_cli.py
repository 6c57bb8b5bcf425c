"""`slicerctl`: exit codes and output shapes (CliRunner against a scripted socket), then the
real command in a subprocess against a real daemon."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any

import pytest
import trio
from click.testing import CliRunner

from slicer.cli import format_event, main, render_table
from tests.harness import Stack, running_stack

HINT = "is slicerd running? (systemctl status slicer)"

STATUS_BODY: dict[str, Any] = {
    "version": "0.1.0",
    "uptime_s": 1.5,
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-fake-0",
            "resident": "sampler",
            "holder": {"workload": "sampler", "turn": 7},
            "queue": ["trainer"],
            "grants": 7,
            "busy": None,
            "foreign": [{"pid": 4242, "bytes": 1 << 30}],
        }
    ],
    "workloads": [
        {"name": "sampler", "gpu": 0, "state": "active", "turn": 7, "pids": [1234, 1240]},
        {"name": "trainer", "gpu": 0, "state": "parked", "turn": None, "pids": []},
    ],
    "totals": {"grants": 7, "parks": 6, "restores": 6, "faults": 0},
}

EVENTS = [
    {"event": "registered", "t": 1.0, "workload": "w", "gpu": 0, "turn": None, "pid": 9},
    {"event": "granted", "t": 2.0, "workload": "w", "gpu": 0, "turn": 3, "restored": False},
    {"event": "released", "t": 3.0, "workload": "w", "gpu": 0, "turn": None},
]


@contextmanager
def scripted_daemon(replies: dict[str, list[bytes]], close_after: bool = False) -> Iterator[str]:
    """A Unix socket that answers each request verb with its scripted lines (one thread,
    one connection at a time); the connection is closed after them if `close_after`."""
    base = tempfile.mkdtemp(prefix="slicerctl-")
    path = os.path.join(base, "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()
    srv.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            # A client that has what it wanted may hang up while we still send.
            with conn, conn.makefile("rb") as f, suppress(BrokenPipeError, ConnectionResetError):
                for line in f:
                    conn.sendall(b"".join(replies[line.split()[0].decode()]))
                    if close_after:
                        break

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield path
    finally:
        stop.set()
        t.join(5)
        srv.close()
        shutil.rmtree(base, ignore_errors=True)


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.mark.parametrize("cmd", [["ping"], ["status"], ["workloads", "--json"], ["watch"]])
def test_unreachable_exits_69_with_hint(cmd: list[str]) -> None:
    path = os.path.join(tempfile.gettempdir(), f"slicerctl-none-{os.getpid()}.sock")
    r = invoke("--socket", path, *cmd)
    assert r.exit_code == 69
    assert r.stdout == ""
    assert r.stderr.strip() == (
        f"slicerctl: cannot reach slicerd at {path}: No such file or directory; {HINT}"
    )


def test_socket_defaults_to_env() -> None:
    path = os.path.join(tempfile.gettempdir(), f"slicerctl-env-{os.getpid()}.sock")
    r = invoke("ping", env={"SLICER_SOCKET": path})
    assert r.exit_code == 69
    assert f"cannot reach slicerd at {path}:" in r.stderr


def test_ping_json_and_text() -> None:
    with scripted_daemon({"PING": [b"OK\n"]}) as path:
        r = invoke("--socket", path, "ping", "--json")
        assert r.exit_code == 0, r.output
        body = json.loads(r.stdout)
        assert set(body) == {"ok", "rtt_us"} and body["ok"] is True
        assert isinstance(body["rtt_us"], int) and body["rtt_us"] >= 0
        r = invoke("--socket", path, "ping")
        assert re.fullmatch(r"ok \(\d+ us\)\n", r.stdout)


def test_status_json_is_the_raw_body_and_text_is_tables() -> None:
    line = b"OK " + json.dumps(STATUS_BODY).encode() + b"\n"
    with scripted_daemon({"STATUS": [line]}) as path:
        r = invoke("--socket", path, "status", "--json")
        assert r.exit_code == 0 and json.loads(r.stdout) == STATUS_BODY
        r = invoke("--socket", path, "workloads", "--json")
        assert r.exit_code == 0 and json.loads(r.stdout) == STATUS_BODY["workloads"]
        r = invoke("--socket", path, "status")
        assert r.exit_code == 0
        text = r.stdout
        assert text.startswith("slicerd 0.1.0  up 1.5 s  grants 7  parks 6  restores 6")
        gpu_row = next(ln for ln in text.splitlines() if "GPU-fake-0" in ln).split()
        assert gpu_row == ["0", "GPU-fake-0", "sampler", "sampler/7", "trainer", "7", "-", "1"]
        rows = [ln.split() for ln in text.splitlines() if ln.startswith(("sampler", "trainer"))]
        assert rows[0][:5] == ["sampler", "0", "active", "7", "1234,1240"]
        assert rows[1][:5] == ["trainer", "0", "parked", "-", "-"]
        r = invoke("--socket", path, "workloads")
        assert r.stdout.splitlines()[0].split()[:3] == ["WORKLOAD", "GPU", "STATE"]
        assert "GPU-fake-0" not in r.stdout


def test_err_reply_exits_1() -> None:
    with scripted_daemon({"STATUS": [b"ERR internal -- state machine on fire\n"]}) as path:
        r = invoke("--socket", path, "status")
    assert r.exit_code == 1
    assert r.stderr == "slicerctl: internal: state machine on fire\n"


def test_watch_count_json_and_text() -> None:
    lines = [b"OK\n"] + [b"EVENT " + json.dumps(e).encode() + b"\n" for e in EVENTS]
    with scripted_daemon({"WATCH": lines}) as path:
        r = invoke("--socket", path, "watch", "--count", "2", "--json")
        assert r.exit_code == 0, r.output
        assert [json.loads(ln) for ln in r.stdout.splitlines()] == EVENTS[:2]
        r = invoke("--socket", path, "watch", "--count", "3")
        assert r.exit_code == 0, r.output
        out = r.stdout.splitlines()
        assert len(out) == 3
        assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}  granted +w  turn=3  gpu=0 restored=no", out[1])


def test_watch_daemon_gone_exits_69() -> None:
    lines = [b"OK\n", b"EVENT " + json.dumps(EVENTS[0]).encode() + b"\n"]
    with scripted_daemon({"WATCH": lines}, close_after=True) as path:
        r = invoke("--socket", path, "watch", "--json")
    assert r.exit_code == 69
    assert len(r.stdout.splitlines()) == 1
    assert "the daemon closed the connection" in r.stderr


def test_format_event_and_table() -> None:
    at = datetime(2024, 1, 2, 3, 4, 5, 678_900)
    line = format_event({"event": "parked", "t": 9.5, "workload": "s", "turn": None, "x": 1}, at)
    assert line == "03:04:05.678  parked       s  turn=-  x=1"
    table = render_table(["A", "NUM"], [["long-name", 5], ["b", 1234]])
    assert table.splitlines() == ["A           NUM", "long-name     5", "b          1234"]


# ---- a real daemon, the real command ------------------------------------------------------


def ctl_argv(stack: Stack, *args: str) -> list[str]:
    return [sys.executable, "-m", "slicer.cli", "--socket", stack.socket, *args]


async def ctl(stack: Stack, *args: str) -> tuple[int, str, str]:
    """Run slicerctl in a subprocess (never blocks our trio loop); rc, stdout, stderr."""
    r = await trio.run_process(
        ctl_argv(stack, *args),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=stack.env,
    )
    return r.returncode, r.stdout.decode(), r.stderr.decode()


@pytest.mark.integration
async def test_integration_ping() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            rc, out, err = await ctl(stack, "ping")
            assert rc == 0, err
            assert re.fullmatch(r"ok \(\d+ us\)\n", out)
            rc, out, err = await ctl(stack, "ping", "--json")
            assert rc == 0, err
            assert json.loads(out)["ok"] is True
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_integration_status_and_workloads() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            reg, holder = await stack.client(), await stack.client()
            try:
                await reg.register("trainer", pid=stack.sleeper())
                await reg.register("sampler", pid=stack.sleeper(), gpu=1)
                turn = await holder.acquire("trainer")
                rc, out, err = await ctl(stack, "status")
                assert rc == 0, err
                print(out)
                lines = out.splitlines()
                trainer = next(ln.split() for ln in lines if ln.startswith("trainer "))
                sampler = next(ln.split() for ln in lines if ln.startswith("sampler "))
                assert trainer[:4] == ["trainer", "0", "active", str(turn.turn)]
                assert sampler[:4] == ["sampler", "1", "registered", "-"]
                gpu0 = next(ln.split() for ln in lines if re.match(r"\s*0  ", ln))
                assert f"trainer/{turn.turn}" in gpu0

                rc, out, err = await ctl(stack, "status", "--json")
                assert rc == 0, err
                st = json.loads(out)
                assert {"version", "uptime_s", "gpus", "workloads", "totals"} <= set(st)
                assert [g["index"] for g in st["gpus"]] == [0, 1]
                assert st["gpus"][0]["holder"] == {"workload": "trainer", "turn": turn.turn}

                rc, out, err = await ctl(stack, "workloads", "--json")
                assert rc == 0, err
                ws = {w["name"]: w for w in json.loads(out)}
                assert ws["trainer"]["state"] == "active"
                assert ws["sampler"]["state"] == "registered"
            finally:
                await holder.aclose()
                await reg.aclose()
            assert stack.overlaps() == 0


async def _read_until(stream: trio.abc.ReceiveStream, marker: bytes | None) -> bytes:
    """Read until `marker` appears (None: until EOF)."""
    data = b""
    while marker is None or marker not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return data


async def _watch_while(stack: Stack, *args: str) -> tuple[int, bytes, bytes, int]:
    """Start `slicerctl watch ARGS`, wait until it is subscribed, then register a workload
    and acquire a turn of it; return (rc, stdout, stderr, turn)."""
    proc = await trio.lowlevel.open_process(
        ctl_argv(stack, "watch", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=stack.env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    reg, holder = await stack.client(), await stack.client()
    try:
        err = await _read_until(proc.stderr, b"watching")  # WATCH answered OK
        assert b"watching" in err, err
        await reg.register("w1", pid=stack.sleeper())
        turn = await holder.acquire("w1")
        out = await _read_until(proc.stdout, None)
        rc = await proc.wait()
        err += await _read_until(proc.stderr, None)
        return rc, out, err, turn.turn
    finally:
        await holder.aclose()
        await reg.aclose()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await proc.stdout.aclose()
        await proc.stderr.aclose()


@pytest.mark.integration
async def test_integration_watch_json() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            rc, out, err, _ = await _watch_while(stack, "--count", "2", "--json")
            assert rc == 0, err
            events = [json.loads(ln) for ln in out.splitlines()]
            assert [(e["event"], e["workload"]) for e in events] == [
                ("registered", "w1"),
                ("queued", "w1"),
            ]
            assert all("t" in e and "turn" in e for e in events)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_integration_watch_text() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            rc, out, err, turn = await _watch_while(stack, "--count", "3")
            assert rc == 0, err
            lines = out.decode().splitlines()
            assert [ln.split()[1:3] for ln in lines] == [
                ["registered", "w1"],
                ["queued", "w1"],
                ["granted", "w1"],
            ]
            assert re.match(rf"\d\d:\d\d:\d\d\.\d{{3}}  granted +w1  turn={turn}  ", lines[2])
            assert stack.overlaps() == 0
