"""`slicerctl watch` follows slicerd across a restart on the same socket; `--once` ends with
the stream (exit 69). The watcher is a real child process; its output is read line by line
as it comes, and every wait is for a line, never a sleep."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from stubs.proc import child_env
from tests.clitable import module_argv
from tests.harness import Stack, running_stack

pytestmark = pytest.mark.integration


class Watcher:
    """A `slicerctl watch` child: its stdout and stderr lines as they arrive."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.ended: set[str] = set()  # the streams at their end
        self._changed = trio.Event()

    async def _read(self, name: str, stream: trio.abc.ReceiveStream) -> None:
        buf = b""
        while data := await stream.receive_some(65536):
            buf += data
            *whole, buf = buf.split(b"\n")
            self.lines[name] += [line.decode() for line in whole]
            self._changed.set()
            self._changed = trio.Event()
        if buf:
            self.lines[name].append(buf.decode())
        self.ended.add(name)
        self._changed.set()

    async def line(self, name: str, pattern: str, start: int = 0) -> int:
        """The index of the first line of `name` (from `start`) matching `pattern`, once it
        has arrived."""
        while True:
            for i, line in enumerate(self.lines[name][start:], start):
                if re.search(pattern, line):
                    return i
            if name in self.ended:
                raise AssertionError(f"no line {pattern!r} before {name} ended: {self.lines}")
            await self._changed.wait()

    async def event(self, event: str, workload: str) -> dict[str, Any]:
        """The first JSON event line of that kind for that workload, once it has arrived."""
        seen = 0
        while True:
            i = await self.line("stdout", r"^\{", seen)
            body: dict[str, Any] = json.loads(self.lines["stdout"][i])
            if (body.get("event"), body.get("workload")) == (event, workload):
                return body
            seen = i + 1


@asynccontextmanager
async def watching(stack: Stack, *args: str) -> AsyncIterator[Watcher]:
    """`slicerctl --socket S watch --json ARGS` running, subscribed (its "watching" line
    arrived); ended with SIGTERM on the way out if it still runs."""
    argv = module_argv("slicerctl", "--socket", stack.socket, "watch", "--json", *args)
    proc = await trio.lowlevel.open_process(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=child_env(),
    )
    w = Watcher(proc)
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(w._read, "stdout", proc.stdout)
            nursery.start_soon(w._read, "stderr", proc.stderr)
            await w.line("stderr", rf"^slicerctl: watching slicerd at {re.escape(stack.socket)} ")
            yield w
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            await proc.wait()
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    assert not any("Traceback" in line for lines in w.lines.values() for line in lines)


async def test_watch_follows_the_daemon_across_a_restart() -> None:
    with trio.fail_after(120):
        async with running_stack(gpus=1) as stack, watching(stack) as w:
            async with await stack.client() as reg:
                await reg.register("before", pid=stack.sleeper())
                await w.event("registered", "before")  # the first daemon's events stream
            assert await stack.stop() == 0
            lost = await w.line(
                "stderr",
                r"^slicerctl: daemon connection lost \(the daemon closed the connection\); "
                r"reconnecting$",
            )
            assert w.proc.returncode is None  # it stays, waiting for the daemon
            await stack.start()  # the same socket and state dir
            back = await w.line("stderr", rf"^slicerctl: reconnected to {re.escape(stack.socket)}$")
            assert back == lost + 1  # one line per loss, none per attempt
            # an event only the new daemon can produce reaches the same watcher
            async with await stack.client() as reg, await stack.client() as holder:
                await reg.register("after", pid=stack.sleeper())
                turn = await holder.acquire("after")
                granted = await w.event("granted", "after")
                assert granted["turn"] == turn.turn
                await holder.release(turn)
            assert w.proc.returncode is None
            w.proc.send_signal(signal.SIGTERM)  # only a signal (or Ctrl-C) ends it
            assert await w.proc.wait() == -signal.SIGTERM
            assert stack.overlaps() == 0


async def test_watch_once_exits_69_when_the_daemon_goes_away() -> None:
    with trio.fail_after(120):
        async with running_stack(gpus=1) as stack, watching(stack, "--once") as w:
            async with await stack.client() as reg:
                await reg.register("w", pid=stack.sleeper())
                await w.event("registered", "w")
            assert await stack.stop() == 0
            assert await w.proc.wait() == 69
            await w.line("stderr", r"^slicerctl: error: lost the connection")  # all read
            errors = [ln for ln in w.lines["stderr"] if "watching slicerd" not in ln]
            assert errors == [
                f"slicerctl: error: lost the connection to slicerd at {stack.socket}: the daemon "
                "closed the connection (is slicerd running? check `systemctl status slicer`, "
                "or pass --socket)"
            ]
            assert not any("reconnect" in ln for ln in w.lines["stderr"])
            assert stack.overlaps() == 0
