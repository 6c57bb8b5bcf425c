"""A trainer stand-in: registers itself, then takes turns allocating its working set.

    python -m stubs.trainer_stub --workload trainer --bytes 40GiB --work 0.5 --steps 5

It behaves like a full-fine-tuning trainer under slicerd: each turn it ACQUIREs, makes
sure its working set is on the (fake) GPU, "trains" for `--work` seconds, and RELEASEs.
With `--park checkpoint` (default) the daemon moves its memory with cuda-checkpoint; with
`--park cooperative` it frees its memory itself before each RELEASE (an offload) and
allocates it again after each grant. A FAULT makes it exit 3, as a real trainer must.
Under `slicer-launch run` pass `--no-register`: the launcher has registered the workload
(its own pid, `tree=1`), so the stub only takes turns (its own REGISTER would be refused:
`exists`).

With `--revisions-dir DIR` each step, once its turn is released, saves its "weights" as
DIR/rev-K/revision.txt (K = 1, 2, ...); with `--publish-url URL` too, it publishes them to
a dispatcher (POST URL/v1/revisions) and exits 1 when that fails. With `--weights-from SRC`
too, DIR/rev-K is a copy of the checkpoint directory SRC/rev-K (real weights, for a real
vLLM's reload_weights), made in a temporary directory and renamed into place, so a
published path is always a whole checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Protocol

import httpx

from gpu_slicer.slicer.client import ClientError, Faulted, Slicer
from stubs.fakegpu import Ledger, parse_size
from stubs.fakegpu.hostpid import to_host


def main(argv: list[str] | None = None) -> int:
    """Run the trainer loop; exit code 0 when all steps ran."""
    p = argparse.ArgumentParser(prog="trainer_stub")
    p.add_argument("--socket")
    p.add_argument("--workload", default=os.environ.get("SLICER_WORKLOAD", "trainer"))
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--bytes", default="8GiB", help="working set")
    p.add_argument("--work", type=float, default=0.2, help="seconds of work per turn")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--park", choices=["checkpoint", "cooperative"], default="checkpoint")
    p.add_argument("--no-register", action="store_true", help="someone else registered us")
    p.add_argument("--revisions-dir", type=Path, help="save DIR/rev-K/revision.txt each step")
    p.add_argument("--publish-url", help="dispatcher base URL: POST /v1/revisions each step")
    p.add_argument(
        "--weights-from", type=Path, help="publish copies of the checkpoint dirs SRC/rev-K"
    )
    p.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds off the GPU after each step (preparing the next batch, awaiting samples)",
    )
    p.add_argument(
        "--last-park",
        choices=["lazy", "now"],
        default="lazy",
        help="how the last step releases: `now` waits until slicerd has parked us, so that "
        "exiting right after cannot race a park of our dying process",
    )
    p.add_argument(
        "--device",
        choices=["fake", "cuda"],
        default="fake",
        help="where the working set lives: the fake GPU ledger, or a real CUDA tensor (torch)",
    )
    args = p.parse_args(argv)
    if (args.publish_url or args.weights_from) and not args.revisions_dir:
        p.error("--publish-url and --weights-from need --revisions-dir")
    nbytes = parse_size(args.bytes)
    ws: _WorkingSet
    if args.device == "cuda":
        ws = _CudaWorkingSet(nbytes)
    else:
        ws = _FakeWorkingSet(args.gpu, nbytes, args.workload)
    return _run(args, ws)


class _WorkingSet(Protocol):
    def ensure(self) -> None: ...  # on the GPU (again) after a grant
    def settle(self) -> None: ...  # the step's GPU work is done
    def drop(self) -> None: ...  # freed by the trainer itself (cooperative park)


class _FakeWorkingSet:
    """The working set as memory of this pid in the fake GPU ledger."""

    def __init__(self, gpu: int, nbytes: int, workload: str) -> None:
        # The ledger speaks host pids, like NVML: in a pod, our own number is another one.
        self.ledger, self.pid = Ledger(), to_host(os.getpid())
        self.gpu, self.nbytes, self.workload = gpu, nbytes, workload

    def ensure(self) -> None:
        have = sum(m.on_device for m in self.ledger.processes(self.gpu) if m.pid == self.pid)
        if have < self.nbytes:
            self.ledger.alloc(
                self.pid, self.gpu, self.nbytes - have, tag="weights", workload=self.workload
            )

    def settle(self) -> None:
        pass

    def drop(self) -> None:
        self.ledger.free(self.pid)


class _CudaWorkingSet:
    """The working set as a real CUDA tensor (`--device cuda`; only this mode needs torch)."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.torch, self.nbytes = torch, nbytes
        self.held: object | None = None

    def ensure(self) -> None:
        if self.held is None:
            self.held = self.torch.ones(self.nbytes, dtype=self.torch.uint8, device="cuda")

    def settle(self) -> None:
        self.torch.cuda.synchronize()

    def drop(self) -> None:
        self.held = None
        self.torch.cuda.empty_cache()


def _run(args: argparse.Namespace, ws: _WorkingSet) -> int:
    """Take `--steps` turns with `ws` on the GPU in each; exit code 0 when all ran."""
    try:
        with Slicer(args.socket, args.workload) as s:
            if not args.no_register:
                s.register(args.workload, gpu=args.gpu, park=args.park)
            for step in range(args.steps):
                with s.turn(park=_release_mode(args, step)) as t:
                    ws.ensure()
                    print(f"step {step} turn {t.turn} restored={int(t.restored)}", flush=True)
                    time.sleep(args.work)  # the "training step"
                    ws.settle()
                    if args.park == "cooperative":
                        ws.drop()
                if args.revisions_dir is not None:
                    _publish(args, f"rev-{step + 1}")
                if args.pause > 0 and step + 1 < args.steps:
                    time.sleep(args.pause)
    except Faulted as e:
        print(f"trainer_stub: FAULT: {e}", file=sys.stderr)
        return 3
    except (ClientError, PublishError) as e:
        print(f"trainer_stub: {e}", file=sys.stderr)
        return 1
    return 0


def _release_mode(args: argparse.Namespace, step: int) -> str:
    return str(args.last_park) if step + 1 == args.steps else "lazy"


class PublishError(Exception):
    """Saving or publishing a revision failed."""


def _publish(args: argparse.Namespace, revision: str) -> None:
    """Save `revision` under --revisions-dir (a copy of --weights-from's checkpoint, or
    just revision.txt; whole or not at all) and POST it to --publish-url."""
    root: Path = args.revisions_dir
    url: str | None = args.publish_url
    path = root / revision
    if args.weights_from is not None:
        src = args.weights_from / revision
        tmp_dir = root / f".{revision}.tmp"
        try:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            shutil.copytree(src, tmp_dir)
            (tmp_dir / "revision.txt").write_text(revision)
            tmp_dir.replace(path)
        except OSError as e:
            raise PublishError(f"saving {revision} from {src}: {e}") from e
    else:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / "revision.txt.tmp"
        tmp.write_text(revision)
        tmp.replace(path / "revision.txt")
    if url is None:
        print(f"saved {revision} in {path}", flush=True)
        return
    body = {"revision": revision, "path": str(path)}
    try:
        r = httpx.post(url.rstrip("/") + "/v1/revisions", json=body, timeout=10)
    except httpx.HTTPError as e:
        raise PublishError(f"publishing {revision} to {url}: {e}") from e
    if r.status_code not in (200, 201):
        raise PublishError(f"publishing {revision} to {url}: HTTP {r.status_code} {r.text}")
    print(f"published {revision} ({path})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
