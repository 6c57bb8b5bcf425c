"""The demo's processes: start them in their own process groups, watch slicerd's events,
and always end them (SIGTERM, then SIGKILL after a bound, then whatever is left of each
group). Shared by both demo modes (`demo.main`, `demo.loop`). Starting, the readiness
wait and stopping are the test doubles' stack harness's (`stubs.proc`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

import stubs.proc
from demo.client import ClientReport
from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer, ClientError
from stubs.stack import FAKE_BACKEND

TOOL = Path(stubs.proc.TOOL)
READY_TIMEOUT_S = 20.0
CHILD_GRACE_S = 5.0
GROUP_GRACE_S = 5.0


class DemoError(Exception):
    """The demo could not run (the daemon did not start, a child died early, ...)."""


class Interrupted(DemoError):
    """A signal ended the run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Procs:
    """Every child we started, so that `finally` can always end them."""

    daemon: subprocess.Popen[bytes] | None = None
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def all(self) -> list[subprocess.Popen[bytes]]:
        """The children (last started first) and the daemon."""
        kids = list(reversed(self.children.values()))
        return [*kids, *([self.daemon] if self.daemon else [])]


@dataclass
class Recording:
    """What one run saw: events (with local arrival time) and the stop moment."""

    events: list[dict[str, Any]] = field(default_factory=list)
    first_grant_local: float | None = None
    stop_local: float | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)
    daemon_rc: int | None = None
    extended_s: float = 0.0
    client: ClientReport | None = None  # loop mode: the sampling client's outcomes
    _changed: trio.Event | None = field(default=None, repr=False)

    def add(self, event: dict[str, Any]) -> None:
        """Record `event` and wake whoever waits in `until`."""
        self.events.append(event)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def until(self, done: Callable[[list[dict[str, Any]]], bool]) -> None:
        """Return once `done(events)` holds (unbounded: the caller bounds it)."""
        while not done(self.events):
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()


def child_env(base: Path, bandwidth: str) -> dict[str, str]:
    """The environment of every child (`stubs.proc.child_env`: our interpreter first on
    PATH, our checkout importable) with the fake GPU in `base`."""
    gpu = {"FAKEGPU_DIR": str(base / "gpu"), "FAKEGPU_CC_LOG": str(base / "cc.log")}
    return stubs.proc.child_env({**gpu, "FAKEGPU_BANDWIDTH": bandwidth})


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `argv` in a session (process group) of its own, output to `log`; SIGTERMed
    if the demo dies (a SIGKILLed demo leaves no slicerd, launcher or trainer behind)."""
    return stubs.proc.spawn(argv, env, log, pdeathsig=True)


async def start_daemon(
    base: Path, env: dict[str, str], procs: Procs, args: list[str] | None = None
) -> str:
    """Start slicerd as systemd would and wait (bounded) for its READY=1; its socket."""
    sock = str(base / "slicer.sock")
    if args is None:
        args = [*FAKE_BACKEND, "--parker", "cli"]  # never a real libcuda on the fake GPU
    args = [*args, "--socket", sock, "--state-dir", str(base / "state"), "--log-level", "info"]
    with stubs.proc.Notify(base / "notify") as notify:
        procs.daemon = spawn(
            [sys.executable, "-m", "gpu_slicer.slicer.daemon", *args],
            {**env, **notify.env},
            base / "slicerd.log",
        )
        try:
            await notify.ready(procs.daemon, READY_TIMEOUT_S, "slicerd")
        except stubs.proc.StackError as e:
            raise DemoError(str(e)) from None
    return sock


async def watch(
    sock: str,
    rec: Recording,
    first_grant: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Record every EVENT (until cancelled or the daemon goes away). Started with
    ``nursery.start``, it returns once slicerd has the WATCH subscribed: start what is to
    be recorded only then. `DemoError` when the subscription fails."""
    try:
        c = await AsyncSlicer.connect(sock)
    except ClientError as e:
        raise DemoError(f"WATCH on {sock}: {e}") from None
    async with c:
        try:
            await c.request(proto.Watch())
        except ClientError as e:
            raise DemoError(f"WATCH on {sock}: {e}") from None
        task_status.started()
        with contextlib.suppress(ClientError):
            while True:
                msg = await c.next_message()
                if not isinstance(msg, proto.Event) or not isinstance(msg.body, dict):
                    continue
                rec.add({**msg.body, "_recv": time.monotonic()})
                if msg.body.get("event") == "granted" and not first_grant.is_set():
                    rec.first_grant_local = time.monotonic()
                    first_grant.set()


def log_tail(log: Path, lines: int = 3) -> str:
    """The last `lines` lines of `log`, indented (for error messages)."""
    tail = log.read_text(errors="replace").strip().splitlines()[-lines:] if log.exists() else []
    return "\n  ".join(["", *tail]) if tail else " (no output)"


def check_alive(procs: Procs, base: Path, names: list[str] | None = None) -> None:
    """Raise DemoError when slicerd or one of the children `names` (default: all) has
    exited before the stop."""
    if procs.daemon is not None and procs.daemon.poll() is not None:
        raise DemoError(f"slicerd exited with {procs.daemon.returncode} during the run")
    for name, p in procs.children.items():
        if (names is None or name in names) and p.poll() is not None:
            raise DemoError(
                f"{name} exited with {p.returncode} during the run; its log ends:"
                + log_tail(base / f"{name}.log")
            )


async def reap(p: subprocess.Popen[bytes], grace: float) -> int:
    """Wait `grace` seconds for `p`, then SIGKILL it; its exit status."""
    return await stubs.proc.stop(p, grace, sig=None)


async def stop(p: subprocess.Popen[bytes], grace: float = CHILD_GRACE_S) -> int:
    """SIGTERM `p` (when still running), SIGKILL after `grace`; its exit status."""
    return await stubs.proc.stop(p, grace)


def end_all(procs: Procs) -> None:
    """Synchronous last resort: end every child and every process of their groups
    (grandchildren such as slicerd's cuda-checkpoint runs are given the grace too: slicerd
    never kills the tool mid-operation)."""
    stubs.proc.end_all(procs.all(), CHILD_GRACE_S + GROUP_GRACE_S)


async def on_signal(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """SIGTERM or SIGHUP ends the run like Ctrl-C does (trio turns SIGINT into
    KeyboardInterrupt): through the cleanup, never leaving children behind."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            raise Interrupted(signum)


def only(e: BaseException) -> BaseException:
    """The one exception inside `e` (trio wraps what a nursery raises in groups)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP while the (bounded) cleanup ends our children."""
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, signal.SIG_IGN) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def print_log_tail(log: Path) -> None:
    """The end of `log` on stderr, for a failed run."""
    if log.exists():
        print(f"---- {log.name} (tail) ----", file=sys.stderr)
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
