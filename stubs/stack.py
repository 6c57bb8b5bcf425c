"""One stack of the real processes on a fake GPU, for the tests, the benchmarks and the demo.

    async with running_stack("--park-timeout", "5", gpus=1) as stack:
        port = free_port()
        await stack.launcher("v", vllm_stub_argv("v", port))
        await stack.dispatcher("v", f"http://127.0.0.1:{port}", free_port())
        stack.trainer("trainer", ["--steps", "3"])
        ...

A `Stack` lives in one directory, ``base``: the fake GPU ledger (``base/gpu``, given to
every child as FAKEGPU_DIR), slicerd's socket, state dir and log, the cuda-checkpoint
stub's log (FAKEGPU_CC_LOG) and one log per component (``base/NAME.log``). Its processes:

- slicerd (`start`): ``python -m gpu_slicer.slicer.daemon --gpu-backend fake
  --cuda-checkpoint stubs/cuda-checkpoint ...``, started as systemd would: `start` returns
  once it sent READY=1 to our NOTIFY_SOCKET (bounded). `stop` and `reap` end it; it may be
  started again (the ledger and the state dir stay).
- components, each in a process group of its own: `launcher` (slicer-launch, awaited
  until its READY=1: its vLLM booted in a boot turn and slept), `dispatcher`
  (slicer-dispatch, awaited until its port accepts), `trainer` (the trainer stub), or any
  command through `spawn`.
- sleepers (`sleeper`): plain processes standing in for a workload's processes.
- in a pod: `spawn`, `launcher`, `dispatcher` and `trainer` take ``pod=`` (a
  `stubs.pods.Pod`): the component runs as a container of that pod (its own PID and mount
  namespace, ``FAKEGPU_HOST_PROC`` set), slicerd staying outside as the node DaemonSet
  does; ``containers[name]`` is its `stubs.pods.Container` (host and pod pids), and
  `stop_component` signals the container's process, not its nsenter parent.
- slicerd in a pod (pod mode: `start` with ``pod=``): slicerd runs as that pod's native
  sidecar container ``slicerd`` (`daemon`); put its socket where the pod's containers
  find it (`use_socket`, e.g. on ``pod.emptydir``) first. READY=1 still comes to our
  NOTIFY_SOCKET (a host path: the pod sees the host's files). We reach the socket through
  the pod's mount namespace, ``/proc/<pod init>/root<socket>`` (`reach`), so `client`,
  `status` and `until` work from outside; STATUS then speaks the pod's pids.

`close` ends everything: components last started first (SIGTERM, a grace, then SIGKILL to
the group), then slicerd, then the sleepers; bounded and shielded; exit statuses go to
`rcs`. Synchronous callers (benchmarks, the hypothesis fuzzer) use the ``*_sync`` methods
and `running_stack_sync`: the same code under ``trio.run`` (the processes are
`subprocess.Popen` objects, which outlive a trio run).

Every child's environment is `stubs.proc.child_env`: this interpreter's bin directory
first on PATH is what lets the cuda-checkpoint stub (``#!/usr/bin/env python3``) run on an
interpreter that has the project installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer
from stubs.fakegpu import Ledger, parse_size
from stubs.pods import Container, Pod
from stubs.proc import (
    ROOT,
    TOOL,
    Notify,
    StackError,
    child_env,
    die_with_parent,
    free_port,
    log_tail,
    spawn,
    tempdir,
    until_listening,
)
from stubs.proc import stop as stop_process

GiB = 1 << 30
FAKE_BACKEND = ("--gpu-backend", "fake", "--cuda-checkpoint", TOOL)
DAEMON_GRACE_S = 15.0
COMPONENT_GRACE_S = 15.0

__all__ = [
    "ROOT",
    "TOOL",
    "GiB",
    "Stack",
    "StackError",
    "cc_log",
    "free_port",
    "running_stack",
    "running_stack_sync",
    "state_of",
    "vllm_stub_argv",
    "workload",
]


@dataclass
class Stack:
    """slicerd on a fake GPU in `base`, and what runs beside it (module docstring)."""

    base: Path
    socket: str
    env: dict[str, str]  # every child's (no NOTIFY_SOCKET: `start` adds its own)
    ledger: Ledger
    args: list[str]  # slicerd's arguments (a test may change them before a restart)
    prefix: list[str] = field(default_factory=lambda: [sys.executable])  # e.g. cProfile
    ready_timeout: float = 60.0  # generous: a loaded 2-core machine starts Python slowly
    pdeathsig: bool = False  # children get SIGTERM when we die (benchmarks)
    proc: subprocess.Popen[bytes] | None = None  # slicerd
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)  # sleepers
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # components
    containers: dict[str, Container] = field(default_factory=dict)  # components in pods
    rcs: dict[str, int] = field(default_factory=dict)  # exit statuses of stopped ones
    clients: list[AsyncSlicer] = field(default_factory=list)  # `client`'s, closed by `close`
    log: Path | None = None  # slicerd's, once started
    daemon: Container | None = None  # slicerd as a pod's sidecar (pod mode)
    reach: str | None = None  # our path to slicerd's socket when not `socket` (pod mode)
    _notifies: int = 0

    @classmethod
    def create(
        cls,
        base: Path,
        *flags: str,
        gpus: int = 2,
        capacity: int | str = "80GiB",
        bandwidth: str | None = "400GB",
        env: Mapping[str, str] | None = None,
        log_level: str = "debug",
        backend: Sequence[str] = FAKE_BACKEND,
        profile: str | None = None,
        pdeathsig: bool = False,
    ) -> Stack:
        """A stack in `base` (created if needed) on a fresh ledger of `gpus` fake GPUs of
        `capacity`; nothing runs yet. `flags` go to slicerd last; `bandwidth` is the fake
        link's (None: FAKEGPU_BANDWIDTH as inherited, else the ledger's default); `env`
        is added to every child's; `profile` runs slicerd under cProfile into that file
        (written when it exits on SIGTERM)."""
        base.mkdir(parents=True, exist_ok=True)
        gpu = base / "gpu"
        Ledger.init(gpu, gpus, parse_size(capacity))
        extra = {"FAKEGPU_DIR": str(gpu), "FAKEGPU_CC_LOG": str(base / "cc.log")}
        if bandwidth is not None:
            extra["FAKEGPU_BANDWIDTH"] = bandwidth
        sock = str(base / "slicer.sock")
        args = ["--socket", sock, *backend, "--state-dir", str(base / "state")]
        # The CLI parker unless a test asks for another: `auto` would load a real libcuda
        # on a GPU host and point it at the fake GPU's processes.
        parker = [] if "--parker" in flags else ["--parker", "cli"]
        args += ["--log-level", log_level, *parker, *flags]
        prefix = [sys.executable]
        if profile:
            prefix += ["-m", "cProfile", "-o", os.path.abspath(profile)]
        return cls(
            base=base,
            socket=sock,
            env=child_env({**extra, **(env or {})}),
            ledger=Ledger(gpu),
            args=args,
            prefix=prefix,
            pdeathsig=pdeathsig,
        )

    # -- slicerd -------------------------------------------------------------------

    def _notify(self, what: str) -> Notify:
        self._notifies += 1
        return Notify(self.base / f"notify-{what}-{self._notifies}")

    def use_socket(self, path: str | Path) -> None:
        """Give slicerd (from its next `start`) and every component started later the
        socket `path`."""
        self.socket = str(path)
        self.args[self.args.index("--socket") + 1] = self.socket

    async def start(
        self, extra_env: Mapping[str, str] | None = None, *, pod: Pod | None = None
    ) -> None:
        """Start slicerd (with `pod`: as its sidecar container ``slicerd``, module
        docstring); return once it sent READY=1 (within `ready_timeout`). A start that
        fails leaves no daemon behind and raises `StackError` with its log's tail."""
        self.log = self.base / "slicerd.log"
        with self._notify("slicerd") as notify:
            env = {**self.env, **(extra_env or {}), **notify.env}
            argv = [*self.prefix, "-m", "gpu_slicer.slicer.daemon", *self.args]
            if pod is not None:
                self.daemon = pod.spawn("slicerd", argv, env, self.log, sidecar=True)
                self.proc = self.daemon.proc
                self.reach = f"/proc/{pod.init_pid}/root{os.path.abspath(self.socket)}"
            else:
                self.daemon = self.reach = None
                self.proc = spawn(argv, env, self.log, pdeathsig=self.pdeathsig)
            try:
                await notify.ready(self.proc, self.ready_timeout, "slicerd", self.log)
            except BaseException:
                await self.reap()
                raise

    async def stop(self, sig: int = signal.SIGTERM, grace: float = DAEMON_GRACE_S) -> int:
        """Send slicerd `sig` (SIGKILL after `grace` s), reap it; its exit status (also
        in ``rcs["slicerd"]``). Its cuda-checkpoint runs are left alone."""
        assert self.proc is not None, "slicerd is not running"
        if self.daemon is not None:  # nsenter, its parent, passes no signal on
            rc = await self.daemon.stop(grace, sig)
        else:
            rc = await stop_process(self.proc, grace, sig=sig)
        self.proc = None
        self.rcs["slicerd"] = rc
        return rc

    async def reap(self) -> None:
        """SIGKILL slicerd (if it runs) and reap it, bounded and even when cancelled: a
        process object nobody reaped warns ``ResourceWarning: subprocess ... is still
        running`` when collected, failing some later test."""
        if self.daemon is not None and self.proc is not None:
            await self.daemon.stop(0, signal.SIGKILL)
            self.proc = None
        elif self.proc is not None:
            await stop_process(self.proc, 0, sig=signal.SIGKILL)
            self.proc = None

    def start_sync(self, extra_env: Mapping[str, str] | None = None) -> None:
        """`start` for synchronous callers."""
        trio.run(self.start, extra_env)

    def stop_sync(self, sig: int = signal.SIGTERM, grace: float = DAEMON_GRACE_S) -> int:
        """`stop` for synchronous callers."""
        return trio.run(self.stop, sig, grace)

    def alive(self) -> bool:
        """Whether slicerd runs."""
        return self.proc is not None and self.proc.poll() is None

    # -- components ----------------------------------------------------------------

    def log_of(self, name: str) -> Path:
        """Component `name`'s log (stdout and stderr)."""
        return self.base / f"{name}.log"

    def spawn(
        self,
        name: str,
        argv: list[str],
        env: Mapping[str, str] | None = None,
        *,
        pod: Pod | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start component `name` (`argv`, env `env` or ours) in a process group of its
        own, output to ``log_of(name)``; `close` and `check_alive` know it by `name`.
        With `pod`: as a container of it (``containers[name]``; the process returned is
        its parent outside the pod, which exits with the container's status)."""
        self.procs.pop(name, None)  # a restarted one is the last started
        self.containers.pop(name, None)
        env = self.env if env is None else env
        if pod is not None:
            c = pod.spawn(name, argv, env, self.log_of(name))
            self.containers[name] = c
            p = c.proc
        else:
            p = spawn(argv, env, self.log_of(name), pdeathsig=self.pdeathsig)
        self.procs[name] = p
        return p

    async def launcher(
        self,
        name: str,
        server: list[str],
        *,
        park: str | None = None,
        args: Sequence[str] = (),
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        component: str | None = None,
        pod: Pod | None = None,
    ) -> subprocess.Popen[bytes]:
        """``slicer-launch vllm --workload NAME [--park PARK] ARGS -- SERVER`` (e.g.
        `vllm_stub_argv`) as component `component` (default: `name`), returned once it
        sent READY=1: its server booted inside a boot turn, slept and released, its ready
        marker ``base/NAME.ready`` written."""
        argv = [sys.executable, "-m", "gpu_slicer.launcher.main", "vllm", "--workload", name]
        argv += ["--socket", self.socket, "--ready-file", str(self.base / f"{name}.ready")]
        argv += [*(["--park", park] if park else []), *args, "--", *server]
        component = component or name
        with self._notify(component) as notify:
            env = {**(self.env if env is None else env), **notify.env}
            p = self.spawn(component, argv, env, pod=pod)
            await notify.ready(p, timeout, f"slicer-launch {name}", self.log_of(component))
        return p

    async def dispatcher(
        self,
        name: str,
        replica: str,
        port: int,
        *,
        state_dir: Path | None = None,
        args: Sequence[str] = (),
        prefix: Sequence[str] | None = None,
        timeout: float = 30.0,
        component: str = "dispatcher",
        pod: Pod | None = None,
    ) -> subprocess.Popen[bytes]:
        """``slicer-dispatch --workload NAME --replica REPLICA --listen 127.0.0.1:PORT``
        (state in `state_dir`, default ``base/dstate``; `prefix`: e.g. cProfile), returned
        once its port accepts connections."""
        state = state_dir if state_dir is not None else self.base / "dstate"
        argv = [*(prefix or [sys.executable]), "-m", "gpu_slicer.dispatcher.main"]
        argv += ["--workload", name, "--replica", replica, "--listen", f"127.0.0.1:{port}"]
        argv += ["--socket", self.socket, "--state-dir", str(state), *args]
        p = self.spawn(component, argv, pod=pod)
        await until_listening(p, port, timeout, f"slicer-dispatch {name}", self.log_of(component))
        return p

    def trainer(
        self,
        name: str,
        args: Sequence[str] = (),
        *,
        component: str = "trainer",
        pod: Pod | None = None,
    ) -> subprocess.Popen[bytes]:
        """The trainer stub as workload `name` (``python -m stubs.trainer_stub``); it
        takes its turns and exits on its own (no readiness to wait for)."""
        argv = [sys.executable, "-m", "stubs.trainer_stub", "--socket", self.socket]
        return self.spawn(component, [*argv, "--workload", name, *args], pod=pod)

    def check_alive(self, names: Sequence[str] | None = None) -> None:
        """`StackError` when slicerd, or one of the components `names` (default: all),
        has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise StackError(f"slicerd exited with {self.proc.returncode}")
        for name, p in self.procs.items():
            if (names is None or name in names) and p.poll() is not None:
                tail = "\n  ".join(["", *log_tail(self.log_of(name), 600).splitlines()[-3:]])
                raise StackError(f"{name} exited with {p.returncode}; its log ends:{tail}")

    async def stop_component(self, name: str, grace: float = COMPONENT_GRACE_S) -> int:
        """SIGTERM component `name`, SIGKILL its group after `grace` s; its exit status
        (also in ``rcs[name]``). A container: SIGTERM to its process (`Container.stop`)."""
        if name in self.containers:
            rc = await self.containers[name].stop(grace)
        else:
            rc = await stop_process(self.procs[name], grace, group=True)
        self.rcs[name] = rc
        return rc

    # -- everything ----------------------------------------------------------------

    async def close(
        self, grace: float = COMPONENT_GRACE_S, daemon_signal: int = signal.SIGTERM
    ) -> dict[str, int]:
        """End every process of the stack (components last started first, slicerd, the
        sleepers), bounded and even when cancelled; `rcs`."""
        with trio.CancelScope(shield=True):
            for name in reversed(list(self.procs)):
                if name not in self.rcs or self.procs[name].poll() is None:
                    await self.stop_component(name, grace)
            if self.proc is not None:
                await self.stop(daemon_signal, grace)
            for p in self.children:
                p.kill()
                p.wait(timeout=10)
            # Every connection `client` made (a test may leave its own open: its peer is
            # gone by now, so each closes at once).
            clients, self.clients = self.clients, []
            for c in clients:
                with contextlib.suppress(Exception):
                    await c.aclose()
        return self.rcs

    def close_sync(self, grace: float = COMPONENT_GRACE_S) -> dict[str, int]:
        """`close` for synchronous callers."""
        return trio.run(self.close, grace)

    # -- the daemon's view ---------------------------------------------------------

    async def client(self) -> AsyncSlicer:
        """A new connection to slicerd (through `reach` in pod mode); `close` closes it
        if the caller did not."""
        c = await AsyncSlicer.connect(self.reach or self.socket)
        self.clients.append(c)
        return c

    def sleeper(
        self, nbytes: int = 0, gpu: int = 0, label: str | None = None, *, node: bool = False
    ) -> int:
        """A child process standing for a workload; optionally holding `nbytes` on `gpu`.
        With `node`, it holds `gpu`'s device node open from its first instruction on, as a
        process with a CUDA context does (what a census by elimination looks for)."""
        argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        fd = os.open(self.ledger.device_node(gpu), os.O_RDONLY) if node else None
        try:
            p = subprocess.Popen(
                argv,
                env=self.env,
                preexec_fn=die_with_parent if self.pdeathsig and _main_thread() else None,
                pass_fds=() if fd is None else (fd,),
            )
        finally:
            if fd is not None:
                os.close(fd)
        self.children.append(p)
        if nbytes:
            self.ledger.alloc(p.pid, gpu, nbytes, tag="weights", workload=label or f"w{p.pid}")
        return p.pid

    async def status(self) -> dict[str, Any]:
        """One STATUS over a fresh connection."""
        async with await AsyncSlicer.connect(self.reach or self.socket) as c:
            return await c.status()

    async def until(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20
    ) -> dict[str, Any]:
        """Wait (event-driven, bounded) until `pred(STATUS)` holds; return that STATUS."""
        with trio.fail_after(timeout):
            here = self.reach or self.socket
            async with await AsyncSlicer.connect(here) as w, await AsyncSlicer.connect(here) as s:
                await w.request(proto.Watch())  # subscribe first: no change can slip by
                while True:
                    st = await s.status()
                    if pred(st):
                        return st
                    await w.next_message()

    def overlaps(self) -> int:
        """The fake GPU's overlap count (must stay 0)."""
        return self.ledger.overlaps()


def vllm_stub_argv(name: str, port: int, *flags: str, model: str = "m") -> list[str]:
    """The vLLM stub's command line (``python -m stubs.vllm_stub serve``) as workload
    `name`'s server on `port`, for `Stack.launcher`."""
    argv = [sys.executable, "-m", "stubs.vllm_stub", "serve", model, "--port", str(port)]
    return [*argv, "--fake-workload", name, *flags]


def workload(st: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The STATUS entry of workload `name` (registered first), or None."""
    for w in st["workloads"]:
        if w["name"] == name:
            return dict(w)
    return None


def state_of(name: str, state: str) -> Callable[[dict[str, Any]], bool]:
    """Predicate on STATUS: workload `name` is in `state`."""

    def pred(st: dict[str, Any]) -> bool:
        w = workload(st, name)
        return w is not None and w["state"] == state

    return pred


def cc_log(stack: Stack) -> list[dict[str, Any]]:
    """The cuda-checkpoint stub's invocation log."""
    path = stack.base / "cc.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _main_thread() -> bool:
    # PR_SET_PDEATHSIG follows the thread that forked: a worker thread ends before us.
    return threading.current_thread() is threading.main_thread()


def _tempdir(prefix: str) -> Path:
    return tempdir(prefix)


@asynccontextmanager
async def running_stack(
    *flags: str,
    gpus: int = 2,
    capacity: str = "80GiB",
    env: dict[str, str] | None = None,
    tmp_prefix: str = "slicer-it-",
    **create: Any,
) -> AsyncIterator[Stack]:
    """A started slicerd on a fresh fake GPU in a new temporary directory. On the way
    out: asserts the core invariant (zero overlaps; on a clean exit), prints slicerd's
    log tail on a failure, ends every process (slicerd with SIGKILL), removes the
    directory. `create`: more `Stack.create` options."""
    base = _tempdir(tmp_prefix)
    stack = Stack.create(base, *flags, gpus=gpus, capacity=capacity, env=env, **create)
    try:
        await stack.start()
        yield stack
        assert stack.overlaps() == 0, stack.ledger.overlap_log()
    except BaseException:
        if stack.log is not None and stack.log.exists():
            print("---- slicerd log (tail) ----")
            print(log_tail(stack.log, 6000))
        raise
    finally:
        await stack.close(daemon_signal=signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def running_stack_sync(
    *flags: str, tmp_prefix: str = "slicer-", start: bool = True, **create: Any
) -> Iterator[Stack]:
    """`running_stack` for synchronous callers (benchmarks): a started slicerd (with
    ``start=False`` not yet: the caller may write files into ``stack.base`` and change
    ``stack.args`` first, then `Stack.start_sync`); more with the ``*_sync`` methods or
    ``trio.run``. On the way out every process is stopped with SIGTERM first (exit
    statuses in ``stack.rcs``) and the directory removed."""
    base = _tempdir(tmp_prefix)
    stack = Stack.create(base, *flags, **create)
    try:
        if start:
            stack.start_sync()
        yield stack
    finally:
        try:
            stack.close_sync()
        finally:
            shutil.rmtree(base, ignore_errors=True)
