"""A fake ``libcuda.so.1``: the driver's checkpoint API on the fake GPU ledger, for CI.

slicerd's driver parker runs a helper process that loads the driver library with ctypes
and calls ``cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState``. Tests build this
library from ``fakecuda.c`` with gcc (:func:`build`) and point slicerd's ``libcuda`` at it;
its calls act on the ledger exactly as the ``cuda-checkpoint`` stub does, because both run
the same op logic (``stubs.fakecuda.driver``, whose docstring lists the ``CUresult`` of
each outcome). The library works only when loaded into a Python process (the helper is
one): it calls back into that interpreter.

``python -m stubs.fakecuda DEST [--no-checkpoint-api]`` builds it and prints its path.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

__all__ = ["LIBRARY", "BuildError", "build"]

LIBRARY = "libcuda.so.1"
SOURCE = "fakecuda.c"
_FLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden")
_NO_API = "-DFAKECUDA_NO_CHECKPOINT_API"


class BuildError(RuntimeError):
    """The fake libcuda could not be built (no C compiler, or it failed)."""


def build(dest: Path, *, checkpoint_api: bool = True) -> Path:
    """Build the fake driver library under ``dest`` and return the path of its
    ``libcuda.so.1``.

    ``checkpoint_api=False`` builds an r550-like driver: ``cuInit``, ``cuDriverGetVersion``
    and ``cuGetErrorName``/``String`` but no ``cuCheckpoint*`` symbol. The result lives in
    a folder named by a hash of the source and the flags, so a second call is free; it is
    built in a private folder and renamed into place, so any number of processes may
    build into one ``dest`` at once. The compiler is ``$CC``, else ``gcc``; BuildError
    when it is missing or fails.
    """
    # Imported here: every call of the cuda-checkpoint stub imports this package (for its
    # .results), some thousands a test run, and only a build needs these modules.
    import hashlib
    import shutil
    import subprocess
    import tempfile
    from importlib import resources

    source = resources.files(__name__).joinpath(SOURCE).read_bytes()
    compiler = os.environ.get("CC") or "gcc"
    flags = [*_FLAGS, *(() if checkpoint_api else (_NO_API,))]
    digest = hashlib.sha256(b"\0".join([source, compiler.encode(), *map(str.encode, flags)]))
    kind = "api" if checkpoint_api else "noapi"
    final = Path(dest) / f"fakecuda-{kind}-{digest.hexdigest()[:16]}"
    if (final / LIBRARY).is_file():
        return final / LIBRARY
    gcc = shutil.which(compiler)
    if gcc is None:
        raise BuildError(
            f"cannot build the fake libcuda: no C compiler {compiler!r} on PATH"
            " (install gcc, or set $CC)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fakecuda-", dir=final.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the helper may run as another user
    try:
        (work / SOURCE).write_bytes(source)
        res = subprocess.run(
            [gcc, *flags, "-o", str(work / LIBRARY), str(work / SOURCE)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            raise BuildError(f"{compiler} failed ({res.returncode}) on {SOURCE}:\n{res.stderr}")
        try:
            os.rename(work, final)
        except OSError as exc:
            # Another process renamed its build into place first: it is the same library.
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(work)
    return final / LIBRARY
