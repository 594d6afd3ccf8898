"""The model-guided strategy of :func:`memkit.probing.search.search_max_batch`.

It aims each next size where a line (or, where four fits bend alike, a parabola) through the
measured peaks crosses the capacity (the module docs of :mod:`memkit.probing.search` explain
the steps and the guarantees), and never pays more trials than doubling + bisection would where
a wrong aim could cost more (:class:`memkit.probing.reference.Reference`). Torch-free.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence

from memkit.probing.bracket import NO_LIMIT, Bracket, plain_next, wide_low
from memkit.probing.reference import Reference

__all__ = [
    "BEND_QUANTA",
    "CURVATURE_TOLERANCE",
    "GROWTH",
    "NEAR",
    "SLOPE_TOLERANCE",
    "STEADY",
    "TRUSTED_GROWTH",
    "ModelStrategy",
]

GROWTH = 2
"""Growth factor while no line can be trusted."""
TRUSTED_GROWTH = 64
"""A trusted prediction is run directly if it is at most this many times the largest fit."""
SLOPE_TOLERANCE = 0.05
"""Two secant slopes agree (the points are collinear) within this relative difference."""
NEAR = 8
"""Within this many samples of free memory above the largest fit, the predicted limit is run
as is, rounded to the nearest size (the limit L and L + 1 each settle it in two trials)."""
STEADY = 0.15
"""Those near steps need the last two secants to agree within this relative difference."""
CURVATURE_TOLERANCE = 0.25
"""Two curvatures (of the last two triples of fits) agree within this relative difference."""
BEND_QUANTA = 4
"""A triple bends when its middle point lies this many of the peaks' steps below the chord."""


def _secant(points: Sequence[tuple[int, int]], capacity: int) -> tuple[float | None, bool]:
    """Where the secant of the two largest fitting sizes crosses ``capacity``, and whether it
    is trusted (the pair below has the same slope: three collinear points)."""
    if len(points) < 2:
        return None, False
    (b1, p1), (b2, p2) = points[-2], points[-1]
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        return None, False
    predicted = b2 + (capacity - p2) / slope
    if len(points) < 3:
        return predicted, False
    b0, p0 = points[-3]
    below = (p1 - p0) / (b1 - b0)
    return predicted, abs(slope - below) <= SLOPE_TOLERANCE * slope


def _curvature(points: Sequence[tuple[int, int]]) -> float:
    """The second divided difference of three points: half the second derivative of the
    parabola through them."""
    (b0, p0), (b1, p1), (b2, p2) = points
    return ((p2 - p1) / (b2 - b1) - (p1 - p0) / (b1 - b0)) / (b2 - b0)


def _bend(points: Sequence[tuple[int, int]]) -> float:
    """How far, in bytes, the middle of three points lies below the chord of the outer two."""
    (b0, p0), (b1, p1), (b2, p2) = points
    return p0 + (p2 - p0) * (b1 - b0) / (b2 - b0) - p1


def _bends(points: Sequence[tuple[int, int]], least: float) -> bool:
    """Whether three points grow and their middle lies more than ``least`` bytes below the
    chord of the outer two: convex, beyond the peaks' rounding."""
    return _local_slope(points[:2]) > 0 and _bend(points) > least


def _parabola(points: Sequence[tuple[int, int]], capacity: int) -> float | None:
    """Where the parabola through the three largest fits crosses ``capacity``, when the four
    largest bend alike: both triples bend (``_bends``, by more than ``BEND_QUANTA`` of the
    peaks' step) with curvatures within ``CURVATURE_TOLERANCE`` of each other (one parabola:
    not a kink between two lines, not noise). ``None`` otherwise."""
    if len(points) < 4 or not all(a[1] < b[1] for a, b in itertools.pairwise(points[-4:])):
        return None  # (peaks that do not grow all the way: noise, not a curve)
    last, below = points[-3:], points[-4:-1]
    least = BEND_QUANTA * _quantum(points)
    if not (_bends(last, least) and _bends(below, least)):
        return None
    c, c_below = _curvature(last), _curvature(below)
    room = capacity - last[2][1]
    if abs(c - c_below) > CURVATURE_TOLERANCE * max(c, c_below) or room < 0:
        return None
    (b1, _), (b2, _) = last[1], last[2]
    slope = _local_slope(last) + c * (b2 - b1)  # the parabola's slope at b2
    return b2 + 2 * room / (slope + math.sqrt(slope * slope + 4 * c * room))


def _aim(s: Bracket, capacity: int) -> tuple[float | None, bool, Sequence[tuple[int, int]]]:
    """The prediction of the part of the step that reaches ``capacity`` first, whether it is
    trusted, and that part's points (the whole peaks when no parts were reported). The
    prediction is the parabola's where the points bend alike (trusted), else the secant's."""
    series = s.part_points()
    capacity -= s.gap()  # the smooth peaks aim where the peak that decides the fit ends
    best: tuple[float | None, bool, Sequence[tuple[int, int]]] = (None, False, series[0])
    for points in series:
        bent = _parabola(points, capacity)
        predicted, trusted = (bent, True) if bent is not None else _secant(points, capacity)
        if predicted is not None and (best[0] is None or predicted < best[0]):
            best = (predicted, trusted, points)
    return best


def _wide_slope(points: Sequence[tuple[int, int]]) -> float | None:
    """The slope from the largest point at most half the largest size (the smallest point
    when there is none) to the largest point: a span wide enough that the allocator's steps
    and a kink between two recorded sizes barely move it."""
    (top, peak) = points[-1]
    b0, p0 = wide_low(points)
    return None if b0 == top else (peak - p0) / (top - b0)


def _local_slope(points: Sequence[tuple[int, int]]) -> float:
    """The slope of the secant of the two largest points."""
    (b1, p1), (b2, p2) = points[-2], points[-1]
    return (p2 - p1) / (b2 - b1)


def _quantum(points: Sequence[tuple[int, int]]) -> int:
    """The step all the peaks move in (their greatest common divisor): 2 MiB for peaks
    rounded as an allocator reserves them, a few bytes for exact counts."""
    return math.gcd(*(p for _, p in points))


def _steady(points: Sequence[tuple[int, int]]) -> bool:
    """Whether the last three peaks grow with the batch and their two secants agree within
    ``STEADY``: a slope to measure headroom with, not noise."""
    if len(points) < 3:
        return False
    (b0, p0), (b1, p1) = points[-3], points[-2]
    below, top = (p1 - p0) / (b1 - b0), _local_slope(points)
    return below > 0 and top > 0 and abs(top - below) <= STEADY * max(top, below)


def _scatter(points: Sequence[tuple[int, int]]) -> float:
    """How far, in samples at the last secant's slope, the middle of the last three points
    lies off the line through the outer two: noise and kinks, where the free memory
    measured at the largest fit is only as exact as this."""
    (b0, p0), (b1, p1), (b2, p2) = points[-3], points[-2], points[-1]
    on_line = p0 + (p2 - p0) * (b1 - b0) / (b2 - b0)
    return abs(p1 - on_line) / _local_slope(points)


def _headroom(s: Bracket, capacity: int, points: Sequence[tuple[int, int]]) -> float | None:
    """Samples that still fit above the largest fit by the measured free memory, under both
    the last secant and the wide slope (the larger of the two estimates); ``None`` when a
    slope is not positive or the largest fit left nothing to measure."""
    if len(points) < 2:
        return None
    free = capacity - s.gap() - points[-1][1]
    local = _local_slope(points)
    wide = _wide_slope(points)
    if free < 0 or local <= 0 or wide is None or wide <= 0:
        return None
    return max(free / local, free / wide)


def _convex_consistent(points: Sequence[tuple[int, int]]) -> bool:
    """Whether the last secant is at least as steep as the line from the first point: what a
    convex memory curve shows. Noise-dominated peaks fail this about half the time, and an
    untrusted line is then not worth aiming with."""
    (b0, p0), (b1, p1), (b2, p2) = points[0], points[-2], points[-1]
    if b2 in (b0, b1):
        return False
    return (p2 - p1) / (b2 - b1) >= (p2 - p0) / (b2 - b0)


def _without(s: Bracket, size: int) -> Bracket:
    """The bracket as if ``size`` (a check that fit) had not been run: its peak, one sample
    from the aim's, adds no slope, and every later step is the one the search would take
    without it (one that proposes ``size`` runs the size after it)."""
    view = copy.copy(s)
    view.trials = [t for t in s.trials if t.batch_size != size]
    view.lo = max((t.batch_size for t in view.trials if t.fits), default=None)
    return view


def _collinear(points: Sequence[tuple[int, int]]) -> bool:
    """Whether three or more points all lie exactly on one line (exact integer arithmetic)."""
    n = len(points)
    if n < 3:
        return False
    sx = sum(b for b, _ in points)
    sy = sum(p for _, p in points)
    d = n * sum(b * b for b, _ in points) - sx * sx
    num = n * sum(b * p for b, p in points) - sx * sy
    return (n * sum(p * p for _, p in points) - sy * sy) * d == num * num


class ModelStrategy:
    """Secant (or parabola) prediction with trust, halfway steps, near-limit steps from the
    measured free memory and a bisection safeguard."""

    def __init__(self, capacity: int, base: int = 1, max_batch: int = NO_LIMIT) -> None:
        self.capacity = capacity
        self.reference = Reference(base, max_batch)
        self.max_batch = max_batch
        self.exact_aim: int | None = None
        self.verified: int | None = None  # the last size run because it was said not to fit
        self.exact_missed = False
        self.widths: list[int] = []  # bracket widths seen since the first failure
        self.gallop = 2  # the least step when the model creeps; doubles each time it is used
        self.said_limit = False  # the last growth step verified a limit the model predicted
        self.small_steps = 0  # consecutive growth steps of one size
        self.aimed_with = -1  # number of fitting points when the bracket was last aimed into
        self.near_missed = False  # a size said to be one too many by the free memory fit
        self.near_lo: int | None = None  # the largest fit the last near step started from
        self.aimed_limit: int | None = None  # run because a trusted line said it is the limit
        self.checked: int | None = None  # the size after it, run once to check that
        self.after_check: int | None = None  # the step the check came before

    def __call__(self, s: Bracket) -> int:
        if self.checked is not None:
            s = _without(s, self.checked)
        if s.lo is None:  # `start` failed: bisect down towards min_batch
            return plain_next(s)
        last = s.trials[-1]
        aimed, self.aimed_limit = self.aimed_limit, None
        later, self.after_check = self.after_check, None
        if later is not None:  # the check fit (had it failed, the search would be over)
            return later
        predicted, trusted, points = _aim(s, self.capacity)
        near = self._near(s, points, predicted)
        if near is not None:
            return near
        proposal = self._step(s, predicted, trusted, points)
        if (
            self.checked is None
            and last.fits
            and last.batch_size == aimed
            and s.gap() > 0
            and proposal > aimed + 1
        ):
            # The smooth peaks said this is the limit and it fit; the peak that decides says
            # there is room for more, but the next size may need a new allocator segment that
            # no smooth peak shows (GPT-2 on the H200: 636 needed a 330 MB block after 635 fit
            # with 316 MB reserved free). Check the next size once, before that step.
            self.checked, self.after_check = aimed + 1, proposal
            return aimed + 1
        if (
            s.hi is None
            and trusted
            and predicted is not None
            and proposal == math.floor(predicted)
            and proposal <= 4 * s.lo  # (not a line read at a few samples)
        ):
            self.aimed_limit = proposal
        return proposal

    def _step(
        self,
        s: Bracket,
        predicted: float | None,
        trusted: bool,
        points: Sequence[tuple[int, int]],
    ) -> int:
        """The next size from the line (or the bracket), once no near step applies."""
        assert s.lo is not None
        lo = s.lo
        if s.hi is None:  # growing
            proposal = self._grow(lo, predicted, trusted, len(points))
            grid = self.reference.next_size(lo)
            if self.exact_aim is not None and s.trials[-1].batch_size == self.exact_aim + 1:
                self.exact_missed = self.exact_missed or s.trials[-1].fits
            if proposal > grid and not trusted:
                return grid  # only a trusted line jumps past doubling's next size
            if proposal < grid:
                exact = _collinear(points) and not self.exact_missed
                if exact:
                    self.exact_aim = proposal
                elif not self.reference.allows(lo, proposal, self.max_batch + 1, len(s.trials)):
                    return grid  # short of doubling where a wrong guess could cost more
            return proposal
        hi = s.hi
        target = self._bracketed(s, lo, hi, points, predicted, trusted)
        window = self.reference.window(lo, hi, len(s.trials))
        if window is None:
            return target
        return min(max(target, window[0]), window[1])

    def _near(
        self, s: Bracket, points: Sequence[tuple[int, int]], predicted: float | None
    ) -> int | None:
        """The next size when the largest fit left less than ``NEAR`` samples' worth of
        memory free: the free memory is a measurement, only the slope is a guess, and the
        guess's error is a fraction of the few samples left. Under one sample: the next size,
        the verification; else the predicted limit rounded to the nearest size. Either is run
        as is, whatever doubling or the bisection window would do. ``None`` when the last
        three peaks are not steady (``_steady``), when the peaks move in steps as large as
        half a sample (the allocator's rounding without a smooth measure: free memory then
        says little), when the middle one lies more than a sample off the line through the
        other two (``_scatter``: noise, the free memory no measurement at a sample's
        resolution) unless the last four bend alike (``_parabola``: a convex curve, whose
        predicted limit then bounds the room), once a size said not to fit has fit, and after
        a near step from the same largest fit (it failed: the other rules take over)."""
        last = s.trials[-1]
        if last.fits and last.batch_size == self.verified:
            self.near_missed = True  # it was said not to fit, and it fit
        if self.near_missed or s.lo is None or s.lo == self.near_lo:
            return None
        room = _headroom(s, self.capacity, points)
        # four fits bending alike (a convex curve, not noise): the parabola's limit is the
        # room, which the secant's slope overestimates
        if predicted is None or room is None:
            return None
        bent = _parabola(points, self.capacity - s.gap()) is not None
        if bent:
            room = min(room, predicted - s.lo)
        if room >= NEAR:
            return None
        if not bent and (not _steady(points) or _scatter(points) > 1):
            return None
        if _quantum(points) * 2 > _local_slope(points):
            return None
        lo, hi = s.lo, (NO_LIMIT if s.hi is None else s.hi)
        step = lo + 1 if room < 1 else min(max(math.floor(predicted + 0.5), lo + 1), hi - 1)
        if bent and s.hi is not None:  # a bend is read from few points: within the reference
            window = self.reference.window(lo, hi, len(s.trials))
            if window is not None and not window[0] <= step <= window[1]:
                return None
        self.near_lo = lo
        if room < 1:
            self.verified = lo + 1
        return step

    def _bracketed(
        self,
        s: Bracket,
        lo: int,
        hi: int,
        points: Sequence[tuple[int, int]],
        predicted: float | None,
        trusted: bool,
    ) -> int:
        """The next size inside the bracket, before the reference window."""
        self.widths.append(hi - lo)
        if len(self.widths) >= 2 and self.widths[-1] * 2 > self.widths[-2]:
            self.widths.clear()  # the last trial did not halve the bracket: bisect once
            return (lo + hi) // 2
        fitted = len(points)
        if not trusted and predicted is not None and not _convex_consistent(points):
            predicted = None  # flatter than the whole curve: not the convex shape, noise
        if (
            predicted is None
            or fitted == self.aimed_with
            or predicted >= hi + 1
            or (predicted >= hi and self._overshot(s, hi, points))
        ):
            # No line; or the last aim failed and no new point has moved the line since; or
            # the line says hi + 1 fits, where hi already failed: the failure refutes it by
            # more than a sample (a flat part's line, refuted again after every bisection,
            # would creep down from hi one size at a time); or it says hi fits, and hi needed
            # more than a sample beyond the capacity (a line of one part, where another part
            # bends up and ran out first: CLIP's B x B logits): bisect.
            return (lo + hi) // 2
        self.aimed_with = fitted
        return min(math.floor(predicted), hi - 1)

    def _overshot(self, s: Bracket, hi: int, points: Sequence[tuple[int, int]]) -> bool:
        """Whether the failure at ``hi`` needed more than a sample's worth (the line's slope)
        beyond the capacity: its bytes (in use plus the request that failed) are a lower
        bound of its peak."""
        failed = next((t for t in s.trials if t.batch_size == hi and not t.fits), None)
        if failed is None or failed.peak_bytes is None or len(points) < 2:
            return False
        return failed.peak_bytes - self.capacity > _local_slope(points)

    def _grow(self, lo: int, predicted: float | None, trusted: bool, fitted: int) -> int:
        if predicted is None and self.said_limit:
            # The model said "the limit is here", that size fit, and the last two peaks are
            # level (rounded alike): no line, but the limit is still just above: gallop.
            proposal = lo + self.gallop
            self.gallop *= 2
            return proposal
        if predicted is None:
            return lo * GROWTH
        limit = math.floor(predicted)
        if trusted:
            proposal = min(limit, lo * TRUSTED_GROWTH)
            self.aimed_with = fitted
        else:
            proposal = min(lo * GROWTH, math.floor((lo + predicted) / 2))
        creeping = (limit <= lo and self.said_limit) or (
            not trusted and proposal <= lo + 1 and self.small_steps >= 2
        )
        if creeping:
            # The model keeps saying "the limit is just above" and is wrong (noise, rounding,
            # a curve bending up): gallop, each such step twice as far as the last.
            proposal = lo + self.gallop
            self.gallop *= 2
        proposal = max(proposal, lo + 1)
        self.said_limit = limit <= lo
        self.small_steps = self.small_steps + 1 if proposal == lo + 1 else 0
        return proposal
