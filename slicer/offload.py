"""Cooperative parking for PyTorch trainers that run without cuda-checkpoint.

A workload registered with `park=cooperative` frees the GPU itself at the end of a turn and
slicerd only verifies (through the GPU backend, never on the workload's word) that it did.
`Offloader` does the freeing for a model and its optimizers: every parameter, gradient,
buffer and optimizer state tensor is copied to host memory (pinned when CUDA is present, so
the copies run at full PCIe speed) and its device storage dropped; `restore` copies them
back bit-exactly. Tensors keep their identity: only `.data` is swapped, so an optimizer's
param groups, its per-parameter state and anyone else holding a reference keep working.

    off = Offloader(model, optimizer)
    s = Slicer.from_env()
    s.register(park="cooperative")
    for batch in data:
        with cooperative_turn(s, off, "cuda"):   # restore, train, offload, release
            train_step(batch)

torch is imported lazily: importing this module (and `slicer`) never needs it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gpu_slicer.slicer.client import Slicer, Turn


@dataclass(frozen=True)
class Moved:
    """What one `offload` or `restore` did."""

    direction: str  # "offload" | "restore"
    tensors: int
    bytes: int
    ms: float


def _torch() -> Any:
    import torch  # lazy: the slicer package must import without torch

    return torch


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


class Offloader:
    """Moves a model's and its optimizers' tensors to host memory and back.

    `offload()` replaces the storage of every parameter, gradient, buffer and optimizer
    state tensor with a host copy (pinned when CUDA is available) and releases the device
    storage (`torch.cuda.empty_cache()` so the driver, and therefore slicerd, sees it
    freed). `restore(device)` copies them back; tensors that lived on the CPU before the
    offload (Adam's `step`, say) go back to the CPU. Both work when everything lives on the
    CPU too: the storages are still replaced, so a round trip is observable in tests.

    Tensors sharing one storage (views, tied weights reached as different tensor objects)
    are copied separately and stop sharing; each tensor object is moved once however many
    places reach it. Only dense (strided) tensors keep their exact strides; other layouts
    are moved with `Tensor.to`.
    """

    def __init__(self, model: Any, optimizers: Iterable[Any] | Any = ()) -> None:
        self.model = model
        if hasattr(optimizers, "state") and hasattr(optimizers, "param_groups"):
            optimizers = [optimizers]
        self.optimizers: list[Any] = list(optimizers)
        self.offloaded = False
        self.last: Moved | None = None
        # Each moved tensor and the device it lived on before the offload.
        self._moved: list[tuple[Any, Any]] = []

    def tensors(self) -> list[Any]:
        """Every tensor this offloader moves, each object once: parameters, their
        gradients, buffers, then optimizer state tensors."""
        torch = _torch()
        seen: set[int] = set()
        out: list[Any] = []

        def add(t: Any) -> None:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)

        for p in self.model.parameters():
            add(p)
            if p.grad is not None:
                add(p.grad)
        for b in self.model.buffers():
            add(b)
        for opt in self.optimizers:
            for per_param in opt.state.values():
                values = per_param.values() if isinstance(per_param, dict) else [per_param]
                for v in values:
                    add(v)
        return out

    def device_bytes(self) -> int:
        """Bytes of the tracked tensors that are currently on a non-CPU device."""
        return sum(_nbytes(t) for t in self.tensors() if t.device.type != "cpu")

    def offload(self) -> Moved:
        """Move every tracked tensor to host memory and free its device storage.

        A second call without a `restore` in between moves nothing."""
        if self.offloaded:
            return self._report("offload", 0, 0, time.perf_counter())
        torch = _torch()
        cuda = bool(torch.cuda.is_available())
        t0 = time.perf_counter()
        host = torch.device("cpu")
        with torch.no_grad():
            tensors = self.tensors()
            # Copy everything first, then swap: a failure midway (host OOM) changes nothing.
            copies = [
                _copy(torch, t.data, host, pin=cuda and t.device.type == "cuda") for t in tensors
            ]
            if cuda:
                torch.cuda.synchronize()
            moved = [(t, t.device) for t in tensors]
            for t, c in zip(tensors, copies, strict=True):
                t.data = c
        del copies
        if cuda:
            torch.cuda.empty_cache()
        nbytes = sum(_nbytes(t) for t in tensors)
        self._moved = moved
        self.offloaded = True
        return self._report("offload", len(moved), nbytes, t0)

    def restore(self, device: Any = None) -> Moved:
        """Move the offloaded tensors back, bit-exactly: those that lived on a device go
        to `device` (default: where each was), those that lived on the CPU to the CPU.

        Without a preceding `offload` this moves nothing."""
        if not self.offloaded:
            return self._report("restore", 0, 0, time.perf_counter())
        torch = _torch()
        target = torch.device(device) if device is not None else None
        t0 = time.perf_counter()
        with torch.no_grad():
            # Copy everything first, then swap: a failure midway (device OOM) leaves the
            # model offloaded, consistently, and the partial copies are dropped.
            copies = [
                _copy(torch, t.data, home if home.type == "cpu" or target is None else target)
                for t, home in self._moved
            ]
            if any(c.device.type == "cuda" for c in copies):
                torch.cuda.synchronize()
            for (t, _), c in zip(self._moved, copies, strict=True):
                t.data = c
        nbytes = sum(_nbytes(t) for t, _ in self._moved)
        count = len(self._moved)
        self._moved = []
        self.offloaded = False
        return self._report("restore", count, nbytes, t0)

    def _report(self, direction: str, count: int, nbytes: int, t0: float) -> Moved:
        self.last = Moved(direction, count, nbytes, (time.perf_counter() - t0) * 1000.0)
        return self.last


def _copy(torch: Any, src: Any, device: Any, pin: bool = False) -> Any:
    """A fresh copy of `src` on `device` (new storage even when it is already there), same
    dtype, shape and, for dense tensors, strides."""
    if src.layout != torch.strided:
        out = src.to(device, copy=True)
        return out.pin_memory() if pin else out
    out = torch.empty_like(src, device=device, pin_memory=pin)
    # Pinned host memory allows an asynchronous copy; the caller synchronizes once.
    out.copy_(src, non_blocking=pin or (src.device.type == "cpu" and src.is_pinned()))
    return out


@contextlib.contextmanager
def cooperative_turn(
    slicer: Slicer,
    offloader: Offloader,
    device: Any,
    name: str | None = None,
    wait: float | None = None,
    park: str = "now",
) -> Iterator[Turn]:
    """One GPU turn for a `park=cooperative` trainer.

    Acquires the turn; restores the model to `device` when the grant says `restored=1` or
    the model is offloaded; yields the turn; offloads; releases. The turn is released
    whatever happens in the body, the restore or the offload (the offload runs first so
    that slicerd's verification finds the GPU freed). `park="now"` (default) has slicerd
    verify at once, so a failed offload surfaces at this release.

    The turn is `Slicer.turn`'s: its release is bounded by `release_timeout` (past it the
    connection is closed, which ends the turn), and an ACQUIRE that raises `Faulted` with
    a granted turn releases that turn first."""
    with slicer.turn(name, wait, park) as t:
        try:
            if t.restored or offloader.offloaded:
                offloader.restore(device)
            yield t
        finally:
            offloader.offload()
