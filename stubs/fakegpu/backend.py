"""The fake GPU backend: the daemon's GPU plugin over the ledger (``--gpu-backend fake``).

Registered under the entry point group ``gpu_slicer.gpu_backends`` by the test doubles'
distribution (``stubs/pyproject.toml``); the daemon finds it there, never by import.
Reads the ledger the way the NVML backend reads the driver: device list, free memory and
on-device bytes per live pid.
"""

from __future__ import annotations

from gpu_slicer.slicer.errors import GpuBackendError
from gpu_slicer.slicer.gpu import Device
from stubs.fakegpu.ledger import Ledger


class FakeBackend:
    """Reads the ledger of `stubs.fakegpu` the way NVML reads the driver."""

    def __init__(self, directory: str | None = None) -> None:
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
