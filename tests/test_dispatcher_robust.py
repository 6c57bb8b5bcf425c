"""No request kills `slicer-dispatch`, one bad revision does not stall the rest, and one
dispatcher owns a state dir: the real dispatcher (real slicerd on a fake GPU, the vLLM
stub under the real launcher) driven into each failure, plus the pure parts alone.

Every wait is event-driven and bounded (HTTP long-polls, lines the processes print,
process exits, all under `trio.fail_after`); every stack asserts zero GPU overlaps.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from gpu_slicer.dispatcher.checkpoint import check_checkpoint_dir
from gpu_slicer.dispatcher.errors import BadRequest, StateInUse
from gpu_slicer.dispatcher.owner import LOCK_NAME, StateLock
from gpu_slicer.dispatcher.store import DB_NAME, Store
from tests.harness import Stack, running_stack
from tests.procs import free_port, spawn
from tests.test_dispatcher import dispatcher, publish, replica, result_of, status, stop, versions

MiB = 1 << 20
NO_REPLICA = "http://127.0.0.1:9"  # nothing is accepted, or nothing is sent


def checkpoint(stack: Stack, rev: str) -> Path:
    """A checkpoint dir of `rev` as the stub loads it (revision.txt inside)."""
    path = stack.base / "ckpt" / rev
    path.mkdir(parents=True)
    (path / "revision.txt").write_text(rev)
    return path


def seed_store(stack: Stack, bodies: list[dict[str, Any]]) -> list[str]:
    """Journal `bodies` for revision r1 of pool "v" in the dispatcher's state dir (as a
    dispatcher that stopped with them pending would have left them); their ids."""
    path = checkpoint(stack, "r1")
    with Store(stack.base / "dstate", "v") as s:
        s.publish("r1", str(path))
        return [s.accept("completion", b, None, 3600).id for b in bodies]


# -- pure parts ------------------------------------------------------------------------


def test_checkpoint_dir_check(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text("{}")
    check_checkpoint_dir(str(good))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        (str(tmp_path / "gone"), "no such directory"),
        (str(tmp_path / "file"), "is not a directory"),
        (str(tmp_path / "empty"), "is an empty directory"),
        ("relative/ckpt", "must be absolute"),
        ("", "non-empty string"),
        ("/tmp/\ud800", "lone UTF-16 surrogate"),
    ]
    for path, text in cases:
        with pytest.raises(BadRequest, match=text):
            check_checkpoint_dir(path)


def test_state_lock_is_exclusive_and_names_its_owner(tmp_path: Path) -> None:
    lock = StateLock.acquire(tmp_path / "state")
    assert (tmp_path / "state" / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    with pytest.raises(
        StateInUse, match=rf"in use by another slicer-dispatch \(pid {os.getpid()},"
    ):
        StateLock.acquire(tmp_path / "state")
    lock.release()
    StateLock.acquire(tmp_path / "state").release()


def test_a_damaged_page_is_a_store_error_and_reported(tmp_path: Path) -> None:
    with Store(tmp_path, "v") as s:
        s.publish("r1", "/ckpt/r1")
        sid = s.accept("completion", {"prompt": "a"}, None, 60).id
    _damage_revision_table(tmp_path / DB_NAME)
    with Store(tmp_path, "v") as s:  # the pending rows load: only the revisions' page broke
        assert s.health() == {"path": str(tmp_path / DB_NAME), "damaged": False, "error": None}
        for call in (s.newest, s.revisions, lambda: s.revision("r1")):
            with pytest.raises(Exception, match="malformed") as e:
                call()
            assert type(e.value).__name__ == "StoreError"
        assert s.get(sid).status == "pending"  # another page: still readable
        health = s.health()
        assert health["damaged"] and "malformed" in health["error"], health


def _damage_revision_table(db: Path) -> None:
    """Overwrite the root page of the revision table with garbage (a corrupt page)."""
    con = sqlite3.connect(db)
    (root,) = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'revision'").fetchone()
    (size,) = con.execute("PRAGMA page_size").fetchone()
    con.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xff" * size)


# -- the real dispatcher -----------------------------------------------------------------

SURROGATES = [
    ("/v1/completions", rb'{"prompt": "\ud800", "max_tokens": 4}', "prompt (offset 0)"),
    ("/v1/completions", rb'{"prompt": "x", "user": "\udfff"}', "user (offset 0)"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800"}]}',
     "messages[0].content (offset 1)"),
    ("/v1/samples", rb'{"prompt": "x", "stop": ["\n", "\udc00"]}', "stop[1] (offset 0)"),
]  # fmt: skip


@pytest.mark.integration
async def test_text_no_encoder_takes_is_refused_at_the_front_and_the_loop_serves_on() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            async with dispatcher(stack, url) as (d, http):
                await publish(stack, http, "r1")
                before = (await status(http))["counts"]
                json_type = {"content-type": "application/json"}
                for path, raw, field in SURROGATES:
                    r = await http.post(path, content=raw, headers=json_type)
                    assert r.status_code == 400, (raw, r.text)
                    msg = r.json()["error"]["message"]
                    assert msg.startswith(field) and "lone UTF-16 surrogate" in msg, msg
                bad = [
                    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
                    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                ]
                for raw, text in bad:
                    r = await http.post("/v1/completions", content=raw, headers=json_type)
                    assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
                raw = rb'{"revision": "r9", "path": "/tmp/\ud800"}'
                r = await http.post("/v1/revisions", content=raw, headers=json_type)
                assert r.status_code == 400 and "surrogate" in r.text, r.text
                assert (await status(http))["counts"] == before  # nothing was journaled
                # A surrogate *pair* is one valid character: served like any text.
                raw = rb'{"prompt": "caf\u00e9 \ud83d\ude00", "user": "\u00e9", "max_tokens": 4}'
                r = await http.post("/v1/completions", content=raw, headers=json_type)
                assert r.status_code == 200 and versions(r.json()) == {"r1"}, r.text
                st = await status(http)
                assert st["counts"] == {"pending": 0, "done": 1, "failed": 0}, st
                assert st["counters"]["turn_errors"] == 0 and st["counters"]["send_errors"] == 0
                await stop(d)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_a_stored_request_that_cannot_be_sent_fails_alone_after_bounded_sends() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            good, bad_param, bad_prompt = seed_store(
                stack,
                [{"prompt": "fine", "max_tokens": 4}, {"prompt": "u", "user": "x"},
                 {"prompt": "p", "max_tokens": 4}],
            )  # fmt: skip
            # Rows as an older release journaled them: lone surrogates a UTF-8 encoder
            # refuses, in a parameter and in a text prompt (that crashed every restart).
            con = sqlite3.connect(stack.base / "dstate" / DB_NAME)
            with con:
                con.execute("UPDATE sample SET params = ? WHERE id = ?",
                            (r'{"user":"\udfff"}', bad_param))  # fmt: skip
                con.execute(
                    "UPDATE sample SET prompt = ? WHERE id = ?", (b"\xed\xa0\x80", bad_prompt)
                )
            con.close()
            async with dispatcher(stack, url) as (d, http):
                got = await result_of(http, good)
                assert got["status"] == "done" and versions(got["result"]) == {"r1"}, got
                for sid, error in (
                    (bad_param, "UnicodeEncodeError"),
                    (bad_prompt, "UnicodeDecodeError"),
                ):
                    got = await result_of(http, sid)
                    assert got["status"] == "failed", got
                    head = (
                        f"send failed: sample {sid} (pool v, revision r1) could not be sent 3 times"
                    )
                    assert got["error"].startswith(head) and error in got["error"], got
                r = await http.post("/v1/completions", json={"prompt": "after", "max_tokens": 4})
                assert r.status_code == 200 and versions(r.json()) == {"r1"}, r.text
                st = await status(http)
                assert st["counts"] == {"pending": 0, "done": 2, "failed": 2}, st
                assert st["counters"]["send_errors"] == 6, st["counters"]
                assert d.proc.returncode is None
                await stop(d)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_a_body_over_the_limit_is_refused_while_it_streams_in() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, dispatcher(stack, NO_REPLICA) as (d, http):
            port = http.base_url.port
            assert port is not None
            head = b"POST /v1/samples HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            # A declared length over the limit: refused before a byte of the body is read.
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(head + b"Content-Length: %d\r\n\r\n" % (1 << 30))
                answer = await _response(s)
            assert answer.startswith(b"HTTP/1.1 413"), answer
            # Chunked: no length to check first. Send up to 1 GiB; the answer must come
            # once a little over 64 MiB were read, and we stop sending when it does.
            sent, answer = await _send_chunked(port, head, limit=1 << 30)
            assert answer.startswith(b"HTTP/1.1 413"), answer
            assert b'"code":"too_large"' in answer, answer
            assert sent < 128 * MiB, sent // MiB
            assert psutil.Process(d.proc.pid).memory_info().rss < 512 * MiB
            assert (await status(http))["counts"] == {"pending": 0, "done": 0, "failed": 0}
            await stop(d)


async def _response(s: trio.SocketStream) -> bytes:
    """Bytes from `s` until its peer closes or a whole response arrived."""
    data = b""
    while chunk := await s.receive_some(65536):
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(h.split(b":")[1])
                for h in head.split(b"\r\n")
                if h.lower().startswith(b"content-length:")
            ),
            None,
        )
        if length is not None and len(body) >= length:
            break
    return data


async def _send_chunked(port: int, head: bytes, limit: int) -> tuple[int, bytes]:
    """POST a chunked body of up to `limit` bytes, stopping when the answer arrives;
    (bytes of body sent, the answer)."""
    chunk = b"%x\r\n" % MiB + b" " * MiB + b"\r\n"
    sent = 0
    answer = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as s:
        await s.send_all(head + b"Transfer-Encoding: chunked\r\n\r\n")
        done = trio.Event()

        async def read() -> None:
            nonlocal answer
            answer = await _response(s)
            done.set()

        async with trio.open_nursery() as n:
            n.start_soon(read)
            try:
                while not done.is_set() and sent < limit:
                    await s.send_all(chunk)
                    sent += MiB
                if not done.is_set():
                    await s.send_all(b"0\r\n\r\n")
            except trio.BrokenResourceError:
                pass  # it answered and closed while we were still sending: expected
            await done.wait()
    return sent, answer


@pytest.mark.integration
async def test_a_damaged_store_answers_503_and_the_loop_lives_and_says_so() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            ids = seed_store(stack, [{"prompt": f"d{i}", "max_tokens": 4} for i in range(2)])
            _damage_revision_table(stack.base / "dstate" / DB_NAME)
            async with dispatcher(stack, url) as (d, http):
                # The turn reads the revision to load: it fails, and the loop retries.
                await d.line(lambda s: "is damaged (DatabaseError: database disk image" in s)
                first = await d.line(lambda s: "turn failed (StoreError" in s)
                await d.line(lambda s: "turn failed (StoreError" in s, first + 1)
                r = await http.post("/v1/samples", json={"prompt": "x", "max_tokens": 4})
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "store_error" and "malformed" in err["message"], err
                assert (await http.get("/v1/revisions")).status_code == 503
                st = await status(http)
                assert st["store"]["damaged"] is True, st["store"]
                assert "malformed" in st["store"]["error"], st["store"]
                assert st["counts"]["pending"] == 2 and st["counters"]["turn_errors"] >= 2
                text = (await http.get("/metrics")).text
                assert 'slicer_dispatch_store_damaged{pool="v"} 1.0' in text, text
                for sid in ids:  # its row is on a healthy page
                    r = await http.get(f"/v1/samples/{sid}", params={"wait": 0})
                    assert r.status_code == 200 and r.json()["status"] == "pending", r.text
                assert d.proc.returncode is None
                await stop(d)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_an_unloadable_revision_is_backed_off_alone_then_fails_naming_it() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            async with dispatcher(stack, url) as (d, http):
                (stack.base / "empty").mkdir()
                (stack.base / "file").write_text("x")
                for path, text in [
                    (str(stack.base / "nope"), "no such directory"),
                    (str(stack.base / "file"), "is not a directory"),
                    (str(stack.base / "empty"), "is an empty directory"),
                    ("ckpt/r9", "must be absolute"),
                ]:
                    r = await http.post("/v1/revisions", json={"revision": "r9", "path": path})
                    assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
                assert (await http.get("/v1/revisions")).json() == {"revisions": []}
                await publish(stack, http, "r1")
                await publish(stack, http, "r2")
                gone = stack.base / "ckpt" / "r2"
                shutil.rmtree(gone)  # a retention policy deleted it after it was published
                bad, good = [], []
                for i in range(2):  # the oldest requests: r2 is the first revision tried
                    r = await http.post("/v1/samples", json={"prompt": f"b{i}", "revision": "r2"})
                    bad.append(r.json()["id"])
                sync: dict[str, Any] = {}

                async def sync_call() -> None:
                    body = {"prompt": "s", "max_tokens": 4, "revision": "r2"}
                    r = await http.post("/v1/completions", json=body)
                    sync.update(status=r.status_code, error=r.json()["error"])

                async with trio.open_nursery() as n:
                    n.start_soon(sync_call)
                    for i in range(3):
                        r = await http.post(
                            "/v1/samples", json={"prompt": f"g{i}", "revision": "r1"}
                        )
                        good.append(r.json()["id"])
                    # Served while r2 is backed off, long before any deadline (1 h).
                    for sid in good:
                        got = await result_of(http, sid, timeout=30)
                        assert got["status"] == "done" and versions(got["result"]) == {"r1"}, got
                    head = (
                        f"load failed: pool v revision r2: replica {url} (workload v) refused 3 "
                        f"loads of {gone} in a row; last error: "
                    )
                    for sid in bad:
                        got = await result_of(http, sid, timeout=40)
                        assert got["status"] == "failed" and got["error"].startswith(head), got
                        assert "No such file or directory" in got["error"], got
                assert sync["status"] == 502 and sync["error"]["message"].startswith(head), sync
                assert any("other revisions first" in s for s in d.lines), d.output()
                st = await status(http)
                assert st["counts"] == {"pending": 0, "done": 3, "failed": 3}, st
                assert st["load_backoff"] == {} and st["counters"]["load_failures"] == 3, st
                r = await http.post("/v1/completions", json={"prompt": "after", "revision": "r1"})
                assert r.status_code == 200 and versions(r.json()) == {"r1"}, r.text
                await stop(d)
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_a_second_dispatcher_on_the_same_state_dir_is_refused_naming_the_owner() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            state = stack.base / "dstate"
            async with dispatcher(stack, NO_REPLICA) as (d, http):
                await publish(stack, http, "r1")
                argv = [sys.executable, "-m", "gpu_slicer.dispatcher.main", "--workload", "v"]
                argv += ["--replica", NO_REPLICA, "--socket", stack.socket]
                argv += ["--state-dir", str(state), "--listen", f"127.0.0.1:{free_port()}"]
                async with spawn(stack, "dispatcher-2", argv) as d2:
                    assert await d2.wait(30) == 75, d2.output()  # EX_TEMPFAIL
                    while not d2.closed:  # the rest of its output
                        await d2.changed.wait()
                    assert d2.lines == [
                        f"slicer-dispatch: error: state dir {state} is in use by another "
                        "slicer-dispatch "
                        f"(pid {d.proc.pid}, lock {state / LOCK_NAME}); run one dispatcher "
                        "per state dir"
                    ], d2.output()
                r = await http.get("/v1/revisions")  # the owner serves on, untouched
                assert [x["revision"] for x in r.json()["revisions"]] == ["r1"]
                await stop(d)
            async with dispatcher(stack, NO_REPLICA) as (d3, http3):  # the lock went with it
                assert (state / LOCK_NAME).read_text() == f"{d3.proc.pid}\n"
                assert [
                    x["revision"] for x in (await http3.get("/v1/revisions")).json()["revisions"]
                ] == ["r1"]
                await stop(d3)
