"""The OOM post-mortem's advice: rules of the breakdown at the failure (``oom-activations``,
``oom-optimizer-state``, ``oom-parameters``, ``oom-batch``, ``oom-other``), of the pass it failed in
(``oom-eval``, ``eval-grad-enabled``), of a leak that ran out (``graph-retained``), and of the
CUDA message (``fragmentation``, ``other-processes``). Each is a function of the
:class:`~memkit.tracking.report.OomPostMortem` (and the parsed message); none measures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memkit.advice.device import fragmentation, other_processes, processes_in_oom_message
from memkit.advice.form import Advice
from memkit.advice.leaks import graph_retained_advice
from memkit.advice.training import (
    STATE_BUFFERS,
    lbfgs_history,
    lighter_options,
    shard_option,
    state_per_parameter,
)
from memkit.units import format_shape, format_size

if TYPE_CHECKING:
    from memkit.oom import OomDetails
    from memkit.tracking.report import Breakdown, OomPostMortem

__all__ = [
    "eval_grad_at_oom",
    "leak_ran_out",
    "message_advice",
    "oom_activations",
    "oom_advice",
    "oom_batch",
    "oom_between_steps",
    "oom_in_evaluation",
    "oom_in_frozen_model",
    "oom_optimizer_state",
    "oom_other",
    "oom_parameters",
]


def oom_advice(
    pm: OomPostMortem,
    reserved_unallocated: int | None = None,
    *,
    details: OomDetails | None = None,
) -> list[Advice]:
    """What to do about the OOM described by ``pm`` (most useful first); ``details`` (the
    parsed message) adds ``fragmentation`` and ``other-processes``."""
    out: list[Advice] = [*leak_ran_out(pm)]
    at_eval = eval_grad_at_oom(pm)
    if at_eval is not None:
        out.append(at_eval)
    if pm.phase == "eval":
        out.append(oom_in_frozen_model(pm) if pm.frozen_model else oom_in_evaluation(pm))
    elif pm.phase == "other" and pm.module is None and pm.step > 0 and not pm.after_backward:
        out.append(oom_between_steps(pm))
    bd = pm.breakdown
    if bd is not None and bd.total > 0:
        share = {name: value / bd.total for name, value in bd.parts()}
        found = (
            oom_large_request(pm, bd),
            oom_activations(pm, bd, share),
            oom_optimizer_state(bd, share, pm),
            oom_parameters(pm, bd, share),
            oom_batch(pm, bd),
            oom_other(pm, bd, share),
        )
        out.extend(a for a in found if a is not None)
        if not out:
            out.append(oom_no_dominant_part(pm, bd, share))
    out.extend(message_advice(pm, reserved_unallocated, details))
    return out


def oom_between_steps(pm: OomPostMortem) -> Advice:
    """``oom-between-steps``: the OOM came between training steps, outside the model (a copy
    of the model or its ``state_dict`` kept as the best so far, an EMA's update): what the
    script makes there is device memory beside the model's, its optimizer state and its
    gradients, at once."""
    asked = pm.tried_to_allocate
    tried = "" if asked is None else f" (asking for {format_size(asked)})"
    return Advice(
        code="oom-between-steps",
        title="out of memory between training steps",
        evidence=f"It failed at {pm.where}{tried}: after an optimizer step and before the next "
        "forward, in the script's own code (a snapshot of the weights, `copy.deepcopy(model)` "
        "or of its `state_dict()`; an EMA update; metrics of the outputs; the next batch moved "
        "to the device). What it makes there sits beside the parameters, any gradients still "
        "allocated and the optimizer state.",
        action="Keep snapshots of the weights on the host (`{k: v.detach().cpu().clone() for "
        "k, v in model.state_dict().items()}`), free the gradients first "
        "(`zero_grad(set_to_none=True)` right after `optimizer.step()`), update an EMA in "
        "place (`torch._foreach_lerp_`), and keep numbers of metrics (`.item()`).",
        saving_bytes=None,
        severity="critical",
    )


def oom_large_request(pm: OomPostMortem, bd: Breakdown) -> Advice | None:
    """``oom-large-request``: the request that failed was made outside the model's modules
    (the loss, or the script's own code) and alone is at least a quarter of the device, half
    of what was held and twice the activations held: one tensor, not the step's parts, is
    the thing to look at (sweep XX: a 16 MiB logging buffer on a 32 MiB device was told to
    switch optimizer, which did not fit either). Not a loss over logits the step holds (a
    large vocabulary's): that is the activations' rule's."""
    tried, capacity = pm.tried_to_allocate or 0, pm.capacity
    if (
        pm.module is not None
        or pm.phase not in ("forward", "backward", "other")
        or not capacity
        or tried < capacity / 4
        or tried < bd.total / 2
        or tried < 2 * bd.activations  # (an LM's loss over its logits: oom-activations')
    ):
        return None
    return Advice(
        code="oom-large-request",
        title="one request outside the model's modules filled the device",
        evidence=f"At {pm.where}, a single request of {format_size(tried)} failed: "
        f"{100 * tried / capacity:.0f}% of the {format_size(capacity)} device, beside the "
        f"{format_size(bd.total)} the step held. No module of the model made it: the loss or "
        "the script's own code did (the traceback's line).",
        action="Look at the line that made it: a logging or metrics buffer, a batch-sized "
        "mask, a tensor made at full size at once. Make it smaller (per chunk), keep it on "
        "the CPU, or compute it from a smaller batch.",
        saving_bytes=None,
        severity="critical",
    )


def oom_no_dominant_part(pm: OomPostMortem, bd: Breakdown, share: dict[str, float]) -> Advice:
    """``oom-no-dominant-part``: no part of the memory was large enough for its own rule (sweep
    WW's PPO agent ran out with activations 39%, optimizer state 24%, other 14%, and the
    post-mortem advised nothing): the parts in order, what the failure lacked, and the levers
    for each, the batch first (what scales with it)."""
    parts = sorted(((v, k) for k, v in share.items() if v > 0), reverse=True)
    listed = ", ".join(f"{name} {100 * v:.0f}%" for v, name in parts)
    lacked = _lacked(pm, bd)
    short = (
        f"; it lacked {format_size(lacked)} (what was allocated and the failed request, over "
        "the capacity)"
        if lacked is not None and lacked > 0
        else ""
    )
    return Advice(
        code="oom-no-dominant-part",
        title="no single part filled the device",
        evidence=f"At {pm.where}, {format_size(bd.total)} was allocated: {listed}{short}.",
        action="Lower the batch size first (the activations scale with it; keep the effective "
        "batch with gradient accumulation; `memkit probe` finds the largest that fits), then "
        "shrink the fixed parts: mixed precision (torch.autocast) for activations, a lighter "
        "optimizer (SGD with momentum keeps one buffer, Adam two) for optimizer state.",
        saving_bytes=None,
        severity="warning",
    )


def leak_ran_out(pm: OomPostMortem) -> list[Advice]:
    """The leak advice (``graph-retained``, ``memory-growth``) of a leak that ran out: critical."""
    if pm.leak is None:
        return []
    return [
        Advice(
            code=a.code,
            title=a.title + " (and ran out)",
            evidence=a.evidence,
            action=a.action,
            saving_bytes=a.saving_bytes,
            severity="critical",
        )
        for a in graph_retained_advice([pm.leak])
    ]


def eval_grad_at_oom(pm: OomPostMortem) -> Advice | None:
    """``eval-grad-enabled``: the last forward ran in eval mode with autograd recording."""
    if not (pm.training is False and pm.grad_enabled):
        return None
    bd = pm.breakdown
    held = bd.activations if bd is not None else 0
    tried = pm.tried_to_allocate or 0
    # under no_grad the failing op still holds its input beside the output it asked for: the
    # pass's need there falls by what it kept less that (sweep CO: 28.56 MiB said, what the
    # pass held; no_grad lowered the peak by 10.55 MiB, 28.56 less the 18 MiB relu input).
    # The simulated device measures the input (review CP: a pool's input is four times its
    # output, 36 MiB said where 28 was saved); elsewhere it is taken as large as the request
    # (review CK: where the request outgrows what was held, a wide head, the input is not
    # its size: "falls by about 0 B" where no_grad saved 12 MiB; then up to what was held)
    measured = pm.op_input_bytes
    held_input = tried if measured is None else measured
    sized = 0 < held_input < held
    saving = held - held_input if sized else 0
    fall = (
        " Under no_grad the failing op would still hold its input"
        + ("" if measured is None else f" ({format_size(measured)})")
        + f" beside the {format_size(tried)} it asked for: the pass's need there falls by "
        f"about {format_size(saving)} of the {format_size(held)} of activations it held"
        + (" (taking the input as large as the request)" if measured is None else "")
        if sized
        else f" Under no_grad it frees up to the {format_size(held)} of activations it held, "
        "less the failing op's input, which a forward still holds"
        if held
        else ""
    )
    return Advice(
        code="eval-grad-enabled",
        title="out of memory during evaluation with autograd recording",
        evidence=f"The last forward ran with the model in eval mode and autograd on "
        f"({pm.where}): every activation is kept for a backward that never comes.{fall}"
        + ("." if fall else ""),
        action="Wrap evaluation in `with torch.no_grad():` (or `torch.inference_mode()`).",
        saving_bytes=saving or None,
        severity="critical",
    )


def oom_in_evaluation(pm: OomPostMortem) -> Advice:
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
        f"to evaluation.{_eval_batch_bound(pm)}",
        action="Lower the evaluation batch size (a loader of its own, e.g. `--test-batch-size`): "
        "it is independent of the training batch. Run evaluation under "
        "`torch.inference_mode()` (or `torch.no_grad()`) with `model.eval()`, and move what you "
        "keep of its outputs to the CPU.",
        saving_bytes=None,
        severity="critical",
    )


def _eval_batch_bound(pm: OomPostMortem) -> str:
    """The largest evaluation batch that could fit, from the failure: what the pass added
    (its activations), its batch and the request that failed scale with the batch, the rest
    does not (the model's persistent memory, and what was held before the pass: graphs an
    earlier grad-on pass left in a list); the layers after the failing one add more, so it is
    an upper bound (sweep XX: 1000 test images ran out at conv1; 40 fit)."""
    bd, shape, capacity = pm.breakdown, pm.input_shape, pm.capacity
    if bd is None or not shape or not capacity or shape[0] < 2:
        return ""
    samples = shape[0]
    scaled = bd.activations + min(pm.batch_bytes, bd.other) + (pm.tried_to_allocate or 0)
    fixed = bd.total + (pm.tried_to_allocate or 0) - scaled
    if scaled <= 0:
        return ""
    most = (capacity - fixed) * samples // scaled
    if most >= samples:
        return ""
    if most < 1:
        free = (
            "free the gradients and optimizer state held from training "
            "(`zero_grad(set_to_none=True)`) before evaluating"
            if bd.gradients or bd.optimizer_state
            else "the weights need less room (half precision, quantized) or a larger device"
        )
        return (
            f" Beside the {format_size(fixed)} held before the pass (parameters, gradients, "
            f"optimizer state, and what else was kept), not one sample fits: {free}."
        )
    return (
        f" If the memory grows in proportion to the input's first dimension ({samples}: the "
        f"batch, for most models), no evaluation batch above about {most} fits: what the pass "
        "added, its batch and the request that failed scale with it, what was held before "
        "it does not, and the layers after the one that failed add more. A "
        "sequence-first input or a batch-by-batch matrix (in-batch similarity) breaks that: "
        "`memkit probe --mode infer` finds the largest that fits."
    )


def oom_in_frozen_model(pm: OomPostMortem) -> Advice:
    """``oom-frozen-model``: the OOM came in the no-grad forward of a model no optimizer
    trains (a distillation teacher, a DPO reference model): it runs on the training batch
    in every step, so the step's remedies apply, not evaluation's. An EMA or mean teacher
    (written in place between its passes) changes every step: no offline outputs, and its
    weights stay float32 (bf16 would lose the small updates), so autocast for its forward."""
    assert pm.frozen_model is not None
    name, size, updated, wide = pm.frozen_model
    shape = pm.input_shape
    batch = "" if shape is None else f" on an input of {format_shape(shape)}"
    accumulate = (
        "No smaller batch makes it fit: the activations held were less than what it lacked "
        "(see oom-parameters)"
        if _batch_cannot_fit(pm)
        else "Lower the training micro-batch and keep the effective batch with gradient "
        "accumulation (its outputs are needed per micro-batch)"
    )
    if updated:
        kind = (
            "an EMA or mean teacher: its parameters are written in place between its "
            "passes, so it changes with the trained model"
        )
        half = (
            "; run its forward under `torch.autocast(..., dtype=torch.bfloat16)` (its "
            "activations halve; its weights stay float32 for the update)"
            if wide
            else ""
        )
        action = f"{accumulate}{half}."
    else:
        kind = "a distillation teacher, a reference model"
        half = (
            "; hold it in bf16 (`.to(torch.bfloat16)` on the model, its floating-point inputs "
            "cast to bf16, token ids as they are, and its output back with `.float()`: its "
            f"{format_size(size)} of parameters and the "
            "activations of its forward halve)"
            if wide
            else ""
        )
        offline = "compute its outputs once, offline, and load them with the batch"
        action = f"{accumulate}{half}; or {offline}."
    return Advice(
        code="oom-frozen-model",
        title=f"out of memory in the forward of `{name}`, a model no optimizer trains",
        evidence=f"It failed at {pm.where}{batch}. No optimizer steps `{name}`'s parameters "
        f"({kind}): its forward runs on the training batch in every step, so its memory is "
        "the training step's.",
        action=action,
        saving_bytes=None,
        severity="critical",
    )


def _precision_option(pm: OomPostMortem) -> str:
    """The precision remedy that fits the model: float32 for a float64 model, autocast for a
    float32 one not already under it (no forward seen under ``torch.autocast``, no autocast
    wrapping the forward), nothing for a half-precision one or one whose weights are mostly
    16-bit or narrower (a bf16 or int8 frozen base: see ``mixed_precision``)."""
    setup = pm.setup
    dtype = None if setup is None else setup.param_dtype
    if dtype == "float64":
        return "; or train in float32 (`model.float()`, float32 inputs): it halves every tensor"
    if pm.autocast_forwards > 0:
        return ""  # a training forward ran under torch.autocast: mixed precision already
    if setup is not None and setup.forward_autocast is not None:
        return ""  # the forward already runs under autocast (accelerate's mixed precision)
    if setup is not None and setup.sharding is not None:
        if setup.sharding[1]:
            return ""  # FSDP2's MixedPrecisionPolicy computes in 16 bits already (sweep CC)
        if dtype in (None, "float32"):  # (sweep CD: autocast named to an FSDP2 user)
            return (
                "; or compute in bf16 with FSDP2's policy (`fully_shard(..., mp_policy="
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16))`)"
            )
    narrow = 0 if setup is None else setup.narrow_weight_bytes or 0
    if pm.breakdown is not None and 2 * narrow > pm.breakdown.parameters:
        return ""  # mostly bf16/int8 weights (a LoRA base): low precision already
    if dtype in (None, "float32"):
        # (sweep CM: offered beside a cut that fits, it alone needed 33.61 MiB of 32)
        return (
            "; or train in bf16/fp16 autocast (it saves less than half the activations: "
            "norms, the loss and the logits stay float32, and it keeps half copies of the "
            "weights; alone it may not fit: track a step with it)"
        )
    return ""


def _state_to_come(pm: OomPostMortem, bd: Breakdown) -> tuple[int, int, str]:
    """What training adds that the failure did not hold yet: ``(gradients, optimizer state,
    what the state is)``. The gradients of the parameters trained (those the optimizer steps,
    else those that require grad, else every parameter) arrive in the step's backward and
    stay through accumulation; the state arrives at the first ``optimizer.step()`` (the
    buffers per parameter its class and settings keep: the setup's ``state_buffers``; 0 for
    an optimizer not known). An optimizer step fused into backward (post-accumulate-grad
    hooks that step) frees each gradient it steps as it is made: of those parameters, one's
    at a time, the largest."""
    setup = pm.setup
    trained = (
        None if setup is None else setup.optimized_bytes or setup.trainable_bytes
    ) or bd.parameters
    fused = None if setup is None else setup.stepped_in_backward_bytes
    alive = trained if fused is None else max(0, trained - fused[1]) + fused[0]
    gradients = max(0, min(trained, alive) - bd.gradients)
    name = None if setup is None else setup.optimizer
    buffers = (None if setup is None else setup.state_buffers) or 0
    state = max(0, buffers * trained - bd.optimizer_state)
    what = f"{name}'s state ({buffers} buffer{'s' if buffers != 1 else ''} of their size)"
    return gradients, state, what


def _all_stepped_in_backward(pm: OomPostMortem) -> bool:
    """Whether every trained parameter is stepped inside backward (post-accumulate-grad hooks
    that step an optimizer): no micro-batch can accumulate (beside an optimizer stepped after
    backward, the rest can)."""
    setup = pm.setup
    if setup is None or setup.stepped_in_backward_bytes is None:
        return False
    trained = setup.optimized_bytes or setup.trainable_bytes or 0
    return setup.stepped_in_backward_bytes[1] >= trained


def _fitting_cut(fixed: int, scaled: int, capacity: int | None, samples: int | None) -> int:
    """The smallest cut ``k`` (2, 4, 8 ...) of the micro-batch at which ``fixed + scaled / k``
    fits ``capacity`` (2 where it is not known); 0 where none does down to one sample of
    ``samples`` (or to 1/1024 when the batch size is not known).

    Examples:
        >>> _fitting_cut(10, 80, 40, 32), _fitting_cut(10, 80, 40, 2), _fitting_cut(10, 80, None, 2)
        (4, 0, 2)
    """
    if capacity is None:
        return 2
    k = 2
    while fixed + scaled // k > capacity:
        k *= 2
        if k > (samples or 1024):
            return 0
    return k


def _cut_words(k: int, samples: int | None, least: bool = False) -> str:
    """``halve the micro-batch (32 -> 16)``, ``quarter ...``, ``cut the micro-batch to 1/8``;
    ``least``: the cut is the least that can fit (a forward that stopped part way), ``(32 ->
    16 or fewer)``."""
    fewer = " or fewer" if least else ""
    sizes = f" ({samples} -> {samples // k}{fewer})" if samples and samples >= k else ""
    if k in (2, 4):
        return f"{'halve' if k == 2 else 'quarter'} the micro-batch{sizes}"
    return f"cut the micro-batch to 1/{k}{sizes}"


def _effective(k: int, samples: int | None, micro: int = 1) -> str:
    """What accumulating ``k`` times the ``micro`` micro-batches of ``samples`` a step, cut to
    ``samples // k``, keeps of the step's samples (sweep BI: 7 -> 3 over 2 was called the same
    effective batch).

    >>> _effective(2, 8)
    'same effective batch'
    >>> _effective(2, 7)[:42]
    '2 x 3 = 6 samples a step where the step ha'
    >>> _effective(4, 1023, 4)[:48]
    '16 x 255 = 4080 samples a step where the step ha'
    """
    if not samples or samples % k == 0 or samples < k:
        return "same effective batch"
    return (
        f"{k * micro} x {samples // k} = {samples // k * k * micro} samples a step where the "
        f"step had {samples * micro}: a {'micro-' if micro > 1 else ''}batch size divisible "
        f"by {k} keeps it whole"
    )


def oom_activations(pm: OomPostMortem, bd: Breakdown, share: dict[str, float]) -> Advice | None:
    """``oom-activations``: activations were at least 40% of the memory (not in evaluation).

    The accumulation it proposes multiplies what the script already runs (``micro_batches``:
    seen, or the trainer's setting) by the cut of the micro-batch whose step fits the device
    (:func:`_fitting_cut`): beside what does not scale with the batch and what training adds
    (:func:`_state_to_come`), the step's activations over the cut. Those are at least the
    ones held at the failure and the allocation that failed; a forward that failed will, in
    backward, hold that activation and its gradient together (as large again).
    Checkpointing is proposed unless it already runs (seen recomputing, or the trainer's
    setting), and the precision option fits the model's dtype."""
    if share["activations"] < 0.4 or pm.phase == "eval":
        return None
    top = ", ".join(path for path, _ in pm.top_modules[:3])
    micro = max(1, pm.micro_batches)
    gradients, state, what = _state_to_come(pm, bd)
    added = gradients + state
    tried = pm.tried_to_allocate or 0
    scaled = bd.activations + tried + (tried if pm.phase == "forward" else 0)
    fixed = bd.total - bd.activations + added
    samples = pm.input_shape[0] if pm.input_shape else None
    k = _fitting_cut(fixed, scaled, pm.capacity, samples)
    # what the step needs loses, at least: it needed what it held and the allocation that
    # failed, and at the cut what does not scale, what training adds and the scaled part's
    # cut (sweep CM: 5.87 MiB was said, what the memory held at the failure would lose, where
    # the step's need fell from 40.87 to 25.48 MiB, and the need at the cut was not printed)
    failed_need = bd.total + tried
    saving = failed_need - (fixed + scaled // max(1, k))
    fused = _all_stepped_in_backward(pm)
    adds = "; ".join(
        part
        for part in (
            (
                f"the gradient of one parameter at a time, the largest's "
                f"({format_size(gradients)}: the optimizer steps each in backward)"
                if fused
                # (sweep CO: "the gradients of the parameters it trains (73.50 KiB)" of 4.58 MiB)
                else f"the gradients of the parameters it trains not yet allocated "
                f"({format_size(gradients)}"
                + (f" of {format_size(gradients + bd.gradients)})" if bd.gradients else ")")
            )
            if gradients
            else "",
            f"{what}, {format_size(state)}, from the first optimizer step" if state else "",
        )
        if part
    )
    room = (
        f" Besides its activations, the step will hold what training adds: {adds}." if adds else ""
    )
    gradient = ", and in backward its gradient" if pm.phase == "forward" else ""
    # a forward that failed part way held the activations of the modules that ran only: a
    # lower bound, unless the gradients and state to come are counted beside every activation,
    # which they never all meet (review CK: 68.20 said, 60.23 needed; sweep CR: "at least
    # 21.06 MiB" at half a DDP rank's batch, 18.66 measured)
    about = "at least" if pm.phase == "forward" and not added else "about"
    if k > 2 and pm.capacity is not None:
        room += (
            f" At 1/{k // 2} of the micro-batch the step would need {about} "
            f"{format_size(fixed + scaled * 2 // k)} of the {format_size(pm.capacity)} (the "
            f"activations held and the allocation that failed{gradient}); at 1/{k}, {about} "
            f"{format_size(fixed + scaled // k)}."
        )
    elif k == 2 and pm.capacity is not None:
        room += (
            f" At half the micro-batch the step would need {about} "
            f"{format_size(fixed + scaled // 2)} of the {format_size(pm.capacity)} (the "
            f"activations held and the allocation that failed{gradient}, halved), where the "
            f"step that failed needed at least {format_size(failed_need)}."
        )
    if k and pm.phase == "forward":
        room += (
            " The forward stopped part way: the modules after it add activations these "
            "figures leave out, so the cut is the least that can fit (`memkit probe` finds the "
            "largest batch that does)."
        )
    # a cut that fits the known capacity is the remedy even where the memory held at the
    # failure would not fall (it held no gradients or state yet); else it must save
    held_falls = bd.activations - bd.activations // max(1, k) > added
    offered = bool(k) and (pm.capacity is not None or held_falls)
    least = pm.phase == "forward"  # (sweep BI: 8 -> 4 ran out at its longer sequence)
    if offered and fused:  # (sweep BH: accumulation was advised where no step can accumulate)
        cut = _cut_words(k, samples, least).replace("micro-batch", "batch")
        accumulate = (
            f"{cut[:1].upper()}{cut[1:]}: the optimizer steps inside backward (the parameters' "
            "post-accumulate-grad hooks), so gradients cannot accumulate over micro-batches "
            "and the effective batch shrinks with it"
        )
    elif offered and micro > 1:
        accumulate = (
            f"The script already accumulates gradients over {micro} micro-batches: "
            f"{_cut_words(k, samples, least)} and accumulate over {k * micro}"
            f"{' or more' if least else ''} ({_effective(k, samples, micro)})"
        )
    elif offered:
        cut = _cut_words(k, samples, least)
        unknown = (  # no optimizer step ran to show how many micro-batches a step runs
            pm.step == 0 and (pm.setup is None or pm.setup.accumulation_steps is None)
        )
        accumulate = (
            f"{cut[:1].upper()}{cut[1:]} and accumulate gradients over {k} steps"
            f"{' or more' if least else ''} ("
            + _effective(k, samples)
            + (f"; {k} times what your loop already accumulates, if it does)" if unknown else ")")
        )
    else:
        accumulate = ""
    if pm.checkpointed:
        blocks = ", ".join(pm.checkpointed[:3]) + (", ..." if len(pm.checkpointed) > 3 else "")
        done = f" Activation checkpointing already runs ({blocks} recomputed in backward)."
        checkpoint = ""
    elif pm.setup is not None and pm.setup.checkpointing:
        done = " Activation checkpointing is already on (the model's or the trainer's setting)."
        checkpoint = ""
    else:
        done, checkpoint = "", "; or checkpoint the largest blocks (`torch.utils.checkpoint`)"
    if pm.made_outside is not None and pm.checkpointed and pm.phase == "backward":
        kept, outside = pm.made_outside
        # (sweep CK: a checkpointed GPT-2 that ran out in backward was told of a contrastive
        # loss's batch x batch matrix; the run's report named the recomputation)
        done += (
            f" The model's modules kept {format_size(kept)} of them until backward; the other "
            f"{format_size(outside)} were made inside backward, by the recomputed forwards of "
            "the checkpointed blocks and the gradients flowing back."
        )
    elif pm.made_outside is not None:
        kept, outside = pm.made_outside
        # (sweep BT: a SimCLR loss's 2N x 2N logits were 88 of 107 MiB, and checkpointing
        # the encoder, offered alike, saved 16 MiB and still ran out)
        done += (
            f" The model's modules kept {format_size(kept)} of them until backward; "
            f"the other {format_size(outside)} were made outside its modules, by the loss or "
            "the step's own code (a batch x batch similarity matrix of a contrastive loss, the "
            "logits of a large vocabulary)"
            + (": checkpointing the model's blocks does not touch them." if checkpoint else ".")
        )
        checkpoint = ""
    if pm.made_outside is not None and accumulate:
        # (review: under checkpointing too, as open_clip's recipe runs: accumulation changes
        # a loss that compares the samples of a batch)
        accumulate += (
            "; if the loss compares each sample with the others of its batch (in-batch "
            "negatives), micro-batches change it: each sample then meets the others of its "
            "micro-batch only"
        )
    if not accumulate and not k:
        done += (
            " A smaller micro-batch with accumulation would not fit: what does not scale with "
            f"the batch and what training adds come to {format_size(fixed)} of the "
            f"{format_size(pm.capacity or 0)}, and the step's activations at one sample add "
            "to it."
        )
    elif not accumulate:
        done += (
            f" Cutting the micro-batch with accumulation would save little: what training "
            f"adds ({format_size(added)}) would stay allocated, against the activations' cut "
            f"({format_size(bd.activations - bd.activations // k)})."
        )
    options = "; or ".join(
        part.removeprefix("; or ")
        for part in (accumulate, checkpoint, _precision_option(pm))
        if part
    )
    return Advice(
        code="oom-activations",
        title="activations fill the device",
        evidence=f"Activations were {format_size(bd.activations)} "
        f"({100 * share['activations']:.0f}% of {format_size(bd.total)}) when it "
        f"failed at {pm.where}" + (f"; the largest come from {top}." if top else ".") + done + room,
        action=(options[:1].upper() + options[1:] + ".") if options else "Reduce the batch.",
        saving_bytes=saving if accumulate and saving > 0 else None,
        severity="critical",
    )


def oom_optimizer_state(
    bd: Breakdown, share: dict[str, float], pm: OomPostMortem | None = None
) -> Advice | None:
    """``oom-optimizer-state``: optimizer state was at least 30% of the memory (LBFGS: its
    history, and a smaller ``history_size``); in the first optimizer step, which was creating
    it, priced complete (sweep BJ: AdamW's first step, whose complete state does not fit
    beside the weights and gradients at any batch, was told to lower the batch)."""
    setup = None if pm is None else pm.setup
    stepped = (setup.optimized_bytes if setup is not None else None) or bd.parameters
    name = "Optimizer" if setup is None or setup.optimizer is None else setup.optimizer
    buffers = (setup.state_buffers if setup is not None else None) or STATE_BUFFERS.get(name)
    complete = buffers * stepped if buffers else None
    # the failed first step was creating the state, and had not made all of it (sweep BU: a
    # state made whole before a temporary ran out was called partial)
    partial = (
        pm is not None
        and pm.optimizer_state_partial
        and (complete is None or bd.optimizer_state < complete)
    )
    complete = complete if partial else None
    weight = share["optimizer state"]
    if complete is not None and complete > bd.optimizer_state:
        weight = complete / (bd.total - bd.optimizer_state + complete)
    if weight < 0.3:
        return None
    if setup is not None and setup.optimizer == "LBFGS":
        found = lbfgs_history(bd.optimizer_state, bd.parameters, setup.history_size)
        if found is not None:
            evidence, action, saving = found
            return Advice(
                code="oom-optimizer-state",
                title="LBFGS's history fills the device",
                evidence=f"Optimizer state was {format_size(bd.optimizer_state)} "
                f"({100 * share['optimizer state']:.0f}%). {evidence}",
                action=f"{action}"
                + (
                    "; in float32 every pair takes half the bytes."
                    if setup.param_dtype == "float64"
                    else "."
                ),
                saving_bytes=saving,
                severity="critical",
            )
    sparse = setup is not None and (bool(setup.sparse_gradients) or setup.optimizer == "SparseAdam")
    state, sep, severity = bd.optimizer_state, ": ", "warning"
    if partial:
        # its first step was creating the state: priced as it will be once complete
        amsgrad = " (3 with `amsgrad=True`)" if name in ("Adam", "AdamW") else ""
        per_parameter = "partial: the optimizer step that failed was creating it" + (
            f". Complete, {name} keeps {buffers} buffers of the parameters' size{amsgrad}: "
            f"{format_size(complete)} for the {format_size(stepped)} of parameters it steps"
            if complete
            else ""
        )
        state, sep = max(state, complete or 0), ", "
        held = bd.parameters + bd.gradients + state
        if pm is not None and pm.capacity is not None and held > pm.capacity:
            per_parameter += (
                f"; with the parameters and gradients that comes to {format_size(held)} of the "
                f"{format_size(pm.capacity)}: no batch size fits with it"
            )
            severity = "critical"
    else:
        per_parameter = state_per_parameter(state, stepped)
    offered = lighter_options(
        state,
        stepped,
        optimizer=None if setup is None else setup.optimizer,
        param_dtype=None if setup is None else setup.param_dtype,
        sparse=sparse,
    )
    lighter = "; ".join(f"{o.name}: saves ~{format_size(saving)}" for o, saving in offered)
    takes = ", which take sparse gradients" if sparse else ""
    shard = f"shard it across ranks ({shard_option(sparse)})"
    ranks = None if setup is None or setup.sharding is None else setup.sharding[0]
    if ranks is not None:  # FSDP2 shards it already (sweep CC: told to shard it)
        shard = (
            f"shard it over more ranks: it is FSDP2's 1/{ranks} shard already, and "
            f"{2 * ranks} ranks halve it again"
        )
    return Advice(
        code="oom-optimizer-state",
        title="optimizer state is a large share",
        evidence=f"{name} state was {format_size(bd.optimizer_state)} "
        f"({100 * share['optimizer state']:.0f}%){sep}{per_parameter}.",
        action=(
            f"Use a lighter optimizer state ({lighter}{takes}), or {shard}."
            if offered
            else f"{shard[0].upper()}{shard[1:]}: 2 ranks save {format_size(state // 2)} per rank."
        ),
        saving_bytes=min(s for _, s in offered) if offered else state // 2,
        severity=severity,
    )


def _lacked(pm: OomPostMortem, bd: Breakdown) -> int | None:
    """What the failure lacked: what was allocated and the failed request, over the capacity
    (``None`` where the capacity is not known)."""
    if pm.capacity is None:
        return None
    return bd.total + (pm.tried_to_allocate or 0) - pm.capacity


def _batch_freeable(pm: OomPostMortem, bd: Breakdown) -> int:
    """What a smaller batch can free: the activations, and the failed request itself where a
    forward or backward made it (an LM's logits, attention scores grow with the batch; an
    optimizer step's state does not)."""
    request = pm.tried_to_allocate or 0 if pm.phase in ("forward", "backward", "eval") else 0
    return bd.activations + request


def _batch_cannot_fit(pm: OomPostMortem) -> bool:
    """No smaller batch makes the failing step fit: a smaller batch frees what
    :func:`_batch_freeable` counts, and that was less than what the failure lacked
    (:func:`_lacked`)."""
    bd = pm.breakdown
    lacked = None if bd is None else _lacked(pm, bd)
    return bd is not None and lacked is not None and _batch_freeable(pm, bd) < lacked


def oom_parameters(pm: OomPostMortem, bd: Breakdown, share: dict[str, float]) -> Advice | None:
    """``oom-parameters``: the parameters were at least half of the memory. Whether a smaller
    batch helps is read from the numbers: it frees activations only, so it cannot make the
    step fit where they are less than what the failure lacked (:func:`_batch_cannot_fit`,
    and ``oom-frozen-model`` then proposes no smaller batch either); else it may, as the
    rules proposing a smaller micro-batch (``oom-activations``, ``oom-frozen-model``,
    ``oom-batch``) say. Also half of the device, or of what the step needed at least where
    that is less (what was allocated and the request that failed): review 4's evaluation
    request of 80 MiB beside 5 MiB of weights and 3 MiB of activations on 64 MiB was told
    that the weights take most of the device."""
    needed = bd.total + (pm.tried_to_allocate or 0)
    room = needed if not pm.capacity else min(pm.capacity, needed)
    if share["parameters"] < 0.5 or bd.parameters < 0.5 * room:
        return None
    ranks = None if pm.setup is None or pm.setup.sharding is None else pm.setup.sharding[0]
    shard = (
        "shard them (FSDP)"
        if ranks is None  # FSDP2 shards them already (sweep CC: told to shard them)
        else f"shard them over more ranks (they are FSDP2's 1/{ranks} shards: "
        f"{2 * ranks} ranks halve them), or offload them (`offload_policy=CPUOffloadPolicy()`)"
    )
    lacked = _lacked(pm, bd)
    activations = (
        f"activations were {format_size(bd.activations)} ({100 * share['activations']:.0f}%)"
    )
    if lacked is not None and _batch_cannot_fit(pm):
        batch = (
            f"; {activations}, with the failed request less than the {format_size(lacked)} it "
            "lacked: no smaller batch makes it fit"
        )
        action = f"Keep weights in bf16, or {shard}; a smaller batch cannot fit."
    elif lacked is not None:
        request = _batch_freeable(pm, bd) - bd.activations
        also = f" and the failed request of {format_size(request)}" if request else ""
        batch = (
            f"; {activations}{also}, more than the {format_size(max(0, lacked))} it lacked at "
            "that point: a smaller batch, which frees them, may make up for it"
        )
        action = (
            f"Keep weights in bf16, or {shard}: their share stays at any batch; or "
            "lower the batch, which frees activations only."
        )
    else:
        batch = f"; {activations}: a smaller batch frees part of them, never the parameters"
        action = f"Keep weights in bf16, or {shard}; a smaller batch frees activations only."
    return Advice(
        code="oom-parameters",
        title="the weights alone take most of the device",
        evidence=f"Parameters were {format_size(bd.parameters)} "
        f"({100 * share['parameters']:.0f}% of what was allocated){batch}.",
        action=action,
        severity="warning",
    )


def oom_other(pm: OomPostMortem, bd: Breakdown, share: dict[str, float]) -> Advice | None:
    """``oom-other``: at least 30% was none of the model's, the live training batch left out
    (the step needs it: ``oom-batch`` speaks of it), and no leak explains it."""
    batch = min(pm.batch_bytes, bd.other)
    kept = bd.other - batch
    if kept < 0.3 * bd.total or pm.leak is not None:
        return None
    besides = f", besides the step's training batch ({format_size(batch)})" if batch > 0 else ""
    # (sweep CO: a loop keeping every loss ran out at step 4, before the growth window)
    held = "; ".join(pm.appended_losses)
    losses = (
        f" A list the script grows holds losses that keep their autograd graphs: {held}; "
        "each keeps its step's activations."
        if held
        else ""
    )
    return Advice(
        code="oom-other",
        title="much of the memory is not the model's",
        evidence=f"{format_size(kept)} ({100 * kept / bd.total:.0f}%) was "
        "allocated before the step's forward and is neither parameters, gradients "
        f"nor optimizer state{besides}: batches, cached tensors, outputs kept from earlier "
        f"steps.{losses}",
        action=(
            "Append the losses' values (`loss.item()`), not the tensors; free what else you "
            "keep across steps (`del`, `.detach()`), move stored tensors to CPU."
            if held
            else "Free what you keep across steps (`del`, `.item()`, `.detach()`), "
            "move stored tensors to CPU."
        ),
        saving_bytes=kept,
        severity="warning",
    )


def oom_batch(pm: OomPostMortem, bd: Breakdown) -> Advice | None:
    """``oom-batch``: the step's own training batch (the forward's first input, alive) was at
    least 30% of the memory when a forward or backward ran out: nothing kept across steps,
    the batch is too large for the device (one oversized batch among smaller ones, or all)."""
    batch = min(pm.batch_bytes, bd.other)
    if batch < 0.3 * bd.total or pm.phase not in ("forward", "backward"):
        return None
    shape = "" if pm.input_shape is None else f" {format_shape(pm.input_shape)}"
    tried = pm.tried_to_allocate or 0
    asked = (
        f"; it then asked for {format_size(tried)} more (an activation of that batch)"
        if tried
        else ""
    )
    room = "" if pm.capacity is None else f", on a device of {format_size(pm.capacity)}"
    return Advice(
        code="oom-batch",
        title="the training batch is too large for the device",
        evidence=f"The step's training batch{shape} was {format_size(batch)} "
        f"({100 * batch / bd.total:.0f}% of the {format_size(bd.total)} allocated) when it "
        f"failed at {pm.where}{asked}: at this batch size the step needs at least "
        f"{format_size(bd.total + tried)}{room}. It is this step's own batch, not memory kept "
        "from earlier steps.",
        action="Lower the batch size (the batch and every activation scale with it) and keep "
        "the effective batch with gradient accumulation; where one batch among smaller ones "
        "is oversized (length buckets, a last giant batch), cap batches by their size "
        "(samples or tokens per batch).",
        saving_bytes=None,
        severity="critical",
    )


def message_advice(
    pm: OomPostMortem, reserved_unallocated: int | None, details: OomDetails | None
) -> list[Advice]:
    """``fragmentation`` and ``other-processes`` from the CUDA message's numbers."""
    out: list[Advice] = []
    if reserved_unallocated is None and details is not None:
        reserved_unallocated = details.reserved_unallocated
    if reserved_unallocated is not None and pm.tried_to_allocate is not None:
        allocated = (
            details.allocated_by_pytorch
            if details is not None and details.allocated_by_pytorch is not None
            else pm.allocated or 0
        )
        frag = fragmentation(
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
        others = other_processes(
            used=details.capacity - details.free,
            this_process=details.process_in_use,
            total=details.capacity,
            device=pm.device,
            includes_context=True,
            processes=processes_in_oom_message(pm.exception),
        )
        if others is not None:
            out.append(others)
    return out
