"""Group commit (dispatcher.journal) and the batch routes, in process: a turn loop over
the fake vLLM and a fake slicerd, its HTTP front called through ASGI.

Transactions are counted by the store itself (`Store.transactions`); a failing commit
is a store whose `commit` raises as SQLite would on a full disk or a broken file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.errors import StoreError, StoreFull
from gpu_slicer.dispatcher.http import MAX_BATCH, build_app
from gpu_slicer.dispatcher.journal import Journal
from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from tests.test_dispatcher_model import FakeSlicer
from tests.test_dispatcher_vllm import FakeVllm

BODY = {"prompt": [1, 2], "max_tokens": 2}


Handler = Callable[[httpx.Request], httpx.Response]


@asynccontextmanager
async def journal_loop(
    tmp_path: Path, *, turns: bool, wrap: Callable[[FakeVllm], Handler] | None = None
) -> AsyncIterator[tuple[TurnLoop, httpx.AsyncClient]]:
    """A turn loop with revision r1 published and its journal's writer running (and,
    with ``turns``, the whole loop: it serves what is accepted) over the fake vLLM,
    ``wrap`` optionally in front of it; (loop, its front)."""
    fake = FakeVllm()
    handler: Handler = wrap(fake) if wrap else fake
    store = Store(tmp_path / "state", "pool-a")
    ckpt = tmp_path / "ckpt" / "r1"
    ckpt.mkdir(parents=True)
    (ckpt / "revision.txt").write_text("r1")
    try:
        async with (
            Replica("http://vllm", transport=httpx.MockTransport(handler)) as r,
            trio.open_nursery() as nursery,
        ):
            loop = TurnLoop(store, r, TurnConfig(workload="v"), connect=FakeSlicer().connect)
            loop.publish("r1", str(ckpt))
            await nursery.start(loop.run if turns else loop.journal.run)
            transport = httpx.ASGITransport(app=build_app(loop))
            async with httpx.AsyncClient(transport=transport, base_url="http://front") as http:
                yield loop, http
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def _failing_commits(store: Store, errors: list[StoreError]) -> list[int]:
    """Make the next ``len(errors)`` commits of ``store`` raise those errors (nothing
    written); returns the list the sizes of the failed groups go to."""
    real = store.commit
    sizes: list[int] = []

    def commit(new: Any = (), finishes: Any = (), attempts: Any = None, **kw: Any) -> list[bool]:
        if errors:
            sizes.append(len(new) + len(finishes))
            raise errors.pop(0)
        return real(new, finishes, attempts, **kw)

    store.commit = commit  # type: ignore[method-assign]
    return sizes


# -- group commit ---------------------------------------------------------------------


async def test_concurrent_accepts_share_one_transaction(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with journal_loop(tmp_path, turns=False) as (loop, _):
            before = loop.store.transactions
            ids: list[str] = []

            async def one(i: int) -> None:
                ids.append((await loop.accept("completion", {"prompt": [i]})).id)

            async with trio.open_nursery() as n:
                for i in range(50):
                    n.start_soon(one, i)
            assert len(ids) == 50
            assert loop.store.transactions - before == 1 and loop.journal.groups == 1
            assert sorted(p.id for p in loop.store.pending()) == sorted(ids)
    with Store(tmp_path / "state", "pool-a") as again:
        assert sorted(p.id for p in again.pending()) == sorted(ids)


async def test_a_lone_accept_commits_at_once(tmp_path: Path, autojump_clock: Any) -> None:
    with trio.fail_after(10):
        async with journal_loop(tmp_path, turns=False) as (loop, _):
            before, t0 = loop.store.transactions, trio.current_time()
            p = await loop.accept("completion", BODY)
            assert trio.current_time() == t0  # no timer: the clock would have jumped
            assert loop.store.transactions - before == 1 and loop.store.is_pending(p.id)
            with Store(tmp_path / "state", "pool-a") as other:  # committed, on disk
                assert [q.id for q in other.pending()] == [p.id]


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [(StoreFull("the disk is full"), 507, "store_full"),
     (StoreError("store failed: disk I/O error"), 503, "store_error")],
)  # fmt: skip
async def test_a_failed_group_fails_only_its_accepts(
    tmp_path: Path, error: StoreError, status: int, code: str
) -> None:
    with trio.fail_after(10):
        async with journal_loop(tmp_path, turns=False) as (loop, http):
            kept = await loop.accept("completion", BODY)
            sizes = _failing_commits(loop.store, [error])
            answers: list[httpx.Response] = []

            async def post(i: int) -> None:
                answers.append(await http.post("/v1/samples", json={"prompt": [i]}))

            async with trio.open_nursery() as n:  # one group, refused as a whole
                for i in range(3):
                    n.start_soon(post, i)
            assert sizes == [3]
            assert [r.status_code for r in answers] == [status] * 3, [r.text for r in answers]
            assert all(r.json()["error"]["code"] == code for r in answers)
            after = await http.post("/v1/samples", json={"prompt": [9]})  # the next group
            assert after.status_code == 202, after.text
            pending = [p.id for p in loop.store.pending()]
            assert pending == [kept.id, after.json()["id"]]
    with Store(tmp_path / "state", "pool-a") as again:  # nothing of the failed group
        assert [p.id for p in again.pending()] == pending


async def test_a_result_whose_commit_failed_stays_pending_and_is_served_again(
    tmp_path: Path, autojump_clock: Any
) -> None:
    with trio.fail_after(60):
        async with journal_loop(tmp_path, turns=True) as (loop, _):
            failed = trio.Event()
            real = loop.store.commit

            def commit_once(new: Any = (), finishes: Any = (), *a: Any, **kw: Any) -> Any:
                if finishes and not failed.is_set():
                    failed.set()
                    raise StoreError("store failed: disk I/O error")
                return real(new, finishes, *a, **kw)

            loop.store.commit = commit_once  # type: ignore[method-assign]
            with loop.subscribe() as sub:
                p = await loop.accept("completion", BODY)
                await failed.wait()
                # The writer has handled the failure by now: pending, never done in memory.
                assert loop.store.is_pending(p.id) and loop.store.get(p.id).status == "pending"
                assert loop.counters.commits == 0
                result = await loop.wait_result(p.id, 30)
                assert result.status == "done" and result.body is not None
                events = []
                async for e in sub:  # to the turn's end
                    events.append(e)
                    if e["event"] == "released":
                        break
            committed = [e for e in events if e["event"] == "committed"]
            assert [e["id"] for e in committed] == [p.id]  # once: no duplicate result
            assert loop.counters.sends == 2 and loop.counters.commits == 1
            assert loop.store.counts() == {"pending": 0, "done": 1, "failed": 0}
    with Store(tmp_path / "state", "pool-a") as again:
        assert again.get(p.id).raw == result.raw and again.counts()["done"] == 1
        (attempts,) = again._con.execute(
            "SELECT attempts FROM sample WHERE id = ?", (p.id,)
        ).fetchone()
        assert attempts == 2


_CRASH = """
import os, sys, trio
from gpu_slicer.dispatcher.journal import Journal
from gpu_slicer.dispatcher.store import Store

async def main():
    store = Store(sys.argv[1], "pool-a")
    store.publish("r1", "/ckpt/r1")
    journal = Journal(store)
    async with trio.open_nursery() as n:
        await n.start(journal.run)
        staged = [store.prepare("completion", {"prompt": [i]}, None, 60) for i in range(20)]
        await journal.accept(staged[:10])
        await journal.accept(staged[10:])
        done = trio.Event()
        journal.finish(staged[0].pending.id, "done", raw=b'{"choices":[]}',
                       on_stored=lambda ok: done.set(), on_error=print)
        await done.wait()
        print(" ".join(s.pending.id for s in staged), flush=True)
        os._exit(3)  # a crash: no close, no flush, nothing after the acknowledgements

trio.run(main)
"""


@pytest.mark.integration  # a real crash: a child process that dies without closing
def test_a_crash_after_acknowledgement_loses_nothing(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 3, out.stderr
    ids = out.stdout.split()
    assert len(ids) == 20
    with Store(tmp_path, "pool-a") as again:
        assert [p.id for p in again.pending()] == ids[1:]
        first = again.get(ids[0])
        assert (first.status, first.raw) == ("done", b'{"choices":[]}')


# -- the batch routes -------------------------------------------------------------------


async def test_batch_submit_journals_in_order_in_one_group(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with journal_loop(tmp_path, turns=False) as (loop, http):
            before = loop.store.transactions
            items = [{"prompt": [i], "max_tokens": 2} for i in range(5)]
            items.append({"kind": "chat", "messages": [{"role": "user", "content": "hi"}]})
            r = await http.post("/v1/samples/batch", json={"requests": items})
            assert r.status_code == 202, r.text
            got = r.json()["samples"]
            assert [s["status"] for s in got] == ["pending"] * 6
            assert {s["revision"] for s in got} == {"r1"}
            assert [p.id for p in loop.store.pending()] == [s["id"] for s in got]
            assert [p.kind for p in loop.store.pending()] == ["completion"] * 5 + ["chat"]
            assert loop.store.transactions - before == 1


@pytest.mark.parametrize(
    ("items", "status", "message"),
    [
        ([BODY, BODY, {"prompt": []}], 400, "requests[2]: prompt must not be an empty list"),
        ([BODY, 7], 400, "requests[1]: request body must be a JSON object"),
        ([BODY, {"prompt": [1], "kind": 3}], 400, "requests[1]: kind must be"),
        ([{"prompt": [1], "revision": "nope"}], 404, "requests[0]: revision 'nope' is not"),
    ],
)
async def test_batch_submit_is_all_or_nothing(
    tmp_path: Path, items: list[Any], status: int, message: str
) -> None:
    with trio.fail_after(10):
        async with journal_loop(tmp_path, turns=False) as (loop, http):
            r = await http.post("/v1/samples/batch", json={"requests": items})
            assert r.status_code == status, r.text
            assert r.json()["error"]["message"].startswith(message), r.text
            assert loop.store.counts() == {"pending": 0, "done": 0, "failed": 0}


async def test_batch_limits(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with journal_loop(tmp_path, turns=False) as (loop, http):
            cases: list[tuple[str, Any, str]] = [
                ("/v1/samples/batch", {"requests": [BODY] * (MAX_BATCH + 1)},
                 f"requests has {MAX_BATCH + 1} items, more than the limit of {MAX_BATCH}"),
                ("/v1/samples/batch", {}, "missing field 'requests'"),
                ("/v1/samples/batch", {"requests": {}}, "requests must be a list"),
                ("/v1/samples/results", {"ids": ["smp-x"] * (MAX_BATCH + 1)},
                 f"ids has {MAX_BATCH + 1} items, more than the limit of {MAX_BATCH}"),
                ("/v1/samples/results", {"ids": [1]}, "ids[0] must be a sample id"),
                ("/v1/samples/results", {"ids": [], "wait": -1}, "wait must be a number"),
                ("/v1/samples/results", {"ids": [], "wait": True}, "wait must be a number"),
                ("/v1/samples/results", {"ids": [], "wait": "soon"}, "wait must be a number"),
            ]  # fmt: skip
            for path, body, message in cases:
                r = await http.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["message"].startswith(message), r.text
            assert loop.store.counts()["pending"] == 0
            # Exactly at the limit: accepted, one group.
            before = loop.store.transactions
            r = await http.post("/v1/samples/batch", json={"requests": [BODY] * MAX_BATCH})
            assert r.status_code == 202 and len(r.json()["samples"]) == MAX_BATCH
            assert loop.store.transactions - before == 1


async def test_batch_results_in_order_unknown_404_and_early_return(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with journal_loop(tmp_path, turns=True) as (loop, http):
            r = await http.post("/v1/samples/batch", json={"requests": [BODY] * 3})
            ids = [s["id"] for s in r.json()["samples"]][::-1]
            r = await http.post("/v1/samples/results", json={"ids": [ids[0], "smp-nope"]})
            assert r.status_code == 404 and "smp-nope" in r.json()["error"]["message"], r.text
            with trio.fail_after(20):  # far before its wait of 300 s: all are done
                r = await http.post("/v1/samples/results", json={"ids": ids, "wait": 300})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["id"] for x in results] == ids
            assert [x["status"] for x in results] == ["done"] * 3
            for x in results:  # exactly what GET /v1/samples/{id} answers
                one = await http.get(f"/v1/samples/{x['id']}", params={"wait": 0})
                assert one.json() == x
            # A pending one with wait 0 answers at once, as it stands.
            pending = (await http.post("/v1/samples", json=BODY)).json()["id"]
            loop.serving._in_flight[pending] = trio.CancelScope()  # held: it is not sent
            r = await http.post("/v1/samples/results", json={"ids": [pending], "wait": 0})
            assert [x["status"] for x in r.json()["results"]] == ["pending"]
            del loop.serving._in_flight[pending]


async def test_results_from_memory_equal_the_sqlite_copy_byte_for_byte(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with journal_loop(tmp_path, turns=True) as (loop, http):
            r = await http.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
            sid = r.headers["x-sample-id"]
            answered = r.content
            polled = (await http.get(f"/v1/samples/{sid}", params={"wait": 0})).content
            loop.store.close()  # from here any read of SQLite would raise
            memory = loop.store.get(sid)
            assert memory.status == "done" and memory.raw is not None
    with Store(tmp_path / "state", "pool-a") as again:
        stored = again.get(sid)
    assert stored.raw == memory.raw == answered  # vLLM's bytes, stored and served as-is
    assert json.loads(answered)["choices"][0]["text"] == "ab"
    assert json.loads(polled) == {"id": sid, "status": "done", "revision": "r1",
                                  "pool": "pool-a", "result": json.loads(answered)}  # fmt: skip


async def test_a_result_queued_when_the_writer_stops_is_still_committed(tmp_path: Path) -> None:
    store = Store(tmp_path, "pool-a")
    store.publish("r1", "/ckpt/r1")
    p = store.accept("completion", BODY, None, 60)
    journal = Journal(store)
    told: list[bool] = []
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                await n.start(journal.run)
                journal.finish(p.id, "done", raw=b"{}", on_stored=told.append, on_error=print)
                assert journal.queued(p.id)
                n.cancel_scope.cancel()  # the dispatcher stops before the writer's round
        assert told == [True] and not journal.queued(p.id)
    finally:
        store.close()
    with Store(tmp_path, "pool-a") as again:
        assert again.get(p.id).raw == b"{}"


async def test_a_failing_expire_is_retried_every_second_not_spun(
    tmp_path: Path, autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ticker wakes at the next deadline; while the store cannot fail a request past
    it (a full disk), that deadline stays the next one: it is retried every second, not
    every few milliseconds (with an error logged each time)."""
    with trio.fail_after(60):
        async with journal_loop(tmp_path, turns=False) as (loop, _):
            calls: list[float] = []

            def failing(now: float) -> None:
                calls.append(trio.current_time())
                raise StoreError("disk full")

            monkeypatch.setattr(loop.serving, "expire", failing)
            monkeypatch.setattr(loop.store, "next_deadline", lambda: time.time() - 5)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop._ticker)
                await trio.sleep(10)
                nursery.cancel_scope.cancel()
            assert 9 <= len(calls) <= 12, len(calls)
