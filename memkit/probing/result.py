"""What a probe found: frozen results that render as text, JSON and HTML.

Data only; the text and HTML layout is :mod:`memkit.render.probe`, the shared methods
(``to_dict``, ``to_json``, ``to_html``...) :class:`memkit.results.Result`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from memkit.advice import Advice
from memkit.render import probe as layout
from memkit.results import Record, Result, memory_model_json

__all__ = ["ProbeModes", "ProbeResult", "ProbeSweep", "ProbeTrial"]


@dataclass(frozen=True)
class ProbeTrial(Record):
    """One batch size that was run.

    Attributes:
        batch_size: the size run.
        fits: it ran ``steps`` full steps without running out of memory (and within capacity).
        peak_bytes: the peak that decides the fit (reserved bytes on a GPU, counted bytes on the
            simulated device); for a failure, bytes known to be needed at least, if known.
        peak_allocated_bytes: peak allocated by tensors (equal to ``peak_bytes`` when simulated).
        seconds: wall time of the trial.
        error: the OOM message's first line, for a failure.
        rank_peaks: across ranks, each rank's own peak (for a rank that failed: the bytes it
            knew it needed; ``None`` when unknown or when it stopped because another rank
            failed). ``peak_bytes`` is then the tightest rank's, on the scale of the smallest
            capacity (see :mod:`memkit.probing.ranks`). Empty in a single process.
        steps_run: the steps the trial ran (more than the probe's ``steps`` while the memory
            kept between steps grew); ``None`` for a failure.
        kept_growth_bytes: what was kept after the last step beyond what was kept after the
            first (an optimizer's history filling up); ``None`` when nothing grew.
        optimizer_growth_bytes: of that, what the optimizer's state added.
        still_growing: the last step still added to what is kept (the trial stopped at
            ``memkit.probing.trials.MAX_STEPS``): the fit holds for ``steps_run`` steps.
        superseded: it fit over fewer steps than a later trial showed the step's cycle needs
            (a step whose work varies from call to call, :mod:`memkit.probing.schedule`): the
            fit does not count, and the size may have been run again.
        part_peaks: the allocated peaks of the step's parts the search aimed with
            (:class:`memkit.probing.trials.PartPeaks`), for a fit; kept in the JSON so that a
            recorded probe replays as it ran (``benchmarks/search_trials.py --recorded``).
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    peak_allocated_bytes: int | None = None
    error: str | None = None
    rank_peaks: tuple[int | None, ...] = ()
    steps_run: int | None = None
    kept_growth_bytes: int | None = None
    optimizer_growth_bytes: int | None = None
    still_growing: bool = False
    superseded: bool = False
    part_peaks: tuple[int, ...] = ()

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["seconds"] = round(self.seconds, 6)
        for key in (
            "rank_peaks",
            "kept_growth_bytes",
            "optimizer_growth_bytes",
            "still_growing",
            "superseded",
            "part_peaks",
        ):
            if not out[key]:
                del out[key]
        if out["steps_run"] is None:
            del out["steps_run"]
        return out


@dataclass(frozen=True)
class ProbeResult(Result):
    """The largest batch that fits, how it was found, and what to do with it.

    Across ranks (a process group): ``world_size`` ranks ran every trial together; a size fits
    only if it fit on every rank. ``per_rank_peaks`` are each rank's peaks at
    ``max_batch_size``, ``per_rank_capacities`` each rank's capacity, and ``capacity_bytes`` the
    smallest of them (the search aims at the tightest rank). ``ddp``: the model ran wrapped in
    ``DistributedDataParallel``. ``trials_without_accumulation``: where the answer is for the
    accumulating step ``--target-batch`` advised, the first search's trials (a step that frees
    its gradients before every forward); ``trials`` are the accumulating step's.
    """

    SCHEMA: ClassVar[str] = "memkit.ProbeResult/1"
    HTML_TITLE: ClassVar[str] = "memkit probe"

    max_batch_size: int | None
    recommended_batch_size: int | None
    trials: tuple[ProbeTrial, ...]
    device: str
    device_name: str
    accounting: str
    capacity_bytes: int | None
    mode: str
    steps: int
    margin: float
    min_batch: int
    max_batch: int | None
    hit_max_batch: bool = False
    seq_len: int | None = None
    fixed_bytes: float | None = None
    per_sample_bytes: float | None = None
    per_pair_bytes: float | None = None
    defaults: tuple[str, ...] = ()
    advice: tuple[Advice, ...] = ()
    world_size: int = 1
    per_rank_peaks: tuple[int | None, ...] = field(default=())
    per_rank_capacities: tuple[int | None, ...] = field(default=())
    ddp: bool = False
    trials_without_accumulation: tuple[ProbeTrial, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether at least ``min_batch`` fits."""
        return self.max_batch_size is not None

    @property
    def tightest_rank(self) -> int | None:
        """The rank with the least room left at ``max_batch_size`` (the first to run out)."""
        rooms = [
            (cap - peak, r)
            for r, (peak, cap) in enumerate(
                zip(self.per_rank_peaks, self.per_rank_capacities, strict=False)
            )
            if peak is not None and cap is not None
        ]
        return min(rooms)[1] if rooms else None

    def trial(self, batch_size: int) -> ProbeTrial | None:
        """The trial run at ``batch_size``, if any (the last one, where a size that fit before
        the step's cycle was seen was run again)."""
        return next((t for t in reversed(self.trials) if t.batch_size == batch_size), None)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """The ``--json`` output: the line's two numbers as ``memory_model``; the per-rank
        capacities, the tightest rank and ``ddp`` only across ranks or under DDP."""
        memory_model_json(out)
        if self.world_size > 1 or self.ddp:
            out["tightest_rank"] = self.tightest_rank
        else:
            del out["per_rank_capacities"], out["ddp"]
        if not out["trials_without_accumulation"]:
            del out["trials_without_accumulation"]
        return out

    def __str__(self) -> str:
        return layout.probe_text(self)

    def __repr__(self) -> str:
        return (
            f"ProbeResult(max_batch_size={self.max_batch_size}, "
            f"recommended_batch_size={self.recommended_batch_size}, device={self.device!r}, "
            f"mode={self.mode!r}, trials={len(self.trials)})"
        )

    def html_body(self) -> str:
        return layout.probe_html_body(self)


@dataclass(frozen=True)
class ProbeSweep(Result):
    """One probe per sequence length (``--seq-len 128,512,2048``)."""

    SCHEMA: ClassVar[str] = "memkit.ProbeSweep/1"
    HTML_TITLE: ClassVar[str] = "memkit probe"

    results: tuple[ProbeResult, ...]

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        return {"seq_lens": out["results"]}

    def __str__(self) -> str:
        return layout.sweep_text(self)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{r.seq_len}: {r.max_batch_size}" for r in self.results)
        return f"ProbeSweep({{{pairs}}})"

    def html_body(self) -> str:
        return layout.sweep_html_body(self)


@dataclass(frozen=True)
class ProbeModes(Result):
    """Training and evaluation probed in one run (``--mode train,infer``): evaluation keeps no
    activations for backward and no optimizer state, so its largest batch is usually larger."""

    SCHEMA: ClassVar[str] = "memkit.ProbeModes/1"
    HTML_TITLE: ClassVar[str] = "memkit probe"

    results: tuple[ProbeResult | ProbeSweep, ...]

    @staticmethod
    def _mode(result: ProbeResult | ProbeSweep) -> str:
        return result.mode if isinstance(result, ProbeResult) else result.results[0].mode

    @property
    def largest_batches(self) -> dict[str, int | None]:
        """Each single-length mode's largest batch (a sequence-length sweep has none)."""
        return {r.mode: r.max_batch_size for r in self.results if isinstance(r, ProbeResult)}

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        return {
            "modes": {self._mode(r): d for r, d in zip(self.results, out["results"], strict=True)}
        }

    def __str__(self) -> str:
        return layout.modes_text(self)

    def __repr__(self) -> str:
        """Each mode's largest batch (per sequence length for a sweep)."""
        parts = []
        for r in self.results:
            if isinstance(r, ProbeResult):
                parts.append(f"{r.mode}={r.max_batch_size}")
            else:
                pairs = ", ".join(f"{s.seq_len}: {s.max_batch_size}" for s in r.results)
                parts.append(f"{self._mode(r)}={{{pairs}}}")
        return f"ProbeModes({', '.join(parts)})"

    def html_body(self) -> str:
        return layout.modes_html_body(self)
