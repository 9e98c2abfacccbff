"""Progress on stderr: a tqdm bar on a terminal, one plain line per phase otherwise.

`--quiet` silences it. tqdm is imported only when a bar is drawn (the `bench` extra).
"""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, quiet: bool = False, stream: Any = None) -> None:
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None

    def phase(self, message: str) -> None:
        """A line saying what starts now (on a terminal too: it stays above the bar)."""
        if not self.quiet:
            print(f"tandem bench: {message}", file=self.stream, flush=True)

    def start(self, total: int, label: str) -> None:
        if self.quiet or not self.tty:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=label, unit="req", file=self.stream,
                         dynamic_ncols=True, leave=False)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
