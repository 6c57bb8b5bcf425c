"""Start the real vLLM server (CPU build) and the stub the same way, for the tier's tests.

``make test-vllm`` sets ``SLICER_VLLM_PYTHON`` (the vLLM venv's interpreter) and
``SLICER_VLLM_MODELS`` (what ``build_models.py`` built). A server is a process group of
its own; readiness is the line the server prints once it listens (uvicorn's
"Application startup complete." for vLLM, "listening on" for the stub), read by a
thread that copies every line to a log file, so a wait is an event with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from stubs.proc import free_port as free_port  # the tier's tests take it from here

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "tiny"
BOOT_TIMEOUT_S = 420.0  # a cold vLLM boot on 2 busy cores, with headroom
STOP_GRACE_S = 15.0
# float32: the tiny revisions' own dtype (build_models.py saves float32). vLLM's default for
# them on the CPU is bfloat16, whose kernels use AMX where the CPU reports it: in a VM that
# reports AMX without enabling it, the worker died of SIGILL (exit -4) at its first step.
REAL_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128"]
REAL_FLAGS += ["--kv-cache-memory-bytes", "67108864"]
# The contract pair's servers (conftest.pair) take both: a request with the xarg
# tier_hold_after=K stays running after K tokens until aborted (hold.py); every other
# request is scheduled as by vLLM's default scheduler.
HOLD_FLAGS = ["--scheduler-cls", "vllm_tier.hold.HoldScheduler"]


class TierSetupError(RuntimeError):
    """The tier's environment is missing or a server did not start."""


def vllm_python() -> str:
    """The vLLM venv's interpreter (``SLICER_VLLM_PYTHON``)."""
    py = os.environ.get("SLICER_VLLM_PYTHON")
    if not py or not Path(py).exists():
        raise TierSetupError("SLICER_VLLM_PYTHON is not set or missing: run `make test-vllm`")
    return py


def models_dir() -> Path:
    """The built tiny model revisions (``SLICER_VLLM_MODELS``)."""
    d = os.environ.get("SLICER_VLLM_MODELS")
    if not d or not (Path(d) / ".built").exists():
        raise TierSetupError("SLICER_VLLM_MODELS is not set or not built: run `make test-vllm`")
    return Path(d).resolve()


def real_env(base: dict[str, str], cache: Path, dev: bool = True) -> dict[str, str]:
    """The environment the real CPU server needs: offline, its own cache, dev routes."""
    env = {k: v for k, v in base.items() if k != "VLLM_SERVER_DEV_MODE"}
    env.update(
        VLLM_CPU_CI_ENV="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(cache),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    if dev:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def real_argv(model: Path, port: int) -> list[str]:
    """The real server's command line (``vllm serve`` as a module: see the Makefile)."""
    argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    return argv + REAL_FLAGS


def stub_argv(model: Path, port: int, *flags: str) -> list[str]:
    """The stub's command line, with the same model directory and served name."""
    argv = [sys.executable, "-m", "stubs.vllm_stub", "serve", str(model)]
    argv += ["--served-model-name", MODEL_NAME, "--port", str(port), "--max-model-len", "128"]
    return argv + list(flags)


@dataclass
class Server:
    """One running server process group and its log."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    ready: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = BOOT_TIMEOUT_S) -> None:
        """Block until the server printed its ready line (or raise with its log)."""
        if not self.ready.wait(timeout) or (self.ended.is_set() and not self.ready.is_set()):
            raise TierSetupError(f"{self.name} did not start in {timeout:g} s:\n{self.tail()}")

    def stop(self) -> int | None:
        """SIGTERM the group, SIGKILL after a grace; the exit code."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # engine-core children too
        code = self.proc.wait(STOP_GRACE_S)
        self.ended.wait(STOP_GRACE_S)
        return code


def _pump(server: Server, marker: bytes) -> None:
    assert server.proc.stdout is not None
    with server.proc.stdout, open(server.log, "ab") as log:
        for line in server.proc.stdout:
            log.write(line)
            log.flush()
            if marker in line:
                server.ready.set()
    server.ended.set()
    server.ready.set()  # wake a waiter: wait_ready tells an exit from readiness


def start(
    name: str, argv: list[str], env: dict[str, str], log: Path, marker: bytes, port: int
) -> Server:
    """Start ``argv`` in a new session, its output copied to ``log``; not yet ready."""
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(name, f"http://127.0.0.1:{port}", proc, log)
    threading.Thread(target=_pump, args=(server, marker), daemon=True).start()
    return server


REAL_READY = b"Application startup complete"
STUB_READY = b"listening on"


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Wait until every server is ready; stop them all on the way out."""
    try:
        for s in servers:
            s.wait_ready()
            if s.ended.is_set():
                raise TierSetupError(f"{s.name} exited while starting:\n{s.tail()}")
        yield servers
    finally:
        for s in servers:
            s.stop()
