"""Sans-IO implementation of the slicer wire protocol, version 1 (see PROTOCOL.md).

Bytes in, messages out: `LineBuffer` splits a stream into lines, `parse_request` and
`parse_server_line` turn a line into a message, `encode` turns a message into a line.
Nothing here does I/O, and the only exception raised is `ProtocolError`.
"""

from gpu_slicer.proto.codec import encode
from gpu_slicer.proto.errors import ErrorCode, LineTooLong, ProtocolError
from gpu_slicer.proto.framing import LineBuffer
from gpu_slicer.proto.messages import (
    Acquire,
    Err,
    Event,
    Fault,
    Hello,
    Ok,
    ParkAsk,
    Parked,
    ParkFallback,
    ParkMode,
    Ping,
    Register,
    Release,
    ReleasePark,
    Reply,
    Request,
    ServerMessage,
    Status,
    Unregister,
    Waiting,
    Watch,
)
from gpu_slicer.proto.replies import parse_server_line
from gpu_slicer.proto.requests import parse_request
from gpu_slicer.proto.values import (
    MAX_LINE,
    MAX_SERVER_LINE,
    NAME_RE,
    PARKED_MAX_LIMIT,
    PROTO_VERSION,
    format_size,
    parse_size,
    validate_name,
)

__all__ = [
    "MAX_LINE",
    "MAX_SERVER_LINE",
    "NAME_RE",
    "PARKED_MAX_LIMIT",
    "PROTO_VERSION",
    "Acquire",
    "Err",
    "ErrorCode",
    "Event",
    "Fault",
    "Hello",
    "LineBuffer",
    "LineTooLong",
    "Ok",
    "ParkAsk",
    "ParkFallback",
    "ParkMode",
    "Parked",
    "Ping",
    "ProtocolError",
    "Register",
    "Release",
    "ReleasePark",
    "Reply",
    "Request",
    "ServerMessage",
    "Status",
    "Unregister",
    "Waiting",
    "Watch",
    "encode",
    "format_size",
    "parse_request",
    "parse_server_line",
    "parse_size",
    "validate_name",
]
