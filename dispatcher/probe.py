"""The health probes: slicerd and the replica asked directly, bounded, forever.

:func:`probe` asks slicerd (one STATUS over a connection of its own: reachable, and is
the workload registered?) and, between turns, the replica (``GET /health``; ``GET
/is_sleeping`` too until it is known healthy, so that a server without vLLM's dev routes
counts as unhealthy; then ``GET /weight_info`` when a revision is loaded), every
``PROBE_INTERVAL_S`` while all is well and sooner (from ``PROBE_RETRY_MIN_S``, doubling)
while something fails; what it learns goes to the :class:`~dispatcher.health.Health` it
was given. The turn loop asks for a turn only while the replica's check is ok (a dead or
misconfigured replica parks nobody), and is woken when it changes. slicerd is probed during a
held turn too (a stopped slicerd, or a workload whose launcher died, shows while the turn
lasts; ``on_workload_lost`` lets the turn loop end a turn whose workload left slicerd);
the replica is not (the turn's own sends are the evidence). A replica whose probe failed
may come back as a new process, and one whose ``/weight_info`` label is not the revision
loaded is not the replica we loaded: ``on_replica_lost`` tells the turn loop, which
forgets the loaded version and recovers the replica at the next turn. Every probe is
bounded by ``PROBE_TIMEOUT_S``; nothing here waits unbounded or starts a task of its own.
A bug in a probe is logged with its traceback once, then at debug level until a round
passes cleanly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from gpu_slicer import proto
from gpu_slicer.dispatcher.errors import DispatchError
from gpu_slicer.dispatcher.health import (
    Check,
    Health,
    daemon_unreachable,
    foreign_weights,
    replica_unhealthy,
    workload_unknown,
)
from gpu_slicer.slicer.client import AsyncSlicer, ClientError

__all__ = [
    "DEV_ROUTES_HINT",
    "PROBE_INTERVAL_S",
    "PROBE_RETRY_MIN_S",
    "PROBE_TIMEOUT_S",
    "probe",
    "probe_daemon",
    "probe_replica",
]

# The health module's logger, as before the probes moved here (logs are filtered by it).
log = logging.getLogger("dispatcher.health")

PROBE_INTERVAL_S = 5.0  # between probes while every check is ok
PROBE_RETRY_MIN_S = 0.5  # the first retry after a probe found a problem (doubling)
PROBE_TIMEOUT_S = 5.0  # one probe of slicerd or of the replica, as a whole


async def probe_daemon(
    health: Health,
    connect: Callable[[], Awaitable[AsyncSlicer]],
    socket: str,
    workload: str,
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """One STATUS over a new slicerd connection (bounded by ``PROBE_TIMEOUT_S``): is
    slicerd reachable, and does it know ``workload``? ``on_status(body)`` is handed the
    STATUS body (the turn loop reads who holds its GPU from it)."""
    try:
        with trio.fail_after(PROBE_TIMEOUT_S):
            slicer = await connect()
            try:
                st = await slicer.status()
            finally:
                with trio.CancelScope(shield=True):
                    await slicer.aclose()
    except ClientError as e:
        if e.code != "unreachable":  # it answered, if only with a refusal: reachable
            health.ok(Check.DAEMON)
            # ... but it said nothing of the workload: an old "registered" would be stale.
            health.forget(Check.WORKLOAD)
            log.info("probe: slicerd refused STATUS (%s); the registration is unknown", e)
            return
        health.forget(Check.WORKLOAD)
        health.fail(Check.DAEMON, daemon_unreachable(socket, e))
        return
    except (OSError, trio.TooSlowError, proto.ProtocolError) as e:
        health.forget(Check.WORKLOAD)
        why = "no answer to STATUS" if isinstance(e, trio.TooSlowError) else e
        health.fail(Check.DAEMON, daemon_unreachable(socket, Exception(why)))
        return
    health.ok(Check.DAEMON)
    if on_status is not None:
        on_status(st)
    names = {w.get("name") for w in st.get("workloads") or [] if isinstance(w, dict)}
    if workload in names:
        health.ok(Check.WORKLOAD)
    else:
        log.debug("probe: slicerd's STATUS lists no workload %s", workload)
        health.fail(Check.WORKLOAD, workload_unknown(workload))


class _Replica(Protocol):
    base_url: str
    epoch: int
    known_version: str | None

    async def check_health(self, timeout: float) -> str | None: ...

    async def weight_version(self, timeout: float) -> str: ...

    async def is_sleeping(self, timeout: float) -> bool: ...


#: The hint after a replica that answers /health but not the dev routes it is driven by.
DEV_ROUTES_HINT = (
    "the dispatcher drives vLLM's dev routes (sleep, wake, weights): start vLLM with "
    "VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode, and check --replica"
)


async def _dev_routes(replica: _Replica) -> str | None:
    """None when ``GET /is_sleeping`` answers (a vLLM whose dev routes the dispatcher can
    drive), else why not, in words (a 404: no dev mode, or not a vLLM at that URL)."""
    try:
        await replica.is_sleeping(PROBE_TIMEOUT_S)
    except DispatchError as e:
        return f"{e}; {DEV_ROUTES_HINT}"
    return None


async def probe_replica(
    health: Health, replica: _Replica, on_lost: Callable[[str], None] | None = None
) -> None:
    """One ``GET /health`` of ``replica`` and, when a revision is loaded, one ``GET
    /weight_info`` (each bounded by ``PROBE_TIMEOUT_S``). ``on_lost(why)`` is called when
    the replica may not be the one loaded any more: it failed the probe (a new process
    may come up at its URL), or its label is not the revision loaded (``weights``).

    A replica not known to be healthy (first sight, or after a failure) must also answer
    ``GET /is_sleeping``: one that answers ``/health`` but not the dev routes (vLLM without
    ``VLLM_SERVER_DEV_MODE=1``, or another server at the URL) would fail every turn's wake,
    and each such turn parks the other workload for nothing. Once healthy, ``/health``
    alone is asked (a dev call reaches the engine process, a plain health check does not)."""
    epoch, known = replica.epoch, replica.known_version
    error = await replica.check_health(PROBE_TIMEOUT_S)
    if error is None and health.state(Check.REPLICA) is not True:
        error = await _dev_routes(replica)
    if error is None and known is not None:
        try:
            label = await replica.weight_version(PROBE_TIMEOUT_S)
        except DispatchError as e:
            error = str(e)
        else:
            # A load or recovery that ran meanwhile (a turn began) changed the epoch: the
            # label read may be its own, so only an unchanged replica is judged.
            if label != known and (replica.epoch, replica.known_version) == (epoch, known):
                health.ok(Check.REPLICA)
                log.warning("probe: %s/weight_info says %r, not %r (the revision loaded)",
                            replica.base_url, label, known)  # fmt: skip
                health.fail(Check.WEIGHTS, foreign_weights(replica.base_url, known))
                if on_lost is not None:
                    on_lost(f"GET /weight_info says {label!r}, not {known!r}")
                return
    if error is None:
        health.ok(Check.REPLICA)
        return
    health.fail(Check.REPLICA, replica_unhealthy(replica.base_url, error))
    if on_lost is not None and known is not None:
        on_lost(error)


async def probe(
    health: Health,
    connect: Callable[[], Awaitable[AsyncSlicer]],
    socket: str,
    workload: str,
    replica: _Replica,
    *,
    skip: Callable[[], bool] = lambda: False,
    held: Callable[[], bool] = lambda: False,
    on_replica_lost: Callable[[str], None] | None = None,
    on_workload_lost: Callable[[], None] | None = None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Probe slicerd and the replica forever: every ``PROBE_INTERVAL_S`` while every
    check is ok, from ``PROBE_RETRY_MIN_S`` doubling while one fails or is not known.
    ``skip()`` true skips a round. While ``held()`` (a turn is held) only slicerd is
    probed, and ``on_workload_lost()`` is called when its STATUS lists no such workload;
    ``on_replica_lost(why)`` as :func:`probe_replica`'s ``on_lost``, ``on_status`` as
    :func:`probe_daemon`'s."""
    retry = PROBE_RETRY_MIN_S
    probed = (Check.DAEMON, Check.WORKLOAD, Check.REPLICA)
    told = False  # a probe's bug was logged with its trace: repeats go to debug
    while True:
        if not skip():
            in_turn = held()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(probe_daemon, health, connect, socket, workload, on_status)
                    if not in_turn:
                        nursery.start_soon(probe_replica, health, replica, on_replica_lost)
            except Exception:
                # A bug in a probe must never take the turn loop down with it, nor fill
                # the log with one traceback per retry.
                level = logging.DEBUG if told else logging.ERROR
                log.log(level, "health probe failed (tried again in %.1f s)", PROBE_INTERVAL_S,
                        exc_info=True)  # fmt: skip
                told = True
            else:
                told = False
                lost = health.state(Check.WORKLOAD) is False
                if in_turn and held() and lost and on_workload_lost is not None:
                    on_workload_lost()
        if all(health.state(c) for c in probed):
            wait, retry = PROBE_INTERVAL_S, PROBE_RETRY_MIN_S
        else:
            wait, retry = retry, min(retry * 2, PROBE_INTERVAL_S)
        await trio.sleep(wait)
