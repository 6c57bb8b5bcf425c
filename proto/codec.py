"""`encode`: one entry point that turns any protocol message into its wire line."""

from __future__ import annotations

from gpu_slicer.proto.errors import ErrorCode, ProtocolError
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
    Ping,
    Preempted,
    Register,
    Release,
    Request,
    ServerMessage,
    Status,
    Unregister,
    Waiting,
    Watch,
)
from gpu_slicer.proto.replies import encode_server_message
from gpu_slicer.proto.requests import encode_request

__all__ = ["encode"]

_REQUESTS = (Hello, Ping, Register, Acquire, Release, Parked, Unregister, Status, Watch)
_SERVER = (Ok, Err, Fault, Waiting, Early, Preempted, ParkAsk, Event)


def encode(msg: Request | ServerMessage) -> bytes:
    """Encode a request or server message as one UTF-8 line ending in ``\\n``.

    For every valid request ``parse_request(encode(r)) == r`` and the line fits in
    `MAX_LINE`; likewise ``parse_server_line(encode(m)) == m`` for server messages
    (whose ``Err``/``Fault`` text is normalised: newlines become spaces). Raises
    `ProtocolError` for a message whose fields are invalid.
    """
    if isinstance(msg, _REQUESTS):
        return encode_request(msg)
    if isinstance(msg, _SERVER):
        return encode_server_message(msg)
    raise ProtocolError(ErrorCode.INTERNAL, f"not a protocol message: {type(msg).__name__}")
