"""Progress of long operations on the console: redrawn in place on a terminal, a plain
line per phase otherwise.

A person at a terminal wants one block that changes (not the same line again every few
seconds); a log file or CI wants a line when a phase changes and nothing in between: no
control characters, no flood of byte counts. `StatusBlock` does either from the same
calls; `render` is its pure part. Torch-free, no dependency (`tandem serve` uses it).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

_UP_TO_LINE_START = "\x1b[{}F"  # cursor to the start of the line N lines up
_CLEAR_LINE = "\x1b[2K"
_CLEAR_BELOW = "\x1b[J"


@dataclass(frozen=True)
class Status:
    """One row of a block: what a thing is doing, and how far along it is."""

    phase: str  # a change of phase prints a line even when the stream is not a terminal
    detail: str = ""  # bytes, counts, seconds: redrawn on a terminal, else shown per phase


def render(rows: Mapping[str, Status]) -> list[str]:
    """The block's lines: `  name: phase (detail)`, names padded to one width."""
    width = max((len(name) for name in rows), default=0) + 1
    return [f"  {name + ':':<{width}} {s.phase}" + (f" ({s.detail})" if s.detail else "")
            for name, s in rows.items()]


class StatusBlock:
    """Rows of status shown on `stream`. On a terminal each `show` redraws the block in
    place; otherwise a row prints a line only when its phase changes. `release` ends the
    block (later output goes below it; the next `show` starts a new one)."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = _isatty(stream) if tty is None else tty
        self._drawn: list[str] = []  # the lines on screen now (terminal)
        self._rows = 0  # the terminal rows they take (a long line wraps)
        self._phases: dict[str, str] = {}  # the phase last printed per row (plain)

    def show(self, rows: Mapping[str, Status]) -> None:
        if self.tty:
            self._redraw(render(rows))
            return
        for name, status in rows.items():
            if self._phases.get(name) != status.phase:
                self._phases[name] = status.phase
                self._write("\n".join(render({name: status})) + "\n")

    def release(self) -> None:
        self._drawn, self._rows = [], 0

    def _redraw(self, lines: list[str]) -> None:
        if lines == self._drawn:
            return
        up = _UP_TO_LINE_START.format(self._rows) if self._rows else ""
        body = "".join(f"{_CLEAR_LINE}{line}\n" for line in lines)
        self._write(f"{up}{body}{_CLEAR_BELOW}")
        columns = max(shutil.get_terminal_size().columns, 1)
        self._drawn = lines
        self._rows = sum(max(1, math.ceil(len(line) / columns)) for line in lines)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
