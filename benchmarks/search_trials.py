"""How many trials does the batch-size search take? Compared with doubling + bisection.

Run: ``python benchmarks/search_trials.py`` (no torch, no GPU: the oracle is a formula).

For each memory curve and each limit L, the oracle says "fits" exactly for ``b <= L`` and
reports the curve's peak for sizes that fit (``None`` for failures); the capacity is the
curve's peak at L. The table gives the trials :func:`search_max_batch` ran, the trials the
plain reference :func:`doubling_bisection` ran, and ``ceil(log2 L) + 3``.

``--module`` compares another implementation of the same API (a dotted module path
importable from ``PYTHONPATH``), e.g. a candidate strategy kept outside the tree.
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
from collections.abc import Callable

MIB = 1 << 20
LIMITS = (7, 100, 1000, 4097, 6000, 8191, 100_000)


def linear(b: int) -> float:
    return 300 * MIB + 40_000 * b


def quadratic(b: int) -> float:  # an attention-like term
    return 300 * MIB + 40_000 * b + 3 * b * b


def noisy(b: int) -> float:  # +-2 % on the reported peak, the same for a given size
    return linear(b) * (1 + 0.02 * random.Random(b).uniform(-1, 1))


def piecewise(b: int) -> float:  # the optimizer step dominates small batches
    return max(900 * MIB + 1_000 * b, 300 * MIB + 40_000 * b)


def rounded(b: int) -> float:  # 2 MiB allocator segments
    return math.ceil(linear(b) / (2 * MIB)) * 2 * MIB


CURVES: dict[str, Callable[[int], float]] = {
    "linear": linear,
    "quadratic": quadratic,
    "noisy": noisy,
    "piecewise": piecewise,
    "rounded": rounded,
}


def count(search: Callable[..., object], curve: Callable[[int], float], limit: int) -> int:
    """Trials one search runs on ``curve`` with limit ``limit`` (checked to be exact)."""
    calls: list[int] = []

    def fits(b: int) -> tuple[bool, int | None]:
        calls.append(b)
        return (True, int(curve(b))) if b <= limit else (False, None)

    result = search(fits)
    assert result.max_batch_size == limit, (limit, calls)  # type: ignore[attr-defined]
    assert len(calls) == len(set(calls)), calls
    return len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="memkit.probing.search")
    args = parser.parse_args()
    mod = importlib.import_module(args.module)

    print(f"search: {args.module}")
    print(f"{'curve':<10} {'limit':>7} {'search':>7} {'doubling+bisection':>19} {'log2+3':>7}")
    totals: dict[str, list[int]] = {}
    for name, curve in CURVES.items():
        for limit in LIMITS:
            ours = count(
                lambda f, c=curve, lim=limit: mod.search_max_batch(f, capacity_bytes=int(c(lim))),
                curve,
                limit,
            )
            ref = count(lambda f: mod.doubling_bisection(f), curve, limit)
            bound = math.ceil(math.log2(limit)) + 3
            flag = "  <- more than the reference" if ours > ref else ""
            print(f"{name:<10} {limit:>7} {ours:>7} {ref:>19} {bound:>7}{flag}")
            sums = totals.setdefault(name, [0, 0])
            sums[0] += ours
            sums[1] += ref
    print()
    for name, (ours, ref) in totals.items():
        print(f"{name:<10} total {ours:>4} trials against {ref:>4} for doubling + bisection")


if __name__ == "__main__":
    main()
