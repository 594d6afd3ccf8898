"""Advice in Lightning's terms, where its training loop differs from a plain one (its closure
zeroes gradients after the forward, its evaluation loops already run under
``inference_mode``) and where the Trainer has a setting for the remedy (``precision``,
``accumulate_grad_batches``, a loader's ``batch_size``)."""

from __future__ import annotations

from collections.abc import Iterable

from memkit.advice.form import Advice, Phrasing, autocast_setting, in_terms, with_settings

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
OOM_EVAL_ACTION = (
    "Lower the evaluation batch size (the DataLoader's `batch_size` in `val_dataloader()`, "
    "`test_dataloader()` or `predict_dataloader()`): it is independent of the training batch. "
    "Lightning already runs these loops under `torch.inference_mode()` with the module in eval "
    "mode; move what you keep of their outputs to the CPU."
)


LIGHTNING_ACTIONS: dict[str, Phrasing] = {
    "zero-grad-keeps-grads": lambda a: ZERO_GRAD_ACTION,
    "eval-peak": lambda a: EVAL_PEAK_ACTION,
    "oom-eval": lambda a: OOM_EVAL_ACTION,
    "mixed-precision": autocast_setting(
        lambda fp16: f'`Trainer(precision="{"16" if fp16 else "bf16"}-mixed")`',
        "Lightning",
        "16-mixed",
    ),
    "oom-activations": with_settings(
        "In Lightning",
        [
            (
                "accumulate",
                "the micro-batch is the DataLoader's `batch_size`, the accumulation "
                "`Trainer(accumulate_grad_batches=N)`",
            ),
            ("autocast", 'bf16 is `Trainer(precision="bf16-mixed")`'),
        ],
        sep="; ",
    ),
}
"""Advice actions said in Lightning's terms, by code."""


def in_lightning_terms(advice: Iterable[Advice]) -> tuple[Advice, ...]:
    """``advice`` with the actions of :data:`LIGHTNING_ACTIONS` said in Lightning's terms; the
    rest as it was."""
    return in_terms(advice, LIGHTNING_ACTIONS)
