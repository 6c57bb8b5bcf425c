"""The plain records `SlicerState` is built with and handed: its limits and a registering
process's identity. `slicer.state` re-exports both (its callers import them from there)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Bounds the state machine enforces (each refusal is `LimitReached`)."""

    max_workloads: int = 256
    max_queue: int = 4096
    fault_kill_after: float = 60.0
    recheck_every: float = 0.5
    adopt_grace: float = 60.0
    registrant_park_timeout: float = 60.0
    # How far above its parked floor a holder's cooperative park may leave a workload
    # (`Workload.parked_floor`) and still count as a park: the noise of a slept vLLM's
    # residue (allocator caches, lazily made workspaces), far below any model's weights.
    parked_slack: int = 512 * 1024**2
    # Foreign memory (no workload's) on a GPU blocks grants there (config `foreign`).
    foreign_blocks: bool = True
    max_connections: int = 1024
    max_connections_per_uid: int = 64  # root and the allowed group are exempt
    reserved_connections: int = 32  # of max_connections, kept for root
    # Fit-aware turns (`slicer.fit`): freeze instead of park when the next one fits.
    fit_aware: bool = False
    fit_headroom: int = 2 * 1024**3
    # Early starts (`slicer.early`): honour ACQUIRE early= when the bytes fit; the least
    # the waiter's wait= runs on once told (the park's bound, and a fault's kill delay).
    early_start: bool = True
    early_hold: float = 180.0


@dataclass(frozen=True)
class ProcessInfo:
    """What the server learned of a registering process (pid, start time, owner)."""

    pid: int
    start_time: float
    uid: int
    # The number the registrant sent and its PID namespace, when that namespace is not
    # slicerd's (a pod): STATUS shows both numbers. None otherwise.
    ns_pid: int | None = None
    pidns: int | None = None
