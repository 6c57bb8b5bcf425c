"""Limits and the syntax of single argument values: names, sizes, integers, numbers.

Each ``parse_*`` helper turns the text of one argument into a value and raises
`ProtocolError` with a message that names the verb and key; each ``check_*`` helper
validates a value that is about to be encoded, so that encode and parse agree.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from gpu_slicer.proto.errors import ErrorCode, ProtocolError

__all__ = [
    "CLIENT_RE",
    "CODE_RE",
    "EARLY_LIMIT",
    "GPU_RE",
    "KEY_RE",
    "MAX_LINE",
    "MAX_SERVER_LINE",
    "NAME_RE",
    "PARKED_MAX_LIMIT",
    "PROTO_VERSION",
    "format_size",
    "parse_size",
    "validate_name",
]

MAX_LINE = 4096
"""Longest request line, and longest server line without a JSON body, in bytes incl. ``\\n``."""

MAX_SERVER_LINE = 1024 * 1024
"""Longest server line with a JSON body (``OK {...}`` from STATUS, ``EVENT {...}``)."""

PROTO_VERSION = 1
PARKED_MAX_LIMIT = 10 * 1024**3
MAX_TURN_LIMIT = 86400.0  # REGISTER max_turn=, seconds
EARLY_LIMIT = 1024**4  # ACQUIRE early=, bytes (1 TiB: more than any one GPU holds)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
"""Workload names; always use ``fullmatch``."""
GPU_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""A GPU token: an index such as ``0`` or a UUID such as ``GPU-8f3c...``."""
CLIENT_RE = re.compile(r"[\x21-\x7e]{1,128}")
"""A HELLO client name: printable ASCII without spaces."""
KEY_RE = re.compile(r"[a-z_]+")
"""Keys of ``key=value`` arguments."""
CODE_RE = re.compile(r"[a-z][a-z0-9-]{0,63}")
"""Error codes and FAULT reasons."""

_INT_RE = re.compile(r"[0-9]{1,20}")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SIZE_RE = re.compile(r"([0-9]{1,30}(?:\.[0-9]{1,30})?)(B|KiB|MiB|GiB)?")
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
INT_MAX = 2**63 - 1
PID_MAX = 2**31 - 1


def validate_name(name: str) -> str:
    """Return `name` if it is a valid workload name, else raise ProtocolError(BAD_NAME)."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ProtocolError(
            ErrorCode.BAD_NAME,
            f"workload name must match {NAME_RE.pattern}, got {_show(name)}",
        )
    return name


def parse_size(text: str) -> int:
    """Parse a byte size: plain bytes or a B/KiB/MiB/GiB suffix (``"10GiB"`` -> 10737418240).

    A fractional number is accepted when it names a whole number of bytes
    (``"1.5KiB"`` -> 1536). Raises ProtocolError(BAD_ARGUMENT) on anything else.
    """
    match = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"size must be a number of bytes with an optional B, KiB, MiB or GiB suffix, "
            f"got {_show(text)}",
        )
    number, unit = match.groups()
    value = Fraction(number) * _UNITS[unit or "B"]
    if value.denominator != 1:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, f"size must be a whole number of bytes, got {_show(text)}"
        )
    return int(value)


def format_size(n: int) -> str:
    """Format a byte count in the largest unit that divides it exactly (``1536`` -> ``1536``,
    ``2048`` -> ``2KiB``, ``0`` -> ``0``); `parse_size` reads the result back exactly."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"size must be an int >= 0, got {n!r}")
    if n == 0:
        return "0"
    for unit in ("GiB", "MiB", "KiB"):
        if n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def parse_int(verb: str, key: str, text: str, minimum: int, maximum: int = INT_MAX) -> int:
    """Parse a decimal integer argument in ``minimum..maximum``."""
    if _INT_RE.fullmatch(text) is None:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, f"{verb}: {key} must be an integer, got {_show(text)}"
        )
    value = int(text)
    if not minimum <= value <= maximum:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, _range_message(verb, key, minimum, maximum, text)
        )
    return value


def check_int(verb: str, key: str, value: object, minimum: int, maximum: int = INT_MAX) -> int:
    """Validate an integer field before encoding it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{verb}: {key} must be an int, got {value!r}")
    if not minimum <= value <= maximum:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, _range_message(verb, key, minimum, maximum, str(value))
        )
    return value


def parse_seconds(verb: str, key: str, text: str) -> float:
    """Parse a finite, non-negative number of seconds (decimal or exponent notation)."""
    value = math.nan
    if _NUMBER_RE.fullmatch(text) is not None:
        value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"{verb}: {key} must be a finite number of seconds >= 0, got {_show(text)}",
        )
    return value


def check_seconds(verb: str, key: str, value: object) -> str:
    """Validate a seconds field and return its repr-exact text."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{verb}: {key} must be a float, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"{verb}: {key} must be a finite number of seconds >= 0, got {value!r}",
        )
    return repr(number)


def parse_choice(verb: str, key: str, text: str, choices: tuple[str, ...]) -> str:
    """Check that `text` is one of `choices` (case-sensitive)."""
    if text not in choices:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"{verb}: {key} must be one of {'|'.join(choices)}, got {_show(text)}",
        )
    return text


def check_token(verb: str, key: str, value: object, pattern: re.Pattern[str]) -> str:
    """Validate a token-valued field (GPU, client name, error code) against `pattern`."""
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"{verb}: {key} must match {pattern.pattern}, got {_show(value)}",
        )
    return value


def _range_message(verb: str, key: str, minimum: int, maximum: int, got: str) -> str:
    if maximum == INT_MAX:
        return f"{verb}: {key} must be >= {minimum}, got {got}"
    return f"{verb}: {key} must be between {minimum} and {maximum}, got {got}"


def _show(value: object) -> str:
    """Quote a bad value for an error message, shortened so the reply stays one short line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
