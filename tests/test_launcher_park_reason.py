"""launcher.registration.park_reason: why slicerd asked for a park, read from STATUS."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_slicer.launcher.registration import park_reason

WHY = "its holder closed its connection mid-turn"
STATUS: dict[str, Any] = {
    "gpus": [{"index": 0, "park_reason": None}, {"index": 1, "park_reason": WHY}],
    "workloads": [{"name": "t", "gpu": 0}, {"name": "v", "gpu": 1}],
}


@pytest.mark.parametrize(
    ("status", "workload", "want"),
    [
        (STATUS, "v", WHY),
        (STATUS, "t", None),  # its GPU is asked nothing
        (STATUS, "x", None),  # not registered (any more)
        ({}, "v", None),  # an older slicerd, or an answer of another shape
        ({"gpus": "?", "workloads": []}, "v", None),
        (
            {"gpus": [{"index": 1, "park_reason": 7}], "workloads": [{"name": "v", "gpu": 1}]},
            "v",
            None,
        ),
    ],
)
def test_park_reason(status: dict[str, Any], workload: str, want: str | None) -> None:
    assert park_reason(status, workload) == want
