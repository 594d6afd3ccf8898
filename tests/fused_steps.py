"""PyTorch's recipe for fusing the optimizer step into backward, for the tests: one optimizer
per parameter, stepped and zeroed by a post-accumulate-grad hook as its gradient is made."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def step_in_backward(
    params: Iterable[torch.nn.Parameter],
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
) -> dict[torch.Tensor, torch.optim.Optimizer]:
    """Give each of ``params`` an ``optimizer([p])`` that its hook steps; returns them."""
    optimizers = {p: optimizer([p]) for p in params}

    def step(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in optimizers:
        p.register_post_accumulate_grad_hook(step)
    return optimizers


def check_finite(params: Iterable[torch.nn.Parameter]) -> None:
    """A post-accumulate-grad hook on each of ``params`` that checks its gradient, stepping
    nothing."""

    def check(t: torch.Tensor) -> None:
        if not bool(t.grad.isfinite().all()):
            raise FloatingPointError("a gradient is not finite")

    for p in params:
        p.register_post_accumulate_grad_hook(check)
