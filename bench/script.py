"""How a benchmark script ends: its exit status, and 130 after Ctrl-C.

The benchmarks start their processes through the test doubles' stack harness
(`stubs.stack`), which stops them on the way out; this is only the script's own exit."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run_script(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; 130 on Ctrl-C, also when trio wrapped it in a group."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseExceptionGroup as eg:
        if eg.split(KeyboardInterrupt)[1] is None:
            sys.exit(130)
        raise
