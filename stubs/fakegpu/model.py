"""Fake GPU value types and errors (process identity: ``hostpid.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from stubs.fakegpu.sizes import format_size

__all__ = [
    "FakeGpuError",
    "GpuInfo",
    "OutOfMemory",
    "ProcMem",
    "UnknownGpu",
    "gpu_uuid",
    "out_of_memory",
]


class FakeGpuError(Exception):
    """Base of every fake GPU error."""


class OutOfMemory(FakeGpuError):
    """An allocation or restore past a GPU's capacity (CUDA's OOM)."""


class UnknownGpu(FakeGpuError):
    """A GPU index the ledger was not initialised with."""


@dataclass(frozen=True)
class GpuInfo:
    """One fake GPU: ``used`` is the on-device bytes of live processes."""

    index: int
    uuid: str
    total: int
    used: int

    @property
    def free(self) -> int:
        """Bytes still allocatable on this GPU."""
        return self.total - self.used


@dataclass(frozen=True)
class ProcMem:
    """A live process's memory on one GPU, summed over its tags."""

    pid: int
    gpu: int
    on_device: int
    on_host: int
    workload: str


def gpu_uuid(index: int) -> str:
    """The stable fake UUID of GPU ``index``."""
    return f"GPU-fake-0000-{index:04d}"


def out_of_memory(gpu: int, nbytes: int, total: int, used: int) -> OutOfMemory:
    """The OutOfMemory error CUDA would raise for this allocation."""
    return OutOfMemory(
        f"CUDA out of memory. Tried to allocate {format_size(nbytes)}. GPU {gpu} has a "
        f"total capacity of {format_size(total)} of which {format_size(total - used)} is free."
    )
