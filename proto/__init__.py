"""Sans-IO implementation of the slicer wire protocol, version 1 (see PROTOCOL.md).

Bytes in, messages out: `LineBuffer` splits a stream into lines, `parse_request` and
`parse_server_line` turn a line into a message, `encode` turns a message into a line.
`ClientSession` is a whole client connection's side of the protocol (reply ordering,
FAULT/WAITING/PARK/EVENT lines, ERR -> `ClientError`), for transports to drive.
Nothing here does I/O. Parsing and encoding raise only `ProtocolError`; the session adds
the client's errors (`ClientError`, `Faulted`, `Unreachable`, `RemoteProtocolError`).
"""

from gpu_slicer.proto.client_errors import ClientError, Faulted, Unreachable
from gpu_slicer.proto.codec import encode
from gpu_slicer.proto.errors import ErrorCode, LineTooLong, ProtocolError, RemoteProtocolError
from gpu_slicer.proto.framing import LineBuffer
from gpu_slicer.proto.messages import (
    Acquire,
    Early,
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
    Preempted,
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
from gpu_slicer.proto.session import Call, ClientSession, Turn
from gpu_slicer.proto.values import (
    EARLY_LIMIT,
    MAX_LINE,
    MAX_SERVER_LINE,
    MAX_TURN_LIMIT,
    NAME_RE,
    PARKED_MAX_LIMIT,
    PROTO_VERSION,
    format_size,
    parse_size,
    validate_name,
)

__all__ = [
    "EARLY_LIMIT",
    "MAX_LINE",
    "MAX_SERVER_LINE",
    "MAX_TURN_LIMIT",
    "NAME_RE",
    "PARKED_MAX_LIMIT",
    "PROTO_VERSION",
    "Acquire",
    "Call",
    "ClientError",
    "ClientSession",
    "Early",
    "Err",
    "ErrorCode",
    "Event",
    "Fault",
    "Faulted",
    "Hello",
    "LineBuffer",
    "LineTooLong",
    "Ok",
    "ParkAsk",
    "ParkFallback",
    "ParkMode",
    "Parked",
    "Ping",
    "Preempted",
    "ProtocolError",
    "Register",
    "Release",
    "ReleasePark",
    "RemoteProtocolError",
    "Reply",
    "Request",
    "ServerMessage",
    "Status",
    "Turn",
    "Unreachable",
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
