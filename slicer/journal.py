"""The restart journal: which workloads exist, their processes and park state.

A small JSON file in the state dir. It sits on the grant path (a park is journaled before
anyone else is granted, and the pids of a park are journaled before the tool runs), so a
save must be all or nothing: the document is written whole to `journal.json.tmp`, checked
(every byte written), fsynced (config `journal_fsync`, on by default), then renamed over
`journal.json`. A SIGKILL or a full disk at any instant leaves either the old document or
the new one, never a torn one. A failed save raises `JournalError`; the caller keeps its
state in memory and saves again later.

Alongside lives `slicerd.lock`: an exclusive `flock` held for the daemon's life, so a
second daemon on the same state dir is refused instead of sharing the journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from gpu_slicer.slicer.errors import SlicerError

VERSION = 1


class JournalError(SlicerError):
    """The journal cannot be read or written."""


class StateDirLocked(SlicerError):
    """Another daemon owns the state dir."""


class Journal:
    """Reads and writes `<state_dir>/journal.json`."""

    def __init__(self, state_dir: str | os.PathLike[str], fsync: bool = True) -> None:
        self.path = Path(state_dir) / "journal.json"
        self._tmp = self.path.with_name("journal.json.tmp")
        self.fsync = fsync
        self._last = b""

    def load(self) -> list[dict[str, Any]]:
        """The journaled workloads, or [] when there is no journal yet; `JournalError`
        (with what to do) when it cannot be read."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise JournalError(self._unreadable(str(e))) from e
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise JournalError(self._unreadable(f"not JSON ({e})")) from e
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise JournalError(self._unreadable("unknown format"))
        workloads = doc.get("workloads", [])
        if not isinstance(workloads, list):
            raise JournalError(self._unreadable("workloads is not a list"))
        for i, w in enumerate(workloads):
            if (why := _bad_entry(w)) is not None:
                raise JournalError(self._unreadable(f"workload entry {i}: {why}"))
        self._last = raw
        return list(workloads)

    def _unreadable(self, why: str) -> str:
        return (
            f"journal {self.path} is unreadable: {why}. Move it aside, or start slicerd "
            "once with --discard-journal (the bad file is kept beside it; processes it "
            "listed count as foreign until they exit or re-register)"
        )

    def discard(self) -> Path | None:
        """Move an existing journal aside (`journal.json.bad-<unix time>`); its new path."""
        if not self.path.exists():
            return None
        aside = self.path.with_name(f"journal.json.bad-{int(time.time())}")
        os.replace(self.path, aside)
        return aside

    def save(self, workloads: list[dict[str, Any]]) -> None:
        """Replace the journal with `workloads` atomically (a no-op when nothing changed);
        `JournalError` when it could not be written whole (the old one then stays)."""
        data = json.dumps({"version": VERSION, "workloads": workloads}).encode()
        if data == self._last:
            return
        try:
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(f"short write ({len(data) - len(view)} of {len(data)})")
                    view = view[n:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self.path)
            if self.fsync:
                dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            raise JournalError(f"cannot write journal {self.path}: {e}") from e
        self._last = data

    def close(self) -> None:
        """Nothing stays open between saves; kept for symmetry with `StateLock`."""


# What adopt_journal reads from an entry: a wrong type there must be one clear line at
# start, never a traceback (and a crash loop) in the middle of recovery.
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "gpu": int,
    "pid": int,
    "start_time": (int, float),
    "tree": bool,
    "park": str,
    "parked_max": int,
    "owner_uid": int,
    "state": str,
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "parked_bytes": int,
    "op_bytes": int,
    "parks": int,
    "restores": int,
    "faults": int,
    "fallback": str,
    "ask": bool,
}


def _bad_entry(w: Any) -> str | None:
    if not isinstance(w, dict):
        return "not an object"
    for key, kind in _FIELDS.items():
        if not isinstance(w.get(key), kind) or (kind is int and isinstance(w[key], bool)):
            return f"{key} is missing or not {getattr(kind, '__name__', 'a number')}"
    for key, kind in _OPTIONAL.items():
        if key in w and not isinstance(w[key], kind):
            return f"{key} is not {getattr(kind, '__name__', kind)}"
    for key in ("parked_procs", "op_procs"):
        procs = w.get(key, [])
        ok = isinstance(procs, list) and all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in procs
        )
        if not ok:
            return f"{key} is not a list of [pid, start time] pairs"
    if not isinstance(w.get("parked_pids", []), list):
        return "parked_pids is not a list"
    return None


class StateLock:
    """An exclusive lock on a state dir, naming its owner's pid in the lock file."""

    def __init__(self, state_dir: str | os.PathLike[str], what: str = "slicerd") -> None:
        self.path = Path(state_dir) / f"{what}.lock"
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise `StateDirLocked` naming the other owner's pid
        (`JournalError` when the state dir cannot hold the lock file at all)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as e:
            raise JournalError(
                f"cannot open {self.path}: {e.strerror or e}; the state dir must be a "
                "writable directory (systemd: StateDirectory=/ReadWritePaths=)"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirLocked(
                f"another {self.what} (pid {owner}) owns state dir {self.path.parent}; "
                "stop it first, or give this one another --state-dir"
            ) from None
        with contextlib.suppress(OSError):  # a full disk must not stop the daemon here
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the kernel drops it too when the process dies)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
