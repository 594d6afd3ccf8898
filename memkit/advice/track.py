"""The advice of a track report: functions of a :class:`~memkit.tracking.report.TrackReport`.

* ``graph-retained`` / ``memory-growth``: memory grows every step (:mod:`memkit.advice.leaks`).
* ``eval-grad-enabled``: forward passes in eval mode with autograd recording keep activations
  that nothing will use; ``eval-peak``: evaluation, not training, sets the peak;
  ``frozen-model-peak``: a teacher's forward on the training batch does.
* :func:`measured_advice` feeds the rules of plain numbers this report's numbers:
  ``mixed-precision``, ``float64``, ``activation-checkpointing``, ``optimizer-state``,
  ``zero-grad-keeps-grads`` (:mod:`memkit.advice.training`), ``fragmentation``, ``empty-cache``
  (:mod:`memkit.advice.device`), ``dp-to-ddp``, ``dp-loss-on-replicas``
  (:mod:`memkit.advice.distributed`).

The OOM post-mortem's rules are in :mod:`memkit.advice.oom` (``oom_advice`` is re-exported
here). Each rule returns a list (empty when it does not fire), so the report can collect them.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

from memkit.advice.device import empty_cache, fragmentation
from memkit.advice.distributed import dp_loss_on_replicas, dp_to_ddp
from memkit.advice.form import Advice
from memkit.advice.leaks import graph_retained_advice
from memkit.advice.oom import oom_advice
from memkit.advice.training import (
    FLOAT32_MATH,
    EmbeddingTable,
    ModuleActivation,
    StepPass,
    activation_checkpointing,
    autocast_casts_to_half,
    autocast_keeps_float32,
    dense_embedding_gradients,
    float64_training,
    mixed_precision,
    oom_retry_holds,
    optimizer_state,
    retain_graph_held,
    stale_gradients,
    zero_grad_keeps_grads,
)
from memkit.units import format_shape, format_size

if TYPE_CHECKING:
    from memkit.tracking.report import (
        Breakdown,
        DeviceReport,
        ModuleRecord,
        StepRecord,
        TrackReport,
        TrainingSetup,
    )

__all__ = [
    "eval_grad_enabled",
    "eval_peak",
    "frozen_model_peak",
    "graph_retained",
    "measured_advice",
    "oom_advice",
    "track_advice",
]


def graph_retained(report: TrackReport) -> list[Advice]:
    """``graph-retained`` (or ``memory-growth`` without a named variable) per growing device."""
    return graph_retained_advice(report.leaks)


def eval_grad_enabled(report: TrackReport, eval_grad_bytes: int = 0) -> list[Advice]:
    """``eval-grad-enabled``: forwards in eval mode while autograd was recording."""
    if report.eval_grad_forwards <= 0:
        return []
    if report.oom is not None and any(a.code == "eval-grad-enabled" for a in report.oom.advice):
        # (sweep CP: the run died in that evaluation; its post-mortem prices no_grad at the
        # failing op, 16.00 MiB measured 15.99, where this said 11.56, or "training sets the
        # peak" in a run that evaluation ended)
        return []
    kept = (
        f" The largest kept {format_size(eval_grad_bytes)} of activations for a backward that "
        "never comes (no_grad lowers the evaluation's peak by up to that: its forward still "
        "holds a layer's input and output at once)."
        if eval_grad_bytes > 0
        else ""
    )
    # the saving lowers a peak only where evaluation sets it
    peaking = [d for d in report.devices if (d.phase_peaks.get("eval") or 0) >= d.peak_allocated]
    at_peak = bool(peaking)
    carried = max((d.eval_carried for d in peaking), default=0)
    if carried:  # what its kept results held from pass to pass (eval-peak claims them)
        kept += (
            f" Its passes began with up to {format_size(carried)} that earlier passes of the "
            "same evaluation left alive (kept results and the graphs they hold; no_grad frees "
            "the graphs, not the results: see eval-peak)."
        )
    saving = _below_training(peaking, eval_grad_bytes) if at_peak else None
    held = None if at_peak else _held_into_training(report, eval_grad_bytes)
    if held is not None:
        # (sweep CI: a DPO reference's log-probs precomputed with grad on, kept in a list:
        # "training sets the peak" where no_grad lowered it from 109.92 to 37.35 MiB)
        dev, saving = held
        kept += (
            f" Their results were kept with their graphs into training: the passes left up to "
            f"{format_size(dev.eval_carried)} alive from pass to pass, and training's peak "
            f"holds {format_size(dev.breakdown.other if dev.breakdown else 0)} of 'other' "
            "beside its own step: no_grad frees the graphs (the results stay), which lowers "
            f"training's peak too, by up to {format_size(saving)}."
        )
    elif eval_grad_bytes > 0 and not at_peak:
        kept += " Training sets the peak: no_grad lowers the evaluation's memory, not the peak."
    return [
        Advice(
            code="eval-grad-enabled",
            title="evaluation runs with autograd recording",
            evidence=f"{report.eval_grad_forwards} forward pass(es) ran outside training (the "
            "model in eval mode, or an SWA/EMA AveragedModel) with torch.is_grad_enabled() "
            f"true.{kept} Results that are kept (a summed "
            "validation loss, stored outputs) hold those graphs alive.",
            action="Wrap evaluation in `with torch.no_grad():` (or `torch.inference_mode()`); "
            "`model.eval()` alone does not stop autograd.",
            saving_bytes=saving,
            severity="warning",
        )
    ]


def _held_into_training(
    report: TrackReport, eval_grad_bytes: int
) -> tuple[DeviceReport, int] | None:
    """Where an evaluation with grad on ran in or before the step of training's peak, what its
    passes left alive from pass to pass (``eval_carried``: results and their graphs) was
    still allocated when it ended (``eval_left``; review: a summed validation loss read and
    dropped leaves nothing), and fits in that peak's 'other' (what the step did not make):
    ``(device, what no_grad would take off that peak)``, the passes' graphs (those carried,
    and the last pass's own), at most what the evaluation left and the 'other'."""
    for dev in report.devices:
        bd = dev.breakdown
        if bd is None or bd.step is None or bd.phase == "eval" or dev.eval_carried <= 0:
            continue
        steps = (s for s in dev.steps if s.step <= bd.step)
        evaluated = any(s.phase_peaks.get("eval") is not None for s in steps)
        if evaluated and min(bd.other, dev.eval_left) >= dev.eval_carried:
            return dev, min(bd.other, dev.eval_left, dev.eval_carried + eval_grad_bytes)
    return None


def _training_peak(dev: DeviceReport) -> int | None:
    """``dev``'s highest training phase peak (``None``: no training ran)."""
    return max(
        (v for p in ("forward", "backward", "optimizer") if (v := dev.phase_peaks.get(p))),
        default=None,
    )


def _below_training(devices: list[DeviceReport], saving: int) -> int | None:
    """``saving`` of evaluation's memory as the peak's: no lower than training's peak."""
    for dev in devices:
        training = _training_peak(dev)
        if training is not None:
            saving = min(saving, max(0, (dev.phase_peaks.get("eval") or 0) - training))
    return saving or None


def eval_peak(report: TrackReport) -> list[Advice]:
    """``eval-peak``: an evaluation pass, not training, sets the device's peak; where the
    eval column's peak is a frozen model's forward on the training batch (a distillation
    teacher), ``frozen-model-peak`` instead: that is the training step's memory. Nothing
    where it is a forward of models no optimizer trains inside the step (a teacher after the
    student's forward: :func:`_untrained_evaluated`); where such models run in most
    steps and the trained one is never evaluated (:func:`_frozen_every_step`: a teacher on
    another batch size, or an averaged copy validated every step), it says both readings."""
    out = []
    for dev in report.devices:
        evaluation, training = dev.phase_peaks.get("eval"), _training_peak(dev)
        if evaluation is None or training is None:
            continue
        frozen = report.frozen_peaks.get(dev.device)
        if frozen is not None and frozen >= evaluation:
            # the teacher's forwards set the eval column's peak: evaluation's own is lower
            # (not known apart), and what is high is the step's
            found = frozen_model_peak(report, dev.device, frozen, training)
            out.extend([found] if found is not None else [])
            continue
        if evaluation <= training * 1.1:
            continue
        if dev.eval_in_step >= evaluation and (
            _untrained_evaluated(dev) or dev.eval_in_forward >= evaluation
        ):
            # a teacher run inside the step (after the student's forward) or the trained
            # model's pseudo-labels there (FixMatch, review CM) are the step's memory, not an
            # evaluation (session 29: told to give evaluation a smaller batch); the trained
            # model validated between backward and the optimizer step is one (review CL)
            continue
        shape = report.eval_input_shape
        batch = "" if shape is None else f" with inputs of shape {format_shape(shape)}"
        every = _frozen_every_step(dev)
        if every is not None:
            # a teacher on the batch and augmented copies of it (twice the rows: booked as
            # evaluation) or an averaged copy validated every step: the report cannot tell
            # them apart (review CL: an EMA validated every step lost its eval-peak)
            out.append(
                Advice(
                    code="eval-peak",
                    title=f"{every}'s forwards in most steps peak above training on {dev.device}",
                    evidence=f"The forwards of {every}, which no optimizer trains, ran in "
                    f"most steps and peaked at {format_size(evaluation)}{batch}; training "
                    f"peaked at {format_size(training)}.",
                    action="If it is a teacher run on the training batch (augmented copies "
                    "too), run its forward in chunks of the batch under `torch.no_grad()` "
                    "(the same outputs, concatenated); if it is a copy validated every step, "
                    "give validation its own, smaller batch size.",
                    saving_bytes=evaluation - training,
                    severity="info",
                )
            )
            continue
        # what its passes keep from pass to pass sets it: under autograd (kept results hold
        # their graphs); without, what is carried may be state its passes need (a
        # generate()'s key-value cache, which a smaller batch shrinks)
        carried = dev.eval_carried if report.eval_grad_forwards > 0 else 0
        if carried and evaluation - carried <= training * 1.1:
            out.append(_eval_keeps(dev, evaluation, training, batch))
            continue
        leaked = _grown_evaluating(dev)
        if evaluation - leaked <= training * 1.1:  # (as the entry's margin: the rest is noise)
            out.append(
                Advice(
                    code="eval-peak",
                    title=f"evaluation peaks above training on {dev.device}: what the leak keeps",
                    evidence=f"Evaluation peaked at {format_size(evaluation)}{batch}; training "
                    f"peaked at {format_size(training)}. The {format_size(evaluation - training)}"
                    " between them is within what the device kept more after the evaluation "
                    f"that peaked than when training peaked ({format_size(leaked)}; the leak "
                    "grows in the steps that evaluate): evaluation holds what it "
                    "makes on top of what earlier evaluations kept, so the gap is the leak's "
                    "until it is fixed, and no saving is claimed for a smaller evaluation batch.",
                    action="Fix the leak first (its advice above), then track again: "
                    "evaluation's own peak says whether it needs a smaller batch.",
                    severity="info",
                )
            )
            continue
        autograd = (
            "and run it under `torch.inference_mode()`"
            if report.eval_grad_forwards > 0
            else "it already runs without autograd, so its batch is what sets its peak"
        )
        kept = (
            f" {format_size(leaked)} of the gap is what the leak kept by then (its advice "
            "above), which a smaller evaluation batch does not free."
            if leaked
            else ""
        )
        out.append(
            Advice(
                code="eval-peak",
                title=f"evaluation needs more memory than training on {dev.device}",
                evidence=f"Evaluation peaked at {format_size(evaluation)}{batch}; training "
                f"peaked at {format_size(training)}. A larger batch or model will run out in "
                f"evaluation first.{kept}",
                action="Give evaluation its own, smaller batch size (it needs no gradients, so "
                f"it does not change training); {autograd}.",
                saving_bytes=evaluation - training - leaked - carried,
                severity="info",
            )
        )
    return out


def _eval_keeps(dev: DeviceReport, evaluation: int, training: int, batch: str) -> Advice:
    """``eval-peak`` where what an evaluation's passes keep from pass to pass under autograd
    (a summed loss tensor, outputs kept on the device) makes its peak, not its batch."""
    carried = dev.eval_carried
    return Advice(
        code="eval-peak",
        title=f"evaluation peaks above training on {dev.device}: what its passes keep",
        evidence=f"Evaluation peaked at {format_size(evaluation)}{batch}; training peaked at "
        f"{format_size(training)}. Its passes began with up to {format_size(carried)} that "
        "earlier passes of the same evaluation left alive: a smaller evaluation batch does "
        "not free it, the same samples leave as much. Autograd was recording: a result kept "
        "as a tensor (`test_loss += loss`) keeps its pass's whole graph.",
        action="Keep numbers or host copies of what evaluation produces (`loss.item()`, "
        "`out.cpu()`, or the metric's running sum), under `torch.no_grad()`; then track "
        "again.",
        saving_bytes=min(carried, evaluation - training),
        severity="info",
    )


def _grown_evaluating(dev: DeviceReport) -> int:
    """What ``dev`` kept more, once the step whose evaluation peaked ended, than when the step
    of the training peak began, where a leak grew mostly in the steps that evaluate (an
    evaluation keeping its losses with their graphs); else 0. The gap between the two peaks
    is then the leak's up to that much; a run's whole growth would explain any gap once the
    run is long enough."""
    if dev.leak is None:
        return 0
    rises = [
        (s.end_allocated - s.start_allocated, s.phase_peaks.get("eval") is not None)
        for s in dev.steps
        if s.step >= dev.leak.first_step and s.end_allocated > s.start_allocated
    ]
    evaluating = sum(rise for rise, evaluated in rises if evaluated)
    if 2 * evaluating <= sum(rise for rise, _ in rises):
        return 0

    def training_peak(step: StepRecord) -> int:
        return max((v for p, v in step.phase_peaks.items() if p != "eval" and v), default=0)

    evaluated = [s for s in dev.steps if s.phase_peaks.get("eval") is not None]
    if not evaluated or not dev.steps:
        return 0
    peak_eval = max(evaluated, key=lambda s: s.phase_peaks.get("eval") or 0)
    peak_train = max(dev.steps, key=training_peak)
    after = peak_eval.end_allocated
    if (dev.phase_peaks.get("eval") or 0) > (peak_eval.phase_peaks.get("eval") or 0):
        after = dev.final_allocated  # it peaked after the last step's end, as the block ended
    return max(0, after - peak_train.start_allocated)


def frozen_model_peak(report: TrackReport, device: str, peak: int, training: int) -> Advice | None:
    """``frozen-model-peak``: the forward of a model no optimizer trains (a distillation
    teacher, a reference model), run on the training batch in every step, peaks above the
    training phases on ``device``: the step's memory is highest there. A fixed model can be
    held in bf16 or have its outputs computed offline; an EMA teacher changes every step (its
    forward under bf16 autocast).

    The saving of bf16: its forward's own bytes above where it began (activations, output)
    halve, and a model held in bf16 frees its parameters' bf16 saving in every phase; the
    peak falls to the higher of the two phases after (sweep CF: a teacher held in bf16 saved
    33.89 MiB where half its parameters, 2.26, were claimed)."""
    if report.frozen_model is None or peak <= training * 1.1:
        return None
    name, size, updated, wide = report.frozen_model
    shape = report.frozen_input_shape
    batch = "" if shape is None else f" on inputs of {format_shape(shape)}"
    base = report.frozen_bases.get(device)
    # its forward's own bytes halve in bf16, unless it ran under autocast already (review)
    own = 0 if base is None or report.frozen_autocast else max(0, peak - base)
    if updated:
        autocast = (
            ""
            if report.frozen_autocast
            else "run its forward under `torch.autocast(..., dtype=torch.bfloat16)` (its "
            "activations halve; its weights stay float32 for the update), or "
        )
        action = (
            f"`{name}` is written in place between its passes (an EMA or mean teacher): "
            f"{autocast}lower the training micro-batch and keep the effective batch with "
            "gradient accumulation."
        )
        saving = min(peak - training, own // 2)
    else:
        halves = (
            "of parameters halve (its forward runs under autocast already)"
            if report.frozen_autocast
            else "of parameters and the activations of its forward halve"
        )
        half = (
            "Hold it in bf16 (`.to(torch.bfloat16)` on the model, its floating-point inputs cast "
            "with `.to(torch.bfloat16)`, token ids as they are, and its output back with "
            "`.float()`: its "
            f"{format_size(size)} {halves}), or compute"
            if wide
            else "Compute"
        )
        action = (
            f"{half} its outputs once, offline, and load them with the batch; a smaller "
            "training micro-batch with gradient accumulation lowers its forward too."
        )
        saving = min(peak - training + wide, own // 2 + wide) if wide else 0
    return Advice(
        code="frozen-model-peak",
        title=f"the forward of `{name}`, "
        + ("models" if " and " in name else "a model")
        + f" no optimizer trains, sets the peak on {device}",
        evidence=f"{report.frozen_forwards} forward(s) of `{name}`{batch}, the training "
        f"batch, peaked at {format_size(peak)}; the training phases peaked at "
        f"{format_size(training)}. It runs in every step (the eval column counts it, "
        "evaluation's own passes are no higher): a larger batch runs out there first, and a "
        "smaller evaluation batch would not help.",
        action=action,
        saving_bytes=saving or None,
        severity="info",
    )


def track_advice(report: TrackReport, *, eval_grad_bytes: int = 0) -> list[Advice]:
    """Every tracker rule that fires on ``report``."""
    return [
        *graph_retained(report),
        *eval_grad_enabled(report, eval_grad_bytes),
        *eval_peak(report),
        *measured_advice(report),
    ]


# -- the rules of plain numbers, fed with a track report (issue #5) ------------------------------


def _cache_releases(dev: DeviceReport) -> int:
    """Readings where reserved memory dropped by 1 MiB or more: the cache given back to the
    driver (``empty_cache``). Zero on devices without a caching allocator (reserved ==
    allocated throughout, the simulated device)."""
    points = dev.timeline
    if not any(p.reserved > p.allocated for p in points):
        return 0
    return sum(1 for a, b in itertools.pairwise(points) if b.reserved <= a.reserved - (1 << 20))


def _optimizer_transient(dev: DeviceReport) -> int:
    """The most an optimizer step allocated above the step's end (its temporaries)."""
    return max(
        (
            (s.phase_peaks.get("optimizer") or 0) - s.end_allocated
            for s in dev.steps
            if s.phase_peaks.get("optimizer") is not None
        ),
        default=0,
    )


def _model_row(m: ModuleRecord) -> bool:
    """Whether ``m`` is a model's own row: named by its class (``Net``), or by its class and
    a number where another model of the class lived beside it (a distillation's student
    beside a teacher of its class: ``Net#2``)."""
    name, mark, number = m.path.partition("#")
    return name == m.type_name and (not mark or number.isdigit())


def _through_own_code(m: ModuleRecord, by_path: dict[str, ModuleRecord]) -> bool:
    """Whether ``m`` (a norm) is fed and read by its parent's own code: the parent kept at
    least as much as ``m`` did. A functional ``F.silu(self.norm(x))`` before a conv keeps the
    norm's float32 output, and a GroupNorm keeps a float32 copy of the residual sum it is fed
    (sweep BY's UNet was promised 4x the saving: 11.79 MiB where the estimate's CUDA rules
    and a CPU emulation of them measured 2.55-2.62 MiB; now 3.27)."""
    parent = by_path.get(m.path.rpartition(".")[0])
    return (
        parent is not None
        and not parent.leaf
        and parent.self_activation_bytes >= m.activation_bytes > 0
    )


def _wrapped(dev: DeviceReport, roots: list[ModuleRecord]) -> list[ModuleRecord]:
    """The models a single model's row wraps, each the one module its wrapper calls (peft's
    ``PeftModelForCausalLM`` > ``LoraModel`` > ``GPT2LMHeadModel``): their own code (a Hugging
    Face model's loss) is the model's (sweep BZ: a wrapper made it count as halved)."""
    if len(roots) != 1:
        return []
    chain: list[ModuleRecord] = []
    parent = ""
    while True:
        children = [
            m
            for m in dev.modules
            if m.calls > 0 and m not in roots and m.path.rpartition(".")[0] == parent
        ]
        if len(children) != 1 or children[0].leaf:
            return chain
        chain.append(children[0])
        parent = children[0].path


def _own_math_float32(type_name: str | None) -> bool:
    """Whether a module's own code keeps float32 under autocast: an attention's scores and
    probabilities (softmax, sdpa's math path), by its class name; not ``nn.MultiheadAttention``,
    whose own code is its in-projection, which autocast runs in half."""
    return type_name is not None and "Attention" in type_name and type_name != "MultiheadAttention"


def _float32_activations(dev: DeviceReport, activations: int) -> tuple[int, int]:
    """Of ``activations`` at ``dev``'s peak, what autocast would keep float32: ``(kept,
    temporaries)``. Kept, walking the leaf layers in call order: what a layer autocast runs
    in float32 kept (:func:`~memkit.advice.training.autocast_keeps_float32`), unless the next
    layer is one autocast runs in half (:func:`~memkit.advice.training.autocast_casts_to_half`:
    it keeps its own half copy of that input, and the float32 output is freed); what a layer
    that runs in its input's dtype (a dropout, an activation) kept where it is fed float32;
    what the last layer called kept (the loss reads its output in float32: `logits.float()`,
    or autocast's float32 loss ops, keep a float32 copy in its place); and what the models' and
    attentions' own code kept around their layers (their own bytes: a Hugging Face model's
    float32 loss; an attention's scores and probabilities, which softmax and sdpa's math path
    keep float32; a block's own GELU halves). Temporaries: the activations beyond what the
    models' forwards kept (at a peak in backward, the gradients of the loss math)."""
    roots = [m for m in dev.modules if _model_row(m) and m.calls > 0]
    leaves = sorted(
        (
            m
            for m in dev.modules
            if m.leaf and m.calls > 0 and m.first_call is not None and m not in roots
        ),
        key=lambda m: m.first_call or 0,
    )
    layers = 0
    wide = False  # the stream feeding the next layer is float32
    by_path = {m.path: m for m in dev.modules}
    for i, m in enumerate(leaves):
        follower = leaves[i + 1] if i + 1 < len(leaves) else None
        if m.type_name in FLOAT32_MATH:  # gelu_new: 3 of its 4 tensors (FLOAT32_MATH)
            wide = False  # (its product's half copy feeds the next layer)
            layers += round(m.activation_bytes * _together(m)) * 3 // 4
        elif autocast_keeps_float32(m.type_name):
            wide = True
            own_code = _through_own_code(m, by_path)
            if follower is None or not autocast_casts_to_half(follower.type_name) or own_code:
                layers += round(m.activation_bytes * _together(m))
            before = leaves[i - 1] if i else None
            fed_by_half = (
                before is not None
                and before.activation_bytes > 0
                and autocast_casts_to_half(before.type_name)
            )
            group_norm = (m.type_name or "").startswith("GroupNorm")
            if own_code and group_norm and not fed_by_half:
                # a conv net's GroupNorm fed by the model's own code (a residual sum, a skip
                # connection's concatenation: half under autocast, as the convs' outputs
                # are) keeps a float32 copy of that input (CUDA's autocast runs batch_norm in
                # its input's dtype)
                layers += round(m.activation_bytes * _together(m))
        elif autocast_casts_to_half(m.type_name):
            wide = False
            # the next layer runs float32 (a norm after a conv): it keeps a float32 copy of
            # this output in its place
            if follower is None or autocast_keeps_float32(follower.type_name):
                layers += round(m.activation_bytes * _together(m))
        elif m.type_name == "Dropout":
            # what it keeps besides its output: a CPU kernel's noise in the input's dtype,
            # which a float32 input (peft's lora_dropout casts to it) keeps float32; CUDA's
            # fused kernel's 1-byte mask in either precision (research for sweep BZ)
            size = round(m.activation_bytes * _together(m))
            mask = size // 2 if dev.device.startswith("cpu") else size // 5
            layers += mask + (size - mask if wide or follower is None else 0)
        elif wide or follower is None:
            layers += round(m.activation_bytes * _together(m))
    models = roots + _wrapped(dev, roots)
    own = sum(
        round(m.self_activation_bytes * _together(m))
        for m in dev.modules
        if not m.leaf and m.calls > 0 and (m in models or _own_math_float32(m.type_name))
    )
    if not roots:
        return min(activations, layers + own), 0
    kept = sum(round(m.activation_bytes * _together(m)) for m in roots)
    return min(activations, layers + own), max(0, activations - kept)


def _half_weights(dev: DeviceReport) -> tuple[int, int | None]:
    """``(frozen copies, cached)``: the half copies of weights autocast would keep on
    ``dev``, from the half layers that ran in training. Frozen float32 weights whose layer's
    input required grad: cast anew at each call, the copy kept for backward (the gradient of
    the input needs the weight: a frozen base's layers under LoRA adapters, not a frozen
    encoder under ``no_grad``; research for sweep BZ's LoRA GPT-2: 1.91 MiB that CPU
    autocast and the estimate's CUDA rules both keep). Trainable float32 weights of half
    layers: cached once (not an embedding table's, which no autocast list casts: sweep CG's
    DLRM, 25.3 MiB of EmbeddingBags taken off a 21 MiB saving). ``cached`` is ``None``
    without module records (steps-only: the trainable weights, all of them)."""
    if not dev.modules:
        return 0, None
    half = [
        m for m in dev.modules
        if m.leaf and m.calls > 0 and autocast_casts_to_half(m.type_name)
    ]  # fmt: skip
    return (
        sum(m.frozen_float32_bytes // 2 for m in half),
        sum(m.trainable_float32_bytes for m in half),
    )


def _step_rules(report: TrackReport, dev: DeviceReport, bd: Breakdown) -> list[Advice | None]:
    """What a training step held at ``dev``'s peak: precision, checkpointing, optimizer,
    gradients kept through the forward."""
    transient = _optimizer_transient(dev)
    # at a peak inside optimizer.step(), what the breakdown calls activations is mostly the
    # optimizer's temporaries (backward freed the graph): neither autocast nor checkpointing
    # shrinks them (the optimizer rule speaks of them)
    activations = 0 if bd.phase == "optimizer" else bd.activations
    setup = dev.setup
    # an autocast wrapping the model's forward (accelerate's mixed precision) is entered
    # after the hooks, which then count no autocast forward: the wrapper says it ran
    wrapped = setup is not None and setup.forward_autocast is not None
    fsdp = None if setup is None else setup.sharding
    wrapped = wrapped or (fsdp is not None and fsdp[1] is not None)  # (its policy's bf16)
    float32, temporaries = _float32_activations(dev, activations)
    frozen_copies, cached = _half_weights(dev)
    return [
        mixed_precision(
            param_dtype=report.param_dtype,
            autocast=report.autocast_forwards > 0 or wrapped,
            activation_bytes=activations,
            peak_bytes=bd.total,
            parameter_bytes=bd.parameters,
            device=dev.device,
            min_share=0.3,
            capacity=dev.capacity,
            narrow_weight_bytes=0 if setup is None else setup.narrow_weight_bytes or 0,
            cached_weight_bytes=(
                cached if cached is not None else None if setup is None else setup.trainable_bytes
            ),
            frozen_copy_bytes=frozen_copies,
            trainable_weight_bytes=None if setup is None else setup.trainable_bytes,
            float32_bytes=float32,
            temporary_bytes=temporaries,
            wrapper="fsdp" if fsdp is not None else None if setup is None else setup.wrapper,
            unsafe_loss=report.unsafe_loss,
        ),
        float64_training(
            param_dtype=report.param_dtype,
            peak_bytes=bd.total,
            parameter_bytes=bd.parameters,
            gradient_bytes=bd.gradients,
            optimizer_state_bytes=bd.optimizer_state,
            activation_bytes=bd.activations,
            capacity=dev.capacity,
            device=dev.device,
            float64_share=_float64_share(setup),
        ),
        None
        # already on: the trainer's setting, or layers recomputed in backward (transformers'
        # checkpointing recomputes a layer's forward: its children are the ones recomputed)
        if (setup is not None and setup.checkpointing)
        or any(m.recompute_calls for m in dev.modules)
        else activation_checkpointing(
            activation_bytes=activations,
            peak_bytes=bd.total,
            modules=[  # a teacher's blocks, run in evaluation passes only, keep nothing
                ModuleActivation(
                    m.path,
                    round(m.activation_bytes * _together(m)),
                    m.leaf,
                    m.type_name,
                    m.first_call,
                    None if m.output_bytes is None else round(m.output_bytes * _together(m)),
                    _together(m),
                )
                for m in dev.modules
                if m.calls > 0
            ],
            capacity=dev.capacity,
            device=dev.device,
            phase_peaks=dev.phase_peaks,
            peak_phase=bd.phase,
            peak_module=bd.module,
            temporary_bytes=temporaries,
            step_passes=_step_passes(report, dev),
        ),
        optimizer_state(
            optimizer_state_bytes=bd.optimizer_state,
            parameter_bytes=bd.parameters,
            peak_bytes=bd.total,
            capacity=dev.capacity,
            optimizer=report.optimizer_name,
            optimizer_transient_bytes=transient if transient > 0 else None,
            ranks=report.world_size,
            device=dev.device,
            history_size=None if setup is None else setup.history_size,
            foreach=None if setup is None else setup.optimizer_foreach,
            sparse_gradients=setup is not None and bool(setup.sparse_gradients),
            optimized_bytes=None if setup is None else setup.optimized_bytes,
            param_dtype=report.param_dtype,
            optimizers=(setup.optimizer_states or ()) if setup is not None else (),
        ),
        _zero_grad_rule(report, dev, bd),
        dense_embedding_gradients(
            tables=_embedding_tables(report, dev),
            gradient_bytes=bd.gradients,
            phase=bd.phase,
            optimizer_transient_bytes=max(0, transient),
            optimized_bytes=None if setup is None else setup.optimized_bytes,
            peak_bytes=bd.total,
            capacity=dev.capacity,
            device=dev.device,
            optimizer=report.optimizer_name,
        ),
        stale_gradients(
            holders=report.stale_gradients,
            step=report.stale_step,
            device=dev.device,
            peak_step=bd.step,
            looks=report.stale_looks,
        ),
        oom_retry_holds(report.retry_held, device=dev.device),
        retain_graph_held(report.retained_held, device=dev.device),
    ]


def _eval_is_the_steps(report: TrackReport, dev: DeviceReport) -> bool:
    """Whether ``dev``'s eval column peaks in passes that are the training step's work: a
    frozen model's forward on the training batch (``frozen_peaks``), or passes inside a step
    (``eval_in_step``: a teacher after the student's forward, multi-crop views)."""
    evaluation = dev.phase_peaks.get("eval")
    frozen = report.frozen_peaks.get(dev.device)
    return evaluation is not None and (
        (frozen is not None and frozen >= evaluation) or dev.eval_in_step >= evaluation
    )


def _untrained_evaluated(dev: DeviceReport) -> list[str]:
    """The models ``dev``'s evaluation passes ran, where each is one no training forward ran
    on (a teacher, a reference model); none where the trained model was evaluated too."""
    roots = [m for m in dev.modules if _model_row(m) and m.eval_calls > 0]
    return [m.path for m in roots] if all(m.calls == 0 for m in roots) else []


def _frozen_every_step(dev: DeviceReport) -> str | None:
    """The model an every-step pass on ``dev`` is of, where its eval column is the forwards
    of models that never ran a training forward (their rows: evaluation calls only), the
    trained models never evaluated, in at least half the steps (of two or more): a teacher
    fed another batch size than the student's (the batch and augmented copies of it), which
    the tracker books as evaluation between steps when it runs before the student's forward,
    or an averaged copy validated every step: the report does not tell them apart. A test
    loop evaluates the trained model, or runs in few of the steps. ``None``: not so."""
    frozen = _untrained_evaluated(dev)
    if not frozen:
        return None
    evaluated = sum(1 for s in dev.steps if s.phase_peaks.get("eval") is not None)
    return " and ".join(frozen) if len(dev.steps) >= 2 and 2 * evaluated >= len(dev.steps) else None


def _step_passes(report: TrackReport, dev: DeviceReport) -> list[StepPass] | None:
    """Where ``dev``'s eval column is the step's own passes (:func:`_eval_is_the_steps`),
    each run of eval readings in its timeline as a :class:`StepPass`: its peak, and what the
    step's training forward had allocated when it began (its first reading less the
    forward's first, where a forward of the same step ran before it and no backward,
    optimizer step or step boundary came between). ``None``: the eval column is not the
    step's, or no readings of it (the peak as it is, then)."""
    if not _eval_is_the_steps(report, dev):
        return None
    passes: set[StepPass] = set()
    step, forward_start = None, None  # the step's training forward began at this reading
    run_start, run_peak = None, 0  # the eval run in progress: its first reading, its peak
    for point in (*dev.timeline, None):
        if point is not None and point.phase == "eval" and point.step == step:
            if run_start is None:
                run_start, run_peak = point.allocated, 0
            run_peak = max(run_peak, point.allocated)
            continue
        if run_start is not None:  # the run ended: the pass it was
            held = 0 if forward_start is None else max(0, run_start - forward_start)
            passes.add(StepPass(run_peak, held))
            run_start = None
        if point is None:
            break
        if point.step != step:
            step, forward_start = point.step, None
            if point.phase == "eval":  # (a pass that opens the step: before its forward)
                run_start, run_peak = point.allocated, point.allocated
                continue
        if point.phase == "forward":
            forward_start = point.allocated if forward_start is None else forward_start
        else:  # backward, optimizer or other: the forward's activations are gone or going
            forward_start = None
    return sorted(passes, key=lambda p: (p.peak, p.held)) or None


def _embedding_tables(report: TrackReport, dev: DeviceReport) -> list[EmbeddingTable]:
    """The dense-gradient embedding tables of ``dev``'s setup with the rows a step looks up:
    each training call's output (what its forward allocated, a row per index) over the
    row's bytes, times its calls a step (accumulated micro-batches add their rows)."""
    setup = dev.setup
    if setup is None or not setup.dense_embeddings or not report.steps:
        return []
    records = {m.path: m for m in dev.modules if m.type_name == "Embedding" and m.calls}
    tables = []
    for path, table, row in setup.dense_embeddings:
        m = records.get(path) or next(
            (r for p, r in records.items() if p.endswith("." + path)), None
        )
        if m is not None and row > 0:
            rows = round(m.peak_over_entry / row * m.calls / report.steps)
            tables.append(EmbeddingTable(path, table, row, rows))
    return tables


def _float64_share(setup: TrainingSetup | None) -> float:
    """The float64 part of the trainable parameters' bytes (1.0: not known)."""
    if setup is None or not setup.trainable_bytes or setup.float64_bytes is None:
        return 1.0
    return setup.float64_bytes / setup.trainable_bytes


def _zero_grad_rule(report: TrackReport, dev: DeviceReport, bd: Breakdown) -> Advice | None:
    """``zero-grad-keeps-grads`` on ``dev``: what the steps' first forwards found, and where
    the peak came in a forward, the gradients alive there, by model (a GAN's generator's,
    kept from its step through the next critic iteration, where the generator's forward
    found the critic's). A peak in a backward that began with them (``set_to_none=False``)
    falls at most to the forward's peak without them or a phase that holds them anyway."""
    found = report.grads_at_forward_bytes or bd.gradients
    # the gradients alive at the peak: a forward's; a backward's that began with them, no more
    # than the forwards were found to begin with (a DCGAN's generator's, made in that
    # backward, are not) nor than the peak's (review: progressive unfreezing with an early
    # peak, before the later layers' were made, quoted them)
    alive = (
        bd.gradients
        if bd.phase == "forward"
        else min(found, bd.gradients)
        if bd.phase == "backward"
        else None
    )
    trailing = bd.step is not None and all(s.step < bd.step for s in dev.steps)
    carried = (bd.gradients_after_forward or 0) if alive and trailing else 0
    into_backward = 2 * report.steps_with_grads_into_backward > report.steps_with_grads_at_forward
    next_peak: int | None
    if bd.idle_gradients:  # (set at a peak in backward or an optimizer's step only)
        # another model's gradients, kept from its step through this update, which froze it:
        # freed right after that step, the peak falls by them, down to the forward's or the
        # time between (sweep CK: a Lightning GAN's generator step held the discriminator's)
        peaks = dev.phase_peaks
        next_peak = max(peaks.get("forward") or 0, peaks.get("other") or 0)
        held = False
    elif bd.phase == "backward" and into_backward:
        peaks = dev.phase_peaks
        holding = (peaks.get("optimizer") or 0, peaks.get("other") or 0)
        next_peak = max((peaks.get("forward") or 0) - (alive or found), *holding)
        held = False
    else:
        next_peak, held = _peak_not_holding(dev, alive or found, carried, bd.step)
    return zero_grad_keeps_grads(
        steps_with_grads=report.steps_with_grads_at_forward,
        gradient_bytes=found,
        peak_phase=bd.phase,
        device=dev.device,
        peak_bytes=bd.total,
        next_peak_bytes=next_peak,
        peak_gradient_bytes=alive,
        holders=bd.gradient_models,
        held_elsewhere=held,
        micro_batches=report.micro_batches if _forwards_per_step(report, dev) > 1 else 1,
        into_backward=into_backward,
        idle_bytes=bd.idle_gradients,
    )


def _together(m: ModuleRecord) -> float:
    """How many of a module's passes a step keeps alive together, as the ratio of what it kept
    until a backward to its largest pass: a step that calls the model several times before
    one backward (a triplet's anchor, positive and negative; SimCLR's two views; R-Drop) keeps
    every pass's activations until it (sweep BP: the advice priced one pass). The per-step
    bytes restart at each backward, so micro-batches of accumulation count once."""
    per_call, per_step = m.activation_bytes, m.activation_bytes_per_step or 0
    return per_step / per_call if per_call > 0 and per_step > per_call else 1.0


def _forwards_per_step(report: TrackReport, dev: DeviceReport) -> float:
    """The models' training forwards a step on ``dev``, on average: micro-batches of
    gradient accumulation run one each, where two backward passes through one forward
    (``retain_graph=True``) accumulate no micro-batches."""
    calls = max((m.calls for m in dev.modules if "." not in m.path), default=0)
    return calls / report.steps if report.steps else 0.0


def _peak_not_holding(
    dev: DeviceReport, gradients: int, carried: int = 0, at_step: int | None = None
) -> tuple[int | None, bool]:
    """The highest backward or optimizer peak on ``dev`` that freeing the ``gradients`` kept
    through the peak's forward would not lower, and whether a higher one holds them.

    A phase holds them in a step whose forward held them where, in a step whose forward
    peaked at least about that much lower (one that began without them: a critic iteration
    that follows no generator step), the same phase peaked that much lower too; such
    forwards do not fall either. Steps from 1 on (step 0 creates the gradients and the
    optimizer's state); a phase's peak outside the steps (after the last boundary) above
    theirs counts as not holding them, less the ``carried`` bytes of them that the peak's
    forward, itself after the last boundary (a GAN's critic's, after the generator's step
    that ends the steps), left allocated into the phases after it.

    Where memory grows from step to step (``dev.leak``: a list kept on the device), each
    step's peaks are compared as at ``at_step`` (the peak's), less the growth between them:
    an earlier step's forward peaked lower for what the list held then, not for gradients
    it began without (sweep BG)."""
    near = 0.9 * gradients  # (the allocator's rounding)
    leak = dev.leak
    rate = leak.growth_per_step if leak is not None and leak.growth_per_step > 0 else 0
    first = leak.first_step if leak is not None else 0

    def grown(step: int) -> int:
        return rate * max(0, step - first)

    def peak(step: StepRecord, phase: str) -> int:
        value = step.phase_peaks.get(phase) or 0
        if not value or at_step is None:
            return value
        return value + grown(at_step) - grown(step.step)

    steps = [s for s in dev.steps if s.step >= 1]
    top = max((peak(s, "forward") for s in steps), default=0)
    without = [s for s in steps if 0 < peak(s, "forward") <= top - near]
    kept = [peak(s, "forward") for s in without]
    held = [0]
    for phase in ("backward", "optimizer"):
        values = [peak(s, phase) for s in steps]
        for s, v in zip(steps, values, strict=True):
            lower = any(0 < peak(w, phase) <= v - near for w in without)
            (held if s not in without and lower else kept).append(v)
        outside = dev.phase_peaks.get(phase) or 0
        if outside > max(values, default=0):
            kept.append(outside - carried)
    return max((v for v in kept if v > 0), default=None), max(held) > top - gradients


def _allocator_rules(dev: DeviceReport) -> list[Advice | None]:
    """``fragmentation`` and ``empty-cache`` from ``dev``'s peaks and timeline."""
    return [
        fragmentation(
            reserved=dev.peak_reserved,
            allocated=dev.peak_allocated,
            peak_allocated=dev.peak_allocated,
            device=dev.device,
        ),
        empty_cache(
            reserved=dev.peak_reserved,
            allocated=dev.peak_allocated,
            device=dev.device,
            cache_releases=_cache_releases(dev),
            steps=len(dev.steps),
        ),
    ]


_ACTIVATION_RULES = ("mixed-precision", "activation-checkpointing")
"""The step rules whose saving is training's activations, which evaluation does not keep."""


def _under_evaluation(
    report: TrackReport, dev: DeviceReport, found: list[Advice | None]
) -> list[Advice | None]:
    """``found`` as it stands, unless an evaluation between steps peaks near training (its
    peak above training's less the activation rules' saving): the device's peak then falls
    to evaluation's at most, so a rule claims training's peak less evaluation's, and where
    evaluation is as high as training or higher, no saving, saying it lowers training's peak
    only (sweep CM: a Lightning run, its validation at 55.62 MiB above training's 40.87, was
    told bf16-mixed saves 7.26 MiB; with it training fell by 7.26 and validation rose to
    66.21 and ran out; sweep CP: evaluation 3% above training got 31.02 MiB claimed, 0 saved;
    evaluation at 42.72 below training's 55.81, 31.02 claimed, 13.09 saved)."""
    evaluation, training = dev.phase_peaks.get("eval"), _training_peak(dev)
    if (
        evaluation is None
        or training is None
        # (a teacher's, or review CK: a frozen copy run inside the step on 4x the batch,
        # multi-crop views: checkpointing the student lowered that peak from 54.84 to 30.84)
        or _eval_is_the_steps(report, dev)
    ):
        return found
    room = max(0, training - evaluation)  # what the device's peak can fall by
    autocast = (
        " (evaluation under autocast was not measured: the loss's float32 copy of "
        "half-precision logits can raise it)"
    )
    out: list[Advice | None] = []
    for a in found:
        if a is None or a.code not in _ACTIVATION_RULES or not room < (a.saving_bytes or 0):
            out.append(a)  # (not an activation rule, or its saving fits above evaluation)
            continue
        lowers = f"this would lower training's peak by about {format_size(a.saving_bytes)}, " + (
            "not the device's"
            if not room
            else f"and the device's by {format_size(room)}, to evaluation's"
        )
        high = "sets the peak" if not room else "peaks close below training"
        out.append(
            dataclasses.replace(
                a,
                evidence=f"{a.evidence} Evaluation {high} on {dev.device} "
                f"({format_size(evaluation)}, training's {format_size(training)}): {lowers}"
                + (autocast if a.code == "mixed-precision" else "")
                + (
                    ". Lower evaluation's peak first (a smaller evaluation batch)."
                    if not room
                    else "."
                ),
                saving_bytes=room or None,
            )
        )
    return out


def _data_parallel_rules(report: TrackReport) -> list[Advice | None]:
    """``dp-to-ddp`` and ``dp-loss-on-replicas`` for a report of an ``nn.DataParallel`` model."""
    if not (report.dp_device_ids and len(report.devices) >= 2 and report.dp_output_device):
        return []
    primary = next((d for d in report.devices if d.device == report.dp_output_device), None)
    pbd = primary.breakdown if primary is not None else None
    return [
        dp_to_ddp(
            {d.device: d.peak_allocated for d in report.devices},
            report.dp_output_device,
            gradient_bytes=pbd.gradients if pbd is not None else 0,
            optimizer_state_bytes=pbd.optimizer_state if pbd is not None else 0,
            parameter_bytes=pbd.parameters if pbd is not None else 0,
            gathered_output_bytes=report.dp_output_bytes,
        ),
        dp_loss_on_replicas(
            report.dp_output_bytes,
            report.dp_output_device,
            len(report.dp_device_ids),
            primary.peak_allocated if primary is not None else None,
        ),
    ]


def measured_advice(report: TrackReport) -> list[Advice]:
    """The rules of plain numbers that fire on ``report``'s measurements."""
    out: list[Advice | None] = []
    trained = any(d.phase_peaks.get("backward") is not None for d in report.devices)
    for dev in report.devices:
        bd = dev.breakdown
        if bd is not None and bd.total > 0 and trained:
            out.extend(_under_evaluation(report, dev, _step_rules(report, dev, bd)))
        out.extend(_allocator_rules(dev))
    out.extend(_data_parallel_rules(report))
    # one advice per code: the first device that shows it (the primary under DataParallel)
    seen: set[str] = set()
    result: list[Advice] = []
    for a in out:
        if a is not None and a.code not in seen:
            seen.add(a.code)
            result.append(a)
    return result
