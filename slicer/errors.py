"""The slicer's exception hierarchy.

The core never speaks wire codes; the server maps these classes to `proto.ErrorCode` at the
edge (see `slicer.server.error_code`).
"""

from __future__ import annotations


class SlicerError(Exception):
    """Base of every error the slicer raises on purpose."""


class ConfigError(SlicerError):
    """The configuration file or flags are invalid."""


class GpuBackendError(SlicerError):
    """The GPU backend cannot be used (no driver, no ledger)."""


class IllegalTransition(SlicerError):
    """A workload state change that the transition table forbids; state is unchanged."""


class RequestError(SlicerError):
    """A request that is refused; the state machine is unchanged."""


class UnknownWorkload(RequestError):
    """No live registration has that name."""


class Exists(RequestError):
    """A live registration already holds that name."""


class Forbidden(RequestError):
    """The peer's uid may not act on that process or workload."""


class NoSuchProcess(RequestError):
    """The pid does not name a live process."""


class UnknownGpu(RequestError):
    """The gpu index or UUID names no GPU of this node."""


class Busy(RequestError):
    """This connection already holds or waits for a turn."""


class Timeout(RequestError):
    """The ACQUIRE wait expired; the connection is no longer queued."""


class Faulted(RequestError):
    """The workload is faulted; it gets no turn until it registers anew."""


class Gone(RequestError):
    """The workload was unregistered while the request waited."""


class RestoreFailed(RequestError):
    """The restore failed; the workload is now faulted."""


class NotHolder(RequestError):
    """The caller does not hold the turn it names."""


class NotRegistrant(RequestError):
    """Only the registrant may UNREGISTER a workload."""


class ParkFailed(RequestError):
    """The park failed; the turn ended but the GPU stays taken."""


class LimitReached(RequestError):
    """A configured limit (workloads, queue length, connections) is reached."""


class InUse(RequestError):
    """A process of the registering tree already belongs to another live workload."""


class NotAsked(RequestError):
    """A PARKED answer names no PARK the slicer is waiting for."""


class NoParker(RequestError):
    """A REGISTER needs slicerd's parker (cuda-checkpoint, or the driver API) and it cannot
    run (wire code ``parker-unavailable``)."""
