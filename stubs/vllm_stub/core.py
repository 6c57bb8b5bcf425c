"""The engine-core child process: it alone holds the fake GPU memory.

    python -m stubs.vllm_stub.core        (started by the API server, never by hand)

Real ``vllm serve`` spawns EngineCore processes and those, not the API server's pid,
own the CUDA memory; so here every ledger allocation is made with this process's pid.

Protocol: one JSON object per line. The parent writes ``{"id", "op", ...}`` on our
stdin; we answer ``{"id", "ok": true, ...}`` or ``{"id", "ok": false, "error", "oom"}``
on stdout, one request at a time. Ops: ``boot``, ``sleep``, ``wake``, ``reload``,
``exit``. The first line we print is ``{"ready": pid}``.

Lifetime: we never outlive the API server. stdin EOF (the parent closed its end or
died) frees our memory and exits; a watchdog thread exits as soon as our parent pid
changes (the parent was SIGKILLed while we were busy, e.g. sleeping through the boot
delay). SIGTERM and SIGINT are ignored, as an engine core leaves its shutdown to the
API server (and a process-group SIGTERM during boot must not kill it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stubs.fakegpu import FakeGpuError, Ledger, OutOfMemory

__all__ = ["Core", "main", "read_identity"]

_WATCH_INTERVAL_S = 0.1
TAGS = ("weights", "kv")


class CoreError(Exception):
    """A worker-side failure reported to the API server (``oom`` for CUDA OOMs)."""

    def __init__(self, message: str, oom: bool = False) -> None:
        super().__init__(message)
        self.oom = oom


def read_identity(path: str) -> str:
    """The weights' identity of checkpoint dir ``path``: revision.txt, else basename."""
    p = Path(path)
    rev = p / "revision.txt"
    if rev.is_file():
        return rev.read_text().strip() or p.name
    return p.name


class Core:
    """The engine core's memory: what is booked in the ledger, under which tags."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.pid = os.getpid()
        self.gpu = 0
        self.workload = "vllm"
        self.allowance = 0
        self.sizes: dict[str, int] = {}  # tag -> bytes it has when awake
        self.on_device: set[str] = set()

    def _alloc(self, tag: str, nbytes: int) -> None:
        try:
            self.ledger.alloc(
                self.pid, self.gpu, nbytes, tag, workload=self.workload, allowance=self.allowance
            )
        except OutOfMemory as e:
            raise CoreError(f"torch.OutOfMemoryError: {e}", oom=True) from e
        except FakeGpuError as e:
            raise CoreError(f"RuntimeError: {e}") from e
        self.on_device.add(tag)
        _log(f"engine core pid={self.pid} allocated {tag}={nbytes} on gpu {self.gpu}")

    def boot(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.gpu = int(msg["gpu"])
        self.workload = str(msg["workload"])
        context, weights = int(msg["context_bytes"]), int(msg["weights_bytes"])
        self.allowance = context
        self._alloc("context", context)
        self._alloc("weights", weights)
        self.sizes["weights"] = weights
        delay = float(msg["boot_delay"])
        if delay:
            _log(f"engine core loading for {delay:g}s")
        time.sleep(delay)  # "loading the weights", "profiling"
        total = next((g.total for g in self.ledger.gpus() if g.index == self.gpu), None)
        if total is None:
            raise CoreError(f"RuntimeError: CUDA error: invalid device ordinal {self.gpu}")
        kv = int(float(msg["gpu_memory_utilization"]) * total) - weights - context
        if kv <= 0:
            raise CoreError(
                "ValueError: No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."
            )
        self._alloc("kv", kv)
        self.sizes["kv"] = kv
        return {"context": context, "weights": weights, "kv": kv}

    def sleep(self, msg: dict[str, Any]) -> dict[str, Any]:
        freed = 0
        for tag in TAGS:
            if tag in self.on_device:
                freed += self.ledger.free(self.pid, tag)
                self.on_device.discard(tag)
        return {"freed": freed}

    def wake(self, msg: dict[str, Any]) -> dict[str, Any]:
        done: list[str] = []
        try:
            for tag in msg["tags"]:
                if tag not in self.on_device:
                    self._alloc(tag, self.sizes[tag])
                    done.append(tag)
        except CoreError:
            for tag in done:  # all or nothing: a failed wake changes nothing
                self.ledger.free(self.pid, tag)
                self.on_device.discard(tag)
            raise
        return {"woken": done}

    def reload(self, msg: dict[str, Any]) -> dict[str, Any]:
        """``reload_weights``: errors are the worker's ``str(exception)`` as vLLM shows
        it; ``weights_path`` None reloads ``model``: the engine passes the weights it
        loaded last (MODEL until a reload; a directory, else its name)."""
        path = msg.get("weights_path")
        time.sleep(float(msg.get("seconds", 0)))
        if msg.get("fail"):
            raise CoreError(f"injected failure loading weights from {path or msg['model']}")
        if "weights" not in self.on_device:
            raise CoreError(
                "cannot load weights while they are offloaded (sleeping); "
                "call /wake_up?tags=weights first"
            )
        if path is None:
            model = str(msg["model"])
            return {"identity": read_identity(model) if Path(model).is_dir() else model}
        if not Path(path).is_dir():
            raise CoreError(f"[Errno 2] No such file or directory: {str(path)!r}")
        return {"identity": read_identity(str(path))}

    def free_all(self) -> None:
        with contextlib.suppress(FakeGpuError):
            self.ledger.free(self.pid)

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "boot":
            return self.boot(msg)
        if op == "sleep":
            return self.sleep(msg)
        if op == "wake":
            return self.wake(msg)
        if op == "reload":
            return self.reload(msg)
        raise CoreError(f"AttributeError: engine core has no operation {op!r}")


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)  # the ledger prunes a dead pid's memory
        time.sleep(_WATCH_INTERVAL_S)


def _log(message: str) -> None:
    print(f"stub: {message}", file=sys.stderr, flush=True)


def _send(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    """Serve the parent's requests on stdin until EOF or ``exit``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = int(os.environ.get("VLLM_STUB_PARENT", os.getppid()))
    if os.getppid() != parent:
        return 1
    # --core-outlives-server: as real vLLM 0.32's EngineCore (measured: it and its worker
    # were alive 20 s after their API server's SIGKILL), no parent watch, and an input
    # that ends without `exit` leaves it running with its memory until it is killed.
    outlives = os.environ.get("VLLM_STUB_CORE_OUTLIVES") == "1"
    if not outlives:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    core = Core(Ledger())
    _send({"ready": core.pid})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            msg = json.loads(line)
            if msg.get("op") == "exit":
                core.free_all()
                _send({"id": msg.get("id"), "ok": True})
                return 0
            try:
                reply = {"id": msg.get("id"), "ok": True, **core.handle(msg)}
            except CoreError as e:
                reply = {"id": msg.get("id"), "ok": False, "error": str(e), "oom": e.oom}
            except Exception as e:  # a bug or a ledger failure: report, keep serving
                reply = {"id": msg.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"}
            _send(reply)
        if outlives:  # the server died without `exit`: orphaned, as vLLM's core is (no
            while True:  # log line: its stderr may be a pipe nobody reads any more)
                time.sleep(3600)
    finally:
        core.free_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
