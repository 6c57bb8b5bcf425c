"""Exit codes (sysexits.h style) and the one-line failure every command-line tool prints.

slicerd, slicerctl, slicer-launch and slicer-dispatch never end in a traceback: a failure
is one line on stderr, ``PROG: error: WHAT (WHAT TO DO)``, and a documented exit code.
Each entry point runs its click command through `run_command` (or is declared with
``cls=OneLineCommand``/``cls=OneLineGroup``, whose standalone ``main()``, the console
script's and click's ``CliRunner``'s, is `run_command`), and raises `CliFailure` (or a
subclass of click's `ClickException`/`UsageError`) for a failure it knows.

A command given no arguments where it needs some (bare ``slicerctl``, bare
``slicer-launch``) prints its help to stderr and exits 64. Output that cannot be written is
no bug: a reader that went away (``slicerctl status | head -1``, a broken pipe) ends the
command quietly with 0, and any other write failure on stdout (``>/dev/full``) is one line
and exit 74 (EX_IOERR).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Sequence
from typing import IO, Any, NoReturn

import click

__all__ = [
    "EX_CANTCREAT",
    "EX_CONFIG",
    "EX_DATAERR",
    "EX_IOERR",
    "EX_NOINPUT",
    "EX_NOPERM",
    "EX_OK",
    "EX_OSERR",
    "EX_SOFTWARE",
    "EX_TEMPFAIL",
    "EX_UNAVAILABLE",
    "EX_USAGE",
    "CliFailure",
    "OneLineCommand",
    "OneLineGroup",
    "one_line",
    "run_command",
    "single_error",
]

EX_OK = 0
EX_USAGE = 64  # bad arguments or options
EX_DATAERR = 65  # input data is malformed
EX_NOINPUT = 66  # an input file does not exist or is unreadable
EX_UNAVAILABLE = 69  # a service it needs (slicerd, a port, the replica) is unavailable
EX_SOFTWARE = 70  # an internal error (a bug); the launcher also uses 70 for a FAULT
EX_OSERR = 71  # the operating system refused something (fork, a socket)
EX_CANTCREAT = 73  # cannot create an output file or directory
EX_IOERR = 74  # an output could not be written (stdout on a full disk, say)
EX_TEMPFAIL = 75  # a bounded wait ran out: retrying later may work
EX_NOPERM = 77  # permission denied
EX_CONFIG = 78  # configuration is wrong or refused (includes a refused REGISTER)


class CliFailure(click.ClickException):
    """A failure the command knows: ``message`` (what and what to do) and ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it per class


def one_line(text: str) -> str:
    """``text`` folded onto one line (tracebacks and multi-line messages never reach users)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def single_error(exc: BaseException) -> BaseException:
    """The one error inside nested one-member exception groups (trio's nurseries wrap
    each failure in one); ``exc`` itself when a group holds several."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _say(prog: str, text: str, out: IO[str] | None = None) -> None:
    # When stderr itself cannot be written, the exit code is all that is left.
    with contextlib.suppress(OSError):
        print(f"{prog}: error: {one_line(text)}", file=out or sys.stderr, flush=True)


def run_command(
    command: click.Command, prog: str, args: Sequence[str] | None = None, **extra: Any
) -> NoReturn:
    """Run ``command`` (click, non-standalone) and exit with one line on any failure.

    Usage errors exit 64 with a pointer to ``--help`` (no arguments at all: the help, on
    stderr, and 64); `CliFailure` and other `ClickException`s print their message with
    their code; Ctrl-C exits 130; a broken pipe on stdout exits 0 quietly, another failed
    write to stdout is one line and 74; anything unexpected (a bug) prints its type and text
    on one line and exits 70. `extra` goes to click's ``main`` (``complete_var``, context
    settings).
    """
    stdout = sys.stdout
    try:
        rv = command.main(
            args=list(args) if args is not None else None,
            prog_name=prog,
            standalone_mode=False,
            **extra,
        )
    except click.exceptions.NoArgsIsHelpError as e:
        # Its message is the whole help: shown as help, not folded into an error line.
        click.echo(e.format_message(), err=True)
        sys.exit(EX_USAGE)
    except click.UsageError as e:
        hint = f"see '{prog} --help'" if e.ctx is None else f"see '{e.ctx.command_path} --help'"
        _say(prog, f"{e.format_message()} ({hint})")
        sys.exit(EX_USAGE)
    except click.ClickException as e:
        _say(prog, e.format_message())
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(EX_OK)
    except SystemExit:
        if sys.stdout is not stdout:
            # click caught an EPIPE on stdout and swapped in its flush-pacifying wrapper
            # before exiting 1: the reader left, which is no failure of ours.
            _quiet_stdout()
            sys.exit(EX_OK)
        raise
    except OSError as e:
        if not _from_echo(e):
            _say(prog, f"internal error: {type(e).__name__}: {e} (a bug; please report it)")
            sys.exit(EX_SOFTWARE)
        _quiet_stdout()
        _say(prog, f"cannot write the output: {e.strerror or e} (check where stdout goes)")
        sys.exit(EX_IOERR)
    except Exception as e:  # a bug: still one line, and the code that says so
        _say(prog, f"internal error: {type(e).__name__}: {e} (a bug; please report it)")
        sys.exit(EX_SOFTWARE)
    sys.exit(rv if isinstance(rv, int) else 0)


def _from_echo(e: BaseException) -> bool:
    # An OSError is the output's failure when it was raised writing the output: every
    # command prints through click.echo. (Probing stdout afterwards tells nothing: a
    # failed flush drops its buffer, so the next flush succeeds.)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is click.echo.__code__:
            return True
        tb = tb.tb_next
    return False


def _quiet_stdout() -> None:
    # The interpreter flushes stdout once more at exit; pointing its descriptor at
    # /dev/null keeps that flush from printing "Exception ignored ..." to stderr.
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # no descriptor (click's CliRunner): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    except OSError as e:
        if e.errno != errno.EBADF:
            raise
    finally:
        os.close(devnull)


class _OneLine:
    """``main()`` for a click command class: standalone, it is `run_command`."""

    name: str | None

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Parse and run; standalone, every failure is one line and an exit code."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)  # type: ignore[misc]
        assert isinstance(self, click.Command)
        run_command(self, prog_name or self.name or "", args, complete_var=complete_var, **extra)


class OneLineCommand(_OneLine, click.Command):
    """A click command whose standalone ``main()`` is `run_command` (prog: its name)."""


class OneLineGroup(_OneLine, click.Group):
    """A click group whose standalone ``main()`` is `run_command` (prog: its name)."""
