"""Child processes for integration tests: output read line by line, waits on lines.

A :class:`Proc` reads the merged stdout/stderr of a child into ``lines`` and wakes
waiters on every new line, so a test waits for what a process prints (bounded by the
test's ``trio.fail_after``), never for a fixed time.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import psutil
import trio

from gpu_slicer.launcher.child import KEEPER_NAME
from stubs.proc import free_port
from tests.harness import Stack

__all__ = ["Proc", "free_port", "spawn"]


@dataclass
class Proc:
    """A child process whose stdout and stderr (merged) are read into `lines`."""

    name: str
    proc: trio.Process
    lines: list[str] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    closed: bool = False

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        async for data in self.proc.stdout:
            buf += data
            *done, buf = buf.split(b"\n")
            self.lines += [raw.decode(errors="replace") for raw in done]
            self.changed.set()
            self.changed = trio.Event()
        self.closed = True
        self.changed.set()

    async def line(self, pred: Callable[[str], bool], start: int = 0) -> int:
        """Index of the first output line from `start` satisfying `pred` (waits for it)."""
        while True:
            for i in range(start, len(self.lines)):
                if pred(self.lines[i]):
                    return i
            assert not self.closed, f"{self.name} ended without the line:\n{self.output()}"
            await self.changed.wait()

    async def wait(self, timeout: float = 20) -> int:
        """Its exit code, within `timeout`."""
        with trio.fail_after(timeout):
            return await self.proc.wait()

    async def text(self, pred: Callable[[str], bool]) -> str:
        """The first output line satisfying `pred` (waits for it)."""
        return self.lines[await self.line(pred)]

    def index(self, fragment: str) -> int:
        """Position of the first output line containing `fragment`."""
        return next(i for i, text in enumerate(self.lines) if fragment in text)

    def output(self) -> str:
        """Everything read so far."""
        return "\n".join(self.lines)

    def descendants(self) -> list[psutil.Process]:
        """Its live descendants, a launcher's keeper aside (`launcher.child`: it holds no
        GPU, exits once the child's group is stopped, and is tested on its own)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in kids if not _is_keeper(p)]


@asynccontextmanager
async def spawn(
    stack: Stack, name: str, argv: list[str], env: dict[str, str] | None = None
) -> AsyncIterator[Proc]:
    """Start `argv` in its own session (env: `stack.env`); kill its tree on the way out."""
    proc = await trio.lowlevel.open_process(
        argv,
        env=env if env is not None else stack.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    p = Proc(name, proc)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p._read)
        try:
            yield p
        except BaseException:
            print(f"---- {name} output ----\n{p.output()[-8000:]}")
            raise
        finally:
            left = p.descendants()
            if proc.returncode is None:
                proc.kill()
            for child in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            # Shielded: even when the test is cancelled, the process is reaped (an
            # unreaped one warns "subprocess ... is still running" in some later test).
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await proc.wait()
                while not p.closed:
                    await p.changed.wait()
            nursery.cancel_scope.cancel()
    assert proc.stdout is not None
    await proc.stdout.aclose()


def _is_keeper(p: psutil.Process) -> bool:
    try:
        return KEEPER_NAME in p.cmdline()
    except psutil.Error:
        return False
