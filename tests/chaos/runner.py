"""The chaos runner: the whole stack as real processes, faults at seeded random moments,
invariants checked once everything was given a bounded time to settle.

Theory of operation
-------------------
One scenario = one fresh temporary directory (its path is unique to the run) holding:

- slicerd on a fake GPU (`stubs.stack.Stack`: READY=1 awaited, restarted with
  ``stack.stop(SIGKILL)`` / ``stack.start()``);
- "launcher": ``slicer-launch vllm --workload v`` running the vLLM stub on a fixed port;
- "dispatcher": ``slicer-dispatch --workload v`` with its state dir (optionally a small
  tmpfs mounted for the full-disk fault) and a short ``--sample-deadline``;
- "trainer": the trainer stub (``park=checkpoint``) taking turns forever;
- in this process: a publisher (a new revision every few seconds), sampling clients
  (durable ``POST /v1/samples``, pinned or not, and synchronous ``/v1/completions``).

Every unit is *supervised* the way systemd would: when its main process exits (on its own
or because a fault killed it), what is left of the unit is killed (the unit's processes
are found by the ``CHAOS_RUN``/``CHAOS_UNIT`` environment they all inherit, a stand-in
for the cgroup) and it is started again after ``RESTART_S`` with the same arguments
(the same workload name, port and state dir).

Faults (`FAULT_KINDS`) are drawn with ``random.Random(seed)``: which, when, how long.
After the fault window the runner waits for every accepted request to finish (bounded by
its deadline plus `SETTLE_S`), then checks the invariants (`Report.violations`):

- the fake GPU's overlap count is 0;
- every request the dispatcher acknowledged (202 with an id, or a 200 result) is done
  with exactly its revision (``weight_versions``) or failed with ``deadline exceeded``
  no earlier than its deadline; nothing acknowledged is unknown (404) or still pending;
- every refusal is a clear one (507 ``store_full`` on a full disk, 503 from the store,
  or the dispatcher being down); no 5xx other than those;
- STATUS answers; every GPU is free or held/resident by a workload whose process lives,
  and every process holding fake-GPU memory is alive and registered;
- after teardown (SIGTERM to every unit, slicerd last) no process of the run is left
  (its pid, its environment marker, or the run's directory in its command line).

Whatever happens to the run itself (an exception, a cancellation, its time limit), the
cleanup (`_reap`) ends every process of the run, bounded (SIGCONT, SIGTERM to each unit's
process group and to every marked process, SIGKILL after `TERM_S`), reaps every process
object it started (no ``Popen`` or ``trio.Process`` outlives the run, so none can warn
``ResourceWarning: subprocess ... is still running`` in a later test), unmounts the tmpfs
and removes the directory.

Disk budget: only the dispatcher's state dir is on the small tmpfs (when the mount
works); everything the runner itself writes (unit logs, revisions, the fake GPU, slicerd's
state) is in the run's directory on the ordinary temporary file system, so a full tmpfs
never touches the runner's bookkeeping. The disk-full fault fills that tmpfs, and nothing
else (it refuses to when the state dir is not a file system of its own), with unbuffered
writes: no buffered tail is left to fail at ``close()`` (the cause of an
``OSError(28, 'No space left on device')`` that used to end the run itself).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from stubs.fakegpu import Ledger
from stubs.proc import free_port, spawn
from stubs.proc import stop as stop_process
from stubs.proc import wait as wait_process
from stubs.stack import Stack

RESTART_S = 0.5  # systemd RestartSec
SETTLE_S = 30.0  # past the last deadline, for the last results to come in
STOP_S = 20.0  # a unit must end within this after SIGTERM
GPU_CHECK_S = 15.0  # the GPU invariant may be transiently false this long
RUN_LIMIT_S = 90.0  # a run's bound past its fault window and deadline (`run_scenario`)
# The cleanup (`_reap`), whatever happened: bounded by about the sum of these.
STRAY_S = 5.0  # after a clean teardown, for the last stragglers (cuda-checkpoint runs)
TERM_S = 5.0  # SIGTERM (after SIGCONT) to whatever is left, then SIGKILL
KILL_S = 5.0  # SIGKILL to gone (and reaped)
REAP_S = STRAY_S + TERM_S + KILL_S + 10.0  # the whole cleanup, with margin
FILL_CHUNK = 64 << 10

FAULT_KINDS = (
    "kill-slicerd",
    "kill-dispatcher",
    "kill-launcher",
    "kill-vllm",
    "kill-trainer",
    "stop-slicerd",
    "stop-dispatcher",
    "stop-launcher",
    "stop-vllm",
    "stop-trainer",
    "cc-fail",
    "cc-hang",
    "vllm-hang",
    "vllm-crash",
    "client-stall",
    "disk-full",
)


def fill_fs(path: Path) -> int:
    """Fill the file system holding `path` (created anew) to its last byte; bytes written.

    Unbuffered (``os.write``): a short write is simply counted, ENOSPC ends the filling
    (after smaller writes for the last bytes), and no buffered tail is left behind whose
    flush at ``close()`` would raise ENOSPC again. Any other error is raised."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    written = 0
    size = FILL_CHUNK
    chunk = b"\0" * size
    try:
        while size:
            try:
                n = os.write(fd, chunk[:size])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                size //= 2
                continue
            if n == 0:
                break
            written += n
    finally:
        os.close(fd)
    return written


def separate_fs(path: Path, other: Path) -> bool:
    """Whether `path` is on another file system than `other` (a mount of its own)."""
    return os.stat(path).st_dev != os.stat(other).st_dev


def describe(p: psutil.Process) -> str:
    """pid:unit:command of a process of the run (for orphans and notes)."""
    try:
        unit = p.environ().get("CHAOS_UNIT")
        return f"{p.pid}:{unit}:{' '.join(p.cmdline()[1:5])}"
    except psutil.Error:
        return f"{p.pid}:?"


@dataclass
class Fault:
    """One planned fault: its kind, when (s after the start) and its parameters."""

    kind: str
    at: float
    hold: float  # how long it lasts (a hang, a stall, a full disk, an injection window)
    detail: str = ""  # e.g. the cuda-checkpoint op

    def describe(self) -> str:
        extra = f" {self.detail}" if self.detail else ""
        return f"{self.kind}{extra} @{self.at:.1f}s/{self.hold:.1f}s"


@dataclass
class Scenario:
    """What one run does: faults drawn from `kinds` (all when empty) with `seed`."""

    name: str
    seed: int
    duration: float = 20.0  # the fault window (s)
    faults: int = 4  # how many faults
    kinds: tuple[str, ...] = ()
    deadline: float = 60.0  # the dispatcher's --sample-deadline
    must: tuple[str, ...] = ()  # kinds that are always included (one each)

    def plan(self) -> list[Fault]:
        """The faults, drawn from ``random.Random(seed)`` (same seed, same plan)."""
        rng = random.Random(self.seed)
        kinds = list(self.kinds or FAULT_KINDS)
        chosen = list(self.must) + [
            rng.choice(kinds) for _ in range(max(0, self.faults - len(self.must)))
        ]
        plan = []
        for kind in chosen:
            at = rng.uniform(1.0, max(1.5, self.duration - 4.0))
            hold = rng.uniform(1.0, 3.0)
            detail = ""
            if kind in ("cc-fail", "cc-hang"):
                detail = rng.choice(("lock", "checkpoint", "restore", "unlock"))
                hold = rng.uniform(4.0, 8.0)
            elif kind == "client-stall":
                hold = rng.uniform(5.0, 14.0)
            elif kind == "vllm-hang":
                hold = rng.uniform(2.0, 6.0)
            elif kind == "disk-full":
                hold = rng.uniform(3.0, 6.0)
            plan.append(Fault(kind, at, hold, detail))
        return sorted(plan, key=lambda f: f.at)


@dataclass
class Sent:
    """One acknowledged request: its id, the revision it must come from, when."""

    id: str
    revision: str
    accepted: float  # wall clock, just before the request was sent
    sync_result: dict[str, Any] | None = None  # a synchronous call's 200 body
    outcome: str = "pending"  # "done" | "failed" | "pending" | "lost"


@dataclass
class Report:
    """What one scenario saw."""

    scenario: str
    seed: int
    plan: list[str] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    completed: int = 0
    failed: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    overlaps: int = 0
    orphans: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exits: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0

    def violate(self, text: str) -> None:
        self.violations.append(text)

    def text(self) -> str:
        """Everything, for a failed assertion or the soak's log."""
        lines = [
            f"scenario {self.scenario} seed {self.seed} ({self.seconds:.0f} s)",
            f"  plan: {', '.join(self.plan)}",
            f"  injected: {dict(self.injected)} skipped: {dict(self.skipped)}",
            f"  requests: accepted {self.accepted} completed {self.completed} "
            f"failed {self.failed} refused {dict(self.refused)}",
            f"  unit exits: {self.exits}",
            f"  overlaps {self.overlaps} orphans {self.orphans}",
            *[f"  note: {n}" for n in self.notes],
            *[f"  VIOLATION: {v}" for v in self.violations],
        ]
        return "\n".join(lines)


@dataclass
class Unit:
    """A supervised component (one main process, restarted as systemd would)."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    exits: list[int] = field(default_factory=list)
    starts: int = 0
    kill_rest: bool = True  # KillMode=control-group/mixed: the rest dies with the unit


class Run:
    """One scenario's stack, clients and faults (see the module docstring)."""

    def __init__(self, scenario: Scenario, stack: Stack, report: Report) -> None:
        self.sc = scenario
        self.stack = stack
        self.base = stack.base
        self.report = report
        self.run_id = stack.env["CHAOS_RUN"]
        self.rng = random.Random(scenario.seed * 7919 + 1)  # the clients' own stream
        self.vport = free_port()
        self.dport = free_port()
        self.vurl = f"http://127.0.0.1:{self.vport}"
        self.durl = f"http://127.0.0.1:{self.dport}"
        self.dstate = self.base / "dstate"
        self.dstate.mkdir()
        self.tmpfs = False
        self.units: dict[str, Unit] = {}
        self.popens: list[subprocess.Popen[bytes]] = []  # every unit process ever started
        self.sent: dict[str, Sent] = {}
        self.revisions: list[str] = []
        self.stopping = False
        self.faults_over = False
        self.disk_full = False
        self.slicerd_busy = trio.Lock()  # a slicerd restart in progress
        self.slicerd_disturbed = 0  # stop-slicerd faults in progress

    # -- units -----------------------------------------------------------------------

    def env(self, unit: str) -> dict[str, str]:
        return {**self.stack.env, "CHAOS_UNIT": unit}

    def define_units(self) -> None:
        py = sys.executable
        sock = self.stack.socket
        launcher = [
            py,
            "-m",
            "gpu_slicer.launcher.main",
            "vllm",
            "--workload",
            "v",
            "--socket",
            sock,
        ]
        launcher += ["--park", "cooperative", "--ready-file", str(self.base / "ready")]
        launcher += ["--boot-timeout", "60", "--health-timeout", "60", "--kill-grace", "3"]
        launcher += ["--", py, "-m", "stubs.vllm_stub", "serve", "m", "--port", str(self.vport)]
        launcher += ["--fake-workload", "v", "--tokens-per-s", "20000"]
        dispatcher = [
            py,
            "-m",
            "gpu_slicer.dispatcher.main",
            "--workload",
            "v",
            "--replica",
            self.vurl,
        ]
        dispatcher += ["--socket", sock, "--state-dir", str(self.dstate)]
        dispatcher += ["--listen", f"127.0.0.1:{self.dport}", "--turn-seconds", "0.5"]
        dispatcher += ["--turn-grace", "1", "--concurrency", "8"]
        dispatcher += ["--sample-deadline", f"{self.sc.deadline:g}"]
        trainer = [py, "-m", "stubs.trainer_stub", "--workload", "trainer", "--socket", sock]
        trainer += ["--bytes", "30GiB", "--work", "0.3", "--pause", "0.4", "--steps", "1000000"]
        for name, argv in (("launcher", launcher), ("dispatcher", dispatcher),
                           ("trainer", trainer)):  # fmt: skip
            self.units[name] = Unit(name, argv, self.base / f"{name}.log")

    def start_unit(self, u: Unit) -> None:
        """Start `u`'s main process in a session (process group) of its own."""
        if self.stopping:
            return
        with open(u.log, "ab") as f:
            f.write(f"---- chaos: start #{u.starts + 1} ----\n".encode())
        u.proc = spawn(u.argv, self.env(u.name), u.log)
        self.popens.append(u.proc)
        u.starts += 1

    def unit_procs(self, unit: str | None = None) -> list[psutil.Process]:
        """Live processes of this run (of `unit`), found by their inherited environment
        or, for the run as a whole, the run's directory in their command line."""
        out = []
        me = os.getpid()
        for p in psutil.process_iter():
            if p.pid == me:
                continue
            try:
                env = p.environ()
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                ours = env.get("CHAOS_RUN") == self.run_id
                if unit is not None:
                    if ours and env.get("CHAOS_UNIT") == unit:
                        out.append(p)
                elif ours or any(str(self.base) in a for a in p.cmdline()):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def kill_unit_rest(self, unit: str) -> list[str]:
        """SIGKILL what is left of a unit whose main process ended; their descriptions."""
        left = []
        for p in self.unit_procs(unit):
            with contextlib.suppress(psutil.NoSuchProcess):
                left.append(f"{p.pid}:{' '.join(p.cmdline()[1:4])}")
                p.kill()
        return left

    def signal_all(self, sig: int) -> None:
        """`sig` to every process of the run: each unit's process group (while its leader
        is not reaped, so the group id cannot have been reused), slicerd, and every
        process carrying the run's marker (the launcher's vLLM runs in a session of its
        own, slicerd's cuda-checkpoint runs in slicerd's)."""
        for p in self.popens:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
        if self.stack.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.stack.proc.send_signal(sig)  # polls first: never a reused pid
        for q in self.unit_procs():
            with contextlib.suppress(psutil.NoSuchProcess):
                q.send_signal(sig)

    def alive(self) -> list[str]:
        """What of the run still runs (reaping the processes we started that ended)."""
        left = [describe(q) for q in self.unit_procs()]
        left += [f"{p.pid}:main" for p in self.popens if p.poll() is None]
        if self.stack.proc is not None and self.stack.proc.poll() is None:
            left.append(f"{self.stack.proc.pid}:slicerd")
        return left

    async def end_all(self) -> list[str]:
        """End every process of the run, bounded: SIGCONT (a stopped process cannot act
        on SIGTERM) and SIGTERM, after `TERM_S` SIGKILL, then up to `KILL_S` until none is
        left. What is still there after that (empty: nothing)."""
        for sig in (signal.SIGCONT, signal.SIGTERM):
            self.signal_all(sig)
        with trio.move_on_after(TERM_S):
            while self.alive():
                await trio.sleep(0.1)
        if not self.alive():
            return []
        self.signal_all(signal.SIGKILL)
        with trio.move_on_after(KILL_S):
            while self.alive():
                await trio.sleep(0.1)
        return self.alive()

    async def supervise(self, u: Unit) -> None:
        """Start `u`; whenever its main process ends, clean the unit up and restart it."""
        self.start_unit(u)
        while True:
            assert u.proc is not None
            rc = await wait_process(u.proc)
            if self.stopping:
                return
            u.exits.append(rc)
            left = self.kill_unit_rest(u.name) if u.kill_rest else []
            if left:
                self.report.notes.append(f"{u.name} exited {rc}, leaving {left}")
            await trio.sleep(RESTART_S)
            if self.stopping:
                return
            self.start_unit(u)

    async def supervise_slicerd(self) -> None:
        """slicerd must not exit on its own; if it does, that is a violation (restarted)."""
        while not self.stopping:
            await trio.sleep(0.2)
            async with self.slicerd_busy:
                proc = self.stack.proc
                if proc is None or proc.poll() is None or self.stopping:
                    continue
                self.report.violate(f"slicerd exited on its own with {proc.returncode}")
                self.stack.proc = None
                await self.stack.start()

    # -- clients ---------------------------------------------------------------------

    async def publish(self, http: httpx.AsyncClient, k: int) -> bool:
        rev = f"r{k}"
        path = self.base / "ckpt" / rev
        path.mkdir(parents=True, exist_ok=True)
        (path / "revision.txt").write_text(rev)
        try:
            r = await http.post("/v1/revisions", json={"revision": rev, "path": str(path)})
        except httpx.HTTPError:
            return False
        if r.status_code in (200, 201):
            if rev not in self.revisions:
                self.revisions.append(rev)
            return True
        self.check_refusal("publish", r)
        return False

    def check_refusal(self, what: str, r: httpx.Response) -> None:
        """A refusal must be clear: 507 store_full (full disk) or 503 (store failed)."""
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            self.report.violate(f"{what}: HTTP {r.status_code} without an error body: {r.text!r}")
            return
        code = err.get("code")
        if r.status_code == 507 and code == "store_full" and "full" in err.get("message", ""):
            self.report.refused["507"] += 1
            if not self.disk_full:
                self.report.notes.append(f"{what}: 507 outside a disk-full fault: {err}")
            return
        if r.status_code == 503 and code == "store_error":
            self.report.refused["503"] += 1
            return
        self.report.violate(f"{what}: HTTP {r.status_code} {err}")

    async def publisher(self, http: httpx.AsyncClient) -> None:
        k = 1
        while not self.faults_over:
            if await self.publish(http, k):
                k += 1
            await trio.sleep(self.rng.uniform(2.0, 5.0))

    def body(self, big: bool = False) -> tuple[dict[str, Any], str | None]:
        """A request body; the revision it pins (None: the newest at acceptance)."""
        n = len(self.report.plan) + len(self.sent)
        body: dict[str, Any] = {"prompt": f"chaos {n}", "max_tokens": 4}
        if big:
            body["prompt"] = [self.rng.randrange(1000) for _ in range(4000)]
        pinned = None
        if self.revisions and self.rng.random() < 0.4:
            pinned = self.rng.choice(self.revisions)
            if self.rng.random() < 0.5:
                body["revision"] = pinned
            else:
                body["model"] = f"m@{pinned}"
        return body, pinned

    async def submit(self, http: httpx.AsyncClient, big: bool = False) -> None:
        body, pinned = self.body(big)
        t = time.time()
        try:
            r = await http.post("/v1/samples", json=body)
        except httpx.HTTPError:
            self.report.refused["unreachable"] += 1
            return
        if r.status_code == 202:
            got = r.json()
            if pinned is not None and got["revision"] != pinned:
                self.report.violate(f"asked for {pinned}, acknowledged as {got['revision']}")
            self.sent[got["id"]] = Sent(got["id"], got["revision"], t)
            self.report.accepted += 1
        elif r.status_code == 404 and not self.revisions:
            self.report.refused["no-revision"] += 1
        else:
            self.check_refusal("POST /v1/samples", r)

    async def sync_call(self, http: httpx.AsyncClient) -> None:
        body, pinned = self.body()
        t = time.time()
        try:
            r = await http.post("/v1/completions", json=body, timeout=self.sc.deadline + 30)
        except httpx.HTTPError:
            self.report.refused["sync-unreachable"] += 1  # not acknowledged: no id known
            return
        sid = r.headers.get("x-sample-id")
        if r.status_code == 200 and sid:
            res = r.json()
            rev = pinned or next(iter(_versions(res)), "?")
            self.sent[sid] = Sent(sid, rev, t, sync_result=res)
            self.report.accepted += 1
        elif r.status_code == 504:
            err = r.json()["error"]
            if err.get("code") != "deadline_exceeded":
                self.report.violate(f"sync 504 without deadline_exceeded: {err}")
            elif time.time() < t + self.sc.deadline - 1:
                self.report.violate(f"sync call failed before its deadline: {err}")
            self.report.accepted += 1
            self.report.failed += 1
        elif r.status_code == 404 and not self.revisions:
            self.report.refused["no-revision"] += 1
        else:
            self.check_refusal("POST /v1/completions", r)

    async def clients(self, http: httpx.AsyncClient) -> None:
        async with trio.open_nursery() as n:
            while not self.faults_over:
                if self.rng.random() < 0.15:
                    n.start_soon(self.sync_call, http)
                else:
                    n.start_soon(self.submit, http)
                await trio.sleep(self.rng.uniform(0.1, 0.5))

    # -- faults ----------------------------------------------------------------------

    def main_pid(self, kind: str) -> int | None:
        """The pid a kill/stop fault targets."""
        comp = kind.split("-", 1)[1]
        if comp == "slicerd":
            return self.stack.proc.pid if self.stack.proc else None
        if comp == "vllm":
            lw = self.units["launcher"].proc
            if lw is None or lw.poll() is not None:
                return None
            with contextlib.suppress(psutil.NoSuchProcess):
                for c in psutil.Process(lw.pid).children():
                    if "stubs.vllm_stub" in c.cmdline():
                        return c.pid
            return None
        p = self.units[comp].proc
        return p.pid if p is not None and p.poll() is None else None

    async def inject(self, f: Fault) -> None:
        await trio.sleep(f.at)
        if self.stopping:
            return
        done = await self._inject(f)
        (self.report.injected if done else self.report.skipped)[f.kind] += 1

    async def _inject(self, f: Fault) -> bool:
        kind = f.kind
        if kind == "kill-slicerd":
            async with self.slicerd_busy:
                if self.stack.proc is None:
                    return False
                await self.stack.stop(signal.SIGKILL)
                await trio.sleep(f.hold / 3)
                await self.stack.start()
            return True
        if kind.startswith("kill-"):
            pid = self.main_pid(kind)
            if pid is None:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return True  # the supervisor restarts it
        if kind.startswith("stop-"):
            pid = self.main_pid(kind)
            if pid is None:
                return False
            slicerd = kind == "stop-slicerd"
            self.slicerd_disturbed += slicerd
            try:
                os.kill(pid, signal.SIGSTOP)
                await trio.sleep(f.hold)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                await trio.sleep(1.0 if slicerd else 0)
                self.slicerd_disturbed -= slicerd
            return True
        if kind in ("cc-fail", "cc-hang"):
            tp = self.units["trainer"].proc
            if tp is None or tp.poll() is not None:
                return False
            pid = tp.pid
            try:
                self.stack.ledger.inject(pid, f.detail, hang=kind == "cc-hang")
            except Exception as e:  # a pid that just died
                self.report.notes.append(f"{kind}: inject failed: {e}")
                return False
            with trio.move_on_after(f.hold):
                while tp.poll() is None:
                    await trio.sleep(0.1)
            with contextlib.suppress(Exception):
                self.stack.ledger.clear_injection(pid)
            return True
        if kind in ("vllm-hang", "vllm-crash"):
            body = {"crash": True} if kind == "vllm-crash" else {"hang_requests": True}
            try:
                async with httpx.AsyncClient(base_url=self.vurl, timeout=5) as v:
                    await v.post("/_stub/fault", json=body)
                    if kind == "vllm-hang":
                        await trio.sleep(f.hold)
                        with contextlib.suppress(httpx.HTTPError):
                            await v.post("/_stub/fault", json={"hang_requests": False})
            except httpx.HTTPError:
                return False
            return True
        if kind == "client-stall":
            return await self.stall(f.hold)
        if kind == "disk-full":
            return await self.fill_disk(f.hold)
        raise AssertionError(kind)

    async def stall(self, hold: float) -> bool:
        """A slicerd client that never reads: 40 pipelined STATUS (more replies than a
        socket buffer holds), then WATCH. slicerd must keep answering everyone else (it
        drops the stalled one after its write timeout)."""
        s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with s:
            try:
                await s.connect(self.stack.socket)
                await s.send(b"STATUS\n" * 40 + b"WATCH\n")
            except OSError:
                return False
            end = trio.current_time() + hold
            while trio.current_time() < end:
                await trio.sleep(1.0)
                if self.slicerd_disturbed or self.slicerd_busy.locked():
                    continue  # a stop/kill fault of slicerd: no answer expected
                t0 = trio.current_time()
                try:
                    with trio.fail_after(10):
                        await self.stack.status()
                except (Exception, trio.TooSlowError) as e:
                    if not (self.slicerd_disturbed or self.slicerd_busy.locked()):
                        self.report.violate(f"STATUS failed while a client stalls: {e!r}")
                    continue
                if trio.current_time() - t0 > 5 and not self.slicerd_disturbed:
                    self.report.notes.append(
                        f"STATUS took {trio.current_time() - t0:.1f} s while a client stalls"
                    )
        return True

    async def fill_disk(self, hold: float) -> bool:
        """Fill the dispatcher's tmpfs; send big requests meanwhile; then free it."""
        if not self.tmpfs:
            return False
        if not separate_fs(self.dstate, self.base):
            self.report.notes.append(f"disk-full: {self.dstate} is no file system of its own")
            return False
        filler = self.dstate / "filler"
        self.disk_full = True
        try:
            try:
                await trio.to_thread.run_sync(fill_fs, filler)
            except OSError as e:  # not ENOSPC: a fault that could not be made
                self.report.notes.append(f"disk-full: filling {filler} failed: {e!r}")
                return False
            # Requests that do not fit must be refused with a clear 507, the others kept.
            async with httpx.AsyncClient(base_url=self.durl, timeout=30) as http:
                end = trio.current_time() + hold
                while trio.current_time() < end:
                    before = self.report.refused["507"]
                    await self.submit(http, big=True)
                    await trio.sleep(0.05 if self.report.refused["507"] == before else 0.3)
        finally:
            try:
                filler.unlink(missing_ok=True)
            except OSError as e:
                self.report.notes.append(f"disk-full: removing {filler} failed: {e!r}")
            self.disk_full = False
        return True

    # -- settling and checks ---------------------------------------------------------

    async def dispatcher_up(self, http: httpx.AsyncClient, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/status", timeout=5)).status_code == 200:
                        return True
                await trio.sleep(0.3)
        return False

    async def settle(self, http: httpx.AsyncClient) -> None:
        """Wait (bounded) until every acknowledged request is finished; check each."""
        if not await self.dispatcher_up(http, 60):
            self.report.violate("the dispatcher's /status did not answer within 60 s")
        for s in list(self.sent.values()):
            if s.sync_result is not None:
                got = _versions(s.sync_result)
                if got != {s.revision}:
                    self.report.violate(f"{s.id}: sync result from {got}, wanted {s.revision}")
                s.outcome = "done"
                self.report.completed += 1
                continue
            limit = s.accepted + self.sc.deadline + SETTLE_S
            body = None
            while time.time() < limit:
                wait = max(0.0, min(10.0, limit - time.time()))
                try:
                    r = await http.get(f"/v1/samples/{s.id}", params={"wait": f"{wait:.1f}"},
                                       timeout=wait + 15)  # fmt: skip
                except httpx.HTTPError:
                    await trio.sleep(0.5)
                    continue
                if r.status_code == 404:
                    s.outcome = "lost"
                    break
                if r.status_code != 200:
                    await trio.sleep(0.5)
                    continue
                body = r.json()
                if body["status"] != "pending":
                    s.outcome = body["status"]
                    break
            self.check_outcome(s, body)

    def check_outcome(self, s: Sent, body: dict[str, Any] | None) -> None:
        if s.outcome == "lost":
            self.report.violate(f"{s.id} (revision {s.revision}) was acknowledged, now unknown")
        elif s.outcome == "pending":
            self.report.violate(
                f"{s.id} (revision {s.revision}) still pending "
                f"{time.time() - s.accepted:.0f} s after acceptance (deadline {self.sc.deadline:g})"
            )
        elif s.outcome == "done":
            assert body is not None
            self.report.completed += 1
            got = _versions(body["result"])
            if body["revision"] != s.revision or got != {s.revision}:
                self.report.violate(
                    f"{s.id}: result from {got} (row {body['revision']}), wanted {s.revision}"
                )
        else:
            assert body is not None
            self.report.failed += 1
            err = str(body.get("error"))
            if not err.startswith("deadline exceeded: pool v revision"):
                self.report.violate(f"{s.id} failed without a deadline error: {err}")
            elif time.time() < s.accepted + self.sc.deadline - 1:
                self.report.violate(f"{s.id} failed before its deadline: {err}")

    async def check_gpu(self) -> None:
        """STATUS answers; every GPU free or held by a live workload (bounded retries)."""
        problems: list[str] = ["STATUS never answered"]
        with trio.move_on_after(GPU_CHECK_S):
            while True:
                try:
                    with trio.fail_after(10):
                        st = await self.stack.status()
                except (Exception, trio.TooSlowError) as e:
                    problems = [f"STATUS failed: {e!r}"]
                else:
                    problems = gpu_problems(st, self.stack.ledger)
                    if not problems:
                        return
                await trio.sleep(0.5)
        for p in problems:
            self.report.violate(p)

    async def teardown(self) -> None:
        """SIGTERM every unit (dispatcher, trainer, launcher), then slicerd; record codes."""
        self.stopping = True
        for name in ("dispatcher", "trainer", "launcher"):
            u = self.units.get(name)
            if u is None or u.proc is None:
                continue
            if u.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(u.proc.pid, signal.SIGCONT)
                # SIGKILL after STOP_S: an exit by SIGKILL is ours (nothing else kills now)
                if await stop_process(u.proc, STOP_S) == -signal.SIGKILL:
                    self.report.violate(f"{name} did not stop within {STOP_S:g} s of SIGTERM")
                u.exits.append(u.proc.returncode)
                if name == "dispatcher" and u.proc.returncode != 0:
                    self.report.violate(f"dispatcher exited {u.proc.returncode} on SIGTERM")
        async with self.slicerd_busy:
            if self.stack.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.stack.proc.send_signal(signal.SIGCONT)
                rc = await self.stack.stop(signal.SIGTERM, grace=15)
                if rc == -signal.SIGKILL:  # the stop's SIGKILL after the grace
                    self.report.violate("slicerd did not stop within 15 s of SIGTERM")
                elif rc != 0:
                    self.report.notes.append(f"slicerd exited {rc} on SIGTERM")
        for name, u in self.units.items():
            self.report.exits[name] = u.exits


def _versions(result: dict[str, Any]) -> set[str]:
    """Every weight version named by any span of any choice."""
    return {s["version"] for c in result.get("choices", []) for s in c["weight_versions"]}


def gpu_problems(st: dict[str, Any], ledger: Ledger) -> list[str]:
    """Why the GPUs are not each free or held by a live workload (empty: they are)."""
    problems = []
    by_name = {w["name"]: w for w in st["workloads"]}
    live_pids: set[int] = set()
    for w in st["workloads"]:
        live_pids.update(w.get("pids") or [w["pid"]])
    for g in st["gpus"]:
        holder = (g.get("holder") or {}).get("workload")
        for role, name in (("resident", g.get("resident")), ("holder", holder)):
            if name is None:
                continue
            w = by_name.get(name)
            pids = (w.get("pids") or [w["pid"]]) if w else []
            if not any(psutil.pid_exists(p) for p in pids):
                problems.append(f"gpu {g['index']}: {role} {name} has no live process")
        if g.get("foreign"):
            problems.append(f"gpu {g['index']}: foreign processes {g['foreign']}")
    for m in ledger.processes():
        if m.on_device and m.pid not in live_pids:
            problems.append(
                f"pid {m.pid} ({m.workload}) holds {m.on_device} B of gpu {m.gpu} "
                f"and belongs to no registered workload"
            )
    return problems


async def wait_ready(run: Run, timeout: float = 90) -> None:
    """Until the replica is booted (ready marker) and the dispatcher listens."""
    with trio.fail_after(timeout):
        while not (run.base / "ready").exists():
            await trio.sleep(0.2)
        async with httpx.AsyncClient(base_url=run.durl) as http:
            while not await run.dispatcher_up(http, 1):
                pass


def _mount_tmpfs(path: Path, size: str) -> bool:
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
        timeout=30,
    )
    return r.returncode == 0


def _unmount(path: Path) -> str | None:
    """Unmount the tmpfs at `path` (lazily: nothing of the run holds it any more); why
    not, or None."""
    try:
        r = subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False,
                           timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return repr(e)
    if r.returncode != 0 and os.path.ismount(path):
        return r.stderr.decode(errors="replace").strip()
    return None


async def run_scenario(
    sc: Scenario, log: Callable[[str], None] = print, limit: float | None = None
) -> Report:
    """Run `sc` from a fresh directory to a checked teardown; its report.

    The run is bounded by `limit` (default: its fault window + deadline + `RUN_LIMIT_S`).
    An error of the run itself, or the limit, is a violation; either way every process of
    the run is ended and reaped (`_reap`, bounded by about `REAP_S`) before the report is
    logged and returned. A cancellation from outside is raised after the same cleanup."""
    if limit is None:
        limit = sc.duration + sc.deadline + RUN_LIMIT_S
    t0 = time.monotonic()
    report = Report(sc.name, sc.seed)
    plan = sc.plan()
    report.plan = [f.describe() for f in plan]
    base = Path(tempfile.mkdtemp(prefix=f"slicer-chaos-{sc.seed}-"))
    os.chmod(base, 0o755)
    run_id = base.name
    env = {"FAKEGPU_HANG_MAX": "30", "CHAOS_RUN": run_id, "CHAOS_UNIT": "slicerd"}
    flags = ["--park-timeout", "8", "--restore-timeout", "8", "--fault-kill-after", "3"]
    stack = Stack.create(base, *flags, gpus=1, capacity="80GiB", env=env)
    run = Run(sc, stack, report)
    clean = False
    try:
        with trio.move_on_after(limit) as scope:
            await _drive(run, plan)
            clean = True
        if scope.cancelled_caught:
            report.violate(f"the run did not end within its limit of {limit:g} s")
    except Exception as e:
        report.violate(f"the run itself failed: {e!r}")
        report.notes.append("".join(traceback.format_exception(e))[-4000:])
    except BaseException as e:
        report.violate(f"the run was interrupted: {e!r}")
        raise
    finally:
        with trio.CancelScope(shield=True):
            await _reap(run, report, clean)
        report.seconds = time.monotonic() - t0
        log(report.text())
    return report


async def _drive(run: Run, plan: list[Fault]) -> None:
    """The run proper: the stack, clients and faults, settling, checks, teardown."""
    sc, stack, report = run.sc, run.stack, run.report
    if "disk-full" in {f.kind for f in plan}:
        # Far more than SQLite's WAL grows to by itself (1000 pages, ~4 MiB, before a
        # checkpoint): only the fault's filler may fill it.
        run.tmpfs = _mount_tmpfs(run.dstate, "64m")
        if not run.tmpfs:
            report.notes.append("no tmpfs (mount failed): disk-full faults skipped")
    run.define_units()
    await stack.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run.supervise_slicerd)
        for u in run.units.values():
            nursery.start_soon(run.supervise, u)
        await wait_ready(run)
        async with httpx.AsyncClient(base_url=run.durl, timeout=30) as http:
            await run.publish(http, 0)
            async with trio.open_nursery() as faults:
                faults.start_soon(run.publisher, http)
                faults.start_soon(run.clients, http)
                for f in plan:
                    faults.start_soon(run.inject, f)
                await trio.sleep(sc.duration)
                run.faults_over = True
            # every fault is over; everything gets a bounded time to settle
            await run.settle(http)
            await run.check_gpu()
        report.overlaps = stack.overlaps()
        if report.overlaps:
            report.violate(f"{report.overlaps} overlaps: {stack.ledger.overlap_log()}")
        await run.teardown()
        nursery.cancel_scope.cancel()


async def _reap(run: Run, report: Report, clean: bool) -> None:
    """No process of the run outlives it, whatever happened (bounded, about `REAP_S`).

    After a `clean` teardown the run's processes get `STRAY_S` to finish (cuda-checkpoint
    runs); whatever is left then is an orphan (a violation). After a failed or cut-short
    run nothing was torn down: everything is simply ended. Either way `Run.end_all`
    (SIGCONT, SIGTERM, SIGKILL, bounded), then every process object we started is reaped,
    the tmpfs unmounted, a failed run's logs kept and the directory removed."""
    run.stopping = True
    try:
        if clean:
            with trio.move_on_after(STRAY_S):
                while run.unit_procs():
                    await trio.sleep(0.2)
            report.orphans = [describe(p) for p in run.unit_procs()]
            if report.orphans:
                report.violate(f"orphan processes after teardown: {report.orphans}")
        else:
            left = [describe(p) for p in run.unit_procs()]
            if left:
                report.notes.append(f"ended after the failed run: {left}")
        survivors = await run.end_all()
        if survivors:
            report.violate(f"processes that survived SIGKILL for {KILL_S:g} s: {survivors}")
    finally:
        _reap_objects(run, report)
        if run.stack.proc is not None:
            with trio.move_on_after(KILL_S):
                await wait_process(run.stack.proc)
            if run.stack.proc.poll() is None:
                report.violate(f"slicerd {run.stack.proc.pid} was not reaped")
            else:
                run.stack.proc = None
        if run.tmpfs and (why := _unmount(run.dstate)):
            report.notes.append(f"umount {run.dstate}: {why}")
        for name, u in run.units.items():
            report.exits.setdefault(name, u.exits)
        if report.violations:
            _keep_logs(run, report)
        shutil.rmtree(run.base, ignore_errors=True)


def _reap_objects(run: Run, report: Report) -> None:
    """SIGKILL (when still running) and wait for every process object we started."""
    for p in run.popens:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            try:
                p.wait(timeout=KILL_S)
            except subprocess.TimeoutExpired:
                report.violate(f"{p.pid} {p.args!r} was not reaped")
    if run.stack.proc is not None and run.stack.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            run.stack.proc.kill()


def _keep_logs(run: Run, report: Report) -> None:
    """Copy the run's logs to a fixed place (best effort: the cleanup goes on)."""
    keep = Path(tempfile.gettempdir()) / f"chaos-logs-{report.scenario}-{report.seed}"
    try:
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir()
        for log in run.base.glob("*.log"):
            shutil.copy(log, keep / log.name)
    except OSError as e:
        report.notes.append(f"keeping the logs in {keep} failed: {e!r}")
    else:
        report.notes.append(f"logs kept in {keep}")


def summary_table(reports: list[Report]) -> str:
    """One line per scenario (for the soak)."""
    head = ("scenario", "seed", "faults injected (skipped)", "acc", "done", "fail", "refused",
            "ovl", "orph", "viol", "s")  # fmt: skip
    rows = [head]
    for r in reports:
        inj = " ".join(f"{k}={v}" for k, v in sorted(r.injected.items())) or "-"
        if r.skipped:
            inj += " (" + " ".join(f"{k}={v}" for k, v in sorted(r.skipped.items())) + ")"
        ref = " ".join(f"{k}={v}" for k, v in sorted(r.refused.items())) or "-"
        rows.append((r.scenario, str(r.seed), inj, str(r.accepted), str(r.completed),
                     str(r.failed), ref, str(r.overlaps), str(len(r.orphans)),
                     str(len(r.violations)), f"{r.seconds:.0f}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = Counter[str]()
    for r in reports:
        total.update(r.injected)
    lines.append("")
    lines.append(
        f"{len(reports)} scenarios, faults {sum(total.values())} "
        f"({', '.join(f'{k}={v}' for k, v in sorted(total.items()))}), "
        f"requests accepted {sum(r.accepted for r in reports)} "
        f"completed {sum(r.completed for r in reports)} failed {sum(r.failed for r in reports)}, "
        f"overlaps {sum(r.overlaps for r in reports)}, "
        f"orphans {sum(len(r.orphans) for r in reports)}, "
        f"violations {sum(len(r.violations) for r in reports)}"
    )
    return "\n".join(lines)


def jsonable(r: Report) -> dict[str, Any]:
    """A report as JSON (the soak writes one line per scenario)."""
    out: dict[str, Any] = json.loads(json.dumps(r.__dict__, default=str))
    return out
