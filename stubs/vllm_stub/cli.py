"""``python -m stubs.vllm_stub serve MODEL [options]``: the ``vllm serve`` command line.

Unknown flags are refused (argparse, exit 2) as vLLM refuses them. Besides vLLM's own
flags it takes the stub's fake-GPU knobs (``--weights-bytes`` and friends) and fault
injection flags (``--fail-reload``, ``--hang-requests``), and ``--http-server
hypercorn|lean`` (which HTTP server serves the same app).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import trio

from stubs.fakegpu import FakeGpuError, Ledger, parse_size
from stubs.vllm_stub.config import Config
from stubs.vllm_stub.engine import HOLD_SCHEDULER
from stubs.vllm_stub.server import serve

__all__ = ["HTTP_SERVERS", "build_parser", "main", "parse_args"]

HTTP_SERVERS = ("hypercorn", "lean")  # lean: gpu_slicer.dispatcher.httpserver.serve_asgi


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _nonneg(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm", description="vLLM 0.33 API server stand-in")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the OpenAI-compatible API server")
    s.add_argument("model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--enable-sleep-mode", action="store_true")
    s.add_argument("--gpu-memory-utilization", type=_positive, default=0.9)
    s.add_argument("--served-model-name", nargs="+", default=None)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--scheduler-cls", default=None)
    g = s.add_argument_group("stub", "fake GPU and fault injection (not vLLM flags)")
    g.add_argument("--weights-bytes", type=_size, default=parse_size("2GiB"))
    g.add_argument("--context-bytes", type=_size, default=parse_size("512MiB"))
    g.add_argument("--tokens-per-s", type=_positive, default=2000.0)
    g.add_argument("--boot-delay", type=_nonneg, default=0.0)
    g.add_argument("--reload-seconds", type=_nonneg, default=0.05)
    g.add_argument("--fake-workload", default=os.environ.get("FAKEGPU_WORKLOAD") or "vllm")
    g.add_argument("--fail-reload", action="store_true")
    g.add_argument("--hang-requests", action="store_true")
    # Real vLLM 0.32: its EngineCore outlives a SIGKILLed API server, memory and all.
    g.add_argument("--core-outlives-server", action="store_true")
    g.add_argument("--http-server", choices=HTTP_SERVERS, default="hypercorn")
    return p


def visible_gpu() -> int:
    """The GPU index: the first entry of CUDA_VISIBLE_DEVICES, else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first:
        return 0
    if first.isdigit():
        return int(first)
    tail = first.rsplit("-", 1)[-1]  # a fake UUID: GPU-fake-0000-0001
    return int(tail) if tail.isdigit() else 0


def parse_args(argv: list[str] | None = None) -> Config:
    args = build_parser().parse_args(argv)
    if args.gpu_memory_utilization > 1:
        build_parser().error("--gpu-memory-utilization must be in (0, 1]")
    if args.scheduler_cls not in (None, HOLD_SCHEDULER):
        # vLLM imports the class by name; the stub has one scheduler of its own besides
        # the default, the tier's (the same behaviour, see engine.Engine.hold_scheduler).
        build_parser().error(
            f"--scheduler-cls {args.scheduler_cls}: the stub knows only {HOLD_SCHEDULER}"
        )
    return Config(
        model=args.model,
        served_model_names=tuple(args.served_model_name or [args.model]),
        host=args.host,
        port=args.port,
        enable_sleep_mode=args.enable_sleep_mode,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        weights_bytes=args.weights_bytes,
        context_bytes=args.context_bytes,
        tokens_per_s=args.tokens_per_s,
        boot_delay=args.boot_delay,
        reload_seconds=args.reload_seconds,
        workload=args.fake_workload,
        fail_reload=args.fail_reload,
        hang_requests=args.hang_requests,
        core_outlives_server=args.core_outlives_server,
        gpu=visible_gpu(),
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1",
        http_server=args.http_server,
        hold_scheduler=args.scheduler_cls == HOLD_SCHEDULER,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse, check the fake GPU, boot and serve; the process's exit code."""
    cfg = parse_args(argv)
    try:
        Ledger()
    except FakeGpuError as e:
        print(f"vllm stub: no fake GPU: {e}", file=sys.stderr)
        return 1
    # vLLM ignores SIGTERM while its engine starts; server.serve takes it over once up.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return trio.run(serve, cfg)
