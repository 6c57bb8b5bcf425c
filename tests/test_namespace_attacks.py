"""Attacks on pid translation through the real daemon (regressions of the R1 review).

- A pod's process connects, forks, and exits before slicerd accepts; its child keeps the
  socket and sends REGISTER naming a host pid (or `pid=self`). The connector's PID
  namespace cannot be read any more: slicerd must not read the pid as its own (it took
  the host process as the workload, and could SIGKILL it on a fault). slicerd is stopped
  (SIGSTOP) while the connector connects and exits, so the accept comes surely after.
- A thread id is not a process: REGISTER pid=<tid> of a real process is refused.

The "pod" is `unshare --pid --fork --kill-child --mount` with its own /proc, as in
tests/test_pid_translation.py; everything it starts dies with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import pytest
import trio

from tests.harness import GiB, Stack, running_stack

pytestmark = pytest.mark.integration

BOUND = 60
T = TypeVar("T")

# argv: SOCKET LINE...; prints "ready" once the connector is gone, then (after a line on
# stdin) each line's reply, and holds the connection until stdin ends.
DEAD_CONNECTOR = textwrap.dedent(
    """
    import os, socket, sys
    sock_path, lines = sys.argv[1], sys.argv[2:]
    connector = os.fork()
    if connector == 0:
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        if os.fork() == 0:  # the child that keeps the socket
            f = s.makefile("rwb", buffering=0)
            sys.stdin.readline()
            for line in lines:
                f.write(line.encode() + b"\\n")
                print(f.readline().decode().strip(), flush=True)
            sys.stdin.read()
            os._exit(0)
        os._exit(0)
    os.waitpid(connector, 0)  # exited and reaped: its pid names nobody now
    print("ready", flush=True)
    while True:  # pid 1 of the pod: reap the orphaned child when it ends
        try:
            os.wait()
        except ChildProcessError:
            break
    """
)

# Prints its pid and a thread's id, then waits for stdin to end.
THREADED = textwrap.dedent(
    """
    import os, sys, threading
    ids = []
    ready = threading.Event()
    def run():
        ids.append(threading.get_native_id())
        ready.set()
        sys.stdin.read()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait()
    print(os.getpid(), ids[0], flush=True)
    t.join()
    """
)


def _pod_argv(script: Path, *args: str) -> list[str]:
    inner = 'mount -t proc proc /proc && exec "$@"'
    return [
        "unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
        "sh", "-c", inner, "sh", sys.executable, str(script), *args,
    ]  # fmt: skip


async def _in_thread(fn: Callable[[], T]) -> T:
    # Abandoned on cancel: a blocked pipe read must not outlive the test's bound.
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _readline(pipe: IO[bytes] | None) -> Callable[[], str]:
    assert pipe is not None
    return lambda: pipe.readline().decode().strip()


class _Raw:
    """One connection of ours (slicerd's namespace), line by line."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buf = stream, b""

    async def ask(self, line: str) -> str:
        await self.stream.send_all(line.encode() + b"\n")
        while b"\n" not in self.buf:
            data = await self.stream.receive_some(65536)
            assert data, "slicerd closed the connection"
            self.buf += data
        reply, self.buf = self.buf.split(b"\n", 1)
        return reply.decode()


def _stop_daemon(stack: Stack, sig: int) -> None:
    assert stack.proc is not None
    os.kill(stack.proc.pid, sig)


async def test_a_connector_that_exited_before_accept_cannot_name_a_host_process(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND):
        async with running_stack(gpus=1) as stack:
            host = stack.sleeper(2 * GiB, label="hostjob")  # not the pod's: never its
            victim = stack.children[-1]
            script = tmp_path / "dead_connector.py"
            script.write_text(DEAD_CONNECTOR)
            lines = [f"REGISTER evil pid={host} park=cooperative", "REGISTER evil2 pid=self"]
            proc = None
            try:
                _stop_daemon(stack, signal.SIGSTOP)  # its accept waits: the connect queues
                try:
                    proc = subprocess.Popen(
                        _pod_argv(script, stack.socket, *lines),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        env=stack.env,
                    )
                    assert await _in_thread(_readline(proc.stdout)) == "ready"
                finally:
                    _stop_daemon(stack, signal.SIGCONT)
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
                for line in lines:
                    reply = await _in_thread(_readline(proc.stdout))
                    assert reply.startswith("ERR no-such-process"), (line, reply)
                    assert "could not be read when it connected" in reply, reply
                st = await stack.status()
                assert st["workloads"] == []
                assert victim.poll() is None  # the host process was never touched
            finally:
                if proc is not None:
                    proc.kill()
                    await _in_thread(proc.wait)
                    for pipe in (proc.stdin, proc.stdout):
                        if pipe is not None:
                            pipe.close()
            assert stack.overlaps() == 0


async def test_a_thread_id_is_not_a_process_to_register(tmp_path: Path) -> None:
    with trio.fail_after(BOUND):
        async with running_stack(gpus=1) as stack:
            script = tmp_path / "threaded.py"
            script.write_text(THREADED)
            proc = subprocess.Popen(
                [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            try:
                pid, tid = map(int, (await _in_thread(_readline(proc.stdout))).split())
                assert pid != tid and os.path.exists(f"/proc/{tid}")
                async with await trio.open_unix_socket(stack.socket) as stream:
                    c = _Raw(stream)
                    thread = await c.ask(f"REGISTER t pid={tid} tree=0")
                    assert thread == f"ERR no-such-process -- no live process {tid}", thread
                    assert (await c.ask(f"REGISTER p pid={pid} tree=0")).startswith("OK")
                    st = await stack.status()
                    assert [(w["name"], w["pid"]) for w in st["workloads"]] == [("p", pid)]
            finally:
                proc.kill()
                await _in_thread(proc.wait)
                for pipe in (proc.stdin, proc.stdout):
                    if pipe is not None:
                        pipe.close()
            assert stack.overlaps() == 0


def test_a_pidfd_names_its_process_only_while_it_lives() -> None:
    """What accept relies on to trust a peer's namespace: the connector's pidfd (from the
    socket itself) says whether SO_PEERCRED's pid still names that very process."""
    import socket
    import subprocess

    from gpu_slicer.slicer.connection import peer_pidfd, pidfd_names

    a, b = socket.socketpair()
    with a, b:
        fd = peer_pidfd(a)  # type: ignore[arg-type]
        assert fd is not None, "this kernel has SO_PEERPIDFD (Linux 6.5+)"
        try:
            assert pidfd_names(fd, os.getpid())
            assert not pidfd_names(fd, os.getpid() + 1)
        finally:
            os.close(fd)
    child = subprocess.Popen(["true"])
    fd = os.pidfd_open(child.pid)
    try:
        child.wait(timeout=30)
        assert not pidfd_names(fd, child.pid)  # exited: its pid may name another now
    finally:
        os.close(fd)
