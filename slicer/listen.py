"""The daemon's listening socket: bound here, or adopted from systemd socket activation.

A socket file already at the path is probed: nobody answering (refused) means stale, and
it is replaced; a daemon that accepts, or one too busy to accept within `PROBE_TIMEOUT`
(its backlog full, or stuck), means busy (`SocketBusy`): never two daemons on one path.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat

import trio

from gpu_slicer.slicer.errors import ConfigError

SD_LISTEN_FDS_START = 3
PROBE_TIMEOUT = 1.0  # seconds a connect to an existing socket file may take


class SocketBusy(ConfigError):
    """Another daemon listens on the socket path (slicerd exits 69 on it, not 78)."""


def _adopted() -> socket.socket | None:
    """The socket systemd passed us (LISTEN_FDS/LISTEN_PID), if any."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = int(os.environ.get("LISTEN_FDS", "0") or 0)
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)  # not for our children
    if count < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ConfigError("systemd passed a socket that is not a Unix stream socket")
    sock.setblocking(False)
    return sock


def _bind(path: str, mode: int, group: str | None) -> socket.socket:
    parent = os.path.dirname(os.path.abspath(path))
    blocker = _not_a_directory(parent)
    if blocker is not None:
        raise ConfigError(
            f"cannot listen on {path}: {blocker} is not a directory (choose another --socket)"
        )
    os.makedirs(parent, mode=0o755, exist_ok=True)
    busy = SocketBusy(
        f"another daemon is listening on {path} (stop it, or give this one its own --socket)"
    )
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a socket"
            raise ConfigError(
                f"{path} exists and is {what} (remove it if it is left over, or choose "
                "another --socket)"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(PROBE_TIMEOUT)
        try:
            probe.connect(path)
        except (TimeoutError, BlockingIOError):
            # Alive but not accepting (a full backlog answers EAGAIN at once, a stuck
            # accept loop lets the connect time out): still not ours to take.
            raise busy from None
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise busy
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    # The socket is created with the final mode so no client can race a chmod.
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError as e:
            sock.close()
            raise ConfigError(f"socket_group {group!r} does not exist") from e
        os.chown(path, -1, gid)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _not_a_directory(path: str) -> str | None:
    # The nearest existing ancestor of `path`, when it is not a directory (makedirs would
    # say only "File exists").
    while True:
        if os.path.lexists(path):
            return None if os.path.isdir(path) else path
        up = os.path.dirname(path)
        if up == path:
            return None
        path = up


def open_listener(path: str, mode: int, group: str | None) -> tuple[trio.SocketListener, bool]:
    """A trio listener and whether we bound it ourselves (then we unlink it on exit)."""
    adopted = _adopted()
    try:
        sock = adopted if adopted is not None else _bind(path, mode, group)
    except OSError as e:
        raise ConfigError(
            f"cannot listen on {path}: {e.strerror or e} (its directory must be writable "
            "by slicerd; or choose another --socket)"
        ) from e
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    return listener, adopted is None
