"""slicerd's checkpoint helper: one long-lived process that calls the driver's checkpoint API.

Run by slicerd (``python -m gpu_slicer.slicer.ckpthelper --lib libcuda.so.1 --owner DIR``),
never by hand. It loads the driver library once, pays ``cuInit`` once, and then performs
the daemon's requests for as long as the daemon lives: each launch of the
``cuda-checkpoint`` CLI pays that initialisation again (~2.7 s on real hardware), twice
per park and twice per restore.

Wire (JSON, one object per line). Out, first: ``{"ready": true, "version": 12080,
"init_s": 0.01}``, or ``{"ready": false, "error": "..."}`` and exit 3 (the library does
not load, lacks the checkpoint API, or ``cuInit`` fails). In: ``{"id": N, "op":
"lock"|"checkpoint"|"restore"|"unlock"|"state", "pid": P, "timeout_ms": T}``. Out, for
each, in the order they end: ``{"id": N, "ok": true}`` (``"state"`` added for a state
op: running, locked, checkpointed, failed, or ``none``: the process is gone or has no
CUDA state) or ``{"id": N, "ok": false, "code": CURESULT, "name": "...", "text":
"..."}``.

The answers go out on a private copy of the helper's stdout; fd 1 itself is pointed at
stderr before the library loads, so a library that prints cannot corrupt them. Each
request runs on a thread of its own (the driver call blocks; other processes' calls
go on). The helper is never to be killed mid-operation, which desynchronises the driver:
it ignores SIGINT, SIGTERM and SIGHUP (slicerd starts it in a session of its own, so a
terminal's ^C never reaches it either), and when its input ends (slicerd stopped or died)
it finishes the calls in flight, then exits 0. A new daemon finds such a leftover by its
``--owner`` (its state dir) and waits for it before recovering anything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import IO, Any

from gpu_slicer.slicer.cudadriver import (
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_SUPPORTED,
    Driver,
    DriverError,
)

__all__ = ["MODULE", "main"]

MODULE = "gpu_slicer.slicer.ckpthelper"
OPS = ("lock", "checkpoint", "restore", "unlock", "state")
EXIT_UNAVAILABLE = 3


class _Helper:
    def __init__(self, driver: Driver, out: IO[str]) -> None:
        self.driver, self.out = driver, out
        self._write = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        line = json.dumps(msg, separators=(",", ":")) + "\n"
        with self._write:
            try:
                self.out.write(line)
                self.out.flush()
            except (BrokenPipeError, ValueError):
                pass  # the daemon is gone; the call itself still ran to its end

    def perform(self, req: dict[str, Any]) -> None:
        rid, op, pid = req.get("id"), req.get("op"), req.get("pid")
        if op not in OPS or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            self.send({"id": rid, "ok": False, "code": 1, "name": "CUDA_ERROR_INVALID_VALUE",
                       "text": f"bad request {req!r}"[:300]})  # fmt: skip
            return
        try:
            if op == "state":
                self.send({"id": rid, "ok": True, "state": self._state(pid)})
                return
            if op == "lock":
                self.driver.lock(pid, int(req.get("timeout_ms", 0)))
            else:
                getattr(self.driver, op)(pid)
            self.send({"id": rid, "ok": True})
        except DriverError as e:
            self.send({"id": rid, "ok": False, "code": e.code, "name": e.name, "text": e.text})
        except Exception as e:  # a reply always goes back: the daemon bounds only its wait
            self.send({"id": rid, "ok": False, "code": -1, "name": type(e).__name__,
                       "text": str(e)[:300]})  # fmt: skip

    def _state(self, pid: int) -> str:
        if not _exists(pid):
            return "none"
        try:
            return self.driver.get_state(pid)
        except DriverError as e:
            if e.code in (CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_SUPPORTED):
                return "none"  # a live process without CUDA state
            raise


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """Serve requests on stdin until it ends; the exit code."""
    parser = argparse.ArgumentParser(prog="ckpthelper", description=__doc__.split("\n")[0])
    parser.add_argument("--lib", required=True, help="the driver library (libcuda.so.1)")
    parser.add_argument("--owner", default="", help="the daemon's state dir (finds leftovers)")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # The protocol gets a private copy of fd 1, and fd 1 becomes stderr: whatever the
    # driver library prints can never be taken for (or split) an answer.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(2, 1)
    t0 = time.monotonic()
    try:
        driver = Driver(args.lib)
        if not driver.has_api:
            raise DriverError("dlsym", -1, "NO_CHECKPOINT_API",
                              f"{args.lib} lacks {', '.join(driver.missing)} (a driver older "
                              "than r570)")  # fmt: skip
        version = driver.init()
    except DriverError as e:
        out.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
        out.flush()
        return EXIT_UNAVAILABLE
    helper = _Helper(driver, out)
    helper.send({"ready": True, "version": version, "init_s": round(time.monotonic() - t0, 3)})
    threads: list[threading.Thread] = []
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            req = {"id": None, "op": None}
        if not isinstance(req, dict):
            req = {"id": None, "op": None}
        t = threading.Thread(target=helper.perform, args=(req,), daemon=False)
        t.start()
        threads = [x for x in threads if x.is_alive()] + [t]
    for t in threads:
        t.join()  # never cut a driver call short: the process exits once all have ended
    return 0


if __name__ == "__main__":
    sys.exit(main())
