"""Integration harness: a real slicerd on a fake GPU, real sockets, real child processes.

Readiness is an event, not a sleep: slicerd is started with NOTIFY_SOCKET pointing at a
datagram socket of ours and we wait for its READY=1, exactly as systemd does. State changes
are awaited through STATUS re-read after each WATCH event.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer
from stubs.fakegpu import Ledger, parse_size

ROOT = Path(__file__).resolve().parent.parent
TOOL = str(ROOT / "stubs" / "cuda-checkpoint")
GiB = 1 << 30


@dataclass
class Stack:
    """One running daemon and the fake GPU it reads."""

    base: Path
    socket: str
    env: dict[str, str]
    ledger: Ledger
    args: list[str]
    proc: trio.Process | None = None
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log: Path | None = None

    async def client(self) -> AsyncSlicer:
        """A new connection to the daemon."""
        return await AsyncSlicer.connect(self.socket)

    async def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Start slicerd and wait for its READY=1 (bounded)."""
        notify_path = str(self.base / f"notify-{len(self.children)}-{os.getpid()}")
        with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            await notify.bind(notify_path)
            env = {**self.env, **(extra_env or {}), "NOTIFY_SOCKET": notify_path}
            self.log = self.base / "slicerd.log"
            with open(self.log, "ab") as logf:
                self.proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "gpu_slicer.slicer.daemon", *self.args],
                    env=env,
                    stdout=logf,
                    stderr=logf,
                )
            try:
                # Generous: a loaded 2-core CI machine can take many seconds to start Python.
                with trio.fail_after(60):
                    while True:
                        msg = await notify.recv(4096)
                        if b"READY=1" in msg:
                            break
            except BaseException:
                await self.reap()  # never leave a daemon behind a failed start
                raise
            finally:
                os.unlink(notify_path)

    async def reap(self) -> None:
        """SIGKILL slicerd (if it runs) and wait for it, bounded and even when cancelled:
        a process object nobody waited for warns ``ResourceWarning: subprocess ... is
        still running`` whenever it is collected, failing some later test."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await self.proc.wait()
        if self.proc.poll() is not None:
            self.proc = None

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop slicerd with `sig`, wait for it (bounded), return its exit code."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        with trio.fail_after(15):
            rc = await self.proc.wait()
        self.proc = None
        return rc

    def sleeper(self, nbytes: int = 0, gpu: int = 0, label: str | None = None) -> int:
        """A child process standing for a workload; optionally holding `nbytes` on `gpu`."""
        p = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            env=self.env,
        )
        self.children.append(p)
        if nbytes:
            self.ledger.alloc(p.pid, gpu, nbytes, tag="weights", workload=label or f"w{p.pid}")
        return p.pid

    async def status(self) -> dict[str, Any]:
        """One STATUS over a fresh connection."""
        async with await self.client() as c:
            return await c.status()

    async def until(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20
    ) -> dict[str, Any]:
        """Wait (event-driven, bounded) until `pred(STATUS)` holds; return that STATUS."""
        with trio.fail_after(timeout):
            async with await self.client() as w, await self.client() as s:
                await w.request(proto.Watch())  # subscribe first: no change can slip by
                while True:
                    st = await s.status()
                    if pred(st):
                        return st
                    await w.next_message()

    def overlaps(self) -> int:
        """The fake GPU's overlap count (must stay 0)."""
        return self.ledger.overlaps()


def workload(st: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The STATUS entry of workload `name` (registered first), or None."""
    for w in st["workloads"]:
        if w["name"] == name:
            return dict(w)
    return None


def state_of(name: str, state: str) -> Callable[[dict[str, Any]], bool]:
    """Predicate: workload `name` is in `state`."""

    def pred(st: dict[str, Any]) -> bool:
        w = workload(st, name)
        return w is not None and w["state"] == state

    return pred


@asynccontextmanager
async def running_stack(
    *flags: str, gpus: int = 2, capacity: str = "80GiB", env: dict[str, str] | None = None
) -> AsyncIterator[Stack]:
    """A started daemon on a fresh fake GPU; on exit, stops it, kills children, and
    asserts the core invariant: zero overlaps."""
    base = Path(tempfile.mkdtemp(prefix="slicer-it-"))
    os.chmod(base, 0o755)  # unprivileged test clients must reach the socket
    fakegpu = base / "gpu"
    fakegpu.mkdir()
    full_env = {
        **os.environ,
        "FAKEGPU_DIR": str(fakegpu),
        "FAKEGPU_BANDWIDTH": "400GB",
        "FAKEGPU_CC_LOG": str(base / "cc.log"),
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    full_env.pop("SLICER_SOCKET", None)
    Ledger.init(fakegpu, gpus, parse_size(capacity))
    sock = str(base / "slicer.sock")
    args = [
        "--socket",
        sock,
        "--gpu-backend",
        "fake",
        "--cuda-checkpoint",
        TOOL,
        "--state-dir",
        str(base / "state"),
        "--log-level",
        "debug",
        *flags,
    ]
    stack = Stack(base=base, socket=sock, env=full_env, ledger=Ledger(fakegpu), args=args)
    try:
        await stack.start()
        yield stack
        assert stack.overlaps() == 0, stack.ledger.overlap_log()
    except BaseException:
        if stack.log is not None and stack.log.exists():
            print("---- slicerd log (tail) ----")
            print(stack.log.read_text()[-6000:])
        raise
    finally:
        await stack.reap()
        for p in stack.children:
            p.kill()
            p.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def cc_log(stack: Stack) -> list[dict[str, Any]]:
    """The cuda-checkpoint stub's invocation log."""
    path = stack.base / "cc.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
