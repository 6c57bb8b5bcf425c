"""What ``python -m stubs.vllm_stub serve`` was told: one frozen record.

Its own module so the command line (:mod:`stubs.vllm_stub.cli`, which builds it) and the
server (:mod:`stubs.vllm_stub.server`, which runs it) both import it and neither imports
the other's importer: cli -> server -> config, one way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """Everything ``serve`` was told."""

    model: str
    served_model_names: tuple[str, ...]  # the first names the model in responses
    host: str
    port: int
    enable_sleep_mode: bool
    gpu_memory_utilization: float
    max_model_len: int
    weights_bytes: int
    context_bytes: int
    tokens_per_s: float
    boot_delay: float
    reload_seconds: float
    workload: str
    fail_reload: bool
    hang_requests: bool
    gpu: int
    dev_mode: bool
    http_server: str = "hypercorn"  # or "lean": gpu_slicer.dispatcher.httpserver
    # Real vLLM 0.32's EngineCore outlives a SIGKILLed API server (`core.main`).
    core_outlives_server: bool = False
    # --scheduler-cls vllm_tier.hold.HoldScheduler (the only class the stub knows)
    hold_scheduler: bool = False
