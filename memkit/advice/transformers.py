"""Advice in the terms of transformers' ``Trainer``: where ``TrainingArguments`` has a setting
for the remedy (``per_device_eval_batch_size``, ``bf16``, ``gradient_accumulation_steps``,
``gradient_checkpointing``), the action names it, and what the Trainer already does
(evaluation under ``torch.no_grad()``) is not asked for."""

from __future__ import annotations

from collections.abc import Iterable

from memkit.advice.form import Advice, Phrasing, autocast_setting, in_terms, with_settings

__all__ = ["TRANSFORMERS_ACTIONS", "in_transformers_terms"]

EVAL_PEAK_ACTION = (
    "Give evaluation its own, smaller batch: `per_device_eval_batch_size` in TrainingArguments "
    "(it needs no gradients, so this does not change training). The Trainer already evaluates "
    "under `torch.no_grad()`."
)
OOM_EVAL_ACTION = (
    "Lower `per_device_eval_batch_size` in TrainingArguments: it is independent of the "
    "training batch. The Trainer already evaluates under `torch.no_grad()` with `model.eval()`; "
    "set `eval_accumulation_steps` so that the predictions it gathers move to the CPU every few "
    "batches instead of piling up on the device."
)


def checkpointing_flag() -> str:
    """TrainingArguments' checkpointing switch in the installed transformers:
    ``activation_checkpointing`` where it has it (``gradient_checkpointing`` is its deprecated
    alias there, which 5.24 warns about: sweep CM), else ``gradient_checkpointing``."""
    try:
        from transformers import TrainingArguments
    except ImportError:  # (phrasing without transformers: the long-standing name)
        return "gradient_checkpointing"
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else ("gradient_checkpointing")
    )


def _checkpointing_action(advice: Advice) -> str:
    return (
        f"`{checkpointing_flag()}=True` in TrainingArguments: the model's layers are "
        "recomputed in backward, at about one extra forward of them per step."
    )


TRANSFORMERS_ACTIONS: dict[str, Phrasing] = {
    "eval-peak": lambda a: EVAL_PEAK_ACTION,
    "oom-eval": lambda a: OOM_EVAL_ACTION,
    "mixed-precision": autocast_setting(
        lambda fp16: f"`{'fp16' if fp16 else 'bf16'}=True` in TrainingArguments",
        "the Trainer",
        "fp16",
    ),
    "activation-checkpointing": _checkpointing_action,
    "oom-activations": with_settings(
        "In TrainingArguments",
        [
            ("accumulate", "`per_device_train_batch_size` and `gradient_accumulation_steps`"),
            ("torch.utils.checkpoint", f"`{checkpointing_flag()}=True`"),
            ("autocast", "`bf16=True`"),
        ],
    ),
}
"""Advice actions said in the Trainer's terms, by code."""


def in_transformers_terms(advice: Iterable[Advice]) -> tuple[Advice, ...]:
    """``advice`` with the actions of :data:`TRANSFORMERS_ACTIONS` said in the Trainer's
    terms; the rest as it was."""
    return in_terms(advice, TRANSFORMERS_ACTIONS)
