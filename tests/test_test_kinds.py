"""The rule behind ``make unit`` (tests/conftest.py): a test that starts a child process
without the ``integration`` marker fails, whether it starts it in a fixture, in the test or
from trio's worker thread, and the failure names the command; marked, the same test passes.

One inner pytest session over a scratch copy of tests/conftest.py shows all of it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # the inner session and its tests start processes

HERE = Path(__file__).resolve().parent

INI = """\
[pytest]
addopts = --strict-markers -p no:cacheprovider -rA
trio_mode = true
markers =
    integration: starts child processes
"""

CASES = """\
import subprocess
import sys

import pytest
import trio

CHILD = [sys.executable, "-c", "pass"]


@pytest.fixture
def child():
    subprocess.run(CHILD + ["# from-a-fixture"], check=True)


def test_unmarked_spawn():
    subprocess.run(CHILD + ["# from-the-test"], check=True)


def test_unmarked_fixture_spawn(child):
    pass


async def test_unmarked_trio_spawn():
    await trio.run_process(CHILD + ["# from-trio"])


def test_unmarked_pure():
    assert sum([1, 2]) == 3


@pytest.mark.integration
def test_marked_spawn(child):
    subprocess.run(CHILD, check=True)


@pytest.mark.integration
async def test_marked_trio_spawn():
    await trio.run_process(CHILD)
"""


def test_unmarked_tests_that_start_processes_fail_and_say_why(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_cases.py").write_text(CASES)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "test_cases.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    for name in ("test_unmarked_pure", "test_marked_spawn", "test_marked_trio_spawn"):
        assert f"PASSED test_cases.py::{name}\n" in out, out
    for name, where in [
        ("test_unmarked_spawn", "# from-the-test"),
        ("test_unmarked_fixture_spawn", "# from-a-fixture"),
        ("test_unmarked_trio_spawn", "# from-trio"),
    ]:
        assert f"FAILED test_cases.py::{name} - " in out, out
        assert f"test_cases.py::{name}: a test that starts a child process is an integration" in out
        assert where in out, out
    assert "3 failed, 3 passed" in out, out
