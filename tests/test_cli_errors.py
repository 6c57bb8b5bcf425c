"""slicerd and slicerctl fail in one line: each case runs the real command as a child and
checks its exit code (README: "Running slicerd", "slicerctl") and its only stderr line,
``PROG: error: WHAT (WHAT TO DO)``, with no traceback anywhere."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from gpu_slicer.slicer import cli, daemon
from gpu_slicer.slicer.client import Unreachable
from gpu_slicer.slicer.errors import GpuBackendError
from gpu_slicer.slicer.exits import CliFailure
from gpu_slicer.slicer.journal import JournalError
from stubs.stack import Stack
from tests.clitable import arun_cli, assert_one_line, module_argv, run_cli
from tests.harness import running_stack

HELP = r" \(see 'slicerd --help'\)$"


def _daemon(tmp_path: Path) -> Stack:
    """A stack not yet started: the fake GPU's ledger and env, slicerd's arguments (at info
    level: a failing start logs nothing else)."""
    return Stack.create(tmp_path / "s", gpus=1, log_level="info")


def _conf(tmp_path: Path, body: str) -> str:
    path = tmp_path / "slicer.toml"
    path.write_text(body)
    return str(path)


def _plain_file(path: Path) -> str:
    path.touch()
    return str(path)


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def _big(path: Path) -> str:
    path.write_text("# padding\n" * 110_000)  # over 1 MiB of valid TOML
    return str(path)


SlicerdCase = tuple[str, Callable[[Path], list[str]], int, str]


def _bad_flag(name: str, flag: str, value: str, why: str) -> SlicerdCase:
    """The case of slicerd given ``flag value`` it refuses: a usage error (64) naming the
    flag, then `why` (a pattern), then the pointer to --help."""
    return (
        name,
        lambda t: [flag, value],
        64,
        rf"^slicerd: error: Invalid value for '{flag}': {why}{HELP}",
    )


# (name, extra slicerd arguments given the tmp dir, exit code, the line's pattern)
SLICERD_CASES: list[SlicerdCase] = [
    ("unknown option", lambda t: ["--bogus"], 64, r"^slicerd: error: No such option '--bogus'"),
    _bad_flag("bad flag value", "--park-timeout", "soon", "'soon'.*"),
    _bad_flag(
        "flag value out of range",
        "--park-timeout",
        "-1",
        r"park_timeout must be in \(0, 86400\) seconds, got -1.*",
    ),
    _bad_flag("flag value nan", "--verify-reuse-ms", "nan", ".*got nan"),
    _bad_flag(
        "flag socket mode not octal",
        "--socket-mode",
        "999",
        r".*bad value '999' \(expected an octal mode such as 660\)",
    ),
    _bad_flag("flag socket empty", "--socket", "", "socket must not be empty.*"),
    (
        "flag bad while the file is bad elsewhere",
        lambda t: [
            *("--config", _conf(t, "park_timeout = -1\n")),
            *("--park-timeout", "5", "--fault-kill-after", "0"),
        ],
        64,
        r"^slicerd: error: Invalid value for '--fault-kill-after': fault_kill_after must be",
    ),
    (
        "config missing",
        lambda t: ["--config", str(t / "none.toml")],
        78,
        r"^slicerd: error: cannot read config .*none\.toml: No such file or directory "
        r"\(check the --config path",
    ),
    (
        "config unreadable",
        lambda t: ["--config", str(t)],
        78,
        r"^slicerd: error: cannot read config .*: Is a directory \(",
    ),
    (
        "config not TOML",
        lambda t: ["--config", _conf(t, "park_timeout = \n")],
        78,
        r"^slicerd: error: cannot read config .*slicer\.toml: not valid TOML: .*line 1.*"
        r"\(fix the file",
    ),
    (
        "config unknown key",
        lambda t: ["--config", _conf(t, "[slicer]\nbogus = 1\n")],
        78,
        r"^slicerd: error: .*slicer\.toml: unknown key 'bogus' \(the keys are listed",
    ),
    (
        "config bad value",
        lambda t: ["--config", _conf(t, "park_timeout = -1\n")],
        78,
        r"^slicerd: error: park_timeout must be in \(0, 86400\) seconds, got -1",
    ),
    (
        "config socket mode not octal",
        lambda t: ["--config", _conf(t, 'socket_mode = "999"\n')],
        78,
        r"^slicerd: error: config key socket_mode: bad value '999' \(expected an octal mode "
        r"such as 660\)$",
    ),
    (
        "config is a fifo",
        lambda t: ["--config", _fifo(t / "f.toml")],
        78,
        r"^slicerd: error: cannot read config .*f\.toml: not a regular file \(",
    ),
    (
        "config too large",
        lambda t: ["--config", _big(t / "big.toml")],
        78,
        r"^slicerd: error: cannot read config .*big\.toml: larger than 1 MiB \(",
    ),
    (
        "module:attribute backend that is no factory",
        lambda t: ["--gpu-backend", "os:path"],
        78,
        r"^slicerd: error: gpu backend 'os:path' failed to start: .*\(check gpu_backend\)$",
    ),
    (
        "unknown gpu backend",
        lambda t: ["--gpu-backend", "cuda"],
        78,
        r"^slicerd: error: gpu_backend: unknown gpu backend 'cuda': one of nvml, fake",
    ),
    (
        "state dir not creatable",
        lambda t: ["--state-dir", "/proc/self/nope"],
        78,
        r"^slicerd: error: cannot create state dir /proc/self/nope: ",
    ),
    (
        "socket path is a file",
        lambda t: ["--socket", _plain_file(t / "s.toml")],
        78,
        r"^slicerd: error: .*s\.toml exists and is not a socket \(remove it if it is left over, "
        r"or choose another --socket\)$",
    ),
    (
        "socket under a file",
        lambda t: ["--socket", _plain_file(t / "f") + "/s.sock"],
        78,
        r"^slicerd: error: cannot listen on .*f/s\.sock: .*/f is not a directory \(choose "
        r"another --socket\)$",
    ),
    (
        "socket dir not creatable",
        lambda t: ["--socket", "/proc/self/nope/s.sock"],
        78,
        r"^slicerd: error: cannot listen on /proc/self/nope/s\.sock: .* \(its directory must be",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "rc", "pattern"),
    [c[1:] for c in SLICERD_CASES],
    ids=[c[0] for c in SLICERD_CASES],
)
def test_slicerd_fails_in_one_line(
    tmp_path: Path, args: Callable[[Path], list[str]], rc: int, pattern: str
) -> None:
    stack = _daemon(tmp_path)
    r = run_cli(["-m", "gpu_slicer.slicer.daemon", *stack.args, *args(tmp_path)], stack.env)
    assert_one_line(r, rc, pattern)
    assert stack.ledger.overlaps() == 0


@pytest.mark.integration
async def test_slicerd_beside_a_running_one_fails_in_one_line() -> None:
    with trio.fail_after(120):
        async with running_stack(gpus=1) as stack:
            argv = ["-m", "gpu_slicer.slicer.daemon", *stack.args, "--log-level", "info"]
            pid = stack.proc.pid if stack.proc else 0
            cases = [
                # the same socket, a state dir of its own: the path is another daemon's
                (
                    ["--state-dir", str(stack.base / "state2")],
                    69,
                    rf"^slicerd: error: another daemon is listening on {stack.socket} \(stop it, "
                    r"or give this one its own --socket\)$",
                ),
                # the same state dir, a socket of its own: the state dir is locked
                (
                    ["--socket", str(stack.base / "other.sock")],
                    78,
                    rf"^slicerd: error: another slicerd \(pid {pid}\) "
                    rf"owns state dir {stack.base / 'state'}; stop it first",
                ),
            ]
            for extra, rc, pattern in cases:
                assert_one_line(await arun_cli([*argv, *extra], stack.env), rc, pattern)
            assert not (stack.base / "other.sock").exists()
            assert (await stack.status())["workloads"] == []  # the first one still serves
            assert stack.overlaps() == 0


@pytest.mark.parametrize(
    ("error", "rc"),
    [
        (JournalError("cannot write journal /x: full"), 78),
        (GpuBackendError("NVML is not available"), 69),
        (CliFailure("its own line", 75), 75),
        (RuntimeError("boom\nsecond line"), 70),
    ],
)
def test_a_failure_inside_the_daemons_nursery_keeps_its_code(error: Exception, rc: int) -> None:
    """What stops serve() inside its nursery arrives in exception groups: the line and the
    code are the leaf's, and a bug's text is still one line."""
    failure = daemon._failure(daemon._leaf(ExceptionGroup("serve", [ExceptionGroup("n", [error])])))
    assert isinstance(failure, CliFailure) and failure.exit_code == rc
    assert "\n" not in failure.format_message()


# ---- slicerctl ----------------------------------------------------------------------------

HINT = r"\(is slicerd running\? check `systemctl status slicer`, or pass --socket\)$"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "rc", "pattern"),
    [
        (
            ["--bogus"],
            64,
            r"^slicerctl: error: No such option '--bogus'.* \(see 'slicerctl --help'\)$",
        ),
        (
            ["watch", "--count", "0"],
            64,
            r"^slicerctl: error: Invalid value for '--count'.*\(see 'slicerctl watch --help'\)$",
        ),
        (["frobnicate"], 64, r"^slicerctl: error: No such command 'frobnicate'"),
    ],
    ids=["unknown option", "bad value", "unknown command"],
)
def test_slicerctl_usage_errors_fail_in_one_line(args: list[str], rc: int, pattern: str) -> None:
    assert_one_line(run_cli(module_argv("slicerctl", *args)), rc, pattern)


@pytest.mark.integration
@pytest.mark.parametrize(
    "cmd", [["ping"], ["status"], ["workloads"], ["watch"], ["watch", "--once"]]
)
def test_slicerctl_unreachable_daemon_is_69_naming_the_socket(
    tmp_path: Path, cmd: list[str]
) -> None:
    path = tmp_path / "none.sock"
    r = run_cli(module_argv("slicerctl", "--socket", str(path), *cmd))
    assert_one_line(
        r,
        69,
        rf"^slicerctl: error: cannot reach slicerd at {path}: No such file or directory {HINT}",
    )
    # the environment's socket is the default, and is named the same way
    r = run_cli(module_argv("slicerctl", *cmd), {"SLICER_SOCKET": str(path)})
    assert_one_line(r, 69, rf"^slicerctl: error: cannot reach slicerd at {path}: ")


@pytest.mark.integration
async def test_slicerctl_err_reply_is_1_naming_code_and_text(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with trio.fail_after(60), trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        await srv.bind(path)
        srv.listen()

        async def answer_err() -> None:
            conn, _ = await srv.accept()
            with conn:
                stream = trio.SocketStream(conn)
                while b"\n" not in await stream.receive_some(4096):
                    pass
                await stream.send_all(b"ERR internal -- state machine on fire\n")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_err)
            r = await arun_cli(module_argv("slicerctl", "--socket", path, "status"))
    assert_one_line(
        r, 1, r"^slicerctl: error: slicerd answered ERR internal: state machine on fire$"
    )


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() == 0, reason="root is never refused a socket")
def test_slicerctl_permission_denied_is_77(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen()
        os.chmod(path, 0)
        r = run_cli(module_argv("slicerctl", "--socket", path, "ping"))
    assert_one_line(
        r, 77, rf"^slicerctl: error: permission denied on slicerd's socket {path} \(join"
    )


def test_slicerctl_permission_denied_is_77_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same as the child-process case, for a root test run (root is never refused):
    the connect's PermissionError is what the client reports."""

    def refused(path: str, timeout: float = 0) -> None:
        try:
            raise PermissionError(13, "Permission denied")
        except PermissionError as e:
            raise Unreachable(f"cannot connect to {path}: {e}") from e

    monkeypatch.setattr(cli, "Slicer", refused)
    r = CliRunner().invoke(cli.main, ["--socket", "/run/x.sock", "ping"], catch_exceptions=False)
    assert r.exit_code == 77
    assert r.stderr == (
        "slicerctl: error: permission denied on slicerd's socket /run/x.sock (join the "
        "socket's group, see socket_group in slicer.toml, or run as root)\n"
    )


# ---- bare commands, bad values of the launcher, output that cannot be written --------------


@pytest.mark.integration
@pytest.mark.parametrize("prog", ["slicerctl", "slicer-launch"])
def test_a_bare_command_prints_its_help_and_exits_64(prog: str) -> None:
    r = run_cli(module_argv(prog))
    assert r.rc == 64, r.describe()
    assert r.stdout == "" and "Traceback" not in r.stderr, r.describe()
    lines = r.stderr.splitlines()
    assert lines[0] == f"Usage: {prog} [OPTIONS] COMMAND [ARGS]...", r.describe()
    assert "Commands:" in lines and "error:" not in r.stderr, r.describe()


LAUNCH = r" \(see 'slicer-launch run --help'\)$"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "rc", "pattern"),
    [
        (
            ["--log-level", "bogus"],
            64,
            r"^slicer-launch: error: Invalid value for '--log-level': 'bogus' is not one of "
            + ".*"
            + LAUNCH,
        ),
        (
            ["--kill-grace", "-1"],
            64,
            r"^slicer-launch: error: Invalid value for '--kill-grace': -1.0 is not in the range "
            r"x>=0\." + LAUNCH,
        ),
        (
            ["--kill-grace", "nan"],
            64,
            r"^slicer-launch: error: Invalid value for '--kill-grace': 'nan' is not a finite "
            r"number of seconds" + LAUNCH,
        ),
        (
            ["--connect-timeout", "inf"],
            64,
            r"^slicer-launch: error: Invalid value for '--connect-timeout': 'inf' is not a "
            r"finite number of seconds" + LAUNCH,
        ),
        (
            ["--connect-timeout", "-5"],
            64,
            r"^slicer-launch: error: Invalid value for '--connect-timeout': -5.0 is not in ",
        ),
        (
            ["--socket", ""],
            64,
            r"^slicer-launch: error: Invalid value for '--socket': is empty" + ".*" + LAUNCH,
        ),
        # a level in capitals is a level: the run goes on to the (absent) daemon
        (
            ["--log-level", "WARNING", "--connect-timeout", "0"],
            69,
            r"^slicer-launch: error: cannot reach slicerd at .*none\.sock \(tried for 0 s\)",
        ),
    ],
    ids=["log level", "negative grace", "nan grace", "inf timeout", "negative timeout", "no socket",
         "log level in capitals"],
)  # fmt: skip
def test_launcher_option_values_are_checked(
    tmp_path: Path, args: list[str], rc: int, pattern: str
) -> None:
    run = ["run", "--workload", "w", "--socket", str(tmp_path / "none.sock"), *args, "--", "true"]
    if args[0] == "--socket":
        run[3:5] = []
    assert_one_line(run_cli(module_argv("slicer-launch", *run)), rc, pattern)


@pytest.mark.integration
def test_vllm_timeouts_are_checked() -> None:
    r = run_cli(module_argv("slicer-launch", "vllm", "--workload", "w", "--boot-timeout", "nan",
                            "--", "true"))  # fmt: skip
    assert_one_line(
        r,
        64,
        r"^slicer-launch: error: Invalid value for '--boot-timeout': 'nan' is not a finite "
        r"number of seconds \(see 'slicer-launch vllm --help'\)$",
    )


@pytest.mark.integration
def test_launcher_commands_that_cannot_start_say_why(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")  # checked before the REGISTER: no daemon needed
    r = run_cli(module_argv("slicer-launch", "run", "--workload", "w", "--", ""))
    assert_one_line(
        r,
        64,
        r"^slicer-launch: error: COMMAND is empty: give the program to run after '--' "
        r"\(see 'slicer-launch run --help'\)$",
    )
    script = tmp_path / "x.sh"
    script.write_text("#!/no/such/sh\necho hi\n")
    script.chmod(0o755)
    r = run_cli(module_argv("slicer-launch", "run", "--workload", "w", "--socket", sock,
                            "--", str(script)))  # fmt: skip
    assert_one_line(
        r,
        126,
        rf"^slicer-launch: error: cannot start {script}: bad interpreter /no/such/sh: No such "
        r"file or directory \(fix its #! line, or run it through its interpreter\)$",
    )


@pytest.mark.integration
def test_slicerctl_socket_paths_that_cannot_work_say_why(tmp_path: Path) -> None:
    long = str(tmp_path / ("x" * 120))
    assert_one_line(
        run_cli(module_argv("slicerctl", "--socket", long, "ping")),
        64,
        r"^slicerctl: error: socket path is \d+ bytes, longer than a Unix socket path may be "
        r"\(107\) \(give a shorter --socket or SLICER_SOCKET\)$",
    )
    plain = _plain_file(tmp_path / "plain")
    assert_one_line(
        run_cli(module_argv("slicerctl", "--socket", plain, "status")),
        69,
        rf"^slicerctl: error: cannot reach slicerd at {plain}: it is not a socket \(check "
        r"--socket and SLICER_SOCKET",
    )
    assert_one_line(
        run_cli(module_argv("slicerctl", "--socket", "", "ping")),
        64,
        r"^slicerctl: error: Invalid value for '--socket': is empty: give slicerd's socket "
        r"path, or leave it out \(see 'slicerctl --help'\)$",
    )


def _run_to(stdout: int, *args: str) -> tuple[int, str]:
    import subprocess
    import sys

    from stubs.proc import child_env

    done = subprocess.run(
        [sys.executable, *module_argv("slicerctl", *args)],
        env=child_env({}),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stderr


@pytest.mark.integration
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["completion", "bash"], ["--help"]])
def test_output_that_cannot_be_written_is_74_or_a_quiet_0(args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        rc, err = _run_to(full.fileno(), *args)
    assert rc == 74, err
    assert err == (
        "slicerctl: error: cannot write the output: No space left on device (check where "
        "stdout goes)\n"
    )
    # a reader that went away (`slicerctl ... | true`): no failure, nothing said
    r, w = os.pipe()
    os.close(r)
    try:
        rc, err = _run_to(w, *args)
    finally:
        os.close(w)
    assert (rc, err) == (0, "")


# ---- slicerd's start, in process --------------------------------------------------------


async def test_a_failed_start_releases_the_state_dir_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slicerd run in process (a test harness, an embedding) that fails to start after
    taking the state-dir lock gives it back: the next start is not refused as locked."""
    from gpu_slicer.slicer.config import load
    from gpu_slicer.slicer.errors import ConfigError
    from gpu_slicer.slicer.journal import StateLock
    from stubs.fakegpu import Ledger

    Ledger.init(tmp_path / "gpu", 1, 1 << 30)
    monkeypatch.setenv("FAKEGPU_DIR", str(tmp_path / "gpu"))
    (tmp_path / "sock").mkdir()  # a directory where the socket goes: the start fails
    flags = {"gpu_backend": "fake", "state_dir": str(tmp_path / "state")}
    cfg = load(str(_conf(tmp_path, "")), {**flags, "socket": str(tmp_path / "sock")})
    with trio.fail_after(30), pytest.raises(ConfigError, match="exists and is a directory"):
        await daemon.serve(cfg)
    lock = StateLock(tmp_path / "state")
    lock.acquire()  # StateDirLocked if the failed start still held it
    lock.release()


async def test_a_live_daemon_with_a_full_backlog_is_busy_not_stale(tmp_path: Path) -> None:
    """The stale-socket probe never waits on a daemon too busy to accept: it is busy."""
    from gpu_slicer.slicer.listen import SocketBusy, _bind

    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(0)
        held = []
        try:
            while True:  # fill its backlog: it never accepts
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.setblocking(False)
                held.append(c)
                c.connect(path)
        except BlockingIOError:
            pass
        try:
            with trio.fail_after(10), pytest.raises(SocketBusy, match="another daemon"):
                await trio.to_thread.run_sync(_bind, path, 0o660, None, abandon_on_cancel=True)
            assert os.path.exists(path)  # not unlinked as stale
        finally:
            for c in held:
                c.close()
