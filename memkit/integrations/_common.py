"""What the framework callbacks share: the optional import, report files, logged numbers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memkit.errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:
    from memkit.tracking.report import StepRecord, TrackReport

__all__ = ["MIB", "ReportFiles", "check_postmortem", "missing", "step_metrics", "unwrap_optimizer"]

log = logging.getLogger(__name__)

MIB = float(1 << 20)
"""Logged peaks are in MiB (the report keeps exact bytes)."""

LOGGED_PHASES = ("forward", "backward", "optimizer")


def missing(extra: str, what: str, needs: str, exc: ImportError) -> MissingDependencyError:
    """The error for an optional framework that is not installed: which extra installs it."""
    return MissingDependencyError(
        f"{what} needs {needs}, which is not installed ({exc}); install it with "
        f"`pip install memkit[{extra}]`"
    )


def check_postmortem(postmortem: str | None) -> None:
    if postmortem not in ("stderr", None):
        raise ConfigError(f"postmortem must be 'stderr' or None, found {postmortem!r}")


@dataclass(frozen=True)
class ReportFiles:
    """Where a callback writes the report when training ends (``None``: not written).

    Under a distributed run each rank writes its own files, ``report.rank1.json``.
    """

    text: Path | None = None
    json: Path | None = None
    html: Path | None = None

    @classmethod
    def checked(
        cls, text: str | Path | None, json: str | Path | None, html: str | Path | None
    ) -> ReportFiles:
        """Check, before training starts, that each file can be written.

        Raises:
            ConfigError: a folder is missing or not writable; the message says what to do.
        """
        from memkit.tracking.run import check_writable

        paths: dict[str, Path | None] = {}
        for name, value in (("text", text), ("json", json), ("html", html)):
            if value is not None and not isinstance(value, (str, Path)):
                raise ConfigError(
                    f"{name}= expected a file path (str or pathlib.Path), found "
                    f"{type(value).__name__}"
                )
            if value is not None:
                check_writable(value, f"{name}=")
            paths[name] = None if value is None else Path(value)
        return cls(paths["text"], paths["json"], paths["html"])

    def write(self, report: TrackReport) -> list[Path]:
        """Write the report's files; returns the paths written (with the rank in the name
        under a distributed run). A file that cannot be written is logged, not raised: the
        training it reports on has finished."""
        from memkit.tracking.run import rank_path

        written = []
        for path, render in (
            (self.text, lambda p: p.write_text(str(report) + "\n", encoding="utf-8")),
            (self.json, report.to_json),
            (self.html, report.to_html),
        ):
            if path is None:
                continue
            target = rank_path(path)
            try:
                render(target)
            except OSError as exc:
                log.error("memkit: could not write the report to %s: %s", target, exc)
                continue
            written.append(target)
        return written


def step_metrics(records: Sequence[StepRecord]) -> dict[str, float]:
    """The highest step peak and phase peaks over ``records``, in MiB, named as the callbacks
    log them: ``memkit/peak_mib``, ``memkit/forward_peak_mib``... (empty without records)."""
    if not records:
        return {}
    out = {"memkit/peak_mib": max(r.peak_allocated for r in records) / MIB}
    for phase in LOGGED_PHASES:
        values = [v for r in records if (v := r.phase_peaks.get(phase)) is not None]
        if values:
            out[f"memkit/{phase}_peak_mib"] = max(values) / MIB
    return out


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``), or ``optimizer`` itself."""
    import torch

    seen = 0
    while seen < 8 and not _is_plain(optimizer, torch):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _is_plain(optimizer: Any, torch: Any) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer")
