"""The CUDA driver's checkpoint API (r570+), through ctypes: what the checkpoint helper calls.

``cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState`` act on another process
by pid, as the ``cuda-checkpoint`` CLI does (the CLI is a thin front over them), without
paying the driver's initialisation (``cuInit``, ~2.7 s on real hardware) at every call:
:class:`Driver` initialises once and is then called for as long as its process lives.
Each argument struct is 64 bytes whose reserved fields must be zero; ``lock`` takes a
timeout in milliseconds (0: none). A failure is a :class:`DriverError` carrying the
``CUresult`` and its name and text from ``cuGetErrorName``/``cuGetErrorString``.

Only the checkpoint helper (:mod:`slicer.ckpthelper`, a process of its own) loads the
library: slicerd itself never does, so a driver call that blocks or crashes never takes
the daemon's event loop with it.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = [
    "API",
    "CUDA_ERROR_NOT_FOUND",
    "CUDA_ERROR_NOT_SUPPORTED",
    "STATES",
    "Driver",
    "DriverError",
]

# The functions a driver must export for the driver parker (r570+; r550 has none).
API = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)
# CUprocessState, in the order of the driver's enum.
STATES = ("running", "locked", "checkpointed", "failed")
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_SUPPORTED = 801


class DriverError(Exception):
    """A driver call returned an error (``code`` is its ``CUresult``)."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call}: {name} ({text})")
        self.call, self.code, self.name, self.text = call, code, name, text


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_ulonglong * 7),
    ]


class _Args(ctypes.Structure):  # Checkpoint, Restore and Unlock args: reserved only
    _fields_ = [("reserved", ctypes.c_ulonglong * 8)]


class Driver:
    """The driver library at `path` (``libcuda.so.1``: found by the dynamic loader)."""

    def __init__(self, path: str) -> None:
        try:
            self._lib: Any = ctypes.CDLL(path)
        except OSError as e:
            raise DriverError("dlopen", -1, "LOAD_FAILED", f"cannot load {path}: {e}") from e
        self.path = path
        self.missing = [name for name in API if not hasattr(self._lib, name)]
        for name in ("cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString"):
            if not hasattr(self._lib, name):
                raise DriverError("dlsym", -1, "NOT_A_DRIVER", f"{path} lacks {name}")
        int_p = ctypes.POINTER(ctypes.c_int)
        self._lib.cuInit.argtypes = [ctypes.c_uint]
        self._lib.cuDriverGetVersion.argtypes = [int_p]
        for name in ("cuGetErrorName", "cuGetErrorString"):
            getattr(self._lib, name).argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for name in API:
            if name in self.missing:
                continue
            fn = getattr(self._lib, name)
            fn.restype = ctypes.c_int
            if name == "cuCheckpointProcessGetState":
                fn.argtypes = [ctypes.c_int, int_p]
            elif name == "cuCheckpointProcessLock":
                fn.argtypes = [ctypes.c_int, ctypes.POINTER(_LockArgs)]
            else:
                fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Args)]

    @property
    def has_api(self) -> bool:
        """Whether the library exports the whole checkpoint API."""
        return not self.missing

    def init(self) -> int:
        """``cuInit(0)``; the driver's version (e.g. 12080)."""
        self._check("cuInit", self._lib.cuInit(0))
        version = ctypes.c_int(0)
        self._check("cuDriverGetVersion", self._lib.cuDriverGetVersion(ctypes.byref(version)))
        return version.value

    def lock(self, pid: int, timeout_ms: int) -> None:
        """running -> locked: no new CUDA work, submitted work drained (0 ms: no bound)."""
        args = _LockArgs(timeoutMs=max(0, timeout_ms))
        self._check("cuCheckpointProcessLock", self._lib.cuCheckpointProcessLock(pid, args))

    def checkpoint(self, pid: int) -> None:
        """locked -> checkpointed: device memory to host, the GPU released."""
        self._call("cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int) -> None:
        """checkpointed -> locked: device memory back onto the GPU."""
        self._call("cuCheckpointProcessRestore", pid)

    def unlock(self, pid: int) -> None:
        """locked -> running."""
        self._call("cuCheckpointProcessUnlock", pid)

    def get_state(self, pid: int) -> str:
        """The process's state: running, locked, checkpointed or failed."""
        state = ctypes.c_int(-1)
        fn = "cuCheckpointProcessGetState"
        self._check(fn, getattr(self._lib, fn)(pid, ctypes.byref(state)))
        if 0 <= state.value < len(STATES):
            return STATES[state.value]
        return f"unknown-{state.value}"

    def _call(self, name: str, pid: int) -> None:
        self._check(name, getattr(self._lib, name)(pid, _Args()))

    def _check(self, call: str, rc: int) -> None:
        if rc == 0:
            return
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._lib.cuGetErrorName(rc, ctypes.byref(name))
        self._lib.cuGetErrorString(rc, ctypes.byref(text))
        raise DriverError(
            call,
            rc,
            (name.value or b"CUDA_ERROR_%d" % rc).decode(errors="replace"),
            (text.value or b"unknown error").decode(errors="replace"),
        )
