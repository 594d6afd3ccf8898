"""The advice of an estimate: ``does-not-fit`` (with ``fsdp-gpus``), ``mixed-precision`` and
``optimizer-state`` for
the batch its breakdown describes, from the estimate's evidence (the search's outcome, the
breakdown, the target card; :mod:`memkit.estimation.evidence` gathers it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from memkit.advice.form import Advice
from memkit.advice.probe import does_not_fit
from memkit.advice.sharding import Unit, fsdp_gpus_needed
from memkit.advice.training import mixed_precision, optimizer_state

if TYPE_CHECKING:
    from memkit.estimation.families import TargetCard
    from memkit.estimation.result import EstimateBreakdown

__all__ = ["estimate_advice"]


def estimate_advice(
    breakdown: EstimateBreakdown,
    card: TargetCard,
    *,
    mode: str,
    amp: str | None,
    fits: bool,
    need_bytes: int,
    bf16_saving: Callable[[], int | None],
    units: Sequence[Unit] = (),
    trainable_bytes: int = 0,
) -> list[Advice]:
    """``does-not-fit``, ``mixed-precision`` and ``optimizer-state`` for the breakdown's batch.

    Args:
        breakdown: the estimate's breakdown (of its recommended batch, or the smallest tried).
        card: the target card (its memory, CUDA context and usable bytes).
        mode: ``"train"`` or ``"infer"``.
        amp: the autocast dtype estimated (``None``: fp32).
        fits: whether any batch fit.
        need_bytes: the reserved peak at the breakdown's batch.
        bf16_saving: what bf16 autocast saves at that batch, measured by a second trial; asked
            only when ``mixed-precision`` may fire (``None`` if that trial fails).
        units: the units FSDP would shard (``memkit.simulated.fsdp.unit_sizes``), for
            ``fsdp-gpus`` when nothing fits in training.
        trainable_bytes: the trainable parameters' bytes (the gradients FSDP shards; what the
            optimizer's state is per parameter of).
    """
    advice: list[Advice] = []
    focus = breakdown.batch_size
    if not fits:
        advice.append(
            does_not_fit(
                batch_size=focus,
                mode=mode,
                need_bytes=need_bytes,
                capacity_bytes=card.usable,
                total_bytes=card.total,
                context_bytes=card.context_bytes,
            )
        )
        if mode == "train" and units:
            state = breakdown.parameters + trainable_bytes + breakdown.optimizer_state
            gpus = fsdp_gpus_needed(
                parameter_bytes=breakdown.parameters,
                gradient_bytes=trainable_bytes,
                optimizer_state_bytes=breakdown.optimizer_state,
                other_bytes=max(0, need_bytes - state),
                capacity_bytes=card.usable,
                units=units,
                batch_size=focus,
            )
            if gpus is not None:
                advice.append(gpus)
    if amp is None and breakdown.activations > 0.2 * breakdown.total:
        mp = mixed_precision(
            param_dtype="float32",  # no --amp: the estimate computes in the model's fp32
            autocast=False,
            activation_bytes=breakdown.activations,
            peak_bytes=breakdown.total,
            parameter_bytes=breakdown.parameters,
            device=f"the estimated card, batch {focus}",
            saving_bytes=bf16_saving(),  # measured: a bf16 estimate of the batch
            min_share=0.2,
            inference=mode == "infer",
        )
        if mp is not None:
            advice.append(mp)
    if mode == "train":
        opt = optimizer_state(
            optimizer_state_bytes=breakdown.optimizer_state,
            parameter_bytes=breakdown.parameters,
            peak_bytes=breakdown.total,
            capacity=None,  # an estimate asks "would it fit": always relevant
            device=f"the estimated card, batch {focus}",
            optimized_bytes=trainable_bytes or None,
        )
        if opt is not None:
            advice.append(opt)
    return advice
