"""Node mode in pods: slicerd outside (the DaemonSet, hostPID), each job in a pod of its own.

A pod is `stubs.pods` (a PID and a mount namespace; Kubernetes cannot run here). Each job
is what deploy/kubernetes/ puts in a job's pods: the vLLM stub under the real
``slicer-launch``, the real ``slicer-dispatch`` in front of it and the trainer stub, all
containers of the job's pod, talking to slicerd through its socket on a host path. Pod A
runs job "a" on fake GPU 0, pod B job "b" on GPU 1, at the same time. They register pids
as their pod sees them; slicerd (in the host's namespace) must track the right processes,
show both numbers in STATUS, and never let a pod name another pod's process.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from demo.client import sample_revisions
from stubs.pods import Container, Pod, running_pod
from stubs.proc import log_tail
from stubs.stack import Stack, cc_log, free_port, running_stack, vllm_stub_argv, workload
from tests.harness import POD_TESTS

pytestmark = POD_TESTS

REVISIONS = ["rev-1", "rev-2"]
REQUESTS = 10  # per revision
# A trainer of 48 GiB and an awake vLLM of 44 GiB never fit on one 80 GiB GPU together:
# every handoff parks the other side (the demo's sizes).
TRAINER_BYTES = "48GiB"
VLLM = ("--weights-bytes", "36GiB", "--gpu-memory-utilization", "0.55")
VLLM += ("--tokens-per-s", "20000", "--reload-seconds", "0.05")
TURN = ("--turn-seconds", "0.5", "--turn-grace", "2", "--concurrency", "16")


@dataclass
class Job:
    """One job's components, all containers of `pod`, on `gpu`."""

    key: str
    pod: Pod
    gpu: int
    url: str = ""

    @property
    def sampler(self) -> str:
        """The replica's workload (and its launcher's component) name."""
        return f"sampler-{self.key}"

    @property
    def trainer(self) -> str:
        """The trainer's workload and component name."""
        return f"trainer-{self.key}"

    @property
    def dispatcher(self) -> str:
        """The dispatcher's component name."""
        return f"dispatcher-{self.key}"


async def start_job(stack: Stack, job: Job) -> None:
    """The replica (booted, slept, released), its dispatcher (listening), then the
    trainer, each in the job's pod."""
    vport, dport = free_port(), free_port()
    env = {**stack.env, "CUDA_VISIBLE_DEVICES": str(job.gpu)}  # the vLLM stub's GPU
    await stack.launcher(
        job.sampler,
        vllm_stub_argv(job.sampler, vport, *VLLM),
        args=["--gpu", str(job.gpu)],
        env=env,
        pod=job.pod,
    )
    await stack.dispatcher(
        job.sampler,
        f"http://127.0.0.1:{vport}",
        dport,
        state_dir=stack.base / f"dstate-{job.key}",
        args=TURN,
        component=job.dispatcher,
        pod=job.pod,
    )
    job.url = f"http://127.0.0.1:{dport}"
    args = ["--gpu", str(job.gpu), "--bytes", TRAINER_BYTES, "--work", "0.1"]
    args += ["--steps", str(len(REVISIONS)), "--revisions-dir", str(stack.base / job.key)]
    args += ["--publish-url", job.url, "--pause", "0.2", "--last-park", "now"]
    stack.trainer(job.trainer, args, component=job.trainer, pod=job.pod)


def assert_both_numbers(st: dict[str, Any], name: str, pod: Pod, c: Container | None) -> None:
    """Workload `name` lives in `pod`: STATUS names its host pid and its pod pid (those of
    container `c` when it registered itself)."""
    w = workload(st, name)
    assert w is not None, st["workloads"]
    assert w["pidns"] == pod.pidns, w
    if c is not None:
        assert (w["pid"], w["ns_pid"]) == (c.host_pid, c.ns_pid), w
    else:
        status = Path(f"/proc/{w['pid']}/status").read_text()
        assert f"NSpid:\t{w['pid']}\t{w['ns_pid']}\n" in status, (w, status)


async def run_job(stack: Stack, job: Job) -> None:
    """The whole loop of one job: every request of every revision served with it, the
    trainer exits 0, the dispatcher and the launcher stop cleanly. On a failure the job's
    logs' tails are printed."""
    try:
        await _run_job(stack, job)
    except BaseException:
        for name in (job.sampler, job.dispatcher, job.trainer):
            print(f"---- {name} log (tail) ----\n{log_tail(stack.log_of(name), 3000)}")
        raise


async def _run_job(stack: Stack, job: Job) -> None:
    await start_job(stack, job)
    st = await stack.until(lambda st: workload(st, job.trainer) is not None)
    await stack.containers[job.trainer].started()
    assert_both_numbers(st, job.trainer, job.pod, stack.containers[job.trainer])
    assert_both_numbers(st, job.sampler, job.pod, None)  # the launcher's vLLM child
    sampler = workload(st, job.sampler)
    assert sampler is not None and sampler["gpu"] == job.gpu
    report = await sample_revisions(job.url, REVISIONS, REQUESTS, 60)
    assert report.problems(len(REVISIONS) * REQUESTS) == []
    assert report.served() == len(REVISIONS) * REQUESTS
    assert await stack.containers[job.trainer].wait() == 0
    assert await stack.stop_component(job.dispatcher) == 0
    assert await stack.stop_component(job.sampler) == 0


async def test_two_pods_each_run_the_whole_loop_on_their_gpu_with_no_overlap(
    tmp_path: Path,
) -> None:
    with trio.fail_after(180):
        async with (
            running_stack(gpus=2) as stack,
            running_pod(tmp_path, "a") as pod_a,
            running_pod(tmp_path, "b") as pod_b,
        ):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_job, stack, Job("a", pod_a, 0))
                nursery.start_soon(run_job, stack, Job("b", pod_b, 1))
            await stack.until(lambda st: not st["workloads"])  # each left with its pod
            assert stack.overlaps() == 0, stack.ledger.overlap_log()
            # Each GPU had its handoffs: slicerd (outside) checkpointed both trainers by
            # their host pids, which the pods never sent.
            trainers = {stack.containers[f"trainer-{k}"].host_pid for k in "ab"}
            parked = {e["pid"] for e in cc_log(stack) if e["op"] == "checkpoint" and e["rc"] == 0}
            assert trainers <= parked, cc_log(stack)


# Sends REGISTER lines (argv[2:], with SELF replaced by its own pod pid) to slicerd at
# argv[1], then STATUS, and prints one JSON object: its pid and every reply.
PROBE = textwrap.dedent(
    """
    import json, os, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    f = s.makefile("rwb", buffering=0)
    def ask(line):
        f.write(line.encode() + b"\\n")
        return f.readline().decode().strip()
    out = {"pid": os.getpid(), "hello": ask("HELLO proto=1"), "replies": []}
    for line in sys.argv[2:]:
        out["replies"].append(ask(line))
    reply = ask("STATUS")
    out["status"] = json.loads(reply[3:]) if reply.startswith("OK ") else reply
    print(json.dumps(out), flush=True)
    """
)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


async def probe(stack: Stack, pod: Pod, *lines: str) -> tuple[Container, dict[str, Any]]:
    """Run PROBE in `pod` to its end; the container and what it printed."""
    log = pod.dir / "probe.log"
    c = await pod.start_container("probe", [sys.executable, "-c", PROBE, stack.socket, *lines],
                                  pod.env(stack.env), log)  # fmt: skip
    assert await c.wait() == 0, log.read_text()
    out: dict[str, Any] = json.loads(log.read_text().splitlines()[-1])
    return c, out


async def test_a_pod_naming_another_pods_process_never_registers_it(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            running_stack(gpus=2) as stack,
            running_pod(tmp_path, "a") as pod_a,
            running_pod(tmp_path, "b") as pod_b,
        ):
            b = await pod_b.start_container("b", SLEEPER, pod_b.env(stack.env))
            # Pod A's processes: its first containers get the same small numbers as pod
            # B's, so pod B's pod pid also names a process of pod A.
            mine = [await pod_a.start_container(f"a{k}", SLEEPER) for k in range(3)]
            lines = [f"REGISTER by-host pid={b.host_pid}", f"REGISTER by-ns pid={b.ns_pid}"]
            c, out = await probe(stack, pod_a, *lines, "REGISTER by-self pid=self")
            by_host, by_ns, by_self = out["replies"]
            st = out["status"]
            assert isinstance(st, dict), st
            # Nothing registered names pod B's process, by either of its numbers.
            assert all(w["pid"] != b.host_pid for w in st["workloads"]), st["workloads"]
            assert all(w["pidns"] == pod_a.pidns for w in st["workloads"]), st["workloads"]
            # Its host pid means nothing in pod A: refused, precisely.
            assert by_host.startswith("ERR "), by_host
            assert workload(st, "by-host") is None
            # Its pod-B number, read in pod A's namespace, is pod A's process of that number.
            same = [m for m in mine if m.ns_pid == b.ns_pid]
            if same:
                assert by_ns.startswith("OK "), by_ns
                assert_both_numbers(st, "by-ns", pod_a, same[0])
            else:
                assert by_ns.startswith("ERR "), by_ns
            # pid=self: the probe itself, by both numbers.
            assert by_self.startswith("OK "), by_self
            assert out["pid"] == c.ns_pid
            assert_both_numbers(st, "by-self", pod_a, c)
            # The registrations went with the probe's connection; pod B's process is alive.
            st = await stack.until(lambda st: not st["workloads"])
            assert b.alive() and os.path.exists(f"/proc/{b.host_pid}")
