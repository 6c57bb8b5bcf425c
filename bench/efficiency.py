"""Share efficiency: the whole train / publish / sample loop against the physical bound.

    .venv/bin/python bench/efficiency.py [--config bench/scenarios.toml] [--quick]
        [--json FILE] [--markdown BENCHMARKS.md] [--png bench/efficiency.png]

Method
------
Every scenario runs the real processes on a fake GPU (one ledger of the configured
capacity): slicerd (READY=1 awaited), the vLLM stub under ``slicer-launch vllm``
(cooperative park: the dispatcher sleeps it at every turn's end), ``slicer-dispatch``,
the trainer stub (``park=checkpoint``: slicerd moves its working set with the
cuda-checkpoint stub, which sleeps bytes / ``FAKEGPU_BANDWIDTH``) publishing one revision
per step, and a client in this process that sends each revision's requests.

Settings. The main tables run the project's best settings: slicerd ``--parker driver``
(one long-lived helper on the driver's checkpoint API, here the fake ``libcuda.so.1``
that ``stubs.fakecuda.build`` compiles with gcc) and ``slicer-dispatch --sleep-level
auto``. The Levers table runs each lever on and off in the same run: ``--parker cli``
(the cuda-checkpoint stub, launched twice per park and twice per restore), and
``--sleep-level 1`` / ``2``.

Time scaling. Each model has a ``time_scale`` k: the fake link runs at k x the real link
and every configured duration (trainer step, pause, generation pace, weight load, turn
length, driver initialisation) is divided by k, so every *modelled* part of the run
(bytes moved, compute, load, ``cuInit``) is k times shorter. Real-equivalent figures
multiply those parts by k; the parts that are fixed costs of processes and sockets (our
orchestration overhead, the HTTP round trips of wake and sleep, starting the Python
cuda-checkpoint stub, the driver helper's round trips) are not multiplied: they are
reported as measured.

Driver initialisation. A real ``cuda-checkpoint`` launch spends about 2.7 s in
``cuInit`` before it acts (NVIDIA/cuda-checkpoint issue 29; ai-dynamo/dynamo PR 7773).
``cuinit_s`` (scenarios.toml, real seconds) is modelled like the other real-hardware
costs: both fakes get ``FAKEGPU_CUINIT_S`` = cuinit_s / k; the CLI stub pays it at every
launch, the fake library once per process (the helper, at daemon start); the
real-equivalent switch counts what a switch paid x k (column ``cuinit``).

Sources. slicerd's WATCH events (CLOCK_MONOTONIC, microseconds): queued, parking,
parked (park_ms, bytes), restoring, restored (restore_ms), granted, released. The
dispatcher's event stream (``GET /v1/events``: granted, woke (with its ``tags``),
load_end, serving, slept (with its ``level``), with their durations, on CLOCK_MONOTONIC
like WATCH). The log of both checkpoint fakes (``FAKEGPU_CC_LOG``: per call ``via``
(``cli`` or ``lib``), the operation's own ``duration``, and ``cuinit_s`` / ``cuinit_at``,
when the calling process paid its driver initialisation), so park_ms splits into the
transfer, the ``cuInit`` paid inside it, and the rest (``tool_start``: the CLI stub's
process start, or the helper's round trips).

A switch is the time from the moment the GPU could change hands (the later of "the
outgoing workload stopped useful work" and "the incoming one asked") to the moment
the incoming one does useful work again (the trainer: its grant; the sampler: its first
send after wake and load). Its parts: park, restore, wake, weight load, sleep (each as
measured by whoever performs it), cuinit, tool start; what is left is the project's own
orchestration overhead (slicerd's queueing, verify and grant, socket hops, the
dispatcher's turn loop).

Sleep levels. The vLLM stub's sleep and wake move no bytes. A level-1 sleep of real vLLM
copies its weights to pinned host memory and its wake copies them back: the
real-equivalent switch adds weights / link to each. A level-2 sleep drops the weights and
its wake (``wake_up?tags=weights``, load, ``wake_up?tags=kv_cache``,
``reset_prefix_cache``) copies nothing but the load, which happens at every step anyway:
nothing is added.

Early starts. The main tables run ``slicer-dispatch --early-start`` with the weights'
bytes: when slicerd parks the trainer for the sampler it locks it first and, where the
weights fit beside it, says EARLY; the dispatcher wakes the weights and loads the new
revision while the trainer's working set is checkpointed, and wakes the KV cache once
granted. The dispatcher's events mark that stage (``early``, then ``woke`` and
``load_end`` with ``early: true``, before its ``granted``). A T>S switch with an early
start has two branches from EARLY on, each real-equivalent on its own (the park, to the
grant; the wake and load): what follows starts at the later of the two, and the column
``hidden`` says how much of the wake and load ran beside the park. The fake link moves
each direction on its own, as PCIe does (full duplex).

Bound. The bytes that must cross the host link, / link: trainer to sampler, the trainer's
working set out and the new weights in (once); sampler to trainer, the trainer's working
set back (the sampler's weights need not move: they are replaced at the next wake). On a
full-duplex link the two directions overlap where the weights fit beside the trainer
(an early start): the *floor* of such a T>S switch is the larger of the two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make slicer/stubs importable
    sys.path.insert(0, str(ROOT))

from bench import hotpath  # noqa: E402
from demo.proc import (  # noqa: E402
    DemoError,
    Procs,
    Recording,
    check_alive,
    child_env,
    end_all,
    reap,
    spawn,
    start_daemon,
    stop,
    watch,
)
from gpu_slicer.dispatcher.events import follow_events  # noqa: E402
from gpu_slicer.slicer.client import AsyncSlicer  # noqa: E402
from stubs import fakecuda  # noqa: E402
from stubs.fakegpu import Ledger  # noqa: E402
from stubs.measure import percentile  # noqa: E402
from stubs.proc import free_port  # noqa: E402
from stubs.stack import FAKE_BACKEND  # noqa: E402

GIB = 1 << 30
TARGET_OVERHEAD_MS = 5.0
TARGET_OVERHEAD_FRAC = 0.01
LEVERS = ("parker", "level", "earlystart", "lazy", "sleep", "early", "batch")  # --levers
PARTS = ("park", "restore", "wake", "load", "sleep", "cuinit", "tool_start", "overhead")

POOL_COMMAND = ".venv/bin/python bench/pool.py"  # what `make bench` runs (its report)
FIT_COMMAND = ".venv/bin/python bench/fit.py"  # likewise
NO_GPU_CHECK = (
    "not run: this run had no GPU. On a machine with one, `bench/gpu_check.sh` writes"
    " `gpu_check.md` (into `$OUT`, else the current directory); copied to"
    " `bench/gpu_check.md`, `make bench` includes it here."
)
# The first section of BENCHMARKS.md: what a reader should take from it (a file of its own,
# so tests/test_benchmarks_doc.py reads the same text without importing the bench).
HOW_TO_READ = (Path(__file__).resolve().parent / "how_to_read.md").read_text()


# ---- configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One model at one link bandwidth (all times real seconds, sizes bytes)."""

    model: str
    params_b: float
    link_gbps: float
    capacity: int
    weights: int
    context: int
    trainer: int
    trainer_capped: bool
    trainer_fft: int
    util: float
    step_s: float
    batch_s: float
    pause_s: float
    load_s: float
    k: float
    revisions: int
    requests: int
    max_tokens: int
    turn_seconds: float
    cuinit_s: float  # driver initialisation per process (real seconds; cuda-checkpoint launch)

    @property
    def name(self) -> str:
        return f"{self.model} @ {self.link_gbps:g} GB/s"

    @property
    def link(self) -> float:
        """Real host-link bandwidth, bytes/s."""
        return self.link_gbps * 1e9

    @property
    def kv(self) -> int:
        return int(self.util * self.capacity) - self.weights - self.context


def load_scenarios(path: Path) -> tuple[list[Scenario], dict[str, Any]]:
    """The model x link scenarios of `path`, and its [levers] table."""
    cfg = tomllib.loads(path.read_text())
    d = cfg["defaults"]
    out: list[Scenario] = []
    for m in cfg["model"]:

        def get(key: str, m: dict[str, Any] = m) -> Any:
            return m.get(key, d.get(key))

        capacity = int(float(get("gpu_capacity_gib")) * GIB)
        params = float(get("params_b")) * 1e9
        weights = int(params * float(get("weight_bytes_per_param")))
        fft = int(params * float(get("trainer_bytes_per_param")))
        cap = int(float(get("trainer_cap_fraction")) * capacity)
        for link in get("links_gbps"):
            out.append(
                Scenario(
                    model=str(m["name"]),
                    params_b=float(get("params_b")),
                    link_gbps=float(link),
                    capacity=capacity,
                    weights=weights,
                    context=int(float(get("context_gib")) * GIB),
                    trainer=min(fft, cap),
                    trainer_capped=fft > cap,
                    trainer_fft=fft,
                    util=float(get("gpu_memory_utilization")),
                    step_s=float(get("trainer_step_s")),
                    batch_s=float(get("sample_batch_s")),
                    pause_s=float(get("trainer_pause_s")),
                    load_s=weights / (float(get("load_gbps")) * 1e9),
                    k=float(get("time_scale")),
                    revisions=int(get("revisions")),
                    requests=int(get("requests")),
                    max_tokens=int(get("max_tokens")),
                    turn_seconds=float(get("turn_seconds")),
                    cuinit_s=float(get("cuinit_s") or 0.0),
                )
            )
    return out, dict(cfg.get("levers", {}))


# ---- statistics ----------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": med(values), "p99": percentile(values, 99)}


# ---- records of one run --------------------------------------------------------------


@dataclass
class Run:
    """Everything one loop run saw (monotonic seconds)."""

    events: list[dict[str, Any]]
    devents: list[dict[str, Any]]  # the dispatcher's GET /v1/events (t: monotonic)
    cc: list[CcCall]  # FAKEGPU_CC_LOG: the checkpoint calls (CLI stub or fake libcuda)
    t_start: float
    t_end: float
    trainer_rc: int
    served: int
    expected: int
    done_at: list[float]  # monotonic: when each request's result reached the client
    parker: str = ""  # STATUS "parker" (cli or driver)
    sleep_level: str = ""  # slicer-dispatch --sleep-level ("" when the flag is absent)
    totals: dict[str, Any] = field(default_factory=dict)  # STATUS "totals" at the end
    overlaps: int = 0  # the fake GPU ledger's overlap count once slicerd stopped


def mono_offset() -> float:
    """time.time() - time.monotonic(), sampled tightly."""
    best = math.inf
    off = 0.0
    for _ in range(5):
        a = time.monotonic()
        w = time.time()
        b = time.monotonic()
        if b - a < best:
            best, off = b - a, w - (a + b) / 2
    return off


@dataclass(frozen=True)
class CcCall:
    """One successful checkpoint call of the log (monotonic seconds)."""

    end: float
    duration: float  # the operation alone (no process start, no cuInit)
    op: str
    via: str  # "cli" (one cuda-checkpoint process per call) or "lib" (the driver helper)
    caller: int  # the pid that paid cuInit
    cuinit_at: float  # when that process finished cuInit (CLOCK_MONOTONIC)
    cuinit_s: float


def read_cc_log(path: Path, offset: float) -> list[CcCall]:
    """The successful lock/checkpoint/restore/unlock calls of ``FAKEGPU_CC_LOG``
    (``offset``: time.time() - time.monotonic(), for the wall-clock ``time`` field)."""
    out: list[CcCall] = []
    if path.exists():
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e.get("rc") == 0 and e.get("op") in ("lock", "checkpoint", "restore", "unlock"):
                out.append(CcCall(
                    end=float(e["time"]) - offset,
                    duration=float(e["duration"]),
                    op=str(e["op"]),
                    via=str(e.get("via") or "cli"),
                    caller=int(e.get("caller") or 0),
                    cuinit_at=float(e.get("cuinit_at") or math.nan),
                    cuinit_s=float(e.get("cuinit_s") or 0.0),
                ))  # fmt: skip
    return out


# ---- the processes -------------------------------------------------------------------


async def _until(what: str, cond: Callable[[], bool], timeout: float, procs: Procs,
                 base: Path) -> None:  # fmt: skip
    with trio.move_on_after(timeout):
        while not cond():
            check_alive(procs, base)
            await trio.sleep(0.02)
        return
    raise DemoError(f"{what} did not happen within {timeout:.0f} s")


def _has_line(log: Path, text: str) -> Callable[[], bool]:
    return lambda: log.exists() and text in log.read_text(errors="replace")


@contextlib.contextmanager
def workdir() -> Iterator[tuple[Path, Procs]]:
    base = Path(tempfile.mkdtemp(prefix="slicer-eff-"))
    procs = Procs()
    try:
        yield base, procs
    finally:
        end_all(procs)
        shutil.rmtree(base, ignore_errors=True)


def _env(base: Path, s: Scenario) -> dict[str, str]:
    (base / "gpu").mkdir()
    Ledger.init(base / "gpu", 1, s.capacity)
    # cuInit is a modelled real-hardware cost: scaled by k like the link.
    cuinit = f"{s.cuinit_s / s.k:.6f}"
    return {**child_env(base, str(int(s.link * s.k))), "FAKEGPU_CUINIT_S": cuinit}


# The fake libcuda.so.1 that slicerd's driver parker loads (built once per bench run).
_FAKECUDA: list[Path] = []
DISPATCHER_FLAGS: set[str] = set()  # filled by run_all (slicer-dispatch --help)


def daemon_args(parker: str) -> list[str]:
    """slicerd's backend and parker options on the fake GPU: ``cli`` (the cuda-checkpoint
    stub) or ``driver`` (the helper on the fake libcuda, built with gcc on first use)."""
    if parker == "cli":
        return [*FAKE_BACKEND, "--parker", "cli"]
    if not _FAKECUDA:
        _FAKECUDA.append(fakecuda.build(Path(tempfile.gettempdir()) / "slicer-bench-fakecuda"))
    return [*FAKE_BACKEND, "--parker", "driver", "--libcuda", str(_FAKECUDA[0])]


def dispatcher_options() -> set[str]:
    """The long options ``slicer-dispatch --help`` lists (what this checkout supports)."""
    out = subprocess.run([sys.executable, "-m", "gpu_slicer.dispatcher.main", "--help"],
                         capture_output=True, text=True, timeout=60, env=child_env(ROOT, "1"),
                         check=False).stdout  # fmt: skip
    return {w.strip(",[]") for w in out.split() if w.startswith("--")}


async def _launch_vllm(base: Path, env: dict[str, str], procs: Procs, sock: str, s: Scenario,
                       name: str, park: str) -> int:  # fmt: skip
    """The vLLM stub under slicer-launch (boot turn, sleep, ready marker); its port."""
    port = free_port()
    ready = base / f"{name}.ready"
    tps = s.max_tokens * s.k / s.batch_s  # a request of max_tokens takes batch_s real
    argv = [
        sys.executable,
        "-m",
        "gpu_slicer.launcher.main",
        "vllm",
        "--workload",
        name,
        "--park",
        park,
    ]
    argv += ["--socket", sock, "--ready-file", str(ready), "--boot-timeout", "60"]
    argv += ["--health-timeout", "60", "--", sys.executable, "-m", "stubs.vllm_stub", "serve"]
    argv += ["m", "--port", str(port), "--fake-workload", name]
    argv += ["--weights-bytes", str(s.weights), "--context-bytes", str(s.context)]
    argv += ["--gpu-memory-utilization", str(s.util), "--tokens-per-s", f"{tps:.3f}"]
    argv += ["--reload-seconds", f"{s.load_s / s.k:.6f}"]
    procs.children[name] = spawn(argv, env, base / f"{name}.log")
    await _until(f"{name}'s boot", ready.exists, 70, procs, base)
    return port


async def _client(url: str, revisions: list[str], s: Scenario, mode: str, gap_s: float,
                  deadline: float) -> tuple[list[float], int]:  # fmt: skip
    """Send each revision's requests as it appears: `batch` all at once, `sequential` one
    after the other's result, `trickle` one every `gap_s` (scaled). (when each request
    was served, expected)."""
    body = {"prompt": "q", "max_tokens": s.max_tokens}
    served: list[float] = []
    limits = httpx.Limits(max_connections=64, keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def one(rev: str, i: int) -> None:
            r = await http.post("/v1/samples", json={**body, "prompt": f"{rev} {i}",
                                                     "revision": rev})  # fmt: skip
            if r.status_code != 202:
                raise DemoError(f"POST /v1/samples: HTTP {r.status_code} {r.text[:200]}")
            sid = r.json()["id"]
            while True:
                got = (await http.get(f"/v1/samples/{sid}", params={"wait": 10})).json()
                if got.get("status") != "pending":
                    if got.get("status") == "done":
                        served.append(time.monotonic())
                    return

        chain = trio.Lock()  # sequential: one request at a time, revisions in order

        async def revision(rev: str) -> None:
            if mode == "sequential":
                async with chain:
                    for i in range(s.requests):
                        await one(rev, i)
                return
            async with trio.open_nursery() as n:
                for i in range(s.requests):
                    n.start_soon(one, rev, i)
                    if mode == "trickle":
                        await trio.sleep(gap_s / s.k)

        with trio.fail_after(deadline):
            async with trio.open_nursery() as nursery:
                todo = list(revisions)
                while todo:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        names = {x["revision"] for x in (await http.get("/v1/revisions")).json()
                                 ["revisions"]}  # fmt: skip
                        for rev in [x for x in todo if x in names]:
                            todo.remove(rev)
                            nursery.start_soon(revision, rev)
                    await trio.sleep(0.01)
    return served, s.requests * len(revisions)


async def run_loop(s: Scenario, *, turn_seconds: float | None = None, mode: str = "batch",
                   gap_s: float = 0.0, parker: str = "driver", sleep_level: str = "auto",
                   early: bool = True, daemon_flags: Sequence[str] = (),
                   dispatcher_flags: Sequence[str] = ()) -> Run:  # fmt: skip
    """One full loop (module docstring) of scenario `s`; its raw records. ``parker``:
    slicerd's ``--parker``; ``sleep_level``: the dispatcher's ``--sleep-level`` (left out,
    and recorded as "", when it is "" or this checkout's dispatcher has no such flag);
    ``early``: the dispatcher's ``--early-start`` asks for the weights' bytes (else off;
    left out where the flag is absent); ``daemon_flags`` / ``dispatcher_flags``: more
    options for slicerd / slicer-dispatch (bench/fit.py's fit-aware turns)."""
    ts = s.turn_seconds if turn_seconds is None else turn_seconds
    if "--sleep-level" not in DISPATCHER_FLAGS:
        sleep_level = ""
    with workdir() as (base, procs):
        env = _env(base, s)
        rec = Recording()
        sock = await start_daemon(base, env, procs, [*daemon_args(parker), *daemon_flags])
        async with await AsyncSlicer.connect(sock) as c:
            parker_seen = str((await c.status()).get("parker", "cli"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, sock, rec, trio.Event())
            await trio.sleep(0.05)
            vport = await _launch_vllm(base, env, procs, sock, s, "sampler", "cooperative")
            dport = free_port()
            dlog = base / "dispatcher.log"
            argv = [sys.executable, "-m", "gpu_slicer.dispatcher.main", "--workload", "sampler"]
            argv += ["--replica", f"http://127.0.0.1:{vport}", "--listen", f"127.0.0.1:{dport}"]
            argv += ["--socket", sock, "--state-dir", str(base / "dispatch")]
            argv += ["--turn-seconds", f"{ts / s.k:.6f}", "--turn-grace", f"{s.batch_s / s.k:.6f}"]
            argv += ["--concurrency", "64", "--log-level", "info"]
            if sleep_level:
                argv += ["--sleep-level", sleep_level]
            if "--early-start" in DISPATCHER_FLAGS:  # the revisions' files hold no weights
                argv += ["--early-start", str(s.weights) if early else "off"]
            argv += dispatcher_flags
            procs.children["dispatcher"] = spawn(argv, env, dlog)
            await _until("the dispatcher", _has_line(dlog, "listening on"), 30, procs, base)
            url = f"http://127.0.0.1:{dport}"
            devents: list[dict[str, Any]] = []
            await nursery.start(follow_events, url, devents.append)
            t_start = time.monotonic()
            argv = [sys.executable, "-m", "stubs.trainer_stub", "--socket", sock]
            argv += ["--workload", "trainer", "--bytes", str(s.trainer)]
            argv += ["--work", f"{s.step_s / s.k:.6f}", "--steps", str(s.revisions)]
            argv += ["--revisions-dir", str(base / "ckpt"), "--publish-url", url]
            argv += ["--pause", f"{s.pause_s / s.k:.6f}", "--last-park", "now"]
            procs.children["trainer"] = spawn(argv, env, base / "trainer.log")
            revs = [f"rev-{i}" for i in range(1, s.revisions + 1)]
            per_rev = (s.step_s + s.batch_s + s.pause_s + gap_s * s.requests) / s.k + 3
            if mode == "sequential":
                per_rev += s.requests * (s.batch_s / s.k + 2)
            done_at, expected = await _client(url, revs, s, mode, gap_s, 60 + per_rev * len(revs))
            trainer_rc = await reap(procs.children["trainer"], 60)
            await trio.sleep(0.2)  # the last turn's release reaches WATCH
            t_end = time.monotonic()
            async with await AsyncSlicer.connect(sock) as c:
                totals = dict((await c.status())["totals"])
            await stop(procs.children["dispatcher"], 15)
            await stop(procs.children["sampler"], 15)
            nursery.cancel_scope.cancel()
        assert procs.daemon is not None
        await stop(procs.daemon, 10)
        off = mono_offset()
        return Run(
            events=rec.events,
            devents=devents,
            cc=read_cc_log(base / "cc.log", off),
            t_start=t_start,
            t_end=t_end,
            trainer_rc=trainer_rc,
            served=len(done_at),
            expected=expected,
            done_at=done_at,
            parker=parker_seen,
            sleep_level=sleep_level,
            totals=totals,
            overlaps=Ledger(base / "gpu").overlaps(),
        )


# ---- analysis ------------------------------------------------------------------------


@dataclass
class Switch:
    """One handoff, measured seconds (scaled run) of each part."""

    direction: str  # "T>S" (trainer to sampler) or "S>T"
    wall: float
    park: float = 0.0  # the tool's own time (lock + checkpoint)
    restore: float = 0.0  # the tool's own time (restore + unlock)
    cuinit: float = 0.0  # driver initialisation paid inside park_ms / restore_ms
    tool_start: float = 0.0  # park_ms / restore_ms minus the tool's own time and cuinit
    wake: float = 0.0
    load: float = 0.0
    sleep: float = 0.0
    bytes_moved: int = 0  # by cuda-checkpoint
    wake_copies: bool = True  # a level-1 wake (weights back from host RAM)
    sleep_level: int = 1
    # An early start (T>S): the sampler's wake and load before its grant, beside the park.
    early: EarlyStage | None = None
    grant_at: float = 0.0  # the sampler's grant, seconds after the switch began

    @property
    def overhead(self) -> float:
        parts = self.park + self.restore + self.tool_start + self.wake + self.load + self.sleep
        if self.early is None:
            return self.wall - parts - self.cuinit
        # slicerd's time before the grant beyond the park, and the dispatcher's after the
        # join (grant and early stage both done) beyond the post-grant wake and load; the
        # early stage itself ran beside the park.
        before = self.grant_at - self.park - self.tool_start - self.cuinit
        return before + self.wall - self.join - self.wake - self.load

    @property
    def join(self) -> float:
        """When both the grant and the early stage were done (seconds into the switch)."""
        e = self.early
        return self.grant_at if e is None else max(self.grant_at, e.at + e.length)


@dataclass
class EarlyStage:
    """The sampler's early start before one grant (dispatcher events ``early``, then
    ``woke``/``load_end`` with ``early: true``), seconds of the scaled run."""

    at: float  # EARLY arrived (absolute at first, then relative to the switch's start)
    end: float
    wake: float = 0.0
    load: float = 0.0
    copies: bool = False  # the wake brought level-1 weights back over the link

    @property
    def length(self) -> float:
        return self.end - self.at


@dataclass
class SamplerTurn:
    granted: float
    released: float
    wake: float = 0.0
    load: float = 0.0
    serving: float | None = None
    serve_end: float | None = None
    sleep: float = 0.0
    wake_copies: bool = True  # False: the level-2 order (tags=weights, load, tags=kv_cache)
    sleep_level: int = 1
    early: EarlyStage | None = None  # its early start, before its grant


def _tool_time(cc: list[CcCall], lo: float, hi: float, ops: set[str]) -> tuple[float, float]:
    """(the operations' own time, the cuInit paid) of the calls inside [lo, hi]: each
    process that finished its cuInit in the window counts once (the CLI: every launch;
    the driver helper: only if it started there)."""
    calls = [c for c in cc if c.op in ops and lo - 0.005 <= c.end <= hi + 0.005]
    inits = {(c.caller, c.cuinit_at): c.cuinit_s for c in calls
             if lo - 0.005 <= c.cuinit_at <= hi + 0.005}  # fmt: skip
    return sum(c.duration for c in calls), sum(inits.values())


def sampler_turns(run: Run) -> list[SamplerTurn]:
    """The dispatcher's turns, each with its phases (daemon grant/release times)."""
    ev = [e for e in run.events if e["workload"] == "sampler" and e["t"] >= run.t_start - 1]
    grants = [e["t"] for e in ev if e["event"] == "granted"]
    rels = [e["t"] for e in ev if e["event"] == "released"]
    turns: dict[int, SamplerTurn] = {}
    order: list[int] = []
    pre: EarlyStage | None = None  # an early start, before the next grant
    for e in run.devents:  # the dispatcher's events (README "Events")
        kind, t, n = e["event"], float(e["t"]), e.get("turn")
        if kind == "early":
            pre = EarlyStage(at=t, end=t)
            continue
        if pre is not None and (e.get("early") or kind == "early_failed"):
            pre.end = t
            if kind == "woke":
                pre.wake += float(e["duration_s"])
                pre.copies = bool(e.get("copies"))
            elif kind == "load_end" and e["ok"]:
                pre.load += float(e["duration_s"])
            continue
        if kind == "granted":
            order.append(n)
            turns[n] = SamplerTurn(granted=t, released=t, early=pre)
            pre = None
            continue
        cur = turns.get(n) if n is not None else None
        if cur is None:
            continue
        if kind == "woke":  # a level-2 wake has two: tags weights, then kv_cache
            cur.wake += float(e["duration_s"])
            if e.get("tags"):
                cur.wake_copies = False
        elif kind == "load_end" and e["ok"]:
            cur.load += float(e["duration_s"])
        elif kind == "serving" and cur.serving is None:
            cur.serving = t
        elif kind == "slept" and e["ok"]:
            cur.sleep = float(e["duration_s"])
            cur.serve_end = t - cur.sleep
            cur.sleep_level = int(e.get("level") or 1)
    out = [turns[n] for n in order]
    # Daemon timestamps (microseconds) for grant and release, matched in order.
    for st, g in zip(out, [g for g in grants if g >= run.t_start], strict=False):
        st.granted = g
        st.released = next((r for r in rels if r >= g), g)
    return out


def analyze(run: Run, s: Scenario, turns: list[SamplerTurn] | None = None) -> dict[str, Any]:
    """Busy fraction and per-switch parts (measured and real-equivalent) of one run;
    `turns`: its sampler turns when the caller has completed them (default
    ``sampler_turns(run)``: bench/fit.py adds the ends of turns that slept nothing)."""
    ev = sorted((e for e in run.events if e["t"] >= run.t_start), key=lambda e: e["t"])
    tr = [e for e in ev if e["workload"] == "trainer"]
    t_grants = [e for e in tr if e["event"] == "granted"]
    t_rels = [e["t"] for e in tr if e["event"] == "released"]
    t_queued = [e["t"] for e in tr if e["event"] == "queued"]
    parked = [e for e in tr if e["event"] == "parked"]
    restored = [e for e in tr if e["event"] == "restored"]
    s_queued = [e["t"] for e in ev if e["workload"] == "sampler" and e["event"] == "queued"]
    sts = [t for t in (sampler_turns(run) if turns is None else turns)
           if t.serving is not None and t.serve_end is not None]  # fmt: skip

    useful_t = 0.0
    for tg in t_grants:
        rel = next((r for r in t_rels if r >= tg["t"]), None)
        if rel is not None:
            useful_t += rel - tg["t"]
    # The window: while both workloads want the GPU (the trainer's first grant to its
    # last release); what the sampler serves alone after the trainer ended is not shared.
    first = t_grants[0]["t"] if t_grants else run.t_start
    last = max(t_rels, default=run.t_end)
    wall = last - first
    useful_s = sum(max(0.0, min(t.serve_end or 0, last) - max(t.serving or 0, first)) for t in sts)
    sts = [t for t in sts if t.granted < last]

    switches: list[Switch] = []
    for st in sts:  # trainer -> sampler
        assert st.serving is not None
        q = max((x for x in s_queued if x <= st.granted), default=st.granted)
        prev_rel = max((r for r in t_rels if r <= st.granted), default=None)
        if prev_rel is None:
            continue
        start = max(q, prev_rel)
        sw = Switch("T>S", st.serving - start, wake=st.wake, load=st.load,
                    wake_copies=st.wake_copies, grant_at=st.granted - start)  # fmt: skip
        if st.early is not None:
            e = st.early
            sw.early = EarlyStage(e.at - start, e.end - start, e.wake, e.load, e.copies)
        for p in parked:
            if start <= p["t"] <= st.granted:
                ms = float(p["park_ms"]) / 1e3
                sw.park, sw.cuinit = _tool_time(run.cc, p["t"] - ms, p["t"], {"lock", "checkpoint"})
                sw.tool_start = ms - sw.park - sw.cuinit
                sw.bytes_moved += int(p.get("bytes", 0))
        switches.append(sw)
    for st in sts:  # sampler -> trainer
        assert st.serve_end is not None
        g: dict[str, Any] | None = next((x for x in t_grants if x["t"] >= st.released), None)
        if g is None:
            continue
        q = max((x for x in t_queued if x <= g["t"]), default=g["t"])
        start = max(q, st.serve_end)
        sw = Switch("S>T", g["t"] - start, sleep=st.sleep, sleep_level=st.sleep_level)
        for r in restored:
            if start <= r["t"] <= g["t"]:
                ms = float(r["restore_ms"]) / 1e3
                sw.restore, sw.cuinit = _tool_time(run.cc, r["t"] - ms, r["t"],
                                                   {"restore", "unlock"})  # fmt: skip
                sw.tool_start = ms - sw.restore - sw.cuinit
                sw.bytes_moved += s.trainer
        switches.append(sw)

    k = s.k
    offload = s.weights / s.link  # real vLLM level-1 sleep (or wake): weights over the link

    def scaled(measured: float, modelled: float) -> float:
        """Real-equivalent of a part whose modelled share (scaled run) is `modelled`:
        that share times k, the rest (process and HTTP costs) as measured."""
        if measured <= 0:
            return 0.0
        return modelled * k + (measured - modelled)

    def real(sw: Switch) -> dict[str, float]:
        t_park = sw.bytes_moved / (s.link * k) if sw.direction == "T>S" else 0.0
        t_rest = sw.bytes_moved / (s.link * k) if sw.direction == "S>T" else 0.0
        copy_in = sw.direction == "T>S" and sw.wake_copies  # level 1: weights back
        copy_out = sw.direction == "S>T" and sw.sleep_level == 1  # level 1: weights to host
        r = {
            "park": scaled(sw.park, t_park),
            "restore": scaled(sw.restore, t_rest),
            "load": scaled(sw.load, s.load_s / k),
            "wake": sw.wake + (offload if copy_in else 0.0),
            "sleep": sw.sleep + (offload if copy_out else 0.0),
            "cuinit": sw.cuinit * k,  # modelled: FAKEGPU_CUINIT_S is cuinit_s / k
            "tool_start": sw.tool_start,
            "overhead": sw.overhead,
            # What must cross the link (module docstring, "Bound").
            "bound": (sw.bytes_moved + (s.weights if sw.direction == "T>S" else 0)) / s.link,
            "hidden": 0.0,
        }
        # The floor on a full-duplex link: where the weights fit beside the trainer (an
        # early start ran), they cross inward while its working set crosses outward.
        both = sw.direction == "T>S" and sw.early is not None
        r["floor"] = max(sw.bytes_moved, s.weights) / s.link if both else r["bound"]
        r["total"] = sum(r[p] for p in PARTS)
        if sw.early is not None:
            # Two branches from EARLY on (module docstring, "Early starts"): slicerd's park
            # to the grant, and the sampler's wake and load; what follows starts at the
            # later of the two. Each branch stretches by its own modelled parts.
            e = sw.early
            e_wake = e.wake + (offload if e.copies else 0.0)
            e_load = scaled(e.load, s.load_s / k)
            grant = sw.grant_at + (r["park"] - sw.park) + (r["cuinit"] - sw.cuinit)
            join = max(grant, e.at + e.length + (e_wake - e.wake) + (e_load - e.load))
            after = (r["wake"] - sw.wake) + (r["load"] - sw.load)  # the post-grant stretch
            r["total"] = sw.wall + (join - sw.join) + after
            r["wake"] += e_wake
            r["load"] += e_load
            r["hidden"] = sum(r[p] for p in PARTS) - r["total"]
        r["native"] = r["total"] - r["tool_start"]
        # slicerd's park or restore as it timed it; vLLM's side (sleep, wake, load).
        r["checkpoint"] = r["park"] + r["restore"] + r["cuinit"] + r["tool_start"]
        r["vllm"] = r["wake"] + r["load"] + r["sleep"]
        return r

    def stretch(sw: Switch) -> float:
        """How much longer the switch is in real time than in the scaled run."""
        return real(sw)["total"] - sw.wall

    # Useful work x k; each switch at its real-equivalent length; the rest (nobody held
    # or asked: publishing, the client's reaction) is fixed cost, as measured.
    idle = max(0.0, wall - useful_t - useful_s - sum(sw.wall for sw in switches))
    wall_real = k * (useful_t + useful_s) + sum(sw.wall + stretch(sw) for sw in switches) + idle
    useful = useful_t + useful_s
    # An estimate: the same run with every switch exactly at its bound.
    wall_bound = k * useful + sum(real(sw)["bound"] for sw in switches) + idle
    wall_floor = k * useful + sum(real(sw)["floor"] for sw in switches) + idle
    levels = [int(e.get("level") or 1) for e in run.devents if e["event"] == "slept" and e["ok"]]
    out: dict[str, Any] = {
        "scenario": s.name,
        "model": s.model,
        "link_gbps": s.link_gbps,
        "k": k,
        "served": run.served,
        "expected": run.expected,
        "trainer_rc": run.trainer_rc,
        "wall_s": wall,
        "useful_trainer_s": useful_t,
        "useful_sampler_s": useful_s,
        "busy_measured": useful / wall if wall > 0 else math.nan,
        "busy_real": k * useful / wall_real if wall_real > 0 else math.nan,
        "busy_bound": k * useful / wall_bound if wall_bound > 0 else math.nan,
        "busy_floor": k * useful / wall_floor if wall_floor > 0 else math.nan,
        "parker": run.parker,
        "sleep_level": run.sleep_level,
        "sleeps_by_level": {str(n): levels.count(n) for n in (1, 2)},
        "earlies": int(run.totals.get("earlies", 0)),  # slicerd's early starts
        "wall_real_s": wall_real,
        "idle_s": idle,
        "sampler_turns": len(sts),
        "served_shared": sum(1 for t in run.done_at if first <= t <= last),
        "trainer_wait_ms": stats([float(g["waited_ms"]) for g in t_grants[1:]]),
        "switches": {},
    }
    for d in ("T>S", "S>T", "all"):
        sel = [sw for sw in switches if d in ("all", sw.direction)]
        reals = [real(sw) for sw in sel]
        row = {p: stats([r[p] * 1e3 for r in reals])
               for p in (*PARTS, "hidden", "total", "native", "bound", "floor", "checkpoint",
                         "vllm")}  # fmt: skip
        row["overhead_frac"] = stats([r["overhead"] / r["total"] for r in reals if r["total"]])
        row["native_over_bound"] = stats([r["native"] / r["bound"] for r in reals if r["bound"]])
        out["switches"][d] = row
    return out


# ---- levers outside the loop ---------------------------------------------------------


async def lever_lazy(s: Scenario, steps: int, blocks: int) -> dict[str, Any]:
    """Trainer-only steps (nobody else waits): RELEASE lazy vs park=now, interleaved."""
    with workdir() as (base, procs):
        env = _env(base, s)
        sock = await start_daemon(base, env, procs, daemon_args("driver"))
        ledger = Ledger(base / "gpu")
        res: dict[str, list[float]] = {"lazy": [], "now": []}
        work = s.step_s / s.k
        async with await AsyncSlicer.connect(sock) as c:
            await c.register("trainer", gpu=0, pid=os.getpid(), tree=False, park="checkpoint")
            for _ in range(blocks):
                for mode in ("lazy", "now"):
                    for step in range(steps + 1):  # step 0: the mode change, not counted
                        t0 = time.monotonic()
                        turn = await c.acquire("trainer")
                        have = sum(m.on_device for m in ledger.processes(0)
                                   if m.pid == os.getpid())  # fmt: skip
                        if have < s.trainer:
                            ledger.alloc(os.getpid(), 0, s.trainer - have, tag="weights",
                                         workload="trainer")  # fmt: skip
                        await trio.sleep(work)
                        await c.release(turn, park=mode)
                        # Modelled transfer of this step (scaled run): the park, and the
                        # restore its ACQUIRE needed; real-equivalent: that share x k.
                        moves = (mode == "now") + bool(turn.restored)
                        modelled = moves * s.trainer / (s.link * s.k)
                        if step:
                            res[mode].append(time.monotonic() - t0 - work + modelled * (s.k - 1))
        ledger.free(os.getpid())
        assert procs.daemon is not None
        await stop(procs.daemon, 10)
    n = steps * blocks
    out: dict[str, Any] = {}
    for mode in ("lazy", "now"):
        cost = res[mode]
        out[mode] = {
            "step_cost_ms": stats([x * 1e3 for x in cost]),
            "busy_real": n * s.step_s / (n * s.step_s + sum(cost)),
            "bound_ms": 0.0 if mode == "lazy" else 2 * s.trainer / s.link * 1e3,
        }
    return out


async def lever_sleep(s: Scenario, cycles: int) -> dict[str, Any]:
    """Sampler turns ended by a cooperative sleep vs by checkpointing the awake replica
    (both released park=now, as when the trainer waits), interleaved in one daemon."""
    with workdir() as (base, procs):
        env = _env(base, s)
        sock = await start_daemon(base, env, procs, daemon_args("driver"))
        ports = {
            "sleep": await _launch_vllm(base, env, procs, sock, s, "slp", "cooperative"),
            "checkpoint": await _launch_vllm(base, env, procs, sock, s, "ckp", "checkpoint"),
        }
        names = {"sleep": "slp", "checkpoint": "ckp"}
        gen = s.batch_s / s.k
        costs: dict[str, list[float]] = {"sleep": [], "checkpoint": []}
        async with (
            await AsyncSlicer.connect(sock) as c,
            httpx.AsyncClient(timeout=60) as http,
        ):
            for i in range(cycles + 1):
                for mode in ("sleep", "checkpoint"):
                    url = f"http://127.0.0.1:{ports[mode]}"
                    t0 = time.monotonic()
                    turn = await c.acquire(names[mode])
                    if mode == "sleep" or i == 0:
                        (await http.post(f"{url}/wake_up")).raise_for_status()
                    t1 = time.monotonic()
                    body = {"prompt": "q", "max_tokens": s.max_tokens}
                    r = await http.post(f"{url}/v1/completions", json=body)
                    r.raise_for_status()
                    t2 = time.monotonic()
                    if mode == "sleep":
                        (await http.post(f"{url}/sleep", params={"level": 1})).raise_for_status()
                    await c.release(turn, park="now")
                    if i > 0:  # the first cycle wakes the checkpoint variant for good
                        costs[mode].append(time.monotonic() - t0 - (t2 - t1))
        assert procs.daemon is not None
        for name in ("slp", "ckp"):
            await stop(procs.children[name], 15)
        await stop(procs.daemon, 10)
    awake = int(s.util * s.capacity)
    offload = s.weights / s.link
    out: dict[str, Any] = {"gen_s": gen}
    for mode in ("sleep", "checkpoint"):
        if mode == "sleep":
            # The stub's sleep and wake are free: real vLLM copies the weights each way.
            real = [x + 2 * offload for x in costs[mode]]
            bound = 2 * s.weights / s.link
        else:
            # Checkpoint + restore of everything awake: that share x k, the rest as measured.
            xfer = 2 * awake / (s.link * s.k)
            real = [x + xfer * (s.k - 1) for x in costs[mode]]
            bound = 2 * awake / s.link
        out[mode] = {"handoff_ms": stats([x * 1e3 for x in real]), "bound_ms": bound * 1e3}
    out["awake_bytes"] = awake
    return out


# ---- report --------------------------------------------------------------------------


def fmt_ms(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.2f}"


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def chart_png(path: Path, rows: list[dict[str, Any]]) -> None:
    """Busy fraction (real-equivalent) against model size, one bar per link (matplotlib,
    the `charts` extra; without it one line on stderr and no PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("efficiency bench: no chart written: the chart needs matplotlib:"
              " pip install -e '.[charts]' (the `charts` extra)", file=sys.stderr)  # fmt: skip
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    links = sorted({float(r["link_gbps"]) for r in rows})
    fig = Figure(figsize=(9, 5.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(links))
    for j, link in enumerate(links):
        xs, ys = [], []
        for i, m in enumerate(models):
            sel = [r for r in rows if r["model"] == m and float(r["link_gbps"]) == link]
            if sel and not math.isnan(sel[0]["busy_real"]):
                xs.append(i + (j - (len(links) - 1) / 2) * width)
                ys.append(100 * max(0.0, min(1.0, float(sel[0]["busy_real"]))))
        bars = ax.bar(xs, ys, width * 0.9, label=f"{link:g} GB/s host link")
        ax.bar_label(bars, fmt="%.0f%%", padding=2)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylim(0, 110)
    ax.set_yticks(range(0, 101, 20), [f"{v}%" for v in range(0, 101, 20)])
    ax.set_xlabel("model")
    ax.set_ylabel("GPU busy fraction (real-equivalent)")
    ax.grid(axis="y", color="0.85")
    ax.set_axisbelow(True)
    ax.set_title("GPU busy fraction vs model size (real-equivalent)")
    ax.legend(loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def settings(res: dict[str, Any]) -> str:
    """The main tables' settings, as the run saw them (STATUS parker, auto's choices)."""
    rows = res["scenarios"]
    parkers = sorted({r["parker"] for r in rows})
    one, two = (sum(r["sleeps_by_level"][n] for r in rows) for n in ("1", "2"))
    level = (f"slicer-dispatch `--sleep-level auto` (it chose level 1 at {one} and level 2 at"
             f" {two} turn ends)" if res.get("sleep_level_flag") else
             "slicer-dispatch without `--sleep-level` (not in this checkout: level 1)")  # fmt: skip
    earlies = sum(r.get("earlies", 0) for r in rows)
    turns = sum(r["sampler_turns"] for r in rows)
    early = (f", `--early-start` the weights' bytes (slicerd sent EARLY at {earlies} of {turns}"
             " sampler turns)" if res.get("early_flag") else "")  # fmt: skip
    return f"slicerd `--parker driver` (STATUS: {', '.join(parkers)}), {level}{early}"


def _find(rows: list[dict[str, Any]], model: str, link: float) -> int | None:
    return next((i for i, r in enumerate(rows) if r["model"] == model
                 and float(r["link_gbps"]) == link), None)  # fmt: skip


def _p50(r: dict[str, Any], d: str, part: str) -> float:
    return float(r["switches"][d][part]["p50"])


PARKER_ANCHOR = ("Published: about 2.7 s of `cuInit` per cuda-checkpoint launch"
                 " (NVIDIA/cuda-checkpoint issue 29); restore+unlock 8.57 s -> 1.32 s with a"
                 " long-lived helper on the driver API (ai-dynamo/dynamo PR 7773), 6.5x (our"
                 " arithmetic).")  # fmt: skip
LEVEL_ANCHOR = ("Published: 8B with LoRA on an A100, new weights loaded at the next wake: level 1"
                " sleep 10.57 s + wake 2.19 s = 12.8 s, level 2 sleep 0.31 s + wake 6.53 s (the"
                " load included) = 6.8 s (blog.vllm.ai/2025/10/26/sleep-mode.html,"
                " vllm-project/vllm PR 48337), 1.87x (our arithmetic).")  # fmt: skip


def parker_cells(on: dict[str, Any], off: dict[str, Any]) -> tuple[str, str, str]:
    """(driver cell, CLI cell, ratio) of the parker lever: slicerd's park and restore p50
    (real-equivalent ms; the CLI's cuInit share) and the busy fraction."""

    def cell(r: dict[str, Any]) -> str:
        return (f"park {fmt_ms(_p50(r, 'T>S', 'checkpoint'))} / restore"
                f" {fmt_ms(_p50(r, 'S>T', 'checkpoint'))} (cuinit"
                f" {fmt_ms(_p50(r, 'T>S', 'cuinit'))} / {fmt_ms(_p50(r, 'S>T', 'cuinit'))});"
                f" busy {pct(r['busy_real'])}")  # fmt: skip

    both = [_p50(r, "T>S", "checkpoint") + _p50(r, "S>T", "checkpoint") for r in (on, off)]
    return cell(on), cell(off), f"{both[1] / max(both[0], 1e-9):.2f}x park + restore"


def level_cells(on: dict[str, Any], off: dict[str, Any]) -> tuple[str, str, str]:
    """(level-2 cell, level-1 cell, ratio): vLLM's sleep + wake + load p50 (real-equivalent
    ms), T>S total / bound p50 and the busy fraction."""

    def out_in(r: dict[str, Any]) -> float:
        return _p50(r, "S>T", "vllm") + _p50(r, "T>S", "vllm")

    def cell(r: dict[str, Any]) -> str:
        tb = _p50(r, "T>S", "total") / max(_p50(r, "T>S", "bound"), 1e-9)
        note = " (the main run: auto chose this level at every turn end)" if r.get("reused") else ""
        return (f"sleep + wake + load {fmt_ms(out_in(r))}; T>S total / bound {tb:.2f};"
                f" busy {pct(r['busy_real'])}{note}")  # fmt: skip

    return cell(on), cell(off), f"{out_in(off) / max(out_in(on), 1e-9):.2f}x sleep + wake + load"


def variants_md(res: dict[str, Any]) -> list[str]:
    """The switch levers on and off at every size (driver parker vs CLI; level 2 vs 1)."""
    v, rows = res.get("variants") or {}, res["scenarios"]
    out: list[str] = []
    if "parker=cli" in v:
        out += ["## Driver-API parker vs the cuda-checkpoint CLI, at every size\n",
                "Both with the main tables' other settings. Real-equivalent ms, p50; `cuinit`"
                " is the modelled driver initialisation inside slicerd's park / restore"
                f" ({res.get('cuinit_s', 2.7):g} s per CLI launch, two launches each). "
                + PARKER_ANCHOR + "\n",
                "| scenario | `--parker driver` | `--parker cli` | CLI / driver |",
                "|---|---|---|---|"]  # fmt: skip
        for r, c in zip(rows, v["parker=cli"], strict=False):
            on, off, ratio = parker_cells(r, c)
            out.append(f"| {r['scenario']} | {on} | {off} | {ratio} |")
        out.append("")
    if not res.get("sleep_level_flag"):
        out += ["## vLLM sleep level 2 vs level 1, at every size\n",
                "not measured: flag not present (`slicer-dispatch --sleep-level` is not in"
                " this checkout).\n"]  # fmt: skip
    elif "sleep=1" in v and "sleep=2" in v:
        out += [
            "## vLLM sleep level 2 vs level 1, at every size\n",
            "`slicer-dispatch --sleep-level 2` vs `1`, both with `--parker driver`."
            " Real-equivalent ms, p50: vLLM's sleep (S>T) + wake and weight load (T>S);"
            " level 1 copies the weights over the link both ways, level 2 copies nothing"
            " (the load happens at every step anyway). " + LEVEL_ANCHOR + "\n",
            "| scenario | level 2 | level 1 | level 1 / level 2 |",
            "|---|---|---|---|",
        ]
        for r, a, b in zip(rows, v["sleep=2"], v["sleep=1"], strict=False):
            on, off, ratio = level_cells(a, b)
            out.append(f"| {r['scenario']} | {on} | {off} | {ratio} |")
        out.append("")
    if "early=off" in v:
        out += [
            "## Early starts vs none, at every size\n",
            "`slicer-dispatch --early-start` (the weights' bytes) vs `--early-start off`, both"
            " with the main tables' other settings. With an early start slicerd locks the"
            " trainer, says EARLY, and vLLM wakes its weights and loads the new revision while"
            " the trainer's working set is checkpointed; where the weights do not fit beside"
            " the trainer (70B) nothing changes. Real-equivalent ms, p50 of the T>S switch."
            " The published systems in ANCHORS.md switch serially (park, then wake and load);"
            " none overlaps the two.\n",
            "| scenario | early starts | none | none / early |",
            "|---|---|---|---|",
        ]
        for r, o in zip(rows, v["early=off"], strict=False):
            on, off, ratio = early_cells(r, o)
            out.append(f"| {r['scenario']} | {on} | {off} | {ratio} |")
        out.append("")
    return out


def early_cells(on: dict[str, Any], off: dict[str, Any]) -> tuple[str, str, str]:
    """(early-start cell, none cell, ratio): the T>S total, its hidden part, total / bound,
    and the busy fraction."""

    def cell(r: dict[str, Any]) -> str:
        t = r["switches"]["T>S"]
        return (f"T>S {fmt_ms(t['total']['p50'])} (hidden {fmt_ms(t['hidden']['p50'])});"
                f" total / bound {t['total']['p50'] / max(t['bound']['p50'], 1e-9):.2f};"
                f" EARLY at {r.get('earlies', 0)} of {r['sampler_turns']} turns;"
                f" busy {pct(r['busy_real'])}")  # fmt: skip

    ts = [_p50(r, "T>S", "total") for r in (on, off)]
    return cell(on), cell(off), f"{ts[1] / max(ts[0], 1e-9):.2f}x T>S"


def targets_md(res: dict[str, Any]) -> list[str]:
    """Issue 18's targets for the switch levers, each with its verdict."""
    rows, v = res["scenarios"], res.get("variants") or {}
    out = ["## Switch targets (issue 18)\n", "| target | figure (this run) | verdict |",
           "|---|---|---|"]  # fmt: skip
    i = _find(rows, "8B", 55.0)
    if i is not None:
        r = rows[i]
        l2 = v.get("sleep=2", [])
        alt = (f"; with `--sleep-level 2`: {pct(l2[i]['busy_real'])}"
               if i < len(l2) and not l2[i].get("reused") else "")  # fmt: skip
        off = v.get("early=off", [])
        no_early = (f"; without early starts {pct(off[i]['busy_real'])}"
                    if i < len(off) else "")  # fmt: skip
        floor = r.get("busy_floor", r["busy_bound"])
        beyond = (" (beyond the floor: every step moves the trainer's working set out and back"
                  " in; only fit-aware turns, below, keep it on the GPU)"
                  if floor < 0.9 and r["busy_real"] < 0.9 else "")  # fmt: skip
        out.append(
            "| busy fraction >= 90% real-equivalent at 8B @ 55 GB/s (was 76.7%; the best"
            " published duty cycle for two jobs sharing GPUs is 71%: llm-d blog \"RL"
            f" time-slicing\") | {pct(r['busy_real'])} (main settings){alt}{no_early}; at the"
            f" bound {pct(r['busy_bound'])}, at the floor {pct(floor)} (estimates){beyond} |"
            f" {'PASS' if r['busy_real'] >= 0.9 else 'MISS'} |"
        )  # fmt: skip
        t = r["switches"]["T>S"]
        tb = [t["total"][q] / t["bound"][q] for q in ("p50", "p99")]
        nb = t["native_over_bound"]
        verdict = ("PASS" if tb[1] <= 1.2 else "PASS at p50, MISS at p99" if tb[0] <= 1.2
                   else "MISS")  # fmt: skip
        was = ""
        if i < len(off):
            o = off[i]["switches"]["T>S"]
            was = (f"; without early starts {o['total']['p50'] / o['bound']['p50']:.2f}"
                   f" ({fmt_ms(o['total']['p50'])} ms)")  # fmt: skip
        out.append(
            "| switch T>S within 1.2x of its bound at 8B @ 55 GB/s (was 1.64x) | total / bound"
            f" {tb[0]:.2f} / {tb[1]:.2f} (p50 / p99; native {nb['p50']:.2f} / {nb['p99']:.2f});"
            f" of the p50 {fmt_ms(t['total']['p50'])} ms the weight load is"
            f" {fmt_ms(t['load']['p50'])} ms, {fmt_ms(t['hidden']['p50'])} ms of wake and load"
            f" ran beside the park (early starts); bound {fmt_ms(t['bound']['p50'])} ms, floor"
            f" {fmt_ms(t['floor']['p50'])} ms{was} | {verdict} |"
        )  # fmt: skip
    fit = res.get("fit")
    if fit:  # bench/fit.py --json-file: its own run, section "Fit-aware turns" below
        out.append("| fit-aware turns at 0.6B: switch (handover: release -> grant) under 50 ms"
                   f" real-equivalent | {fit['figure']} (section \"Fit-aware turns\") |"
                   f" {fit['verdict']} |")  # fmt: skip
        big = fit.get("big")
        if big:  # its busy-fraction scenario: fit-aware turns with a small vLLM
            where = big["row"]["scenario"]
            out.append(f"| busy fraction >= 90% real-equivalent at {where} with fit-aware turns"
                       f" (needs vLLM with a small KV cache) | {big['figure']} (section"
                       f" \"Fit-aware turns\") | {big['verdict']} |")  # fmt: skip
    else:
        out.append("| fit-aware turns at 0.6B: switch under 50 ms real-equivalent | not run"
                   " (`bench/fit.py`) | - |")  # fmt: skip
    out.append("")
    return out


def markdown(res: dict[str, Any], scenarios: list[Scenario]) -> str:
    L: list[str] = []
    add = L.append
    m = res["machine"]
    add("# Benchmarks\n")
    add("Generated by `make bench` (`bench/handoff.py`, then `bench/efficiency.py`). Do not"
        " edit by hand.\n")  # fmt: skip
    add(HOW_TO_READ)
    add("## Machine\n")
    add(f"- {m['cpus']} CPUs ({m['cpu_model']}), Python {m['python']}; load average"
        f" {m['load_before']} before, {m['load_after']} after (other work shares the machine)."
        )  # fmt: skip
    add(f"- Fake GPU (ledger) of {gib(scenarios[0].capacity)}; no real GPU was used.")
    add(f"- efficiency bench wall time: {res['total_s']:.0f} s.\n")
    add("## Method\n")
    add((__doc__ or "").split("Method\n------\n", 1)[-1].strip() + "\n")
    add("Sizes: weights = 2 bytes/param (bf16); trainer working set = 16 bytes/param (full"
        " fine-tuning: weights, grads, Adam moments, master weights), capped at"
        " `trainer_cap_fraction` x GPU capacity when it cannot fit (then it stands for a"
        " sharded or offloaded trainer's per-GPU share). Medians and p99 are over every switch"
        " of a run (nearest rank; with few switches p99 is the worst one).\n")  # fmt: skip
    add("| model | weights | trainer working set | vLLM awake | step / batch (real) | k |")
    add("|---|---|---|---|---|---|")
    seen: set[str] = set()
    for s in scenarios:
        if s.model in seen:
            continue
        seen.add(s.model)
        tr = gib(s.trainer) + (f" (capped; FFT needs {s.trainer_fft / 1e9:.0f} GB)"
                               if s.trainer_capped else "")  # fmt: skip
        add(f"| {s.model} | {s.weights / 1e9:.1f} GB | {tr} | {gib(int(s.util * s.capacity))}"
            f" | {s.step_s:g} s / {s.batch_s:g} s | {s.k:g} |")  # fmt: skip
    add("")
    add("## Busy fraction\n")
    add("![busy fraction vs model size](bench/efficiency.png)\n")
    add(f"Settings: {settings(res)}. `busy at the bound` and `at the floor` are estimates"
        " (our arithmetic): the same run with every switch taking exactly its bound (bytes"
        " out, then bytes in) or its floor (where an early start overlaps them on the"
        " full-duplex link, the larger of the two).\n")  # fmt: skip
    add("| scenario | busy (real-equiv.) | busy at the bound / floor (estimate) | busy"
        " (measured, scaled run) | sampler turns | sleeps level 1 / 2 | served (while the"
        " trainer ran) | trainer wait p50 / p99 (scaled run) |")  # fmt: skip
    add("|---|---|---|---|---|---|---|---|")
    for r in res["scenarios"]:
        tw, lvl = r["trainer_wait_ms"], r["sleeps_by_level"]
        floor = pct(r["busy_floor"]) if "busy_floor" in r else "-"
        add(f"| {r['scenario']} | {pct(r['busy_real'])} | {pct(r['busy_bound'])} / {floor} |"
            f" {pct(r['busy_measured'])} | {r['sampler_turns']} | {lvl['1']} / {lvl['2']} |"
            f" {r['served']}/{r['expected']} ({r['served_shared']}) |"
            f" {fmt_ms(tw['p50'])} / {fmt_ms(tw['p99'])} ms |")  # fmt: skip
    add("")
    add("## Per-switch cost (real-equivalent ms, median / p99)\n")
    add(f"Settings: {settings(res)}. T>S: trainer to sampler (park the trainer, wake vLLM,"
        " load the new weights). S>T: sampler to trainer (sleep vLLM, restore the trainer)."
        " Bound: the bytes that must cross the link / link (T>S: the trainer's working set"
        " and the new weights once; S>T: the trainer's working set). `cuinit`: the driver"
        " initialisation paid inside the park or restore (modelled, x k; the driver helper"
        " paid its own once at daemon start). `tool_start`: the rest of slicerd's park or"
        " restore time outside the operations (the driver helper's round trips; with the"
        " CLI, starting the Python stub). `native`: total without `tool_start`. Parts whose"
        " modelled share is scaled (park, restore, load) count that share x k and the rest"
        " (process, HTTP, ledger costs) as measured; wake and sleep are the stub's measured"
        " HTTP calls plus weights / link when the level copies them (level 1). `hidden`:"
        " with an early start, the part of the sampler's wake and load (both counted in"
        " their columns) that ran before its grant, beside the trainer's park, so that"
        " total = the parts - hidden. `floor`: the bound on a full-duplex link (T>S with an"
        " early start: the larger of the working set out and the weights in).\n")  # fmt: skip
    parts = (*PARTS, "hidden", "total", "native", "bound", "floor")
    add("| scenario | dir | n | " + " | ".join(parts) + " | overhead % | native / bound |")
    add("|---|---|---|" + "---|" * (len(parts) + 2))
    for r in res["scenarios"]:
        for d in ("T>S", "S>T"):
            row = r["switches"][d]
            cells = [f"{fmt_ms(row[p]['p50'])} / {fmt_ms(row[p]['p99'])}" for p in parts]
            of, tb = row["overhead_frac"], row["native_over_bound"]
            add(f"| {r['scenario']} | {d} | {row['total']['n']} | " + " | ".join(cells)
                + f" | {of['p50'] * 100:.2f} / {of['p99'] * 100:.2f} |"
                f" {tb['p50']:.2f} / {tb['p99']:.2f} |")  # fmt: skip
    add("")
    add("## Orchestration overhead against the target\n")
    add(f"Target: under {TARGET_OVERHEAD_MS:g} ms and under {TARGET_OVERHEAD_FRAC * 100:g}% of"
        " the switch, at every size.\n")  # fmt: skip
    add("| scenario | overhead p50 / p99 ms | share of switch p50 / p99 | verdict |")
    add("|---|---|---|---|")
    for r in res["scenarios"]:
        a = r["switches"]["all"]
        o, f = a["overhead"], a["overhead_frac"]
        ok = o["p99"] < TARGET_OVERHEAD_MS and f["p99"] < TARGET_OVERHEAD_FRAC
        ok50 = o["p50"] < TARGET_OVERHEAD_MS and f["p50"] < TARGET_OVERHEAD_FRAC
        verdict = "PASS" if ok else ("PASS at p50, MISS at p99" if ok50 else "MISS")
        add(f"| {r['scenario']} | {fmt_ms(o['p50'])} / {fmt_ms(o['p99'])} |"
            f" {f['p50'] * 100:.2f}% / {f['p99'] * 100:.2f}% | {verdict} |")  # fmt: skip
    add("\n`tool_start` (the driver helper's round trips; with the CLI, starting the"
        " cuda-checkpoint stub, a Python program, twice per park or restore, where the real"
        " tool is a native binary) and `cuinit` are listed apart. They are not in"
        " `overhead`.\n")  # fmt: skip
    for line in targets_md(res):
        add(line)
    for line in variants_md(res):
        add(line)
    lv = res.get("levers", {})
    if lv:
        s = lv["scenario"]
        add(f"## Levers (on and off side by side in this run; {s})\n")
        add("| lever | on | off | ratio off/on |")
        add("|---|---|---|---|")
        v, rows = res.get("variants") or {}, res["scenarios"]
        i = _find(rows, s.split(" @ ")[0], float(s.split(" @ ")[1].split()[0]))
        if i is not None and i < len(v.get("parker=cli", [])):
            on, off, ratio = parker_cells(rows[i], v["parker=cli"][i])
            add(f"| driver-API parker (`--parker driver` vs `cli`; real-equivalent p50 ms):"
                f" {PARKER_ANCHOR} | {on} | {off} | {ratio} |")  # fmt: skip
        if not res.get("sleep_level_flag"):
            add("| vLLM sleep level 2 vs 1 (`--sleep-level`) | not measured: flag not present |"
                " not measured: flag not present | - |")  # fmt: skip
        elif i is not None and i < len(v.get("sleep=2", [])) and i < len(v.get("sleep=1", [])):
            on, off, ratio = level_cells(v["sleep=2"][i], v["sleep=1"][i])
            add(f"| vLLM sleep level 2 (vs 1; real-equivalent p50 ms): {LEVEL_ANCHOR} | {on} |"
                f" {off} | {ratio} |")  # fmt: skip
        if i is not None and i < len(v.get("early=off", [])):
            on, off, ratio = early_cells(rows[i], v["early=off"][i])
            add(f"| early start (`--early-start` vs `off`; real-equivalent p50 ms): vLLM wakes"
                f" and loads beside the trainer's park | {on} | {off} | {ratio} |")  # fmt: skip
        lz = lv.get("lazy")
        if lz:
            on, off = lz["lazy"]["step_cost_ms"]["p50"], lz["now"]["step_cost_ms"]["p50"]
            add(f"| lazy parking (trainer alone, {lz['steps']} steps): cost per step p50 ms"
                f" (busy) | {fmt_ms(on)} ({lz['lazy']['busy_real'] * 100:.1f}%) |"
                f" {fmt_ms(off)} ({lz['now']['busy_real'] * 100:.1f}%); bound"
                f" {fmt_ms(lz['now']['bound_ms'])} | {off / max(on, 1e-9):.0f}x |")  # fmt: skip
        sl = lv.get("sleep")
        if sl:
            on, off = sl["sleep"]["handoff_ms"], sl["checkpoint"]["handoff_ms"]
            add(f"| sleep vLLM before parking (vs checkpoint the awake replica,"
                f" {gib(sl['awake_bytes'])}): sampler out+in p50 / p99 ms |"
                f" {fmt_ms(on['p50'])} / {fmt_ms(on['p99'])} (bound"
                f" {fmt_ms(sl['sleep']['bound_ms'])}) | {fmt_ms(off['p50'])} /"
                f" {fmt_ms(off['p99'])} (bound {fmt_ms(sl['checkpoint']['bound_ms'])}) |"
                f" {off['p50'] / on['p50']:.2f}x |")  # fmt: skip
        for key, label in (("early", "end the turn early on WAITING"),
                           ("batch", "batch all pending requests into one turn")):  # fmt: skip
            x = lv.get(key)
            if not x:
                continue
            on, off = x["on"], x["off"]

            def cell(r: dict[str, Any]) -> str:
                return (f"{r['busy_real'] * 100:.1f}%, {r['served_shared']}, {r['sampler_turns']},"
                        f" {fmt_ms(r['trainer_wait_ms']['p50'])}")  # fmt: skip

            per = [r["served_shared"] / max(1, r["sampler_turns"]) for r in (on, off)]
            add(f"| {label} ({x['how']}): busy, requests served while the trainer ran,"
                f" sampler turns, trainer wait p50 ms (scaled run) | {cell(on)} | {cell(off)} |"
                f" requests per turn {per[0]:.1f} vs {per[1]:.1f} |")  # fmt: skip
        add("")
    add("## Notes\n")
    add(
        "- Busy fraction counts the window in which both workloads want the GPU (the"
        " trainer's first grant to its last release); useful work is the trainer's turns and"
        " the sampler's serving (first send to sleep). Idle gaps nobody asked to fill"
        " (publishing a revision, the client reacting to it) are counted as measured."
    )
    add(
        "- The measured (scaled-run) busy fraction is lower than the real-equivalent one"
        " because fixed costs (process starts, HTTP, sockets) are k times larger relative to"
        " the compressed work there."
    )
    add(
        "- `tool_start` is, with the driver parker, the round trips to its helper process"
        " (a cost that carries over to a real GPU); with the CLI, the price of the Python"
        " cuda-checkpoint stub (interpreter start, twice per park or restore) on this loaded"
        " 2-CPU machine, which a native tool does not pay; `native` shows each switch"
        " without it."
    )
    add(
        "- `--sleep-level auto` picks level 2 only when it knows, at the turn's end, that the"
        " next wake loads other weights (a newer revision published, or pending requests for"
        " another one). In this on-policy loop the next revision is usually published only"
        " after the trainer's next step, i.e. after the sampler's turn has ended, so auto"
        " sees the loaded revision as the newest and sleeps at level 1; it chose level 2"
        " where a turn that finished an older revision's requests ended after the trainer"
        " had published the next one (the counts in the busy table). The level-2 rows above"
        " show what always knowing it would gain."
    )
    add(
        "- The batching lever's `off` run sends one request at a time: while the trainer"
        " runs, each sampler turn then serves about one request; what is left is served"
        " after the trainer ended (outside the shared window)."
    )
    add(
        "- A setting to avoid: a `--turn-seconds` shorter than one generation"
        " (1 s against 12 s requests) ends turns before any send finishes; the sends are"
        " cancelled after `--turn-grace` and stay pending, so whole turns serve nothing"
        " until the trainer stops. Keep `--turn-seconds` above the longest generation."
    )
    add("")
    add((ROOT / "bench" / "gpu_check" / "section.md").read_text())  # how to run it
    add("## Real GPU check (`bench/gpu_check.sh`)\n")
    add(res.get("gpu_check", NO_GPU_CHECK) + "\n")
    hp = res.get("hotpath")
    if hp:
        for line in hotpath.markdown(hp["before"], hp.get("dispatch"), hp.get("handoff"),
                                     res["scenarios"], hp.get("profiles", {})):  # fmt: skip
            add(line)
    if res.get("dispatch_text"):
        add("## Dispatcher benchmark (`bench/dispatch.py`)\n")
        add("```\n" + res["dispatch_text"].rstrip() + "\n```\n")
    if res.get("handoff"):
        add("## Handoff micro-benchmark (`bench/handoff.py`)\n")
        add("```\n" + res["handoff"].rstrip() + "\n```\n")
    if res.get("pool_text"):
        add("## Pools across nodes (`bench/pool.py`)\n")
        add(f"`{POOL_COMMAND}` (module docstring: what each phase does).\n")
        add("```\n" + res["pool_text"].rstrip() + "\n```\n")
    if res.get("fit_text"):
        add("## Fit-aware turns (`bench/fit.py`)\n")
        add(f"`{FIT_COMMAND}` (module docstring: the method; the verdict is also in"
            " \"Switch targets\").\n")  # fmt: skip
        big = (res.get("fit") or {}).get("big")
        if big:  # what its busy-fraction scenario asks of vLLM
            add(f"Its busy fraction at {big['row']['scenario']} needs vLLM configured with a"
                f" small KV cache (`--gpu-memory-utilization {big['util']:g}`:"
                f" {big['kv_gb']:.1f} GB of KV cache instead of {big['kv_default_gb']:.0f} GB at"
                f" {big['util_default']:g}), so that the trainer stays resident beside it: a"
                " real trade (fewer concurrent sequences, shorter contexts). The new weights"
                " are still loaded at every step.\n")  # fmt: skip
        add("```\n" + res["fit_text"].rstrip() + "\n```\n")
    return "\n".join(L)


# ---- main ----------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _say(r: dict[str, Any], what: str) -> None:
    print(f"  {what}: busy {r['busy_real'] * 100:.1f}% (real-equiv.), T>S p50"
          f" {fmt_ms(r['switches']['T>S']['total']['p50'])} ms, S>T p50"
          f" {fmt_ms(r['switches']['S>T']['total']['p50'])} ms, parker {r['parker']},"
          f" sleeps by level {r['sleeps_by_level']}, {r.get('run_s', 0):.0f} s",
          file=sys.stderr, flush=True)  # fmt: skip


async def run_variants(scenarios: list[Scenario], main: list[dict[str, Any]],
                       which: set[str]) -> dict[str, Any]:  # fmt: skip
    """The switch levers off, at every scenario: ``parker`` (``--parker cli``, vs the
    main tables' driver), ``level`` (``--sleep-level 1`` and ``2``, vs the main tables'
    auto), ``earlystart`` (``--early-start off``, vs the main tables' weights); each a
    list parallel to ``scenarios``. Where auto chose one level at every turn end, the main
    run *is* that level's run (same settings, same choices): it is reused (``"reused":
    true``) instead of run twice."""
    runs: list[tuple[str, str, str, bool]] = []  # (name, --parker, --sleep-level, early)
    if "parker" in which:
        runs.append(("parker=cli", "cli", "auto", True))
    if "level" in which and "--sleep-level" in DISPATCHER_FLAGS:
        runs += [("sleep=1", "driver", "1", True), ("sleep=2", "driver", "2", True)]
    if "earlystart" in which and "--early-start" in DISPATCHER_FLAGS:
        runs.append(("early=off", "driver", "auto", False))
    out: dict[str, Any] = {name: [] for name, *_ in runs}
    for s, m in zip(scenarios, main, strict=True):
        for name, parker, level_flag, early in runs:
            if name.startswith("sleep="):
                level = name.split("=")[1]
                if sum(m["sleeps_by_level"].values()) == m["sleeps_by_level"][level] > 0:
                    out[name].append({**m, "reused": True})
                    continue
            t0 = time.monotonic()
            run = await run_loop(s, parker=parker, sleep_level=level_flag, early=early)
            r = analyze(run, s)
            r["run_s"] = time.monotonic() - t0
            _say(r, f"{s.name} {name}")
            out[name].append(r)
    return out


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    DISPATCHER_FLAGS.update(dispatcher_options())
    every, lev = load_scenarios(Path(args.config))
    scenarios = every
    if args.scenarios:  # e.g. "8B@55,0.6B@25"
        want = {w.replace(" ", "") for w in args.scenarios.split(",")}
        scenarios = [s for s in every if f"{s.model}@{s.link_gbps:g}" in want]
    if args.quick:
        scenarios = [s for s in scenarios if s.model == scenarios[0].model][:1]
    which = set(args.levers.split(",")) if args.levers else (set() if args.quick else set(LEVERS))
    res: dict[str, Any] = {"scenarios": [], "levers": {}, "variants": {},
                           "cuinit_s": every[0].cuinit_s,
                           "sleep_level_flag": "--sleep-level" in DISPATCHER_FLAGS,
                           "early_flag": "--early-start" in DISPATCHER_FLAGS}  # fmt: skip
    for s in scenarios:
        t0 = time.monotonic()
        r = analyze(await run_loop(s), s)
        r["run_s"] = time.monotonic() - t0
        _say(r, s.name)
        res["scenarios"].append(r)
    res["variants"] = await run_variants(scenarios, res["scenarios"], which)
    if not lev or not which & {"lazy", "sleep", "early", "batch"}:
        return res
    base = next(s for s in every if s.model == lev["model"] and s.link_gbps == lev["link_gbps"])
    lv: dict[str, Any] = {"scenario": base.name}
    if "lazy" in which:
        lz = await lever_lazy(base, int(lev["lazy_steps"]), int(lev["lazy_blocks"]))
        lv["lazy"] = {**lz, "steps": int(lev["lazy_steps"]) * int(lev["lazy_blocks"])}
        print("  lever lazy parking done", file=sys.stderr, flush=True)
    if "sleep" in which:
        lv["sleep"] = await lever_sleep(base, int(lev["sleep_cycles"]))
        print("  lever sleep done", file=sys.stderr, flush=True)
    gap = float(lev["trickle_gap_s"])
    small, large = float(lev["turn_seconds_small"]), float(lev["turn_seconds_large"])
    if "early" in which:
        lv["early"] = {
            "how": f"requests trickle one per {gap:g} s; --turn-seconds {small:g} vs {large:g}",
            "on": analyze(
                await run_loop(base, turn_seconds=small, mode="trickle", gap_s=gap), base
            ),
            "off": analyze(
                await run_loop(base, turn_seconds=large, mode="trickle", gap_s=gap), base
            ),
        }
        print("  lever early end done", file=sys.stderr, flush=True)
    if "batch" in which:
        lv["batch"] = {
            "how": "all of a revision's requests at once vs one at a time, revisions in order",
            "on": analyze(await run_loop(base, mode="batch"), base),
            "off": analyze(await run_loop(base, mode="sequential"), base),
        }
        print("  lever batching done", file=sys.stderr, flush=True)
    res["levers"] = lv
    return res


def _json_file(path: str | None) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is not given or missing."""
    if not path or not Path(path).exists():
        return None
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "bench" / "scenarios.toml"))
    ap.add_argument("--quick", action="store_true",
                    help="one scenario, no levers (unless --levers names some)")  # fmt: skip
    ap.add_argument("--scenarios", help="only these scenarios (comma list of MODEL@GBPS, e.g."
                    " 8B@55; default all)")  # fmt: skip
    ap.add_argument("--levers", help=f"only these levers (comma list of {','.join(LEVERS)};"
                    " default all)")  # fmt: skip
    ap.add_argument("--json", help="write every figure as JSON here")
    ap.add_argument("--markdown", help="write BENCHMARKS.md here")
    ap.add_argument("--png", default=str(ROOT / "bench" / "efficiency.png"))
    ap.add_argument("--handoff-output", help="a file with bench/handoff.py's output to include")
    ap.add_argument("--gpu-check", help="a file with bench/gpu_check.sh's table to include")
    ap.add_argument("--hotpath-before", help="bench/hotpath_before.json: the before figures")
    ap.add_argument("--dispatch-json", help="bench/dispatch.py --json-file's output")
    ap.add_argument("--dispatch-output", help="a file with bench/dispatch.py's report")
    ap.add_argument("--handoff-json", help="bench/handoff.py --json-file's output")
    ap.add_argument("--pool-output", help="a file with bench/pool.py's report to include")
    ap.add_argument("--fit-output", help="a file with bench/fit.py's report to include")
    ap.add_argument("--fit-json", help="bench/fit.py --json-file's output (its verdict)")
    ap.add_argument(
        "--profile-text",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="bench/profile_summary.py output (NAME: dispatcher or daemon)",
    )
    args = ap.parse_args()
    t0 = time.monotonic()
    load_before = round(os.getloadavg()[0], 2)
    res = trio.run(run_all, args)
    res["total_s"] = time.monotonic() - t0
    res["machine"] = {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": sys.version.split()[0],
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
    }
    if args.handoff_output and Path(args.handoff_output).exists():
        res["handoff"] = Path(args.handoff_output).read_text()
    if args.hotpath_before:
        res["hotpath"] = {
            "before": json.loads(Path(args.hotpath_before).read_text()),
            "dispatch": _json_file(args.dispatch_json),
            "handoff": _json_file(args.handoff_json),
            "profiles": {
                name: Path(f).read_text()
                for name, _, f in (p.partition("=") for p in args.profile_text)
                if Path(f).exists()
            },
        }
    if args.dispatch_output and Path(args.dispatch_output).exists():
        res["dispatch_text"] = Path(args.dispatch_output).read_text()
    if args.pool_output and Path(args.pool_output).exists():
        res["pool_text"] = Path(args.pool_output).read_text()
    if args.fit_output and Path(args.fit_output).exists():
        res["fit_text"] = Path(args.fit_output).read_text()
    res["fit"] = _json_file(args.fit_json)
    if args.gpu_check and Path(args.gpu_check).exists():
        res["gpu_check"] = Path(args.gpu_check).read_text()
    chart_png(Path(args.png), res["scenarios"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True, default=str))
    scenarios, _ = load_scenarios(Path(args.config))
    if args.markdown:
        Path(args.markdown).write_text(markdown(res, scenarios))
    bad = [r["scenario"] for r in res["scenarios"] if r["trainer_rc"] != 0
           or r["served"] != r["expected"]]  # fmt: skip
    print(f"efficiency bench: {len(res['scenarios'])} scenarios in {res['total_s']:.0f} s"
          + (f"; incomplete: {', '.join(bad)}" if bad else ""))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except subprocess.SubprocessError as e:
        print(f"efficiency bench: {e}", file=sys.stderr)
        sys.exit(1)
