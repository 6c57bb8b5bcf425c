"""The fake GPU: a process-safe SQLite ledger of GPU memory, for tests without a GPU.

See ``ledger.py`` for the theory of operation and ``python -m stubs.fakegpu --help``
for the CLI.
"""

from stubs.fakegpu.hostpid import host_namespace, host_proc, to_host
from stubs.fakegpu.ledger import (
    CC_OPS,
    CC_STATES,
    FakeGpuError,
    GpuInfo,
    HostPid,
    Ledger,
    OutOfMemory,
    ProcMem,
    UnknownGpu,
    process_identity,
)
from stubs.fakegpu.sizes import format_size, parse_size

__all__ = [
    "CC_OPS",
    "CC_STATES",
    "FakeGpuError",
    "GpuInfo",
    "HostPid",
    "Ledger",
    "OutOfMemory",
    "ProcMem",
    "UnknownGpu",
    "format_size",
    "host_namespace",
    "host_proc",
    "parse_size",
    "process_identity",
    "to_host",
]
