"""Turn-handoff benchmark for slicerd on a fake GPU.

    .venv/bin/python bench/handoff.py [--cycles N] [--waiters 1000] [--json]

Starts its own slicerd (fake GPU backend, fresh ledger in a temp dir, READY=1 awaited on a
NOTIFY_SOCKET like systemd does), measures three things with `time.perf_counter_ns`, stops
the daemon with SIGTERM and removes the temp dir:

Every workload registers a process of its own, a sleeper child (a process belongs to at
most one workload: a second REGISTER of it is `ERR in-use`); each part kills its sleepers
when it ends, so the daemon forgets their workloads before the next part starts.

1. handoff: workloads A and B (park=cooperative, GPU 0) on two connections of this process.
   The holder waits for the daemon's WAITING line (proof that the other connection is
   queued), then sends RELEASE; the figure is RELEASE sent -> the waiter's grant received.
   One thread drives both raw blocking sockets with poll(), so no thread or event-loop
   wake-up of the client is counted; what is left is the daemon plus two socket hops.
2. uncontended re-ACQUIRE of an idle workload: ACQUIRE and RELEASE round trips on one
   connection (the workload stays resident between turns: lazy park); PING round trips on
   the same connection give the transport-plus-event-loop floor.
3. cascade: a holder holds H while N connections queue for W one after the other (each
   confirmed through a WATCH `queued` event with the expected position); then the holder
   releases and every granted connection releases at once. Grants must come in queue
   order (turn ids increasing); meanwhile a separate process issues STATUS in a loop and
   its latency is reported. A second round on the same connections, without the STATUS
   prober, gives the cascade's own pace.

`--verify-reuse-ms MS` is passed to slicerd (how long a clean GPU reading may serve a
grant check, `slicer.reuse`; 0 reads the GPU for every grant, as before it existed).

`--profile-daemon FILE` runs the daemon under cProfile (its stats are written when it
exits on SIGTERM): `python -m pstats FILE`, then `sort cumtime`, `stats 30`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make proto/slicer/stubs importable
    sys.path.insert(0, str(ROOT))

from bench.script import run_script  # noqa: E402
from gpu_slicer import proto  # noqa: E402
from gpu_slicer.slicer.client import AsyncSlicer  # noqa: E402
from stubs.measure import percentile  # noqa: E402
from stubs.stack import Stack, running_stack_sync  # noqa: E402

TARGETS = {
    "handoff_p50_us": 250.0,
    "acquire_p50_us": 150.0,
    "status_max_ms": 50.0,
    # Issue 14, relative to the transport floor measured in the same run (PING p50).
    "handoff_over_ping": 2.0,
    "acquire_over_ping": 1.5,
}


# ---- statistics --------------------------------------------------------------------------


def summary(samples_ns: list[int], unit: float) -> dict[str, float | int]:
    """p50/p90/p99/max/mean of `samples_ns`, divided by `unit` (1e3: us, 1e6: ms)."""
    s = sorted(samples_ns)
    if not s:
        return {"n": 0}
    return {
        "n": len(s),
        "p50": round(percentile(s, 50) / unit, 1),
        "p90": round(percentile(s, 90) / unit, 1),
        "p99": round(percentile(s, 99) / unit, 1),
        "max": round(s[-1] / unit, 1),
        "mean": round(sum(s) / len(s) / unit, 1),
    }


# ---- the daemon --------------------------------------------------------------------------


@dataclass
class Daemon:
    base: Path
    socket: str
    proc: subprocess.Popen[bytes]
    log: Path
    stack: Stack
    rc: int | None = None


@contextlib.contextmanager
def running_daemon(
    profile: str | None, log_level: str, flags: tuple[str, ...] = ()
) -> Iterator[Daemon]:
    """slicerd (with `flags`) on a fresh one-GPU fake ledger in a temp dir; SIGTERM and
    cleanup on exit."""
    with running_stack_sync(
        *flags,
        tmp_prefix="slicer-bench-",
        gpus=1,
        bandwidth=None,
        log_level=log_level,
        profile=profile,
        pdeathsig=True,
    ) as stack:
        assert stack.proc is not None and stack.log is not None
        d = Daemon(stack.base, stack.socket, stack.proc, stack.log, stack)
        yield d
        d.rc = stack.stop_sync()


# ---- a raw blocking connection -----------------------------------------------------------


class Raw:
    """A blocking Unix-socket connection speaking the line protocol, with no client library
    in the measured path: `send` writes bytes, `line` returns the next parsed line."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = proto.LineBuffer(proto.MAX_SERVER_LINE)
        self.lines: list[bytes] = []
        self.t_last = 0  # perf_counter_ns when the data holding the last line arrived

    def close(self) -> None:
        self.sock.close()

    def fill(self) -> None:
        """One recv (blocking); timestamps its arrival."""
        data = self.sock.recv(1 << 20)
        t = time.perf_counter_ns()
        if not data:
            raise RuntimeError("slicerd closed the connection")
        self.lines.extend(self.buf.feed(data))
        self.t_last = t

    def line(self) -> proto.ServerMessage:
        while not self.lines:
            self.fill()
        return proto.parse_server_line(self.lines.pop(0))

    def reply(self) -> proto.Ok:
        """The next OK (events skipped); ERR raises."""
        while True:
            msg = self.line()
            if isinstance(msg, proto.Err):
                raise RuntimeError(f"ERR {msg.code} {msg.text}")
            if isinstance(msg, proto.Ok):
                return msg

    def request(self, line: str) -> proto.Ok:
        self.sock.sendall(line.encode() + b"\n")
        return self.reply()


def _await_waiting(holder: Raw) -> None:
    """Block until the holder gets WAITING (the other workload is queued)."""
    while True:
        msg = holder.line()
        if isinstance(msg, proto.Waiting):
            return
        if isinstance(msg, proto.Ok | proto.Err):
            raise RuntimeError(f"unexpected reply while waiting for WAITING: {msg}")


@contextlib.contextmanager
def own_processes(d: Daemon, n: int) -> Iterator[list[int]]:
    """`n` sleeper children (started from the main thread: they die with this process),
    one per workload of a part; killed on the way out."""
    pids = [d.stack.sleeper() for _ in range(n)]
    try:
        yield pids
    finally:
        for p in d.stack.children:
            if p.pid in pids and p.poll() is None:
                p.kill()
                p.wait()


def _wait_no_workloads(path: str) -> None:
    """After closing registrants and killing their sleepers: poll STATUS until the daemon
    forgot the workloads (bounded)."""
    c = Raw(path)
    try:
        deadline = time.monotonic() + 10
        while True:
            st = c.request("STATUS").body
            gpu0 = st["gpus"][0]
            # Registrations end with their registrant; a workload stays as a parked orphan
            # (re-adoptable) until the daemon's reaper sees its process gone.
            if not st["workloads"] and gpu0["holder"] is None and not gpu0["queue"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"workloads linger after close: {st['workloads']}")
            time.sleep(0.01)
    finally:
        c.close()


# ---- 1. handoff --------------------------------------------------------------------------


def bench_handoff(path: str, cycles: int, warmup: int, pids: list[int]) -> dict[str, Any]:
    a, b = Raw(path), Raw(path)
    a.request(f"REGISTER bench-a gpu=0 pid={pids[0]} park=cooperative tree=0")
    b.request(f"REGISTER bench-b gpu=0 pid={pids[1]} park=cooperative tree=0")
    turn = int(a.request("ACQUIRE bench-a").fields["turn"])
    holder, waiter = (a, "bench-a"), (b, "bench-b")
    handoff: list[int] = []
    release_rtt: list[int] = []
    turns = [turn]
    poller = select.poll()
    poller.register(a.sock, select.POLLIN)
    poller.register(b.sock, select.POLLIN)
    by_fd = {a.sock.fileno(): a, b.sock.fileno(): b}
    t_begin = 0
    for i in range(warmup + cycles):
        if i == warmup:
            t_begin = time.perf_counter_ns()
        (hc, hname), (wc, wname) = holder, waiter
        wc.sock.sendall(f"ACQUIRE {wname}\n".encode())
        _await_waiting(hc)
        line = f"RELEASE {hname} turn={turn}\n".encode()
        t0 = time.perf_counter_ns()
        hc.sock.sendall(line)
        # Read both sockets as data comes: the waiter's grant and the holder's reply.
        got_grant = got_reply = False
        t_grant = t_reply = 0
        while not (got_grant and got_reply):
            if not ((not got_grant and wc.lines) or (not got_reply and hc.lines)):
                for fd, _ in poller.poll():
                    by_fd[fd].fill()
            if not got_grant and wc.lines:
                msg = wc.line()
                if isinstance(msg, proto.Err):
                    raise RuntimeError(f"ACQUIRE {wname}: ERR {msg.code} {msg.text}")
                if isinstance(msg, proto.Ok):
                    got_grant, t_grant = True, wc.t_last
                    turn = int(msg.fields["turn"])
            if not got_reply and hc.lines:
                msg = hc.line()
                if isinstance(msg, proto.Err):
                    raise RuntimeError(f"RELEASE {hname}: ERR {msg.code} {msg.text}")
                if isinstance(msg, proto.Ok):
                    got_reply, t_reply = True, hc.t_last
        turns.append(turn)
        if i >= warmup:
            handoff.append(t_grant - t0)
            release_rtt.append(t_reply - t0)
        holder, waiter = waiter, holder
    elapsed = time.perf_counter_ns() - t_begin
    for c in (a, b):
        c.close()
    monotonic = all(x < y for x, y in itertools.pairwise(turns))
    return {
        "cycles": cycles,
        "warmup": warmup,
        "handoff_us": summary(handoff, 1e3),
        "release_rtt_us": summary(release_rtt, 1e3),
        "cycles_per_s": round(cycles / (elapsed / 1e9), 1),
        "turns_increasing": monotonic,
    }


# ---- 2. uncontended re-ACQUIRE ------------------------------------------------------------


def bench_reacquire(path: str, cycles: int, warmup: int, pid: int) -> dict[str, Any]:
    c = Raw(path)
    c.request(f"REGISTER bench-solo gpu=0 pid={pid} park=cooperative tree=0")
    acq: list[int] = []
    rel: list[int] = []
    restored = 0
    acquire_line = b"ACQUIRE bench-solo\n"
    t_begin = 0
    for i in range(warmup + cycles):
        if i == warmup:
            t_begin = time.perf_counter_ns()
        t0 = time.perf_counter_ns()
        c.sock.sendall(acquire_line)
        ok = c.reply()
        t1 = c.t_last
        turn = ok.fields["turn"]
        if i >= 1 and ok.fields.get("restored") != "0":
            restored += 1
        line = f"RELEASE bench-solo turn={turn}\n".encode()
        t2 = time.perf_counter_ns()
        c.sock.sendall(line)
        c.reply()
        t3 = c.t_last
        if i >= warmup:
            acq.append(t1 - t0)
            rel.append(t3 - t2)
    elapsed = time.perf_counter_ns() - t_begin
    # The floor: PING costs one read, one dispatch and one write in the daemon.
    ping: list[int] = []
    for i in range(warmup + cycles):
        t0 = time.perf_counter_ns()
        c.sock.sendall(b"PING\n")
        c.reply()
        if i >= warmup:
            ping.append(c.t_last - t0)
    c.close()
    return {
        "cycles": cycles,
        "ping_us": summary(ping, 1e3),
        "acquire_us": summary(acq, 1e3),
        "release_us": summary(rel, 1e3),
        "turns_per_s": round(cycles / (elapsed / 1e9), 1),
        "restored_regrants": restored,
    }


# ---- 3. cascade of N queued connections ---------------------------------------------------


def status_prober(
    path: str, go: MpEvent, stop: MpEvent, out: Connection, interval_s: float
) -> None:
    """In its own process: STATUS in a loop between `go` and `stop`; send back latencies."""
    c = Raw(path)
    go.wait(60)
    lat: list[int] = []
    line = b"STATUS\n"
    while not stop.is_set():
        t0 = time.perf_counter_ns()
        c.sock.sendall(line)
        c.reply()
        lat.append(c.t_last - t0)
        if interval_s > 0:
            time.sleep(interval_s)
    c.close()
    out.send(lat)
    out.close()


async def _queue_and_cascade(
    path: str,
    holder: AsyncSlicer,
    registrar: AsyncSlicer,
    conns: list[AsyncSlicer],
    go: MpEvent | None,
) -> dict[str, Any]:
    """One round: the holder takes H, every connection queues for W in order (confirmed by
    WATCH), then the holder releases and the grants cascade. `go`: start the prober."""
    n = len(conns)
    grants: list[tuple[int, int, int]] = []  # (index, turn, t_ns received)
    errors: list[str] = []
    held = await holder.acquire("bench-h")
    watcher = await AsyncSlicer.connect(path)
    await watcher.request(proto.Watch())

    async def one(i: int, c: AsyncSlicer) -> None:
        try:
            t = await c.acquire("bench-w")
            grants.append((i, t.turn, time.perf_counter_ns()))
            await c.release(t)
        except Exception as e:
            errors.append(f"{i}: {e!r}")

    async def queued_at(position: int) -> None:
        while True:
            msg = await watcher.next_message()
            if (
                isinstance(msg, proto.Event)
                and msg.body.get("event") == "queued"
                and msg.body.get("workload") == "bench-w"
            ):
                if msg.body.get("position") != position:
                    raise RuntimeError(f"queued at {msg.body.get('position')}, not {position}")
                return

    async with trio.open_nursery() as nursery:
        t_q = time.perf_counter_ns()
        with trio.fail_after(60):
            for i, c in enumerate(conns):
                nursery.start_soon(one, i, c)
                await queued_at(i + 1)
        queue_ms = (time.perf_counter_ns() - t_q) / 1e6
        await watcher.aclose()  # a watcher must keep up with events; this one is done
        st = await registrar.status()
        queue_len = len(st["gpus"][0]["queue"])
        # STATUS with N waiters while nothing else happens, for reference.
        idle_status: list[int] = []
        for _ in range(20):
            t0 = time.perf_counter_ns()
            await registrar.status()
            idle_status.append(time.perf_counter_ns() - t0)
        if go is not None:
            go.set()
            await trio.sleep(0.05)  # the prober is running before the cascade starts
        t_start = time.perf_counter_ns()
        await holder.release(held)
    t_end = max((g[2] for g in grants), default=time.perf_counter_ns())

    by_turn = sorted(grants, key=lambda g: g[1])
    steps = [b[2] - a[2] for a, b in itertools.pairwise(grants)]
    return {
        "queue_ms": round(queue_ms, 1),
        "queue_len_before": queue_len,
        "cascade_ms": round((t_end - t_start) / 1e6, 1),
        "grant_step_us": summary(steps, 1e3),
        "fifo_by_turn": [g[0] for g in by_turn] == list(range(n)) and len(grants) == n,
        "fifo_by_arrival": [g[0] for g in grants] == list(range(n)),
        "errors": errors[:5],
        "status_idle_ms": summary(idle_status, 1e6),
    }


async def _cascade(
    path: str, n: int, go: MpEvent, stop: MpEvent, pids: list[int]
) -> dict[str, Any]:
    holder = await AsyncSlicer.connect(path)
    registrar = await AsyncSlicer.connect(path)
    conns: list[AsyncSlicer] = []
    try:
        # tree=1 (the default, as a vLLM launcher registers): STATUS resolves descendants.
        await holder.register("bench-h", gpu=0, pid=pids[0], park="cooperative")
        await registrar.register("bench-w", gpu=0, pid=pids[1], park="cooperative")
        t_conn = time.perf_counter_ns()
        for _ in range(n):
            conns.append(await AsyncSlicer.connect(path))
        connect_ms = (time.perf_counter_ns() - t_conn) / 1e6
        probed = await _queue_and_cascade(path, holder, registrar, conns, go)
        stop.set()
        quiet = await _queue_and_cascade(path, holder, registrar, conns, None)
    finally:
        stop.set()
        for c in [holder, registrar, *conns]:
            with contextlib.suppress(Exception):
                await c.aclose()
    return {
        "waiters": n,
        "connect_ms": round(connect_ms, 1),
        **probed,
        "quiet": {k: quiet[k] for k in ("cascade_ms", "grant_step_us", "fifo_by_turn", "errors")},
    }


def bench_cascade(path: str, n: int, interval_s: float, pids: list[int]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    rx, tx = ctx.Pipe(duplex=False)
    prober = ctx.Process(
        target=status_prober, args=(path, go, stop, tx, interval_s), name="status-prober"
    )
    prober.start()
    tx.close()
    try:
        out = trio.run(_cascade, path, n, go, stop, pids)
        lat: list[int] = rx.recv() if rx.poll(30) else []
    finally:
        go.set()
        stop.set()
        prober.join(10)
        if prober.is_alive():
            prober.terminate()
            prober.join(5)
    out["status_during_ms"] = summary(lat, 1e6)
    out["status_interval_ms"] = interval_s * 1e3
    return out


# ---- report ------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "PASS" if value <= target else "MISS"


def report(res: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    h, r, c = res["handoff"], res["reacquire"], res["cascade"]
    hu = h["handoff_us"]
    rows.append(("handoff p50", f"{hu['p50']} us", "<= 250 us", h["verdict"]))
    rows.append(("handoff p99", f"{hu['p99']} us", "", ""))
    rows.append(("handoff max", f"{hu['max']} us", "", ""))
    rows.append(("handoff holder RELEASE rtt p50", f"{h['release_rtt_us']['p50']} us", "", ""))
    rows.append(("handoff cycles/s", f"{h['cycles_per_s']}", "", ""))
    au, ru = r["acquire_us"], r["release_us"]
    rows.append(("re-ACQUIRE p50", f"{au['p50']} us", "<= 150 us", r["verdict"]))
    rows.append(("re-ACQUIRE p99", f"{au['p99']} us", "", ""))
    rows.append(("RELEASE (idle) p50", f"{ru['p50']} us", "", ""))
    rows.append(("RELEASE (idle) p99", f"{ru['p99']} us", "", ""))
    rows.append(("turns/s uncontended", f"{r['turns_per_s']}", "", ""))
    rows.append(("PING rtt p50 (floor)", f"{r['ping_us']['p50']} us", "", ""))
    rows.append(("PING rtt p99", f"{r['ping_us']['p99']} us", "", ""))
    sd = c["status_during_ms"]
    n = c["waiters"]
    fifo = f"{c['fifo_by_turn']}/{c['quiet']['fifo_by_turn']}"
    rows.append((f"cascade {n} waiters: FIFO (2 rounds)", fifo, "True", c["fifo_verdict"]))
    rows.append(("cascade total", f"{c['cascade_ms']} ms", "", ""))
    rows.append(("cascade grant step p50", f"{c['grant_step_us']['p50']} us", "", ""))
    rows.append(("cascade grant step p99", f"{c['grant_step_us']['p99']} us", "", ""))
    q = c["quiet"]
    rows.append(("cascade total, no STATUS load", f"{q['cascade_ms']} ms", "", ""))
    rows.append(("  grant step p50, no STATUS load", f"{q['grant_step_us']['p50']} us", "", ""))
    rows.append(("STATUS during cascade p50", f"{sd.get('p50')} ms (n={sd['n']})", "", ""))
    rows.append(("STATUS during cascade p99", f"{sd.get('p99')} ms", "", ""))
    rows.append(("STATUS during cascade max", f"{sd.get('max')} ms", "<= 50 ms", c["verdict"]))
    rows.append((f"STATUS idle, {n} queued p50", f"{c['status_idle_ms']['p50']} ms", "", ""))
    rows.append(
        ("ratio handoff/re-ACQUIRE p50", f"{res['ratios']['handoff_over_acquire']}", "", "")
    )
    rows.append(("ratio handoff p99/p50", f"{res['ratios']['handoff_p99_over_p50']}", "", ""))
    ratios = res["ratios"]
    for key, label in (
        ("handoff_over_ping", "handoff/PING"),
        ("acquire_over_ping", "re-ACQUIRE/PING"),
    ):
        target = TARGETS[key]
        rows.append(
            (f"ratio {label} p50", f"{ratios[key]}", f"<= {target}x", verdict(ratios[key], target))
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cycles", type=int, default=2000, help="measured handoffs and re-ACQUIREs")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--waiters", type=int, default=1000, help="queued connections (cascade)")
    ap.add_argument(
        "--status-interval-ms", type=float, default=1.0, help="prober pause between STATUSes"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--json-file", metavar="FILE", help="also write the JSON object here")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--profile-daemon", metavar="FILE", help="run slicerd under cProfile")
    ap.add_argument("--only", choices=["handoff", "reacquire", "cascade"], action="append")
    ap.add_argument(
        "--verify-reuse-ms",
        type=float,
        metavar="MS",
        help="passed to slicerd (its default when not given: 20; 0 reads the GPU per grant)",
    )
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C (inside trio.run too): the daemon is stopped and the temp
    # dir removed.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * args.waiters + 256  # inherited by the daemon, which holds as many sockets
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))

    only = set(args.only or ["handoff", "reacquire", "cascade"])
    res: dict[str, Any] = {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "targets": TARGETS,
    }
    t_all = time.perf_counter()
    flags: tuple[str, ...] = ()
    if args.verify_reuse_ms is not None:
        flags = ("--verify-reuse-ms", f"{args.verify_reuse_ms:g}")
    res["verify_reuse_ms"] = args.verify_reuse_ms if flags else "default"
    with running_daemon(args.profile_daemon, args.log_level, flags) as d:
        if "handoff" in only:
            with own_processes(d, 2) as pids:
                res["handoff"] = bench_handoff(d.socket, args.cycles, args.warmup, pids)
            _wait_no_workloads(d.socket)
        if "reacquire" in only:
            with own_processes(d, 1) as pids:
                res["reacquire"] = bench_reacquire(d.socket, args.cycles, args.warmup, pids[0])
            _wait_no_workloads(d.socket)
        if "cascade" in only:
            interval_s = args.status_interval_ms / 1e3
            with own_processes(d, 2) as pids:
                res["cascade"] = bench_cascade(d.socket, args.waiters, interval_s, pids)
        log_tail = d.log.read_text(errors="replace")[-2000:]
    res["daemon_rc"] = d.rc
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]

    ok = d.rc == 0
    if "handoff" in res:
        h = res["handoff"]
        h["verdict"] = verdict(h["handoff_us"]["p50"], TARGETS["handoff_p50_us"])
        ok = ok and h["turns_increasing"]
    if "reacquire" in res:
        r = res["reacquire"]
        r["verdict"] = verdict(r["acquire_us"]["p50"], TARGETS["acquire_p50_us"])
        ok = ok and r["restored_regrants"] == 0
    if "cascade" in res:
        c = res["cascade"]
        c["verdict"] = verdict(c["status_during_ms"].get("max", math.inf), TARGETS["status_max_ms"])
        c["fifo_verdict"] = "PASS" if c["fifo_by_turn"] and c["quiet"]["fifo_by_turn"] else "FAIL"
        ok = ok and c["fifo_by_turn"] and not c["errors"] and c["queue_len_before"] == args.waiters
        ok = ok and c["quiet"]["fifo_by_turn"] and not c["quiet"]["errors"]
    if {"handoff", "reacquire"} <= res.keys():
        hp50 = res["handoff"]["handoff_us"]["p50"]
        res["ratios"] = {
            "handoff_over_acquire": round(hp50 / res["reacquire"]["acquire_us"]["p50"], 2),
            "handoff_over_ping": round(hp50 / res["reacquire"]["ping_us"]["p50"], 2),
            "handoff_p99_over_p50": round(res["handoff"]["handoff_us"]["p99"] / hp50, 2),
            "acquire_over_ping": round(
                res["reacquire"]["acquire_us"]["p50"] / res["reacquire"]["ping_us"]["p50"], 2
            ),
            "acquire_p99_over_p50": round(
                res["reacquire"]["acquire_us"]["p99"] / res["reacquire"]["acquire_us"]["p50"], 2
            ),
        }
    res["checks_ok"] = ok

    if args.json_file:
        Path(args.json_file).write_text(json.dumps(res, sort_keys=True))
    if args.json:
        print(json.dumps(res, sort_keys=True))
    elif {"handoff", "reacquire", "cascade"} <= res.keys():
        rows = report(res)
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        print(
            f"slicerd handoff bench (python {res['python']}, {res['cpus']} CPUs,"
            f" loadavg before {res['loadavg_before'][0]}, after {res['loadavg_after'][0]})"
        )
        for r in rows:
            print(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")
        print(f"  checks ok: {ok}   daemon rc: {d.rc}   total: {res['total_s']} s")
    else:
        print(json.dumps(res, indent=2, sort_keys=True))
    if not ok:
        print("---- slicerd log (tail) ----\n" + log_tail, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    run_script(main)
