"""The advice of an estimate: its evidence (the trials, the breakdown, a bf16 re-run) handed
to the rules of :mod:`memkit.advice` (one implementation per code)."""

from __future__ import annotations

import logging

import torch

from memkit import advice as rules
from memkit.advice import Advice
from memkit.estimation.families import TargetCard
from memkit.estimation.meta_step import MetaSession
from memkit.estimation.result import EstimateBreakdown
from memkit.probing.search import SearchResult

__all__ = ["estimate_advice"]

log = logging.getLogger(__name__)


def estimate_advice(
    search: SearchResult,
    session: MetaSession,
    breakdown: EstimateBreakdown,
    amp: str | None,
    mode: str,
    card: TargetCard,
) -> list[Advice]:
    """``does-not-fit``, ``mixed-precision`` and ``optimizer-state`` for the breakdown's batch."""
    advice: list[Advice] = []
    focus = breakdown.batch_size
    peaks = session.cache[focus]
    if search.max_batch_size is None:
        advice.append(
            rules.does_not_fit(
                batch_size=focus,
                mode=mode,
                need_bytes=peaks.reserved,
                capacity_bytes=card.usable,
                total_bytes=card.total,
                context_bytes=card.context_bytes,
            )
        )
    if amp is None and breakdown.activations > 0.2 * breakdown.total:
        mp = rules.mixed_precision(
            param_dtype="float32",  # no --amp: the estimate computes in the model's fp32
            autocast=False,
            activation_bytes=breakdown.activations,
            peak_bytes=breakdown.total,
            parameter_bytes=breakdown.parameters,
            device=f"the estimated card, batch {focus}",
            saving_bytes=_bf16_saving(session, focus),  # measured: a bf16 estimate of the batch
            min_share=0.2,
        )
        if mp is not None:
            advice.append(mp)
    if mode == "train":
        opt = rules.optimizer_state(
            optimizer_state_bytes=breakdown.optimizer_state,
            parameter_bytes=breakdown.parameters,
            peak_bytes=breakdown.total,
            capacity=None,  # an estimate asks "would it fit": always relevant
            device=f"the estimated card, batch {focus}",
        )
        if opt is not None:
            advice.append(opt)
    return advice


def _bf16_saving(session: MetaSession, batch_size: int) -> int | None:
    """What bf16 autocast would save at ``batch_size``: a second trial (``None`` if it fails)."""
    try:
        bf16 = session.with_amp(torch.bfloat16).run(batch_size).allocated
    except Exception as exc:  # advice must never break the estimate
        log.debug("bf16 comparison failed: %s", exc)
        return None
    return max(0, session.cache[batch_size].allocated - bf16)
