"""`make demo`: slicerd on the fake GPU, trainer stubs taking turns on GPU 0.

    python -m slicer.demo [--seconds 10] [--trainers 2] [--json] [--keep DIR]

Theory of operation
-------------------
A fresh temporary directory holds everything: the fake GPU ledger (one GPU of
``--capacity``), slicerd's socket, state and log, and one log per trainer. slicerd is
started exactly as systemd would (``NOTIFY_SOCKET``, wait for ``READY=1``, bounded); a
WATCH connection records every EVENT with the local time it arrived. Then ``--trainers``
trainer stubs register themselves (``park=checkpoint``) and loop: acquire a turn, put
their working set on the GPU, "train" ``--work`` seconds, release. The working sets are
sized so that two of them do not fit on the GPU together: every handoff needs a park
(cuda-checkpoint stub, ``--bandwidth``) of the previous holder and, from the second turn
on, a restore of the next one.

The run lasts ``--seconds`` from the first grant, longer (at most ``EXTEND_MAX_S``) on a
machine too slow to show ``--min-handoffs`` handoffs by then. Then the trainers get
SIGTERM (SIGKILL after a bound), slicerd gets SIGTERM (SIGKILL after a bound), and
whatever is left of their process groups is killed: the demo leaves no process behind.

Every time in the report is on the daemon's clock (the ``t`` of its events), relative to
the first grant. The report: a timeline chart (``#`` holds the GPU, ``p`` parking,
``r`` restoring, ``.`` otherwise), the turns, park and restore milliseconds per
workload, the GPU busy fraction, and the fake GPU's overlap count. Exit status 0 only
when there were no overlaps, no faults, no two turns at once and at least two handoffs;
1 otherwise (the temporary directory is then kept for inspection); 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

import proto
from slicer.client import AsyncSlicer, ClientError
from slicer.demo_report import build_report, render
from stubs.fakegpu import Ledger, parse_size

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "stubs" / "cuda-checkpoint"
READY_TIMEOUT_S = 20.0
FIRST_GRANT_TIMEOUT_S = 30.0
TRAINER_GRACE_S = 5.0
DAEMON_GRACE_S = 10.0
GROUP_GRACE_S = 5.0
SETTLE_S = 5.0
EXTEND_MAX_S = 20.0
MAX_SOCKET_PATH = 100


class DemoError(Exception):
    """The demo could not run (the daemon did not start, a trainer died early, ...)."""


class Interrupted(DemoError):
    """A signal ended the run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Procs:
    """Every child we started, so that `finally` can always end them."""

    daemon: subprocess.Popen[bytes] | None = None
    trainers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def all(self) -> list[subprocess.Popen[bytes]]:
        """The daemon and the trainers (those started)."""
        return [*self.trainers.values(), *([self.daemon] if self.daemon else [])]


@dataclass
class Recording:
    """What one run saw: events (with local arrival time) and the stop moment."""

    events: list[dict[str, Any]] = field(default_factory=list)
    first_grant_local: float | None = None
    stop_local: float | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)
    daemon_rc: int | None = None
    extended_s: float = 0.0


# ---- options -----------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from e
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"must be in (0, 86400): {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's options."""
    p = argparse.ArgumentParser(
        prog="python -m slicer.demo",
        description="slicerd on the fake GPU with trainer stubs taking turns on GPU 0.",
    )
    p.add_argument(
        "--seconds", type=_positive, default=10.0, help="run length after the first grant"
    )
    p.add_argument("--trainers", type=int, default=2, help="trainer stubs sharing GPU 0 (>= 2)")
    p.add_argument("--capacity", type=_size, default=parse_size("80GiB"), help="fake GPU memory")
    p.add_argument(
        "--bytes", type=_size, default=parse_size("48GiB"), help="working set per trainer"
    )
    p.add_argument(
        "--bandwidth",
        default="200GB",
        help="host<->device bytes/s of the cuda-checkpoint stub (48GiB at 200GB/s: ~0.26 s a move)",
    )
    p.add_argument("--work", type=_positive, default=0.5, help="seconds per training step")
    p.add_argument(
        "--min-handoffs",
        type=int,
        default=2,
        help=f"run past --seconds (at most {EXTEND_MAX_S:.0f} s more) until this many handoffs",
    )
    p.add_argument("--json", action="store_true", help="print one JSON report only")
    p.add_argument("--keep", metavar="DIR", help="run in DIR (created) and keep it")
    return p


# ---- the run -------------------------------------------------------------------------


def _env(base: Path, bandwidth: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SLICER_SOCKET", None)
    env.pop("SLICER_WORKLOAD", None)
    env.pop("NOTIFY_SOCKET", None)
    env.update(
        FAKEGPU_DIR=str(base / "gpu"),
        FAKEGPU_BANDWIDTH=bandwidth,
        FAKEGPU_CC_LOG=str(base / "cc.log"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        # The cuda-checkpoint stub runs under `env python3`: make that our interpreter
        # (which has psutil), not a shim that would re-exec it, so moves cost less.
        PATH=os.pathsep.join(
            p for p in (os.path.dirname(sys.executable), env.get("PATH", "")) if p
        ),
    )
    return env


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our own process group: cleanup can reach grandchildren
        )


async def _start_daemon(base: Path, env: dict[str, str], procs: Procs) -> str:
    sock = str(base / "slicer.sock")
    notify_path = str(base / "notify")
    args = [
        *("--socket", sock, "--gpu-backend", "fake", "--cuda-checkpoint", str(TOOL)),
        *("--state-dir", str(base / "state"), "--log-level", "info"),
    ]
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(notify_path)
        procs.daemon = _spawn(
            [sys.executable, "-m", "slicer.daemon", *args],
            {**env, "NOTIFY_SOCKET": notify_path},
            base / "slicerd.log",
        )
        deadline = trio.current_time() + READY_TIMEOUT_S
        while True:
            if procs.daemon.poll() is not None:
                raise DemoError(f"slicerd exited with {procs.daemon.returncode} before READY=1")
            if trio.current_time() > deadline:
                raise DemoError(f"slicerd sent no READY=1 within {READY_TIMEOUT_S:.0f} s")
            with trio.move_on_after(0.2):
                if b"READY=1" in await notify.recv(4096):
                    break
    os.unlink(notify_path)
    return sock


async def _watch(sock: str, rec: Recording, first_grant: trio.Event) -> None:
    """Record every EVENT (until cancelled or the daemon goes away)."""
    with contextlib.suppress(ClientError):
        async with await AsyncSlicer.connect(sock) as c:
            await c.request(proto.Watch())
            while True:
                msg = await c.next_message()
                if not isinstance(msg, proto.Event) or not isinstance(msg.body, dict):
                    continue
                rec.events.append({**msg.body, "_recv": time.monotonic()})
                if msg.body.get("event") == "granted" and not first_grant.is_set():
                    rec.first_grant_local = time.monotonic()
                    first_grant.set()


def _check_alive(procs: Procs, base: Path) -> None:
    """Raise DemoError when slicerd or a trainer has exited before the stop."""
    if procs.daemon is not None and procs.daemon.poll() is not None:
        raise DemoError(f"slicerd exited with {procs.daemon.returncode} during the run")
    for name, p in procs.trainers.items():
        if p.poll() is not None:
            log = base / f"{name}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            raise DemoError(
                f"{name} exited with {p.returncode} during the run; its log ends:\n  "
                + "\n  ".join(tail)
            )


async def _run(opts: argparse.Namespace, base: Path, procs: Procs, rec: Recording) -> None:
    async with trio.open_nursery() as outer:
        await outer.start(_on_signal)
        await _run_body(opts, base, procs, rec)
        outer.cancel_scope.cancel()


async def _on_signal(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """SIGTERM or SIGHUP ends the run like Ctrl-C does (trio turns SIGINT into
    KeyboardInterrupt): through the cleanup, never leaving children behind."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            raise Interrupted(signum)


async def _run_body(opts: argparse.Namespace, base: Path, procs: Procs, rec: Recording) -> None:
    env = _env(base, opts.bandwidth)
    (base / "gpu").mkdir()
    Ledger.init(base / "gpu", 1, opts.capacity)
    sock = await _start_daemon(base, env, procs)
    first_grant = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch, sock, rec, first_grant)
        await trio.sleep(0.05)  # let WATCH subscribe before the first REGISTER
        for k in range(1, opts.trainers + 1):
            name = f"trainer-{k}"
            argv = [sys.executable, "-m", "stubs.trainer_stub", "--socket", sock]
            argv += ["--workload", name, "--bytes", str(opts.bytes), "--work", str(opts.work)]
            argv += ["--steps", "1000000000"]
            procs.trainers[name] = _spawn(argv, env, base / f"{name}.log")
        with trio.move_on_after(FIRST_GRANT_TIMEOUT_S):
            while not first_grant.is_set():
                _check_alive(procs, base)
                with trio.move_on_after(0.1):
                    await first_grant.wait()
        if not first_grant.is_set():
            raise DemoError(f"no trainer was granted a turn within {FIRST_GRANT_TIMEOUT_S:.0f} s")
        end = trio.current_time() + opts.seconds
        while trio.current_time() < end:
            _check_alive(procs, base)
            await trio.sleep(min(0.1, max(0.0, end - trio.current_time())))
        # A slow machine may not have shown enough handoffs yet: run on, bounded.
        limit = trio.current_time() + EXTEND_MAX_S
        while _live_handoffs(rec) < opts.min_handoffs and trio.current_time() < limit:
            _check_alive(procs, base)
            await trio.sleep(0.05)
        rec.extended_s = max(0.0, trio.current_time() - end)
        rec.stop_local = time.monotonic()
        _check_alive(procs, base)
        for p in procs.trainers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in procs.trainers.items():
            rec.exit_codes[name] = await _reap(p, TRAINER_GRACE_S)
        # Let the daemon notice the closed connections before it is stopped.
        with trio.move_on_after(SETTLE_S):
            while len(_names(rec, "unregistered")) < len(procs.trainers):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert procs.daemon is not None
    procs.daemon.send_signal(signal.SIGTERM)
    rec.daemon_rc = await _reap(procs.daemon, DAEMON_GRACE_S)


def _live_handoffs(rec: Recording) -> int:
    """Grants so far that went to another workload than the grant before."""
    grants = [str(e["workload"]) for e in rec.events if e.get("event") == "granted"]
    return sum(1 for a, b in itertools.pairwise(grants) if a != b)


def _names(rec: Recording, kind: str) -> set[str]:
    return {str(e["workload"]) for e in rec.events if e.get("event") == kind}


async def _reap(p: subprocess.Popen[bytes], grace: float) -> int:
    """Wait `grace` seconds for `p`, then SIGKILL it; its exit status."""
    with trio.move_on_after(grace):
        while p.poll() is None:
            await trio.sleep(0.05)
    if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
    return p.returncode


def _end_all(procs: Procs) -> None:
    """Synchronous last resort: end every child and every process of their groups."""
    for p in procs.all():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TRAINER_GRACE_S
    for p in procs.all():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    # Grandchildren (cuda-checkpoint runs of slicerd) live in their leader's group; the
    # tool is never killed mid-operation by slicerd, so give it a while to finish first.
    deadline = time.monotonic() + GROUP_GRACE_S
    for pgid in [p.pid for p in procs.all()]:
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# ---- entry point ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when it showed clean turns, 1 when not, 2 on bad usage."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.bytes > opts.capacity:
        parser.error("--bytes: a working set must fit on the GPU (--capacity)")
    if opts.trainers < 2:
        parser.error("--trainers must be at least 2 (a handoff needs two)")
    try:
        parse_size(opts.bandwidth)
    except ValueError as e:
        parser.error(f"--bandwidth: {e}")
    if not TOOL.exists():
        print(f"demo: no cuda-checkpoint stub at {TOOL} (run from a checkout)", file=sys.stderr)
        return 1
    if opts.keep:
        base = Path(opts.keep).resolve()
        base.mkdir(parents=True, exist_ok=True)
        if any(base.iterdir()):
            parser.error(f"--keep: {base} is not empty")
    else:
        base = Path(tempfile.mkdtemp(prefix="slicer-demo-"))
    if len(str(base / "slicer.sock")) > MAX_SOCKET_PATH:
        parser.error(f"{base} is too long a path for a Unix socket")
    if not opts.json:
        print(f"demo: running in {base} for {opts.seconds:g} s ...", flush=True)
    procs, rec = Procs(), Recording()
    keep = bool(opts.keep)
    try:
        try:
            trio.run(_run, opts, base, procs, rec)
        finally:
            with _signals_held():
                _end_all(procs)
        report = build_report(opts, rec, Ledger(base / "gpu"), base)
        keep = keep or not report["ok"]
    except BaseException as e:
        keep = True
        err = _only(e)
        if isinstance(err, KeyboardInterrupt):
            err = Interrupted(signal.SIGINT)
        if not isinstance(err, DemoError):
            print(f"demo: crashed; logs kept in {base}", file=sys.stderr)
            raise
        if isinstance(err, Interrupted):
            keep = bool(opts.keep)
            print(f"demo: {err}", file=sys.stderr)
            return 128 + err.signum
        print(f"demo: FAILED: {err}", file=sys.stderr)
        _print_log_tail(base / "slicerd.log")
        print(f"demo: logs kept in {base}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    if not keep:
        report["dir"] = None
    print(json.dumps(report, indent=2) if opts.json else render(report))
    if not report["ok"]:
        print(f"demo: FAILED; logs kept in {base}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _only(e: BaseException) -> BaseException:
    """The one exception inside `e` (trio wraps what a nursery raises in groups)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while the (bounded) cleanup ends our children."""
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, signal.SIG_IGN) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _print_log_tail(log: Path) -> None:
    if log.exists():
        print("---- slicerd log (tail) ----", file=sys.stderr)
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
