"""No park for nothing: the dispatcher asks for a turn only when its replica can use it.

Each park of the trainer costs it seconds on a real GPU, so a turn its grantee cannot use
is the most expensive bug this product can have. Here the real stack (slicerd on the fake
GPU, the trainer stub taking turns, the vLLM stub under the real launcher, the real
dispatcher) is driven into each way a dispatcher used to ask for such turns, and the
trainer's parks and the dispatcher's turns are counted: a dead replica, a server at
``--replica`` that is not a vLLM with dev routes, a request past its deadline.

Every wait is event-driven or a bounded poll of ``/status`` (as ``accepted`` does),
under ``trio.fail_after``; every stack asserts zero GPU overlaps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import psutil
import pytest
import trio

from gpu_slicer.dispatcher.probe import DEV_ROUTES_HINT
from stubs.notvllm import not_a_vllm
from tests.harness import Stack, running_stack, workload
from tests.procs import free_port, spawn
from tests.test_dispatcher import publish, replica, result_of, status, stop, trainer, versions
from tests.test_dispatcher_health import dispatcher, says, until_problem

pytestmark = pytest.mark.integration

# Long enough that a dispatcher asking after each failed turn (0.5 s doubling) would have
# asked three times or more.
WATCH_S = 6.0


async def trainer_parks(stack: Stack) -> int:
    """How often slicerd parked the trainer so far."""
    t = workload(await stack.status(), "trainer")
    assert t is not None
    parks: int = t["parks"]
    return parks


async def problem_lasted(http: httpx.AsyncClient, text: str, seconds: float) -> dict[str, Any]:
    """The first ``/status`` whose problem contains ``text`` and has lasted ``seconds``
    (a bounded poll every 100 ms: nothing announces how long a problem lasts)."""
    with trio.move_on_after(seconds + 30):
        await until_problem(http, says(text))
        while True:
            st = await status(http)
            p = st["problem"]
            if p is not None and text in p["what"] and p["for_s"] >= seconds:
                return st
            await trio.sleep(0.1)
    st = await status(http)
    raise AssertionError(
        f"no problem {text!r} lasting {seconds} s: {st['problem']}, counters {st['counters']}"
    )


@asynccontextmanager
async def forwarder(port: int, to: str) -> AsyncIterator[None]:
    """Listen on ``port`` and pass every connection through to ``to`` (a base URL): the
    replica at the dispatcher's ``--replica`` comes back."""
    target = httpx.URL(to)

    async def pipe(a: trio.SocketStream, b: trio.SocketStream) -> None:
        try:
            while data := await a.receive_some(65536):
                await b.send_all(data)
            await b.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def one(client: trio.SocketStream) -> None:
        up = await trio.open_tcp_stream(target.host, target.port or 80)
        async with client, up, trio.open_nursery() as n:
            n.start_soon(pipe, client, up)
            n.start_soon(pipe, up, client)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(trio.serve_tcp, one, port, host="127.0.0.1"))
        yield
        nursery.cancel_scope.cancel()


async def test_a_dead_replica_parks_nobody_and_is_served_once_it_answers() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack) as (_, url):
            port = free_port()  # --replica names this port; nothing listens there yet
            async with (
                spawn(stack, "trainer", trainer(stack, 100_000, 0.05)),
                dispatcher(stack, f"http://127.0.0.1:{port}") as (d, http),
            ):
                await stack.until(lambda st: (workload(st, "trainer") or {}).get("grants", 0) > 0)
                await publish(stack, http, "r1")
                r = await http.post("/v1/samples", json={"prompt": "hi", "max_tokens": 4})
                assert r.status_code == 202, r.text
                st = await problem_lasted(http, "replica unhealthy", WATCH_S)
                assert st["counts"]["pending"] == 1 and st["state"] == "backoff", st
                assert st["counters"]["turns"] == 0, st["counters"]
                assert await trainer_parks(stack) == 0  # nobody asked for the GPU
                async with forwarder(port, url):  # the replica answers at --replica now
                    got = await result_of(http, r.json()["id"])
                    assert got["status"] == "done" and got["revision"] == "r1", got
                    st = await status(http)
                    assert st["counters"]["turns"] == 1, st["counters"]  # the one that served
                    assert st["counters"]["wasted_turns"] == 0, st["counters"]
                    assert st["problem"] is None, st["problem"]
                    assert await trainer_parks(stack) >= 1  # parked for a turn that served
                    await stop(d)
            assert stack.overlaps() == 0


async def test_a_server_without_vllm_dev_routes_parks_nobody_and_says_why() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack), not_a_vllm() as url:
            # Workload v is registered (its launcher runs), but --replica points at a
            # server that answers /health and nothing the dispatcher drives.
            async with (
                spawn(stack, "trainer", trainer(stack, 100_000, 0.05)),
                dispatcher(stack, url) as (d, http),
            ):
                await stack.until(lambda st: (workload(st, "trainer") or {}).get("grants", 0) > 0)
                parks = await trainer_parks(stack)  # the launcher's boot turn, if it came later
                await publish(stack, http, "r1")
                r = await http.post("/v1/samples", json={"prompt": "hi", "max_tokens": 4})
                assert r.status_code == 202, r.text
                st = await problem_lasted(http, "replica unhealthy", WATCH_S)
                what = st["problem"]["what"]
                assert f"({url}: GET /is_sleeping: HTTP 404" in what and DEV_ROUTES_HINT in what, (
                    what
                )
                assert st["counters"]["turns"] == 0, st["counters"]
                assert await trainer_parks(stack) == parks
                await stop(d)
            assert stack.overlaps() == 0


async def test_a_request_failed_at_its_deadline_across_a_restart_is_never_sent() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack) as (lw, url):
            holder = await stack.client()
            async with holder:
                # The test holds the GPU itself (a workload with nothing on the GPU).
                await holder.register("holder", park="cooperative", parked_max="1GiB", tree=False)
                turn = await holder.acquire("holder")
                flags = ["--sample-deadline", "3"]
                async with dispatcher(stack, url, *flags, name="d1") as (d1, http):
                    await publish(stack, http, "r1")
                    r = await http.post("/v1/samples", json={"prompt": "late", "max_tokens": 4})
                    assert r.status_code == 202, r.text
                    late = r.json()["id"]
                    await stack.until(lambda st: st["gpus"][0]["queue"] == ["v"])
                    d1.proc.kill()  # SIGKILL while the holder has the GPU and v waits
                    await d1.wait()
                async with dispatcher(stack, url, *flags, name="d2") as (d2, http):
                    # Read without waiting, as a client polling does: the sample reads
                    # as failed the moment its deadline passed.
                    while (got := (await http.get(f"/v1/samples/{late}")).json())[
                        "status"
                    ] == "pending":
                        await trio.sleep(0.02)
                    assert got["status"] == "failed" and "deadline" in got["error"], got
                    r = await http.post("/v1/samples", json={"prompt": "fresh", "max_tokens": 4})
                    await holder.release(turn)
                    got = await result_of(http, r.json()["id"])
                    assert got["status"] == "done", got
                    await stop(d2)
                # The stub logs a request after answering it: a marker request's line
                # comes after every line of the sends before it.
                async with httpx.AsyncClient(base_url=url) as direct:
                    await direct.get("/health?marker")
                await lw.line(lambda s: "/health?marker" in s)
                sent = [s for s in lw.lines if "POST /v1/completions" in s]
                assert len(sent) == 1, sent  # only "fresh": "late" had failed
            assert stack.overlaps() == 0


def connections_to(pid: int, port: int) -> int:
    """Open TCP connections of process ``pid`` to ``port`` on this host."""
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


async def test_a_burst_leaves_at_most_32_idle_connections_to_the_replica() -> None:
    with trio.fail_after(120):
        async with (
            running_stack() as stack,
            replica(stack, "cooperative", "--tokens-per-s", "200") as (_, url),
        ):
            port = httpx.URL(url).port
            assert port is not None
            async with dispatcher(stack, url) as (d, http):  # the default concurrency: 64
                await publish(stack, http, "r1")
                r = await http.post(
                    "/v1/samples/batch",
                    json={"requests": [{"prompt": f"b{i}", "max_tokens": 8} for i in range(80)]},
                )
                assert r.status_code == 202, r.text
                ids = [x["id"] for x in r.json()["samples"]]
                for sid in ids:
                    assert (await result_of(http, sid))["status"] == "done"
                assert 0 < connections_to(d.proc.pid, port) <= 32
                await stop(d)
            assert stack.overlaps() == 0


async def test_sampling_inside_the_holders_own_turn_is_named_as_the_problem() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack) as (_, url):
            holder = await stack.client()
            async with holder, dispatcher(stack, url) as (d, http):
                await holder.register("trainer", park="cooperative", parked_max="1GiB", tree=False)
                turn = await holder.acquire("trainer")  # ... and samples inside its turn
                await publish(stack, http, "r1")
                r = await http.post("/v1/samples", json={"prompt": "hi", "max_tokens": 4})
                st = await until_problem(http, says("waiting for the GPU: held by trainer for "))
                what = st["problem"]["what"]
                assert f"(turn {turn.turn})" in what and "release the turn before sampling" in what
                held = int(
                    what.removeprefix("waiting for the GPU: held by trainer for ").split()[0]
                )
                assert held >= 10, what
                assert st["state"] == "acquiring" and st["counts"]["pending"] == 1, st
                await holder.release(turn)
                got = await result_of(http, r.json()["id"])
                assert got["status"] == "done", got
                assert (await status(http))["problem"] is None
                await stop(d)
            assert stack.overlaps() == 0


async def test_step_zero_samples_the_boot_weights_as_revision_base() -> None:
    """An RL loop's first rollout comes before the first publish: the weights the replica
    booted with are revision ``base`` (the model directory vLLM names, published at start
    while none is), loaded whole like any revision, never the newest over a published
    one; a replica started from a hub name (no directory) publishes none and says so."""
    with trio.fail_after(120):
        async with running_stack() as stack:
            boot = stack.base / "models" / "boot"
            boot.mkdir(parents=True)
            (boot / "revision.txt").write_text("boot")
            async with (
                replica(stack, model=str(boot)) as (_, url),
                dispatcher(stack, url) as (d, http),
            ):
                body = {"prompt": "step zero", "max_tokens": 6, "seed": 1}
                r = await http.post("/v1/completions", json=body)  # nothing published
                assert r.status_code == 200, r.text
                first = r.json()
                assert versions(first) == {"base"}, first
                revs = (await http.get("/v1/revisions")).json()["revisions"]
                assert [(x["revision"], x["path"]) for x in revs] == [("base", str(boot))]
                await publish(stack, http, "r1")
                r1 = (await http.post("/v1/completions", json=body)).json()
                assert versions(r1) == {"r1"}  # the newest, not the base
                assert r1["choices"][0]["text"] != first["choices"][0]["text"]
                body["revision"] = "base"
                again = await http.post("/v1/completions", json=body)
                assert again.status_code == 200, again.text
                # Loaded whole again from the directory vLLM booted from: the same text.
                assert versions(again.json()) == {"base"}
                assert again.json()["choices"][0]["text"] == first["choices"][0]["text"]
                await stop(d)
            async with (
                replica(stack) as (_, url),  # vLLM serve m: a name, no directory
                dispatcher(stack, url, state="named") as (d, http),
            ):
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 404 and "no revision" in r.text, r.text
                await d.line(lambda s: "base revision base not published" in s)
                assert "no checkpoint directory" in d.output()
                await stop(d)
            assert stack.overlaps() == 0
