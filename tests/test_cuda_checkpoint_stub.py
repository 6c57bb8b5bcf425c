"""The cuda-checkpoint stub: CLI, state machine, memory moves, injected failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stubs.cuda_checkpoint_stub import main
from stubs.fakegpu import Ledger, ProcMem
from stubs.proc import child_env

pytestmark = pytest.mark.integration  # the tool and its target processes are children

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "stubs" / "cuda-checkpoint"
MiB = 1024**2
GiB = 1024**3

Spawn = Callable[[], subprocess.Popen[bytes]]


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    monkeypatch.setenv("FAKEGPU_DIR", str(tmp_path))
    monkeypatch.setenv("FAKEGPU_BANDWIDTH", "1000TB")
    monkeypatch.setenv("FAKEGPU_CC_LOG", str(tmp_path / "cc.log"))
    for name in ("FAKEGPU_CC_TOGGLE_ONLY", "FAKEGPU_HANG_MAX", "FAKEGPU_WORKLOAD"):
        monkeypatch.delenv(name, raising=False)
    return Ledger.init(tmp_path, gpus=1, capacity=GiB)


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start sleeping child processes to stand in for CUDA processes; kill them after."""
    children: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()
        child.wait(timeout=10)


@pytest.fixture
def cuda_pid(ledger: Ledger, spawn: Spawn) -> int:
    """A live process with 600 MiB on GPU 0."""
    pid = spawn().pid
    ledger.alloc(pid, 0, 600 * MiB, workload="vllm")
    return pid


def cc(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """Run the stub in-process: (exit status, stdout, stderr)."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def tool(*args: object, **env: str) -> subprocess.Popen[str]:
    """Start the real script as a child process."""
    return subprocess.Popen(
        [sys.executable, str(TOOL), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 15) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def still_running(proc: subprocess.Popen[str], seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


def test_script_is_executable_with_shebang() -> None:
    assert os.access(TOOL, os.X_OK)
    assert TOOL.read_text().startswith("#!/usr/bin/env python3\n")


def test_runs_on_the_python3_the_harness_puts_first_on_path() -> None:
    # Executed by its shebang, as slicerd runs it: `env python3` must find this interpreter.
    res = subprocess.run([str(TOOL), "--help"], env=child_env(), capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert b"--get-state" in res.stdout


def test_an_interpreter_without_the_project_gets_one_line_and_exit_1() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(  # -S: no site-packages, so neither psutil nor the project
        [sys.executable, "-S", str(TOOL), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "installed" in lines[0], res.stderr


def test_help_lists_action_and_get_state(ledger: Ledger) -> None:
    rc, out, _ = finish(tool("--help"))
    assert rc == 0
    for flag in ("--action", "--get-state", "--toggle", "--pid", "--timeout", "checkpoint"):
        assert flag in out


def test_full_cycle_moves_memory(ledger: Ledger, cuda_pid: int) -> None:
    pid = cuda_pid
    assert finish(tool("--get-state", "--pid", pid)) == (0, "running\n", "")
    assert finish(tool("--action", "lock", "--pid", pid, "--timeout", 5000))[0] == 0
    assert ledger.state(pid) == "locked"
    assert ledger.processes() == [ProcMem(pid, 0, 600 * MiB, 0, "vllm")]
    assert finish(tool("--action", "checkpoint", "--pid", pid))[0] == 0
    assert finish(tool("--get-state", "--pid", pid))[1] == "checkpointed\n"
    assert ledger.processes() == [ProcMem(pid, 0, 0, 600 * MiB, "vllm")]
    assert ledger.gpus()[0].used == 0
    assert finish(tool("--action", "restore", "--pid", pid))[0] == 0
    assert ledger.state(pid) == "locked"
    assert ledger.processes() == [ProcMem(pid, 0, 600 * MiB, 0, "vllm")]
    assert finish(tool("--action", "unlock", "--pid", pid))[0] == 0
    assert ledger.state(pid) == "running"
    log = [json.loads(line) for line in (ledger.directory / "cc.log").read_text().splitlines()]
    assert [(e["op"], e["rc"], e["state_after"]) for e in log] == [
        ("get-state", 0, "running"),
        ("lock", 0, "locked"),
        ("checkpoint", 0, "checkpointed"),
        ("get-state", 0, "checkpointed"),
        ("restore", 0, "locked"),
        ("unlock", 0, "running"),
    ]
    assert all(e["pid"] == pid for e in log)


def test_toggle_both_directions(
    ledger: Ledger, cuda_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cc(capsys, "--toggle", "--pid", cuda_pid)[0] == 0
    assert ledger.state(cuda_pid) == "checkpointed"
    assert ledger.gpus()[0].used == 0
    assert cc(capsys, "--toggle", "--pid", cuda_pid)[0] == 0
    assert ledger.state(cuda_pid) == "running"
    assert ledger.gpus()[0].used == 600 * MiB


def test_checkpoint_copies_before_releasing(ledger: Ledger, cuda_pid: int) -> None:
    ledger.set_state(cuda_pid, "locked")
    proc = tool("--action", "checkpoint", "--pid", cuda_pid, FAKEGPU_BANDWIDTH=f"{600 * MiB}")
    assert still_running(proc, 0.5)  # one second of copying at 600 MiB/s
    assert ledger.gpus()[0].used == 600 * MiB
    assert finish(proc)[0] == 0
    assert ledger.gpus()[0].used == 0


@pytest.mark.parametrize(
    ("state", "args"),
    [
        ("running", ["--action", "unlock"]),
        ("running", ["--action", "checkpoint"]),
        ("running", ["--action", "restore"]),
        ("locked", ["--action", "lock"]),
        ("locked", ["--action", "restore"]),
        ("locked", ["--toggle"]),
        ("checkpointed", ["--action", "unlock"]),
        ("checkpointed", ["--action", "lock"]),
    ],
)
def test_illegal_transition_changes_nothing(
    ledger: Ledger,
    cuda_pid: int,
    capsys: pytest.CaptureFixture[str],
    state: str,
    args: list[str],
) -> None:
    ledger.set_state(cuda_pid, state)
    before = ledger.snapshot()
    rc, _, err = cc(capsys, *args, "--pid", cuda_pid)
    assert rc == 1
    assert f"process {cuda_pid}" in err
    assert ledger.snapshot() == before


def test_no_such_process_and_not_cuda(
    ledger: Ledger, spawn: Spawn, capsys: pytest.CaptureFixture[str]
) -> None:
    child = spawn()
    rc, _, err = cc(capsys, "--get-state", "--pid", child.pid)
    assert rc == 1
    assert "OPERATION_NOT_SUPPORTED" in err
    child.kill()
    child.wait(timeout=10)
    rc, _, err = cc(capsys, "--action", "lock", "--pid", child.pid)
    assert rc == 1
    assert "no such process" in err


def test_usage_errors_exit_2(ledger: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    assert cc(capsys, "--action", "lock")[0] == 2
    assert cc(capsys, "--pid", 1)[0] == 2
    assert cc(capsys, "--action", "explode", "--pid", 1)[0] == 2
    assert cc(capsys, "--toggle", "--get-state", "--pid", 1)[0] == 2


def test_injected_fail_is_terminal(
    ledger: Ledger, cuda_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger.inject(cuda_pid, "checkpoint")
    assert cc(capsys, "--action", "lock", "--pid", cuda_pid)[0] == 0
    rc, _, err = cc(capsys, "--action", "checkpoint", "--pid", cuda_pid)
    assert rc == 1
    assert "checkpoint" in err
    assert cc(capsys, "--get-state", "--pid", cuda_pid) == (0, "failed\n", "")
    ledger.clear_injection(cuda_pid)
    for args in (["--action", "unlock"], ["--action", "checkpoint"], ["--toggle"]):
        assert cc(capsys, *args, "--pid", cuda_pid)[0] == 1
    assert ledger.state(cuda_pid) == "failed"
    assert ledger.gpus()[0].used == 600 * MiB


def test_toggle_honours_injections(
    ledger: Ledger, cuda_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cc(capsys, "--toggle", "--pid", cuda_pid)[0] == 0
    ledger.inject(cuda_pid, "unlock")
    assert cc(capsys, "--toggle", "--pid", cuda_pid)[0] == 1
    assert ledger.state(cuda_pid) == "failed"


def test_hang_unblocked_by_clear(ledger: Ledger, cuda_pid: int) -> None:
    ledger.inject(cuda_pid, "lock", hang=True)
    proc = tool("--action", "lock", "--pid", cuda_pid)
    assert still_running(proc, 0.5)
    assert ledger.state(cuda_pid) == "running"
    ledger.clear_injection(cuda_pid, "lock")
    assert finish(proc)[0] == 0
    assert ledger.state(cuda_pid) == "locked"


def test_hang_unblocked_by_target_exit(ledger: Ledger, spawn: Spawn) -> None:
    target = spawn()
    ledger.alloc(target.pid, 0, MiB)
    ledger.set_state(target.pid, "checkpointed")
    ledger.move(target.pid, to_device=False)
    ledger.inject(target.pid, "restore", hang=True)
    proc = tool("--action", "restore", "--pid", target.pid)
    assert still_running(proc, 0.5)
    target.kill()
    target.wait(timeout=10)
    rc, _, err = finish(proc)
    assert rc == 1
    assert "exited" in err or "no such process" in err


def test_lock_timeout_outlasted_by_hang(
    ledger: Ledger, cuda_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger.inject(cuda_pid, "lock", hang=True)
    rc, _, err = cc(capsys, "--action", "lock", "--pid", cuda_pid, "--timeout", 100)
    assert rc == 1
    assert "timed out" in err
    assert ledger.state(cuda_pid) == "running"


def test_hang_bounded_by_hang_max(
    ledger: Ledger,
    cuda_pid: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKEGPU_HANG_MAX", "0.1")
    ledger.set_state(cuda_pid, "locked")
    ledger.inject(cuda_pid, "checkpoint", hang=True)
    assert cc(capsys, "--action", "checkpoint", "--pid", cuda_pid)[0] == 1
    assert ledger.state(cuda_pid) == "locked"
    assert ledger.gpus()[0].used == 600 * MiB


def test_killing_the_tool_mid_operation_fails_the_process(ledger: Ledger, cuda_pid: int) -> None:
    ledger.inject(cuda_pid, "lock", hang=True)
    proc = tool("--action", "lock", "--pid", cuda_pid)
    assert still_running(proc, 1.0)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc)[0] == 128 + signal.SIGTERM
    assert ledger.state(cuda_pid) == "failed"


def test_toggle_only_mode(ledger: Ledger, cuda_pid: int) -> None:
    rc, out, _ = finish(tool("--help", FAKEGPU_CC_TOGGLE_ONLY="1"))
    assert rc == 0
    assert "--action" not in out
    assert "--toggle" in out
    assert "--get-state" in out
    rc, _, err = finish(tool("--action", "lock", "--pid", cuda_pid, FAKEGPU_CC_TOGGLE_ONLY="1"))
    assert rc == 2
    assert "--action" in err
    assert ledger.state(cuda_pid) == "running"
    assert finish(tool("--toggle", "--pid", cuda_pid, FAKEGPU_CC_TOGGLE_ONLY="1"))[0] == 0
    assert ledger.state(cuda_pid) == "checkpointed"


def test_restore_out_of_memory_is_stuck(
    ledger: Ledger, cuda_pid: int, spawn: Spawn, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cc(capsys, "--toggle", "--pid", cuda_pid)[0] == 0
    trainer = spawn().pid
    ledger.alloc(trainer, 0, 600 * MiB, workload="trainer")
    rc, _, err = cc(capsys, "--action", "restore", "--pid", cuda_pid)
    assert rc == 1
    assert "out of memory" in err
    assert ledger.state(cuda_pid) == "checkpointed"
    assert ledger.processes() == [
        ProcMem(cuda_pid, 0, 0, 600 * MiB, "vllm"),
        ProcMem(trainer, 0, 600 * MiB, 0, "trainer"),
    ]
    ledger.free(trainer)
    assert cc(capsys, "--action", "restore", "--pid", cuda_pid)[0] == 1
    assert cc(capsys, "--action", "unlock", "--pid", cuda_pid)[0] == 1
    assert cc(capsys, "--toggle", "--pid", cuda_pid)[0] == 1
    assert ledger.state(cuda_pid) == "checkpointed"
    assert ledger.overlaps() == 0
