"""`slicer-pool`: a pool's status read straight from its Redis (no dispatcher asked).

    slicer-pool --queue URL [--queue-password-file F] status [--pool P] [--reclaim-idle S] [--json]
    slicer-pool --queue URL [--queue-password-file F] revisions --pool P [--json]

The password, if Redis needs one and the URL holds none: ``--queue-password-file FILE``
(its first line), else ``$SLICER_REDIS_PASSWORD``; it shows nowhere (``dispatcher.poolurl``).

``status --pool P`` prints three tables and the pool's counters:

* per revision with pending work: ``pending`` (unclaimed + claimed), ``unclaimed``
  (never delivered), ``claimed`` (in the consumer group's pending list: held by a
  replica, or handed back and claimable at once), ``reclaimable`` (claimable now:
  handed back, or untouched longer than the reclaim bound; at most 1000 counted) and the
  age of the oldest pending request;
* per replica, from the figures each dispatcher writes every 2 s
  (``slicer:pool:{P}:replica:NAME``, kept 30 s): claims held now (Redis' count for its
  consumer), state, loaded revision, turns, commits, loads, load failures, the last load
  error, results it served, and how old its report is (``stale``: older than 30 s, or
  gone: the dispatcher stopped or cannot reach Redis);
* consumers holding claims with no live report (a dispatcher that died or was
  restarted: its claims are reclaimed after the bound);
* ``committed``, ``failed``, ``duplicates``, ``reclaimed``, ``returned``, ``aside`` (requests
  put aside unread: failed, kept in the pool's ``aside`` stream).

Without ``--pool`` it lists the pools found in that Redis (``SCAN`` for their keys).
``--reclaim-idle`` is the bound ``reclaimable`` is counted with (default: the largest a
replica reports, else the dispatcher's default, 380 s). ``--json`` prints one JSON object.
Nothing is written: the scripts used are read-only.

Failures are one line, ``slicer-pool: error: WHAT (WHAT TO DO)``, never a traceback
(:mod:`slicer.exits`): 64 bad arguments (a URL that is not ``redis://HOST[:PORT][/DB]`` nor
``unix:///PATH[?db=N]``, a bad pool name), 66 the pool has nothing in that Redis, 69
Redis cannot be reached or failed a call (each call bounded: 5 s), 70 a bug.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
import coredis
import trio

from gpu_slicer.dispatcher import poolconn, startup
from gpu_slicer.dispatcher.errors import PoolUnavailable
from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.dispatcher.poolconn import PoolConn
from gpu_slicer.dispatcher.poollink import REPORT_TTL_S
from gpu_slicer.dispatcher.poolscripts import FREE
from gpu_slicer.dispatcher.poolstore import PoolStore
from gpu_slicer.dispatcher.poolsummary import read_reports
from gpu_slicer.dispatcher.poolurl import check_password_file, load_password, password_from, redact
from gpu_slicer.dispatcher.turns import RELEASE_TIMEOUT_S
from gpu_slicer.slicer.cli import render_table
from gpu_slicer.slicer.exits import (
    EX_NOINPUT,
    EX_UNAVAILABLE,
    CliFailure,
    OneLineGroup,
    single_error,
)

__all__ = ["main", "pool_names", "pool_status"]

PROG = "slicer-pool"
STATS = ("committed", "failed", "duplicates", "reclaimed", "returned", "aside")
_cfg = TurnConfig(workload="-")
# The dispatcher's default --reclaim-idle with its default flags (dispatcher/main.py).
DEFAULT_RECLAIM_IDLE_S = (
    _cfg.turn_seconds + _cfg.turn_grace + _cfg.sleep_timeout + RELEASE_TIMEOUT_S + 10.0
)
_POOL_KEY = re.compile(r"^slicer:pool:\{(.+)\}:(revs|replicas)$")

T = TypeVar("T")


# -- reading ---------------------------------------------------------------------------


def _last_load_error(backoff: object) -> str | None:
    if not isinstance(backoff, dict) or not backoff:
        return None
    # No time stamps in a backoff: the revision that failed most is the one to show.
    rev, b = max(backoff.items(), key=lambda kv: int(kv[1].get("failures", 0)))
    return f"{rev}: {b.get('error') or 'load failed'}"


async def pool_status(conn: PoolConn, reclaim_idle: float | None = None) -> dict[str, Any]:
    """Pool ``conn.pool`` as Redis has it now (the ``--json`` object of ``status``)."""
    reports = await read_reports(conn)
    if reclaim_idle is None:
        told = [float(r["reclaim_idle_s"]) for r in reports.values()
                if r and isinstance(r.get("reclaim_idle_s"), int | float)]  # fmt: skip
        reclaim_idle = max(told, default=DEFAULT_RECLAIM_IDLE_S)
    # Read-only: POLL and two HGETALLs; the consumer name is never used.
    store = PoolStore(conn, PROG, consumer=f"{PROG}/read-only", reclaim_idle=reclaim_idle)
    summary = await store.poll()
    revs = await conn.command("hgetall", "revs")
    now = time.time()
    by_consumer = dict(summary.claimed)
    returned = by_consumer.pop(FREE, 0)
    replicas: dict[str, dict[str, Any]] = {}
    for name in sorted(set(reports) | set(summary.served)):
        r = reports.get(name) or {}
        consumer = r.get("consumer")
        at = r.get("updated_at")
        age = round(max(0.0, now - float(at)), 1) if isinstance(at, int | float) else None
        replicas[name] = {
            "claimed": by_consumer.pop(consumer, 0) if consumer else None,
            "state": r.get("state"),
            "loaded_revision": r.get("loaded_revision"),
            "turns": r.get("turns"),
            "commits": r.get("commits"),
            "loads": r.get("loads"),
            "load_failures": r.get("load_failures"),
            "load_error": _last_load_error(r.get("load_backoff")),
            "served": summary.served.get(name, 0),
            "report_age_s": age,
            "stale": age is None or age > REPORT_TTL_S,
            "consumer": consumer,
            "workload": r.get("workload"),
            "load_backoff": r.get("load_backoff") or {},
        }
    revisions: dict[str, dict[str, Any]] = {}
    for name, v in summary.revisions.items():
        revisions[name] = {"pending": v["unclaimed"] + v["claimed"], **v}
    published = {}
    for k, raw in revs.items():
        try:
            v = json.loads(raw)
            entry = {"path": v["path"], "published_at": v["published_at"], "seq": v["seq"]}
        except (ValueError, KeyError, TypeError) as e:
            entry = {"path": None, "published_at": None, "seq": None,
                     "unreadable": f"{type(e).__name__}: {e}"}  # fmt: skip
        published[k.decode("utf-8", "replace")] = entry
    return {
        "pool": conn.pool,
        "redis": conn.shown,
        "reclaim_idle_s": reclaim_idle,
        "revisions": revisions,
        "replicas": replicas,
        "orphan_claims": by_consumer,  # consumers with claims and no live report
        "returned": returned,
        "stats": {k: summary.stats.get(k, 0) for k in STATS},
        "published": dict(sorted(published.items(), key=lambda kv: kv[1]["seq"])),
        "polled_at": summary.at,
    }


async def pool_names(url: str, password: str | None = None) -> list[str]:
    """The pools that have revisions or replicas in the Redis at ``url``, sorted."""
    probe = PoolConn(url, "-", password=password)  # the URL's password or the given one
    client = probe.raw_client()
    found: set[str] = set()
    async with client:
        # Caught in here: out of the client's block an error comes wrapped in a group.
        try:
            for pattern in ("slicer:pool:{*}:revs", "slicer:pool:{*}:replicas"):
                cursor = None
                while cursor != 0:
                    with trio.fail_after(poolconn.CALL_TIMEOUT_S):
                        cursor, keys = await client.scan(cursor or 0, match=pattern, count=1000)
                    for k in keys:
                        m = _POOL_KEY.match(k.decode(errors="replace"))
                        if m:
                            found.add(m.group(1))
        except (coredis.exceptions.RedisError, OSError, trio.TooSlowError) as e:
            why = probe.scrub(str(e))
            text = f"redis {probe.shown}: SCAN: {type(e).__name__}: {why}".rstrip(": ")
            raise PoolUnavailable(text) from None
    return sorted(found)


# -- printing --------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:g} s"


def _report(r: dict[str, Any]) -> str:
    if r["report_age_s"] is None:
        return "none (stale)"
    return f"{r['report_age_s']:g} s ago" + (" (stale)" if r["stale"] else "")


def status_text(st: dict[str, Any]) -> str:
    """``status --pool P`` as text (the object of :func:`pool_status`)."""
    out = [f"pool {st['pool']} on {st['redis']} (reclaim idle {st['reclaim_idle_s']:g} s)", ""]
    if st["revisions"]:
        out.append(render_table(
            ["revision", "pending", "unclaimed", "claimed", "reclaimable", "oldest"],
            [[n, v["pending"], v["unclaimed"], v["claimed"], v["reclaimable"],
              _age(v["oldest_age_s"])] for n, v in st["revisions"].items()],
        ))  # fmt: skip
    else:
        out.append("no pending requests")
    out.append("")
    if st["replicas"]:
        out.append(render_table(
            ["replica", "claimed", "state", "loaded", "turns", "commits", "loads",
             "load_failures", "served", "report", "last_load_error"],
            [[n, r["claimed"], r["state"], r["loaded_revision"], r["turns"], r["commits"],
              r["loads"], r["load_failures"], r["served"], _report(r), r["load_error"]]
             for n, r in st["replicas"].items()],
        ))  # fmt: skip
    else:
        out.append("no replica has reported")
    if st["orphan_claims"]:
        held = ", ".join(f"{c} ({n})" for c, n in sorted(st["orphan_claims"].items()))
        out.append(f"claims of consumers with no live report (reclaimed after the bound): {held}")
    if st["returned"]:
        out.append(f"handed back, claimable at once: {st['returned']}")
    out.append("")
    out.append("  ".join(f"{k} {st['stats'][k]}" for k in STATS))
    return "\n".join(out)


def revisions_text(st: dict[str, Any]) -> str:
    """``revisions --pool P`` as text: the published revisions, oldest first."""
    if not st["published"]:
        return f"no revision is published in pool {st['pool']}"
    rows = []
    for name, v in st["published"].items():
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(v["published_at"])))
        pending = st["revisions"].get(name, {}).get("pending", 0)
        rows.append([name, v["seq"], at, pending, v["path"]])
    return render_table(["revision", "seq", "published", "pending", "path"], rows)


# -- the command -----------------------------------------------------------------------


def _run(call: Callable[[], Awaitable[T]]) -> T:
    try:
        try:
            return trio.run(call)
        except BaseExceptionGroup as group:  # coredis' task groups wrap what we raise
            leaf = single_error(group)
            if leaf is group:
                raise
            raise leaf from None
    except PoolUnavailable as e:
        raise CliFailure(f"{e} (is Redis running there? check --queue)", EX_UNAVAILABLE) from None


async def _read(
    url: str, pool: str, reclaim_idle: float | None, password: str | None
) -> dict[str, Any]:
    async with PoolConn(url, pool, password=password) as conn:
        st = await pool_status(conn, reclaim_idle)
        if not (st["published"] or st["replicas"] or st["revisions"]):
            raise CliFailure(
                f"pool {pool!r} has nothing in the Redis at {conn.shown} (no revision, no "
                f"replica: '{PROG} --queue URL status' lists the pools there)",
                EX_NOINPUT,
            )
        return st


def _echo(obj: object, as_json: bool, text: str) -> None:
    click.echo(json.dumps(obj, sort_keys=True) if as_json else text)


@click.group(PROG, cls=OneLineGroup, no_args_is_help=True,
             context_settings={"help_option_names": ["-h", "--help"]})  # fmt: skip
@click.option(
    "--queue",
    required=True,
    callback=startup.check_queue,
    help="the pool's Redis, redis://HOST[:PORT][/DB] or unix:///PATH[?db=N]",
)
@click.option(
    "--queue-password-file",
    "password",
    callback=check_password_file,
    help="a file whose first line is the Redis password (else $SLICER_REDIS_PASSWORD)",
)
@click.pass_context
def main(ctx: click.Context, queue: str, password: str | None) -> None:
    """Read a sampling pool's state from its Redis (what `slicer-dispatch --queue` uses)."""
    # PoolConn and coredis log their failures; here the one error line says it all.
    logging.getLogger().addHandler(logging.NullHandler())
    ctx.obj = (queue, password_from(load_password(password)))


@main.command("status")
@click.option("--pool", callback=startup.check_name, help="the pool (default: list the pools)")
@click.option(
    "--reclaim-idle",
    type=startup.SECONDS,
    help="the bound 'reclaimable' is counted with (default: the replicas' own)",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.pass_obj
def status(
    obj: tuple[str, str | None], pool: str | None, reclaim_idle: float | None, as_json: bool
) -> None:
    """Per revision and per replica: pending, claims, turns, loads, counters."""
    url, password = obj
    if pool is not None:
        st = _run(lambda: _read(url, pool, reclaim_idle, password))
        _echo(st, as_json, status_text(st))
        return

    async def listing() -> list[dict[str, Any]]:
        out = []
        for name in await pool_names(url, password):
            async with PoolConn(url, name, password=password) as conn:
                st = await pool_status(conn, reclaim_idle)
            live = [n for n, r in st["replicas"].items() if not r["stale"]]
            pending = sum(v["pending"] for v in st["revisions"].values())
            out.append({"pool": name, "pending": pending, "revisions": len(st["published"]),
                        "replicas": len(live)})  # fmt: skip
        return out

    pools = _run(listing)
    text = (
        render_table(["pool", "pending", "revisions", "replicas"],
                     [[p["pool"], p["pending"], p["revisions"], p["replicas"]] for p in pools])
        if pools else f"no pool in the Redis at {redact(url)}"
    )  # fmt: skip
    _echo({"pools": pools}, as_json, text)


@main.command("revisions")
@click.option("--pool", required=True, callback=startup.check_name, help="the pool")
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.pass_obj
def revisions(obj: tuple[str, str | None], pool: str, as_json: bool) -> None:
    """The pool's published revisions, oldest first, with their pending requests."""
    url, password = obj
    st = _run(lambda: _read(url, pool, None, password))
    pending = {n: st["revisions"].get(n, {}).get("pending", 0) for n in st["published"]}
    out = {"pool": pool, "revisions": {n: {**v, "pending": pending[n]}
                                       for n, v in st["published"].items()}}  # fmt: skip
    _echo(out, as_json, revisions_text(st))


if __name__ == "__main__":
    main()
