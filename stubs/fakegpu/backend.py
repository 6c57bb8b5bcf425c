"""The fake GPU backend: the daemon's GPU plugin over the ledger (``--gpu-backend fake``).

Registered under the entry point group ``gpu_slicer.gpu_backends`` by the test doubles'
distribution (``stubs/pyproject.toml``); the daemon finds it there, never by import.
Reads the ledger the way the NVML backend reads the driver: device list, free memory and
on-device bytes per live pid. Like NVML, it speaks host pids (the fake driver's PID
namespace, ``stubs.fakegpu.hostpid``) whichever namespace the daemon runs in; a daemon in
a pod learns that namespace from ``pid_namespace`` and finds its own GPU processes by
their open ``device_node``, as it would by ``/dev/nvidiaN``.
"""

from __future__ import annotations

from gpu_slicer.slicer.errors import GpuBackendError
from gpu_slicer.slicer.gpu import Device
from stubs.fakegpu.hostpid import host_namespace
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

    def pid_namespace(self) -> int:
        """The inode of the PID namespace that `processes` pids are in: the host's.

        The fake driver, like NVIDIA's kernel driver, numbers processes in the host
        (outermost) namespace and cannot translate them back into a caller's nested one
        (NVML cannot either); a daemon whose own namespace differs must not read these
        pids as its own."""
        try:
            return host_namespace()
        except Exception as e:
            raise GpuBackendError(f"fake GPU: {e}") from e

    def device_node(self, index: int) -> str:
        """The path of GPU `index`'s device node (``$FAKEGPU_DIR/dev/nvidia<index>``).

        Every process that allocated on the GPU for itself holds it open, as a CUDA
        context holds ``/dev/nvidia<index>``: a ``/proc/<pid>/fd`` link to it marks a GPU
        process in any PID namespace that can see that process."""
        return str(self._ledger.device_node(index))
