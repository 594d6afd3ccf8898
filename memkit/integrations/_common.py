"""What the framework callbacks share: the optional import, report files, logged numbers."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memkit.devices import get_backend, parse_device
from memkit.errors import ConfigError, MissingDependencyError
from memkit.optimizers import unwrap_optimizer
from memkit.tracking.options import check_flag, check_track_options
from memkit.tracking.outputs import check_writable, rank_path
from memkit.tracking.tracker import DEFAULT_TIMELINE_LIMIT, Tracker
from memkit.units import parse_budget

if TYPE_CHECKING:
    import torch

    from memkit.advice.form import Advice
    from memkit.tracking.report import StepRecord, TrackReport
    from memkit.tracking.tracker import Tracker

__all__ = [
    "MIB",
    "ReportFiles",
    "TrackingCallback",
    "missing",
    "step_metrics",
    "unwrap_optimizer",
]

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


def _check_options(device: Any, budget: int | str | None) -> None:
    """A bad ``device`` or ``budget`` is a ConfigError naming the option when the callback is
    made, not a traceback when training starts: an unknown or absent device, meta (a training
    run's tensors are on cpu or a GPU: it would count nothing), a size that is not one."""
    if budget is not None:
        parse_budget(budget)
    if device is None:
        return
    try:
        parsed = parse_device(device, meta=False)
        if parsed is not None and parsed.type == "meta":
            raise ConfigError(
                "a training run's tensors are on cpu or a GPU, so meta would count nothing; "
                "use 'cpu' for memkit's simulated device"
            )
        get_backend(parsed)  # a GPU this machine does not have
    except ConfigError as exc:
        raise ConfigError(f"device={device!r}: {exc}") from None


class TrackingCallback:
    """What both framework callbacks hold: the tracking options, the live tracker, the last
    report and the files it was written to. Mixed in before the framework's callback class.

    Args:
        device: the device to track; ``None``: the model's (``cpu`` means memkit's simulated
            device).
        budget: the simulated device's size (``"512MiB"``), or a cap on a real GPU.
        per_module: module detail (default), or hooks on the model only.
        module_every: module hooks on steps 0, 1 and every ``module_every``-th step (default:
            100 on a GPU, every step on the simulated device); ``1``: every step.
        log_peaks: add memkit's peaks (MiB) to the framework's logs.
        text, json, html: files the report is written to at the end (after an OOM too);
            under a distributed run each rank writes ``NAME.rankN.EXT``.
        postmortem: ``"stderr"`` prints the OOM post-mortem there; ``None`` only logs it.
        timeline_limit: counter readings kept.

    Raises:
        ConfigError: a bad option, or a report file that cannot be written (checked now).
    """

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        budget: int | str | None = None,
        per_module: bool = True,
        module_every: int | None = None,
        log_peaks: bool = True,
        text: str | Path | None = None,
        json: str | Path | None = None,
        html: str | Path | None = None,
        postmortem: str | None = "stderr",
        timeline_limit: int | None = None,
    ) -> None:
        super().__init__()
        if timeline_limit is None:
            timeline_limit = DEFAULT_TIMELINE_LIMIT
        # the tracker's own checks, now rather than when the framework starts training
        check_track_options(
            per_module=per_module,
            module_every=module_every,
            timeline_limit=timeline_limit,
            postmortem=postmortem,
        )
        check_flag("log_peaks", log_peaks)
        _check_options(device, budget)
        self.device = device
        self.budget = budget
        self.per_module = per_module
        self.module_every = module_every
        self.log_peaks = log_peaks
        self.files = ReportFiles.checked(text, json, html)
        self.postmortem = postmortem
        self.timeline_limit = timeline_limit
        self.written: list[Path] = []
        self._tracker: Tracker | None = None
        self._report: TrackReport | None = None

    @property
    def report(self) -> TrackReport | None:
        """The last run's report (``None`` before one ended); while it runs, use
        ``callback.tracker.report()``."""
        return self._report

    @property
    def tracker(self) -> Tracker | None:
        """The live tracker while a run is tracked."""
        return self._tracker

    def _new_tracker(
        self,
        model: Any,
        optimizers: Any,
        device: Any,
        *,
        accumulation_steps: int | None = None,
        checkpointing: bool | None = None,
    ) -> Tracker:
        """A tracker with this callback's options and the trainer's settings
        (:meth:`Tracker.trainer_settings`), entered."""
        tracker = Tracker(
            model,
            optimizers,
            device=device,
            budget=self.budget,
            per_module=self.per_module,
            module_every=self.module_every,
            postmortem=None,  # printed by _final_report, in the framework's terms
            timeline_limit=self.timeline_limit,
        )
        tracker.trainer_settings(accumulation_steps=accumulation_steps, checkpointing=checkpointing)
        tracker.__enter__()
        return tracker

    def _in_terms(self, advice: Iterable[Advice]) -> tuple[Advice, ...]:
        """``advice`` said in the framework's terms (each callback says how)."""
        return tuple(advice)

    def _final_report(self, tracker: Tracker) -> TrackReport:
        """The ended tracker's report with its advice, and the post-mortem's, in the
        framework's terms; the post-mortem printed to stderr if asked."""
        report = tracker.report().in_terms(self._in_terms)
        oom = report.oom
        if oom is not None and self.postmortem == "stderr":
            sys.stderr.write(str(oom) + "\n")
            sys.stderr.flush()
        return report

    def _end_tracking(self, exc: BaseException | None) -> Tracker | None:
        """Exit the live tracker (with the exception that ended the run, for its
        post-mortem); returns it, or ``None`` when nothing was tracked."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(
                None if exc is None else type(exc), exc, None if exc is None else exc.__traceback__
            )
        return tracker


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
