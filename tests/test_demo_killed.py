"""A SIGKILLed demo (`python -m demo`, `--pool`) leaves no process behind: every child it
starts (slicerd, launchers and their vLLM stubs, dispatchers, trainers, redis-server) is
SIGTERMed when the demo dies (PR_SET_PDEATHSIG, `stubs.proc.spawn`). Before, every one
but redis-server outlived it, holding its fake GPU memory, its ports and its sockets."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
STARTED_S, GONE_S = 60.0, 30.0


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize(
    ("args", "started"),
    [
        (["--mode", "trainers", "--seconds", "60", "--json"], 3),  # slicerd, 2 trainers
        (["--pool", "--requests", "200", "--json"], 13),  # redis, 3 x (slicerd, ...)
    ],
    ids=["one-node", "pool"],
)
def test_a_killed_demo_leaves_no_process_behind(args: list[str], started: int) -> None:
    # Its directories too: under a TMPDIR of the test's own (short: sockets live there).
    tmp = tempfile.mkdtemp(prefix="dk-", dir="/tmp")
    demo = subprocess.Popen(
        [sys.executable, "-m", "demo", *args], cwd=ROOT, env={**os.environ, "TMPDIR": tmp},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    kids: list[psutil.Process] = []
    try:
        until = time.monotonic() + STARTED_S
        kids = descendants(demo.pid)
        # State, not time: its processes are up (checked every 50 ms, bounded).
        while len(kids) < started:
            assert demo.poll() is None, f"the demo ended first (rc {demo.returncode})"
            assert time.monotonic() < until, [k.name() for k in kids]
            time.sleep(0.05)
            kids = descendants(demo.pid)
        demo.send_signal(signal.SIGKILL)
        demo.wait(timeout=10)
        _, alive = psutil.wait_procs(kids, timeout=GONE_S)
        assert alive == [], [" ".join(p.cmdline()[:4]) for p in alive]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
        for p in kids:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(kids, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
