"""The pool's figures as one read sees them: per revision, per consumer, the counters.

Read by every dispatcher's ticker (``/status``'s ``pool_mode``, ``/metrics``, whether to
ask for a turn) and by ``slicer-pool status``; nothing here writes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gpu_slicer.dispatcher.poolconn import PoolConn

__all__ = ["STATS", "PoolSummary", "entry_ms", "read_reports", "read_summary"]

# The pool's counters.
STATS = ("committed", "failed", "duplicates", "reclaimed", "returned", "aside")


def entry_ms(eid: bytes | str) -> int:
    """A stream entry id's time part: Redis' clock (ms) when the entry was added."""
    text = eid.decode() if isinstance(eid, bytes) else eid
    return int(text.split("-", 1)[0])


class PoolSummary:
    """The pool as the last :func:`read_summary` saw it (``/status``)."""

    def __init__(self) -> None:
        self.revisions: dict[str, dict[str, Any]] = {}  # rev -> unclaimed, reclaimable, ...
        self.claimed: dict[str, int] = {}  # consumer -> entries it holds
        self.stats: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self.at: float | None = None  # wall clock of the poll

    @property
    def claimable(self) -> int:
        """Entries any replica may claim now (never delivered, returned or reclaimable)."""
        return sum(r["unclaimed"] + r["reclaimable"] for r in self.revisions.values())


async def read_summary(conn: PoolConn, reclaim_idle: float) -> PoolSummary:
    """The pool's queue figures and counters now (entries idle past ``reclaim_idle`` s
    count as reclaimable)."""
    revs, owners = await conn.script("POLL", int(reclaim_idle * 1000))
    stats = await conn.command("hgetall", "stats")
    served = await conn.command("hgetall", "served")
    s = PoolSummary()
    now = time.time()
    for rev_b, un, rc, claimed, oldest in revs:
        age = None if not oldest else round(max(0.0, now - entry_ms(oldest) / 1000), 3)
        s.revisions[rev_b.decode()] = {
            "unclaimed": int(un), "reclaimable": int(rc), "claimed": int(claimed),
            "oldest_age_s": age,
        }  # fmt: skip
    s.claimed = {c.decode(): int(n) for c, n in owners}
    s.stats = dict.fromkeys(STATS, 0) | {k.decode(): int(v) for k, v in stats.items()}
    s.served = {k.decode(): int(v) for k, v in served.items()}
    s.at = now
    return s


async def read_reports(conn: PoolConn) -> dict[str, dict[str, Any] | None]:
    """Each replica's last report of its figures (None: named in the pool's set of
    replicas, but its report expired or cannot be read by this release)."""
    names = sorted(n.decode() for n in await conn.command("smembers", "replicas"))
    out: dict[str, dict[str, Any] | None] = {}
    for name in names:
        raw = await conn.command("get", f"replica:{name}")
        try:
            report = None if raw is None else json.loads(raw)
        except ValueError:
            report = None
        out[name] = report if isinstance(report, dict) else None
    return out
