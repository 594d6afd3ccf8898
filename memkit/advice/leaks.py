"""Leak advice: ``graph-retained`` (a live variable holds a growing autograd graph) and
``memory-growth`` (memory grows and no variable is named), from the tracker's leak findings
(:mod:`memkit.tracking.leaks` finds them)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from memkit.advice.form import Advice
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.tracking.report import LeakFinding

__all__ = ["graph_retained_advice"]


def graph_retained_advice(leaks: list[LeakFinding]) -> list[Advice]:
    """``graph-retained``: memory grows each step and a live variable holds an autograd graph."""
    out: list[Advice] = []
    for leak in leaks:
        if leak.period > 1:
            growth = (
                f"Allocated memory on {leak.device} grew by "
                f"{format_size(leak.growth_per_step * leak.period)} every {leak.period} steps "
                f"over {leak.steps} steps (from step {leak.first_step}) without coming back down."
            )
        elif leak.graph_growth and leak.growth_per_step <= 0:
            growth = (
                f"An autograd graph grew by about {leak.graph_growth} nodes per step (from step "
                f"{leak.first_step}); device memory on {leak.device} stayed flat because "
                "backward freed the saved tensors, but every step's graph nodes stay alive in "
                "host memory, and anything that still holds tensors keeps them on the device."
            )
        else:
            growth = (
                f"Allocated memory on {leak.device} grew by {format_size(leak.growth_per_step)} "
                f"per step over {leak.steps} steps (from step {leak.first_step}) without "
                "coming back down."
            )
        names = ", ".join(f"`{s.name}` ({s.where})" for s in leak.suspects[:3])
        grown = leak.growth_per_step * leak.steps
        if leak.held_batches > 1 and grown > 0 and leak.held_batch_bytes >= grown:
            growth += (
                f" {leak.held_batches} input tensors the model has read are still alive "
                f"({format_size(leak.held_batch_bytes)}): the simulated device counts a host "
                "tensor from the step that first feeds it to the model, so batches a script "
                "keeps (a list built before training) grow here one by one. On a GPU they "
                "would be there from the start if moved up front, or copied per step."
            )
        if not leak.suspects or not leak.suspects[0].growing:
            # a variable seen holding a graph whose graph never grew is the step's own (its
            # loss), not shown to be the cause: say what was seen, claim nothing
            seen = (
                f" At the end of a step {names} held an autograd graph, but none of their "
                "graphs grew between two scans: the step's own, most likely, not the cause."
                if leak.suspects
                else " No variable of the training thread holds an autograd graph."
            )
            out.append(
                Advice(
                    code="memory-growth",
                    title=f"memory grows every step on {leak.device}",
                    evidence=growth + seen + " Look for tensors kept in lists, caches or "
                    "globals (the scan sees locals, `self`'s attributes and containers two "
                    "levels deep).",
                    action="Keep only Python numbers across steps (`.item()`), or `.detach()` "
                    "tensors you store; check caches that grow with the step count.",
                    saving_bytes=leak.growth_per_step or None,
                    severity="warning",
                )
            )
            continue
        top = leak.suspects[0]
        if top.carried:  # a state the next step builds on: cut its graph at each step
            action = (
                f"Detach `{top.name}` where each step begins (`{top.name} = "
                + (
                    f"tuple(h.detach() for h in {top.name})`"
                    if top.kind == "container"
                    else f"{top.name}.detach()`"
                )
                + ", as truncated backpropagation through time does), so backward stops at "
                "the step; `retain_graph=True` is then no longer needed."
            )
        else:
            if top.kind != "container":
                fix = f"`{top.name} += loss.item()` (or `loss.detach()`)"
            elif re.search(rf"{re.escape(top.name)}\s*\[[^\]]*\]\s*=(?!=)", top.code):
                fix = f"`{top.name}[key] = x.item()` (or `x.detach()`)"  # a dict it fills
            else:
                fix = f"`{top.name}.append(x.item())` (or `x.detach()`)"
            action = f"Store numbers, not graphs: {fix}. Use `torch.no_grad()` for code that "
            action += "only logs."
        out.append(
            Advice(
                code="graph-retained",
                title=f"`{top.name}` keeps an autograd graph alive across steps",
                evidence=growth
                + f" Still holding a graph at the end of a step: {names}"
                + (f"; line: `{top.code}`" if top.code else "")
                + ". Each step's graph (and whatever tensors it saved) stays alive.",
                action=action,
                saving_bytes=leak.growth_per_step or None,
                severity="critical",
            )
        )
    return out
