"""GPU inspection backends: NVML (the real driver) built in, any other one a plugin.

A plugin is found by name among the entry points of group ``gpu_slicer.gpu_backends``
(the test doubles' distribution registers ``fake``, the fake GPU ledger), or given as
``module:attribute``; either way it is a callable taking no argument that returns a
`GpuBackend`. The daemon never imports a backend by name.

Every backend answers the same three questions: which GPUs exist, how much memory is free, and how
much device memory each process holds on a GPU. Every park is verified through these, never
through a workload's word.

Two optional methods tell slicerd how to read those pids: `pid_namespace()`, the PID
namespace they are in (NVML: the host's, whatever namespace asks; slicerd in a pod then
cannot read them and verifies by elimination, `slicer.census`), and `device_node(index)`,
the device file a process keeps open while it holds a context on that GPU (NVML:
`/dev/nvidiaN`), which names a workload's GPU processes when their pids are unreadable.
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, cast

from gpu_slicer.slicer import pidns
from gpu_slicer.slicer.errors import GpuBackendError


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

    def pid_namespace(self) -> int:
        """NVML names processes by their pids in the host's (initial) PID namespace."""
        return pidns.INIT_PID_NS

    def device_node(self, index: int) -> str:
        """The device file of GPU `index`, which every CUDA process on it keeps open."""
        return f"/dev/nvidia{int(self._nvml.nvmlDeviceGetMinorNumber(self._handles[index]))}"


def pid_namespace_of(backend: GpuBackend) -> int | None:
    """The PID namespace of `backend`'s pids; None when it does not say (taken as
    slicerd's own, as before PID namespaces were known)."""
    fn = getattr(backend, "pid_namespace", None)
    try:
        ns = fn() if callable(fn) else None
    except Exception:
        return None
    return ns if isinstance(ns, int) and not isinstance(ns, bool) else None


def device_node_of(backend: GpuBackend, index: int) -> str | None:
    """The device file of GPU `index` per `backend`, or None when it does not say."""
    fn = getattr(backend, "device_node", None)
    try:
        node = fn(index) if callable(fn) else None
    except Exception:
        return None
    return node if isinstance(node, str) and node else None


ENTRY_POINT_GROUP = "gpu_slicer.gpu_backends"


def backend_names() -> list[str]:
    """`nvml` and every backend registered under `ENTRY_POINT_GROUP`, sorted."""
    found = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return ["nvml", *sorted(found - {"nvml"})]


# module:attribute, both non-empty dotted names (no relative import). Loading one runs its
# module's code as slicerd's user: the config file and the command line are root's alone.
_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check_backend_name(kind: str) -> None:
    """Raise `GpuBackendError` unless `kind` names a backend `open_backend` can try."""
    if ":" in kind:
        if _TARGET.fullmatch(kind):
            return
        raise GpuBackendError(f"gpu backend {kind!r} is not module:attribute")
    if kind == "nvml" or kind in backend_names():
        return
    raise GpuBackendError(
        f"unknown gpu backend {kind!r}: one of {', '.join(backend_names())}, or module:attribute"
        + (
            " (`fake` is registered by the test doubles: `pip install -e stubs` in a checkout)"
            if kind == "fake"
            else ""
        )
    )


def _load_plugin(kind: str) -> Any:
    check_backend_name(kind)
    # Whatever a plugin's import raises is one line naming it, never a traceback.
    if ":" in kind:
        module, _, attr = kind.partition(":")
        try:
            found: Any = importlib.import_module(module)
            for part in attr.split("."):
                found = getattr(found, part)
            return found
        except Exception as e:
            raise GpuBackendError(f"gpu backend {kind!r} cannot be loaded: {e}") from e
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=kind):
        try:
            return ep.load()
        except Exception as e:
            raise GpuBackendError(f"gpu backend {kind!r} ({ep.value}) cannot be loaded: {e}") from e
    check_backend_name(kind)
    raise GpuBackendError(f"unknown gpu backend {kind!r}")  # pragma: no cover - checked above


def open_backend(kind: str) -> GpuBackend:
    """The backend named by config `gpu_backend`: `nvml`, a registered plugin or
    `module:attribute`; a `GpuBackendError` naming what is wrong otherwise."""
    if kind == "nvml":
        return NvmlBackend()
    factory = _load_plugin(kind)
    try:
        backend = factory()
    except GpuBackendError:
        raise
    except Exception as e:
        raise GpuBackendError(f"gpu backend {kind!r} failed to start: {e}") from e
    for name in ("devices", "free_bytes", "processes"):
        if not callable(getattr(backend, name, None)):
            raise GpuBackendError(f"gpu backend {kind!r} has no method {name}()")
    return cast(GpuBackend, backend)
