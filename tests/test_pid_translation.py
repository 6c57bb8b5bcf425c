"""REGISTER from another PID namespace: every pid= is read in the sender's namespace.

A "pod" here is `unshare --pid --fork --mount` with its own /proc: a client inside it
registers itself (`pid=self`), a child of its own by its pod number, and numbers that
only mean something outside; slicerd (outside, like the node DaemonSet with hostPID)
must track the right processes and show both numbers in STATUS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from gpu_slicer.slicer import pidns
from tests.harness import running_stack, workload

pytestmark = pytest.mark.integration

CLIENT = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys
    child = subprocess.Popen(["sleep", "300"])
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    f = s.makefile("rwb", buffering=0)
    def ask(line):
        f.write(line.encode() + b"\\n")
        return f.readline().decode().strip()
    out = {"self_ns_pid": os.getpid(), "child_ns_pid": child.pid, "replies": {}}
    out["replies"]["hello"] = ask("HELLO proto=1")
    for line in sys.argv[2:]:
        out["replies"][line] = ask(line.replace("CHILD", str(child.pid)))
    print(json.dumps(out), flush=True)
    sys.stdin.read()  # hold the registrations until the test is done
    child.kill()
    """
)


def _pod_argv(script: Path, *args: str) -> list[str]:
    # The new /proc makes the client see its pod's numbers, as in a container.
    inner = 'mount -t proc proc /proc && exec "$@"'
    return [
        "unshare", "--pid", "--fork", "--mount", "--propagation", "private",
        "sh", "-c", inner, "sh", sys.executable, str(script), *args,
    ]  # fmt: skip


def _host_pid_of(ns_pid: int, ns: int) -> int | None:
    return pidns.translate(ns_pid, ns)


async def test_pids_from_a_pod_are_translated_and_status_shows_both_numbers(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            outside = stack.sleeper()  # a host process the pod must not be able to name
            script = tmp_path / "client.py"
            script.write_text(CLIENT)
            lines = [
                "REGISTER me pid=self tree=0",
                "REGISTER kid pid=CHILD",
                f"REGISTER wrong pid={outside}",
            ]
            proc = subprocess.Popen(
                _pod_argv(script, stack.socket, *lines),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=stack.env,
            )
            try:
                assert proc.stdout is not None
                raw = await trio.to_thread.run_sync(proc.stdout.readline)
                out = json.loads(raw)
                replies = out["replies"]
                assert replies["REGISTER me pid=self tree=0"].startswith("OK workload=me")
                assert replies["REGISTER kid pid=CHILD"].startswith("OK workload=kid")
                # The host number of a process outside names nothing in the pod.
                wrong = replies[f"REGISTER wrong pid={outside}"]
                assert wrong.startswith("ERR no-such-process"), wrong
                assert "namespace" in wrong

                ns = pidns.namespace_of(proc.pid)
                assert ns is not None
                # unshare --fork: the pod's pid 1 is sh's exec'd python, a child of unshare
                me_host = _host_pid_of(out["self_ns_pid"], _ns_of_child(proc.pid))
                st = await stack.status()
                me, kid = workload(st, "me"), workload(st, "kid")
                assert me is not None and kid is not None
                assert me["pid"] == me_host and me["ns_pid"] == out["self_ns_pid"]
                kid_host = _host_pid_of(out["child_ns_pid"], _ns_of_child(proc.pid))
                assert kid["pid"] == kid_host and kid["ns_pid"] == out["child_ns_pid"]
                assert kid["pidns"] == me["pidns"] == _ns_of_child(proc.pid)
                assert kid["pid"] != kid["ns_pid"]
                assert workload(st, "wrong") is None  # refused: nothing changed
                assert os.path.exists(f"/proc/{kid['pid']}")
            finally:
                proc.kill()
                await trio.to_thread.run_sync(proc.wait)
                if proc.stdout is not None:
                    proc.stdout.close()
                if proc.stdin is not None:
                    proc.stdin.close()
            assert stack.overlaps() == 0


def _ns_of_child(unshare_pid: int) -> int:
    """The PID namespace of the pod: the one its first process (unshare's child) is in."""
    kids = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    ns = pidns.namespace_of(int(kids[0]))
    assert ns is not None
    return ns


async def test_a_peer_in_slicerds_namespace_is_unchanged() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            pid = stack.sleeper()
            async with await stack.client() as c:
                await c.register("w", pid=pid)
                st = await stack.status()
                w = workload(st, "w")
                assert w is not None
                assert (w["pid"], w["ns_pid"], w["pidns"]) == (pid, None, None)
            assert stack.overlaps() == 0
