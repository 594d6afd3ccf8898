"""Advice as text (most severe first, one indented block each) and as an HTML table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from memkit.render import html as h
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.advice.form import Advice

__all__ = ["advice_block", "advice_html", "advice_text"]


def advice_block(advice: Advice) -> str:
    """One advice: ``[code] title``, then its evidence, action and saving indented."""
    return f"[{advice.code}] {advice.title}\n    {advice.evidence}\n    -> {advice.action}" + (
        f"\n    saving: ~{format_size(advice.saving_bytes)}"
        if advice.saving_bytes is not None
        else ""
    )


def advice_text(advice: Iterable[Advice]) -> str:
    """Advice as indented text, most severe first; empty string when there is none."""
    items = sorted(advice, key=lambda a: -a.rank)
    return "\n".join(str(a) for a in items)


def advice_html(advice: Sequence[Advice]) -> str:
    """Advice as an HTML table (code, title, evidence, action, saving)."""
    if not advice:
        return '<p class="note">No advice: nothing measured calls for a change.</p>'
    rows = [[a.code, a.title, a.evidence, a.action, format_size(a.saving_bytes)] for a in advice]
    return h.table(["code", "advice", "evidence", "action", "saving"], rows)
