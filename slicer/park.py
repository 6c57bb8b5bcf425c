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
import shutil
import subprocess
from dataclasses import dataclass
from typing import Protocol

import trio

from gpu_slicer.slicer.readings import Outcome

__all__ = [
    "CHECK_TIMEOUT",
    "CheckpointParker",
    "Outcome",
    "Parker",
    "ParkerCheck",
    "Running",
    "ToolResult",
    "ToolRunner",
    "locate",
]

log = logging.getLogger("slicer.park")

CHECK_TIMEOUT = 10.0  # seconds a parker's check may take (`--help`; a driver helper start)
# What to do when the parker cannot run (every check's error ends with it).
FIX = (
    "install NVIDIA's cuda-checkpoint (driver r550+) or give its path: slicerd "
    "--cuda-checkpoint PATH, or cuda_checkpoint in slicer.toml; it is checked again at the "
    "next REGISTER that needs it. A workload that parks itself (park=cooperative "
    "fallback=none) needs no parker"
)


@dataclass(frozen=True, slots=True)
class ParkerCheck:
    """Whether the parker can run (STATUS `parker_check`): its `kind` (cli, driver), the
    `path` it runs (or the name it looked up when it found none), and `error` (None when
    `ok`) naming what was looked up and the fix."""

    kind: str
    path: str
    ok: bool
    error: str | None = None

    def body(self) -> dict[str, object]:
        """The STATUS object."""
        return {"kind": self.kind, "path": self.path, "ok": self.ok, "error": self.error}


def locate(asked: str) -> tuple[str | None, str]:
    """The cuda-checkpoint executable config `cuda_checkpoint` = `asked` names, as exec
    finds it (a path as given; a bare name on $PATH), or None; and what was looked up, in
    words."""
    if "/" in asked:
        path = os.path.abspath(asked)
        return (path if os.path.exists(path) else None), path
    found = shutil.which(asked) or shutil.which(asked, mode=os.F_OK)
    where = os.environ.get("PATH", os.defpath)
    shown = where if len(where) <= 300 else where[:297] + "..."
    return found, f"{asked!r} on PATH ({shown})"


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

    async def check(self, timeout: float = CHECK_TIMEOUT) -> str:
        """Whether the parker can run now: "" when it can, else why (what was looked up,
        and the fix). Bounded by `timeout`; the server keeps the verdict (`ParkerCheck`)."""
        ...

    def changed(self) -> bool:
        """Whether what a failed check found may be different now (the tool appeared,
        changed, or went away), so that checking again may tell something new."""
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
    """Parks and restores processes with the cuda-checkpoint executable `path` (a path,
    or a name looked up on $PATH as exec does: `locate`)."""

    kind = "cli"

    def __init__(self, path: str, runner: ToolRunner) -> None:
        self.asked = path  # as configured: looked up again at each check
        self.path = locate(path)[0] or path
        self.runner = runner
        self.has_action = True
        self._checked: tuple[str | None, object] = ("", None)  # (path found, its stat)

    async def probe(self, timeout: float = 30.0) -> str:
        """Check the tool once at start (off the hot path), learning whether `--action`
        exists; a note for the log ("" when all is well)."""
        why = await self.check(min(timeout, CHECK_TIMEOUT))
        if why:
            return why
        return "" if self.has_action else "driver lacks --action: using --toggle"

    def changed(self) -> bool:
        """Whether the executable `asked` names is not what the last check found."""
        found, _ = locate(self.asked)
        return (found, _stat_of(found)) != self._checked

    async def check(self, timeout: float = CHECK_TIMEOUT) -> str:
        """Look the tool up, and read its `--help` (bounded by `timeout`): "" when it
        runs (and `has_action` learned), else why, naming what was looked up, and the
        fix."""
        found, looked = locate(self.asked)
        self._checked = (found, _stat_of(found))
        if found is None:
            return f"cuda-checkpoint not found: looked for {looked} ({FIX})"
        self.path = found
        if not os.path.isfile(found) or not os.access(found, os.X_OK):
            return f"cuda-checkpoint at {found} is not an executable file ({FIX})"
        res = await self.runner.run([found, "--help"], timeout)
        if res is None:
            return f"{found} --help did not answer within {timeout:g} s ({FIX})"
        text = res.stdout + res.stderr
        # Every driver's help names --toggle; output without it is a tool that cannot run
        # at all (a broken install): say so, never "lacks --action", and keep --action.
        if res.returncode != 0 and "--toggle" not in text:
            first = " ".join(text.strip().splitlines()[:1])
            return f"{found} --help failed (exit {res.returncode}): {first} ({FIX})"
        self.has_action = "--action" in text
        return ""

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


def _stat_of(path: str | None) -> object:
    # What tells a changed file: its inode, size, mtime and mode (None: absent).
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
