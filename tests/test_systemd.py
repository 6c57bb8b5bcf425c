"""systemd/: every unit verifies with no output at all (`systemd/verify.sh`, the same check as
`make verify-units`), the check is not vacuous, the units say what the operations guide
promises, and every ExecStart command line parses with the real command's options."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
VERIFY = UNITS / "verify.sh"
BIN = Path(sys.executable).parent  # the venv's console scripts: slicerd, slicer-launch, ...

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)

Unit = dict[str, dict[str, list[str]]]


def parse_unit(path: Path) -> Unit:
    """A unit file as {section: {key: [values in order]}} (continuations joined)."""
    unit: Unit = {}
    section: dict[str, list[str]] = {}
    text = re.sub(r"\\\n", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = unit.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def one(unit: Unit, section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, (section, key, values)
    return values[0]


def run_verify(*args: str, units_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if units_dir is not None:
        env["SLICER_UNITS_DIR"] = str(units_dir)
    return subprocess.run(
        [str(VERIFY), *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.integration
@needs_systemd
def test_every_unit_and_snippet_verifies_without_a_word() -> None:
    r = run_verify(str(BIN))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r.stdout + r.stderr


@pytest.mark.integration
@needs_systemd
def test_verify_reports_warnings_and_bad_snippets(tmp_path: Path) -> None:
    broken = tmp_path / "units"
    shutil.copytree(UNITS, broken)
    with open(broken / "slicer.socket", "a") as f:
        f.write("\n[Socket]\nListenStrem=/run/typo.sock\n")
    with open(broken / "tmpfiles.d" / "slicer.conf", "a") as f:
        f.write("d /var/lib/slicer-x 0750 root no-such-group -\n")
    r = run_verify(str(BIN), units_dir=broken)
    assert r.returncode == 1
    assert "Unknown key 'ListenStrem' in section [Socket]" in r.stdout
    assert "no-such-group" in r.stdout


@pytest.mark.integration
def test_verify_refuses_a_missing_binary(tmp_path: Path) -> None:
    r = run_verify(str(tmp_path))  # an empty BIN: nothing is installed there
    if shutil.which("systemd-analyze") is None:
        assert r.returncode == 0 and "skipped" in r.stderr
        return
    assert r.returncode == 1
    assert "slicerd is not installed in" in r.stdout


def test_socket_and_service_say_what_the_docs_promise() -> None:
    sock = parse_unit(UNITS / "slicer.socket")
    assert one(sock, "Socket", "ListenStream") == "/run/slicer/slicer.sock"
    assert one(sock, "Socket", "SocketMode") == "0660"
    assert one(sock, "Socket", "SocketGroup") == "slicer"

    svc = parse_unit(UNITS / "slicer.service")["Service"]
    assert svc["Type"] == ["notify"] and svc["Restart"] == ["on-failure"]
    # vLLM exits 0 when its engine dies: only Restart=always brings a replica back.
    assert parse_unit(UNITS / "slicer-vllm@.service")["Service"]["Restart"] == ["always"]
    assert svc["KillMode"] == ["process"]  # a daemon restart never kills a workload
    assert int(svc["WatchdogSec"][0]) > 0
    # Root must keep its power over other users' processes and /dev/nvidia*.
    for key in (
        "User",
        "DynamicUser",
        "PrivateUsers",
        "CapabilityBoundingSet",
        "AmbientCapabilities",
        "ProtectProc",
        "ProcSubset",
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "ProtectKernelLogs",
        "MemoryDenyWriteExecute",
        "SystemCallFilter",
        "PrivateNetwork",
        "RuntimeDirectory",  # it would remove /run/slicer, socket and markers, on stop
    ):
        assert key not in svc, key
    assert svc["NoNewPrivileges"] == ["yes"] and svc["ProtectSystem"] == ["strict"]


def test_snippets() -> None:
    def lines(rel: str) -> list[list[str]]:
        text = (UNITS / rel).read_text().splitlines()
        return [ln.split() for ln in text if ln.strip() and not ln.startswith("#")]

    assert lines("sysusers.d/slicer.conf") == [["g", "slicer", "-"]]
    assert lines("tmpfiles.d/slicer.conf") == [
        ["d", "/run/slicer", "0755", "root", "root", "-"],
        ["d", "/var/lib/slicer", "0750", "root", "root", "-"],
    ]


ENV = {"PORT": "8000", "DISPATCH_PORT": "8100", "GPU": "0", "MODEL": "/models/m"}
ENV["VLLM_ARGS"] = "--max-model-len 4096"


def exec_argv(unit: Path, instance: str = "r0") -> list[str]:
    """ExecStart as systemd would run it: %i and ${VAR} substituted, $VAR word-split."""
    line = one(parse_unit(unit), "Service", "ExecStart").replace("%i", instance)
    line = re.sub(r"\$\{(\w+)\}", lambda m: ENV[m[1]], line)
    words: list[str] = []
    for word in shlex.split(line):
        m = re.fullmatch(r"\$(\w+)", word)
        words += ENV[m[1]].split() if m else [word]
    return words


def commands() -> dict[str, click.Command]:
    from gpu_slicer.dispatcher.main import main as dispatch
    from gpu_slicer.launcher.main import main as launch
    from gpu_slicer.slicer.daemon import main as slicerd

    return {"slicerd": slicerd, "slicer-launch": launch, "slicer-dispatch": dispatch}


@pytest.mark.parametrize(
    "unit", ["slicer.service", "slicer-vllm@.service", "slicer-dispatch@.service"]
)
def test_exec_start_parses_with_the_real_command(unit: str) -> None:
    argv = exec_argv(UNITS / unit)
    assert argv[0].startswith("/usr/local/bin/")
    cmd = commands()[Path(argv[0]).name]
    args = argv[1:]
    if isinstance(cmd, click.Group):
        cmd, args = cmd.commands[args[0]], args[1:]
    with cmd.make_context(Path(argv[0]).name, args) as ctx:  # raises on a bad option
        params = ctx.params
    if unit == "slicer-dispatch@.service":
        assert params["workload"] == "r0"
        assert params["replica_url"] == "http://127.0.0.1:8000"
        assert params["socket_path"] == "/run/slicer/slicer.sock"
        assert params["state_dir"] == "/var/lib/slicer/dispatch-r0"
        assert params["listen"] == "127.0.0.1:8100"
        svc = parse_unit(UNITS / unit)["Service"]
        assert svc["EnvironmentFile"] == ["/etc/slicer/dispatch-%i.env"]
        assert svc["StateDirectory"] == ["slicer/dispatch-%i"]  # = its --state-dir
    if unit == "slicer-vllm@.service":
        assert params["workload"] == "r0"
        serve = ["vllm", "serve", "/models/m", "--port", "8000", "--max-model-len", "4096"]
        assert list(params["command"]) == serve
