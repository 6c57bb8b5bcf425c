"""The dispatcher's one exception hierarchy.

Every failure the dispatcher reports is a :class:`DispatchError`. The library never
speaks HTTP: the front maps these classes to status codes at its edge (for example
``BadRequest`` -> 400, ``UnknownRevision`` -> 404 or 400, ``NotFound`` -> 404,
``DeadlineExceeded`` -> 504, ``StoreFull``/``StoreError`` -> 507/503), the way httpcore
maps transport errors in one place.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "DeadlineExceeded",
    "DispatchError",
    "IllegalTransition",
    "NotFound",
    "PoolUnavailable",
    "ReplicaError",
    "StateInUse",
    "StoreError",
    "StoreFull",
    "UnknownRevision",
    "quoted",
]


def quoted(value: object, limit: int = 50) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters of it:
    a long string is cut *before* quoting (so its quotes stay balanced) and marked with
    ``...`` after the closing quote."""
    if isinstance(value, str):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class DispatchError(Exception):
    """Base class of every error the dispatcher raises on purpose.

    ``param`` optionally names the request field at fault (OpenAI's error ``param``);
    without it the front infers one from the message where it can."""

    param: str | None = None

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class BadRequest(DispatchError):
    """A client request is invalid; the message says exactly which field and why."""


class UnknownRevision(DispatchError):
    """A request names a weight revision that was never published (or none is)."""

    param = "model"  # as vLLM's unknown model


class NotFound(DispatchError):
    """No sample with this id is known to the store."""


class DeadlineExceeded(DispatchError):
    """A pending request outlived its deadline; the message names pool and revision."""


class ReplicaError(DispatchError):
    """A vLLM replica answered an error, broke a bound, or could not be reached.

    ``status`` is the HTTP status vLLM answered, or ``None`` when there was no answer
    (timeout, connection refused, malformed body).
    """

    def __init__(
        self, message: str, status: int | None = None, *, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.status = status


class StoreError(DispatchError):
    """The durable store failed (I/O error, corrupt database); nothing was accepted."""


class StoreFull(StoreError):
    """The disk holding the store is full; the request was not journaled."""


class PoolUnavailable(StoreError):
    """The pool's Redis cannot be reached or failed a call (pool mode); nothing of the
    call is known to have happened unless its script says so."""


class IllegalTransition(DispatchError):
    """A phase change the turn loop's table does not allow (:mod:`dispatcher.model`); a
    bug, raised before anything changed."""


class StateInUse(DispatchError):
    """Another dispatcher owns the state directory (its lock is held)."""
