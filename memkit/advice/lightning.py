"""Advice in Lightning's terms, where its training loop differs from a plain one: its closure
zeroes gradients after the forward, and its validation loop already runs under
``inference_mode``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from memkit.advice.form import Advice

__all__ = ["LIGHTNING_ACTIONS", "in_lightning_terms"]

ZERO_GRAD_ACTION = (
    "Lightning zeroes gradients inside its closure, after `training_step` and before the "
    "backward, so the previous step's gradients are alive through every forward. Free them "
    "right after the step instead: in your LightningModule, `def optimizer_step(self, epoch, "
    "batch_idx, optimizer, optimizer_closure=None): optimizer.step(closure=optimizer_closure); "
    "optimizer.zero_grad(set_to_none=True)` (Lightning's own zero_grad then finds nothing to "
    "free)."
)


EVAL_PEAK_ACTION = (
    "Give validation its own, smaller batch size (its DataLoader's `batch_size` in "
    "`val_dataloader()`): it needs no gradients, so this does not change training. Lightning "
    "already runs validation under `torch.inference_mode()`."
)
LIGHTNING_ACTIONS = {
    "zero-grad-keeps-grads": ZERO_GRAD_ACTION,
    "eval-peak": EVAL_PEAK_ACTION,
}
"""Advice actions said in Lightning's terms where its loop differs from a plain one."""


def in_lightning_terms(advice: Iterable[Advice]) -> tuple[Advice, ...]:
    """``advice`` with the actions of :data:`LIGHTNING_ACTIONS` said in Lightning's terms; the
    rest as it was."""
    return tuple(
        dataclasses.replace(a, action=LIGHTNING_ACTIONS[a.code])
        if a.code in LIGHTNING_ACTIONS
        else a
        for a in advice
    )
