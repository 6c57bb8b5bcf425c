"""What `slicer-dispatch` checks before it serves, and its startup failures in one line.

A bad argument is a usage error (64), found before anything is opened: the replica URL
must be an absolute ``http://`` or ``https://`` URL with a host (``--replica
127.0.0.1:8000`` is refused with the form to use), ``--listen`` must be ``HOST:PORT``,
the workload and pool names must follow the names' rule. A state dir another dispatcher
owns (75), a state dir or store that cannot be created or opened (73), a damaged store
(65) and a front address that cannot be bound (69; 77 when permission is denied; for
``--listen-unix``, a live socket 69 and a path that is no socket 73:
:func:`claim_unix_socket`) are `CliFailure`s naming the path or the address and what to
do. Durations must be finite numbers of seconds (:class:`Seconds`), the log level one of
``LOG_LEVELS`` in any case. An unreachable slicerd is
none of these: the dispatcher starts and waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import sqlite3
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import httpx

from gpu_slicer import proto
from gpu_slicer.dispatcher.errors import BadRequest, StateInUse, StoreError
from gpu_slicer.dispatcher.owner import StateLock
from gpu_slicer.dispatcher.poolurl import check_url
from gpu_slicer.dispatcher.store import Store, check_revision_name
from gpu_slicer.slicer.exits import (
    EX_CANTCREAT,
    EX_DATAERR,
    EX_NOPERM,
    EX_TEMPFAIL,
    EX_UNAVAILABLE,
    CliFailure,
)

__all__ = [
    "LOG_LEVELS",
    "SECONDS",
    "SECONDS_OR_ZERO",
    "Seconds",
    "bind_failure",
    "check_listen",
    "check_name",
    "check_replica_url",
    "claim_unix_socket",
    "open_state",
    "probe_bind",
]

_GOOD_URL = "e.g. http://127.0.0.1:8000"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_PROBE_CONNECT_S = 1.0  # claim_unix_socket: how long a live socket may take to answer


class Seconds(click.FloatRange):
    """A duration option: a finite number of seconds, > 0 (``min_open``) or >= 0.

    click's FloatRange lets ``nan`` and ``inf`` through (no comparison fails on them)."""

    name = "seconds"

    def __init__(self, *, zero_ok: bool) -> None:
        super().__init__(min=0.0, min_open=not zero_ok)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The value as a float, or a usage error naming the option."""
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return rv


SECONDS = Seconds(zero_ok=False)
SECONDS_OR_ZERO = Seconds(zero_ok=True)


def check_replica_url(_ctx: click.Context, _param: click.Parameter, url: str) -> str:
    """``--replica``: an absolute http(s) URL with a host and a valid port, no query."""
    if "://" not in url:
        raise click.BadParameter(f"{url!r} has no scheme: give the replica's URL, {_GOOD_URL}")
    try:
        u = urlsplit(url)
        u.port  # noqa: B018  # raises ValueError for a port that is not a number
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as e:
        raise click.BadParameter(f"{url!r} is not a valid URL ({e}): {_GOOD_URL}") from None
    if u.scheme not in ("http", "https"):
        raise click.BadParameter(f"{url!r}: the scheme must be http or https, {_GOOD_URL}")
    if not u.hostname:
        raise click.BadParameter(f"{url!r} names no host: {_GOOD_URL}")
    if u.query or u.fragment:
        raise click.BadParameter(f"{url!r}: a base URL has no ?query or #fragment, {_GOOD_URL}")
    return url


def check_listen(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--listen``: ``HOST:PORT`` (IPv6 as ``[::1]:PORT``), the port 0-65535."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT, e.g. 127.0.0.1:8100 or [::1]:8100")
    return value


def check_queue(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--queue``: ``redis://HOST[:PORT][/DB]`` or ``unix:///PATH[?db=N]``."""
    if value is None:
        return None
    try:
        return check_url(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


MIN_RECLAIM_IDLE_S = 3.0


def check_reclaim_idle(
    _ctx: click.Context, _param: click.Parameter, value: float | None
) -> float | None:
    """``--reclaim-idle``: at least :data:`MIN_RECLAIM_IDLE_S` (a live dispatcher's
    heartbeat runs every second at best, so a shorter bound would take its claims)."""
    if value is not None and value < MIN_RECLAIM_IDLE_S:
        raise click.BadParameter(
            f"{value:g} s is shorter than {MIN_RECLAIM_IDLE_S:g} s: a live dispatcher's "
            "heartbeat (every second at best) could not keep its claims"
        )
    return value


def check_consumer(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--consumer``: 1-100 printable ASCII characters, no space (a Redis consumer name)."""
    if value is not None and not (
        0 < len(value) <= 100 and value.isascii() and value.isprintable() and " " not in value
    ):
        raise click.BadParameter(
            f"{value!r:.120} must be 1-100 printable ASCII characters, no space"
        )
    return value


def check_early_start(_ctx: click.Context, _param: click.Parameter, value: str) -> int | None:
    """``--early-start``: ``auto`` (None: the revision's weight files), ``off`` (0), or a
    size in bytes (``16GiB``; B, KiB, MiB, GiB, up to slicerd's limit)."""
    if value == "auto":
        return None
    if value == "off":
        return 0
    try:
        size = proto.parse_size(value)
    except proto.ProtocolError:
        raise click.BadParameter(
            f"{value!r:.60} is not auto, off or a size such as 16GiB (B, KiB, MiB, GiB)"
        ) from None
    if size > proto.EARLY_LIMIT:
        raise click.BadParameter(f"{value!r:.60} is over {proto.format_size(proto.EARLY_LIMIT)}")
    return size


def check_base_revision(_ctx: click.Context, _param: click.Parameter, value: str) -> str | None:
    """``--base-revision``: a revision name (the store's rule), or ``''`` for none."""
    if value == "":
        return None
    try:
        return check_revision_name(value)
    except BadRequest as e:
        raise click.BadParameter(str(e)) from None


def check_name(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--workload``/``--pool``: the names' rule of slicerd and the store."""
    if value is not None:
        try:
            proto.validate_name(value)
        except proto.ProtocolError as e:
            raise click.BadParameter(e.message) from None
    return value


def open_state(state_dir: str, pool: str, sync: str) -> tuple[StateLock, Store]:
    """Take the state dir's lock, then open its store; `CliFailure` when either fails."""
    try:
        lock = StateLock.acquire(state_dir)
    except StateInUse as e:
        raise CliFailure(str(e), EX_TEMPFAIL) from None
    except StoreError as e:
        todo = "make it writable by this user, or give another --state-dir"
        raise CliFailure(f"{e} ({todo})", EX_CANTCREAT) from None
    try:
        return lock, Store(state_dir, pool, synchronous=sync)
    except BadRequest as e:
        lock.release()
        raise click.UsageError(str(e)) from None
    except StoreError as e:
        lock.release()
        raise _store_failure(e, Path(state_dir)) from None
    except BaseException:
        lock.release()
        raise


def _store_failure(e: StoreError, state_dir: Path) -> CliFailure:
    cause = e.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    # SQLITE_CORRUPT (11) and SQLITE_NOTADB (26): the file itself is damaged.
    if isinstance(cause, sqlite3.DatabaseError) and code is not None and code & 0xFF in (11, 26):
        todo = "move the file aside to start an empty store, or restore it from a backup"
        return CliFailure(f"{e}: the store is damaged ({todo})", EX_DATAERR)
    todo = f"check the permissions and free space of {state_dir}, or give another --state-dir"
    return CliFailure(f"{e} ({todo})", EX_CANTCREAT)


def claim_unix_socket(path: str) -> None:
    """Make ``path`` free for ``--listen-unix``: nothing there is fine; a socket file that
    nothing answers on (a previous run's) is removed; a socket something answers a
    connect() on (within ``_PROBE_CONNECT_S``) is refused, 69, and so is a path that is
    no socket, 73: neither is ever removed."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise bind_failure(f"unix:{path}", e) from None
    if not stat.S_ISSOCK(mode):
        todo = "move it away, or give another path with --listen-unix PATH"
        raise CliFailure(f"{path} exists and is not a socket ({todo})", EX_CANTCREAT)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_CONNECT_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # dead: nobody listens
        except TimeoutError:
            _in_use(path, "it did not answer within 1 s but holds the socket")
        except OSError as e:
            raise bind_failure(f"unix:{path}", e) from None
        else:
            _in_use(path, "a process answers on it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket of a previous run


def _in_use(path: str, why: str) -> None:
    todo = "stop it, or give another path with --listen-unix PATH"
    raise CliFailure(f"cannot listen on {path}: the socket is in use: {why} ({todo})",
                     EX_UNAVAILABLE)  # fmt: skip


def probe_bind(bind: str) -> None:
    """Bind `bind` once and let go, so that a busy address fails before the turn loop
    says anything (the front binds for real later and maps a failure the same way)."""
    unix = bind.startswith("unix:")
    family = socket.AF_UNIX if unix else socket.AF_INET
    host, _, port = bind.replace("[", "").replace("]", "").rpartition(":")
    if not unix and ":" in host:
        family = socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            if unix:
                sock.bind(bind[5:])
                os.unlink(bind[5:])
            else:
                # As the front binds: SO_REUSEADDR, so a TIME_WAIT port does not fail.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, int(port)))
                sock.listen(1)  # EADDRINUSE may come only here (another SO_REUSEPORT one)
    except OSError as e:
        raise bind_failure(bind, e) from None


def bind_failure(bind: str, e: OSError) -> CliFailure:
    """The failure for a front that cannot listen on `bind` (``HOST:PORT`` or ``unix:P``)."""
    flag = "--listen-unix PATH" if bind.startswith("unix:") else "--listen HOST:PORT"
    where = bind.removeprefix("unix:")
    why = e.strerror or str(e)
    if e.errno == errno.EADDRINUSE:
        todo = f"another process listens there: stop it, or pick another address with {flag}"
    elif e.errno == errno.EACCES:
        todo = f"this user may not listen there (ports below 1024 need privileges): see {flag}"
        return CliFailure(f"cannot listen on {where}: {why} ({todo})", EX_NOPERM)
    else:
        todo = f"give an address of this host with {flag}"
    return CliFailure(f"cannot listen on {where}: {why} ({todo})", EX_UNAVAILABLE)
