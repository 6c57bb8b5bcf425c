"""A pool revision that no replica can load (its checkpoint removed after publish), over
the real processes of one simulated node (`stubs.poolnodes`: real redis-server, slicerd
on the fake GPU, trainer stub, vLLM stub under the launcher, pool-mode dispatcher).

Each try to load it costs the node's trainer a park. The replica backs the revision off
4x a refusal (1, 4, 16 s, ... up to ``--load-backoff-max``), where it used to double to
30 s and try every 30 s until the deadline; the request fails at its deadline with the
load error named; the backoff shows in ``/status``, ``/metrics`` and ``slicer-pool
status``. The schedule's parks per hour are counted in tests/test_dispatcher_core.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from stubs.poolnodes import publish, results, running_pool, submit_many
from stubs.redisserver import RedisServer
from stubs.stack import workload

pytestmark = pytest.mark.integration

DEADLINE_S = 12.0


def pool_status(redis: RedisServer, pool: str) -> dict[str, object]:
    """``slicer-pool --queue URL status --pool P --json`` (the real command, a child)."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "slicer-pool"), "--queue", redis.url,
         "status", "--pool", pool, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    got: dict[str, object] = json.loads(out.stdout)
    return got


async def test_a_revision_no_replica_can_load_backs_off_and_fails_at_its_deadline(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60), RedisServer(tmp_path / "redis") as redis:
        dargs = ["--turn-seconds", "0.3", "--turn-grace", "1", "--concurrency", "8"]
        dargs += ["--sample-deadline", str(DEADLINE_S)]
        async with running_pool(1, redis, dispatch_args=dargs) as pool:
            node = pool.nodes[0]
            path = await publish(node.front, "r1", pool.base)
            shutil.rmtree(path)  # a retention policy took it after publish
            before = workload(await node.stack.status(), "trainer") or {}
            [sample] = await submit_many([node.front], 1, revision="r1")
            got = (await results(node.front, [sample.id]))[sample.id]
            after = workload(await node.stack.status(), "trainer") or {}
            assert got["status"] == "failed", got
            err = got["error"]["message"] if isinstance(got["error"], dict) else got["error"]
            assert err.startswith("deadline exceeded: pool pa revision r1"), err
            assert "its weights could not be loaded: replica node0 (this one):" in err, err
            assert "No such file or directory" in err, err  # vLLM's own words (path hidden)

            st = await node.status()
            b = st["load_backoff"]["r1"]
            # 1, 4, 16 s between tries: at most 3 in the 12 s (before: 1, 2, 4, 8 s, 4).
            assert 1 <= b["refused"] == b["failures"] <= 3, b
            assert b["delay_s"] == 4.0 ** (b["refused"] - 1), b
            parks = after.get("parks", 0) - before.get("parks", 0)
            assert parks <= b["refused"], (parks, b)  # one park a try, no more
            assert st["counters"]["load_failures"] == b["failures"], st["counters"]

            async with httpx.AsyncClient(base_url=node.front, timeout=10) as http:
                text = (await http.get("/metrics")).text
            line = 'slicer_dispatch_load_backoff_failures{pool="pa",revision="r1"}'
            assert f"{line} {float(b['failures'])}" in text, text
            assert 'slicer_dispatch_load_backoff_seconds{pool="pa",revision="r1"}' in text

            cli = await trio.to_thread.run_sync(pool_status, redis, pool.name)
            rep = cli["replicas"]["node0"]  # type: ignore[index]
            assert "No such file or directory" in rep["load_error"], rep
            assert rep["load_backoff"]["r1"]["refused"] >= 1, rep
            print(f"unloadable revision: {parks} trainer parks in {DEADLINE_S:g} s, "
                  f"backoff {b}")  # fmt: skip
            pool.check_alive()
