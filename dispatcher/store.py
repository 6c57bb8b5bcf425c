"""The durable pending queue: sampling requests and their results in SQLite.

Theory of operation
-------------------
One SQLite database, ``<state_dir>/dispatch.db`` (WAL, ``synchronous=NORMAL`` unless
told ``FULL``, busy timeout), holds two tables: the weight revisions the trainer
published and the samples. A sample row is inserted and committed *before* the caller
sees its id, so an acknowledged request survives a dispatcher crash. Its status then
moves exactly once from ``pending`` to ``done`` or ``failed`` (an ``UPDATE ... WHERE
status = 'pending'``), which makes storing a result idempotent: the second store finds
no pending row and is ignored.

Group commit: :meth:`Store.commit` writes a whole group (new samples, results, attempt
counts) in ONE transaction (``executemany``); :class:`~dispatcher.journal.Journal` makes
the groups. :meth:`Store.prepare` validates a request without writing it, so a group's
requests are all checked before any is written. :meth:`Store.accept`,
:meth:`Store.complete` and :meth:`Store.fail` are groups of one. Nothing of a group is
in memory until its commit returned: a new sample is indexed (visible as pending) only
after it, a result unindexes its sample only after it, and a failed commit changes
nothing in memory. :attr:`Store.transactions` counts committed write transactions.

What a loss can lose. A *process* crash (SIGKILL, a bug) loses nothing committed: with
WAL the commit is in the WAL file in the OS's page cache, and the next open replays it.
A *power loss* (or a kernel crash) under ``synchronous=NORMAL`` may lose the commits made
since the WAL was last synced to disk (SQLite syncs it at each checkpoint, by default
every 1000 pages of WAL): those requests were acknowledged and are gone, those results
were served and their samples are pending again (served again). The database itself
stays consistent (no half-written group). ``synchronous=FULL`` (``slicer-dispatch --sync
full``) syncs the WAL at every commit, so a power loss loses nothing acknowledged; with
group commit that is one fsync per group, not per request.

Recent results are also held in memory (the last ``RECENT_RESULTS`` of them, at most
``RECENT_BYTES`` of bodies): :meth:`Store.get` of a pending or recently finished sample
reads no SQLite and parses no JSON; older ones are read from the database. A body is
kept as the bytes vLLM returned (:attr:`Result.raw <dispatcher.model.Result.raw>`),
stored as TEXT when it is UTF-8 (always, for JSON), byte for byte.

Pending requests are also held in memory, in acceptance order
(:class:`~dispatcher.pending.PendingIndex`), so the turn loop reads them without touching
the disk; on open the pending rows of this pool are loaded back.
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
import json
import logging
import math
import re
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
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
from gpu_slicer.dispatcher.pending import PendingIndex, PendingView
from gpu_slicer.dispatcher.rows import (
    SCHEMA,
    Finish,
    Staged,
    blob_to_tokens,
    body_bytes,
    body_value,
    tokens_to_blob,
)

__all__ = [  # Pending, Result, Revision: dispatcher.model's; Finish, Staged: dispatcher.rows's
    "DB_NAME",
    "RECENT_BYTES",
    "RECENT_RESULTS",
    "REVISION_RE",
    "SYNC_MODES",
    "Finish",
    "Pending",
    "Result",
    "Revision",
    "Staged",
    "Store",
    "check_revision_name",
    "deadline_error",
]

log = logging.getLogger("dispatcher.store")

DB_NAME = "dispatch.db"
SYNC_MODES = ("normal", "full")  # PRAGMA synchronous (module docstring: what a loss loses)
RECENT_RESULTS = 10_000  # finished results held in memory, the newest ones
RECENT_BYTES = 64 << 20  # ... and at most this many bytes of their bodies
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
BUSY_TIMEOUT_S = 5.0


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not REVISION_RE.fullmatch(name):
        raise BadRequest(
            f"{what} must match [A-Za-z0-9][A-Za-z0-9_.:-]{{0,127}}, got {name!r:.200}"
        )
    return name


def deadline_error(p: Pending, now: float, load_error: str | None = None) -> str:
    """The error text of a request that missed its deadline (names pool and revision,
    and ``load_error``: why its weights would not load, when a load of them failed)."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.accepted_at))
    why = "" if load_error is None else f"; its weights could not be loaded: {load_error}"
    return (
        f"deadline exceeded: pool {p.pool} revision {p.revision} pending since {since} "
        f"({now - p.accepted_at:.0f} s, deadline {p.deadline - p.accepted_at:.0f} s){why}"
    )


def check_revision_name(name: object) -> str:
    """``name`` if it is a valid revision name; :class:`BadRequest` naming the rule."""
    return _check_name("revision", name)


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


class Store(PendingView):
    """The durable queue of one pool in ``state_dir`` (created if missing)."""

    def __init__(
        self,
        state_dir: str | Path,
        pool: str,
        *,
        max_prompt_tokens: int = 32768,
        max_prompt_bytes: int = 1 << 20,
        synchronous: str = "normal",
    ) -> None:
        if synchronous not in SYNC_MODES:
            raise ValueError(f"synchronous must be one of {SYNC_MODES}, got {synchronous!r}")
        self.pool = _check_name("pool", pool)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self.path = Path(state_dir) / DB_NAME
        self._index = PendingIndex()
        self._pending = self._index.by_id  # the hot lookups read the dict itself
        self._finished = {"done": 0, "failed": 0}
        self._recent: OrderedDict[str, Result] = OrderedDict()  # id -> newest results
        self._recent_bytes = 0
        self.transactions = 0  # write transactions committed (group commit: one per group)
        self._newest_name: str | None = None  # _resolve's memory of the revisions read
        self._known: set[str] = set()
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
            self._con.execute(f"PRAGMA synchronous={synchronous.upper()}")
            self._con.executescript(SCHEMA)
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
                self.transactions += 1
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
                held = bytes(prompt) if is_text else blob_to_tokens(prompt)
            self._index.add(
                Pending(sid, self.pool, rev, kind, json.loads(params), held,
                        None if messages is None else bytes(messages), acc, deadline, attempts)
            )  # fmt: skip

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
        self._newest_name = revision  # a new one is the newest: its seq is the largest
        self._known.add(revision)
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
        """Validate ``body``, journal it (a group of one), and return it as a new
        :class:`Pending`.

        The revision is ``revision`` if given, else ``body["revision"]``, else the
        ``@REV`` suffix of ``body["model"]``, else the newest published one. Raises
        :class:`BadRequest` (the message names the field), :class:`UnknownRevision`, or
        :class:`StoreFull`/:class:`StoreError`, in which case nothing was journaled.
        """
        staged = self.prepare(kind, body, revision, deadline_s, now)
        self.commit([staged], what=f"accept a request for revision {staged.pending.revision}")
        return staged.pending

    def prepare(
        self,
        kind: str,
        body: dict[str, Any],
        revision: str | None,
        deadline_s: float,
        now: float | None = None,
        resolved: dict[str | None, str] | None = None,
    ) -> Staged:
        """Validate ``body`` as :meth:`accept` does, without journaling it: the request
        exists once a :meth:`commit` of it returned. ``resolved`` (optional) caches the
        revision names looked up, across the requests of one batch."""
        if not (isinstance(deadline_s, int | float) and math.isfinite(deadline_s)) or (
            deadline_s <= 0
        ):
            raise BadRequest(f"deadline must be a positive number of seconds, got {deadline_s!r}")
        parsed = parse_body(kind, body, self.max_prompt_tokens, self.max_prompt_bytes)
        asked = revision if revision is not None else parsed.revision
        name = None if resolved is None else resolved.get(asked)
        if name is None:
            name = self._resolve(asked)
            if resolved is not None:
                resolved[asked] = name
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
        blob = tokens_to_blob(p.prompt) if isinstance(p.prompt, array.array) else p.prompt
        row = (p.id, p.pool, name, kind, params_json, blob, isinstance(p.prompt, bytes),
               p.messages, p.accepted_at, p.deadline)  # fmt: skip
        return Staged(p, row)

    def _resolve(self, name: str | None) -> str:
        """The revision a request asking for ``name`` (None: the newest) gets.

        What was read once is remembered (one dispatcher per state dir, and a revision
        is never unpublished): a request reads no SQLite for a revision already seen;
        the first look-up of each does, so a damaged revision table still refuses it."""
        if name is None:
            if self._newest_name is None:
                newest = self.newest()
                if newest is None:
                    raise UnknownRevision(
                        f"no revision is published in pool {self.pool!r} and the request names none"
                    )
                self._newest_name = newest.name
            return self._newest_name
        if name not in self._known:
            _check_name("revision", name)
            self.revision(name)
            self._known.add(name)
        return name

    # -- group commit ----------------------------------------------------------------

    def commit(
        self,
        new: Sequence[Staged] = (),
        finishes: Sequence[Finish] = (),
        attempts: Mapping[str, int] | None = None,
        *,
        what: str | None = None,
    ) -> list[bool]:
        """Journal one group in ONE transaction: the ``new`` requests, the ``finishes``
        (results) and the ``attempts`` (id -> send count); for each finish, whether it
        was stored (False: its sample had a result already, or is unknown here).

        All or nothing: on :class:`StoreFull`/:class:`StoreError` nothing of the group
        is written and nothing in memory changed (the requests are not indexed, the
        results' samples stay pending). After the commit the new requests are pending
        and the stored results are held in memory for :meth:`get`."""
        stored: list[bool] = []
        taken: set[str] = set()
        for f in finishes:  # in memory: a sample is pending here iff its row is
            ok = f.id in self._pending and f.id not in taken
            stored.append(ok)
            if ok:
                taken.add(f.id)
        if not (new or taken or attempts):
            return stored
        done_at = time.time()
        rows = [
            (f.status, None if f.raw is None else body_value(f.raw), f.error, done_at, f.id)
            for f, ok in zip(finishes, stored, strict=True)
            if ok
        ]
        what = what or f"journal {len(new)} request(s) and {len(rows)} result(s)"
        with self._tx(what) as con:
            if new:
                con.executemany(
                    "INSERT INTO sample (id, pool, revision, kind, params, prompt,"
                    " prompt_is_text, messages, accepted_at, deadline, status)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,'pending')",
                    [s.row for s in new],
                )
            if attempts:
                con.executemany(
                    "UPDATE sample SET attempts = ? WHERE id = ?",
                    [(n, id) for id, n in attempts.items()],
                )
            if rows:
                # The prompt is dropped with the result: it is no longer needed, and
                # keeping it would grow the database by every prompt ever served.
                con.executemany(
                    "UPDATE sample SET status = ?, body = ?, error = ?, finished_at = ?,"
                    " prompt = NULL, messages = NULL WHERE id = ? AND status = 'pending'",
                    rows,
                )
        # Only after the commit: a request the caller never saw acknowledged is not held.
        for s in new:
            self._index.add(s.pending)
        for f, ok in zip(finishes, stored, strict=True):
            if not ok:
                continue
            p = self._index.remove(f.id)
            assert p is not None
            self._finished[f.status] = self._finished.get(f.status, 0) + 1
            self._remember(Result(f.id, f.status, f.raw, f.error, p.revision, p.pool))
        return stored

    def _remember(self, result: Result) -> None:
        """Hold ``result`` for :meth:`get`, dropping the oldest past the bounds."""
        self._recent[result.id] = result
        self._recent_bytes += len(result.raw or b"") + len(result.error or "")
        while len(self._recent) > RECENT_RESULTS or self._recent_bytes > RECENT_BYTES:
            _, old = self._recent.popitem(last=False)
            self._recent_bytes -= len(old.raw or b"") + len(old.error or "")

    # -- the pending index (reads: PendingView) ----------------------------------------

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

    def complete(self, id: str, body: dict[str, Any] | bytes) -> bool:
        """Store ``body`` (vLLM's response: its raw bytes, or a JSON object) as the result
        of ``id`` (a group of one); False (ignored) if it has one already."""
        raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        return self.commit([], [Finish(id, "done", raw=raw)], what=f"store the result of {id}")[0]

    def fail(self, id: str, error: str) -> bool:
        """Fail ``id`` with ``error`` (a group of one); False (ignored) if it has a result
        already."""
        return self.commit([], [Finish(id, "failed", error=error)],
                           what=f"store the result of {id}")[0]  # fmt: skip

    def get(self, id: str, now: float | None = None) -> Result:
        """The status and result of sample ``id`` (at wall time ``now``, default the
        current time); :class:`NotFound` if unknown. A pending or recently finished
        sample is answered from memory; an older one is read from the database."""
        recent = self._recent.get(id)
        if recent is not None:
            return recent
        p = self._pending.get(id)
        if p is not None:
            now = time.time() if now is None else now
            if p.deadline <= now:
                # Past its deadline it has failed, even while the durable update cannot
                # be written yet (a full disk): expire() keeps retrying that write.
                return Result(id, "failed", None, self.deadline_error(p, now), p.revision, p.pool)
            return Result(id, "pending", None, None, p.revision, p.pool)
        rows = self._read(
            f"read sample {id}",
            "SELECT status, body, error, revision, pool FROM sample WHERE id = ?",
            (id,),
        )
        if not rows:
            raise NotFound(f"no sample {id!r}")
        status, body, error, rev, pool = rows[0]
        return Result(id, status, None if body is None else body_bytes(body), error, rev, pool)

    def expire(self, now: float) -> list[Pending]:
        """Fail every pending request whose deadline is at or before ``now``; return them."""
        due = self._index.due(now)
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
            self._index.keep_due(due)  # the next expire() retries instead of forgetting them
            raise
        for p in due:
            self._index.remove(p.id)
            self._finished["failed"] += 1
            self._remember(Result(p.id, "failed", None, self.deadline_error(p, now),
                                  p.revision, p.pool))  # fmt: skip
        return due

    def deadline_error(self, p: Pending, now: float) -> str:
        """The error text of a request that missed its deadline (names pool and revision,
        and the last failed load of its weights)."""
        return deadline_error(p, now, self.load_error(p.revision))

    # -- figures ---------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Number of pending, done and failed samples of this pool."""
        return {"pending": len(self._pending), **self._finished}

    def wants_turn(self) -> bool:
        """Whether the turn loop should ask for a turn: anything is pending."""
        return bool(self._pending)
