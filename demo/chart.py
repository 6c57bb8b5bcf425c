"""The demo's timeline chart, drawn with matplotlib (the ``charts`` extra, Agg canvas).

One track per workload on a time axis (seconds since the first grant): the turns it held
in its own colour, and over them, each in its colour, the phases that move its memory:
slicerd's `park` (to host memory, or verifying it was freed) and `restore` (back to the
GPU), and for the sampler the dispatcher's `vLLM sleep` and `vLLM wake + load` (vLLM
woken and the revision's weights loaded). The title line (overlaps, busy fraction, what
was served) above, the legend below (only the phases drawn). matplotlib is
imported only when a chart is drawn: the demo's text report never needs it
(`ChartsMissing`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Bar = tuple[float, float, str]  # start s, end s, kind: "held" or a key of KIND_COLORS

PARK, RESTORE, SLEEP, WAKE_LOAD = "park", "restore", "vLLM sleep", "vLLM wake + load"
ROW_COLORS = ["tab:blue", "tab:orange", "tab:purple", "tab:brown"]
# Each phase's colour; also the legend's order and names.
KIND_COLORS = {PARK: "tab:red", RESTORE: "tab:green", SLEEP: "tab:pink", WAKE_LOAD: "tab:cyan"}
KINDS = ("held", *KIND_COLORS)  # drawing order: the phases over held
CHARTS_HINT = "the chart needs matplotlib: pip install -e '.[charts]' (the `charts` extra)"
WIDTH_IN, DPI = 10.0, 100
TRACK_IN, FRAME_IN = 0.55, 2.0  # inches per workload track; title, legend and axis


class ChartsMissing(Exception):
    """matplotlib (the ``charts`` extra) is not installed."""

    def __init__(self) -> None:
        super().__init__(CHARTS_HINT)


def new_figure(width_in: float, height_in: float) -> Figure:
    """An empty figure on an Agg canvas (no pyplot, no display), constrained layout;
    `ChartsMissing` without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ChartsMissing() from e
    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> tuple[int, int]:
    """Write `fig` to `path` as a PNG (atomically; parents created); its pixel size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=DPI)
    tmp.replace(path)
    width, height = fig.canvas.get_width_height()
    return int(width), int(height)


def chart(
    title: str,
    rows: list[tuple[str, list[Bar]]],
    window_s: float,
    colors: list[str] | None = None,
    legend: list[tuple[str, str]] | None = None,
) -> Figure:
    """Draw the timeline (module docstring); `rows` are drawn top to bottom. `colors`:
    each row's colour (default `ROW_COLORS` in turn); `legend`: (label, colour) entries
    in place of one "NAME holds the GPU" entry per row (the pool demo's many rows)."""
    fig = new_figure(WIDTH_IN, FRAME_IN + TRACK_IN * len(rows))  # ChartsMissing without it
    from matplotlib.patches import Patch  # after new_figure: it checked matplotlib is there

    ax = fig.add_subplot()
    window = max(window_s, 1e-6)
    handles: list[Any] = []
    for k, (name, bars) in enumerate(rows):
        color = colors[k] if colors else ROW_COLORS[k % len(ROW_COLORS)]
        ax.axhspan(k - 0.4, k + 0.4, color="0.94", zorder=0)
        for kind in KINDS:
            spans = [(s, min(e, window) - s) for s, e, what in bars if what == kind and e > s]
            ax.broken_barh(spans, (k - 0.4, 0.8), color=KIND_COLORS.get(kind, color), zorder=2)
        if legend is None:
            handles.append(Patch(color=color, label=f"{name} holds the GPU"))
    handles += [Patch(color=c, label=label) for label, c in legend or []]
    drawn = {what for _, bars in rows for s, e, what in bars if e > s}
    handles += [Patch(color=c, label=kind) for kind, c in KIND_COLORS.items() if kind in drawn]
    ax.set_xlim(0, window)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_xlabel("seconds since the first grant")
    ax.set_ylabel("workload")
    ax.grid(axis="x", color="0.85", zorder=1)
    ax.set_axisbelow(True)
    fig.suptitle(title, fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    return fig


def write_chart(
    path: Path,
    title: str,
    rows: list[tuple[str, list[Bar]]],
    window_s: float,
    colors: list[str] | None = None,
    legend: list[tuple[str, str]] | None = None,
) -> tuple[int, int]:
    """Draw the chart (`chart`'s arguments) and write it to `path` (atomically; parents
    created); its size. `ChartsMissing` without matplotlib."""
    return save_png(chart(title, rows, window_s, colors, legend), path)
