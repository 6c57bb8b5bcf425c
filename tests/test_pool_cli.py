"""`slicer-pool`: a pool's status read from a real Redis by the real command (a child).

The pool is set up in-process with :class:`PoolStore` (two replicas' claims, a result,
a hand-back) and a replica's figures written by :class:`PoolLink`'s own reporter; the
command must show per revision, per replica and the counters what Redis holds, list the
pools, list the revisions, and fail in one line with the documented codes.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio

from gpu_slicer.dispatcher.poolconn import PoolConn
from gpu_slicer.dispatcher.poollink import PoolLink
from gpu_slicer.dispatcher.poolstore import PoolStore
from gpu_slicer.dispatcher.rows import Finish
from stubs.redisserver import RedisServer
from tests.clitable import CliResult, arun_cli, assert_one_line

pytestmark = pytest.mark.integration

CLI = ["-m", "gpu_slicer.dispatcher.poolcli"]
DOWN = (
    r"^slicer-pool: error: redis unix://.*: Unable to establish a connection .* "
    r"\(is Redis running there\? check --queue\)$"
)
FIGURES = {  # the shape of TurnLoop._figures
    "workload": "v", "replica_url": "http://127.0.0.1:8000", "state": "serving", "turn": 7,
    "loaded_revision": "r1", "claimed": 1, "in_flight": 1, "turns": 4, "turn_errors": 0,
    "commits": 1, "loads": 2, "load_failures": 1, "problem": None,
    "load_backoff": {"r9": {"failures": 1, "refused": 1, "retry_in_s": 3.0,
                            "error": "vLLM refused the load: 400"}},
}  # fmt: skip


async def run(r: RedisServer, *args: str) -> CliResult:
    return await arun_cli([*CLI, "--queue", r.url, *args], timeout=60)


@asynccontextmanager
async def populated(tmp_path: Path) -> AsyncIterator[tuple[RedisServer, dict[str, Any]]]:
    """Pool ``pa``: r1 (5 requests) and r2 (3); node-a claimed 3 of r1, committed one,
    kept one and handed one back; node-b's consumer holds 2 of r2 with no report; node-a
    reported; node-c is named in the set but its report expired. Also pool ``pb``."""
    with RedisServer(tmp_path / "redis") as r:
        async with PoolConn(r.url, "pa") as c, PoolConn(r.url, "pb") as cb:
            a, b = PoolStore(c, "node-a"), PoolStore(c, "node-b")
            await a.publish("r1", "/ckpt/r1")
            await a.publish("r2", "/ckpt/r2")
            await PoolStore(cb, "node-x").publish("q1", "/ckpt/q1")
            body = {"prompt": [1, 2], "max_tokens": 2}
            await a.enqueue([a.prepare("completion", body, "r1", 3600) for _ in range(5)])
            await a.enqueue([a.prepare("completion", body, "r2", 3600) for _ in range(3)])
            assert await a.claim("r1", 3) == 3
            first, kept, _ = (p.id for p in a.pending())
            assert await a.commit([Finish(first, "done", b"{}")]) == [True]
            assert await a.give_back({kept}) == 1
            assert await b.claim("r2", 2) == 2
            link = PoolLink(a, 8)
            link.bind(lambda: None, lambda: dict(FIGURES))
            await link._report()  # what the ticker writes every 2 s
            await c.command("sadd", "replicas", ["node-c"])
            yield r, {"a": a.consumer, "b": b.consumer}


async def test_status_shows_revisions_replicas_and_counters(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with populated(tmp_path) as (r, consumers):
            a_reclaim_idle = PoolStore.__init__.__kwdefaults__["reclaim_idle"]
            res = await run(r, "status", "--pool", "pa", "--json")
            assert res.rc == 0, res.describe()
            st = json.loads(res.stdout)
            r1, r2 = st["revisions"]["r1"], st["revisions"]["r2"]
            # r1: 2 never delivered; 2 in the group's list: node-a's kept one and the one
            # it handed back, which is claimable at once ("reclaimable").
            assert (r1["pending"], r1["unclaimed"], r1["claimed"], r1["reclaimable"]) == (
                4, 2, 2, 1
            )  # fmt: skip
            assert (r2["pending"], r2["unclaimed"], r2["claimed"], r2["reclaimable"]) == (
                3, 1, 2, 0
            )  # fmt: skip
            assert 0 <= r1["oldest_age_s"] < 60
            a = st["replicas"]["node-a"]
            assert a["claimed"] == 1  # Redis' count for its consumer
            assert a["consumer"] == consumers["a"]
            assert (a["state"], a["loaded_revision"], a["turns"], a["commits"]) == (
                "serving", "r1", 4, 1
            )  # fmt: skip
            assert (a["loads"], a["load_failures"], a["served"]) == (2, 1, 1)
            assert a["load_error"] == "r9: vLLM refused the load: 400"
            assert not a["stale"] and 0 <= a["report_age_s"] < 30
            c = st["replicas"]["node-c"]
            assert c["stale"] and c["report_age_s"] is None and c["state"] is None
            assert st["orphan_claims"] == {consumers["b"]: 2}  # no report names it
            assert st["returned"] == 1
            assert st["stats"] == {"committed": 1, "failed": 0, "duplicates": 0,
                                   "reclaimed": 0, "returned": 1, "aside": 0}  # fmt: skip
            # The replicas' own bound, as node-a reported it (its PoolStore's default).
            assert st["reclaim_idle_s"] == a_reclaim_idle

            res = await run(r, "status", "--pool", "pa")
            assert res.rc == 0 and res.stderr == "", res.describe()
            rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line}
            assert rows["revision"] == ["revision", "pending", "unclaimed", "claimed",
                                        "reclaimable", "oldest"]  # fmt: skip
            assert rows["r1"][1:5] == ["4", "2", "2", "1"]
            assert rows["r2"][1:5] == ["3", "1", "2", "0"]
            assert rows["node-a"][1:9] == ["1", "serving", "r1", "4", "1", "2", "1", "1"]
            assert re.search(r"s ago\s+r9: vLLM refused the load: 400$", res.stdout, re.M)
            assert re.search(r"^node-c .* none \(stale\)", res.stdout, re.M)
            assert f"{consumers['b']} (2)" in res.stdout
            counters = "committed 1  failed 0  duplicates 0  reclaimed 0  returned 1  aside 0"
            assert counters in res.stdout


async def test_the_pools_and_the_revisions_are_listed(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with populated(tmp_path) as (r, _):
            res = await run(r, "status", "--json")
            assert res.rc == 0, res.describe()
            assert json.loads(res.stdout) == {"pools": [
                {"pool": "pa", "pending": 7, "revisions": 2, "replicas": 1},
                {"pool": "pb", "pending": 0, "revisions": 1, "replicas": 0},
            ]}  # fmt: skip
            res = await run(r, "revisions", "--pool", "pa", "--json")
            assert res.rc == 0, res.describe()
            revs = json.loads(res.stdout)["revisions"]
            assert list(revs) == ["r1", "r2"]  # oldest first
            assert [(v["path"], v["seq"], v["pending"]) for v in revs.values()] == [
                ("/ckpt/r1", 1, 4), ("/ckpt/r2", 2, 3)
            ]  # fmt: skip
            res = await run(r, "revisions", "--pool", "pa")
            lines = res.stdout.splitlines()
            assert lines[0].split() == ["revision", "seq", "published", "pending", "path"]
            assert lines[1].split()[:2] == ["r1", "1"] and lines[1].endswith("/ckpt/r1")


async def test_failures_are_one_line_with_their_codes(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with populated(tmp_path) as (r, _):
            assert_one_line(await run(r, "status", "--pool", "nope"), 66,
                            r"^slicer-pool: error: pool 'nope' has nothing in the Redis at "
                            r"unix://.* lists the pools there\)$")  # fmt: skip
            assert_one_line(await run(r, "status", "--pool", "bad name"), 64,
                            r"^slicer-pool: error: Invalid value for '--pool'")  # fmt: skip
            bad = await arun_cli([*CLI, "--queue", "http://redis:6379", "status"])
            assert_one_line(bad, 64, r"^slicer-pool: error: Invalid value for '--queue': "
                            r"'http://redis:6379' is not redis://HOST")  # fmt: skip
            r.kill()
            for args in (["status"], ["status", "--pool", "pa"], ["revisions", "--pool", "pa"]):
                assert_one_line(await run(r, *args), 69, DOWN)


async def test_a_redis_password_works_from_a_file_or_the_environment_and_never_shows(
    tmp_path: Path,
) -> None:
    """A pool's Redis with ``requirepass``: the password is taken from the URL, a file
    (``--queue-password-file``: a mounted Secret) or ``$SLICER_REDIS_PASSWORD``; no output,
    error or status shows it, in any URL form, right or wrong."""
    secret, wrong = "S3c/ret?pw#1", "Wr0ng-pw_2"  # '/', '?', '#': percent-encoded in a URL
    with trio.fail_after(60), RedisServer(tmp_path / "redis") as r:
        r.command("CONFIG", "SET", "requirepass", secret)
        async with PoolConn(r.url, "pa", password=secret) as c:
            await PoolStore(c, "node-a").publish("r1", "/ckpt/r1")
            assert secret not in json.dumps(c.health())
        (tmp_path / "pw").write_text(f"{secret}\n")
        base = [*CLI, "--queue", r.url]
        ok = [
            await arun_cli([*base, "--queue-password-file", str(tmp_path / "pw"), "status",
                            "--pool", "pa", "--json"]),
            await arun_cli([*base, "status", "--pool", "pa", "--json"],
                           env={"SLICER_REDIS_PASSWORD": secret}),
            await arun_cli([*CLI, "--queue",
                            r.url.replace("unix://", f"unix://:{quote(secret, safe='')}@"),
                            "status", "--pool", "pa", "--json"]),
            # An ACL user name alone holds no password: the environment's goes with it.
            await arun_cli([*CLI, "--queue", r.url.replace("unix://", "unix://default@"),
                            "status", "--pool", "pa", "--json"],
                           env={"SLICER_REDIS_PASSWORD": secret}),
        ]  # fmt: skip
        for res in ok:
            assert res.rc == 0 and "r1" in json.loads(res.stdout)["published"], res.describe()
            said = res.stdout + res.stderr
            assert secret not in said and quote(secret, safe="") not in said, res.describe()
        refused = [
            await run(r, "status", "--pool", "pa"),  # none given
            await arun_cli([*CLI, "--queue", r.url.replace("unix://", f"unix://:{wrong}@"),
                            "status"]),
            await arun_cli([*CLI, "--queue", f"{r.url}&password={wrong}", "status"]),
            await arun_cli([*base, "status"], env={"SLICER_REDIS_PASSWORD": wrong}),
        ]  # fmt: skip
        for res in refused:
            assert res.rc == 69, res.describe()
            said = res.stdout + res.stderr
            assert secret not in said and wrong not in said, res.describe()
        assert "***" in refused[1].stderr and "***" in refused[2].stderr
