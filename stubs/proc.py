"""Child processes of the test doubles' stack: environment, start, readiness, stop.

Everything `stubs.stack` starts, and whatever tests, benchmarks and the demo start beside
it, goes through these few functions, so that there is one way to do each:

- `child_env`: a child's environment. The running interpreter's bin directory comes first
  on PATH, so the ``#!/usr/bin/env python3`` tools the stack runs (``stubs/cuda-checkpoint``)
  run under an interpreter that has the project installed; the checkout is importable;
  nothing points the child at somebody else's daemon or workload.
- `spawn`: start a child in a process group of its own (a stop can reach what it started),
  its stdout and stderr appended to one log file.
- `Notify`: our end of systemd's readiness protocol: a datagram socket the child finds in
  ``NOTIFY_SOCKET``, awaited for ``READY=1`` (slicerd and slicer-launch both send it).
- `until_listening`: a TCP port accepting connections (slicer-dispatch has no READY=1).
- `wait`: a `subprocess.Popen` awaited on its pidfd: woken by the exit, not by a poll.
- `stop`: a signal (SIGTERM), a grace period, then SIGKILL (to the process group with
  ``group=True``); bounded, and the process is always reaped.
- `end_all`: the synchronous last resort of a ``finally``: every child and its group.

Processes are plain `subprocess.Popen` objects: they outlive a `trio.run`, so synchronous
callers (benchmarks, the hypothesis fuzzer) use the same code through ``trio.run``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import trio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the checkout (the test doubles are installed editable from it)
TOOL = str(HERE / "cuda-checkpoint")
KILL_BOUND_S = 10.0  # SIGKILL to reaped
GROUP_POLL_S = 0.05  # a process group has no pidfd: its end is polled for
# A child of ours must talk to our daemon and be its own workload.
SCRUBBED = ("SLICER_SOCKET", "SLICER_WORKLOAD", "NOTIFY_SOCKET", "FAKEGPU_WORKLOAD")

Proc = subprocess.Popen[bytes] | trio.Process
# `free_port`'s ports: below Linux's default ephemeral range (32768-60999), which bind(0)
# and outgoing connections draw from; the counter every process on the machine shares.
PORTS = (20000, 32000)
UNIX_PATH_MAX = 107  # bytes of an AF_UNIX socket path (sun_path less its NUL)
# What `tempdir`'s callers put below it: 8 random characters, then a socket at most two
# levels down (``node2/redis/redis.sock``).
SOCKET_HEADROOM = 48
PORT_COUNTER = os.path.join(tempfile.gettempdir(), "gpu-slicer-test-ports")


class StackError(RuntimeError):
    """A child of the stack did not start, exited early, or did not become ready."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now, and that no other
    caller on this machine was given recently.

    The kernel's ``bind(0)`` picks at random in the ephemeral range, so two test
    processes running side by side (``pytest -n``) could be given one port between its
    pick and its child's bind, and outgoing connections take ports from that range too.
    Instead every caller on the machine takes the next port of `PORTS` in turn, below
    the ephemeral range, through one counter file under a lock (`PORT_COUNTER`): a port
    comes round again only after all the others were handed out."""
    lo, hi = PORTS
    with open(PORT_COUNTER, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        text = f.read().decode(errors="replace").strip()
        at = int(text) if text.isdigit() and lo <= int(text) < hi else lo + os.getpid() % (hi - lo)
        for _ in range(hi - lo):
            at = lo if at + 1 >= hi else at + 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", at))
                except OSError:
                    continue  # in use: the next one
            f.seek(0)
            f.truncate()
            f.write(str(at).encode())
            return at
    raise StackError(f"no free TCP port on 127.0.0.1 in {lo}-{hi - 1}")


def tempdir(prefix: str) -> Path:
    """A new temporary directory (mode 0755: unprivileged clients must reach a socket in
    it) under $TMPDIR, or under /tmp where $TMPDIR is so deep that a socket a few levels
    below it would pass the 107 bytes an AF_UNIX path may have (a test worker's own
    temporary directory, a CI runner's)."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=socket_parent(prefix)))
    base.chmod(0o755)
    return base


def socket_parent(prefix: str) -> str:
    """Where `tempdir` makes a directory named `prefix` + 8 characters: $TMPDIR, or /tmp
    when $TMPDIR is too deep for a socket below it."""
    parent = tempfile.gettempdir()
    return "/tmp" if len(parent) + len(prefix) + SOCKET_HEADROOM > UNIX_PATH_MAX else parent


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment for a child: this interpreter's bin dir first on PATH, the checkout
    first on PYTHONPATH, no ``SLICER_SOCKET``/``NOTIFY_SOCKET``/... of ours; then `extra`."""
    env = dict(os.environ)
    for name in SCRUBBED:
        env.pop(name, None)
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM it when its parent dies (no orphans of a crashed
    benchmark or demo). Only for children started from the main thread: the signal
    follows the thread that forked (`spawn` checks)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def spawn(
    argv: list[str],
    env: Mapping[str, str],
    log: Path,
    *,
    session: bool = True,
    pdeathsig: bool = False,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start `argv` (in a session and process group of its own unless ``session=False``),
    stdin from /dev/null, stdout and stderr appended to `log`, `pass_fds` left open;
    ``pdeathsig``: SIGTERMed when this process dies (from the main thread only: the
    signal follows the thread that forked, and a worker thread ends long before us)."""
    pdeathsig = pdeathsig and threading.current_thread() is threading.main_thread()
    with open(log, "ab") as f:
        return subprocess.Popen(
            argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=session,
            preexec_fn=die_with_parent if pdeathsig else None,
            pass_fds=pass_fds,
        )


def log_tail(log: Path, chars: int = 4000) -> str:
    """The end of `log` ('' when it does not exist)."""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


async def wait(proc: Proc) -> int:
    """`proc`'s exit status once it exits (cancellable)."""
    if isinstance(proc, trio.Process):
        return await proc.wait()
    if proc.poll() is not None:
        return proc.returncode
    # Not reaped yet (poll above), so the pid is still this child's.
    fd = os.pidfd_open(proc.pid)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    return proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group `pgid` exists."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # A killed orphan stays a zombie until its new parent reaps it (never, when that is a
    # container's init that does not): it counts as gone.
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)"
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _send(proc: Proc, sig: int, group: bool) -> None:
    # The group only while its leader is unreaped or members are left: its id is then
    # still taken, so it cannot be somebody else's group.
    if group and (proc.poll() is None or group_alive(proc.pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


async def stop(
    proc: Proc, grace: float = 10.0, *, sig: int | None = signal.SIGTERM, group: bool = False
) -> int:
    """Send `sig` to `proc` (None: nothing, it is expected to end by itself); after
    `grace` s SIGKILL (to its process group too with ``group=True``, whose other members
    also get `grace` to end); its exit status.

    Bounded by about ``grace + KILL_BOUND_S``. Even when the caller is cancelled the
    SIGKILL and the reaping happen (shielded): no process object is left running."""
    if sig is not None:
        _send(proc, sig, False)
    try:
        with trio.move_on_after(grace):
            await wait(proc)
            while group and group_alive(proc.pid):
                await trio.sleep(GROUP_POLL_S)
    finally:
        with trio.CancelScope(shield=True):
            if proc.poll() is None or (group and group_alive(proc.pid)):
                _send(proc, signal.SIGKILL, group)
            with trio.move_on_after(KILL_BOUND_S):
                await wait(proc)
                while group and group_alive(proc.pid):
                    await trio.sleep(GROUP_POLL_S)
    rc = proc.poll()
    if rc is None:
        raise StackError(f"pid {proc.pid} still runs {KILL_BOUND_S:g} s after SIGKILL")
    return rc


def end_all(
    procs: Iterable[subprocess.Popen[bytes]],
    grace: float = 5.0,
    *,
    sig: int = signal.SIGTERM,
    group: bool = True,
) -> None:
    """Synchronous last resort: `sig` to each of `procs` at once; after `grace` s SIGKILL
    to what is left (and, with `group`, to what is left of each one's process group);
    every one is reaped (bounded by `KILL_BOUND_S` more)."""
    procs = list(procs)
    for p in procs:
        _send(p, sig, False)
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        # Grandchildren (slicerd's cuda-checkpoint runs) live in their leader's group;
        # slicerd never kills the tool mid-operation, so they get the grace too.
        while group and group_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(GROUP_POLL_S)
    for p in procs:
        if p.poll() is None or (group and group_alive(p.pid)):
            _send(p, signal.SIGKILL, group)
    deadline = time.monotonic() + KILL_BOUND_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        while group and group_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(GROUP_POLL_S)


class Notify:
    """A ``NOTIFY_SOCKET`` of ours at `path`: the child started with `env` reports
    ``READY=1`` to it. Use as a context manager (closes and unlinks the socket)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(self.path)

    @property
    def env(self) -> dict[str, str]:
        """The variable to add to the child's environment."""
        return {"NOTIFY_SOCKET": self.path}

    def _ready_now(self) -> bool:
        """Read every queued datagram; whether one of them said READY=1."""
        ready = False
        while True:
            try:
                msg = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return ready
            ready = ready or b"READY=1" in msg

    async def ready(self, proc: Proc, timeout: float, what: str, log: Path | None = None) -> None:
        """Return once READY=1 came; `StackError` (with `log`'s tail) when `proc` exits
        first or nothing came within `timeout` s."""
        seen = exited = False
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:

                async def watch_exit() -> None:
                    nonlocal exited
                    await wait(proc)
                    exited = True
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_exit)
                while not (seen := self._ready_now()):
                    await trio.lowlevel.wait_readable(self.sock)
                nursery.cancel_scope.cancel()
        seen = seen or self._ready_now()  # it may have come just before the exit
        if not seen:
            if exited:
                why = f"exited with {proc.poll()} before READY=1"
            else:
                why = f"sent no READY=1 within {timeout:g} s"
            tail = log_tail(log, 3000) if log is not None else ""
            raise StackError(f"{what} {why}" + (f":\n{tail}" if tail else ""))

    def close(self) -> None:
        """Close and unlink the socket (a later notification of the child just fails)."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        _t: type[BaseException] | None,
        _e: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.close()


async def until_listening(
    proc: Proc, port: int, timeout: float, what: str, log: Path | None = None
) -> None:
    """Return once 127.0.0.1:`port` accepts a connection; `StackError` when `proc` exits
    first or `timeout` s pass. (A port has no readiness event: it is tried every 20 ms.)"""
    with trio.move_on_after(timeout):
        while proc.poll() is None:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.02)
                continue
            await stream.aclose()
            return
    why = f"exited with {proc.poll()}" if proc.poll() is not None else f"not within {timeout:g} s"
    tail = log_tail(log, 3000) if log is not None else ""
    raise StackError(f"{what} listening on {port}: {why}" + (f":\n{tail}" if tail else ""))
