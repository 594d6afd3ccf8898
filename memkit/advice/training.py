"""Rules on what a training step holds: mixed precision, activation checkpointing, the
optimizer's state, gradients kept through the forward. Functions of measured numbers (no
torch); the track report and the estimate feed them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memkit.advice.form import Advice, percent_of, under_pressure
from memkit.units import format_size

__all__ = [
    "LIGHTER_OPTIMIZERS",
    "ModuleActivation",
    "activation_checkpointing",
    "mixed_precision",
    "optimizer_state",
    "zero_grad_keeps_grads",
]


def mixed_precision(
    *,
    param_dtype: str | None,
    autocast: bool,
    activation_bytes: int,
    peak_bytes: int,
    parameter_bytes: int = 0,
    device: str = "the device",
    half: str | None = "bf16",
    saving_bytes: int | None = None,
    min_share: float = 0.2,
) -> Advice | None:
    """``mixed-precision``: fp32 training whose activations are a large share of the peak.

    Args:
        param_dtype: the model's floating parameters' dtype (``"float32"``).
        autocast: a forward ran under ``torch.autocast``: already mixed precision.
        activation_bytes: activations at the peak.
        peak_bytes: the peak.
        parameter_bytes: parameters (autocast caches a half copy of each weight it casts).
        device: where it ran, for the text.
        half: the half type the device supports (``"bf16"``, ``"fp16"``), ``None`` for none.
        saving_bytes: a measured saving (an estimate's bf16 rerun) overrides the estimate
            ``activations / 2 - parameters / 2``.
        min_share: activations must be at least this share of the peak.
    """
    if half is None or autocast or param_dtype not in ("float32", "torch.float32"):
        return None
    if peak_bytes <= 0 or activation_bytes < min_share * peak_bytes:
        return None
    if saving_bytes is None:
        saving_bytes = max(0, activation_bytes // 2 - parameter_bytes // 2) or None
    dtype = "torch.bfloat16" if half == "bf16" else "torch.float16"
    scaler = (
        "" if half == "bf16" else " With fp16 also use `torch.amp.GradScaler()` to scale the loss."
    )
    kind = device.split(":")[0] if device.startswith(("cuda", "xpu", "mps")) else "cuda"
    return Advice(
        code="mixed-precision",
        title="fp32 training: mixed precision would cut activation memory",
        evidence=(
            f"Parameters are {param_dtype} and no forward ran under autocast; activations were "
            f"{format_size(activation_bytes)} ({percent_of(activation_bytes, peak_bytes)}) of the "
            f"{format_size(peak_bytes)} peak on {device}. In {half} most activations take half "
            "the bytes (autocast keeps a half copy of the weights it casts)."
        ),
        action=(
            f"`with torch.autocast('{kind}', dtype={dtype}):` around the forward and the loss "
            f"(weights and the optimizer stay fp32).{scaler}"
        ),
        saving_bytes=saving_bytes,
    )


@dataclass(frozen=True)
class ModuleActivation:
    """What :func:`activation_checkpointing` needs of a module (a ``ModuleRecord`` has it)."""

    path: str
    activation_bytes: int
    leaf: bool


def _checkpoint_blocks(
    modules: Sequence[ModuleActivation],
) -> tuple[list[ModuleActivation], dict[str, int]]:
    """The non-leaf, non-root blocks at the depth whose blocks keep the most activations, and
    the estimated output (kept when checkpointed) of each: its largest leaf descendant's."""
    if not modules:
        return [], {}
    root = max(modules, key=lambda m: m.activation_bytes)
    blocks = [m for m in modules if m is not root and not m.leaf]
    by_depth: dict[int, list[ModuleActivation]] = {}
    for m in blocks:
        by_depth.setdefault(m.path.count("."), []).append(m)
    if not by_depth:
        return [], {}
    best = max(by_depth.values(), key=lambda ms: (sum(m.activation_bytes for m in ms), -len(ms)))
    outputs: dict[str, int] = {}
    for b in best:
        leaves = [m.activation_bytes for m in modules if m.leaf and m.path.startswith(b.path + ".")]
        outputs[b.path] = max(leaves, default=0)
    return sorted(best, key=lambda m: -m.activation_bytes), outputs


def activation_checkpointing(
    *,
    activation_bytes: int,
    peak_bytes: int,
    modules: Sequence[ModuleActivation],
    capacity: int | None = None,
    device: str = "the device",
    min_share: float = 0.5,
) -> Advice | None:
    """``activation-checkpointing``: activations dominate the peak; which blocks to checkpoint.

    The blocks are the non-leaf submodules at the depth whose blocks keep the most activation
    memory (a transformer's layers, a ResNet's stages). Checkpointing k blocks keeps each
    one's output (estimated as its largest leaf module's activation) and, during backward,
    recomputes one block at a time: saving ~ sum(kept) - sum(outputs) - max(kept). Fires when
    activations are at least ``min_share`` of the peak and memory is short (:data:`PRESSURE`).
    """
    if peak_bytes <= 0 or activation_bytes < min_share * peak_bytes:
        return None
    if not under_pressure(peak_bytes, capacity):
        return None
    blocks, outputs = _checkpoint_blocks(modules)
    if len(blocks) < 2:
        return None
    kept = sum(b.activation_bytes for b in blocks)
    saving = kept - sum(outputs.values()) - max(b.activation_bytes for b in blocks)
    if saving <= 0:
        return None
    names = ", ".join(f"{b.path} ({format_size(b.activation_bytes)})" for b in blocks[:5])
    more = f" and {len(blocks) - 5} more" if len(blocks) > 5 else ""
    cap = "" if not capacity else f" (capacity {format_size(capacity)})"
    first = blocks[0].path
    return Advice(
        code="activation-checkpointing",
        title=f"activations are {percent_of(activation_bytes, peak_bytes)} of the peak: checkpoint "
        f"{len(blocks)} blocks",
        evidence=(
            f"Activations were {format_size(activation_bytes)} of the {format_size(peak_bytes)} "
            f"peak on {device}{cap}. The blocks that keep the most: {names}{more}; together "
            f"{format_size(kept)}, of which their outputs (kept when checkpointed) are about "
            f"{format_size(sum(outputs.values()))}."
        ),
        action=(
            "Recompute those blocks in backward: in the parent's forward, `x = torch.utils."
            f"checkpoint.checkpoint(block, x, use_reentrant=False)` for each (e.g. `{first}`); "
            "Hugging Face models: `model.gradient_checkpointing_enable()`. Costs about one "
            "extra forward of those blocks per step."
        ),
        saving_bytes=saving,
        severity="warning",
    )


LIGHTER_OPTIMIZERS = (
    ("SGD with momentum (one buffer per parameter)", 1 / 2),
    ("8-bit Adam (bitsandbytes.optim.Adam8bit, ~1/4 of the bytes)", 3 / 4),
    ("Adafactor (factored second moment, no first moment)", 0.95),
)
"""``(option, share of Adam's state saved)`` for the ``optimizer-state`` advice."""


def optimizer_state(
    *,
    optimizer_state_bytes: int,
    parameter_bytes: int,
    peak_bytes: int,
    capacity: int | None = None,
    optimizer: str | None = None,
    optimizer_transient_bytes: int | None = None,
    ranks: int | None = None,
    device: str = "the device",
    min_share: float = 0.3,
) -> Advice | None:
    """``optimizer-state``: optimizer state dominates the peak; the options and their savings.

    Args:
        optimizer_state_bytes: state at the peak (Adam: two moments per parameter).
        parameter_bytes: the parameters, for the ratio.
        peak_bytes: the peak.
        capacity: the device's size (see :data:`PRESSURE`).
        optimizer: its class name, for the text.
        optimizer_transient_bytes: what the optimizer step allocated on top of its state (the
            ``foreach`` implementation's temporaries): ``foreach=False`` saves most of it.
        ranks: ranks to shard across (the world size); the text shows 2, 4 and 8 when unknown.
        device: where it ran, for the text.
        min_share: state must be at least this share of the peak.
    """
    if peak_bytes <= 0 or optimizer_state_bytes < min_share * peak_bytes:
        return None
    if not under_pressure(peak_bytes, capacity):
        return None
    name = optimizer or "the optimizer"
    ratio = optimizer_state_bytes / parameter_bytes if parameter_bytes else 0.0
    options = [
        f"{opt}: saves ~{format_size(int(optimizer_state_bytes * share))}"
        for opt, share in LIGHTER_OPTIMIZERS
    ]
    shard_ns = [ranks] if ranks and ranks > 1 else [2, 4, 8]
    shards = ", ".join(
        f"{n} ranks save {format_size(optimizer_state_bytes * (n - 1) // n)}" for n in shard_ns
    )
    options.append(
        "shard it across ranks (torch.distributed.optim.ZeroRedundancyOptimizer, or FSDP which "
        f"also shards weights and gradients): {shards} per rank"
    )
    if optimizer_transient_bytes:
        options.insert(
            0,
            f"`{name}(..., foreach=False)`: the step's temporaries "
            f"({format_size(optimizer_transient_bytes)}) shrink to one parameter's worth",
        )
    return Advice(
        code="optimizer-state",
        title=f"optimizer state is {percent_of(optimizer_state_bytes, peak_bytes)} of the peak",
        evidence=(
            f"{name} state was {format_size(optimizer_state_bytes)} "
            f"({ratio:.1f}x the {format_size(parameter_bytes)} of parameters; Adam keeps two "
            f"moments per parameter) of the {format_size(peak_bytes)} peak on {device}."
        ),
        action="Options: " + "; ".join(options) + ".",
        saving_bytes=optimizer_state_bytes // 2,
        severity="warning",
    )


def zero_grad_keeps_grads(
    *,
    steps_with_grads: int,
    gradient_bytes: int,
    peak_phase: str | None = None,
    device: str = "the device",
) -> Advice | None:
    """``zero-grad-keeps-grads``: gradients were allocated when a step's first forward began.

    ``steps_with_grads`` counts steps after the first whose first forward began with gradients
    allocated: ``optimizer.zero_grad(set_to_none=False)`` (zeros, still allocated), or
    ``zero_grad()`` called between the forward and backward instead of before the forward.
    Under gradient accumulation the later micro batches of a step legitimately start with
    gradients; only a step's first forward counts.
    """
    if steps_with_grads < 1 or gradient_bytes <= 0:
        return None
    at_peak = peak_phase == "forward"
    return Advice(
        code="zero-grad-keeps-grads",
        title=f"{format_size(gradient_bytes)} of gradients stay allocated through the forward",
        evidence=(
            f"On {device}, {steps_with_grads} step(s) began their forward with the "
            f"{format_size(gradient_bytes)} of gradients still allocated"
            + (", and the peak came in a forward, so they are part of it." if at_peak else ".")
        ),
        action=(
            "Free them before the forward: `optimizer.zero_grad(set_to_none=True)` (the "
            "default since PyTorch 2.0; drop `set_to_none=False`) right after "
            "`optimizer.step()` or before `model(x)`, not between forward and backward."
        ),
        saving_bytes=gradient_bytes,
        severity="warning" if at_peak else "info",
    )
