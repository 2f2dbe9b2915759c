"""chart.png for a sweep's report: step time and cost per 1k steps per configuration, as bar charts.

Standard library only (zlib + struct PNG, a 5×7 bitmap font), because the report Lambda ships only this
project's code: no plotting library to bundle for the Lambda runtime. Two panels side by side, one bar
per configuration in sweep order; failed configurations get a hatched stub and "FAILED"; the recommended
one is drawn in green.

    png = render_chart(report, title="resnet-weekly 2026-11-29")
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

# 5×7 glyphs, rows top to bottom, "#" = ink. Lower-case text is drawn in capitals.
_GLYPHS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    " ": "..... ..... ..... ..... ..... ..... .....", ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...", ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "-": "..... ..... ..... ##### ..... ..... .....", "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "/": "....# ....# ...#. ..#.. .#... #.... #....", "%": "##..# ##..# ...#. ..#.. .#... #..## #..##",
    "$": "..#.. .#### #.#.. .###. ..#.# ####. ..#..", "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...", "×": "..... #...# .#.#. ..#.. .#.#. #...# .....",
    "=": "..... ..... ##### ..... ##### ..... .....", "_": "..... ..... ..... ..... ..... ..... #####",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
}

WHITE, INK, GREY, BAR, BEST, FAILED = (255, 255, 255), (33, 37, 41), (206, 212, 218), (66, 110, 180), (46, 150, 80), (200, 60, 60)


class Canvas:
    """An RGB raster with just what a bar chart needs."""

    def __init__(self, width: int, height: int, background: tuple[int, int, int] = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, colour: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        row = bytes(colour) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, colour: tuple[int, int, int] = INK, scale: int = 2) -> int:
        """Draw ``text`` with its top-left at (x, y); returns the x after it."""
        for char in text.upper():
            glyph = _GLYPHS.get(char, _GLYPHS["?"])
            for row, bits in enumerate(glyph.split()):
                for column, bit in enumerate(bits[:5]):
                    if bit == "#":
                        self.rect(x + column * scale, y + row * scale, x + (column + 1) * scale, y + (row + 1) * scale, colour)
            x += 6 * scale
        return x

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack("!I", len(data)) + kind + data + struct.pack("!I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack("!IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * 6 * scale


def _panel(canvas: Canvas, x0: int, y0: int, width: int, height: int, title: str, rows: Sequence[Mapping[str, Any]],
           key: str, unit: str, recommended: str | None) -> None:
    canvas.text(x0, y0, title, scale=2)
    top, bottom = y0 + 40, y0 + height - 70
    values = [row[key] for row in rows if row[key] is not None]
    peak = max(values) if values else 1.0
    canvas.rect(x0, bottom, x0 + width, bottom + 2, INK)  # axis
    slot = width // max(1, len(rows))
    for index, row in enumerate(rows):
        left = x0 + index * slot + slot // 6
        right = x0 + (index + 1) * slot - slot // 6
        value = row[key]
        if value is None:
            for stripe in range(left, right, 8):  # hatched stub: no figure
                canvas.rect(stripe, bottom - 24, min(stripe + 4, right), bottom, FAILED)
            canvas.text(left, bottom - 40, "FAILED", FAILED, scale=1)
        else:
            bar_top = bottom - int((bottom - top - 20) * value / peak)
            canvas.rect(left, bar_top, right, bottom, BEST if row["name"] == recommended else BAR)
            label = f"{value:.1f}" if value >= 10 else f"{value:.3f}"
            canvas.text(left, bar_top - 12, label + unit, INK, scale=1)
        room = max(4, (right - left) // 6)
        name = row["name"] if len(row["name"]) <= room else ".." + row["name"][-(room - 2):]
        canvas.text(left, bottom + 8, name, INK, scale=1)
        canvas.text(left, bottom + 20, f"{row['data_hosts']} DATA HOSTS", GREY if row["status"] == "failed" else INK, scale=1)


def render_chart(report: Mapping[str, Any], title: str) -> bytes:
    rows = report["configurations"]
    width = max(900, 2 * (140 * len(rows)) + 120)
    canvas = Canvas(width, 480)
    canvas.text(20, 16, title, scale=3)
    panel_width = (width - 100) // 2
    _panel(canvas, 30, 70, panel_width, 400, "MS PER STEP (BILLED)", rows, "step_time_ms", "", report.get("recommended"))
    _panel(canvas, 70 + panel_width, 70, panel_width, 400, "$ PER 1K STEPS", rows, "cost_per_1k_steps_usd", "", report.get("recommended"))
    prices = report["prices"]
    line = f"PRICES: {prices['source']} ({prices['date']})"
    room = (width - 40) // 6
    canvas.text(20, 458, line if len(line) <= room else line[:room - 2] + "..", INK, scale=1)
    return canvas.png()
