"""The pool's store at its edges, on a real Redis: :class:`PoolConn`, :class:`PoolStore`
and :class:`PoolLink`'s journal and hooks driven directly under trio (no HTTP, no
slicerd, no replica).

What a user of a pool relies on here:

* a result that could not be stored after its turn ended (Redis died at that instant)
  does not leave its request claimed forever: the replica lets the claim go, and once
  idle past the reclaim bound a replica claims it and serves it;
* a revision record this release cannot read (another release's, a hand edit) is
  skipped: the other revisions are read and served, by a running store and a fresh one;
* a revision with nothing pending leaves nothing behind in Redis (no stream, not
  active), so a long run publishing a revision per step costs every scan nothing more;
  a later request naming an old revision is still accepted and served;
* an accept that reaches Redis after its caller's bound (the client was told 503)
  writes nothing;
* the heartbeat counts as lost only the claims another replica took, not those whose
  result is stored;
* a long-poll that times out leaves nothing behind on the front.

Redis' idle times and entry ids are wall-clock milliseconds, so the reclaim and deadline
tests wait for real time (tiny bounds: 0.2-0.5 s); each wait is bounded and commented.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gpu_slicer.dispatcher.errors import (
    NotFound,
    PoolUnavailable,
    StoreError,
    StoreFull,
    UnknownRevision,
)
from gpu_slicer.dispatcher.poolconn import PoolConn
from gpu_slicer.dispatcher.poollink import PoolLink
from gpu_slicer.dispatcher.poolscripts import prefix
from gpu_slicer.dispatcher.poolstore import PoolStore
from stubs.redisserver import RedisServer
from tests.test_pool_store import POOL, done, enqueue, held, pool, staged, stats

pytestmark = pytest.mark.integration

KEY = prefix(POOL)
IDLE = 0.3  # the reclaim bound of the tests that wait for it (wall clock)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as r:
        yield r


def members(redis: RedisServer, key: str) -> set[bytes]:
    got = redis.command("SMEMBERS", KEY + key)
    assert isinstance(got, list)
    return set(got)


def stream_keys(redis: RedisServer) -> list[bytes]:
    got = redis.command("KEYS", KEY + "q:*")
    assert isinstance(got, list)
    return sorted(got)


def _message_only(record: logging.LogRecord) -> bool:
    # pytest keeps a test's log records until its end: a record holding the exception
    # (and, through its traceback, coredis' leaked streams) would outlive gc.collect().
    record.msg, record.args = record.getMessage(), ()
    return True


# coredis 6.9 leaks the memory streams of a connection whose connect failed (the killed
# Redis): harmless, but a ResourceWarning when collected (see test_pool_store).
@pytest.mark.filterwarnings("ignore:Unclosed <MemoryObject:ResourceWarning")
async def test_a_result_lost_with_redis_after_its_turn_is_reclaimed_and_served(
    redis: RedisServer,
) -> None:
    logging.getLogger("dispatcher.pool").addFilter(_message_only)
    try:
        await _lost_result_scenario(redis)
    finally:
        logging.getLogger("dispatcher.pool").removeFilter(_message_only)
    gc.collect()  # the leaked streams are collected here, under this test's filter


async def _lost_result_scenario(redis: RedisServer) -> None:
    with trio.fail_after(30):
        async with pool(redis, "a", "b", reclaim_idle=IDLE) as [a, b]:
            [sid] = await enqueue(a, "r1", 1)
            link = PoolLink(a, concurrency=4)
            await a.poll()
            await link.top_up("r1", [])  # a's turn claims it
            assert held(a) == [sid]
            outcome: dict[str, object] = {}  # no exception kept (_message_only says why)
            link.journal.finish(
                sid, "done", raw=b'{"by":"a"}',
                on_stored=lambda ok: outcome.setdefault("stored", ok),
                on_error=lambda e: outcome.setdefault("error", type(e)),
            )  # fmt: skip
            # The grace is over: its result waits for the commit, so it is kept claimed...
            await link.turn_ended()
            assert a.entries() != []
            redis.kill()  # ... and Redis dies at that instant: the commit fails
            await link.journal.flush()
            assert outcome.keys() == {"error"}, outcome
            err = outcome["error"]
            assert isinstance(err, type) and issubclass(err, StoreError), outcome
            redis.start()  # from its AOF: the request is pending, claimed by a
            # a's heartbeat goes on every quarter of the bound (as its ticker's does), for
            # one and a half bounds of wall clock: the claim still goes idle past the bound.
            for _ in range(6):
                await trio.sleep(IDLE / 4)
                await a.touch()
            assert await b.claim(None, 10) == 1
            assert held(b) == [sid] and b.reclaimed == 1
            assert await b.commit(done([sid], b'{"by":"b"}')) == [True]
            got = await a.lookup(sid)
            assert (got.status, got.raw) == ("done", b'{"by":"b"}')
            await a.touch()
            assert a.lost_claims == 0 and a.entries() == []  # let go, not lost


async def test_an_unreadable_revision_record_is_skipped_and_the_others_serve(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a") as [a]:
            redis.command("HSET", KEY + "revs", "r3", "not json")
            no_seq = {"path": "/ckpt/r4", "published_at": 1.0}  # another release's record
            redis.command("HSET", KEY + "revs", "r4", json.dumps(no_seq))
            await a.refresh_revisions()  # a running dispatcher, woken by the "rev" event
            async with PoolConn(redis.url, POOL) as c:
                fresh = PoolStore(c, "c")  # a restarted one
                await fresh.refresh_revisions()
                for s in (a, fresh):
                    assert set(s.bad_revisions) == {"r3", "r4"}
                    assert [r.name for r in s.revisions()] == ["r1", "r2"]
                    newest = s.newest()
                    assert newest is not None and newest.name == "r2"
                    with pytest.raises(UnknownRevision, match="'r3'"):
                        s.prepare("completion", {"prompt": [1], "max_tokens": 1}, "r3", 60)
                [sid] = await enqueue(fresh, "r1", 1)
                assert await a.claim("r1", 10) == 1 and held(a) == [sid]
                assert await a.commit(done([sid])) == [True]
                assert (await fresh.lookup(sid)).status == "done"


async def test_a_revision_with_nothing_pending_leaves_nothing_in_redis(
    redis: RedisServer,
) -> None:
    with trio.fail_after(60):
        async with pool(redis, "a") as [a]:
            [kept, _] = await enqueue(a, "r1", 2)  # r1 keeps pending work throughout
            assert await a.claim("r1", 1) == 1 and held(a) == [kept]
            steps = [f"step{k}" for k in range(50)]  # an RL run: a revision per step
            for rev in steps:
                await a.publish(rev, f"/ckpt/{rev}")
                [sid] = await enqueue(a, rev, 1)
                assert await a.claim(rev, 1) == 1
                assert await a.commit(done([sid])) == [True]
            expired = await enqueue(a, "r2", 1, deadline=0.05)  # failed, never claimed
            await trio.sleep(0.2)  # past its deadline, by Redis' clock (ms)
            assert await a.expire_pool() == 1
            assert (await a.lookup(expired[0])).status == "failed"
            assert (await a.poll()).stats["committed"] == 50
            # Only the revision with pending work is left: every scan walks that one.
            assert members(redis, "active") == {b"r1"}
            assert stream_keys(redis) == [(KEY + "q:r1").encode()]
            unclaimed = redis.command("HKEYS", KEY + "unclaimed")
            assert isinstance(unclaimed, list) and set(unclaimed) <= {b"r1"}
            assert set((await a.poll()).revisions) == {"r1"}
            assert await a.commit(done([kept])) == [True]  # r1 keeps its unclaimed one
            assert members(redis, "active") == {b"r1"}
            # A later request for an old revision: its stream and group come back.
            [late] = await enqueue(a, "step3", 1)
            assert members(redis, "active") == {b"r1", b"step3"}
            assert await a.claim("step3", 10) == 1 and held(a) == [late]
            assert await a.commit(done([late])) == [True]
            assert (await a.lookup(late)).status == "done"
            assert members(redis, "active") == {b"r1"}


async def test_an_accept_reaching_redis_past_its_bound_writes_nothing(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a") as [a]:
            await a.expire_pool()  # the ticker's scan learns Redis' clock
            assert a.clock_offset is not None and abs(a.clock_offset) < 5
            [first] = await enqueue(a, "r1", 1)  # a bound in the future: accepted
            assert (await a.lookup(first)).status == "pending"
            # As if this call reached Redis an hour after its caller gave up (its client
            # was told 503): the script sees its bound in the past.
            a.clock_offset = -3600.0
            late = [staged(a, "r1", {"prompt": [9], "max_tokens": 1})]
            with pytest.raises(PoolUnavailable, match="nothing written"):
                await a.enqueue(late)
            assert redis.command("XLEN", KEY + "q:r1") == 1
            assert redis.command("HKEYS", KEY + "where") == [first.encode()]
            with pytest.raises(NotFound):
                await a.lookup(late[0].pending.id)
            await a.expire_pool()  # the next scan sets the offset right again
            again = await enqueue(a, "r1", 1)
            assert (await a.lookup(again[0])).status == "pending"
            assert redis.command("XLEN", KEY + "q:r1") == 2


async def test_the_heartbeat_counts_as_lost_only_claims_another_replica_took(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a", "b", reclaim_idle=IDLE) as [a, b]:
            short = await enqueue(a, "r1", 1, deadline=0.05)
            rest = await enqueue(a, "r1", 2)  # the stream stays: r1 has pending work
            assert await a.claim("r1", 10) == 3
            await trio.sleep(0.2)  # short's deadline passes (Redis' clock); a is silent
            # Any replica's scan fails it: its result is stored, its entry acknowledged.
            assert await b.expire_pool() == 1
            assert (await a.lookup(short[0])).status == "failed"
            await a.touch()  # a still lists it among its claims: not lost to anyone
            assert a.lost_claims == 0
            await trio.sleep(IDLE + 0.1)  # a silent past the bound (wall clock)
            assert await b.claim("r1", 10) == 2 and held(b) == rest
            await a.touch()
            assert a.lost_claims == 2  # these two another replica took


async def test_a_claim_whose_stream_was_dropped_costs_the_heartbeat_nothing(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a", "b", reclaim_idle=IDLE) as [a, b]:
            [only] = await enqueue(a, "r1", 1)  # r1's only request
            [other] = await enqueue(a, "r2", 1)
            assert await a.claim("r1", 1) == 1 and await a.claim("r2", 1) == 1
            await trio.sleep(IDLE + 0.1)  # a silent past the bound (wall clock)
            assert await b.claim("r1", 10) == 1
            assert await b.commit(done([only])) == [True]  # r1 has nothing pending: dropped
            await a.touch()  # its other claim (r2) must stay a's; the stream gone is no error
            assert a.lost_claims == 0  # r1's entry has no owner now: its result is stored
            assert await a.give_back(set()) == 1  # r2's goes back, claimable at once
            assert await b.claim("r2", 10) == 1 and held(b) == [other]


async def test_a_long_poll_that_times_out_leaves_no_waiter(redis: RedisServer) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a") as [a]:
            link = PoolLink(a, concurrency=4)
            ids = await enqueue(a, "r1", 3)
            for sid in ids:  # never finished: no notification ever comes for these
                assert (await link.wait_result(sid, 0.2)).status == "pending"
            assert link._waiters == {}
            with trio.move_on_after(0.1):  # a long-poll whose client went away
                await link.wait_result(ids[0], 5)
            assert link._waiters == {}


async def test_a_full_redis_refuses_new_requests_with_507_but_still_drains(
    redis: RedisServer,
) -> None:
    with trio.fail_after(30):
        async with pool(redis, "a", "b") as [a, b]:
            ids = await enqueue(a, "r1", 20)
            used = int(redis.info_memory()["used_memory"])
            redis.command("CONFIG", "SET", "maxmemory", str(used // 2))  # full from now on
            with pytest.raises(StoreFull, match="out of memory"):
                await enqueue(a, "r1", 1)
            assert a.conn.down is None  # reachable: full is not down
            # Everything that drains still runs: asking for a turn, claiming, storing
            # results (which frees their requests), handing back, the heartbeat.
            assert await a.want(8, 5.0, 30.0)
            assert await a.claim("r1", 20) == 20
            await a.touch()
            assert a.lost_claims == 0
            assert await a.commit(done(ids[:10])) == [True] * 10
            assert await a.give_back(set()) == 10  # the other ten, claimable at once
            assert sorted(await claimed_ids(b)) == sorted(ids[10:])
            assert await b.commit(done(ids[10:])) == [True] * 10
            await a.unwant()
            redis.command("CONFIG", "SET", "maxmemory", "0")
            assert [r.status for r in await a.lookup_many(ids)] == ["done"] * 20
            assert stream_keys(redis) == []  # drained: r1's stream went with its last entry


async def claimed_ids(s: PoolStore) -> list[str]:
    assert await s.claim("r1", 20) == 10
    return held(s)


async def test_a_replica_past_its_patience_keeps_asking_beside_the_next(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a", "b", "c") as [a, b, c]:
            await enqueue(a, "r1", 1)
            assert await a.want(8, 5.0, IDLE)
            assert not await b.want(8, 5.0, IDLE)  # a covers the one request
            await trio.sleep(IDLE + 0.1)  # a's trainer keeps its GPU (wall clock: Redis')
            assert await b.want(8, 5.0, IDLE)  # a is past its patience: b may ask too
            assert await a.want(8, 5.0, IDLE)  # ... beside a, which keeps asking
            assert not await c.want(8, 5.0, IDLE)  # b, within its patience, covers c


async def test_a_replica_that_cannot_serve_the_backlog_holds_nobody_back(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a", "b") as [a, b]:
            await enqueue(a, "r1", 1)
            assert not await a.want(8, 5.0, 30.0, avoid=["r1"])  # its r1 loads back off
            assert await b.want(8, 5.0, 30.0)
            a.bad_revisions["r1"] = "ValueError: unreadable"  # nor if it cannot read r1
            assert not await a.want(8, 5.0, 30.0)
            assert await a.claim("r1", 8) == 0 and await b.claim("r1", 8) == 1


def raw_entry(redis: RedisServer, rev: str, fields: dict[str, str | bytes]) -> str:
    """Add a request entry to ``rev``'s stream as another release (or a hand edit) might
    write it, with the bookkeeping ENQUEUE does; its entry id. The stream must exist."""
    flat: list[str | bytes] = [x for kv in fields.items() for x in kv]
    eid = redis.command("XADD", KEY + f"q:{rev}", "*", *flat)
    assert isinstance(eid, bytes)
    if isinstance(fields.get("i"), str):
        redis.command("HSET", KEY + "where", str(fields["i"]), f"{rev} {eid.decode()}")
    redis.command("HINCRBY", KEY + "unclaimed", rev, "1")
    return eid.decode()


GOOD = {"k": "completion", "a": '{"max_tokens": 2}', "d": "3600", "t": b"\x01\x00\x00\x00"}


async def test_an_unreadable_entry_is_handed_back_twice_then_put_aside_failed(
    redis: RedisServer,
) -> None:
    """Unreadable params: each reading hands it back, claimable again once past the
    reclaim bound (a replica that reads it may come first; none reads it again at once,
    and each reading may wake a replica) until the third, which fails it naming pool,
    field and reason, and keeps it for an operator."""
    with trio.fail_after(20):
        async with pool(redis, "a", "b", reclaim_idle=IDLE) as [a, b]:
            [ok] = await enqueue(a, "r1", 1)
            eid = raw_entry(redis, "r1", {"i": "bad1", **GOOD, "a": "not json"})
            assert await a.claim("r1", 10) == 1 and held(a) == [ok]  # bad1: read 1, back
            assert await a.commit(done([ok])) == [True]  # the readable one is served
            assert await b.claim("r1", 10) == 0 and not await b.want(8, 5.0, 30.0)
            await trio.sleep(IDLE + 0.1)  # Redis' clock: past the bound
            assert await b.want(8, 5.0, 30.0)  # claimable again: it may wake b
            assert await b.claim("r1", 10) == 0  # read 2, back
            await trio.sleep(IDLE + 0.1)
            assert await a.claim("r1", 10) == 0  # read 3: put aside
            await trio.sleep(IDLE + 0.1)
            assert await b.claim("r1", 10) == 0 and not await b.want(8, 5.0, 30.0)
            got = await b.lookup("bad1")
            assert got.status == "failed" and got.error is not None
            for part in ("pool pa", "revision r1", f"entry {eid}", "field 'a'",
                         "request parameters", "JSONDecodeError", "in 3 tries"):  # fmt: skip
                assert part in got.error, (part, got.error)
            st = await stats(a)
            assert (st["aside"], st["failed"], st["returned"]) == (1, 1, 2), st
            [(_, kept)] = redis.command("XRANGE", KEY + "aside", "-", "+")  # type: ignore[misc]
            kept = dict(zip(kept[::2], kept[1::2], strict=True))
            assert kept[b"eid"] == eid.encode() and kept[b"f.a"] == b"not json", kept
            assert kept[b"f.i"] == b"bad1" and b"field 'a'" in kept[b"why"], kept
            assert a.put_aside + b.put_aside == 1
            assert stream_keys(redis) == []  # nothing left pending: the stream went too
            assert redis.command("HLEN", KEY + "unread") == 0


async def test_an_entry_without_a_readable_id_is_put_aside_without_a_result(
    redis: RedisServer,
) -> None:
    with trio.fail_after(20):
        async with pool(redis, "a", reclaim_idle=IDLE) as [a]:
            [ok] = await enqueue(a, "r1", 1)
            raw_entry(redis, "r1", {"i": b"\xff\xfe", **GOOD})
            assert await a.claim("r1", 10) == 1
            assert await a.commit(done([ok])) == [True]
            for _ in range(2):
                await trio.sleep(IDLE + 0.1)  # Redis' clock: past the bound
                assert await a.claim("r1", 10) == 0
            st = await stats(a)
            assert (st["aside"], st["failed"], st["returned"]) == (1, 0, 2), st
            assert redis.command("XLEN", KEY + "aside") == 1
            assert stream_keys(redis) == []


@pytest.mark.parametrize("dl", ["soon", "nan", "inf", "-1", ""])
async def test_an_unreadable_deadline_fails_its_request_at_once(
    redis: RedisServer, dl: str
) -> None:
    """The deadline scan fails it at the first look (it could never be reached), naming
    the field; the readable requests beside it stay pending."""
    with trio.fail_after(20):
        async with pool(redis, "a") as [a]:
            [ok] = await enqueue(a, "r1", 1)
            fields: dict[str, str | bytes] = {"i": "late1", **GOOD, "d": dl}
            if not dl:
                del fields["d"]
            raw_entry(redis, "r1", fields)
            assert await a.expire_pool() == 1
            got = await a.lookup("late1")
            assert got.status == "failed" and got.error is not None
            assert "pool pa revision r1" in got.error and "field 'd'" in got.error, got.error
            assert "deadline" in got.error, got.error
            assert (await a.lookup(ok)).status == "pending"
            assert await a.expire_pool() == 0


async def test_a_repaired_revision_record_is_read_again_and_served(redis: RedisServer) -> None:
    """Skipped while unreadable (its requests neither claimed nor counted in the backlog),
    served once repaired, with no event and no restart; a removed record stays skipped."""
    with trio.fail_after(20):
        async with pool(redis, "a", "b") as [a, b]:
            await a.publish("r3", "/ckpt/r3")
            await b.refresh_revisions()
            [sid] = await enqueue(b, "r3", 1)  # accepted where the record still read
            redis.command("HSET", KEY + "revs", "r3", "not json")  # then broken by hand
            redis.command("HSET", KEY + "revs", "r9", "not json")
            await a.refresh_revisions()
            assert set(a.bad_revisions) == {"r3", "r9"}
            assert not await a.want(8, 5.0, 30.0) and await a.claim("r3", 8) == 0
            good = {"path": "/ckpt/r3", "published_at": 1.0, "seq": 3}
            redis.command("HSET", KEY + "revs", "r3", json.dumps(good))  # repaired
            redis.command("HDEL", KEY + "revs", "r9")  # removed
            await a.recheck_bad_revisions()
            assert set(a.bad_revisions) == {"r9"} and "removed" in a.bad_revisions["r9"]
            assert a.revision("r3").path == "/ckpt/r3"
            assert await a.want(8, 5.0, 30.0)
            assert await a.claim(None, 8) == 1 and held(a) == [sid]


async def test_the_deadline_index_forgets_entries_another_release_deleted(
    redis: RedisServer,
) -> None:
    """An older release's COMMIT deletes an entry without its index member: the scan drops
    the member instead of finding it due at every look; and a deadline Lua reads
    otherwise than Python ('1_0': 10 s here) is not failed before it is due."""
    with trio.fail_after(20):
        async with pool(redis, "a") as [a]:
            [gone, kept] = await enqueue(a, "r1", 2, deadline=0.05)
            eid = redis.command("HGET", KEY + "where", gone)
            assert isinstance(eid, bytes)
            redis.command("XDEL", KEY + "q:r1", eid.split()[1])  # as an older release does
            redis.command("HDEL", KEY + "where", gone)
            raw_entry(redis, "r1", {"i": "odd1", **GOOD, "d": "1_0"})
            await trio.sleep(0.2)  # past the short deadlines, measured by Redis' clock
            assert await a.expire_pool() == 1  # kept only
            assert (await a.lookup(kept)).status == "failed"
            assert (await a.lookup("odd1")).status == "pending"
            assert redis.command("ZCARD", KEY + "dl:r1") == 0
            assert await a.expire_pool() == 0
