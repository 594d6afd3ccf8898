"""Gradient accumulation: plan a target effective batch with micro batches that fit (the
``accumulate`` advice on a plan: :func:`memkit.advice.probe.accumulation_advice`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memkit.errors import ConfigError

__all__ = ["AccumulationPlan", "exact_split", "plan_accumulation"]


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
    Otherwise up to a quarter more steps (at least one more) are tried for an exact split;
    failing that, the smallest micro batch that reaches the target at the first step count is
    used, and the effective batch overshoots the target by less than ``steps * world_size``
    (the plan says so).

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
