"""Gradient accumulation: reach a target effective batch with micro batches that fit."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memkit.advice import Advice
from memkit.errors import ConfigError

__all__ = ["AccumulationPlan", "accumulation_advice", "exact_split", "plan_accumulation"]


@dataclass(frozen=True)
class AccumulationPlan:
    """Micro batch per device x accumulation steps x world size = effective batch."""

    target_batch: int
    micro_batch: int
    steps: int
    world_size: int

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.steps * self.world_size

    @property
    def exact(self) -> bool:
        return self.effective_batch == self.target_batch


def plan_accumulation(
    target_batch: int, max_micro_batch: int, world_size: int = 1
) -> AccumulationPlan:
    """The fewest accumulation steps, with a micro batch that makes the target exact if any.

    Steps are ``ceil(target / (max_micro_batch * world_size))``. If the target divides evenly
    by ``steps * world_size``, the micro batch is that quotient (at most ``max_micro_batch``).
    Otherwise up to 25% more steps are tried for an exact split; failing that, the smallest
    micro batch that reaches the target at the first step count is used, and the effective batch
    overshoots the target by less than ``steps * world_size`` (the plan says so).

    Examples:
        >>> plan_accumulation(256, 48)
        AccumulationPlan(target_batch=256, micro_batch=43, steps=6, world_size=1)
        >>> plan_accumulation(256, 60)  # 5 steps of 52 overshoot; 6 steps of 43 overshoot too
        AccumulationPlan(target_batch=256, micro_batch=52, steps=5, world_size=1)
        >>> plan_accumulation(250, 60)
        AccumulationPlan(target_batch=250, micro_batch=50, steps=5, world_size=1)
        >>> plan_accumulation(1000, 48, world_size=2).effective_batch
        1012
    """
    if target_batch < 1 or max_micro_batch < 1 or world_size < 1:
        raise ConfigError(
            f"expected positive target batch, micro batch and world size, found "
            f"{target_batch}, {max_micro_batch}, {world_size}"
        )
    first = math.ceil(target_batch / (max_micro_batch * world_size))
    for steps in range(first, first + max(1, first // 4) + 1):
        per_step = steps * world_size
        if target_batch % per_step == 0 and target_batch // per_step <= max_micro_batch:
            return AccumulationPlan(target_batch, target_batch // per_step, steps, world_size)
    micro = math.ceil(target_batch / (first * world_size))
    return AccumulationPlan(target_batch, micro, first, world_size)


def exact_split(target_batch: int, max_micro_batch: int, world_size: int = 1) -> AccumulationPlan:
    """The fewest accumulation steps whose micro batch (at most ``max_micro_batch``) reaches
    ``target_batch`` exactly; a micro batch of 1 always does when the world size divides it.

    Examples:
        >>> exact_split(256, 60)
        AccumulationPlan(target_batch=256, micro_batch=32, steps=8, world_size=1)
    """
    for micro in range(min(max_micro_batch, target_batch), 0, -1):
        if target_batch % (micro * world_size) == 0:
            steps = target_batch // (micro * world_size)
            return AccumulationPlan(target_batch, micro, steps, world_size)
    return AccumulationPlan(target_batch, 1, math.ceil(target_batch / world_size), world_size)


def accumulation_advice(
    plan: AccumulationPlan, recommended: int, device: str, *, batch_norm: bool = False
) -> Advice:
    """The ``accumulate`` advice for a plan built on the probe's ``recommended`` batch size."""
    world = f" x {plan.world_size} ranks" if plan.world_size > 1 else ""
    if plan.steps == 1:
        return Advice(
            code="accumulate",
            title=f"Target batch {plan.target_batch} fits without accumulation",
            evidence=(
                f"The recommended batch size on {device} is {recommended} per device; the "
                f"target needs {plan.micro_batch} per device{world}."
            ),
            action=f"Train with batch_size={plan.micro_batch} per device; no accumulation needed.",
        )
    if plan.exact:
        overshoot = ""
        schedule = "The effective batch (and so the learning-rate schedule) matches the target."
    else:
        exact = exact_split(plan.target_batch, recommended, plan.world_size)
        overshoot = (
            f" With {plan.steps} steps no micro batch gives exactly {plan.target_batch}; an exact "
            f"split needs {exact.steps} steps of {exact.micro_batch}."
        )
        schedule = (
            f"The effective batch is {plan.effective_batch}, "
            f"{plan.effective_batch - plan.target_batch} above the target: scale the learning "
            f"rate for it, or use {exact.steps} steps of {exact.micro_batch} to match exactly."
        )
    norm = f" Batch-norm statistics see micro batches of {plan.micro_batch}." if batch_norm else ""
    return Advice(
        code="accumulate",
        title=(
            f"Accumulate gradients over {plan.steps} steps of {plan.micro_batch} "
            f"for an effective batch of {plan.effective_batch}"
        ),
        evidence=(
            f"Target effective batch {plan.target_batch}; the recommended batch size on {device} "
            f"is {recommended}{world}.{overshoot}"
        ),
        action=(
            f"batch_size={plan.micro_batch}; call optimizer.step() and zero_grad() every "
            f"{plan.steps} micro batches and divide each micro batch's loss by {plan.steps}. "
            f"{schedule}{norm}"
        ),
    )
