"""GPU inspection backends: NVML (the real driver) and the fake GPU ledger (stubs).

Both answer the same three questions: which GPUs exist, how much memory is free, and how
much device memory each process holds on a GPU. Every park is verified through these, never
through a workload's word.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from slicer.errors import GpuBackendError


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU as the backend sees it."""

    index: int
    uuid: str
    total: int


class GpuBackend(Protocol):
    """What the daemon needs to know of the GPUs."""

    def devices(self) -> list[Device]:
        """All GPUs of this node."""
        ...

    def free_bytes(self, index: int) -> int:
        """Free device memory on GPU `index`."""
        ...

    def processes(self, index: int) -> dict[int, int]:
        """Device bytes per pid holding a context on GPU `index`."""
        ...


class FakeBackend:
    """Reads the ledger of `stubs.fakegpu` the way NVML reads the driver."""

    def __init__(self, directory: str | None = None) -> None:
        try:
            from stubs.fakegpu import Ledger
        except ImportError as e:  # pragma: no cover - the stubs ship with the package
            raise GpuBackendError(f"fake GPU backend unavailable: {e}") from e
        try:
            self._ledger = Ledger(directory)
            self._ledger.gpus()
        except Exception as e:
            raise GpuBackendError(
                f"fake GPU ledger unusable ({e}); run `python -m stubs.fakegpu init` "
                "with FAKEGPU_DIR set"
            ) from e

    def devices(self) -> list[Device]:
        """All GPUs in the ledger."""
        return [Device(g.index, g.uuid, g.total) for g in self._ledger.gpus()]

    def free_bytes(self, index: int) -> int:
        """Free bytes of GPU `index` per the ledger."""
        for g in self._ledger.gpus():
            if g.index == index:
                return int(g.free)
        raise GpuBackendError(f"no GPU {index} in the ledger")

    def processes(self, index: int) -> dict[int, int]:
        """On-device bytes per live pid on GPU `index`."""
        return {p.pid: int(p.on_device) for p in self._ledger.processes(index) if p.on_device}


class NvmlBackend:
    """The real driver through pynvml; a clear error when no driver is present."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise GpuBackendError("nvidia-ml-py (pynvml) is not installed") from e
        self._nvml: Any = pynvml
        self._lock = threading.Lock()
        try:
            pynvml.nvmlInit()
        except Exception as e:
            raise GpuBackendError(
                f"NVML is not available ({e}): is the NVIDIA driver installed and "
                "/dev/nvidia* visible? Use --gpu-backend fake only for tests."
            ) from e
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def devices(self) -> list[Device]:
        """Every device NVML reports, by index, with its UUID and total memory."""
        out = []
        for i, h in enumerate(self._handles):
            uuid = self._nvml.nvmlDeviceGetUUID(h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            out.append(Device(i, str(uuid), int(self._nvml.nvmlDeviceGetMemoryInfo(h).total)))
        return out

    def free_bytes(self, index: int) -> int:
        """Free memory of device `index`."""
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handles[index]).free)

    def processes(self, index: int) -> dict[int, int]:
        """Used memory per compute process on device `index` (graphics ones too)."""
        h = self._handles[index]
        out: dict[int, int] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            for p in getattr(self._nvml, fn)(h):
                used = p.usedGpuMemory
                # NVML reports None when it cannot attribute memory (e.g. in a container):
                # count the process as holding a context with unknown, hence non-zero, bytes.
                out[int(p.pid)] = out.get(int(p.pid), 0) + (int(used) if used is not None else 1)
        return out


def open_backend(kind: str) -> GpuBackend:
    """The backend named by config `gpu_backend` (`nvml` or `fake`)."""
    if kind == "nvml":
        return NvmlBackend()
    if kind == "fake":
        return FakeBackend()
    raise GpuBackendError(f"unknown gpu backend {kind!r} (nvml or fake)")
