"""The dispatcher's declared event stream, `GET /v1/events` (dispatcher.events).

In-process: the real HTTP front (its lean HTTP/1.1 server) over a turn loop that is never
run, for the stream's framing, its `closed` end and a slow reader's `dropped` end. End to
end: a real dispatcher in a real stack serves one request, and its stream tells the whole
turn; one stopped mid-turn still tells the turn's end before its front closes.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from gpu_slicer.dispatcher.events import EventStream, follow_events
from gpu_slicer.dispatcher.http import build_app, serve_http
from gpu_slicer.dispatcher.model import Phase, TurnConfig
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from tests.harness import running_stack
from tests.procs import free_port
from tests.test_dispatcher import dispatcher, publish, replica, stop

# -- the stream itself ------------------------------------------------------------------


async def test_events_are_numbered_stamped_and_start_with_the_state() -> None:
    stream = EventStream()
    stream.publish("before")  # not seen: it came before the subscription
    with trio.fail_after(5), stream.subscribe(phase="idle") as sub:
        t0, w0 = time.monotonic(), time.time()
        stream.publish("one", turn=3)
        stream.publish("two")
        stream.close()
        got = [e async for e in sub]
    assert [e["event"] for e in got] == ["subscribed", "one", "two", "closed"]
    assert [e["seq"] for e in got] == [1, 2, 3, 3]
    assert got[0]["phase"] == "idle" and got[1]["turn"] == 3
    assert all(t0 - 1 <= e["t"] <= time.monotonic() for e in got[1:])
    assert all(w0 - 1 <= e["time"] <= time.time() for e in got[1:])
    assert stream.subscribers == 0


async def test_a_slow_reader_is_dropped_and_the_publisher_never_waits() -> None:
    stream = EventStream(buffer=4)
    with trio.fail_after(5), stream.subscribe() as slow, stream.subscribe() as keeping_up:
        seen = []
        for i in range(10):
            stream.publish("tick", i=i)  # no await: publishing cannot block
            seen.append(await keeping_up.__anext__())
        assert stream.subscribers == 1  # the slow one is out, the other one stays
        got = [e async for e in slow]
    assert [e["event"] for e in got] == ["subscribed", "tick", "tick", "tick", "dropped"]
    assert got[-1]["seq"] == got[-2]["seq"] + 1  # the first event it missed
    assert "slow reader" in got[-1]["reason"] and got[-1]["buffer"] == 4
    assert [e.get("i") for e in seen[1:]] == list(range(9))


# -- over the real HTTP front, in process --------------------------------------------


@asynccontextmanager
async def loop_front(
    tmp_path: Path, buffer: int = 4096, model: str | None = None
) -> AsyncIterator[tuple[TurnLoop, str]]:
    """The HTTP front of a turn loop that is never run (workload "v", served as `model`,
    events buffered `buffer` deep); (loop, base URL)."""
    store = Store(tmp_path / "state", "pool-a")
    try:
        async with Replica("http://127.0.0.1:9") as r, trio.open_nursery() as nursery:
            cfg = TurnConfig(workload="v", model=model)
            loop = TurnLoop(store, r, cfg, events=EventStream(buffer))
            stop_front = trio.Event()
            bind = f"127.0.0.1:{free_port()}"
            await nursery.start(serve_http, build_app(loop), bind, stop_front)
            yield loop, f"http://{bind}"
            stop_front.set()
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def test_the_stream_is_json_lines_of_the_loop_and_ends_when_it_stops(
    tmp_path: Path,
) -> None:
    with trio.fail_after(20):
        async with loop_front(tmp_path) as (loop, url):
            async with (
                httpx.AsyncClient(base_url=url) as http,
                http.stream("GET", "/v1/events") as resp,
            ):
                assert resp.status_code == 200
                assert resp.headers["content-type"] == "application/x-ndjson"
                lines = resp.aiter_lines()
                first = json.loads(await lines.__anext__())
                assert first["event"] == "subscribed"
                assert (first["pool"], first["workload"]) == ("pool-a", "v")
                assert (first["phase"], first["turn"], first["loaded_revision"]) == (
                    "idle", None, None)  # fmt: skip
                loop._enter(Phase.ACQUIRING)
                loop._enter(Phase.BACKOFF)
                await loop.events.aclose(5)
                rest = [json.loads(line) async for line in lines if line]
            assert [(e["event"], e.get("phase")) for e in rest] == [
                ("phase", "acquiring"), ("phase", "backoff"), ("closed", None)]  # fmt: skip
            assert [e["seq"] for e in rest] == [1, 2, 2]
            # Once closed, a new reader gets the state and the end at once.
            got: list[dict[str, Any]] = []
            await follow_events(url, got.append)
            assert [(e["event"], e.get("phase")) for e in got] == [
                ("subscribed", "backoff"), ("closed", None)]  # fmt: skip


async def test_a_reader_that_stops_reading_is_dropped_with_a_last_line(tmp_path: Path) -> None:
    """The dispatcher never waits for a reader: one that reads nothing is cut off once
    its buffer is full, and still finds out, as its last line, that it lost events."""
    pad = "x" * (256 << 10)
    with trio.fail_after(60):
        async with (
            loop_front(tmp_path, buffer=8) as (loop, url),
            httpx.AsyncClient(base_url=url, timeout=30) as http,
            http.stream("GET", "/v1/events") as resp,
        ):
            published = 0
            while loop.events.subscribers and published < 2000:  # the sockets fill first
                loop.events.publish("filler", n=published, pad=pad)
                published += 1
                await trio.testing.wait_all_tasks_blocked()
            assert loop.events.subscribers == 0, f"still subscribed after {published} events"
            got = [json.loads(line) async for line in resp.aiter_lines() if line]
    assert got[0]["event"] == "subscribed" and got[-1]["event"] == "dropped"
    fillers = got[1:-1]
    assert [e["n"] for e in fillers] == list(range(len(fillers)))  # in order, no gap
    assert got[-1]["seq"] == fillers[-1]["seq"] + 1 and len(fillers) < published
    assert "slow reader" in got[-1]["reason"]


# -- end to end ------------------------------------------------------------------------

ONE_TURN = [
    ("subscribed", "idle"), ("phase", "acquiring"), ("granted", None),
    ("phase", "recovering"), ("recovered", None), ("phase", "waking"), ("woke", None),
    ("phase", "loading"), ("load_begin", None), ("load_end", None),
    ("phase", "serving"), ("serving", None), ("committed", None),
    ("phase", "sleeping"), ("slept", None), ("phase", "releasing"), ("released", None),
    ("phase", "idle"), ("closed", None),
]  # fmt: skip


@pytest.mark.integration
async def test_a_turn_as_the_event_stream_tells_it() -> None:
    """One request: the stream shows the whole turn in order (first sight of the replica,
    so a recovery; one load of r1), every event of it, on this node's monotonic clock;
    SIGTERM ends the stream with `closed`."""
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            # A turn that sleeps at its end (lazy: tests/test_dispatcher_lazy_sleep.py).
            async with dispatcher(stack, url, "--no-lazy-sleep") as (d, http):
                events: list[dict[str, Any]] = []
                released = trio.Event()

                def on_event(e: dict[str, Any]) -> None:
                    events.append(e)
                    if e["event"] == "released":
                        released.set()

                t0 = time.monotonic()
                async with trio.open_nursery() as nursery:
                    await nursery.start(follow_events, str(http.base_url), on_event)
                    await publish(stack, http, "r1")
                    r = await http.post("/v1/completions", json={"prompt": "q", "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    await released.wait()
                    await stop(d)  # the stream ends: follow_events returns
                t1 = time.monotonic()
            assert stack.overlaps() == 0
    assert [(e["event"], e.get("phase")) for e in events] == ONE_TURN, events
    by = {e["event"]: e for e in events}
    seqs = [e["seq"] for e in events[1:-1]]
    assert seqs == list(range(events[0]["seq"] + 1, events[0]["seq"] + 1 + len(seqs)))
    ts = [e["t"] for e in events]
    assert ts == sorted(ts) and t0 <= ts[0] and ts[-1] <= t1
    turn = by["granted"]["turn"]
    for kind in ("woke", "load_begin", "load_end", "serving", "committed", "slept", "released"):
        assert by[kind]["turn"] == turn, kind
    assert by["load_end"]["ok"] and by["load_end"]["revision"] == "r1"
    assert by["load_end"]["duration_s"] >= 0 and by["woke"]["duration_s"] >= 0
    assert by["committed"]["id"] == r.headers["x-sample-id"]
    assert (by["committed"]["commits"], by["committed"]["pending"]) == (1, 0)
    assert by["slept"]["ok"] and by["released"]["ok"] and by["released"]["reason"] == "idle"


# The end of a turn cut short by SIGTERM, as the stream tells it (after the last `serving`).
STOPPED_MID_TURN = [
    ("phase", "sleeping"), ("slept", None), ("phase", "releasing"), ("released", None),
    ("phase", "idle"), ("closed", None),
]  # fmt: skip
SLOW_SLEEP_S = 3.0  # longer than the front's default 2 s grace for open requests at a stop


@pytest.mark.integration
async def test_sigterm_mid_turn_tells_the_turns_end_before_the_front_closes() -> None:
    """SIGTERM while a send is in flight and vLLM takes 3 s to sleep: the stream still
    gets slept, released and closed (it is not cut when the front stops), the dispatcher
    exits 0, and a request that arrives during the stop is never taken."""
    with trio.fail_after(60):
        async with running_stack() as stack, replica(stack) as (_, url):
            fault = httpx.AsyncClient(base_url=url, timeout=10)
            async with fault, dispatcher(stack, url) as (d, http):
                events: list[dict[str, Any]] = []
                serving, sleeping = trio.Event(), trio.Event()
                late: list[BaseException] = []

                def on_event(e: dict[str, Any]) -> None:
                    events.append(e)
                    if e["event"] == "serving":
                        serving.set()
                    if (e["event"], e.get("phase")) == ("phase", "sleeping"):
                        sleeping.set()

                async def late_request() -> None:
                    async with httpx.AsyncClient(base_url=http.base_url, timeout=30) as c:
                        try:
                            r = await c.post("/v1/samples", json={"prompt": "late"})
                        except httpx.TransportError as e:
                            late.append(e)
                        else:
                            raise AssertionError(f"taken during the stop: {r.status_code}")

                async with trio.open_nursery() as nursery:
                    # follow_events raises if its stream is cut before its last line.
                    await nursery.start(follow_events, str(http.base_url), on_event)
                    await publish(stack, http, "r1")
                    r = await fault.post(
                        "/_stub/fault", json={"hang_requests": True, "sleep_seconds": SLOW_SLEEP_S}
                    )
                    assert r.json()["sleep_seconds"] == SLOW_SLEEP_S, r.text
                    r = await http.post("/v1/samples", json={"prompt": "held", "max_tokens": 4})
                    assert r.status_code == 202, r.text
                    await serving.wait()
                    d.proc.send_signal(signal.SIGTERM)
                    await sleeping.wait()  # the front has stopped accepting by now
                    nursery.start_soon(late_request)
                assert await d.wait() == 0, d.output()
                await fault.post("/_stub/fault", json={"hang_requests": False, "sleep_seconds": 0})
            assert stack.overlaps() == 0
    last_serving = max(i for i, e in enumerate(events) if e["event"] == "serving")
    tail = [(e["event"], e.get("phase")) for e in events[last_serving + 1 :]]
    assert tail == STOPPED_MID_TURN, events
    by = {e["event"]: e for e in events}
    assert by["slept"]["ok"] and by["slept"]["duration_s"] >= SLOW_SLEEP_S
    assert by["released"]["ok"] and by["released"]["turn"] == by["granted"]["turn"]
    assert len(late) == 1
