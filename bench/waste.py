"""Waste benchmark: the trainer's parks that buy nothing, per fault scenario.

    .venv/bin/python bench/waste.py [--seconds 30] [--scenario NAME ...] [--json]

Each scenario starts its own slicerd (fake GPU), the vLLM stub under the real launcher
(workload "v"), a trainer stub that takes a turn every 50 ms (30 GiB, checkpoint-parked)
and ``slicer-dispatch`` with one request pending, drives the dispatcher into one fault for
``--seconds`` and counts what a trainer's owner pays: the trainer's parks (slicerd's
STATUS), the turns the dispatcher was granted, and its wasted turns (``/status``'s
``counters.wasted_turns``: granted, nothing loaded or served), extrapolated to parks per
hour. Scenarios:

``dead-replica``
    ``--replica`` names a port where nothing listens (the launcher's replica is elsewhere).
``not-vllm``
    ``--replica`` names a server that answers ``GET /health`` and 404 to every dev route
    (a vLLM without ``VLLM_SERVER_DEV_MODE=1``, or another service).
``deadline-restart``
    Not parks but GPU work for nothing: ``--trials`` times a request is accepted while the
    GPU is held, the dispatcher is SIGKILLed and restarted, the request fails at its
    deadline (read by a client that polls), and the holder lets go: how many such failed
    requests were still sent to vLLM.
``load-fails``
    The replica refuses every load (``--fail-reload``: a checkpoint it cannot read): each
    turn wakes it and fails the load; the revision's own backoff spaces the tries.
``burst-idle``
    Not parks: the connections the dispatcher keeps open to its replica once a burst of 80
    (the default concurrency, 64) is served.

Run from a checkout of another commit (copy this file there) to compare before and after:
the figures it cannot read there (``wasted_turns`` of a release that had no such counter)
print as ``null``.

Measured on 2 cores (fake GPU; ``--seconds 20``, ``load-fails`` 60), 740e0c8 (before the
waste issue) and cc2100e: dead-replica 7 parks in 20 s (1260 an hour) -> 0; not-vllm 6
(1080 an hour) -> 0; load-fails (after) 3 in all, then the requests fail naming the load
error (``--max-load-failures``); deadline-restart 0 failed requests sent in 5 trials both
(the race did not show before); burst-idle 64 idle connections -> 32. A replica whose
every wake fails (tests/test_waste_backoff.py, virtual time): 723 parks an hour with no
wasted-turn backoff -> 20 (6 in the first minute, then one per 300 s).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the product and stubs importable
    sys.path.insert(0, str(ROOT))

from stubs.notvllm import not_a_vllm  # noqa: E402
from stubs.proc import free_port  # noqa: E402
from stubs.stack import Stack, running_stack, vllm_stub_argv, workload  # noqa: E402

SCENARIOS = ("dead-replica", "not-vllm", "load-fails", "deadline-restart", "burst-idle")
HOUR = 3600.0


async def _replica(stack: Stack, *stub: str) -> str:
    port = free_port()
    argv = vllm_stub_argv("v", port, "--tokens-per-s", "2000", *stub)
    await stack.launcher("v", argv, park="cooperative", timeout=60, component="launcher")
    return f"http://127.0.0.1:{port}"


async def _dispatcher(
    stack: Stack, url: str, *flags: str, component: str = "dispatcher"
) -> httpx.AsyncClient:
    port = free_port()
    args = ["--log-level", "warning", *flags]
    await stack.dispatcher("v", url, port, args=args, component=component)
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60)


async def _publish(stack: Stack, http: httpx.AsyncClient, rev: str) -> None:
    path = stack.base / "ckpt" / rev
    path.mkdir(parents=True, exist_ok=True)
    (path / "revision.txt").write_text(rev)
    r = await http.post("/v1/revisions", json={"revision": rev, "path": str(path)})
    r.raise_for_status()


async def _parks(stack: Stack) -> int:
    t = workload(await stack.status(), "trainer")
    return int(t["parks"]) if t else 0


async def _watch_parks(stack: Stack, url: str, seconds: float) -> dict[str, Any]:
    """The trainer takes turns; the dispatcher at ``url`` has one request pending for
    ``seconds``: the trainer's parks, the dispatcher's turns and wasted turns."""
    stack.trainer("trainer", ["--bytes", "30GiB", "--work", "0.05", "--steps", "1000000"])
    await stack.until(lambda st: (workload(st, "trainer") or {}).get("grants", 0) > 0, 60)
    async with await _dispatcher(stack, url) as http:
        await _publish(stack, http, "r1")
        (await http.post("/v1/samples", json={"prompt": "hi", "max_tokens": 4})).raise_for_status()
        parks0 = await _parks(stack)
        await trio.sleep(seconds)
        parks = await _parks(stack) - parks0
        st = (await http.get("/status")).json()
    c = st["counters"]
    return {
        "seconds": seconds,
        "trainer_parks": parks,
        "turns": c["turns"],
        "wasted_turns": c.get("wasted_turns"),
        "parks_per_hour": round(parks * HOUR / seconds, 1),
        "problem": (st.get("problem") or {}).get("what"),
    }


async def dead_replica(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    await _replica(stack)
    return await _watch_parks(stack, f"http://127.0.0.1:{free_port()}", args.seconds)


async def not_vllm(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    await _replica(stack)
    async with not_a_vllm() as url:
        return await _watch_parks(stack, url, args.seconds)


async def load_fails(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    url = await _replica(stack, "--fail-reload")
    return await _watch_parks(stack, url, args.seconds)


async def deadline_restart(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    url = await _replica(stack)
    holder = await stack.client()
    async with holder:
        await holder.register("holder", park="cooperative", parked_max="1GiB", tree=False)
        for trial in range(args.trials):
            turn = await holder.acquire("holder")
            flags = ("--sample-deadline", "2", "--state-dir", str(stack.base / f"d{trial}"))
            http = await _dispatcher(stack, url, *flags, component="d1")
            async with http:
                await _publish(stack, http, "r1")
                r = await http.post("/v1/samples", json={"prompt": f"late{trial}", "max_tokens": 4})
                late = r.json()["id"]
                await stack.until(lambda st: st["gpus"][0]["queue"] == ["v"], 30)
            stack.procs["d1"].send_signal(signal.SIGKILL)
            stack.procs["d1"].wait()
            http = await _dispatcher(stack, url, *flags, component="d2")
            async with http:
                while (await http.get(f"/v1/samples/{late}")).json()["status"] == "pending":
                    await trio.sleep(0.02)
                r = await http.post("/v1/samples", json={"prompt": "fresh", "max_tokens": 4})
                await holder.release(turn)
                await http.get(f"/v1/samples/{r.json()['id']}", params={"wait": 30})
            await stack.stop_component("d2")
    # One legitimate send ("fresh") per trial; every other is a failed request's.
    log = stack.log_of("launcher").read_text(errors="replace")
    sent_late = log.count("POST /v1/completions") - args.trials
    return {"trials": args.trials, "failed_requests_sent": sent_late}


async def burst_idle(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    url = await _replica(stack)
    port = httpx.URL(url).port
    async with await _dispatcher(stack, url) as http:
        await _publish(stack, http, "r1")
        body = {"requests": [{"prompt": f"b{i}", "max_tokens": 8} for i in range(80)]}
        ids = [s["id"] for s in (await http.post("/v1/samples/batch", json=body)).json()["samples"]]
        r = await http.post("/v1/samples/results", json={"ids": ids, "wait": 60})
        done = sum(1 for x in r.json()["results"] if x["status"] == "done")
        pid = stack.procs["dispatcher"].pid
        conns = sum(
            1
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
        )
    return {"burst": 80, "done": done, "idle_connections": conns}


RUNS = {
    "dead-replica": dead_replica,
    "not-vllm": not_vllm,
    "load-fails": load_fails,
    "deadline-restart": deadline_restart,
    "burst-idle": burst_idle,
}


async def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in args.scenario or SCENARIOS:
        t0 = time.monotonic()
        async with running_stack(gpus=1, tmp_prefix="waste-bench-") as stack:
            out[name] = await RUNS[name](stack, args)
        out[name]["wall_s"] = round(time.monotonic() - t0, 1)
        if not args.json:
            print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="watched per parks scenario")
    p.add_argument("--trials", type=int, default=5, help="deadline-restart trials")
    p.add_argument("--scenario", action="append", choices=SCENARIOS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = trio.run(run, args)
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
