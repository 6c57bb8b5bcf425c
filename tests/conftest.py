"""The kinds of test, and the rule that keeps ``make unit`` a fast loop.

Markers (declared in pyproject.toml, ``--strict-markers``):

- ``integration``: the test starts child processes (slicerd, the launcher, the stubs, a
  tool, a shell). ``make integration`` runs these.
- ``fuzz``: a long property or fuzz run (hypothesis with many examples).
- ``chaos``: the chaos scenarios and their regressions (tests/chaos).

``make unit`` runs everything else (``-m "not integration and not fuzz and not chaos"``):
pure and in-process tests (trio memory streams, ``autojump_clock``, mocked transports).
``make test`` runs both halves, so nothing falls between them.

The rule is checked, not trusted: a test without the ``integration`` marker that starts a
child process (``subprocess``, ``trio.run_process``, ``os.fork``, ``os.posix_spawn``,
``os.system``, ...) during its setup, call or teardown fails, naming the command. Process
creation is seen through an audit hook (``sys.addaudithook``, which fires in every thread,
so it also sees trio's ``open_process`` worker thread); a child still running at the end of
an unmarked test is caught too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Generator
from typing import Any

import psutil
import pytest

# Audit events that create a process (exec replaces this one, so it is not among them).
SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"}
)
RULE = (
    "a test that starts a child process is an integration test: mark it "
    "`@pytest.mark.integration` (or `pytestmark = pytest.mark.integration` for the file), "
    "or test the code in-process (tests/conftest.py)"
)

# The unmarked test whose phase is running, and what it spawned: one test runs at a time,
# and the audit hook (which cannot be removed) reports into whichever that is.
_current: pytest.Item | None = None
_spawned: list[str] = []
_CHILDREN = pytest.StashKey[set[int]]()  # the children an unmarked test found at its start


def _describe(event: str, args: tuple[Any, ...]) -> str:
    if event == "subprocess.Popen" and len(args) >= 2:
        cmd = args[1]
        words = [cmd] if isinstance(cmd, str | bytes) else list(cmd or [])
        return f"{event}: {' '.join(str(w) for w in words[:6])}"
    if event == "os.system" and args:
        return f"{event}: {args[0]!r}"
    return event


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _current is not None and event in SPAWN_EVENTS:
        _spawned.append(_describe(event, args))


sys.addaudithook(_audit)


def _may_spawn(item: pytest.Item) -> bool:
    return item.get_closest_marker("integration") is not None


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def _check(item: pytest.Item, children_before: set[int] | None = None) -> None:
    found = list(dict.fromkeys(_spawned))
    _spawned.clear()
    if children_before is not None:
        found += [f"child process still running: pid {p}" for p in _children() - children_before]
    if found:
        pytest.fail(f"{item.nodeid}: {RULE}; it started:\n  " + "\n  ".join(found[:10]))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build matplotlib's font cache before any test runs: on a machine that never ran it
    (a fresh CI runner) its first import starts ``fc-list``, which the rule above would
    charge to whichever unmarked test happened to import it first."""
    with contextlib.suppress(ImportError):  # without the charts extra: nothing to warm
        import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    global _current
    _spawned.clear()
    _current = None if _may_spawn(item) else item
    item.stash[_CHILDREN] = _children() if _current is not None else set()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    result = yield
    if _current is item:
        _check(item)  # what setup and the call started
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    global _current
    try:
        result = yield
    finally:
        watched, _current = _current is item, None
    if watched:
        _check(item, item.stash[_CHILDREN])  # teardown's, or setup's when it failed
    return result
