"""The fixed chaos set run by `make test` (each a seed and the fault kinds it covers)."""

from __future__ import annotations

from tests.chaos.runner import Scenario

DEADLINE_S = 45.0  # --sample-deadline in the fixed set: a stuck request resolves in time

FIXED: list[Scenario] = [
    Scenario(
        "restarts",
        seed=1,
        duration=18,
        faults=4,
        kinds=("kill-slicerd", "kill-dispatcher", "kill-trainer"),
        must=("kill-slicerd", "kill-dispatcher"),
        deadline=DEADLINE_S,
    ),
    Scenario(
        "checkpoint-faults",
        seed=2,
        duration=18,
        faults=4,
        kinds=("cc-fail", "cc-hang", "stop-slicerd", "stop-trainer"),
        must=("cc-fail", "cc-hang", "stop-slicerd"),
        deadline=DEADLINE_S,
    ),
    Scenario(
        "replica-faults",
        seed=3,
        duration=18,
        faults=4,
        kinds=("kill-launcher", "kill-vllm", "vllm-hang", "vllm-crash", "stop-vllm"),
        must=("kill-launcher", "vllm-hang", "vllm-crash"),
        deadline=DEADLINE_S,
    ),
    Scenario(
        "disk-and-stalls",
        seed=4,
        duration=18,
        faults=4,
        kinds=("disk-full", "client-stall", "stop-dispatcher", "stop-launcher"),
        must=("disk-full", "client-stall", "stop-dispatcher"),
        deadline=DEADLINE_S,
    ),
]
