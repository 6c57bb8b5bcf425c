"""The fake GPU: a process-safe ledger of device memory, in SQLite.

Theory of operation
-------------------
``ledger.db`` (WAL mode) lives in the directory named by ``$FAKEGPU_DIR``. Every
operation opens a connection, runs one short ``BEGIN IMMEDIATE`` transaction and
closes it, so any number of processes (the vLLM and trainer stubs, the
``cuda-checkpoint`` stub, the slicer's fake backend, tests) can share it.

Memory is booked per (gpu, pid, tag), each row either on device or on host (a
checkpointed process). A process is identified by (pid, start time): when it has
exited, is a zombie, or its pid was reused, its memory counts as freed, as the NVIDIA
driver does; such rows are pruned at the start of every transaction, reads included.

PID namespaces. The real driver lives in the kernel: NVML reports processes by their
pid in the host (outermost) PID namespace whoever asks, while a pid a caller passes in
(``cuda-checkpoint --pid``) is read in the caller's namespace. So here: every row is
keyed by *host* pid, the pid of ``$FAKEGPU_HOST_PROC`` (default ``/proc``, a procfs of
the host namespace; a pod mounts the host's there). Every method taking a pid reads it
in the caller's namespace and translates it at entry (``hostpid.to_host``; a
``HostPid`` passes through); ``processes``, ``gpus`` and ``snapshot`` report host pids.
The start time (``create_time`` in ``snapshot``: clock ticks after boot) is read from the
host procfs too, so callers in every namespace agree on which rows are alive. A pid
that names no process of the caller's namespace reads and frees like a dead one; the
methods that need a live process (``alloc``, ``set_state``, ``set_stuck``, ``inject``)
raise FakeGpuError.

Device nodes. ``init`` creates ``dev/nvidia<i>`` per GPU next to the ledger. A process
that allocates for itself opens its GPU's node once and holds it open for the rest of
its life, as a CUDA context holds ``/dev/nvidia<i>``: a daemon that cannot read host pids
(in a pod) finds the GPU processes it can see by their ``/proc/<pid>/fd`` links to it.
Booking memory on behalf of another pid opens nothing.

Each pid carries a workload label (overlap accounting), a cuda-checkpoint state
(``running``, ``locked``, ``checkpointed``, ``failed``), a ``stuck`` flag (a restore
ran out of memory: the process stays checkpointed for good) and optional injected
failures for the ``cuda-checkpoint`` stub. Each workload label has an *allowance*:
bytes it may keep on device while still counting as not resident (a sleeping vLLM
keeps its CUDA context).

After every mutation that puts bytes on a device (``alloc``, ``move(to_device=True)``)
or lets them run again (``set_state(..., "running")``: an unlock) the same transaction
computes, per touched GPU, the set of *running* resident workloads (live on-device bytes
summed over the label's pids > the label's allowance, and not every one of those pids
``locked``: a frozen workload, fit-aware turns, is resident but runs nothing). Two or
more is an *overlap*: it is counted and logged. Capacity is never exceeded (``alloc``
and a restore past it fail). Tests assert ``Ledger().overlaps() == 0``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stubs.fakegpu.hostpid import HostPid, process_identity, to_host
from stubs.fakegpu.model import (
    FakeGpuError,
    GpuInfo,
    OutOfMemory,
    ProcMem,
    UnknownGpu,
    gpu_uuid,
    out_of_memory,
)

__all__ = [
    "CC_OPS",
    "CC_STATES",
    "FakeGpuError",
    "GpuInfo",
    "HostPid",
    "Ledger",
    "OutOfMemory",
    "ProcMem",
    "UnknownGpu",
    "process_identity",
]

DB_NAME = "ledger.db"
BUSY_TIMEOUT_S = 10.0
CC_STATES = ("running", "locked", "checkpointed", "failed")
CC_OPS = ("lock", "checkpoint", "restore", "unlock")
DEV_DIR = "dev"

# The device nodes this process holds open, like a CUDA context holds /dev/nvidiaN: by
# (os.getpid(), path), so that a forked child opens its own (it inherits the parent's fd,
# as on the real driver, but that one is not its context).
_held_nodes: dict[tuple[int, str], int] = {}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS gpu (
    idx INTEGER PRIMARY KEY, uuid TEXT NOT NULL, total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS proc (
    pid INTEGER PRIMARY KEY, ctime REAL NOT NULL, workload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'running', stuck INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS mem (
    gpu INTEGER NOT NULL, pid INTEGER NOT NULL, tag TEXT NOT NULL,
    nbytes INTEGER NOT NULL, on_device INTEGER NOT NULL, PRIMARY KEY (gpu, pid, tag));
CREATE TABLE IF NOT EXISTS allowance (workload TEXT PRIMARY KEY, nbytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS injection (
    pid INTEGER NOT NULL, op TEXT NOT NULL, kind TEXT NOT NULL, PRIMARY KEY (pid, op));
CREATE TABLE IF NOT EXISTS overlap (
    id INTEGER PRIMARY KEY AUTOINCREMENT, gpu INTEGER NOT NULL, time REAL NOT NULL,
    workloads TEXT NOT NULL);
"""
_TABLES = ("gpu", "proc", "mem", "allowance", "injection", "overlap")


class Ledger:
    """Handle on the ledger in ``directory`` (default ``$FAKEGPU_DIR``)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        if directory is None:
            directory = os.environ.get("FAKEGPU_DIR")
            if not directory:
                raise FakeGpuError("FAKEGPU_DIR is not set and no ledger directory was given")
        self.directory = Path(directory)
        self.path = self.directory / DB_NAME
        self._readers: dict[tuple[int, int], sqlite3.Connection] = {}
        if not self.path.exists():
            raise FakeGpuError(f"no fake GPU ledger at {self.path} (run `init` first)")

    # -- creation and transactions -------------------------------------------------

    @classmethod
    def init(cls, directory: str | os.PathLike[str] | None, gpus: int, capacity: int) -> Ledger:
        """(Re)create a fresh ledger of ``gpus`` GPUs of ``capacity`` bytes each."""
        if directory is None:
            directory = os.environ.get("FAKEGPU_DIR")
            if not directory:
                raise FakeGpuError("FAKEGPU_DIR is not set and no ledger directory was given")
        if gpus < 1 or capacity < 0:
            raise FakeGpuError(f"bad ledger shape: gpus={gpus} capacity={capacity}")
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(path / DB_NAME, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            con.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(_SCHEMA)
            con.execute("BEGIN IMMEDIATE")
            for table in _TABLES:
                con.execute(f"DELETE FROM {table}")
            con.executemany(
                "INSERT INTO gpu (idx, uuid, total) VALUES (?, ?, ?)",
                [(i, gpu_uuid(i), capacity) for i in range(gpus)],
            )
            con.execute("COMMIT")
        finally:
            con.close()
        dev = path / DEV_DIR
        dev.mkdir(exist_ok=True)
        for i in range(gpus):
            (dev / f"nvidia{i}").touch()
        return cls(path)

    def device_node(self, gpu: int) -> Path:
        """The device node of ``gpu`` (``$FAKEGPU_DIR/dev/nvidia<gpu>``): a process that
        allocates for itself holds it open for the rest of its life, as a CUDA context
        holds ``/dev/nvidia<gpu>``, so a daemon in any PID namespace can find the GPU's
        processes among its own by their open files."""
        return self.directory / DEV_DIR / f"nvidia{gpu}"

    def _hold_device_node(self, gpu: int) -> None:
        path = str(self.device_node(gpu))
        key = (os.getpid(), path)
        if key not in _held_nodes:
            with contextlib.suppress(FileNotFoundError):  # a ledger from before device nodes
                _held_nodes[key] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            con.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            con.execute("BEGIN IMMEDIATE")
            try:
                self._prune(con)
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        finally:
            con.close()

    @staticmethod
    def _prune(con: sqlite3.Connection) -> None:
        for pid, ctime in con.execute("SELECT pid, ctime FROM proc").fetchall():
            if process_identity(pid) != ctime:
                for table in ("mem", "injection", "proc"):
                    con.execute(f"DELETE FROM {table} WHERE pid = ?", (pid,))

    @staticmethod
    def _ensure_proc(con: sqlite3.Connection, pid: int, workload: str | None = None) -> None:
        """Make sure live ``pid`` has a proc row (call after ``_prune``)."""
        row = con.execute("SELECT workload FROM proc WHERE pid = ?", (pid,)).fetchone()
        if row is not None:
            if workload is not None and workload != row[0]:
                con.execute("UPDATE proc SET workload = ? WHERE pid = ?", (workload, pid))
            return
        ctime = process_identity(pid)
        if ctime is None:
            raise FakeGpuError(f"no such process: {pid}")
        if workload is None:
            workload = os.environ.get("FAKEGPU_WORKLOAD") or f"pid-{pid}"
        con.execute(
            "INSERT INTO proc (pid, ctime, workload) VALUES (?, ?, ?)", (pid, ctime, workload)
        )

    @staticmethod
    def _gpu_row(con: sqlite3.Connection, gpu: int) -> tuple[int, int]:
        """(total, used) of ``gpu``; UnknownGpu if there is no such GPU."""
        row = con.execute("SELECT total FROM gpu WHERE idx = ?", (gpu,)).fetchone()
        if row is None:
            raise UnknownGpu(f"no fake GPU {gpu}")
        used = con.execute(
            "SELECT COALESCE(SUM(nbytes), 0) FROM mem WHERE gpu = ? AND on_device = 1", (gpu,)
        ).fetchone()[0]
        return int(row[0]), int(used)

    @staticmethod
    def _record_overlaps(con: sqlite3.Connection, gpus: set[int]) -> None:
        allowances = dict(con.execute("SELECT workload, nbytes FROM allowance").fetchall())
        # A label whose every process holding device memory is locked is *frozen* (fit-
        # aware turns): resident, but running nothing. Two running ones is the overlap.
        rows = con.execute(
            "SELECT m.gpu, p.workload, SUM(m.nbytes), MIN(p.state = 'locked')"
            " FROM mem m JOIN proc p ON m.pid = p.pid"
            " WHERE m.on_device = 1 GROUP BY m.gpu, p.workload ORDER BY p.workload"
        ).fetchall()
        resident: dict[int, list[str]] = {}
        for gpu, workload, nbytes, frozen in rows:
            if gpu in gpus and nbytes > allowances.get(workload, 0) and not frozen:
                resident.setdefault(gpu, []).append(workload)
        now = time.time()
        for gpu, workloads in sorted(resident.items()):
            if len(workloads) >= 2:
                con.execute(
                    "INSERT INTO overlap (gpu, time, workloads) VALUES (?, ?, ?)",
                    (gpu, now, json.dumps(workloads)),
                )

    # -- reads ---------------------------------------------------------------------

    @staticmethod
    def _gpus(con: sqlite3.Connection) -> list[GpuInfo]:
        rows = con.execute(
            "SELECT g.idx, g.uuid, g.total, COALESCE(SUM(m.nbytes), 0) FROM gpu g"
            " LEFT JOIN mem m ON m.gpu = g.idx AND m.on_device = 1"
            " GROUP BY g.idx ORDER BY g.idx"
        ).fetchall()
        return [GpuInfo(index=i, uuid=u, total=t, used=used) for i, u, t, used in rows]

    @staticmethod
    def _processes(con: sqlite3.Connection, gpu: int | None = None) -> list[ProcMem]:
        rows = con.execute(
            "SELECT m.pid, m.gpu,"
            " SUM(CASE WHEN m.on_device = 1 THEN m.nbytes ELSE 0 END),"
            " SUM(CASE WHEN m.on_device = 0 THEN m.nbytes ELSE 0 END), p.workload"
            " FROM mem m JOIN proc p ON m.pid = p.pid"
            " WHERE (? IS NULL OR m.gpu = ?) GROUP BY m.pid, m.gpu ORDER BY m.gpu, m.pid",
            (gpu, gpu),
        ).fetchall()
        return [
            ProcMem(pid=r[0], gpu=r[1], on_device=r[2], on_host=r[3], workload=r[4]) for r in rows
        ]

    @staticmethod
    def _overlap_log(con: sqlite3.Connection) -> list[dict[str, Any]]:
        rows = con.execute("SELECT gpu, time, workloads FROM overlap ORDER BY id").fetchall()
        return [{"gpu": g, "time": t, "workloads": json.loads(w)} for g, t, w in rows]

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        # Reads are the hot path of the slicer's fake backend (a verify before every
        # grant): they reuse one connection per process and thread, take a deferred
        # (snapshot) transaction and never write; dead pids are filtered, not pruned.
        key = (os.getpid(), threading.get_ident())
        con = self._readers.get(key)
        if con is None:
            con = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            con.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            self._readers[key] = con
        con.execute("BEGIN")
        try:
            yield con
        finally:
            con.execute("COMMIT")

    @staticmethod
    def _live(con: sqlite3.Connection) -> set[int]:
        live = set()
        for pid, ctime in con.execute("SELECT pid, ctime FROM proc").fetchall():
            if process_identity(pid) == ctime:
                live.add(pid)
        return live

    def gpus(self) -> list[GpuInfo]:
        """All GPUs with their capacity and the on-device bytes of live processes."""
        with self._snapshot() as con:
            live = self._live(con)
            used: dict[int, int] = {}
            for g, pid, n in con.execute(
                "SELECT gpu, pid, SUM(nbytes) FROM mem WHERE on_device = 1 GROUP BY gpu, pid"
            ).fetchall():
                if pid in live:
                    used[g] = used.get(g, 0) + n
            rows = con.execute("SELECT idx, uuid, total FROM gpu ORDER BY idx").fetchall()
        return [GpuInfo(index=i, uuid=u, total=t, used=used.get(i, 0)) for i, u, t in rows]

    def processes(self, gpu: int | None = None) -> list[ProcMem]:
        """Live processes' memory, one row per (pid, gpu), optionally for one GPU."""
        with self._snapshot() as con:
            live = self._live(con)
            rows = self._processes(con, gpu)
        return [r for r in rows if r.pid in live]

    # The three reads of the checkpoint fakes (every lock, checkpoint, restore and unlock
    # asks them) take no write lock: a row of a dead process (or of a pid reused since)
    # reads as no row, as the pruning of a write transaction would leave it. Holding the
    # write lock for a read would queue them behind every allocation of every process,
    # in SQLite's busy handler (sleeps of up to 100 ms), which a real driver never does.

    def _row_of(self, host: int, sql: str, *params: object) -> tuple[Any, ...] | None:
        """The first row of `sql` (its last column: the proc row's ctime) for live
        `host`, or None."""
        with self._snapshot() as con:
            row = con.execute(sql, (host, *params)).fetchone()
        if row is None or process_identity(host) != row[-1]:
            return None
        return tuple(row)

    def state(self, pid: int) -> str:
        """The cuda-checkpoint state of ``pid`` (``running`` when never set)."""
        row = self._row_of(_host_or_none(pid), "SELECT state, ctime FROM proc WHERE pid = ?")
        return "running" if row is None else str(row[0])

    def is_stuck(self, pid: int) -> bool:
        """Whether a restore of ``pid`` ran out of memory (stuck checkpointed for good)."""
        row = self._row_of(_host_or_none(pid), "SELECT stuck, ctime FROM proc WHERE pid = ?")
        return bool(row and row[0])

    def injection(self, pid: int, op: str) -> str | None:
        """The failure injected for ``op`` on ``pid``: None, ``"fail"`` or ``"hang"``."""
        row = self._row_of(
            _host_or_none(pid),
            "SELECT i.kind, p.ctime FROM injection i JOIN proc p ON p.pid = i.pid"
            " WHERE i.pid = ? AND i.op = ?",
            op,
        )
        return None if row is None else str(row[0])

    def overlaps(self) -> int:
        """How many overlap moments (two resident workloads on one GPU) were recorded."""
        with self._tx() as con:
            return int(con.execute("SELECT COUNT(*) FROM overlap").fetchone()[0])

    def overlap_log(self) -> list[dict[str, Any]]:
        """Every recorded overlap: ``{"gpu", "time", "workloads"}``, oldest first."""
        with self._tx() as con:
            return self._overlap_log(con)

    def snapshot(self) -> dict[str, Any]:
        """The whole ledger as one JSON-able dict (one consistent transaction)."""
        with self._tx() as con:
            gpus = [{**asdict(g), "free": g.free} for g in self._gpus(con)]
            procs = con.execute(
                "SELECT pid, ctime, workload, state, stuck FROM proc ORDER BY pid"
            ).fetchall()
            return {
                "directory": str(self.directory),
                "gpus": gpus,
                "memory": [asdict(p) for p in self._processes(con)],
                "processes": [
                    {"pid": p, "create_time": c, "workload": w, "state": s, "stuck": bool(k)}
                    for p, c, w, s, k in procs
                ],
                "allowances": dict(
                    con.execute("SELECT workload, nbytes FROM allowance ORDER BY workload")
                ),
                "injections": [
                    {"pid": p, "op": o, "kind": k}
                    for p, o, k in con.execute(
                        "SELECT pid, op, kind FROM injection ORDER BY pid, op"
                    )
                ],
                "overlaps": int(con.execute("SELECT COUNT(*) FROM overlap").fetchone()[0]),
                "overlap_log": self._overlap_log(con),
            }

    # -- mutations -----------------------------------------------------------------

    def alloc(
        self,
        pid: int,
        gpu: int,
        nbytes: int,
        tag: str = "main",
        workload: str | None = None,
        allowance: int | None = None,
    ) -> None:
        """Put ``nbytes`` on ``gpu`` for live ``pid`` under ``tag``.

        ``workload`` labels the pid for overlap accounting (default: its current label,
        else ``$FAKEGPU_WORKLOAD``, else ``pid-<pid>``). ``allowance`` sets the label's
        allowance (latest wins; None leaves it as is, 0 if never set). Raises
        OutOfMemory past capacity and FakeGpuError when the pid is checkpointed, failed
        or locked (its CUDA calls would block); nothing changes on error. A process
        allocating for itself then holds the GPU's device node open (``device_node``);
        one on behalf of another opens nothing.
        """
        if nbytes < 0:
            raise FakeGpuError(f"negative allocation: {nbytes}")
        pid = to_host(pid)
        with self._tx() as con:
            total, used = self._gpu_row(con, gpu)
            self._ensure_proc(con, pid, workload)
            state, label = con.execute(
                "SELECT state, workload FROM proc WHERE pid = ?", (pid,)
            ).fetchone()
            on_host = con.execute(
                "SELECT COUNT(*) FROM mem WHERE pid = ? AND on_device = 0", (pid,)
            ).fetchone()[0]
            # A locked process's CUDA calls block until unlock on the real driver; here an
            # allocation then is refused, so a wake before a thaw fails loudly.
            if on_host or state in ("checkpointed", "failed", "locked"):
                raise FakeGpuError(
                    f"CUDA error: operation not permitted when process {pid} is {state}"
                    + (" (its memory is on host)" if on_host else "")
                )
            if used + nbytes > total:
                raise out_of_memory(gpu, nbytes, total, used)
            if allowance is not None:
                con.execute(
                    "INSERT INTO allowance (workload, nbytes) VALUES (?, ?)"
                    " ON CONFLICT (workload) DO UPDATE SET nbytes = excluded.nbytes",
                    (label, allowance),
                )
            con.execute(
                "INSERT INTO mem (gpu, pid, tag, nbytes, on_device) VALUES (?, ?, ?, ?, 1)"
                " ON CONFLICT (gpu, pid, tag) DO UPDATE SET nbytes = nbytes + excluded.nbytes",
                (gpu, pid, tag, nbytes),
            )
            self._record_overlaps(con, {gpu})
        if pid == to_host(os.getpid()):
            self._hold_device_node(gpu)

    def free(self, pid: int, tag: str | None = None) -> int:
        """Free ``pid``'s memory (one tag, or all) on every GPU; returns bytes freed."""
        host = _host_or_none(pid)
        with self._tx() as con:
            where: str = "pid = ?"
            params: list[object] = [host]
            if tag is not None:
                where, params = "pid = ? AND tag = ?", [host, tag]
            freed = con.execute(
                f"SELECT COALESCE(SUM(nbytes), 0) FROM mem WHERE {where}", params
            ).fetchone()[0]
            con.execute(f"DELETE FROM mem WHERE {where}", params)
            return int(freed)

    def move(self, pid: int, to_device: bool) -> int:
        """Move all of ``pid``'s memory to device or host; returns bytes moved.

        Moving to device checks every GPU's capacity first: OutOfMemory, nothing moved.
        """
        pid = _host_or_none(pid)
        with self._tx() as con:
            src = 0 if to_device else 1
            rows = con.execute(
                "SELECT gpu, SUM(nbytes) FROM mem WHERE pid = ? AND on_device = ? GROUP BY gpu",
                (pid, src),
            ).fetchall()
            if to_device:
                for gpu, nbytes in rows:
                    total, used = self._gpu_row(con, gpu)
                    if used + nbytes > total:
                        raise out_of_memory(gpu, nbytes, total, used)
            con.execute(
                "UPDATE mem SET on_device = ? WHERE pid = ? AND on_device = ?", (1 - src, pid, src)
            )
            if to_device:
                self._record_overlaps(con, {gpu for gpu, _ in rows})
            return int(sum(nbytes for _, nbytes in rows))

    def set_state(self, pid: int, state: str) -> None:
        """Set the cuda-checkpoint state of live ``pid``."""
        if state not in CC_STATES:
            raise FakeGpuError(f"unknown cuda-checkpoint state {state!r}")
        pid = to_host(pid)
        with self._tx() as con:
            self._ensure_proc(con, pid)
            con.execute("UPDATE proc SET state = ? WHERE pid = ?", (state, pid))
            if state == "running":  # a thaw: its resident memory runs again
                gpus = con.execute(
                    "SELECT DISTINCT gpu FROM mem WHERE pid = ? AND on_device = 1", (pid,)
                ).fetchall()
                self._record_overlaps(con, {g for (g,) in gpus})

    def set_stuck(self, pid: int, stuck: bool = True) -> None:
        """Mark live ``pid`` as stuck checkpointed (a restore ran out of memory)."""
        pid = to_host(pid)
        with self._tx() as con:
            self._ensure_proc(con, pid)
            con.execute("UPDATE proc SET stuck = ? WHERE pid = ?", (int(stuck), pid))

    def inject(self, pid: int, op: str, hang: bool = False) -> None:
        """Make the cuda-checkpoint stub fail (or hang) on ``op`` for live ``pid``."""
        if op not in CC_OPS:
            raise FakeGpuError(f"unknown cuda-checkpoint op {op!r}; expected one of {CC_OPS}")
        pid = to_host(pid)
        with self._tx() as con:
            self._ensure_proc(con, pid)
            con.execute(
                "INSERT OR REPLACE INTO injection (pid, op, kind) VALUES (?, ?, ?)",
                (pid, op, "hang" if hang else "fail"),
            )

    def clear_injection(self, pid: int, op: str | None = None) -> None:
        """Remove the injected failure for ``op`` on ``pid`` (all ops when None)."""
        pid = _host_or_none(pid)
        with self._tx() as con:
            if op is None:
                con.execute("DELETE FROM injection WHERE pid = ?", (pid,))
            else:
                con.execute("DELETE FROM injection WHERE pid = ? AND op = ?", (pid, op))


def _host_or_none(pid: int) -> int:
    """``to_host(pid)``, or -1 (no row has it) when no process has that pid in the
    caller's namespace: a pid that names no process reads and frees like a dead one."""
    try:
        return to_host(pid)
    except FakeGpuError:
        return -1
