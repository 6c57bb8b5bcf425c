"""The API server's side of the engine-core child: spawn it, call it, notice its death.

The core is a real child process (``python -m stubs.vllm_stub.core``) started with
``trio.lowlevel.open_process``; we talk JSON lines over its stdin/stdout, one call at
a time (a lock), as vLLM's API server talks to its EngineCore over ZMQ. ``run`` reads
its stdout for the whole life of the server: when the core exits, ``dead`` is set and
every pending and later call fails with ``CoreDead``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Any

import trio

__all__ = ["CoreDead", "CoreError", "CoreLink"]


class CoreError(Exception):
    """A call the core answered with an error (``oom``: a CUDA out-of-memory)."""

    def __init__(self, message: str, oom: bool = False) -> None:
        super().__init__(message)
        self.oom = oom


class CoreDead(Exception):
    """The engine core process is gone (vLLM's EngineDeadError)."""


class CoreLink:
    """One engine-core child process and the calls to it."""

    def __init__(self, outlives_server: bool = False) -> None:
        self.outlives_server = outlives_server
        self.proc: trio.Process | None = None
        self.pid: int | None = None
        self.dead = trio.Event()
        self.returncode: int | None = None
        self._lock = trio.Lock()
        self._next_id = 0
        self._reply: trio.MemorySendChannel[dict[str, Any]] | None = None
        self._ready = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the core, hand back its pid, then read its replies until it exits."""
        env = {**os.environ, "VLLM_STUB_PARENT": str(os.getpid())}
        if self.outlives_server:
            env["VLLM_STUB_CORE_OUTLIVES"] = "1"
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "stubs.vllm_stub.core"],
            stdin=-1,  # subprocess.PIPE
            stdout=-1,
            env=env,
        )
        self.proc = proc
        assert proc.stdout is not None
        buf = b""
        started = False
        try:
            while True:
                chunk = await proc.stdout.receive_some(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "ready" in msg and not started:
                        started = True
                        self.pid = int(msg["ready"])
                        task_status.started(self.pid)
                    elif self._reply is not None:
                        self._reply.send_nowait(msg)
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(5):
                    self.returncode = await proc.wait()
                if self.returncode is None:
                    proc.kill()
                    self.returncode = await proc.wait()
            self.dead.set()
            if not started:
                raise CoreDead(f"engine core exited at start (code {self.returncode})")

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply (CoreError / CoreDead on failure)."""
        async with self._lock:
            if self.dead.is_set() or self.proc is None or self.proc.stdin is None:
                raise CoreDead("engine core is dead")
            self._next_id += 1
            send, recv = trio.open_memory_channel[dict[str, Any]](1)
            self._reply = send
            try:
                line = json.dumps({"id": self._next_id, "op": op, **fields}) + "\n"
                try:
                    await self.proc.stdin.send_all(line.encode())
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise CoreDead("engine core is dead") from e
                reply: dict[str, Any] | None = None
                async with trio.open_nursery() as nursery:

                    async def on_death() -> None:
                        await self.dead.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(on_death)
                    reply = await recv.receive()
                    nursery.cancel_scope.cancel()
                if reply is None:
                    raise CoreDead("engine core died during a call")
            finally:
                self._reply = None
        if not reply.get("ok"):
            raise CoreError(str(reply.get("error")), oom=bool(reply.get("oom")))
        return reply

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to free its memory and exit; kill it past ``timeout``."""
        if self.proc is None or self.dead.is_set():
            return
        with trio.move_on_after(timeout):
            with contextlib.suppress(CoreDead, CoreError):
                await self.call("exit")
            await self.dead.wait()
        if not self.dead.is_set() and self.proc.returncode is None:
            self.proc.kill()

    def kill(self) -> None:
        """SIGKILL the core (fault injection: a crashed engine)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
