"""The GPU check's driver: park and restore a real GPU workload through slicerd.

    python bench/gpu_check/driver.py --gpumem BIN --probe "LINE" [--libcuda PATH] ...
    python bench/gpu_check/driver.py --fake [--sizes 0.25,0.5] [--repeats 1]

`bench/gpu_check.sh` builds the C holder (`gpumem.c`), probes the GPU with it and runs
this with the probe's line. For each parker (`cli`: the cuda-checkpoint tool; `driver`:
slicerd's helper on the driver's checkpoint API) that this machine has, it starts slicerd
(the real `nvml` backend, a temporary socket and state dir), and for each size:

1. starts the holder with that many GiB filled with a pattern, REGISTERs it as workload
   `mem` (``park=checkpoint``) and a sleeper with no GPU memory as `other`;
2. `mem` ACQUIREs and RELEASEs (lazy: it stays resident); then, per repeat: `other`
   ACQUIREs and slicerd parks `mem` (lock + checkpoint): the time to `other`'s grant is
   the park; `other` RELEASEs and `mem` ACQUIREs: the time to its grant (``restored=1``)
   is the restore; the holder's `verify` must answer `ok`; `mem` RELEASEs;
3. the holder quits (so nothing is parked when the registrations end).

It prints, per parker and size, the median park and restore seconds, GB/s each way and
their ratio to the host link (the PCIe generation and width, from pynvml or nvidia-smi,
`figures.X16_GBPS`), the driver parker's speed-up over the CLI and the ``parker`` each
slicerd's STATUS reported, and writes the same as JSON (`--json`). What a machine lacks
(the tool, or a driver without the checkpoint API) is said in one line and skipped.

`--fake` runs the same flow on the test doubles: slicerd on the fake GPU ledger
(`stubs.stack`), the cuda-checkpoint stub for `cli`, the fake libcuda
(`stubs.fakecuda`) for `driver`, and for the holder a stand-in process that books its
bytes in the ledger (this file with ``--standin BYTES``); the link is the fake one's
bandwidth (`--fake-bandwidth`). The ledger's overlap count must stay 0.

Every wait is bounded (`--budget` seconds in all: repeats that would not fit are skipped
and said so; a hard alarm a little later ends the run), and everything it starts is ended
on the way out, on a failure or SIGTERM too. Exit: 0 ran (every verify ok, every park and
restore granted), 1 a failed verify, park or restore, 2 a missing prerequisite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make bench/ and the product importable
    sys.path.insert(0, str(ROOT))

from bench.gpu_check import figures  # noqa: E402
from bench.gpu_check.holder import CheckFailed, Holder, standin  # noqa: E402
from bench.gpu_check.machine import (  # noqa: E402
    Missing,
    daemon_has_parker_flag,
    find_tool,
    host_available,
    pcie_link,
    tool_mode,
)
from gpu_slicer.proto import ClientError, Faulted, Unreachable  # noqa: E402
from gpu_slicer.slicer.client import Slicer  # noqa: E402
from stubs.proc import socket_parent  # noqa: E402

GiB = figures.GiB
# Room left on the GPU beside the holder: its CUDA context and the driver's own use.
GPU_RESERVE = 2 * GiB
# Host memory the checkpointed bytes need, plus this for everything else.
HOST_RESERVE = 8 * GiB
DAEMON_START_S = 60.0
OP_TIMEOUT_S = 90.0  # slicerd's park_timeout / restore_timeout


class OutOfTime(Exception):
    """The whole run's alarm went off."""


# -- the measurement ---------------------------------------------------------------


@dataclass
class Run:
    """One parker's figures."""

    parker: str
    status_parker: str | None = None
    sizes: dict[int, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def measure_size(
    sock: str,
    holder: Holder,
    other_pid: int,
    repeats: int,
    deadline: float,
    say: Callable[[str], None],
) -> tuple[list[float], list[float], str | None]:
    """Park and restore the ready `holder` `repeats` times through slicerd at `sock`
    (module docstring, steps 1-2); (park seconds, restore seconds, STATUS parker). Stops
    early, saying so, when the next repeat would pass `deadline` (monotonic)."""
    parks: list[float] = []
    restores: list[float] = []
    wait = OP_TIMEOUT_S + 30
    with Slicer(sock, timeout=30) as mem, Slicer(sock, timeout=30) as other:
        mem.register("mem", gpu=0, pid=holder.pid, tree=False, park="checkpoint")
        other.register("other", gpu=0, pid=other_pid, tree=False, park="checkpoint")
        status_parker = other.status().get("parker")
        try:
            mem.release(mem.acquire("mem", wait=wait))
            for i in range(repeats):
                t0 = time.monotonic()
                try:
                    t = other.acquire("other", wait=wait)
                except (ClientError, Faulted) as e:
                    raise CheckFailed(f"park {i + 1}: other's ACQUIRE failed: {e}") from e
                parks.append(time.monotonic() - t0)
                state = _state(other.status(), "mem")
                if state != "parked":
                    raise CheckFailed(f"park {i + 1}: other was granted with mem {state}")
                other.release(t)
                t1 = time.monotonic()
                try:
                    t = mem.acquire("mem", wait=wait)
                except (ClientError, Faulted) as e:
                    raise CheckFailed(f"restore {i + 1}: mem's ACQUIRE failed: {e}") from e
                restores.append(time.monotonic() - t1)
                if not t.restored:
                    raise CheckFailed(f"restore {i + 1}: mem's grant says restored=0")
                answer = holder.command("verify")
                mem.release(t)
                if answer != "ok":
                    raise CheckFailed(f"verify after restore {i + 1}: {answer}")
                took = time.monotonic() - t0
                if i + 1 < repeats and time.monotonic() + 1.5 * took > deadline:
                    say(f"  {i + 1} of {repeats} repeats: the next would pass the time budget")
                    break
        finally:
            # The holder quits before the registrations end: closing them with its memory
            # resident would park it on the way out.
            holder.close()
    return parks, restores, status_parker


def _state(status: dict[str, Any], name: str) -> str | None:
    for w in status.get("workloads", []):
        if w.get("name") == name:
            return str(w.get("state"))
    return None


def run_parker(
    parker: str,
    sock: str,
    sizes: list[int],
    repeats: int,
    start_holder: Callable[[int], Holder],
    other_pid: int,
    deadline: float,
    say: Callable[[str], None],
    link: float | None,
) -> Run:
    """Every size with one parker (slicerd already runs at `sock`)."""
    run = Run(parker)
    for n in sizes:
        if time.monotonic() + 10 > deadline:
            run.notes.append(f"{n / GiB:g} GiB skipped: out of time budget")
            say(f"  {n / GiB:g} GiB skipped: out of time budget")
            continue
        holder = start_holder(n)
        try:
            holder.ready()
            parks, restores, run.status_parker = measure_size(
                sock, holder, other_pid, repeats, deadline, say
            )
        finally:
            holder.close()
        row = figures.summarise(holder.nbytes, parks, restores, link)
        run.sizes[holder.nbytes] = row
        say(
            f"  {parker} {holder.nbytes / GiB:g} GiB x{len(parks)}: park "
            f"{row['park_s']:.2f} s ({row['park_gbps']:.1f} GB/s), restore "
            f"{row['restore_s']:.2f} s ({row['restore_gbps']:.1f} GB/s), verify ok"
        )
    return run


# -- slicerd -----------------------------------------------------------------------


@contextmanager
def real_daemon(base: Path, flags: list[str]) -> Iterator[str]:
    """slicerd on the real GPU (nvml backend) in `base`, with `flags`; yields its
    socket once it answers PING (bounded); SIGTERM, then SIGKILL, on the way out."""
    sock = str(base / "slicer.sock")
    config = base / "slicer.toml"
    # A config of our own: a host's /etc/slicer/slicer.toml must not change the check.
    config.write_text('gpu_backend = "nvml"\nforeign = "block"\n')
    log = base / "slicerd.log"
    argv = [sys.executable, "-m", "gpu_slicer.slicer.daemon", "--config", str(config)]
    argv += ["--socket", sock, "--state-dir", str(base / "state"), *flags]
    argv += ["--park-timeout", str(OP_TIMEOUT_S), "--restore-timeout", str(OP_TIMEOUT_S)]
    env = {k: v for k, v in os.environ.items() if k not in ("SLICER_SOCKET", "NOTIFY_SOCKET")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        until = time.monotonic() + DAEMON_START_S
        while True:
            if proc.poll() is not None:
                raise CheckFailed(f"slicerd exited with {proc.returncode}: {_tail(log)}")
            try:
                with Slicer(sock, timeout=5) as c:
                    c.ping()
                break
            except (Unreachable, OSError, TimeoutError):
                if time.monotonic() > until:
                    raise CheckFailed(f"slicerd did not answer in {DAEMON_START_S:g} s") from None
                time.sleep(0.1)
        yield sock
    except CheckFailed:
        print(f"slicerd log ends:\n{_tail(log, 2000)}", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.terminate()  # it lets a cuda-checkpoint in flight end first
            try:
                proc.wait(timeout=OP_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _tail(path: Path, n: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return "(no log)"


# -- the run -----------------------------------------------------------------------


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise OutOfTime("the GPU check ran past its time budget")


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The driver's options (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpumem", help="the built holder (gpumem.c)")
    ap.add_argument("--probe", help="gpumem's probe line")
    ap.add_argument("--libcuda", default="libcuda.so.1", help="the driver library")
    ap.add_argument("--sizes", default="4,16", help="GiB, comma-separated (capped by free memory)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parkers", default="cli,driver")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--markdown", help="write the summary table here (for BENCHMARKS.md)")
    ap.add_argument("--fake", action="store_true", help="the test doubles (module docstring)")
    ap.add_argument("--fake-bandwidth", default="50GB", help="the fake link (bytes/s)")
    ap.add_argument("--standin", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the check; the exit status (module docstring)."""
    args = parse_args(argv)
    if args.standin is not None:
        return standin(args.standin)
    if args.repeats < 1:
        raise SystemExit("gpu_check: --repeats must be at least 1")
    if not set(args.parkers.split(",")) <= {"cli", "driver"}:
        raise SystemExit(f"gpu_check: --parkers takes cli and/or driver, got {args.parkers!r}")
    # A process group of our own: gpu_check.sh's trap ends whatever we leave behind.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(int(args.budget) + 30)
    started = time.monotonic()
    deadline = started + args.budget
    report: dict[str, Any] = {"ok": False, "fake": args.fake, "notes": [], "parkers": {}}

    def say(line: str) -> None:
        print(line, flush=True)

    def note(line: str) -> None:
        report["notes"].append(line)
        say(f"gpu_check: {line}")

    rc = 1
    try:
        run = _run_fake if args.fake else _run_real
        rc = run(args, report, deadline, say, note)
    except CheckFailed as e:
        note(f"FAILED: {e}")
        rc = 1
    except OutOfTime as e:
        note(f"FAILED: {e}")
        rc = 1
    except Missing as e:
        note(f"cannot run: {e}")
        rc = 2
    except (ClientError, Unreachable, OSError, RuntimeError) as e:
        # slicerd refused or dropped us, or a stack did not start: one line, and the JSON.
        note(f"FAILED: {type(e).__name__}: {e}")
        rc = 1
    finally:
        signal.alarm(0)
        report["wall_s"] = round(time.monotonic() - started, 1)
        report["ok"] = rc == 0
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        if args.markdown and report.get("table"):
            Path(args.markdown).write_text(markdown(report))
    return rc


def _finish(
    report: dict[str, Any], runs: list[Run], link: float | None, say: Callable[[str], None]
) -> int:
    rows = {r.parker: r.sizes for r in runs if r.sizes}
    ups = figures.speedups(rows)
    for r in runs:
        report["parkers"][r.parker] = {
            "status_parker": r.status_parker,
            "sizes": [r.sizes[n] for n in sorted(r.sizes)],
            "notes": r.notes,
        }
    report["speedup_driver_over_cli"] = [{"bytes": n, **u} for n, u in ups.items()]
    if not rows:
        say("gpu_check: no parker could run here: nothing to measure")
        return 77
    report["table"] = figures.table(rows, link, ups)
    say("")
    for line in report["table"]:
        say(line)
    for r in runs:
        say(f"STATUS parker reported by the {r.parker} run: {r.status_parker or 'none'}")
    return 0


def markdown(report: dict[str, Any]) -> str:
    """The run as a short Markdown block: the machine, the notes, the table."""
    gpu = report.get("gpu", {})
    machine = "fake GPU (the test doubles)" if report["fake"] else gpu.get("name", "?")
    link = report.get("link", {})
    out = [
        f"Run on {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}: {machine}; link "
        f"{figures._fmt(link.get('gbps'), '.1f')} GB/s per direction ({link.get('source')}); "
        f"wall {report.get('wall_s')} s (`bench/gpu_check.sh`).",
        "",
        *[f"- {n}" for n in report["notes"]],
        "",
        "```",
        *report["table"],
        *[
            f"STATUS parker of the {name} run: {p['status_parker']}"
            for name, p in report["parkers"].items()
        ],
        "```",
        "",
    ]
    return "\n".join(out)


def _wanted(args: argparse.Namespace) -> list[float]:
    return [float(s) for s in args.sizes.split(",") if s.strip()]


def _run_real(
    args: argparse.Namespace,
    report: dict[str, Any],
    deadline: float,
    say: Callable[[str], None],
    note: Callable[[str], None],
) -> int:
    if not args.gpumem or not args.probe:
        raise Missing("--gpumem and --probe are required (bench/gpu_check.sh passes them)")
    try:
        gpu = figures.parse_probe(args.probe)
    except ValueError as e:
        raise Missing(str(e)) from None
    link = pcie_link()
    report["gpu"], report["link"] = gpu, link
    say(
        f"gpu_check: {gpu['name']}, {gpu['total'] / GiB:.1f} GiB ({gpu['free'] / GiB:.1f} free), "
        f"CUDA {gpu['cuda'] // 1000}.{gpu['cuda'] % 1000 // 10}; PCIe link "
        f"Gen{link['gen']} x{link['width']} (current {link['current'][0]} x{link['current'][1]}, "
        f"from {link['source']}): {figures._fmt(link['gbps'], '.1f')} GB/s per direction"
        + ("" if link["anchored"] or link["gbps"] is None else " (our estimate)")
    )
    free = gpu["free"] - GPU_RESERVE
    host = host_available()
    if host is not None:
        free = min(free, host - HOST_RESERVE)
    sizes = figures.sizes_that_fit(_wanted(args), free + GPU_RESERVE, GPU_RESERVE)
    if not sizes:
        raise Missing(f"too little free memory to hold even 1 GiB (GPU free {gpu['free']})")
    report["sizes"] = sizes
    has_flag = daemon_has_parker_flag(sys.executable)
    tool = find_tool(args.libcuda)
    mode = tool_mode(tool) if tool else None
    report["cuda_checkpoint"] = {"path": tool, "mode": mode}
    runs: list[Run] = []
    other = subprocess.Popen(["sleep", str(int(args.budget) + 60)])
    try:
        for parker in args.parkers.split(","):
            flags: list[str] = []
            if parker == "cli":
                if tool is None or mode == "unusable":
                    note("cli parker: skipped: no usable cuda-checkpoint on PATH or by the driver")
                    continue
                flags = ["--cuda-checkpoint", tool]
                if mode == "toggle":
                    note("cli parker: this cuda-checkpoint has no --action (r550): --toggle it is")
            elif parker == "driver":
                if not gpu["checkpoint_api"]:
                    note(
                        f"driver parker: skipped: {args.libcuda} lacks cuCheckpointProcessLock "
                        "(the driver's checkpoint API needs r570 or newer)"
                    )
                    continue
                flags = ["--libcuda", args.libcuda, *(["--cuda-checkpoint", tool] if tool else [])]
            if has_flag:
                flags += ["--parker", parker]
            elif parker != "cli":
                note(f"{parker} parker: skipped: this slicerd has no --parker")
                continue
            say(f"gpu_check: {parker} parker: slicerd {' '.join(flags)}")
            with (
                tempfile.TemporaryDirectory(
                    prefix="gpu-check-", dir=socket_parent("gpu-check-")
                ) as tmp,
                real_daemon(Path(tmp), flags) as sock,
            ):

                def start(n: int) -> Holder:
                    return Holder([args.gpumem, "--lib", args.libcuda, f"{n / GiB!r}"])

                runs.append(
                    run_parker(
                        parker,
                        sock,
                        sizes,
                        args.repeats,
                        start,
                        other.pid,
                        deadline,
                        say,
                        link["gbps"],
                    )
                )
    finally:
        other.kill()
        other.wait(timeout=10)
    return _finish(report, runs, link["gbps"], say)


def _run_fake(
    args: argparse.Namespace,
    report: dict[str, Any],
    deadline: float,
    say: Callable[[str], None],
    note: Callable[[str], None],
) -> int:
    from stubs.fakegpu import parse_size

    bandwidth = parse_size(args.fake_bandwidth)
    link = bandwidth / 1e9
    report["link"] = {"source": "fake", "gbps": link}
    sizes = figures.sizes_that_fit(_wanted(args), None, 0)
    report["sizes"] = sizes
    say(f"gpu_check: fake GPU (ledger), fake link {link:.1f} GB/s")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-fakecuda-") as cache:
        for parker in args.parkers.split(","):
            _fake_parker(args, parker, Path(cache), bandwidth, sizes, deadline, say, note, runs)
    return _finish(report, runs, link, say)


def _fake_parker(
    args: argparse.Namespace,
    parker: str,
    cache: Path,
    bandwidth: int,
    sizes: list[int],
    deadline: float,
    say: Callable[[str], None],
    note: Callable[[str], None],
    runs: list[Run],
) -> None:
    from stubs.stack import running_stack_sync

    link = bandwidth / 1e9
    flags = ["--parker", parker, "--park-timeout", "60", "--restore-timeout", "60"]
    lib = None
    if parker == "driver":
        try:
            from stubs.fakecuda import BuildError, build
        except ImportError:
            note("driver parker: skipped: this checkout has no stubs.fakecuda")
            return
        try:
            lib = build(cache)
        except BuildError as e:
            note(f"driver parker: skipped: {e}")
            return
        flags += ["--libcuda", str(lib)]
    with running_stack_sync(
        *flags, gpus=1, capacity="141GiB", bandwidth=str(bandwidth), tmp_prefix="gpu-check-"
    ) as stack:
        say(f"gpu_check: {parker} parker (fake)")
        other_pid = stack.sleeper()

        def start(n: int) -> Holder:
            me = [sys.executable, os.path.abspath(__file__), "--standin", str(n)]
            return Holder(me, env=stack.env)

        runs.append(
            run_parker(
                parker, stack.socket, sizes, args.repeats, start, other_pid, deadline, say, link
            )
        )
        if stack.overlaps():
            raise CheckFailed(f"the fake GPU saw {stack.overlaps()} overlap(s)")


if __name__ == "__main__":
    sys.exit(main())
