"""bench/gpu_check.sh, the check run on a bare GPU machine, checked here without a GPU.

What can be checked without one is: the holder (bench/gpu_check/gpumem.c) builds with every
warning an error and does what it says against a fake libcuda with memory in host RAM
(built here from `FAKE_MEM_CUDA`; corrupting one word after the fill must be caught);
the script parses (and passes shellcheck where installed); without a driver it exits 77
with one line and leaves nothing running; the arithmetic of the figures; and the whole
orchestration end to end on the test doubles (``--fake``: slicerd on the fake GPU, the
cuda-checkpoint stub and the fake libcuda as the two parkers, a stand-in holder booking
its bytes in the ledger; the driver fails on any overlap).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import psutil
import pytest


def _load(name: str) -> ModuleType:
    # By path, not `import bench...`: tests never import the bench as a package (the house
    # has bench -> vllm_tier -> tests, tests/test_house.py); these two files import
    # nothing of the repo.
    path = Path(__file__).resolve().parent.parent / "bench" / "gpu_check" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up here
    spec.loader.exec_module(module)
    return module


figures = _load("figures")
Holder = _load("holder").Holder
parse_probe = figures.parse_probe

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
GPUMEM = ROOT / "bench" / "gpu_check" / "gpumem.c"
GiB = 1 << 30

# The driver functions gpumem uses, on host memory. FAKE_NO_DEVICE=1: cuInit answers
# CUDA_ERROR_NO_DEVICE (100). FAKE_CORRUPT=OFFSET: the word at that byte offset of the
# first allocation reads back flipped (a restore that lost data).
FAKE_MEM_CUDA = r"""
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static char *first; static size_t first_len;
CUresult cuInit(unsigned f) { (void)f; return getenv("FAKE_NO_DEVICE") ? 100 : 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = o; return o == 0 ? 0 : 101; }
CUresult cuDeviceGetName(char *n, int len, int d) {
    (void)d; strncpy(n, "Fake \"H\"", len); return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = 8ULL << 30; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = (void *)1; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
CUresult cuCtxSetCurrent(void *c) { (void)c; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { *f = 6ULL << 30; *t = 8ULL << 30; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    char *m = malloc(n); if (!m) return 2;
    if (!first) { first = m; first_len = n; }
    *p = (CUdeviceptr)(uintptr_t)m; return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { free((void *)(uintptr_t)p); return 0; }
CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned v, size_t n) {
    unsigned *w = (unsigned *)(uintptr_t)p;
    for (size_t i = 0; i < n; i++) w[i] = v;
    const char *c = getenv("FAKE_CORRUPT");
    if (c && first) { size_t at = strtoull(c, NULL, 10);
        char *q = first + at; if (at < first_len && q >= (char *)w && q < (char *)(w + n))
            *(unsigned *)q ^= 0xffu; }
    return 0;
}
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) {
    memcpy(d, (void *)(uintptr_t)s, n); return 0;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
    *s = r == 100 ? "no CUDA-capable device is detected" : "fake error"; return 0;
}
"""


def _build_gpumem(dest: Path) -> Path:
    exe = dest / "gpumem"
    res = subprocess.run(
        [
            "gcc",
            "-O2",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(exe),
            str(GPUMEM),
            "-ldl",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return exe


def _build_fake_lib(dest: Path) -> Path:
    src, lib = dest / "fakemem.c", dest / "libcuda.so.1"
    src.write_text(FAKE_MEM_CUDA)
    res = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return lib


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    d = tmp_path_factory.mktemp("gpumem")
    return _build_gpumem(d), _build_fake_lib(d)


def _leftovers(run: Path) -> list[str]:
    """Every live process of the run in `run` (a test's tmp_path): its path in the command
    line, or in the environment every process of the run inherits (TMPDIR, OUT), as the
    driver's ``--standin`` holders have; never another test's (they run in parallel)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            mine = any(str(run) in part for part in (p.info["cmdline"] or []))
            mine = mine or any(v.startswith(str(run)) for v in p.environ().values())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone meanwhile (or not ours to read: not of this run)
        if mine:
            found.append(" ".join(p.info["cmdline"] or []))
    return found


# -- the holder ----------------------------------------------------------------------


@pytest.mark.integration
def test_gpumem_builds_with_every_warning_an_error_and_probes(built: tuple[Path, Path]) -> None:
    exe, lib = built
    res = subprocess.run(
        [str(exe), "--lib", str(lib), "probe"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    gpu = parse_probe(res.stdout.strip())
    assert gpu == {
        "name": "Fake 'H'",
        "total": 8 * GiB,
        "free": 6 * GiB,
        "cuda": 12040,
        "checkpoint_api": False,  # the fake exports no cuCheckpointProcessLock
    }


@pytest.mark.integration
def test_gpumem_fills_verifies_and_quits(built: tuple[Path, Path]) -> None:
    exe, lib = built
    h = Holder([str(exe), "--lib", str(lib), "0.3"])
    try:
        h.ready(timeout=60)
        assert h.pid == h.proc.pid
        assert h.nbytes == int(0.3 * GiB) // 4 * 4  # more than one 64 MiB stripe, a partial one
        assert h.command("verify", timeout=30) == "ok"
        assert h.command("nonsense", timeout=30).startswith("error unknown command")
        assert h.command("verify", timeout=30) == "ok"
    finally:
        h.close(timeout=30)
    assert h.proc.returncode == 0


@pytest.mark.integration
def test_gpumem_finds_a_word_that_came_back_wrong(built: tuple[Path, Path]) -> None:
    exe, lib = built
    offset = 64 * (1 << 20) + 32 * (1 << 20) + 8  # in the second stripe's middle window
    env = {**os.environ, "FAKE_CORRUPT": str(offset)}
    h = Holder([str(exe), "--lib", str(lib), "0.25"], env=env)
    try:
        h.ready(timeout=60)
        assert h.command("verify", timeout=30).startswith(f"bad at {offset} read=")
    finally:
        h.close(timeout=30)


@pytest.mark.integration
def test_gpumem_without_a_device_or_driver_exits_77(built: tuple[Path, Path]) -> None:
    exe, lib = built
    env = {**os.environ, "FAKE_NO_DEVICE": "1"}
    res = subprocess.run(
        [str(exe), "--lib", str(lib), "1"], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 77
    assert "cuInit failed: no CUDA-capable device is detected" in res.stderr
    res = subprocess.run(
        [str(exe), "--lib", "/nonexistent/libcuda.so.1", "probe"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 77
    assert "cannot load /nonexistent/libcuda.so.1" in res.stderr


# -- the script ----------------------------------------------------------------------


@pytest.mark.integration
def test_the_script_parses_and_passes_shellcheck() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    res = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout


def _script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    full = {**os.environ, "TMPDIR": str(tmp), "OUT": str(tmp_path / "out"), **env}
    full.pop("SLICER_SOCKET", None)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=full,
        cwd=tmp_path,
    )


@pytest.mark.integration
def test_without_a_driver_it_exits_77_with_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    res = _script(tmp_path, LIBCUDA=str(tmp_path / "no" / "libcuda.so.1"))
    assert res.returncode == 77, res.stdout + res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no NVIDIA driver here"), lines
    assert list((tmp_path / "tmp").iterdir()) == []  # its temp dir is gone
    assert _leftovers(tmp_path) == []


@pytest.mark.integration
def test_a_driver_without_a_device_exits_77_after_the_probe(
    tmp_path: Path, built: tuple[Path, Path]
) -> None:
    _, lib = built
    res = _script(tmp_path, LIBCUDA=str(lib), FAKE_NO_DEVICE="1")
    assert res.returncode == 77, res.stdout + res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert lines == [
        "gpu_check: no usable GPU: gpumem: cuInit failed: no CUDA-capable device "
        "is detected (CUresult 100)"
    ], lines
    assert list((tmp_path / "tmp").iterdir()) == []
    assert _leftovers(tmp_path) == []


@pytest.mark.integration
def test_fake_run_parks_and_restores_with_both_parkers_end_to_end(tmp_path: Path) -> None:
    res = _script(tmp_path, "--fake", "--sizes", "0.25,0.5", "--repeats", "2")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["ok"] and report["fake"] and report["notes"] == []
    for parker in ("cli", "driver"):
        p = report["parkers"][parker]
        assert p["status_parker"] == parker  # STATUS says which parker ran
        assert [s["bytes"] for s in p["sizes"]] == [GiB // 4, GiB // 2]
        for s in p["sizes"]:
            assert s["runs"] == 2 and s["park_s"] > 0 and s["restore_s"] > 0
            assert s["park_over_link"] <= 1 and s["restore_over_link"] <= 1
        assert f"STATUS parker reported by the {parker} run: {parker}" in out
    assert [u["bytes"] for u in report["speedup_driver_over_cli"]] == [GiB // 4, GiB // 2]
    assert "driver over cli at 0.5 GiB: park" in out
    assert "```" in (tmp_path / "out" / "gpu_check.md").read_text()
    assert _leftovers(tmp_path) == []


@pytest.mark.integration
def test_fake_run_with_an_unknown_parker_is_refused_and_cleans_up(tmp_path: Path) -> None:
    res = _script(tmp_path, "--fake", "--sizes", "0.25", "--repeats", "1", "--parkers", "bogus")
    assert res.returncode == 1
    assert "--parkers takes cli and/or driver, got 'bogus'" in res.stderr
    assert _leftovers(tmp_path) == []


# -- the figures -----------------------------------------------------------------------


def test_link_bound_is_the_anchors_per_direction_figure() -> None:
    assert figures.link_gbps(4, 16) == 25.0  # ../shared/ANCHORS.md: Gen4 x16 ~25 GB/s
    assert figures.link_gbps(5, 16) == 55.0  # Gen5 x16 ~55 GB/s
    assert figures.link_gbps(5, 8) == 27.5
    assert figures.link_gbps(None, 16) is None and figures.link_gbps(9, 16) is None
    assert figures.link_gbps(4, 0) is None


def test_an_idle_downtrained_link_is_bounded_by_its_maximum() -> None:
    assert figures.link_used(1, 16, 5, 16) == (5, 16)  # idle GPUs train down to Gen1
    assert figures.link_used(5, 16, 5, 16) == (5, 16)
    assert figures.link_used(4, 8, None, None) == (4, 8)
    assert figures.link_used(None, None, 4, 16) == (4, 16)


def test_medians_rates_and_ratios() -> None:
    assert figures.median([3.0, 1.0, 2.0]) == 2.0
    assert figures.median([1.0, 2.0]) == 1.5
    assert figures.median([]) is None
    assert figures.gbps(16 * 10**9, 2.0) == 8.0
    assert figures.gbps(1, 0) is None and figures.gbps(1, None) is None
    row = figures.summarise(4 * GiB, [1.0, 2.0, 9.0], [0.5, 0.4, 0.6], 25.0)
    assert row["park_s"] == 2.0 and row["restore_s"] == 0.5
    assert row["park_gbps"] == pytest.approx(4 * GiB / 2.0 / 1e9)
    assert row["restore_over_link"] == pytest.approx(4 * GiB / 0.5 / 1e9 / 25.0)
    assert row["runs"] == 3


def test_driver_speedup_over_the_cli_per_size() -> None:
    rows = {
        "cli": {GiB: {"park_s": 6.0, "restore_s": 8.0}, 2 * GiB: {"park_s": 7.0, "restore_s": 9}},
        "driver": {GiB: {"park_s": 1.5, "restore_s": 2.0}},
    }
    assert figures.speedups(rows) == {GiB: {"park": 4.0, "restore": 4.0}}
    assert figures.speedups({"cli": rows["cli"]}) == {}


def test_sizes_are_capped_by_free_memory() -> None:
    assert figures.sizes_that_fit([4, 16], 141 * GiB, 2 * GiB) == [4 * GiB, 16 * GiB]
    # 16 GiB does not fit in 12 - 2: it is capped once to what does.
    assert figures.sizes_that_fit([4, 16, 32], 12 * GiB, 2 * GiB) == [4 * GiB, 10 * GiB]
    assert figures.sizes_that_fit([4], 2 * GiB, 2 * GiB) == []
    assert figures.sizes_that_fit([0.25], None, 0) == [GiB // 4]


def test_table_reads_per_parker_and_size() -> None:
    rows = {"cli": {GiB: figures.summarise(GiB, [2.0], [4.0], 25.0)}}
    lines = figures.table(rows, 25.0, {})
    assert lines[0] == "link bound: 25.0 GB/s per direction"
    assert lines[2].split() == ["cli", "1", "GiB", "2.00", "4.00", "0.5", "0.3", "0.02", "0.01"]


def test_probe_line_is_parsed_or_refused() -> None:
    line = 'gpu name="NVIDIA H200" total=150754820096 free=150000000000 cuda=12080 checkpoint_api=1'
    assert parse_probe(line)["checkpoint_api"] is True
    with pytest.raises(ValueError, match="cannot read"):
        parse_probe("gpu name=H200")


def test_benchmarks_md_says_how_to_run_the_gpu_check() -> None:
    # bench/efficiency.py writes bench/gpu_check/section.md into BENCHMARKS.md, so the
    # next `make bench` keeps it; the committed file has it now.
    section = (ROOT / "bench" / "gpu_check" / "section.md").read_text()
    assert section.startswith("## The GPU check (`bench/gpu_check.sh`)\n")
    assert section + "\n## Real GPU check" in (ROOT / "BENCHMARKS.md").read_text()
    for words in ("--parker cli", "--parker driver", "gpu_check.json", "77", "--fake"):
        assert words in section
