"""A tiny progress bar on stderr (tqdm is not a dependency).

On a terminal it redraws one line; in a log (CI) it prints one line per step.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, title: str = "", stream=None, width: int = 24):
        self.total, self.title, self.width = max(total, 1), title, width
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def step(self, label: str = "") -> None:
        """Mark one more item done (call after it finishes)."""
        self.done += 1
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.start
        line = f"{self.title} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {label}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:200])
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
