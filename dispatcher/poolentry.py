"""A pool's stream entry read back as a :class:`~dispatcher.model.Pending`, or
:class:`BadEntry` naming the field that this release cannot read and why.

An entry is written by ENQUEUE (:mod:`dispatcher.poolscripts`: fields ``i`` id, ``k``
kind, ``a`` params JSON, ``d`` deadline seconds, ``t`` packed token ids or ``x`` text,
``m`` chat messages JSON). Another release, or a hand edit, may write one this release
cannot read: the claim then hands it back a bounded number of times and puts it aside
(:data:`~dispatcher.poolscripts.UNREADABLE`), failed with the error built here.
"""

from __future__ import annotations

import array
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_slicer.dispatcher.model import Pending
from gpu_slicer.dispatcher.poolsummary import entry_ms
from gpu_slicer.dispatcher.rows import blob_to_tokens

__all__ = ["BadEntry", "entry_id", "read_entry", "read_entry_deadline", "unreadable_error"]

KINDS = ("completion", "chat")
MAX_ID = 128
T = TypeVar("T")

_MEANING = {
    "i": "the request id",
    "k": "the request kind",
    "a": "the request parameters",
    "d": "the deadline",
    "t": "the prompt's token ids",
    "x": "the prompt text",
    "m": "the chat messages",
}


class BadEntry(ValueError):
    """An entry field this release cannot read: ``field`` (its name in the entry) and
    ``reason``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"field {field!r} ({_MEANING.get(field, 'unknown')}): {reason}")
        self.field = field
        self.reason = reason


def _read(f: dict[bytes, bytes], key: str, parse: Callable[[bytes], T]) -> T:
    raw = f.get(key.encode())
    if raw is None:
        raise BadEntry(key, "missing")
    try:
        return parse(raw)
    except (ValueError, TypeError, KeyError) as e:  # UnicodeDecodeError is a ValueError
        raise BadEntry(key, f"{type(e).__name__}: {e}"[:300]) from None


def _id(raw: bytes) -> str:
    sid = raw.decode("ascii")
    if not 0 < len(sid) <= MAX_ID:
        raise ValueError(f"{len(sid)} characters, not 1 to {MAX_ID}")
    return sid


def _kind(raw: bytes) -> str:
    kind = raw.decode("ascii")
    if kind not in KINDS:
        raise ValueError(f"{kind[:40]!r} is not one of {', '.join(KINDS)}")
    return kind


def _params(raw: bytes) -> dict[str, Any]:
    v = json.loads(raw)
    if not isinstance(v, dict):
        raise TypeError(f"a JSON {type(v).__name__}, not an object")
    return v


def _deadline(raw: bytes) -> float:
    v = float(raw.decode("ascii"))
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{v!r} is not a finite number of seconds >= 0")
    return v


def _tokens(raw: bytes) -> array.array[int]:
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes, not a whole number of int32 token ids")
    return blob_to_tokens(raw)


def _messages(raw: bytes) -> bytes:
    if not isinstance(json.loads(raw), list):
        raise TypeError("not a JSON array")
    return raw


def read_entry_deadline(raw: bytes) -> float:
    """An entry's deadline field ``d`` (seconds after its acceptance); :class:`BadEntry`
    when it cannot be read ("" when it is missing)."""
    return _read({b"d": raw} if raw else {}, "d", _deadline)


def entry_id(flat: list[bytes]) -> str:
    """The request id of an entry's fields, or "" when it cannot be read."""
    f = dict(zip(flat[::2], flat[1::2], strict=False))
    try:
        return _read(f, "i", _id)
    except BadEntry:
        return ""


def read_entry(pool: str, revision: str, eid: str, flat: list[bytes]) -> Pending:
    """The pending request of stream entry ``eid`` (its fields ``flat``) of ``revision``;
    :class:`BadEntry` for the first field that cannot be read."""
    if len(flat) % 2:
        raise BadEntry("?", f"{len(flat)} field names and values: not pairs")
    f = dict(zip(flat[::2], flat[1::2], strict=True))
    sid = _read(f, "i", _id)
    kind = _read(f, "k", _kind)
    params = _read(f, "a", _params)
    deadline = _read(f, "d", _deadline)
    prompt: array.array[int] | bytes | None = None
    messages: bytes | None = None
    if b"t" in f:
        prompt = _read(f, "t", _tokens)
    elif b"x" in f:
        prompt = _read(f, "x", bytes)
    if kind == "chat":
        messages = _read(f, "m", _messages)
    elif prompt is None:
        raise BadEntry("t", "missing (a completion has token ids 't' or text 'x')")
    accepted = entry_ms(eid) / 1000
    return Pending(
        id=sid, pool=pool, revision=revision, kind=kind, params=params, prompt=prompt,
        messages=messages, accepted_at=accepted, deadline=accepted + deadline, attempts=0,
    )  # fmt: skip


def unreadable_error(pool: str, revision: str, eid: str, why: BadEntry, reads: int) -> str:
    """The error a request put aside unread fails with (names pool, field and reason)."""
    return (
        f"unreadable request: pool {pool} revision {revision} entry {eid}: {why}; "
        f"no replica could read it in {reads} tries (another release's entry?), so it was "
        f"put aside (kept in the pool's 'aside' stream)"
    )
