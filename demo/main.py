"""`make demo`: the gpu-slicer loop on a fake GPU, in one command.

    python -m demo [--mode loop|trainers] [--pods] [--pool] [--json] [--keep DIR] ...

``--mode loop`` (the default, `demo.loop`): slicerd, a vLLM replica (the stub)
under ``slicer-launch``, ``slicer-dispatch`` in front of it, a trainer stub whose every
step publishes a revision, and a client sampling each revision ``--requests`` times. It
prints a timeline of who held the GPU, park/restore times, the GPU busy fraction, the
overlap count and how many requests were served with their revision, and writes the
timeline as a PNG (``--png``). ``--pods`` (`make demo-k8s`) runs the same loop in
Kubernetes' node mode, the job's processes in a simulated pod (`demo.loop`; needs root,
``unshare`` and ``nsenter``: says what is missing, exit 2). ``--real`` runs the same loop
with real vLLM, cuda-checkpoint and NVML, or says exactly what is missing (exit 2,
nothing started). ``--pool`` (`make demo-pool`, `demo.pool`) runs the loop across three
simulated nodes sharing one sampling pool on a real Redis: a per-node timeline and a pool
summary (``--revisions`` x ``--requests`` through every node's front; needs
``redis-server`` 7: says so, exit 2).

``--mode trainers``: slicerd and ``--trainers`` trainer stubs taking turns.

Theory of operation (trainers mode)
-----------------------------------
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
the first grant. The report: a timeline chart (``#`` holds the GPU, ``p`` park,
``r`` restore, ``.`` otherwise; in loop mode ``w`` vLLM wake + weight load and ``s``
vLLM sleep inside the sampler's turns), the turns, park and restore milliseconds per
workload, the GPU busy fraction, and the fake GPU's overlap count. Exit status 0 only
when there were no overlaps, no faults, no two turns at once and at least two handoffs
(loop mode: and every request served with its revision); 1 otherwise (the temporary
directory is then kept for inspection); 2 on bad usage (and ``--real`` lacking
something).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from demo.proc import (
    TOOL,
    DemoError,
    Interrupted,
    Procs,
    Recording,
    check_alive,
    child_env,
    end_all,
    on_signal,
    only,
    print_log_tail,
    reap,
    signals_held,
    spawn,
    start_daemon,
    watch,
)
from demo.report import build_report, render
from stubs.fakegpu import Ledger, parse_size

FIRST_GRANT_TIMEOUT_S = 30.0
TRAINER_GRACE_S = 5.0
DAEMON_GRACE_S = 10.0
SETTLE_S = 5.0
EXTEND_MAX_S = 20.0
MAX_SOCKET_PATH = 100
DEFAULT_PNG = "demo-out/timeline.png"

Runner = Callable[[argparse.Namespace, Path, Procs, Recording], Awaitable[None]]


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


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from e
    if not 1 <= value <= 10000:
        raise argparse.ArgumentTypeError(f"must be in [1, 10000]: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's options."""
    p = argparse.ArgumentParser(
        prog="python -m demo",
        description="The gpu-slicer loop on a fake GPU: slicerd, a vLLM replica under "
        "slicer-launch, slicer-dispatch, a trainer publishing revisions and a sampling "
        "client (--mode loop); or trainer stubs taking turns (--mode trainers).",
    )
    p.add_argument(
        "--mode",
        choices=["loop", "trainers"],
        default="loop",
        help="loop: the whole train/publish/sample loop (default); trainers: stubs taking turns",
    )
    p.add_argument("--json", action="store_true", help="print one JSON report only")
    p.add_argument("--keep", metavar="DIR", help="run in DIR (created) and keep it")
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
    g = p.add_argument_group("loop mode")
    g.add_argument("--revisions", type=_count, default=5, help="training steps (revisions)")
    g.add_argument("--requests", type=_count, default=100, help="sampling requests per revision")
    g.add_argument("--png", default=DEFAULT_PNG, help="where to write the timeline chart")
    g.add_argument(
        "--real",
        action="store_true",
        help="real vLLM, cuda-checkpoint and NVML (says what is missing, exit 2)",
    )
    g.add_argument("--model", help="--real: the model vLLM serves")
    g.add_argument(
        "--pods",
        action="store_true",
        help="node mode: slicerd on the host, the job's processes in a simulated pod "
        "(a PID + mount namespace; needs root, unshare, nsenter)",
    )
    g.add_argument(
        "--pool",
        action="store_true",
        help="three nodes (each a fake GPU, slicerd, trainer, vLLM stub, dispatcher) "
        "sharing one sampling pool on a real Redis (needs redis-server 7)",
    )
    g = p.add_argument_group("trainers mode")
    g.add_argument(
        "--seconds", type=_positive, default=10.0, help="run length after the first grant"
    )
    g.add_argument("--trainers", type=int, default=2, help="trainer stubs sharing GPU 0 (>= 2)")
    g.add_argument(
        "--min-handoffs",
        type=int,
        default=2,
        help=f"run past --seconds (at most {EXTEND_MAX_S:.0f} s more) until this many handoffs",
    )
    return p


# ---- trainers mode -------------------------------------------------------------------


async def _run_trainers(opts: argparse.Namespace, base: Path, procs: Procs, rec: Recording) -> None:
    env = child_env(base, opts.bandwidth)
    (base / "gpu").mkdir()
    Ledger.init(base / "gpu", 1, opts.capacity)
    sock = await start_daemon(base, env, procs)
    first_grant = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(watch, sock, rec, first_grant)  # subscribed before any REGISTER
        for k in range(1, opts.trainers + 1):
            name = f"trainer-{k}"
            argv = [sys.executable, "-m", "stubs.trainer_stub", "--socket", sock]
            argv += ["--workload", name, "--bytes", str(opts.bytes), "--work", str(opts.work)]
            argv += ["--steps", "1000000000"]
            procs.children[name] = spawn(argv, env, base / f"{name}.log")
        with trio.move_on_after(FIRST_GRANT_TIMEOUT_S):
            while not first_grant.is_set():
                check_alive(procs, base)
                with trio.move_on_after(0.1):
                    await first_grant.wait()
        if not first_grant.is_set():
            raise DemoError(f"no trainer was granted a turn within {FIRST_GRANT_TIMEOUT_S:.0f} s")
        end = trio.current_time() + opts.seconds
        while trio.current_time() < end:
            check_alive(procs, base)
            await trio.sleep(min(0.1, max(0.0, end - trio.current_time())))
        # A slow machine may not have shown enough handoffs yet: run on, bounded.
        limit = trio.current_time() + EXTEND_MAX_S
        while _live_handoffs(rec) < opts.min_handoffs and trio.current_time() < limit:
            check_alive(procs, base)
            await trio.sleep(0.05)
        rec.extended_s = max(0.0, trio.current_time() - end)
        rec.stop_local = time.monotonic()
        check_alive(procs, base)
        for p in procs.children.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in procs.children.items():
            rec.exit_codes[name] = await reap(p, TRAINER_GRACE_S)
        # Let the daemon notice the closed connections before it is stopped.
        with trio.move_on_after(SETTLE_S):
            while len(_names(rec, "unregistered")) < len(procs.children):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert procs.daemon is not None
    procs.daemon.send_signal(signal.SIGTERM)
    rec.daemon_rc = await reap(procs.daemon, DAEMON_GRACE_S)


def _live_handoffs(rec: Recording) -> int:
    """Grants so far that went to another workload than the grant before."""
    grants = [str(e["workload"]) for e in rec.events if e.get("event") == "granted"]
    return sum(1 for a, b in itertools.pairwise(grants) if a != b)


def _names(rec: Recording, kind: str) -> set[str]:
    return {str(e["workload"]) for e in rec.events if e.get("event") == kind}


async def _run(runner: Runner, opts: argparse.Namespace, base: Path, procs: Procs,
               rec: Recording) -> None:  # fmt: skip
    async with trio.open_nursery() as outer:
        await outer.start(on_signal)
        await runner(opts, base, procs, rec)
        outer.cancel_scope.cancel()


# ---- entry point ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when it showed clean turns (and, in loop mode, every request
    served with its revision), 1 when not, 2 on bad usage or `--real` lacking something."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.bytes > opts.capacity:
        parser.error("--bytes: a working set must fit on the GPU (--capacity)")
    if opts.mode == "trainers" and opts.trainers < 2:
        parser.error("--trainers must be at least 2 (a handoff needs two)")
    if opts.real and opts.mode != "loop":
        parser.error("--real runs the loop (--mode loop)")
    if opts.pods and (opts.real or opts.mode != "loop"):
        parser.error("--pods runs the loop on the fake GPU (--mode loop, no --real)")
    if opts.pods and (why := _pods_missing()):
        print(f"demo --pods: cannot run here: {why}", file=sys.stderr)
        return 2
    if opts.pool and (opts.real or opts.pods or opts.mode != "loop"):
        parser.error("--pool runs the loop on fake GPUs (--mode loop, no --real, no --pods)")
    if opts.pool:
        from demo.pool import missing as pool_missing

        if why := pool_missing():
            print(f"demo --pool: cannot run here: {why}", file=sys.stderr)
            return 2
    try:
        parse_size(opts.bandwidth)
    except ValueError as e:
        parser.error(f"--bandwidth: {e}")
    if opts.real:
        from demo.real import missing

        lacking = missing(opts.model)
        if lacking:
            print("demo --real: cannot run here; missing:", file=sys.stderr)
            for line in lacking:
                print(f"  - {line}", file=sys.stderr)
            print("demo --real: nothing was started (run without --real for the fake GPU)",
                  file=sys.stderr)  # fmt: skip
            return 2
    elif not TOOL.exists():
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
    if opts.pool:
        from demo.pool import execute_pool

        return execute_pool(opts, base, keep=bool(opts.keep))
    return _execute(opts, base)


def _pods_missing() -> str:
    """Why a pod cannot be simulated here ('' when it can)."""
    if os.geteuid() != 0:
        return "making PID and mount namespaces needs root"
    tools = [tool for tool in ("unshare", "nsenter", "mount", "bash") if not shutil.which(tool)]
    return f"no {', '.join(tools)} on PATH" if tools else ""


def _execute(opts: argparse.Namespace, base: Path) -> int:
    loop = opts.mode == "loop"
    if loop:
        from demo.loop import run_loop
        from demo.loop_report import build_loop_report, render_loop, write_png

        runner: Runner = run_loop
    else:
        runner = _run_trainers
    if not opts.json:
        what = (
            f"{opts.revisions} revisions x {opts.requests} requests"
            if loop
            else f"{opts.seconds:g} s"
        )
        mode = f"{opts.mode} mode" + (" (node mode, in a pod)" if opts.pods else "")
        print(f"demo: {mode}, running in {base} ({what}) ...", flush=True)
    procs, rec = Procs(), Recording()
    keep = bool(opts.keep)
    try:
        try:
            trio.run(_run, runner, opts, base, procs, rec)
        finally:
            with signals_held():
                end_all(procs)
        ledger = None if opts.real else Ledger(base / "gpu")
        if loop:
            report = build_loop_report(opts, rec, ledger, base)
            write_png(report, Path(opts.png).resolve())
        else:
            assert ledger is not None
            report = build_report(opts, rec, ledger, base)
        keep = keep or not report["ok"]
    except BaseException as e:
        keep = True
        err = only(e)
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
        for log in sorted(base.glob("*.log")):
            print_log_tail(log)
        print(f"demo: logs kept in {base}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    if not keep:
        report["dir"] = None
    if opts.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_loop(report) if loop else render(report))
    if not report["ok"]:
        print(f"demo: FAILED; logs kept in {base}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
