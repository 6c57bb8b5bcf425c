"""What a launch needs to know, and the exit codes it can end with.

Both commands share `LaunchConfig` (the workload's registration and the supervision
rules); the vLLM profile adds `VllmConfig`. Exit codes follow sysexits.h where one fits;
`main` documents them for operators.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("launcher")


class Exit(enum.IntEnum):
    """Exit codes of `slicer-launch` other than the child's own."""

    FAILED = 1  # the vLLM boot failed (never healthy, sleep refused, exited early, port taken)
    USAGE = 64  # bad command line (EX_USAGE)
    UNREACHABLE = 69  # slicerd could not be reached to register at start (EX_UNAVAILABLE)
    FAULT = 70  # a FAULT arrived: the child's processes were stopped (EX_SOFTWARE)
    TIMEOUT = 75  # boot turn not granted / vLLM not healthy in time (EX_TEMPFAIL)
    REFUSED = 78  # slicerd refused the REGISTER (name taken, unknown GPU, ...) (EX_CONFIG)
    NOT_EXECUTABLE = 126  # COMMAND exists but cannot be executed (as a shell says)
    NOT_FOUND = 127  # COMMAND not found (as a shell says)


@dataclass(frozen=True)
class LaunchConfig:
    """The registration and supervision settings of one launch."""

    workload: str
    gpu: str | None = None
    park: str = "checkpoint"
    parked_max: int = 0
    # Cooperative workloads: what slicerd may do when nobody parks it (see PROTOCOL.md).
    park_fallback: str = "none"
    # Opt-in preemption (REGISTER max_turn=, park=checkpoint only); None: never.
    max_turn: float | None = None
    socket: str | None = None
    kill_grace: float = 5.0
    connect_timeout: float = 30.0  # how long the first REGISTER may keep retrying
    request_timeout: float = 10.0  # one connect+REGISTER attempt
    backoff_min: float = 0.1
    backoff_max: float = 5.0


@dataclass(frozen=True)
class VllmConfig:
    """The vLLM profile's boot settings."""

    ready_file: Path | None = None
    boot_timeout: float = 900.0
    health_timeout: float = 600.0
    sleep_level: int = 1
    sleep_timeout: float = 300.0
    health_poll: float = 0.25
    sleep_mode_flag: bool = True


def setup_logging(workload: str, level: str = "INFO") -> None:
    """Log to stderr, every line prefixed with `slicer-launch[NAME]:`."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"slicer-launch[{workload}]: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
