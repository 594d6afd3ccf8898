"""The reference the batch-size search must never do worse than: doubling + bisection's trial
count for every limit, as Kraft masses.

:class:`Reference` answers, for :mod:`memkit.probing.search`, "how many trials would doubling +
bisection take to find this limit?" and "which sizes can run next so that no limit still
possible costs more than that?". Pure arithmetic on integers and powers of two: no torch, no
trials.
"""

from __future__ import annotations

import math

__all__ = ["Reference"]

_EXACT_WIDTH = 32
"""Brackets of at most this many sizes get the exact, leaf-by-leaf window."""


def _prefix_mass(width: int, j: int) -> float:
    """Kraft mass of the first ``j`` leaves of a midpoint-bisection tree over ``width`` leaves.

    Bisection of a bracket ``(lo, lo + width)`` tests ``lo + width // 2``; the leaf for limit
    ``lo + k`` then sits at some depth ``d_k`` (trials), with mass ``2**-d_k``; the whole tree
    has mass 1.
    """
    mass, scale = 0.0, 1.0
    while 0 < j < width:
        half = width // 2
        scale /= 2
        if j <= half:
            width = half
        else:
            mass += scale
            j -= half
            width -= half
    return mass + (scale if j >= width > 0 else 0.0)


def _leaves_within(width: int, mass: float) -> int:
    """Largest ``j`` with ``_prefix_mass(width, j) <= mass`` (up to rounding)."""
    j, scale = 0, 1.0
    while width > 1:
        if mass >= scale * (1 - 1e-12):
            return j + width
        half = width // 2
        scale /= 2
        if mass >= scale * (1 - 1e-12):
            j += half
            mass -= scale
            width -= half
        else:
            width = half
    return j + (width if mass >= scale * (1 - 1e-12) else 0)


def _leaves_reaching(width: int, mass: float) -> int:
    """Smallest ``j`` with ``_prefix_mass(width, j) >= mass`` (up to rounding)."""
    j, scale = 0, 1.0
    while width > 1:
        if mass <= scale * 1e-12:
            return j
        half = width // 2
        scale /= 2
        if mass > scale * (1 + 1e-12):  # more than the whole left half
            j += half
            mass -= scale
            width -= half
        else:
            width = half
    return j + (1 if width == 1 and mass > scale * 1e-12 else 0)


def _leaf_depths(width: int, first: int, stop: int, depth: int, out: list[int]) -> None:
    """Appends the depths of leaves ``first .. stop - 1`` of a bisection tree over ``width``."""
    if stop <= first:
        return
    if width == 1:
        out.append(depth)
        return
    half = width // 2
    _leaf_depths(half, first, min(stop, half), depth + 1, out)
    _leaf_depths(width - half, max(first - half, 0), stop - half, depth + 1, out)


class Reference:
    """The trials doubling + bisection needs for each limit ``L``, as Kraft masses.

    Doubling from ``base`` runs ``d_i = base * 2**i`` (capped at ``max_batch``). A limit in
    the octave ``[d_i, d_{i+1})`` costs ``i + 2`` doubling trials, then its depth in the
    bisection tree of that octave; its mass is ``2**-trials``. Doubling + bisection is one
    binary decision tree, so all masses add up to 1, and after ``t`` trials the limits still
    possible carry mass ``2**-t`` while the search keeps pace with the reference, less once it
    has gained on it. :meth:`window` keeps both outcomes of the next trial within half the
    allowance, so that every limit can still be found within the reference's count.
    """

    def __init__(self, base: int, max_batch: int) -> None:
        self.base = base
        self.max_batch = max_batch
        self._trials: dict[int, int] = {}

    def _octave(self, size: int) -> tuple[int, int, float]:
        """``(start, end, scale)`` of the octave holding ``size``: its limits are
        ``[start, end)``, the doubling trials before its bisection ``t``, ``scale = 2**-t``.

        ``max_batch`` is an octave of its own: doubling reaches it, it fits, done.
        """
        if size >= self.max_batch:
            trials = ((self.max_batch - 1) // self.base).bit_length() + 1
            return self.max_batch, self.max_batch + 1, 2.0**-trials
        i = (size // self.base).bit_length() - 1
        start = self.base << i
        return start, min(start * 2, self.max_batch), 2.0 ** -(i + 2)

    def _walk_up(self, lo: int, hi: int, mass: float) -> int:
        """Largest ``c <= hi`` with the mass of limits ``[lo, c)`` at most ``mass``."""
        pos = lo
        while pos < hi:
            start, end, scale = self._octave(pos)
            width, stop = end - start, min(end, hi)
            done = _prefix_mass(width, pos - start)
            here = (_prefix_mass(width, stop - start) - done) * scale
            if here > mass:
                return min(start + _leaves_within(width, done + mass / scale), stop)
            mass -= here
            pos = stop
        return hi

    def _walk_down(self, lo: int, hi: int, mass: float) -> int:
        """Smallest ``c >= lo`` with the mass of limits ``[c, hi)`` at most ``mass``."""
        pos = hi
        while pos > lo:
            start, end, scale = self._octave(pos - 1)
            width, stop = end - start, max(start, lo)
            top = _prefix_mass(width, pos - start)
            here = (top - _prefix_mass(width, stop - start)) * scale
            if here > mass:
                return max(start + _leaves_reaching(width, top - mass / scale), stop)
            mass -= here
            pos = stop
        return lo

    def mass(self, lo: int, hi: int) -> float:
        """Mass of the limits ``[lo, hi)``; ``hi > max_batch`` means all limits from ``lo``."""
        total, pos = 0.0, lo
        while pos < hi:
            start, end, scale = self._octave(pos)
            if hi > self.max_batch and end <= self.max_batch:
                # all limits from `end` on: the subtree after doubling's `end` fit, which
                # is scale (2**-t) deep
                return total + scale * (1 - _prefix_mass(end - start, pos - start)) + scale
            stop = min(end, hi)
            total += scale * (
                _prefix_mass(end - start, stop - start) - _prefix_mass(end - start, pos - start)
            )
            pos = stop
        return total

    def allows(self, lo: int, size: int, hi: int, trials: int) -> bool:
        """Whether running ``size`` next keeps every limit in ``[lo, hi)`` within its count."""
        if lo < self.base:
            return False
        half = 2.0 ** -(trials + 1) * (1 + 1e-12)
        return self.mass(lo, size) <= half and self.mass(size, hi) <= half

    def trials_for(self, limit: int) -> int:
        """Trials doubling + bisection runs to find ``limit`` (``base <= limit <= max_batch``)."""
        known = self._trials.get(limit)
        if known is not None:
            return known
        start, end, scale = self._octave(limit)
        trials = 1 - math.frexp(scale)[1]  # the doubling trials: scale == 2**-trials
        width, j = end - start, limit - start
        while width > 1:
            half = width // 2
            trials += 1
            if j < half:
                width = half
            else:
                j -= half
                width -= half
        self._trials[limit] = trials
        return trials

    def trials_between(self, lo: int, hi: int) -> list[int]:
        """``[trials_for(limit) for limit in range(lo, hi)]``, leaf by leaf in one walk."""
        out: list[int] = []
        pos = lo
        while pos < hi:
            start, end, scale = self._octave(pos)
            stop = min(end, hi)
            _leaf_depths(end - start, pos - start, stop - start, 1 - math.frexp(scale)[1], out)
            pos = stop
        return out

    def _exact_window(self, lo: int, hi: int, trials: int) -> tuple[int, int] | None:
        """:meth:`window`, leaf by leaf: for narrow brackets.

        Kraft masses alone do not decide whether an *ordered* decision tree exists when the
        allowed depths are not monotone (inside an octave of odd width they are not). The
        greedy that places each leaf at the first aligned free position does: a prefix (or
        suffix) of the bracket can be finished in time if and only if the greedy fits it.
        """
        budgets = [count - trials - 1 for count in self.trials_between(lo, hi)]
        if min(budgets) < 0:
            return None
        top = max(budgets)

        def fits_from_left(order: list[int]) -> list[bool]:
            pos, ok = 0, []
            for budget in order:
                size = 1 << (top - budget)
                pos = -(-pos // size) * size + size
                ok.append(pos <= 1 << top)
            return ok

        left = fits_from_left(budgets)  # left[k]: limits lo .. lo + k fit
        right = fits_from_left(budgets[::-1])[::-1]  # right[k]: limits lo + k .. hi - 1 fit
        valid = [c for c in range(lo + 1, hi) if left[c - lo - 1] and right[c - lo]]
        return (valid[0], valid[-1]) if valid else None

    def _mass_window(self, lo: int, hi: int, trials: int) -> tuple[int, int] | None:
        half = 2.0 ** -(trials + 1)
        first = max(self._walk_down(lo, hi, half), lo + 1)
        last = min(self._walk_up(lo, hi, half), hi - 1)
        return (first, last) if first <= last else None

    def window(self, lo: int, hi: int, trials: int) -> tuple[int, int] | None:
        """Sizes to run next so that no limit in ``[lo, hi)`` costs more than the reference.

        Exact for brackets of at most ``_EXACT_WIDTH`` sizes; by Kraft masses above (where,
        in practice, the search is far ahead of the reference or far behind it).

        Returns:
            ``(first, last)``, a non-empty range inside ``(lo, hi)``, or ``None`` when some
            limit in the bracket can no longer be found within the reference's count.
        """
        if lo < self.base:
            return None
        if hi - lo <= _EXACT_WIDTH:
            return self._exact_window(lo, hi, trials)
        return self._mass_window(lo, hi, trials)

    def next_size(self, lo: int) -> int:
        """The size doubling runs after the octave holding ``lo``."""
        if lo < self.base:
            return 2 * lo
        return 2 * self._octave(lo)[0]
