"""Pool mode's store: the pool's queue in Redis, and this replica's claimed part of it.

:class:`PoolStore` answers the turn loop and the senders the way
:class:`~dispatcher.store.Store` does (``pending``, ``iter_pending``, ``is_pending``,
``counts``, ``revision``, ...), synchronously and from memory, but what it holds as
*pending* is only what this dispatcher **claimed** from the pool during the turn it
holds (:meth:`claim`), never the pool's whole queue. The pool itself is in Redis
(:mod:`dispatcher.poolscripts`); every change to it is one atomic script, awaited:

* :meth:`enqueue`: a request is acknowledged only after its ``XADD`` returned, so it is
  in Redis (and, with ``appendfsync always``, in Redis' AOF on disk) when the caller
  hears "accepted";
* :meth:`claim`: up to N entries of one revision, this replica's loaded one first;
* :meth:`give_back`: at a turn's end, every claimed entry without a result goes back to
  the pool, claimable at once by any replica;
* :meth:`commit`: results, first one wins (``SET NX``), then the entry is acknowledged;
* :meth:`touch`: the heartbeat that keeps a live dispatcher's claims its own; the claims
  of one that stopped touching them (SIGKILL, a lost node, a partition) are reclaimed by
  the others after ``reclaim_idle`` seconds.

Revisions are read from the pool (:meth:`refresh_revisions`) and held in memory; a
request naming a revision not seen yet refreshes them once before it is refused.
Token prompts travel as packed little-endian int32 (4 bytes a token).
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

from gpu_slicer.dispatcher.core import MAX_PARAMS_BYTES, parse_body
from gpu_slicer.dispatcher.errors import BadRequest, NotFound, StoreError, UnknownRevision
from gpu_slicer.dispatcher.model import Pending, Result, Revision
from gpu_slicer.dispatcher.pending import PendingIndex, PendingView
from gpu_slicer.dispatcher.poolconn import CALL_TIMEOUT_S, PoolConn
from gpu_slicer.dispatcher.poolentry import (
    BadEntry,
    entry_id,
    read_entry,
    read_entry_deadline,
    unreadable_error,
)
from gpu_slicer.dispatcher.poolscripts import UNREADABLE_READS, prefix
from gpu_slicer.dispatcher.poolsummary import PoolSummary, entry_ms, read_summary
from gpu_slicer.dispatcher.rows import Finish, Staged, tokens_to_blob
from gpu_slicer.dispatcher.store import check_revision_name, deadline_error

__all__ = ["PoolStore", "PoolSummary"]

log = logging.getLogger("dispatcher.pool")

RESULT_TTL_S = 86_400.0


class PoolStore(PendingView):
    """Pool ``conn.pool`` as seen by replica ``replica`` (consumer ``consumer``); what
    it holds as pending (:class:`~dispatcher.pending.PendingView`) is its claims."""

    def __init__(
        self,
        conn: PoolConn,
        replica: str,
        *,
        consumer: str | None = None,
        reclaim_idle: float = 120.0,
        result_ttl: float = RESULT_TTL_S,
        max_prompt_tokens: int = 32768,
        max_prompt_bytes: int = 1 << 20,
    ) -> None:
        self.conn = conn
        self.pool = conn.pool
        self.replica = replica
        # One consumer per process: a restarted dispatcher never takes its dead
        # predecessor's claims for its own (they are reclaimed like any dead one's).
        self.consumer = consumer or f"{replica}/{secrets.token_hex(4)}"
        self.reclaim_idle = reclaim_idle
        self.result_ttl = max(1.0, result_ttl)  # SET EX takes whole seconds, at least 1
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self._index = PendingIndex()
        self._entry: dict[str, tuple[str, str]] = {}  # id -> (rev, entry id), claimed
        self._revs: dict[str, Revision] = {}
        self._seq: dict[str, int] = {}
        self.summary = PoolSummary()
        self.claimable_hint = 0  # what the last claim or poll said is claimable
        self._finished = {"done": 0, "failed": 0}  # results this dispatcher stored
        self.claims = 0
        self.claimed_entries = 0
        self.reclaimed = 0
        self.returned = 0
        self.put_aside = 0  # unreadable entries this replica put aside (failed)
        self._strays = False  # a CLAIM failed: Redis may hold claims of ours we do not
        self.duplicates = 0
        self.lost_claims = 0  # claims another replica took (we were silent too long)
        self.held_back = 0  # times the backlog was covered by others: no turn asked for
        self.expired_failures: list[tuple[Pending, str]] = []  # local deadlines to store
        self.clock_offset: float | None = None  # Redis' clock minus ours, seconds
        self.bad_revisions: dict[str, str] = {}  # revision -> why its record is unreadable

    # -- what the turn loop and the senders read (memory only) ------------------------

    def health(self) -> dict[str, Any]:
        """The store check (``/status``'s ``store``): Redis reachable or not."""
        h = self.conn.health()
        return {"path": h["url"], "damaged": False, "error": h["error"]}

    def counts(self) -> dict[str, int]:
        """Claimed requests here (``pending``) and the results this dispatcher stored."""
        return {"pending": len(self._index.by_id), **self._finished}

    def wants_turn(self) -> bool:
        """Whether to ask for a turn: something is claimed here, or the pool has work and
        its Redis answers (while it does not, a turn could claim nothing: the trainer
        keeps the GPU)."""
        if self._index.by_id:
            return True
        return self.claimable_hint > 0 and self.conn.down is None

    def revision(self, name: str) -> Revision:
        """The published revision ``name`` as last read from the pool."""
        rev = self._revs.get(name)
        if rev is None:
            raise UnknownRevision(f"revision {name!r} is not published in pool {self.pool!r}")
        return rev

    def revisions(self) -> list[Revision]:
        """Every revision of the pool as last read, oldest first."""
        return sorted(self._revs.values(), key=lambda r: self._seq[r.name])

    def newest(self) -> Revision | None:
        """The most recently published revision as last read, or None."""
        if not self._revs:
            return None
        return max(self._revs.values(), key=lambda r: self._seq[r.name])

    def entries(self) -> list[tuple[str, str]]:
        """(revision, entry id) of every claim this dispatcher holds."""
        return list(self._entry.values())

    def deadline_error(self, p: Pending, now: float) -> str:
        """The error of a request that missed its deadline (names pool and revision, and
        the last failed load of its weights by any replica that reported one)."""
        return deadline_error(p, now, self.load_error(p.revision))

    def expire(self, now: float) -> list[Pending]:
        """Unclaim the claimed requests past their deadline at ``now`` and queue their
        failures for :meth:`store_expired` (any dispatcher's scan fails them too)."""
        now += self.clock_offset or 0.0  # deadlines are on Redis' clock (the entry ids)
        due = self._index.due(now)
        for p in due:
            self._index.remove(p.id)
            self.expired_failures.append((p, self.deadline_error(p, now)))
        return due

    # -- accepting -------------------------------------------------------------------

    def prepare(
        self,
        kind: str,
        body: dict[str, Any],
        revision: str | None,
        deadline_s: float,
        now: float | None = None,
        resolved: dict[str | None, str] | None = None,
    ) -> Staged:
        """Validate a request like :meth:`Store.prepare <dispatcher.store.Store.prepare>`;
        it exists once :meth:`enqueue` of it returned."""
        parsed = parse_body(kind, body, self.max_prompt_tokens, self.max_prompt_bytes)
        asked = revision if revision is not None else parsed.revision
        name = None if resolved is None else resolved.get(asked)
        if name is None:
            if asked is None:
                newest = self.newest()
                if newest is None:
                    raise UnknownRevision(
                        f"no revision is published in pool {self.pool!r} and the request names none"
                    )
                name = newest.name
            else:
                name = self.revision(check_revision_name(asked)).name
            if resolved is not None:
                resolved[asked] = name
        params = json.dumps(parsed.params, separators=(",", ":"))
        if len(params) > MAX_PARAMS_BYTES:
            raise BadRequest(
                f"request parameters are {len(params)} bytes of JSON, more than {MAX_PARAMS_BYTES}"
            )
        accepted = time.time() if now is None else now
        p = Pending(
            id="smp-" + secrets.token_hex(12), pool=self.pool, revision=name, kind=kind,
            params=parsed.params, prompt=parsed.prompt, messages=parsed.messages,
            accepted_at=accepted, deadline=accepted + deadline_s, attempts=0,
        )  # fmt: skip
        if isinstance(p.prompt, array.array):
            form, prompt = "t", tokens_to_blob(p.prompt)
        elif p.prompt is not None:
            form, prompt = "x", p.prompt
        else:
            form, prompt = "", b""
        row = (p.id, name, kind, params, form, prompt, p.messages or b"", repr(deadline_s))
        return Staged(p, row)

    async def enqueue(self, staged: Sequence[Staged]) -> None:
        """Put ``staged`` in the pool, all or none; returns once Redis has them. The
        acceptance time becomes the entry's (Redis' clock): deadlines count from it."""
        # A script that reaches Redis only after this call's bound (a paused or slow
        # Redis) must not accept what the client was told 503 for.
        until = 0
        if self.clock_offset is not None:
            until = int((time.time() + self.clock_offset + CALL_TIMEOUT_S) * 1000)
        args: list[Any] = [until, len(staged)]
        for s in staged:
            args += s.row
        eids = await self.conn.script("ENQUEUE", *args)
        for s, eid in zip(staged, eids, strict=True):
            s.pending.accepted_at = entry_ms(eid) / 1000
            s.pending.deadline = s.pending.accepted_at + float(s.row[7])

    async def publish(self, name: str, path: str) -> tuple[Revision, bool]:
        """Record revision ``name`` at ``path`` for the whole pool; (revision, new).
        The same name with another path is a :class:`BadRequest`."""
        created, raw = await self.conn.script("PUBLISH", name, path, repr(time.time()))
        rev = self._remember_revision(name, raw)
        if rev.path != path:
            raise BadRequest(
                f"revision {name!r} is already published with path {rev.path!r}, not {path!r}"
            )
        return rev, bool(created)

    async def publish_first(self, name: str, path: str) -> Revision | None:
        """Publish revision ``name`` at ``path`` only while the pool has none at all (the
        check and the write are one step in Redis); None when another came first. The
        same name with another path is a :class:`BadRequest`."""
        created, raw = await self.conn.script("PUBLISH", name, path, repr(time.time()), "1")
        if int(created) == 2:
            return None
        rev = self._remember_revision(name, raw)
        if rev.path != path:
            raise BadRequest(
                f"revision {name!r} is already published with path {rev.path!r}, not {path!r}"
            )
        return rev

    def _remember_revision(self, name: str, raw: bytes) -> Revision:
        try:
            v = json.loads(raw)
            rev = Revision(name, str(v["path"]), float(v["published_at"]))
            seq = int(v["seq"])
        except (ValueError, KeyError, TypeError) as e:
            # Written by another release, or by hand: one bad value must not take every
            # dispatcher of the pool down (they all read it); the revision is unusable.
            if name not in self.bad_revisions:
                log.error("pool %s: revision %r is unreadable in Redis (%s: %s); skipped",
                          self.pool, name, type(e).__name__, e)  # fmt: skip
            self.bad_revisions[name] = f"{type(e).__name__}: {e}"
            raise UnknownRevision(f"revision {name!r} of pool {self.pool!r} is unreadable") from e
        self._revs[name] = rev
        self._seq[name] = seq
        if self.bad_revisions.pop(name, None) is not None:
            log.warning("pool %s: revision %r reads again (%s); served", self.pool, name, rev.path)
        return rev

    async def recheck_bad_revisions(self) -> None:
        """Read again the records of the revisions found unreadable (repaired by hand,
        rewritten by their release: no event says so): one that reads now is served from
        now on, its requests claimed and counted in the backlog."""
        names = list(self.bad_revisions)
        if not names:
            return
        got = await self.conn.command("hmget", "revs", names)
        for name, raw in zip(names, got, strict=True):
            if raw is None:
                self.bad_revisions[name] = "no record in the pool (removed?)"
                continue
            with contextlib.suppress(UnknownRevision):
                self._remember_revision(name, raw)

    async def refresh_revisions(self) -> None:
        """Read the pool's revisions again (an unreadable one is skipped and logged)."""
        got = await self.conn.command("hgetall", "revs")
        for k, raw in got.items():
            with contextlib.suppress(UnknownRevision):
                self._remember_revision(k.decode("utf-8", "replace"), raw)

    # -- claiming and giving back -------------------------------------------------------

    async def claim(self, preferred: str | None, limit: int, avoid: Sequence[str] = ()) -> int:
        """Claim up to ``limit`` entries of one revision, ``preferred`` first, never one of
        ``avoid`` (this replica's backed-off loads); returns how many."""
        if limit <= 0:
            return 0
        if self._strays:
            await self._hand_back_strays()
        try:
            rev, got, reclaimed, left = await self.conn.script(
                "CLAIM", self.consumer, preferred or "", limit, int(self.reclaim_idle * 1000),
                *avoid, *self.bad_revisions,
            )  # fmt: skip
        except BaseException:
            # Redis may have run it and the answer was lost: entries claimed there that
            # this replica does not hold would wait for the reclaim bound. The next
            # claim hands them back first.
            self._strays = True
            raise
        self.claims += 1
        self.claimable_hint = int(left)
        self.reclaimed += int(reclaimed)
        if not got:
            return 0
        revision = rev.decode()
        if revision not in self._revs:
            try:
                await self.refresh_revisions()  # published on another front since?
            except StoreError:
                # Claimed in Redis all the same: held here (touched, handed back at the
                # turn's end) rather than left to the reclaim bound.
                for eid_b, flat in got:
                    sid = dict(zip(flat[::2], flat[1::2], strict=False)).get(b"i", eid_b)
                    self._entry[sid.decode("utf-8", "replace")] = (revision, eid_b.decode())
                raise
        taken = 0
        unusable: list[tuple[str, str]] = []
        unread: list[tuple[str, str, BadEntry]] = []
        for eid_b, flat in got:
            eid = eid_b.decode()
            try:
                self.revision(revision)
                p = read_entry(self.pool, revision, eid, flat)
            except UnknownRevision:
                # Its record is unreadable or gone: CLAIM skips the revision from now on,
                # and the record is read again every tick (recheck_bad_revisions).
                self.bad_revisions.setdefault(revision, "no record in the pool")
                unusable.append((revision, eid))
                continue
            except BadEntry as e:
                unread.append((eid, entry_id(flat), e))
                continue
            self._index.add(p)
            self._entry[p.id] = (revision, eid)
            taken += 1
        if unusable:
            await self._hand_back(unusable)
        if unread:
            await self._unreadable(revision, unread)
        self.claimed_entries += taken
        return taken

    async def _unreadable(self, revision: str, entries: list[tuple[str, str, BadEntry]]) -> None:
        # An entry this release cannot read (written by another one?) may be readable by
        # another replica: handed back, claimable again past the reclaim bound, but only
        # UNREADABLE_READS - 1 times in all (each reading may wake a replica), then put
        # aside, failed naming the field.
        args: list[str | int] = [self.consumer, UNREADABLE_READS, int(self.result_ttl)]
        for eid, sid, e in entries:
            err = unreadable_error(self.pool, revision, eid, e, UNREADABLE_READS)
            args += [revision, eid, sid, err]
        back, aside = await self.conn.script("UNREADABLE", *args)
        self.returned += int(back)
        self.put_aside += int(aside)
        for eid, sid, e in entries:
            log.error("pool %s: entry %s (request %s) of revision %s is unreadable: %s",
                      self.pool, eid, sid or "?", revision, e)  # fmt: skip
        if int(aside):
            log.error("pool %s: %d unreadable entr%s of revision %s put aside after %d "
                      "readings (failed; kept in Redis stream %saside)", self.pool, int(aside),
                      "y" if int(aside) == 1 else "ies", revision, UNREADABLE_READS,
                      prefix(self.pool))  # fmt: skip

    async def _hand_back_strays(self) -> None:
        args: list[str] = []
        for rev, eid in self._entry.values():
            args += [rev, eid]
        n = int(await self.conn.script("STRAYS", self.consumer, *args))
        self._strays = False
        if n:
            self.returned += n
            log.warning("pool %s: handed back %d claims whose answer was lost", self.pool, n)

    async def _hand_back(self, entries: Sequence[tuple[str, str]]) -> int:
        args: list[str] = []
        for rev, eid in entries:
            args += [rev, eid]
        n = int(await self.conn.script("RETURN", self.consumer, *args))
        self.returned += n
        return n

    async def give_back(self, keep: set[str]) -> int:
        """Hand every claimed request back to the pool but those in ``keep`` (results
        waiting for their commit), and forget them here; returns how many went back.
        If Redis cannot be reached they stay this consumer's in the pool and are
        reclaimed after ``reclaim_idle``: either way none is pending here after this."""
        back = [(sid, e) for sid, e in self._entry.items() if sid not in keep]
        for sid in list(self._index.by_id):
            self._index.remove(sid)
        for sid, _ in back:
            del self._entry[sid]
        if not back:
            return 0
        return await self._hand_back([e for _, e in back])

    def forget(self, ids: Sequence[str]) -> None:
        """Stop holding the claims ``ids`` that are no longer pending here (their result
        could not be stored after their turn ended): untouched, they are reclaimed after
        ``reclaim_idle`` by whichever replica claims next, this one included."""
        for sid in ids:
            if sid not in self._index.by_id:
                self._entry.pop(sid, None)

    async def touch(self) -> None:
        """The heartbeat: reset the idle time of every claim still this consumer's."""
        entries = self.entries()
        if not entries:
            return
        args: list[str] = []
        for rev, eid in entries:
            args += [rev, eid]
        _mine, other = await self.conn.script(
            "TOUCH", self.consumer, int(self.reclaim_idle * 1000), *args
        )
        if int(other):
            self.lost_claims += int(other)
            log.warning("pool %s: %d of %d claims were reclaimed by another replica (this "
                        "one was silent longer than %g s); their first result wins",
                        self.pool, int(other), len(entries),
                        self.reclaim_idle)  # fmt: skip

    # -- who asks for a turn ------------------------------------------------------------

    async def want(
        self, capacity: int, ttl: float, patience: float, avoid: Sequence[str] = ()
    ) -> bool:
        """Whether this replica may ask its slicerd for a turn now: the pool's backlog is
        more than what the replicas holding or (for less than ``patience`` s) asking for
        a turn can take (:data:`~dispatcher.poolscripts.WANT`), the revisions of ``avoid``
        (this replica's backed-off loads) and unreadable ones left out: a replica that
        could claim nothing must not hold the others back; if so it is recorded as asking
        for ``ttl`` s (refresh with :meth:`hold`)."""
        ok, backlog, _covered = await self.conn.script(
            "WANT", self.consumer, capacity, int(ttl * 1000), int(patience * 1000),
            int(self.reclaim_idle * 1000), *avoid, *self.bad_revisions,
        )  # fmt: skip
        self.claimable_hint = int(backlog)
        if not ok:
            self.held_back += 1
        return bool(ok)

    async def hold(self, capacity: int, ttl: float, granted: bool) -> None:
        """Refresh this replica's record: still asking, or holding a turn (``granted``)."""
        await self.conn.script("HOLD", self.consumer, capacity, int(ttl * 1000), int(granted))

    async def unwant(self) -> None:
        """No longer asking for a turn nor holding one."""
        await self.conn.script("UNWANT", self.consumer)

    # -- results ---------------------------------------------------------------------

    async def commit(self, finishes: Sequence[Finish]) -> list[bool]:
        """Store ``finishes`` (claimed requests' results); per one, whether it was the
        first (False: the pool had a result already, or the claim is no longer held
        here, say failed by a deadline meanwhile: dropped and counted)."""
        args: list[Any] = [self.replica, int(self.result_ttl)]
        known = [f for f in finishes if f.id in self._entry]
        for f in known:
            rev, eid = self._entry[f.id]
            status = b"d" if f.status == "done" else b"f"
            body = f.raw if f.status == "done" else (f.error or "").encode()
            args += [f.id, rev, eid, status + rev.encode() + b"\n" + (body or b"")]
        out = await self.conn.script("COMMIT", *args) if known else []
        first = {f.id: bool(x) for f, x in zip(known, out, strict=True)}
        stored = [first.get(f.id, False) for f in finishes]
        for f, ok in zip(finishes, stored, strict=True):
            self._index.remove(f.id)
            self._entry.pop(f.id, None)
            if ok:
                self._finished[f.status] += 1
            else:
                self.duplicates += 1
        return stored

    async def store_expired(self) -> int:
        """Store the failures :meth:`expire` queued; returns how many were first."""
        queued, self.expired_failures = self.expired_failures, []
        if not queued:
            return 0
        try:
            finishes = [
                Finish(p.id, "failed", None, err) for p, err in queued if p.id in self._entry
            ]
            return sum(await self.commit(finishes)) if finishes else 0
        except BaseException:
            self.expired_failures = queued + self.expired_failures  # tried again next tick
            raise

    async def expire_pool(self, scan: int = 256) -> int:
        """Fail the pool's requests past their deadline (any replica's, claimed or not);
        returns how many this call failed first."""
        t0 = time.time()
        now_ms, due = await self.conn.script("EXPIRE_SCAN", scan)
        self.clock_offset = int(now_ms) / 1000 - (t0 + time.time()) / 2
        if not due:
            return 0
        args: list[Any] = [self.replica, int(self.result_ttl)]
        failing: list[str] = []
        for id_b, rev_b, eid_b, dl_b in due:
            accepted = entry_ms(eid_b) / 1000
            sid, rev, eid = id_b.decode("utf-8", "replace"), rev_b.decode(), eid_b.decode()
            try:
                dl = read_entry_deadline(dl_b)
            except BadEntry as e:  # failed at once: no deadline can be kept for it
                err = f"unreadable request: pool {self.pool} revision {rev} entry {eid}: {e}"
                log.error("pool %s: request %s failed: %s", self.pool, sid, err)
            else:
                p = Pending(sid, self.pool, rev, "", {}, None, None, accepted, accepted + dl, 0)
                if p.deadline > int(now_ms) / 1000:
                    continue  # a field Lua read otherwise ("1_0"): not due as read here
                err = self.deadline_error(p, int(now_ms) / 1000)
            args += [id_b, rev, eid, b"f" + rev_b + b"\n" + err.encode()]
            failing.append(sid)
        if not failing:
            return 0
        out = await self.conn.script("COMMIT", *args)
        for sid in failing:  # claimed here: its sends are moot now
            self._index.remove(sid)
            self._entry.pop(sid, None)
        return sum(int(x) for x in out)

    async def lookup(self, sid: str) -> Result:
        """Sample ``sid`` as the pool knows it (pending, done, failed); NotFound when the
        pool has no such request (or its result outlived ``result_ttl``)."""
        [result] = await self.lookup_many([sid])
        return result

    async def lookup_many(self, ids: Sequence[str]) -> list[Result]:
        """:meth:`lookup` of every id of ``ids`` (in order) in one call; NotFound names
        the first unknown one."""
        for sid in ids:
            if not (0 < len(sid) <= 128) or not sid.isascii():
                raise NotFound(f"no sample {sid[:128]!r} in pool {self.pool!r}")
        got = await self.conn.script("LOOKUP", *ids) if ids else []
        out = []
        for sid, g in zip(ids, got, strict=True):
            if g[0] == b"n":
                raise NotFound(
                    f"no sample {sid!r} in pool {self.pool!r} (results are kept "
                    f"{self.result_ttl:g} s)"
                )
            if g[0] == b"p":
                out.append(Result(sid, "pending", None, None, g[1].decode(), self.pool))
                continue
            head, _, body = bytes(g[1]).partition(b"\n")
            rev = head[1:].decode()
            if head[:1] == b"d":
                out.append(Result(sid, "done", body, None, rev, self.pool))
            else:
                text = body.decode("utf-8", "replace")
                out.append(Result(sid, "failed", None, text, rev, self.pool))
        return out

    # -- figures ---------------------------------------------------------------------

    async def poll(self) -> PoolSummary:
        """Read the pool's queue figures (per revision, per consumer) and counters."""
        s = await read_summary(self.conn, self.reclaim_idle)
        self.summary = s
        self.claimable_hint = s.claimable
        return s
