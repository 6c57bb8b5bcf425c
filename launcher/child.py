"""The supervised command: started in its own process group, stopped by the grace rule.

The child is a session leader (`start_new_session`), so its process group is its pid and
holds everything it spawns unless a descendant leaves the group on purpose. Stopping is
always the same, whoever asks (a FAULT, a signal to the launcher, a failed boot):
SIGTERM to the group, SIGKILL to the group after the grace, then a sweep of whatever of
the group (or of the descendants seen while the leader lived) is still there. vLLM
ignores SIGTERM while its engine starts, so the SIGKILL step is not optional.

The child dies with the launcher: it is started with `PR_SET_PDEATHSIG` = SIGKILL. The
kernel sends that signal when the *thread* that forked it exits, so it is forked from
the launcher's main thread (trio's own `open_process` forks from a worker thread, which
idles out after seconds) and waited on through a pidfd. What the child started itself
is not covered by that signal, and vLLM's engine core does not follow its API server
(measured on vLLM 0.32: its EngineCore and worker were alive 20 s after the API
server's SIGKILL, holding the model's memory). So beside each child runs a *keeper*
(`KEEPER`, a few lines of Python in a session of its own), blocked reading a pipe whose
only write end the launcher holds: once the child's group is stopped the launcher writes
one byte (nothing to do), and if the launcher dies first the pipe ends and the keeper
SIGKILLs the child's whole process group, engine core and workers included (they stay
in it: vLLM does not start sessions of its own). Under systemd the unit's
`KillMode=mixed` kills the cgroup besides.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

import psutil
import trio

from gpu_slicer.launcher.config import log

SWEEP_POLL = 0.05  # seconds between looks at processes that are not our children
KILL_WAIT = 10.0  # bound on the wait after SIGKILL (the kernel needs no more)
KEEPER_WAIT = 2.0  # a disarmed keeper exits as it reads its byte: milliseconds
PR_SET_PDEATHSIG = 1
KEEPER_NAME = "slicer-launch-keeper"  # its last argument: what `ps` shows, what tests skip
# argv[1] the child's pid (its process group), argv[2] its start time (/proc stat field 22).
# A byte on stdin: the group was stopped, exit. The input ends without one: the launcher
# died: SIGKILL the group, unless its leader's pid now names another process (reused:
# a pid is never reused while a group of that id has members, so a dead leader is safe).
KEEPER = (
    "import os, signal, sys\n"
    "if not os.read(0, 1):\n"
    "    try:\n"
    "        now = open(f'/proc/{sys.argv[1]}/stat').read().rsplit(')', 1)[1].split()[19]\n"
    "    except (OSError, IndexError):\n"
    "        now = None\n"
    "    if now in (None, sys.argv[2]):\n"
    "        try:\n"
    "            os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
    "        except OSError:\n"
    "            pass\n"
)
# Looked up before any fork: the child, between fork and exec, only calls it.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


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


def _die_with_launcher(launcher: int) -> None:
    # In the child, before exec: SIGKILL when the launcher dies; and if it died already
    # (between the fork and here), the signal will never come: exit now.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:
        os._exit(127)


def start_ticks(pid: int) -> str | None:
    """The start time of `pid` (/proc/PID/stat field 22, clock ticks), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


Keeper = tuple[subprocess.Popen[bytes], int]  # the keeper and the write end of its pipe


def start_keeper(pgid: int) -> Keeper | None:
    """Start the keeper of process group `pgid` (module docstring): it and the write end of
    its pipe (None when it could not start: the child then has only its death signal)."""
    start = start_ticks(pgid)
    if start is None:  # the child is gone already: nothing of its group to keep
        return None
    r, w = os.pipe()  # both ends close-on-exec: no other child inherits the write end
    try:
        keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", KEEPER, str(pgid), start, KEEPER_NAME],
            stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={}, start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        log.error("no keeper for pid %d's group (%s): if the launcher dies, what the "
                  "child started may outlive it", pgid, e)  # fmt: skip
        os.close(w)
        return None
    finally:
        os.close(r)
    return keeper, w


async def _reap(proc: Started, bound: float) -> None:
    # Waited on, never left to the garbage collector: a Popen collected while its process
    # runs is a ResourceWarning and, later, a zombie.
    with trio.move_on_after(bound):
        await proc.wait()
        return
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGKILL)
    with trio.move_on_after(KILL_WAIT):
        await proc.wait()


class Started:
    """A process started by `Child.start`: its pid, exit status and an async wait."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while it runs."""
        return self._popen.poll()

    async def wait(self) -> int:
        """Wait until it exits (each call with a pidfd of its own); its exit status."""
        while (rc := self._popen.poll()) is None:
            try:
                fd = os.pidfd_open(self.pid)
            except OSError:  # no pidfd on this kernel (before 5.3): look again shortly
                await trio.sleep(SWEEP_POLL)
                continue
            try:
                if self._popen.poll() is None:
                    await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
        return rc


class Child:
    """One running command in its own process group."""

    def __init__(self, proc: Started, keeper: Keeper | None = None) -> None:
        self.proc = proc
        self.pid: int = proc.pid
        self.pgid: int = proc.pid
        self._seen: dict[int, psutil.Process] = {}  # descendants seen while it lived
        self._keeper = keeper  # while it is armed (its Popen is kept: reaped by disarm)

    @classmethod
    async def start(cls, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        """Start `argv` as a new session (process group leader) with `env`, to be killed by
        the kernel if the launcher dies (module docstring)."""
        await trio.lowlevel.checkpoint()
        launcher = os.getpid()
        # Forked here, on the main thread, and not from a worker thread: the death
        # signal follows the thread that forks. The fork and exec take milliseconds.
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            start_new_session=True,
            preexec_fn=lambda: _die_with_launcher(launcher),
        )
        proc = Started(popen)
        log.info("started pid %d: %s", proc.pid, " ".join(argv))
        return cls(proc, start_keeper(proc.pid))

    async def disarm(self) -> None:
        """The group is stopped: let the keeper go without killing anything, and reap it
        (it exits as it reads the byte; past `KEEPER_WAIT` it is killed, harmless now)."""
        if self._keeper is None:
            return
        keeper, fd = self._keeper
        self._keeper = None
        with contextlib.suppress(OSError):  # a keeper that is gone needs no word
            os.write(fd, b"x")
        os.close(fd)
        await _reap(Started(keeper), KEEPER_WAIT)

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
            try:
                rc = await self._stop(grace, first)
            finally:
                if not self.leftovers():
                    await self.disarm()
        return rc

    async def _stop(self, grace: float, first: int) -> int:
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
        elif self.proc.returncode is not None:
            await self.disarm()
