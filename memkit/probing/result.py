"""What a probe found: frozen results that render as text, JSON and HTML."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from memkit.advice import Advice, advice_html, advice_text
from memkit.render import html as h
from memkit.render.text import table
from memkit.units import format_size

__all__ = ["ProbeModes", "ProbeResult", "ProbeSweep", "ProbeTrial"]


@dataclass(frozen=True)
class ProbeTrial:
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
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    peak_allocated_bytes: int | None = None
    error: str | None = None
    rank_peaks: tuple[int | None, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_size": self.batch_size,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "seconds": round(self.seconds, 6),
            "error": self.error,
        }
        if self.rank_peaks:
            out["rank_peaks"] = list(self.rank_peaks)
        return out


def _peak_cell(trial: ProbeTrial) -> str:
    """A trial's peak; for a failed one, the lower bound its OOM gave (never a "peak" above
    the capacity that no allocation reached)."""
    if trial.fits or trial.peak_bytes is None:
        return format_size(trial.peak_bytes)
    return f"needs >= {format_size(trial.peak_bytes)}"


@dataclass(frozen=True)
class ProbeResult:
    """The largest batch that fits, how it was found, and what to do with it.

    Across ranks (a process group): ``world_size`` ranks ran every trial together; a size fits
    only if it fit on every rank. ``per_rank_peaks`` are each rank's peaks at
    ``max_batch_size``, ``per_rank_capacities`` each rank's capacity, and ``capacity_bytes`` the
    smallest of them (the search aims at the tightest rank). ``ddp``: the model ran wrapped in
    ``DistributedDataParallel``.
    """

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
    defaults: tuple[str, ...] = ()
    advice: tuple[Advice, ...] = ()
    world_size: int = 1
    per_rank_peaks: tuple[int | None, ...] = field(default=())
    per_rank_capacities: tuple[int | None, ...] = field(default=())
    ddp: bool = False

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

    def _rank_rows(self) -> list[list[object]]:
        rows: list[list[object]] = []
        tight = self.tightest_rank
        for r in range(self.world_size):
            peak = self.per_rank_peaks[r] if r < len(self.per_rank_peaks) else None
            cap = self.per_rank_capacities[r] if r < len(self.per_rank_capacities) else None
            room = None if peak is None or cap is None else cap - peak
            share = "" if peak is None or not cap else f"{peak / cap:.0%}"
            rows.append(
                [
                    r,
                    format_size(cap),
                    format_size(peak),
                    share,
                    format_size(room),
                    "tightest" if r == tight else "",
                ]
            )
        return rows

    _RANK_HEAD = ("rank", "capacity", "peak", "used", "room left", "")

    def trial(self, batch_size: int) -> ProbeTrial | None:
        """The trial run at ``batch_size``, if any."""
        return next((t for t in self.trials if t.batch_size == batch_size), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (the ``--json`` output)."""
        return {
            "max_batch_size": self.max_batch_size,
            "recommended_batch_size": self.recommended_batch_size,
            "device": self.device,
            "device_name": self.device_name,
            "accounting": self.accounting,
            "capacity_bytes": self.capacity_bytes,
            "mode": self.mode,
            "steps": self.steps,
            "margin": self.margin,
            "min_batch": self.min_batch,
            "max_batch": self.max_batch,
            "hit_max_batch": self.hit_max_batch,
            "seq_len": self.seq_len,
            "memory_model": None
            if self.per_sample_bytes is None
            else {"fixed_bytes": self.fixed_bytes, "per_sample_bytes": self.per_sample_bytes},
            "defaults": list(self.defaults),
            "world_size": self.world_size,
            "per_rank_peaks": list(self.per_rank_peaks),
            **(
                {
                    "per_rank_capacities": list(self.per_rank_capacities),
                    "tightest_rank": self.tightest_rank,
                    "ddp": self.ddp,
                }
                if self.world_size > 1 or self.ddp
                else {}
            ),
            "trials": [t.to_dict() for t in self.trials],
            "advice": [a.to_dict() for a in self.advice],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _headline(self) -> str:
        where = f"{self.device_name} [{self.device}]"
        cap = format_size(self.capacity_bytes)
        seq = f", seq_len {self.seq_len}" if self.seq_len is not None else ""
        if self.world_size > 1:
            where = f"{self.world_size} ranks{' (DDP)' if self.ddp else ''}, {where} on rank 0"
            cap = f"{cap} (the smallest rank's)"
        if self.max_batch_size is None:
            return (
                f"Does not fit: batch {self.min_batch} ({self.mode}{seq}) needs more than the "
                f"{cap} of {where}."
            )
        bound = " (the --max-batch limit, not a memory limit)" if self.hit_max_batch else ""
        return (
            f"Largest batch that fits ({self.mode}{seq}) on {where}, capacity {cap}: "
            f"{self.max_batch_size}{bound}; {self._recommended_words()}."
        )

    def _recommended_words(self) -> str:
        """``recommended N (leaves 5% free)``, only where the numbers say so."""
        margin, rec, cap = f"{self.margin:.0%}", self.recommended_batch_size, self.capacity_bytes
        if rec is None:
            return f"no size leaves {margin} free"
        ran = self.trial(rec)
        if ran is not None and ran.peak_bytes is not None and cap:
            free = 1 - ran.peak_bytes / cap
            if free < self.margin:
                return f"no size leaves {margin} free (batch {rec} leaves {free:.1%})"
        return f"recommended {rec} (leaves {margin} free)"

    def _trial_rows(self) -> list[list[object]]:
        return [
            [t.batch_size, "yes" if t.fits else "OOM", _peak_cell(t), f"{t.seconds:.2f}"]
            for t in self.trials
        ]

    def __str__(self) -> str:
        parts = [self._headline(), ""]
        parts.append(table(["batch", "fits", "peak", "seconds"], self._trial_rows(), align="rlrr"))
        if self.world_size > 1 and self.per_rank_peaks:
            parts.append(f"\nper rank at batch {self.max_batch_size} (every rank runs that batch):")
            parts.append(table(list(self._RANK_HEAD), self._rank_rows(), align="rrrrrl"))
        if self.per_sample_bytes is not None:
            parts.append(
                f"\nmemory model: {format_size(self.fixed_bytes)} + "
                f"{format_size(self.per_sample_bytes)} per sample"
            )
        parts.append(f"accounting: {self.accounting}")
        parts.extend(self.defaults)
        text = advice_text(self.advice)
        if text:
            parts += ["", "advice:", text]
        return "\n".join(parts)

    def __repr__(self) -> str:
        return (
            f"ProbeResult(max_batch_size={self.max_batch_size}, "
            f"recommended_batch_size={self.recommended_batch_size}, device={self.device!r}, "
            f"mode={self.mode!r}, trials={len(self.trials)})"
        )

    def _repr_html_(self) -> str:
        rows = self._trial_rows()
        body = (
            f"<h3>memkit probe</h3><p>{h.escape(self._headline())}</p>"
            + h.table(["batch", "fits", "peak", "seconds"], rows)
            + (
                h.table(list(self._RANK_HEAD), self._rank_rows())
                if self.world_size > 1 and self.per_rank_peaks
                else ""
            )
            + f'<p class="note">accounting: {h.escape(self.accounting)}<br>'
            + "<br>".join(h.escape(d) for d in self.defaults)
            + "</p>"
            + advice_html(self.advice)
        )
        return h.fragment(body)


@dataclass(frozen=True)
class ProbeSweep:
    """One probe per sequence length (``--seq-len 128,512,2048``)."""

    results: tuple[ProbeResult, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"seq_lens": [r.to_dict() for r in self.results]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _rows(self) -> list[list[object]]:
        return [
            [
                r.seq_len,
                r.max_batch_size,
                r.recommended_batch_size,
                len(r.trials),
                format_size(max((t.peak_bytes or 0 for t in r.trials if t.fits), default=None)),
            ]
            for r in self.results
        ]

    def __str__(self) -> str:
        first = self.results[0]
        head = (
            f"Largest batch per sequence length ({first.mode}) on {first.device_name} "
            f"[{first.device}], capacity {format_size(first.capacity_bytes)}:"
        )
        body = table(["seq_len", "max batch", "recommended", "trials", "peak"], self._rows())
        advice = advice_text(a for r in self.results for a in r.advice)
        return "\n".join([head, "", body, *(["", "advice:", advice] if advice else [])])

    def __repr__(self) -> str:
        pairs = ", ".join(f"{r.seq_len}: {r.max_batch_size}" for r in self.results)
        return f"ProbeSweep({{{pairs}}})"

    def _repr_html_(self) -> str:
        return h.fragment(
            "<h3>memkit probe: max batch per sequence length</h3>"
            + h.table(["seq_len", "max batch", "recommended", "trials", "peak"], self._rows())
        )


@dataclass(frozen=True)
class ProbeModes:
    """Training and evaluation probed in one run (``--mode train,infer``): evaluation keeps no
    activations for backward and no optimizer state, so its largest batch is usually larger."""

    results: tuple[ProbeResult | ProbeSweep, ...]

    @staticmethod
    def _mode(result: ProbeResult | ProbeSweep) -> str:
        return result.mode if isinstance(result, ProbeResult) else result.results[0].mode

    def to_dict(self) -> dict[str, Any]:
        return {"modes": {self._mode(r): r.to_dict() for r in self.results}}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        heads = [
            f"{self._mode(r)} {r.max_batch_size}"
            for r in self.results
            if isinstance(r, ProbeResult)
        ]
        summary = f"Largest batch per mode: {', '.join(heads)}\n\n" if heads else ""
        return summary + "\n\n".join(str(r) for r in self.results)

    def __repr__(self) -> str:
        return f"ProbeModes({', '.join(repr(r) for r in self.results)})"

    def _repr_html_(self) -> str:
        return "".join(r._repr_html_() for r in self.results)
