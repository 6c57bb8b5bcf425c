"""The fake GPU across PID namespaces: host pids out, caller's pids in, like the driver.

A "pod" is a PID + mount namespace with its own /proc, the host's procfs bind-mounted at
``$FAKEGPU_HOST_PROC`` first (``unshare``; the test machines run as root). Its init is a
small controller that starts one CUDA process (it allocates for itself and waits) and
runs commands inside the pod on request: a line of JSON in, a line of JSON out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from stubs.fakegpu import Ledger
from stubs.fakegpu.backend import FakeBackend
from stubs.proc import TOOL, child_env

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="a pod simulation needs root and unshare(1)",
    ),
]

MiB = 1024**2
NBYTES = 300 * MiB
BOUND_S = 60

WORKER = f"""
import json, os, sys
from stubs.fakegpu import Ledger
Ledger().alloc(os.getpid(), 0, {NBYTES}, workload="pod")
print(json.dumps({{"pid": os.getpid()}}), flush=True)
sys.stdin.read()
"""

CONTROLLER = """
import json, os, subprocess, sys
worker = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE
)
ready = json.loads(worker.stdout.readline())
print(json.dumps({"worker": worker.pid, "said": ready["pid"]}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "run":
        r = subprocess.run(
            [sys.executable, *cmd["argv"]], capture_output=True, text=True, timeout=30
        )
        out = {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr}
    elif cmd["op"] == "stop":
        worker.stdin.close()
        out = {"rc": worker.wait(timeout=30)}
    else:
        from stubs.fakegpu.backend import FakeBackend
        backend = FakeBackend()
        out = {
            "ns": backend.pid_namespace(),
            "own_ns": os.stat("/proc/self/ns/pid").st_ino,
            "procs": {str(k): v for k, v in backend.processes(0).items()},
        }
    print(json.dumps(out), flush=True)
"""


class Pod:
    """The controller of one pod: `ask` sends a command, returns its answer."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buf = b""
        self.worker = 0  # the CUDA process's pid in the pod's namespace

    async def line(self) -> Any:
        """The next JSON line the controller prints."""
        assert self.proc.stdout is not None
        while b"\n" not in self._buf:
            chunk = await self.proc.stdout.receive_some()
            if not chunk:
                raise AssertionError("the pod's controller exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    async def ask(self, op: str, **kw: Any) -> Any:
        """Run `op` in the pod (``run`` takes ``argv`` for this interpreter)."""
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps({"op": op, **kw}).encode() + b"\n")
        return await self.line()

    async def tool(self, *args: str) -> Any:
        """The cuda-checkpoint stub, run inside the pod."""
        return await self.ask("run", argv=[TOOL, *args])


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    monkeypatch.setenv("FAKEGPU_DIR", str(tmp_path / "gpu"))
    monkeypatch.setenv("FAKEGPU_BANDWIDTH", "1000TB")
    for name in ("FAKEGPU_HOST_PROC", "FAKEGPU_WORKLOAD", "FAKEGPU_CC_TOGGLE_ONLY"):
        monkeypatch.delenv(name, raising=False)
    return Ledger.init(tmp_path / "gpu", gpus=1, capacity=1024 * MiB)


@pytest.fixture
async def pod(gpu: Ledger, tmp_path: Path) -> AsyncIterator[Pod]:
    host_proc = tmp_path / "hostproc"
    host_proc.mkdir()
    env = child_env({"HP": str(host_proc), "FAKEGPU_HOST_PROC": str(host_proc)})
    argv = [
        "unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
        "--", "sh", "-c",
        'mount --bind /proc "$HP" && mount -t proc proc /proc && exec "$@"', "sh",
        sys.executable, "-c", CONTROLLER, WORKER,
    ]  # fmt: skip
    with open(tmp_path / "pod.log", "wb") as log:
        proc = await trio.lowlevel.open_process(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
        )
    pod = Pod(proc)
    try:
        with trio.fail_after(BOUND_S):
            hello = await pod.line()
        pod.worker = hello["worker"]
        assert hello["said"] == pod.worker  # the worker saw itself by its pod pid
        yield pod
    finally:
        # Closing the controller's stdin ends it; its end (the pod's init) kills the pod.
        assert proc.stdin is not None
        with trio.move_on_after(10):
            await proc.stdin.aclose()
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            with trio.move_on_after(10):
                await proc.wait()


def host_pid_of(pod: Pod, gpu: Ledger) -> int:
    """The host pid of the pod's CUDA process, as the ledger reports it from outside."""
    rows = gpu.processes()
    assert len(rows) == 1, rows
    return rows[0].pid


def nspid(host_pid: int) -> list[int]:
    with open(f"/proc/{host_pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError("no NSpid line")


async def test_pod_process_is_reported_by_host_pid(pod: Pod, gpu: Ledger) -> None:
    with trio.fail_after(BOUND_S):
        host = host_pid_of(pod, gpu)
        assert host != pod.worker
        assert nspid(host) == [host, pod.worker]  # that host pid is the pod's worker
        (row,) = gpu.processes()
        assert (row.gpu, row.on_device, row.on_host, row.workload) == (0, NBYTES, 0, "pod")
        assert gpu.gpus()[0].used == NBYTES
        assert gpu.snapshot()["processes"][0]["pid"] == host

        # The backend speaks host pids in the host's namespace, from outside and inside.
        host_ns = os.stat("/proc/self/ns/pid").st_ino
        backend = FakeBackend()
        assert backend.pid_namespace() == host_ns
        assert backend.processes(0) == {host: NBYTES}
        inside = await pod.ask("backend")
        assert inside["own_ns"] != host_ns
        assert inside["ns"] == host_ns
        assert inside["procs"] == {str(host): NBYTES}

        # Like a CUDA context, the worker holds its GPU's device node open.
        node = backend.device_node(0)
        assert node == str(gpu.directory / "dev" / "nvidia0") and os.path.exists(node)
        fds = os.listdir(f"/proc/{host}/fd")
        assert node in {os.readlink(f"/proc/{host}/fd/{fd}") for fd in fds}
        assert gpu.overlaps() == 0


async def test_pod_process_exit_frees_its_memory(pod: Pod, gpu: Ledger) -> None:
    with trio.fail_after(BOUND_S):
        host_pid_of(pod, gpu)
        assert (await pod.ask("stop"))["rc"] == 0
        assert gpu.processes() == []
        assert gpu.gpus()[0].used == 0
        assert gpu.overlaps() == 0


async def test_checkpoint_stub_in_pod_reads_pod_pids(pod: Pod, gpu: Ledger) -> None:
    with trio.fail_after(BOUND_S):
        host = host_pid_of(pod, gpu)
        pid = str(pod.worker)

        # A number that names a process only outside the pod is no process of the pod.
        r = await pod.tool("--toggle", "--pid", str(host))
        assert r["rc"] == 1 and "no such process" in r["stderr"], r
        r = await pod.tool("--get-state", "--pid", str(host))
        assert r["rc"] == 1 and "no such process" in r["stderr"], r
        assert gpu.state(host) == "running"

        r = await pod.tool("--toggle", "--pid", pid)
        assert r["rc"] == 0, r
        (row,) = gpu.processes()
        assert (row.pid, row.on_device, row.on_host) == (host, 0, NBYTES)
        assert gpu.state(host) == "checkpointed"
        r = await pod.tool("--get-state", "--pid", pid)
        assert (r["rc"], r["stdout"].strip()) == (0, "checkpointed"), r

        for op in ("restore", "unlock"):
            r = await pod.tool("--action", op, "--pid", pid)
            assert r["rc"] == 0, r
        (row,) = gpu.processes()
        assert (row.pid, row.on_device, row.on_host) == (host, NBYTES, 0)
        assert gpu.state(host) == "running"
        assert gpu.overlaps() == 0


async def test_fakegpu_cli_in_pod_reads_pod_pids(pod: Pod, gpu: Ledger) -> None:
    with trio.fail_after(BOUND_S):
        host = host_pid_of(pod, gpu)
        cli = ["-m", "stubs.fakegpu"]
        r = await pod.ask("run", argv=[*cli, "fail", "--pid", str(pod.worker), "--op", "lock"])
        assert r["rc"] == 0, r
        assert gpu.injection(host, "lock") == "fail"
        r = await pod.ask("run", argv=[*cli, "fail", "--pid", str(host), "--op", "unlock"])
        assert r["rc"] == 1 and "no process" in r["stderr"], r
        assert gpu.injection(host, "unlock") is None
        r = await pod.ask("run", argv=[*cli, "clear", "--pid", str(pod.worker)])
        assert r["rc"] == 0, r
        assert gpu.injection(host, "lock") is None
        # Booking memory on behalf of the worker does not make the CLI a GPU process.
        r = await pod.ask("run", argv=[*cli, "alloc", "--pid", str(pod.worker), "--bytes", "1MiB"])
        assert r["rc"] == 0, r
        (row,) = gpu.processes()
        assert (row.pid, row.on_device) == (host, NBYTES + MiB)
        assert gpu.overlaps() == 0


HOLDER = """
import json, os
from stubs.fakegpu import Ledger
ledger = Ledger()
node = str(ledger.device_node(0))
def held():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == node
        except OSError:
            pass
    return n
seen = {}
ledger.alloc(os.getppid(), 0, 1, workload="holder")
seen["for_another"] = held()
ledger.alloc(os.getpid(), 0, 1, workload="holder")
ledger.alloc(os.getpid(), 0, 1, tag="more")
seen["for_itself"] = held()
r, w = os.pipe()
child = os.fork()
if child == 0:
    ledger.alloc(os.getpid(), 0, 1, workload="holder")
    os.write(w, str(held()).encode())
    os._exit(0)
os.close(w)
seen["forked_child"] = int(os.read(r, 100))
os.waitpid(child, 0)
print(json.dumps(seen))
"""


def test_device_node_held_by_own_allocations_only(gpu: Ledger) -> None:
    out = subprocess.run(
        [sys.executable, "-c", HOLDER], env=child_env(), capture_output=True, timeout=BOUND_S
    )
    assert out.returncode == 0, out.stderr
    # The child inherits its parent's fd, as a forked CUDA process does, and opens its own.
    assert json.loads(out.stdout) == {"for_another": 0, "for_itself": 1, "forked_child": 2}
    assert gpu.overlaps() == 0
