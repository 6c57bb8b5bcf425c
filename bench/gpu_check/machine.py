"""The GPU check's view of the machine: the GPU (gpumem's probe line), its PCIe link,
host memory, the cuda-checkpoint tool and what this checkout's slicerd offers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.gpu_check import figures


class Missing(Exception):
    """A prerequisite is missing: the check exits 2."""


def pcie_link() -> dict[str, Any]:
    """GPU 0's PCIe link, current and max generation and width (pynvml, else nvidia-smi),
    and the one the bound uses (`figures.link_used`)."""
    cur_gen = cur_width = max_gen = max_width = None
    source = "none"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            cur_gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)
            cur_width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
            max_gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
            max_width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
            source = "pynvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, or it cannot read the link: ask nvidia-smi
        fields = (
            "pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"
        )
        try:
            res = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            vals = [_int(v) for v in res.stdout.strip().split(",")]
            if len(vals) == 4:
                cur_gen, cur_width, max_gen, max_width = vals
                source = "nvidia-smi"
        except (OSError, subprocess.TimeoutExpired):
            pass
    gen, width = figures.link_used(cur_gen, cur_width, max_gen, max_width)
    return {
        "source": source,
        "current": [cur_gen, cur_width],
        "max": [max_gen, max_width],
        "gen": gen,
        "width": width,
        "gbps": figures.link_gbps(gen, width),
        "anchored": gen in figures.ANCHORED_GENS and width == 16,
    }


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def host_available() -> int | None:
    """MemAvailable in bytes (a checkpoint keeps the bytes in host memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def find_tool(libcuda: str | None) -> str | None:
    """cuda-checkpoint on PATH, else beside the driver's library or in the usual places."""
    found = shutil.which("cuda-checkpoint")
    if found:
        return found
    dirs = ["/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin", "/usr/lib/nvidia"]
    if libcuda and os.path.isabs(libcuda):
        lib_dir = Path(os.path.realpath(libcuda)).parent
        dirs += [str(lib_dir), str(lib_dir / "nvidia"), str(lib_dir.parent / "bin")]
    for d in dirs:
        p = Path(d) / "cuda-checkpoint"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def tool_mode(tool: str) -> str:
    """``action`` when the tool's --help has --action (r570+), else ``toggle`` (r550)."""
    try:
        res = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unusable"
    return "action" if "--action" in res.stdout + res.stderr else "toggle"


def daemon_has_parker_flag(python: str) -> bool:
    """Whether this checkout's slicerd takes ``--parker``."""
    res = subprocess.run(
        [python, "-m", "gpu_slicer.slicer.daemon", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return "--parker" in res.stdout
