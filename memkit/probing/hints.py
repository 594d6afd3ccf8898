"""What to do about a step error that is not an OOM: the line a known cause gets under the
error's traceback (:func:`step_hint`)."""

from __future__ import annotations

import os
import re
import traceback

from torch.nn import Module

from memkit.errors import spelled
from memkit.probing import step as step_module
from memkit.probing.step import StepPlan

__all__ = ["step_hint"]

_CALL_PLUMBING = (
    os.path.join("torch", "nn", "modules", "module.py"),  # Module.__call__
    os.path.join("torch", "nn", "parallel", ""),  # DistributedDataParallel's, DataParallel's
    os.path.join("torch", "_dynamo", ""),  # a compiled model's wrapper
)
"""Where torch's frames between the default step's call and the model's ``forward`` are."""

_BATCH_STATISTIC = re.compile(r"\bnan\b|degrees of freedom|\b(std|var)\(", re.IGNORECASE)
"""A message that says a statistic over the batch failed: a NaN (the ``std`` or ``var`` of
one value, and what follows from it: a distribution's NaN logits), torch's ``std(): degrees
of freedom is <= 0``. ``std(`` and ``var(`` with their parenthesis: C++ messages say
``std::``."""


def step_hint(exc: BaseException, batch_size: int, plan: StepPlan) -> str:
    """A line for the error of ``plan``'s step at ``batch_size``, where a known cause explains
    it (``""`` where none does)."""
    text = str(exc)
    if batch_size == 1 and "Expected more than 1 value per channel" in text:
        return (
            f"\nBatchNorm needs at least 2 samples per channel in training: probe from "
            f"{_min_batch_2()}."
        )
    if _from_default_call(exc):
        how = _call_hint(exc, plan)
        if how:
            return how
    elif _NO_FORWARD in text:
        return (
            "\nThe model has no forward(), so model(...) cannot be called: call the methods it "
            "has instead."
        )
    if batch_size == 1 and _BATCH_STATISTIC.search(text):
        return (
            "\nAt batch size 1 a statistic over the batch has one value: its std or var is NaN "
            "(a PPO loss normalising its advantages, a normalisation layer). If the step "
            f"computes one, probe from {_min_batch_2()}."
        )
    dicts = _dicts_passed(exc)
    if dicts:
        calls = _calls(plan)
        own = (
            "eval_step(model, batch)"
            if plan.mode == "infer"
            else "train_step(model, batch, optimizer)"
        )
        return (
            f"\n{calls[0].upper() + calls[1:]} model(*batch) for a list or tuple batch: here "
            f"make_batch's {dicts} dict{'s' if dicts > 1 else ''}, each a positional argument "
            "(model(dict_0, dict_1, ...)). A detection model takes model(images, targets): "
            "return a tuple (images, targets) from make_batch, or write a "
            f"{own} that calls the model as your loop does."
        )
    return ""


_NO_FORWARD = 'is missing the required "forward" function'


def _dicts_passed(exc: BaseException) -> int:
    """How many dicts the default step passed as the model's positional arguments (a batch
    that is a list of per-sample or per-image dicts), read from its call's frame in the
    traceback; 0 where it passed none or did not make the call."""
    if not isinstance(exc, TypeError | ValueError | KeyError):
        return 0
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is step_module.call_model.__code__:
            batch, model = tb.tb_frame.f_locals.get("batch"), tb.tb_frame.f_locals.get("model")
            one = isinstance(model, Module) and step_module.takes_one_input(model)
            if isinstance(batch, tuple) and len(batch) > 1 and one:  # (model(batch[0]))
                return 0
            items = batch if isinstance(batch, list | tuple) else ()
            return len(items) if items and all(isinstance(b, dict) for b in items) else 0
        tb = tb.tb_next
    return 0


def _call_hint(exc: BaseException, plan: StepPlan) -> str:
    """The line for the default step's own call of the model failing: how it calls it, and
    what to write instead."""
    text = str(exc)
    calls = _calls(plan)
    said = calls[0].upper() + calls[1:]
    if plan.mode == "infer":
        own = "an eval_step(model, batch) (memkit runs it under torch.no_grad())"
    else:
        own = "a train_step(model, batch, optimizer)"
    if _NO_FORWARD in text:
        infer = spelled("--mode infer", "mode='infer'")
        what = (
            "that calls the methods your evaluation calls"
            if plan.mode == "infer"
            else "that calls its methods, backward and optimizer.step() as your loop does (and "
            f"an eval_step(model, batch) for {infer})"
        )
        return (
            "\nThe model has no forward() (an RL agent with get_value and "
            f"get_action_and_value, as cleanRL's), and {calls} model(batch): write "
            f"{own} {what}."
        )
    if not isinstance(exc, TypeError):
        return ""
    if re.search(r"forward\(\) got an unexpected keyword", text):
        return (
            f"\n{said} model(**batch) for a dict batch: its keys must be the names of "
            "forward's parameters (input_ids, attention_mask, labels for a transformers "
            "model). Return a tensor or a tuple (inputs, labels) from make_batch for a "
            f"forward(x), or write {own}."
        )
    if re.search(r"forward\(\) takes \d+ positional", text):
        return (
            f"\n{said} model(*batch) for a tuple or list batch, all its items as forward's "
            "arguments, and model(batch[0]) for a tuple when forward takes one argument: "
            "return a tuple (inputs, labels) from make_batch for a one-input forward (a "
            "DataLoader's batch is a list); where the batch holds more than a forward of "
            "several inputs takes (labels, lengths for the loss), write "
            f"{own} that calls the model as your loop does."
        )
    if re.search(r"forward\(\) missing \d+ required", text):
        return (
            f"\n{said} model(batch) for a tensor batch, model(*batch) for a tuple or "
            "list, model(**batch) for a dict: return all of forward's arguments from "
            f"make_batch, or write {own} that calls the model as your loop does (a diffusion "
            "model's forward(x, t) with the timesteps it samples)."
        )
    return ""


def _min_batch_2() -> str:
    return spelled("--min-batch 2", "min_batch=2")


def _calls(plan: StepPlan) -> str:
    """Who calls the model, up to the verb: the default training step, or the evaluation
    step, which never runs ``train_step``."""
    if plan.mode != "infer":
        return "the default step calls"
    infer = spelled("--mode infer", "mode='infer'")
    if plan.train_step is not None:
        return f"{infer} runs no train_step (that is training's): it calls"
    return f"{infer} calls"


def _from_default_call(exc: BaseException) -> bool:
    """Whether the default step's own call of the model raised ``exc`` (the call's
    arguments do not fit ``forward``, or there is no ``forward``), not code inside the model
    or a user's step: past torch's plumbing (``Module.__call__``, the DDP, DataParallel and
    compiled wrappers), the innermost frame is :func:`memkit.probing.step.call_model`."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not any(part in f.filename for part in _CALL_PLUMBING)
    ]
    last = frames[-1] if frames else None
    return last is not None and last.filename == step_module.__file__ and last.name == "call_model"
