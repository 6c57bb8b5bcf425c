"""Parkers: move a workload's GPU memory to host and back with NVIDIA's cuda-checkpoint.

The tool is run with its real CLI (`--action lock|checkpoint|restore|unlock`, or `--toggle`
on r550 drivers whose `--help` lacks `--action`), never through a shell. It is never killed
mid-operation, since that desynchronises the driver: each run is owned by a long-lived
nursery that reaps it whenever it ends, and callers only bound their *wait* for it. A
caller that gives up reports a timeout, and the workload is faulted.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Protocol

import trio

from gpu_slicer.slicer.readings import Outcome

__all__ = ["CheckpointParker", "Outcome", "Parker", "Running", "ToolResult", "ToolRunner"]

log = logging.getLogger("slicer.park")


@dataclass(frozen=True, slots=True)
class ToolResult:
    """How one cuda-checkpoint run ended."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """True when the tool exited 0."""
        return self.returncode == 0


class ToolRunner:
    """Runs tools inside a nursery that outlives any one caller's deadline."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.running = 0

    async def run(self, argv: list[str], timeout: float) -> ToolResult | None:
        """Run `argv`; None when it did not end within `timeout` (it keeps running)."""
        done = trio.Event()
        box: list[ToolResult] = []

        async def _own() -> None:
            self.running += 1
            try:
                box.append(await _run_to_end(argv))
            finally:
                self.running -= 1
                done.set()

        self._nursery.start_soon(_own)
        with trio.move_on_after(timeout):
            await done.wait()
        return box[0] if box else None


async def _run_to_end(argv: list[str]) -> ToolResult:
    try:
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    except OSError as e:
        return ToolResult(tuple(argv), 127, "", f"cannot run {argv[0]}: {e}")
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    async def _drain(stream: trio.abc.ReceiveStream | None, key: str) -> None:
        if stream is None:
            return
        async with stream:
            while data := await stream.receive_some(65536):
                chunks[key].append(bytes(data))

    # Only the daemon's shutdown cancels this; the tool is then left to finish on its own
    # (init reaps it): killing it mid-operation would desynchronise the driver.
    async with trio.open_nursery() as n:
        n.start_soon(_drain, proc.stdout, "out")
        n.start_soon(_drain, proc.stderr, "err")
    rc = await proc.wait()
    return ToolResult(
        tuple(argv),
        rc,
        b"".join(chunks["out"]).decode(errors="replace"),
        b"".join(chunks["err"]).decode(errors="replace"),
    )


class Running(Protocol):
    """How many tool runs are under way (STATUS `tools_running`)."""

    running: int


class Parker(Protocol):
    """What the server and recovery need of a parker (`CheckpointParker`, or a test's)."""

    path: str
    has_action: bool
    kind: str  # "cli" or "driver" (STATUS `parker`)

    @property
    def runner(self) -> Running:
        """Whoever owns the tool's runs."""
        ...

    async def probe(self, timeout: float = 30.0) -> str:
        """Learn what the tool can do; a note for the log ("" when all is well)."""
        ...

    async def park(self, pids: list[int], timeout: float) -> Outcome:
        """Move the GPU memory of `pids` to host memory."""
        ...

    async def restore(self, pids: list[int], timeout: float) -> Outcome:
        """Bring the GPU memory of `pids` back."""
        ...

    async def get_state(self, pid: int, timeout: float) -> str:
        """The driver's CUDA state of `pid`."""
        ...

    async def act(self, pids: list[int], action: str, timeout: float) -> Outcome:
        """One `--action` on every pid."""
        ...

    async def act_toggle(self, pids: list[int], timeout: float) -> Outcome:
        """`--toggle` every pid."""
        ...


class CheckpointParker:
    """Parks and restores processes with the cuda-checkpoint executable at `path`."""

    kind = "cli"

    def __init__(self, path: str, runner: ToolRunner) -> None:
        self.path = path
        self.runner = runner
        self.has_action = True

    async def probe(self, timeout: float = 30.0) -> str:
        """Read `--help` once (off the hot path) to learn whether `--action` exists."""
        if not os.access(self.path, os.X_OK):
            return f"cuda-checkpoint not executable at {self.path}"
        res = await self.runner.run([self.path, "--help"], timeout)
        if res is None:
            return "cuda-checkpoint --help did not answer"
        text = res.stdout + res.stderr
        # Every driver's help names --toggle; output without it is a tool that cannot run
        # at all (a broken install): say so, never "lacks --action", and keep --action.
        if res.returncode != 0 and "--toggle" not in text:
            first = text.strip().splitlines()[:1]
            return f"cuda-checkpoint --help failed (exit {res.returncode}): {' '.join(first)}"
        self.has_action = "--action" in text
        return "" if self.has_action else "driver lacks --action: using --toggle"

    async def park(self, pids: list[int], timeout: float) -> Outcome:
        """lock then checkpoint every pid (or toggle them), all within `timeout`."""
        deadline = trio.current_time() + timeout
        if not self.has_action:
            return await self._step(pids, ["--toggle"], deadline, "checkpoint")
        lock_ms = max(1, int(timeout * 1000))
        out = await self._step(
            pids, ["--action", "lock", "--timeout", str(lock_ms)], deadline, "lock"
        )
        if not out.ok:
            return out
        return await self._step(pids, ["--action", "checkpoint"], deadline, "checkpoint")

    async def restore(self, pids: list[int], timeout: float) -> Outcome:
        """restore then unlock every pid (or toggle them), all within `timeout`."""
        deadline = trio.current_time() + timeout
        if not self.has_action:
            return await self._step(pids, ["--toggle"], deadline, "restore")
        out = await self._step(pids, ["--action", "restore"], deadline, "restore")
        if not out.ok:
            return out
        return await self._step(pids, ["--action", "unlock"], deadline, "unlock")

    async def get_state(self, pid: int, timeout: float) -> str:
        """The driver's CUDA state of `pid`: running, locked, checkpointed, failed (or a
        transient checkpointing/restoring); "none" for a process without CUDA state or
        one that is gone; "error: ..." when the tool failed otherwise or did not answer."""
        res = await self.runner.run([self.path, "--get-state", "--pid", str(pid)], timeout)
        if res is None:
            return "error: --get-state did not answer"
        if res.ok:
            words = res.stdout.split()
            return words[-1].lower() if words else "error: --get-state printed nothing"
        msg = (res.stderr or res.stdout).strip().replace("\n", " ")[:300]
        if "not a CUDA process" in msg or "no such process" in msg:
            return "none"
        return f"error: rc={res.returncode} {msg}"

    async def act(self, pids: list[int], action: str, timeout: float) -> Outcome:
        """One `--action` (lock, checkpoint, restore, unlock) on every pid; recovery's
        building block (lock gets `--timeout` like a park's)."""
        deadline = trio.current_time() + timeout
        args = ["--action", action]
        if action == "lock":
            args += ["--timeout", str(max(1, int(timeout * 1000)))]
        return await self._step(pids, args, deadline, action)

    async def act_toggle(self, pids: list[int], timeout: float) -> Outcome:
        """`--toggle` every pid (r550 drivers), recovery's building block there."""
        return await self._step(pids, ["--toggle"], trio.current_time() + timeout, "toggle")

    async def _step(self, pids: list[int], args: list[str], deadline: float, what: str) -> Outcome:
        results: dict[int, ToolResult | None] = {}

        async def _one(pid: int) -> None:
            left = max(0.0, deadline - trio.current_time())
            results[pid] = await self.runner.run([self.path, *args, "--pid", str(pid)], left)

        async with trio.open_nursery() as n:
            for pid in pids:
                n.start_soon(_one, pid)
        for pid in pids:
            res = results.get(pid)
            if res is None:
                return Outcome(False, f"{what}-timeout", f"{what} of pid {pid} still running")
            if not res.ok:
                msg = (res.stderr or res.stdout).strip().replace("\n", " ")[:300]
                return Outcome(False, f"{what}-failed", f"pid {pid}: rc={res.returncode} {msg}")
        return Outcome(True)
