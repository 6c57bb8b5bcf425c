"""The GPU check's arithmetic: medians, GB/s, the host link's bound, the summary table.

Pure functions of numbers (no GPU, no processes), so tests check them directly. A park
moves the workload's bytes device -> host, a restore host -> device; each is measured as
the time from the ACQUIRE that needed it to its grant, so GB/s here is the whole
operation's (tool start, lock, copy, unlock), not the copy's alone. The bound is the host
link per direction (../shared/ANCHORS.md: PCIe Gen4 x16 ~25 GB/s, Gen5 x16 ~55 GB/s).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

GiB = 1 << 30

# Usable GB/s per direction of an x16 link, by PCIe generation. Gen4 and Gen5 are the
# anchors' figures; the others are our estimates at the same efficiency (~80% of the raw
# rate: Gen3 15.75, Gen6 126 GB/s raw).
X16_GBPS: dict[int, float] = {1: 3.2, 2: 6.4, 3: 12.6, 4: 25.0, 5: 55.0, 6: 110.0}
ANCHORED_GENS = frozenset({4, 5})


def median(values: Sequence[float]) -> float | None:
    """The median of `values`, None when there are none."""
    return statistics.median(values) if values else None


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """`nbytes` moved in `seconds`, in GB/s (10^9 bytes per second); None when unknown."""
    if seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def link_gbps(gen: int | None, width: int | None) -> float | None:
    """The usable GB/s per direction of a PCIe link of generation `gen` and `width` lanes
    (`X16_GBPS` scaled by width); None for an unknown or unreadable link."""
    if gen is None or width is None or gen not in X16_GBPS or width <= 0:
        return None
    return X16_GBPS[gen] * width / 16


def link_used(
    cur_gen: int | None, cur_width: int | None, max_gen: int | None, max_width: int | None
) -> tuple[int | None, int | None]:
    """The (generation, width) to bound a copy by: the current link, except that an idle
    GPU trains its link down to save power (Gen1 at idle is common), so a current reading
    below the maximum is replaced by the maximum, which a copy brings it back to."""
    gen = max_gen if cur_gen is None or (max_gen is not None and max_gen > cur_gen) else cur_gen
    width = (
        max_width
        if cur_width is None or (max_width is not None and max_width > cur_width)
        else cur_width
    )
    return gen, width


def ratio(value: float | None, bound: float | None) -> float | None:
    """`value / bound`, None when either is unknown."""
    if value is None or bound is None or bound <= 0:
        return None
    return value / bound


def summarise(
    nbytes: int, parks: Sequence[float], restores: Sequence[float], link: float | None
) -> dict[str, Any]:
    """One row: the median park and restore times of `nbytes`, GB/s each way, and each
    as a fraction of the `link` (GB/s per direction, None when unknown)."""
    park, restore = median(parks), median(restores)
    park_gbps, restore_gbps = gbps(nbytes, park), gbps(nbytes, restore)
    return {
        "bytes": nbytes,
        "gib": nbytes / GiB,
        "runs": len(parks),
        "park_s": park,
        "restore_s": restore,
        "park_gbps": park_gbps,
        "restore_gbps": restore_gbps,
        "park_over_link": ratio(park_gbps, link),
        "restore_over_link": ratio(restore_gbps, link),
        "parks_s": list(parks),
        "restores_s": list(restores),
    }


def speedups(
    rows: Mapping[str, Mapping[int, Mapping[str, Any]]], fast: str = "driver", slow: str = "cli"
) -> dict[int, dict[str, float | None]]:
    """Per size (bytes): how many times faster parker `fast` parked and restored than
    `slow` (`slow`'s median time over `fast`'s); sizes measured by both only."""
    out: dict[int, dict[str, float | None]] = {}
    for nbytes in sorted(set(rows.get(fast, {})) & set(rows.get(slow, {}))):
        f, s = rows[fast][nbytes], rows[slow][nbytes]
        out[nbytes] = {
            "park": ratio(s["park_s"], f["park_s"]),
            "restore": ratio(s["restore_s"], f["restore_s"]),
        }
    return out


def sizes_that_fit(wanted_gib: Sequence[float], free_bytes: int | None, reserve: int) -> list[int]:
    """The sizes (bytes, multiples of 4) of `wanted_gib` that fit in `free_bytes` less
    `reserve` (the CUDA context, other processes); a larger one is capped to what fits
    once (so a small GPU still measures one large size). Unknown free memory: all."""
    out: list[int] = []
    room = None if free_bytes is None else free_bytes - reserve
    for gib in wanted_gib:
        n = int(gib * GiB) // 4 * 4
        if room is not None and n > room:
            n = room // GiB * GiB
            if n <= 0 or n in out:
                continue
        if n > 0 and n not in out:
            out.append(n)
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(
    rows: Mapping[str, Mapping[int, Mapping[str, Any]]],
    link: float | None,
    ups: Mapping[int, Mapping[str, float | None]],
) -> list[str]:
    """The summary as lines of text (one per parker and size, then the speed-ups)."""
    head = "parker  size      park s  restore s  park GB/s  restore GB/s  park/link  restore/link"
    lines = [f"link bound: {_fmt(link, '.1f')} GB/s per direction", head]
    for parker, by_size in rows.items():
        for nbytes, r in sorted(by_size.items()):
            lines.append(
                f"{parker:<7} {nbytes / GiB:>5g} GiB {_fmt(r['park_s'], '>8.2f')} "
                f"{_fmt(r['restore_s'], '>10.2f')} {_fmt(r['park_gbps'], '>10.1f')} "
                f"{_fmt(r['restore_gbps'], '>13.1f')} {_fmt(r['park_over_link'], '>10.2f')} "
                f"{_fmt(r['restore_over_link'], '>13.2f')}"
            )
    for nbytes, up in sorted(ups.items()):
        lines.append(
            f"driver over cli at {nbytes / GiB:g} GiB: park {_fmt(up['park'], '.2f')}x, "
            f"restore {_fmt(up['restore'], '.2f')}x faster"
        )
    return lines


def parse_probe(line: str) -> dict[str, Any]:
    """gpumem's ``gpu name="..." total=B free=B cuda=V checkpoint_api=0|1`` as a dict
    (ValueError for another line)."""
    m = re.fullmatch(
        r'gpu name="([^"]*)" total=(\d+) free=(\d+) cuda=(\d+) checkpoint_api=([01])', line
    )
    if not m:
        raise ValueError(f"cannot read gpumem's probe line {line!r}")
    return {
        "name": m[1],
        "total": int(m[2]),
        "free": int(m[3]),
        "cuda": int(m[4]),
        "checkpoint_api": m[5] == "1",
    }
