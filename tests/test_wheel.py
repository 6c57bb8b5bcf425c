"""The wheel holds the product alone, and installs beside PyPI's `slicer` and `proto-plus`.

Builds the wheel from this checkout, installs it into a fresh virtual environment next to
`slicer==0.0.8` (a dependency of shap) and `proto-plus` (pulled in by Google Cloud clients),
then runs what a user would: every console script's `--help`, the trainer client's
documented import, and the other two packages' own imports. Needs the package registry (as
`make test`'s install does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("slicerd", "slicerctl", "slicer-launch", "slicer-dispatch", "slicer-pool")
PRODUCT = ("proto", "slicer", "launcher", "dispatcher")


def _run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # A clean environment: no PYTHONPATH, and a cwd outside the checkout, so that nothing of
    # the source tree can stand in for what was installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a private copy of what the wheel is made of: setuptools writes build/ and
    # gpu_slicer.egg-info/ into the tree it builds, and parallel workers (each builds its own:
    # the fixture is per worker) building from the checkout itself emptied each other's
    # build/lib mid-build (a wheel without gpu_slicer). The copy follows the package's
    # symlinks, as the build does.
    src = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "gpu_slicer", src / "gpu_slicer", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    r = _run([*build, "-w", str(out), str(src)], cwd=out)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("gpu_slicer-*.whl")
    return whl


@pytest.fixture(scope="module")
def env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel, slicer==0.0.8 and proto-plus; returns its bin dir."""
    where = tmp_path_factory.mktemp("venv")
    venv.create(where, with_pip=True, clear=True)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q"]
    r = _run([*pip, str(wheel), "slicer==0.0.8", "proto-plus"], cwd=where)
    assert r.returncode == 0, r.stdout + r.stderr
    return where / "bin"


def test_the_wheel_holds_only_the_product(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"gpu_slicer", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    packages = {n.split("/")[1] for n in names if n.startswith("gpu_slicer/") and n.count("/") > 1}
    assert packages == set(PRODUCT)
    assert "gpu_slicer/proto/PROTOCOL.md" in names
    assert "gpu_slicer/slicer/py.typed" in names and "gpu_slicer/proto/py.typed" in names
    for room in ("stubs", "demo", "bench", "tests", "vllm_tier"):
        assert not [n for n in names if f"/{room}/" in f"/{n}"], room


def test_every_console_script_runs_beside_pypi_slicer_and_proto_plus(env: Path) -> None:
    for script in SCRIPTS:
        r = _run([str(env / script), "--help"], cwd=env)
        assert r.returncode == 0 and "Usage:" in r.stdout, (script, r.stderr)
    r = _run([str(env / "slicerctl"), "run", "--help"], cwd=env)
    assert r.returncode == 0 and "--workload" in r.stdout, r.stderr


def test_three_packages_import_side_by_side(env: Path) -> None:
    code = (
        "from gpu_slicer.slicer.client import Slicer as Ours, AsyncSlicer, Faulted\n"
        "from gpu_slicer.slicer.offload import Offloader\n"
        "from gpu_slicer import proto as ours\n"
        "from slicer import Slicer\n"  # PyPI slicer (shap's)
        "import proto\n"  # proto-plus
        "assert proto.Message.__module__.startswith('proto.'), proto.Message\n"
        "assert Slicer.__module__.startswith('slicer'), Slicer\n"
        "assert Ours.__module__ == 'gpu_slicer.slicer.client'\n"
        "assert ours.parse_request is not None and ours is not proto\n"
        "print('ok')\n"
    )
    r = _run([str(env / "python"), "-c", code], cwd=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_fake_gpu_is_not_in_the_product(env: Path, tmp_path: Path) -> None:
    """Without the test doubles installed, `--gpu-backend fake` is one line naming them."""
    argv = [str(env / "slicerd"), "--gpu-backend", "fake", "--socket", str(tmp_path / "s")]
    r = _run([*argv, "--state-dir", str(tmp_path / "st")], cwd=tmp_path, timeout=30)
    assert r.returncode != 0
    assert "unknown gpu backend 'fake'" in r.stderr and "stubs" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_the_demo_is_not_in_the_product(env: Path, tmp_path: Path) -> None:
    """Installed from the wheel, `slicerctl demo` is one line saying where the demo runs."""
    r = _run([str(env / "slicerctl"), "demo", "--", "--json"], cwd=tmp_path, timeout=30)
    assert r.returncode == 69, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        "slicerctl demo: the demo runs from a checkout of gpu-slicer (`make demo` there)"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing was started or written
