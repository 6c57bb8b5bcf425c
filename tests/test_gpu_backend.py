"""GPU backends are plugins (a registered name or module:attribute): every way a plugin can
be wrong is one precise error, never a traceback; and the cuda-checkpoint probe tells a
tool that cannot run from a driver without `--action`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from gpu_slicer.slicer.errors import GpuBackendError
from gpu_slicer.slicer.gpu import Device, backend_names, check_backend_name, open_backend
from gpu_slicer.slicer.park import CheckpointParker, ToolResult


class _Good:
    def devices(self) -> list[Device]:
        return [Device(0, "GPU-x", 1 << 30)]

    def free_bytes(self, index: int) -> int:
        return 1 << 30

    def processes(self, index: int) -> dict[int, int]:
        return {}


class _Partial:
    def devices(self) -> list[Device]:
        return []


def _broken() -> Any:
    raise RuntimeError("no such device file")


def test_fake_is_registered_by_the_test_doubles() -> None:
    assert backend_names()[0] == "nvml" and "fake" in backend_names()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("cuda", "unknown gpu backend 'cuda': one of nvml, fake"),
        (":x", "':x' is not module:attribute"),
        ("mod:", "'mod:' is not module:attribute"),
        (".rel:x", "'.rel:x' is not module:attribute"),
        ("a b:c", "'a b:c' is not module:attribute"),
        ("no_such_module_here:X", "'no_such_module_here:X' cannot be loaded: No module named"),
        (f"{__name__}:Missing", f"'{__name__}:Missing' cannot be loaded"),
        (f"{__name__}:_Partial", "has no method free_bytes()"),
        (f"{__name__}:_broken", "failed to start: no such device file"),
    ],
)
def test_a_bad_backend_is_one_precise_error(kind: str, message: str) -> None:
    with pytest.raises(GpuBackendError) as e:
        open_backend(kind)
    assert message in str(e.value)


def test_a_plugin_module_that_raises_on_import_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "exploding_backend.py").write_text("raise ZeroDivisionError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GpuBackendError, match="cannot be loaded: at import"):
        open_backend("exploding_backend:Backend")
    sys.modules.pop("exploding_backend", None)


def test_module_attribute_loads_a_factory() -> None:
    check_backend_name(f"{__name__}:_Good")
    backend = open_backend(f"{__name__}:_Good")
    assert backend.devices() == [Device(0, "GPU-x", 1 << 30)]


class _Runner:
    def __init__(self, result: ToolResult) -> None:
        self.result = result

    async def run(self, argv: list[str], timeout: float) -> ToolResult:
        return self.result


@pytest.mark.parametrize(
    ("rc", "out", "err", "note", "has_action"),
    [
        (0, "usage: --action lock --toggle --pid", "", "", True),
        (0, "usage: --toggle --pid --get-state", "", "driver lacks --action", False),
        (1, "", "cuda-checkpoint stub: needs psutil\n", "--help failed (exit 1): cuda", True),
        (127, "", "", "--help failed (exit 127)", True),
    ],
)
async def test_the_probe_tells_a_broken_tool_from_an_old_driver(
    tmp_path: Path, rc: int, out: str, err: str, note: str, has_action: bool
) -> None:
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    result = ToolResult((str(tool), "--help"), rc, out, err)
    parker = CheckpointParker(str(tool), _Runner(result))  # type: ignore[arg-type]
    with trio.fail_after(5):
        got = await parker.probe()
    assert (note in got) if note else got == ""
    assert parker.has_action is has_action
