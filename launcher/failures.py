"""The launcher's own failures, each said in one line: what is wrong, then what to do.

`slicer-launch` ends with the child's code when the child ran; when the launcher itself
cannot go on (REGISTER refused, slicerd out of reach, COMMAND missing, a FAULT, a failed
vLLM boot) it prints one ``slicer-launch: error: ...`` line (`slicer.exits`) and exits
with the documented code. This module words those lines, and checks COMMAND before the
workload is registered, so a typo costs no registration and no boot turn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from gpu_slicer.launcher.config import Exit

# What to do about each ERR code of a refused REGISTER (PROTOCOL.md's codes).
_REFUSED_HINTS = {
    "exists": "another launcher holds that name: pick another --workload, or stop that one",
    "bad-name": "a name is 1-128 letters, digits and _ . : - , starting with a letter or digit",
    "unknown-gpu": "see the node's GPUs with 'slicerctl status' and fix --gpu",
    "forbidden": "this user may not register these processes or this name: run the "
    "launcher as the workload's owner",
    "in-use": "this process already belongs to another workload",
    "no-such-process": "slicerd cannot see this process (another PID namespace?)",
    "limit": "slicerd reached one of its limits: see its log",
}


def refused(workload: str, code: str, text: str) -> str:
    """The line for a REGISTER of `workload` refused with ERR `code` `text`."""
    hint = _REFUSED_HINTS.get(code, "see slicerd's log")
    return f"REGISTER {workload!r} refused: {code}: {text} ({hint})"


def unreachable(socket: str, why: str, waited: float) -> str:
    """The line for a slicerd that stayed out of reach at `socket` for `waited` s."""
    why = why.removeprefix(f"cannot connect to {socket}: ")
    return (
        f"cannot reach slicerd at {socket} (tried for {waited:g} s): {why} "
        "(start slicerd, or give its socket with --socket or SLICER_SOCKET)"
    )


def command_problem(argv: Sequence[str], path: str | None) -> tuple[int, str] | None:
    """Why COMMAND (``argv[0]``, looked up in `path` as exec does) cannot run, as
    ``(code, line)`` with a shell's codes (127 not found, 126 not executable); None when
    it can. The start itself still maps an OSError the same way (the file may change)."""
    cmd = argv[0]
    found = [c for c in _candidates(cmd, path) if os.path.exists(c)]
    runnable = [c for c in found if os.path.isfile(c) and os.access(c, os.X_OK)]
    if runnable:
        bad = bad_interpreter(runnable[0])
        if bad is None:
            return None
        return Exit.NOT_EXECUTABLE, start_failed(cmd, bad, Exit.NOT_EXECUTABLE)
    if not found:
        where = "no such file" if "/" in cmd else "not found on PATH"
        return Exit.NOT_FOUND, start_failed(cmd, f"{where}", Exit.NOT_FOUND)
    what = "is a directory" if os.path.isdir(found[0]) else "is not executable"
    return Exit.NOT_EXECUTABLE, start_failed(cmd, f"{found[0]} {what}", Exit.NOT_EXECUTABLE)


def _candidates(cmd: str, path: str | None) -> list[str]:
    if "/" in cmd:
        return [cmd]
    dirs = (path if path is not None else os.defpath).split(os.pathsep)
    return [os.path.join(d or ".", cmd) for d in dirs]


def found_but_bad(cmd: str, env: Mapping[str, str]) -> str | None:
    """For an exec of `cmd` that failed with "No such file": the bad-interpreter reason
    when `cmd` (looked up in `env`'s PATH) is a script whose ``#!`` names no program."""
    for c in _candidates(cmd, env.get("PATH")):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return bad_interpreter(c)
    return None


def bad_interpreter(path: str) -> str | None:
    """Why the ``#!`` interpreter of script `path` cannot run (as a shell's "bad
    interpreter"), or None when it can or `path` is no script."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None  # unreadable: exec itself will say why
    if not first.startswith(b"#!"):
        return None
    words = first[2:].split()
    if not words:
        return "bad interpreter: its #! line names none"
    interp = os.fsdecode(words[0])
    if not os.path.isfile(interp):
        return f"bad interpreter {interp}: No such file or directory"
    if not os.access(interp, os.X_OK):
        return f"bad interpreter {interp}: not executable"
    return None


def start_failed(cmd: str, why: str, code: int) -> str:
    """The line for a COMMAND that cannot be started (`code` 127 or 126)."""
    if code == Exit.NOT_FOUND:
        todo = "check COMMAND and PATH"
    elif why.startswith("bad interpreter"):
        todo = "fix its #! line, or run it through its interpreter"
    else:
        todo = "make it executable, or run it through its interpreter"
    return f"cannot start {cmd}: {why} ({todo})"
