"""Advice: recommendations that fire on measured evidence and say what to do.

Each :class:`Advice` has a stable ``code`` (tests and users match on it; docs/advice.md has one
section per code), the ``evidence`` with the measured numbers (device, bytes, ratios), a concrete
``action`` (a code line, an environment variable, a flag) and, where it can be computed, the
expected ``saving_bytes``. Rules live next to the results they read; this module holds the form
and the renderings shared by probe, track, run and snapshot reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memkit.render import html as h
from memkit.units import format_size

__all__ = ["SEVERITIES", "Advice", "advice_html", "advice_text"]

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Advice:
    """One recommendation.

    Attributes:
        code: stable identifier, e.g. ``"accumulate"``, ``"dp-to-ddp"``.
        title: one line.
        evidence: what was measured, with numbers.
        action: what to do, concretely.
        saving_bytes: expected memory saved, if it can be estimated.
        severity: ``"info"``, ``"warning"`` or ``"critical"``.
    """

    code: str
    title: str
    evidence: str
    action: str
    saving_bytes: int | None = None
    severity: str = "info"

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, found {self.severity!r}")

    @property
    def detail(self) -> str:
        """Evidence, action and saving in one paragraph."""
        saving = (
            f" Expected saving: {format_size(self.saving_bytes)}."
            if self.saving_bytes is not None
            else ""
        )
        return f"{self.evidence} {self.action}{saving}".strip()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field plus ``detail``."""
        return {**asdict(self), "detail": self.detail}

    def __str__(self) -> str:
        return f"[{self.code}] {self.title}\n    {self.evidence}\n    -> {self.action}" + (
            f"\n    saving: ~{format_size(self.saving_bytes)}"
            if self.saving_bytes is not None
            else ""
        )


def advice_text(advice: Iterable[Advice]) -> str:
    """Advice as indented text, most severe first; empty string when there is none."""
    items = sorted(advice, key=lambda a: -SEVERITIES.index(a.severity))
    return "\n".join(str(a) for a in items)


def advice_html(advice: Sequence[Advice]) -> str:
    """Advice as an HTML table (code, title, evidence, action, saving)."""
    if not advice:
        return '<p class="note">No advice: nothing measured calls for a change.</p>'
    rows = [[a.code, a.title, a.evidence, a.action, format_size(a.saving_bytes)] for a in advice]
    return h.table(["code", "advice", "evidence", "action", "saving"], rows)
