"""A live progress line for long searches: tqdm's, which knows a notebook from a terminal.

``tqdm.auto`` draws a widget in Jupyter and a text line in a terminal: the convention of the
ecosystem (transformers, Lightning, datasets). It is imported only when a progress line is
asked for. While a trial runs, a thread redraws the line every second with the trial's size
and elapsed time, so a trial that takes minutes is visibly alive.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from memkit.units import format_size

__all__ = ["TrialProgress"]

REFRESH_SECONDS = 1.0
"""How often the running trial's elapsed time is redrawn."""


class TrialProgress:
    """Trials run so far, the last one's outcome, and the running trial with its elapsed time.

    Args:
        label: what is searched, e.g. ``"memkit probe (train, seq 512)"``.
        file: where the line goes (standard error by default).
    """

    def __init__(self, label: str, file: Any = None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            desc=label,
            unit=" trials",
            file=sys.stderr if file is None else file,
            bar_format="{desc}: trials done {n_fmt}{postfix} [{elapsed}]",
            dynamic_ncols=True,
        )
        self._lock = threading.Lock()
        self._last = ""
        self._running: int | None = None
        self._since = 0.0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="memkit-progress", daemon=True)
        self._ticker.start()

    def started(self, batch_size: int) -> None:
        """A trial at ``batch_size`` begins."""
        with self._lock:
            self._running, self._since = batch_size, time.monotonic()
            self._draw()

    def finished(self, batch_size: int, fits: bool, peak_bytes: int | None) -> None:
        """The trial at ``batch_size`` ended: it fit with ``peak_bytes``, or did not."""
        with self._lock:
            self._running = None
            if fits:
                self._last = f"batch {batch_size} fits ({format_size(peak_bytes)})"
            else:
                self._last = f"batch {batch_size} OOM"
            self._bar.n += 1  # drawn once, with the new outcome
            self._draw()

    def close(self) -> None:
        """Stop the ticker and leave the last line on screen."""
        self._stop.set()
        self._ticker.join()
        self._bar.close()

    def _draw(self) -> None:
        parts = [self._last] if self._last else []
        if self._running is not None:
            elapsed = time.monotonic() - self._since
            parts.append(f"running batch {self._running} ({elapsed:.0f} s)")
        self._bar.set_postfix_str(", ".join(parts), refresh=True)

    def _tick(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            with self._lock:
                if self._running is not None:
                    self._draw()
