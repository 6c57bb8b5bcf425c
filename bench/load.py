"""Load benchmark for slicerd on a fake GPU: many connections, many workloads, many turns.

    .venv/bin/python bench/load.py [--connections 1000] [--workloads 200] [--gpus 8]
                                   [--cycles 100000] [--seed 1] [--json]

Starts its own slicerd (fake GPU backend, a fresh ledger of `--gpus` GPUs in a temp dir, a
`--config` TOML whose limits admit every connection, READY=1 awaited on a NOTIFY_SOCKET),
stops it with SIGTERM at the end and removes the temp dir; nothing is left running.

1. `--workloads` workloads (park=cooperative, so a park is verify-only; tree=0; each the
   pid of a sleeper child of its own: a process belongs to at most one workload) are
   registered round-robin over the GPUs, one registrant connection each.
2. A WATCH connection in its own process records every event to a file.
3. `--connections` client connections (raw trio streams) each repeat ACQUIRE of a random
   workload (the plan is seeded) -> RELEASE until `--cycles` cycles are done in all.
4. Checks (any violation: exit 1):
   - no lost grant: every ACQUIRE gets its OK within `--grant-timeout` (a watchdog);
     every cycle completes; no ERR, FAULT or dropped connection;
   - no duplicated grant: turn ids are unique; a client that gets a grant while another
     of our connections still believes it holds that GPU (between its grant and its
     RELEASE, a scheduler pass or `--hold-ms`) is a violation; in the daemon's event
     stream, each GPU's `granted` and `released` events alternate with matching turns;
   - FIFO per GPU: the `queued` events of each GPU are replayed as a queue (their
     `position` must be its length); every `granted` event must take the head, by
     workload, and the connection that received that turn must have sent its ACQUIRE
     no later than the head was queued (clocks: both CLOCK_MONOTONIC); the turns, GPUs
     and workloads of the events equal the clients' grants one for one;
   - bounded memory: the daemon's RSS is sampled (psutil) throughout; its growth from 10%
     of the cycles to the end must stay under `--rss-growth-limit-mib`;
   - no fd leak: the daemon's num_fds after every connection closed must be within
     `--fd-slack` of its count before any connection;
   - the daemon exits 0 on SIGTERM and logs no traceback.

Reports cycles/s, grant latency (ACQUIRE sent -> OK received, queueing included)
p50/p99/max, RSS and fds (start/peak/end), and every violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make proto/slicer/stubs importable
    sys.path.insert(0, str(ROOT))

from bench.script import run_script  # noqa: E402
from gpu_slicer.slicer.client import AsyncSlicer  # noqa: E402
from stubs.measure import percentile  # noqa: E402
from stubs.proc import die_with_parent  # noqa: E402
from stubs.stack import running_stack_sync  # noqa: E402

MARKER = "load-end-marker"  # registered after the run: the watcher's cue that it has all
MAX_KEPT = 20  # violation messages kept per kind (all are counted)
MiB = 1 << 20


# ---- statistics --------------------------------------------------------------------------


def summary_ms(samples_ns: list[int]) -> dict[str, float | int]:
    s = sorted(samples_ns)
    if not s:
        return {"n": 0}
    return {
        "n": len(s),
        "p50": round(percentile(s, 50) / 1e6, 2),
        "p90": round(percentile(s, 90) / 1e6, 2),
        "p99": round(percentile(s, 99) / 1e6, 2),
        "max": round(s[-1] / 1e6, 2),
        "mean": round(sum(s) / len(s) / 1e6, 2),
    }


class Violations:
    """Every invariant violation, counted by kind, the first few kept verbatim."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.samples: dict[str, list[str]] = {}

    def add(self, kind: str, text: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        kept = self.samples.setdefault(kind, [])
        if len(kept) < MAX_KEPT:
            kept.append(text)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def as_dict(self) -> dict[str, Any]:
        return {k: {"count": n, "first": self.samples[k]} for k, n in self.counts.items()}


# ---- processes ---------------------------------------------------------------------------


@dataclass
class Daemon:
    base: Path
    socket: str
    proc: subprocess.Popen[bytes]
    log: Path
    sleepers: list[subprocess.Popen[bytes]]
    rc: int | None = None


def _config_toml(connections: int, workloads: int) -> str:
    # Every client, every registrant, the watcher, the marker and a few probes.
    return (
        "[slicer]\n"
        f"max_connections = {connections + workloads + 32}\n"
        f"max_workloads = {workloads + 16}\n"
        f"max_queue = {connections + 16}\n"
    )


@contextlib.contextmanager
def running_daemon(args: argparse.Namespace) -> Iterator[Daemon]:
    """slicerd on a fresh fake ledger of `args.gpus` GPUs in a temp dir, plus one sleeper
    child per workload and one for the marker (the last); SIGTERM, kills and cleanup on
    the way out."""
    with running_stack_sync(
        tmp_prefix="slicer-load-",
        start=False,
        gpus=args.gpus,
        bandwidth=None,
        log_level=args.log_level,
        profile=args.profile_daemon,
        pdeathsig=True,
    ) as stack:
        cfg = stack.base / "slicer.toml"
        cfg.write_text(_config_toml(args.connections, args.workloads))
        stack.args += ["--config", str(cfg)]
        stack.start_sync()
        # `sleep`, not Python: cheap, and it lasts as long as the run.
        for _ in range(args.workloads + 1):
            stack.children.append(
                subprocess.Popen(
                    ["sleep", "86400"],
                    stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent,
                )
            )
        assert stack.proc is not None and stack.log is not None
        d = Daemon(stack.base, stack.socket, stack.proc, stack.log, list(stack.children))
        yield d
        d.rc = stack.stop_sync()


# ---- the watcher (its own process, so it always keeps up) ---------------------------------


def watch_events(path: str, out_path: str, marker: str, tx: Connection) -> None:
    """WATCH; write every byte received to `out_path` until the `registered` event of
    `marker` arrives; report "ready", then "done" (or what went wrong) on `tx`."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MiB)
        s.connect(path)
        s.sendall(b"WATCH\n")
        buf = b""
        while b"\n" not in buf:
            data = s.recv(65536)
            if not data:
                tx.send("eof before WATCH's reply")
                return
            buf += data
        first, rest = buf.split(b"\n", 1)
        if first.strip() != b"OK":
            tx.send(f"WATCH answered {first!r}")
            return
        tx.send("ready")
        needle = b'"workload":"' + marker.encode() + b'"'
        tail = rest[-256:]
        with open(out_path, "wb") as f:
            f.write(rest)
            if needle in rest:
                tx.send("done")
                return
            while True:
                data = s.recv(1 << 20)
                if not data:
                    tx.send("the daemon closed the WATCH connection (dropped?)")
                    return
                f.write(data)
                if needle in tail + data:
                    break
                tail = data[-256:]
        s.close()
        tx.send("done")
    except Exception as e:  # reported to the main process, which fails the run
        tx.send(f"watcher failed: {e!r}")


# ---- raw client connections -------------------------------------------------------------


class Closed(Exception):
    """The daemon closed a client connection."""


class RawConn:
    """A trio stream speaking the line protocol with minimal parsing: `reply` returns the
    next OK/ERR line; WAITING and EVENT lines are skipped, FAULT lines counted."""

    __slots__ = ("buf", "faults", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.faults: list[bytes] = []

    async def reply(self) -> bytes:
        buf = self.buf
        while True:
            nl = buf.find(b"\n")
            while nl < 0:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise Closed(str(e)) from e
                if not data:
                    raise Closed("the daemon closed the connection")
                buf += data
                nl = buf.find(b"\n")
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            if line.startswith((b"OK", b"ERR")):
                return line
            if line.startswith(b"FAULT"):
                self.faults.append(line)


def ok_fields(line: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for tok in line.split()[1:]:
        k, _, v = tok.partition(b"=")
        out[k] = v
    return out


@dataclass
class Grant:
    conn: int
    workload: int
    gpu: int
    sent_mono: float  # time.monotonic() just before the ACQUIRE was sent


@dataclass
class Run:
    """Shared state of the client side."""

    args: argparse.Namespace
    names: list[str]
    plan: list[int]  # workload index of each cycle (seeded)
    daemon_pid: int
    proc: psutil.Process
    v: Violations = field(default_factory=Violations)
    next_cycle: int = 0
    done: int = 0
    grants: dict[int, Grant] = field(default_factory=dict)
    holder: list[int] = field(default_factory=list)  # per GPU: conn believing it holds, or -1
    waiting_since: list[int] = field(default_factory=list)  # per conn: perf ns, 0 = not
    latencies: list[int] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    fds: list[tuple[float, int]] = field(default_factory=list)
    marks: dict[str, dict[str, float | int]] = field(default_factory=dict)
    aborted: str = ""
    t_start: float = 0.0
    t_end: float = 0.0

    def sample(self) -> tuple[int, int]:
        t = time.monotonic()
        rss = self.proc.memory_info().rss
        nfd = self.proc.num_fds()
        self.rss.append((t, rss))
        self.fds.append((t, nfd))
        return rss, nfd

    def mark(self, name: str) -> None:
        rss, nfd = self.sample()
        self.marks[name] = {"rss_mib": round(rss / MiB, 1), "fds": nfd, "done": self.done}


async def client_loop(run: Run, i: int, c: RawConn) -> None:
    """Connection `i`: ACQUIRE -> RELEASE until the plan is exhausted."""
    args, v = run.args, run.v
    gpus = args.gpus
    hold = args.hold_ms / 1e3
    names = run.names
    while run.next_cycle < args.cycles and not run.aborted:
        k = run.next_cycle
        run.next_cycle += 1
        w = run.plan[k]
        gpu = w % gpus
        name = names[w]
        t_mono = time.monotonic()
        t0 = time.perf_counter_ns()
        run.waiting_since[i] = t0
        try:
            await c.stream.send_all(b"ACQUIRE " + name.encode() + b"\n")
            line = await c.reply()
        except Closed as e:
            v.add("connection-closed", f"conn {i} ACQUIRE {name}: {e}")
            run.waiting_since[i] = 0
            return
        t1 = time.perf_counter_ns()
        run.waiting_since[i] = 0
        if not line.startswith(b"OK"):
            v.add("acquire-err", f"conn {i} ACQUIRE {name}: {line!r}")
            continue
        run.latencies.append(t1 - t0)
        turn = int(ok_fields(line)[b"turn"])
        if turn in run.grants:
            g = run.grants[turn]
            v.add("duplicate-turn", f"turn {turn} granted to conn {g.conn} and conn {i}")
        run.grants[turn] = Grant(i, w, gpu, t_mono)
        other = run.holder[gpu]
        if other >= 0:
            v.add(
                "two-holders",
                f"conn {i} granted GPU {gpu} ({name} turn {turn}) while conn {other} holds it",
            )
        run.holder[gpu] = i
        # Hold the turn across at least one scheduler pass: every other connection gets
        # to read its socket while this one believes it holds the GPU.
        if hold > 0:
            await trio.sleep(hold)
        else:
            await trio.lowlevel.checkpoint()
        if run.holder[gpu] == i:
            run.holder[gpu] = -1
        try:
            await c.stream.send_all(b"RELEASE " + name.encode() + b" turn=%d\n" % turn)
            line = await c.reply()
        except Closed as e:
            v.add("connection-closed", f"conn {i} RELEASE {name} turn={turn}: {e}")
            return
        if not line.startswith(b"OK"):
            v.add("release-err", f"conn {i} RELEASE {name} turn={turn}: {line!r}")
        run.done += 1
        if c.faults:
            v.add("fault", f"conn {i}: {c.faults[0]!r}")
            c.faults.clear()


async def monitor(run: Run, d: Daemon, cancel: trio.CancelScope) -> None:
    """Samples RSS/fds, prints progress, and finds lost grants and stalls."""
    args = run.args
    bound_ns = int(args.grant_timeout * 1e9)
    last_print = time.monotonic()
    last_done, last_progress = run.done, time.monotonic()
    ten_pct = max(1, args.cycles // 10)
    while True:
        await trio.sleep(args.sample_s)
        now = time.monotonic()
        if d.proc.poll() is not None:
            run.aborted = f"slicerd exited with {d.proc.returncode} during the run"
            run.v.add("daemon-crash", run.aborted)
            cancel.cancel()
            return
        rss, nfd = run.sample()
        if "rss_10pct" not in run.marks and run.done >= ten_pct:
            run.mark("rss_10pct")
        now_ns = time.perf_counter_ns()
        late = [
            (i, now_ns - t) for i, t in enumerate(run.waiting_since) if t and now_ns - t > bound_ns
        ]
        if late:
            for i, age in late:
                run.v.add("lost-grant", f"conn {i}: no reply to ACQUIRE after {age / 1e9:.1f} s")
            run.aborted = f"{len(late)} ACQUIREs unanswered after {args.grant_timeout} s"
            cancel.cancel()
            return
        if run.done != last_done:
            last_done, last_progress = run.done, now
        elif now - last_progress > args.grant_timeout:
            run.aborted = f"no cycle completed for {args.grant_timeout} s"
            run.v.add("stall", run.aborted)
            cancel.cancel()
            return
        if now - last_print >= args.progress_s:
            last_print = now
            el = now - run.t_start
            print(
                f"  [{el:7.1f} s] {run.done}/{args.cycles} cycles"
                f" ({run.done / el:.0f}/s), daemon RSS {rss / MiB:.1f} MiB, fds {nfd}",
                file=sys.stderr,
                flush=True,
            )


async def run_load(d: Daemon, args: argparse.Namespace, events_path: str) -> Run:
    rng = random.Random(args.seed)
    names = [f"load-w{j:03d}" for j in range(args.workloads)]
    plan = [rng.randrange(args.workloads) for _ in range(args.cycles)]
    proc = psutil.Process(d.proc.pid)
    run = Run(args=args, names=names, plan=plan, daemon_pid=d.proc.pid, proc=proc)
    run.holder = [-1] * args.gpus
    run.waiting_since = [0] * args.connections
    run.mark("start")

    # Registrants: one connection per workload, round-robin over GPUs, a sleeper each.
    registrants: list[AsyncSlicer] = []
    clients: list[RawConn] = []
    probe: AsyncSlicer | None = None
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    watcher = ctx.Process(
        target=watch_events, args=(d.socket, events_path, MARKER, tx), name="load-watcher"
    )
    try:
        t = time.perf_counter()
        for j, name in enumerate(names):
            r = await AsyncSlicer.connect(d.socket)
            registrants.append(r)
            pid = d.sleepers[j].pid
            await r.register(name, gpu=j % args.gpus, pid=pid, tree=False, park="cooperative")
        run.marks["timing"] = {"register_s": round(time.perf_counter() - t, 2)}
        run.mark("registered")

        watcher.start()
        tx.close()
        msg = await trio.to_thread.run_sync(lambda: rx.recv() if rx.poll(30) else "timeout")
        if msg != "ready":
            raise RuntimeError(f"watcher: {msg}")

        t = time.perf_counter()
        for _ in range(args.connections):
            clients.append(RawConn(await trio.open_unix_socket(d.socket)))
        run.marks["timing"]["connect_s"] = round(time.perf_counter() - t, 2)
        # The daemon accepts in its own time: the mark waits until it counts them all
        # (the clients, the registrants, the watcher and this probe).
        probe = await AsyncSlicer.connect(d.socket)
        expected = args.connections + args.workloads + 2
        with trio.fail_after(60):
            while (await probe.status())["connections"] < expected:
                await trio.sleep(0.05)
        await probe.aclose()
        probe = None
        run.mark("connected")

        print(
            f"load: {args.connections} connections, {args.workloads} workloads over"
            f" {args.gpus} GPUs, {args.cycles} cycles (seed {args.seed})",
            file=sys.stderr,
            flush=True,
        )
        run.t_start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor, run, d, nursery.cancel_scope)
            async with trio.open_nursery() as workers:
                for i, c in enumerate(clients):
                    workers.start_soon(client_loop, run, i, c)
            run.t_end = time.monotonic()
            nursery.cancel_scope.cancel()
        if not run.t_end:
            run.t_end = time.monotonic()
        run.mark("cycles_done")

        # The marker: once the watcher sees its `registered` event it has every event.
        probe = await AsyncSlicer.connect(d.socket)
        pid = d.sleepers[-1].pid
        await probe.register(MARKER, gpu=0, pid=pid, tree=False, park="cooperative")
        msg = await trio.to_thread.run_sync(lambda: rx.recv() if rx.poll(60) else "timeout")
        if msg != "done":
            run.v.add("watcher", f"event stream incomplete: {msg}")
        st = await probe.status()
        run.marks["status_after"] = {
            "connections": int(st["connections"]),
            "grants": int(st["totals"]["grants"]),
            "parks": int(st["totals"]["parks"]),
            "faults": int(st["totals"]["faults"]),
        }
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.stream.aclose()
        for r in registrants:
            with contextlib.suppress(Exception):
                await r.aclose()
        if probe is not None:
            with contextlib.suppress(Exception):
                await probe.aclose()
        if watcher.is_alive():
            watcher.join(10)
            if watcher.is_alive():
                watcher.terminate()
                watcher.join(5)
        rx.close()

    # Every connection is closed: the daemon's fds must come back to where they started.
    start_fds = int(run.marks["start"]["fds"])
    deadline = time.monotonic() + 15
    while True:
        _, nfd = run.sample()
        if nfd <= start_fds + args.fd_slack or time.monotonic() > deadline:
            break
        await trio.sleep(0.1)
    run.mark("closed")
    return run


# ---- the event stream --------------------------------------------------------------------


def check_events(run: Run, events_path: str) -> dict[str, Any]:
    """Replays the WATCH stream: per-GPU FIFO, alternation of grant and release, and the
    one-for-one match of the daemon's grants with the clients'."""
    v, args = run.v, run.args
    gpus = args.gpus
    index = {n: j for j, n in enumerate(run.names)}
    queues: list[deque[tuple[int, float]]] = [deque() for _ in range(gpus)]
    held: list[int] = [0] * gpus  # turn held per GPU per the events, 0 = none
    counts: dict[str, int] = {}
    event_turns: set[int] = set()
    try:
        raw = Path(events_path).read_bytes()
    except OSError as e:
        v.add("watcher", f"no event file: {e}")
        return {}
    for line in raw.split(b"\n"):
        if not line.startswith(b"EVENT "):
            continue
        ev = json.loads(line[6:])
        kind = ev.get("event")
        counts[kind] = counts.get(kind, 0) + 1
        name = ev.get("workload")
        if name not in index:
            continue  # the marker
        w = index[name]
        gpu = int(ev["gpu"])
        if kind == "queued":
            q = queues[gpu]
            q.append((w, float(ev["t"])))
            if ev.get("position") != len(q):
                v.add(
                    "fifo-position",
                    f"GPU {gpu}: {name} queued at position {ev.get('position')},"
                    f" replayed queue length {len(q)}",
                )
        elif kind == "granted":
            turn = int(ev["turn"])
            if held[gpu]:
                v.add("overlap", f"GPU {gpu}: turn {turn} granted while turn {held[gpu]} held")
            held[gpu] = turn
            if turn in event_turns:
                v.add("duplicate-turn", f"turn {turn} granted twice in the event stream")
            event_turns.add(turn)
            q = queues[gpu]
            if not q:
                v.add("fifo", f"GPU {gpu}: {name} turn {turn} granted with an empty queue")
                continue
            head_w, t_queued = q.popleft()
            if head_w != w:
                v.add(
                    "fifo",
                    f"GPU {gpu}: turn {turn} went to {name}, queue head was {run.names[head_w]}",
                )
            g = run.grants.get(turn)
            if g is None:
                v.add("lost-grant", f"turn {turn} ({name}, GPU {gpu}) never reached a client")
                continue
            if g.workload != w or g.gpu != gpu:
                v.add("mismatch", f"turn {turn}: event {name}/GPU {gpu}, client {g}")
            if g.sent_mono > t_queued + 2e-6:
                v.add(
                    "fifo",
                    f"GPU {gpu}: turn {turn} of {name} went to conn {g.conn}, whose ACQUIRE was"
                    f" sent {(g.sent_mono - t_queued) * 1e3:.3f} ms after the head was queued",
                )
        elif kind == "released":
            ended = int(ev.get("turn_ended") or 0)
            if held[gpu] != ended:
                v.add("overlap", f"GPU {gpu}: turn {ended} released, held turn is {held[gpu]}")
            held[gpu] = 0
            if ev.get("how") != "released":
                v.add("unexpected-release", f"GPU {gpu}: turn {ended} ended by {ev.get('how')}")
    missing = set(run.grants) - event_turns
    if missing:
        v.add(
            "event-missing",
            f"{len(missing)} client turns have no granted event, e.g. {min(missing)}",
        )
    left = sum(len(q) for q in queues)
    if left:
        v.add("fifo", f"{left} queued events never granted")
    return {
        "events": sum(counts.values()),
        "by_kind": dict(sorted(counts.items())),
        "event_bytes": len(raw),
    }


# ---- report ------------------------------------------------------------------------------


def log_problems(text: str) -> list[str]:
    lines = text.splitlines()
    bad = [ln for ln in lines if " ERROR " in ln or "Traceback" in ln or " WARNING " in ln]
    return bad[:10]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--workloads", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hold-ms", type=float, default=0.0, help="hold each turn (0: one yield)")
    ap.add_argument("--grant-timeout", type=float, default=60.0, help="lost-grant bound, s")
    ap.add_argument("--rss-growth-limit-mib", type=float, default=64.0)
    ap.add_argument("--fd-slack", type=int, default=3)
    ap.add_argument("--sample-s", type=float, default=0.5, help="RSS/fd sampling period")
    ap.add_argument("--progress-s", type=float, default=10.0, help="progress line period")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--profile-daemon", metavar="FILE", help="run slicerd under cProfile")
    args = ap.parse_args()
    if args.workloads < args.gpus or args.connections < 1 or args.cycles < 1:
        ap.error("need workloads >= gpus, connections >= 1, cycles >= 1")
    # SIGTERM unwinds like Ctrl-C (inside trio.run too): the daemon is stopped and the temp
    # dir removed.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))

    # This process holds every client socket; the daemon inherits the limit and holds as
    # many, plus one per registrant.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (args.connections + args.workloads) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    t_all = time.perf_counter()
    res: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "bench/load.py", *sys.argv[1:]]),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "rlimit_nofile": nofile,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "params": {
            k: getattr(args, k)
            for k in ("connections", "workloads", "gpus", "cycles", "seed", "hold_ms")
        },
    }
    with running_daemon(args) as d:
        events_path = str(d.base / "events.log")
        run = trio.run(run_load, d, args, events_path)
        res["event_stream"] = check_events(run, events_path)
        log_text = d.log.read_text(errors="replace")
    v = run.v
    res["daemon_rc"] = d.rc
    if d.rc != 0:
        v.add("daemon-exit", f"slicerd exited {d.rc} on SIGTERM")
    problems = log_problems(log_text)
    if any("Traceback" in p or " ERROR " in p for p in problems):
        v.add("daemon-log", problems[0])
    res["daemon_log_warnings"] = problems

    elapsed = max(1e-9, run.t_end - run.t_start)
    rss = [r for _, r in run.rss]
    fds = [n for _, n in run.fds]
    m = run.marks
    res["aborted"] = run.aborted
    res["cycles_done"] = run.done
    res["elapsed_s"] = round(elapsed, 2)
    res["cycles_per_s"] = round(run.done / elapsed, 1)
    res["grant_latency_ms"] = summary_ms(run.latencies)
    res["rss_mib"] = {
        "start": m["start"]["rss_mib"],
        "registered": m["registered"]["rss_mib"],
        "connected": m["connected"]["rss_mib"],
        "at_10pct": m.get("rss_10pct", {}).get("rss_mib"),
        "cycles_done": m["cycles_done"]["rss_mib"],
        "peak": round(max(rss) / MiB, 1),
        "end": m["closed"]["rss_mib"],
    }
    res["fds"] = {
        "start": m["start"]["fds"],
        "connected": m["connected"]["fds"],
        "peak": max(fds),
        "end": m["closed"]["fds"],
    }
    res["timing_s"] = m.get("timing", {})
    res["status_after"] = m.get("status_after", {})
    res["samples"] = len(rss)
    if run.done != args.cycles:
        v.add("incomplete", f"{run.done}/{args.cycles} cycles completed")
    if len(run.grants) != run.done:
        v.add("grant-count", f"{len(run.grants)} distinct turns for {run.done} cycles")
    if "rss_10pct" in m:
        growth = float(m["cycles_done"]["rss_mib"]) - float(m["rss_10pct"]["rss_mib"])
        res["rss_mib"]["growth_10pct_to_done"] = round(growth, 1)
        if growth > args.rss_growth_limit_mib:
            v.add("memory", f"RSS grew {growth:.1f} MiB from 10% of the cycles to the end")
    if int(m["closed"]["fds"]) > int(m["start"]["fds"]) + args.fd_slack:
        v.add("fd-leak", f"fds {m['start']['fds']} before connections, {m['closed']['fds']} after")
    res["violations"] = v.as_dict()
    res["ok"] = not v
    res["total_s"] = round(time.perf_counter() - t_all, 1)

    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        lat, r, f = res["grant_latency_ms"], res["rss_mib"], res["fds"]
        print(
            f"slicerd load bench: {args.connections} connections, {args.workloads} workloads,"
            f" {args.gpus} fake GPUs, {args.cycles} cycles, seed {args.seed}"
            f" (python {res['python']}, {res['cpus']} CPUs)"
        )
        print(f"  cycles done         {run.done} in {res['elapsed_s']} s")
        print(f"  cycles/s            {res['cycles_per_s']}")
        print(
            f"  grant latency ms    p50 {lat.get('p50')}  p99 {lat.get('p99')}"
            f"  max {lat.get('max')}"
        )
        print(
            f"  daemon RSS MiB      start {r['start']}  peak {r['peak']}  end {r['end']}"
            f"  (10% {r['at_10pct']} -> done {r['cycles_done']})"
        )
        print(
            f"  daemon fds          start {f['start']}  peak {f['peak']}  end {f['end']}"
            f"  (connected {f['connected']})"
        )
        es = res["event_stream"]
        print(f"  events checked      {es.get('events')} {es.get('by_kind')}")
        print(f"  daemon rc           {d.rc}   total {res['total_s']} s")
        if v:
            print("  VIOLATIONS:")
            for kind, info in res["violations"].items():
                print(f"    {kind}: {info['count']}")
                for text in info["first"][:5]:
                    print(f"      {text}")
        else:
            print("  violations          none")
    if not res["ok"]:
        print("---- slicerd log (tail) ----\n" + log_text[-3000:], file=sys.stderr)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    run_script(main)
