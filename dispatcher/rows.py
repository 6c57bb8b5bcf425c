"""The sample table's row format: the schema, how prompts and bodies are encoded in it,
and the rows one group commit writes (:class:`Staged`, :class:`Finish`).

Apart from :mod:`dispatcher.store` so the store holds the queue's behaviour (transactions,
the pending index, the results cache) and this module what its rows look like on disk.
Token prompts are stored as little-endian ``int32`` blobs (the ``array('i')`` they are
held as in memory); a result body is stored as TEXT when it is UTF-8 (always, for JSON),
else as a BLOB, and reads back byte for byte either way.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass
from typing import Any

from gpu_slicer.dispatcher.model import Pending

__all__ = [
    "SCHEMA",
    "Finish",
    "Staged",
    "blob_to_tokens",
    "body_bytes",
    "body_value",
    "tokens_to_blob",
]

# array('i') is 4 bytes on every platform CPython supports; the memory figure relies on it.
assert array.array("i").itemsize == 4

SCHEMA = """
CREATE TABLE IF NOT EXISTS revision (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    pool TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL, published_at REAL NOT NULL,
    UNIQUE (pool, name));
CREATE TABLE IF NOT EXISTS sample (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE, pool TEXT NOT NULL, revision TEXT NOT NULL, kind TEXT NOT NULL,
    params TEXT NOT NULL, prompt BLOB, prompt_is_text INTEGER NOT NULL DEFAULT 0,
    messages BLOB, accepted_at REAL NOT NULL, deadline REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, status TEXT NOT NULL,
    body TEXT, error TEXT, finished_at REAL);
CREATE INDEX IF NOT EXISTS sample_pending ON sample (pool, status);
"""


def tokens_to_blob(tokens: array.array[int]) -> bytes:
    """A token prompt as the ``prompt`` column stores it."""
    # Stored little-endian so a database moved between machines still reads back.
    if sys.byteorder == "big":
        tokens = array.array("i", tokens)
        tokens.byteswap()
    return tokens.tobytes()


def blob_to_tokens(blob: bytes) -> array.array[int]:
    """A ``prompt`` column's blob back as the token array (inverse of :func:`tokens_to_blob`)."""
    tokens = array.array("i")
    tokens.frombytes(blob)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def body_value(raw: bytes) -> str | bytes:
    """How a body is stored: TEXT when it is UTF-8 (it reads back byte for byte), else
    the bytes as a BLOB."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def body_bytes(value: str | bytes) -> bytes:
    """A stored body back as the bytes vLLM returned (inverse of :func:`body_value`)."""
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


@dataclass(frozen=True)
class Staged:
    """A validated request not journaled yet (:meth:`Store.prepare
    <dispatcher.store.Store.prepare>`): its :class:`Pending` and the row
    :meth:`Store.commit <dispatcher.store.Store.commit>` inserts."""

    pending: Pending
    row: tuple[Any, ...]


@dataclass(frozen=True)
class Finish:
    """A result to store (:meth:`Store.commit <dispatcher.store.Store.commit>`): ``status``
    "done" with ``raw`` (the body as vLLM returned it) or "failed" with ``error``."""

    id: str
    status: str
    raw: bytes | None = None
    error: str | None = None
