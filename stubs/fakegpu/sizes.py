"""Byte sizes as people write them: ``80GiB``, ``512MiB``, ``25GB``, ``25e9``, ``1024``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB)
powers of 1000; a bare number is bytes. Units are case-insensitive, a trailing ``/s``
is ignored so that bandwidths (``25GB/s``) parse too.
"""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*([A-Za-z]*)\s*(?:/s)?\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``80GiB`` or ``1024`` into a number of bytes.

    Raises ``ValueError`` for anything that is not a non-negative size.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative size: {text}")
        return text
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    return int(float(number) * factor)


def format_size(nbytes: int) -> str:
    """Render a byte count the way CUDA's OOM message does (``1.50 GiB``)."""
    value = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
