"""Torch optimizers inside the wrappers frameworks hand back (accelerate's
``AcceleratedOptimizer``, Lightning's ``LightningOptimizer`` and Fabric's
``_FabricOptimizer``): torch's step hooks see the inner optimizer step, not the wrapper."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["state_tensors", "steps_in_backward", "unwrap_optimizer"]

_STATE_DEPTH = 3
"""How deep :func:`state_tensors` looks into lists, tuples and dicts of an optimizer's state."""


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


def steps_in_backward(param: torch.Tensor) -> bool:
    """Whether ``param``'s post-accumulate-grad hooks step an optimizer: the recipe that fuses
    the optimizer step into backward (a hook calling ``optimizer_dict[p].step()``), told by a
    hook's code naming a ``step``; not a hook that checks, logs or reduces the gradient.

    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> def check(t):
    ...     assert t.grad.isfinite().all()
    >>> _ = p.register_post_accumulate_grad_hook(check)
    >>> steps_in_backward(p)
    False
    >>> opt = torch.optim.SGD([p], lr=0.1)
    >>> _ = p.register_post_accumulate_grad_hook(lambda t: opt.step())
    >>> steps_in_backward(p)
    True
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return hooks is not None and any(map(_calls_a_step, hooks.values()))


def _calls_a_step(hook: Any) -> bool:
    fn = getattr(hook, "func", hook)  # (a functools.partial's)
    fn = getattr(fn, "__func__", fn)  # (a bound method's)
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    return code is not None and any("step" in name for name in code.co_names)


def state_tensors(value: Any, depth: int = _STATE_DEPTH) -> list[torch.Tensor]:
    """The tensors of one optimizer state entry: the value itself, or inside lists, tuples and
    dicts (LBFGS keeps its history as lists: ``old_dirs``, ``old_stps``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth <= 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in state_tensors(v, depth - 1)]
    return []
