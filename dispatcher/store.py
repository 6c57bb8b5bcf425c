"""The durable pending queue: sampling requests and their results in SQLite.

Theory of operation
-------------------
One SQLite database, ``<state_dir>/dispatch.db`` (WAL, ``synchronous=NORMAL``, busy
timeout), holds two tables: the weight revisions the trainer published and the
samples. A sample row is inserted and committed by :meth:`Store.accept` *before* the
caller sees its id, so an acknowledged request survives a dispatcher crash (WAL with
``synchronous=NORMAL`` survives a process crash; only a power cut may drop the last
commits). Its status then moves exactly once from ``pending`` to ``done`` or
``failed`` (an ``UPDATE ... WHERE status = 'pending'``), which makes storing a result
idempotent: the second store finds no pending row and is ignored.

Pending requests are also held in memory, in acceptance order, so the turn loop reads
them without touching the disk; on open the pending rows of this pool are loaded back.
Token prompts are kept as ``array('i')`` (4 bytes per token) to keep a million pending
tokens within a few MiB.

The store is synchronous and meant for one thread (the trio thread): every call is a
short local transaction. It raises only :mod:`dispatcher.errors` classes: every SQLite
error of a read or a write, at open or at run time, is a :class:`StoreError`
(:class:`StoreFull` for a full disk). An error that says the file itself is damaged (a
corrupt page, "database disk image is malformed", "file is not a database") is logged
once and kept in :attr:`Store.damaged`: damage does not heal, so :meth:`Store.health`
(``/status``'s ``store``) reports it until the file is repaired or moved aside.
"""

from __future__ import annotations

import array
import contextlib
import heapq
import json
import logging
import math
import re
import secrets
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpu_slicer.dispatcher.checkpoint import check_path_text
from gpu_slicer.dispatcher.core import MAX_PARAMS_BYTES, parse_body
from gpu_slicer.dispatcher.errors import (
    BadRequest,
    NotFound,
    StoreError,
    StoreFull,
    UnknownRevision,
)
from gpu_slicer.dispatcher.model import Pending, Result, Revision

__all__ = [  # Pending, Result and Revision are dispatcher.model's, returned by the store
    "DB_NAME",
    "REVISION_RE",
    "Pending",
    "Result",
    "Revision",
    "Store",
    "check_revision_name",
]

log = logging.getLogger("dispatcher.store")

DB_NAME = "dispatch.db"
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
BUSY_TIMEOUT_S = 5.0

# array('i') is 4 bytes on every platform CPython supports; the memory figure relies on it.
assert array.array("i").itemsize == 4

_SCHEMA = """
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


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not REVISION_RE.fullmatch(name):
        raise BadRequest(
            f"{what} must match [A-Za-z0-9][A-Za-z0-9_.:-]{{0,127}}, got {name!r:.200}"
        )
    return name


def check_revision_name(name: object) -> str:
    """``name`` if it is a valid revision name; :class:`BadRequest` naming the rule."""
    return _check_name("revision", name)


def _tokens_to_blob(tokens: array.array[int]) -> bytes:
    # Stored little-endian so a database moved between machines still reads back.
    if sys.byteorder == "big":
        tokens = array.array("i", tokens)
        tokens.byteswap()
    return tokens.tobytes()


def _blob_to_tokens(blob: bytes) -> array.array[int]:
    tokens = array.array("i")
    tokens.frombytes(blob)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def _is_disk_full(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return "full" in text or getattr(exc, "sqlite_errorcode", None) == 13  # SQLITE_FULL


_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _is_damage(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the database file itself is damaged (it will not heal)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


class Store:
    """The durable queue of one pool in ``state_dir`` (created if missing)."""

    def __init__(
        self,
        state_dir: str | Path,
        pool: str,
        *,
        max_prompt_tokens: int = 32768,
        max_prompt_bytes: int = 1 << 20,
    ) -> None:
        self.pool = _check_name("pool", pool)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self.path = Path(state_dir) / DB_NAME
        # id -> Pending in acceptance order; per revision the same, for the turn loop.
        self._pending: dict[str, Pending] = {}
        self._by_rev: dict[str, dict[str, Pending]] = {}
        # Lazy-deletion heap of (deadline, seq, id): expire() is O(expired log n).
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = 0
        self._tokens = 0
        self._finished = {"done": 0, "failed": 0}
        self.damaged: str | None = None  # the first error that said the file is damaged
        self.last_error: str | None = None  # the last failure; None once a call worked
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the dispatch store {self.path}: {exc}") from exc
        try:
            self._con.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            self._con.execute("PRAGMA journal_mode=WAL")
            self._con.execute("PRAGMA synchronous=NORMAL")
            self._con.executescript(_SCHEMA)
            self._load()
        except (sqlite3.Error, ValueError) as exc:  # ValueError: a row's JSON is unreadable
            self._con.close()
            raise StoreError(f"cannot open the dispatch store {self.path}: {exc}") from exc

    def close(self) -> None:
        """Close the database; the in-memory pending index stays readable."""
        self._con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------------------

    @contextlib.contextmanager
    def _tx(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction; a failure rolls back and maps to StoreFull/StoreError."""
        con = self._con
        try:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    con.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise self._failed(what, exc) from exc
        self.last_error = None

    def _failed(self, what: str, exc: sqlite3.Error) -> StoreError:
        """The error to raise for ``exc``; notes it for :meth:`health` (and logs damage)."""
        if _is_disk_full(exc):
            err: StoreError = StoreFull(f"{what}: the disk holding {self.path} is full ({exc})")
        else:
            err = StoreError(f"{what}: store {self.path} failed: {exc}")
        self.last_error = str(err)
        if self.damaged is None and _is_damage(exc):
            self.damaged = f"{type(exc).__name__}: {exc}"
            log.error(
                "the dispatch store %s is damaged (%s); requests that touch it fail with 503 "
                "until it is repaired or moved aside and the dispatcher restarted",
                self.path, self.damaged,
            )  # fmt: skip
        return err

    def _read(self, what: str, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """Every row of one read; a failure maps to StoreError like a transaction's."""
        try:
            rows = self._con.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise self._failed(what, exc) from exc
        self.last_error = None
        return rows

    def health(self) -> dict[str, Any]:
        """The store's state for ``GET /status``: ``damaged`` (the file is corrupt: it
        stays so until repaired) and ``error`` (the damage, else the last failure, else
        None)."""
        return {
            "path": str(self.path),
            "damaged": self.damaged is not None,
            "error": self.damaged or self.last_error,
        }

    def _load(self) -> None:
        for status, count in self._con.execute(
            "SELECT status, count(*) FROM sample WHERE pool = ? AND status != 'pending' "
            "GROUP BY status",
            (self.pool,),
        ):
            self._finished[status] = count
        rows = self._con.execute(
            "SELECT id, revision, kind, params, prompt, prompt_is_text, messages, accepted_at,"
            " deadline, attempts FROM sample WHERE pool = ? AND status = 'pending' ORDER BY seq",
            (self.pool,),
        )
        for sid, rev, kind, params, prompt, is_text, messages, acc, deadline, attempts in rows:
            held: array.array[int] | bytes | None = None
            if prompt is not None:
                held = bytes(prompt) if is_text else _blob_to_tokens(prompt)
            self._index(
                Pending(sid, self.pool, rev, kind, json.loads(params), held,
                        None if messages is None else bytes(messages), acc, deadline, attempts)
            )  # fmt: skip

    def _index(self, p: Pending) -> None:
        self._pending[p.id] = p
        self._by_rev.setdefault(p.revision, {})[p.id] = p
        self._seq += 1
        heapq.heappush(self._deadlines, (p.deadline, self._seq, p.id))
        if isinstance(p.prompt, array.array):
            self._tokens += len(p.prompt)

    def _unindex(self, sid: str) -> Pending | None:
        p = self._pending.pop(sid, None)
        if p is None:
            return None
        per_rev = self._by_rev[p.revision]
        del per_rev[sid]
        if not per_rev:
            del self._by_rev[p.revision]
        if isinstance(p.prompt, array.array):
            self._tokens -= len(p.prompt)
        return p

    # -- revisions -------------------------------------------------------------------

    def publish(self, revision: str, path: str) -> Revision:
        """Record that weights ``revision`` are saved in directory ``path``.

        Idempotent for the same (revision, path); the same revision with another path is
        a :class:`BadRequest` (a revision names one set of weights forever).
        """
        _check_name("revision", revision)
        check_path_text(path)
        with self._tx(f"publish revision {revision}") as con:
            row = con.execute(
                "SELECT path, published_at FROM revision WHERE pool = ? AND name = ?",
                (self.pool, revision),
            ).fetchone()
            if row is not None:
                if row[0] != path:
                    raise BadRequest(
                        f"revision {revision!r} is already published with path {row[0]!r}, "
                        f"not {path!r}"
                    )
                return Revision(revision, row[0], row[1])
            now = time.time()
            con.execute(
                "INSERT INTO revision (pool, name, path, published_at) VALUES (?, ?, ?, ?)",
                (self.pool, revision, path, now),
            )
        return Revision(revision, path, now)

    def revisions(self) -> list[Revision]:
        """Every published revision of this pool, oldest first."""
        rows = self._read(
            "list revisions",
            "SELECT name, path, published_at FROM revision WHERE pool = ? ORDER BY seq",
            (self.pool,),
        )
        return [Revision(*row) for row in rows]

    def newest(self) -> Revision | None:
        """The most recently published revision, or None when none is."""
        rows = self._read(
            "read the newest revision",
            "SELECT name, path, published_at FROM revision WHERE pool = ? ORDER BY seq DESC "
            "LIMIT 1",
            (self.pool,),
        )
        return Revision(*rows[0]) if rows else None

    def revision(self, name: str) -> Revision:
        """The published revision ``name``; :class:`UnknownRevision` if there is none."""
        rows = self._read(
            f"read revision {name}",
            "SELECT name, path, published_at FROM revision WHERE pool = ? AND name = ?",
            (self.pool, name),
        )
        if not rows:
            raise UnknownRevision(f"revision {name!r} is not published in pool {self.pool!r}")
        return Revision(*rows[0])

    # -- accepting requests ----------------------------------------------------------

    def accept(
        self,
        kind: str,
        body: dict[str, Any],
        revision: str | None,
        deadline_s: float,
        now: float | None = None,
    ) -> Pending:
        """Validate ``body``, journal it, and return it as a new :class:`Pending`.

        The revision is ``revision`` if given, else ``body["revision"]``, else the
        ``@REV`` suffix of ``body["model"]``, else the newest published one. Raises
        :class:`BadRequest` (the message names the field), :class:`UnknownRevision`, or
        :class:`StoreFull`/:class:`StoreError`, in which case nothing was journaled.
        """
        if not (isinstance(deadline_s, int | float) and math.isfinite(deadline_s)) or (
            deadline_s <= 0
        ):
            raise BadRequest(f"deadline must be a positive number of seconds, got {deadline_s!r}")
        parsed = parse_body(kind, body, self.max_prompt_tokens, self.max_prompt_bytes)
        name = revision if revision is not None else parsed.revision
        if name is None:
            newest = self.newest()
            if newest is None:
                raise UnknownRevision(
                    f"no revision is published in pool {self.pool!r} and the request names none"
                )
            name = newest.name
        else:
            _check_name("revision", name)
            self.revision(name)
        params_json = json.dumps(parsed.params, separators=(",", ":"))
        if len(params_json) > MAX_PARAMS_BYTES:
            raise BadRequest(
                f"request parameters are {len(params_json)} bytes of JSON, "
                f"more than {MAX_PARAMS_BYTES}"
            )
        accepted = time.time() if now is None else now
        p = Pending(
            id="smp-" + secrets.token_hex(12),
            pool=self.pool,
            revision=name,
            kind=kind,
            params=parsed.params,
            prompt=parsed.prompt,
            messages=parsed.messages,
            accepted_at=accepted,
            deadline=accepted + deadline_s,
            attempts=0,
        )
        blob = _tokens_to_blob(p.prompt) if isinstance(p.prompt, array.array) else p.prompt
        with self._tx(f"accept a request for revision {name}") as con:
            con.execute(
                "INSERT INTO sample (id, pool, revision, kind, params, prompt, prompt_is_text,"
                " messages, accepted_at, deadline, status) VALUES (?,?,?,?,?,?,?,?,?,?,'pending')",
                (p.id, p.pool, name, kind, params_json, blob, isinstance(p.prompt, bytes),
                 p.messages, p.accepted_at, p.deadline),
            )  # fmt: skip
        # Only after the commit: a request the caller never saw acknowledged is not held.
        self._index(p)
        return p

    # -- the pending index -----------------------------------------------------------

    def pending(self, revision: str | None = None) -> list[Pending]:
        """Pending requests (of ``revision``, or all) in acceptance order."""
        if revision is None:
            return list(self._pending.values())
        return list(self._by_rev.get(revision, {}).values())

    def pending_revisions(self) -> list[str]:
        """Revisions that have pending requests, the one waiting longest first."""

        def oldest(rev: str) -> float:
            return next(iter(self._by_rev[rev].values())).accepted_at

        return sorted(self._by_rev, key=oldest)

    def is_pending(self, id: str) -> bool:
        """Whether ``id`` is still pending (cheap: in memory)."""
        return id in self._pending

    def attempt(self, id: str) -> int:
        """Count one more send of pending ``id`` (journaled); returns the new count."""
        p = self._pending.get(id)
        if p is None:
            raise NotFound(f"no pending sample {id!r} in pool {self.pool!r}")
        with self._tx(f"count an attempt of {id}") as con:
            con.execute("UPDATE sample SET attempts = attempts + 1 WHERE id = ?", (id,))
        p.attempts += 1
        return p.attempts

    # -- results ---------------------------------------------------------------------

    def _finish(self, id: str, status: str, body: str | None, error: str | None) -> bool:
        with self._tx(f"store the result of {id}") as con:
            # The prompt is dropped with the result: it is no longer needed, and keeping
            # it would grow the database by every prompt ever served.
            cur = con.execute(
                "UPDATE sample SET status = ?, body = ?, error = ?, finished_at = ?,"
                " prompt = NULL, messages = NULL WHERE id = ? AND status = 'pending'",
                (status, body, error, time.time(), id),
            )
            stored = cur.rowcount == 1
        self._unindex(id)
        if stored:
            self._finished[status] = self._finished.get(status, 0) + 1
        return stored

    def complete(self, id: str, body: dict[str, Any]) -> bool:
        """Store ``body`` as the result of ``id``; False (ignored) if it has one already."""
        return self._finish(id, "done", json.dumps(body, separators=(",", ":")), None)

    def fail(self, id: str, error: str) -> bool:
        """Fail ``id`` with ``error``; False (ignored) if it has a result already."""
        return self._finish(id, "failed", None, error)

    def get(self, id: str, now: float | None = None) -> Result:
        """The status and result of sample ``id`` (at wall time ``now``, default the
        current time); :class:`NotFound` if unknown."""
        rows = self._read(
            f"read sample {id}",
            "SELECT status, body, error, revision, pool FROM sample WHERE id = ?",
            (id,),
        )
        if not rows:
            raise NotFound(f"no sample {id!r}")
        status, body, error, rev, pool = rows[0]
        p = self._pending.get(id) if status == "pending" else None
        now = time.time() if now is None else now
        if p is not None and p.deadline <= now:
            # Past its deadline it has failed, even while the durable update cannot be
            # written yet (a full disk): expire() keeps retrying that write.
            return Result(id, "failed", None, self.deadline_error(p, now), rev, pool)
        return Result(id, status, None if body is None else json.loads(body), error, rev, pool)

    def expire(self, now: float) -> list[Pending]:
        """Fail every pending request whose deadline is at or before ``now``; return them."""
        due: list[Pending] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, sid = heapq.heappop(self._deadlines)
            p = self._pending.get(sid)
            if p is not None:  # finished ones are left in the heap and skipped here
                due.append(p)
        if not due:
            return []
        try:
            with self._tx(f"expire {len(due)} requests") as con:
                for p in due:
                    con.execute(
                        "UPDATE sample SET status = 'failed', error = ?, finished_at = ?,"
                        " prompt = NULL, messages = NULL WHERE id = ? AND status = 'pending'",
                        (self.deadline_error(p, now), now, p.id),
                    )
        except StoreError:
            # Keep them due: the next expire() retries instead of forgetting them.
            for p in due:
                heapq.heappush(self._deadlines, (p.deadline, 0, p.id))
            raise
        for p in due:
            self._unindex(p.id)
            self._finished["failed"] += 1
        return due

    def deadline_error(self, p: Pending, now: float) -> str:
        """The error text of a request that missed its deadline (names pool and revision)."""
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.accepted_at))
        return (
            f"deadline exceeded: pool {p.pool} revision {p.revision} pending since {since} "
            f"({now - p.accepted_at:.0f} s, deadline {p.deadline - p.accepted_at:.0f} s)"
        )

    # -- figures ---------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Number of pending, done and failed samples of this pool."""
        return {"pending": len(self._pending), **self._finished}

    def pending_token_bytes(self) -> tuple[int, int]:
        """(token ids held in pending prompts, bytes of their arrays' buffers)."""
        return self._tokens, self._tokens * 4
