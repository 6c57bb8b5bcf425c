"""The test doubles' stack harness (`stubs.stack`, `stubs.proc`): what its users rely on."""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from stubs.proc import Notify, StackError, group_alive, spawn, stop
from stubs.stack import Stack, running_stack_sync

pytestmark = pytest.mark.integration  # it starts slicerd and other children

# A leader ignoring SIGTERM whose child (same process group) ignores it too; READY=1 once
# both run.
STUBBORN = (
    "import os, signal, socket, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "s.sendto(b'READY=1', os.environ['NOTIFY_SOCKET'])\n"
    "time.sleep(60)\n"
)


async def test_stop_kills_the_group_of_a_process_ignoring_sigterm_after_the_grace(
    tmp_path: Path,
) -> None:
    with Notify(tmp_path / "notify") as notify:
        p = spawn([sys.executable, "-c", STUBBORN], notify.env, tmp_path / "stubborn.log")
        with trio.fail_after(30):
            await notify.ready(p, 20, "stubborn")
    assert group_alive(p.pid)
    with trio.fail_after(30):
        assert await stop(p, 0.5, group=True) == -9
    assert not group_alive(p.pid)  # the grandchild went with it


async def test_a_daemon_that_exits_before_ready_is_one_error_with_its_log(
    tmp_path: Path,
) -> None:
    stack = Stack.create(tmp_path / "s", gpus=1)
    stack.args[stack.args.index("--state-dir") + 1] = "/proc/self/nope"
    with trio.fail_after(60), pytest.raises(StackError) as err:
        await stack.start()
    assert "slicerd exited with 78 before READY=1" in str(err.value)
    assert "/proc/self/nope" in str(err.value)  # the log's tail, with the daemon's reason
    assert stack.proc is None


def test_the_sync_entry_starts_and_stops_slicerd_and_removes_its_directory() -> None:
    with running_stack_sync(gpus=1, tmp_prefix="slicer-stack-") as stack:
        assert Path(stack.base).parent == Path(tempfile.gettempdir())
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(20)
            s.connect(stack.socket)
            s.sendall(b"PING\n")
            assert s.recv(100) == b"OK\n"
        assert stack.overlaps() == 0
        assert stack.stop_sync() == 0
        assert stack.rcs == {"slicerd": 0}
    assert not stack.base.exists()
