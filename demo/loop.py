"""`make demo` (``--mode loop``): the whole train / publish / sample loop on one fake GPU.

Theory of operation
-------------------
Everything runs in one temporary directory: the fake GPU ledger (one GPU of
``--capacity``), slicerd (started as systemd would, READY=1 awaited), and then, each in a
process group of its own and each awaited on an event (a file or a log line, bounded):

1. ``slicer-launch vllm --workload sampler`` with the vLLM stub. The replica's weights
   and KV cache, awake, and the trainer's working set do not fit on the GPU together, so
   every handoff needs the other side parked. The launcher boots it in a boot turn,
   sleeps it, releases, and writes its ready marker.
2. ``slicer-dispatch --workload sampler`` in front of the replica; its event stream
   (``GET /v1/events``) is copied to ``dispatcher-events.jsonl`` for the report.
3. The trainer stub (``park=checkpoint``): ``--revisions`` steps; after each step's turn
   is released it saves rev-K and POSTs it to the dispatcher's ``/v1/revisions``.
4. In this process, the sampling client (`demo.client`): as each revision appears
   it sends ``--requests`` requests pinned to it and long-polls their results.

With ``--pods`` (`make demo-k8s`) it is Kubernetes' node mode: slicerd stays on the host
(the DaemonSet, hostPID) and the launcher, the dispatcher and the trainer run as
containers of one pod, a PID and a mount namespace of their own (`stubs.pods`): they
register pids as their pod sees them, slicerd translates them, and the report is the
same. The pod is killed (everything in it) when the run ends, whatever happened.

The run ends when every request is settled (or the client's deadline passed); then the
trainer must have exited 0, the dispatcher and the launcher get SIGTERM (each ends its
turn cleanly, exit 0 expected; SIGKILL after a bound), and slicerd last. Whatever is
left of any process group is killed by `demo.proc.end_all`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from demo.client import sample_revisions
from demo.proc import (
    DemoError,
    Procs,
    Recording,
    check_alive,
    child_env,
    log_tail,
    reap,
    spawn,
    start_daemon,
    stop,
    watch,
)
from gpu_slicer.dispatcher.events import follow_events
from stubs.fakegpu import Ledger, format_size
from stubs.pods import Pod, running_pod
from stubs.proc import free_port

BOOT_TIMEOUT_S = 60.0
REAL_BOOT_TIMEOUT_S = 900.0  # real vLLM loads weights and compiles first
LISTEN_TIMEOUT_S = 20.0
STOP_GRACE_S = 15.0
SETTLE_S = 5.0
TRAINER_END_S = 30.0
CLIENT_BASE_S = 30.0  # plus per-revision time: the client's whole-run bound
CLIENT_PER_REVISION_S = 15.0
EVENTS_FILE = "dispatcher-events.jsonl"  # the dispatcher's GET /v1/events, as it came

# Sizes: trainer 48 GiB + awake vLLM (0.55 x 80 GiB = 44 GiB: 36 GiB weights, 0.5 GiB
# context, the rest KV cache) > 80 GiB; the slept vLLM keeps only its 0.5 GiB context.
VLLM_WEIGHTS = "36GiB"
VLLM_UTILIZATION = 0.55
VLLM_TOKENS_PER_S = 100
VLLM_RELOAD_S = 0.3
TRAINER_PAUSE_S = 0.5  # off the GPU between steps: the sampler gets its turn


async def _until(
    what: str, cond: Callable[[], bool], timeout: float, procs: Procs, base: Path
) -> None:
    """Wait (polling, bounded) until `cond()`; every child must stay alive meanwhile."""
    with trio.move_on_after(timeout):
        while not cond():
            check_alive(procs, base)
            await trio.sleep(0.05)
        return
    raise DemoError(f"{what} did not happen within {timeout:.0f} s")


def _has_line(log: Path, text: str) -> Callable[[], bool]:
    return lambda: log.exists() and text in log.read_text(errors="replace")


def vllm_command(opts: argparse.Namespace, port: int) -> list[str]:
    """The replica's command line: the stub (fake GPU), or real vLLM with `--real`."""
    if opts.real:
        return ["vllm", "serve", opts.model, "--port", str(port)]
    argv = [sys.executable, "-m", "stubs.vllm_stub", "serve", "demo-model"]
    argv += ["--port", str(port), "--fake-workload", "sampler"]
    argv += ["--weights-bytes", VLLM_WEIGHTS, "--gpu-memory-utilization", str(VLLM_UTILIZATION)]
    argv += ["--tokens-per-s", str(VLLM_TOKENS_PER_S), "--reload-seconds", str(VLLM_RELOAD_S)]
    return argv


def _spawn(
    pod: Pod | None, name: str, argv: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """A child, or with `pod` a container of it (its nsenter parent is returned)."""
    if pod is None:
        return spawn(argv, env, log)
    return pod.spawn(name, argv, env, log).proc


async def _stop(pod: Pod | None, procs: Procs, name: str) -> int:
    """SIGTERM child `name` (a container: its process, not its nsenter parent)."""
    if pod is not None:
        return await pod.containers[name].stop(STOP_GRACE_S)
    return await stop(procs.children[name], STOP_GRACE_S)


async def run_loop(opts: argparse.Namespace, base: Path, procs: Procs, rec: Recording) -> None:
    """The whole loop (module docstring); fills `rec` (events, client report, exit codes)."""
    if not getattr(opts, "pods", False):
        await _run_loop(opts, base, procs, rec, None)
        return
    async with running_pod(base, "job") as pod:
        await _run_loop(opts, base, procs, rec, pod)


async def _run_loop(
    opts: argparse.Namespace, base: Path, procs: Procs, rec: Recording, pod: Pod | None
) -> None:
    env = child_env(base, opts.bandwidth)
    if opts.real:
        daemon_args = ["--gpu-backend", "nvml"]
    else:
        (base / "gpu").mkdir()
        Ledger.init(base / "gpu", 1, opts.capacity)
        daemon_args = None
    sock = await start_daemon(base, env, procs, daemon_args)
    first_grant = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(watch, sock, rec, first_grant)  # subscribed before any REGISTER
        vport, dport = free_port(), free_port()
        ready = base / "sampler.ready"
        argv = [sys.executable, "-m", "gpu_slicer.launcher.main", "vllm", "--workload", "sampler"]
        boot = REAL_BOOT_TIMEOUT_S if opts.real else BOOT_TIMEOUT_S
        argv += ["--socket", sock, "--ready-file", str(ready), "--boot-timeout", f"{boot:g}"]
        argv += ["--health-timeout", f"{boot:g}", "--", *vllm_command(opts, vport)]
        procs.children["sampler"] = _spawn(pod, "sampler", argv, env, base / "sampler.log")
        await _until("the vLLM replica's boot", ready.exists, boot + 10, procs, base)

        dlog = base / "dispatcher.log"
        argv = [sys.executable, "-m", "gpu_slicer.dispatcher.main", "--workload", "sampler"]
        argv += ["--replica", f"http://127.0.0.1:{vport}", "--listen", f"127.0.0.1:{dport}"]
        argv += ["--socket", sock, "--state-dir", str(base / "dispatch")]
        argv += ["--turn-seconds", "1", "--turn-grace", "2", "--concurrency", "64"]
        procs.children["dispatcher"] = _spawn(pod, "dispatcher", argv, env, dlog)
        await _until("the dispatcher's listening", _has_line(dlog, "listening on"),
                     LISTEN_TIMEOUT_S, procs, base)  # fmt: skip

        url = f"http://127.0.0.1:{dport}"
        events = base / EVENTS_FILE

        def keep(event: dict[str, object]) -> None:
            with events.open("a") as f:
                f.write(json.dumps(event) + "\n")

        async def follow(*, task_status: trio.TaskStatus[object]) -> None:
            with contextlib.suppress(httpx.HTTPError):  # a dead dispatcher: its exit says so
                await follow_events(url, keep, task_status=task_status)

        await nursery.start(follow)  # subscribed before the trainer publishes anything
        argv = [sys.executable, "-m", "stubs.trainer_stub", "--socket", sock]
        argv += ["--workload", "trainer", "--bytes", str(opts.bytes), "--work", str(opts.work)]
        argv += ["--steps", str(opts.revisions), "--revisions-dir", str(base / "ckpt")]
        argv += ["--publish-url", url, "--pause", str(TRAINER_PAUSE_S), "--last-park", "now"]
        argv += ["--device", "cuda"] if opts.real else []
        procs.children["trainer"] = _spawn(pod, "trainer", argv, env, base / "trainer.log")

        async def guard() -> None:  # a child that dies (the trainer: with an error) ends it
            while True:
                tr = procs.children["trainer"].poll()
                check_alive(procs, base, [] if tr == 0 else None)
                await trio.sleep(0.1)

        revisions = [f"rev-{k}" for k in range(1, opts.revisions + 1)]
        timeout = CLIENT_BASE_S + CLIENT_PER_REVISION_S * opts.revisions
        async with trio.open_nursery() as inner:
            inner.start_soon(guard)
            rec.client = await sample_revisions(url, revisions, opts.requests, timeout)
            inner.cancel_scope.cancel()

        rec.exit_codes["trainer"] = await reap(procs.children["trainer"], TRAINER_END_S)
        if rec.exit_codes["trainer"] != 0:
            raise DemoError(
                f"the trainer exited with {rec.exit_codes['trainer']}; its log ends:"
                + log_tail(base / "trainer.log")
            )
        # The dispatcher ends a turn it holds (vLLM to sleep, RELEASE) before it exits.
        rec.exit_codes["dispatcher"] = await _stop(pod, procs, "dispatcher")
        rec.stop_local = time.monotonic()
        rec.exit_codes["sampler"] = await _stop(pod, procs, "sampler")
        # Let the daemon notice the closed registrations before it is stopped.
        with trio.move_on_after(SETTLE_S):
            while not {"sampler", "trainer"} <= {
                str(e["workload"]) for e in rec.events if e.get("event") == "unregistered"
            }:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert procs.daemon is not None
    rec.daemon_rc = await stop(procs.daemon, 10.0)


def describe(opts: argparse.Namespace) -> str:
    """One line saying what the loop runs."""
    if opts.real:
        return (
            f"gpu-slicer demo: real vLLM ({opts.model}), cuda-checkpoint and NVML; "
            f"{opts.revisions} training steps x {opts.requests} requests"
        )
    awake = int(VLLM_UTILIZATION * opts.capacity)
    where = (
        "; node mode: slicerd on the host, the job's processes in a pod (PID + mount namespace)"
        if getattr(opts, "pods", False)
        else ""
    )
    return (
        f"gpu-slicer demo: one {format_size(opts.capacity)} fake GPU; trainer "
        f"{format_size(opts.bytes)} (cuda-checkpoint at {opts.bandwidth}/s) and vLLM sampler "
        f"{format_size(awake)} awake (weights {VLLM_WEIGHTS}) never both fit; "
        f"{opts.revisions} training steps x {opts.requests} requests each{where}"
    )
