"""``python -m stubs.fakegpu``: drive the fake GPU ledger from a shell.

Exit codes: 0 success, 1 fake GPU errors (OOM, unknown GPU, dead pid, nonzero
``overlaps``), 2 usage errors.

``--pid`` is read in the caller's PID namespace (the ledger translates it to the host
pid, ``stubs.fakegpu.hostpid``); ``show`` prints host pids, as ``nvidia-smi`` does.
``alloc`` books memory on behalf of the pid: it opens no device node for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stubs.fakegpu.ledger import CC_OPS, FakeGpuError, Ledger
from stubs.fakegpu.sizes import format_size, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the fake GPU CLI."""
    parser = argparse.ArgumentParser(prog="python -m stubs.fakegpu", description=__doc__)
    parser.add_argument("--dir", help="ledger directory (default: $FAKEGPU_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="(re)create a fresh ledger")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--capacity", type=_size, required=True, help="per GPU, e.g. 80GiB")

    p = sub.add_parser("alloc", help="put bytes on a GPU for a live pid")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--bytes", type=_size, required=True, dest="nbytes")
    p.add_argument("--tag", default="main")
    p.add_argument("--workload")
    p.add_argument("--allowance", type=_size)

    p = sub.add_parser("free", help="free a pid's memory (one tag or all)")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--tag")

    p = sub.add_parser("show", help="print GPUs, processes, states and overlaps")
    p.add_argument("--json", action="store_true")

    sub.add_parser("overlaps", help="print the overlap count; exit 1 when not 0")

    p = sub.add_parser("fail", help="make cuda-checkpoint fail (or hang) on an op for a pid")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--op", choices=CC_OPS, required=True)
    p.add_argument("--hang", action="store_true")

    p = sub.add_parser("clear", help="clear injected cuda-checkpoint failures of a pid")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--op", choices=CC_OPS)
    return parser


def _show(snap: dict[str, Any]) -> str:
    lines = []
    for g in snap["gpus"]:
        lines.append(
            f"gpu {g['index']} {g['uuid']}: {format_size(g['used'])} used"
            f" / {format_size(g['total'])} ({format_size(g['free'])} free)"
        )
    states = {p["pid"]: p for p in snap["processes"]}
    for m in snap["memory"]:
        proc = states.get(m["pid"], {})
        lines.append(
            f"  pid {m['pid']} gpu {m['gpu']} [{m['workload']}] {proc.get('state', 'running')}:"
            f" device {format_size(m['on_device'])}, host {format_size(m['on_host'])}"
        )
    for inj in snap["injections"]:
        lines.append(f"  inject pid {inj['pid']} {inj['op']}: {inj['kind']}")
    lines.append(f"overlaps: {snap['overlaps']}")
    for o in snap["overlap_log"]:
        lines.append(f"  gpu {o['gpu']} at {o['time']:.3f}: {', '.join(o['workloads'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (argparse exits 2 on usage errors)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "init":
            Ledger.init(args.dir, args.gpus, args.capacity)
            return 0
        ledger = Ledger(args.dir)
        if args.command == "alloc":
            ledger.alloc(args.pid, args.gpu, args.nbytes, args.tag, args.workload, args.allowance)
        elif args.command == "free":
            print(ledger.free(args.pid, args.tag))
        elif args.command == "show":
            snap = ledger.snapshot()
            print(json.dumps(snap, indent=2) if args.json else _show(snap))
        elif args.command == "overlaps":
            count = ledger.overlaps()
            print(count)
            return 1 if count else 0
        elif args.command == "fail":
            ledger.inject(args.pid, args.op, hang=args.hang)
        elif args.command == "clear":
            ledger.clear_injection(args.pid, args.op)
    except FakeGpuError as exc:
        print(f"fakegpu: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
