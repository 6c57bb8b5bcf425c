"""The restart journal: which workloads exist, their processes and park state.

A small JSON file in the state dir. It sits on the grant path (a park is journaled before
anyone else is granted), so a save is one `pwrite` of the whole document at offset 0,
padded with spaces to the previous length, then a truncate: a SIGKILL between the two
leaves valid JSON followed by whitespace, and no syscall can be torn by a process kill.
No fsync on purpose: it must survive a crash of the daemon (the page cache does); a power
loss kills the workloads with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slicer.errors import SlicerError

VERSION = 1


class Journal:
    """Reads and writes `<state_dir>/journal.json`."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / "journal.json"
        self._fd: int | None = None
        self._size = 0
        self._last = b""

    def load(self) -> list[dict[str, Any]]:
        """The journaled workloads, or [] when there is no journal yet."""
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise SlicerError(f"journal {self.path} is unreadable: {e}") from e
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise SlicerError(f"journal {self.path} has an unknown format")
        workloads = doc.get("workloads", [])
        if not isinstance(workloads, list):
            raise SlicerError(f"journal {self.path}: workloads is not a list")
        return [w for w in workloads if isinstance(w, dict)]

    def save(self, workloads: list[dict[str, Any]]) -> None:
        """Replace the journal with `workloads` (a no-op when nothing changed)."""
        data = json.dumps({"version": VERSION, "workloads": workloads}).encode()
        if data == self._last:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            self._size = os.fstat(self._fd).st_size
        os.pwrite(self._fd, data + b" " * max(0, self._size - len(data)), 0)
        os.ftruncate(self._fd, len(data))
        self._size, self._last = len(data), data

    def close(self) -> None:
        """Close the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
