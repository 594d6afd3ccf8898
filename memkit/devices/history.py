"""Memory history: the CUDA caching allocator's own trace, or the simulated device's.

The format (PyTorch's memory snapshot) and the simulated recorder are
:mod:`memkit.simulated.history`; :class:`MemoryHistory` picks the recorder for a backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memkit.devices.backends import SimulatedBackend
from memkit.errors import ConfigError
from memkit.simulated.history import (
    DEFAULT_MAX_ENTRIES,
    SimulatedHistory,
    without_memkit_frames,
    write_snapshot,
)


def start_cuda_history(max_entries: int) -> None:
    """Record every allocation and free of the CUDA caching allocator, with its Python stack
    (``stacks="python"``: no C++ frames, the cheap kind; ``context="all"``: stacks for frees
    too), keeping the last ``max_entries`` events (torch's ring buffer drops older ones).
    Recording covers every CUDA device of the process."""
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="python", max_entries=max_entries
    )


def cuda_history_snapshot() -> dict[str, Any]:
    """The allocator's segments and the recorded trace: ``torch.cuda.memory._snapshot()``, the
    dict that ``torch.cuda.memory._dump_snapshot`` pickles."""
    return dict(torch.cuda.memory._snapshot())


def stop_cuda_history() -> None:
    """Stop recording (``_record_memory_history(enabled=None)``)."""
    torch.cuda.memory._record_memory_history(enabled=None)


class MemoryHistory:
    """Record a backend's memory history and write it as a PyTorch snapshot pickle.

    On a CUDA device, PyTorch records (through this module: python stacks, the last
    ``max_entries`` events); on the simulated device, :class:`SimulatedHistory`. Other devices
    have no history to record.

    Raises:
        ConfigError: the backend's device has no memory history (XPU, MPS...).
    """

    def __init__(self, backend: Any, path: str | Path, *, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.path = Path(path)
        self.max_entries = max_entries
        self._backend = backend
        self._sim: SimulatedHistory | None = None
        self._cuda = False
        if isinstance(backend, SimulatedBackend):
            self._sim = SimulatedHistory(backend.accountant, max_entries=max_entries)
        elif backend.device.type != "cuda":
            raise ConfigError(
                f"a memory history was asked for on {backend.device}, but PyTorch records one "
                "only for CUDA devices; use a cuda device, or --device cpu for the simulated one"
            )

    def start(self) -> MemoryHistory:
        """Start recording; returns ``self``."""
        if self._sim is not None:
            self._sim.start()
        else:
            start_cuda_history(self.max_entries)
            self._cuda = True
        return self

    def snapshot(self) -> dict[str, Any]:
        """What has been recorded, in PyTorch's snapshot format, its stacks as the script's
        own run would show them (memkit's frames left out)."""
        if self._sim is not None:
            return without_memkit_frames(self._sim.snapshot())
        return without_memkit_frames(cuda_history_snapshot())

    def dump(self) -> Path:
        """Write the snapshot to :attr:`path` (pickle protocol 4) and return it."""
        return write_snapshot(self.snapshot(), self.path)

    def stop(self) -> None:
        """Stop recording (on CUDA: ``_record_memory_history(enabled=None)``)."""
        if self._sim is not None:
            self._sim.stop()
        elif self._cuda:
            stop_cuda_history()
            self._cuda = False

    @property
    def events(self) -> int | None:
        """Events recorded on the simulated device (``None`` on CUDA)."""
        return None if self._sim is None else self._sim.events_recorded
