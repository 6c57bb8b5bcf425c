"""The dispatcher checks its world: ``/status``'s ``problem`` and ``GET /ready``.

The pure parts (the checks and their order, the words, since when, the probe's capped
backoff under ``autojump_clock``) and ``ready_endpoint`` in process; then the real
dispatcher (real slicerd on a fake GPU, the vLLM stub under the real launcher) started
with no daemon, with its workload unregistered, with its replica down, and with a
revision that cannot be loaded. Every wait is event-driven (``GET /v1/events``, lines the
processes print) and bounded by ``trio.fail_after``; every stack asserts zero overlaps.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.routing import Route

from gpu_slicer.dispatcher.errors import ReplicaError
from gpu_slicer.dispatcher.events import follow_events
from gpu_slicer.dispatcher.health import (
    Check,
    Health,
    Problem,
    foreign_weights,
    note_loads,
    note_store,
    ready_endpoint,
    workload_unknown,
)
from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.dispatcher.probe import (
    DEV_ROUTES_HINT,
    PROBE_INTERVAL_S,
    probe,
    probe_daemon,
    probe_replica,
)
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from gpu_slicer.proto import Unreachable
from gpu_slicer.slicer.client import ClientError
from tests.harness import running_stack
from tests.procs import free_port
from tests.test_dispatcher import dispatcher, publish, replica, result_of, status, stop

# -- pure parts ------------------------------------------------------------------------


class Clocks:
    """A health clock and a wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0
        self.wall = 1_767_225_600.0  # 2026-01-01T00:00:00Z

    def advance(self, dt: float) -> None:
        self.t += dt
        self.wall += dt


def _health() -> tuple[Health, Clocks, list[Problem | None]]:
    clocks, changes = Clocks(), []
    h = Health(clock=lambda: clocks.t, wall=lambda: clocks.wall, on_change=changes.append)
    return h, clocks, changes


def test_the_first_failing_check_is_the_problem_and_keeps_its_since() -> None:
    h, clocks, changes = _health()
    assert h.problem_json() is None
    assert h.not_ready() == "slicerd has not been contacted yet"
    h.fail(Check.REPLICA, "replica unhealthy (http://r: down)")
    clocks.advance(2.5)
    h.fail(Check.DAEMON, "daemon unreachable (/s: gone)")  # hides the replica behind it
    assert h.problem_json() == {
        "what": "daemon unreachable (/s: gone)",
        "since": "2026-01-01T00:00:02.500+00:00",
        "for_s": 0.0,
    }
    clocks.advance(4)
    h.fail(Check.DAEMON, "daemon unreachable (/s: refused)")  # still failing: same since
    got = h.problem_json()
    assert got is not None and got["for_s"] == 4.0
    assert got["since"] == "2026-01-01T00:00:02.500+00:00"
    assert got["what"] == "daemon unreachable (/s: refused)"
    h.ok(Check.DAEMON)  # works again: the replica's problem shows, with its own since
    got = h.problem_json()
    assert got is not None and got["what"].startswith("replica unhealthy")
    assert got["since"] == "2026-01-01T00:00:00.000+00:00" and got["for_s"] == 6.5
    h.ok(Check.REPLICA)
    assert h.problem is None
    assert [c and c.what for c in changes] == [
        "replica unhealthy (http://r: down)", "daemon unreachable (/s: gone)",
        "daemon unreachable (/s: refused)", "replica unhealthy (http://r: down)", None,
    ]  # fmt: skip
    h.ok(Check.REPLICA)  # no change: nothing told
    assert len(changes) == 5


def test_ready_needs_every_check_known_ok_and_a_load_error_is_only_a_problem() -> None:
    h, _, _ = _health()
    for check, reason in [
        (Check.DAEMON, "slicerd has not been contacted yet"),
        (Check.WORKLOAD, "the workload's registration with slicerd has not been checked yet"),
        (Check.REPLICA, "the replica's health has not been checked yet"),
    ]:
        assert h.not_ready() == reason
        h.ok(check)
    assert h.not_ready() is None
    note_loads(h, {"r2": {"retry_in_s": 3.0, "error": "HTTP 500: no such dir"},
                   "r3": {"retry_in_s": 1.0, "error": "x"}}, {"r2", "r3"})  # fmt: skip
    assert h.problem is not None
    assert h.problem.what == "last load error (revision r2: HTTP 500: no such dir)"
    assert h.not_ready() is None  # the replica serves other revisions meanwhile
    note_loads(h, {"r2": {"retry_in_s": 3.0, "error": "x"}}, {"r1"})  # nothing waits for r2
    assert h.problem is None
    note_store(h, {"damaged": True, "error": "DatabaseError: database disk image is malformed"})
    assert h.not_ready() == "store damaged (DatabaseError: database disk image is malformed)"
    note_store(h, {"damaged": False, "error": "accept: the disk holding x is full"})
    assert h.not_ready() == "store unwritable (accept: the disk holding x is full)"
    note_store(h, {"damaged": False, "error": None})
    assert h.not_ready() is None and h.problem is None


class FakeReplica:
    base_url = "http://127.0.0.1:9"

    def __init__(self) -> None:
        self.error: str | None = "GET http://127.0.0.1:9/health: ConnectError: refused"
        self.epoch = 0
        self.known_version: str | None = None
        self.label = "default"
        self.label_reads = 0
        self.during_read: Callable[[], None] | None = None
        self.dev_error: str | None = None  # GET /is_sleeping's failure, if any

    async def check_health(self, timeout: float) -> str | None:
        return self.error

    async def weight_version(self, timeout: float) -> str:
        self.label_reads += 1
        if self.during_read is not None:
            self.during_read()
        return self.label

    async def is_sleeping(self, timeout: float) -> bool:
        if self.dev_error is not None:
            raise ReplicaError(self.dev_error, 404)
        return True


class FakeConn:
    """What the probe uses of a slicerd connection: STATUS lists `workloads` (the very
    list: a test changes it in place to register or lose a workload); `aclose` is a no-op."""

    def __init__(self, workloads: list[dict[str, Any]] | None = None) -> None:
        self.workloads = [] if workloads is None else workloads

    async def status(self) -> dict[str, Any]:
        return {"workloads": self.workloads}

    async def aclose(self) -> None:
        pass


def connects_to(conn: FakeConn) -> Callable[[], Awaitable[Any]]:
    """A `connect` for the probe that always reaches `conn`."""

    async def connect() -> Any:
        return conn

    return connect


async def test_an_unreachable_daemon_is_probed_with_a_capped_backoff(autojump_clock: Any) -> None:
    h = Health()
    tries: list[float] = []
    up = False
    workloads: list[dict[str, Any]] = []

    async def connect() -> Any:
        tries.append(trio.current_time())
        if not up:
            raise Unreachable("cannot connect to /run/s.sock: [Errno 2] No such file or directory")
        return FakeConn(workloads)

    rep = FakeReplica()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe, h, connect, "/run/s.sock", "v", rep)
            await trio.sleep(20)
            assert h.problem is not None and h.problem.what == (
                "daemon unreachable (/run/s.sock: [Errno 2] No such file or directory); "
                "is slicerd running? (--socket / $SLICER_SOCKET)"
            )
            gaps = [round(b - a, 3) for a, b in itertools.pairwise(tries)]
            assert gaps[:4] == [0.5, 1.0, 2.0, 4.0]  # doubling ...
            assert set(gaps[4:]) == {PROBE_INTERVAL_S}  # ... to the cap, never longer
            up = True
            await trio.sleep(PROBE_INTERVAL_S)
            assert h.problem is not None
            assert h.problem.what.startswith("workload v is not registered with slicerd")
            workloads.append({"name": "v"})
            await trio.sleep(PROBE_INTERVAL_S)
            assert h.problem is not None and h.problem.what == (
                "replica unhealthy (http://127.0.0.1:9: GET /health: ConnectError: refused)"
            )
            rep.error = None
            await trio.sleep(PROBE_INTERVAL_S)
            assert h.problem is None and h.not_ready() is None
            nursery.cancel_scope.cancel()


async def test_a_daemon_that_answers_no_status_in_time_is_unreachable(autojump_clock: Any) -> None:
    h = Health()

    class Hung(FakeConn):
        async def status(self) -> dict[str, Any]:
            await trio.sleep_forever()
            raise AssertionError

    with trio.fail_after(60):
        await probe_daemon(h, connects_to(Hung()), "/s", "v")
    assert h.problem is not None
    assert h.problem.what.startswith("daemon unreachable (/s: no answer to STATUS)")


async def test_check_health_says_why() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "engine dead"}})

    async with Replica("http://vllm", transport=httpx.MockTransport(handler)) as r:
        with trio.fail_after(10):
            assert await r.check_health(5) == "GET http://vllm/health: HTTP 503: engine dead"
            assert await r.health(5) is False


async def test_a_replica_with_other_weights_is_a_problem_and_is_forgotten() -> None:
    """A replica restarted at the same URL (boot weights, "default") while r1 is loaded:
    the weights check fails with one sentence, /ready needs it, on_lost is told."""
    h, _, changes = _health()
    for check in (Check.DAEMON, Check.WORKLOAD):
        h.ok(check)
    rep, lost = FakeReplica(), []
    rep.error, rep.known_version = None, "r1"
    with trio.fail_after(10):
        await probe_replica(h, rep, lost.append)
        assert h.state(Check.REPLICA) is True and h.state(Check.WEIGHTS) is False
        assert h.not_ready() == foreign_weights(rep.base_url, "r1")
        assert h.not_ready() == (
            "replica serves weights other than r1 (http://127.0.0.1:9: a new replica process, "
            "or weights loaded by someone else); recovering it and loading r1 again"
        )
        assert lost == ["GET /weight_info says 'default', not 'r1'"]
        h.ok(Check.WEIGHTS)
        rep.label = "r1"  # the one loaded: nothing to tell
        await probe_replica(h, rep, lost.append)
        assert h.not_ready() is None and len(lost) == 1
        rep.label = "r2"  # a load of ours ran during the read: its label is not judged
        rep.during_read = lambda: setattr(rep, "epoch", rep.epoch + 1)
        await probe_replica(h, rep, lost.append)
        assert h.not_ready() is None and len(lost) == 1
        rep.known_version = None  # nothing loaded: no label read at all
        reads = rep.label_reads
        await probe_replica(h, rep, lost.append)
        assert rep.label_reads == reads and len(lost) == 1
        rep.known_version = "r1"  # a replica that cannot be reached may come back anew
        rep.error = "GET http://127.0.0.1:9/health: ConnectError: refused"
        await probe_replica(h, rep, lost.append)
        assert lost[-1] == rep.error and h.state(Check.REPLICA) is False
    assert [c and c.check for c in changes].count(Check.WEIGHTS) == 1


async def test_a_replica_without_dev_routes_is_unhealthy_until_they_answer() -> None:
    """/health alone does not make a replica healthy on first sight: its dev routes must
    answer too (a vLLM without VLLM_SERVER_DEV_MODE=1, another server at the URL); once
    healthy, /health alone is asked."""
    h, _, _ = _health()
    rep, lost = FakeReplica(), []
    rep.error, rep.dev_error = None, "GET http://127.0.0.1:9/is_sleeping: HTTP 404: Not Found"
    with trio.fail_after(10):
        await probe_replica(h, rep, lost.append)
        assert h.state(Check.REPLICA) is False and h.problem is not None
        assert h.problem.what == (
            "replica unhealthy (http://127.0.0.1:9: GET /is_sleeping: HTTP 404: Not Found; "
            f"{DEV_ROUTES_HINT})"
        )
        rep.dev_error = None
        await probe_replica(h, rep, lost.append)
        assert h.state(Check.REPLICA) is True
        rep.dev_error = "GET http://127.0.0.1:9/is_sleeping: no answer within 5 s"
        await probe_replica(h, rep, lost.append)  # healthy: only /health is asked
        assert h.state(Check.REPLICA) is True and lost == []


async def test_the_workload_problem_has_one_wording_whoever_found_it(tmp_path: Path) -> None:
    """A STATUS that lists no such workload and an ACQUIRE answered unknown-workload say
    the same words: the problem does not flap (one event, one warning)."""
    h, _, changes = _health()

    connect = connects_to(FakeConn())
    with trio.fail_after(10):
        await probe_daemon(h, connect, "/s", "v")
    h.fail(Check.WORKLOAD, workload_unknown("v"))  # as the turn loop does on ERR
    with trio.fail_after(10):
        await probe_daemon(h, connect, "/s", "v")
    assert [c and c.what for c in changes] == [workload_unknown("v")]
    assert "unknown-workload" in workload_unknown("v")


async def test_a_status_refusal_leaves_the_registration_unknown() -> None:
    h, _, _ = _health()
    h.ok(Check.WORKLOAD)

    class Refuses(FakeConn):
        async def status(self) -> dict[str, Any]:
            raise ClientError("bad-request", "no")

    with trio.fail_after(10):
        await probe_daemon(h, connects_to(Refuses()), "/s", "v")
    assert h.state(Check.DAEMON) is True and h.state(Check.WORKLOAD) is None


async def test_during_a_turn_only_slicerd_is_probed_and_a_lost_workload_is_told(
    autojump_clock: Any,
) -> None:
    h = Health()
    workloads = [{"name": "v"}]
    told: list[str] = []

    connect = connects_to(FakeConn(workloads))
    rep = FakeReplica()
    rep.error = None
    rep.known_version = "r1"
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(probe, h, connect, "/s", "v", rep, held=lambda: True,
                                       on_workload_lost=lambda: told.append("lost")))  # fmt: skip
            await trio.sleep(PROBE_INTERVAL_S * 2)
            assert h.state(Check.DAEMON) is True and rep.label_reads == 0
            assert h.state(Check.REPLICA) is None and told == []  # the replica is not probed
            workloads.clear()  # its launcher died: slicerd unregistered it
            await trio.sleep(PROBE_INTERVAL_S * 2)
            assert told and set(told) == {"lost"}
            assert h.problem is not None and h.problem.what == workload_unknown("v")
            nursery.cancel_scope.cancel()


async def test_a_bug_in_a_probe_is_logged_with_its_trace_once(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    class Buggy(FakeReplica):
        async def check_health(self, timeout: float) -> str | None:
            raise RuntimeError("a bug")

    async def connect() -> Any:
        raise Unreachable("cannot connect to /s: gone")

    caplog.set_level(logging.DEBUG, logger="dispatcher.health")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe, Health(), connect, "/s", "v", Buggy())
            await trio.sleep(PROBE_INTERVAL_S * 6)
            nursery.cancel_scope.cancel()
    failed = [r for r in caplog.records if r.getMessage().startswith("health probe failed")]
    assert len(failed) >= 6, failed
    assert [r.levelno for r in failed].count(logging.ERROR) == 1
    assert failed[0].levelno == logging.ERROR and failed[0].exc_info is not None
    assert {r.levelno for r in failed[1:]} == {logging.DEBUG}


# -- ready_endpoint in process -----------------------------------------------------------


@asynccontextmanager
async def _ready_app(tmp_path: Path) -> AsyncIterator[tuple[TurnLoop, httpx.AsyncClient]]:
    """A turn loop that is never run, and a client of a Starlette app with its one route
    ``GET /ready`` (as the front mounts it)."""
    store = Store(tmp_path / "state", "pool-a")
    try:
        async with Replica("http://127.0.0.1:9") as r:
            loop = TurnLoop(store, r, TurnConfig(workload="v"))
            app = Starlette(routes=[Route("/ready", ready_endpoint(loop), methods=["GET"])])
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://d") as http:
                yield loop, http
    finally:
        store.close()


async def test_ready_is_503_with_the_reason_until_every_check_is_ok(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with _ready_app(tmp_path) as (loop, http):
            r = await http.get("/ready")
            assert r.status_code == 503
            assert r.json() == {"ready": False, "reason": "slicerd has not been contacted yet"}
            for check in (Check.DAEMON, Check.WORKLOAD, Check.REPLICA):
                loop.health.ok(check)
            r = await http.get("/ready")
            assert (r.status_code, r.json()) == (200, {"ready": True})
            r = await http.get("/ready", params={"revision": "r1"})
            assert r.status_code == 503
            assert r.json() == {"ready": False, "reason": "revision r1 is not published"}
            ckpt = tmp_path / "ckpt" / "r1"
            ckpt.mkdir(parents=True)
            (ckpt / "revision.txt").write_text("r1")
            loop.publish("r1", str(ckpt))
            r = await http.get("/ready", params={"revision": "r1"})
            assert (r.status_code, r.json()) == (200, {"ready": True})
            loop.health.fail(Check.REPLICA, "replica unhealthy (http://127.0.0.1:9: down)")
            r = await http.get("/ready", params={"revision": "r1"})
            assert r.status_code == 503
            assert r.json()["reason"] == "replica unhealthy (http://127.0.0.1:9: down)"
            st = loop.status()
            assert st["problem"]["what"] == "replica unhealthy (http://127.0.0.1:9: down)"
            datetime.fromisoformat(st["problem"]["since"])
            assert st["state"] == "idle" and "store" in st  # today's fields stay


async def test_ready_takes_name_at_rev_and_refuses_an_empty_or_bad_revision(
    tmp_path: Path,
) -> None:
    with trio.fail_after(20):
        async with _ready_app(tmp_path) as (loop, http):
            for check in (Check.DAEMON, Check.WORKLOAD, Check.REPLICA):
                loop.health.ok(check)
            ckpt = tmp_path / "ckpt" / "rev-1"
            ckpt.mkdir(parents=True)
            (ckpt / "revision.txt").write_text("rev-1")
            loop.publish("rev-1", str(ckpt))
            for asked in ("rev-1", "pool-a@rev-1", "sampler@rev-1"):  # as /v1/models lists it
                r = await http.get("/ready", params={"revision": asked})
                assert (r.status_code, r.json()) == (200, {"ready": True}), asked
            r = await http.get("/ready", params={"revision": "pool-a@rev-9"})
            assert r.status_code == 503
            assert r.json()["reason"] == "revision rev-9 is not published"
            r = await http.get("/ready?revision=")
            assert r.status_code == 400 and r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert err["message"].startswith("revision must not be empty"), err
            assert (err["type"], err["code"], err["param"]) == (
                "BadRequestError", "bad_request", "revision"
            )  # fmt: skip
            r = await http.get("/ready", params={"revision": "pool-a@"})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                "revision 'pool-a@' ends with '@' but names no revision after it"
            )
            r = await http.get("/ready", params={"revision": "a" * 5000})
            assert r.status_code == 400
            message = r.json()["error"]["message"]
            assert len(message) < 300 and message.endswith("'" + "a" * 200 + "'..."), message
            loop.health.fail(Check.WEIGHTS, foreign_weights(loop.replica.base_url, "rev-1"))
            assert loop.health.not_ready() == foreign_weights(loop.replica.base_url, "rev-1")
            # Nothing pending: nothing is served from the other weights, the next turn
            # recovers the replica anyway: ready (the problem cleared).
            r = await http.get("/ready")
            assert (r.status_code, r.json()) == (200, {"ready": True})
            assert loop.status()["problem"] is None


# -- the real dispatcher -----------------------------------------------------------------


async def until_problem(
    http: httpx.AsyncClient, pred: Callable[[dict[str, Any] | None], bool]
) -> dict[str, Any]:
    """The first ``/status`` whose ``problem`` satisfies ``pred``: read once, then again
    after each ``problem`` event (subscribed first, so no change slips by)."""
    changed = [trio.Event()]

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "problem":
            changed[0].set()

    async with trio.open_nursery() as nursery:
        await nursery.start(follow_events, str(http.base_url), on_event)
        while True:
            changed[0] = trio.Event()
            st = await status(http)
            if pred(st["problem"]):
                nursery.cancel_scope.cancel()
                return st
            await changed[0].wait()
    raise AssertionError("unreachable")


def says(prefix: str) -> Callable[[dict[str, Any] | None], bool]:
    """Predicate on ``problem``: its words start with ``prefix``."""
    return lambda p: p is not None and p["what"].startswith(prefix)


async def ready(http: httpx.AsyncClient, **params: str) -> tuple[int, dict[str, Any]]:
    r = await http.get("/ready", params=params)
    body: dict[str, Any] = r.json()
    return r.status_code, body


@pytest.mark.integration
async def test_no_daemon_then_no_workload_are_waiting_then_the_request_is_served() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack:
            await stack.stop()  # the dispatcher starts with no slicerd
            port = free_port()  # the replica's, once it runs
            async with dispatcher(stack, f"http://127.0.0.1:{port}") as (d, http):
                st = await until_problem(http, says("daemon unreachable"))
                what = st["problem"]["what"]
                assert what.startswith(f"daemon unreachable ({stack.socket}: "), what
                datetime.fromisoformat(st["problem"]["since"])
                assert st["problem"]["for_s"] >= 0
                code, body = await ready(http)
                assert code == 503 and body == {"ready": False, "reason": what}, body
                await publish(stack, http, "r1")
                r = await http.post("/v1/samples", json={"prompt": "hi", "max_tokens": 4})
                assert r.status_code == 202, r.text  # held durably while nothing can serve
                sid = r.json()["id"]
                st = await status(http)
                assert st["counts"]["pending"] == 1 and st["problem"]["what"] == what
                assert st["state"] in ("backoff", "acquiring", "idle"), st

                await stack.start()
                st = await until_problem(http, says("workload v is not registered"))
                assert "unknown-workload" in st["problem"]["what"] or (
                    "STATUS lists no such workload" in st["problem"]["what"]
                ), st["problem"]
                code, body = await ready(http)
                assert code == 503 and body["reason"].startswith("workload v is not registered")

                async with replica(stack, port=port):
                    await until_problem(http, lambda p: p is None)
                    got = await result_of(http, sid)
                    assert got["status"] == "done" and got["revision"] == "r1", got
                    assert (await ready(http)) == (200, {"ready": True})
                    code, body = await ready(http, revision="r9")
                    assert code == 503 and body["reason"] == "revision r9 is not published"
                    assert (await ready(http, revision="r1")) == (200, {"ready": True})
                    await stop(d)
            assert any("problem: daemon unreachable" in s for s in d.lines), d.output()
            assert any("problem cleared" in s for s in d.lines), d.output()
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_a_replica_down_and_a_load_error_are_named() -> None:
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack) as (_, url):
            flags = ["--max-load-failures", "1000"]  # r2 stays backed off: its problem stays
            async with dispatcher(stack, url, *flags) as (d, http):
                await until_problem(http, lambda p: p is None)
                assert (await ready(http)) == (200, {"ready": True})
                await publish(stack, http, "r1")
                await publish(stack, http, "r2")
                gone = stack.base / "ckpt" / "r2"
                shutil.rmtree(gone)  # deleted after it was published
                r = await http.post("/v1/samples", json={"prompt": "a", "revision": "r2"})
                assert r.status_code == 202, r.text
                st = await until_problem(http, says("last load error (revision r2: "))
                assert "No such file or directory" in st["problem"]["what"], st["problem"]
                assert "r2" in st["load_backoff"], st
                r = await http.post("/v1/completions", json={"prompt": "b", "revision": "r1"})
                assert r.status_code == 200, r.text  # r1 is served meanwhile

                down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
                async with dispatcher(stack, down, state="d2", name="d2") as (d2, http2):
                    st = await until_problem(http2, says("replica unhealthy"))
                    what = st["problem"]["what"]
                    assert what.startswith(f"replica unhealthy ({down}: GET /health: "), what
                    code, body = await ready(http2)
                    assert code == 503 and body["reason"] == what, body
                    await stop(d2)
                await stop(d)
            assert stack.overlaps() == 0
