"""Fixtures of the real-vLLM tier: the real server and the stub, started once per module.

Four servers start together (their boots overlap): the real vLLM and the stub, each with
and without ``VLLM_SERVER_DEV_MODE``. The stub runs with ``--enable-sleep-mode`` (its
GPU semantics); the real CPU server cannot take that flag (refused at startup on CPU)
and its worker ignores sleep, which is what the contract test needs from it: the HTTP
behaviour of the routes. The pair's real servers and stubs take ``--scheduler-cls
vllm_tier.hold.HoldScheduler`` (``hold.py``: a request can be held running until an
abort ends it; every other request is scheduled as by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stubs.fakegpu import Ledger, parse_size
from vllm_tier import servers as sv


@pytest.fixture(scope="session")
def models() -> Path:
    """The tiny model revisions (base, rev-1, rev-2)."""
    return sv.models_dir()


@pytest.fixture(scope="module")  # stopped before the loop test boots its own vLLM
def pair(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[dict[str, sv.Server]]:
    """{"real", "stub", "real-nodev", "stub-nodev"}: ready servers on the base model."""
    base = tmp_path_factory.mktemp("pair")
    gpu = base / "gpu"
    gpu.mkdir()
    Ledger.init(gpu, 2, parse_size("80GiB"))  # one fake GPU per stub: no overlap
    env = {**os.environ, "FAKEGPU_DIR": str(gpu), "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    started: list[sv.Server] = []
    model = models / "base"
    for name, dev in (("real", True), ("real-nodev", False)):
        port = sv.free_port()
        started.append(
            sv.start(
                name,
                [*sv.real_argv(model, port), *sv.HOLD_FLAGS],
                sv.real_env(env, base / f"cache-{name}", dev=dev),
                base / f"{name}.log",
                sv.REAL_READY,
                port,
            )
        )
    for index, (name, dev) in enumerate((("stub", True), ("stub-nodev", False))):
        port = sv.free_port()
        stub_env = {**env, "CUDA_VISIBLE_DEVICES": str(index)}
        if dev:
            stub_env["VLLM_SERVER_DEV_MODE"] = "1"
        flags = ["--enable-sleep-mode", "--tokens-per-s", "200", "--fake-workload", name]
        flags += sv.HOLD_FLAGS
        started.append(
            sv.start(
                name,
                sv.stub_argv(model, port, *flags),
                stub_env,
                base / f"{name}.log",
                sv.STUB_READY,
                port,
            )
        )
    with sv.running(started):
        yield {s.name: s for s in started}
        assert Ledger(gpu).overlaps() == 0
