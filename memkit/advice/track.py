"""Advice rules of the tracker: functions from measured results to :class:`~memkit.advice.Advice`.

* ``graph-retained`` / ``memory-growth``: memory grows every step
  (see :mod:`memkit.tracking.leaks`).
* ``eval-grad-enabled``: forward passes in eval mode with autograd recording keep activations
  that nothing will use.
* OOM rules (:func:`oom_advice`), from a post-mortem's breakdown: ``oom-activations``,
  ``oom-optimizer-state``, ``oom-parameters``, ``oom-other``; and ``fragmentation`` and
  ``other-processes`` from the CUDA message (rules of :mod:`memkit.advice`).

Each rule returns a list (empty when it does not fire), so the advice issue can collect them.

The rules that are functions of plain numbers live in :mod:`memkit.advice`;
:func:`measured_advice` feeds them this report's numbers: ``mixed-precision``,
``activation-checkpointing``, ``optimizer-state``, ``zero-grad-keeps-grads``, ``dp-to-ddp``,
``dp-loss-on-replicas``, ``fragmentation``, ``empty-cache`` (and, at an OOM, ``fragmentation``
and ``other-processes`` from the message).
"""

from __future__ import annotations

import itertools

from memkit import advice as rules_of
from memkit.advice import Advice
from memkit.oom import OomDetails
from memkit.render.track import format_shape
from memkit.tracking.leaks import graph_retained_advice
from memkit.tracking.report import DeviceReport, OomPostMortem, TrackReport
from memkit.units import format_size

__all__ = ["eval_grad_enabled", "graph_retained", "measured_advice", "oom_advice", "track_advice"]


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


def eval_peak(report: TrackReport) -> list[Advice]:
    """``eval-peak``: an evaluation pass, not training, sets the device's peak."""
    out = []
    for dev in report.devices:
        evaluation = dev.phase_peaks.get("eval")
        training = max(
            (v for p in ("forward", "backward", "optimizer") if (v := dev.phase_peaks.get(p))),
            default=None,
        )
        if evaluation is None or training is None or evaluation <= training * 1.1:
            continue
        shape = report.eval_input_shape
        batch = "" if shape is None else f" with inputs of shape {format_shape(shape)}"
        out.append(
            Advice(
                code="eval-peak",
                title=f"evaluation needs more memory than training on {dev.device}",
                evidence=f"Evaluation peaked at {format_size(evaluation)}{batch}; training "
                f"peaked at {format_size(training)}. A larger batch or model will run out in "
                "evaluation first.",
                action="Give evaluation its own, smaller batch size (it needs no gradients, so "
                "it does not change training), and run it under `torch.inference_mode()`.",
                saving_bytes=evaluation - training,
                severity="info",
            )
        )
    return out


def track_advice(report: TrackReport, *, eval_grad_bytes: int = 0) -> list[Advice]:
    """Every tracker rule that fires on ``report``."""
    return [
        *graph_retained(report),
        *eval_grad_enabled(report, eval_grad_bytes),
        *eval_peak(report),
        *measured_advice(report),
    ]


def _oom_in_evaluation(pm: OomPostMortem) -> Advice:
    """``oom-eval``: the OOM came in an evaluation pass, where accumulation does not apply."""
    shape = pm.input_shape
    batch = "" if shape is None else f"; the model's first input was {format_shape(shape)}"
    kept = (
        "Autograd was recording, so every layer's activations were kept for a backward that "
        "never comes (see eval-grad-enabled)."
        if pm.grad_enabled
        else "Autograd was off: evaluation keeps no activations for a backward, so its memory "
        "is the model, the batch and a few layers' outputs."
    )
    return Advice(
        code="oom-eval",
        title="out of memory in an evaluation pass",
        evidence=f"It failed at {pm.where}{batch}. {kept} Gradient accumulation does not apply "
        "to evaluation.",
        action="Lower the evaluation batch size (a loader of its own, e.g. `--test-batch-size`): "
        "it is independent of the training batch. Run evaluation under "
        "`torch.inference_mode()` (or `torch.no_grad()`) with `model.eval()`, and move what you "
        "keep of its outputs to the CPU.",
        saving_bytes=None,
        severity="critical",
    )


# -- rules of memkit.advice, fed with a track report (issue #5) ---------------------------------


def _cache_releases(dev: DeviceReport) -> int:
    """Readings where reserved memory dropped by 1 MiB or more: the cache given back to the
    driver (``empty_cache``). Zero on devices without a caching allocator (reserved ==
    allocated throughout, the simulated device)."""
    points = dev.timeline
    if not any(p.reserved > p.allocated for p in points):
        return 0
    return sum(1 for a, b in itertools.pairwise(points) if b.reserved <= a.reserved - (1 << 20))


def measured_advice(report: TrackReport) -> list[Advice]:
    """The :mod:`memkit.advice` rules that fire on ``report``'s measurements."""
    out: list[Advice | None] = []
    trained = any(d.phase_peaks.get("backward") is not None for d in report.devices)
    for dev in report.devices:
        bd = dev.breakdown
        if bd is not None and bd.total > 0 and trained:
            out.append(
                rules_of.mixed_precision(
                    param_dtype=report.param_dtype,
                    autocast=report.autocast_forwards > 0,
                    activation_bytes=bd.activations,
                    peak_bytes=bd.total,
                    parameter_bytes=bd.parameters,
                    device=dev.device,
                    min_share=0.3,
                )
            )
            out.append(
                rules_of.activation_checkpointing(
                    activation_bytes=bd.activations,
                    peak_bytes=bd.total,
                    modules=[
                        rules_of.ModuleActivation(m.path, m.activation_bytes, m.leaf)
                        for m in dev.modules
                    ],
                    capacity=dev.capacity,
                    device=dev.device,
                )
            )
            transient = max(
                (
                    (s.phase_peaks.get("optimizer") or 0) - s.end_allocated
                    for s in dev.steps
                    if s.phase_peaks.get("optimizer") is not None
                ),
                default=0,
            )
            out.append(
                rules_of.optimizer_state(
                    optimizer_state_bytes=bd.optimizer_state,
                    parameter_bytes=bd.parameters,
                    peak_bytes=bd.total,
                    capacity=dev.capacity,
                    optimizer=report.optimizer_name,
                    optimizer_transient_bytes=transient if transient > 0 else None,
                    ranks=report.world_size,
                    device=dev.device,
                )
            )
            out.append(
                rules_of.zero_grad_keeps_grads(
                    steps_with_grads=report.steps_with_grads_at_forward,
                    gradient_bytes=bd.gradients,
                    peak_phase=bd.phase,
                    device=dev.device,
                )
            )
        out.append(
            rules_of.fragmentation(
                reserved=dev.peak_reserved,
                allocated=dev.peak_allocated,
                peak_allocated=dev.peak_allocated,
                device=dev.device,
            )
        )
        out.append(
            rules_of.empty_cache(
                reserved=dev.peak_reserved,
                allocated=dev.peak_allocated,
                device=dev.device,
                cache_releases=_cache_releases(dev),
                steps=len(dev.steps),
            )
        )
    if report.dp_device_ids and len(report.devices) >= 2 and report.dp_output_device:
        primary = next((d for d in report.devices if d.device == report.dp_output_device), None)
        pbd = primary.breakdown if primary is not None else None
        out.append(
            rules_of.dp_to_ddp(
                {d.device: d.peak_allocated for d in report.devices},
                report.dp_output_device,
                gradient_bytes=pbd.gradients if pbd is not None else 0,
                optimizer_state_bytes=pbd.optimizer_state if pbd is not None else 0,
                parameter_bytes=pbd.parameters if pbd is not None else 0,
                gathered_output_bytes=report.dp_output_bytes,
            )
        )
        out.append(
            rules_of.dp_loss_on_replicas(
                report.dp_output_bytes,
                report.dp_output_device,
                len(report.dp_device_ids),
                primary.peak_allocated if primary is not None else None,
            )
        )
    # one advice per code: the first device that shows it (the primary under DataParallel)
    seen: set[str] = set()
    result: list[Advice] = []
    for a in out:
        if a is not None and a.code not in seen:
            seen.add(a.code)
            result.append(a)
    return result


def oom_advice(
    pm: OomPostMortem,
    reserved_unallocated: int | None = None,
    *,
    details: OomDetails | None = None,
) -> list[Advice]:
    """What to do about the OOM described by ``pm`` (most useful first); ``details`` (the
    parsed message) adds ``fragmentation`` and ``other-processes``."""
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
    if pm.phase == "eval":
        out.append(_oom_in_evaluation(pm))
    if bd is not None and bd.total > 0:
        share = {name: value / bd.total for name, value in bd.parts()}
        if share["activations"] >= 0.4 and pm.phase != "eval":
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
    # -- rules of memkit.advice, from the OOM message (issue #5) --
    if reserved_unallocated is None and details is not None:
        reserved_unallocated = details.reserved_unallocated
    if reserved_unallocated is not None and pm.tried_to_allocate is not None:
        allocated = (
            details.allocated_by_pytorch
            if details is not None and details.allocated_by_pytorch is not None
            else pm.allocated or 0
        )
        frag = rules_of.fragmentation(
            reserved=allocated + reserved_unallocated,
            allocated=allocated,
            tried_to_allocate=pm.tried_to_allocate,
            capacity=pm.capacity,
            device=pm.device,
        )
        if frag is not None:
            out.append(frag)
    if (
        details is not None
        and details.process_in_use is not None
        and details.capacity is not None
        and details.free is not None
    ):
        others = rules_of.other_processes(
            used=details.capacity - details.free,
            this_process=details.process_in_use,
            total=details.capacity,
            device=pm.device,
            includes_context=True,
            processes=rules_of.processes_in_oom_message(pm.exception),
        )
        if others is not None:
            out.append(others)
    return out
