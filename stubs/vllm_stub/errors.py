"""vLLM's error bodies and the stub's error exception.

Every error is ``{"error": {"message", "type", "param", "code"}}`` as in vLLM 0.32's
exception handlers:

- request validation (FastAPI / pydantic: a bad query value, a missing or mistyped
  body field, a body that is not JSON): 400, ``type`` ``"Bad Request"``, ``param`` the
  dotted location (``query.mode``, ``body.new_version``, ``body.0``), ``message``
  ``"1 validation error:\\n  {...}"`` (see :func:`invalid`);
- a ``HTTPException`` raised by a route (``/collective_rpc`` body checks): 400,
  ``"Bad Request"``, ``param`` null;
- vLLM's own validation (``VLLMValidationError``): 400 ``"BadRequestError"`` with
  ``param`` the parameter, and `` (parameter=..., value=...)`` appended to the message;
- unknown model: 404 ``"NotFoundError"``, ``param`` ``"model"``;
- anything else: 500 ``"InternalServerError"`` (503 ``"ServiceUnavailableError"``).

Messages pass through vLLM's ``sanitize_message`` (absolute paths under /tmp, /home,
... become ``<path>``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "DEAD_MESSAGE",
    "PAUSED_MESSAGE",
    "EngineError",
    "Paused",
    "error_body",
    "invalid",
    "rpc_failed",
    "sanitize",
    "validation",
]

DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


class EngineError(Exception):
    """A failed call; ``status`` is the HTTP status, ``type`` / ``param`` the body's."""

    def __init__(
        self,
        message: str,
        status: int = 500,
        *,
        etype: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.etype = etype or _TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.status, self.etype, self.param)


class Paused(EngineError):
    """New requests while paused with mode abort or wait (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__(PAUSED_MESSAGE, 503)


def sanitize(message: str) -> str:
    """vLLM's ``sanitize_message``: strip addresses, tracebacks and file paths."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_body(
    message: str, status: int, etype: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": sanitize(message),
            "type": etype or _TYPES.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def _summary(value: Any) -> Any:
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value if isinstance(value, str) else str(value)


def invalid(
    loc: tuple[str | int, ...], kind: str, msg: str, value: Any = None, **ctx: Any
) -> EngineError:
    """A FastAPI request-validation error (400 ``"Bad Request"``, ``param`` = ``loc``)."""
    where = ".".join(str(p) for p in loc)
    err: dict[str, Any] = {"type": kind, "loc": where, "msg": msg, "input": _summary(value)}
    if ctx:
        err["ctx"] = ctx
    return EngineError(f"1 validation error:\n  {err}", 400, etype="Bad Request", param=where)


def validation(message: str, param: str | None = None, value: Any = None) -> EngineError:
    """vLLM's ``VLLMValidationError``: 400 ``"BadRequestError"``."""
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return EngineError(text, 400, param=param)


def rpc_failed(worker_error: str) -> EngineError:
    """A worker-side failure of a ``collective_rpc`` (500), worded as vLLM words it."""
    return EngineError(
        f"Call to collective_rpc method failed: Worker failed with error '{worker_error}', "
        "please check the stack trace above for the root cause"
    )
