"""The pod test double (`stubs.pods`): a PID and a mount namespace standing in for a pod.

What the Kubernetes simulation tests rely on: a container's two pids, signals reaching the
real process (not its nsenter parent), the pod's own /proc with the host's beside it for
the fake driver, a private emptyDir, Kubernetes' deletion order, a container's processes
dying with its main process (``shareProcessNamespace``), and nothing left behind.
Every container announces itself on a Unix socket of the test (files are shared with the
pod), so readiness is an event.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from stubs.pods import Pod, running_pod
from tests.harness import POD_TESTS

pytestmark = POD_TESTS

# argv[1]: the test's socket; argv[2]: the emptyDir (or ""); SIGTERM exits with argv[3]
# (or is ignored when it is "ignore").
CONTAINER = textwrap.dedent(
    """
    import json, os, signal, socket, sys
    sock, emptydir, on_term = sys.argv[1], sys.argv[2], sys.argv[3]
    if on_term == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(int(on_term)))
    if emptydir:
        open(os.path.join(emptydir, "inside"), "w").close()
    hp = os.environ["FAKEGPU_HOST_PROC"]
    me = {"pid": os.getpid(), "host_self": int(os.readlink(hp + "/self")),
          "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
          "emptydir": sorted(os.listdir(emptydir)) if emptydir else None}
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(json.dumps(me).encode() + b"\\n")
    while True:
        signal.pause()
    """
)


class Announcements:
    """The test's socket: each container connects once and sends one JSON line."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = trio.socket.socket(trio.socket.AF_UNIX)

    async def __aenter__(self) -> Announcements:
        await self.sock.bind(self.path)
        self.sock.listen(16)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.sock.close()

    async def next(self) -> dict[str, Any]:
        conn, _ = await self.sock.accept()
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = await conn.recv(65536)
                assert chunk, data
                data += chunk
        body: dict[str, Any] = json.loads(data)
        return body


async def start(
    pod: Pod, ann: Announcements, name: str, on_term: str = "0", *, sidecar: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Container `name` running CONTAINER, once it announced itself."""
    ed = str(pod.emptydir or "")
    argv = [sys.executable, "-c", CONTAINER, ann.path, ed, on_term]
    c = await pod.start_container(name, argv, sidecar=sidecar)
    return c, await ann.next()


async def test_a_container_has_a_host_pid_and_a_pod_pid_and_sees_its_pod(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with Announcements(tmp_path / "ann.sock") as ann:
            async with running_pod(tmp_path, "a", emptydir=True) as pod:
                assert pod.emptydir is not None
                c, me = await start(pod, ann, "app")
                # One process, two numbers: its own view, and the host's (NSpid).
                assert me["pid"] == c.ns_pid and me["host_self"] == c.host_pid
                status = Path(f"/proc/{c.host_pid}/status").read_text()
                assert f"NSpid:\t{c.host_pid}\t{c.ns_pid}" in status
                assert (
                    os.stat(f"/proc/{c.host_pid}/ns/pid").st_ino
                    == pod.pidns
                    != (os.stat("/proc/self/ns/pid").st_ino)
                )
                # Its /proc is the pod's: pid 1 (the init) and small numbers, not the host's.
                assert 1 in me["proc"] and c.ns_pid in me["proc"]
                assert c.host_pid not in me["proc"] and os.getpid() not in me["proc"]
                # The emptyDir is the pod's own: its file is not seen outside, ours not in.
                (pod.emptydir / "outside").write_text("x")
                assert me["emptydir"] == ["inside"]
                assert os.listdir(pod.emptydir) == ["outside"]
                assert str(pod.host_proc) not in Path("/proc/self/mounts").read_text()
                c.signal(signal.SIGTERM)
                assert await c.wait() == 0
                mntns = pod.mntns
            # Gone with the pod: every process of its mount namespace (so its mounts).
            assert not [p for p in os.listdir("/proc") if p.isdigit() and _mnt(p) == mntns]


def _mnt(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


async def test_signals_reach_the_containers_process_not_its_nsenter_parent(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with Announcements(tmp_path / "ann.sock") as ann, running_pod(tmp_path, "a") as pod:
            c, _ = await start(pod, ann, "app", "7")
            assert c.proc.pid != c.host_pid  # nsenter stays outside, as the parent
            c.signal(signal.SIGTERM)
            assert await c.wait() == 7  # the handler's status, passed on by nsenter
            # Ignoring SIGTERM: stop's SIGKILL after the grace ends it.
            c, _ = await start(pod, ann, "stubborn", "ignore")
            assert await c.stop(grace=0.5) == -signal.SIGKILL


async def test_delete_stops_regular_containers_first_then_sidecars_last_started_first(
    tmp_path: Path,
) -> None:
    with trio.fail_after(40):
        async with Announcements(tmp_path / "ann.sock") as ann, running_pod(tmp_path, "a") as pod:
            await start(pod, ann, "side-1", "11", sidecar=True)
            await start(pod, ann, "side-2", "12", sidecar=True)
            await start(pod, ann, "app-1", "21")
            await start(pod, ann, "app-2", "22")
            rcs = await pod.delete(grace=20)
            assert rcs == {"side-1": 11, "side-2": 12, "app-1": 21, "app-2": 22}
            assert set(pod.exit_order[:2]) == {"app-1", "app-2"}
            assert pod.exit_order[2:] == ["side-2", "side-1"]
            assert pod.proc.poll() is not None and not pod.leftovers()


async def test_delete_kills_what_outlives_the_grace_and_the_sidecars_with_it(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with Announcements(tmp_path / "ann.sock") as ann, running_pod(tmp_path, "a") as pod:
            await start(pod, ann, "side", "11", sidecar=True)
            await start(pod, ann, "app", "ignore")
            rcs = await pod.delete(grace=0.5)
            assert rcs == {"side": -signal.SIGKILL, "app": -signal.SIGKILL}


async def test_kill_ends_every_process_of_the_pod_and_a_failing_test_leaves_nothing(
    tmp_path: Path,
) -> None:
    pids: list[int] = []
    with trio.fail_after(30), pytest.raises(RuntimeError, match="a failing test"):
        async with Announcements(tmp_path / "ann.sock") as ann, running_pod(tmp_path, "a") as pod:
            for name in ("one", "two"):
                c, _ = await start(pod, ann, name, "ignore")
                pids += [c.host_pid, c.proc.pid]
            pids += [pod.init_pid, pod.proc.pid]
            raise RuntimeError("a failing test")
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


async def test_pod_kill_is_sigkill_for_every_container(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with Announcements(tmp_path / "ann.sock") as ann, running_pod(tmp_path, "a") as pod:
            a, _ = await start(pod, ann, "a", "ignore")
            b, _ = await start(pod, ann, "b", "ignore")
            pod.kill()
            assert await a.wait() == -signal.SIGKILL
            assert await b.wait() == -signal.SIGKILL


# A container's process tree (argv[1]: the test's socket, argv[2]: the host procfs as the
# pod sees it, argv[3]: the role). main starts middle and waits for it; middle starts b in
# a session of its own and exits (b is orphaned: the pod's init adopts it); b starts c
# with an empty environment. Each but middle announces its host pid (main once middle
# has exited). main exits 3 on SIGTERM, leaving the others behind.
TREE = textwrap.dedent(
    """
    import json, os, signal, socket, subprocess, sys
    sock, hostproc, role = sys.argv[1], sys.argv[2], sys.argv[3]
    me = [sys.executable, __file__, sock, hostproc]
    if role == "main":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
        subprocess.Popen([*me, "middle"]).wait()
    elif role == "middle":
        subprocess.Popen([*me, "b"], start_new_session=True)
        os._exit(0)
    elif role == "b":
        subprocess.Popen([*me, "c"], env={})
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    host = int(os.readlink(hostproc + "/self"))
    s.sendall(json.dumps({"role": role, "host": host}).encode() + b"\\n")
    s.close()
    while True:
        signal.pause()
    """
)


def _alive(pid: int) -> bool:
    """Whether `pid` names a process that is not a zombie (reaped ones are gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


@pytest.mark.parametrize(("sig", "rc"), [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 3)])
async def test_a_containers_processes_die_with_its_main_process_even_when_orphaned(
    tmp_path: Path, sig: int, rc: int
) -> None:
    """shareProcessNamespace: runc kills the container's cgroup once its init exits."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    with trio.fail_after(30):
        async with Announcements(tmp_path / "ann.sock") as ann, running_pod(tmp_path, "a") as pod:
            other, _ = await start(pod, ann, "other", "ignore")
            argv = [sys.executable, str(script), ann.path, str(pod.host_proc), "main"]
            c = await pod.start_container("app", argv)
            seen = {}
            while len(seen) < 3:  # main's line comes once middle has exited
                a = await ann.next()
                seen[a["role"]] = a["host"]
            main, b, grandchild = seen["main"], seen["b"], seen["c"]
            assert main == c.host_pid
            # b left the container's session and parent; c has no environment at all.
            assert f"PPid:\t{pod.init_pid}\n" in Path(f"/proc/{b}/status").read_text()
            assert os.getsid(b) != os.getsid(main)
            assert (
                f"STUBS_POD_CONTAINER={c.marker}".encode()
                in Path(f"/proc/{b}/environ").read_bytes()
            )
            assert Path(f"/proc/{grandchild}/environ").read_bytes() == b""
            c.signal(sig)
            assert await c.wait() == rc
            # Gone, and reaped, by the time the container's exit is seen.
            assert [p for p in (main, b, grandchild) if os.path.exists(f"/proc/{p}")] == []
            # Another container of the pod is not touched.
            assert other.alive() and _alive(other.host_pid)
            assert await other.stop(grace=0.2) == -signal.SIGKILL
