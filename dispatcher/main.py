"""`slicer-dispatch`: the HTTP front and the turn loop of one vLLM replica.

    slicer-dispatch --workload sampler --replica http://127.0.0.1:8000 \\
        [--socket S] [--state-dir D] [--pool NAME] [--listen HOST:PORT | --listen-unix PATH]
        [--weight-check spans|label] [--max-send-errors N] [--max-load-failures N]
        [--load-backoff-max S]
        [--no-check-revision-paths] [--sync normal|full] [--batch-prompts N]
        [--concurrency N] [--max-idle-connections N]
        [--sleep-level auto|1|2] [--lazy-sleep/--no-lazy-sleep] [--lazy-sleep-always]
        [--early-start auto|off|SIZE]
        [--queue REDIS_URL [--consumer NAME] [--reclaim-idle S] [--result-ttl S]
                           [--ask-patience S]]

``--weight-check`` says how a result is tied to the weights it asked for (the commit
rule in :mod:`dispatcher.core`): ``spans`` (default) needs vLLM 0.33 or later, which
returns per-choice ``weight_versions``; ``label`` is for vLLM releases that ignore
``return_weight_versions`` (such as 0.32): after each response the dispatcher reads
``GET /weight_info`` once and commits only if it names the request's revision. The label
check is weaker (a weight change undone during a request goes unseen, and it trusts that
nothing else loads weights into the replica during a turn). With ``spans`` against a vLLM
that returns no ``weight_versions`` nothing is ever committed; the dispatcher logs one
error saying so and ``/status`` shows the rule in use as ``weight_check``.

``--batch-prompts N`` (default 1: one request per sample) packs up to N pending
completion samples of the revision being served that have identical parameters and the
same prompt form (text or token ids) into ONE ``POST /v1/completions`` with a list of
prompts; the answer is split per sample, each part judged and committed on its own. Each
sample's result is the answer's top-level fields with its own choices (renumbered from 0),
the ``usage`` of the whole send, and ``"batch": {"size": K, "position": I}``. A batch vLLM
refuses (400/422) is sent again one sample per request, so a bad prompt fails alone with
vLLM's own error. Chat samples are never batched. ``--concurrency`` bounds the sends in
flight (a batch is one); once a burst is over, at most ``--max-idle-connections`` (32)
of the connections it opened stay open to the replica, the others are closed as their
sends end. See :mod:`dispatcher.serve`.

``--sleep-level`` is vLLM's sleep level at each turn's end: ``1`` copies the weights to
host RAM and back, ``2`` drops them (the next wake loads them: ``/wake_up?tags=weights``,
a whole load, ``/wake_up?tags=kv_cache``, ``/reset_prefix_cache``), ``auto`` (default)
picks 2 when the next wake will load other weights anyway (a newer revision published,
or pending requests that want only other revisions), else 1 (:func:`dispatcher.core.sleep_level`).

``--lazy-sleep`` (default) ends a turn that ran out of work without anybody else asking
for the GPU (no WAITING) with a RELEASE that leaves vLLM awake and loaded, when the
replica is healthy; the next turn reads ``GET /is_sleeping`` and skips the wake. When
another workload asks for the GPU meanwhile, slicerd parks the idle replica itself
(PARK to its launcher, which sleeps it; verified; cuda-checkpoint as the fallback;
bounded by ``registrant_park_timeout``). ``--no-lazy-sleep``: every turn ends with a
sleep, as before (see :mod:`dispatcher.turns`). ``--lazy-sleep-always`` leaves vLLM awake
also when another workload waited: slicerd then freezes it beside that one (its
``fit_aware``) or has its launcher sleep it.

``--early-start`` (default ``auto``) asks slicerd for an early start at each ACQUIRE:
when it parks the trainer by checkpoint, it locks it first and, with the bytes free
beside it, says ``EARLY``; the dispatcher then wakes vLLM's weights and loads the revision
while the trainer's memory moves off, and wakes the KV cache once granted
(:mod:`dispatcher.early`). ``auto`` asks for the size of the revision's weight files;
``off`` never asks; a size (``16GiB``) asks for that. Pool mode asks for none.

``--sync`` is SQLite's ``PRAGMA synchronous`` for the store: ``normal`` (default) loses
nothing acknowledged on a process crash, but a power loss may drop the commits since the
WAL was last synced; ``full`` syncs at every commit, so a power loss loses nothing
acknowledged either, at one fsync per group commit (not per request; see
:mod:`dispatcher.store`).

One dispatcher per state dir: it takes an exclusive lock on ``STATE_DIR/dispatch.lock``
(holding its pid) before it opens the store; a second one on the same dir exits 75 with
one line naming the owner's pid (:mod:`dispatcher.owner`).

Startup failures are one ``slicer-dispatch: error: WHAT (WHAT TO DO)`` line on stderr,
never a traceback, with a sysexits code (:mod:`dispatcher.startup`): 64 bad arguments
(an unknown option, a replica URL without ``http://``, a malformed ``--listen``, an
unknown ``--log-level``, a ``--turn-seconds``/``--sample-deadline`` that is not a finite
number > 0, a ``--turn-grace`` that is not one >= 0), 65 the store is damaged, 69 the
front cannot listen on its address (in use; for ``--listen-unix``, a socket something
answers on), 73 the state dir or the store cannot be created or opened (for
``--listen-unix``, a path that exists and is not a socket), 75 another dispatcher owns
the state dir, 77 permission denied for the address, 70 a bug. ``--listen-unix`` removes
only a dead socket file (nothing answers a connect to it), left by a previous run. An
unreachable slicerd is not a startup failure: the dispatcher starts and waits for it.

Pool mode (``--queue redis://HOST:PORT/DB`` or ``unix:///PATH?db=N``, README "Pools
across nodes"): the queue of pool ``--pool`` is in Redis, shared by every replica's
dispatcher; any front accepts, long-polls and publishes for the whole pool, and this
dispatcher claims work only while its replica holds a turn (:mod:`dispatcher.poollink`).
No SQLite store and no state-dir lock then. ``--consumer`` names this replica in the pool
(default ``HOST/WORKLOAD``); ``--ask-patience`` how long a replica asking for a turn
covers the pool's backlog before another may ask too (default 2 x turn seconds + grace);
``--reclaim-idle`` (at least 3 s) is how long a replica's claims may go
untouched before the others take them (default: the turn's whole bound, turn seconds +
grace + sleep + RELEASE bounds + 10 s; a live dispatcher touches its claims every quarter
of it); ``--result-ttl`` how long results stay readable. Redis unreachable is a waiting
state: 503 at the front, turns end cleanly, service resumes by itself.

SIGTERM/SIGINT: stop accepting, end a held turn (sleep vLLM, RELEASE, both bounded),
end every ``GET /v1/events`` stream after the turn's last events with ``closed``, then
close the front and exit 0. Prints ``listening on ...`` to stderr once the front is bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import click
import trio

from gpu_slicer.dispatcher import startup
from gpu_slicer.dispatcher.http import build_app, serve_http
from gpu_slicer.dispatcher.model import (
    MAX_LOAD_FAILURES,
    MAX_SEND_ERRORS,
    SLEEP_LEVELS,
    WEIGHT_CHECKS,
    TurnConfig,
)
from gpu_slicer.dispatcher.poolurl import check_password_file, load_password
from gpu_slicer.dispatcher.store import SYNC_MODES, Store
from gpu_slicer.dispatcher.turns import RELEASE_TIMEOUT_S, TurnLoop
from gpu_slicer.dispatcher.vllm import MAX_IDLE_CONNECTIONS, Replica
from gpu_slicer.slicer.exits import OneLineCommand, single_error

if TYPE_CHECKING:
    from gpu_slicer.dispatcher.poollink import PoolLink
    from gpu_slicer.dispatcher.poolstore import PoolStore

PROG = "slicer-dispatch"

log = logging.getLogger("dispatcher")

EVENTS_CLOSE_GRACE_S = 1.0  # at a stop, for readers of GET /v1/events to get "closed"
SHUTDOWN_MARGIN_S = 5.0  # the front's own cut (its grace) comes this long after ours would


@dataclass(frozen=True)
class _PoolArgs:
    queue: str
    pool: str
    replica: str
    reclaim_idle: float
    result_ttl: float
    patience: float
    password: str | None = None  # --queue-password-file's (else $SLICER_REDIS_PASSWORD)


async def _run(
    store: Store | None, replica_url: str, cfg: TurnConfig, bind: str, pool: _PoolArgs | None
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        replica = await stack.enter_async_context(
            Replica(replica_url, max_idle=cfg.max_idle_connections)
        )
        link: PoolLink | None = None
        queue: Store | PoolStore
        if pool is not None:
            # Imported here: coredis costs a second of start-up that SQLite mode never pays.
            from gpu_slicer.dispatcher.poolconn import PoolConn
            from gpu_slicer.dispatcher.poollink import PoolLink
            from gpu_slicer.dispatcher.poolstore import PoolStore

            conn = await stack.enter_async_context(
                PoolConn(pool.queue, pool.pool, password=pool.password)
            )
            queue = PoolStore(conn, pool.replica, reclaim_idle=pool.reclaim_idle,
                              result_ttl=pool.result_ttl)  # fmt: skip
            link = PoolLink(queue, cfg.concurrency * cfg.batch_prompts, pool.patience,
                            cfg.turn_seconds)  # fmt: skip
            log.info("pool %s on %s as %s (reclaim idle %g s)", pool.pool, conn.shown,
                     queue.consumer, pool.reclaim_idle)  # fmt: skip
        else:
            assert store is not None
            queue = store
        loop = TurnLoop(queue, replica, cfg, pool=link)  # type: ignore[arg-type]
        stop = trio.Event()
        # Caught before the turn loop starts and the front binds: a SIGTERM the moment the
        # port answers must stop cleanly (exit 0), never by the default action.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as turns:
                    await turns.start(loop.run)
                    # The open requests outlive the turn's end (and "closed"): main cuts them.
                    grace = loop.end_timeout + EVENTS_CLOSE_GRACE_S + SHUTDOWN_MARGIN_S
                    serve = partial(serve_http, build_app(loop), bind, stop, grace=grace)
                    try:
                        binds = await nursery.start(serve)
                    except OSError as e:
                        raise startup.bind_failure(bind, e) from None
                    print(f"listening on {' '.join(binds)}", file=sys.stderr, flush=True)
                    async for signum in signals:
                        log.info("%s: stopping", signal.Signals(signum).name)
                        break
                    stop.set()  # no new connections; the open ones (event streams) stay
                    turns.cancel_scope.cancel()  # the loop ends its turn (shielded, bounded)
                # The turn's end is published; the event streams end with their "closed" line.
                await loop.events.aclose(EVENTS_CLOSE_GRACE_S)
                nursery.cancel_scope.cancel()  # only now: the requests still open are cut


def _bind(listen: str | None, listen_unix: str | None) -> str:
    if listen_unix:
        startup.claim_unix_socket(listen_unix)  # refuses a live one; removes a dead one
        return f"unix:{listen_unix}"
    return listen or "127.0.0.1:8100"


@click.command(PROG, cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workload", required=True, callback=startup.check_name,
              help="the replica's workload name in slicerd")  # fmt: skip
@click.option("--replica", "replica_url", required=True, callback=startup.check_replica_url,
              help="vLLM base URL, e.g. http://127.0.0.1:8000")  # fmt: skip
@click.option("--socket", "socket_path", help="slicerd socket (default $SLICER_SOCKET)")
@click.option("--state-dir", default="/var/lib/slicer-dispatch", show_default=True)
@click.option("--pool", callback=startup.check_name, help="pool name (default: the workload name)")
@click.option(
    "--queue",
    callback=startup.check_queue,
    help="pool mode: the pool's Redis, redis://HOST:PORT/DB or unix:///PATH?db=N",
)
@click.option(
    "--queue-password-file",
    "queue_password_file",
    callback=check_password_file,
    help="pool mode: a file whose first line is the Redis password (kept out of ps and "
    "pod specs; else $SLICER_REDIS_PASSWORD, unless the --queue URL holds one)",
)
@click.option(
    "--consumer",
    callback=startup.check_consumer,
    help="pool mode: this replica's name in the pool (default HOST/WORKLOAD)",
)
@click.option(
    "--reclaim-idle",
    type=startup.SECONDS,
    callback=startup.check_reclaim_idle,
    help="pool mode: seconds a replica's claims may go untouched before the others "
    "take them (default: the turn's whole bound)",
)
@click.option(
    "--result-ttl",
    type=startup.SECONDS,
    default=86400.0,
    show_default=True,
    help="pool mode: seconds a result stays readable",
)
@click.option(
    "--ask-patience",
    type=startup.SECONDS,
    help="pool mode: seconds a replica asking for a turn covers the backlog before "
    "another may ask too (default: 2 x turn seconds + grace)",
)
@click.option("--listen", callback=startup.check_listen, help="HOST:PORT (default 127.0.0.1:8100)")
@click.option("--listen-unix", help="serve HTTP on this Unix socket instead")
@click.option("--model", help="served model name sent to vLLM (default: vLLM's own)")
@click.option("--turn-seconds", type=startup.SECONDS, default=30.0, show_default=True,
              help="seconds a turn serves once another workload waits (> 0)")  # fmt: skip
@click.option("--turn-grace", type=startup.SECONDS_OR_ZERO, default=10.0, show_default=True,
              help="seconds sends in flight get at a turn's end (>= 0)")  # fmt: skip
@click.option("--sample-deadline", type=startup.SECONDS, default=3600.0, show_default=True,
              help="seconds a request may stay pending before it fails (> 0)")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--base-revision", default="base", show_default=True,
              callback=startup.check_base_revision,
              help="the revision that names the weights the replica booted with (published "
              "at start while none is, so step 0 samples before the first publish; '' for "
              "none)")  # fmt: skip
@click.option("--max-idle-connections", type=click.IntRange(0, 4096),
              default=MAX_IDLE_CONNECTIONS, show_default=True,
              help="idle keep-alive connections kept to the replica after a burst")  # fmt: skip
@click.option(
    "--weight-check",
    type=click.Choice(WEIGHT_CHECKS),
    default="spans",
    show_default=True,
    help="how a result is tied to its revision's weights: 'spans' checks each choice's "
    "weight_versions (vLLM >= 0.33); 'label' checks GET /weight_info after each response, "
    "for vLLM releases that ignore return_weight_versions (e.g. 0.32; a weaker check)",
)
@click.option("--max-send-errors", type=click.IntRange(1), default=MAX_SEND_ERRORS,
              show_default=True, help="unexpected send errors before a request fails")  # fmt: skip
@click.option("--max-load-failures", type=click.IntRange(1), default=MAX_LOAD_FAILURES,
              show_default=True, help="refused loads until a revision's requests fail")  # fmt: skip
@click.option("--load-backoff-max", type=startup.SECONDS, default=900.0, show_default=True,
              help="pool mode: the longest wait before this replica tries again a revision "
              "its vLLM refused to load (waits grow 4x from 1 s); its requests stay for "
              "another replica, or fail at their deadline naming the load error")  # fmt: skip
@click.option("--check-revision-paths/--no-check-revision-paths", default=True,
              show_default=True, help="publish only readable checkpoint dirs (off: the "
              "replica's file system is not this one's)")  # fmt: skip
@click.option("--sync", "sync", type=click.Choice(SYNC_MODES), default="normal",
              show_default=True, help="SQLite synchronous mode: 'full' also survives a power "
              "loss, at one fsync per group commit")  # fmt: skip
@click.option("--batch-prompts", type=click.IntRange(1, 256), default=1, show_default=True,
              help="completion samples with identical parameters sent in one request as a "
              "list of prompts (1: one request per sample); chat samples go alone")  # fmt: skip
@click.option("--sleep-level", type=click.Choice(SLEEP_LEVELS), default="auto", show_default=True,
              help="vLLM sleep level at a turn's end: 1 copies the weights to host RAM, 2 "
              "drops them (reloaded at the next wake); auto: 2 when the next wake loads "
              "other weights anyway")  # fmt: skip
@click.option("--lazy-sleep/--no-lazy-sleep", default=True, show_default=True,
              help="a turn nobody else waited on ends without a vLLM sleep (slicerd has the "
              "launcher sleep it when another workload asks for the GPU)")  # fmt: skip
@click.option("--lazy-sleep-always", is_flag=True,
              help="with --lazy-sleep, also leave vLLM awake when another workload waits: "
              "slicerd then freezes it beside the next (slicerd fit_aware) or has the "
              "launcher sleep it")  # fmt: skip
@click.option("--early-start", default="auto", show_default=True,
              callback=startup.check_early_start,
              help="start waking and loading the weights before the grant, while slicerd "
              "checkpoints the workload before us: auto (the size of the revision's weight "
              "files), off, or the bytes the weights take on the GPU (e.g. 16GiB)")  # fmt: skip
@click.option("--log-level", type=click.Choice(startup.LOG_LEVELS, case_sensitive=False),
              default="info", show_default=True)  # fmt: skip
def main(
    workload: str,
    replica_url: str,
    socket_path: str | None,
    state_dir: str,
    pool: str | None,
    listen: str | None,
    listen_unix: str | None,
    model: str | None,
    turn_seconds: float,
    turn_grace: float,
    sample_deadline: float,
    concurrency: int,
    max_idle_connections: int,
    base_revision: str | None,
    weight_check: str,
    max_send_errors: int,
    max_load_failures: int,
    load_backoff_max: float,
    check_revision_paths: bool,
    sync: str,
    batch_prompts: int,
    sleep_level: str,
    lazy_sleep: bool,
    lazy_sleep_always: bool,
    early_start: int | None,
    log_level: str,
    queue: str | None,
    queue_password_file: str | None,
    consumer: str | None,
    reclaim_idle: float | None,
    result_ttl: float,
    ask_patience: float | None,
) -> None:
    """Hold sampling requests durably and serve them in the replica's GPU turns."""
    logging.basicConfig(
        stream=sys.stderr,
        level=log_level.upper(),
        format=f"%(asctime)s slicer-dispatch[{os.getpid()}] %(levelname)s %(message)s",
    )
    for name in ("httpx", "httpcore", "dispatcher.httpserver", "coredis"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if listen and listen_unix:
        raise click.UsageError("give --listen or --listen-unix, not both")
    # The lock (then the store) before _bind: _bind may unlink the owner's Unix socket.
    # Pool mode keeps nothing on this disk: no store, no lock.
    lock, store = (None, None) if queue else startup.open_state(state_dir, pool or workload, sync)
    try:
        bind = _bind(listen, listen_unix)
        startup.probe_bind(bind)
        cfg = TurnConfig(
            workload=workload,
            socket=socket_path,
            model=model,
            turn_seconds=turn_seconds,
            turn_grace=turn_grace,
            sample_deadline=sample_deadline,
            concurrency=concurrency,
            max_idle_connections=max_idle_connections,
            base_revision=base_revision,
            weight_check=weight_check,
            max_send_errors=max_send_errors,
            max_load_failures=max_load_failures,
            load_backoff_max=load_backoff_max,
            check_revision_paths=check_revision_paths,
            batch_prompts=batch_prompts,
            sleep_level=sleep_level,
            lazy_sleep=lazy_sleep,
            lazy_always=lazy_sleep_always,
            early_start=early_start,
        )
        log.info("weight check: %s", weight_check)
        pool_args = None
        if queue:
            whole = turn_seconds + turn_grace + cfg.sleep_timeout + RELEASE_TIMEOUT_S + 10.0
            if reclaim_idle is not None and reclaim_idle < whole:
                log.warning("--reclaim-idle %g s is shorter than a turn's whole bound (%g s): "
                            "a dispatcher silent that long (a stall, a partition) has its "
                            "claims served elsewhere too (the first result wins)",
                            reclaim_idle, whole)  # fmt: skip
            patience = ask_patience or 2 * turn_seconds + turn_grace
            pool_args = _PoolArgs(queue, pool or workload,
                                  consumer or f"{socket.gethostname()}/{workload}",
                                  reclaim_idle or whole, result_ttl, patience,
                                  load_password(queue_password_file))  # fmt: skip
        try:
            trio.run(_run, store, replica_url, cfg, bind, pool_args)
        except BaseExceptionGroup as group:
            leaf = single_error(group)
            if leaf is group:
                raise
            raise leaf from None  # e.g. the front's bind failure, said in one line
    finally:
        if store is not None:
            store.close()
        if lock is not None:
            lock.release()
    log.info("stopped")


if __name__ == "__main__":
    main()
