"""The GPU check's holder: the process that holds the GPU memory, driven by lines on stdin.

On a GPU it is ``gpumem`` (``gpumem.c``); on the test doubles, `standin` (run as
``driver.py --standin BYTES``) books the bytes in the fake GPU ledger instead. Both
answer ``ready pid=P bytes=N`` once the memory is filled, then ``verify`` (``ok`` or
``bad at OFFSET ...``) and ``quit``.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time


class CheckFailed(Exception):
    """A park, restore or verify failed: the check exits 1."""


READY_TIMEOUT_S = 120.0  # cuInit plus filling 16 GiB; the fake's Python start on 2 cores
REPLY_S = 60.0  # a verify of 16 GiB samples is well under a second on a GPU


class Holder:
    """The process holding the GPU memory (gpumem, or the fake's stand-in), driven by
    lines on its stdin; `pid` and `nbytes` from its ``ready pid=P bytes=N``."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        self.pid = 0
        self.nbytes = 0

    def read_line(self, timeout: float) -> str:
        """The holder's next stdout line (bounded); CheckFailed when it exits or is slow."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed(f"holder gave no answer within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise CheckFailed(f"holder exited ({self._exit_text()})")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    def _exit_text(self) -> str:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "its stdout closed"
        err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
        return f"rc {rc}" + (f": {err.splitlines()[-1]}" if err else "")

    def ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for ``ready pid=P bytes=N``."""
        line = self.read_line(timeout)
        m = re.fullmatch(r"ready pid=(\d+) bytes=(\d+)", line)
        if not m:
            raise CheckFailed(f"holder said {line!r}, not 'ready pid=P bytes=N'")
        self.pid, self.nbytes = int(m[1]), int(m[2])

    def command(self, what: str, timeout: float = REPLY_S) -> str:
        """Send `what`, return the answer line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(what.encode() + b"\n")
        self.proc.stdin.flush()
        return self.read_line(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """``quit`` and reap it (SIGKILL past `timeout`)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def standin(nbytes: int) -> int:
    """The fake's holder: book `nbytes` on fake GPU 0 as workload `mem`, then serve
    ``verify`` (all of it on the device again, nothing on host) and ``quit``."""
    from stubs.fakegpu import Ledger

    ledger = Ledger()
    ledger.alloc(os.getpid(), 0, nbytes, tag="main", workload="mem")
    print(f"ready pid={os.getpid()} bytes={nbytes}", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        if line.strip() == "verify":
            mine = [p for p in ledger.processes(0) if p.pid == os.getpid()]
            on_device = sum(p.on_device for p in mine)
            on_host = sum(p.on_host for p in mine)
            ok = on_device == nbytes and on_host == 0 and ledger.state(os.getpid()) == "running"
            print("ok" if ok else f"bad at 0 device={on_device} host={on_host}", flush=True)
    return 0
