"""The demo's timeline as a PNG, with no imaging library: a tiny RGB canvas, a PNG
encoder (zlib + struct: IHDR, one IDAT, IEND; 8-bit RGB, filter 0 on every row) and
labels from the built-in 5x7 font (`slicer.demo_font`).

The chart: a title line (overlaps, busy fraction, what was served), a legend, one track
per workload with its bars on a time axis ('held' in the workload's colour, 'parking' and
'restoring' in their own), and ticks "0s .. Ns" under the tracks."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from gpu_slicer.slicer.demo_font import GLYPH_H, pixels, text_width

RGB = tuple[int, int, int]
Bar = tuple[float, float, str]  # start s, end s, kind: "held" | "parking" | "restoring"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BACKGROUND: RGB = (255, 255, 255)
INK: RGB = (33, 33, 33)
GRID: RGB = (214, 214, 214)
TRACK: RGB = (240, 240, 240)
PARKING: RGB = (214, 39, 40)
RESTORING: RGB = (44, 160, 44)
ROW_COLORS: list[RGB] = [(31, 119, 180), (255, 127, 14), (148, 103, 189), (140, 86, 75)]

SCALE = 2  # font scale: 10x14 pixel glyphs
MARGIN = 16
LABEL_W = 150
ROW_H, BAR_H = 44, 28
WIDTH = 1000


@dataclass
class Canvas:
    """An RGB image in memory, top-left origin."""

    width: int
    height: int
    background: RGB = BACKGROUND
    data: bytearray = field(init=False)

    def __post_init__(self) -> None:
        if not (0 < self.width <= 1 << 14 and 0 < self.height <= 1 << 14):
            raise ValueError(f"bad canvas size {self.width}x{self.height}")
        self.data = bytearray(bytes(self.background) * (self.width * self.height))

    def pixel(self, x: int, y: int) -> RGB:
        """The colour at (x, y)."""
        i = (y * self.width + x) * 3
        return (self.data[i], self.data[i + 1], self.data[i + 2])

    def rect(self, x: int, y: int, w: int, h: int, color: RGB) -> None:
        """Fill a rectangle (clipped to the canvas)."""
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0 or y1 <= y0:
            return
        line = bytes(color) * (x1 - x0)
        for yy in range(y0, y1):
            i = (yy * self.width + x0) * 3
            self.data[i : i + len(line)] = line

    def text(self, x: int, y: int, text: str, color: RGB = INK, scale: int = SCALE) -> int:
        """Draw `text` with its top left at (x, y); the x just after it."""
        for dx, dy in pixels(text, scale):
            if 0 <= x + dx < self.width and 0 <= y + dy < self.height:
                i = ((y + dy) * self.width + x + dx) * 3
                self.data[i : i + 3] = bytes(color)
        return x + text_width(text, scale)

    def png(self) -> bytes:
        """The image as PNG bytes."""
        return encode_png(self.width, self.height, bytes(self.data))


def _chunk(tag: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(tag + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", crc)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """A PNG of `width` x `height` 8-bit RGB pixels (`rgb`: rows top to bottom)."""
    stride = width * 3
    if len(rgb) != stride * height:
        raise ValueError(f"{len(rgb)} bytes for {width}x{height} RGB")
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


def _tick_step(window: float) -> float:
    """A round tick step giving about 5-10 ticks over `window` seconds."""
    for step in (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600):
        if window / step <= 10:
            return float(step)
    return window / 10


def _fmt_s(x: float) -> str:
    return f"{x:.0f}s" if abs(x - round(x)) < 1e-6 else f"{x:.1f}s"


def chart(title: str, rows: list[tuple[str, list[Bar]]], window_s: float) -> Canvas:
    """Draw the timeline (module docstring); `rows` are drawn top to bottom."""
    text_h = GLYPH_H * SCALE
    top = MARGIN + text_h + 12 + text_h + 16  # title, legend
    height = top + ROW_H * len(rows) + 8 + text_h + MARGIN
    c = Canvas(WIDTH, height)
    c.text(MARGIN, MARGIN, title.upper())
    x, y = MARGIN, MARGIN + text_h + 12
    legend = [
        (f"{name} holds", ROW_COLORS[k % len(ROW_COLORS)]) for k, (name, _) in enumerate(rows)
    ]
    for name, color in [*legend, ("parking", PARKING), ("restoring", RESTORING)]:
        c.rect(x, y, text_h, text_h, color)
        x = c.text(x + text_h + 6, y, name.upper()) + 24

    x0, x1 = MARGIN + LABEL_W, WIDTH - MARGIN - 24
    window = max(window_s, 1e-6)

    def px(t: float) -> int:
        return x0 + round(min(max(t, 0.0), window) / window * (x1 - x0))

    step = _tick_step(window)
    ticks = [k * step for k in range(int(window / step + 1e-9) + 1)]
    if window - ticks[-1] > 1e-6:  # the end of the run, "Ns", replaces a tick too near it
        ticks = [*ticks[: -1 if window - ticks[-1] < step / 2 and len(ticks) > 1 else None],
                 window]  # fmt: skip
    bottom = top + ROW_H * len(rows)
    for t in ticks:
        c.rect(px(t), top - 4, 1, bottom - top + 8, GRID)
    for k, (name, bars) in enumerate(rows):
        y = top + k * ROW_H + (ROW_H - BAR_H) // 2
        c.text(MARGIN, y + (BAR_H - text_h) // 2, name.upper())
        c.rect(x0, y, x1 - x0, BAR_H, TRACK)
        color = ROW_COLORS[k % len(ROW_COLORS)]
        for kind in ("held", "parking", "restoring"):  # park and restore drawn over held
            fill = {"held": color, "parking": PARKING, "restoring": RESTORING}[kind]
            for start, end, what in bars:
                if what == kind and end > start:
                    c.rect(px(start), y, max(1, px(end) - px(start)), BAR_H, fill)
    c.rect(x0, bottom + 2, x1 - x0 + 1, 2, INK)
    for t in ticks:
        label = _fmt_s(t)
        c.rect(px(t), bottom + 2, 2, 8, INK)
        lx = min(px(t) - text_width(label, SCALE) // 2, WIDTH - MARGIN - text_width(label))
        c.text(max(x0 - 10, lx), bottom + 14, label)
    return c


def write_chart(
    path: Path, title: str, rows: list[tuple[str, list[Bar]]], window_s: float
) -> tuple[int, int]:
    """Draw the chart and write it to `path` (atomically; parents created); its size."""
    c = chart(title, rows, window_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(c.png())
    tmp.replace(path)
    return c.width, c.height
