"""Integration harness of the tests: the test doubles' stack harness, `stubs.stack`.

A real slicerd on a fake GPU, real sockets, real child processes. Readiness is an event,
not a sleep: slicerd is started with NOTIFY_SOCKET pointing at a datagram socket of ours
and we wait for its READY=1, exactly as systemd does. State changes are awaited through
STATUS re-read after each WATCH event (`Stack.until`).
"""

import os
import shutil

import pytest

from stubs.stack import (
    ROOT,
    TOOL,
    GiB,
    Stack,
    cc_log,
    running_stack,
    state_of,
    workload,
)

__all__ = [
    "POD_TESTS",
    "ROOT",
    "TOOL",
    "GiB",
    "Stack",
    "cc_log",
    "running_stack",
    "state_of",
    "workload",
]

# The marks of a test module that simulates pods (`stubs.pods`): child processes, a bound
# above the tests' own trio bounds (the thread-method backstop would os._exit first), and
# what a pod needs of the machine.
POD_TESTS = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="a pod simulation needs root and unshare(1)",
    ),
]
