"""The memory history a tracker writes: PyTorch's memory snapshot of the block (on CUDA
PyTorch's own recording, on the simulated device memkit's; :mod:`memkit.devices.history`),
written when the block ends, also when it ends with an OOM (docs/memory-history.md)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from memkit.devices.history import MemoryHistory
from memkit.tracking.outputs import check_writable, rank_path

__all__ = ["HistoryFile"]

log = logging.getLogger(__name__)


class HistoryFile:
    """Where a tracker's memory history goes, and how writing it went.

    Args:
        path: the file (``None``: no history); under torchrun each rank writes
            ``NAME.rankN.EXT``.
        entries: events the history keeps (the most recent).

    Attributes:
        file: where it was written (after the block).
        error: why it could not be written, if it could not.
    """

    def __init__(self, path: str | Path | None, entries: int) -> None:
        self.path = None if path is None else Path(path)
        self.entries = entries
        self.file: Path | None = None
        self.error: str | None = None
        self._recorder: MemoryHistory | None = None

    def prepare(self, backend: Any) -> None:
        """Check the file can be written and that ``backend``'s device has a history, before
        anything is hooked.

        Raises:
            ConfigError: it cannot be written, or the device records no history.
        """
        if self.path is None:
            return
        path = rank_path(self.path)
        check_writable(path, "memory_history")
        self._recorder = MemoryHistory(backend, path, max_entries=self.entries)

    def start(self, stack: contextlib.ExitStack) -> None:
        """Start recording, stopped when ``stack`` closes (before the tracked objects are
        counted, so that they are in it)."""
        if self._recorder is not None:
            self._recorder.start()
            stack.callback(self._recorder.stop)

    def write(self) -> str | None:
        """Write the history (first thing when the block ends: after an OOM the failed step's
        tensors are alive); returns the report's note on it (``None``: no history)."""
        recorder = self._recorder
        if recorder is None:
            return None
        try:
            self.file = recorder.dump()
        except Exception as exc:  # never hide the user's exception behind our own
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("memkit could not write the memory history: %s", self.error)
            return f"memory history: could not write {recorder.path} ({self.error})"
        return (
            f"memory history: {self.file} (open it at https://pytorch.org/memory_viz, "
            f"or: memkit inspect {self.file})"
        )
