"""One owner per state directory: an exclusive ``flock`` on ``<state_dir>/dispatch.lock``.

Two dispatchers on one state directory would serve the same pending rows twice and race
on the same database, so ``slicer-dispatch`` takes the lock before it opens the store and
holds it for its whole life. The lock file holds the owner's pid, so the one refused can
say who owns the directory. The kernel drops the lock when the owner's process ends, even
by SIGKILL: a stale lock file never blocks a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from gpu_slicer.dispatcher.errors import StateInUse, StoreError

__all__ = ["LOCK_NAME", "StateLock"]

LOCK_NAME = "dispatch.lock"


class StateLock:
    """The held lock of one state directory (see the module docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: str | Path) -> StateLock:
        """Take the lock of ``state_dir`` (created if missing) and write our pid in it.

        Raises :class:`StateInUse` naming the owner's pid when another process holds it,
        :class:`StoreError` when the directory or the lock file cannot be made.
        """
        path = Path(state_dir) / LOCK_NAME
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot create the lock file {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_pid(fd)
            os.close(fd)
            who = f"pid {owner}" if owner else "a process whose pid is not written yet"
            raise StateInUse(
                f"state dir {path.parent} is in use by another slicer-dispatch ({who}, "
                f"lock {path}); run one dispatcher per state dir"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot lock {path}: {exc}") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot write our pid into {path}: {exc}") from exc
        return cls(path, fd)

    def release(self) -> None:
        """Drop the lock (also dropped by the kernel when the process ends)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no pid of a process that no longer owns it
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
