"""A trainer stand-in: registers itself, then takes turns allocating its working set.

    python -m stubs.trainer_stub --workload trainer --bytes 40GiB --work 0.5 --steps 5

It behaves like a full-fine-tuning trainer under slicerd: each turn it ACQUIREs, makes
sure its working set is on the (fake) GPU, "trains" for `--work` seconds, and RELEASEs.
With `--park checkpoint` (default) the daemon moves its memory with cuda-checkpoint; with
`--park cooperative` it frees its memory itself before each RELEASE (an offload) and
allocates it again after each grant. A FAULT makes it exit 3, as a real trainer must.
When run under `slicer-launch` it is not the registrant and only takes turns.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from slicer.client import ClientError, Faulted, Slicer
from stubs.fakegpu import Ledger, parse_size


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
    args = p.parse_args(argv)
    nbytes = parse_size(args.bytes)
    ledger = Ledger()
    pid = os.getpid()
    try:
        with Slicer(args.socket, args.workload) as s:
            if not args.no_register:
                s.register(args.workload, gpu=args.gpu, park=args.park)
            for step in range(args.steps):
                with s.turn(park="lazy") as t:
                    have = sum(m.on_device for m in ledger.processes(args.gpu) if m.pid == pid)
                    if have < nbytes:
                        ledger.alloc(
                            pid, args.gpu, nbytes - have, tag="weights", workload=args.workload
                        )
                    print(f"step {step} turn {t.turn} restored={int(t.restored)}", flush=True)
                    time.sleep(args.work)  # the "training step"
                    if args.park == "cooperative":
                        ledger.free(pid)
    except Faulted as e:
        print(f"trainer_stub: FAULT: {e}", file=sys.stderr)
        return 3
    except ClientError as e:
        print(f"trainer_stub: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
