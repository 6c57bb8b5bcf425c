"""Wake, reload, generate and sleep times of a real vLLM (CPU) and of the stub.

    make bench-vllm            # after `make test-vllm` installed the real server
    .venv/bin/python bench/vllm_cycle.py --cycles 50

Boots the real server (``vllm_tier.servers``, the tier's flags) and the stub on the
same tiny model, then runs CYCLES turns on each, as the dispatcher does them:
``POST /wake_up``, ``collective_rpc reload_weights`` (alternating rev-1 / rev-2),
``update_weight_version``, ``reset_prefix_cache``, ``GET /weight_info``, one greedy
completion of 8 tokens, ``POST /sleep?level=1&mode=abort``.
Prints the median and p99 of each call in milliseconds and the real/stub ratio. On CPU
vLLM ignores sleep (no memory moves), so wake and sleep measure the HTTP and engine
round trip, not a weight transfer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stubs.fakegpu import Ledger, parse_size
from vllm_tier import servers as sv

STEPS = ("wake", "reload", "version", "reset_cache", "weight_info", "generate", "sleep")


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def cycles(url: str, models: Path, n: int) -> dict[str, list[float]]:
    """``n`` dispatcher-like turns against ``url``; seconds per step."""
    out: dict[str, list[float]] = {k: [] for k in STEPS}
    with httpx.Client(base_url=url, timeout=120) as http:
        http.post("/sleep", params={"level": 1}).raise_for_status()
        for i in range(n):
            rev = f"rev-{1 + i % 2}"
            calls = {
                "wake": lambda: http.post("/wake_up"),
                "reload": lambda rev=rev: http.post(
                    "/collective_rpc",
                    json={
                        "method": "reload_weights",
                        "kwargs": {"weights_path": str(models / rev)},
                    },
                ),
                "version": lambda rev=rev: http.post(
                    "/update_weight_version", json={"new_version": rev}
                ),
                "reset_cache": lambda: http.post("/reset_prefix_cache"),
                "weight_info": lambda: http.get("/weight_info"),
                "generate": lambda: http.post(
                    "/v1/completions",
                    json={"prompt": "hello world", "max_tokens": 8, "temperature": 0},
                ),
                "sleep": lambda: http.post("/sleep", params={"level": 1, "mode": "abort"}),
            }
            for step in STEPS:
                t0 = time.perf_counter()
                calls[step]().raise_for_status()
                out[step].append(time.perf_counter() - t0)
    return out


def main() -> int:
    """Boot both servers, run the cycles, print the table."""
    p = argparse.ArgumentParser(prog="vllm_cycle")
    p.add_argument("--cycles", type=int, default=50)
    args = p.parse_args()
    models = sv.models_dir()
    base = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    gpu = base / "gpu"
    gpu.mkdir()
    Ledger.init(gpu, 1, parse_size("80GiB"))
    env = {**os.environ, "FAKEGPU_DIR": str(gpu)}
    rp, sp = sv.free_port(), sv.free_port()
    real = sv.start(
        "real",
        sv.real_argv(models / "base", rp),
        sv.real_env(env, base / "cache"),
        base / "real.log",
        sv.REAL_READY,
        rp,
    )
    stub = sv.start(
        "stub",
        sv.stub_argv(models / "base", sp, "--enable-sleep-mode"),
        {**env, "VLLM_SERVER_DEV_MODE": "1"},
        base / "stub.log",
        sv.STUB_READY,
        sp,
    )
    t0 = time.monotonic()
    with sv.running([real, stub]):
        print(f"both servers ready after {time.monotonic() - t0:.1f} s (booted together)")
        got = {s.name: cycles(s.url, models, args.cycles) for s in (real, stub)}
    print(f"\n{args.cycles} turns each (ms)      real median    p99    stub median    p99   ratio")
    for step in STEPS:
        r, s = got["real"][step], got["stub"][step]
        rm, sm = statistics.median(r) * 1e3, statistics.median(s) * 1e3
        print(
            f"  {step:<22} {rm:11.2f} {_p99(r) * 1e3:7.2f} {sm:13.2f} "
            f"{_p99(s) * 1e3:7.2f} {rm / sm:7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
