"""The slicerd process: systemd socket activation, sd_notify, signals, config, backends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from gpu_slicer.slicer.config import Config, load
from gpu_slicer.slicer.errors import ConfigError
from stubs.fakegpu import Ledger
from stubs.proc import TOOL, child_env

pytestmark = pytest.mark.integration

ACTIVATE = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); "
    "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'; "
    "os.execv(sys.executable, [sys.executable, '-m', 'gpu_slicer.slicer.daemon', *sys.argv[2:]])"
)


def _env(tmp_path: Path, notify: str) -> dict[str, str]:
    gpu = tmp_path / "gpu"
    gpu.mkdir(exist_ok=True)
    Ledger.init(gpu, 1, 80 << 30)
    return child_env({"FAKEGPU_DIR": str(gpu), "NOTIFY_SOCKET": notify})


def _args(tmp_path: Path, sock: str) -> list[str]:
    return [
        "--socket",
        sock,
        "--gpu-backend",
        "fake",
        "--cuda-checkpoint",
        TOOL,
        "--state-dir",
        str(tmp_path / "state"),
    ]


async def _expect(notify: trio.socket.SocketType, word: bytes) -> None:
    with trio.fail_after(20):
        while word not in await notify.recv(4096):
            pass


async def _ping(path: str) -> bytes:
    with trio.fail_after(10):
        s = await trio.open_unix_socket(path)
        async with s:
            await s.send_all(b"PING\n")
            return await s.receive_some(100)


async def test_socket_activation_notify_and_sigterm(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    notify_path = str(tmp_path / "notify")
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(notify_path)
        proc = subprocess.Popen(
            [sys.executable, "-c", ACTIVATE, str(listener.fileno()), *_args(tmp_path, "/nope")],
            env=_env(tmp_path, notify_path),
            pass_fds=(listener.fileno(),),
        )
        try:
            listener.close()  # the daemon owns it now
            await _expect(notify, b"READY=1")
            assert await _ping(sock_path) == b"OK\n"
            proc.send_signal(signal.SIGTERM)
            await _expect(notify, b"STOPPING=1")
            assert await trio.to_thread.run_sync(proc.wait, 15) == 0
        finally:
            proc.kill()
            proc.wait(10)
    # systemd owns an activated socket: the daemon must not unlink it
    assert os.path.exists(sock_path)
    assert Ledger(tmp_path / "gpu").overlaps() == 0
    assert not os.path.exists("/nope")


async def test_bound_socket_is_removed_on_sigterm_and_refused_while_live(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "slicer.sock")
    notify_path = str(tmp_path / "notify")
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(notify_path)
        env = _env(tmp_path, notify_path)
        cmd = [sys.executable, "-m", "gpu_slicer.slicer.daemon", *_args(tmp_path, sock)]
        proc = subprocess.Popen(cmd, env=env)
        try:
            await _expect(notify, b"READY=1")
            assert await _ping(sock) == b"OK\n"
            # a second daemon on the same path (its own state dir) refuses to steal it
            other_state = [*cmd[:-1], str(tmp_path / "state2")]
            second = await trio.run_process(other_state, env=env, check=False, capture_stderr=True)
            assert second.returncode == 69  # EX_UNAVAILABLE: the path is another's
            assert b"another daemon is listening" in second.stderr
            # one on the same state dir (another socket) is refused before it reads the
            # journal, with the owner's pid, and exits 78 (systemd does not restart it)
            cmd3 = [*cmd[:3], *_args(tmp_path, str(tmp_path / "run" / "other.sock"))]
            third = await trio.run_process(cmd3, env=env, check=False, capture_stderr=True)
            assert third.returncode == 78
            assert f"another slicerd (pid {proc.pid}) owns state dir".encode() in third.stderr
            assert b"Traceback" not in third.stderr
            assert not os.path.exists(tmp_path / "run" / "other.sock")
            assert await _ping(sock) == b"OK\n"
            proc.send_signal(signal.SIGINT)
            await _expect(notify, b"STOPPING=1")
            assert await trio.to_thread.run_sync(proc.wait, 15) == 0
        finally:
            proc.kill()
            proc.wait(10)
    assert not os.path.exists(sock)
    assert Ledger(tmp_path / "gpu").overlaps() == 0


async def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    sock = str(tmp_path / "slicer.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock)
    dead.close()  # leaves the file, nobody listening
    notify_path = str(tmp_path / "notify")
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(notify_path)
        cmd = [sys.executable, "-m", "gpu_slicer.slicer.daemon", *_args(tmp_path, sock)]
        proc = subprocess.Popen(cmd, env=_env(tmp_path, notify_path))
        try:
            await _expect(notify, b"READY=1")
            assert await _ping(sock) == b"OK\n"
        finally:
            proc.terminate()
            proc.wait(15)


async def test_nvml_without_a_driver_is_a_clear_error(tmp_path: Path) -> None:
    res = await trio.run_process(
        [
            sys.executable,
            "-m",
            "gpu_slicer.slicer.daemon",
            "--gpu-backend",
            "nvml",
            "--socket",
            str(tmp_path / "s.sock"),
            "--state-dir",
            str(tmp_path),
        ],
        check=False,
        capture_stderr=True,
        env=child_env(),
    )
    assert res.returncode == 69  # EX_UNAVAILABLE: no driver (slicer.service retries)
    assert b"NVML is not available" in res.stderr
    assert not (tmp_path / "s.sock").exists()


def test_config_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "slicer.toml"
    conf.write_text(
        '[slicer]\nsocket = "/tmp/a.sock"\npark_timeout = 30\nsocket_mode = "600"\n'
        'gpu_backend = "fake"\nfault_kill_after = 5\n'
    )
    monkeypatch.delenv("SLICER_SOCKET", raising=False)
    cfg = load(str(conf))
    assert (cfg.socket, cfg.park_timeout, cfg.socket_mode) == ("/tmp/a.sock", 30.0, 0o600)
    assert cfg.fault_kill_after == 5.0 and cfg.restore_timeout == Config().restore_timeout
    monkeypatch.setenv("SLICER_SOCKET", "/tmp/env.sock")
    assert load(str(conf)).socket == "/tmp/env.sock"
    assert load(str(conf), {"socket": "/tmp/flag.sock"}).socket == "/tmp/flag.sock"
    assert load(str(conf), {"park_timeout": 7.0}).park_timeout == 7.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("park_timeout = -1\n", "park_timeout must be in"),
        ('park_timeout = "soon"\n', "park_timeout: bad value"),
        ('gpu_backend = "cuda"\n', "gpu_backend: unknown gpu backend 'cuda': one of nvml, fake"),
        ('foreign = "maybe"\n', "foreign must be block or ignore"),
        ("max_queue = 0\n", "max_queue must be >= 1"),
        ("park_timeout = \n", "cannot read config"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(tmp_path: Path, body: str, message: str) -> None:
    conf = tmp_path / "slicer.toml"
    conf.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load(str(conf))


async def test_bad_config_stops_the_daemon_before_it_listens(tmp_path: Path) -> None:
    conf = tmp_path / "slicer.toml"
    conf.write_text("park_timeout = 0\n")
    res = await trio.run_process(
        [sys.executable, "-m", "gpu_slicer.slicer.daemon", "--config", str(conf)],
        check=False,
        capture_stderr=True,
        env=child_env(),
    )
    assert res.returncode != 0
    assert b"park_timeout must be in" in res.stderr
