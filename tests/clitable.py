"""The runner of the command-line table tests: a real child process, its exit code and output.

    result = run_cli(["-m", "gpu_slicer.slicer.cli", "--socket", path, "ping"])
    assert_one_line(result, 69, r"^slicerctl: error: cannot reach slicerd at .*")

`run_cli` (blocking) and `arun_cli` (trio: the test's own servers keep running) start
``sys.executable ARGV...`` (give ``-m MODULE`` first, or use `module_argv`) in the
environment of `stubs.proc.child_env` (this interpreter's bin dir on PATH, the checkout
importable, no SLICER_SOCKET/NOTIFY_SOCKET of ours) plus `env`, with stdin closed, bounded
by `timeout`. Tests that use them start child processes: mark them
``pytest.mark.integration`` (tests/conftest.py enforces it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import trio

from stubs.proc import child_env

__all__ = ["CliResult", "arun_cli", "assert_one_line", "module_argv", "run_cli"]

# The entry points' modules, by program name (argv for `run_cli`: module_argv(PROG, ...)).
MODULES = {
    "slicerd": "gpu_slicer.slicer.daemon",
    "slicerctl": "gpu_slicer.slicer.cli",
    "slicer-launch": "gpu_slicer.launcher.main",
    "slicer-dispatch": "gpu_slicer.dispatcher.main",
}


@dataclass(frozen=True)
class CliResult:
    """What a finished command left: exit code, stdout, stderr (text), and its argv."""

    rc: int
    stdout: str
    stderr: str
    argv: tuple[str, ...] = ()

    def describe(self) -> str:
        """The run for an assertion message: argv, code, and both streams."""
        return (
            f"argv: {' '.join(self.argv)}\nrc: {self.rc}\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )


def module_argv(prog: str, *args: str) -> list[str]:
    """``["-m", MODULE, *args]`` for program `prog` (one of `MODULES`)."""
    return ["-m", MODULES[prog], *args]


def run_cli(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    stdin: str | None = None,
) -> CliResult:
    """Run ``sys.executable *argv`` to its end (at most `timeout` s: then the test fails
    with `subprocess.TimeoutExpired`); `env` is added to the child environment, `stdin`
    is its input (default: none, stdin is /dev/null)."""
    full = [sys.executable, *argv]
    done = subprocess.run(
        full,
        env=child_env(dict(env or {})),
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr, tuple(full))


async def arun_cli(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    stdin: str | None = None,
) -> CliResult:
    """`run_cli` for trio tests: the command runs while the loop goes on (a test's scripted
    server answers it); past `timeout` s it is killed and `trio.TooSlowError` raised."""
    full = [sys.executable, *argv]
    with trio.fail_after(timeout):
        done = await trio.run_process(
            full,
            env=child_env(dict(env or {})),
            stdin=(stdin or "").encode(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out, err = (b.decode(errors="replace") for b in (done.stdout, done.stderr))
    return CliResult(done.returncode, out, err, tuple(full))


def assert_one_line(result: CliResult, rc: int, pattern: str) -> str:
    """Check that `result` exited `rc`, that its stderr holds exactly one non-empty line,
    that the line matches the regex `pattern` (``re.search``), and that no traceback shows
    on either stream; return the line."""
    why = result.describe()
    assert "Traceback" not in result.stderr + result.stdout, why
    assert result.rc == rc, f"exit code {result.rc}, wanted {rc}\n{why}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{len(lines)} lines on stderr, wanted one\n{why}"
    assert re.search(pattern, lines[0]), f"stderr line does not match {pattern!r}\n{why}"
    return lines[0]
