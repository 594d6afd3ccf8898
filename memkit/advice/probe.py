"""Rules on the batch size: ``does-not-fit`` (a probe or an estimate found no batch that fits)
and ``accumulate`` (a target effective batch from micro batches that fit), and the advice of a
probe's search."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memkit.advice.accumulation import AccumulationPlan, exact_split, plan_accumulation
from memkit.advice.form import Advice
from memkit.advice.sharding import Unit, fsdp_gpus_needed
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.probing.search import SearchResult

__all__ = ["accumulation_advice", "does_not_fit", "probe_advice", "state_still_grows"]


@dataclass(frozen=True)
class ModelState:
    """What a model holds whatever the batch (measured when no batch fit): parameters and
    buffers, gradients (the trainable parameters' bytes), the optimizer's state after a step,
    and the units FSDP would all-gather."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    units: tuple[Unit, ...]


def probe_advice(
    search: SearchResult,
    device: str,
    mode: str,
    *,
    target_batch: int | None = None,
    world_size: int = 1,
    batch_norm: bool = False,
    pairwise: bool = False,
    growing: tuple[int, int, int] | None = None,
    state: ModelState | None = None,
    steps_in_backward: bool = False,
    calls_per_step: int = 1,
) -> list[Advice]:
    """A probe's advice: ``does-not-fit`` when no batch fit (its first trial's numbers; with
    the model's ``state``, ``fsdp-gpus`` when that state alone exceeds the capacity: the rest
    of the step is the failed trial's lower bound less the state), else
    ``probe-state-grows`` when the memory kept between the answer's steps still grew at the
    last (``growing``: steps run, bytes grown since the first step, of them the optimizer's
    state) and ``accumulate`` toward ``target_batch`` (when given) with the recommended batch
    size (``steps_in_backward``: the optimizer steps inside backward, and no accumulation
    can reach the target; ``pairwise``: the peaks grow faster than the batch;
    ``calls_per_step``: the ``train_step`` accumulates itself, stepping the optimizer every
    that many calls)."""
    if search.max_batch_size is None:
        trial = search.trials[0]
        found = [
            does_not_fit(
                batch_size=trial.batch_size,
                mode=mode,
                need_bytes=trial.peak_bytes,
                capacity_bytes=search.capacity_bytes,
                device=device,
                parameter_bytes=None if state is None else state.parameter_bytes,
            )
        ]
        held = 0 if state is None else (
            state.parameter_bytes + state.gradient_bytes + state.optimizer_state_bytes
        )  # fmt: skip
        capacity = search.capacity_bytes
        if state is not None and trial.peak_bytes and capacity and held > capacity:
            gpus = fsdp_gpus_needed(
                parameter_bytes=state.parameter_bytes,
                gradient_bytes=state.gradient_bytes,
                optimizer_state_bytes=state.optimizer_state_bytes,
                other_bytes=max(0, trial.peak_bytes - held),
                capacity_bytes=capacity,
                units=state.units,
                batch_size=trial.batch_size,
                rest_at_least=True,  # the failed trial's bytes: a lower bound
            )
            found += [gpus] if gpus is not None else []
        return found
    advice: list[Advice] = []
    if growing is not None and search.max_batch_size is not None:
        advice.append(state_still_grows(search.max_batch_size, *growing, mode=mode))
    micro = search.recommended_batch_size
    if target_batch is None or micro is None:
        return advice
    plan = plan_accumulation(target_batch, micro, world_size)
    if steps_in_backward and plan.steps > 1:
        return [*advice, _no_accumulation(plan, micro, device)]
    if calls_per_step > 1:
        return [*advice, _own_accumulation(plan, micro, device, calls_per_step)]
    return [
        *advice,
        accumulation_advice(plan, micro, device, batch_norm=batch_norm, pairwise=pairwise),
    ]


def _no_accumulation(plan: AccumulationPlan, recommended: int, device: str) -> Advice:
    """``accumulate`` where the optimizer steps inside backward: the target needs micro
    batches whose gradients this step cannot add up."""
    return Advice(
        code="accumulate",
        title=f"Target batch {plan.target_batch} needs {plan.steps} micro batches, which this "
        "step cannot accumulate",
        evidence=(
            f"The recommended batch size on {device} is {recommended}. The model's parameters "
            "have post-accumulate-grad hooks: the optimizer steps each inside backward and "
            "frees its gradient, so gradients do not add up over micro batches."
        ),
        action=(
            f"Train with batch_size={recommended} (the effective batch is then {recommended}: "
            f"scale the learning rate for it), or step outside backward (`optimizer.step()` "
            f"every {plan.steps} backward passes) to accumulate {plan.steps} x {plan.micro_batch}."
        ),
    )


def state_still_grows(
    batch_size: int, steps: int, grown_bytes: int, optimizer_bytes: int, mode: str = "train"
) -> Advice:
    """``probe-state-grows``: the memory kept between steps still grew at the probe's last
    step, so its answer holds for that many steps, not for a longer run (``mode``: ``infer``
    worded for an evaluation loop: results it keeps on the device)."""
    if mode == "infer":
        return Advice(
            code="probe-state-grows",
            title=f"Batch {batch_size} is measured for {steps} steps: memory kept between "
            "steps still grew",
            evidence=(
                f"At batch {batch_size}, what the evaluation keeps between steps grew by "
                f"{format_size(grown_bytes)} from step 1 to step {steps} and was still growing "
                f"at step {steps}: results kept on the device (a list of logits), or a cache "
                "that grows."
            ),
            action=(
                "Evaluate with less than the answer, or keep results off the device "
                "(`.cpu()`, `.item()`) or bounded, then probe again; what a whole evaluation "
                "keeps grows with its length."
            ),
            severity="warning",
        )
    what = (
        f"{format_size(optimizer_bytes)} of it in the optimizer's state (an LBFGS-like "
        "history, or state that appears late)"
        if optimizer_bytes
        else "none of it in the optimizer's state (a cache, a list the step appends to, "
        "tensors kept across steps)"
    )
    return Advice(
        code="probe-state-grows",
        title=f"Batch {batch_size} is measured for {steps} steps: memory kept between steps "
        "still grew",
        evidence=(
            f"At batch {batch_size}, what the loop keeps between steps grew by "
            f"{format_size(grown_bytes)} from step 1 to step {steps} and was still growing at "
            f"step {steps}; {what}."
        ),
        action=(
            "Train with less than the answer, or bound what grows (LBFGS: history_size; a "
            "list of losses: append loss.item(), not loss), then probe again; `memkit run` "
            "shows which step's memory grows."
        ),
        severity="warning",
    )


def does_not_fit(
    *,
    batch_size: int,
    mode: str,
    need_bytes: int | None,
    capacity_bytes: int | None,
    device: str | None = None,
    total_bytes: int | None = None,
    context_bytes: int | None = None,
    parameter_bytes: int | None = None,
) -> Advice:
    """``does-not-fit``: even the smallest batch tried does not fit; what every step can shed.

    Measured by ``memkit probe`` (``device`` names where it ran) or estimated by
    ``memkit estimate`` (``total_bytes`` and ``context_bytes`` describe the card: the capacity is
    what the allocator may reserve, the card minus its CUDA context).

    Args:
        batch_size: the batch that did not fit.
        mode: ``"train"`` or ``"infer"``.
        need_bytes: what it needed (probe: at least this; estimate: the reserved peak).
        capacity_bytes: what the step may use.
        device: where a probe ran (its backend's name).
        total_bytes: the estimated card's memory.
        context_bytes: the estimated card's CUDA context.
        parameter_bytes: the model's parameters and buffers (a probe's): where they alone
            exceed the capacity, nothing a step sheds helps, and the advice says what does.
    """
    shard = "shard parameters and optimizer state across GPUs (FSDP/ZeRO)."
    if mode == "infer":  # no gradients, no optimizer state, no activations kept for backward
        shard = "shard the weights across GPUs (tensor or pipeline parallelism, FSDP)."
    if total_bytes is None or context_bytes is None:  # measured by a probe
        need = format_size(need_bytes) if need_bytes else "more"
        if parameter_bytes and capacity_bytes and parameter_bytes > capacity_bytes:
            return Advice(
                code="does-not-fit",
                title=f"The weights alone ({format_size(parameter_bytes)}) do not fit",
                evidence=(
                    f"Batch {batch_size} ({mode}) needed at least {need} on {device}, "
                    f"capacity {format_size(capacity_bytes)}: the model's parameters and "
                    f"buffers alone are {format_size(parameter_bytes)}."
                ),
                action=(
                    "Nothing a step sheds helps (autocast and checkpointing keep the weights "
                    "as they are): store the weights in half precision "
                    "(`model.to(torch.bfloat16)`) or quantized, use a smaller model or a "
                    f"larger device, or {shard}"
                ),
                severity="critical",
            )
        return Advice(
            code="does-not-fit",
            title=f"Even batch {batch_size} does not fit",
            evidence=(
                f"Batch {batch_size} ({mode}) needed at least {need} on {device}, "
                f"capacity {format_size(capacity_bytes)}."
            ),
            action=(
                "Reduce what every step holds: mixed precision (torch.autocast), activation "
                "checkpointing (torch.utils.checkpoint), a lighter optimizer (SGD keeps no "
                f"moments; Adam keeps two per parameter), or {shard}"
                if mode != "infer"
                else "Reduce what the forward holds: the weights in half precision "
                "(`model.to(torch.bfloat16)`) or quantized (8-bit, 4-bit), a shorter input "
                f"(sequence length, resolution), or {shard}"
            ),
            severity="critical",
        )
    return Advice(
        code="does-not-fit",
        title=f"Even batch {batch_size} is estimated not to fit",
        evidence=(
            f"Batch {batch_size} ({mode}) needs an estimated {format_size(need_bytes)} "
            f"reserved; the card has {format_size(capacity_bytes)} usable "
            f"({format_size(total_bytes)} minus a {format_size(context_bytes)} CUDA context)."
        ),
        action=(
            "Use a larger card, or reduce what every step holds: mixed precision "
            f"(--amp bf16), activation checkpointing, a lighter optimizer, or {shard}"
            if mode != "infer"
            else "Use a larger card, or reduce what the forward holds: the weights in half "
            "precision (--amp bf16 estimates autocast; `model.to(torch.bfloat16)` halves the "
            f"weights too) or quantized, a shorter input, or {shard}"
        ),
        severity="critical",
    )


def _own_accumulation(plan: AccumulationPlan, micro: int, device: str, calls: int) -> Advice:
    """``accumulate`` for a ``train_step`` that accumulates itself (sweep BV: "6 steps of 667"
    was advised to a step that already stepped every 4th call: 24 micro-batches an update)."""
    now = calls * micro * plan.world_size
    return Advice(
        code="accumulate",
        title=(
            f"Step the optimizer every {plan.steps} calls of {plan.micro_batch} for an effective "
            f"batch of {plan.effective_batch}"
        ),
        evidence=(
            f"Your train_step steps the optimizer every {calls} calls (it accumulates itself): "
            f"at the recommended batch size on {device}, {micro}, an optimizer step sees "
            f"{now} samples; the target is {plan.target_batch}."
        ),
        action=(
            f"batch_size={plan.micro_batch}, and the step's own accumulation set to "
            f"{plan.steps} calls per optimizer step (now {calls}; each call's loss divided by "
            f"{plan.steps}). The memory answer holds for any number of calls: the gradients "
            "held between them are the same."
        ),
    )


def accumulation_advice(
    plan: AccumulationPlan,
    recommended: int,
    device: str,
    *,
    batch_norm: bool = False,
    pairwise: bool = False,
) -> Advice:
    """The ``accumulate`` advice for a plan built on the probe's ``recommended`` batch size;
    ``pairwise``: the peaks grow faster than the batch, the sign of a loss over pairs
    of samples (in-batch negatives), which micro-batches change (sweep BT: SimCLR and CLIP
    were told "the effective batch matches the target")."""
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
        schedule = "The effective batch (and so the learning-rate schedule) matches the target" + (
            " in size." if pairwise else "."
        )
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
    pairs = (
        " The peaks grow faster than the batch, as a batch x batch tensor (a similarity, "
        "logits or distance matrix) makes them grow. If the loss compares each sample with the "
        "others of its batch (in-batch negatives: SimCLR, CLIP, triplet mining), micro-batches "
        f"change it: each sample is compared with {plan.micro_batch - 1} others, not "
        f"{plan.target_batch - 1}, and accumulating does not give the target batch's loss or "
        "gradient. Keep the whole batch's comparisons with gradient caching (compute the "
        "embeddings without a graph in chunks, the loss on all of them, then backward chunk by "
        "chunk: GradCache), or accept the smaller comparison batch."
        if pairwise
        else ""
    )
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
            f"{schedule}{norm}{pairs}"
        ),
        severity="warning" if pairwise else "info",
    )
