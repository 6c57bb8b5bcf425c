"""`slicer-dispatch` end to end: real slicerd (fake GPU), the vLLM stub under the real
launcher, a trainer stub, and the dispatcher as a subprocess.

Every wait is event-driven and bounded: HTTP long-polls, WATCH-driven `stack.until`,
lines the processes print, process exits, all under `trio.fail_after`.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from tests.harness import Stack, running_stack, workload
from tests.procs import Proc, free_port, spawn

pytestmark = pytest.mark.integration


def replica_argv(stack: Stack, port: int, park: str, *stub: str, model: str = "m") -> list[str]:
    """The launcher running the vLLM stub as workload "v" on `port` (`stub`: its flags),
    serving `model` (a name, or a checkpoint directory)."""
    argv = [sys.executable, "-m", "gpu_slicer.launcher.main", "vllm", "--workload", "v"]
    argv += ["--socket", stack.socket, "--park", park, "--ready-file", str(stack.base / "ready")]
    argv += ["--", sys.executable, "-m", "stubs.vllm_stub", "serve", model, "--port", str(port)]
    return [*argv, "--fake-workload", "v", "--tokens-per-s", "20000", *stub]


@asynccontextmanager
async def replica(
    stack: Stack,
    park: str = "cooperative",
    *stub: str,
    port: int | None = None,
    model: str = "m",
) -> AsyncIterator[tuple[Proc, str]]:
    """The vLLM stub as workload "v" under the launcher, ready (booted, slept, released)."""
    port = port or free_port()
    argv = replica_argv(stack, port, park, *stub, model=model)
    async with spawn(stack, "launcher", argv) as lw:
        await lw.line(lambda s: "]: ready" in s)
        yield lw, f"http://127.0.0.1:{port}"
        lw.proc.send_signal(signal.SIGTERM)  # the launcher stops the replica cleanly
        assert await lw.wait() == 0, lw.output()


@asynccontextmanager
async def dispatcher(
    stack: Stack, url: str, *flags: str, state: str = "dstate", name: str = "dispatcher"
) -> AsyncIterator[tuple[Proc, httpx.AsyncClient]]:
    """`slicer-dispatch` for workload "v" with its state in `stack.base / state` (its
    output named `name`)."""
    port = free_port()
    argv = [sys.executable, "-m", "gpu_slicer.dispatcher.main", "--workload", "v", "--replica", url]
    argv += ["--socket", stack.socket, "--state-dir", str(stack.base / state)]
    argv += ["--listen", f"127.0.0.1:{port}", *flags]
    async with (
        spawn(stack, name, argv) as d,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http,
    ):
        await d.line(lambda s: s.startswith("listening on"))
        yield d, http


def trainer(stack: Stack, steps: int, work: float) -> list[str]:
    """The trainer stub's command line (30 GiB working set, checkpoint-parked)."""
    argv = [sys.executable, "-m", "stubs.trainer_stub", "--workload", "trainer"]
    argv += ["--socket", stack.socket, "--bytes", "30GiB", "--work", str(work)]
    return [*argv, "--steps", str(steps)]


async def publish(stack: Stack, http: httpx.AsyncClient, rev: str) -> None:
    """Save "weights" of `rev` (a dir with revision.txt) and publish them."""
    path = stack.base / "ckpt" / rev
    path.mkdir(parents=True)
    (path / "revision.txt").write_text(rev)
    r = await http.post("/v1/revisions", json={"revision": rev, "path": str(path)})
    assert r.status_code == 201, r.text


async def result_of(http: httpx.AsyncClient, sid: str, timeout: float = 60) -> dict[str, Any]:
    """Long-poll sample `sid` until it is finished (bounded)."""
    with trio.fail_after(timeout):
        while True:
            r = await http.get(f"/v1/samples/{sid}", params={"wait": 10})
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            if body["status"] != "pending":
                return body


def versions(result: dict[str, Any]) -> set[str]:
    """Every weight version named by any span of any choice."""
    return {s["version"] for c in result["choices"] for s in c["weight_versions"]}


async def status(http: httpx.AsyncClient) -> dict[str, Any]:
    """The dispatcher's /status."""
    r = await http.get("/status")
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


async def accepted(http: httpx.AsyncClient, n: int) -> None:
    """Return once the dispatcher has accepted `n` requests in all (bounded by the caller).
    A direct request's POST answers only when it is served, and nothing announces its
    accept, so /status is read every 10 ms."""
    while sum((await status(http))["counts"].values()) < n:
        await trio.sleep(0.01)


async def stop(d: Proc) -> None:
    """SIGTERM the dispatcher; it must exit 0."""
    d.proc.send_signal(signal.SIGTERM)
    assert await d.wait() == 0, d.output()


async def test_revisions_and_a_trainer_alternate_every_result_from_its_weights() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack, replica(stack) as (_, url):
            flags = ["--turn-seconds", "0.3", "--turn-grace", "2", "--concurrency", "8"]
            async with (
                dispatcher(stack, url, *flags) as (d, http),
                spawn(stack, "trainer", trainer(stack, 1000, 0.05)) as tr,
            ):
                # The trainer holds the GPU before any work arrives (a slow start must not
                # let every request be served before its first turn): then serving them
                # parks it.
                await stack.until(lambda st: (workload(st, "trainer") or {}).get("grants", 0) > 0)
                expected: dict[int, str] = {}
                results: dict[int, dict[str, Any]] = {}
                sample_ids: dict[int, str] = {}

                async def direct(i: int, body: dict[str, Any]) -> None:
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    results[i] = r.json()

                async with trio.open_nursery() as n:
                    i = 0
                    for rev in ("r1", "r2", "r3"):
                        # An unpinned request takes the revision newest when it is accepted:
                        # the last round's direct POSTs must be in before the next publish.
                        await accepted(http, i)
                        await publish(stack, http, rev)
                        for k in range(20):
                            body: dict[str, Any] = {"prompt": f"q{i}", "max_tokens": 4}
                            if k % 4 == 1:
                                body["revision"] = "r1"  # pinned to an older revision
                            elif k % 4 == 2:
                                body["model"] = f"m@{rev}"
                            expected[i] = body.get("revision", rev)
                            if k % 2:
                                r = await http.post("/v1/samples", json=body)
                                assert r.status_code == 202, r.text
                                sample_ids[i] = r.json()["id"]
                            else:
                                n.start_soon(direct, i, body)
                            i += 1
                for i, sid in sample_ids.items():
                    got = await result_of(http, sid)
                    assert got["status"] == "done", got
                    assert got["revision"] == expected[i]
                    results[i] = got["result"]
                assert len(results) == 60
                for i, res in results.items():
                    assert versions(res) == {expected[i]}, (i, res)
                # stream: true gives the whole result as SSE chunks, then [DONE]
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                r = await http.post("/v1/chat/completions", json={**body, "stream": True})
                assert r.status_code == 200 and r.headers["x-sample-id"].startswith("smp-")
                events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
                assert events[-1] == "data: [DONE]" and len(events) == 2, r.text
                chunk = json.loads(events[0].removeprefix("data: "))
                assert chunk["object"] == "chat.completion.chunk"
                assert chunk["choices"][0]["delta"]["content"]
                assert {s["version"] for s in chunk["choices"][0]["weight_versions"]} == {"r3"}
                st = await status(http)
                assert st["counts"] == {"pending": 0, "done": 61, "failed": 0}
                assert st["counters"]["loads"] >= 3
                assert st["counters"]["turns"] >= 2
                text = (await http.get("/metrics")).text
                assert 'slicer_dispatch_commits_total{pool="v"} 61' in text
                t = workload(await stack.status(), "trainer")
                assert t is not None and t["parks"] >= 1  # it held the GPU between our turns
                await stop(d)
                assert tr.proc.returncode is None  # the trainer still takes turns
            assert stack.overlaps() == 0


async def test_sigkill_mid_turn_parks_the_replica_and_a_restart_serves_everything() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack, park="checkpoint") as (_, url):
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            async with fault, dispatcher(stack, url) as (d, http):
                await publish(stack, http, "r1")
                await fault.post("/_stub/fault", json={"hang_requests": True})
                ids = []
                for i in range(5):
                    r = await http.post("/v1/samples", json={"prompt": f"k{i}", "max_tokens": 4})
                    ids.append(r.json()["id"])
                await d.line(lambda s: "serving revision r1" in s)
                async with spawn(stack, "trainer", trainer(stack, 1, 1.5)) as tr:
                    await d.line(lambda s: "WAITING" in s)
                    d.proc.kill()
                    assert await d.wait() == -signal.SIGKILL

                    def trainer_after_park(st: dict[str, Any]) -> bool:
                        t, v = workload(st, "trainer"), workload(st, "v")
                        return bool(t and v and t["state"] == "active" and v["state"] == "parked")

                    await stack.until(trainer_after_park)
                    await fault.post("/_stub/fault", json={"hang_requests": False})
                    assert await tr.wait() == 0
                async with dispatcher(stack, url) as (d2, http2):
                    for sid in ids:
                        got = await result_of(http2, sid)
                        assert got["status"] == "done", got
                        assert versions(got["result"]) == {"r1"}
                    assert (await status(http2))["counts"]["pending"] == 0
                    await stop(d2)
            assert stack.overlaps() == 0


async def test_a_hung_generate_ends_the_turn_at_turn_seconds_plus_grace() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            flags = ["--turn-seconds", "1", "--turn-grace", "1"]
            async with fault, dispatcher(stack, url, *flags) as (d, http):
                await publish(stack, http, "r1")
                await fault.post("/_stub/fault", json={"hang_requests": True})
                r = await http.post("/v1/samples", json={"prompt": "hang", "max_tokens": 4})
                sid = r.json()["id"]
                await d.line(lambda s: "serving revision r1" in s)
                async with spawn(stack, "trainer", trainer(stack, 1, 0.5)) as tr:
                    t0 = time.monotonic()

                    def trainer_active(st: dict[str, Any]) -> bool:
                        t = workload(st, "trainer")
                        return t is not None and t["state"] == "active"

                    await stack.until(trainer_active)
                    waited = time.monotonic() - t0
                    # turn_seconds (counted from serving, which began earlier) + grace,
                    # plus sleep, release, park and restore on the fake GPU
                    assert waited < 1 + 1 + 1.5, waited
                    assert any("cancelling 1 send(s)" in s for s in d.lines), d.output()
                    assert (await http.get(f"/v1/samples/{sid}?wait=0")).json()["status"] == (
                        "pending"
                    )
                    await fault.post("/_stub/fault", json={"hang_requests": False})
                    assert await tr.wait() == 0
                got = await result_of(http, sid)
                assert got["status"] == "done" and versions(got["result"]) == {"r1"}
                print(f"hung turn handed over {waited:.2f} s after the trainer asked")
                await stop(d)
            assert stack.overlaps() == 0


async def test_a_request_past_its_deadline_fails_naming_pool_and_revision() -> None:
    with trio.fail_after(30):
        async with running_stack() as stack, replica(stack) as (_, url):
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            async with fault, dispatcher(stack, url, "--sample-deadline", "2") as (d, http):
                await publish(stack, http, "r1")
                await fault.post("/_stub/fault", json={"hang_requests": True})
                t0 = time.monotonic()
                r = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 4})
                assert 2 <= time.monotonic() - t0 < 4.5
                assert r.status_code == 504, r.text
                err = r.json()["error"]
                assert "deadline exceeded: pool v revision r1" in err["message"], err
                assert err["code"] == "deadline_exceeded"
                await d.line(lambda s: "released (idle)" in s)  # its send was cancelled
                st = await status(http)
                assert st["counts"]["failed"] == 1 and st["in_flight"] == 0
                assert st["counters"]["expired"] == 1
                await fault.post("/_stub/fault", json={"hang_requests": False})
                await stop(d)
            assert stack.overlaps() == 0


BAD: list[tuple[str, str, Any, int, str]] = [
    ("/v1/completions", "malformed", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", "not an object", [1, 2], 400, "must be a JSON object"),
    ("/v1/completions", "unknown revision", {"prompt": "x", "revision": "nope"}, 404,
     "'nope' is not published"),
    ("/v1/completions", "unknown model rev", {"prompt": "x", "model": "m@r9"}, 404,
     "'r9' is not published"),
    ("/v1/completions", "oversized prompt", {"prompt": list(range(40000))}, 400,
     "more than the limit"),
    ("/v1/completions", "missing prompt", {"max_tokens": 4}, 400, "missing field 'prompt'"),
    ("/v1/chat/completions", "missing messages", {"prompt": "x"}, 400, "not a field"),
    ("/v1/completions", "bad max_tokens", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/samples", "bad kind", {"kind": "embed", "prompt": "x"}, 400, "kind must be"),
    ("/v1/revisions", "missing path", {"revision": "r2"}, 400, "missing field 'path'"),
    ("/v1/revisions", "bad name", {"revision": "../x", "path": "/tmp"}, 400, "must match"),
]  # fmt: skip


async def test_bad_input_is_refused_with_a_clear_message_and_never_journaled() -> None:
    with trio.fail_after(30):
        async with running_stack() as stack:
            # nothing is accepted, so the loop never touches the (absent) replica
            async with dispatcher(stack, "http://127.0.0.1:9") as (d, http):
                await publish(stack, http, "r1")
                before = (await status(http))["counts"]
                for path, what, body, code, text in BAD:
                    if isinstance(body, bytes):
                        r = await http.post(path, content=body)
                    else:
                        r = await http.post(path, json=body)
                    assert r.status_code == code, (what, r.status_code, r.text)
                    err = r.json()["error"]
                    assert text in err["message"], (what, err)
                    assert err["type"] and err["code"], (what, err)
                r = await http.get("/v1/samples/smp-nope")
                assert r.status_code == 404 and "no sample" in r.json()["error"]["message"]
                r = await http.get("/v1/samples/smp-nope?wait=abc")
                assert r.status_code == 400
                assert (await status(http))["counts"] == before
                await stop(d)
            assert stack.overlaps() == 0


def stub_reloads(lw: Proc, rev: str) -> int:
    """How many times the stub under launcher `lw` finished reloading checkpoint `rev`."""
    return sum(f"/ckpt/{rev} (identity={rev})" in s for s in lw.lines)


async def test_a_replica_crash_mid_turn_keeps_requests_until_a_new_replica_serves_them() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            async with fault, dispatcher(stack, url) as (d, http):
                await publish(stack, http, "r1")
                async with spawn(stack, "launcher", replica_argv(stack, port, "cooperative")) as lw:
                    await lw.line(lambda s: "]: ready" in s)
                    r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
                    assert r.status_code == 200 and versions(r.json()) == {"r1"}, r.text
                    await publish(stack, http, "r2")
                    await fault.post("/_stub/fault", json={"hang_requests": True})
                    mark = len(d.lines)
                    ids: dict[str, str] = {}
                    for i in range(8):
                        rev = ("r1", "r2")[i % 2]
                        body = {"prompt": f"c{i}", "max_tokens": 4, "revision": rev}
                        r = await http.post("/v1/samples", json=body)
                        assert r.status_code == 202, r.text
                        ids[r.json()["id"]] = rev
                    await d.line(lambda s: "serving revision r1" in s, mark)
                    st = await status(http)
                    assert st["in_flight"] == 4, st  # the r1 requests hang in the replica
                    r = await fault.post("/_stub/fault", json={"crash": True})
                    assert r.status_code == 200, r.text
                    # Its child died (vLLM then exits 0, so does the launcher, with the
                    # child's code; systemd restarts it: Restart=always).
                    assert await lw.wait() == 0, lw.output()
                await d.line(lambda s: "released" in s or "RELEASE failed" in s, mark)
                st = await status(http)
                assert st["counts"]["pending"] == 8 and st["in_flight"] == 0, st
                for sid in ids:
                    r = await http.get(f"/v1/samples/{sid}", params={"wait": 0})
                    assert r.json()["status"] == "pending", r.text
                # the same workload name and port: a new replica (fresh weights, no hang)
                async with replica(stack, port=port) as (lw2, _):
                    for sid, rev in ids.items():
                        got = await result_of(http, sid)
                        assert got["status"] == "done" and got["revision"] == rev, got
                        assert versions(got["result"]) == {rev}, got
                    # the new replica got each revision as a whole load
                    assert stub_reloads(lw2, "r1") >= 1 and stub_reloads(lw2, "r2") >= 1
                    st = await status(http)
                    assert st["counts"] == {"pending": 0, "done": 9, "failed": 0}, st
                    await stop(d)
            assert stack.overlaps() == 0


async def test_sigkill_during_a_load_parks_the_replica_and_a_restart_loads_it_whole() -> None:
    with trio.fail_after(90):
        slow = ("--reload-seconds", "5")  # the kill lands inside the load
        async with (
            running_stack() as stack,
            replica(stack, "checkpoint", *slow) as (lw, url),
            dispatcher(stack, url) as (d, http),
        ):
            await publish(stack, http, "r1")
            ids = []
            for i in range(5):
                r = await http.post("/v1/samples", json={"prompt": f"l{i}", "max_tokens": 4})
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            await d.line(lambda s: "loading revision r1" in s)
            async with spawn(stack, "trainer", trainer(stack, 1, 0.5)) as tr:
                await d.line(lambda s: "WAITING" in s)  # the trainer asked, mid-load
                d.proc.kill()
                assert await d.wait() == -signal.SIGKILL
                assert not any("loaded revision" in s for s in d.lines), d.output()
                assert stub_reloads(lw, "r1") == 0  # the stub is still inside that load

                def trainer_after_park(st: dict[str, Any]) -> bool:
                    t, v = workload(st, "trainer"), workload(st, "v")
                    return bool(t and v and t["state"] == "active" and v["state"] == "parked")

                await stack.until(trainer_after_park)
                assert await tr.wait() == 0
            async with dispatcher(stack, url) as (d2, http2):
                for sid in ids:
                    got = await result_of(http2, sid)
                    assert got["status"] == "done" and versions(got["result"]) == {"r1"}, got
                # recovery (resume / one bare finish), then a full load in the new turn
                assert any("recovered the replica" in s for s in d2.lines), d2.output()
                assert any("loaded revision r1" in s for s in d2.lines), d2.output()
                assert (await status(http2))["counts"] == {"pending": 0, "done": 5, "failed": 0}
                await stop(d2)
            assert stack.overlaps() == 0
