"""Batch-size search: the largest batch that fits, exact and verified, in few trials.

This module is the search only (the loop in :mod:`memkit.probing.bracket`, the model-guided
strategy in :mod:`memkit.probing.aiming`): a pure function of an oracle
``fits(batch_size) -> (fits, peak_bytes)`` that runs one trial. Building the batch, catching the
out-of-memory error and recovering from it are the caller's business (``memkit.probe``).
Nothing here imports torch.

Guarantees of :func:`search_max_batch` (and of the reference :func:`doubling_bisection`):

* **Exact.** The reported ``max_batch_size`` B was run and fit, and B + 1 was run and did not
  fit, or B is ``max_batch`` (run, and it fit). A size that was not run is never reported.
* **No waste.** No size is run twice and no size outside ``[min_batch, max_batch]`` is run:
  every trial lies strictly inside the bracket (largest size known to fit, smallest known to
  fail), so an outcome that is already implied is never paid for.
* **Fast.** Each trial's measured peak is used. Training memory is close to linear in the batch
  size once activations dominate; below that the peak is set by something that barely grows
  (the optimizer step: parameters, gradients, Adam's moments, foreach temporaries), so real
  curves look like ``max(flat, fixed + per_sample * batch)``: convex. The search

  1. runs ``start`` (``min_batch`` by default) and grows by ``aiming.GROWTH`` (2x, as
     doubling would) while it has no line to aim with;
  2. predicts the limit where the secant of the two largest sizes that fit crosses the
     capacity. The line is *trusted* when the pair below has the same slope (within
     ``aiming.SLOPE_TOLERANCE``: three collinear points, i.e. past the flat part). Where the
     four largest fits bend alike (each triple's middle point below its chord by more than
     ``aiming.BEND_QUANTA`` of the peaks' rounding, the two curvatures within
     ``aiming.CURVATURE_TOLERANCE``), the prediction is where the parabola through the last
     three crosses the capacity, trusted: a secant of a convex curve overshoots, and a memory
     term in B x B (a contrastive loss's similarity matrix, CLIP or SimCLR; attention across
     the batch) bends the curve exactly so; a kink between two lines (a flat part, then
     activations), rounding and noise do not bend four points alike. A trusted prediction is
     run directly (at most ``aiming.TRUSTED_GROWTH`` times the largest fit); an untrusted
     one, which on a convex curve overshoots, is approached halfway. When the model keeps
     predicting "just above" and is wrong (noise, rounding), or right after it said so
     has no line (the last two peaks level, rounded alike), the steps gallop (2, 4, 8, ...
     sizes);
  3. once a size has failed, the prediction is run inside the bracket (an untrusted one only
     when the last secant is at least as steep as the whole curve, as a convex curve's is),
     once per new point: an aim that failed is followed by a bisection, not a second aim with
     the same line, and so is any trial that did not halve the bracket. A line refuted by the
     failure, one that says the smallest failed size plus one would fit, is not aimed with
     but bisected: points from a flat part keep predicting far past the limit, and aiming
     with them would creep down from the failure one size a trial; so is one that says the
     failed size itself fits where that failure needed more than a sample's worth beyond
     the capacity (a linear part's line, where a part bending up ran out first: CLIP's
     B x B logits);
  4. near the limit the measured free memory decides (``aiming.NEAR``): once a new largest
     fit leaves less than ``NEAR`` samples' worth free (by the last secant and by a wide one,
     the last three points growing with slopes within ``aiming.STEADY``), the predicted limit
     is run as is, rounded to the nearest size; under one sample's worth, the next size, the
     verification. Doubling's grid and the bisection window are skipped for that step: they
     would pay for sizes the free memory already rules out (x-transformers' copy task: 32 26
     23 21 all ran out after 20 fit with 2.8 MiB free at 10.8 MiB a sample). Off once a size
     said not to fit has fit, where the peaks move in steps of half a sample or more, and
     where the last three peaks lie more than a sample off one line (noise), unless the last
     four bend alike (a convex curve: the parabola's limit bounds the room, and the step
     stays inside the reference's window).

  The oracle may report a second, smooth measure of each peak (``aim_bytes``: on CUDA the
  allocated peak, where the reserved peak that decides the fit moves in 2 and 20 MiB allocator
  segments); the search then aims with the smooth one, at the capacity less the gap between
  the two measured at the largest fit and growing as it grew over a wide span below it
  (:meth:`~memkit.probing.bracket.Bracket.gap_slope`), and decides with the other. Where a
  trusted line said a size is the limit (at most 4 times the largest fit before it) and it fit,
  but the peak that decides shows room for more, the next size is run before the step into
  that room: a new allocator block right after the limit shows in no smooth peak (GPT-2 on
  an H200 paid 5 OOM trials growing into 0.3 GB that one more sample could not use). This
  check is made once; where it fits, the search goes on as it would have without it.

  On a linear curve: 6 trials for limits up to 16384 (1, 2, 4, a jump capped at 64x, the
  limit, one more), 7 up to 2**20. The tests run every limit from 1 to 1024, 19 chosen ones
  and 400 sampled up to 100 000 on linear, piecewise, quadratic, allocator-rounded and noisy
  curves: never more trials than doubling + bisection (mean 6.1, 6.6, 6.3, 19.3 and 21.6
  trials against 21.9; quadratic 10.4 before the parabola, with 556 of the 1443 searches
  paying more than 2 OOM trials, none since), and on linear and piecewise curves at most
  ``ceil(log2 B) + 3``.

Never worse than doubling + bisection, by construction where it matters: the reference
(:class:`memkit.probing.reference.Reference`) knows, for every limit, how many trials doubling
and bisection would take, as a Kraft mass ``2**-trials``. While growing, a step short of
doubling's next size is taken only where a wrong guess cannot make any limit cost more than the
reference (or on an exact line); once bracketed, every size is projected into the window that
keeps every limit still possible within the reference's count (exact leaf by leaf for narrow
brackets, by masses for wide ones). Only a trusted jump beyond doubling's next size, a near
step (4.) and the check after an aimed limit can still cost more, when they are wrong; the
tests check that they never do on the five test curves (one measure: no check), and on 3000
random two-measure curves 128 searches take a trial or more beyond the reference
(``benchmarks/search_trials.py --two-measures``).

Failure trials' ``peak_bytes`` (in use plus the allocation that failed) are lower bounds of a
peak that was never reached; they never enter a fit.

A non-monotone oracle (a size failing although a larger one fit) cannot be observed: the search
only runs sizes strictly inside the bracket. "Exact" then still holds locally (B fit, B + 1
failed, both run).

With ``capacity_bytes=None`` there is nothing to aim at, and the search is
:func:`doubling_bisection`.

Examples:
    >>> def fits(batch):  # 1 GB of weights, 1 MB per sample, an 8 GB device
    ...     peak = 10**9 + 10**6 * batch
    ...     return peak <= 8 * 10**9, peak
    >>> result = search_max_batch(fits, capacity_bytes=8 * 10**9)
    >>> result.max_batch_size, [t.batch_size for t in result.trials]
    (7000, [1, 2, 4, 256, 7000, 7001])
    >>> len(doubling_bisection(fits).trials)
    26
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

from memkit.errors import ConfigError
from memkit.probing.aiming import ModelStrategy
from memkit.probing.bracket import NO_LIMIT, Bracket, Oracle, Trial, plain_next, run_strategy
from memkit.results import Record

__all__ = [
    "LinearFit",
    "Oracle",
    "PairwiseFit",
    "SearchResult",
    "Trial",
    "check_bounds",
    "doubling_bisection",
    "search_max_batch",
    "summary_fit",
    "superlinear",
]


@dataclasses.dataclass(frozen=True)
class LinearFit(Record):
    """Peak memory as a straight line of the batch size: ``fixed + per_sample * batch``.

    Attributes:
        fixed_bytes: the intercept (weights, gradients, optimizer state, workspaces).
        per_sample_bytes: the slope (activations and the like, per sample).
    """

    fixed_bytes: float
    per_sample_bytes: float

    @classmethod
    def from_points(cls, points: Sequence[tuple[float, float]]) -> LinearFit | None:
        """Least-squares line through ``(batch_size, peak_bytes)`` points.

        Returns:
            The fit, or ``None`` with fewer than two distinct batch sizes.

        Examples:
            >>> LinearFit.from_points([(1, 30), (2, 50), (4, 90)])
            LinearFit(fixed_bytes=10.0, per_sample_bytes=20.0)
        """
        n = len(points)
        sx = sum(x for x, _ in points)
        sy = sum(y for _, y in points)
        d = n * sum(x * x for x, _ in points) - sx * sx
        if n < 2 or d <= 0:
            return None
        num = n * sum(x * y for x, y in points) - sx * sy  # exact for integer points
        return cls((sy * d - num * sx) / (n * d), num / d)

    def predict(self, batch_size: float) -> float:
        """Predicted peak bytes at ``batch_size``."""
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def max_batch_within(self, budget_bytes: float) -> int | None:
        """Largest batch size whose predicted peak is at most ``budget_bytes``.

        Returns:
            That size (``0`` when not even one sample is predicted to fit), or ``None`` when
            the line does not grow (``per_sample_bytes <= 0``) and so sets no finite limit.

        Examples:
            >>> LinearFit(10.0, 20.0).max_batch_within(100)
            4
        """
        if self.per_sample_bytes <= 0:
            return None
        x = (budget_bytes - self.fixed_bytes) / self.per_sample_bytes
        return max(0, math.floor(x + 1e-12 * max(1.0, abs(x))))


@dataclasses.dataclass(frozen=True)
class SearchResult(Record):
    """What a batch-size search found, and every trial it ran to find it.

    Attributes:
        max_batch_size: the largest size that fit, verified (see the module docstring); ``None``
            when even ``min_batch`` did not fit.
        recommended_batch_size: the size to train with, leaving ``margin`` of
            ``capacity_bytes`` free (see :func:`search_max_batch`); ``max_batch_size`` when the
            capacity is unknown; ``None`` when nothing fit.
        trials: every trial, in the order run.
        capacity_bytes: the capacity the search aimed at, or ``None`` when unknown.
        margin: the fraction of ``capacity_bytes`` the recommendation leaves free.
        model: the least-squares line through every size that fit with a measured peak, or
            ``None`` with fewer than two of them.
        hit_max_batch: ``True`` when ``max_batch_size == max_batch``: the upper bound was
            reached, not a memory limit.
        margin_met: ``True`` when the recommendation's peak, and every smaller measured
            size's, is within ``(1 - margin) * capacity_bytes``; ``False`` when no size that
            fit is, and the smallest size that fit is recommended anyway; ``None`` when the
            capacity is unknown or nothing fit.
        recommended_measured: ``True`` when the recommended size was run (its peak is a
            measurement); ``False`` when it was interpolated between two sizes that were run.
        strategy: ``"model"`` or ``"doubling"``: how the sizes were chosen.
        pairwise: where the peaks (the smooth, allocated ones where measured) grow with the
            square of the batch, that parabola (:class:`PairwiseFit`).
        superlinear: the peaks grow faster than the batch (:func:`superlinear`): a
            ``pairwise`` parabola, or too few sizes to fit one.
    """

    max_batch_size: int | None
    recommended_batch_size: int | None
    trials: tuple[Trial, ...]
    capacity_bytes: int | None
    margin: float
    model: LinearFit | None
    hit_max_batch: bool
    margin_met: bool | None = None
    recommended_measured: bool = True
    strategy: str = "model"
    pairwise: PairwiseFit | None = None
    superlinear: bool = False


@dataclasses.dataclass(frozen=True)
class PairwiseFit(Record):
    """Peaks that grow with the square of the batch: ``fixed + per_sample * b + per_pair *
    b**2``, where the ``b**2`` term holds a material share of the largest peak: a loss over
    pairs of samples (a ``B x B`` similarity, logits or distance matrix: contrastive losses
    with in-batch negatives, triplet mining), whose samples a micro-batch cannot split.

    Attributes:
        fixed_bytes: the intercept.
        per_sample_bytes: the linear term.
        per_pair_bytes: the quadratic term (bytes per pair of samples, ``b**2`` of them).
        pair_share: the quadratic term's share of the fitted peak at the largest size.
    """

    fixed_bytes: float
    per_sample_bytes: float
    per_pair_bytes: float
    pair_share: float

    @classmethod
    def from_points(
        cls, points: Sequence[tuple[int, int]], min_share: float = 0.2
    ) -> PairwiseFit | None:
        """The least-squares parabola through the ``(batch_size, peak_bytes)`` points of the
        upper sizes (at least an eighth of the largest: the smallest sizes' peaks sit on
        floors of allocator rounding, which a line through them bends like a parabola)
        where there are three of them at least, its quadratic term is at least ``min_share``
        of the fitted peak at the largest size, its linear term is not negative (a bend from a
        floor to a line is fitted by a parabola with one), and it fits them at least three
        times as closely as a line does; ``None`` otherwise.

        Examples:
            >>> sizes = (1, 2, 4, 8, 16, 32)
            >>> fit = PairwiseFit.from_points([(b, 1000 + 10 * b + b * b) for b in sizes])
            >>> round(fit.per_pair_bytes, 6), round(fit.pair_share, 2)
            (1.0, 0.44)
            >>> PairwiseFit.from_points([(b, 1000 + 10 * b) for b in sizes]) is None
            True
            >>> PairwiseFit.from_points([(1, 99), (2, 99), (4, 99), (256, 180), (2846, 1200)])
            >>> bend = [(b, max(1000, 600 + 2 * b)) for b in (64, 128, 200, 300, 400, 512)]
            >>> PairwiseFit.from_points(bend) is None  # a floor, then a line
            True
        """
        top = max((b for b, _ in points), default=0)
        upper = sorted((b, p) for b, p in points if 8 * b >= top)
        if len({b for b, _ in upper}) < 3:
            return None
        xs = [b / top for b, _ in upper]  # scaled: the normal equations stay well conditioned
        ys = [float(p) for _, p in upper]
        s = [sum(x**k for x in xs) for k in range(5)]
        t = [sum(y * x**k for x, y in zip(xs, ys, strict=True)) for k in range(3)]
        m = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]

        def det(a: list[list[float]]) -> float:
            return (
                a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
            )

        d = det(m)
        line = LinearFit.from_points(upper)
        if d <= 0 or line is None:
            return None
        a, b, c = (
            det([[t[r] if col == k else m[r][col] for col in range(3)] for r in range(3)]) / d
            for k in range(3)
        )
        quad_error = sum((a + b * x + c * x * x - y) ** 2 for x, y in zip(xs, ys, strict=True))
        line_error = sum((line.predict(x) - y) ** 2 for (x, _), y in zip(upper, ys, strict=True))
        peak = a + b + c
        share = c / peak if peak > 0 else 0.0
        # (b < 0: a bend, not a parabola: a flat floor the optimizer step sets, then the
        # backward's line, as a wide MLP's estimate peaks are; review of sweep BT's change)
        if c <= 0 or b < 0 or share < min_share or line_error < 9 * quad_error:
            return None
        return cls(a, b / top, c / (top * top), share)


def superlinear(points: Sequence[tuple[int, int]]) -> bool:
    """Whether the peaks grow faster than the batch: a :class:`PairwiseFit` through them, or
    the :func:`summary_fit` chord's intercept below zero. A linear step's chord meets zero at
    its fixed part or above (the smallest sizes' rounding floors only raise it); a batch x
    batch term bends it below.

    Examples:
        >>> superlinear([(1, 1000), (8, 1100), (253, 66000)])
        True
        >>> superlinear([(1, 99), (256, 180), (2846, 1200)])
        False
    """
    if PairwiseFit.from_points(points) is not None:
        return True
    chord = summary_fit(points)
    return chord is not None and chord.fixed_bytes < 0


def summary_fit(points: Sequence[tuple[int, int]]) -> LinearFit | None:
    """The line reported with a result, through well-spread ``(batch_size, peak)`` points.

    The sizes a search runs last cluster just under the limit, where the allocator's 2 MiB
    rounding swamps the per-sample cost; a line through them alone can show a slope of zero.
    This one is the line from the largest point at most half the largest size (the smallest
    point when there is none) to the largest point.

    Examples:
        >>> mib = 1 << 20
        >>> summary_fit([(100, 110 * mib), (400, 410 * mib), (999, 1010 * mib), (1000, 1010 * mib)])
        LinearFit(fixed_bytes=10485760.0, per_sample_bytes=1048576.0)
    """
    ordered = sorted(points)
    if not ordered:
        return None
    half = ordered[-1][0] / 2
    low = [i for i, (x, _) in enumerate(ordered) if x <= half]
    start = low[-1] if low else 0
    spread = ordered[start:]
    fit = LinearFit.from_points([spread[0], spread[-1]])
    if fit is None:
        return LinearFit.from_points(ordered)
    return fit


def check_bounds(min_batch: int, max_batch: int | None, margin: float) -> None:
    """The :class:`ConfigError` for search bounds no search can run with."""
    if min_batch < 1:
        raise ConfigError(f"min_batch must be at least 1, got {min_batch}.")
    if max_batch is not None and max_batch < min_batch:
        raise ConfigError(
            f"max_batch ({max_batch}) must be at least min_batch ({min_batch}); "
            "raise max_batch or lower min_batch."
        )
    if not 0 <= margin < 1:
        raise ConfigError(f"margin is a fraction of the capacity in [0, 1), got {margin}.")


def _check(min_batch: int, max_batch: int | None, margin: float, capacity: int | None) -> None:
    check_bounds(min_batch, max_batch, margin)
    if capacity is not None and capacity <= 0:
        raise ConfigError(f"capacity_bytes must be positive, or None when unknown; got {capacity}.")


def _new_search(
    fits: Oracle,
    min_batch: int,
    max_batch: int | None,
    start: int | None,
    clock: Callable[[], float],
    on_trial: Callable[[Trial], None] | None,
    known: Sequence[Trial] = (),
) -> tuple[Bracket, int]:
    upper = NO_LIMIT if max_batch is None else max_batch
    first = min(max(min_batch if start is None else start, min_batch), upper)
    search = Bracket(
        fits, min_batch=min_batch, max_batch=upper, clock=clock, on_trial=on_trial, known=known
    )
    return search, first


def _recommend(s: Bracket, budget: float) -> tuple[int, bool, bool]:
    """``(size, margin_met, measured)``: the largest size known to keep the peak in budget.

    Peaks are read as their envelope, the largest peak measured at this size or any smaller
    one: a peak need not grow with the batch (allocator rounding, a kernel that changes with
    the shape), and a recommendation with a smaller size that needed more than the budget has
    no real headroom. The largest size whose envelope is within ``budget``; raised, when the
    next larger size that fit measured above budget, to where the straight line between the two
    crosses the budget (below a size that fit, so it fits; interpolated, never extrapolated).
    With no size within budget, the smallest size that fit.
    """
    points = _envelope(s.fitting_points())
    within = [(b, p) for b, p in points if p <= budget]
    if not within:
        return min(t.batch_size for t in s.trials if t.fits), False, True
    b1, p1 = max(within)
    above = [(b, p) for b, p in points if b > b1]
    if above:
        b2, p2 = above[0]
        if p2 > p1:
            b = b1 + math.floor((budget - p1) * (b2 - b1) / (p2 - p1))
            if b1 < b < b2:
                return b, True, False
    return b1, True, True


def _envelope(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(size, the largest peak at this size or below)`` of size-ordered points.

    Examples:
        >>> _envelope([(1, 10), (2, 30), (3, 20), (4, 40)])
        [(1, 10), (2, 30), (3, 30), (4, 40)]
    """
    peaks = itertools.accumulate((p for _, p in points), max)
    return list(zip([b for b, _ in points], peaks, strict=True))


def _result(s: Bracket, *, capacity: int | None, margin: float, strategy: str) -> SearchResult:
    best = s.lo
    recommended, met, measured = best, None, True
    if best is not None and capacity is not None:
        recommended, met, measured = _recommend(s, capacity * (1.0 - margin))
    smooth = s.aim_points() or s.fitting_points()
    return SearchResult(
        max_batch_size=best,
        recommended_batch_size=recommended,
        trials=tuple(s.trials),
        capacity_bytes=capacity,
        margin=margin,
        model=summary_fit(s.fitting_points()),
        pairwise=PairwiseFit.from_points(smooth),
        superlinear=superlinear(smooth),
        hit_max_batch=best is not None and best == s.max_batch,
        margin_met=met,
        recommended_measured=measured,
        strategy=strategy,
    )


def doubling_bisection(
    fits: Oracle,
    *,
    min_batch: int = 1,
    max_batch: int | None = None,
    start: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_trial: Callable[[Trial], None] | None = None,
    known: Sequence[Trial] = (),
) -> SearchResult:
    """The plain reference strategy: double from ``min_batch`` until a failure, then bisect.

    It uses nothing but fit / no fit. It is what :func:`search_max_batch` does when the
    capacity is unknown, and the yardstick its trial counts are tested against. Same
    guarantees of exactness (see the module docstring).

    Args:
        fits: the oracle; see :data:`Oracle`. Its exceptions propagate unchanged.
        min_batch: the smallest size to consider; run first unless ``start`` is given.
        max_batch: the largest size to consider; ``None`` for no bound (in practice
            ``2**40``).
        start: the first size to run (clamped into range); bisects down if it fails.
        clock: the clock that times each trial.
        on_trial: called with each trial just after it ran.
        known: trials run before that still hold: the search resumes from their bracket
            (they are the result's first trials; none of their sizes is run again).

    Returns:
        The result, with ``recommended_batch_size == max_batch_size``.

    Raises:
        ConfigError: on an out-of-range argument.
    """
    _check(min_batch, max_batch, 0.0, None)
    s, first = _new_search(fits, min_batch, max_batch, start, clock, on_trial, known)
    run_strategy(s, first, plain_next)
    return _result(s, capacity=None, margin=0.0, strategy="doubling")


def search_max_batch(
    fits: Oracle,
    *,
    capacity_bytes: int | None,
    min_batch: int = 1,
    max_batch: int | None = None,
    margin: float = 0.05,
    start: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_trial: Callable[[Trial], None] | None = None,
    known: Sequence[Trial] = (),
) -> SearchResult:
    """Finds the largest batch size that fits, exactly, from each trial's measured peak.

    See the module docstring for the guarantees and how the sizes are chosen.

    Args:
        fits: the oracle; see :data:`Oracle`. Its exceptions propagate unchanged.
        capacity_bytes: the memory the peak must stay within, or ``None`` when unknown
            (then the search is :func:`doubling_bisection`).
        min_batch: the smallest size to consider; when it does not fit, the search stops
            after that one trial with ``max_batch_size=None``.
        max_batch: the largest size to consider; ``None`` for no bound (in practice
            ``2**40``).
        margin: the fraction of ``capacity_bytes`` the recommended size leaves free, in bytes.
        start: the first size to run instead of ``min_batch`` (clamped into range).
        clock: the clock that times each trial.
        on_trial: called with each trial just after it ran (for progress lines).
        known: trials run before that still hold (fits measured before a step's schedule was
            seen are dropped from them): the search resumes from their bracket and aims with
            their peaks; they are the result's first trials, and none of their sizes is run
            again.

    Returns:
        The result. ``recommended_batch_size`` is the largest size that fit with a measured
        peak within ``(1 - margin) * capacity_bytes``, as no smaller size measured above it
        (peaks read as their running maximum over sizes), raised to where the straight line
        between that measurement and the next larger one crosses that budget
        (``recommended_measured=False``); with no size within the margin, the smallest size
        that fit (``margin_met=False``).

    Raises:
        ConfigError: on an out-of-range argument.
    """
    _check(min_batch, max_batch, margin, capacity_bytes)
    if capacity_bytes is None:  # nothing to aim at: the reference strategy
        plain = doubling_bisection(
            fits,
            min_batch=min_batch,
            max_batch=max_batch,
            start=start,
            clock=clock,
            on_trial=on_trial,
            known=known,
        )
        return dataclasses.replace(plain, margin=margin)
    s, first = _new_search(fits, min_batch, max_batch, start, clock, on_trial, known)
    run_strategy(s, first, ModelStrategy(capacity_bytes, first, s.max_batch))
    return _result(s, capacity=capacity_bytes, margin=margin, strategy="model")
