"""The launcher's keeper (`launcher.child`): when the launcher dies, the whole process
group of its child dies (real vLLM 0.32's EngineCore outlives its API server: measured),
never a group that merely reuses its number; a clean stop disarms it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest
import trio

from gpu_slicer.launcher import child

pytestmark = pytest.mark.integration

# A leader in a session of its own and a grandchild in its group (as vLLM's engine core).
GROUP = (
    "import subprocess, sys, time; "
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(g.pid, flush=True); time.sleep(60)"
)


def group() -> tuple[subprocess.Popen[str], psutil.Process]:
    leader = subprocess.Popen(
        [sys.executable, "-c", GROUP], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout is not None
    return leader, psutil.Process(int(leader.stdout.readline()))


def cleanup(leader: subprocess.Popen[str], grandchild: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        grandchild.kill()
    if leader.poll() is None:
        leader.kill()
    leader.wait(timeout=10)
    assert leader.stdout is not None
    leader.stdout.close()


@pytest.mark.parametrize("died", [True, False], ids=["launcher-died", "clean-stop"])
def test_the_keeper_kills_the_group_only_when_the_launcher_dies(died: bool) -> None:
    leader, grandchild = group()
    kept = child.start_keeper(leader.pid)
    assert kept is not None
    keeper, w = kept
    try:
        # Its argv, not /proc's cmdline: read while it execs, that can be empty.
        assert child.KEEPER_NAME in keeper.args  # type: ignore[operator]
        if died:
            w, fd = -1, w
            os.close(fd)  # what the kernel does to the pipe when the launcher dies
        else:
            c = child.Child(child.Started(leader), (keeper, w))  # type: ignore[arg-type]
            w = -1
            trio.run(c.disarm)  # it reaps the keeper too
        assert keeper.wait(timeout=10) == 0
        if died:
            assert leader.wait(timeout=10) == -signal.SIGKILL
            psutil.wait_procs([grandchild], timeout=10)
            assert not grandchild.is_running()
        else:
            assert leader.poll() is None and grandchild.is_running()
    finally:
        if w != -1:  # failed before the pipe was handed on: close it here, once
            os.close(w)
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait(timeout=10)
        cleanup(leader, grandchild)


def test_a_group_that_reuses_the_number_is_left_alone() -> None:
    leader, grandchild = group()
    try:
        # The keeper of a leader that started at another time: this pid names another
        # process now, so its group is not the one the keeper kept.
        keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", child.KEEPER, str(leader.pid), "1",
             child.KEEPER_NAME], stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert keeper.wait(timeout=10) == 0
        assert leader.poll() is None and grandchild.is_running()
    finally:
        cleanup(leader, grandchild)
