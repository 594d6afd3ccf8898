"""Advice rules of the tracker: functions from measured results to :class:`~memkit.advice.Advice`.

* ``graph-retained`` / ``memory-growth``: memory grows every step
  (see :mod:`memkit.tracking.leaks`).
* ``eval-grad-enabled``: forward passes in eval mode with autograd recording keep activations
  that nothing will use.
* OOM rules (:func:`oom_advice`), from a post-mortem's breakdown: ``oom-activations``,
  ``oom-optimizer-state``, ``oom-parameters``, ``oom-fragmentation``, ``oom-leak``.

Each rule returns a list (empty when it does not fire), so the advice issue can collect them.
"""

from __future__ import annotations

from memkit.advice import Advice
from memkit.tracking.leaks import graph_retained_advice
from memkit.tracking.report import OomPostMortem, TrackReport
from memkit.units import format_size

__all__ = ["eval_grad_enabled", "graph_retained", "oom_advice", "track_advice"]


def graph_retained(report: TrackReport) -> list[Advice]:
    """``graph-retained`` (or ``memory-growth`` without a named variable) per growing device."""
    return graph_retained_advice(report.leaks)


def eval_grad_enabled(report: TrackReport, eval_grad_bytes: int = 0) -> list[Advice]:
    """``eval-grad-enabled``: forwards in eval mode while autograd was recording."""
    if report.eval_grad_forwards <= 0:
        return []
    kept = (
        f" The largest kept {format_size(eval_grad_bytes)} of activations for a backward that "
        "never comes."
        if eval_grad_bytes > 0
        else ""
    )
    return [
        Advice(
            code="eval-grad-enabled",
            title="evaluation runs with autograd recording",
            evidence=f"{report.eval_grad_forwards} forward pass(es) ran with the model in eval "
            f"mode and torch.is_grad_enabled() true.{kept} Results that are kept (a summed "
            "validation loss, stored outputs) hold those graphs alive.",
            action="Wrap evaluation in `with torch.no_grad():` (or `torch.inference_mode()`); "
            "`model.eval()` alone does not stop autograd.",
            saving_bytes=eval_grad_bytes or None,
            severity="warning",
        )
    ]


def track_advice(report: TrackReport, *, eval_grad_bytes: int = 0) -> list[Advice]:
    """Every tracker rule that fires on ``report``."""
    return [*graph_retained(report), *eval_grad_enabled(report, eval_grad_bytes)]


def oom_advice(pm: OomPostMortem, reserved_unallocated: int | None = None) -> list[Advice]:
    """What to do about the OOM described by ``pm`` (most useful first)."""
    out: list[Advice] = []
    bd = pm.breakdown
    where = pm.where
    if pm.leak is not None:
        leak_advice = graph_retained_advice([pm.leak])
        for a in leak_advice:
            out.append(
                Advice(
                    code=a.code,
                    title=a.title + " (and ran out)",
                    evidence=a.evidence,
                    action=a.action,
                    saving_bytes=a.saving_bytes,
                    severity="critical",
                )
            )
    if pm.training is False and pm.grad_enabled:
        out.append(
            Advice(
                code="eval-grad-enabled",
                title="out of memory during evaluation with autograd recording",
                evidence=f"The last forward ran with the model in eval mode and autograd on "
                f"({where}): every activation is kept for a backward that never comes.",
                action="Wrap evaluation in `with torch.no_grad():` (or `torch.inference_mode()`).",
                saving_bytes=bd.activations if bd is not None else None,
                severity="critical",
            )
        )
    if bd is not None and bd.total > 0:
        share = {name: value / bd.total for name, value in bd.parts()}
        if share["activations"] >= 0.4 and not (pm.training is False and pm.grad_enabled):
            top = ", ".join(path for path, _ in pm.top_modules[:3])
            out.append(
                Advice(
                    code="oom-activations",
                    title="activations fill the device",
                    evidence=f"Activations were {format_size(bd.activations)} "
                    f"({100 * share['activations']:.0f}% of {format_size(bd.total)}) when it "
                    f"failed at {where}" + (f"; the largest come from {top}." if top else "."),
                    action="Halve the micro-batch and accumulate gradients over 2 steps (same "
                    "effective batch); or checkpoint the largest blocks "
                    "(`torch.utils.checkpoint`); or train in bf16/fp16 autocast.",
                    saving_bytes=bd.activations // 2,
                    severity="critical",
                )
            )
        if share["optimizer state"] >= 0.3:
            out.append(
                Advice(
                    code="oom-optimizer-state",
                    title="optimizer state is a large share",
                    evidence=f"Optimizer state was {format_size(bd.optimizer_state)} "
                    f"({100 * share['optimizer state']:.0f}%), "
                    f"{bd.optimizer_state / max(1, bd.parameters):.1f}x the parameters.",
                    action="Use a lighter optimizer state (SGD with momentum, Adafactor, 8-bit "
                    "Adam), or shard it across ranks (ZeroRedundancyOptimizer, FSDP).",
                    saving_bytes=bd.optimizer_state // 2,
                    severity="warning",
                )
            )
        if share["parameters"] >= 0.5:
            out.append(
                Advice(
                    code="oom-parameters",
                    title="the weights alone take most of the device",
                    evidence=f"Parameters were {format_size(bd.parameters)} "
                    f"({100 * share['parameters']:.0f}% of what was allocated).",
                    action="Keep weights in bf16, or shard them (FSDP); a smaller batch will "
                    "not help much.",
                    severity="warning",
                )
            )
        if share["other"] >= 0.3 and pm.leak is None:
            out.append(
                Advice(
                    code="oom-other",
                    title="much of the memory is not the model's",
                    evidence=f"{format_size(bd.other)} ({100 * share['other']:.0f}%) was "
                    "allocated before the step's forward and is neither parameters, gradients "
                    "nor optimizer state: batches, cached tensors, outputs kept from earlier "
                    "steps.",
                    action="Free what you keep across steps (`del`, `.item()`, `.detach()`), "
                    "move stored tensors to CPU.",
                    saving_bytes=bd.other,
                    severity="warning",
                )
            )
    if (
        reserved_unallocated is not None
        and pm.tried_to_allocate is not None
        and reserved_unallocated >= pm.tried_to_allocate
    ):
        out.append(
            Advice(
                code="oom-fragmentation",
                title="enough memory was reserved but fragmented",
                evidence=f"{format_size(reserved_unallocated)} was reserved by PyTorch but "
                f"unallocated, more than the {format_size(pm.tried_to_allocate)} requested.",
                action="Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting.",
                saving_bytes=reserved_unallocated,
                severity="warning",
            )
        )
    return out
