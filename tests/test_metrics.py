"""Prometheus metrics: slicerd's opt-in listener (`metrics_listen`) scraped while real turns
park and restore on the fake GPU, a hostile scraper that must stall nothing, bad and busy
addresses, and the dispatcher's ``/metrics`` read by the same parser."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from gpu_slicer.dispatcher.http import build_app
from gpu_slicer.dispatcher.metrics import render_metrics
from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.dispatcher.poolconn import PoolConn
from gpu_slicer.dispatcher.poollink import PoolLink
from gpu_slicer.dispatcher.poolstore import PoolStore
from gpu_slicer.dispatcher.turns import TurnLoop
from gpu_slicer.dispatcher.vllm import Replica
from gpu_slicer.slicer.config import load
from gpu_slicer.slicer.errors import ConfigError
from gpu_slicer.slicer.metrics_http import READ_TIMEOUT
from stubs.fakegpu import Ledger
from stubs.proc import child_env, free_port
from stubs.redisserver import RedisServer
from tests.harness import GiB, running_stack
from tests.test_dispatcher_journal import BODY, journal_loop
from tests.test_dispatcher_model import FakeSlicer
from tests.test_dispatcher_vllm import FakeVllm

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and each family's type by name."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when the series has no sample yet, as Prometheus reads it)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(http: httpx.AsyncClient) -> Samples:
    r = await http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    assert r.headers["connection"] == "close"
    return parse(r.text)[0]


@pytest.mark.integration
async def test_a_scrape_counts_turns_parks_restores_queues_and_foreign_bytes() -> None:
    port = free_port()
    with trio.fail_after(90):
        async with (
            running_stack("--metrics-listen", f"127.0.0.1:{port}") as stack,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http,
        ):
            a_pid, b_pid = stack.sleeper(), stack.sleeper()
            stack.sleeper(5 * GiB, gpu=1, label="someone-else")  # no workload's: foreign
            reg_a, reg_b = await stack.client(), await stack.client()
            await reg_a.register("a", pid=a_pid)
            await reg_b.register("b", pid=b_pid, parked_max="1GiB")
            ca, cb = await stack.client(), await stack.client()
            t1 = await ca.acquire("a")
            stack.ledger.alloc(a_pid, 0, 30 * GiB, workload="a")
            turns = {}

            async def take(client: object, name: str) -> None:
                turns[name] = await client.acquire(name)  # type: ignore[attr-defined]

            async with trio.open_nursery() as n:
                n.start_soon(take, cb, "b")
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["b"])
                m = await scrape(http)
                assert value(m, "slicer_queue_length", gpu="0") == 1
                assert value(m, "slicer_queue_length", gpu="1") == 0
                assert value(m, "slicer_turn_held", gpu="0") == 1
                assert value(m, "slicer_gpu_foreign_bytes", gpu="1") == 5 * GiB
                assert value(m, "slicer_gpu_foreign_bytes", gpu="0") == 0
                assert value(m, "slicer_gpu_resident_bytes", gpu="0") == 30 * GiB
                assert value(m, "slicer_gpu_used_bytes", gpu="0") == 30 * GiB
                assert value(m, "slicer_gpu_total_bytes", gpu="0") == 80 * GiB
                assert value(m, "slicer_workloads", state="active") == 1
                assert value(m, "slicer_connections") >= 4
                await ca.release(t1)  # a is parked (checkpointed), then b granted
            stack.ledger.alloc(b_pid, 0, 512 << 20, workload="b")  # within its parked_max
            async with trio.open_nursery() as n:
                n.start_soon(take, ca, "a")
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["a"])
                await cb.release(turns["b"])  # b parked, a restored and granted
            assert turns["a"].restored
            st = await stack.status()
            m = await scrape(http)
            assert value(m, "slicer_turns_granted_total", gpu="0", workload="a") == 2
            assert value(m, "slicer_turns_granted_total", gpu="0", workload="b") == 1
            ended = {"gpu": "0", "how": "released"}
            assert value(m, "slicer_turns_ended_total", workload="a", **ended) == 1
            assert value(m, "slicer_turns_ended_total", workload="b", **ended) == 1
            assert value(m, "slicer_acquire_wait_seconds_count", gpu="0") == 3
            parks = sum(
                value(m, "slicer_park_seconds_count", gpu="0", how=how)
                for how in ("checkpoint", "cooperative")
            )
            assert parks == st["totals"]["parks"] == 2  # a, then b: both checkpointed
            assert value(m, "slicer_park_seconds_count", gpu="0", how="checkpoint") == 2
            assert value(m, "slicer_park_bytes_total", gpu="0") >= 30 * GiB
            assert value(m, "slicer_restore_seconds_count", gpu="0") == 1
            assert value(m, "slicer_restore_bytes_total", gpu="0") == 30 * GiB
            assert value(m, "slicer_parks_failed_total", gpu="0") == 0
            assert value(m, "slicer_faults_total", gpu="0", reason="park-failed") == 0
            assert value(m, "slicer_queue_length", gpu="0") == 0
            assert value(m, "slicer_workloads", state="active") == 1
            assert value(m, "slicer_workloads", state="parked") == 1
            assert value(m, "slicer_journal_ok") == 1
            for c in (ca, cb, reg_a, reg_b):
                await c.aclose()
            assert stack.overlaps() == 0


async def _read_all(stream: trio.SocketStream) -> bytes:
    out = b""
    while data := await stream.receive_some(65536):
        out += data
    return out


@pytest.mark.integration
async def test_a_hostile_scraper_stalls_neither_scrapes_nor_the_daemon() -> None:
    port = free_port()
    with trio.fail_after(60):
        async with (
            running_stack("--metrics-listen", f"127.0.0.1:{port}", gpus=1) as stack,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http,
        ):
            silent = await trio.open_tcp_stream("127.0.0.1", port)
            garbage = await trio.open_tcp_stream("127.0.0.1", port)
            await garbage.send_all(b"\x16\x03\x01\x02\x00 not http, never ends" * 20)
            # While both are open: a scrape is answered, and so is the daemon's socket.
            await scrape(http)
            async with await stack.client() as c:
                await c.ping()
            # A request that is not HTTP, a head past 8 KiB, other paths and methods.
            async with await trio.open_tcp_stream("127.0.0.1", port) as bad:
                await bad.send_all(b"BREW /pot HTCPCP/1.0\r\n\r\n")
                assert (await _read_all(bad)).startswith(b"HTTP/1.1 400 ")
            async with await trio.open_tcp_stream("127.0.0.1", port) as big:
                await big.send_all(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (9 << 10))
                assert (await _read_all(big)).startswith(b"HTTP/1.1 431 ")
            assert (await http.get("/status")).status_code == 404
            r = await http.post("/metrics", content=b"x")
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
            # The silent and the garbage connections are dropped after the read timeout.
            with trio.fail_after(READ_TIMEOUT + 15):
                assert await _read_all(silent) == b""
                assert await _read_all(garbage) == b""
            await silent.aclose()
            await garbage.aclose()
            await scrape(http)
            async with await stack.client() as c:
                await c.ping()
            assert stack.overlaps() == 0


GOOD = [("127.0.0.1:9403", "127.0.0.1:9403"), ("[::1]:0", "[::1]:0"), ("", "")]
BAD = ["nope", "127.0.0.1", ":9403", "127.0.0.1:99999", "127.0.0.1:port", "a b:1"]


@pytest.mark.parametrize(("given", "kept"), GOOD)
def test_metrics_listen_accepts_host_port_or_nothing(tmp_path: Path, given: str, kept: str) -> None:
    conf = tmp_path / "slicer.toml"
    conf.write_text(f'metrics_listen = "{given}"\n')
    assert load(str(conf)).metrics_listen == kept
    assert load(str(conf), {"metrics_listen": None}).metrics_listen == kept


@pytest.mark.parametrize("given", BAD)
def test_a_bad_metrics_listen_is_refused_with_the_form_it_needs(tmp_path: Path, given: str) -> None:
    conf = tmp_path / "slicer.toml"
    conf.write_text("")
    with pytest.raises(ConfigError) as e:
        load(str(conf), {"metrics_listen": given})
    assert str(e.value) == (
        "metrics_listen must be HOST:PORT (e.g. 127.0.0.1:9403, port 0 for any free one), "
        f"got {given!r}"
    )
    conf.write_text("metrics_listen = 9403\n")
    with pytest.raises(ConfigError, match="config key metrics_listen: bad value 9403"):
        load(str(conf))


def _daemon(tmp_path: Path, *flags: str) -> list[str]:
    Ledger.init(tmp_path / "gpu", 1, GiB)
    argv = [sys.executable, "-m", "gpu_slicer.slicer.daemon", "--gpu-backend", "fake"]
    argv += ["--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state")]
    return [*argv, "--config", str(tmp_path / "slicer.toml"), *flags]


async def _run(argv: list[str], tmp_path: Path) -> tuple[int, list[str]]:
    (tmp_path / "slicer.toml").write_text("")
    env = child_env({"FAKEGPU_DIR": str(tmp_path / "gpu")})
    res = await trio.run_process(argv, check=False, capture_stderr=True, env=env)
    return res.returncode, res.stderr.decode().splitlines()


@pytest.mark.integration
async def test_a_bad_metrics_listen_flag_stops_slicerd_with_one_line(tmp_path: Path) -> None:
    with trio.fail_after(60):
        rc, lines = await _run(_daemon(tmp_path, "--metrics-listen", "localhost"), tmp_path)
    assert rc == 78
    assert lines == [
        "slicerd: error: metrics_listen must be HOST:PORT (e.g. 127.0.0.1:9403, port 0 for "
        "any free one), got 'localhost'"
    ]


@pytest.mark.integration
async def test_a_busy_metrics_port_stops_slicerd_before_it_serves(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with trio.fail_after(60):
            argv = _daemon(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
            rc, lines = await _run(argv, tmp_path)
    assert rc == 69  # EX_UNAVAILABLE, not 78: a port held by another may be free next start
    assert lines == [
        f"slicerd: error: metrics_listen 127.0.0.1:{port}: cannot listen: Address already in "
        "use (another process holds that port: pick another metrics_listen)"
    ]
    assert not (tmp_path / "s.sock").exists()  # it stopped cleanly: socket removed


DISPATCH_SERIES = {
    "slicer_dispatch_pending": "gauge",
    "slicer_dispatch_in_flight": "gauge",
    "slicer_dispatch_store_damaged": "gauge",
    "slicer_dispatch_load_backoff_seconds": "gauge",  # no sample unless backed off
    "slicer_dispatch_load_backoff_failures": "gauge",
    **{
        f"slicer_dispatch_{name}": "counter"
        for name in [
            *("done", "failed", "turns", "turn_errors", "loads", "load_failures", "sends"),
            *("batched_samples", "send_errors", "commits", "expired", "wasted_turns", "rejects"),
        ]
    },
}


async def test_the_dispatchers_metrics_parse_with_every_series(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with journal_loop(tmp_path, turns=True) as (_, http):
            r = await http.post("/v1/samples/batch", json={"requests": [BODY] * 3})
            ids = [s["id"] for s in r.json()["samples"]]
            r = await http.post("/v1/samples/results", json={"ids": ids, "wait": 300})
            assert [x["status"] for x in r.json()["results"]] == ["done"] * 3
            r = await http.get("/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain; version=")
            # The classic text format's type, as before prometheus-client: scrapers that
            # negotiated 0.0.4 see what they saw.
            assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            samples, types = parse(r.text)
            assert types == DISPATCH_SERIES
            assert value(samples, "slicer_dispatch_done_total", pool="pool-a") == 3
            assert value(samples, "slicer_dispatch_commits_total", pool="pool-a") == 3
            assert value(samples, "slicer_dispatch_pending", pool="pool-a") == 0
            assert value(samples, "slicer_dispatch_store_damaged", pool="pool-a") == 0
            assert value(samples, "slicer_dispatch_turns_total", pool="pool-a") >= 1
            # Every sample carries the pool, as the hand-written text did.
            assert all(dict(labels)["pool"] == "pool-a" for _, labels in samples)


@pytest.mark.integration
async def test_an_unregistered_workloads_series_are_removed() -> None:
    """A node that sees a new workload name per job keeps as many turn series as it has
    workloads: unregistering one removes every series labelled with it."""
    port = free_port()
    names = [f"job-{i}" for i in range(5)]
    with trio.fail_after(90):
        async with (
            running_stack("--metrics-listen", f"127.0.0.1:{port}", gpus=1) as stack,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http,
        ):
            async with await stack.client() as c:
                for name in names:
                    await c.register(name, pid=stack.sleeper())
                    await c.release(await c.acquire(name))
                m = await scrape(http)
                for name in names:
                    assert value(m, "slicer_turns_granted_total", gpu="0", workload=name) == 1
                for name in names[:4]:
                    await c.unregister(name)
                m = await scrape(http)
            labelled = {dict(labels).get("workload") for _, labels in m}
            assert labelled - {None} == {names[4]}  # only the one still registered
            assert value(m, "slicer_turns_granted_total", gpu="0", workload=names[4]) == 1
            assert value(m, "slicer_acquire_wait_seconds_count", gpu="0") == 5  # unlabelled
            assert stack.overlaps() == 0


async def _render_server(nursery: trio.Nursery) -> int:
    from gpu_slicer.slicer.metrics_http import serve

    async def render() -> tuple[bytes, str]:
        return b"slicer_up 1\n", "text/plain; version=0.0.4"

    addresses = await nursery.start(serve, "127.0.0.1:0", render)
    return int(addresses[0][1])


async def _ask(port: int, request: bytes) -> bytes:
    async with await trio.open_tcp_stream("127.0.0.1", port) as s:
        await s.send_all(request)
        return await _read_all(s)


async def test_a_head_of_exactly_8_kib_is_served_and_one_byte_more_is_431() -> None:
    from gpu_slicer.slicer.metrics_http import MAX_HEAD

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            port = await _render_server(n)
            start = b"GET /metrics HTTP/1.1\r\nX-Pad: "
            for size, status in [(MAX_HEAD, b"200"), (MAX_HEAD + 1, b"431")]:
                head = start + b"a" * (size - len(start))
                assert len(head) == size
                for end in (b"\r\n\r\n", b"\n\n"):
                    got = await _ask(port, head + end)
                    assert got.startswith(b"HTTP/1.1 " + status + b" "), (size, end, got[:40])
            n.cancel_scope.cancel()


async def test_a_scrape_over_the_connection_cap_is_answered_503_not_reset() -> None:
    from gpu_slicer.slicer.metrics_http import MAX_CONNECTIONS

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            port = await _render_server(n)
            idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
            # The idle ones hold every slot (a slowloris): the next scraper learns why.
            await trio.testing.wait_all_tasks_blocked()
            got = await _ask(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 503 "), got[:80]
            assert b"\r\nRetry-After: 1\r\n" in got and b"\r\nConnection: close\r\n" in got
            for s in idle:
                await s.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert (await _ask(port, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            n.cancel_scope.cancel()


def test_ipv6_metrics_addresses_are_bracketed_in_urls() -> None:
    from gpu_slicer.slicer.metrics_http import _host

    assert _host("::1") == "[::1]"
    assert _host("127.0.0.1") == "127.0.0.1"


@pytest.mark.integration  # a real redis-server
async def test_pool_mode_metrics_show_the_pool_and_this_replicas_claims(tmp_path: Path) -> None:
    with trio.fail_after(60), RedisServer(tmp_path / "redis") as redis:
        ckpt = tmp_path / "ckpt" / "r1"
        ckpt.mkdir(parents=True)
        (ckpt / "revision.txt").write_text("r1")
        async with (
            PoolConn(redis.url, "pool-p") as conn,
            Replica("http://vllm", transport=httpx.MockTransport(FakeVllm())) as replica,
        ):
            store = PoolStore(conn, "node-a")
            cfg = TurnConfig(workload="v")
            loop = TurnLoop(store, replica, cfg, connect=FakeSlicer().connect,
                            pool=PoolLink(store, cfg.concurrency))  # fmt: skip
            await loop.publish_async("r1", str(ckpt))
            async with trio.open_nursery() as nursery:
                await nursery.start(loop.run)
                transport = httpx.ASGITransport(app=build_app(loop))
                async with httpx.AsyncClient(transport=transport, base_url="http://f") as http:
                    r = await http.post("/v1/samples/batch", json={"requests": [BODY] * 3})
                    ids = [s["id"] for s in r.json()["samples"]]
                    r = await http.post("/v1/samples/results", json={"ids": ids, "wait": 300})
                    assert [x["status"] for x in r.json()["results"]] == ["done"] * 3
                nursery.cancel_scope.cancel()  # the loop stops: what follows stays put
            # Another replica's claim, and one of this replica's, on a fresh request each.
            other = PoolStore(conn, "node-b")
            await other.refresh_revisions()
            await other.enqueue([other.prepare("completion", BODY, "r1", 60) for _ in range(3)])
            assert await other.claim("r1", 1) == 1
            assert await store.claim("r1", 1) == 1
            await store.poll()  # what the ticker does every second
            samples, types = parse(render_metrics(loop).decode())
    pool = {"pool": "pool-p"}
    assert value(samples, "slicer_dispatch_pool_pending", revision="r1", **pool) == 3
    assert value(samples, "slicer_dispatch_pool_unclaimed", revision="r1", **pool) == 1
    assert value(samples, "slicer_dispatch_pool_reclaimable", revision="r1", **pool) == 0
    oldest = value(samples, "slicer_dispatch_pool_oldest_pending_seconds", revision="r1", **pool)
    assert 0 <= oldest < 60
    assert value(samples, "slicer_dispatch_pool_claimed", consumer=store.consumer, **pool) == 1
    assert value(samples, "slicer_dispatch_pool_claimed", consumer=other.consumer, **pool) == 1
    assert value(samples, "slicer_dispatch_pool_committed_total", **pool) == 3
    assert value(samples, "slicer_dispatch_pool_served_total", replica="node-a", **pool) == 3
    for name in ("failed", "duplicates", "reclaimed"):
        assert value(samples, f"slicer_dispatch_pool_{name}_total", **pool) == 0
    assert value(samples, "slicer_dispatch_pool_redis_up", **pool) == 1
    assert value(samples, "slicer_dispatch_pool_claimed_here", **pool) == 1
    assert value(samples, "slicer_dispatch_pool_claims_here_total", **pool) >= 4
    assert value(samples, "slicer_dispatch_pool_lost_claims_total", **pool) == 0
    assert value(samples, "slicer_dispatch_done_total", **pool) == 3
    assert {n for n in types if n.startswith("slicer_dispatch_pool_")} == POOL_SERIES
    assert all(dict(labels)["pool"] == "pool-p" for _, labels in samples)


POOL_SERIES = {
    f"slicer_dispatch_pool_{n}"
    for n in [
        *("pending", "unclaimed", "reclaimable", "oldest_pending_seconds", "claimed"),
        *("committed", "failed", "duplicates", "reclaimed", "returned", "aside", "served"),
        *("redis_up", "claimed_here", "claims_here", "reclaimed_here", "returned_here"),
        *("duplicates_here", "lost_claims"),
    ]
}
