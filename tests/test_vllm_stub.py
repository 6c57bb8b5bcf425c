"""The vLLM stub against VLLM_API.md: a contract table plus behaviour tests.

Every test starts the stub as a real subprocess (``python -m stubs.vllm_stub serve``)
on a free port with a fresh fake GPU ledger and kills it afterwards.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from stubs.fakegpu import Ledger, parse_size
from stubs.proc import free_port

pytestmark = pytest.mark.integration

GiB = 1024**3
MiB = 1024**2
MODEL = "test/model"
WEIGHTS, CONTEXT = 2 * GiB, 512 * MiB
KV = int(0.9 * 80 * GiB) - WEIGHTS - CONTEXT
BOOT_TIMEOUT_S = 15.0
POLL_S = 0.05


def tag_bytes(directory: Path, pid: int) -> dict[str, int]:
    """The on-device bytes per tag of ``pid`` (read straight from the ledger's table)."""
    con = sqlite3.connect(directory / "ledger.db")
    try:
        rows = con.execute(
            "SELECT tag, nbytes FROM mem WHERE pid = ? AND on_device = 1", (pid,)
        ).fetchall()
    finally:
        con.close()
    return {str(t): int(n) for t, n in rows}


async def until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    """Poll ``predicate`` (plain or async) until it holds, failing after ``timeout``."""
    with trio.fail_after(timeout):
        while True:
            ok = predicate()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            await trio.sleep(POLL_S)


def ignores(pid: int, signum: int) -> bool:
    """Whether ``pid`` ignores ``signum`` (the SigIgn mask of /proc/PID/status): the kernel
    discards such a signal when it is sent, so no waiting shows more than this does."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigIgn line in /proc/{pid}/status")


async def running_requests(stub: Stub, n: int) -> bool:
    """Whether the stub reports ``n`` requests past its gate (``num_requests_running``)."""
    return await stub.metric("vllm:num_requests_running") == n


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Stub:
    """A running stub: its process, URL, HTTP client and log."""

    def __init__(self, proc: trio.Process, port: int, log: Path, client: httpx.AsyncClient):
        self.proc = proc
        self.port = port
        self.log = log
        self.http = client

    def core_pid(self) -> int:
        children = psutil.Process(self.proc.pid).children()
        assert len(children) == 1, children
        return children[0].pid

    async def metric(self, name: str, sleep_state: str | None = None) -> float:
        """A sample of /metrics by name (and ``sleep_state`` label)."""
        text = (await self.http.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + "{") and (
                sleep_state is None or f'sleep_state="{sleep_state}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {sleep_state} not in metrics:\n{text}")

    async def complete(self, prompt: str = "hello world", **body: Any) -> dict[str, Any]:
        r = await self.http.post("/v1/completions", json={"prompt": prompt, **body})
        assert r.status_code == 200, r.text
        return dict(r.json())


def _env(ledger_dir: Path, dev: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SERVER_DEV_MODE",)}
    env.update(FAKEGPU_DIR=str(ledger_dir), PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("FAKEGPU_WORKLOAD", None)
    if dev:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


@asynccontextmanager
async def start_stub(
    tmp_path: Path, *args: str, dev: bool = True, wait: bool = True
) -> AsyncIterator[Stub]:
    port = free_port()
    log = tmp_path / f"stub-{port}.log"
    cmd = [sys.executable, "-m", "stubs.vllm_stub", "serve", MODEL, "--port", str(port)]
    with open(log, "wb") as logf:
        proc = await trio.lowlevel.open_process(
            [*cmd, *args], env=_env(tmp_path / "gpu", dev), stderr=logf
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            stub = Stub(proc, port, log, client)
            if wait:
                await wait_healthy(stub)
            yield stub
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def wait_healthy(stub: Stub) -> None:
    with trio.fail_after(BOOT_TIMEOUT_S):
        while True:
            assert stub.proc.returncode is None, stub.log.read_text()
            try:
                if (await stub.http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(POLL_S)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger.init(tmp_path / "gpu", 1, parse_size("80GiB"))
    yield led
    assert led.overlaps() == 0, led.overlap_log()


# -- the contract table ---------------------------------------------------------------

ANY = object()


def err(etype: Any, param: Any, code: int, message: Any = ANY) -> dict[str, Any]:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def contains(*parts: str) -> Callable[[Any], bool]:
    return lambda actual: isinstance(actual, str) and all(p in actual for p in parts)


def matches(expected: Any, actual: Any) -> bool:
    if expected is ANY:
        return True
    if callable(expected):
        return bool(expected(actual))
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and matches(v, actual[k]) for k, v in expected.items()
        )
    return bool(expected == actual)


class Raw(bytes):
    """A table body sent as it is, with ``Content-Type: application/json``."""


SERVER_ERROR = err("InternalServerError", None, 500)
RPC_FAILED = "Call to collective_rpc method failed: Worker failed with error '"
RPC_TAIL = "', please check the stack trace above for the root cause"
COMPLETION = {
    "id": ANY,
    "object": "text_completion",
    "created": ANY,
    "model": MODEL,
    "choices": ANY,
    "usage": {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18},
}
CHAT = {"id": ANY, "object": "chat.completion", "model": MODEL, "choices": ANY, "usage": ANY}
RELOAD_DIR = "@reload_dir"  # replaced by a real checkpoint directory
RELOAD = {"method": "reload_weights", "kwargs": {"weights_path": RELOAD_DIR}}
HI = [{"role": "user", "content": "hi"}]

# (method, path, JSON body or None, expected status, expected JSON subset or bytes)
CONTRACT: list[tuple[str, str, Any, int, Any]] = [
    ("GET", "/health", None, 200, b""),
    ("GET", "/version", None, 200, {"version": "0.33.0"}),
    ("GET", "/v1/models", None, 200, {"object": "list", "data": ANY}),
    ("GET", "/is_sleeping", None, 200, {"is_sleeping": False}),
    ("GET", "/is_paused", None, 200, {"is_paused": False}),
    ("POST", "/reset_prefix_cache", None, 200, {"success": True}),
    ("GET", "/weight_info", None, 200, {"weight_version": "default"}),
    ("POST", "/update_weight_version", {"new_version": "v1"}, 200,
     {"success": True, "new_version": "v1"}),
    ("GET", "/weight_info", None, 200, {"weight_version": "v1"}),
    ("POST", "/update_weight_version", {}, 400, err("Bad Request", "body.new_version", 400)),
    ("POST", "/update_weight_version", None, 400, err("Bad Request", "body.new_version", 400)),
    ("POST", "/update_weight_version", {"new_version": 3}, 400,
     err("Bad Request", "body.new_version", 400)),
    ("POST", "/start_weight_update", None, 200, {"message": "Weight update started"}),
    ("POST", "/start_weight_update", None, 500, SERVER_ERROR),
    ("POST", "/finish_weight_update", {"weight_version": "v2"}, 200,
     {"message": "Weight update finished"}),
    ("GET", "/weight_info", None, 200, {"weight_version": "v2"}),
    ("POST", "/finish_weight_update", None, 500, SERVER_ERROR),
    ("POST", "/pause?mode=bogus", None, 400,
     err("Bad Request", "query.mode", 400, contains("literal_error", "'abort', 'wait' or 'keep'"))),
    ("POST", "/pause?mode=abort", None, 200, {"status": "paused"}),
    ("GET", "/is_paused", None, 200, {"is_paused": True}),
    ("GET", "/is_sleeping", None, 200, {"is_sleeping": True}),
    ("POST", "/v1/completions", {"prompt": "hi"}, 503,
     err("ServiceUnavailableError", None, 503,
         "Generation is paused. Please retry after it resumes.")),
    ("GET", "/health", None, 200, b""),
    ("POST", "/resume", None, 200, {"status": "resumed"}),
    ("GET", "/is_paused", None, 200, {"is_paused": False}),
    ("POST", "/pause?mode=keep", None, 200, {"status": "paused"}),
    ("POST", "/wake_up", None, 200, {"status": "awake", "tags": None}),  # ends a pause too
    ("GET", "/is_paused", None, 200, {"is_paused": False}),
    ("POST", "/wake_up?tags=bogus", None, 200, {"status": "awake", "tags": ["bogus"]}),
    ("POST", "/sleep?level=1", None, 200, {"status": "sleeping", "level": 1}),
    ("POST", "/sleep?level=1", None, 200, {"status": "sleeping", "level": 1}),
    ("GET", "/is_sleeping", None, 200, {"is_sleeping": True}),
    ("GET", "/is_paused", None, 200, {"is_paused": True}),
    ("GET", "/health", None, 200, b""),
    ("POST", "/wake_up?tags=bogus", None, 200, {"status": "sleeping", "tags": ["bogus"]}),
    ("POST", "/wake_up?tags=weights&tags=bogus", None, 200,
     {"status": "sleeping", "tags": ["weights", "bogus"]}),  # all or nothing: a no-op
    ("POST", "/wake_up?tags=weights", None, 200, {"status": "sleeping", "tags": ["weights"]}),
    ("POST", "/wake_up?tags=kv_cache", None, 200, {"status": "awake", "tags": ["kv_cache"]}),
    ("POST", "/wake_up", None, 200, {"status": "awake", "tags": None}),
    ("GET", "/is_sleeping", None, 200, {"is_sleeping": False}),
    ("POST", "/sleep?level=2&mode=wait", None, 200, {"status": "sleeping", "level": 2}),
    ("POST", "/wake_up", None, 200, {"status": "awake", "tags": None}),
    ("POST", "/sleep?level=0", None, 200, {"status": "sleeping", "level": 0}),
    ("GET", "/is_sleeping", None, 200, {"is_sleeping": True}),
    ("GET", "/is_paused", None, 200, {"is_paused": True}),
    ("POST", "/wake_up?tags=weights", None, 200, {"status": "awake", "tags": ["weights"]}),
    ("POST", "/sleep?level=7", None, 400, err("Bad Request", "query.level", 400)),
    ("POST", "/sleep?level=x", None, 400, err("Bad Request", "query.level", 400)),
    ("POST", "/sleep?mode=bogus", None, 400, err("Bad Request", "query.mode", 400)),
    ("POST", "/collective_rpc", RELOAD, 200, {"results": [None]}),
    ("POST", "/collective_rpc",
     {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent/ckpt"}}, 500,
     err("InternalServerError", None, 500,
         contains(RPC_FAILED, "No such file or directory", "/nonexistent/ckpt", RPC_TAIL))),
    ("POST", "/collective_rpc", {}, 400,
     err("Bad Request", None, 400, "Missing 'method' in request body")),
    ("POST", "/collective_rpc", {"method": "nosuch"}, 500,
     err("InternalServerError", None, 500,
         f"{RPC_FAILED}'Worker' object has no attribute 'nosuch'{RPC_TAIL}")),
    ("POST", "/collective_rpc", RELOAD, 200, {"results": [None]}),  # repairs the weights
    ("POST", "/v1/completions", {"prompt": "hello world"}, 200, COMPLETION),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}, 200,
     {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}),
    ("POST", "/v1/completions", {"prompt": [[1], [2]], "n": 2, "max_tokens": 1}, 200,
     {"usage": {"completion_tokens": 4}}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "2"}, 200,
     {"usage": {"completion_tokens": 2}}),  # pydantic's lax mode
    ("POST", "/v1/completions", {"prompt": "hi", "model": "other"}, 404,
     err("NotFoundError", "model", 404,
         f"The model `other` does not exist. Valid aliases: {MODEL}.")),
    ("POST", "/v1/completions", {"prompt": 7}, 400, err("Bad Request", "body.prompt", 400)),
    ("POST", "/v1/completions", {"max_tokens": 2}, 400, err("BadRequestError", "prompt", 400)),
    ("POST", "/v1/completions", Raw(b"notjson"), 400, err("Bad Request", "body.0", 400)),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400,
     err("BadRequestError", "max_tokens", 400)),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400,
     err("BadRequestError", "max_tokens", 400,
         "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer "
         "output tokens. (parameter=max_tokens, value=5000)")),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400,
     err("BadRequestError", "temperature", 400)),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "x"}, 400,
     err("Bad Request", "body.max_tokens", 400)),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4}, 200,
     CHAT),
    ("POST", "/v1/chat/completions", {"max_tokens": 4}, 400,
     err("Bad Request", "body.messages", 400)),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, err("BadRequestError", ANY, 400)),
    ("GET", "/no/such/route", None, 404, {"detail": "Not Found"}),
]  # fmt: skip


async def check_contract(http: httpx.AsyncClient, ckpt: Path) -> None:
    """Every row of :data:`CONTRACT` against the stub behind ``http`` (``ckpt``: the
    checkpoint directory the reload rows name)."""
    for i, (method, path, body, status, expected) in enumerate(CONTRACT):
        if isinstance(body, Raw):
            headers = {"content-type": "application/json"}
            r = await http.request(method, path, content=bytes(body), headers=headers)
        else:
            if body is not None:
                body = json.loads(json.dumps(body).replace(RELOAD_DIR, str(ckpt)))
            r = await http.request(method, path, json=body)
        row = f"row {i}: {method} {path} {body!r} -> {r.status_code} {r.text[:300]}"
        assert r.status_code == status, row
        if isinstance(expected, bytes):
            assert r.content == expected, row
        else:
            assert matches(expected, r.json()), row


async def test_contract_table(tmp_path: Path, ledger: Ledger) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "revision.txt").write_text("rev-1\n")
    with trio.fail_after(30):
        async with start_stub(tmp_path, "--enable-sleep-mode") as stub:
            await check_contract(stub.http, ckpt)
            models = (await stub.http.get("/v1/models")).json()
            assert models["data"][0]["id"] == MODEL
            text = (await stub.http.get("/metrics")).text
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                assert name in text
            assert 'sleep_state="awake"} 1.0' in text
            chat = (
                await stub.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
            ).json()
            assert chat["choices"][0]["message"]["role"] == "assistant"
            assert chat["choices"][0]["finish_reason"] == "length"


# -- behaviour ------------------------------------------------------------------------


async def test_memory_is_held_by_the_engine_core(tmp_path: Path, ledger: Ledger) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode") as stub:
            core = stub.core_pid()
            assert core != stub.proc.pid
            procs = ledger.processes(0)
            assert [(p.pid, p.workload) for p in procs] == [(core, "vllm")]
            assert tag_bytes(tmp_path / "gpu", core) == {
                "context": CONTEXT,
                "weights": WEIGHTS,
                "kv": KV,
            }
            assert ledger.snapshot()["allowances"] == {"vllm": CONTEXT}
            log = stub.log.read_text()
            assert log.index("engine core allocated") < log.index("stub: healthy")


async def test_sleep_level1_keeps_only_context_and_wake_restores(
    tmp_path: Path, ledger: Ledger
) -> None:
    gpu = tmp_path / "gpu"
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode") as stub:
            core = stub.core_pid()
            before = await stub.complete()
            r = await stub.http.post("/sleep", params={"level": 1})
            assert r.json() == {"status": "sleeping", "level": 1}
            assert tag_bytes(gpu, core) == {"context": CONTEXT}
            assert await stub.metric("vllm:engine_sleep_state", "weights_offloaded") == 1.0
            assert await stub.metric("vllm:engine_sleep_state", "awake") == 0.0
            assert (await stub.http.get("/health")).status_code == 200
            r = await stub.http.post("/wake_up")
            assert r.json() == {"status": "awake", "tags": None}
            assert tag_bytes(gpu, core) == {"context": CONTEXT, "weights": WEIGHTS, "kv": KV}
            after = await stub.complete()
            assert after["choices"][0]["text"] == before["choices"][0]["text"]
            log = stub.log.read_text()
            assert "stub: slept level=1" in log and "stub: woke" in log


async def test_sleep_level2_discards_weights_until_reload(tmp_path: Path, ledger: Ledger) -> None:
    ckpt = tmp_path / "same"
    ckpt.mkdir()
    (ckpt / "revision.txt").write_text(MODEL)
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode") as stub:
            before = (await stub.complete())["choices"][0]["text"]
            assert (await stub.http.post("/sleep?level=2")).status_code == 200
            assert await stub.metric("vllm:engine_sleep_state", "discard_all") == 1.0
            await stub.http.post("/wake_up")
            assert (await stub.http.get("/weight_info")).json() == {"weight_version": "default"}
            assert (await stub.complete())["choices"][0]["text"] != before  # random weights
            r = await stub.http.post(
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}},
            )
            assert r.status_code == 200, r.text
            assert (await stub.complete())["choices"][0]["text"] == before


async def test_wake_that_does_not_fit_is_a_cuda_oom(tmp_path: Path, ledger: Ledger) -> None:
    gpu = tmp_path / "gpu"
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode") as stub:
            core = stub.core_pid()
            await stub.http.post("/sleep?level=1")
            ledger.alloc(os.getpid(), 0, 79 * GiB, "hog", workload="hog")
            try:
                r = await stub.http.post("/wake_up")
                assert r.status_code == 500
                assert "CUDA out of memory" in r.json()["error"]["message"]
                assert (await stub.http.get("/is_sleeping")).json() == {"is_sleeping": True}
                assert tag_bytes(gpu, core) == {"context": CONTEXT}
            finally:
                ledger.free(os.getpid())
            assert (await stub.http.post("/wake_up")).json()["status"] == "awake"
            assert tag_bytes(gpu, core)["kv"] == KV


@pytest.mark.parametrize("level", [0, 1])
async def test_request_sent_while_asleep_is_held_until_wake(
    tmp_path: Path, ledger: Ledger, level: int
) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode") as stub:
            await stub.http.post(f"/sleep?level={level}")
            done: list[dict[str, Any]] = []

            async def send() -> None:
                done.append(await stub.complete(max_tokens=4))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await until(lambda: "request held" in stub.log.read_text())
                # as in vLLM 0.32: a held request has not reached the scheduler
                assert await stub.metric("vllm:num_requests_waiting") == 0.0
                assert await stub.metric("vllm:num_requests_running") == 0.0
                assert not done
                if level == 1:
                    r = await stub.http.post("/wake_up?tags=weights")
                    assert r.json()["status"] == "sleeping"
                    # only a full wake resumes scheduling: the request is still held
                    assert (await stub.http.get("/is_sleeping")).json() == {"is_sleeping": True}
                    assert await stub.metric("vllm:num_requests_running") == 0.0
                    assert await stub.metric("vllm:generation_tokens_total") == 0.0
                    assert not done
                    await stub.http.post("/wake_up?tags=kv_cache")
                else:
                    r = await stub.http.post("/wake_up")
                    assert r.json() == {"status": "awake", "tags": None}
            assert done[0]["choices"][0]["finish_reason"] == "length"
            assert await stub.metric("vllm:num_requests_waiting") == 0.0
            assert await stub.metric("vllm:num_requests_running") == 0.0


async def _stream(
    stub: Stub, body: dict[str, Any], on_chunk: Callable[[int], Any], path: str = "/v1/completions"
) -> list[Any]:
    chunks: list[Any] = []
    async with stub.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            chunks.append(data if data == "[DONE]" else json.loads(data))
            await on_chunk(len(chunks))
    return chunks


async def test_sleep_abort_ends_a_stream_with_finish_reason_abort(
    tmp_path: Path, ledger: Ledger
) -> None:
    body = {"prompt": "hi", "max_tokens": 500, "stream": True, "return_weight_versions": True}
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode", "--tokens-per-s", "50") as stub:
            slept: list[Any] = []

            async def on_chunk(n: int) -> None:
                if n == 3:
                    slept.append((await stub.http.post("/sleep?level=1&mode=abort")).json())

            chunks = await _stream(stub, body, on_chunk)
            assert chunks[-1] == "[DONE]"
            last = chunks[-2]["choices"][0]
            assert last["finish_reason"] == "abort"
            assert "weight_versions" in last
            assert all("weight_versions" not in c["choices"][0] for c in chunks[:-2])
            text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
            assert 2 <= len(text.split()) < 500
            assert slept == [{"status": "sleeping", "level": 1}]


HOLD = ("--scheduler-cls", "vllm_tier.hold.HoldScheduler")


async def test_hold_scheduler_keeps_a_marked_request_running_until_an_abort(
    tmp_path: Path, ledger: Ledger
) -> None:
    """vllm_tier.hold's scheduler, as the stub plays it: a request with the xarg
    tier_hold_after=K stops after K tokens per choice and stays running (others are not
    held) until an abort ends it with finish_reason abort."""
    held = {"prompt": "hi", "max_tokens": 50, "n": 2, "stream": True, "return_token_ids": True}
    held["vllm_xargs"] = {"tier_hold_after": 3}
    tokens: dict[int, int] = {}
    finish: dict[int, str] = {}
    slept: list[Any] = []
    with trio.fail_after(20):
        async with (
            start_stub(tmp_path, "--enable-sleep-mode", *HOLD) as stub,
            stub.http.stream("POST", "/v1/completions", json=held) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for ch in json.loads(line[len("data: ") :])["choices"]:
                    tokens[ch["index"]] = tokens.get(ch["index"], 0) + len(ch["token_ids"])
                    if ch["finish_reason"]:
                        finish[ch["index"]] = ch["finish_reason"]
                if len(tokens) == 2 and min(tokens.values()) >= 3 and not slept:
                    # held, not finished: another request runs to its end beside it
                    assert await stub.metric("vllm:num_requests_running") == 1.0
                    other = await stub.complete(max_tokens=20, vllm_xargs={"x": 1})
                    assert other["usage"]["completion_tokens"] == 20
                    assert await stub.metric("vllm:num_requests_running") == 1.0
                    slept.append((await stub.http.post("/sleep?level=1&mode=abort")).json())
    assert slept == [{"status": "sleeping", "level": 1}]
    assert finish == {0: "abort", 1: "abort"} and tokens == {0: 3, 1: 3}


async def test_hold_xarg_is_ignored_without_the_hold_scheduler(
    tmp_path: Path, ledger: Ledger
) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path) as stub:
            done = await stub.complete(max_tokens=20, vllm_xargs={"tier_hold_after": 1})
            assert done["choices"][0]["finish_reason"] == "length"
            bad = await stub.http.post("/v1/completions", json={"prompt": "a", "vllm_xargs": 3})
            assert bad.status_code == 400 and "vllm_xargs" in bad.text


async def test_sleep_keep_freezes_and_resumes_after_wake(tmp_path: Path, ledger: Ledger) -> None:
    body = {"prompt": "hi", "max_tokens": 20, "stream": True}
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode", "--tokens-per-s", "50") as stub:

            async def on_chunk(n: int) -> None:
                if n == 2:
                    await stub.http.post("/sleep?level=1&mode=keep")
                    # asleep with the stream frozen mid-way: neither aborted nor finished
                    assert await stub.metric("vllm:engine_sleep_state", "weights_offloaded") == 1
                    assert await stub.metric("vllm:num_requests_running") == 1.0
                    await stub.http.post("/wake_up")

            chunks = await _stream(stub, body, on_chunk)
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(c["choices"][0]["text"].split()) for c in chunks[:-1]) == 20


async def test_sleep_wait_drains_in_flight_and_refuses_new(tmp_path: Path, ledger: Ledger) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode", "--tokens-per-s", "50") as stub:
            events: list[str] = []

            async def generate() -> None:
                r = await stub.complete("a", max_tokens=20)
                events.append(f"done:{r['choices'][0]['finish_reason']}")

            async def sleep() -> None:
                r = await stub.http.post("/sleep?level=1&mode=wait")
                events.append(f"slept:{r.status_code}")

            async def paused() -> bool:
                return bool((await stub.http.get("/is_paused")).json()["is_paused"])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                await until(lambda: running_requests(stub, 1))  # "a" is generating
                nursery.start_soon(sleep)
                await until(paused)  # the sleep is draining "a"
                r = await stub.http.post("/v1/completions", json={"prompt": "b"})
                assert r.status_code == 503
            assert events == ["done:length", "slept:200"]


async def test_dev_routes_are_404_without_dev_mode(tmp_path: Path, ledger: Ledger) -> None:
    dev_routes = [
        ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"),
        ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
        ("POST", "/collective_rpc"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
        ("POST", "/start_weight_update"), ("POST", "/finish_weight_update"),
    ]  # fmt: skip
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode", dev=False) as stub:
            for method, path in dev_routes:
                r = await stub.http.request(method, path)
                assert r.status_code == 404, (method, path)
            assert (await stub.http.get("/health")).status_code == 200
            assert (await stub.http.get("/version")).status_code == 200


async def test_sleep_without_sleep_mode_is_400(tmp_path: Path, ledger: Ledger) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path) as stub:
            r = await stub.http.post("/sleep")
            assert r.status_code == 400
            assert "sleep mode" in r.json()["error"]["message"].lower()


async def test_reload_changes_text_and_weight_versions(tmp_path: Path, ledger: Ledger) -> None:
    ckpt = tmp_path / "step-7"
    ckpt.mkdir()
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--enable-sleep-mode", "--tokens-per-s", "100") as stub:
            a = await stub.complete(return_weight_versions=True, return_token_ids=True)
            assert a["choices"][0]["weight_versions"] == [
                {"version": "default", "start": 0, "end": 16}
            ]
            assert len(a["choices"][0]["token_ids"]) == 16
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
            assert (await stub.http.post("/collective_rpc", json=rpc)).status_code == 200
            b = await stub.complete()
            assert b["choices"][0]["text"] != a["choices"][0]["text"]
            assert (await stub.complete())["choices"][0]["text"] == b["choices"][0]["text"]

            # a label change mid-generation splits the ranges
            async def on_chunk(n: int) -> None:
                if n == 5:
                    await stub.http.post("/update_weight_version", json={"new_version": "v2"})

            body = {"prompt": "x", "max_tokens": 30, "stream": True, "return_weight_versions": True}
            chunks = await _stream(stub, body, on_chunk)
            versions = chunks[-2]["choices"][0]["weight_versions"]
            assert [v["version"] for v in versions] == ["default", "v2"]
            assert versions[0]["start"] == 0 and versions[-1]["end"] == 30
            assert versions[0]["end"] == versions[1]["start"]

            await stub.http.post("/_stub/fault", json={"fail_reload": True})
            r = await stub.http.post("/collective_rpc", json=rpc)
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]


COMPLETION_KEYS = [
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
]
COMPLETION_CHOICE_KEYS = [
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
]
STREAM_CHOICE_KEYS = [
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "prompt_token_ids",
    "token_ids",
]
USAGE_KEYS = [
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
]
CHAT_KEYS = [
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
]
CHAT_CHOICE_KEYS = [
    "index",
    "message",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
]
MESSAGE_KEYS = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
PERMISSION_KEYS = [
    "id",
    "object",
    "created",
    "allow_create_engine",
    "allow_sampling",
    "allow_logprobs",
    "allow_search_indices",
    "allow_view",
    "allow_fine_tuning",
    "organization",
    "group",
    "is_blocking",
]
CARD_KEYS = ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]


async def test_bodies_have_real_vllm_keys_and_served_name(tmp_path: Path, ledger: Ledger) -> None:
    """Key sets as a real vLLM 0.32 server answers (``--served-model-name tiny``)."""
    args = ("--served-model-name", "tiny", "--max-model-len", "128")
    with trio.fail_after(20):
        async with start_stub(tmp_path, *args) as stub:
            plain = await stub.complete(max_tokens=5, model="tiny")
            assert list(plain) == COMPLETION_KEYS
            assert plain["model"] == "tiny" and plain["id"].startswith("cmpl-")
            assert plain["system_fingerprint"].startswith("vllm-")
            assert list(plain["usage"]) == USAGE_KEYS
            choice = plain["choices"][0]
            assert list(choice) == COMPLETION_CHOICE_KEYS
            assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
            ids = (await stub.complete(max_tokens=5, return_token_ids=True))["choices"][0]
            assert len(ids["token_ids"]) == 5 and len(ids["prompt_token_ids"]) == 2
            assert "weight_versions" not in ids

            body = {"prompt": "hi", "max_tokens": 3, "stream": True}
            chunks = await _stream(stub, body, lambda n: trio.lowlevel.checkpoint())
            assert chunks[-1] == "[DONE]"
            for c in chunks[:-2]:
                assert list(c) == COMPLETION_KEYS[:5]
            assert list(chunks[-2]) == [*COMPLETION_KEYS[:5], "system_fingerprint"]
            for c in chunks[:-1]:
                assert list(c["choices"][0]) == STREAM_CHOICE_KEYS
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"

            r = await stub.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
            chat = r.json()
            assert list(chat) == CHAT_KEYS and chat["model"] == "tiny"
            assert list(chat["choices"][0]) == CHAT_CHOICE_KEYS
            assert list(chat["choices"][0]["message"]) == MESSAGE_KEYS  # no tool_calls
            assert list(chat["usage"]) == USAGE_KEYS

            body = {"messages": HI, "max_tokens": 2, "stream": True, "return_token_ids": True}
            chat_chunks = await _stream(
                stub, body, lambda n: trio.lowlevel.checkpoint(), "/v1/chat/completions"
            )
            head, *deltas, last, done = chat_chunks
            assert done == "[DONE]"
            assert list(head) == [*COMPLETION_KEYS[:5], "prompt_token_ids", "prompt_text"]
            assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert list(head["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
            for c in deltas:
                assert list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason",
                                                 "token_ids"]  # fmt: skip
            assert list(last) == [*COMPLETION_KEYS[:5], "system_fingerprint"]
            assert list(last["choices"][0]) == ["index", "delta", "logprobs", "finish_reason",
                                                "stop_reason", "token_ids"]  # fmt: skip
            assert sum(len(c["choices"][0]["token_ids"]) for c in [*deltas, last]) == 2

            card = (await stub.http.get("/v1/models")).json()["data"][0]
            assert list(card) == CARD_KEYS
            assert (card["id"], card["root"], card["max_model_len"]) == ("tiny", MODEL, 128)
            assert [list(p) for p in card["permission"]] == [PERMISSION_KEYS]
            assert 'model_name="tiny"' in (await stub.http.get("/metrics")).text

            r = await stub.http.post("/v1/completions", json={"prompt": "hi", "model": MODEL})
            assert r.status_code == 404
            assert r.json()["error"]["message"].endswith("Valid aliases: tiny.")
            r = await stub.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200})
            assert r.status_code == 400
            assert r.json()["error"] == {
                "message": "max_tokens=200 cannot be greater than max_model_len=128. Please "
                "request fewer output tokens. (parameter=max_tokens, value=200)",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
            # a prompt plus max_tokens past the context is clamped, as vLLM 0.32 does
            r = await stub.http.post(
                "/v1/completions", json={"prompt": list(range(120)), "max_tokens": 16}
            )
            assert r.json()["usage"]["completion_tokens"] == 8
            r = await stub.http.post(
                "/v1/completions",
                content=b'{"prompt": "hi"}',
                headers={"content-type": "text/plain"},
            )
            assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"


async def test_failed_reload_kills_the_engine_on_the_next_generation(
    tmp_path: Path, ledger: Ledger
) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path) as stub:
            core = psutil.Process(stub.core_pid())
            missing = tmp_path / "no-such-ckpt"
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(missing)}}
            r = await stub.http.post("/collective_rpc", json=rpc)
            assert r.status_code == 500
            message = r.json()["error"]["message"]
            assert message.startswith(RPC_FAILED) and message.endswith(RPC_TAIL)
            assert "No such file or directory" in message
            assert (await stub.http.get("/health")).status_code == 200  # not dead yet
            r = await stub.http.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 500
            assert r.json()["error"] == {
                "message": "EngineCore encountered an issue. See stack trace (above) for the "
                "root cause.",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
            await until(lambda: not running(core))
            with trio.fail_after(10):
                assert await stub.proc.wait() == 0  # as vLLM 0.32
            with pytest.raises(httpx.TransportError):
                await stub.http.get("/health")
            assert "engine core died" in stub.log.read_text()


async def test_a_successful_reload_repairs_weights_a_failed_one_broke(
    tmp_path: Path, ledger: Ledger
) -> None:
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
    with trio.fail_after(20):
        async with start_stub(tmp_path, "--fail-reload") as stub:
            r = await stub.http.post("/collective_rpc", json=rpc)
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
            await stub.http.post("/_stub/fault", json={"fail_reload": False})
            assert (await stub.http.post("/collective_rpc", json=rpc)).status_code == 200
            assert (await stub.complete(max_tokens=3))["choices"][0]["finish_reason"] == "length"
            assert stub.proc.returncode is None


async def test_hang_requests_fault(tmp_path: Path, ledger: Ledger) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path) as stub:
            await stub.http.post("/_stub/fault", json={"hang_requests": True})
            done: list[Any] = []

            async def send() -> None:
                done.append(await stub.complete(max_tokens=2))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await until(lambda: running_requests(stub, 1))  # past the gate, then hung
                assert await stub.metric("vllm:generation_tokens_total") == 0.0
                assert not done
                await stub.http.post("/_stub/fault", json={"hang_requests": False})
            assert done


async def test_sigterm_is_ignored_during_boot(tmp_path: Path, ledger: Ledger) -> None:
    with trio.fail_after(25):
        async with start_stub(tmp_path, "--boot-delay", "1.5", wait=False) as stub:
            await until(lambda: ledger.processes(0), timeout=10)  # the core is booting
            assert ignores(stub.proc.pid, signal.SIGTERM)  # so this SIGTERM is discarded
            t0 = time.monotonic()
            stub.proc.send_signal(signal.SIGTERM)
            await wait_healthy(stub)  # which fails the moment the server has exited
            assert time.monotonic() - t0 >= 0.5
            core = psutil.Process(stub.core_pid())
            stub.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                assert await stub.proc.wait() == 0
            await until(lambda: not running(core))
            assert ledger.processes(0) == []
            log = stub.log.read_text()
            assert "received SIGTERM" in log and "engine core stopped" in log


async def test_core_never_outlives_the_server(tmp_path: Path, ledger: Ledger) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path) as stub:
            core = psutil.Process(stub.core_pid())
            stub.proc.kill()
            await stub.proc.wait()
            await until(lambda: not running(core))
            assert ledger.processes(0) == []


async def test_crashed_core_makes_the_server_exit_0_like_vllm(
    tmp_path: Path, ledger: Ledger
) -> None:
    with trio.fail_after(20):
        async with start_stub(tmp_path) as stub:
            core = psutil.Process(stub.core_pid())
            await stub.http.post("/_stub/fault", json={"crash": True})
            await until(lambda: not running(core))
            # The server notices the dead core asynchronously: until then /health may still
            # say 200; afterwards it says 503 until the server exits (or is already gone).
            health = 200
            with trio.fail_after(10):
                while health == 200:
                    try:
                        health = (await stub.http.get("/health")).status_code
                    except httpx.TransportError:
                        health = -1  # the server already exited
                    if health == 200:
                        await trio.sleep(POLL_S)
            assert health in (503, -1)
            with trio.fail_after(10):
                # vLLM 0.32's API server exits 0 when its engine core dies (seen on the real
                # server): a supervisor must restart on any exit (Restart=always).
                assert await stub.proc.wait() == 0
            assert "engine core died" in stub.log.read_text()


@pytest.mark.parametrize(
    ("capacity", "args", "message"),
    [
        ("1GiB", (), "CUDA out of memory"),
        ("80GiB", ("--gpu-memory-utilization", "0.01"), "No available memory for the cache"),
    ],
)
async def test_boot_failures_exit_1(
    tmp_path: Path, capacity: str, args: tuple[str, ...], message: str
) -> None:
    led = Ledger.init(tmp_path / "gpu", 1, parse_size(capacity))
    with trio.fail_after(20):
        async with start_stub(tmp_path, *args, wait=False) as stub:
            assert await stub.proc.wait() == 1
            assert message in stub.log.read_text()
    assert led.processes(0) == []


async def test_cli_refuses_unknown_flags_and_a_missing_ledger(tmp_path: Path) -> None:
    env = _env(tmp_path / "gpu", dev=True)
    cmd = [sys.executable, "-m", "stubs.vllm_stub", "serve", MODEL]
    with trio.fail_after(20):
        r = await trio.run_process(
            [*cmd, "--no-such-flag"], env=env, check=False, capture_stderr=True
        )
        assert r.returncode == 2 and b"unrecognized arguments" in r.stderr
        r = await trio.run_process(
            [*cmd, "--scheduler-cls", "my.Scheduler"], env=env, check=False, capture_stderr=True
        )
        assert r.returncode == 2 and b"the stub knows only vllm_tier.hold.Hold" in r.stderr
        del env["FAKEGPU_DIR"]
        r = await trio.run_process(cmd, env=env, check=False, capture_stderr=True)
        assert r.returncode == 1 and b"FAKEGPU_DIR" in r.stderr
