"""`--real`: what the loop demo needs to run on a real GPU, and what of it is missing.

The real loop runs slicerd with the NVML backend and the real `cuda-checkpoint`, the
launcher with `vllm serve MODEL`, and the trainer stub with its working set as a CUDA
tensor (`--device cuda`, PyTorch). Nothing is started unless all of them are present."""

from __future__ import annotations

import importlib.util
import shutil

from gpu_slicer.slicer.gpu import NvmlBackend


def _nvml() -> str | None:
    """None when NVML answers with at least one GPU, else why not."""
    try:
        if not NvmlBackend().devices():
            return "an NVIDIA GPU: NVML sees none"
    except Exception as e:  # GpuBackendError: no driver library, NVML_ERROR_*, ...
        return f"an NVIDIA driver with NVML (libnvidia-ml): {e.__cause__ or e}"
    return None


def missing(model: str | None) -> list[str]:
    """Everything the real loop lacks here, one line each (empty: it can run)."""
    out: list[str] = []
    if shutil.which("vllm") is None:
        out.append("vllm: the `vllm` command is not on PATH (pip install vllm)")
    if shutil.which("cuda-checkpoint") is None:
        out.append(
            "cuda-checkpoint: not on PATH (NVIDIA's tool, github.com/NVIDIA/cuda-checkpoint)"
        )
    nvml = _nvml()
    if nvml is not None:
        out.append(nvml)
    if importlib.util.find_spec("torch") is None:
        out.append("torch: the trainer stub's CUDA working set needs PyTorch")
    if not model:
        out.append("--model: the model vLLM should serve (a path or a Hugging Face name)")
    return out
