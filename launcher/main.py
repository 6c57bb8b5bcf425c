"""`slicer-launch`: register a workload with slicerd and supervise its processes.

    slicer-launch run  --workload trainer [--max-turn S] -- python train.py
    slicer-launch vllm --workload sampler --ready-file /run/ready -- vllm serve MODEL

``run --max-turn S`` registers with ``max_turn=S`` (opt-in preemption, ``--park
checkpoint`` only): a turn held longer than S seconds while another workload waits is
taken back by slicerd (``PREEMPTED``; README, "Protocol").

Exit codes (every one but the child's own comes with one ``slicer-launch: error: ...``
line on stderr, never a traceback):
    N     the child's own exit code (128+S when it died of signal S), also after a
          SIGTERM/SIGINT to the launcher was forwarded to it (137: SIGKILLed after grace)
    1     vLLM profile: the replica never got ready (exited early, /sleep failed, ...),
          or its --host/--port was taken by another listener (checked before the boot turn)
    64    bad command line (unknown option, bad value, no COMMAND, an empty COMMAND);
          bare `slicer-launch` prints its help to stderr and exits 64 too
    69    slicerd could not be reached for the first REGISTER (--connect-timeout)
    70    a FAULT arrived: the child's process group was stopped
    75    vLLM profile: boot turn not granted in --boot-timeout, or not healthy in
          --health-timeout
    78    slicerd refused the REGISTER (name taken, unknown GPU, forbidden)
    126   COMMAND could not be executed; 127: COMMAND not found (both checked before
          the REGISTER, so a typo registers nothing)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import trio

from gpu_slicer import proto
from gpu_slicer.launcher.config import LaunchConfig, VllmConfig, setup_logging
from gpu_slicer.launcher.supervise import Profile, Supervisor
from gpu_slicer.launcher.vllm import VllmProfile
from gpu_slicer.slicer.exits import CliFailure, OneLineGroup, single_error

PROG = "slicer-launch"
LOG_LEVELS = ["debug", "info", "warning", "error"]


class Seconds(click.FloatRange):
    """A duration option: a finite number of seconds, at least 0 (NaN and inf refused:
    a NaN bound never runs out, and is no bound)."""

    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The value as float seconds; a usage error (64) naming the option otherwise."""
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


SECONDS = Seconds()


def _size(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return proto.parse_size(value)
    except proto.ProtocolError as e:
        raise click.BadParameter(str(e)) from e


def _socket(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value == "":  # never silently the default socket instead
        raise click.BadParameter("is empty: give slicerd's socket path, or leave it out")
    return value


def _common(
    park: str, parked_max: str, fallback: str = "none"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed(
            [
                click.option("--workload", required=True, help="workload name to register"),
                click.option("--gpu", help="GPU index or UUID (slicerd default: 0)"),
                click.option(
                    "--park",
                    type=click.Choice(["checkpoint", "cooperative"]),
                    default=park,
                    show_default=True,
                ),
                click.option(
                    "--park-fallback",
                    type=click.Choice(["checkpoint", "residue", "none"]),
                    default=fallback,
                    show_default=True,
                    help="cooperative park: if nobody parks the workload (its dispatcher "
                    "died mid-turn), slicerd may cuda-checkpoint it (checkpoint) or "
                    "FAULT it (none); residue: as checkpoint, and after every park also "
                    "checkpoint what the slept workload left on the GPU (restored before "
                    "its next turn, so before its wake)",
                ),
                click.option(
                    "--parked-max",
                    default=parked_max,
                    callback=_size,
                    show_default=True,
                    help="GPU bytes the parked workload may keep (KiB/MiB/GiB suffixes)",
                ),
                click.option(
                    "--socket", callback=_socket, help="slicerd socket (default $SLICER_SOCKET)"
                ),
                click.option(
                    "--kill-grace",
                    type=SECONDS,
                    default=5.0,
                    show_default=True,
                    help="seconds between forwarding SIGTERM and SIGKILL",
                ),
                click.option(
                    "--connect-timeout",
                    type=SECONDS,
                    default=30.0,
                    show_default=True,
                    help="seconds the first REGISTER keeps retrying an unreachable slicerd",
                ),
                click.option(
                    "--log-level",
                    type=click.Choice(LOG_LEVELS, case_sensitive=False),
                    default="info",
                    show_default=True,
                ),
                click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED),
            ]
        ):
            f = opt(f)
        return f

    return deco


def _launch(kw: dict[str, Any], profile: Profile) -> None:
    command = list(kw.pop("command"))
    if not command[0]:
        raise click.UsageError("COMMAND is empty: give the program to run after '--'")
    if command[0].startswith("-"):
        # ignore_unknown_options lets a misspelt option through as COMMAND.
        raise click.UsageError(f"no such option: {command[0]}; COMMAND goes after '--'")
    setup_logging(kw["workload"], kw.pop("log_level"))
    cfg = LaunchConfig(**kw)
    sup = Supervisor(cfg, command, profile)
    try:
        code = trio.run(sup.run)
    except BaseExceptionGroup as group:
        leaf = single_error(group)
        if leaf is group:
            raise
        raise leaf from None  # a bug: `run_command` says it in one line
    if sup.failure is not None:
        raise CliFailure(sup.failure, code)
    sys.exit(code)


@click.group(name=PROG, cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Register a workload with slicerd and supervise its processes."""


@main.command(context_settings={"ignore_unknown_options": True})
@_common("checkpoint", "0")
@click.option(
    "--max-turn",
    type=SECONDS,
    help="opt into preemption: a turn held longer than this while another workload waits "
    "is taken back (PREEMPTED) and the workload parked by checkpoint (--park checkpoint only)",
)
def run(**kw: Any) -> None:
    """Run COMMAND as workload NAME for its whole life (exit: the child's code)."""
    if kw.get("max_turn") is not None and kw["park"] != "checkpoint":
        raise click.UsageError("--max-turn needs --park checkpoint (a cooperative workload "
                               "parks itself: it gets WAITING hints only)")  # fmt: skip
    if kw.get("max_turn") is not None and not 0 < kw["max_turn"] <= 86400:
        raise click.UsageError("--max-turn must be in (0, 86400] seconds")
    _launch(kw, Profile())


@main.command(context_settings={"ignore_unknown_options": True})
@_common("cooperative", "4GiB", "checkpoint")
@click.option("--ready-file", type=click.Path(path_type=Path), help="ready marker")
@click.option("--boot-timeout", type=SECONDS, default=900.0, show_default=True)
@click.option("--health-timeout", type=SECONDS, default=600.0, show_default=True)
@click.option("--sleep-level", type=click.IntRange(1, 2), default=1, show_default=True)
@click.option("--sleep-timeout", type=SECONDS, default=300.0, show_default=True)
@click.option("--no-sleep-mode-flag", is_flag=True, help="do not add --enable-sleep-mode")
def vllm(**kw: Any) -> None:
    """Boot `vllm serve` in a boot turn, sleep it, release, then supervise it."""
    vcfg = VllmConfig(
        ready_file=kw.pop("ready_file"),
        boot_timeout=kw.pop("boot_timeout"),
        health_timeout=kw.pop("health_timeout"),
        sleep_level=kw.pop("sleep_level"),
        sleep_timeout=kw.pop("sleep_timeout"),
        sleep_mode_flag=not kw.pop("no_sleep_mode_flag"),
    )
    _launch(kw, VllmProfile(vcfg, kw["workload"]))


def slicerctl_run() -> click.Command:
    """`slicer-launch run` as `slicerctl run` (entry point group `gpu_slicer.slicerctl`):
    the launcher's options, help and code; only `--socket` is left out, the group's is
    passed instead."""
    base = run

    @click.pass_context
    def callback(ctx: click.Context, /, **kw: Any) -> None:
        ctx.invoke(base, socket=ctx.obj, **kw)  # exits with the launcher's code

    return click.Command(
        "run",
        callback=callback,
        params=[p for p in base.params if p.name != "socket"],
        help=base.help,
        short_help="Run COMMAND as a registered workload (slicer-launch run).",
        context_settings=base.context_settings,
    )


if __name__ == "__main__":
    main()
