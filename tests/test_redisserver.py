"""The real-Redis harness (`stubs.redisserver`): what the pool tests, demo and bench rely on.

A real redis-server 7 on a private Unix socket, reached with coredis under trio; a
SIGKILLed server restarted from its AOF (``appendfsync always``) has every acknowledged
write; a paused one is unreachable (a bounded command fails) and answers again after
`resume`; its memory figures; a missing binary is named clearly; nothing left running.
"""

from __future__ import annotations

import os
from pathlib import Path

import coredis
import pytest
import trio

from stubs.redisserver import RedisServer, RedisServerError, find_redis_server, running_redis

pytestmark = pytest.mark.integration


def _client(r: RedisServer) -> coredis.Redis[bytes]:
    return coredis.Redis(unix_socket_path=str(r.socket))


async def test_ping_and_url(tmp_path: Path) -> None:
    with trio.fail_after(20), running_redis(tmp_path) as r:
        assert r.url == f"unix://{r.socket}?db=0"
        assert r.socket.is_socket() and r.pid is not None
        async with _client(r) as client:
            assert await client.ping() == b"PONG"
            assert await client.config_get(["appendonly", "appendfsync", "save", "port"]) == {
                b"appendonly": b"yes",
                b"appendfsync": b"always",
                b"save": b"",
                b"port": b"0",
            }
        pid = r.pid
        assert pid is not None
    assert r.proc is not None and r.proc.returncode is not None and r.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_sigkill_then_restart_keeps_acknowledged_writes(tmp_path: Path) -> None:
    with trio.fail_after(30), running_redis(tmp_path) as r:
        async with _client(r) as client:
            ids = [await client.xadd("s", {"n": str(i)}) for i in range(20)]
        first = r.pid
        r.kill()  # no shutdown: only what the AOF had fsynced survives
        assert r.pid is None
        r.restart()
        assert r.pid not in (None, first)
        async with _client(r) as client:
            entries = await client.xrange("s")
        assert [e.identifier for e in entries] == ids
        assert [e.field_values[b"n"] for e in entries] == [str(i).encode() for i in range(20)]
        assert (tmp_path / "appendonlydir").is_dir()


async def test_paused_is_unreachable_then_resumes(tmp_path: Path) -> None:
    with trio.fail_after(30), running_redis(tmp_path) as r:
        async with _client(r) as client:
            await client.set("k", "before")
            r.pause()
            with pytest.raises(trio.TooSlowError), trio.fail_after(0.5):
                await client.get("k")
            r.resume()
            # The cancelled GET's late reply must not be taken for the next command's.
            assert await client.ping() == b"PONG"
            assert await client.get("missing") is None
            assert await client.get("k") == b"before"
            assert await client.set("k", "after")
        assert r.command("GET", "k") == b"after"


async def test_stop_while_paused_and_info_memory(tmp_path: Path) -> None:
    with trio.fail_after(30), running_redis(tmp_path, appendfsync="everysec") as r:
        info = r.info_memory()
        assert isinstance(info["used_memory"], int) and info["used_memory"] > 0
        assert r.command("CONFIG", "GET", "appendfsync") == [b"appendfsync", b"everysec"]
        r.pause()
        r.stop()  # SIGCONT first: a stopped process would not act on SIGTERM
        assert not r.running and r.proc is not None and r.proc.returncode == 0


async def test_long_dir_gets_a_short_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with trio.fail_after(20):
        r = RedisServer(deep)
        with r:
            assert len(str(r.socket)) < 100 and r.socket.parent != deep
            assert r.command("PING") == b"PONG"
            assert (deep / "redis.log").exists()
        assert not r.socket.parent.exists()
    assert deep.is_dir()  # the data dir stays


async def test_missing_or_broken_binary_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(20):
        monkeypatch.setenv("REDIS_SERVER", str(tmp_path / "nope"))
        with pytest.raises(RedisServerError, match="make test"):
            find_redis_server()
        monkeypatch.delenv("REDIS_SERVER")
        assert find_redis_server()
        r = RedisServer(tmp_path, config={"no-such-directive": "1"})
        with pytest.raises(RedisServerError, match="no-such-directive"):
            r.start()
        assert not r.running
