"""The CUDA caching allocator's own trace of allocations and frees (:mod:`memkit.history`)."""

from __future__ import annotations

from typing import Any

import torch


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
