"""Torch optimizers inside the wrappers frameworks hand back (accelerate's
``AcceleratedOptimizer``, Lightning's ``LightningOptimizer`` and Fabric's
``_FabricOptimizer``): torch's step hooks see the inner optimizer step, not the wrapper."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper (accelerate's ``AcceleratedOptimizer``, which
    subclasses ``Optimizer`` without its hooks' state; Lightning's ``LightningOptimizer``;
    Fabric's ``_FabricOptimizer``), or ``optimizer`` itself; ``None`` when it is no torch
    optimizer."""
    seen = 0
    while seen < 8 and not _is_plain(optimizer):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _is_plain(optimizer: Any) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer")
