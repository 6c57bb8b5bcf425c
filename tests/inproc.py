"""The real slicerd server, in-process: no child process, no socket file, virtual time.

`inproc_server` runs `slicer.server.Server` over the real `SlicerState` with stand-ins for
what it measures and drives: `FakeHost` (a process table of made-up processes: pids,
parents, start times, kills), `FakeGpu` (device memory per pid, read like NVML reads the
driver) and `FakeParker` (cuda-checkpoint: moves a pid's memory to host and back, or fails
as told). Clients talk to it over socketpairs (the server reads their SO_PEERCRED as for
any Unix socket), so every byte on the wire is the real protocol. The state machine's
clock is trio's, so tests run under `autojump_clock`.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.slicer.config import Config
from gpu_slicer.slicer.gpu import Device
from gpu_slicer.slicer.journal import Journal
from gpu_slicer.slicer.readings import Outcome
from gpu_slicer.slicer.server import Server
from gpu_slicer.slicer.state import Limits, SlicerState

GiB = 1024**3
UID = os.getuid()
PEER_START = 1  # the start time FakeHost gives the tests' own process (not in its table)


@dataclass
class Proc:
    ppid: int
    start: int
    uid: int = UID


class FakeHost:
    """A process table (`slicer.procs.ProcessTable`) of made-up processes."""

    HAS_CHILDREN_FILES = True

    def __init__(self) -> None:
        self.procs: dict[int, Proc] = {}
        self.killed: list[int] = []
        self.kill_seen = trio.Event()
        self.ns: dict[int, tuple[int, int]] = {}

    def spawn(self, pid: int, ppid: int = 1, start: int = 1000) -> tuple[int, int]:
        self.procs[pid] = Proc(ppid, start)
        return pid, start

    def exit(self, pid: int) -> None:
        self.procs.pop(pid, None)

    def start_time(self, pid: int) -> int | None:
        p = self.procs.get(pid)
        if p is None and pid == os.getpid():
            return PEER_START  # the tests' own process, the server's peer over socketpairs
        return p.start if p is not None else None

    def owner_uid(self, pid: int) -> int | None:
        p = self.procs.get(pid)
        return p.uid if p is not None else None

    def groups(self, pid: int) -> set[int]:
        return set()

    def alive(self, ident: tuple[int, int]) -> bool:
        return self.start_time(ident[0]) == ident[1]

    def ancestry(self, pid: int, limit: int = 64) -> Iterator[tuple[int, int]]:
        for _ in range(limit):
            p = self.procs.get(pid)
            if p is None:
                return
            yield pid, p.start
            pid = p.ppid

    def children_map(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for pid, p in self.procs.items():
            out.setdefault(p.ppid, []).append(pid)
        return out

    def tree(
        self,
        ident: tuple[int, int],
        descendants: bool = True,
        children: dict[int, list[int]] | None = None,
    ) -> list[int]:
        if not self.alive(ident):
            return []
        kids = self.children_map()
        pids = [ident[0]]
        for pid in pids:
            pids += kids.get(pid, []) if descendants else []
        return pids

    def kill_pids(self, pids: list[int], sig: int = signal.SIGKILL) -> int:
        for pid in pids:
            self.exit(pid)
        self.killed += pids
        self.kill_seen.set()
        return len(pids)

    def tool_runs(self, tool: str, pids: set[int]) -> dict[int, int]:
        return {}

    # PID namespaces: every made-up process lives in slicerd's namespace (OWN_NS) unless
    # `enter` put it in another one, with its number there.
    OWN_NS = 1

    def enter(self, pid: int, ns: int, ns_pid: int) -> None:
        self.ns[pid] = (ns, ns_pid)

    def namespace_of(self, pid: int) -> int | None:
        if pid not in self.procs:
            return self.OWN_NS if pid == os.getpid() else None
        return self.ns.get(pid, (self.OWN_NS, pid))[0]

    def own_namespace(self) -> int | None:
        return self.OWN_NS

    def translate(self, ns_pid: int, ns: int) -> int | None:
        for pid, (n, number) in self.ns.items():
            if n == ns and number == ns_pid and pid in self.procs:
                return pid
        return None

    def nspid(self, pid: int) -> int | None:
        return self.ns.get(pid, (self.OWN_NS, pid))[1] if pid in self.procs else None

    def holding(self, pids: list[int], path: str) -> list[int]:
        return [p for p in pids if p in self.procs]


class FakeGpu:
    """Device memory per (gpu, pid); a dead process holds none (the driver freed it)."""

    def __init__(self, host: FakeHost, gpus: int = 1, total: int = 80 * GiB) -> None:
        self.host, self.total = host, total
        self.mem: dict[int, dict[int, int]] = {i: {} for i in range(gpus)}
        self.host_mem: dict[int, int] = {}  # pid -> bytes moved to host memory
        self.fail_reads = 0  # the next N reads of processes() raise

    def devices(self) -> list[Device]:
        return [Device(i, f"GPU-fake-{i}", self.total) for i in self.mem]

    def processes(self, index: int) -> dict[int, int]:
        if self.fail_reads:
            self.fail_reads -= 1
            raise RuntimeError("NVML: unknown error")
        return {p: b for p, b in self.mem[index].items() if self.host.start_time(p) is not None}

    def free_bytes(self, index: int) -> int:
        return self.total - sum(self.processes(index).values())

    def load(self, pid: int, nbytes: int, gpu: int = 0) -> None:
        self.mem[gpu][pid] = nbytes

    def resident(self, gpu: int = 0) -> set[int]:
        return set(self.processes(gpu))


@dataclass
class FakeParker:
    """cuda-checkpoint: park moves each pid's memory to host, restore brings it back.

    `park_outcome` / `restore_outcome` make the tool fail; `on_park` runs before a park
    answers (to make processes exit under the tool); `states` are `--get-state` answers."""

    gpu: FakeGpu
    path: str = "/usr/bin/cuda-checkpoint"
    has_action: bool = True
    kind: str = "cli"
    park_outcome: Outcome = field(default_factory=lambda: Outcome(True))
    restore_outcome: Outcome = field(default_factory=lambda: Outcome(True))
    on_park: Any = None
    states: dict[int, str] = field(default_factory=dict)
    parks: list[list[int]] = field(default_factory=list)
    restores: list[list[int]] = field(default_factory=list)
    actions: list[tuple[str, list[int]]] = field(default_factory=list)

    @dataclass
    class _Runner:
        running: int = 0

    runner: _Runner = field(default_factory=_Runner)

    async def probe(self, timeout: float = 30.0) -> str:
        return ""

    async def check(self, timeout: float = 10.0) -> str:
        return ""

    def changed(self) -> bool:
        return False

    async def park(self, pids: list[int], timeout: float) -> Outcome:
        self.parks.append(pids)
        await trio.sleep(0.5)  # the tool takes its time
        if self.on_park is not None:
            self.on_park(pids)
        if not self.park_outcome.ok:
            return self.park_outcome
        for pid in pids:
            for mem in self.gpu.mem.values():
                if pid in mem:
                    self.gpu.host_mem[pid] = mem.pop(pid)
        return Outcome(True)

    async def restore(self, pids: list[int], timeout: float) -> Outcome:
        self.restores.append(pids)
        await trio.sleep(0.5)
        if not self.restore_outcome.ok:
            return self.restore_outcome
        for pid in pids:
            if pid in self.gpu.host_mem:
                self.gpu.mem[0][pid] = self.gpu.host_mem.pop(pid)
        return Outcome(True)

    async def get_state(self, pid: int, timeout: float) -> str:
        return self.states.get(pid, "running")

    async def act(self, pids: list[int], action: str, timeout: float) -> Outcome:
        self.actions.append((action, pids))
        if action == "checkpoint":
            for pid in pids:
                if pid in self.gpu.mem[0]:
                    self.gpu.host_mem[pid] = self.gpu.mem[0].pop(pid)
        return Outcome(True)

    async def act_toggle(self, pids: list[int], timeout: float) -> Outcome:
        return await self.act(pids, "toggle", timeout)


class PairListener(trio.abc.Listener[trio.SocketStream]):
    """Hands the server the server ends of socketpairs made by `connect`."""

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[trio.SocketStream](math.inf)

    async def accept(self) -> trio.SocketStream:
        return await self._recv.receive()

    async def aclose(self) -> None:
        await self._recv.aclose()

    def connect(self) -> trio.SocketStream:
        a, b = trio.socket.socketpair()
        self._send.send_nowait(trio.SocketStream(b))
        return trio.SocketStream(a)


class Client:
    """Speaks the wire protocol line by line (what a client library would send)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = proto.LineBuffer(proto.MAX_SERVER_LINE)
        self._lines: list[bytes] = []

    async def send(self, line: str) -> None:
        await self.stream.send_all(line.encode() + b"\n")

    async def line(self) -> str:
        """The next line from the server (a reply, FAULT, WAITING, PARK or EVENT)."""
        while not self._lines:
            data = await self.stream.receive_some(65536)
            assert data, "the server closed the connection"
            self._lines += self._buf.feed(data)
        return self._lines.pop(0).decode()

    async def ask(self, line: str) -> str:
        await self.send(line)
        return await self.line()

    async def next_push(self, verb: str) -> str:
        """The next line starting with `verb` (skipping others)."""
        while not (got := await self.line()).startswith(verb):
            pass
        return got

    async def aclose(self) -> None:
        await self.stream.aclose()


class Watcher(Client):
    """A client that sent WATCH: reads EVENT lines."""

    async def event(self, kind: str, **match: Any) -> dict[str, Any]:
        """The next event of `kind` whose fields include `match`."""
        while True:
            line = await self.line()
            assert line.startswith("EVENT "), line
            body: dict[str, Any] = json.loads(line[len("EVENT ") :])
            if body["event"] == kind and all(body.get(k) == v for k, v in match.items()):
                return body


@dataclass
class Stack:
    server: Server
    sm: SlicerState
    host: FakeHost
    gpu: FakeGpu
    parker: FakeParker
    listener: PairListener
    clients: list[Client] = field(default_factory=list)

    def connect(self) -> Client:
        """A new connection (closed when the server stops)."""
        c = Client(self.listener.connect())
        self.clients.append(c)
        return c

    async def client(self) -> Client:
        c = self.connect()
        assert await c.ask("PING") == "OK"  # connected and admitted
        return c

    async def watcher(self) -> Watcher:
        """A WATCH connection: every state change as an event, in order."""
        c = Watcher(self.listener.connect())
        self.clients.append(c)
        assert await c.ask("WATCH") == "OK"
        return c

    async def until(self, pred: Any, every: float = 0.05) -> dict[str, Any]:
        """Poll STATUS (in virtual time) until `pred(status)`; the caller bounds it."""
        while not pred(st := await self.status()):
            await trio.sleep(every)
        return st

    async def status(self) -> dict[str, Any]:
        c = await self.client()
        line = await c.ask("STATUS")
        await c.aclose()
        reply = proto.parse_server_line(line.encode())
        assert isinstance(reply, proto.Ok) and reply.body is not None, line
        return dict(reply.body)

    async def workload(self, name: str) -> dict[str, Any]:
        """The one STATUS entry of workload `name`."""
        (w,) = [w for w in (await self.status())["workloads"] if w["name"] == name]
        return dict(w)


@asynccontextmanager
async def inproc_server(
    tmp: Path,
    limits: Limits | None = None,
    entries: list[dict[str, Any]] | None = None,
    prepare: Any = None,
    **cfg: Any,
) -> AsyncIterator[Stack]:
    """The server on one fake GPU, serving until the block ends; `prepare(stack)` runs
    before it starts (to set up processes and memory a journal names)."""
    host = FakeHost()
    gpu = FakeGpu(host)
    parker = FakeParker(gpu)
    sm = SlicerState([(d.index, d.uuid) for d in gpu.devices()], limits)
    config = Config(state_dir=str(tmp), journal_fsync=False, **cfg)
    server = Server(
        config,
        sm,
        gpu,
        parker,
        Journal(tmp, fsync=False),
        entries,
        host=host,
        clock=trio.current_time,
    )
    stack = Stack(server, sm, host, gpu, parker, PairListener())
    if prepare is not None:
        prepare(stack)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run, stack.listener)
        try:
            yield stack
        finally:
            for c in stack.clients:
                await c.aclose()
            nursery.cancel_scope.cancel()
