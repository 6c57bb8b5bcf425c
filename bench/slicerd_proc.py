"""Start and stop a real slicerd on a fake GPU for the benchmarks (no test harness, no trio).

    proc, sock, log = start_fake_slicerd(base, gpus=1, log_level="info")
    ...
    rc = stop(proc)

The daemon gets a fresh fake ledger in ``base``, the cuda-checkpoint stub, and a
NOTIFY_SOCKET of ours; start returns once it sent READY=1 (bounded), as systemd waits.
Its children die with the benchmark (PR_SET_PDEATHSIG), so a crashed run leaves no
orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make stubs importable
    sys.path.insert(0, str(ROOT))

from stubs.fakegpu import Ledger, parse_size  # noqa: E402

TOOL = str(ROOT / "stubs" / "cuda-checkpoint")


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM it if this benchmark dies (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def start_fake_slicerd(
    base: Path,
    gpus: int,
    log_level: str,
    *,
    extra_args: list[str] | None = None,
    profile: str | None = None,
    ready_timeout: float = 20.0,
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """slicerd on a fresh ledger of ``gpus`` fake GPUs in ``base``; (process, socket, log)
    once it sent READY=1; raises with the log's tail if it does not within the bound."""
    gpu_dir = base / "gpu"
    Ledger.init(gpu_dir, gpus, parse_size("80GiB"))
    sock = str(base / "slicer.sock")
    notify_path = str(base / "notify")
    env = {
        **os.environ,
        "FAKEGPU_DIR": str(gpu_dir),
        "FAKEGPU_CC_LOG": str(base / "cc.log"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "NOTIFY_SOCKET": notify_path,
    }
    env.pop("SLICER_SOCKET", None)
    prefix = [sys.executable]
    if profile:  # stats are written when the daemon exits on SIGTERM
        prefix += ["-m", "cProfile", "-o", os.path.abspath(profile)]
    cmd = [*prefix, "-m", "gpu_slicer.slicer.daemon", *(extra_args or [])]
    cmd += ["--socket", sock, "--gpu-backend", "fake", "--cuda-checkpoint", TOOL]
    cmd += ["--state-dir", str(base / "state"), "--log-level", log_level]
    log = base / "slicerd.log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(notify_path)
        notify.settimeout(ready_timeout)
        with open(log, "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                msg = notify.recv(4096)
            except TimeoutError:
                msg = b""
            if b"READY=1" in msg:
                return proc, sock, log
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(
                    f"slicerd did not become ready (rc={proc.poll()}):\n"
                    + log.read_text(errors="replace")[-3000:]
                )


def stop(proc: subprocess.Popen[bytes], timeout: float = 20) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` s; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def run_script(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; 130 on Ctrl-C, also when trio wrapped it in a group."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseExceptionGroup as eg:
        if eg.split(KeyboardInterrupt)[1] is None:
            sys.exit(130)
        raise
