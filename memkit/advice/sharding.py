"""Rules on sharding with FSDP2 (``fully_shard``): ``fsdp-gpus`` (the model's state does not fit
on one GPU: how many GPUs FSDP needs and what each holds), ``fsdp-saves`` (DDP fits: what FSDP
would save per GPU, and the communication it costs) and ``fsdp-wrap-unit`` (one all-gathered
unit sets the peak: the module to ``fully_shard`` on its own).

A rank under FSDP holds ``1/N`` of the parameters, gradients and optimizer state (its shards),
the activations of its own batch, and, around the unit running, unsharded memory: at the peak
of a unit's backward its unsharded parameters, their unsharded gradients and the reduce-scatter
input (three times the unit), and the next unit's all-gather buffer, prefetched
(:func:`gathered_bytes`; the step-by-step model is :mod:`memkit.simulated.fsdp`). Pure functions
of numbers, so tests construct them.
"""

from __future__ import annotations

from collections.abc import Sequence

from memkit.advice.form import Advice
from memkit.units import format_size, size_option

__all__ = [
    "MAX_GPUS",
    "Unit",
    "fsdp_gpus_needed",
    "fsdp_saves",
    "fsdp_wrap_unit",
    "gathered_bytes",
]

MAX_GPUS = 4096
"""``fsdp-gpus`` counts up to this many GPUs; beyond it the answer is "FSDP alone will not"."""

Unit = tuple[str, int]
"""A unit's module path (``""``: the root) and its unsharded parameter bytes."""


def gathered_bytes(units: Sequence[Unit]) -> int:
    """The unsharded memory a rank holds at its peak, at most: three times the largest unit
    (its unsharded parameters, their gradients, the reduce-scatter input) plus the second
    largest (its all-gather buffer, prefetched for backward)."""
    sizes = [*sorted((b for _, b in units), reverse=True), 0, 0]
    return 3 * sizes[0] + sizes[1]


def _largest(units: Sequence[Unit]) -> Unit:
    return max(units, key=lambda u: u[1]) if units else ("", 0)


def _name(path: str) -> str:
    return f"model.{path}" if path else "model (the root)"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fsdp_gpus_needed(
    *,
    parameter_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
    other_bytes: int,
    capacity_bytes: int,
    units: Sequence[Unit],
    batch_size: int,
    measured_fit: tuple[int, int, int] | None = None,
    rest_at_least: bool = False,
) -> Advice | None:
    """``fsdp-gpus``: parameters + gradients + optimizer state (+ the step's other memory at
    ``batch_size``) do not fit in ``capacity_bytes``; the fewest GPUs ``N`` whose ranks each
    fit ``ceil(state / N) + gathered_bytes(units) + other_bytes``.

    Args:
        parameter_bytes, gradient_bytes, optimizer_state_bytes: the whole model's, on one GPU.
        other_bytes: the rest of the step's peak at ``batch_size`` (activations, temporaries):
            per rank, for a per-rank batch of ``batch_size``.
        capacity_bytes: what one GPU's step may use.
        units: the units FSDP would all-gather (``memkit.simulated.fsdp.unit_sizes``).
        measured_fit: FSDP measured to fit (``memkit probe --strategies fsdp``): on how many
            GPUs, its largest global batch there and the per-GPU peak at it; the answer is
            never above that number of GPUs.
        rest_at_least: ``other_bytes`` is a lower bound (a step that ran out before its end
            measured no more): the number of GPUs is a least one, said so.

    ``None`` when it all fits on one GPU. When the unsharded part alone (all-gathers and
    other memory) exceeds a GPU, says that no number of GPUs makes FSDP fit.

        >>> a = fsdp_gpus_needed(parameter_bytes=400, gradient_bytes=400,
        ...     optimizer_state_bytes=800, other_bytes=100, capacity_bytes=600,
        ...     units=[("0", 100), ("1", 100)], batch_size=1)
        >>> print(a.title)  # 1600 / N + 400 + 100 <= 600: N = 16
        FSDP needs 16 GPUs for batch 1 per GPU: the model's state does not fit on one
    """
    state = parameter_bytes + gradient_bytes + optimizer_state_bytes
    if state + other_bytes <= capacity_bytes or state <= 0:
        return None
    gathered = gathered_bytes(units)
    name, unit = _largest(units)
    fixed = gathered + other_bytes
    least = "at least " if rest_at_least else ""
    rest = f"{least}{format_size(other_bytes)} of the rest of the step"
    if rest_at_least and not other_bytes:
        rest = "the rest of the step (not measured)"
    one = (
        f"On one GPU: parameters {format_size(parameter_bytes)} + gradients "
        f"{format_size(gradient_bytes)} + optimizer state {format_size(optimizer_state_bytes)} "
        f"= {format_size(state)}, plus {rest} at batch {batch_size} (activations, "
        "temporaries, workspaces"
        + ("; the step ran out before its end" if rest_at_least else "")
        + f"), against {format_size(capacity_bytes)}."
    )
    unsharded = (
        f"up to {format_size(gathered)} unsharded around the running unit (3 x the largest, "
        f"{_name(name)} at {format_size(unit)}: its parameters, gradients and reduce-scatter "
        "input, + the prefetched next one)"
    )
    room = capacity_bytes - fixed
    gpus = _ceil_div(state, room) if room > 0 else MAX_GPUS + 1
    if gpus > MAX_GPUS and measured_fit is None:
        return Advice(
            code="fsdp-gpus",
            title=f"Sharding with FSDP alone does not fit batch {batch_size} per GPU",
            evidence=(
                f"{one} Whatever the number of GPUs, each rank holds {unsharded} and "
                f"{rest}: {least}{format_size(fixed)}, against {format_size(capacity_bytes)}."
            ),
            action=(
                "Shrink what is not sharded: fully_shard smaller units (fsdp-wrap-unit), "
                "activation checkpointing, mixed precision (MixedPrecisionPolicy(param_dtype="
                "torch.bfloat16)), or a smaller batch per GPU."
            ),
            severity="warning",
        )
    if measured_fit is not None and measured_fit[0] < gpus:
        gpus, batch, peak = measured_fit
        outcome = (
            f"Measured on {gpus} GPUs: a global batch of {batch}, each GPU peaking at "
            f"{format_size(peak)} (the parts above are an upper bound)."
        )
    else:
        gpus = max(2, gpus)
        outcome = (
            f"{'At least' if rest_at_least else 'About'} "
            f"{format_size(_ceil_div(state, gpus) + fixed)} per GPU, estimated from these "
            f"parts; with {gpus - 1} it would be {least}"
            f"{format_size(_ceil_div(state, gpus - 1) + fixed)}"
            + (": measure the step on them before you rely on it." if rest_at_least else ".")
        )
    shard = _ceil_div(state, gpus)
    return Advice(
        code="fsdp-gpus",
        title=(
            f"FSDP needs {least if measured_fit is None else ''}{gpus} GPUs for batch "
            f"{batch_size} per GPU: the model's state does not fit on one"
        ),
        evidence=(
            f"{one} Sharded over {gpus} GPUs each holds {format_size(shard)} of it (parameters "
            f"{format_size(_ceil_div(parameter_bytes, gpus))}, gradients "
            f"{format_size(_ceil_div(gradient_bytes, gpus))}, optimizer state "
            f"{format_size(_ceil_div(optimizer_state_bytes, gpus))}), {unsharded} and "
            f"{rest}. {outcome}"
        ),
        action=(
            f"`torchrun --nproc-per-node {gpus} train.py`; in it, `fully_shard(block)` for each "
            "block (a transformer layer), then `fully_shard(model)`, the optimizer built after; "
            f"check with `memkit probe FILE --device cpu --gpus {gpus} --budget "
            f"{size_option(capacity_bytes)} --strategies fsdp`, or without running the steps "
            f"(meta tensors, faster for a large model) `memkit estimate FILE --gpus {gpus} "
            "--strategies fsdp --device-memory SIZE --arch CARD`."
        ),
        saving_bytes=state - shard,
        severity="critical",
    )


def fsdp_saves(
    *,
    parameter_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
    bucket_bytes: int,
    gpus: int,
    units: Sequence[Unit],
    largest_batches: tuple[int | None, int | None] | None = None,
) -> Advice | None:
    """``fsdp-saves``: what FSDP would hold less per GPU than DDP, and its communication.

    Per GPU, DDP holds the parameters, gradients, optimizer state and its bucket copy of the
    gradients; FSDP holds ``1/N`` of the first three and :func:`gathered_bytes`. Per step and
    rank, DDP's all-reduce sends about ``2 x gradients x (N - 1) / N``; FSDP's all-gathers
    (forward and backward, ``reshard_after_forward=True``) and reduce-scatter about
    ``(2 x parameters + gradients) x (N - 1) / N``: 1.5x when every parameter trains.
    ``largest_batches`` (DDP, FSDP global), when measured, decide the title; ``None`` when FSDP
    saves nothing by the estimate and the measurement (if any) shows no larger batch.
    """
    state = parameter_bytes + gradient_bytes + optimizer_state_bytes
    ddp = state + bucket_bytes
    shard = _ceil_div(state, gpus)
    gathered = gathered_bytes(units)
    fsdp = shard + gathered
    saving = ddp - fsdp
    ddp_b, fsdp_b = largest_batches or (None, None)
    measured = largest_batches is not None and fsdp_b is not None
    if saving <= 0 and not (measured and (fsdp_b or 0) > (ddp_b or 0)):
        return None
    share = (gpus - 1) / gpus
    ddp_traffic = int(2 * gradient_bytes * share)
    fsdp_traffic = int((2 * parameter_bytes + gradient_bytes) * share)
    ratio = fsdp_traffic / ddp_traffic if ddp_traffic else float("inf")
    if measured:
        title = (
            f"FSDP fits a global batch of {fsdp_b} on {gpus} GPUs (DDP {ddp_b or 'none'}), "
            f"{format_size(saving)} less state per GPU, at {ratio:.1f}x DDP's communication"
        )
    else:
        title = (
            f"FSDP would hold {format_size(saving)} less per GPU than DDP on {gpus} GPUs, at "
            f"{ratio:.1f}x its communication"
        )
    return Advice(
        code="fsdp-saves",
        title=title,
        evidence=(
            f"DDP holds on every GPU the parameters {format_size(parameter_bytes)}, gradients "
            f"{format_size(gradient_bytes)}, optimizer state {format_size(optimizer_state_bytes)} "
            f"and its bucket copy of the gradients {format_size(bucket_bytes)}: "
            f"{format_size(ddp)}. FSDP over {gpus} holds {format_size(shard)} of shards and up "
            f"to {format_size(gathered)} unsharded around the running unit: {format_size(fsdp)}. "
            f"Per step each rank sends about {format_size(fsdp_traffic)} (parameters all-"
            f"gathered in forward and again in backward, gradients reduce-scattered) against "
            f"DDP's {format_size(ddp_traffic)} (one all-reduce of the gradients), and waits on "
            "an all-gather per unit that prefetching only partly hides."
        ),
        action=(
            "If memory is the limit (a larger batch per GPU, a larger model), use FSDP: "
            "`fully_shard(block)` per block, then `fully_shard(model)`"
            + (
                "; DDP fits no batch here."
                if measured and ddp_b is None
                else "; if DDP's batch is enough and speed matters, stay with DDP."
            )
        ),
        saving_bytes=saving if saving > 0 else None,
        severity="info",
    )


def fsdp_wrap_unit(
    units: Sequence[Unit],
    inner: Unit | None,
    peak_bytes: int,
) -> Advice | None:
    """``fsdp-wrap-unit``: the largest unit is at least twice the next and its all-gather (3 x
    it, :func:`gathered_bytes`) is at least a quarter of a rank's ``peak_bytes``; ``inner`` is
    the largest module inside it that is not yet a unit (its path and bytes, smaller than the
    unit). Wrapping ``inner`` on its own splits the unit in two."""
    if inner is None or len(units) < 1:
        return None
    sizes = sorted(units, key=lambda u: u[1], reverse=True)
    name, unit = sizes[0]
    second = sizes[1][1] if len(sizes) > 1 else 0
    now = gathered_bytes(units)
    if unit < 2 * second or 3 * unit < 0.25 * peak_bytes or not 0 < inner[1] < unit:
        return None
    split = [u for u in units if u[0] != name] + [(name, unit - inner[1]), inner]
    saving = now - gathered_bytes(split)
    if saving <= 0:
        return None
    return Advice(
        code="fsdp-wrap-unit",
        title=f"One FSDP unit sets the peak: {_name(name)}, {format_size(unit)} all-gathered",
        evidence=(
            f"The largest unit, {_name(name)}, holds {format_size(unit)} of parameters "
            f"unsharded, the next {format_size(second)}; around it a rank holds up to "
            f"{format_size(now)} unsharded (its parameters, gradients and reduce-scatter input, "
            f"+ the prefetched next unit), against a per-GPU peak of {format_size(peak_bytes)}. "
            f"Inside it, model.{inner[0]} ({format_size(inner[1])}) is not a unit of its own."
        ),
        action=(
            f"`fully_shard(model.{inner[0]})` before `fully_shard({_name(name).split(' ')[0]})`: "
            f"the largest unit becomes {format_size(max(unit - inner[1], inner[1], second))}."
        ),
        saving_bytes=saving,
        severity="warning",
    )
