"""The evidence an estimate's advice needs, handed to :mod:`memkit.advice.estimate`: the
search's outcome, the reserved peak at the breakdown's batch, and (when the rule asks) a bf16
re-run of that batch."""

from __future__ import annotations

import logging

import torch

from memkit.advice import Advice
from memkit.advice.estimate import estimate_advice
from memkit.estimation.families import TargetCard
from memkit.estimation.meta_step import MetaSession
from memkit.estimation.result import EstimateBreakdown
from memkit.probing.search import SearchResult
from memkit.simulated.fsdp import unit_sizes

__all__ = ["advice_for", "bf16_saving"]

log = logging.getLogger(__name__)


def advice_for(
    search: SearchResult,
    session: MetaSession,
    breakdown: EstimateBreakdown,
    amp: str | None,
    mode: str,
    card: TargetCard,
) -> list[Advice]:
    """The estimate's advice for the breakdown's batch, from the trials ``session`` ran."""
    focus = breakdown.batch_size
    return estimate_advice(
        breakdown,
        card,
        mode=mode,
        amp=amp,
        fits=search.max_batch_size is not None,
        need_bytes=session.cache[focus].reserved,
        bf16_saving=lambda: bf16_saving(session, focus),
        units=unit_sizes(session.model),
        trainable_bytes=sum(
            p.numel() * p.element_size() for p in session.model.parameters() if p.requires_grad
        ),
    )


def bf16_saving(session: MetaSession, batch_size: int) -> int | None:
    """What bf16 autocast would save at ``batch_size``: a second trial (``None`` if it fails)."""
    try:
        bf16 = session.with_amp(torch.bfloat16).run(batch_size).allocated
    except Exception as exc:  # advice must never break the estimate
        log.debug("bf16 comparison failed: %s", exc)
        return None
    return max(0, session.cache[batch_size].allocated - bf16)
