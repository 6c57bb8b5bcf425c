"""A real ``redis-server`` (7.x) for the tests, the demo and the bench: not a fake.

`RedisServer` runs the installed binary (Debian's ``redis-server``, or ``$REDIS_SERVER``)
on a private Unix socket, with no TCP port (``port 0``), AOF on (``appendfsync always`` by
default: nothing acknowledged is lost) and no RDB snapshots. `make test` installs the
binary with apt-get where it is missing (the Makefile's ``redis`` target).

- `find_redis_server`: the binary to run, checked to be Redis 7 or newer.
- `RedisServer(dir)`: ``dir`` holds its config (``redis.conf``), its log (``redis.log``:
  show `log_tail` when a test fails) and its AOF (``appendonlydir/``). ``url`` is what the
  dispatcher's ``--queue`` takes (``unix:///...sock?db=0``). ``start`` returns once the
  server sent READY=1 (it is started ``supervised systemd`` with a ``NOTIFY_SOCKET`` of
  ours: readiness is an event, waited for with ``select`` on that socket and the process's
  pidfd, bounded by ``ready_timeout``), which it sends after loading its AOF. ``kill``
  (SIGKILL), ``stop`` (SIGTERM: it fsyncs and exits; SIGKILL after a bound), ``restart``
  (the same dir: it reloads its AOF), ``pause``/``resume`` (SIGSTOP/SIGCONT: Redis is
  unreachable, connections hang, nothing is lost), ``info_memory`` (``INFO memory`` over
  a raw RESP exchange on the socket).
- `running_redis(dir)`: ``with running_redis(tmp_path) as r:``; the server is killed on
  exit, whatever happened.

The socket path: a Unix socket's path is limited to 107 bytes, so when ``dir`` is deep
(pytest's tmp_path can be), the sockets go into a short ``mkdtemp`` under /tmp, removed
by `close` (and by ``__exit__``). A test that dies never leaks the server: it is started
with ``PR_SET_PDEATHSIG`` = SIGKILL (when started from the main thread: the signal follows
the thread that forked, and a worker thread of ``trio.to_thread`` may exit while the server
should run on), and killed by ``__exit__``.

The methods are synchronous and quick (a start takes about 10 ms): call them straight
from trio code, or from ``trio.to_thread.run_sync`` (then without PDEATHSIG, see above).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

MIN_MAJOR = 7
READY_TIMEOUT_S = 10.0
STOP_BOUND_S = 10.0  # SIGTERM to exit, then SIGKILL
KILL_BOUND_S = 10.0
SOCKET_MAX = 100  # bytes of a Unix socket path we allow (the kernel's limit is 107)
INSTALL_HINT = (
    "`make test` installs it (apt-get install redis-server, Debian's Redis 7), "
    "or set REDIS_SERVER to a redis-server binary"
)


class RedisServerError(RuntimeError):
    """redis-server is missing, too old, did not start, or did not answer."""


@functools.cache
def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    m = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    if m is None:
        raise RedisServerError(f"{binary} --version printed no version: {out.strip()!r}")
    return tuple(int(g) for g in m.groups())


def find_redis_server() -> str:
    """The redis-server binary to run: ``$REDIS_SERVER``, else ``redis-server`` on PATH.
    `RedisServerError` (a `RuntimeError`) when there is none or it is older than Redis 7."""
    binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.access(binary, os.X_OK):
        raise RedisServerError(f"no redis-server found ({binary or 'not on PATH'}): {INSTALL_HINT}")
    version = _version(binary)
    if version[0] < MIN_MAJOR:
        raise RedisServerError(
            f"{binary} is Redis {'.'.join(map(str, version))}; Redis {MIN_MAJOR} or newer "
            f"is needed: {INSTALL_HINT}"
        )
    return binary


def _quoted(value: str) -> str:
    # redis.conf's double-quoted strings take backslash escapes.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _die_with_test() -> None:
    # A test process that dies (pytest-timeout's os._exit) takes its Redis with it.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG


class RedisServer:
    """One redis-server on `dir` (its data, config and log), reached at `socket`/`url`.

    `appendfsync` is ``always`` (every write is on disk before it is acknowledged), or
    ``everysec``/``no`` for a bench that measures the difference; `config` adds or
    overrides directives (``{"maxmemory": "64mb"}``)."""

    def __init__(
        self,
        dir: Path | str,
        *,
        appendfsync: str = "always",
        config: Mapping[str, str] | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
    ) -> None:
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.extra = dict(config or {})
        self.ready_timeout = ready_timeout
        self.log = self.dir / "redis.log"
        self._sockdir: Path | None = None
        if len(str(self.dir / "redis.sock").encode()) > SOCKET_MAX:
            self._sockdir = Path(tempfile.mkdtemp(prefix="redis-", dir="/tmp"))
        self.socket = (self._sockdir or self.dir) / "redis.sock"
        self.url = f"unix://{self.socket}?db=0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def pid(self) -> int | None:
        """The running server's pid (None when it is not running)."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive (a paused one is)."""
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> str:
        directives = {
            "port": "0",
            "unixsocket": _quoted(str(self.socket)),
            "unixsocketperm": "700",
            "dir": _quoted(str(self.dir)),
            "appendonly": "yes",
            "appendfsync": self.appendfsync,
            "save": '""',
            "daemonize": "no",
            "supervised": "systemd",
            "protected-mode": "no",
            "loglevel": "notice",
            "logfile": _quoted(str(self.log)),
            # What README "Pools across nodes" recommends: one entry a stream node, so a
            # served request frees its node and a sparse backlog costs what a dense one
            # does (bench/pool_sparse.py).
            "stream-node-max-entries": "1",
            **self.extra,
        }
        return "".join(f"{k} {v}\n" for k, v in directives.items())

    def start(self) -> None:
        """Start the server and return once it is ready (its AOF loaded). `RedisServerError`
        with the log's tail when it exits first or is not ready within `ready_timeout` s."""
        if (pid := self.pid) is not None:
            raise RedisServerError(f"redis-server {pid} already runs on {self.dir}")
        binary = find_redis_server()
        conf = self.dir / "redis.conf"
        conf.write_text(self._config())
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a killed server's leftover
        notify_path = self.socket.with_name("notify.sock")
        with contextlib.suppress(FileNotFoundError):
            notify_path.unlink()
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            notify.bind(str(notify_path))
            env = {**os.environ, "NOTIFY_SOCKET": str(notify_path)}
            main = threading.current_thread() is threading.main_thread()
            with open(self.log, "ab") as log:
                # Before its logfile is open (a bad config) it writes to stderr: same log.
                self.proc = subprocess.Popen(
                    [binary, str(conf)], env=env, cwd=self.dir,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_test if main else None,
                )  # fmt: skip
            self.paused = False
            try:
                self._until_ready(notify)
            except BaseException:
                self.kill()
                raise
        finally:
            notify.close()
            with contextlib.suppress(FileNotFoundError):
                notify_path.unlink()

    def _until_ready(self, notify: socket.socket) -> None:
        assert self.proc is not None
        pidfd = os.pidfd_open(self.proc.pid)
        try:
            deadline = time.monotonic() + self.ready_timeout
            while (left := deadline - time.monotonic()) > 0:
                readable, _, _ = select.select([notify.fileno(), pidfd], [], [], left)
                if notify.fileno() in readable and b"READY=1" in notify.recv(4096):
                    return
                if pidfd in readable:
                    rc = self.proc.wait()
                    raise RedisServerError(
                        f"redis-server exited with {rc} before it was ready:\n{self.log_tail()}"
                    )
            raise RedisServerError(
                f"redis-server was not ready within {self.ready_timeout:g} s:\n{self.log_tail()}"
            )
        finally:
            os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL the server (it loses nothing acknowledged with ``appendfsync always``)
        and reap it; nothing when it is not running."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=KILL_BOUND_S)
        self.paused = False

    def stop(self) -> None:
        """SIGTERM (it fsyncs its AOF and exits), reaped within a bound, then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()  # a stopped process would not act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self.paused = False

    def restart(self) -> None:
        """Stop it if it runs, then start it again on the same dir: it reloads its AOF."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: Redis is unreachable (connections open, commands hang) until `resume`;
        nothing is lost."""
        if (pid := self.pid) is not None:
            os.kill(pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT after `pause`: the server answers again, the hung commands first."""
        if (pid := self.pid) is not None and self.paused:
            os.kill(pid, signal.SIGCONT)
        self.paused = False

    def command(self, *args: str | bytes, timeout: float = 5.0) -> object:
        """One command over a fresh connection to the socket (raw RESP, no client library):
        its reply as Python values (bytes, int, list, None); an error reply raises
        `RedisServerError`. For checks and the harness itself; use coredis in the product."""
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        request = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.socket))
            s.sendall(request)
            with s.makefile("rb") as f:
                return _reply(f)

    def info_memory(self) -> dict[str, int | float | str]:
        """``INFO memory`` as a dict: numbers as int or float (``used_memory``: bytes),
        the rest as str."""
        text = self.command("INFO", "memory")
        assert isinstance(text, bytes)
        info: dict[str, int | float | str] = {}
        for line in text.decode().splitlines():
            if not line or line.startswith("#") or ":" not in line:
                continue
            key, value = line.split(":", 1)
            info[key] = _number(value)
        return info

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log ('' before it wrote one)."""
        try:
            data = self.log.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-chars:].decode(errors="replace")

    def close(self) -> None:
        """Kill the server and remove the short socket directory (the data dir stays)."""
        try:
            self.kill()
        finally:
            if self._sockdir is not None:
                shutil.rmtree(self._sockdir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        _t: type[BaseException] | None,
        _e: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.close()


def _number(value: str) -> int | float | str:
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(value)
    return value


def _reply(f: BinaryIO) -> object:
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise RedisServerError(f"redis-server closed the connection mid-reply ({line!r})")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise RedisServerError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        n = int(body)
        return None if n < 0 else f.read(n + 2)[:-2]
    if kind == b"*":
        n = int(body)
        return None if n < 0 else [_reply(f) for _ in range(n)]
    raise RedisServerError(f"unexpected reply from redis-server: {line!r}")


@contextlib.contextmanager
def running_redis(
    dir: Path | str,
    *,
    appendfsync: str = "always",
    config: Mapping[str, str] | None = None,
) -> Iterator[RedisServer]:
    """A started `RedisServer` on `dir`, killed (and its socket directory removed) on exit."""
    with RedisServer(dir, appendfsync=appendfsync, config=config) as server:
        yield server
