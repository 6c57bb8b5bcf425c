"""The dispatcher's ``GET /metrics``: Prometheus exposition by prometheus-client.

One private `CollectorRegistry` per turn loop (never the process-global one: a process
may run several loops, tests do) holds one collector that reads the loop's figures at
scrape time (its ``status()`` and counters), so nothing is counted twice and nothing is
added to the hot path. Every series carries ``pool``; README.md ("Running the
dispatcher") lists them:

``slicer_dispatch_pending{revision}`` (gauge), ``slicer_dispatch_in_flight`` (gauge),
``slicer_dispatch_store_damaged`` (gauge), and the counters ``slicer_dispatch_done_total``,
``failed_total``, ``turns_total``, ``turn_errors_total``, ``loads_total``,
``load_failures_total``, ``sends_total``, ``batched_samples_total``,
``send_errors_total``, ``commits_total``, ``expired_total``, ``wasted_turns_total``,
``rejects_total{reason}``; while a revision's load is backed off here,
``slicer_dispatch_load_backoff_seconds{revision}`` (until it is tried again) and
``load_backoff_failures{revision}`` (failed loads in a row) (gauges).

In pool mode (``--queue``) also, from the pool's last poll (every dispatcher of a pool
exports the same pool-wide values: aggregate them with ``max``, not ``sum``):
``slicer_dispatch_pool_pending{revision}`` (unclaimed + claimed), ``pool_unclaimed{revision}``,
``pool_reclaimable{revision}``, ``pool_oldest_pending_seconds{revision}``,
``pool_claimed{consumer}`` (``__free__``: handed back), ``pool_redis_up`` (gauges); the
counters ``pool_committed_total``, ``pool_failed_total``, ``pool_duplicates_total``,
``pool_reclaimed_total``, ``pool_returned_total``, ``pool_aside_total`` (requests put aside
unread: no replica could read them), ``pool_served_total{replica}``; and this
replica's own: ``pool_claimed_here`` (gauge), ``pool_claims_here_total``,
``pool_reclaimed_here_total``, ``pool_returned_here_total``, ``pool_duplicates_here_total``,
``pool_lost_claims_total``.

Served as ``text/plain; version=0.0.4; charset=utf-8`` (the classic text format); the
values are floats as prometheus-client writes them, so a counter of 61 reads ``61.0``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpu_slicer.dispatcher.poolscripts import FREE
from gpu_slicer.dispatcher.turns import TurnLoop

__all__ = ["CONTENT_TYPE", "DispatchCollector", "registry_for", "render_metrics"]

# The classic text format's own type, as the hand-written exposition answered (and what
# generate_latest writes); prometheus-client's CONTENT_TYPE_LATEST says 1.0.0 instead.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "slicer_dispatch_"

_registries: weakref.WeakKeyDictionary[TurnLoop, CollectorRegistry] = weakref.WeakKeyDictionary()


class DispatchCollector(Collector):
    """The loop's figures as metric families, read when scraped."""

    def __init__(self, loop: TurnLoop) -> None:
        # Weak: the registry lives in a WeakKeyDictionary keyed by this very loop.
        self._loop = weakref.ref(loop)

    def collect(self) -> Iterator[Metric]:
        loop = self._loop()
        if loop is None:
            return
        st = loop.status()
        c = loop.counters
        pool = st["pool"]

        def family(
            name: str, kind: str, doc: str, samples: list[tuple[dict[str, str], float]]
        ) -> Metric:
            # A counter's family is named without `_total`; its samples carry it.
            base = name.removesuffix("_total") if kind == "counter" else name
            m = Metric(PREFIX + base, doc, kind)
            for labels, value in samples:
                m.add_sample(PREFIX + name, {"pool": pool, **labels}, float(value))
            return m

        def one(name: str, kind: str, doc: str, value: float) -> Metric:
            return family(name, kind, doc, [({}, value)])

        pending = [({"revision": r}, float(n)) for r, n in st["pending"].items()]
        yield family("pending", "gauge", "Pending sampling requests.", pending or [({}, 0.0)])
        yield one("in_flight", "gauge", "Requests sent and not answered.", st["in_flight"])
        yield one("done_total", "counter", "Requests with a result.", st["counts"]["done"])
        yield one("failed_total", "counter", "Requests failed.", st["counts"]["failed"])
        yield one("turns_total", "counter", "Turns granted.", c.turns)
        yield one("turn_errors_total", "counter", "Turns ended by an error.", c.turn_errors)
        yield one("loads_total", "counter", "Whole weight loads done.", c.loads)
        yield one("load_failures_total", "counter", "Weight loads that broke.", c.load_failures)
        yield one("sends_total", "counter", "Requests sent to the replica.", c.sends)
        yield one(
            "batched_samples_total", "counter", "Samples sent in a batch of prompts.",
            c.batched_samples,
        )  # fmt: skip
        yield one(
            "send_errors_total", "counter", "Sends ended by an unexpected error.", c.send_errors
        )
        damaged = 1.0 if st["store"]["damaged"] else 0.0
        yield one("store_damaged", "gauge", "1 while the store's database is damaged.", damaged)
        yield one("commits_total", "counter", "Results committed.", c.commits)
        yield one("expired_total", "counter", "Requests failed by deadline.", c.expired)
        yield one(
            "wasted_turns_total", "counter", "Turns granted (the replica woken: a park paid "
            "for) in which nothing was loaded or served.", c.wasted_turns,
        )  # fmt: skip
        backoff = sorted(st["load_backoff"].items())
        yield family(
            "load_backoff_seconds", "gauge", "Seconds until a revision whose load failed here "
            "is tried again (0: due now; a series only while it is backed off).",
            [({"revision": r}, b["retry_in_s"]) for r, b in backoff],
        )  # fmt: skip
        yield family(
            "load_backoff_failures", "gauge", "Failed loads of the revision in a row here.",
            [({"revision": r}, b["failures"]) for r, b in backoff],
        )  # fmt: skip
        rejects = [({"reason": r}, float(n)) for r, n in sorted(c.rejects.items())]
        yield family("rejects_total", "counter", "Answers not committed, by reason.", rejects)
        if "pool_mode" in st:
            yield from _pool_families(st["pool_mode"], family, one)


_Family = Callable[[str, str, str, list[tuple[dict[str, str], float]]], Metric]


def _pool_families(
    pm: dict[str, Any], family: _Family, one: Callable[..., Metric]
) -> Iterator[Metric]:
    """Pool mode's series: the pool as this dispatcher's last poll saw it (the same on
    every replica's dispatcher), and this replica's own claims."""
    revs = sorted(pm["revisions"].items())

    def per_rev(key: str) -> list[tuple[dict[str, str], float]]:
        return [({"revision": r}, float(v[key])) for r, v in revs if v[key] is not None]

    pending = [({"revision": r}, float(v["unclaimed"] + v["claimed"])) for r, v in revs]
    yield family("pool_pending", "gauge", "The pool's pending requests (unclaimed + claimed).",
                 pending)  # fmt: skip
    yield family("pool_unclaimed", "gauge", "The pool's requests never delivered.",
                 per_rev("unclaimed"))  # fmt: skip
    yield family("pool_reclaimable", "gauge", "The pool's requests claimable now (handed back "
                 "or idle past the reclaim bound; at most 1000 counted).",
                 per_rev("reclaimable"))  # fmt: skip
    yield family("pool_oldest_pending_seconds", "gauge", "Age of the pool's oldest pending "
                 "request.", per_rev("oldest_age_s"))  # fmt: skip
    claimed = [({"consumer": c}, float(n)) for c, n in sorted(pm["claimed"].items())]
    yield family("pool_claimed", "gauge", "The pool's claimed requests per consumer "
                 f"({FREE}: handed back).", claimed)  # fmt: skip
    stats = pm["stats"]
    for key, doc in _POOL_STATS:
        yield one(f"pool_{key}_total", "counter", doc, stats.get(key, 0))
    served = [({"replica": r}, float(n)) for r, n in sorted(pm["served"].items())]
    yield family("pool_served_total", "counter", "Results committed, per replica.", served)
    redis_up = 1.0 if pm["redis"]["reachable"] else 0.0
    yield one("pool_redis_up", "gauge", "1 while the pool's Redis answers.", redis_up)
    yield one("pool_claimed_here", "gauge", "Requests this replica holds claimed.",
              pm["claimed_here"])  # fmt: skip
    for key, name, doc in _HERE:
        yield one(name, "counter", doc, pm[key])


_POOL_STATS = (
    ("committed", "The pool's results stored (first results)."),
    ("failed", "The pool's requests failed."),
    ("duplicates", "The pool's results dropped: a result was there already."),
    ("reclaimed", "The pool's claims taken over after the reclaim bound."),
    ("returned", "The pool's claims handed back unfinished."),
    ("aside", "The pool's requests put aside unread (failed: no replica could read them)."),
)
_HERE = (
    ("claimed_entries", "pool_claims_here_total", "Requests this replica claimed."),
    ("reclaimed_here", "pool_reclaimed_here_total", "Of them, taken over from a silent replica."),
    ("returned_here", "pool_returned_here_total", "Claims this replica handed back."),
    ("duplicates_here", "pool_duplicates_here_total", "This replica's results dropped."),
    ("lost_claims", "pool_lost_claims_total", "This replica's claims another one took over."),
)


def registry_for(loop: TurnLoop) -> CollectorRegistry:
    """The private registry of `loop` (made on first use, gone with the loop)."""
    reg = _registries.get(loop)
    if reg is None:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(DispatchCollector(loop))
        _registries[loop] = reg
    return reg


def render_metrics(loop: TurnLoop) -> bytes:
    """The Prometheus text exposition of `loop`'s figures (content type `CONTENT_TYPE`)."""
    return generate_latest(registry_for(loop))
