"""`slicerd`: the per-node GPU time-slicing daemon (entry point).

A failure to start is one line on stderr, ``slicerd: error: WHAT (WHAT TO DO)``, never a
traceback, and a sysexits-style exit code (README, "Running slicerd"): 0 stopped by
SIGTERM/SIGINT; 64 a bad option or option value on the command line (the same bad value
in the config file is 78, as is a bad flag of `config.HOST_KEYS`); 69 the GPU backend's
driver is unavailable, or another daemon listens on the socket path or the metrics port,
or the driver parker cannot start (`parker = driver` without the API, or a dead daemon's
checkpoint helper still running past its bound: `slicer.driverpark`);
70 an internal error (a bug; ``--log-level debug`` logs its traceback); 78 the
configuration is wrong (config file missing, unreadable, not a regular file, not TOML, an
unknown key, a bad value, an unknown GPU backend or a ``module:attribute`` one that does
not load, an unusable socket path, a metrics host that does not resolve), the state dir is
unusable or owned by another slicerd, or the journal is unreadable (slicer.service does
not restart on 78); 1 any other failure.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from typing import Any

import click
import trio

from gpu_slicer.slicer import __version__
from gpu_slicer.slicer.config import Config, FlagError, load
from gpu_slicer.slicer.driverpark import open_parker, settle_leftovers
from gpu_slicer.slicer.errors import ConfigError, GpuBackendError, SlicerError
from gpu_slicer.slicer.exits import (
    EX_CONFIG,
    EX_SOFTWARE,
    EX_UNAVAILABLE,
    EX_USAGE,
    CliFailure,
    OneLineCommand,
    one_line,
)
from gpu_slicer.slicer.gpu import open_backend
from gpu_slicer.slicer.journal import Journal, JournalError, StateDirLocked, StateLock
from gpu_slicer.slicer.listen import SocketBusy, open_listener
from gpu_slicer.slicer.metrics_http import MetricsListenError, serve_metrics
from gpu_slicer.slicer.notify import sd_notify, watchdog_interval
from gpu_slicer.slicer.park import Running, locate
from gpu_slicer.slicer.server import Server
from gpu_slicer.slicer.state import Limits, SlicerState

log = logging.getLogger("slicer")


def _tool_path(cfg: Config) -> str:
    # What exec finds (a bare name not found stays the name, so that the parker looks it
    # up again, and says so, instead of naming a file in slicerd's working directory).
    return locate(cfg.cuda_checkpoint)[0] or cfg.cuda_checkpoint


async def serve(
    cfg: Config, *, discard_journal: bool = False, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the daemon for `cfg` until SIGTERM/SIGINT or cancellation."""
    try:
        backend = open_backend(cfg.gpu_backend)
    except GpuBackendError as e:
        if ":" not in cfg.gpu_backend:
            raise  # nvml or a plugin: its driver or device may come back (69)
        # A module:attribute the operator named that does not load or start: the config.
        raise ConfigError(f"{e} (check gpu_backend)") from e
    try:
        os.makedirs(cfg.state_dir, mode=0o750, exist_ok=True)
    except OSError as e:
        raise JournalError(f"cannot create state dir {cfg.state_dir}: {e.strerror or e}") from e
    lock = StateLock(cfg.state_dir)
    lock.acquire()  # before anything reads the journal: one owner per state dir
    owned = False
    try:  # from here on, every way out releases the lock (a failed start included)
        journal = Journal(cfg.state_dir, fsync=cfg.journal_fsync)
        if discard_journal and (aside := journal.discard()) is not None:
            log.warning("--discard-journal: moved %s to %s", journal.path, aside)
        entries = journal.load()
        devices = backend.devices()
        limits = Limits(
            max_workloads=cfg.max_workloads,
            max_queue=cfg.max_queue,
            fault_kill_after=cfg.fault_kill_after,
            registrant_park_timeout=cfg.registrant_park_timeout,
            foreign_blocks=cfg.foreign == "block",
            max_connections=cfg.max_connections,
            max_connections_per_uid=cfg.max_connections_per_uid,
            reserved_connections=cfg.reserved_connections,
            fit_aware=cfg.fit_aware,
            fit_headroom=cfg.fit_headroom,
            early_start=cfg.early_start,
            early_hold=cfg.park_timeout + cfg.fault_kill_after,
        )
        sm = SlicerState([(d.index, d.uuid) for d in devices], limits)
        # Signals are caught before the socket exists: a SIGTERM the moment it answers (or
        # right after READY=1) must still stop the daemon cleanly (socket removed, lock
        # released), never by the default action.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            # Before the socket: a start that waits for a dead daemon's checkpoint helper
            # must not accept connections it cannot answer.
            await settle_leftovers(cfg)
            listener, owned = open_listener(cfg.socket, cfg.socket_mode, cfg.socket_group)
            async with trio.open_nursery() as nursery:
                parker = await open_parker(cfg, _tool_path(cfg), nursery)
                server = Server(cfg, sm, backend, parker, journal, entries)
                await nursery.start(serve_metrics, cfg, server)  # none without metrics_listen
                await nursery.start(server.run, listener)
                log.info(
                    "slicerd %s listening on %s (%d GPUs)", __version__, cfg.socket, len(devices)
                )
                sd_notify("READY=1\nSTATUS=serving")
                task_status.started(server)
                if (every := watchdog_interval()) is not None:
                    nursery.start_soon(_watchdog, every)
                async for signum in signals:
                    log.info("signal %d: stopping", signum)
                    sd_notify("STOPPING=1")
                    await _let_parks_finish(server, parker.runner, cfg.park_timeout)
                    nursery.cancel_scope.cancel()
                    break
    finally:
        if owned:
            with contextlib.suppress(OSError):
                os.unlink(cfg.socket)
        lock.release()


async def _let_parks_finish(server: Server, runner: Running, bound: float) -> None:
    # A cuda-checkpoint killed mid-operation desynchronises the driver, and in a container
    # the runtime kills what the daemon leaves behind: let the park, restore and recovery
    # tasks in flight (a park is several tool runs) and any tool still running end,
    # bounded, serving meanwhile. Nothing awaits between the last look and the caller's
    # cancel, so nothing can start in between.
    def busy() -> int:
        tasks = sum(1 for _, what in server.ops.owners.values() if what.endswith("-task"))
        return tasks + runner.running

    if busy():
        log.info("waiting up to %.0f s for %d GPU operation(s) to end", bound, busy())
    with trio.move_on_after(bound):
        while busy():
            await trio.sleep(0.05)
    if busy():
        log.warning("stopping with %d GPU operation(s) still running", busy())


async def _watchdog(every: float) -> None:
    while True:
        sd_notify("WATCHDOG=1")
        await trio.sleep(every)


@click.command(
    "slicerd", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="slicerd")
@click.option("--config", "config_path", help="TOML file (default /etc/slicer/slicer.toml).")
@click.option("--socket", help="Unix socket path (env SLICER_SOCKET).")
@click.option("--socket-mode", help="Octal socket mode, e.g. 660.")
@click.option("--socket-group", help="Group owning the socket.")
@click.option("--allow-group", help="Members may take turns of any workload.")
@click.option("--state-dir", help="Directory for the restart journal.")
@click.option(
    "--gpu-backend",
    help="nvml (default), a registered plugin such as fake (the test doubles' fake GPU), "
    "or module:attribute.",
)
@click.option("--cuda-checkpoint", help="Path of the cuda-checkpoint executable.")
@click.option(
    "--parker",
    type=click.Choice(["auto", "cli", "driver"]),
    help="Park with the cuda-checkpoint CLI, or one helper on the driver's checkpoint API "
    "(r570+); auto (default): the driver API where the library exports it.",
)
@click.option("--libcuda", help="The driver library the driver parker loads (libcuda.so.1).")
@click.option(
    "--fit-aware/--no-fit-aware",
    default=None,
    help="Freeze (lock) instead of park when the next workload fits beside (default off).",
)
@click.option("--fit-headroom", help="Bytes kept free beside a freeze (e.g. 2GiB; default 2GiB).")
@click.option(
    "--early-start/--no-early-start",
    default=None,
    help="Let a waiter that asked ACQUIRE early=N start what fits in N bytes while the "
    "workload before it is checkpointed (default on).",
)
@click.option("--park-timeout", type=float)
@click.option("--restore-timeout", type=float)
@click.option("--fault-kill-after", type=float)
@click.option(
    "--registrant-park-timeout", type=float, help="Bound on a registrant's answer to PARK."
)
@click.option("--foreign", type=click.Choice(["block", "ignore"]))
@click.option(
    "--census",
    type=click.Choice(["auto", "pids", "elimination"]),
    help="Attribute GPU memory by the backend's pids, or by elimination where those pids "
    "are another PID namespace's (slicerd in a pod); auto (default) picks.",
)
@click.option(
    "--verify-reuse-ms",
    type=float,
    help="A grant check may reuse a clean GPU reading this young (default 20; 0: always read).",
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False)
)
@click.option(
    "--metrics-listen",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off).",
)
@click.option(
    "--discard-journal",
    is_flag=True,
    help="Move an unreadable journal aside and start without it (see README).",
)
def main(config_path: str | None, discard_journal: bool, **flags: Any) -> None:
    """Grant exclusive, connection-bound GPU turns over a Unix socket."""
    try:
        cfg = load(config_path, flags)
    except FlagError as e:
        raise CliFailure(f"{e} (see 'slicerd --help')", EX_USAGE) from None
    except SlicerError as e:
        raise CliFailure(str(e), EX_CONFIG) from None
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        trio.run(functools.partial(serve, cfg, discard_journal=discard_journal))
    except BaseException as e:  # every failure is one line (module docstring)
        raise _failure(_leaf(e)) from None


def _leaf(e: BaseException) -> BaseException:
    # A failure inside serve()'s nursery arrives wrapped in exception groups.
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _failure(e: BaseException) -> BaseException:
    """The `CliFailure` (line and exit code) for what stopped the daemon."""
    if isinstance(e, KeyboardInterrupt | SystemExit | click.ClickException):
        return e  # Ctrl-C before the signal handlers were up: exit 130, quietly; or a
        # failure that carries its own line and code
    if isinstance(e, SocketBusy | GpuBackendError | MetricsListenError):
        return CliFailure(str(e), EX_UNAVAILABLE)
    if isinstance(e, JournalError | StateDirLocked | ConfigError):
        return CliFailure(str(e), EX_CONFIG)
    if isinstance(e, SlicerError):
        return CliFailure(str(e), 1)
    log.debug("internal error", exc_info=e)  # the traceback, for a bug report
    return CliFailure(
        f"internal error: {type(e).__name__}: {one_line(str(e))} (a bug; please report "
        "it with the output of --log-level debug)",
        EX_SOFTWARE,
    )


if __name__ == "__main__":
    main()
