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


# (name, extra slicerd arguments given the tmp dir, exit code, the line's pattern)
SLICERD_CASES: list[tuple[str, Callable[[Path], list[str]], int, str]] = [
    ("unknown option", lambda t: ["--bogus"], 64, r"^slicerd: error: No such option '--bogus'"),
    (
        "bad flag value",
        lambda t: ["--park-timeout", "soon"],
        64,
        r"^slicerd: error: Invalid value for '--park-timeout': 'soon'.*" + HELP,
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
        r"^slicerd: error: .*s\.toml exists and is not a socket",
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
            # the same socket, a state dir of its own: the path is another daemon's
            busy = [*argv, "--state-dir", str(stack.base / "state2")]
            r = await arun_cli(busy, stack.env)
            assert_one_line(
                r,
                69,
                rf"^slicerd: error: another daemon is listening on {stack.socket} \(stop it, "
                r"or give this one its own --socket\)$",
            )
            # the same state dir, a socket of its own: the state dir is locked
            locked = [*argv, "--socket", str(stack.base / "other.sock")]
            r = await arun_cli(locked, stack.env)
            assert_one_line(
                r,
                78,
                rf"^slicerd: error: another slicerd \(pid {stack.proc.pid if stack.proc else 0}\) "
                rf"owns state dir {stack.base / 'state'}; stop it first",
            )
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
