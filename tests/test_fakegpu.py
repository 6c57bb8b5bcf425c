"""The fake GPU ledger: capacity, process liveness, overlap accounting, CLI."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stubs.fakegpu import (
    FakeGpuError,
    GpuInfo,
    Ledger,
    OutOfMemory,
    ProcMem,
    UnknownGpu,
    parse_size,
)

pytestmark = pytest.mark.integration  # child processes stand in for CUDA processes

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
MiB = 1024**2

Spawn = Callable[[], int]


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    monkeypatch.setenv("FAKEGPU_DIR", str(tmp_path))
    monkeypatch.delenv("FAKEGPU_WORKLOAD", raising=False)
    return Ledger.init(tmp_path, gpus=2, capacity=GiB)


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start sleeping child processes to stand in for CUDA processes; kill them after."""
    children: list[subprocess.Popen[bytes]] = []

    def start() -> int:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        children.append(child)
        return child.pid

    yield start
    for child in children:
        child.kill()
        child.wait(timeout=10)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    return child.pid


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "stubs.fakegpu", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("80GiB", 80 * GiB),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("25GB", 25 * 10**9),
        ("25GB/s", 25 * 10**9),
        ("25e9", 25 * 10**9),
        ("1.5GiB", 3 * GiB // 2),
        ("10 MB", 10**7),
        (7, 7),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "12XB", "1.2.3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_init_makes_fresh_gpus(ledger: Ledger, spawn: Spawn) -> None:
    assert ledger.gpus() == [
        GpuInfo(0, "GPU-fake-0000-0000", GiB, 0),
        GpuInfo(1, "GPU-fake-0000-0001", GiB, 0),
    ]
    ledger.alloc(spawn(), 0, MiB)
    again = Ledger.init(ledger.directory, gpus=1, capacity=2 * GiB)
    assert again.gpus() == [GpuInfo(0, "GPU-fake-0000-0000", 2 * GiB, 0)]
    assert again.processes() == []


def test_ledger_needs_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKEGPU_DIR", raising=False)
    with pytest.raises(FakeGpuError, match="FAKEGPU_DIR"):
        Ledger()
    with pytest.raises(FakeGpuError, match="init"):
        Ledger(tmp_path)


def test_alloc_sums_tags_and_free(ledger: Ledger, spawn: Spawn) -> None:
    pid = spawn()
    ledger.alloc(pid, 0, 100, tag="weights", workload="vllm")
    ledger.alloc(pid, 0, 50, tag="kv")
    ledger.alloc(pid, 0, 25, tag="kv")
    ledger.alloc(pid, 1, 7)
    assert ledger.processes() == [ProcMem(pid, 0, 175, 0, "vllm"), ProcMem(pid, 1, 7, 0, "vllm")]
    assert ledger.processes(gpu=1) == [ProcMem(pid, 1, 7, 0, "vllm")]
    assert ledger.gpus()[0].used == 175
    assert ledger.gpus()[0].free == GiB - 175
    assert ledger.free(pid, tag="kv") == 75
    assert ledger.free(pid) == 107
    assert ledger.processes() == []


def test_workload_defaults(ledger: Ledger, spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = spawn(), spawn()
    ledger.alloc(a, 0, 1)
    monkeypatch.setenv("FAKEGPU_WORKLOAD", "trainer")
    ledger.alloc(b, 1, 1)
    assert {p.pid: p.workload for p in ledger.processes()} == {a: f"pid-{a}", b: "trainer"}


def test_oom_leaves_ledger_unchanged(ledger: Ledger, spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    ledger.alloc(a, 0, GiB - 10, workload="a")
    before = ledger.snapshot()
    with pytest.raises(OutOfMemory, match=r"CUDA out of memory\. Tried to allocate"):
        ledger.alloc(b, 0, 11, workload="b", allowance=100)
    assert ledger.snapshot() == before
    ledger.alloc(b, 0, 10, workload="b")
    assert ledger.gpus()[0].free == 0


def test_unknown_gpu_and_bad_pid(ledger: Ledger) -> None:
    with pytest.raises(UnknownGpu):
        ledger.alloc(os.getpid(), 5, 1)
    with pytest.raises(FakeGpuError, match="no such process"):
        ledger.alloc(dead_pid(), 0, 1)


def test_dead_process_memory_is_freed(ledger: Ledger) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ledger.alloc(child.pid, 0, 300 * MiB)
        ledger.inject(child.pid, "lock")
        assert ledger.gpus()[0].used == 300 * MiB
    finally:
        child.kill()
        child.wait(timeout=10)
    assert ledger.gpus()[0].used == 0
    assert ledger.processes() == []
    assert ledger.injection(child.pid, "lock") is None


def test_reused_pid_memory_is_freed(ledger: Ledger) -> None:
    pid = os.getpid()
    ledger.alloc(pid, 0, MiB)
    con = sqlite3.connect(ledger.path)  # pretend the pid belonged to an older process
    with con:
        con.execute("UPDATE proc SET ctime = ctime - 100 WHERE pid = ?", (pid,))
    con.close()
    assert ledger.processes() == []
    assert ledger.gpus()[0].used == 0


def test_overlap_counted_when_two_workloads_resident(ledger: Ledger, spawn: Spawn) -> None:
    ledger.alloc(spawn(), 0, 10, workload="trainer")
    ledger.alloc(spawn(), 1, 10, workload="vllm")  # other GPU: no overlap
    assert ledger.overlaps() == 0
    ledger.alloc(spawn(), 0, 10, workload="vllm")
    assert ledger.overlaps() == 1
    [entry] = ledger.overlap_log()
    assert entry["gpu"] == 0
    assert entry["workloads"] == ["trainer", "vllm"]


def test_same_workload_in_many_pids_is_no_overlap(ledger: Ledger, spawn: Spawn) -> None:
    ledger.alloc(spawn(), 0, 10, workload="vllm")
    ledger.alloc(spawn(), 0, 10, workload="vllm")
    assert ledger.overlaps() == 0


def test_allowance_keeps_a_sleeping_workload_non_resident(ledger: Ledger, spawn: Spawn) -> None:
    vllm, trainer = spawn(), spawn()
    ledger.alloc(vllm, 0, 100, tag="context", workload="vllm", allowance=100)
    ledger.alloc(trainer, 0, 500, workload="trainer")
    assert ledger.overlaps() == 0
    ledger.alloc(vllm, 0, 1, tag="kv")  # vLLM wakes while the trainer is resident
    assert ledger.overlaps() == 1
    assert ledger.snapshot()["allowances"] == {"vllm": 100}


def test_move_to_host_and_back_checks_capacity(ledger: Ledger, spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    ledger.alloc(a, 0, 600 * MiB, workload="a")
    ledger.alloc(a, 1, 1, workload="a")
    assert ledger.move(a, to_device=False) == 600 * MiB + 1
    assert ledger.processes() == [ProcMem(a, 0, 0, 600 * MiB, "a"), ProcMem(a, 1, 0, 1, "a")]
    with pytest.raises(FakeGpuError, match="on host"):
        ledger.alloc(a, 0, 1)
    ledger.alloc(b, 0, 600 * MiB, workload="b")
    before = ledger.snapshot()
    with pytest.raises(OutOfMemory, match="CUDA out of memory"):
        ledger.move(a, to_device=True)
    assert ledger.snapshot() == before
    ledger.free(b)
    assert ledger.move(a, to_device=True) == 600 * MiB + 1
    assert ledger.gpus()[0].used == 600 * MiB
    assert ledger.move(a, to_device=True) == 0
    assert ledger.overlaps() == 0


def test_move_back_while_other_resident_is_an_overlap(ledger: Ledger, spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    ledger.alloc(a, 0, 10, workload="a")
    ledger.move(a, to_device=False)
    ledger.alloc(b, 0, 10, workload="b")
    assert ledger.overlaps() == 0
    ledger.move(a, to_device=True)
    assert ledger.overlaps() == 1


def test_states_and_injections(ledger: Ledger, spawn: Spawn) -> None:
    pid = spawn()
    assert ledger.state(pid) == "running"
    ledger.set_state(pid, "locked")
    assert ledger.state(pid) == "locked"
    with pytest.raises(FakeGpuError):
        ledger.set_state(pid, "asleep")
    ledger.inject(pid, "lock")
    ledger.inject(pid, "restore", hang=True)
    assert ledger.injection(pid, "lock") == "fail"
    assert ledger.injection(pid, "restore") == "hang"
    assert ledger.injection(pid, "unlock") is None
    ledger.clear_injection(pid, "lock")
    assert ledger.injection(pid, "lock") is None
    ledger.clear_injection(pid)
    assert ledger.injection(pid, "restore") is None
    with pytest.raises(FakeGpuError):
        ledger.inject(pid, "explode")
    assert not ledger.is_stuck(pid)
    ledger.set_stuck(pid)
    assert ledger.is_stuck(pid)


def test_concurrent_processes(ledger: Ledger, spawn: Spawn) -> None:
    target = spawn()
    code = (
        "import sys\nfrom stubs.fakegpu import Ledger\nledger = Ledger()\n"
        "for i in range(25):\n    ledger.alloc(int(sys.argv[1]), 0, 1, tag=f'{sys.argv[2]}-{i}')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen([sys.executable, "-c", code, str(target), str(n)], env=env)
        for n in range(4)
    ]
    assert [w.wait(timeout=30) for w in workers] == [0, 0, 0, 0]
    assert ledger.gpus()[0].used == 100


def test_cli_init_alloc_show_overlaps(ledger: Ledger, spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    assert cli("init", "--gpus", "1", "--capacity", "1GiB").returncode == 0
    ok = cli("alloc", "--pid", str(a), "--gpu", "0", "--bytes", "512MiB", "--workload", "a")
    assert ok.returncode == 0, ok.stderr
    oom = cli("alloc", "--pid", str(b), "--gpu", "0", "--bytes", "513MiB", "--workload", "b")
    assert oom.returncode == 1
    assert "CUDA out of memory" in oom.stderr
    shown = cli("show", "--json")
    assert shown.returncode == 0
    snap = json.loads(shown.stdout)
    assert snap["gpus"][0]["used"] == 512 * MiB
    assert snap["memory"] == [
        {"pid": a, "gpu": 0, "on_device": 512 * MiB, "on_host": 0, "workload": "a"}
    ]
    human = cli("show")
    assert human.returncode == 0
    assert "GPU-fake-0000-0000" in human.stdout
    assert cli("overlaps").stdout.strip() == "0"
    assert cli("overlaps").returncode == 0
    assert cli("alloc", "--pid", str(b), "--bytes", "1MiB", "--workload", "b").returncode == 0
    over = cli("overlaps")
    assert (over.returncode, over.stdout.strip()) == (1, "1")
    freed = cli("free", "--pid", str(a))
    assert (freed.returncode, freed.stdout.strip()) == (0, str(512 * MiB))


def test_cli_fail_clear_and_errors(ledger: Ledger, spawn: Spawn) -> None:
    pid = spawn()
    assert cli("fail", "--pid", str(pid), "--op", "restore", "--hang").returncode == 0
    assert ledger.injection(pid, "restore") == "hang"
    assert cli("clear", "--pid", str(pid)).returncode == 0
    assert ledger.injection(pid, "restore") is None
    assert cli("fail", "--pid", str(pid), "--op", "explode").returncode == 2
    assert cli("init", "--capacity", "12XB").returncode == 2
    assert cli("alloc", "--pid", str(pid), "--gpu", "9", "--bytes", "1").returncode == 1
    assert cli("--dir", str(ledger.directory / "nowhere"), "show").returncode == 1
