"""`slicerctl`: exit codes and output shapes (CliRunner against a scripted socket), then
every command through CliRunner against a real daemon (tests.harness.running_stack).

CliRunner runs the command in-process and blocks. Commands that only talk to the daemon run
in a worker thread (`trio.to_thread.run_sync`) so that our trio loop keeps going; `run` and
`demo` install signal handlers (the launcher forwards SIGTERM/SIGINT to its child), which
only the main thread may do, so for them the daemon's trio loop runs in a helper thread
instead (`stack_in_thread`)."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result

from gpu_slicer.slicer.cli import duration, format_event, main, render_table, status_text
from tests.harness import Stack, running_stack, workload

HINT = "is slicerd running? check `systemctl status slicer`, or pass --socket"

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
        f"slicerctl: error: cannot reach slicerd at {path}: No such file or directory ({HINT})"
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
        assert re.match(r"slicerd 0\.1\.0  up 1\.5s \(since [-\d]+ [:\d]+ \S+\)  grants 7  ", text)
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
    assert r.stderr == "slicerctl: error: slicerd answered ERR internal: state machine on fire\n"


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


def test_watch_once_daemon_gone_exits_69() -> None:
    lines = [b"OK\n", b"EVENT " + json.dumps(EVENTS[0]).encode() + b"\n"]
    with scripted_daemon({"WATCH": lines}, close_after=True) as path:
        r = invoke("--socket", path, "watch", "--json", "--once")
    assert r.exit_code == 69
    assert len(r.stdout.splitlines()) == 1
    assert "the daemon closed the connection" in r.stderr


def test_format_event_and_table() -> None:
    at = datetime(2024, 1, 2, 3, 4, 5, 678_900)
    line = format_event({"event": "parked", "t": 9.5, "workload": "s", "turn": None, "x": 1}, at)
    assert line == "03:04:05.678  parked       s  turn=-  x=1"
    table = render_table(["A", "NUM"], [["long-name", 5], ["b", 1234]])
    assert table.splitlines() == ["A           NUM", "long-name     5", "b          1234"]


def test_uptime_and_durations_in_local_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "EST+5")  # a zone without DST: 5 hours behind UTC
    time.tzset()
    try:
        now = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
        first = status_text({"version": "1", "uptime_s": 3725.2}, now=now).splitlines()[0]
    finally:
        monkeypatch.undo()
        time.tzset()
    assert first == "slicerd 1  up 1h 02m (since 2023-11-14 16:11:14 EST)"
    assert [duration(s) for s in (0.25, 59.94, 61, 3599, 86400 + 7200)] == [
        "0.2s",
        "59.9s",
        "1m 01s",
        "59m 59s",
        "1d 02h",
    ]
    assert status_text({"version": "1"}).startswith("slicerd 1  up ?")


def test_status_says_first_when_the_parker_cannot_run() -> None:
    check = {"kind": "cli", "path": "/x/cuda-checkpoint", "ok": False, "error": "not found (fix)"}
    lines = status_text({"version": "1", "parker_check": check}).splitlines()
    assert lines[1] == "parker cli cannot run: not found (fix); REGISTERs that need it are refused"
    ok = {**check, "ok": True, "error": None}
    assert "cannot run" not in status_text({"version": "1", "parker_check": ok})


# ---- completion ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shell", "marks"),
    [
        # click runs `bash` to read its version before it writes the bash script
        pytest.param(
            "bash",
            ["_SLICERCTL_COMPLETE=bash_complete", "complete -o nosort -F _slicerctl_co"],
            marks=pytest.mark.integration,
        ),
        ("zsh", ["#compdef slicerctl", "_SLICERCTL_COMPLETE=zsh_complete", "compdef _slicerctl"]),
    ],
)
def test_completion_script(shell: str, marks: list[str]) -> None:
    r = invoke("completion", shell)
    assert r.exit_code == 0 and r.stderr == ""
    assert "_slicerctl_completion()" in r.stdout
    for mark in marks:
        assert mark in r.stdout


def test_completion_unknown_shell_is_a_usage_error() -> None:
    r = invoke("completion", "fish")
    assert r.exit_code == 64 and "'fish' is not one of 'bash', 'zsh'" in r.stderr


def test_completion_protocol_answers_commands_and_options() -> None:
    def complete(words: str, cword: int) -> str:
        env = {"_SLICERCTL_COMPLETE": "bash_complete", "COMP_WORDS": words}
        r = CliRunner().invoke(
            main, [], env={**env, "COMP_CWORD": str(cword)}, prog_name="slicerctl"
        )
        assert r.exit_code == 0, r.output
        return r.stdout

    assert complete("slicerctl wo", 1) == "plain,workloads\n"
    assert complete("slicerctl c", 1) == "plain,completion\n"
    assert "plain,--parked-max" in complete("slicerctl run --p", 2)
    assert "plain,--socket" not in complete("slicerctl run --", 2)  # the group's, not run's


@pytest.mark.integration
def test_completion_in_a_real_bash() -> None:
    exe = Path(sys.executable).parent / "slicerctl"
    if shutil.which("bash") is None or not os.access(exe, os.X_OK):
        pytest.skip("needs bash and the installed slicerctl script")
    script = (
        'eval "$(slicerctl completion bash)"; COMP_WORDS=(slicerctl st); COMP_CWORD=1; '
        '_slicerctl_completion slicerctl; echo "${COMPREPLY[*]}"'
    )
    env = {**os.environ, "PATH": f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "status\n"


def test_run_unreachable_exits_69() -> None:
    path = os.path.join(tempfile.gettempdir(), f"slicerctl-none-{os.getpid()}.sock")
    try:
        r = invoke(
            "--socket", path, "run", "--workload", "w", "--connect-timeout", "0.2", "--", "true"
        )
    finally:
        logging.getLogger("launcher").handlers.clear()  # it wrote to CliRunner's stderr
    assert r.exit_code == 69
    assert f"slicerd at {path}" in r.stderr


# ---- a real daemon, CliRunner ------------------------------------------------------------


async def ainvoke(*args: str, abandon: bool = False) -> Result:
    """`slicerctl ARGS` through CliRunner in a worker thread (our trio loop keeps going);
    `abandon`: a cancel (trio.fail_after) leaves the thread behind instead of waiting."""
    call = partial(CliRunner().invoke, main, list(args), catch_exceptions=False)
    return await trio.to_thread.run_sync(call, abandon_on_cancel=abandon)


@pytest.mark.integration
async def test_integration_ping_and_unreachable_after_stop() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            r = await ainvoke("--socket", stack.socket, "ping")
            assert r.exit_code == 0, r.output
            assert re.fullmatch(r"ok \(\d+ us\)\n", r.stdout)
            r = await ainvoke("--socket", stack.socket, "ping", "--json")
            assert r.exit_code == 0, r.output
            assert json.loads(r.stdout)["ok"] is True
            assert stack.overlaps() == 0
            assert await stack.stop() == 0
            for cmd in (["ping"], ["status", "--json"], ["workloads"], ["watch"]):
                r = await ainvoke("--socket", stack.socket, *cmd)
                assert r.exit_code == 69, (cmd, r.output)
                assert r.stdout == ""
                assert f"slicerctl: error: cannot reach slicerd at {stack.socket}: " in r.stderr
                assert r.stderr.rstrip().endswith(f"({HINT})")


@pytest.mark.integration
async def test_integration_status_and_workloads() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            r = await ainvoke("--socket", stack.socket, "workloads")
            assert (r.exit_code, r.stdout) == (0, "no workloads\n")
            reg, holder = await stack.client(), await stack.client()
            try:
                await reg.register("trainer", pid=stack.sleeper())
                await reg.register("sampler", pid=stack.sleeper(), gpu=1)
                turn = await holder.acquire("trainer")
                r = await ainvoke("--socket", stack.socket, "status")
                assert r.exit_code == 0, r.output
                lines = r.stdout.splitlines()
                assert re.fullmatch(
                    r"slicerd \S+  up \S+( \S+)? \(since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+\)"
                    r"  \d+ connections  .*",
                    lines[0],
                ), lines[0]
                trainer = next(ln.split() for ln in lines if ln.startswith("trainer "))
                sampler = next(ln.split() for ln in lines if ln.startswith("sampler "))
                assert trainer[:4] == ["trainer", "0", "active", str(turn.turn)]
                assert sampler[:4] == ["sampler", "1", "registered", "-"]
                gpu0 = next(ln.split() for ln in lines if re.match(r"\s*0  ", ln))
                assert f"trainer/{turn.turn}" in gpu0

                r = await ainvoke("--socket", stack.socket, "status", "--json")
                assert r.exit_code == 0, r.output
                st = json.loads(r.stdout)
                assert {"version", "uptime_s", "gpus", "workloads", "totals"} <= set(st)
                assert [g["index"] for g in st["gpus"]] == [0, 1]
                assert st["gpus"][0]["holder"] == {"workload": "trainer", "turn": turn.turn}

                r = await ainvoke("--socket", stack.socket, "workloads")
                assert r.exit_code == 0, r.output
                lines = r.stdout.splitlines()
                assert lines[0].split()[:3] == ["WORKLOAD", "GPU", "STATE"]
                assert sorted(ln.split()[0] for ln in lines[1:]) == ["sampler", "trainer"]

                r = await ainvoke("--socket", stack.socket, "workloads", "--json")
                assert r.exit_code == 0, r.output
                ws = {w["name"]: w for w in json.loads(r.stdout)}
                assert ws["trainer"]["state"] == "active"
                assert ws["sampler"]["state"] == "registered"
            finally:
                await holder.aclose()
                await reg.aclose()
            assert stack.overlaps() == 0


@asynccontextmanager
async def watch_relay(stack: Stack) -> AsyncIterator[tuple[str, trio.Event]]:
    """A socket that relays one client to the daemon byte for byte. `subscribed` is set
    once the daemon's first line (its reply to WATCH) has been passed on: from then on no
    state change can slip by the watcher, without sleeping or guessing."""
    path = str(stack.base / "relay.sock")
    subscribed = trio.Event()
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    async def pump(src: trio.SocketStream, dst: trio.SocketStream, mark: trio.Event | None) -> None:
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await src.receive_some(65536):
                await dst.send_all(data)
                if mark is not None and b"\n" in data:
                    mark.set()

    async def relay_one() -> None:
        sock, _ = await listener.accept()
        async with (
            trio.SocketStream(sock) as down,
            await trio.open_unix_socket(stack.socket) as up,
            trio.open_nursery() as pumps,  # either side closing ends both
        ):

            async def then_stop(src: trio.SocketStream, dst: trio.SocketStream, m: Any) -> None:
                await pump(src, dst, m)
                pumps.cancel_scope.cancel()

            pumps.start_soon(then_stop, down, up, None)
            pumps.start_soon(then_stop, up, down, subscribed)

    with listener:
        await listener.bind(path)
        listener.listen(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay_one)
            yield path, subscribed
            nursery.cancel_scope.cancel()


async def watch_during(stack: Stack, *args: str) -> tuple[Result, int]:
    """`slicerctl watch ARGS` through a relay; once it is subscribed, register workload w1
    and acquire a turn of it. The result and the turn."""
    box: dict[str, Result] = {}

    async def cli(path: str) -> None:
        box["r"] = await ainvoke("--socket", path, "watch", *args, abandon=True)

    reg, holder = await stack.client(), await stack.client()
    try:
        async with watch_relay(stack) as (path, subscribed), trio.open_nursery() as n:
            n.start_soon(cli, path)
            await subscribed.wait()
            await reg.register("w1", pid=stack.sleeper())
            turn = await holder.acquire("w1")
    finally:
        await holder.aclose()
        await reg.aclose()
    return box["r"], turn.turn


@pytest.mark.integration
async def test_integration_watch_json() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            r, _ = await watch_during(stack, "--count", "2", "--json")
            assert r.exit_code == 0, r.output
            assert "watching slicerd" in r.stderr
            events = [json.loads(ln) for ln in r.stdout.splitlines()]
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
            before = datetime.now().replace(microsecond=0)
            r, turn = await watch_during(stack, "--count", "3")
            assert r.exit_code == 0, r.output
            lines = r.stdout.splitlines()
            assert [ln.split()[1:3] for ln in lines] == [
                ["registered", "w1"],
                ["queued", "w1"],
                ["granted", "w1"],
            ]
            assert re.match(rf"\d\d:\d\d:\d\d\.\d{{3}}  granted +w1  turn={turn}  ", lines[2])
            stamp = datetime.strptime(lines[0][:8], "%H:%M:%S").time()  # local arrival time
            assert abs(datetime.combine(before.date(), stamp) - before).total_seconds() < 60
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_integration_watch_once_exits_69_when_the_daemon_stops() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            box: dict[str, Result] = {}

            async def cli(path: str) -> None:
                box["r"] = await ainvoke(
                    "--socket", path, "watch", "--json", "--once", abandon=True
                )

            async with watch_relay(stack) as (path, subscribed), trio.open_nursery() as n:
                n.start_soon(cli, path)
                await subscribed.wait()
                assert await stack.stop() == 0
            r = box["r"]
            assert r.exit_code == 69, r.output
            assert r.stdout == ""
            assert "the daemon closed the connection" in r.stderr
            assert stack.overlaps() == 0


# ---- run and demo: the main thread runs the command, the daemon's loop a helper thread ---


@contextmanager
def stack_in_thread(
    during: Callable[[Stack, Callable[[], Awaitable[None]]], Awaitable[None]],
    limit: float = 60,
) -> Iterator[Stack]:
    """A running_stack() whose trio loop runs in a helper thread, bounded by `limit`.
    `during(stack, main_done)` runs in that loop while the caller's block runs;
    `await main_done()` waits for the block's end. Errors of the loop are raised here."""
    handoff: queue.Queue[Stack | BaseException] = queue.Queue()
    finished = threading.Event()
    errors: list[BaseException] = []

    async def main_done() -> None:
        await trio.to_thread.run_sync(finished.wait, abandon_on_cancel=True)

    async def host() -> None:
        with trio.fail_after(limit):
            async with running_stack() as stack:
                handoff.put(stack)
                await during(stack, main_done)
                await main_done()

    def thread() -> None:
        try:
            trio.run(host)
        except BaseException as e:
            errors.append(e)
            handoff.put(e)

    t = threading.Thread(target=thread, name="stack", daemon=True)
    t.start()
    try:
        got = handoff.get(timeout=limit)
        if isinstance(got, BaseException):
            raise got
        yield got
    finally:
        finished.set()
        t.join(limit + 30)
        assert not t.is_alive(), "the stack's thread did not end"
        if errors:
            raise errors[0]


CHILD = """
import json, os, sys, time
d = sys.argv[1]
keys = ("SLICER_SOCKET", "SLICER_WORKLOAD")
with open(os.path.join(d, "env.tmp"), "w") as f:
    json.dump({"pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}, f)
os.replace(os.path.join(d, "env.tmp"), os.path.join(d, "env.json"))
deadline = time.monotonic() + 20
while not os.path.exists(os.path.join(d, "go")):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.02)
sys.exit(7)
"""


@pytest.mark.integration
def test_integration_run_registers_for_the_commands_life(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    async def during(stack: Stack, main_done: Callable[[], Awaitable[None]]) -> None:
        env_file = tmp_path / "env.json"
        while not env_file.exists():  # bounded by stack_in_thread's fail_after
            await trio.sleep(0.02)
        env = json.loads(env_file.read_text())
        seen.append(env)

        def running(st: dict[str, Any]) -> bool:
            w = workload(st, "job")
            return w is not None and env["pid"] in w["pids"]

        seen.append(await stack.until(running))  # visible while the command runs
        (tmp_path / "go").touch()
        await main_done()
        await stack.until(lambda st: workload(st, "job") is None)  # gone with it
        assert stack.overlaps() == 0

    with stack_in_thread(during) as stack:
        argv = ["--socket", stack.socket, "run", "--workload", "job", "--gpu", "1"]
        argv += ["--park", "cooperative", "--parked-max", "1GiB"]
        try:
            r = CliRunner().invoke(main, [*argv, "--", sys.executable, "-c", CHILD, str(tmp_path)])
        finally:
            logging.getLogger("launcher").handlers.clear()  # it wrote to CliRunner's stderr
    assert r.exit_code == 7, r.output  # the child's own exit code
    env, st = seen
    assert env["SLICER_WORKLOAD"] == "job"
    assert env["SLICER_SOCKET"] == os.path.abspath(stack.socket)  # the group's --socket
    w = workload(st, "job")
    assert w is not None
    assert (w["gpu"], w["state"], w["park"], w["parked_max"]) == (
        1,
        "registered",
        "cooperative",
        1 << 30,
    )
    assert w["pid"] == os.getpid()  # the launcher ran in this process, under CliRunner


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_integration_demo_passes_its_arguments_through() -> None:
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["demo", "--", "--mode", "trainers", "--seconds", "2", "--json"])
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (exit {r.exit_code}):\n{r.output}")
    why = f"problems={report.get('problems')} after {time.monotonic() - t0:.1f} s\n{r.stderr}"
    assert r.exit_code == 0, why
    assert report["ok"] and report["overlaps"] == 0, why
    r = CliRunner().invoke(main, ["demo", "--", "--no-such-option"])
    assert r.exit_code == 2 and "--no-such-option" in r.stderr  # the demo's own usage error


@pytest.mark.integration
def test_demo_runs_the_checkouts_demo_never_one_in_the_cwd(tmp_path: Path) -> None:
    # A `demo` package where an operator happens to stand must not run (slicerctl may run
    # under sudo); the checkout's demo answers instead. (Without a checkout: test_wheel.)
    hostile = tmp_path / "demo"
    hostile.mkdir()
    (hostile / "__init__.py").write_text("")
    (hostile / "__main__.py").write_text("open('ran', 'w').write('x')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [sys.executable, "-c", "from gpu_slicer.slicer.cli import main; main()", "demo"]
    proc = subprocess.run(
        [*argv, "--", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "--mode" in proc.stdout  # the real demo's options
    assert not (tmp_path / "ran").exists()


def test_a_plugin_command_never_replaces_a_built_in_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib.metadata import EntryPoint

    from gpu_slicer.slicer import cli

    status = cli.main.commands["status"]
    hostile = EntryPoint("status", "gpu_slicer.launcher.main:slicerctl_run", cli.COMMANDS_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [hostile])
    cli._add_plugin_commands()
    assert cli.main.commands["status"] is status
    assert "command 'status'" in capsys.readouterr().err
