"""The driver-API parker: parks through one long-lived checkpoint helper, not a CLI per step.

:class:`DriverParker` has the same interface as the CLI's
:class:`~slicer.park.CheckpointParker` (`slicer.park.Parker`) and the same outcomes (a
step that fails is ``<step>-failed``, one not answered within the caller's bound
``<step>-timeout``), so the state machine, recovery and the journal cannot tell them
apart. Each step is a request to the helper (:mod:`slicer.ckpthelper`), which calls
``cuCheckpointProcess*`` on a thread of its own; the helper paid ``cuInit`` once, when
slicerd started it.

Rules kept from the CLI parker: a call is never cut short (only the *wait* for its answer
is bounded; an answer that comes late is read and dropped, and ``runner.running`` counts
the calls in flight, so a stopping daemon lets them end first); a helper that dies fails
every call in flight (the workload is faulted: its driver state is unknown) and is
started again at the next call, at most every ``RESTART_EVERY_S``. A helper left over by
a daemon that died (it finishes its calls, then exits) is waited for before this one
starts, so recovery never reads a process a leftover is still moving.

:func:`open_parker` picks the parker from config ``parker``: ``cli``; ``driver`` (slicerd
does not start without it); ``auto``: the driver API when the library is there, loads
and exports it (r570+), else the CLI, logged either way. STATUS says which (``parker``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import trio

from gpu_slicer.slicer.ckpthelper import MODULE
from gpu_slicer.slicer.config import Config
from gpu_slicer.slicer.errors import GpuBackendError
from gpu_slicer.slicer.park import CHECK_TIMEOUT, CheckpointParker, Outcome, Parker, ToolRunner

__all__ = [
    "DriverParker",
    "ParkerUnavailable",
    "library_present",
    "open_parker",
    "settle_leftovers",
]

log = logging.getLogger("slicer.park")

START_TIMEOUT_S = 60.0  # dlopen + cuInit (seen: 2.7 s on real hardware)
RESTART_EVERY_S = 1.0
LEFTOVER_POLL_S = 0.1
MAX_LINE = 1 << 16
REAP_WAIT_S = 2.0
# The dynamic loader's default directories (beside LD_LIBRARY_PATH and its cache).
DEFAULT_LIB_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib", "/lib/x86_64-linux-gnu",
                    "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
                    "/usr/lib/aarch64-linux-gnu")  # fmt: skip


class ParkerUnavailable(GpuBackendError):
    """``parker = "driver"`` and the driver's checkpoint API cannot be used."""


class DriverParker:
    """Parks and restores through the checkpoint helper on the driver library `lib`."""

    kind = "driver"
    has_action = True

    def __init__(self, lib: str, tool: str, owner: str, nursery: trio.Nursery) -> None:
        # `path` is the CLI's: recovery looks for runs of it a previous daemon left.
        self.lib, self.path, self.owner = lib, tool, owner
        self._nursery = nursery
        self.running = 0  # calls sent and not answered (STATUS tools_running)
        self.version = 0
        self._proc: trio.Process | None = None
        self._ids = 0
        self._waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._late: dict[int, dict[str, Any]] = {}  # calls whose caller stopped waiting
        self._starting = trio.Lock()
        self._next_start = 0.0
        self._last_error = ""

    @property
    def runner(self) -> DriverParker:
        """Whoever owns the calls in flight (this parker: ``running``)."""
        return self

    # ---- the helper ------------------------------------------------------------------

    async def start(self, timeout: float = START_TIMEOUT_S) -> str | None:
        """Start the helper (after any leftover of a dead daemon ends, bounded by
        `timeout`); None when it is ready, else why not."""
        with trio.move_on_after(timeout):
            while left := leftovers(self.owner):
                log.info("waiting for checkpoint helper(s) %s of a previous slicerd to end",
                         left)  # fmt: skip
                await trio.sleep(LEFTOVER_POLL_S)
        if left := leftovers(self.owner):
            return f"checkpoint helper(s) {left} of a previous slicerd still running"
        argv = [sys.executable, "-m", MODULE, "--lib", self.lib, "--owner", self.owner]
        try:
            proc = await trio.lowlevel.open_process(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
            )
        except OSError as e:
            return f"cannot start the checkpoint helper: {e}"
        assert proc.stdout is not None
        lines = _Lines(proc.stdout)
        first: dict[str, Any] | None = None
        try:
            with trio.move_on_after(timeout):
                while (first := await lines.next()) is not None and "ready" not in first:
                    pass  # not its first line (nothing else writes there: its docstring)
        except BaseException:  # cancelled (the caller's bound, a stop): no untracked helper
            with trio.CancelScope(shield=True):
                proc.kill()  # before its ready line it moves nothing
                await proc.wait()
            raise
        if first is None or not first.get("ready"):
            # Not ready: it is in dlopen or cuInit, or gave up; nothing is being moved.
            why = (first or {}).get("error") or f"no ready line within {timeout:g} s"
            with trio.CancelScope(shield=True):
                with trio.move_on_after(REAP_WAIT_S):
                    await proc.wait()
                if proc.poll() is None:
                    proc.kill()
                    await proc.wait()
            return f"checkpoint helper not ready: {why}"
        self._proc, self.version = proc, int(first.get("version", 0))
        self._nursery.start_soon(self._read, proc, lines)
        log.info("parker: driver API through %s (driver %d, helper pid %d, init %.2f s)",
                 self.lib, self.version, proc.pid, float(first.get("init_s", 0)))  # fmt: skip
        return None

    async def _read(self, proc: trio.Process, lines: _Lines) -> None:
        # Answers in the order calls end; EOF: the helper died (or was stopped).
        try:
            while (msg := await lines.next()) is not None:
                rid = msg.get("id", -1)
                waiter = self._waiting.pop(rid, None)
                if waiter is not None:
                    waiter[1].append(msg)
                    self.running -= 1
                    waiter[0].set()
                late = self._late.pop(rid, None) if isinstance(rid, int) else None
                if late is not None:
                    # The caller gave up (the workload is faulted): say how it ended.
                    how = "ok" if msg.get("ok") else f"{msg.get('name')} ({msg.get('text')})"
                    log.warning("%s of pid %s ended after its bound: %s", late["op"],
                                late["pid"], how)  # fmt: skip
        finally:
            with trio.CancelScope(shield=True):
                if self._proc is proc:
                    self._proc = None
                    self._next_start = trio.current_time() + RESTART_EVERY_S
                why = "the checkpoint helper ended"
                lost = len(self._waiting)
                for event, box in self._waiting.values():
                    box.append({"ok": False, "code": -1, "name": "HELPER_DIED", "text": why})
                    event.set()
                self.running -= lost
                self._waiting.clear()
                self._late.clear()
                if proc.stdin is not None:
                    await proc.stdin.aclose()  # a live one finishes its calls, then exits
                if proc.stdout is not None:
                    await proc.stdout.aclose()  # it never blocks on answers nobody reads
                with trio.move_on_after(REAP_WAIT_S):
                    await proc.wait()
                if proc.poll() is None:
                    self._nursery.start_soon(proc.wait)  # reaped when it ends, not a zombie
                if lost:
                    log.error("%s (rc=%s) with %d call(s) in flight", why, proc.poll(), lost)

    async def _ensure(self, deadline: float) -> str | None:
        async with self._starting:
            if self._proc is not None:
                return None
            with trio.move_on_at(deadline):
                await trio.sleep_until(self._next_start)  # at most one start per second
                why = await self.start(max(0.0, deadline - trio.current_time()))
                self._last_error = why or ""
                if why is not None:
                    self._next_start = trio.current_time() + RESTART_EVERY_S
                return why
            why = self._last_error or "restarting"
            return f"checkpoint helper did not start in time ({why})"

    async def _call(self, req: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        """One request; its answer, or None when none came by `deadline`."""
        why = await self._ensure(deadline)
        proc = self._proc
        if why is not None or proc is None or proc.stdin is None:
            return {"ok": False, "code": -1, "name": "HELPER_UNAVAILABLE", "text": why or "gone"}
        self._ids += 1
        rid = self._ids
        event = trio.Event()
        box: list[dict[str, Any]] = []
        self._waiting[rid] = (event, box)
        self.running += 1
        line = json.dumps({**req, "id": rid}, separators=(",", ":")).encode() + b"\n"
        try:
            with trio.move_on_at(deadline):
                await proc.stdin.send_all(line)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass  # the reader sees the helper's end and answers for it
        with trio.move_on_at(deadline):
            await event.wait()
        if not box:
            self._late[rid] = req
        return box[0] if box else None

    # ---- the Parker interface ---------------------------------------------------------

    async def probe(self, timeout: float = 30.0) -> str:
        """Nothing to learn: the helper said at its start what the driver can do."""
        return ""

    async def check(self, timeout: float = CHECK_TIMEOUT) -> str:
        """Whether the helper runs, or can be started again within `timeout`: "" or why."""
        why = await self._ensure(trio.current_time() + timeout)
        if why is None:
            return ""
        return f"the driver's checkpoint API ({self.lib}) cannot be used: {why}"

    def changed(self) -> bool:
        """Always: a helper that died is started again at the next call (bounded)."""
        return True

    async def park(self, pids: list[int], timeout: float) -> Outcome:
        """lock then checkpoint every pid, all within `timeout`."""
        deadline = trio.current_time() + timeout
        out = await self._step(pids, "lock", deadline, max(1, int(timeout * 1000)))
        if not out.ok:
            return out
        return await self._step(pids, "checkpoint", deadline)

    async def restore(self, pids: list[int], timeout: float) -> Outcome:
        """restore then unlock every pid, all within `timeout`."""
        deadline = trio.current_time() + timeout
        out = await self._step(pids, "restore", deadline)
        if not out.ok:
            return out
        return await self._step(pids, "unlock", deadline)

    async def get_state(self, pid: int, timeout: float) -> str:
        """The driver's CUDA state of `pid` (as CheckpointParker.get_state says it)."""
        ans = await self._call({"op": "state", "pid": pid}, trio.current_time() + timeout)
        if ans is None:
            return "error: the state call did not answer"
        if ans.get("ok"):
            return str(ans.get("state", "error: no state"))
        return f"error: {ans.get('name')} {ans.get('text')}"[:300]

    async def act(self, pids: list[int], action: str, timeout: float) -> Outcome:
        """One step (lock, checkpoint, restore, unlock) on every pid; recovery's."""
        deadline = trio.current_time() + timeout
        lock_ms = max(1, int(timeout * 1000)) if action == "lock" else 0
        return await self._step(pids, action, deadline, lock_ms)

    async def act_toggle(self, pids: list[int], timeout: float) -> Outcome:
        """The driver API has no toggle (r550's CLI form); never asked of this parker,
        whose ``has_action`` is always true."""
        return Outcome(False, "toggle-failed", "the driver API has no --toggle")

    async def _step(self, pids: list[int], what: str, deadline: float, lock_ms: int = 0) -> Outcome:
        answers: dict[int, dict[str, Any] | None] = {}

        async def _one(pid: int) -> None:
            req: dict[str, Any] = {"op": what, "pid": pid}
            if what == "lock":
                req["timeout_ms"] = lock_ms
            answers[pid] = await self._call(req, deadline)

        async with trio.open_nursery() as n:
            for pid in pids:
                n.start_soon(_one, pid)
        for pid in pids:
            ans = answers.get(pid)
            if ans is None:
                return Outcome(False, f"{what}-timeout", f"{what} of pid {pid} still running")
            if not ans.get("ok"):
                text = f"pid {pid}: {ans.get('name')} ({ans.get('text')})"[:300]
                return Outcome(False, f"{what}-failed", text)
        return Outcome(True)


class _Lines:
    """JSON lines from the helper's stdout (a line past MAX_LINE ends the stream)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream, self._buf = stream, b""

    async def next(self) -> dict[str, Any] | None:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                return None
            try:
                data = await self._stream.receive_some(MAX_LINE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            return {}
        return msg if isinstance(msg, dict) else {}


def leftovers(owner: str) -> list[int]:
    """Live checkpoint helpers started for state dir `owner` (by a daemon that is gone:
    this one has started none yet)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if MODULE.encode() in argv and owner.encode() in argv:
            i = argv.index(b"--owner") if b"--owner" in argv else -1
            if 0 <= i < len(argv) - 1 and argv[i + 1] == owner.encode():
                found.append(int(entry))
    return sorted(found)


def library_present(lib: str) -> bool:
    """Whether the dynamic loader could find `lib` (a path, or a soname looked up in
    LD_LIBRARY_PATH, the default directories and the loader's cache), without loading
    it: the daemon never loads the driver library itself."""
    if "/" in lib:
        return os.path.exists(lib)
    dirs = [*os.environ.get("LD_LIBRARY_PATH", "").split(":"), *DEFAULT_LIB_DIRS]
    if any(d and os.path.exists(os.path.join(d, lib)) for d in dirs):
        return True
    try:
        with open("/etc/ld.so.cache", "rb") as f:
            return lib.encode() + b"\0" in f.read()
    except OSError:
        return False


async def settle_leftovers(cfg: Config) -> None:
    """Wait for any checkpoint helper a dead daemon of this state dir left running calls
    (bounded by park_timeout + restore_timeout): no step of this daemon's may run beside
    one of its; one still running then stops the start (`ParkerUnavailable`). Called
    before the socket exists, whatever the parker (a previous daemon may have had the
    driver parker)."""
    owner = os.path.abspath(cfg.state_dir)
    with trio.move_on_after(cfg.park_timeout + cfg.restore_timeout):
        while left := leftovers(owner):
            log.info("waiting for checkpoint helper(s) %s of a previous slicerd to end", left)
            await trio.sleep(LEFTOVER_POLL_S * 10)
    if left := leftovers(owner):
        raise ParkerUnavailable(
            f"checkpoint helper(s) {left} of a previous slicerd are still running driver calls; "
            "not starting beside them (they end by themselves: start slicerd again then)"
        )


async def open_parker(cfg: Config, tool: str, nursery: trio.Nursery) -> Parker:
    """The parker config `parker` asks for, started (see the module docstring), after
    `settle_leftovers`."""
    await settle_leftovers(cfg)
    owner = os.path.abspath(cfg.state_dir)
    cli = CheckpointParker(tool, ToolRunner(nursery))
    if cfg.parker == "cli":
        return cli
    if cfg.parker == "auto" and not library_present(cfg.libcuda):
        # debug: the common case off GPU hosts; STATUS `parker` says it at any time
        log.debug("parker: cuda-checkpoint CLI (no %s on this host)", cfg.libcuda)
        return cli
    driver = DriverParker(cfg.libcuda, tool, owner, nursery)
    why = await driver.start()
    if why is None:
        return driver
    if cfg.parker == "driver":
        raise ParkerUnavailable(f"parker = driver: {why}")
    log.warning("parker: cuda-checkpoint CLI (%s)", why)
    return cli
