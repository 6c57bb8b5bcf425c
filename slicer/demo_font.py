"""A small built-in 5x7 bitmap font for the demo's PNG chart: digits, upper-case letters
(lower case is drawn upper case, but for the 's' of "5s") and a few symbols; anything
else draws as '?'.

Each glyph is seven rows of five bits (bit 4 is the leftmost pixel), written as seven
two-digit hex numbers."""

from __future__ import annotations

GLYPH_W, GLYPH_H = 5, 7

_HEX = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F",
    "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E",
    "9": "0E11110F01020C", "A": "0E1111111F1111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F",
    "F": "1F10101E101010", "G": "0E11101711110F", "H": "1111111F111111",
    "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211",
    "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D",
    "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A",
    "X": "11110A040A1111", "Y": "1111110A040404", "Z": "1F01020408101F",
    " ": "00000000000000", ".": "00000000000C0C", ",": "000000000C0408",
    ":": "000C0C000C0C00", "-": "0000001F000000", "_": "0000000000001F",
    "/": "00010204081000", "%": "18190204081303", "(": "02040808080402",
    ")": "08040202020408", "=": "00001F001F0000", "+": "0004041F040400",
    "#": "0A0A1F0A1F0A0A", "'": "0C040800000000", "!": "04040404040004",
    "?": "0E110102040004", ">": "08040201020408", "<": "02040810080402",
    "*": "0004150E150400", "@": "0E11171517100E", "s": "00000E100E011E",
}  # fmt: skip


def _rows(code: str) -> tuple[int, ...]:
    rows = tuple(int(code[i : i + 2], 16) for i in range(0, len(code), 2))
    if len(rows) != GLYPH_H or any(r >= 1 << GLYPH_W for r in rows):
        raise ValueError(f"bad glyph {code!r}")
    return rows


FONT: dict[str, tuple[int, ...]] = {ch: _rows(code) for ch, code in _HEX.items()}


def glyph(ch: str) -> tuple[int, ...]:
    """The seven rows of `ch` (upper-cased unless the font has it in lower case, as 's'
    for seconds; '?' when the font lacks it)."""
    return FONT.get(ch) or FONT.get(ch.upper(), FONT["?"])


def text_width(text: str, scale: int = 1) -> int:
    """Pixels `text` takes: GLYPH_W + 1 per character (one column of spacing)."""
    return max(0, len(text) * (GLYPH_W + 1) * scale - scale)


def pixels(text: str, scale: int = 1) -> list[tuple[int, int]]:
    """The (x, y) offsets of the set pixels of `text` drawn at `scale`, from its top left."""
    out: list[tuple[int, int]] = []
    for i, ch in enumerate(text):
        x0 = i * (GLYPH_W + 1) * scale
        for row, bits in enumerate(glyph(ch)):
            for col in range(GLYPH_W):
                if bits & (1 << (GLYPH_W - 1 - col)):
                    for dy in range(scale):
                        for dx in range(scale):
                            out.append((x0 + col * scale + dx, row * scale + dy))
    return out
