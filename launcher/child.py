"""The supervised command: started in its own process group, stopped by the grace rule.

The child is a session leader (`start_new_session`), so its process group is its pid and
holds everything it spawns unless a descendant leaves the group on purpose. Stopping is
always the same, whoever asks (a FAULT, a signal to the launcher, a failed boot):
SIGTERM to the group, SIGKILL to the group after the grace, then a sweep of whatever of
the group (or of the descendants seen while the leader lived) is still there. vLLM
ignores SIGTERM while its engine starts, so the SIGKILL step is not optional.

No `PR_SET_PDEATHSIG`: trio forks from a worker thread, and the kernel sends the death
signal when that *thread* exits (it idles out after seconds), not the launcher. A
SIGKILLed launcher is covered by the daemon instead (the registration ends; a resident
workload is parked or, failing that, killed after `fault_kill_after`) and by the unit's
`KillMode=control-group` under systemd.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping, Sequence

import psutil
import trio

from gpu_slicer.launcher.config import log

SWEEP_POLL = 0.05  # seconds between looks at processes that are not our children
KILL_WAIT = 10.0  # bound on the wait after SIGKILL (the kernel needs no more)


def exit_code(returncode: int) -> int:
    """A shell-style exit code: a death by signal N reads as 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def group_members(pgid: int) -> set[int]:
    """Live (non-zombie) pids whose process group is `pgid`."""
    out: set[int] = set()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


class Child:
    """One running command in its own process group."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.pid: int = proc.pid
        self.pgid: int = proc.pid
        self._seen: dict[int, psutil.Process] = {}  # descendants seen while it lived

    @classmethod
    async def start(cls, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        """Start `argv` as a new session (process group leader) with `env`."""
        proc = await trio.lowlevel.open_process(list(argv), env=dict(env), start_new_session=True)
        log.info("started pid %d: %s", proc.pid, " ".join(argv))
        return cls(proc)

    @property
    def returncode(self) -> int | None:
        """The shell-style exit code once it has exited, else None."""
        rc = self.proc.returncode
        return None if rc is None else exit_code(rc)

    async def wait(self) -> int:
        """Wait for the leader to exit; its shell-style exit code."""
        return exit_code(await self.proc.wait())

    def _note_descendants(self) -> None:
        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                self._seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the whole process group (and to descendants that left it)."""
        if self.proc.returncode is None:
            self._note_descendants()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        for p in list(self._seen.values()):
            try:
                if p.is_running() and os.getpgid(p.pid) != self.pgid:
                    p.send_signal(sig)
            except (OSError, psutil.Error):
                pass

    def leftovers(self) -> set[int]:
        """Processes of the group, or seen descendants, that are still alive."""
        alive = group_members(self.pgid)
        for pid, p in list(self._seen.items()):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
            except psutil.Error:
                pass
        if self.proc.returncode is None:
            alive.add(self.pid)
        return alive

    async def _gone_within(self, seconds: float) -> bool:
        """Wait up to `seconds` for the leader and every leftover to be gone."""
        with trio.move_on_after(seconds):
            await self.proc.wait()
            while self.leftovers():
                await trio.sleep(SWEEP_POLL)
            return True
        return False

    async def stop(self, grace: float, first: int = signal.SIGTERM) -> int:
        """SIGTERM (or `first`) the group, SIGKILL after `grace`; the leader's exit code.

        Runs shielded: a stop, once begun, always finishes (bounded by grace + KILL_WAIT).
        """
        with trio.CancelScope(shield=True):
            if self.leftovers():
                log.info("stopping pid %d group: %s", self.pid, signal.Signals(first).name)
                self.send_signal(first)
                if not await self._gone_within(grace):
                    log.warning(
                        "still running %.1f s after %s: SIGKILL", grace, signal.Signals(first).name
                    )
                    await self.kill()
            with trio.move_on_after(KILL_WAIT):
                await self.proc.wait()
        rc = self.returncode
        return rc if rc is not None else exit_code(-signal.SIGKILL)

    async def kill(self) -> None:
        """SIGKILL the group and every leftover; wait (bounded) until they are gone."""
        self.send_signal(signal.SIGKILL)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not await self._gone_within(KILL_WAIT):
            log.error("processes survived SIGKILL: %s", sorted(self.leftovers()))

    async def sweep(self, grace: float) -> None:
        """After the leader exited on its own: stop what it left behind in its group."""
        if self.leftovers():
            log.warning("pid %d left processes behind: stopping them", self.pid)
            await self.stop(grace)
