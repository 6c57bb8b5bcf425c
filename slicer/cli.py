"""`slicerctl`: look at and use a running slicerd from a shell.

`ping`, `status`, `workloads` and `watch` talk to the daemon (PING, STATUS, WATCH); `run`
is `slicer-launch run` (the launcher's own code) with the group's `--socket`; `demo` is
`make demo`; `completion bash|zsh` prints the shell completion script.

`watch` follows the daemon across restarts: when the connection drops it says so in one
line on stderr, reconnects with a capped backoff (each attempt bounded) until Ctrl-C or
SIGTERM, says when it is back, and goes on printing the new daemon's events (events while
no daemon ran are not replayed). `watch --once` ends with the stream instead (exit 69).

Every command that prints data takes `--json` for scripts (`demo` passes it to the demo).
Times are shown in local time. A failure is one line on stderr, ``slicerctl: error: WHAT
(WHAT TO DO)``, never a traceback. Exit codes: 0 success, 1 the daemon answered ERR (or
sent a line we could not parse), 64 (EX_USAGE) usage error (bare `slicerctl`: the help on
stderr; a socket path too long for a Unix socket), 69 (EX_UNAVAILABLE) the daemon cannot
be reached or stopped answering, 74 (EX_IOERR) the output could not be written (a full
disk), 77 (EX_NOPERM) permission denied on its socket, 70 (EX_SOFTWARE) an internal error;
a reader that goes away (`slicerctl status | head -1`) ends it quietly with 0. `run` exits
with the launcher's codes (the child's own, 69, 70, 78, ...), `demo` with the demo's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
from click.shell_completion import BashComplete, ShellComplete, ZshComplete

from gpu_slicer import proto
from gpu_slicer.slicer.client import ClientError, Slicer, Unreachable, socket_path
from gpu_slicer.slicer.exits import (
    EX_NOPERM,
    EX_UNAVAILABLE,
    EX_USAGE,
    CliFailure,
    OneLineGroup,
)

REPLY_TIMEOUT = 30.0  # seconds to wait for a reply to PING/STATUS/WATCH
# watch's reconnection: each attempt (connect + WATCH) is bounded by RECONNECT_TIMEOUT; the
# pause between attempts doubles from RECONNECT_FIRST up to RECONNECT_CAP.
RECONNECT_TIMEOUT = 5.0
RECONNECT_FIRST = 0.1
RECONNECT_CAP = 2.0
PROG = "slicerctl"
COMPLETE_VAR = "_SLICERCTL_COMPLETE"  # what click derives from PROG; the scripts set it
SHELLS: dict[str, type[ShellComplete]] = {"bash": BashComplete, "zsh": ZshComplete}

F = TypeVar("F", bound=Callable[..., Any])


UNREACHABLE_HINT = "is slicerd running? check `systemctl status slicer`, or pass --socket"
SUN_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108, NUL included)


def _fail(code: int, message: str) -> NoReturn:
    raise CliFailure(message, code)


def _why(e: Unreachable) -> str:
    cause = e.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return e.text


def _connect(path: str, timeout: float) -> Slicer:
    """A connection to slicerd at `path`, or `CliFailure` saying why there is none."""
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        _fail(
            EX_USAGE,
            f"socket path is {len(os.fsencode(path))} bytes, longer than a Unix socket path "
            f"may be ({SUN_PATH_MAX}) (give a shorter --socket or SLICER_SOCKET)",
        )
    try:
        return Slicer(path, timeout=timeout)
    except Unreachable as e:
        if isinstance(e.__cause__, PermissionError):
            _fail(
                EX_NOPERM,
                f"permission denied on slicerd's socket {path} (join the socket's group, "
                "see socket_group in slicer.toml, or run as root)",
            )
        if _not_a_socket(path):
            _fail(
                EX_UNAVAILABLE,
                f"cannot reach slicerd at {path}: it is not a socket (check --socket and "
                "SLICER_SOCKET: slicerd's socket is the path it logs at start)",
            )
        _fail(EX_UNAVAILABLE, f"cannot reach slicerd at {path}: {_why(e)} ({UNREACHABLE_HINT})")


def _not_a_socket(path: str) -> bool:
    try:
        return not stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False  # absent or unreachable: the connect's own reason says it


@contextlib.contextmanager
def _session(path: str, timeout: float = REPLY_TIMEOUT) -> Iterator[Slicer]:
    """A connection to slicerd; failures become one line on stderr and an exit code."""
    s = _connect(path, timeout)
    try:
        with s:
            yield s
    except Unreachable as e:
        _fail(
            EX_UNAVAILABLE,
            f"lost the connection to slicerd at {path}: {_why(e)} ({UNREACHABLE_HINT})",
        )
    except TimeoutError:
        _fail(
            EX_UNAVAILABLE,
            f"slicerd at {path} sent no reply within {timeout:g} s "
            "(it may be stuck or overloaded: check `journalctl -u slicer`)",
        )
    except ClientError as e:
        _fail(1, f"slicerd answered ERR {e}")
    except proto.ProtocolError as e:
        _fail(1, f"bad reply from slicerd at {path}: {e} (is it a slicerd of this version?)")


def _json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(f)


def _events(s: Slicer) -> Iterator[dict[str, Any]]:
    """Event bodies after WATCH, forever."""
    while True:
        msg = s.next_message()
        if isinstance(msg, proto.Event):
            yield msg.body


def cell(value: object) -> str:
    """One value as table/`k=v` text: None is "-", lists are comma-joined."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value) if value else "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """An aligned text table; columns whose values are all numbers are right-aligned."""
    raw = [list(r) for r in rows]
    numeric = [
        bool(raw) and all(r[i] is None or isinstance(r[i], int | float) for r in raw)
        for i in range(len(headers))
    ]
    cells = [list(headers), *([cell(v) for v in r] for r in raw)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def gpu_table(st: dict[str, Any]) -> str:
    """The GPUs of a STATUS body as a table."""
    rows = []
    for g in st.get("gpus", []):
        h = g.get("holder")
        holder = f"{h['workload']}/{h['turn']}" if h else None
        rows.append(
            [
                g.get("index"),
                g.get("uuid"),
                g.get("resident"),
                holder,
                cell(g.get("queue") or []),
                g.get("grants"),
                g.get("busy"),
                len(g.get("foreign") or []),
            ]
        )
    headers = ["GPU", "UUID", "RESIDENT", "HOLDER", "QUEUE", "GRANTS", "BUSY", "FOREIGN"]
    return render_table(headers, rows)


def workload_table(workloads: list[dict[str, Any]]) -> str:
    """The workloads of a STATUS body as a table ("no workloads" when there are none)."""
    if not workloads:
        return "no workloads"
    rows = [
        [
            w.get("name"),
            w.get("gpu"),
            w.get("state"),
            w.get("turn"),
            cell(w.get("pids") or []),
            w.get("parks"),
            w.get("restores"),
            w.get("last_park_ms"),
            w.get("last_restore_ms"),
            w.get("faults"),
            w.get("wasted_turns"),
        ]
        for w in workloads
    ]
    headers = ["WORKLOAD", "GPU", "STATE", "TURN", "PIDS", "PARKS", "RESTORES"]
    headers += ["PARK_MS", "RESTORE_MS", "FAULTS", "WASTED"]
    if any(w.get("ns_pid") is not None for w in workloads):
        # A registrant in a pod knows its own numbers: the registered process's, there.
        for row, w in zip(rows, workloads, strict=True):
            row.insert(5, w.get("ns_pid"))
        headers.insert(5, "POD_PID")
    return render_table(headers, rows)


def duration(seconds: float) -> str:
    """A span for people: "42.5s", "5m 03s", "2h 05m", "3d 04h"."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h:02d}h"
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def local_time(wall: float) -> str:
    """A wall-clock time (epoch seconds) in local time, with the zone's name."""
    return datetime.fromtimestamp(wall).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def uptime_text(uptime_s: object, now: float | None = None) -> str:
    """The daemon's uptime and start in local time: `up 5m 03s (since 2024-01-02 03:04:05
    CET)`; `now` is the wall clock (epoch seconds), default the current time."""
    if not isinstance(uptime_s, int | float) or isinstance(uptime_s, bool):
        return "up ?"
    since = (time.time() if now is None else now) - uptime_s
    return f"up {duration(uptime_s)} (since {local_time(since)})"


def status_text(st: dict[str, Any], now: float | None = None) -> str:
    """A STATUS body as text: a summary line, the GPU table, the workload table."""
    totals = st.get("totals") or {}
    summary = [f"slicerd {st.get('version', '?')}", uptime_text(st.get("uptime_s"), now)]
    if "connections" in st:
        summary.append(f"{st['connections']} connections")
    summary += [f"{k} {v}" for k, v in totals.items()]
    head = ["  ".join(summary)]
    check = st.get("parker_check")
    if isinstance(check, dict) and check.get("ok") is False:
        # The one thing a new install gets wrong: say it before the tables.
        head.append(
            f"parker {check.get('kind', '?')} cannot run: {check.get('error')}; "
            "REGISTERs that need it are refused"
        )
    return "\n\n".join(["\n".join(head), gpu_table(st), workload_table(st.get("workloads") or [])])


def format_event(body: dict[str, Any], at: datetime) -> str:
    """One WATCH event as a line: arrival time, event, workload, turn, then other keys."""
    stamp = f"{at:%H:%M:%S}.{at.microsecond // 1000:03d}"
    skip = {"event", "t", "workload", "turn"}
    extra = " ".join(f"{k}={cell(v)}" for k, v in body.items() if k not in skip)
    head = f"{stamp}  {cell(body.get('event')):<12} {cell(body.get('workload'))}"
    return f"{head}  turn={cell(body.get('turn'))}  {extra}".rstrip()


@click.group(name=PROG, cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "sock",
    metavar="PATH",
    default=None,
    help="slicerd's socket [default: $SLICER_SOCKET, else /run/slicer/slicer.sock].",
)
@click.pass_context
def main(ctx: click.Context, sock: str | None) -> None:
    """Inspect and use a running slicerd: its GPUs, workloads, turns and events."""
    if sock == "":  # never silently the default socket instead
        raise click.BadParameter(
            "is empty: give slicerd's socket path, or leave it out", param_hint="'--socket'"
        )
    ctx.obj = socket_path(sock)


@main.command()
@_json_option
@click.pass_obj
def ping(path: str, as_json: bool) -> None:
    """Check that slicerd answers; print the round-trip time."""
    with _session(path) as s:
        t0 = time.perf_counter()
        s.request(proto.Ping())
        rtt_us = int((time.perf_counter() - t0) * 1e6)
    click.echo(json.dumps({"ok": True, "rtt_us": rtt_us}) if as_json else f"ok ({rtt_us} us)")


@main.command()
@_json_option
@click.pass_obj
def status(path: str, as_json: bool) -> None:
    """Show every GPU and workload (`--json`: the STATUS body as sent)."""
    with _session(path) as s:
        st = s.status()
    click.echo(json.dumps(st) if as_json else status_text(st))


@main.command()
@_json_option
@click.pass_obj
def workloads(path: str, as_json: bool) -> None:
    """Show the workload table only (`--json`: the list of workload objects)."""
    with _session(path) as s:
        ws = s.status().get("workloads") or []
    click.echo(json.dumps(ws) if as_json else workload_table(ws))


@main.command()
@_json_option
@click.option(
    "--count", type=click.IntRange(min=1), default=None, help="Stop after this many events."
)
@click.option(
    "--once",
    is_flag=True,
    help="End when the daemon goes away (exit 69) instead of reconnecting.",
)
@click.pass_obj
def watch(path: str, as_json: bool, count: int | None, once: bool) -> None:
    """Print each state change as it happens, until Ctrl-C (or `--count` events).

    When the daemon restarts, watch says so on stderr, reconnects (retrying with a capped
    backoff until it is back, or Ctrl-C/SIGTERM) and goes on; `--once` exits 69 instead."""
    seen = 0

    def show(body: dict[str, Any]) -> bool:
        nonlocal seen
        click.echo(json.dumps(body) if as_json else format_event(body, datetime.now()))
        seen += 1
        return count is not None and seen >= count

    try:
        with _session(path) as s:
            s.request(proto.Watch())
            click.echo(f"slicerctl: watching slicerd at {path} (Ctrl-C to stop)", err=True)
            if once:
                for body in _events(s):
                    if show(body):
                        return
                return
            lost = _follow(s, show)
        while lost is not None:
            click.echo(f"slicerctl: daemon connection lost ({lost}); reconnecting", err=True)
            s = _reconnect(path)
            with s:
                click.echo(f"slicerctl: reconnected to {path}", err=True)
                lost = _follow(s, show)
    except KeyboardInterrupt:
        return
    except BrokenPipeError:  # `slicerctl watch | head`: the reader left; so do we, quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _follow(s: Slicer, show: Callable[[dict[str, Any]], bool]) -> str | None:
    """Show the events of a subscribed connection; None once `show` says stop, else why
    the connection ended."""
    try:
        for body in _events(s):
            if show(body):
                return None
    except Unreachable as e:
        return _why(e)
    except proto.ProtocolError as e:  # a line cut off by the daemon's death, say
        return f"bad line: {e}"
    raise AssertionError("unreachable: _events never ends")  # pragma: no cover


def _reconnect(path: str) -> Slicer:
    """A new connection to `path`, subscribed with WATCH: tries until it works, each try
    bounded by RECONNECT_TIMEOUT, pausing a doubling delay capped at RECONNECT_CAP."""
    pause = RECONNECT_FIRST
    while True:
        try:
            s = Slicer(path, timeout=RECONNECT_TIMEOUT)
        except Unreachable:
            pass
        else:
            try:
                s.request(proto.Watch(), timeout=RECONNECT_TIMEOUT)
                return s
            except (ClientError, TimeoutError, proto.ProtocolError):
                s.close()  # a daemon still starting, or at its limits: try again
        time.sleep(pause)
        pause = min(pause * 2, RECONNECT_CAP)


# Commands other packages add to slicerctl: entry points of this group, each a function
# returning a click command (the launcher's `run`). Found at run time, so slicerctl never
# imports the launcher (which imports slicer's client: no package cycle).
COMMANDS_GROUP = "gpu_slicer.slicerctl"


def _add_plugin_commands() -> None:
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            if ep.name in main.commands:  # a plugin never replaces a built-in command
                raise ValueError("a command of that name exists")
            main.add_command(ep.load()(), ep.name)
        except Exception as e:  # a broken plugin must not take the other commands down
            click.echo(f"slicerctl: command {ep.name!r} ({ep.value}) unavailable: {e}", err=True)


_add_plugin_commands()


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> None:
    """Run the demo (`make demo`): its own slicerd on a fake GPU, a vLLM stub under the
    launcher, the dispatcher and a trainer stub publishing revisions (`--mode trainers`:
    two trainer stubs only). ARGS go to the demo: `slicerctl demo -- --revisions 2`; its
    options: `slicerctl demo -- --help`. It runs from a checkout (exit 69 elsewhere)."""
    sys.exit(run_demo(list(args)))


# The demo is no part of the product: it is the checkout's top-level `demo` package. The
# checkout is where this file really lives (gpu_slicer/slicer is a link to slicer/); an
# installed wheel has no demo beside it. The child runs with `-P` and the checkout alone on
# its path: a `demo` folder in whatever directory slicerctl runs from (perhaps under sudo)
# is never imported.
CHECKOUT = Path(__file__).resolve().parent.parent
DEMO_MISSING = "slicerctl demo: the demo runs from a checkout of gpu-slicer (`make demo` there)"


def run_demo(args: list[str]) -> int:
    """Run the checkout's demo (`python -m demo ARGS`) and return its exit status (128+N
    when signal N ended it); EX_UNAVAILABLE, with one line on stderr, without a checkout."""
    if not (CHECKOUT / "demo" / "__main__.py").is_file():
        click.echo(DEMO_MISSING, err=True)
        return EX_UNAVAILABLE
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), *([path] if path else [])])}
    out, err = _demo_stream(sys.stdout), _demo_stream(sys.stderr)
    argv = [sys.executable, "-P", "-m", "demo", *args]
    proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
    with _signals_to(proc):
        got_out, got_err = proc.communicate()
    if got_out:  # our streams had no file descriptor (click's CliRunner): relay
        click.echo(got_out.decode(errors="replace"), nl=False)
    if got_err:
        click.echo(got_err.decode(errors="replace"), nl=False, err=True)
    return 128 - proc.returncode if proc.returncode < 0 else proc.returncode


def _demo_stream(stream: Any) -> int:
    """The descriptor the demo inherits for `stream`, or PIPE when it has none."""
    try:
        fd = int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return subprocess.PIPE
    stream.flush()
    return fd


@contextlib.contextmanager
def _signals_to(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """While the demo runs, SIGTERM and SIGHUP are passed on to it (it ends its stack
    cleanly) and SIGINT is ignored: Ctrl-C reaches the demo from the terminal itself, and
    a second SIGINT would cut the demo's own cleanup short."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the caller owns the signals then
        return

    def forward(signum: int, _frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


@main.command()
@click.argument("shell", type=click.Choice(sorted(SHELLS)))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the SHELL completion script.

    \b
    bash: eval "$(slicerctl completion bash)"   (e.g. in ~/.bashrc)
    zsh:  eval "$(slicerctl completion zsh)"    (e.g. in ~/.zshrc, after compinit)
    """
    root = ctx.find_root().command
    click.echo(SHELLS[shell](root, {}, PROG, COMPLETE_VAR).source())


if __name__ == "__main__":
    main(prog_name=PROG)
