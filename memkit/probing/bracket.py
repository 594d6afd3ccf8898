"""The loop every batch-size search shares: run a size, keep the bracket.

:class:`Bracket` runs the oracle (:data:`Oracle`) at the size a strategy proposes, clamped
strictly inside the bracket (the largest size known to fit, the smallest known to fail), and
records each :class:`Trial`. :func:`plain_next` is the plain strategy (doubling, then
bisection); :mod:`memkit.probing.aiming` is the model-guided one; :mod:`memkit.probing.search`
puts them together. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from memkit.results import Record

__all__ = ["NO_LIMIT", "Bracket", "Oracle", "Trial", "plain_next", "run_strategy", "wide_low"]

Oracle = Callable[
    [int],
    "tuple[bool, int | None] | tuple[bool, int | None, tuple[int, ...] | None]"
    " | tuple[bool, int | None, tuple[int, ...] | None, int | None]",
]
"""Runs one trial at a batch size and returns ``(fits, peak_bytes)``, or
``(fits, peak_bytes, part_peaks)`` (``part_peaks`` ``None`` or empty when unknown), or
``(fits, peak_bytes, part_peaks, aim_bytes)``.

``peak_bytes`` is the measured peak when it fit; when it did not, the bytes known to be needed
at least (in use plus the allocation that failed), or ``None`` when unknown. ``part_peaks``,
when the oracle can tell, are the peaks of the parts of a step whose maximum is the peak (for
``memkit.probe``: cut at module forwards, module gradients and the optimizer step; see
:class:`memkit.probing.trials.PartPeaks`): each part is fitted with its own line, so that a flat
part (the optimizer step's) cannot hide the slope of a growing one.

``aim_bytes``, when given, is a smoother measure of the same peak to aim with (on CUDA the
allocated peak: the reserved peak that decides the fit moves in allocator segments of 2 and 20
MiB, so its secants jump; the allocated peak grows smoothly). ``part_peaks`` are then in the
same measure as ``aim_bytes``. The search aims where the smooth measure plus the gap measured
at the largest fit (``peak_bytes - aim_bytes``) reaches the capacity; the fit itself is always
``fits``.
"""

NO_LIMIT = 1 << 40
"""The upper bound when ``max_batch`` is None."""


@dataclasses.dataclass(frozen=True)
class Trial(Record):
    """One run of the oracle.

    Attributes:
        batch_size: the size that was run.
        fits: whether it fit.
        peak_bytes: the measured peak when it fit; for a failure, the bytes known to be needed
            at least (in use plus the allocation that failed), or ``None`` when unknown.
        seconds: wall time of the oracle call.
        part_peaks: the peaks of the step's parts when the oracle reported them (see
            :data:`Oracle`), else ``None``.
        aim_bytes: the smooth measure of the peak the search aims with (see :data:`Oracle`);
            ``None`` when the oracle gave none (``peak_bytes`` is used).
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    part_peaks: tuple[int, ...] | None = None
    aim_bytes: int | None = None

    _JSON_SKIP: ClassVar[tuple[str, ...]] = ("part_peaks", "aim_bytes")

    @property
    def smooth_bytes(self) -> int | None:
        """The peak the search aims with: ``aim_bytes``, else ``peak_bytes``."""
        return self.peak_bytes if self.aim_bytes is None else self.aim_bytes


class Bracket:
    """Runs trials and keeps the bracket; a strategy only proposes the next size. ``known``:
    trials run before that still hold (a search resumed), the bracket's start."""

    def __init__(
        self,
        fits: Oracle,
        *,
        min_batch: int,
        max_batch: int,
        clock: Callable[[], float],
        on_trial: Callable[[Trial], None] | None,
        known: Sequence[Trial] = (),
    ) -> None:
        self.fits = fits
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.clock = clock
        self.on_trial = on_trial
        self.trials: list[Trial] = list(known)
        # the largest size run that fit, the smallest that failed
        self.lo: int | None = max((t.batch_size for t in known if t.fits), default=None)
        self.hi: int | None = min((t.batch_size for t in known if not t.fits), default=None)

    def done(self) -> bool:
        if self.lo is None:
            return self.hi == self.min_batch
        return self.lo == self.max_batch or self.hi == self.lo + 1

    def run(self, batch_size: int) -> None:
        # The strategy proposes; the bracket disposes: only a size strictly inside it is run.
        low = self.min_batch if self.lo is None else self.lo + 1
        high = self.max_batch if self.hi is None else self.hi - 1
        batch_size = min(max(batch_size, low), high)
        start = self.clock()
        ok, peak, *extra = self.fits(batch_size)
        seconds = self.clock() - start
        parts: Any = extra[0] if extra else None
        part_peaks = tuple(int(p) for p in parts) if parts else None
        aim: Any = extra[1] if len(extra) > 1 else None
        aim = None if aim is None else int(aim)
        trial = Trial(
            batch_size, bool(ok), None if peak is None else int(peak), seconds, part_peaks,
            aim if ok else None,
        )  # fmt: skip
        self.trials.append(trial)
        if trial.fits:
            self.lo = batch_size
        else:
            self.hi = batch_size
        if self.on_trial is not None:
            self.on_trial(trial)

    def fitting_points(self) -> list[tuple[int, int]]:
        """``(batch_size, peak_bytes)`` of the sizes that fit with a measured peak, by size."""
        return sorted(
            (t.batch_size, t.peak_bytes) for t in self.trials if t.fits and t.peak_bytes is not None
        )

    def aim_points(self) -> list[tuple[int, int]]:
        """``(batch_size, smooth_bytes)`` of the sizes that fit, by size (see :data:`Oracle`)."""
        return sorted(
            (t.batch_size, t.smooth_bytes)
            for t in self.trials
            if t.fits and t.smooth_bytes is not None
        )

    def gap(self) -> int:
        """What the peak that decides the fit held above the smooth one at the largest size
        that fit (the allocator's rounding and cached blocks on CUDA; 0 without ``aim_bytes``)."""
        fitting = [t for t in self.trials if t.fits and t.peak_bytes is not None]
        if not fitting:
            return 0
        top = max(fitting, key=lambda t: t.batch_size)
        smooth = top.smooth_bytes
        if top.peak_bytes is None or smooth is None:  # pragma: no cover - filtered above
            return 0
        return max(0, top.peak_bytes - smooth)

    def gap_slope(self) -> float:
        """How much the gap grows a sample: from the gap at :func:`wide_low`'s fit to the
        largest fit's (the allocator's rounding moves each by up to a step, which a wide span
        spreads thin); 0 without a smooth measure, or where the gap shrinks. On a real GPU the
        cached blocks that a larger step cannot reuse grow with the batch: GPT-2's gap was
        0.31 GB at 256 samples and 0.68 GB at 567 on the H200."""
        gaps = sorted(
            (t.batch_size, t.peak_bytes - t.smooth_bytes)
            for t in self.trials
            if t.fits and t.peak_bytes is not None and t.smooth_bytes is not None
        )
        if len(gaps) < 2:
            return 0.0
        top, gap = gaps[-1]
        b0, g0 = wide_low(gaps)
        return max(0.0, (gap - g0) / (top - b0))

    def part_points(self) -> list[list[tuple[int, int]]]:
        """One ``(batch_size, peak)`` list per part of the step when every size that fit
        reported the same parts; else the whole (smooth) peaks' list alone. Each peak is
        raised by the gap's growth from its size to the largest fit's (:meth:`gap_slope`), so
        that a line through them, less the largest fit's :meth:`gap`, crosses the capacity
        where the peak that decides the fit would."""
        fitting = sorted(
            (t for t in self.trials if t.fits and t.peak_bytes is not None),
            key=lambda t: t.batch_size,
        )
        shapes = {None if t.part_peaks is None else len(t.part_peaks) for t in fitting}
        if len(shapes) != 1 or None in shapes:
            series = [self.aim_points()]
        else:
            parts = fitting[0].part_peaks
            assert parts is not None
            series = [
                [(t.batch_size, t.part_peaks[i]) for t in fitting if t.part_peaks is not None]
                for i in range(len(parts))
            ]
        slope = self.gap_slope()
        if slope == 0 or not fitting:
            return series
        top = fitting[-1].batch_size
        return [[(b, p + round(slope * (b - top))) for b, p in points] for points in series]


def wide_low(points: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The point a wide span to the largest of ``points`` (by size) starts from: the largest
    at most half the largest's size, else the smallest. Over such a span the allocator's 2 and
    20 MiB steps and a kink between two recorded sizes barely move a slope."""
    top = points[-1][0]
    return ([p for p in points[:-1] if p[0] <= top / 2] or list(points[:1]))[-1]


def plain_next(s: Bracket) -> int:
    """Doubling until a failure, then bisection (bisecting down when ``start`` failed)."""
    if s.lo is None:
        assert s.hi is not None
        return (s.min_batch - 1 + s.hi) // 2
    if s.hi is None:
        return 2 * s.lo
    return (s.lo + s.hi) // 2


def run_strategy(s: Bracket, start: int, strategy: Callable[[Bracket], int]) -> None:
    if not s.done():
        s.run(start)
    while not s.done():
        s.run(strategy(s))
