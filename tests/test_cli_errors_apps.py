"""slicer-launch and slicer-dispatch fail in one line: each case runs the real command as a
child and checks its exit code (README: "slicer-launch exit codes", "slicer-dispatch exit
codes") and its only stderr line, ``PROG: error: WHAT (WHAT TO DO)``, with no traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from gpu_slicer.dispatcher import startup
from gpu_slicer.dispatcher.owner import StateLock
from stubs.proc import child_env, free_port, until_listening
from tests.clitable import arun_cli, assert_one_line, module_argv, run_cli
from tests.harness import running_stack

pytestmark = pytest.mark.integration


# ---- slicer-launch ------------------------------------------------------------------------

LAUNCH_HELP = r" \(see 'slicer-launch run --help'\)$"
START = r"\(start slicerd, or give its socket with --socket or SLICER_SOCKET\)$"


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--bogus"], r"^slicer-launch: error: No such option '--bogus'.*\(see 'slicer-launch"),
        (["frobnicate"], r"^slicer-launch: error: No such command 'frobnicate'"),
        (
            ["run", "--workload", "w", "--bogus", "true"],
            r"^slicer-launch: error: no such option: --bogus; COMMAND goes after '--'"
            + LAUNCH_HELP,
        ),
        (
            ["run", "--workload", "w", "--kill-grace", "soon", "--", "true"],
            r"^slicer-launch: error: Invalid value for '--kill-grace': 'soon'" + ".*" + LAUNCH_HELP,
        ),
        (
            ["run", "--workload", "w", "--parked-max", "lots", "--", "true"],
            r"^slicer-launch: error: Invalid value for '--parked-max'",
        ),
        (["run", "--workload", "w"], r"^slicer-launch: error: Missing argument 'COMMAND"),
        (["run", "--", "true"], r"^slicer-launch: error: Missing option '--workload'"),
        (
            ["vllm", "--workload", "v", "--sleep-level", "3", "--", "vllm"],
            r"^slicer-launch: error: Invalid value for '--sleep-level'.*vllm --help'\)$",
        ),
    ],
    ids=[
        "unknown option",
        "unknown command",
        "misspelt option before COMMAND",
        "bad value",
        "bad size",
        "no COMMAND",
        "no workload",
        "vllm bad value",
    ],
)
def test_launcher_usage_errors_are_64_in_one_line(args: list[str], pattern: str) -> None:
    assert_one_line(run_cli(module_argv("slicer-launch", *args)), 64, pattern)


def test_launcher_unreachable_daemon_is_69_naming_the_socket(tmp_path: Path) -> None:
    path = tmp_path / "none.sock"
    run = ["run", "--workload", "w", "--connect-timeout", "0", "--", "true"]
    r = run_cli(module_argv("slicer-launch", *run[:3], "--socket", str(path), *run[3:]))
    assert_one_line(
        r,
        69,
        rf"^slicer-launch: error: cannot reach slicerd at {path} \(tried for 0 s\): "
        rf"\[Errno 2\] No such file or directory {START}",
    )
    # SLICER_SOCKET is the default, named the same way
    r = run_cli(module_argv("slicer-launch", *run), {"SLICER_SOCKET": str(path)})
    assert_one_line(r, 69, rf"^slicer-launch: error: cannot reach slicerd at {path} ")
    # `slicerctl run` is the same command under slicerctl's name
    r = run_cli(module_argv("slicerctl", "--socket", str(path), *run))
    assert_one_line(r, 69, rf"^slicerctl: error: cannot reach slicerd at {path} .*{START}")


async def test_launcher_refused_and_unstartable_fail_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexit 0\n")  # not executable
    with trio.fail_after(180):
        async with running_stack(gpus=1) as stack:
            env = {"SLICER_SOCKET": stack.socket, **stack.env}
            taken = await stack.client()
            await taken.register("taken", pid=stack.sleeper(), park="cooperative")

            cases = [
                (
                    ["--workload", "bad name", "--", "true"],
                    78,
                    r"^slicer-launch: error: REGISTER 'bad name' refused: bad-name: "
                    r"REGISTER: workload name must match .*, got 'bad name' \(a name is ",
                ),
                (
                    ["--workload", "w", "--gpu", "7", "--", "true"],
                    78,
                    r"^slicer-launch: error: REGISTER 'w' refused: unknown-gpu: no GPU "
                    r"'7' on this node \(see the node's GPUs with 'slicerctl status'",
                ),
                (
                    ["--workload", "taken", "--", "true"],
                    78,
                    r"^slicer-launch: error: REGISTER 'taken' refused: exists: .*"
                    r"\(another launcher holds that name: pick another --workload",
                ),
                (
                    ["--workload", "w", "--", "no-such-command-xyz"],
                    127,
                    r"^slicer-launch: error: cannot start no-such-command-xyz: not found on PATH "
                    r"\(check COMMAND and PATH\)$",
                ),
                (
                    ["--workload", "w", "--", str(tmp_path / "none")],
                    127,
                    rf"^slicer-launch: error: cannot start {tmp_path / 'none'}: no such file ",
                ),
                (
                    ["--workload", "w", "--", str(script)],
                    126,
                    rf"^slicer-launch: error: cannot start {script}: {script} is not executable "
                    r"\(make it executable, or run it through its interpreter\)$",
                ),
                (
                    ["--workload", "w", "--", str(tmp_path)],
                    126,
                    rf"^slicer-launch: error: cannot start {tmp_path}: {tmp_path} is a directory",
                ),
            ]
            for args, rc, pattern in cases:
                r = await arun_cli(module_argv("slicer-launch", "run", *args), env)
                assert_one_line(r, rc, pattern)
            # Nothing was registered by any of them: a typo costs no registration.
            names = [w["name"] for w in (await stack.status())["workloads"]]
            assert names == ["taken"]
            await taken.aclose()
            assert stack.overlaps() == 0


# ---- slicer-dispatch ----------------------------------------------------------------------

DISPATCH_HELP = r" \(see 'slicer-dispatch --help'\)$"
GOOD_URL = r"e\.g\. http://127\.0\.0\.1:8000"
REPLICA = "Invalid value for '--replica': "
LISTEN = "Invalid value for '--listen': "


def _dispatch(tmp_path: Path, *args: str, replica: str = "http://127.0.0.1:9") -> list[str]:
    base = ["--workload", "w", "--replica", replica, "--socket", str(tmp_path / "none.sock")]
    return module_argv("slicer-dispatch", *base, "--state-dir", str(tmp_path / "state"), *args)


@pytest.mark.parametrize(
    ("replica", "args", "pattern"),
    [
        ("http://127.0.0.1:9", ["--bogus"], r"No such option '--bogus'"),
        (
            "127.0.0.1:8000",
            [],
            rf"Invalid value for '--replica': '127\.0\.0\.1:8000' has no scheme: give the "
            rf"replica's URL, {GOOD_URL}",
        ),
        (
            "http://host:port",
            [],
            rf"{REPLICA}'http://host:port' is not a valid URL \(.*\): {GOOD_URL}",
        ),
        (
            "ftp://host:21",
            [],
            rf"{REPLICA}'ftp://host:21': the scheme must be http or https, {GOOD_URL}",
        ),
        ("http://", [], rf"{REPLICA}'http://' names no host: {GOOD_URL}"),
        (
            "http://h:1/?x=1",
            [],
            rf"{REPLICA}'http://h:1/\?x=1': a base URL has no \?query or #fragment",
        ),
        ("http://127.0.0.1:9", ["--listen", "8100"], rf"{LISTEN}'8100' is not HOST:PORT, e\.g\. "),
        ("http://127.0.0.1:9", ["--listen", "h:99999"], rf"{LISTEN}'h:99999' is not HOST:PORT"),
        (
            "http://127.0.0.1:9",
            ["--listen", "127.0.0.1:1", "--listen-unix", "/tmp/x.sock"],
            r"give --listen or --listen-unix, not both",
        ),
        (
            "http://127.0.0.1:9",
            ["--pool", "a pool"],
            r"Invalid value for '--pool': workload name must match ",
        ),
        (
            "http://127.0.0.1:9",
            ["--log-level", "bogus"],
            r"Invalid value for '--log-level': 'bogus' is not one of 'debug', 'info', ",
        ),
        *[
            ("http://127.0.0.1:9", [flag, value], rf"Invalid value for '{flag}': {why}")
            for flag, value, why in [
                ("--sample-deadline", "nan", r"'nan' is not a finite number of seconds"),
                ("--sample-deadline", "0", r"0\.0 is not in the range x>0\.0"),
                ("--sample-deadline", "-1", r"-1\.0 is not in the range x>0\.0"),
                ("--turn-seconds", "-1", r"-1\.0 is not in the range x>0\.0"),
                ("--turn-seconds", "inf", r"'inf' is not a finite number of seconds"),
                ("--turn-grace", "-5", r"-5\.0 is not in the range x>=0\.0"),
                ("--turn-grace", "nan", r"'nan' is not a finite number of seconds"),
                ("--concurrency", "0", r"0 is not in the range 1<=x<=4096"),
            ]
        ],
    ],
    ids=[
        "unknown option",
        "replica without scheme",
        "replica bad port",
        "replica not http",
        "replica no host",
        "replica with query",
        "listen without host",
        "listen bad port",
        "listen and listen-unix",
        "bad pool name",
        "bad log level",
        "deadline nan",
        "deadline zero",
        "deadline negative",
        "turn seconds negative",
        "turn seconds inf",
        "turn grace negative",
        "turn grace nan",
        "concurrency zero",
    ],
)
def test_dispatcher_usage_errors_are_64_in_one_line(
    tmp_path: Path, replica: str, args: list[str], pattern: str
) -> None:
    r = run_cli(_dispatch(tmp_path, *args, replica=replica))
    assert_one_line(r, 64, rf"^slicer-dispatch: error: {pattern}.*{DISPATCH_HELP}")
    assert not (tmp_path / "state").exists()  # refused before anything was opened


def test_dispatcher_busy_port_is_69_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        where = f"127.0.0.1:{busy.getsockname()[1]}"
        r = run_cli(_dispatch(tmp_path, "--listen", where))
    assert_one_line(
        r,
        69,
        rf"^slicer-dispatch: error: cannot listen on {where}: Address already in use \(another "
        r"process listens there: stop it, or pick another address with --listen HOST:PORT\)$",
    )
    sock = tmp_path / "no" / "front.sock"
    r = run_cli(_dispatch(tmp_path, "--listen-unix", str(sock)))
    assert_one_line(
        r, 69, rf"^slicer-dispatch: error: cannot listen on {sock}: .* with --listen-unix PATH\)$"
    )


def test_dispatcher_log_level_is_any_case(tmp_path: Path) -> None:
    # A valid level in capitals passes the option check: the run fails later, for the
    # non-socket path it is given, not for the level.
    afile = tmp_path / "afile"
    afile.touch()
    r = run_cli(_dispatch(tmp_path, "--log-level", "DEBUG", "--listen-unix", str(afile)))
    assert_one_line(r, 73, r"is not a socket")


def test_dispatcher_never_takes_over_a_live_unix_socket_or_a_file(tmp_path: Path) -> None:
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as other:  # another server, listening there
        other.bind(str(live))
        other.listen()
        r = run_cli(_dispatch(tmp_path, "--listen-unix", str(live)))
        assert_one_line(
            r,
            69,
            rf"^slicer-dispatch: error: cannot listen on {live}: the socket is in use: a "
            r"process answers on it \(stop it, or give another path with --listen-unix PATH\)$",
        )
        assert live.is_socket()  # still there, and still its owner's
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(live))
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    r = run_cli(_dispatch(tmp_path, "--listen-unix", str(afile)))
    assert_one_line(
        r,
        73,
        rf"^slicer-dispatch: error: {afile} exists and is not a socket \(move it away, or "
        r"give another path with --listen-unix PATH\)$",
    )
    assert afile.read_text() == "keep me"


def test_a_dead_unix_socket_is_removed_for_the_front(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as gone:  # a previous run's, nobody listens now
        gone.bind(str(dead))
    assert dead.is_socket()
    startup.claim_unix_socket(str(dead))
    assert not dead.exists()
    startup.claim_unix_socket(str(dead))  # nothing there: fine


def test_dispatcher_state_dir_failures_name_the_path(tmp_path: Path) -> None:
    listen = ["--listen", f"127.0.0.1:{free_port()}"]
    afile = tmp_path / "afile"
    afile.touch()
    state = afile / "state"
    r = run_cli([*_dispatch(tmp_path, *listen), "--state-dir", str(state)])
    assert_one_line(
        r,
        73,
        rf"^slicer-dispatch: error: cannot create the lock file {state}/dispatch\.lock: .*Not a "
        r"directory.* \(make it writable by this user, or give another --state-dir\)$",
    )
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "dispatch.db").write_bytes(b"not a database, not at all" * 200)
    r = run_cli([*_dispatch(tmp_path, *listen), "--state-dir", str(damaged)])
    assert_one_line(
        r,
        65,
        rf"^slicer-dispatch: error: cannot open the dispatch store {damaged}/dispatch\.db: file "
        r"is not a database: the store is damaged \(move the file aside to start an empty "
        r"store, or restore it from a backup\)$",
    )
    owned = tmp_path / "owned"
    lock = StateLock.acquire(owned)  # as a running dispatcher holds it
    try:
        r = run_cli([*_dispatch(tmp_path, *listen), "--state-dir", str(owned)])
    finally:
        lock.release()
    assert_one_line(
        r,
        75,
        rf"^slicer-dispatch: error: state dir {owned} is in use by another slicer-dispatch "
        rf"\(pid {os.getpid()}, lock {owned}/dispatch\.lock\); run one dispatcher per state dir$",
    )


async def test_dispatcher_starts_and_waits_when_slicerd_is_unreachable(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, *_dispatch(tmp_path, "--listen", f"127.0.0.1:{port}")]
    log = tmp_path / "d.log"
    with trio.fail_after(60), log.open("wb") as out:
        proc = subprocess.Popen(argv, env=child_env({}), stdout=out, stderr=subprocess.STDOUT)
        try:
            await until_listening(proc, port, 45, "slicer-dispatch", log)
            assert proc.poll() is None  # no daemon is not a reason to exit
            proc.send_signal(signal.SIGTERM)
            rc = await trio.to_thread.run_sync(proc.wait)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == 0, log.read_text()
    assert "Traceback" not in log.read_text()
