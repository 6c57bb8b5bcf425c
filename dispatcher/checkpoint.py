"""What the dispatcher accepts as a revision's checkpoint directory, checked at publish.

The replica loads a revision with ``collective_rpc reload_weights`` from its ``path``
(shared/VLLM_API.md), which needs a directory of weight files. A path that is not one
(mistyped, deleted by a retention policy before it was published, a file) would only
fail inside a turn, after a wake and a broken load, so ``POST /v1/revisions`` refuses it
with a 400 instead. The check is what a reader on this host can see: the path exists, is
a directory, can be listed, and holds at least one entry (``config.json`` and the weight
files for vLLM; ``revision.txt`` for the stub). It cannot tell that the weights inside
are good: a revision whose load fails anyway is backed off and, after a bounded number
of refused loads, failed by the turn loop (:mod:`dispatcher.serve`).

The dispatcher must see the path as the replica sees it (same host or the same mount at
the same place); ``slicer-dispatch --no-check-revision-paths`` turns the check off for
a replica whose file system the dispatcher does not share.
"""

from __future__ import annotations

import os

from gpu_slicer.dispatcher.errors import BadRequest

__all__ = ["MAX_PATH_CHARS", "check_checkpoint_dir", "check_path_text"]

MAX_PATH_CHARS = 4096


def check_path_text(path: object) -> str:
    """``path`` if it is usable text for a path; :class:`BadRequest` saying why not."""
    if not isinstance(path, str) or not path or "\0" in path or len(path) > MAX_PATH_CHARS:
        raise BadRequest(
            f"path must be a non-empty string (<= {MAX_PATH_CHARS} chars), got {path!r:.200}"
        )
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"path contains a lone UTF-16 surrogate at offset {e.start}, which no file "
            "name can hold"
        ) from None
    return path


def check_checkpoint_dir(path: str) -> None:
    """Refuse ``path`` (:class:`BadRequest`) unless it is a readable, non-empty directory
    (see the module docstring)."""
    check_path_text(path)
    if not os.path.isabs(path):
        raise BadRequest(f"path must be absolute (the replica resolves it), got {path!r:.200}")
    try:
        with os.scandir(path) as entries:
            empty = next(entries, None) is None
    except FileNotFoundError:
        raise BadRequest(f"path {path!r:.200}: no such directory") from None
    except NotADirectoryError:
        raise BadRequest(f"path {path!r:.200} is not a directory") from None
    except PermissionError:
        raise BadRequest(f"path {path!r:.200}: the directory cannot be read") from None
    except OSError as e:
        raise BadRequest(f"path {path!r:.200}: cannot read the directory ({e})") from None
    if empty:
        raise BadRequest(f"path {path!r:.200} is an empty directory, not a checkpoint")
