"""The restart journal: which workloads exist, their processes and park state.

A small JSON file in the state dir, replaced atomically (write, rename). It is written
without fsync on purpose: it must survive a SIGKILL of the daemon (the page cache does), and
a power loss kills the workloads with it.
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

    def load(self) -> list[dict[str, Any]]:
        """The journaled workloads, or [] when there is no journal yet."""
        try:
            doc = json.loads(self.path.read_text())
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
        """Replace the journal with `workloads`."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "workloads": workloads}))
        os.replace(tmp, self.path)
