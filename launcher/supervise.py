"""Supervision: register, start the child, and end everything by one rule.

Theory of operation
-------------------
`Supervisor.run` opens one nursery with three kinds of tasks:

* the *flow*: the first REGISTER, the profile's boot steps (`before_start`, e.g. a
  boot turn), the child's start, then the profile's `after_start` (health, sleep,
  release, ready marker);
* the registration reader (`Registration.serve`), which reports FAULTs and reconnects;
* the signal watcher (SIGTERM, SIGINT) and, once it runs, the child watcher.

Whichever of them first calls `stop(...)` decides why the launch ends; every later
call is ignored (a second SIGTERM/SIGINT only hurries the SIGKILL). The main task then
cancels the flow, tells the profile the replica can no longer serve (the ready marker
goes first), stops the child by the grace rule (SIGTERM to its group, SIGKILL after
`kill_grace`), closes the registration, and returns the exit code:

    child exited          -> the child's code (128+N for signal N)
    FAULT                 -> 70                SIGTERM/SIGINT -> the child's code
    boot failed/timed out -> 1 / 75            REGISTER refused / unreachable -> 78 / 69
    COMMAND not found / not executable -> 127 / 126 (checked before the REGISTER too)

Every end but the child's own exit and a signal is a failure of the launch: its one line
(`failures`) is left in `failure` for the command to print as ``slicer-launch: error:``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import trio

from gpu_slicer import proto
from gpu_slicer.launcher import failures
from gpu_slicer.launcher.child import Child, exit_code
from gpu_slicer.launcher.config import Exit, LaunchConfig, log
from gpu_slicer.launcher.registration import Refused, Registration
from gpu_slicer.slicer.client import Unreachable
from gpu_slicer.slicer.notify import sd_notify


class BootFailed(Exception):
    """A profile's boot step failed; `code` is the launcher's exit code, `hint` what to
    do (default: look at the replica's output)."""

    def __init__(
        self, code: int, message: str, hint: str = "see the replica's output above"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


@dataclass(frozen=True)
class Stop:
    """Why the launch ends: `why` is exit, fault, signal, boot, command, refused or
    unreachable."""

    why: str
    code: int
    message: str = ""
    signum: int = signal.SIGTERM  # what the child's group gets first


class Profile:
    """The generic `run` profile: no boot steps, ready as soon as the child runs."""

    boots = False  # True: an exit before the first ready is a boot failure
    parks = False  # True: `park` can park the workload when slicerd asks (PARK)
    ready = False
    ready_seen = False

    def command(self, argv: Sequence[str]) -> list[str]:
        """The argv to start."""
        return list(argv)

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The child's environment."""
        return dict(base)

    def not_ready(self) -> None:
        """The replica can no longer serve (called at start and on every stop)."""
        self.ready = False

    async def before_start(self, sup: Supervisor) -> None:
        """Steps before the child starts (the vLLM profile takes a boot turn here)."""

    async def after_start(self, sup: Supervisor, child: Child) -> None:
        """Steps once the child runs; ends with the replica ready."""
        self.ready = self.ready_seen = True
        sd_notify("READY=1")

    async def park(self, timeout: float) -> bool:
        """Park the workload now, within `timeout` (slicerd sent PARK); True when it did."""
        return False

    async def aclose(self) -> None:
        """Release whatever the boot steps still hold."""


class Supervisor:
    """One launch: a registration, a child, and the rule that ends them together."""

    def __init__(self, cfg: LaunchConfig, argv: Sequence[str], profile: Profile) -> None:
        self.cfg = cfg
        self.argv = list(argv)
        self.profile = profile
        self.reg = Registration(cfg, self._on_fault, profile.park if profile.parks else None)
        self.child: Child | None = None
        self.reason: Stop | None = None
        self.failure: str | None = None  # the launch failed: its one line (module docstring)
        self._stopped = trio.Event()

    def stop(self, reason: Stop) -> None:
        """End the launch for `reason` (the first reason wins)."""
        if self.reason is None:
            self.reason = reason
            self._stopped.set()

    def _on_fault(self, fault: proto.Fault) -> None:
        self.profile.not_ready()  # the marker goes before anything else happens
        text = f"FAULT reason={fault.reason} {fault.text}".rstrip()
        hint = "its processes were stopped; see 'slicerctl status' and slicerd's log"
        self.stop(Stop("fault", Exit.FAULT, f"{text} ({hint})"))

    def child_env(self) -> dict[str, str]:
        """The environment of the child: ours, plus SLICER_SOCKET and SLICER_WORKLOAD."""
        base = {**os.environ, "SLICER_SOCKET": self.reg.socket}
        base["SLICER_WORKLOAD"] = self.cfg.workload
        return self.profile.env(base)

    async def run(self) -> int:
        """Run the launch to its end; the exit code."""
        self.profile.not_ready()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._signals, signals)
                    flow = trio.CancelScope()
                    nursery.start_soon(self._flow, nursery, flow)
                    await self._stopped.wait()
                    flow.cancel()
                    code = await self._finish()
                    nursery.cancel_scope.cancel()
            finally:
                self.profile.not_ready()
                with trio.CancelScope(shield=True):
                    await self.profile.aclose()
                await self.reg.aclose()
        return code

    async def _flow(self, nursery: trio.Nursery, scope: trio.CancelScope) -> None:
        with scope:
            problem = failures.command_problem(self.argv, self.child_env().get("PATH"))
            if problem is not None:
                self.stop(Stop("command", *problem))
                return
            try:
                await self.reg.open()
            except Refused as e:
                line = failures.refused(self.cfg.workload, e.code, e.text)
                self.stop(Stop("refused", Exit.REFUSED, line))
                return
            except Unreachable as e:
                line = failures.unreachable(self.reg.socket, e.text, self.cfg.connect_timeout)
                self.stop(Stop("unreachable", Exit.UNREACHABLE, line))
                return
            nursery.start_soon(self.reg.serve)
            try:
                await self.profile.before_start(self)
                argv = self.profile.command(self.argv)
                try:
                    self.child = await Child.start(argv, self.child_env())
                except OSError as e:  # as a shell: 127 not found, 126 not executable
                    why = e.strerror or str(e)
                    missing = isinstance(e, FileNotFoundError)
                    if missing and (bad := failures.found_but_bad(argv[0], self.child_env())):
                        missing, why = False, bad  # the file is there: its #! is not
                    code = Exit.NOT_FOUND if missing else Exit.NOT_EXECUTABLE
                    line = failures.start_failed(argv[0], why, code)
                    self.stop(Stop("command", code, line))
                    return
                nursery.start_soon(self._watch_child, self.child)
                await self.profile.after_start(self, self.child)
            except BootFailed as e:
                self.stop(Stop("boot", e.code, f"vLLM boot failed: {e} ({e.hint})"))

    async def _watch_child(self, child: Child) -> None:
        rc = await child.wait()
        self.stop(Stop("exit", rc, f"pid {child.pid} exited with code {rc}"))

    async def _signals(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if self.reason is None:
                self.stop(Stop("signal", exit_code(-signum), f"got {name}", signum))
            elif self.child is not None:
                log.warning("got %s again: SIGKILL now", name)
                self.child.send_signal(signal.SIGKILL)

    async def _finish(self) -> int:
        """Stop the child by the grace rule; the exit code for `self.reason`."""
        reason = self.reason
        assert reason is not None
        self.profile.not_ready()
        sd_notify("STOPPING=1")
        child, grace = self.child, self.cfg.kill_grace
        if reason.why == "exit":
            assert child is not None
            await child.sweep(grace)
            if self.profile.boots and not self.profile.ready_seen:
                self.failure = (
                    f"the replica exited with code {reason.code} before it was ready "
                    "(see its output above)"
                )
                return int(Exit.FAILED)
            log.info("%s", reason.message)
            return reason.code
        if reason.why == "signal":
            log.info("stopping: %s", reason.message)
        else:
            self.failure = reason.message
            log.debug("stopping: %s", reason.message)
        if child is None:
            return reason.code
        rc = await child.stop(grace, reason.signum)
        log.info("pid %d ended with code %d", child.pid, rc)
        return rc if reason.why == "signal" else reason.code
