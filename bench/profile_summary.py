"""Summarise a cProfile file: CPU by package, then the top functions by own time.

    .venv/bin/python bench/profile_summary.py FILE [--top 15] [--markdown]

FILE is what ``--profile-dispatcher`` (bench/dispatch.py) or ``--profile-daemon``
(bench/handoff.py) wrote. Time spent waiting in ``epoll`` (the event loop with nothing
to do) is reported apart: it is idle time, not cost. The package split uses each
function's own time (``tottime``), so it adds up to the profiled CPU time.
"""

from __future__ import annotations

import argparse
import pstats
import sys
from collections import Counter

IDLE = ("'poll' of 'select.epoll' objects", "'poll' of 'select.poll' objects")
# (label, substring of the function's file name or of the built-in's name), first match wins
PACKAGES = [
    ("hypercorn (HTTP front)", "/hypercorn/"),
    ("starlette", "/starlette/"),
    ("httpx/httpcore (HTTP client)", "/httpx/"),
    ("httpx/httpcore (HTTP client)", "/httpcore/"),
    ("h11 (HTTP parser)", "/h11/"),
    ("trio", "/trio/"),
    ("sqlite3", "sqlite3"),
    ("json", "/json/"),
    ("dispatcher", "/dispatcher/"),
    ("slicer", "/slicer/"),
    ("proto", "/proto/"),
    ("os calls (fsync, rename, open, write)", "posix."),
    ("imports (process start)", "builtins.compile"),
    ("imports (process start)", "marshal.loads"),
    ("imports (process start)", "<frozen importlib"),
]


def package(file: str, name: str) -> str:
    """The label of the package a profiled function belongs to."""
    for label, needle in PACKAGES:
        if needle in file or (file == "~" and needle in name):
            return label
    return "other (stdlib, builtins)"


def summarise(path: str, top: int) -> tuple[float, float, list[tuple[str, float]], list[str]]:
    """(busy seconds, idle seconds, [(package, seconds)], top function lines)."""
    st = pstats.Stats(path)
    raw = st.stats  # type: ignore[attr-defined]
    busy = idle = 0.0
    by_pkg: Counter[str] = Counter()
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in raw.items():
        label = f"{name}" if file == "~" else f"{file.rsplit('/', 2)[-2:][-1]}:{line}({name})"
        if file == "~" and any(needle in name for needle in IDLE):
            idle += tt
            continue
        busy += tt
        by_pkg[package(file, name)] += tt
        rows.append((tt, nc, ct, label, package(file, name)))
    rows.sort(reverse=True)
    lines = [
        f"{tt:8.3f} s {tt / busy * 100:5.1f}%  {nc:>9}  {label}  [{pkg}]"
        for tt, nc, ct, label, pkg in rows[:top]
    ]
    return busy, idle, by_pkg.most_common(), lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    busy, idle, pkgs, lines = summarise(args.file, args.top)
    print(f"profiled CPU {busy:.2f} s (event loop idle in poll: {idle:.2f} s, not counted)")
    print("by package (own time):")
    for label, t in pkgs:
        print(f"  {label:<38} {t:8.3f} s  {t / busy * 100:5.1f}%")
    print(f"top {args.top} functions by own time (seconds, share, calls):")
    for line in lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
