"""What an estimate assumed, one line each: the target card, its policies and the step.

The lines are part of the result (``Estimate.assumptions``), written where the facts are known:
before the search (the target) and after it (the kernels seen, the step, meta's limits).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from memkit.estimation.autocast import autocast_lists
from memkit.estimation.families import DeviceFamily, TargetCard
from memkit.units import format_size

__all__ = ["RNN_NOTE", "attention_line", "outcome_lines", "target_lines"]

RNN_NOTE = (
    "recurrent layers ({layers}): meta runs them a time step at a time (in float32 also "
    "under --amp), where a GPU runs cuDNN's fused RNN kernels (their own workspace and "
    "reserve; half precision under autocast): their activations may be off by tens of "
    "percent either way; measure with `memkit probe` on the GPU"
)
"""A model with ``nn.LSTM``/``GRU``/``RNN`` layers: what the estimate does not model."""

MAKE_BATCH_ON_META = (
    "make_batch ran under torch.device('meta'): its tensors are shapes only, so an error that "
    "depends on values (an index out of range from some batch size on) cannot show here; "
    "`memkit probe` runs the step on real values"
)


def target_lines(
    card: TargetCard,
    mode: str,
    amp: str | None,
    num_params: int,
    trainable: int,
    weights: str | None = None,
) -> list[str]:
    """The card, its CUDA context, allocator, cuBLAS workspace, autocast and the parameters
    (``weights``: their dtype where it is not float32, a model cast to bf16 whole)."""
    family = card.family
    return [
        f"target: {family.name} (sm{family.sm}; e.g. {family.examples}), "
        f"{format_size(card.total)} total",
        f"CUDA context: {format_size(card.context_bytes)}"
        + (" (given)" if card.context_given else " (family default; override with --context)"),
        "allocator: PyTorch CUDA caching allocator, default settings, one stream "
        "(512-byte blocks, 2 MiB small / 20 MiB large segments, best fit, split, merge)",
        f"cuBLAS workspace: {format_size(card.workspace_bytes)} per thread that runs matmuls"
        + (" (2 in training: autograd's device thread has its own)" if mode == "train" else "")
        + "; cuBLASLt: 1.00 MiB more per thread that runs a Linear with a bias",
        "amp: "
        + (
            "none (fp32)"
            if amp is None and weights is None
            else f"none (the model's own {weights} weights)"
            if amp is None
            else f"torch.autocast('cuda', {amp}) policy on the forward; fp32 master weights; "
            f"op lists from {autocast_lists().source}"
        ),
        f"parameters: {num_params:,} ({trainable:,} trainable, {num_params - trainable:,} "
        "frozen: no gradients, no optimizer state)",
    ]


def attention_line(requested: str, kernels: Sequence[str], family: DeviceFamily) -> str:
    """Which attention kernels the trials used, and why."""
    if not kernels:
        return "attention: no F.scaled_dot_product_attention call seen"
    if requested == "auto":
        how = "chosen as PyTorch would on"
    elif requested in kernels:
        how = "requested; on"
    else:  # (a kernel that cannot take the inputs: PyTorch's fallback)
        how = f"{requested} was requested and cannot take these inputs on"
    line = f"attention: {', '.join(kernels)} kernel ({how} sm{family.sm}; --attention overrides)"
    if "flash" in kernels and requested == "auto" and family.sm in (90, 100):
        line += (
            "; PyTorch builds with cuDNN > 9.15 run cuDNN attention here first, whose forward"
            " keeps the same tensors: flash's footprint stands in for it"
        )
    return line


_PADDING_KEY = re.compile(
    r"(?i)^(mask|.*attention_masks?|.*attn_mask|.*padding_mask|.*pad_mask|input_mask"
    r"|src_mask|pixel_mask)$"
)
"""A batch key naming a mask that padding zeroes (:func:`padded_masks`)."""

PADDING_PROBE_BATCH = 8
"""The batch size make_batch is called at on the CPU to see whether its masks hold padding
(one row has none)."""


def padded_masks(batch: Any) -> tuple[str, ...]:
    """The keys (in a mapping, one level of nesting) of ``batch``'s masks that hold padding:
    an integer or bool tensor of 2 or more dimensions under a key naming an attention or
    padding mask (``attention_mask``, ``decoder_attention_mask``, ``key_padding_mask``,
    ``attn_mask``, ``input_mask``, DETR's ``pixel_mask``, ``mask``), with a zero. Other
    masks are no padding (review CL: BEiT's ``bool_masked_pos``, an SFT ``loss_mask``,
    ``special_tokens_mask``); a tuple batch's tensors have no names and are not read.

    Examples:
        >>> import torch
        >>> mask = torch.ones(2, 4, dtype=torch.long)
        >>> padded_masks({"input_ids": mask, "attention_mask": mask})
        ()
        >>> mask[1, 3] = 0
        >>> padded_masks({"input_ids": mask, "attention_mask": mask})
        ('attention_mask',)
        >>> padded_masks({"bool_masked_pos": mask.bool(), "loss_mask": mask})
        ()
    """
    found: list[str] = []
    items = list(batch.items()) if isinstance(batch, Mapping) else []
    for key, value in items:
        if isinstance(value, Mapping):
            items.extend((f"{key}.{k}", v) for k, v in value.items() if "." not in str(key))
        elif (
            isinstance(value, torch.Tensor)
            and _PADDING_KEY.search(str(key).rsplit(".", 1)[-1]) is not None
            and not (value.is_floating_point() or value.is_complex())  # (bool and integers)
            and value.dim() >= 2
            and value.device.type != "meta"
            and not bool(value.all())
        ):
            found.append(str(key))
    return tuple(found)


def outcome_lines(
    requested_attention: str,
    kernels: Sequence[str],
    family: DeviceFamily,
    step_lines: Sequence[str],
    data_checks: int,
    generate_checks: int = 0,
    unstepped: int | None = None,
    padded: Sequence[str] = (),
    step_reads: int = 0,
) -> list[str]:
    """After the search: the attention kernels, the step (``StepPlan.describe()``), the
    data-dependent checks taken as true (those of a ``generate()``: it stopped at its first
    token) and what make_batch's tensors were."""
    lines = [attention_line(requested_attention, kernels, family), *step_lines]
    if unstepped is not None:
        lines.append(
            f"warning: no optimizer stepped in the 2 steps of the answer's trial (batch "
            f"{unstepped}: a step that steps every k-th call, accelerate's sync_gradients), so "
            "the optimizer's step and state may be missing from its peak; `memkit probe` runs "
            "the step's cycle"
        )
    if generate_checks:
        lines.append(
            "warning: generate() ran on meta tensors, where its stopping check (are all "
            "sequences finished?) has no value and read as true: each call stopped after its "
            "first new token, so the key-value cache and scores of longer outputs are not "
            "counted; `memkit probe FILE --mode infer --device cpu --budget SIZE` runs it"
        )
    if data_checks:
        lines.append(
            "data-dependent checks (`if mask.all():` and the like) read from meta tensors were "
            f"taken as true ({data_checks} times in the trials): right for batches "
            "without padding, as make_batch usually builds them"
        )
    if step_reads:
        lines.append(
            f"the file's step read a value with .item() in its own lines ({step_reads} times "
            "in the trials: a loss returned, printed or kept), which meta tensors do not hold: "
            "a number kept that way holds no device memory (computed with or compared in "
            "Python it stops the estimate; C code, math.isfinite or numpy, reads it as 1.0)"
        )
    if data_checks and padded:
        masks = ", ".join(f"`{key}`" for key in padded)
        lines.append(
            f"warning: make_batch's {masks} holds padding (zeros, in a batch of "
            f"{PADDING_PROBE_BATCH} it built on the CPU), where a check such as transformers' "
            "`mask.all()` is false on a GPU: the estimate ran the path for batches without "
            "padding, and the padded one can need more (the mask made additive, key and "
            "value heads repeated for grouped-query attention: sweep CQ, 3-7% more on small "
            "transformers); `memkit probe FILE --device cpu --budget SIZE` runs the padded batch"
        )
    lines.append(MAKE_BATCH_ON_META)
    return lines
