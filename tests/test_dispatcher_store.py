"""The durable pending queue: journal before ack, results once, deadlines, validation."""

from __future__ import annotations

import array
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_slicer.dispatcher import store as store_mod
from gpu_slicer.dispatcher.errors import (
    BadRequest,
    NotFound,
    StoreError,
    StoreFull,
    UnknownRevision,
)
from gpu_slicer.dispatcher.store import Finish, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path, "pool-a")
    s.publish("r1", "/ckpt/r1")
    yield s
    s.close()


def test_journal_before_ack_survives_reopen(tmp_path: Path) -> None:
    with Store(tmp_path, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        p = s.accept("completion", {"prompt": [1, 2, 3], "max_tokens": 8}, None, 60, now=100.0)
        c = s.accept("chat", {"messages": [{"role": "user", "content": "hé"}]}, "r1", 60)
        t = s.accept("completion", {"prompt": "hello"}, None, 60)
    # Nothing is closed gracefully in a crash; the commit alone must be enough.
    with Store(tmp_path, "pool-a") as again:
        got = again.pending()
        assert [g.id for g in got] == [p.id, c.id, t.id]
        assert got[0] == p
        assert isinstance(got[0].prompt, array.array) and list(got[0].prompt) == [1, 2, 3]
        assert got[1].messages == c.messages and got[1].kind == "chat"
        assert got[2].prompt == b"hello"
        assert again.get(p.id, now=100.0).status == "pending"
        assert again.pending_token_bytes() == (3, 12)
    with Store(tmp_path, "pool-b") as other:  # another pool's requests are not its work
        assert other.pending() == []


def test_result_stored_once_and_kept(tmp_path: Path) -> None:
    with Store(tmp_path, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        p = s.accept("completion", {"prompt": [5]}, None, 60)
        assert s.complete(p.id, {"choices": [{"text": "first"}]}) is True
        assert s.complete(p.id, {"choices": [{"text": "second"}]}) is False
        assert s.fail(p.id, "late failure") is False
        assert s.pending() == [] and s.pending_revisions() == []
    with Store(tmp_path, "pool-a") as s:
        r = s.get(p.id)
        assert (r.status, r.body, r.error) == ("done", {"choices": [{"text": "first"}]}, None)
        assert (r.revision, r.pool) == ("r1", "pool-a")
        assert s.pending() == []
        assert s.counts() == {"pending": 0, "done": 1, "failed": 0}
        with pytest.raises(NotFound, match="smp-nope"):
            s.get("smp-nope")


def test_fail_and_counts(store: Store) -> None:
    a = store.accept("completion", {"prompt": [1]}, None, 60)
    b = store.accept("completion", {"prompt": [2]}, None, 60)
    assert store.fail(a.id, "replica said 400: bad logprobs") is True
    assert store.get(a.id).error == "replica said 400: bad logprobs"
    assert store.counts() == {"pending": 1, "done": 0, "failed": 1}
    assert store.attempt(b.id) == 1 and store.attempt(b.id) == 2
    with pytest.raises(NotFound):
        store.attempt(a.id)


def test_expire_names_pool_and_revision(tmp_path: Path) -> None:
    with Store(tmp_path, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        s.publish("r2", "/ckpt/r2")
        old = s.accept("completion", {"prompt": [1]}, "r2", 10, now=1000.0)
        young = s.accept("completion", {"prompt": [1]}, "r1", 100, now=1000.0)
        done = s.accept("completion", {"prompt": [1]}, "r1", 5, now=1000.0)
        s.complete(done.id, {"choices": []})
        assert s.expire(1009.0) == []
        assert [p.id for p in s.expire(1010.0)] == [old.id]
        assert s.expire(1010.0) == []
        r = s.get(old.id)
        assert r.status == "failed" and r.error is not None
        assert r.error.startswith("deadline exceeded: pool pool-a revision r2 pending since ")
        assert s.get(done.id).status == "done"
        assert [p.id for p in s.pending()] == [young.id]
    with Store(tmp_path, "pool-a") as s:  # the heap is rebuilt from disk
        assert [p.id for p in s.expire(2000.0)] == [young.id]
        assert s.counts() == {"pending": 0, "done": 1, "failed": 2}


def test_a_missed_deadline_names_the_last_failed_load_of_its_weights(tmp_path: Path) -> None:
    with Store(tmp_path, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        s.publish("r2", "/ckpt/r2")
        a = s.accept("completion", {"prompt": [1]}, "r1", 10, now=1000.0)
        b = s.accept("completion", {"prompt": [1]}, "r2", 10, now=1000.0)
        s.explain_loads(lambda rev: "replica x: HTTP 500: gone" if rev == "r2" else None)
        assert [p.id for p in s.expire(1010.0)] == [a.id, b.id]
        ea, eb = s.get(a.id).error, s.get(b.id).error
        assert ea is not None and eb is not None
        assert ea.startswith("deadline exceeded: pool pool-a revision r1 ") and ";" not in ea
        assert eb.startswith("deadline exceeded: pool pool-a revision r2 "), eb
        assert eb.endswith("(10 s, deadline 10 s); its weights could not be loaded: "
                           "replica x: HTTP 500: gone"), eb  # fmt: skip


def test_revisions(tmp_path: Path) -> None:
    with Store(tmp_path, "pool-a") as s:
        assert s.newest() is None and s.revisions() == []
        with pytest.raises(UnknownRevision, match="no revision is published"):
            s.accept("completion", {"prompt": [1]}, None, 60)
        r1 = s.publish("step-1", "/ckpt/1")
        assert s.publish("step-1", "/ckpt/1") == r1  # idempotent
        with pytest.raises(BadRequest, match="already published with path '/ckpt/1'"):
            s.publish("step-1", "/ckpt/other")
        s.publish("step-2:a.b_c", "/ckpt/2")
        for bad in ("", "-x", "a b", "a/b", "x" * 129, "é"):
            with pytest.raises(BadRequest, match="revision must match"):
                s.publish(bad, "/p")
        with pytest.raises(BadRequest, match="path must be"):
            s.publish("ok", "")
        assert [r.name for r in s.revisions()] == ["step-1", "step-2:a.b_c"]
        newest = s.newest()
        assert newest is not None and newest.name == "step-2:a.b_c"
        assert s.revision("step-1").path == "/ckpt/1"
        with pytest.raises(UnknownRevision, match="'nope' is not published in pool 'pool-a'"):
            s.revision("nope")
    with Store(tmp_path, "pool-a") as s:
        assert [r.name for r in s.revisions()] == ["step-1", "step-2:a.b_c"]


def test_revision_resolution_and_pending_order(tmp_path: Path) -> None:
    with Store(tmp_path, "pool-a") as s:
        for r in ("r1", "r2", "r3"):
            s.publish(r, f"/ckpt/{r}")
        body: dict[str, Any] = {"prompt": [1], "model": "llama@r1", "revision": "r2"}
        assert s.accept("completion", body, "r3", 60, now=1.0).revision == "r3"
        assert s.accept("completion", body, None, 60, now=2.0).revision == "r2"
        assert (
            s.accept("completion", {"prompt": [1], "model": "llama@r1"}, None, 60).revision == "r1"
        )
        assert s.accept("completion", {"prompt": [1], "model": "llama"}, None, 60).revision == "r3"
        assert s.pending_revisions() == ["r3", "r2", "r1"]
        assert len(s.pending("r3")) == 2 and s.pending("nope") == []
        first_r3 = s.pending("r3")[0]
        s.complete(first_r3.id, {})
        assert s.pending_revisions() == ["r2", "r1", "r3"]  # by each one's oldest request
        p = s.pending("r2")[0]
        assert "model" not in p.params and "revision" not in p.params


_BAD: list[tuple[str, object, type[Exception], str]] = [
    ("completion", [], BadRequest, "request body must be a JSON object"),
    ("embedding", {"prompt": "x"}, BadRequest, "kind must be one of"),
    ("completion", {}, BadRequest, "missing field 'prompt'"),
    ("chat", {}, BadRequest, "missing field 'messages'"),
    ("completion", {"prompt": 5}, BadRequest, "prompt must be a string or a list of token ids"),
    ("completion", {"prompt": ""}, BadRequest, "prompt must not be empty"),
    ("completion", {"prompt": []}, BadRequest, "prompt must not be an empty list"),
    ("completion", {"prompt": ["a", "b"]}, BadRequest, "batch of 2 prompts"),
    ("completion", {"prompt": [1, "a"]}, BadRequest, "batch of 2 prompts"),
    ("completion", {"prompt": [1, 2.0]}, BadRequest, r"prompt\[1\] must be an integer"),
    ("completion", {"prompt": [1, True]}, BadRequest, r"prompt\[1\] must be an integer"),
    ("completion", {"prompt": [-1]}, BadRequest, "token ids must be in 0..2147483647"),
    ("completion", {"prompt": [1 << 31]}, BadRequest, "token ids must be in"),
    ("completion", {"prompt": [1] * 32769}, BadRequest, "32769 tokens, more than the limit"),
    ("completion", {"prompt": "x" * (1 << 20) + "y"}, BadRequest, "1048577 bytes of UTF-8"),
    ("completion", {"prompt": [1], "max_tokens": 0}, BadRequest, "max_tokens must be a positive"),
    ("completion", {"prompt": [1], "max_tokens": "8"}, BadRequest, "max_tokens must be"),
    ("completion", {"prompt": [1], "max_tokens": 1.5}, BadRequest, "max_tokens must be"),
    ("completion", {"prompt": [1], "max_tokens": True}, BadRequest, "max_tokens must be"),
    ("completion", {"prompt": [1], "n": 0}, BadRequest, "n must be an integer from 1 to 16"),
    ("completion", {"prompt": [1], "n": 17}, BadRequest, "n must be an integer from 1 to 16"),
    ("completion", {"prompt": [1], "temperature": -1}, BadRequest, "temperature must be"),
    ("completion", {"prompt": [1], "top_p": 0}, BadRequest, "top_p must be"),
    ("completion", {"prompt": [1], "seed": "1"}, BadRequest, "seed must be an integer"),
    ("completion", {"prompt": [1], "stop": [1]}, BadRequest, "stop must be a string"),
    ("completion", {"prompt": [1], "stream": "yes"}, BadRequest, "stream must be true or false"),
    ("completion", {"prompt": [1], "model": 3}, BadRequest, "model must be a string"),
    ("completion", {"prompt": [1], "messages": []}, BadRequest, "'messages' is not a field"),
    ("chat", {"messages": [], "prompt": "x"}, BadRequest, "'prompt' is not a field"),
    ("chat", {"messages": []}, BadRequest, "messages must be a non-empty list"),
    ("chat", {"messages": "hi"}, BadRequest, "messages must be a non-empty list"),
    ("chat", {"messages": ["hi"]}, BadRequest, r"messages\[0\] must be an object"),
    ("chat", {"messages": [{"content": "x"}]}, BadRequest, r"messages\[0\].role must be"),
    ("chat", {"messages": [{"role": "u", "content": 1}]}, BadRequest, r"messages\[0\].content"),
    ("completion", {"prompt": [1], "revision": "nope"}, UnknownRevision, "'nope' is not published"),
    ("completion", {"prompt": [1], "model": "m@nope"}, UnknownRevision, "'nope' is not published"),
    ("completion", {"prompt": [1], "model": "m@"}, BadRequest, "names no revision after it"),
    ("completion", {"prompt": [1], "revision": "a b"}, BadRequest, "revision must match"),
    ("completion", {"prompt": [1], "revision": 7}, BadRequest, "revision must be a string"),
]


@pytest.mark.parametrize(("kind", "body", "exc", "message"), _BAD)
def test_bad_requests_are_refused_and_not_journaled(
    store: Store, kind: str, body: Any, exc: type[Exception], message: str
) -> None:
    with pytest.raises(exc, match=message):
        store.accept(kind, body, None, 60)
    assert store.counts() == {"pending": 0, "done": 0, "failed": 0}
    assert store.pending() == []


def test_limits_edges_accepted(store: Store) -> None:
    store.accept("completion", {"prompt": [0] * 32768 + []}, None, 60)
    store.accept("completion", {"prompt": "é" * (1 << 19)}, None, 60)  # exactly 1 MiB
    store.accept("completion", {"prompt": [[1, 2]]}, None, 60)  # a batch of one
    store.accept("completion", {"prompt": [1], "n": 16, "max_tokens": None}, None, 60)
    with pytest.raises(BadRequest, match="deadline must be a positive number"):
        store.accept("completion", {"prompt": [1]}, None, 0)
    p = store.accept("completion", {"prompt": [1], "stream": True, "stream_options": {}}, None, 5)
    assert p.params == {} and p.deadline - p.accepted_at == 5


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_memory_per_pending_token(tmp_path: Path) -> None:
    """1,000,000 pending prompt tokens: <= 8 bytes/token of array storage (target)."""
    tokens_per = 1000
    prompt = list(range(tokens_per))
    with Store(tmp_path, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        rss0 = _rss_bytes()
        start = time.perf_counter()
        for _ in range(1_000_000 // tokens_per):
            s.accept("completion", {"prompt": prompt, "max_tokens": 16}, None, 3600)
        elapsed = time.perf_counter() - start
        rss1 = _rss_bytes()
        tokens, nbytes = s.pending_token_bytes()
        assert tokens == 1_000_000
        held = sum(p.prompt.buffer_info()[1] * p.prompt.itemsize for p in s.pending()
                   if isinstance(p.prompt, array.array))  # fmt: skip
        assert held == nbytes
        per_token = nbytes / tokens
        print(
            f"\npending prompt memory: {per_token:.2f} B/token in arrays, "
            f"process RSS delta {(rss1 - rss0) / tokens:.2f} B/token "
            f"({(rss1 - rss0) / 2**20:.1f} MiB for {tokens} tokens in {tokens // tokens_per} "
            f"requests; accept {elapsed / (tokens // tokens_per) * 1e6:.0f} us/request)"
        )
        assert per_token <= 8
    with Store(tmp_path, "pool-a") as s:
        assert s.pending_token_bytes() == (1_000_000, 4_000_000)


def test_unwritable_state_dir_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot open the dispatch store"):
        Store(blocker / "sub", "pool-a")


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.integration  # mount(8) and umount(8)
def test_full_disk_is_store_full_and_nothing_half_written(tiny_fs: Path) -> None:
    accepted: list[str] = []
    with Store(tiny_fs, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        with pytest.raises(StoreFull, match="is full"):
            for i in range(1000):
                accepted.append(s.accept("completion", {"prompt": [i] * 4000}, None, 60).id)
        assert accepted, "the disk filled before the first request"
        assert [p.id for p in s.pending()] == accepted  # the refused one is not held
        # A result that does not fit either stays pending: it is served again later.
        try:
            stored = s.complete(accepted[0], {"text": "x" * (512 << 10)})
        except StoreFull:
            stored = False
            assert s.pending()[0].id == accepted[0]
    with Store(tiny_fs, "pool-a") as again:
        still = [p.id for p in again.pending()]
        assert still == (accepted[1:] if stored else accepted)
        assert again.counts()["done"] == int(stored)


def test_a_group_is_one_transaction_and_a_failed_one_changes_nothing(store: Store) -> None:
    old = store.accept("completion", {"prompt": [9]}, None, 60)
    staged = [store.prepare("completion", {"prompt": [i]}, None, 60) for i in range(5)]
    before = store.transactions
    stored = store.commit(
        staged, [Finish(old.id, "done", raw=b'{"a": 1}')], {staged[0].pending.id: 1}
    )
    assert stored == [True] and store.transactions - before == 1
    assert [p.id for p in store.pending()] == [s.pending.id for s in staged]
    # A group SQLite refuses (here: a request journaled twice) is written not at all.
    again = store.prepare("completion", {"prompt": [7]}, None, 60)
    with pytest.raises(StoreError, match="UNIQUE"):
        store.commit([again, staged[1]], [Finish(staged[2].pending.id, "failed", error="x")])
    assert store.transactions - before == 1
    assert [p.id for p in store.pending()] == [s.pending.id for s in staged]
    assert store.counts() == {"pending": 5, "done": 1, "failed": 0}
    assert store.get(staged[2].pending.id).status == "pending"


def test_recent_results_come_from_memory_and_older_ones_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "RECENT_RESULTS", 2)
    with Store(tmp_path, "pool-a") as s:
        s.publish("r1", "/ckpt/r1")
        ps = [s.accept("completion", {"prompt": [i]}, None, 60) for i in range(3)]
        raws = [b'{"choices": [{"text": "\\u00e9"}], "n": %d}' % i for i in range(3)]
        for p, raw in zip(ps, raws, strict=True):
            assert s.complete(p.id, raw)
        s._con.close()  # no SQLite from here: the two newest still answer, from memory
        assert [s.get(p.id).raw for p in ps[1:]] == raws[1:]
        with pytest.raises(StoreError):
            s.get(ps[0].id)  # the oldest fell out of memory: it is read from the database
    with Store(tmp_path, "pool-a") as s:
        assert [s.get(p.id).raw for p in ps] == raws  # byte for byte, as stored
        assert s.get(ps[0].id).body == {"choices": [{"text": "é"}], "n": 0}


def test_sync_modes(tmp_path: Path) -> None:
    for mode, level in (("normal", 1), ("full", 2)):
        with Store(tmp_path / mode, "pool-a", synchronous=mode) as s:
            assert s._con.execute("PRAGMA synchronous").fetchone() == (level,)
    with pytest.raises(ValueError, match="synchronous must be one of"):
        Store(tmp_path, "pool-a", synchronous="off")
