"""Integration harness of the tests: the test doubles' stack harness, `stubs.stack`.

A real slicerd on a fake GPU, real sockets, real child processes. Readiness is an event,
not a sleep: slicerd is started with NOTIFY_SOCKET pointing at a datagram socket of ours
and we wait for its READY=1, exactly as systemd does. State changes are awaited through
STATUS re-read after each WATCH event (`Stack.until`). The tests' shared waits live here
too: `queue_is` (a `Stack.until` condition), `next_of` / `next_fault` (the next
unsolicited line of a kind on a client).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from gpu_slicer import proto
from gpu_slicer.slicer.client import AsyncSlicer
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
    "event_index",
    "events_until",
    "next_fault",
    "next_of",
    "queue_is",
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

M = TypeVar("M")


def queue_is(names: list[str], gpu: int = 0) -> Callable[[dict[str, Any]], bool]:
    """A `Stack.until` condition: GPU `gpu`'s wait queue is exactly `names`, in order."""
    return lambda st: st["gpus"][gpu]["queue"] == names


async def next_of(client: AsyncSlicer, kind: type[M]) -> M:
    """The next unsolicited line of type `kind` on `client` (others before it, such as
    WAITING hints, are skipped)."""
    while True:
        msg = await client.next_message()
        if isinstance(msg, kind):
            return msg


async def next_fault(client: AsyncSlicer) -> proto.Fault:
    """The next FAULT line on `client` (WAITING hints before it are skipped)."""
    return await next_of(client, proto.Fault)


async def events_until(
    watch: AsyncSlicer, pred: Callable[[dict[str, Any]], bool], seen: list[dict[str, Any]]
) -> None:
    """Collect slicerd's WATCH events into `seen` until one satisfies `pred`."""
    while True:
        msg = await watch.next_message()
        if isinstance(msg, proto.Event):
            seen.append(msg.body)
            if pred(msg.body):
                return


def event_index(seen: list[dict[str, Any]], event: str, name: str) -> int:
    """The position in `seen` of the first `event` about workload `name`."""
    return next(i for i, e in enumerate(seen) if e["event"] == event and e["workload"] == name)
