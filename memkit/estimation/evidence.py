"""The evidence an estimate's advice needs, handed to :mod:`memkit.advice.estimate`: the
search's outcome, the reserved peak at the breakdown's batch, and (when the rule asks) a bf16
re-run of that batch."""

from __future__ import annotations

import dataclasses
import logging

import torch

from memkit.advice import Advice
from memkit.advice.estimate import estimate_advice
from memkit.estimation.families import TargetCard
from memkit.estimation.meta_step import MetaSession, run_guarded
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
        need_bytes=need_bytes(session, focus),
        bf16_saving=lambda: bf16_saving(session, focus),
        units=unit_sizes(session.model),
        trainable_bytes=sum(
            p.numel() * p.element_size() for p in session.model.parameters() if p.requires_grad
        ),
    )


def need_bytes(session: MetaSession, batch_size: int) -> int:
    """The reserved peak ``batch_size``'s step needs: its trial's, or, where the allocator
    model ran out of the usable memory (its peaks are where it failed), a trial with no limit."""
    peaks = session.cache[batch_size]
    if peaks.ooms == 0:
        return peaks.reserved
    unlimited = dataclasses.replace(session, usable=1 << 62, cache={})
    return run_guarded(lambda: unlimited.run(batch_size), batch_size, session.plan.mode).reserved


def bf16_saving(session: MetaSession, batch_size: int) -> int | None:
    """What bf16 autocast would save at ``batch_size``: a second trial (``None`` if it fails)."""
    try:
        bf16 = session.with_amp(torch.bfloat16).run(batch_size).allocated
    except Exception as exc:  # advice must never break the estimate
        log.debug("bf16 comparison failed: %s", exc)
        return None
    return max(0, session.cache[batch_size].allocated - bf16)
