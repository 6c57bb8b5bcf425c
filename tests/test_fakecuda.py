"""The fake libcuda: the driver's checkpoint API (ctypes, real ABI) on the fake GPU ledger.

The library is built once per session with gcc and loaded into this process, as slicerd's
checkpoint helper loads it; what needs a fresh process (a call before ``cuInit``, the start
cost paid once) runs in a child interpreter.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stubs.fakecuda import BuildError, build
from stubs.fakecuda.results import (
    DRIVER_VERSION,
    DRIVER_VERSION_NO_API,
    PROCESS_STATES,
    CUresult,
)
from stubs.fakegpu import Ledger, ProcMem
from tests.test_cuda_checkpoint_stub import (  # noqa: F401 (fixtures)
    MiB,
    Spawn,
    cc,
    cuda_pid,
    finish,
    ledger,
    spawn,
    tool,
)

# gcc and the stand-in CUDA processes are child processes.
pytestmark = pytest.mark.integration

API = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
)
BASE = ("cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString")
WAIT_S = 30  # the bound on every wait for a call that should end


class LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_ulonglong * 7),
    ]


class Args(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ulonglong * 8)]


class Lib:
    """Raw calls into the library: each returns the CUresult."""

    def __init__(self, path: Path) -> None:
        self.dll: Any = ctypes.CDLL(str(path))

    def init(self, flags: int = 0) -> int:
        return int(self.dll.cuInit(ctypes.c_uint(flags)))

    def version(self) -> tuple[int, int]:
        out = ctypes.c_int(0)
        return int(self.dll.cuDriverGetVersion(ctypes.byref(out))), out.value

    def error(self, code: int) -> tuple[int, bytes | None, int, bytes | None]:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        rc_name = self.dll.cuGetErrorName(ctypes.c_int(code), ctypes.byref(name))
        rc_text = self.dll.cuGetErrorString(ctypes.c_int(code), ctypes.byref(text))
        return int(rc_name), name.value, int(rc_text), text.value

    def state(self, pid: int) -> tuple[int, int]:
        out = ctypes.c_int(-1)
        return int(self.dll.cuCheckpointProcessGetState(pid, ctypes.byref(out))), out.value

    def lock(self, pid: int, timeout_ms: int = 0, args: LockArgs | None = None) -> int:
        args = LockArgs(timeoutMs=timeout_ms) if args is None else args
        return int(self.dll.cuCheckpointProcessLock(pid, ctypes.byref(args)))

    def op(self, name: str, pid: int, args: Args | None = None) -> int:
        fn = getattr(self.dll, f"cuCheckpointProcess{name.capitalize()}")
        return int(fn(pid, ctypes.byref(Args() if args is None else args)))

    def null(self, name: str, pid: int) -> int:
        return int(getattr(self.dll, f"cuCheckpointProcess{name.capitalize()}")(pid, None))


@pytest.fixture(scope="session")
def libs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    dest = tmp_path_factory.mktemp("fakecuda")
    return build(dest), build(dest, checkpoint_api=False)


@pytest.fixture(autouse=True)
def _no_start_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKEGPU_CUINIT_S", raising=False)


@pytest.fixture
def lib(libs: tuple[Path, Path], ledger: Ledger) -> Lib:  # noqa: F811
    """The library loaded into this process, past ``cuInit`` (once per process)."""
    loaded = Lib(libs[0])
    assert loaded.init() == 0
    return loaded


def log(ledger: Ledger) -> list[dict[str, Any]]:  # noqa: F811
    path = ledger.directory / "cc.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def in_thread(call: Callable[[], int]) -> tuple[threading.Event, list[int]]:
    """Run a blocking library call on a thread; the event is set when it returns."""
    done, result = threading.Event(), []

    def run() -> None:
        result.append(call())
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, result


def run_python(code: str, *args: object, **env: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert res.returncode == 0, res.stderr
    return res


def test_full_cycle_moves_memory_and_logs_via_lib(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
) -> None:
    pid = cuda_pid
    assert lib.state(pid) == (0, PROCESS_STATES["running"])
    assert lib.lock(pid, timeout_ms=5000) == 0
    assert lib.state(pid) == (0, PROCESS_STATES["locked"])
    assert ledger.processes() == [ProcMem(pid, 0, 600 * MiB, 0, "vllm")]
    assert lib.op("checkpoint", pid) == 0
    assert lib.state(pid) == (0, PROCESS_STATES["checkpointed"])
    assert ledger.processes() == [ProcMem(pid, 0, 0, 600 * MiB, "vllm")]
    assert ledger.gpus()[0].used == 0
    assert lib.op("restore", pid) == 0
    assert ledger.state(pid) == "locked"
    assert ledger.processes() == [ProcMem(pid, 0, 600 * MiB, 0, "vllm")]
    assert lib.op("unlock", pid) == 0
    assert ledger.state(pid) == "running"
    assert [(e["via"], e["op"], e["code"], e["state_after"]) for e in log(ledger)] == [
        ("lib", "get-state", 0, "running"),
        ("lib", "lock", 0, "locked"),
        ("lib", "get-state", 0, "locked"),
        ("lib", "checkpoint", 0, "checkpointed"),
        ("lib", "get-state", 0, "checkpointed"),
        ("lib", "restore", 0, "locked"),
        ("lib", "unlock", 0, "running"),
    ]
    assert {(e["pid"], e["caller"]) for e in log(ledger)} == {(pid, os.getpid())}
    assert ledger.overlaps() == 0


def test_null_args_are_allowed(lib: Lib, ledger: Ledger, cuda_pid: int) -> None:  # noqa: F811
    for name, state in (
        ("lock", "locked"),
        ("checkpoint", "checkpointed"),
        ("restore", "locked"),
        ("unlock", "running"),
    ):
        assert lib.null(name, cuda_pid) == 0
        assert ledger.state(cuda_pid) == state
    assert ledger.gpus()[0].used == 600 * MiB


def test_non_zero_reserved_fields_are_invalid_and_change_nothing(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
) -> None:
    bad_lock = [LockArgs(reserved0=1), LockArgs()]
    bad_lock[1].reserved1[6] = 1
    for args in bad_lock:
        assert lib.lock(cuda_pid, args=args) == CUresult.CUDA_ERROR_INVALID_VALUE
    assert ledger.state(cuda_pid) == "running"
    ledger.set_state(cuda_pid, "locked")
    before = ledger.snapshot()
    for name in ("checkpoint", "restore", "unlock"):
        bad = Args()
        bad.reserved[7] = 1
        assert lib.op(name, cuda_pid, bad) == CUresult.CUDA_ERROR_INVALID_VALUE
    assert ledger.snapshot() == before
    assert lib.dll.cuCheckpointProcessGetState(cuda_pid, None) == CUresult.CUDA_ERROR_INVALID_VALUE
    assert log(ledger) == []  # refused before the process is looked at


def test_no_such_process_and_not_cuda(lib: Lib, ledger: Ledger, spawn: Spawn) -> None:  # noqa: F811
    child = spawn()
    assert lib.state(child.pid)[0] == CUresult.CUDA_ERROR_NOT_SUPPORTED
    assert lib.lock(child.pid) == CUresult.CUDA_ERROR_NOT_SUPPORTED
    child.kill()
    child.wait(timeout=10)
    assert lib.state(child.pid)[0] == CUresult.CUDA_ERROR_NOT_FOUND
    assert lib.lock(child.pid) == CUresult.CUDA_ERROR_NOT_FOUND
    assert [e["error"].rpartition(": ")[2] for e in log(ledger)] == [
        "OPERATION_NOT_SUPPORTED (not a CUDA process)",
        "OPERATION_NOT_SUPPORTED (not a CUDA process)",
        "no such process",
        "no such process",
    ]


@pytest.mark.parametrize(
    ("state", "op"),
    [
        ("running", "unlock"),
        ("running", "checkpoint"),
        ("running", "restore"),
        ("locked", "lock"),
        ("locked", "restore"),
        ("checkpointed", "unlock"),
        ("checkpointed", "lock"),
    ],
)
def test_illegal_transition_changes_nothing(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
    state: str,
    op: str,
) -> None:
    ledger.set_state(cuda_pid, state)
    before = ledger.snapshot()
    code = lib.lock(cuda_pid) if op == "lock" else lib.op(op, cuda_pid)
    assert code == CUresult.CUDA_ERROR_ILLEGAL_STATE
    assert ledger.snapshot() == before


def test_injected_fail_is_terminal(lib: Lib, ledger: Ledger, cuda_pid: int) -> None:  # noqa: F811
    ledger.inject(cuda_pid, "checkpoint")
    assert lib.lock(cuda_pid) == 0
    assert lib.op("checkpoint", cuda_pid) == CUresult.CUDA_ERROR_UNKNOWN
    assert lib.state(cuda_pid) == (0, PROCESS_STATES["failed"])
    ledger.clear_injection(cuda_pid)
    assert lib.op("unlock", cuda_pid) == CUresult.CUDA_ERROR_ILLEGAL_STATE
    assert lib.op("checkpoint", cuda_pid) == CUresult.CUDA_ERROR_ILLEGAL_STATE
    assert lib.lock(cuda_pid) == CUresult.CUDA_ERROR_ILLEGAL_STATE
    assert ledger.state(cuda_pid) == "failed"
    assert ledger.gpus()[0].used == 600 * MiB


def test_restore_out_of_memory_is_stuck(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
    spawn: Spawn,  # noqa: F811
) -> None:
    assert lib.lock(cuda_pid) == 0
    assert lib.op("checkpoint", cuda_pid) == 0
    trainer = spawn().pid
    ledger.alloc(trainer, 0, 600 * MiB, workload="trainer")
    assert lib.op("restore", cuda_pid) == CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert ledger.state(cuda_pid) == "checkpointed"
    assert ledger.processes() == [
        ProcMem(cuda_pid, 0, 0, 600 * MiB, "vllm"),
        ProcMem(trainer, 0, 600 * MiB, 0, "trainer"),
    ]
    ledger.free(trainer)
    assert lib.op("restore", cuda_pid) == CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert lib.op("unlock", cuda_pid) == CUresult.CUDA_ERROR_ILLEGAL_STATE
    assert lib.state(cuda_pid) == (0, PROCESS_STATES["checkpointed"])
    assert ledger.overlaps() == 0


def test_checkpoint_copies_before_releasing(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger.set_state(cuda_pid, "locked")
    monkeypatch.setenv("FAKEGPU_BANDWIDTH", f"{600 * MiB}")  # one second of copying
    done, result = in_thread(lambda: lib.op("checkpoint", cuda_pid))
    assert not done.wait(0.5)
    assert ledger.gpus()[0].used == 600 * MiB
    assert done.wait(WAIT_S)
    assert result == [0]
    assert ledger.gpus()[0].used == 0


def test_hang_blocks_until_cleared(lib: Lib, ledger: Ledger, cuda_pid: int) -> None:  # noqa: F811
    ledger.inject(cuda_pid, "lock", hang=True)
    done, result = in_thread(lambda: lib.lock(cuda_pid))
    assert not done.wait(0.5)
    assert ledger.state(cuda_pid) == "running"
    assert lib.state(cuda_pid) == (0, PROCESS_STATES["running"])  # other calls go on
    ledger.clear_injection(cuda_pid, "lock")
    assert done.wait(WAIT_S)
    assert result == [0]
    assert ledger.state(cuda_pid) == "locked"


def test_hang_ends_when_the_target_exits(lib: Lib, ledger: Ledger, spawn: Spawn) -> None:  # noqa: F811
    target = spawn()
    ledger.alloc(target.pid, 0, MiB)
    ledger.set_state(target.pid, "checkpointed")
    ledger.move(target.pid, to_device=False)
    ledger.inject(target.pid, "restore", hang=True)
    done, result = in_thread(lambda: lib.op("restore", target.pid))
    assert not done.wait(0.5)
    target.kill()
    target.wait(timeout=10)
    assert done.wait(WAIT_S)
    assert result == [CUresult.CUDA_ERROR_NOT_FOUND]


def test_lock_timeout_outlasted_by_hang(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
) -> None:
    ledger.inject(cuda_pid, "lock", hang=True)
    assert lib.lock(cuda_pid, timeout_ms=100) == CUresult.CUDA_ERROR_TIMEOUT
    assert ledger.state(cuda_pid) == "running"
    assert "timed out after 100 ms" in log(ledger)[-1]["error"]


def test_hang_bounded_by_hang_max(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKEGPU_HANG_MAX", "0.1")
    ledger.set_state(cuda_pid, "locked")
    ledger.inject(cuda_pid, "checkpoint", hang=True)
    assert lib.op("checkpoint", cuda_pid) == CUresult.CUDA_ERROR_TIMEOUT
    assert ledger.state(cuda_pid) == "locked"
    assert ledger.gpus()[0].used == 600 * MiB


def test_error_names_and_texts_cover_every_code(lib: Lib) -> None:
    for code in CUresult:
        rc_name, name, rc_text, text = lib.error(code)
        assert (rc_name, rc_text) == (0, 0)
        assert name == code.name.encode()
        assert text
    assert lib.error(CUresult.CUDA_ERROR_NOT_FOUND)[3] == b"named symbol not found"
    assert lib.error(12345) == (1, None, 1, None)


def test_version_init_flags_and_restore_thread_id(lib: Lib, cuda_pid: int) -> None:  # noqa: F811
    assert lib.version() == (0, DRIVER_VERSION)
    assert lib.init(flags=1) == CUresult.CUDA_ERROR_INVALID_VALUE
    tid = ctypes.c_int(0)
    rc = lib.dll.cuCheckpointProcessGetRestoreThreadId(cuda_pid, ctypes.byref(tid))
    assert rc == CUresult.CUDA_ERROR_NOT_SUPPORTED


def test_variant_without_the_api_lacks_its_symbols(libs: tuple[Path, Path]) -> None:
    assert libs[0] != libs[1] and libs[1].name == "libcuda.so.1"
    dll = ctypes.CDLL(str(libs[1]))
    assert [name for name in API if hasattr(dll, name)] == []
    assert all(hasattr(dll, name) for name in BASE)
    full = ctypes.CDLL(str(libs[0]))
    assert all(hasattr(full, name) for name in API + BASE)
    version = ctypes.c_int(0)
    assert dll.cuDriverGetVersion(ctypes.byref(version)) == 0
    assert version.value == DRIVER_VERSION_NO_API


def test_build_is_cached_and_needs_a_compiler(
    libs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    again = build(libs[0].parents[1])
    assert again == libs[0]
    assert [p.name for p in libs[0].parents[1].iterdir() if p.name.startswith(".")] == []
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(BuildError, match="no C compiler 'no-such-cc'"):
        build(tmp_path)


def test_concurrent_builds_into_one_folder(tmp_path: Path) -> None:
    code = "import sys, pathlib, stubs.fakecuda as f; print(f.build(pathlib.Path(sys.argv[1])))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outs)) == 1 and Path(outs[0]).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(outs[0]).parent.name]


_CHILD = """
import ctypes, json, sys, time
dll = ctypes.CDLL(sys.argv[1])
pid = int(sys.argv[2])
state = ctypes.c_int(-1)
out = {"before_init": dll.cuCheckpointProcessGetState(pid, ctypes.byref(state)),
       "lock_before_init": dll.cuCheckpointProcessLock(pid, None)}
out["t0"] = time.monotonic()
out["init"] = [dll.cuInit(0), dll.cuInit(0)]
out["t1"] = time.monotonic()
out["ops"] = [dll.cuCheckpointProcessLock(pid, None), dll.cuCheckpointProcessUnlock(pid, None),
              dll.cuCheckpointProcessGetState(pid, ctypes.byref(state))]
print(json.dumps(out))
"""


def test_calls_before_cuinit_fail_and_the_start_cost_is_paid_once(
    libs: tuple[Path, Path],
    ledger: Ledger,  # noqa: F811
    cuda_pid: int,  # noqa: F811
) -> None:
    res = run_python(_CHILD, libs[0], cuda_pid, FAKEGPU_CUINIT_S="0.2")
    out = json.loads(res.stdout)
    assert out["before_init"] == out["lock_before_init"] == CUresult.CUDA_ERROR_NOT_INITIALIZED
    assert out["init"] == [0, 0] and out["ops"] == [0, 0, 0]
    lines = log(ledger)
    assert [e["op"] for e in lines] == ["lock", "unlock", "get-state"]  # none before cuInit
    assert len({e["caller"] for e in lines}) == 1
    (stamp,) = {e["cuinit_at"] for e in lines}  # one cuInit for every call of the process
    assert stamp - out["t0"] >= 0.2 and stamp <= out["t1"]
    assert {e["cuinit_s"] for e in lines} == {0.2}


def test_the_cli_pays_the_start_cost_at_every_launch(ledger: Ledger, cuda_pid: int) -> None:  # noqa: F811
    stamps = []
    for args in (["--get-state"], ["--action", "lock"], ["--action", "unlock"]):
        started = time.monotonic()
        assert finish(tool(*args, "--pid", cuda_pid, FAKEGPU_CUINIT_S="0.2"))[0] == 0
        stamps.append(started)
    lines = log(ledger)
    assert [(e["via"], e["op"], e["cuinit_s"]) for e in lines] == [
        ("cli", "get-state", 0.2),
        ("cli", "lock", 0.2),
        ("cli", "unlock", 0.2),
    ]
    assert len({e["caller"] for e in lines}) == 3 and os.getpid() not in {
        e["caller"] for e in lines
    }
    assert all(e["code"] == 0 for e in lines)
    for started, entry in zip(stamps, lines, strict=True):
        assert entry["cuinit_at"] - started >= 0.2  # paid by this launch, after it began
    rc, out, _ = finish(tool("--help", FAKEGPU_CUINIT_S="bad"))  # --help pays nothing
    assert rc == 0 and "--get-state" in out
    rc, _, err = finish(tool("--get-state", "--pid", cuda_pid, FAKEGPU_CUINIT_S="bad"))
    assert rc == 1 and "FAKEGPU_CUINIT_S" in err


def test_lib_and_cli_act_identically(
    lib: Lib,
    ledger: Ledger,  # noqa: F811
    spawn: Spawn,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same sequence through the CLI stub (on process A) and the library (on B)."""
    a, b = spawn().pid, spawn().pid
    for pid in (a, b):
        ledger.alloc(pid, 0, 300 * MiB, workload="parity")  # one workload: no overlap
    steps: list[tuple[str, str | None]] = [
        ("get-state", None),
        ("lock", None),
        ("lock", None),
        ("checkpoint", None),
        ("get-state", None),
        ("unlock", None),
        ("restore", None),
        ("unlock", None),
        ("lock", None),
        ("checkpoint", "fail"),
        ("unlock", None),
        ("get-state", None),
    ]

    def via_lib(op: str) -> int:
        if op == "get-state":
            return lib.state(b)[0]
        return lib.lock(b) if op == "lock" else lib.op(op, b)

    for op, inject in steps:
        if inject:
            ledger.inject(a, op)
            ledger.inject(b, op)
        args = ["--get-state"] if op == "get-state" else ["--action", op]
        rc, _, _ = cc(capsys, *args, "--pid", a)
        code = via_lib(op)
        assert (rc == 0) == (code == 0), op
    lines = log(ledger)
    cli = [e for e in lines if e["via"] == "cli"]
    via = [e for e in lines if e["via"] == "lib"]
    assert len(cli) == len(via) == len(steps)

    def same(entry: dict[str, Any], pid: int) -> tuple[Any, ...]:
        error = entry["error"] and entry["error"].replace(str(pid), "PID")
        return entry["op"], entry["code"], error, entry["state_before"], entry["state_after"]

    assert [same(e, a) for e in cli] == [same(e, b) for e in via]
    assert [e["code"] for e in via][-3:] == [CUresult.CUDA_ERROR_UNKNOWN, 401, 0]
    snap = ledger.snapshot()
    procs = {p["pid"]: (p["state"], p["stuck"]) for p in snap["processes"]}
    assert procs[a] == procs[b] == ("failed", False)
    mem = {m["pid"]: (m["on_device"], m["on_host"]) for m in snap["memory"]}
    assert mem[a] == mem[b] == (300 * MiB, 0)
    assert ledger.overlaps() == 0


_NOT_PYTHON = r"""
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { printf("%s\n", dlerror()); return 2; }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*lock)(int, void *) = (int (*)(int, void *))dlsym(h, "cuCheckpointProcessLock");
    int (*ver)(int *) = (int (*)(int *))dlsym(h, "cuDriverGetVersion");
    int v = 0, rc = ver(&v);
    printf("%d %d %d %d\n", init(0), lock(1, 0), rc, v);
    return argc == 2 ? 0 : 1;
}
"""


def test_outside_a_python_process_it_loads_and_says_not_initialised(
    libs: tuple[Path, Path], tmp_path: Path
) -> None:
    (tmp_path / "main.c").write_text(_NOT_PYTHON)
    subprocess.run(
        ["gcc", "-o", str(tmp_path / "main"), str(tmp_path / "main.c"), "-ldl"],
        check=True,
        timeout=120,
    )
    res = subprocess.run(
        [str(tmp_path / "main"), str(libs[0])], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["3", "3", "0", str(DRIVER_VERSION)]
