"""What a client makes of the server's words: one exception hierarchy for every client.

The session (`proto.session`) raises these, so a sync, a trio and an asyncio transport
raise alike: ``ERR`` is a `ClientError` carrying the wire code (unknown codes stay plain
strings), a ``FAULT`` that arrives while a request waits for its reply is `Faulted`, a
connection that cannot be made or was lost is `Unreachable`. A server that breaks the
protocol is `proto.RemoteProtocolError` (a `ProtocolError`, not a `ClientError`).
"""

from __future__ import annotations

from gpu_slicer.proto.messages import Err, Fault, Reply

__all__ = ["HINTS", "ClientError", "Faulted", "Unreachable"]

# What to do, for the codes a library user meets first (the CLIs say the same): in the
# exception's words (`str`), never in `text` (the server's own words, which callers log
# or match).
HINTS: dict[str, str] = {
    "unreachable": "is slicerd running? The socket is the path given, else $SLICER_SOCKET "
    "(slicer-launch sets it for its command), else /run/slicer/slicer.sock",
    "exists": "registered by another connection: under slicer-launch the launcher already "
    "registered it, so connect with Slicer.from_env() and acquire, do not register",
    "unknown-workload": "no workload of that name is registered: register it first, or run "
    "under slicer-launch and use $SLICER_WORKLOAD; 'slicerctl status' lists them",
    "not-registrant": "only the connection that registered the workload may do this (under "
    "slicer-launch that is the launcher)",
}


class ClientError(Exception):
    """The daemon refused a request (``ERR``); `code` is the wire code, `text` its words,
    `hint` what to do about it (`HINTS`; "" when none), which its `str` ends with."""

    def __init__(self, code: str, text: str) -> None:
        self.code, self.text = code, text
        self.hint = HINTS.get(code, "")
        said = f"{code}: {text}" if text else code
        super().__init__(f"{said} ({self.hint})" if self.hint else said)


class Unreachable(ClientError):
    """The daemon's socket cannot be reached, or the connection dropped (code
    ``unreachable``)."""

    def __init__(self, text: str) -> None:
        super().__init__("unreachable", text)


class Faulted(ClientError):
    """A ``FAULT`` line arrived while the request waited for its reply: the workload's
    processes must stop. `fault` is that line and `reply` the request's own reply, which
    was read first so that the connection stays in step; `code` is the reply's ``ERR``
    code when the request was refused too, else ``fault``."""

    def __init__(self, fault: Fault, reply: Reply | None = None) -> None:
        code = str(reply.code) if isinstance(reply, Err) else "fault"
        super().__init__(code, f"{fault.workload} turn={fault.turn} {fault.reason}")
        self.fault, self.reply = fault, reply
