"""A stand-in for NVIDIA's ``cuda-checkpoint`` that acts on the fake GPU ledger.

Same CLI as the real tool (``--get-state``, ``--action lock|checkpoint|restore|unlock``,
``--toggle``, ``--pid``, ``--timeout``, ``--help``), same states and exit codes: 0 on
success, 1 with a message on stderr on any failure, 2 on bad usage (argparse).

Theory of operation
-------------------
States per pid live in the ledger (``Ledger.state``)::

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running
    --toggle: running -> checkpointed (lock + checkpoint), checkpointed -> running
      (restore + unlock)

Any other transition exits 1 and leaves the state unchanged. A pid that does not exist
exits 1 ("no such process"); a live pid without ledger memory is "not a CUDA process"
(exit 1, OPERATION_NOT_SUPPORTED), for ``--get-state`` too.

``--pid P`` is read in the tool's own PID namespace, as the real tool reads it (slicerd
runs it, possibly inside a pod), and translated once to the host pid that the ledger and
the process identity use (``stubs.fakegpu.hostpid``); messages name P. A P that no
process of the tool's namespace has, even if a process outside has that number, is "no
such process".

- checkpoint sleeps bytes / ``$FAKEGPU_BANDWIDTH`` (bytes/s, default 25e9, ``25GB``
  forms accepted) while the memory is still on device, then moves it to host.
- restore checks free memory first; past capacity it exits 1 ("out of memory"), the
  memory stays on host, the state stays ``checkpointed`` and the pid is marked *stuck*
  (``Ledger.set_stuck``): every later restore fails too, and unlock is illegal from
  checkpointed, so the process is stuck for good, as on the real driver. Otherwise it
  sleeps bytes / bandwidth, then moves the memory back.
- Injected failures (``Ledger.inject``): ``fail`` exits 1 and sets the state to
  ``failed``, which is terminal (every later action exits 1; ``--get-state`` prints
  ``failed``). ``hang`` blocks, polling every 50 ms, until the injection is cleared
  (then the op proceeds normally), the target exits (exit 1), ``--timeout`` ms pass for
  lock (exit 1, state stays running) or ``$FAKEGPU_HANG_MAX`` s (default 600) pass
  (exit 1, state unchanged). ``--toggle`` honours the lock/checkpoint or restore/unlock
  injections.
- Killing the tool mid-operation desynchronises the real driver: SIGTERM or SIGINT
  during an action sets the target's state to ``failed`` and exits 143 / 130.
- ``FAKEGPU_CC_TOGGLE_ONLY=1`` emulates an r550 driver: ``--help`` has no ``--action``
  and ``--action`` is an unrecognised option (exit 2).
- ``$FAKEGPU_CUINIT_S`` (seconds, default 0): the fixed driver-initialisation cost
  (``cuInit``, ~2.7 s per launch on real hardware) that every invocation running an
  operation (not ``--help`` nor a usage error) pays first, before it looks at the target
  or the ledger. The fake libcuda (``stubs.fakecuda``) pays it once per process instead:
  that is the lever.
- ``$FAKEGPU_CC_LOG``: a file to which each invocation appends one JSON line
  (``time``, ``via`` (``"cli"``; the fake libcuda writes ``"lib"``), ``argv``, ``pid``,
  ``op``, ``rc`` (exit status), ``code`` (the ``CUresult`` the driver API returns for the
  same outcome, None when killed), ``error``, ``state_before``, ``state_after``,
  ``duration`` (of the operation, the start cost excluded), ``caller`` (the pid of the
  process that paid the start cost), ``cuinit_at`` (``time.monotonic()`` when that
  process finished paying it) and ``cuinit_s``).

The op logic (``do_action``, ``get_state``) and the log line (``log_call``) are shared
with the fake libcuda (``stubs.fakecuda.driver``), so the two act identically; each
failure carries the ``CUresult`` the library returns for it (``ToolError.code``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from types import FrameType

from stubs.fakecuda.results import CUresult
from stubs.fakegpu import (
    FakeGpuError,
    HostPid,
    Ledger,
    OutOfMemory,
    format_size,
    parse_size,
    process_identity,
    to_host,
)

TRANSITIONS: dict[str, tuple[str, str]] = {
    "lock": ("running", "locked"),
    "checkpoint": ("locked", "checkpointed"),
    "restore": ("checkpointed", "locked"),
    "unlock": ("locked", "running"),
}
POLL_S = 0.05
# The CUresult of each outcome (the fake libcuda returns these; see stubs.fakecuda.driver).
_GONE = CUresult.CUDA_ERROR_NOT_FOUND  # no such process in the caller's namespace, or it exited
_ILLEGAL = CUresult.CUDA_ERROR_ILLEGAL_STATE  # illegal transition, or the process is failed
_OOM = CUresult.CUDA_ERROR_OUT_OF_MEMORY  # restore past capacity: stuck checkpointed
_TIMEOUT = CUresult.CUDA_ERROR_TIMEOUT  # lock past --timeout, or a hang past FAKEGPU_HANG_MAX
_ENV_ERROR = CUresult.CUDA_ERROR_OPERATING_SYSTEM  # the fake's own setting or ledger is bad

_HEAD = """CUDA checkpoint and restore utility.
Toggles the state of CUDA within a process between suspended and running.
Version 550.54.15 (fake GPU stub). Copyright (C) 2024 NVIDIA Corporation. All rights reserved.
"""
_TOGGLE = """
    --toggle --pid <value>
        Toggle the state of CUDA in the specified process.
"""
_ACTION = """
    --action <value> --pid <value> [--timeout <value>]
        Perform the specified action on the process.
        Actions:
            lock        Lock the process, blocking further CUDA API calls.
                        --timeout <ms> bounds the wait for submitted work.
            checkpoint  Checkpoint GPU memory to host memory and release the GPU.
            restore     Restore GPU memory; the process stays locked.
            unlock      Unlock the process, resuming CUDA API calls.
"""
_TAIL = """
    --get-state --pid <value>
        Print the current state of CUDA in the specified process
        (running, locked, checkpointed or failed).

    --help
        Print help message.
"""


class ToolError(Exception):
    """A failure the tool reports on stderr with exit status 1; ``code`` is the
    ``CUresult`` the driver API (the fake libcuda) returns for it."""

    def __init__(self, message: str, code: CUresult) -> None:
        super().__init__(message)
        self.code = code


class _Killed(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def toggle_only() -> bool:
    """Whether ``$FAKEGPU_CC_TOGGLE_ONLY`` asks for an r550 (toggle-only) tool."""
    return os.environ.get("FAKEGPU_CC_TOGGLE_ONLY", "") not in ("", "0")


def help_text() -> str:
    """The ``--help`` text (without ``--action`` in toggle-only mode)."""
    return _HEAD + _TOGGLE + ("" if toggle_only() else _ACTION) + _TAIL


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the stub (no ``--action`` in toggle-only mode)."""
    parser = argparse.ArgumentParser(prog="cuda-checkpoint", add_help=False, allow_abbrev=False)
    parser.add_argument("--help", action="store_true")
    parser.add_argument("--get-state", action="store_true")
    parser.add_argument("--toggle", action="store_true")
    if not toggle_only():
        parser.add_argument("--action", choices=tuple(TRANSITIONS))
        parser.add_argument("--timeout", type=int, metavar="MS")
    parser.add_argument("--pid", type=int)
    return parser


def _bandwidth() -> float:
    text = os.environ.get("FAKEGPU_BANDWIDTH", "")
    try:
        bandwidth = float(parse_size(text)) if text else 25e9
    except ValueError as exc:
        raise ToolError(f"bad FAKEGPU_BANDWIDTH: {exc}", _ENV_ERROR) from exc
    if bandwidth <= 0:
        raise ToolError(f"bad FAKEGPU_BANDWIDTH: {text!r}", _ENV_ERROR)
    return bandwidth


def cuinit_seconds() -> float:
    """``$FAKEGPU_CUINIT_S``: the fixed driver-initialisation cost in seconds (default 0)."""
    text = os.environ.get("FAKEGPU_CUINIT_S", "")
    try:
        seconds = float(text) if text else 0.0
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also rejects nan
        raise ToolError(f"bad FAKEGPU_CUINIT_S: {text!r}", _ENV_ERROR)
    return seconds


def _memory(ledger: Ledger, host: HostPid) -> tuple[dict[int, int], dict[int, int]]:
    """(on-device, on-host) bytes of host pid ``host`` per GPU."""
    device: dict[int, int] = {}
    on_host: dict[int, int] = {}
    for row in ledger.processes():
        if row.pid == host:
            device[row.gpu] = device.get(row.gpu, 0) + row.on_device
            on_host[row.gpu] = on_host.get(row.gpu, 0) + row.on_host
    return device, on_host


def _target(ledger: Ledger, pid: int, verb: str) -> tuple[HostPid, float]:
    """Check ``pid`` (in this tool's PID namespace) is a live CUDA process; returns its
    host pid and its identity (start time)."""
    try:
        host = to_host(pid)
    except FakeGpuError:
        raise ToolError(f"Could not {verb} process {pid}: no such process", _GONE) from None
    ident = process_identity(host)
    if ident is None:
        raise ToolError(f"Could not {verb} process {pid}: no such process", _GONE)
    on_device, on_host = _memory(ledger, host)
    if not on_device and not on_host:
        raise ToolError(
            f"Could not {verb} process {pid}: OPERATION_NOT_SUPPORTED (not a CUDA process)",
            CUresult.CUDA_ERROR_NOT_SUPPORTED,
        )
    return host, ident


def _await_injection(
    ledger: Ledger, pid: int, host: HostPid, ident: float, op: str, timeout_ms: int | None
) -> None:
    """Apply an injected ``fail``/``hang`` for ``op``; returns when the op may proceed."""
    start = time.monotonic()
    hang_max = float(os.environ.get("FAKEGPU_HANG_MAX", "600"))
    while True:
        kind = ledger.injection(host, op)
        # Looked at after the injection: the ledger reads a dead process as having none,
        # and the op must then fail as gone, not proceed on it (a ledger error, 304).
        if process_identity(host) != ident:
            raise ToolError(f"Could not {op} process {pid}: process exited", _GONE)
        if kind is None:
            return
        if kind == "fail":
            ledger.set_state(host, "failed")
            raise ToolError(
                f"Could not {op} process {pid}: CUDA_ERROR_UNKNOWN (injected)",
                CUresult.CUDA_ERROR_UNKNOWN,
            )
        waited = time.monotonic() - start
        if op == "lock" and timeout_ms is not None and waited * 1000 >= timeout_ms:
            raise ToolError(
                f"Could not lock process {pid}: lock timed out after {timeout_ms} ms", _TIMEOUT
            )
        if waited >= hang_max:
            raise ToolError(
                f"Could not {op} process {pid}: timed out after {hang_max:g} s", _TIMEOUT
            )
        time.sleep(POLL_S)


def get_state(ledger: Ledger, pid: int) -> str:
    """``--get-state``: the state of ``pid`` (in this tool's PID namespace); raises
    ToolError when it is no live CUDA process."""
    host, _ = _target(ledger, pid, "get state of")
    return ledger.state(host)


def do_action(ledger: Ledger, pid: int, op: str, timeout_ms: int | None = None) -> None:
    """Perform one ``--action`` on ``pid`` (in this tool's PID namespace); raises
    ToolError on any failure."""
    host, ident = _target(ledger, pid, op)
    state = ledger.state(host)
    if state == "failed":
        raise ToolError(f"Could not {op} process {pid}: process is in failed state", _ILLEGAL)
    src, dst = TRANSITIONS[op]
    if state != src:
        raise ToolError(
            f"Could not {op} process {pid}: process is {state}, expected {src}", _ILLEGAL
        )
    if op == "restore" and ledger.is_stuck(host):
        raise ToolError(
            f"Could not restore process {pid}: out of memory on an earlier restore;"
            " process is stuck checkpointed",
            _OOM,
        )
    _await_injection(ledger, pid, host, ident, op, timeout_ms)
    if op == "checkpoint":
        device, _ = _memory(ledger, host)
        time.sleep(sum(device.values()) / _bandwidth())
        ledger.move(host, to_device=False)
    elif op == "restore":
        _, on_host = _memory(ledger, host)
        free = {g.index: g.free for g in ledger.gpus()}
        for gpu, nbytes in sorted(on_host.items()):
            if nbytes > free.get(gpu, 0):
                ledger.set_stuck(host)
                raise ToolError(
                    f"Could not restore process {pid}: out of memory (needs"
                    f" {format_size(nbytes)} on GPU {gpu}, {format_size(free.get(gpu, 0))} free)",
                    _OOM,
                )
        time.sleep(sum(on_host.values()) / _bandwidth())
        try:
            ledger.move(host, to_device=True)
        except OutOfMemory as exc:
            ledger.set_stuck(host)
            raise ToolError(
                f"Could not restore process {pid}: out of memory ({exc})", _OOM
            ) from exc
    ledger.set_state(host, dst)


def do_toggle(ledger: Ledger, pid: int) -> None:
    """``--toggle``: running -> checkpointed or checkpointed -> running."""
    host, _ = _target(ledger, pid, "toggle")
    state = ledger.state(host)
    if state == "running":
        steps = ("lock", "checkpoint")
    elif state == "checkpointed":
        steps = ("restore", "unlock")
    else:
        raise ToolError(f"Could not toggle process {pid}: process is {state}", _ILLEGAL)
    for op in steps:
        do_action(ledger, pid, op)


def error_code(exc: Exception) -> CUresult:
    """The ``CUresult`` of a failure the op logic raised (ToolError or FakeGpuError)."""
    return exc.code if isinstance(exc, ToolError) else _ENV_ERROR


def log_call(
    *,
    via: str,
    argv: list[str] | None,
    pid: int,
    op: str,
    rc: int,
    code: int | None,
    error: str | None,
    before: str | None,
    started: float,
    cuinit_at: float,
    cuinit_s: float,
) -> None:
    """Append one call's JSON line to ``$FAKEGPU_CC_LOG`` (no-op when unset); ``started``
    is the ``time.monotonic()`` at which the operation began."""
    _log(
        {
            "time": time.time(),
            "via": via,
            "argv": argv,
            "pid": pid,
            "op": op,
            "rc": rc,
            "code": code,
            "error": error,
            "state_before": before,
            "state_after": state_or_none(pid),
            "duration": time.monotonic() - started,
            "caller": os.getpid(),
            "cuinit_at": cuinit_at,
            "cuinit_s": cuinit_s,
        }
    )


def _log(entry: dict[str, object]) -> None:
    path = os.environ.get("FAKEGPU_CC_LOG")
    if not path:
        return
    line = (json.dumps(entry) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def state_or_none(pid: int) -> str | None:
    """The ledger state of ``pid`` for the log, None when there is no ledger."""
    try:
        return Ledger().state(pid)
    except FakeGpuError:
        return None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Killed(signum)


def _run(args: argparse.Namespace, op: str) -> None:
    ledger = Ledger()
    if op == "get-state":
        print(get_state(ledger, args.pid))
        return
    old_term = signal.signal(signal.SIGTERM, _on_signal)
    old_int = signal.signal(signal.SIGINT, _on_signal)
    try:
        if op == "toggle":
            do_toggle(ledger, args.pid)
        else:
            do_action(ledger, args.pid, op, args.timeout)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def main(argv: list[str] | None = None) -> int:
    """Run the stub; returns the exit status (argparse exits 2 on usage errors)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help:
        print(help_text(), end="")
        return 0
    action = getattr(args, "action", None)
    ops = [o for o, on in (("get-state", args.get_state), ("toggle", args.toggle)) if on]
    ops += [action] if action else []
    if len(ops) != 1:
        parser.error("exactly one of --get-state, --toggle or --action is required")
    if args.pid is None:
        parser.error("--pid is required")
    op = ops[0]
    rc, error = 0, None
    code: CUresult | None = CUresult.CUDA_SUCCESS
    try:
        cuinit_s = cuinit_seconds()
    except ToolError as exc:
        print(f"cuda-checkpoint: {exc}", file=sys.stderr)
        return 1
    time.sleep(cuinit_s)  # every launch initialises the driver anew
    cuinit_at = started = time.monotonic()
    before = state_or_none(args.pid)
    try:
        _run(args, op)
    except (ToolError, FakeGpuError) as exc:
        rc, error, code = 1, str(exc), error_code(exc)
    except _Killed as exc:
        rc, error, code = 128 + exc.signum, f"killed by signal {exc.signum} mid-operation", None
        with contextlib.suppress(FakeGpuError):
            Ledger().set_state(args.pid, "failed")
    if error is not None:
        print(f"cuda-checkpoint: {error}", file=sys.stderr)
    log_call(
        via="cli",
        argv=argv,
        pid=args.pid,
        op=op,
        rc=rc,
        code=code,
        error=error,
        before=before,
        started=started,
        cuinit_at=cuinit_at,
        cuinit_s=cuinit_s,
    )
    return rc
