"""Advice in Lightning's terms, where its training loop differs from a plain one (its closure
zeroes gradients after the forward, its evaluation loops already run under
``inference_mode``) and where the Trainer has a setting for the remedy (``precision``,
``accumulate_grad_batches``, a loader's ``batch_size``). With manual optimization
(``automatic_optimization = False``) the module's ``training_step`` zeroes and steps the
optimizers itself: Lightning calls neither ``optimizer_step`` nor ``optimizer_zero_grad`` and
refuses ``accumulate_grad_batches``, so those remedies are said in the step's own terms."""

from __future__ import annotations

import re
from collections.abc import Iterable

from memkit.advice.form import Advice, Phrasing, autocast_setting, in_terms, with_settings

__all__ = ["LIGHTNING_ACTIONS", "MANUAL_ACTIONS", "in_lightning_terms"]

ZERO_GRAD_ACTION = (
    "Lightning zeroes gradients inside its closure, after `training_step` and before the "
    "backward, so the previous step's gradients are alive through every forward. Free them "
    "right after the step instead: in your LightningModule, `def optimizer_step(self, epoch, "
    "batch_idx, optimizer, optimizer_closure=None): optimizer.step(closure=optimizer_closure); "
    "optimizer.zero_grad(set_to_none=True)` (Lightning's own zero_grad then finds nothing to "
    "free)."
)

MANUAL_ZERO_GRAD_ACTION = (
    "With manual optimization Lightning never zeroes gradients (nor calls `optimizer_step`): "
    "your `training_step` does. Call `opt.zero_grad(set_to_none=True)` right after each "
    "`opt.step()` instead of between the forward and `self.manual_backward(loss)`, so that no "
    "gradients are allocated when the next forward begins. A backward that also reaches "
    "another optimizer's parameters (a GAN's generator loss through the discriminator) fills "
    "their gradients too: zero that optimizer again after it."
)
MANUAL_ACCUMULATE = (
    "accumulate",
    "with manual optimization the accumulation is your `training_step`'s (Lightning refuses "
    "`accumulate_grad_batches`): call `opt.step()` and `opt.zero_grad()` every N batches, "
    "the loss divided by N",
)
AUTOCAST_SETTING = ("autocast", 'bf16 is `Trainer(precision="bf16-mixed")`')

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


def _accumulate_in_lightning(advice: Advice) -> str:
    """The probe's ``accumulate`` (``... over K steps of B ...``) as the DataLoader's batch
    size and the Trainer's ``accumulate_grad_batches`` (sweep BV: it said to call
    ``optimizer.step()`` every K micro batches, which Lightning does itself)."""
    found = re.search(r"over (\d+) steps of (\d+)", advice.title)
    if found is None:
        return advice.action
    steps, micro = found.groups()
    rest = advice.action.split(". ", 1)[1] if ". " in advice.action else ""
    return (
        f"`batch_size={micro}` in your DataLoader and `Trainer(accumulate_grad_batches="
        f"{steps})`: Lightning divides each micro-batch's loss by {steps} and steps the "
        f"optimizer every {steps} batches. {rest}"
    ).strip()


LIGHTNING_ACTIONS: dict[str, Phrasing] = {
    "accumulate": _accumulate_in_lightning,
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
            AUTOCAST_SETTING,
        ],
        sep="; ",
    ),
}
"""Advice actions said in Lightning's terms, by code."""

MANUAL_ACTIONS: dict[str, Phrasing] = {
    **LIGHTNING_ACTIONS,
    "accumulate": lambda a: a.action,  # (manual optimization steps where its code says)
    "zero-grad-keeps-grads": lambda a: MANUAL_ZERO_GRAD_ACTION,
    "oom-activations": with_settings(
        "In Lightning", [MANUAL_ACCUMULATE, AUTOCAST_SETTING], sep="; "
    ),
}
""":data:`LIGHTNING_ACTIONS` for a module with manual optimization."""


def in_lightning_terms(
    advice: Iterable[Advice], *, manual_optimization: bool = False
) -> tuple[Advice, ...]:
    """``advice`` with the actions of :data:`LIGHTNING_ACTIONS` (:data:`MANUAL_ACTIONS` for a
    module with ``automatic_optimization = False``) said in Lightning's terms; the rest as it
    was."""
    return in_terms(advice, MANUAL_ACTIONS if manual_optimization else LIGHTNING_ACTIONS)
