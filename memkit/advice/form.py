"""The form of advice: :class:`Advice`, its severities, and the thresholds the rules share.

Each :class:`Advice` has a stable ``code`` (tests and users match on it; docs/advice.md has one
section per code), the ``evidence`` with the measured numbers (device, bytes, ratios), a concrete
``action`` (a code line, an environment variable, a flag) and, where it can be computed, the
expected ``saving_bytes``. Its text and HTML layout is in :mod:`memkit.render.advice`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memkit.render.advice import advice_block
from memkit.results import Record
from memkit.units import format_size

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "MATERIAL",
    "PRESSURE",
    "SEVERITIES",
    "Advice",
    "MiB",
    "Phrasing",
    "autocast_setting",
    "in_terms",
    "matters",
    "percent_of",
    "under_pressure",
    "with_settings",
]

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Advice(Record):
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

    @property
    def rank(self) -> int:
        """The severity's place in :data:`SEVERITIES` (0 for ``"info"``): higher is worse."""
        return SEVERITIES.index(self.severity)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["detail"] = self.detail
        return out

    def __str__(self) -> str:
        return advice_block(self)


MiB = 1024**2

PRESSURE = 0.5
"""Trade-off rules (activation checkpointing costs recompute, a lighter optimizer changes
training) fire only when the peak reached this share of the device's capacity, or capacity is
unknown: advice to save memory when memory is not short is noise."""

CUDA_CONTEXT_BYTES = 512 * MiB
"""A CUDA context's size, roughly (300-600 MiB depending on the GPU and the CUDA version)."""


def percent_of(part: float, whole: float) -> str:
    """``part`` as a whole percentage of ``whole`` (``"-"`` when ``whole`` is zero)."""
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def under_pressure(peak: int, capacity: int | None, pressure: float = PRESSURE) -> bool:
    """Whether ``peak`` reached ``pressure`` of ``capacity`` (or capacity is unknown)."""
    return capacity is None or capacity <= 0 or peak >= pressure * capacity


MATERIAL = 0.05
"""A saving matters (:func:`matters`) when it is at least this share of the device's
capacity, even while memory is not short."""


def matters(saving: int | None, peak: int, capacity: int | None) -> bool:
    """Whether a saving earns advice: memory is short (:func:`under_pressure`), or the saving
    is at least :data:`MATERIAL` of the capacity (capacity unknown: it does). A 494 B saving
    on a 1 KiB peak of a 1 MiB device does not."""
    if capacity is None or capacity <= 0 or under_pressure(peak, capacity):
        return True
    return saving is not None and saving >= MATERIAL * capacity


Phrasing = Callable[[Advice], str]
"""An advice's action said in a framework's terms (memkit.advice.lightning, .transformers)."""


def in_terms(advice: Iterable[Advice], actions: Mapping[str, Phrasing]) -> tuple[Advice, ...]:
    """``advice`` with the action of each code in ``actions`` said as it says it; the rest as
    it was (the evidence and the saving never change)."""
    return tuple(
        dataclasses.replace(a, action=actions[a.code](a)) if a.code in actions else a
        for a in advice
    )


def autocast_setting(setting: Callable[[bool], str], runner: str, fp16_name: str) -> Phrasing:
    """A ``mixed-precision`` phrasing naming a framework's setting: ``setting(fp16)`` (fp16 when
    the advice chose it: the device has no bf16), what ``runner`` then does, and that with
    ``fp16_name`` it also scales the loss."""

    def phrase(advice: Advice) -> str:
        fp16 = "torch.float16" in advice.action
        return (
            f"{setting(fp16)}: {runner} runs the forward and the loss under autocast (weights "
            "and the optimizer stay fp32)"
            + (f"; with {fp16_name} it also scales the loss." if fp16 else ".")
        )

    return phrase


def with_settings(lead: str, settings: Sequence[tuple[str, str]], sep: str = ", ") -> Phrasing:
    """A phrasing that keeps the action and adds, after ``lead``, the framework's settings
    for the remedies it names (``settings``: a word of the action, the setting)."""

    def phrase(advice: Advice) -> str:
        found = [setting for word, setting in settings if word in advice.action]
        return advice.action + (f" {lead}: {sep.join(found)}." if found else "")

    return phrase
