"""What a pending prompt token costs in Redis when the pending entries are sparse.

    .venv/bin/python bench/pool_sparse.py [--requests N] [--json]

A pool's requests are entries of one stream per revision (``q:REV``). Redis keeps a
stream in nodes (listpacks) of up to ``stream-node-max-bytes`` and
``stream-node-max-entries``; a deleted entry (a request served: COMMIT deletes it) is
only flagged, and a node's memory is freed only once every entry in it is deleted. So
when one entry in K stays pending (a request handed back, retried, or slow, while its
neighbours are served), each still holds its whole node.

For each Redis configuration and prompt size: ``--requests`` prompts are enqueued with
`PoolStore.enqueue` (what a front does), the stream's own memory is read (``MEMORY
USAGE q:r1 SAMPLES 0``) dense, then after deleting all but one entry in each K
(``XDEL``, as COMMIT does) for K = 4, 16 and 64; printed as bytes per pending prompt
token (4 is the packed token ids alone). Every Redis is a real ``redis-server``
(`stubs.redisserver.RedisServer`), removed at the end. No figure is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from gpu_slicer.dispatcher.poolconn import PoolConn
from gpu_slicer.dispatcher.poolscripts import prefix
from gpu_slicer.dispatcher.poolstore import PoolStore
from stubs.redisserver import RedisServer

POOL = "bench"
SPARSITY = (1, 4, 16, 64)  # one entry in K left pending (1: dense)
# (stream-node-max-bytes, stream-node-max-entries): Redis' defaults, what the tests,
# demo and manifests used, and one entry a node at each size.
CONFIGS = [("4096", "100"), ("65536", "100"), ("65536", "16"), ("4096", "1"), ("65536", "1")]
PROMPTS = (1000, 100)  # tokens a prompt


async def _measure(base: Path, node_bytes: str, node_entries: str, tokens: int,
                   n: int) -> dict[int, float]:  # fmt: skip
    config = {"stream-node-max-bytes": node_bytes, "stream-node-max-entries": node_entries}
    out: dict[int, float] = {}
    for k in SPARSITY:
        with RedisServer(base / f"r-{node_bytes}-{node_entries}-{tokens}-{k}",
                         config=config) as r:  # fmt: skip
            async with PoolConn(r.url, POOL) as conn:
                store = PoolStore(conn, "bench")
                await store.publish("r1", "/ckpt/r1")
                for start in range(0, n, 100):
                    await store.enqueue([
                        store.prepare("completion", {"prompt": list(range(i, i + tokens)),
                                                     "max_tokens": 16}, "r1", 3600.0)
                        for i in range(start, min(n, start + 100))
                    ])  # fmt: skip
            q = prefix(POOL) + "q:r1"
            entries = r.command("XRANGE", q, "-", "+")
            assert isinstance(entries, list)
            ids = [e[0] for e in entries]
            gone = [i for j, i in enumerate(ids) if j % k]
            for at in range(0, len(gone), 500):
                r.command("XDEL", q, *gone[at : at + 500])
            left = len(ids) - len(gone)
            used = r.command("MEMORY", "USAGE", q, "SAMPLES", "0")
            assert isinstance(used, int)
            out[k] = used / (left * tokens)
    return out


async def run(n: int) -> list[dict[str, Any]]:
    """Every configuration and prompt size: bytes per pending token by sparsity."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparse-") as tmp:
        for node_bytes, node_entries in CONFIGS:
            for tokens in PROMPTS:
                got = await _measure(Path(tmp), node_bytes, node_entries, tokens, n)
                per = {str(k): round(v, 3) for k, v in got.items()}
                rows.append({"stream_node_max_bytes": int(node_bytes),
                             "stream_node_max_entries": int(node_entries),
                             "prompt_tokens": tokens, "bytes_per_token": per})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args()
    rows = trio.run(run, opts.requests)
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"Redis memory of the stream per pending prompt token ({opts.requests} requests; "
          "one in K left pending; 4.0 = the token ids alone)")  # fmt: skip
    head = "  node bytes  node entries  prompt tokens  " + "  ".join(
        "dense" if k == 1 else f"1 in {k:<2}" for k in SPARSITY
    )
    print(head)
    for row in rows:
        b = row["bytes_per_token"]
        cells = "  ".join(f"{b[str(k)]:>7.2f}" for k in SPARSITY)
        print(f"  {row['stream_node_max_bytes']:>10}  {row['stream_node_max_entries']:>12}  "
              f"{row['prompt_tokens']:>13}  {cells}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
