"""The daemon's listening socket: bound here, or adopted from systemd socket activation."""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat

import trio

from gpu_slicer.slicer.errors import ConfigError

SD_LISTEN_FDS_START = 3


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
    os.makedirs(parent, mode=0o755, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise SocketBusy(
                f"another daemon is listening on {path} (stop it, or give this one its own "
                "--socket)"
            )
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
