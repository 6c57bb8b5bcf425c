"""The Python half of the fake libcuda: what its checkpoint functions call back into.

``fakecuda.c`` exports the real driver ABI (``cuInit``, ``cuCheckpointProcessLock`` ...);
each of its calls takes the GIL of the process that loaded it and calls the function of
the same op here, which runs the cuda-checkpoint stub's own op logic
(``stubs.cuda_checkpoint_stub.do_action``/``get_state``) on the fake GPU ledger of
``$FAKEGPU_DIR``, so the library and the CLI stub act identically: same states and
transitions, bandwidth sleeps (``$FAKEGPU_BANDWIDTH``), out-of-memory rule (a restore past
capacity leaves the process stuck checkpointed for good), injections
(``Ledger.inject``: ``fail`` and ``hang`` per op, ``$FAKEGPU_HANG_MAX``), PID-namespace
translation (the pid is read in the calling process's namespace) and ``$FAKEGPU_CC_LOG``
lines (``"via": "lib"``; ``argv`` is None and ``rc`` is the ``CUresult``). The library
works only loaded into a Python process (slicerd's checkpoint helper is one, with
``ctypes.CDLL``); elsewhere it still loads, but ``cuInit`` and every checkpoint call
return ``CUDA_ERROR_NOT_INITIALIZED`` (the version and error-name calls work anywhere).

``cuInit(0)`` pays ``$FAKEGPU_CUINIT_S`` seconds once per process (the CLI stub pays it at
every launch), then marks the process initialised; it returns ``CUDA_ERROR_NO_DEVICE``
when there is no ledger, ``CUDA_ERROR_INVALID_VALUE`` for flags other than 0. The log's
``cuinit_at`` (a ``time.monotonic()`` stamp) is the same on every line of one process.

Results (the fake's mapping of the stub's failures onto ``CUresult``, ``results.py``):

- ``CUDA_SUCCESS`` 0: success.
- ``CUDA_ERROR_NOT_INITIALIZED`` 3: a checkpoint call before ``cuInit`` in this process.
- ``CUDA_ERROR_INVALID_VALUE`` 1: a non-zero reserved field, a NULL state pointer (args
  themselves may be NULL, as the real API allows).
- ``CUDA_ERROR_NOT_FOUND`` 500: no such process in the caller's PID namespace, or it
  exited during a hang.
- ``CUDA_ERROR_NOT_SUPPORTED`` 801: a live pid without ledger memory ("not a CUDA
  process"), ``GetState`` included.
- ``CUDA_ERROR_ILLEGAL_STATE`` 401: an illegal transition, or the process is failed.
- ``CUDA_ERROR_OUT_OF_MEMORY`` 2: a restore past capacity, and every restore after one
  (the process is stuck checkpointed for good; unlock is then illegal).
- ``CUDA_ERROR_TIMEOUT`` 909: a lock past its ``timeoutMs`` (0: none) while an injected
  hang holds, or any hang past ``$FAKEGPU_HANG_MAX``; the state is unchanged.
- ``CUDA_ERROR_UNKNOWN`` 999: an injected ``fail`` (the state becomes failed, terminal);
  also a Python exception in this module (a bug; its traceback goes to stderr).
- ``CUDA_ERROR_OPERATING_SYSTEM`` 304: a bad ``$FAKEGPU_BANDWIDTH`` or
  ``$FAKEGPU_CUINIT_S``, or a ledger error.

An injected ``hang`` blocks the calling thread (polling every 50 ms, the GIL released)
until the injection is cleared, the target exits, the lock's ``timeoutMs`` or
``$FAKEGPU_HANG_MAX`` passes, exactly as the stub's. ``cuCheckpointProcessGetRestoreThreadId``
returns ``CUDA_ERROR_NOT_SUPPORTED``. Only the CLI has the SIGTERM desync rule: a call in
a library cannot be interrupted.

The op functions here take two integers, as the C side passes them, and return a
``CUresult``; they are the C side's, not meant to be called from Python directly.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable

from stubs import cuda_checkpoint_stub as stub
from stubs.cuda_checkpoint_stub import (
    ToolError,
    cuinit_seconds,
    do_action,
    error_code,
    log_call,
    state_or_none,
)
from stubs.fakecuda.results import PROCESS_STATES, CUresult
from stubs.fakegpu import FakeGpuError, Ledger

__all__ = ["checkpoint", "get_state", "init", "initialised", "lock", "restore", "unlock"]

_init_lock = threading.Lock()
# os.getpid() -> (cuinit_at, cuinit_s): keyed by pid so that a forked child pays again.
_init: dict[int, tuple[float, float]] = {}


def initialised() -> tuple[float, float] | None:
    """(``cuinit_at``, ``cuinit_s``) when this process has passed ``cuInit``, else None."""
    return _init.get(os.getpid())


def init(flags: int, _unused: int = 0) -> int:
    """``cuInit(flags)``: pays ``$FAKEGPU_CUINIT_S`` once per process."""
    if flags != 0:
        return CUresult.CUDA_ERROR_INVALID_VALUE
    with _init_lock:  # a second thread's cuInit waits for the first, as on the driver
        if initialised() is not None:
            return CUresult.CUDA_SUCCESS
        try:
            seconds = cuinit_seconds()
            Ledger()
        except ToolError as exc:
            return exc.code
        except FakeGpuError:
            return CUresult.CUDA_ERROR_NO_DEVICE
        time.sleep(seconds)
        _init[os.getpid()] = (time.monotonic(), seconds)
    return CUresult.CUDA_SUCCESS


def _call(op: str, pid: int, run: Callable[[Ledger], None]) -> int:
    stamp = initialised()
    if stamp is None:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED
    started = time.monotonic()
    before = state_or_none(pid)
    code, error = CUresult.CUDA_SUCCESS, None
    try:
        run(Ledger())
    except (ToolError, FakeGpuError) as exc:
        code, error = error_code(exc), str(exc)
    log_call(
        via="lib",
        argv=None,
        pid=pid,
        op=op,
        rc=int(code),
        code=int(code),
        error=error,
        before=before,
        started=started,
        cuinit_at=stamp[0],
        cuinit_s=stamp[1],
    )
    return int(code)


def lock(pid: int, timeout_ms: int) -> int:
    """``cuCheckpointProcessLock``: running -> locked (``timeout_ms`` 0: no timeout)."""
    return _call("lock", pid, lambda ledger: do_action(ledger, pid, "lock", timeout_ms or None))


def checkpoint(pid: int, _unused: int = 0) -> int:
    """``cuCheckpointProcessCheckpoint``: locked -> checkpointed."""
    return _call("checkpoint", pid, lambda ledger: do_action(ledger, pid, "checkpoint"))


def restore(pid: int, _unused: int = 0) -> int:
    """``cuCheckpointProcessRestore``: checkpointed -> locked."""
    return _call("restore", pid, lambda ledger: do_action(ledger, pid, "restore"))


def unlock(pid: int, _unused: int = 0) -> int:
    """``cuCheckpointProcessUnlock``: locked -> running."""
    return _call("unlock", pid, lambda ledger: do_action(ledger, pid, "unlock"))


def get_state(pid: int, address: int) -> int:
    """``cuCheckpointProcessGetState``: writes the ``CUprocessState`` at ``address``."""

    def run(ledger: Ledger) -> None:
        ctypes.c_int.from_address(address).value = PROCESS_STATES[stub.get_state(ledger, pid)]

    return _call("get-state", pid, run)
