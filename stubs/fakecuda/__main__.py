"""``python -m stubs.fakecuda DEST [--no-checkpoint-api]``: build the fake libcuda, print
its path."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stubs.fakecuda import BuildError, build


def main(argv: list[str] | None = None) -> int:
    """Build the library into DEST and print the path of its ``libcuda.so.1``."""
    parser = argparse.ArgumentParser(prog="python -m stubs.fakecuda", description=__doc__)
    parser.add_argument("dest", type=Path, help="the cache folder to build into")
    parser.add_argument(
        "--no-checkpoint-api", action="store_true", help="an r550-like driver: no cuCheckpoint*"
    )
    args = parser.parse_args(argv)
    try:
        print(build(args.dest, checkpoint_api=not args.no_checkpoint_api))
    except BuildError as exc:
        print(f"stubs.fakecuda: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
