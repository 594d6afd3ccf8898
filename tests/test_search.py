"""The batch-size search as a pure function of an oracle: exact, never repeats, fast.

No torch here. Curves model what trials measure: linear, the convex "flat optimizer step, then
activations" shape of real training, quadratic (attention), allocator-rounded steps and noisy
peaks. The oracle's truth is monotone (``b`` fits iff ``b <= L``); its reported peaks follow the
curve, so the search's model sees realistic numbers.
"""

from __future__ import annotations

import math
import random

import pytest

from memkit.errors import ConfigError
from memkit.probing.search import LinearFit, doubling_bisection, search_max_batch, summary_fit

MIB = 1 << 20


def linear(b: int) -> float:
    return 300 * MIB + 40_000 * b


def piecewise(b: int) -> float:  # the optimizer step dominates small batches
    return max(900 * MIB + 1_000 * b, 300 * MIB + 40_000 * b)


def quadratic(b: int) -> float:
    return 300 * MIB + 40_000 * b + 3 * b * b


def rounded(b: int) -> float:  # 2 MiB allocator segments
    return math.ceil(linear(b) / (2 * MIB)) * 2 * MIB


def noisy(b: int) -> float:
    return linear(b) * (1 + 0.02 * random.Random(b).uniform(-1, 1))


CURVES = {"linear": linear, "piecewise": piecewise, "quadratic": quadratic,
          "rounded": rounded, "noisy": noisy}  # fmt: skip
TYPICAL = ("linear", "piecewise", "rounded")


def oracle(curve, limit: int):
    calls: list[int] = []

    def fits(b: int) -> tuple[bool, int | None]:
        calls.append(b)
        peak = int(curve(b))
        return (True, peak) if b <= limit else (False, None)

    return fits, calls


def capacity_for(curve, limit: int) -> int:
    return int(curve(limit))  # the peak at the limit: the curve crosses it there


def check(result, calls, limit, *, min_batch=1, max_batch=None) -> None:
    assert result.max_batch_size == limit
    assert len(calls) == len(set(calls)), f"repeated a size: {calls}"
    top = max_batch if max_batch is not None else 1 << 40
    assert all(min_batch <= b <= top for b in calls)
    by_size = {t.batch_size: t for t in result.trials}
    assert by_size[limit].fits
    if limit == max_batch:  # the cap: reached, reported as such, nothing above it run
        assert result.hit_max_batch and limit + 1 not in by_size
    else:
        assert not by_size[limit + 1].fits and not result.hit_max_batch
    assert [t.batch_size for t in result.trials] == calls


def limits_to_check() -> list[int]:
    rng = random.Random(7)
    dense = list(range(1, 2049))
    special = [4095, 4096, 4097, 5000, 6143, 6144, 7000, 8191, 8192, 8193, 65536, 99999, 100000]
    sample = rng.sample(range(2049, 100_001), 400)
    return dense + special + sample


LIMITS = limits_to_check()


@pytest.mark.parametrize("name", list(CURVES))
def test_exact_and_compared_with_doubling_bisection(name):
    """Exact everywhere, never more trials than doubling + bisection, and on typical curves
    within ceil(log2 L) + 3."""
    curve = CURVES[name]
    ours_total = reference_total = 0
    for limit in LIMITS:
        fits, calls = oracle(curve, limit)
        result = search_max_batch(fits, capacity_bytes=capacity_for(curve, limit))
        check(result, calls, limit)
        ref_fits, ref_calls = oracle(curve, limit)
        assert doubling_bisection(ref_fits).max_batch_size == limit
        ours_total += len(calls)
        reference_total += len(ref_calls)
        assert len(calls) <= len(ref_calls), (name, limit, calls, ref_calls)
        if name in TYPICAL[:2]:
            bound = math.ceil(math.log2(limit)) + 3 if limit > 1 else 1
            assert len(calls) <= max(bound, 5), (name, limit, calls)
    assert ours_total <= reference_total


def test_linear_curves_take_few_trials_whatever_the_limit():
    for limit in (7, 100, 1000, 4097, 6000, 8191, 100_000, 1_000_000):
        fits, calls = oracle(linear, limit)
        result = search_max_batch(fits, capacity_bytes=capacity_for(linear, limit))
        check(result, calls, limit)
        assert len(calls) <= 7, (limit, calls)


def test_doubling_bisection_is_exact_on_its_own():
    for limit in range(1, 300):
        fits, calls = oracle(linear, limit)
        check(doubling_bisection(fits), calls, limit)


def test_max_batch_cap_is_run_and_reported():
    fits, calls = oracle(linear, 5000)
    result = search_max_batch(fits, capacity_bytes=capacity_for(linear, 5000), max_batch=300)
    check(result, calls, 300, max_batch=300)
    assert result.hit_max_batch
    assert calls[-1] == 300 or 300 in calls


def test_min_batch_above_one_and_start():
    fits, calls = oracle(piecewise, 777)
    result = search_max_batch(fits, capacity_bytes=capacity_for(piecewise, 777), min_batch=8)
    check(result, calls, 777, min_batch=8)
    assert calls[0] == 8
    fits, calls = oracle(piecewise, 777)
    result = search_max_batch(fits, capacity_bytes=capacity_for(piecewise, 777), start=512)
    check(result, calls, 777)
    assert calls[0] == 512


def test_start_that_fails_bisects_down():
    fits, calls = oracle(linear, 37)
    result = search_max_batch(fits, capacity_bytes=capacity_for(linear, 37), start=1000)
    check(result, calls, 37)


def test_min_batch_failing_stops_after_one_trial():
    fits, calls = oracle(linear, 3)
    result = search_max_batch(fits, capacity_bytes=capacity_for(linear, 3), min_batch=4)
    assert result.max_batch_size is None and result.recommended_batch_size is None
    assert calls == [4]


def test_recommended_leaves_the_margin_in_bytes():
    limit = 5000
    capacity = capacity_for(linear, limit)
    fits, _ = oracle(linear, limit)
    result = search_max_batch(fits, capacity_bytes=capacity, margin=0.10)
    rec = result.recommended_batch_size
    assert rec < limit
    assert linear(rec) <= 0.9 * capacity
    # below a size that was run and fit (interpolated between two measurements), or run
    assert any(t.fits and t.batch_size >= rec for t in result.trials)
    assert result.margin_met


def test_capacity_unknown_falls_back_to_doubling_bisection():
    fits, calls = oracle(linear, 123)
    result = search_max_batch(fits, capacity_bytes=None)
    check(result, calls, 123)
    assert result.strategy == "doubling"
    assert result.recommended_batch_size == 123


def test_oracle_errors_propagate():
    def fits(b):
        if b > 10:
            raise ValueError("a real bug")
        return True, 100 * b

    with pytest.raises(ValueError, match="a real bug"):
        search_max_batch(fits, capacity_bytes=10**9)


@pytest.mark.parametrize(
    "kwargs",
    [dict(min_batch=0), dict(min_batch=5, max_batch=4), dict(margin=1.0), dict(capacity_bytes=0)],
)
def test_bad_arguments_are_config_errors(kwargs):
    args = dict(capacity_bytes=10**9)
    args.update(kwargs)
    with pytest.raises(ConfigError):
        search_max_batch(lambda b: (True, b), **args)


def test_linear_fit():
    fit = LinearFit.from_points([(1, 30), (2, 50), (4, 90)])
    assert (fit.fixed_bytes, fit.per_sample_bytes) == (10.0, 20.0)
    assert fit.max_batch_within(100) == 4


def test_reported_model_spans_the_search_not_its_last_cluster():
    """Rounded peaks just under the limit must not flatten the reported per-sample cost."""
    mib = 1 << 20

    def rounded(batch):  # 100 MiB fixed, 1 MiB per sample, peaks rounded up to 64 MiB
        peak = -(-(100 + batch) // 64) * 64 * mib
        return peak <= 4000 * mib, peak

    result = search_max_batch(rounded, capacity_bytes=4000 * mib)
    assert result.max_batch_size == 3868
    assert result.model is not None
    assert result.model.per_sample_bytes == pytest.approx(mib, rel=0.05)
    assert summary_fit([]) is None
    assert summary_fit([(8, 100)]) is None


def test_a_flat_part_does_not_hide_the_growing_one():
    """A step whose flat part (the optimizer step: weights, gradients, Adam's moments, and a
    little that grows with the batch) sets the peak at small sizes: a line through whole
    peaks sees three collinear points with a tiny slope, trusts them and jumps far past the
    limit (a large, slow OOM trial). With the step's parts reported, the search fits each
    part and aims where the growing one reaches the capacity."""
    limit = 60

    def flat(b: int) -> int:
        return 100 * MIB + 2_000 * b

    def growing(b: int) -> int:
        return 55 * MIB + 1_200_000 * b

    capacity = max(flat(limit), growing(limit))
    assert flat(4) > growing(4) and growing(limit + 1) > capacity  # the flat part hides it

    def fits(b: int, parts: bool):
        peaks = (flat(b), growing(b))
        ok = b <= limit
        return (ok, max(peaks), peaks if ok else ()) if parts else (ok, max(peaks))

    whole = search_max_batch(lambda b: fits(b, False), capacity_bytes=capacity)
    split = search_max_batch(lambda b: fits(b, True), capacity_bytes=capacity)
    assert whole.max_batch_size == split.max_batch_size == limit
    assert whole.trials[3].batch_size == 256 and not whole.trials[3].fits  # the overshoot
    assert [t.batch_size for t in split.trials] == [1, 2, 4, limit, limit + 1]
    assert split.trials[2].part_peaks == (flat(4), growing(4))


def test_parts_that_differ_between_sizes_fall_back_to_whole_peaks():
    """Control flow that depends on the batch (a different number of parts per size) gives
    no part-by-part line: the search uses the whole peaks, and stays exact."""
    def fits(b: int):
        peaks = tuple([int(linear(b))] * (1 + b % 3))
        return b <= 500, int(linear(b)), peaks

    result = search_max_batch(fits, capacity_bytes=int(linear(500)))
    assert result.max_batch_size == 500
    assert not result.trials[-1].fits and result.trials[-1].batch_size == 501
