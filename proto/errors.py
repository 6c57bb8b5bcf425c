"""Wire error codes and the one exception type that `proto` raises.

Every failure inside `proto` -- a malformed request, an undecodable server line, a
message that cannot be encoded -- is a `ProtocolError` carrying an `ErrorCode`. The
server answers such a failure with ``ERR <code> -- <message>``; see ``proto/PROTOCOL.md``.
`RemoteProtocolError` is the client's name for a server that broke the protocol. What the
client session makes of the server's words is in `proto.client_errors`.
"""

from __future__ import annotations

import enum

__all__ = ["ErrorCode", "LineTooLong", "ProtocolError", "RemoteProtocolError"]


class ErrorCode(enum.StrEnum):
    """Every error code that may appear after ``ERR`` on the wire."""

    # Codes named by the shared protocol contract.
    UNSUPPORTED_PROTO = "unsupported-proto"
    EXISTS = "exists"
    FORBIDDEN = "forbidden"
    NO_SUCH_PROCESS = "no-such-process"
    UNKNOWN_GPU = "unknown-gpu"
    BAD_REQUEST = "bad-request"
    UNKNOWN_WORKLOAD = "unknown-workload"
    BUSY = "busy"
    TIMEOUT = "timeout"
    FAULTED = "faulted"
    GONE = "gone"
    RESTORE_FAILED = "restore-failed"
    NOT_HOLDER = "not-holder"
    PARK_FAILED = "park-failed"
    LINE_TOO_LONG = "line-too-long"
    # Finer codes added by this project (documented in proto/PROTOCOL.md).
    EMPTY = "empty"
    BAD_ENCODING = "bad-encoding"
    UNKNOWN_VERB = "unknown-verb"
    BAD_NAME = "bad-name"
    MISSING_ARGUMENT = "missing-argument"
    BAD_ARGUMENT = "bad-argument"
    NOT_REGISTRANT = "not-registrant"
    LIMIT = "limit"
    IN_USE = "in-use"
    NOT_ASKED = "not-asked"
    PARKER_UNAVAILABLE = "parker-unavailable"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A protocol violation: `code` is the wire error code, `message` says what was wrong."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class LineTooLong(ProtocolError):
    """A line (complete, or a partial tail still without its newline) exceeds its limit."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.LINE_TOO_LONG, message)
        self.args = (message,)


class RemoteProtocolError(ProtocolError):
    """The server broke the protocol: a malformed line, or a reply no request waits for."""
