"""Pod mode in a pod: slicerd as the job pod's native sidecar, the job's containers beside it.

A pod is `stubs.pods` (a PID and a mount namespace; Kubernetes cannot run here). The pod
is what deploy/kubernetes/pod/ makes of one job: slicerd started first as a sidecar
(``sidecar=True``: stopped last), its socket on the pod's emptyDir (only the pod sees
it), and as regular containers the vLLM stub under the real ``slicer-launch``, the real
``slicer-dispatch`` and the trainer stub, all on the pod's one fake GPU. The fake GPU
reports host pids, as NVML does, which slicerd (in the pod's namespace) cannot read: its
census must go by elimination (README "PID namespaces"). We (outside) reach the socket
through the pod's mount namespace (`stubs.stack.Stack.reach`). Container restarts are
Kubernetes': a container's processes die with it (`stubs.pods`), so a restarted launcher
boots a new replica, while a restarted slicerd sidecar adopts the parked one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from demo.client import Outcome, check, sample_revisions
from stubs.pods import Pod, running_pod
from stubs.proc import log_tail
from stubs.stack import GiB, Stack, cc_log, free_port, vllm_stub_argv, workload
from tests.harness import POD_TESTS
from tests.test_k8s_node import (
    REQUESTS,
    REVISIONS,
    TRAINER_BYTES,
    TURN,
    VLLM,
    Job,
    start_job,
)

pytestmark = POD_TESTS

FOREIGN_BYTES = 20 * GiB  # with the slept replica and the 48 GiB trainer: fits in 80 GiB


@asynccontextmanager
async def pod_stack(name: str = "job") -> AsyncIterator[tuple[Stack, Pod]]:
    """A pod with an emptyDir and slicerd started as its sidecar, on one fake GPU. On the
    way out: zero overlaps (on a clean exit), the logs' tails on a failure, every process
    ended, the directory removed. The pod lives in the stack's short temporary directory:
    ``/proc/<init>/root`` + the socket's path must fit in a socket address (108 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="slicer-pod-"))
    stack = Stack.create(base, gpus=1)
    try:
        async with running_pod(base, name, emptydir=True) as pod:
            assert pod.emptydir is not None
            stack.use_socket(pod.emptydir / "slicer.sock")
            try:
                await stack.start(pod=pod)
                yield stack, pod
                assert stack.overlaps() == 0, stack.ledger.overlap_log()
            except BaseException:
                for log in sorted(base.glob("*.log")):
                    print(f"---- {log.name} (tail) ----\n{log_tail(log, 4000)}")
                raise
            finally:
                await stack.close(daemon_signal=signal.SIGKILL)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def start_replica(stack: Stack, job: Job) -> int:
    """The job's replica under slicer-launch in its pod (booted, slept, released); its
    vLLM port. (`start_job` in two halves, for a test that acts in between.)"""
    vport = free_port()
    env = {**stack.env, "CUDA_VISIBLE_DEVICES": str(job.gpu)}
    await stack.launcher(job.sampler, vllm_stub_argv(job.sampler, vport, *VLLM),
                         args=["--gpu", str(job.gpu)], env=env, pod=job.pod)  # fmt: skip
    return vport


async def start_rest(stack: Stack, job: Job, vport: int) -> None:
    """The dispatcher in front of the replica on `vport` (listening), then the trainer."""
    dport = free_port()
    await stack.dispatcher(job.sampler, f"http://127.0.0.1:{vport}", dport,
                           state_dir=stack.base / f"dstate-{job.key}", args=TURN,
                           component=job.dispatcher, pod=job.pod)  # fmt: skip
    job.url = f"http://127.0.0.1:{dport}"
    args = ["--gpu", str(job.gpu), "--bytes", TRAINER_BYTES, "--work", "0.1"]
    args += ["--steps", str(len(REVISIONS)), "--revisions-dir", str(stack.base / job.key)]
    args += ["--publish-url", job.url, "--pause", "0.2", "--last-park", "now"]
    stack.trainer(job.trainer, args, component=job.trainer, pod=job.pod)


def holder(st: dict[str, Any]) -> str | None:
    """The name of the workload holding the pod's GPU, or None."""
    h = st["gpus"][0]["holder"]
    return None if h is None else str(h["workload"])


async def slicerctl_status(stack: Stack, pod: Pod) -> dict[str, Any]:
    """``slicerctl status --json`` run as a short container of `pod` (``kubectl exec``)."""
    log = pod.dir / "slicerctl.log"
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "gpu_slicer.slicer.cli", "--socket", stack.socket]
    c = await pod.start_container("slicerctl", [*argv, "status", "--json"], stack.env, log)
    assert await c.wait() == 0, log.read_text()
    out: dict[str, Any] = json.loads(log.read_text())
    return out


async def finish_job(stack: Stack, job: Job) -> None:
    """Every request of every revision served with it; the trainer exits 0, the
    dispatcher and the launcher stop cleanly."""
    report = await sample_revisions(job.url, REVISIONS, REQUESTS, 60)
    assert report.problems(len(REVISIONS) * REQUESTS) == []
    assert report.served() == len(REVISIONS) * REQUESTS
    assert await stack.containers[job.trainer].wait() == 0
    assert await stack.stop_component(job.dispatcher) == 0
    assert await stack.stop_component(job.sampler) == 0


async def test_pod_mode_runs_the_whole_loop_by_elimination_with_no_overlap() -> None:
    with trio.fail_after(180):
        async with pod_stack() as (stack, pod):
            job = Job("p", pod, 0)
            await start_job(stack, job)
            st = await stack.until(lambda st: workload(st, job.trainer) is not None)
            assert st["census"] == "elimination", st
            # slicerd shares the pod's namespace: the pods' own numbers, nothing to translate.
            trainer = await stack.containers[job.trainer].started()
            launcher = await stack.containers[job.sampler].started()
            for name, c in ((job.trainer, trainer), (job.sampler, launcher)):
                w = workload(st, name)
                assert w is not None, st["workloads"]
                assert (w["pid"], w["ns_pid"], w["pidns"]) == (c.ns_pid, None, None), w
                assert w["pid"] != c.host_pid
            # The same from inside the pod, as `kubectl exec -c slicerd` would read it.
            inside = await slicerctl_status(stack, pod)
            assert inside["census"] == "elimination"
            pids = {w["name"]: w["pid"] for w in inside["workloads"]}
            assert pids[job.sampler] == launcher.ns_pid, inside["workloads"]
            await finish_job(stack, job)
            st = await stack.until(lambda st: not st["workloads"])
            assert st["totals"]["parks"] >= len(REVISIONS), st["totals"]
            # The trainer was checkpointed (the tool is handed the pod's pids).
            parked = [e for e in cc_log(stack) if e["op"] == "checkpoint" and e["rc"] == 0]
            assert parked, cc_log(stack)
            assert stack.overlaps() == 0, stack.ledger.overlap_log()


def unattributed(st: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod GPU's foreign entries slicerd could not attribute."""
    return [f for f in st["gpus"][0]["foreign"] if f.get("reason") == "unattributed"]


async def test_memory_taken_from_outside_the_pod_blocks_grants_until_freed() -> None:
    with trio.fail_after(180):
        async with pod_stack() as (stack, pod):
            job = Job("p", pod, 0)
            vport = await start_replica(stack, job)
            # Booting the replica ends with it parked (slept, verified) and nobody else is
            # registered: nobody on the GPU may hold more than their budget now, so the
            # memory a host process takes is nobody's.
            assert workload(await stack.status(), job.sampler)["state"] == "parked"
            sleeper = stack.sleeper()  # a process of the host: not the pod's
            stack.ledger.alloc(sleeper, 0, FOREIGN_BYTES, tag="weights", workload="foreign")
            await start_rest(stack, job, vport)
            # The trainer's first ACQUIRE waits: the excess blocks every grant.
            st = await stack.until(
                lambda st: job.trainer in st["gpus"][0]["queue"] and bool(unattributed(st))
            )
            # Charged: what the GPU holds beyond the workloads' budgets, with the host's
            # pids as the backend reported them (the sleeper's among them).
            (entry,) = unattributed(st)
            used = sum(p.on_device for p in stack.ledger.processes(0))
            budgets = sum(w["parked_max"] for w in st["workloads"])
            assert entry["bytes"] == used - budgets > FOREIGN_BYTES - budgets, (entry, used)
            assert str(sleeper) in str(entry["host_pids"]).split(","), entry
            assert holder(st) is None and workload(st, job.trainer)["state"] == "registered"
            assert stack.ledger.processes(0) and not [
                p for p in stack.ledger.processes(0) if p.workload == job.trainer and p.on_device
            ]
            # Freed: the grant goes ahead and the loop runs as usual.
            assert stack.ledger.free(sleeper) == FOREIGN_BYTES
            st = await stack.until(lambda st: not unattributed(st) and holder(st) is not None)
            await finish_job(stack, job)
            assert stack.overlaps() == 0, stack.ledger.overlap_log()


async def start_replica_again(stack: Stack, job: Job, vport: int) -> None:
    """The launcher container started again exactly as `start_replica` started it."""
    env = {**stack.env, "CUDA_VISIBLE_DEVICES": str(job.gpu)}
    await stack.launcher(job.sampler, vllm_stub_argv(job.sampler, vport, *VLLM),
                         args=["--gpu", str(job.gpu)], env=env, pod=job.pod)  # fmt: skip


def replica_memory(stack: Stack, job: Job) -> list[int]:
    """Host pids of the replica's processes holding memory on the pod's GPU (the fake
    driver's view: a dead process holds nothing)."""
    return sorted(p.pid for p in stack.ledger.processes(0) if p.workload == job.sampler)


async def submit(url: str, revisions: list[str], n: int) -> list[Outcome]:
    """`n` samples per revision accepted by the dispatcher (202, pending), not waited for."""
    out = [Outcome(rev, i) for rev in revisions for i in range(n)]
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for o in out:
            body = {"prompt": f"{o.revision} question {o.index}", "max_tokens": 8}
            r = await http.post("/v1/samples", json={**body, "revision": o.revision})
            assert r.status_code == 202, r.text
            o.id, o.status = str(r.json()["id"]), "pending"
    return out


async def settle(url: str, outcomes: list[Outcome]) -> None:
    """Long-poll each of `outcomes` until it is no longer pending; `demo.client.check`
    settles it (done only when served with exactly its revision)."""
    async with httpx.AsyncClient(base_url=url, timeout=40) as http:
        for o in outcomes:
            while o.status == "pending":
                r = await http.get(f"/v1/samples/{o.id}", params={"wait": 30})
                assert r.status_code == 200, r.text
                if r.json().get("status") != "pending":
                    check(o, r.json())


async def test_a_killed_launcher_container_takes_its_replica_with_it_and_restarts_cleanly() -> None:
    """Kubernetes restarts a container whose process died (OOM-killed, say); with
    ``shareProcessNamespace`` its vLLM dies with it (`stubs.pods`). The new launcher
    registers the name anew and boots a new replica in a boot turn; the dispatcher, up
    all along, serves what was asked meanwhile."""
    with trio.fail_after(240):
        async with pod_stack() as (stack, pod):
            job = Job("p", pod, 0)
            vport = await start_replica(stack, job)
            await start_rest(stack, job, vport)
            st = await stack.until(lambda st: workload(st, job.trainer) is not None)
            old = await stack.containers[job.sampler].started()
            before = workload(st, job.sampler)
            assert before is not None and before["pid"] == old.ns_pid, before
            held = replica_memory(stack, job)
            assert len(held) == 1, stack.ledger.processes(0)  # the vLLM engine core
            old.signal(signal.SIGKILL)
            assert await old.wait() == -signal.SIGKILL
            # The container's processes went with it (reaped), and their GPU memory.
            assert replica_memory(stack, job) == []
            assert not [p for p in held if Path(f"/proc/{p}").exists()], held
            # slicerd ends that registration (its parked record goes with its processes);
            # nobody else is faulted.
            st = await stack.until(lambda st: workload(st, job.sampler) is None, timeout=30)
            assert st["totals"]["faults"] == 0 and all(w["faults"] == 0 for w in st["workloads"])
            # The trainer goes on alone and publishes; requests are asked for meanwhile.
            assert await stack.containers[job.trainer].wait() == 0
            pending = await submit(job.url, REVISIONS, REQUESTS)
            # kubelet starts the container again, with the same command line.
            await start_replica_again(stack, job, vport)
            new = await stack.containers[job.sampler].started()
            st = await stack.status()
            after = workload(st, job.sampler)
            assert after is not None and after["pid"] == new.ns_pid != old.ns_pid, after
            assert (after["registrant"] or {}).get("pid") == new.ns_pid, after
            assert len(replica_memory(stack, job)) == 1
            # The dispatcher serves what waited, and what comes now, each with its revision.
            await settle(job.url, pending)
            assert [f"{o.revision} #{o.index}: {o.status} {o.detail}" for o in pending
                    if o.status != "done"] == []  # fmt: skip
            report = await sample_revisions(job.url, REVISIONS, REQUESTS, 60)
            assert report.problems(len(REVISIONS) * REQUESTS) == []
            st = await stack.status()
            assert st["totals"]["faults"] == 0, st["totals"]
            assert await stack.stop_component(job.dispatcher) == 0
            assert await stack.stop_component(job.sampler) == 0
            assert stack.overlaps() == 0, stack.ledger.overlap_log()


async def test_a_restarted_slicerd_sidecar_is_rejoined_and_adopts_the_parked_replica() -> None:
    """The sidecar's process dies (a crash, an OOM kill) while the replica is parked;
    Kubernetes restarts it in place, on the same emptyDir: the launcher reconnects and
    re-registers, and the restarted slicerd adopts the parked replica it journalled (README
    "Operations guide", "slicerd restarted"): nothing of the job is restarted."""
    with trio.fail_after(240):
        async with pod_stack() as (stack, pod):
            job = Job("p", pod, 0)
            vport = await start_replica(stack, job)
            dport = free_port()
            await stack.dispatcher(job.sampler, f"http://127.0.0.1:{vport}", dport,
                                   state_dir=stack.base / f"dstate-{job.key}", args=TURN,
                                   component=job.dispatcher, pod=job.pod)  # fmt: skip
            job.url = f"http://127.0.0.1:{dport}"
            launcher = await stack.containers[job.sampler].started()
            before = workload(await stack.status(), job.sampler)
            assert before is not None and before["state"] == "parked", before
            held = replica_memory(stack, job)
            assert len(held) == 1, stack.ledger.processes(0)
            # slicerd's container dies; kubelet starts it again with the same argv.
            assert await stack.stop(signal.SIGKILL) == -signal.SIGKILL
            await stack.start(pod=pod)
            st = await stack.until(
                lambda st: (
                    ((workload(st, job.sampler) or {}).get("registrant") or {}).get("pid")
                    == launcher.ns_pid
                ),
                timeout=30,
            )
            after = workload(st, job.sampler)
            assert after is not None
            # The same replica: the same launcher and processes, still parked and asleep.
            assert after["state"] == "parked" and after["pid"] == before["pid"], after
            assert replica_memory(stack, job) == held
            assert launcher.alive() and stack.containers[job.sampler].alive()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{vport}") as http:
                assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
            # Adopted (REGISTER answered with the journalled state), not registered anew.
            lines = stack.log_of(job.sampler).read_text().splitlines()
            registered = [line for line in lines if f"registered {job.sampler} " in line]
            assert len(registered) == 2 and "state=parked" in registered[1], registered
            # ... and the job runs on.
            args = ["--gpu", str(job.gpu), "--bytes", TRAINER_BYTES, "--work", "0.1"]
            args += ["--steps", str(len(REVISIONS)), "--revisions-dir", str(stack.base / job.key)]
            args += ["--publish-url", job.url, "--pause", "0.2", "--last-park", "now"]
            stack.trainer(job.trainer, args, component=job.trainer, pod=job.pod)
            await finish_job(stack, job)
            assert stack.overlaps() == 0, stack.ledger.overlap_log()


async def test_deleting_the_pod_mid_turn_frees_the_gpu_before_slicerd_stops() -> None:
    with trio.fail_after(180):
        async with pod_stack() as (stack, pod):
            job = Job("p", pod, 0)
            await start_job(stack, job)
            labels = {job.sampler, job.trainer}  # the fake GPU's labels of the pod's memory
            seen: dict[str, Any] = {}

            async def before_sidecars() -> None:
                # Every regular container has exited; slicerd has not been told yet.
                assert stack.daemon is not None and stack.daemon.alive()
                seen["memory"] = [p for p in stack.ledger.processes(0) if p.workload in labels]
                seen["status"] = await stack.status()

            async with trio.open_nursery() as nursery:

                async def requests() -> None:
                    # They fail once the pod goes; what matters here is the replica's turn.
                    with contextlib.suppress(Exception):
                        await sample_revisions(job.url, REVISIONS, REQUESTS, 60)

                nursery.start_soon(requests)
                # The replica holds the GPU, awake and serving, when the pod is deleted.
                await stack.until(lambda st: holder(st) == job.sampler, timeout=60)
                rcs = await pod.delete(grace=30, before_sidecars=before_sidecars)
                nursery.cancel_scope.cancel()
            # Kubernetes' order: the job's containers first, slicerd, the sidecar, last.
            assert pod.exit_order[-1] == "slicerd", pod.exit_order
            assert set(pod.exit_order) == {"slicerd", job.sampler, job.dispatcher, job.trainer}
            assert rcs["slicerd"] == 0, log_tail(stack.log_of("slicerd"))
            assert rcs[job.sampler] == 0 and rcs[job.dispatcher] == 0, rcs
            # While slicerd still ran: vLLM gone with its launcher (nothing of the pod's
            # workloads left on the device beyond a slept replica's allowance), every
            # registration ended, nothing resident or held (a parked record may wait for
            # slicerd's reaper to see its processes gone).
            allowance = stack.ledger.snapshot()["allowances"]
            assert all(p.on_device <= allowance.get(p.workload, 0) for p in seen["memory"]), seen
            st = seen["status"]
            assert all(w["state"] == "parked" and w["registrant"] is None and not w["pids"]
                       for w in st["workloads"]), st["workloads"]  # fmt: skip
            assert holder(st) is None and st["gpus"][0]["resident"] is None, st["gpus"]
            assert st["gpus"][0]["foreign"] == [], st["gpus"]
            assert stack.overlaps() == 0, stack.ledger.overlap_log()
