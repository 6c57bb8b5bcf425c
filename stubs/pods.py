"""A test double of a Kubernetes pod on this machine: a PID namespace and a mount namespace.

    async with running_pod(tmp_path, "a", emptydir=True) as pod:
        c = await pod.start_container("app", argv, env=env)
        c.host_pid, c.ns_pid          # the same process, seen from the host and from the pod
        c.signal(signal.SIGTERM); await c.wait()
        await pod.delete(grace=30)    # Kubernetes' order (below); or pod.kill()

Kubernetes cannot run here, Linux namespaces can (as root). A pod is what a pod's
processes see of the kernel: their own PID namespace (pid 1 is the pod's "pause"
container, which reaps orphans) and their own mount namespace (their own /proc, and
volumes). The network stays the host's (127.0.0.1 ports are shared), and so do the
files: a host directory such as slicerd's socket directory is "mounted" into the pod just
by being there (node mode's hostPath volume).

Theory of operation
-------------------
The pod (`running_pod`) is ``unshare --pid --fork --kill-child --mount --propagation
private`` running a shell that, inside the new namespaces, bind-mounts the host's /proc on
``DIR/hostproc`` (`Pod.host_proc`: the host procfs seen inside, for the fake GPU driver
only: every container gets ``FAKEGPU_HOST_PROC`` naming it, as NVIDIA's driver sees host
pids), mounts the pod's own procfs on /proc, optionally a tmpfs on ``DIR/emptydir`` (an
emptyDir volume: `Pod.emptydir`, empty and private to the pod; outside it is an empty
directory), then execs the init: a small Python loop, pid 1 of the pod, that reaps every
orphan (a zombie would count as alive to nobody and as dead to the fake GPU) and exits on
SIGTERM or SIGINT (the kernel then kills the whole pod). It reports its host pid (read as
``hostproc/self``) on a pipe: the pod is up once that line came (bounded).

A container (`Pod.start_container`) is ``SHIM -- nsenter --target INIT --pid --mount
--wd=CWD -- bash -c 'echo $$ >&FD; exec ARGV'``: nsenter joins the namespaces and forks (a
PID namespace applies to children only), and stays outside the pod as the container's
parent, exiting with its child's status (a signal re-raised). It does not forward
signals: a `Container` finds the real process (the pod pid the shell wrote, translated
into a host pid through ``NSpid``), holds a pidfd on it, and signals that one. The shim
(`stubs.podshim`, a small Python program outside the pod, as containerd's shim is) is the
container's ``proc``: its exit is the container's, with the same status.

A container's processes die with its main process, as in Kubernetes with
``shareProcessNamespace: true``: runc then kills every process of the container's cgroup
when the container's init exits, so a child the container started (a launcher's vLLM,
reparented to the pod's pid 1) never outlives it. Here the cgroup is a marker: every
container gets ``STUBS_POD_CONTAINER=<pod>/<name>/<unique token>`` in its environment,
which every descendant inherits through fork and exec, whatever it does with its process
group or session (slicer-launch starts vLLM with ``setsid``, so a process group would
not do) and after it is reparented (so ancestry alone would not do). When nsenter has
exited (the main process ended, any way), the shim, before it exits itself, SIGKILLs every
process of the pod's PID namespace whose ``/proc/<pid>/environ`` holds the marker, and
their descendants (by ``PPid``: one that exec'd with a clean environment while its parent
still lived), by pidfd after checking the start time (no reused pid is hit); it rescans
until none is left (one forking meanwhile), then waits until each is reaped (the pod's
init reaps orphans), all within `_SHIM_BOUND_S`. Not covered: a process that dropped the
marker from its environment *and* was orphaned before the container ended (a real
cgroup has no such gap).

`Pod.delete` follows Kubernetes' order: SIGTERM to every regular container at once, wait
for them, then to the sidecars (``sidecar=True``, native sidecars: init containers with
``restartPolicy: Always``) one by one, last started first, each awaited, all within the
grace period; then SIGKILL to what is left and to pid 1. `Pod.kill` is SIGKILL to pid 1
(a node losing the pod): the kernel kills every process of the namespace. Either way the
mounts go with the mount namespace when its last process has exited; leaving the
`running_pod` context kills the pod, reaps every process (bounded, even when cancelled)
and checks that no process is left in the pod's mount namespace (`Pod.leftovers`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from gpu_slicer.slicer.pidns import nspids, translate
from stubs import podshim
from stubs.proc import KILL_BOUND_S, StackError, child_env, log_tail, spawn, wait

__all__ = ["Container", "Pod", "PodError", "running_pod"]

START_TIMEOUT_S = 20.0  # the pod's init up, a container's pid reported
DELETE_GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds
_SIGTERM = signal.SIGTERM  # (`Container.signal` hides the module in its class body)

# pid 1 of the pod. SIGCHLD, SIGTERM and SIGINT are blocked and taken with sigwait: a
# child's exit between two reaps stays pending (no lost wake-up), and a blocked signal
# reaches a namespace's init even from outside (an unhandled one would be dropped).
_INIT = """
import os, signal, sys
sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
os.write(1, os.readlink(sys.argv[1] + "/self").encode() + b"\\n")
os.close(1)
while True:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    if signal.sigwait(sigs) != signal.SIGCHLD:
        sys.exit(0)
"""
_SHIM = Path(__file__).with_name("podshim.py")  # a container's parent (module docstring)
_SHIM_BOUND_S = 4.0  # its kill and reaping (well within stubs.proc.KILL_BOUND_S)
MARKER_ENV = podshim.ENV  # the container's cgroup stand-in (module docstring)
# $1 host procfs mount point, $2 emptyDir mount point ('' for none), $3 python.
_SETUP = (
    'mount --bind /proc "$1" && mount -t proc proc /proc'
    ' && { [ -z "$2" ] || mount -t tmpfs -o mode=0755 tmpfs "$2"; }'
    ' && exec "$3" -I -S -c "$4" "$1"'
)


class PodError(StackError):
    """A pod or one of its containers did not start, or would not go away."""


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


async def _read_line(fd: int, timeout: float) -> bytes:
    """One line from pipe `fd` (b'' at EOF without one), within `timeout` s."""
    data = b""
    with trio.move_on_after(timeout):
        while b"\n" not in data:
            await trio.lowlevel.wait_readable(fd)
            chunk = os.read(fd, 64)
            if not chunk:
                break
            data += chunk
    return data


@dataclass(eq=False)
class Container:
    """One process started in a pod (module docstring): `proc` is its nsenter parent
    (outside the pod; exits with the container's status), `host_pid`/`ns_pid` the real
    process's pids on the host and in the pod (known once `started` returned)."""

    name: str
    pod: Pod
    proc: subprocess.Popen[bytes]
    log: Path
    sidecar: bool = False
    marker: str = ""  # its ``STUBS_POD_CONTAINER`` (module docstring)
    host_pid: int = 0
    ns_pid: int = 0
    rc: int | None = None
    exited_at: float | None = None  # time.monotonic() when its exit was seen
    _report: int | None = None  # the pipe its pod pid comes on
    _pidfd: int | None = None

    async def started(self, timeout: float = START_TIMEOUT_S) -> Container:
        """Wait (bounded) until the container's process is identified: its pod pid came
        and its host pid is found (a pidfd held on it); `PodError` when it exited first."""
        if self._report is None:
            return self
        try:
            line = await _read_line(self._report, timeout)
        finally:
            os.close(self._report)
            self._report = None
        host = translate(int(line), self.pod.pidns) if line.strip().isdigit() else None
        if host is not None:
            with contextlib.suppress(ProcessLookupError):
                fd = os.pidfd_open(host)
                # Checked after the open: the pid may have been reused in between.
                if (nspids(host) or [0])[-1] == int(line):
                    self._pidfd = fd
                else:
                    os.close(fd)
        if self._pidfd is None:
            self.stop_now()
            why = f"exited with {self.proc.poll()}" if self.proc.poll() is not None else "lost"
            tail = log_tail(self.log, 2000)
            raise PodError(f"container {self.name} of pod {self.pod.name} {why}:\n{tail}")
        assert host is not None
        self.host_pid, self.ns_pid = host, int(line)
        return self

    def alive(self) -> bool:
        """Whether the container's process (its nsenter parent) has not exited."""
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the container's process (not to its nsenter parent); nothing when
        it has exited. Call after `started`."""
        if self._pidfd is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def stop_now(self) -> None:
        """SIGKILL the container's process: its shim then kills every other process of
        the container (module docstring). Before the process is identified, and with
        ``group=True``: the shim's whole process group (the shim, nsenter, the shell)."""
        self._kill(group=self._pidfd is None)

    def _kill(self, *, group: bool) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            elif self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        """Its exit status (negative: the signal that ended it), once it has exited."""
        if self.rc is None:
            rc = await wait(self.proc)
            self.exited_at = self.exited_at or time.monotonic()
            self.rc = rc
            self._close()
        return self.rc

    async def stop(self, grace: float = 10.0, sig: int = _SIGTERM) -> int:
        """`sig` to the process, SIGKILL to it after `grace` s (`stop_now`); its exit status
        (bounded; the kill and the reaping happen even when cancelled)."""
        try:
            with contextlib.suppress(PodError):  # it exited before it was identified
                await self.started()
            self.signal(sig)
            with trio.move_on_after(grace):
                await self.wait()
        finally:
            with trio.CancelScope(shield=True):
                if self.alive():
                    self.stop_now()
                with trio.move_on_after(KILL_BOUND_S):
                    await self.wait()
        if self.rc is None:
            raise PodError(f"container {self.name} still runs {KILL_BOUND_S:g} s after SIGKILL")
        return self.rc

    def _close(self) -> None:
        for fd in (self._report, self._pidfd):
            if fd is not None:
                os.close(fd)
        self._report = self._pidfd = None


@dataclass(eq=False)
class Pod:
    """A running pod (module docstring). `init_pid` is pid 1's host pid, `pidns` and
    `mntns` its namespaces' inodes."""

    name: str
    dir: Path
    proc: subprocess.Popen[bytes]  # unshare (outside; --kill-child ties pid 1 to it)
    init_pid: int
    pidns: int
    mntns: int
    emptydir: Path | None
    containers: dict[str, Container] = field(default_factory=dict)
    exit_order: list[str] = field(default_factory=list)  # by `delete`
    _init_fd: int | None = None
    _started: int = 0  # containers started (each one's marker is unique)

    @property
    def host_proc(self) -> Path:
        """Where the host's procfs is mounted inside the pod (``FAKEGPU_HOST_PROC``)."""
        return self.dir / "hostproc"

    def env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """A container's environment: `env` (default: `stubs.proc.child_env`) with
        ``FAKEGPU_HOST_PROC`` naming `host_proc`."""
        base = dict(child_env() if env is None else env)
        return {**base, "FAKEGPU_HOST_PROC": str(self.host_proc)}

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        *,
        cwd: str | Path | None = None,
        sidecar: bool = False,
    ) -> Container:
        """Start container `name` running `argv` (environment `env` through `env`,
        output appended to `log`, default ``DIR/NAME.log``; working directory `cwd`,
        default ours); not yet identified: await `Container.started`."""
        log = log or self.dir / f"{name}.log"
        self._started += 1
        marker = f"{self.name}/{name}/{os.getpid()}.{self.init_pid}.{self._started}"
        r, w = os.pipe()
        try:
            shell = f'echo $$ >&{w} && exec {w}>&- && exec "$@"'
            shim = [sys.executable, "-I", "-S", str(_SHIM), marker, str(self.pidns),
                    str(self.init_pid), str(w), str(_SHIM_BOUND_S), "--"]  # fmt: skip
            argv = [*shim, "nsenter", f"--target={self.init_pid}", "--pid", "--mount",
                    f"--wd={cwd or os.getcwd()}", "--", "bash", "-c", shell, name,
                    *argv]  # fmt: skip
            proc = spawn(argv, {**self.env(env), MARKER_ENV: marker}, log, pass_fds=(w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        c = Container(name=name, pod=self, proc=proc, log=log, sidecar=sidecar, marker=marker,
                      _report=r)  # fmt: skip
        self.containers[name] = c  # a restarted container replaces its predecessor
        return c

    async def start_container(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        *,
        cwd: str | Path | None = None,
        sidecar: bool = False,
        timeout: float = START_TIMEOUT_S,
    ) -> Container:
        """`spawn`, then `Container.started`: the container with its pids."""
        c = self.spawn(name, argv, env, log, cwd=cwd, sidecar=sidecar)
        return await c.started(timeout)

    def kill(self) -> None:
        """SIGKILL pid 1: the kernel kills every process of the pod (a node losing it)."""
        if self._init_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)

    async def delete(
        self,
        grace: float = DELETE_GRACE_S,
        *,
        before_sidecars: Callable[[], Awaitable[object]] | None = None,
    ) -> dict[str, int]:
        """Delete the pod as Kubernetes does (module docstring), within `grace` s plus the
        kill's bound; every container's exit status. `exit_order` gets the names in the
        order their exits were seen. `before_sidecars` is awaited (within the grace) once
        every regular container has exited and before any sidecar gets its SIGTERM: what
        the sidecars still see then."""
        deadline = trio.current_time() + grace
        live = [c for c in self.containers.values() if c.alive()]

        async def stop(c: Container) -> None:
            with contextlib.suppress(PodError):  # it exited before it was identified
                await c.started()
            c.signal(signal.SIGTERM)
            await c.wait()
            self.exit_order.append(c.name)

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                for c in live:
                    if not c.sidecar:
                        nursery.start_soon(stop, c)
            if before_sidecars is not None:
                await before_sidecars()
            for c in reversed([c for c in live if c.sidecar]):
                await stop(c)
        await self.close()
        return {name: c.rc for name, c in self.containers.items() if c.rc is not None}

    def leftovers(self) -> list[int]:
        """Host pids of processes still in the pod's mount namespace (none once closed)."""
        return [
            int(e)
            for e in os.listdir("/proc")
            if e.isdigit() and _ns_inode(int(e), "mnt") == self.mntns
        ]

    async def close(self) -> None:
        """Kill the pod and reap every process of it, bounded, even when cancelled."""
        with trio.CancelScope(shield=True):
            self.kill()
            for c in self.containers.values():
                c.stop_now()  # a container's process outside the pod's PID namespace
            with trio.move_on_after(KILL_BOUND_S):
                for c in self.containers.values():
                    await c.wait()
                await wait(self.proc)
            for c in self.containers.values():
                c._kill(group=True)  # a shim that did not finish (never seen; bounded)
                with trio.move_on_after(KILL_BOUND_S):
                    await c.wait()
            if self.proc.poll() is None:
                self.proc.kill()
                with trio.move_on_after(KILL_BOUND_S):
                    await wait(self.proc)
            if self._init_fd is not None:
                os.close(self._init_fd)
                self._init_fd = None
        if self.proc.poll() is None or any(c.rc is None for c in self.containers.values()):
            raise PodError(f"pod {self.name}: processes still run after SIGKILL")


def _die_with_test() -> None:
    # A test process that dies (pytest-timeout's os._exit) takes the pod with it: unshare
    # gets SIGKILL (it may block SIGTERM), and --kill-child then kills the pod's pid 1.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG


async def _start(base: Path, name: str, emptydir: bool, timeout: float) -> Pod:
    (base / "hostproc").mkdir(parents=True, exist_ok=True)
    ed = base / "emptydir" if emptydir else None
    if ed is not None:
        ed.mkdir(exist_ok=True)
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
            "--", "sh", "-c", _SETUP, "pod", str(base / "hostproc"), str(ed or ""),
            sys.executable, _INIT]  # fmt: skip
    log = base / "pod.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=f,
            start_new_session=True, preexec_fn=_die_with_test,
        )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await _read_line(proc.stdout.fileno(), timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
    init = int(line) if line.strip().isdigit() else 0
    fd = None
    if init:
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(init)
    pidns, mntns = (_ns_inode(init, "pid"), _ns_inode(init, "mnt")) if init else (None, None)
    if fd is None or pidns is None or mntns is None or nspids(init) != [init, 1]:
        if fd is not None:
            os.close(fd)
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(KILL_BOUND_S):
            await wait(proc)
        raise PodError(f"pod {name} did not start (rc {proc.poll()}):\n{log_tail(log, 2000)}")
    return Pod(name=name, dir=base, proc=proc, init_pid=init, pidns=pidns, mntns=mntns,
               emptydir=ed, _init_fd=fd)  # fmt: skip


@asynccontextmanager
async def running_pod(
    tmp_path: Path, name: str, *, emptydir: bool = False, timeout: float = START_TIMEOUT_S
) -> AsyncIterator[Pod]:
    """A started pod `name` in ``tmp_path/pod-NAME`` (its files: ``hostproc``, the
    optional ``emptydir``, ``pod.log``, one log per container). On the way out (a failure
    included) the pod is killed, every process reaped, and no process may be left in its
    mount namespace."""
    pod = await _start(tmp_path / f"pod-{name}", name, emptydir, timeout)
    try:
        yield pod
    finally:
        await pod.close()
        # Every process that can hold the mount namespace is reaped by now: those of the
        # PID namespace died with pid 1, the nsenter parents were waited for.
        if left := pod.leftovers():
            raise PodError(f"pod {name}: processes {left} left in its mount namespace")
