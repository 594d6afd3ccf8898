"""Rules on the batch size: ``does-not-fit`` (a probe or an estimate found no batch that fits)."""

from __future__ import annotations

from memkit.advice.form import Advice
from memkit.units import format_size

__all__ = ["does_not_fit"]


def does_not_fit(
    *,
    batch_size: int,
    mode: str,
    need_bytes: int | None,
    capacity_bytes: int | None,
    device: str | None = None,
    total_bytes: int | None = None,
    context_bytes: int | None = None,
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
    """
    shard = "shard parameters and optimizer state across GPUs (FSDP/ZeRO)."
    if total_bytes is None or context_bytes is None:  # measured by a probe
        need = format_size(need_bytes) if need_bytes else "more"
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
        ),
        severity="critical",
    )
