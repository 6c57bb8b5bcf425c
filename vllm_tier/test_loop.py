"""The whole loop around a real vLLM server: slicerd (fake GPU), ``slicer-launch vllm``
booting the real CPU server, ``slicer-dispatch`` and a trainer stub that publishes two
real weight revisions.

The dispatcher talks to vLLM through a recording proxy in this test. For every call the
proxy notes, before forwarding it, whether slicerd says the replica's workload holds the
GPU, how many generation calls are in flight, and how long vLLM took. From that record
the test checks the order the dispatcher issue specifies, per turn: calls only inside a
turn of the replica (the read-only health probes, ``GET /health``, ``GET
/is_sleeping`` and ``GET /weight_info``, and ``GET /v1/models``, excepted: they do no
GPU work and are asked between turns too; ``/is_sleeping`` proves the dev routes answer
before a turn is asked for, ``/v1/models`` names the model directory the replica booted
from, revision ``base``),
recovery (one bare finish) and a whole load before the first
generation of a dispatcher's life, wake before any generation, a load whole (reload,
label, prefix-cache reset, check) and never under a generation, sleep at the end of
every turn, never ``/resume``. It kills the dispatcher with SIGKILL while generations
are held in the proxy, then (in a turn of its own) swaps the base weights in behind the
unchanged label, restarts the dispatcher, and checks that every accepted sample is
served, each by the revision it pinned: the text equals what a direct call gets at
temperature 0 with that revision loaded, and the two revisions give different text for
every prompt used.

The real vLLM holds no memory in the fake GPU ledger (it runs on the CPU), so the
ledger's overlap count here covers the trainer stub's memory only; that a slept replica
is verified before anyone else is granted is covered by the stub tests.

vLLM 0.32 does not return ``weight_versions``, so the dispatcher runs with
``--weight-check label`` (see ``dispatcher/core.py``).
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.harness import Stack, running_stack, workload
from tests.procs import Proc, free_port, spawn
from tests.test_dispatcher import result_of
from vllm_tier import servers as sv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parent.parent
PARAMS = {"max_tokens": 6, "temperature": 0}


@dataclass
class Call:
    """One call the dispatcher made to vLLM, as the proxy saw it."""

    life: int  # which dispatcher process (1, 2, ...)
    method: str
    path: str
    query: str
    body: bytes
    v_active: bool  # slicerd said workload "v" held the GPU when the call arrived
    turn: int | None  # v's turn number then (None when it held none)
    gens_in_flight: int  # generation calls in flight when it arrived
    status: int | None = None
    seconds: float = 0.0
    dropped: bool = False  # held by the proxy and never forwarded (the kill)


@dataclass
class Proxy:
    """A recording reverse proxy in front of vLLM (see the module docstring)."""

    upstream: str
    stack: Stack
    life: int = 1
    calls: list[Call] = field(default_factory=list)
    hold: trio.Event | None = None  # while set to an Event, generations wait on it
    drop_held: bool = False
    gen_arrived: trio.Event = field(default_factory=trio.Event)
    in_flight: int = 0

    async def handle(self, request: Request) -> Response:
        # Whether a generation is held is decided at its arrival: the reads below take
        # time, and a generation sent just before the kill must not be let through by
        # the test's release of the hold (it was sent inside the killed turn).
        hold = self.hold if request.url.path.startswith("/v1/") else None
        body = await request.body()
        st = await self.stack.status()
        v = workload(st, "v")
        call = Call(
            self.life,
            request.method,
            request.url.path,
            request.url.query,
            body,
            bool(v and v["state"] == "active"),
            int(v["turn"]) if v and v["state"] == "active" else None,
            self.in_flight,
        )
        self.calls.append(call)
        gen = call.path.startswith("/v1/")
        if gen:
            self.in_flight += 1
            self.gen_arrived.set()
        try:
            if hold is not None:
                await hold.wait()
                if self.drop_held:
                    call.dropped = True
                    return Response(b"dropped by the test proxy", 502)
            t0 = trio.current_time()
            async with httpx.AsyncClient(base_url=self.upstream, timeout=120) as http:
                r = await http.request(
                    request.method,
                    call.path,
                    params=request.query_params,
                    content=body,
                    headers={"content-type": request.headers.get("content-type", "")},
                )
            call.seconds = trio.current_time() - t0
        finally:
            if gen:
                self.in_flight -= 1
        call.status = r.status_code
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))


@asynccontextmanager
async def proxy(upstream: str, stack: Stack) -> AsyncIterator[tuple[Proxy, str]]:
    """Serve a :class:`Proxy` on a free port for the duration."""
    p = Proxy(upstream, stack)
    methods = ["GET", "POST"]
    app = Starlette(routes=[Route("/{path:path}", p.handle, methods=methods)])
    conf = HyperConfig()
    port = free_port()
    conf.bind = [f"127.0.0.1:{port}"]
    conf.accesslog = None
    shutdown = trio.Event()
    async with trio.open_nursery() as n:
        asgi: Any = app
        await n.start(
            lambda task_status: hypercorn_serve(
                asgi, conf, shutdown_trigger=shutdown.wait, task_status=task_status
            )
        )
        try:
            yield p, f"http://127.0.0.1:{port}"
        finally:
            shutdown.set()


@asynccontextmanager
async def dispatcher(
    stack: Stack, url: str, life: int, px: Proxy
) -> AsyncIterator[tuple[Proc, httpx.AsyncClient]]:
    """``slicer-dispatch`` for workload "v" through the proxy, state kept across lives."""
    px.life = life
    port = free_port()
    argv = [sys.executable, "-m", "gpu_slicer.dispatcher.main", "--workload", "v", "--replica", url]
    argv += ["--socket", stack.socket, "--state-dir", str(stack.base / "dstate")]
    argv += ["--listen", f"127.0.0.1:{port}", "--weight-check", "label"]
    argv += ["--turn-seconds", "1", "--turn-grace", "2", "--concurrency", "4"]
    # Every turn's whole cycle (wake, load, serve, sleep) is what this test checks
    # against the real server; lazy sleep would skip a turn's sleep and the next wake, and
    # an early start would wake and load before the grant (the CPU build has no sleep mode
    # to wake from: tests/test_dispatcher_early.py holds that order against the stub).
    argv += ["--no-lazy-sleep", "--early-start", "off"]
    async with (
        spawn(stack, f"dispatcher-{life}", argv) as d,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http,
    ):
        await d.line(lambda s: s.startswith("listening on"))
        yield d, http


async def submit(http: httpx.AsyncClient, prompt: str, revision: str | None) -> str:
    body: dict[str, Any] = {"prompt": prompt, **PARAMS}
    if revision is not None:
        body["revision"] = revision
    r = await http.post("/v1/samples", json=body)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def direct_texts(
    stack: Stack, url: str, models: Path, prompts: list[str]
) -> dict[tuple[str, str], str]:
    """Greedy text of every prompt under rev-1 and rev-2 (loaded from the source
    checkpoints, not the trainer's copies), from vLLM directly, inside a turn of ours."""
    out: dict[tuple[str, str], str] = {}
    async with await stack.client() as c, httpx.AsyncClient(base_url=url, timeout=120) as http:
        turn = await c.acquire("v", wait=120)
        (await http.post("/wake_up")).raise_for_status()
        for rev in ("rev-1", "rev-2"):
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(models / rev)}}
            (await http.post("/collective_rpc", json=rpc)).raise_for_status()
            for prompt in prompts:
                r = await http.post("/v1/completions", json={"prompt": prompt, **PARAMS})
                r.raise_for_status()
                out[rev, prompt] = r.json()["choices"][0]["text"]
        (await http.post("/sleep", params={"level": 1})).raise_for_status()
        await c.release(turn, park="now")
    return out


async def swap_weights_behind_the_label(stack: Stack, url: str, models: Path) -> None:
    """In a turn of ours, load the base weights and leave the label as it is: a
    dispatcher that trusted the label after a restart would serve the wrong weights."""
    async with await stack.client() as c, httpx.AsyncClient(base_url=url, timeout=120) as http:
        turn = await c.acquire("v", wait=120)
        (await http.post("/wake_up")).raise_for_status()
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(models / "base")}}
        (await http.post("/collective_rpc", json=rpc)).raise_for_status()
        (await http.post("/sleep", params={"level": 1})).raise_for_status()
        await c.release(turn, park="now")


# The dispatcher's health probes (README, "What is wrong, and readiness"): read-only
# questions that do no GPU work, asked between its turns too. Every call that can (wake,
# load, generate, sleep) is held to the order below.
PROBES = ("/health", "/is_sleeping", "/weight_info", "/v1/models")


def _probe(c: Call) -> bool:
    return c.method == "GET" and c.path in PROBES


def check_order(calls: list[Call], killed_life: int) -> None:
    """The dispatcher issue's order, per dispatcher life and per turn (module docstring)."""
    for life in sorted({c.life for c in calls}):
        # A probe outside a turn of v, or one landing in a turn's last moments (after its
        # sleep, before its RELEASE), is not a call of that turn's.
        seq = [
            c
            for c in calls
            if c.life == life and not c.dropped and not (_probe(c) and not c.v_active)
            and not (c.method == "GET" and c.path == "/health")
        ]  # fmt: skip
        where = f"life {life}"
        outside = [f"{c.method} {c.path}" for c in seq if not c.v_active]
        assert not outside, f"{where}: calls outside a turn of 'v': {outside}"
        # /resume on a slept vLLM would schedule on offloaded weights: the wake resumes.
        assert all(c.path != "/resume" for c in seq), f"{where}: /resume was sent"
        # First sight: one bare finish, and a whole load before the first generation.
        paths = [c.path for c in seq]
        assert "/finish_weight_update" in paths[:2], f"{where}: no recovery first: {paths[:3]}"
        first_gen = next(i for i, p in enumerate(paths) if p.startswith("/v1/"))
        assert "/collective_rpc" in paths[:first_gen], f"{where}: served before any load"
        turns = sorted({c.turn for c in seq if c.turn is not None})
        for t in turns:
            tseq = [c for c in seq if c.turn == t]
            while tseq and _probe(tseq[-1]) and any(x.path == "/sleep" for x in tseq):
                tseq.pop()  # a probe after the turn's sleep, before its RELEASE
            if not tseq:
                continue  # a turn of the test's own, seen only by a probe
            tw = f"{where} turn {t}"
            awake = False
            for i, c in enumerate(tseq):
                if c.path == "/wake_up":
                    awake = True
                elif c.path == "/sleep":
                    awake = False
                elif c.path.startswith("/v1/"):
                    assert awake, f"{tw}: a generation before the wake (call {i})"
                elif c.path == "/collective_rpc":
                    assert c.gens_in_flight == 0, f"{tw}: a load under a generation ({i})"
                    assert awake, f"{tw}: a load while asleep (call {i})"
                    after = tseq[i + 1 :]
                    ctl = [x.path for x in after if not x.path.startswith("/v1/")]
                    then = ["/update_weight_version", "/reset_prefix_cache", "/weight_info"]
                    if c.status == 200:
                        assert ctl[:3] == then, f"{tw}: load not whole: {ctl[:3]}"
                    gens = [k for k, x in enumerate(after) if x.path.startswith("/v1/")]
                    assert not gens or gens[0] >= 3, f"{tw}: served mid-load"
            killed = life == killed_life and t == turns[-1]
            if not killed:
                assert tseq[-1].path == "/sleep", f"{tw}: ended without a sleep: {tseq[-1]}"


def timings(calls: list[Call]) -> dict[str, dict[str, float]]:
    """Median and max seconds of vLLM's answers per control route."""
    out = {}
    for path in ("/wake_up", "/sleep", "/collective_rpc"):
        secs = [c.seconds for c in calls if c.path == path and c.status == 200]
        if secs:
            out[path] = {
                "n": len(secs),
                "median_ms": statistics.median(secs) * 1000,
                "max_ms": max(secs) * 1000,
            }
    return out


async def test_dispatcher_and_launcher_around_a_real_vllm(models: Path) -> None:
    cache = Path(sv.models_dir()).parent / "vllm-cache-loop"
    with trio.fail_after(1200):
        async with running_stack() as stack:
            env = sv.real_env(stack.env, cache)
            port = free_port()
            ready = stack.base / "ready"
            argv = [sys.executable, "-m", "gpu_slicer.launcher.main", "vllm", "--workload", "v"]
            argv += ["--socket", stack.socket, "--ready-file", str(ready)]
            argv += ["--no-sleep-mode-flag", "--boot-timeout", "900", "--health-timeout", "900"]
            argv += ["--", *sv.real_argv(models / "base", port)]
            vllm_url = f"http://127.0.0.1:{port}"
            ckpt = stack.base / "ckpt"
            async with (
                spawn(stack, "launcher", argv, env=env) as lw,
                proxy(vllm_url, stack) as (px, purl),
            ):
                await lw.line(lambda s: "]: ready" in s)
                assert ready.exists()
                ids: dict[str, tuple[str, str]] = {}  # sample id -> (revision, prompt)
                async with dispatcher(stack, purl, 1, px) as (d, http):
                    tr_argv = [sys.executable, "-m", "stubs.trainer_stub", "--workload", "t"]
                    tr_argv += ["--socket", stack.socket, "--bytes", "30GiB", "--work", "0.3"]
                    tr_argv += ["--steps", "2", "--revisions-dir", str(ckpt)]
                    tr_argv += ["--weights-from", str(models), "--last-park", "now"]
                    tr_argv += ["--publish-url", str(http.base_url)]
                    async with spawn(stack, "trainer", tr_argv) as tr:
                        await tr.line(lambda s: s.startswith("published rev-1"))
                        for k in range(6):
                            ids[await submit(http, f"alpha {k}", "rev-1")] = ("rev-1", f"alpha {k}")
                        assert await tr.wait(600) == 0, tr.output()
                    for k in range(6):
                        pinned = "rev-1" if k % 3 == 0 else None  # None: the latest, rev-2
                        sid = await submit(http, f"beta {k}", pinned)
                        ids[sid] = (pinned or "rev-2", f"beta {k}")
                    for sid in list(ids):
                        got = await result_of(http, sid)
                        assert got["status"] == "done", got
                    # The kill: generations held in the proxy, then SIGKILL mid-turn.
                    px.hold, px.gen_arrived = trio.Event(), trio.Event()
                    for k in range(4):
                        ids[await submit(http, f"gamma {k}", "rev-2")] = ("rev-2", f"gamma {k}")
                    await px.gen_arrived.wait()
                    d.proc.kill()
                    assert await d.wait() == -signal.SIGKILL
                # Generations the dead dispatcher sent are dropped, also one whose arrival
                # the proxy reads only now (a loaded machine): the hold stays up until the
                # next dispatcher starts.
                px.drop_held = True
                px.hold.set()

                def v_parked(st: dict[str, Any]) -> bool:
                    v = workload(st, "v")
                    return bool(v and v["state"] == "parked")

                await stack.until(v_parked)
                await swap_weights_behind_the_label(stack, vllm_url, models)
                px.hold, px.drop_held = None, False
                async with dispatcher(stack, purl, 2, px) as (d2, http2):
                    results = {sid: await result_of(http2, sid, timeout=300) for sid in ids}
                    st = (await http2.get("/status")).json()
                    assert st["counts"] == {"pending": 0, "done": len(ids), "failed": 0}, st
                    d2.proc.send_signal(signal.SIGTERM)
                    assert await d2.wait() == 0, d2.output()
                check_order(px.calls, killed_life=1)
                prompts = sorted({prompt for _, prompt in ids.values()})
                direct = await direct_texts(stack, vllm_url, models, prompts)
                for p in prompts:  # the revisions are told apart by every prompt used
                    assert direct["rev-1", p] != direct["rev-2", p], (p, direct["rev-1", p])
                for sid, (rev, prompt) in ids.items():
                    res = results[sid]
                    assert res["revision"] == rev, res
                    text = res["result"]["choices"][0]["text"]
                    assert text == direct[rev, prompt], (sid, rev, prompt, text)
                report = {
                    "calls": len(px.calls),
                    "timings": timings(px.calls),
                    "sequence": [
                        f"{c.life} {c.turn or '-'} {c.method} {c.path}"
                        f"{'?' + c.query if c.query else ''} {c.status}"
                        f"{' dropped' if c.dropped else ''}"
                        for c in px.calls
                    ],
                }
                print("real vLLM control-call timings:", json.dumps(report, indent=1))
                out = ROOT / "build" / "vllm-tier-timings.json"
                out.parent.mkdir(exist_ok=True)
                out.write_text(json.dumps(report, indent=1))
                lw.proc.send_signal(signal.SIGTERM)
                assert await lw.wait(120) == 0, lw.output()
            assert stack.overlaps() == 0
