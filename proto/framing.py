"""Framing: splitting a byte stream into lines, and a line into arguments.

A line is UTF-8 text ending in ``\\n``; a ``\\r`` before the ``\\n`` is ignored. Its
length, newline included, is bounded (`MAX_LINE` for requests). Arguments are separated
by one or more spaces: positionals first, then ``key=value`` pairs; server lines may end
in a free-text tail introduced by `` -- ``.
"""

from __future__ import annotations

from gpu_slicer.proto.errors import ErrorCode, LineTooLong, ProtocolError
from gpu_slicer.proto.values import KEY_RE, MAX_LINE

__all__ = ["LineBuffer", "decode_line", "split_args", "split_tail"]


class LineBuffer:
    """Splits a byte stream into lines.

    `max_line` bounds each line in bytes, its ``\\n`` included. Lines are returned
    without the ``\\n`` but with any ``\\r`` before it (the parsers drop it). After
    `LineTooLong` the stream cannot be resynchronised: the buffer raises again on
    every later `feed`, and the peer should be disconnected.
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        if max_line < 1:
            raise ProtocolError(ErrorCode.INTERNAL, f"max_line must be >= 1, got {max_line}")
        self.max_line = max_line
        self._buffer = bytearray()
        self._broken = False

    @property
    def pending(self) -> int:
        """Bytes buffered of the partial tail (a line whose ``\\n`` has not arrived)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add `data`; return every line it completes, each without its ``\\n``.

        Raises `LineTooLong` as soon as a complete line exceeds `max_line` bytes with
        its newline, or the partial tail reaches `max_line` bytes without one. Complete
        lines before the offending one in the same `data` are then discarded.
        """
        if self._broken:
            raise LineTooLong(f"stream already had a line longer than {self.max_line} bytes")
        buffer = self._buffer
        scan = len(buffer)
        buffer += data
        lines: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n", scan)
            if end < 0:
                break
            if end - start + 1 > self.max_line:
                self._fail(end - start + 1)
            lines.append(bytes(buffer[start:end]))
            start = scan = end + 1
        if len(buffer) - start >= self.max_line:
            self._fail(len(buffer) - start)
        del buffer[:start]
        return lines

    def _fail(self, size: int) -> None:
        self._broken = True
        self._buffer.clear()
        raise LineTooLong(f"line of {size}+ bytes exceeds the limit of {self.max_line} bytes")


def decode_line(line: bytes, max_line: int = MAX_LINE) -> str:
    """Check and decode one line: drop a trailing ``\\n`` and then ``\\r``, enforce
    `max_line` (newline included), require UTF-8 and a line that is not blank."""
    if not isinstance(line, bytes | bytearray | memoryview):
        raise ProtocolError(ErrorCode.INTERNAL, f"line must be bytes, got {type(line).__name__}")
    raw = bytes(line)
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if len(raw) + 1 > max_line:
        raise LineTooLong(f"line of {len(raw) + 1} bytes exceeds the limit of {max_line} bytes")
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(
            ErrorCode.BAD_ENCODING, f"line is not valid UTF-8 (byte {exc.start})"
        ) from None
    if not text.strip():
        raise ProtocolError(ErrorCode.EMPTY, "empty line")
    if "\n" in text:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "line contains a newline before its end")
    return text


def split_tail(text: str) -> tuple[str, str | None]:
    """Split a server line at its first `` -- ``: (head, text tail or None if absent)."""
    head, sep, tail = text.partition(" -- ")
    if sep:
        return head, tail
    if text.endswith(" --"):
        return text[:-3], ""
    return text, None


def split_args(what: str, text: str) -> tuple[list[str], dict[str, str]]:
    """Split space-separated arguments into positionals and a ``key=value`` dict.

    Raises BAD_ARGUMENT for a ``--`` token, a malformed or duplicate key, and a
    positional after a ``key=value`` pair. `what` prefixes error messages.
    """
    positionals: list[str] = []
    pairs: dict[str, str] = {}
    for token in text.split(" "):
        if not token:
            continue
        if token == "--":
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{what}: unexpected '--' (no text here)")
        key, sep, value = token.partition("=")
        if not sep:
            if pairs:
                raise ProtocolError(
                    ErrorCode.BAD_ARGUMENT,
                    f"{what}: positional argument {_short(token)} after key=value arguments",
                )
            positionals.append(token)
            continue
        if KEY_RE.fullmatch(key) is None:
            raise ProtocolError(
                ErrorCode.BAD_ARGUMENT, f"{what}: bad key {_short(key)} (keys match [a-z_]+)"
            )
        if key in pairs:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{what}: duplicate key {key}=")
        pairs[key] = value
    return positionals, pairs


def _short(token: str) -> str:
    text = repr(token)
    return text if len(text) <= 80 else text[:77] + "..."
