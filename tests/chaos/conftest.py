"""No process, and no process object, outlives a chaos test.

A ``subprocess.Popen`` (or the one inside a ``trio.Process``) that nobody waited for warns
``ResourceWarning: subprocess N is still running`` when it is garbage-collected, even if
the process is long dead; with ``filterwarnings = error`` that fails whichever test is
running when the collector gets to it (a `tests/test_cli.py` test, right after a chaos
run whose cleanup had not waited for slicerd). So after each test here: collect garbage
while recording warnings, reap every process object the test left unreaped, end every
child process it left, and fail *this* test if there was anything, never a later one.
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import warnings
import weakref
from collections.abc import Iterator

import psutil
import pytest
import trio

KILL_WAIT_S = 5.0


def _of_type(cls: type) -> list[object]:
    # type(), not isinstance(): isinstance reads `__class__`, which some foreign objects
    # (torch's deprecated `reduce_op`, imported by other tests) answer with a warning.
    return [o for o in gc.get_objects() if issubclass(type(o), cls)]


def _unreaped() -> list[subprocess.Popen[bytes]]:
    popens = _of_type(subprocess.Popen)
    return [o for o in popens if isinstance(o, subprocess.Popen) and o.returncode is None]


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def reap_leftovers(
    popens_before: weakref.WeakSet[subprocess.Popen[bytes]], children_before: set[int]
) -> list[str]:
    """End and reap what a test left behind (not what was there before it); what it was."""
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
        for p in _unreaped():
            if p in popens_before:
                continue
            running = p.poll() is None
            problems.append(f"unreaped {'running' if running else 'ended'} {p.args!r}")
            if running:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=KILL_WAIT_S)
        for o in _of_type(trio.Process):
            if isinstance(o, trio.Process):
                o.poll()  # its Popen is reaped now: this closes its pidfd
        gc.collect()
    problems += [f"{w.category.__name__}: {w.message}" for w in caught]
    for pid in _children() - children_before:
        with contextlib.suppress(psutil.NoSuchProcess):
            child = psutil.Process(pid)
            problems.append(f"child process left running: {pid} {child.cmdline()[:4]}")
            child.kill()
            with contextlib.suppress(psutil.TimeoutExpired):
                child.wait(timeout=KILL_WAIT_S)
    return problems


@pytest.fixture(autouse=True)
def no_process_outlives_the_test() -> Iterator[None]:
    popens, children = weakref.WeakSet(_unreaped()), _children()
    yield
    problems = reap_leftovers(popens, children)
    if problems:
        pytest.fail("the test left processes behind (now ended):\n  " + "\n  ".join(problems))
