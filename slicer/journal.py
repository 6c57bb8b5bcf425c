"""The restart journal: which workloads exist, their processes and park state.

A small JSON file in the state dir. It sits on the grant path (a park is journaled before
anyone else is granted, and the pids of a park are journaled before the tool runs), so a
save must be all or nothing: the document is written whole to `journal.json.tmp`, checked
(every byte written), fsynced (config `journal_fsync`, on by default), then renamed over
`journal.json`. A SIGKILL or a full disk at any instant leaves either the old document or
the new one, never a torn one. A failed save raises `JournalError`; the caller keeps its
state in memory and saves again later.

When a record must be on disk
-----------------------------
Every save writes the whole document, so the file is always the state at one instant,
and a save never lets an older document replace a newer one (`write` numbers them). A
restarted daemon reads the file *and measures*: which processes live, what each holds on
its GPU, and for journaled cuda-checkpoint processes the driver's state
(`slicer.restart`, `slicer.recovery`). What it cannot measure is whom a process belongs to
and which processes the tool may have checkpointed: those records are written before
anything depends on them (`Persist()`, inline, before any later effect or reply of the
batch). The others (`Persist(lazy=True)`) are written once after their batch, by a worker
thread, after the batch's replies left (write-behind); a SIGKILL before that leaves the
previous document, and recovery from it is correct, record by record:

    register / adopt / unregister   inline: who owns which processes (unjournaled memory
                                    would count as foreign after a crash)
    park started (PARKING)          lazy: nothing is checkpointed yet; the previous record
                                    plus the measured memory say all there is
    park tool intent (op_procs)     inline, before cuda-checkpoint runs (`park_started`;
                                    a park whose intent cannot be written does not run)
    parked, with checkpointed procs inline: the procs a restore must bring back (its
                                    counters and state survive a crash from the reply on)
    parked, nothing checkpointed    lazy: a cooperative park; memory off the device reads
                                    the same either way (kept as a parked orphan, or
                                    forgotten when the old record said idle)
    restore started (RESTORING)     inline, before the tool runs: the intent recovery
                                    settles (roll back or finish) without a guess
    restored (IDLE)                 lazy: the restore intent on disk leads recovery to the
                                    driver, which says running: resident, parked before
                                    any grant, as the IDLE record would
    frozen (locked, memory kept)    lazy: the park's tool intent on disk names the same
                                    processes; recovery asks the driver (locked: it
                                    checkpoints them, the park finishes; running: resident)
    thaw started / thawed           lazy: the freeze on disk leads recovery to the driver,
                                    whose states say how far the unlock got (locked:
                                    checkpointed, restored at the next grant; running:
                                    resident, parked before any other grant)
    early start (EARLY)             inline, before EARLY leaves: the head may allocate
                                    once told, and a restart must park it first
    grant / release                 nothing durable changes: no write at all
    fault / forgotten / recovered   inline (rare; a fault must survive a crash)

What a lazy record can lose in a crash is therefore only bookkeeping: a workload's
`parks`/`restores` counters may lag by the records of the last few milliseconds, and a
cooperative workload parked just before the crash may be forgotten instead of kept as a
parked orphan (its launcher registers it again either way). A clean stop writes the
document before the daemon exits. Where saves are not fsynced (`journal_fsync = false`)
the write-behind runs in the loop, still after the batch's replies.

Alongside lives `slicerd.lock`: an exclusive `flock` held for the daemon's life, so a
second daemon on the same state dir is refused instead of sharing the journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
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
        # The write-behind thread and the loop both write: one at a time, newest last.
        self._lock = threading.Lock()
        self._seq = self._written = 0

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
        self.write(self.encode(workloads), self.next_seq())

    def encode(self, workloads: list[dict[str, Any]]) -> bytes:
        """The document `save` writes for `workloads`."""
        return json.dumps({"version": VERSION, "workloads": workloads}).encode()

    def next_seq(self) -> int:
        """A sequence number for the next document (from the daemon's one loop): `write`
        never lets an older document replace a newer one."""
        self._seq += 1
        return self._seq

    @property
    def written(self) -> int:
        """The sequence number of the newest document on disk (0: none yet)."""
        return self._written

    def write(self, data: bytes, seq: int) -> int:
        """Write document `data` numbered `seq` (from `next_seq`) atomically, from any one
        thread at a time; the number of the newest document on disk after it. A document
        older than the one on disk is skipped, as is one equal to it; `JournalError`
        when it could not be written whole (the old one then stays)."""
        with self._lock:
            if seq <= self._written:
                return self._written
            if data != self._last:
                self._replace(data)
            self._written = seq
            return seq

    def _replace(self, data: bytes) -> None:
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
    "parked_floor": int,
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
