"""PyTorch's cuBLAS workspaces: the device memory its matmuls keep, which no tensor owns
(torch-free: the estimate's families and the CUDA backend's accounting both read it).

PyTorch allocates one workspace through the caching allocator for each (cuBLAS handle, stream)
that runs a matmul, and keeps it until ``torch._C._cuda_clearCublasWorkspaces()``
(``aten/src/ATen/cuda/CublasHandlePool.cpp``). Handles are per thread, so a training step
usually holds two: the forward's thread and autograd's device thread (an H200 run: 64 MiB in
a breakdown's "other"). cuBLASLt shares the cuBLAS workspace by default. The size is
``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs when set, else PyTorch's default for
the card.
"""

from __future__ import annotations

import os
import re

__all__ = ["HOPPER_WORKSPACE", "PRE_HOPPER_WORKSPACE", "cublas_workspace_bytes"]

PRE_HOPPER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
"""PyTorch's default cuBLAS workspace before Hopper (``:4096:2:16:8``, 8.125 MiB)."""
HOPPER_WORKSPACE = 4096 * 1024 * 8
"""PyTorch's default cuBLAS workspace on sm90 and later (``:4096:8``, 32 MiB)."""

_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_bytes(major: int, config: str | None = None) -> int:
    """One workspace's bytes on a card of compute capability ``major``: ``config`` (default:
    the ``CUBLAS_WORKSPACE_CONFIG`` environment variable) as PyTorch parses it, summing
    ``SIZE_KIB * COUNT`` over its pairs, else PyTorch's default (which an unparsable value
    also gets).

    >>> cublas_workspace_bytes(9, ""), cublas_workspace_bytes(8, "")
    (33554432, 8519680)
    >>> cublas_workspace_bytes(8, ":4096:8")
    33554432
    """
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "") if config is None else config
    pairs = _PAIR.findall(value)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return HOPPER_WORKSPACE if major >= 9 else PRE_HOPPER_WORKSPACE
