"""Integration harness of the tests: the test doubles' stack harness, `stubs.stack`.

A real slicerd on a fake GPU, real sockets, real child processes. Readiness is an event,
not a sleep: slicerd is started with NOTIFY_SOCKET pointing at a datagram socket of ours
and we wait for its READY=1, exactly as systemd does. State changes are awaited through
STATUS re-read after each WATCH event (`Stack.until`).
"""

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

__all__ = ["ROOT", "TOOL", "GiB", "Stack", "cc_log", "running_stack", "state_of", "workload"]
