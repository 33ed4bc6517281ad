"""One live status line (\\r) on a terminal: prefill progress, then decode tok/s. Silent when redirected."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    def __init__(self, stream=None, interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self.interval = interval
        self._last = 0.0
        self._t_first = None
        self._width = 0

    def _write(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        pad = max(self._width - len(text), 0)
        self._width = len(text)
        try:
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False

    def begin(self) -> None:
        self._t_first = None
        self._first_count = 0

    def prefill(self, done: int, total: int) -> None:
        if self.enabled:
            pct = 100.0 * done / total if total else 100.0
            self._write(f"prefill {done}/{total} tokens ({pct:.0f}%)", force=done >= total)

    def decode(self, count: int, _elapsed: float = 0.0) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first, self._first_count = now, count
            self._write(f"decode {count} tokens")
            return
        dt = now - self._t_first
        tps = (count - self._first_count) / dt if dt > 0 else 0.0
        self._write(f"decode {count} tokens, {tps:.1f} tok/s")

    def end(self) -> None:
        if self.enabled and self._width:
            self._write("", force=True)
            try:
                self.stream.write("\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self._width = 0
