"""The replica client against the VLLM_API.md contract (httpx.MockTransport), every call
bounded in virtual time, once against the real vLLM stub when it boots, and the serving
half of the turn loop over the same fake under both ``--weight-check`` rules."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.errors import ReplicaError
from gpu_slicer.dispatcher.model import Phase, TurnConfig, TurnState
from gpu_slicer.dispatcher.serve import NO_WEIGHT_VERSIONS_ERROR
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from gpu_slicer.slicer.client import Turn
from stubs.fakegpu import Ledger
from stubs.proc import free_port


def _err(status: int, message: str) -> httpx.Response:
    typ = "BadRequestError" if status == 400 else "InternalServerError"
    return httpx.Response(
        status,
        json={"error": {"message": message, "type": typ, "param": None, "code": status}},
    )


class FakeVllm:
    """The routes of VLLM_API.md with their status codes and bodies, in memory.

    ``weight_versions = False`` plays a vLLM that ignores ``return_weight_versions``
    (0.32); ``on_complete`` runs as each completion arrives (another party relabelling
    the replica, a broken ``/weight_info``); ``weight_info_error`` is that route's status.
    """

    def __init__(self) -> None:
        self.asleep = False
        self.paused = False
        self.version = "default"
        self.loaded_path: str | None = None
        self.update_open = False
        self.fail_reload: str | None = None
        self.weight_versions = True
        self.weight_info_error: int | None = None
        self.on_complete: Callable[[], None] | None = None
        self.calls: list[str] = []
        self.connection: dict[str, set[str | None]] = {}  # path -> Connection headers seen

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(f"{request.method} {path}")
        self.connection.setdefault(path, set()).add(request.headers.get("connection"))
        body: Any = json.loads(request.content) if request.content else None
        q = request.url.params
        route = (request.method, path)
        if route == ("GET", "/health"):
            return httpx.Response(200)
        if route == ("POST", "/sleep"):
            assert q.get("level") in ("0", "1", "2") and q.get("mode") in ("abort", "wait", "keep")
            self.asleep = True
            return httpx.Response(200, json={"status": "sleeping", "level": int(q["level"])})
        if route == ("POST", "/wake_up"):
            self.asleep = self.paused = False
            return httpx.Response(200, json={"status": "awake", "tags": None})
        if route == ("GET", "/is_sleeping"):
            return httpx.Response(200, json={"is_sleeping": self.asleep or self.paused})
        if route == ("GET", "/is_paused"):
            return httpx.Response(200, json={"is_paused": self.asleep or self.paused})
        if route == ("POST", "/resume"):
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if route == ("POST", "/collective_rpc"):
            assert body["method"] == "reload_weights"
            if self.fail_reload:
                return _err(500, f"worker error: {self.fail_reload}")
            self.loaded_path = body["kwargs"]["weights_path"]
            return httpx.Response(200, json={"results": [None]})
        if route == ("POST", "/update_weight_version"):
            self.version = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.version})
        if route == ("POST", "/reset_prefix_cache"):
            return httpx.Response(200, json={"success": True})
        if route == ("GET", "/weight_info"):
            if self.weight_info_error is not None:
                return _err(self.weight_info_error, "weight_info broke")
            return httpx.Response(200, json={"weight_version": self.version})
        if route == ("POST", "/finish_weight_update"):
            if not self.update_open:
                return _err(500, "No weight update in progress")
            self.update_open = False
            return httpx.Response(200, json={"message": "Weight update finished"})
        if route in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            if not isinstance(body.get("max_tokens", 16), int):
                return _err(400, "max_tokens must be an integer")
            choice = {"index": 0, "text": "ab", "finish_reason": "length"}
            if body.get("return_weight_versions") and self.weight_versions:
                choice["weight_versions"] = [{"version": self.version, "start": 0, "end": 2}]
            if self.on_complete is not None:
                self.on_complete()
            return httpx.Response(200, json={"object": "text_completion", "choices": [choice]})
        return httpx.Response(404, json={"detail": "Not Found"})


@pytest.fixture
def fake() -> FakeVllm:
    return FakeVllm()


async def test_turn_cycle(fake: FakeVllm) -> None:
    async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
        assert await r.health()
        assert r.known_version is None
        await r.recover()  # first sight
        assert fake.calls[-1] == "POST /finish_weight_update"  # one bare finish
        assert fake.calls.count("POST /finish_weight_update") == 1
        await r.wake()
        assert not await r.is_sleeping() and not await r.is_paused()
        assert await r.weight_version() == "default"
        epoch = r.epoch
        await r.load("r1", "/ckpt/r1")
        assert r.epoch == epoch + 1 and r.known_version == "r1"
        assert (fake.version, fake.loaded_path) == ("r1", "/ckpt/r1")
        out = await r.complete(
            "completion", {"prompt": [1], "return_weight_versions": True}, timeout=60
        )
        assert out["choices"][0]["weight_versions"][0]["version"] == "r1"
        chat = await r.complete("chat", {"messages": []}, timeout=60)
        assert chat["choices"][0]["text"] == "ab"
        await r.sleep()
        assert r.epoch == epoch + 2 and fake.asleep and await r.is_sleeping()
        assert r.known_version == "r1"  # level 1 keeps the weights
        await r.sleep(level=2, mode="wait")
        assert r.known_version is None
        # Real vLLM resets a connection after an unhandled 500 (the bare finish of every
        # recovery): control calls never reuse one; only generations keep theirs.
        gen = ("/v1/completions", "/v1/chat/completions")
        assert {p for p, h in fake.connection.items() if h != {"close"}} == set(gen)
        assert all(fake.connection[p] == {"keep-alive"} for p in gen), fake.connection


async def test_recover_closes_an_open_update_and_never_resumes(fake: FakeVllm) -> None:
    fake.asleep = fake.update_open = True  # a slept replica reads as paused too
    async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
        r.known_version = "r1"
        await r.recover()
        assert not fake.update_open and r.known_version is None
        # No /resume: on a slept vLLM it would schedule on offloaded weights.
        assert fake.calls == ["POST /finish_weight_update"] and fake.asleep
        assert await r.finish_open_update() is False  # the 500 "no update open"
        fake.asleep, fake.paused = False, True
        await r.wake()  # the turn's wake ends a pause
        assert not fake.paused


async def test_errors_carry_status_and_vllm_message(fake: FakeVllm) -> None:
    async with Replica("http://vllm", transport=httpx.MockTransport(fake)) as r:
        with pytest.raises(ReplicaError, match="HTTP 400: max_tokens must be an integer") as e:
            await r.complete("completion", {"max_tokens": "x"}, timeout=5)
        assert e.value.status == 400
        fake.fail_reload = "FileNotFoundError: /ckpt/r9/model.safetensors"
        with pytest.raises(ReplicaError, match="HTTP 500: worker error: FileNotFoundError") as e:
            await r.load("r9", "/ckpt/r9")
        assert e.value.status == 500 and r.known_version is None
        with pytest.raises(ValueError):
            await r.sleep(level=3)
        with pytest.raises(ValueError):
            await r.complete("embedding", {}, timeout=5)


async def test_load_checks_weight_info_and_cache_reset() -> None:
    def lying(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "stale"})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={})

    async with Replica("http://vllm", transport=httpx.MockTransport(lying)) as r:
        with pytest.raises(ReplicaError, match="/weight_info says 'stale'"):
            await r.load("r1", "/ckpt/r1")
        assert r.known_version is None

    def no_reset(request: httpx.Request) -> httpx.Response:
        ok = request.url.path != "/reset_prefix_cache"
        return httpx.Response(200, json={"success": ok, "weight_version": "r1"})

    async with Replica("http://vllm", transport=httpx.MockTransport(no_reset)) as r:
        with pytest.raises(ReplicaError, match="cache was not reset"):
            await r.load("r1", "/ckpt/r1")


async def test_malformed_and_unreachable() -> None:
    def garbage(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>")

    async with Replica("http://vllm", transport=httpx.MockTransport(garbage)) as r:
        with pytest.raises(ReplicaError, match="expected a JSON object") as e:
            await r.weight_version()
        assert e.value.status is None

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    async with Replica("http://vllm", transport=httpx.MockTransport(refused)) as r:
        assert await r.health() is False
        with pytest.raises(ReplicaError, match="ConnectError: Connection refused"):
            await r.wake()


async def _hang(request: httpx.Request) -> httpx.Response:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


_BOUNDED: list[tuple[str, float]] = [
    ("wake", 300),
    ("sleep", 300),
    ("is_sleeping", 30),
    ("is_paused", 30),
    ("weight_version", 30),
    ("load", 1800),
    ("finish_open_update", 30),
    ("recover", 30),
    ("complete", 120),
]


@pytest.mark.parametrize(("call", "bound"), _BOUNDED)
async def test_every_call_is_bounded(autojump_clock: Any, call: str, bound: float) -> None:
    async with Replica("http://vllm", transport=httpx.MockTransport(_hang)) as r:
        start = trio.current_time()
        with pytest.raises(ReplicaError, match=f"within {bound:g} s") as e:
            if call == "load":
                await r.load("r1", "/ckpt/r1")
            elif call == "complete":
                await r.complete("completion", {"prompt": [1]}, timeout=120)
            else:
                await getattr(r, call)()
        assert trio.current_time() - start == pytest.approx(bound)
        assert e.value.status is None


async def test_health_is_bounded_and_false(autojump_clock: Any) -> None:
    async with Replica("http://vllm", transport=httpx.MockTransport(_hang)) as r:
        start = trio.current_time()
        assert await r.health(timeout=10) is False
        assert trio.current_time() - start == pytest.approx(10)


async def test_load_is_bounded_as_a_whole(autojump_clock: Any) -> None:
    """Each step answers in 400 s, below the bound, yet the sequence stops at 1000 s."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await trio.sleep(400)
        return httpx.Response(200, json={"success": True, "weight_version": "r1"})

    async with Replica("http://vllm", transport=httpx.MockTransport(slow)) as r:
        start = trio.current_time()
        with pytest.raises(ReplicaError, match="not done within 1000 s"):
            await r.load("r1", "/ckpt/r1", timeout=1000)
        assert trio.current_time() - start == pytest.approx(1000)
        assert r.known_version is None


# -- serving under both --weight-check rules -------------------------------------------


@asynccontextmanager
async def _loop(tmp_path: Path, fake: FakeVllm, weight_check: str) -> AsyncIterator[TurnLoop]:
    """:func:`held_loop` over ``fake`` with ``weight_check``."""
    async with held_loop(tmp_path, fake, weight_check=weight_check) as loop:
        yield loop


@asynccontextmanager
async def held_loop(
    tmp_path: Path, handler: Callable[[httpx.Request], httpx.Response], **cfg: Any
) -> AsyncIterator[TurnLoop]:
    """A turn loop (never run: tests drive its Serving) over the vLLM ``handler``, holding
    a turn (woken), with revision r1 published; ``cfg``: TurnConfig fields."""
    store = Store(tmp_path / "state", "pool-a")
    try:
        async with Replica("http://vllm", transport=httpx.MockTransport(handler)) as r:
            loop = TurnLoop(store, r, TurnConfig(workload="v", turn_seconds=5, **cfg))
            ckpt = tmp_path / "ckpt" / "r1"
            ckpt.mkdir(parents=True)
            (ckpt / "revision.txt").write_text("r1")
            loop.publish("r1", str(ckpt))
            loop._current = TurnState(Turn("v", 1, False, 0))
            loop._enter(Phase.ACQUIRING)
            loop._enter(Phase.WAKING)
            yield loop
    finally:
        store.close()


def _choices(loop: TurnLoop, id: str) -> list[dict[str, Any]]:
    result = loop.store.get(id)
    assert result.status == "done" and result.body is not None
    choices: list[dict[str, Any]] = result.body["choices"]
    return choices


async def test_label_mode_commits_without_weight_versions(tmp_path: Path, fake: FakeVllm) -> None:
    """vLLM 0.32 returns no weight_versions; /weight_info names the revision: commit,
    storing the body as vLLM returned it."""
    fake.weight_versions = False
    async with _loop(tmp_path, fake, "label") as loop:
        assert loop.status()["weight_check"] == "label"
        ids = [(await loop.accept("completion", {"prompt": [1, 2], "max_tokens": 2})).id
               for _ in range(3)]  # fmt: skip
        with trio.fail_after(10):
            assert loop._current is not None
            assert await loop.serving.serve(loop._current) == "idle"
        for id in ids:
            assert _choices(loop, id) == [{"index": 0, "text": "ab", "finish_reason": "length"}]
        assert loop.counters.commits == 3 and not loop.counters.rejects
        sent = [i for i, c in enumerate(fake.calls) if c == "POST /v1/completions"]
        assert len(sent) == 3
        # Each response is followed, in its send, by one check of the label.
        assert fake.calls.count("GET /weight_info") == 1 + 3  # the load's own, then one each


async def test_label_mode_refuses_another_label(
    tmp_path: Path, fake: FakeVllm, autojump_clock: Any
) -> None:
    """The label changes under the request (someone else relabelled the replica): no
    commit for a whole turn, the request stays pending; once the label is right, commit."""
    fake.weight_versions = False
    async with _loop(tmp_path, fake, "label") as loop:
        p = await loop.accept("completion", {"prompt": [1, 2], "max_tokens": 2})
        fake.on_complete = lambda: setattr(fake, "version", "r0")
        cur = loop._current
        assert cur is not None
        cur.waiting_seen_at = trio.current_time()  # the turn ends after turn_seconds
        with trio.fail_after(60):
            assert await loop.serving.serve(cur) == "waiting"
        assert loop.store.is_pending(p.id) and loop.counters.commits == 0
        assert loop.counters.rejects["weight_label"] >= 2
        assert set(loop.counters.rejects) == {"weight_label"}
        # The same request, sent again once the label is back to r1: committed.
        fake.on_complete = None
        fake.version = "r1"
        with trio.fail_after(10):
            await loop.serving._sender._send(
                loop._current, p, trio.CancelScope(), loop.replica.epoch
            )
        assert _choices(loop, p.id)[0]["text"] == "ab"
        assert "weight_versions" not in _choices(loop, p.id)[0]  # never fabricated


async def test_label_mode_epoch_and_abort_still_refuse(tmp_path: Path, fake: FakeVllm) -> None:
    fake.weight_versions = False
    async with _loop(tmp_path, fake, "label") as loop:
        await loop.replica.load("r1", "/ckpt/r1")
        p = await loop.accept("completion", {"prompt": [1], "max_tokens": 2})
        fake.on_complete = lambda: setattr(loop.replica, "epoch", loop.replica.epoch + 1)
        with trio.fail_after(10):
            await loop.serving._sender._send(
                loop._current, p, trio.CancelScope(), loop.replica.epoch
            )
        assert loop.store.is_pending(p.id) and loop.counters.rejects == {"epoch": 1}


async def test_label_mode_failed_weight_info_is_a_failed_send(
    tmp_path: Path, fake: FakeVllm
) -> None:
    """A 5xx from /weight_info: no commit, the request stays pending (never failed, even
    on a 400), the replica counts as failed."""
    fake.weight_versions = False
    async with _loop(tmp_path, fake, "label") as loop:
        await loop.replica.load("r1", "/ckpt/r1")
        p = await loop.accept("completion", {"prompt": [1], "max_tokens": 2})
        fake.on_complete = lambda: setattr(fake, "weight_info_error", 500)
        with trio.fail_after(10):
            await loop.serving._sender._send(
                loop._current, p, trio.CancelScope(), loop.replica.epoch
            )
        assert loop.store.is_pending(p.id) and loop.counters.rejects == {"error": 1}
        assert loop._current is not None and loop._current.replica_failed
        assert "/weight_info: HTTP 500" in loop._current.replica_failed
        loop._current.replica_failed = None
        fake.on_complete = lambda: setattr(fake, "weight_info_error", 400)
        with trio.fail_after(10):
            await loop.serving._sender._send(
                loop._current, p, trio.CancelScope(), loop.replica.epoch
            )
        assert loop.store.is_pending(p.id) and loop.counters.refused_by_replica == 0
        assert loop._current.replica_failed is None  # a 4xx is no dead replica


async def test_spans_mode_against_an_old_vllm_says_so_once(
    tmp_path: Path, fake: FakeVllm, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The default rule against vLLM 0.32: nothing commits, every refusal is counted as
    no_weight_versions, and the cause and fix are logged once, not per request."""
    fake.weight_versions = False
    caplog.set_level(logging.WARNING, logger="dispatcher.serve")
    async with _loop(tmp_path, fake, "spans") as loop:
        assert loop.status()["weight_check"] == "spans"
        ids = [(await loop.accept("completion", {"prompt": [1], "max_tokens": 2})).id
               for _ in range(2)]  # fmt: skip
        cur = loop._current
        assert cur is not None
        cur.waiting_seen_at = trio.current_time()
        with trio.fail_after(60):
            assert await loop.serving.serve(cur) == "waiting"
        assert all(loop.store.is_pending(id) for id in ids) and loop.counters.commits == 0
        assert set(loop.counters.rejects) == {"no_weight_versions"}
        assert loop.counters.rejects["no_weight_versions"] >= 4  # both, retried
        assert "GET /weight_info" not in fake.calls[fake.calls.index("POST /v1/completions") :]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [NO_WEIGHT_VERSIONS_ERROR]
    assert "--weight-check label" in NO_WEIGHT_VERSIONS_ERROR


async def test_spans_mode_with_weight_versions_commits(tmp_path: Path, fake: FakeVllm) -> None:
    async with _loop(tmp_path, fake, "spans") as loop:
        p = await loop.accept("completion", {"prompt": [1], "max_tokens": 2})
        with trio.fail_after(10):
            assert loop._current is not None
            assert await loop.serving.serve(loop._current) == "idle"
        assert _choices(loop, p.id)[0]["weight_versions"][0]["version"] == "r1"
        assert loop.counters.commits == 1 and not loop.counters.rejects


def test_weight_check_is_validated() -> None:
    with pytest.raises(ValueError, match="weight_check must be one of"):
        TurnConfig(workload="v", weight_check="trust")


# -- against the real stub ------------------------------------------------------------


@pytest.fixture
def vllm_stub(tmp_path: Path) -> Iterator[str]:
    # The stub is this repository's own: a stub that dies or hangs at boot fails the test.
    gpu_dir = tmp_path / "gpu"
    Ledger.init(gpu_dir, 1, 80 << 30)
    port = free_port()
    env = {**os.environ, "FAKEGPU_DIR": str(gpu_dir), "VLLM_SERVER_DEV_MODE": "1"}
    log_path = tmp_path / "stub.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stubs.vllm_stub", "serve", "m", "--port", str(port),
         "--enable-sleep-mode"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the vLLM stub exited {proc.returncode} at boot:\n{log_path.read_text()}"
                )
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM stub was not healthy within 30 s:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.integration
async def test_against_vllm_stub(vllm_stub: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt-r7"
    ckpt.mkdir()
    (ckpt / "revision.txt").write_text("r7\n")
    async with Replica(vllm_stub) as r:
        assert await r.health()
        await r.recover()
        await r.sleep()
        assert await r.is_sleeping()
        await r.wake()
        assert not await r.is_sleeping()
        await r.load("r7", str(ckpt), timeout=60)
        assert await r.weight_version() == "r7" and r.known_version == "r7"
        out = await r.complete(
            "completion",
            {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "return_weight_versions": True},
            timeout=60,
        )
        spans = out["choices"][0]["weight_versions"]
        assert spans and all(s["version"] == "r7" for s in spans)
        chat = await r.complete(
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
             "return_weight_versions": True},
            timeout=60,
        )  # fmt: skip
        assert chat["choices"][0]["weight_versions"][0]["version"] == "r7"
        await r.sleep()
        assert await r.is_sleeping()


@pytest.mark.parametrize(
    ("state", "label", "kept"),
    [
        ("weights_offloaded", "r1", True),  # level 1 (ours or the launcher's): weights kept
        ("discard_all", "r1", False),  # level 2 by the launcher: the label outlives them
        ("weights_offloaded", "other", False),  # relabelled: not the weights we loaded
        (None, "r1", False),  # an unreadable sleep state proves nothing
    ],
)
async def test_a_failed_sleep_leaves_the_replica_unknown_until_settle_reads_it(
    fake: FakeVllm, state: str | None, label: str, kept: bool
) -> None:
    def route(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/sleep" and not fake.asleep:
            fake.asleep = True  # it acted, then the answer was lost (a reset, a timeout)
            raise httpx.ReadError("connection reset", request=request)
        if path == "/metrics":
            if state is None:
                return httpx.Response(404)
            lines = [
                f'vllm:engine_sleep_state{{engine="0",sleep_state="{s}"}} '
                f"{1.0 if s == state else 0.0}"
                for s in ("awake", "weights_offloaded", "discard_all")
            ]
            return httpx.Response(200, text="\n".join(lines) + "\n")
        return fake(request)

    async with Replica("http://vllm", transport=httpx.MockTransport(route)) as r:
        await r.wake()
        await r.load("r1", "/ckpt/r1")
        fake.version = label
        with pytest.raises(ReplicaError):
            await r.sleep(level=1)
        # Never "asleep with its weights kept": unknown, and nothing claimed of it.
        assert r.unknown and not r.awake and r.known_version == "r1"
        found = await r.settle(5)
        assert not r.unknown and not r.awake, found
        assert (r.known_version == "r1") is kept, found
        # Not proven: the next wake goes in the level-2 order and loads whole.
        assert r.dropped is (not kept), found
