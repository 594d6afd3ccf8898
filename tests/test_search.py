"""The batch-size search as a pure function of an oracle: exact, never repeats, fast.

No torch here. Curves model what trials measure: linear, the convex "flat optimizer step, then
activations" shape of real training, quadratic (attention), allocator-rounded steps and noisy
peaks. The oracle's truth is monotone (``b`` fits iff ``b <= L``); its reported peaks follow the
curve, so the search's model sees realistic numbers.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import json
import math
import random
import re
import runpy
import sys
from pathlib import Path

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


@functools.cache  # the same value for b every time; a Random per call cost seconds here
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
    dense = list(range(1, 1025))  # every small limit: where off-by-ones live
    special = [1535, 1536, 1537, 2047, 2048, 2049, 4095, 4096, 4097, 5000, 6143, 6144, 7000,
               8191, 8192, 8193, 65536, 99999, 100000]  # fmt: skip
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


@pytest.mark.parametrize(("name", "limit"), [("piecewise", 16372), ("noisy", 14418)])
def test_limits_where_the_search_once_paid_more_than_its_bound(name, limit):
    """Found by a wider sample of limits. Piecewise at 16372 took 22 trials (bound 17): the
    flat part's line, refuted by 16384's failure, was aimed with again after each bisection
    (16383x, 16382x, 16381x ...). Noisy at 14418 took 29 (doubling + bisection: 28): a
    near-limit step from free memory the noise makes no measurement left the reference's pace.
    Exact in both."""
    curve = CURVES[name]
    fits, calls = oracle(curve, limit)
    result = search_max_batch(fits, capacity_bytes=capacity_for(curve, limit))
    check(result, calls, limit)
    ref_fits, ref_calls = oracle(curve, limit)
    doubling_bisection(ref_fits)
    bound = max(math.ceil(math.log2(limit)) + 3, 5) if name in TYPICAL[:2] else len(ref_calls)
    assert len(calls) <= min(bound, len(ref_calls)), _sizes(result)
    if name in TYPICAL:  # the refuted line is not aimed with: 9 OOM trials before, now 2
        assert sum(not t.fits for t in result.trials) <= 2, _sizes(result)


def _oom_counts(name: str, limits: list[int]) -> tuple[int, int, int]:
    """(searches with more than 2 OOM trials, OOM trials, trials) over ``limits``."""
    over = ooms = trials = 0
    for limit in limits:
        fits, calls = oracle(CURVES[name], limit)
        result = search_max_batch(fits, capacity_bytes=capacity_for(CURVES[name], limit))
        check(result, calls, limit)
        failed = sum(not t.fits for t in result.trials)
        over, ooms, trials = over + (failed > 2), ooms + failed, trials + len(calls)
    return over, ooms, trials


OOM_SAMPLE = random.Random(24).sample(range(1, 100_001), 100)


def test_a_convex_curve_is_aimed_at_with_the_parabola_its_fits_bend_along():
    """Issue 24: secants of a convex curve (a contrastive loss's B x B similarity matrix)
    overshoot, and the search alternated overshooting aims and bisections (30 of these 100
    searches paid more than 2 OOM trials, 233 OOM trials in all: ``1 2 4 256 6743x 3499 5121x
    4310 5048x ...``). Four fits that bend alike are aimed at with the parabola through the
    last three: none pays more than 2, 100 in all."""
    over, ooms, _ = _oom_counts("quadratic", OOM_SAMPLE)
    assert over <= 3 and ooms <= 110, (over, ooms)


@pytest.mark.parametrize(("name", "before"), [("rounded", (587, 2321)), ("noisy", (812, 3089))])
def test_rounded_and_noisy_curves_pay_no_more_than_before_the_parabola(name, before):
    """Their peaks bend by noise or by rounding, not alike: the parabola must stay off. The
    OOM trials and trials over the same sample before it, as ceilings."""
    _, ooms, trials = _oom_counts(name, OOM_SAMPLE)
    assert ooms <= before[0] and trials <= before[1], (ooms, trials)


def test_a_level_pair_after_the_predicted_limit_fit_gallops_on():
    """A B x B curve with peaks rounded to 2 MiB: the parabola puts 25447 just under the limit,
    25447 and 25448 fit with the same rounded peak, and their level secant gives no line.
    Doubling's grid then paid 12 OOM trials down from 32768 (``25448 32768x 29108x ... 25450x
    25449``); the limit is still just above, so the steps gallop from the largest fit."""
    limit = 25449

    def peak(b: int) -> int:
        return math.ceil(quadratic(b) / (2 * MIB)) * 2 * MIB

    fits, calls = oracle(peak, limit)
    result = search_max_batch(fits, capacity_bytes=peak(limit))
    check(result, calls, limit)
    assert sum(not t.fits for t in result.trials) <= 2, _sizes(result)


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


@pytest.mark.parametrize("search", [search_max_batch, doubling_bisection])
def test_a_search_resumed_from_known_trials_runs_none_of_their_sizes_again(search):
    """The probe resumes its search when a fit turned out to be measured too early (a step
    whose work varies, seen late): from the trials that still hold, starting at the old
    answer. The known trials lead the result; no size among them is run again, and the answer
    is exact."""
    kwargs = {"capacity_bytes": capacity_for(linear, 300)} if search is search_max_batch else {}
    fits, _ = oracle(linear, 300)
    known = search(fits, **kwargs).trials[:3]  # 1, 2, 4: fit
    assert [t.batch_size for t in known] == [1, 2, 4] and all(t.fits for t in known)
    fits, calls = oracle(linear, 300)
    result = search(fits, start=420, known=known, **kwargs)
    assert result.trials[:3] == known and calls[0] == 420
    assert not {1, 2, 4} & set(calls) and len(calls) == len(set(calls))
    by_size = {t.batch_size: t for t in result.trials}
    assert result.max_batch_size == 300 and by_size[300].fits and not by_size[301].fits


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


def test_the_recommendation_has_no_smaller_size_that_needed_more_than_the_margin():
    # reserved peaks need not grow with the batch (allocator rounding, a kernel changing with
    # the shape): here size 4 peaks above the margin and the larger sizes below it again
    def bumpy(b: int) -> float:
        return 960 if b == 4 else 100 * b

    fits, calls = oracle(bumpy, 10)
    result = search_max_batch(fits, capacity_bytes=1000, margin=0.05)
    assert result.max_batch_size == 10 and 4 in calls and 8 in calls  # 8 measured 800 <= 950
    rec = result.recommended_batch_size
    assert rec is not None and rec < 4 and result.margin_met
    assert all(bumpy(t.batch_size) <= 950 for t in result.trials if t.fits and t.batch_size <= rec)


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


def _sizes(result) -> str:
    return " ".join(f"{t.batch_size}{'' if t.fits else 'x'}" for t in result.trials)


def test_a_fit_that_leaves_less_than_a_sample_free_is_followed_by_the_verification():
    """x-transformers' copy task at 256 MiB: about 10.8 MiB a sample, 20 fits with 2.8 MiB
    free. The measured free memory and slope say 21 does not fit: the search runs 21 next,
    not doubling's 32 (which paid 4 OOM trials: 32 26 23 21)."""

    def peak(b: int) -> float:  # a flat optimizer step below 3 samples, a kink at 8
        return max(60 * MIB, 37.2 * MIB + 10.8 * MIB * b) + (3 * MIB if b == 8 else 0)

    result = search_max_batch(lambda b: (peak(b) <= 256 * MIB, int(peak(b))),
                              capacity_bytes=256 * MIB)  # fmt: skip
    assert result.max_batch_size == 20
    assert [t.batch_size for t in result.trials if not t.fits] == [21], _sizes(result)
    assert result.trials[-2].batch_size == 20 and result.trials[-1].batch_size == 21


def test_a_fit_a_few_samples_below_the_limit_aims_at_it_inside_the_bracket():
    """LBFGS (time_sequence_prediction) at 48 MiB: 0.54 MiB a sample, 50 fits with 0.43 MiB
    free. After an overshoot, a fit a few samples below the limit is followed by the
    predicted limit, not by the bisection's midpoint (which paid 64 57 53 51)."""

    def peak(b: int) -> float:
        kink = 0.2 * MIB if b in (2, 8) else 0
        return max(20 * MIB, 47.57 * MIB - 0.54 * MIB * (50 - b)) + kink

    result = search_max_batch(lambda b: (peak(b) <= 48 * MIB, int(peak(b))),
                              capacity_bytes=48 * MIB)  # fmt: skip
    assert result.max_batch_size == 50
    assert sum(not t.fits for t in result.trials) <= 2, _sizes(result)


def test_a_smooth_measure_aims_where_the_rounded_one_decides():
    """On CUDA the reserved peak (what runs out) moves in 20 MiB segments; the allocated peak
    grows smoothly. Aiming with the smooth one plus the gap measured at the largest fit finds
    the limit in fewer trials than aiming with the rounded one."""
    seg = 20 * MIB

    def allocated(b: int) -> int:
        return 250 * MIB + 24 * MIB * b

    def reserved(b: int) -> int:
        return -(-(allocated(b) + 30 * MIB) // seg) * seg

    capacity = 3 * 1024 * MIB
    limit = max(b for b in range(1, 200) if reserved(b) <= capacity)

    def with_aim(b: int):
        return reserved(b) <= capacity, reserved(b), None, allocated(b)

    smooth = search_max_batch(with_aim, capacity_bytes=capacity)
    rounded = search_max_batch(lambda b: with_aim(b)[:2], capacity_bytes=capacity)
    assert smooth.max_batch_size == rounded.max_batch_size == limit
    assert len(smooth.trials) < len(rounded.trials), (_sizes(smooth), _sizes(rounded))
    assert len(smooth.trials) <= 6, _sizes(smooth)
    assert all(t.aim_bytes == allocated(t.batch_size) for t in smooth.trials if t.fits)
    assert "aim_bytes" not in smooth.trials[0].to_dict()


FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


def test_the_recorded_h200_probe_of_nanogpt_replays_to_122_in_at_most_7_trials(monkeypatch, capsys):
    """memkit probe of nanoGPT's shakespeare_char GPT on an H200 under a 3 GiB cap (bf16,
    2026-11-26): the run doubled 1..128 and took 14 trials (3 OOM). Replayed with the
    recorded peaks (interpolated between recorded sizes, reserved rounded as the caching
    allocator reserves), the search finds the same exact answer in at most 7. The benchmark
    runs as a script, in this process (a new one would spend its time importing)."""
    fixture = FIXTURES / "h200_probe_nanogpt_call1.json"
    script = ROOT / "benchmarks" / "search_trials.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--recorded", str(fixture)])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    trials, answer = (int(x) for x in re.fullmatch(r"trials (\d+), answer (\d+)", last).groups())
    assert answer == 122 and trials <= 7, out
    assert sum(s.endswith("x") for s in out.splitlines()[-2].split()) <= 2, out


@pytest.mark.parametrize(
    ("fixture", "answer", "trials", "ooms"),
    [
        ("h200_probe_nanogpt_call2.json", 116, 7, 2),
        ("h200_probe_nanogpt_call3.json", 117, 7, 1),
        ("h200_probe_nanogpt_call5.json", 118, 7, 1),  # 2026-11-28: 6 trials, 1 OOM on the card
        ("h200_probe_nanogpt_call6.json", 120, 7, 1),  # the same day, 9 trials, 2 OOM on the card
        ("h200_probe_gpt2_seqlen_call3.json", 162, 7, 2),  # sequence 512
    ],
)
def test_the_recorded_h200_probes_replay_to_their_answers(fixture, answer, trials, ooms):
    """The other probes recorded on an H200 (nanoGPT under 3 GiB, 2026-11-26, 27 and 28 twice; GPT-2
    at sequence 512 under 8 GiB, 2026-11-27, where the real search ran 9 trials, 2 of them
    failures). Replayed, each finds the recorded answer; aiming with the growth of the gap
    between the reserved and the allocated peak (nanoGPT's: 23 MB at 4 samples, 116 MB at
    116), the replays of the two sparse nanoGPT recordings take 7 trials where they took 14
    and 12."""
    records = json.loads((FIXTURES / fixture).read_text())
    record = (records.get("seq_lens") or [records])[-1]
    n, found, sizes = _bench().replay(record, "memkit.probing.search")
    assert found == answer == record["max_batch_size"], sizes
    assert n <= trials and sum(b > answer for b in sizes) <= ooms, sizes


def test_gpt2_at_sequence_128_on_the_h200_replays_with_at_most_2_oom_trials():
    """GPT-2 at sequence 128 under 8 GiB on the H200: the real search paid 3 OOM (`1 2 4 256
    671x 463 567 638x 602 634 636x 635`). Aiming with the gap's growth, the first aim is the
    limit, 635, and fits with 0.3 GB reserved free; 636 needs a new block the smooth peaks do
    not show. Growing into that free memory paid 5 OOM (`635 660x 647x 641x 638x 636x`); the
    size after an aimed limit that fit is checked first: 636 fails, and the search ends."""
    record = json.loads((FIXTURES / "h200_probe_gpt2_seqlen_call3.json").read_text())
    n, found, sizes = _bench().replay(record["seq_lens"][0], "memkit.probing.search")
    assert found == 635, sizes
    assert sum(b > found for b in sizes) <= 2 and n <= 7, sizes


def _blocked(block_at: int):
    """A smooth (allocated) peak and a deciding (reserved) one whose gap grew up to 256
    samples and then stopped, and a 400 MiB block from ``block_at`` on: the line aims at 999,
    where the reserved peak then shows room for hundreds of samples more."""
    per = 40_000

    def allocated(b: int) -> int:
        return 300 * MIB + per * b

    def reserved(b: int) -> int:
        gap = 10 * MIB + per * min(b, 256) // 2
        return allocated(b) + gap + (400 * MIB if b >= block_at else 0)

    capacity = allocated(999) + 10 * MIB + per * 128 + per * (999 - 256) // 2
    calls: list[int] = []

    def fits(b: int):
        calls.append(b)
        return reserved(b) <= capacity, reserved(b), None, allocated(b)

    return fits, calls, capacity


@pytest.mark.parametrize(("block_at", "expected"), [
    (1000, [1, 2, 4, 256, 999, 1000]),  # the check fails: done in 6, 1 OOM
    (3000, [1, 2, 4, 256, 999, 1000, 1370, 1371]),  # the room was real: the step it came before
])  # fmt: skip
def test_the_size_after_an_aimed_limit_is_checked_where_a_smooth_measure_aims(block_at, expected):
    """GPT-2's pattern (above) on a curve: the aim with the smooth peaks hits the limit, and
    the block after it shows only when the next size runs. Where the check fits, the search
    goes on as it would have without it (without the check: 1370, 1371)."""
    fits, calls, capacity = _blocked(block_at)
    check(search_max_batch(fits, capacity_bytes=capacity), calls, min(block_at - 1, 1370))
    assert calls == expected


def test_an_aim_read_at_a_few_samples_is_not_checked():
    """A line through 1, 2 and 4 samples aims 22 times further: a rough aim, and no check of
    the size after it (the gap stops growing at 4 samples, so the reserved peak shows room)."""

    def allocated(b: int) -> int:
        return 300 * MIB + 1_000_000 * b

    def reserved(b: int) -> int:
        return allocated(b) + 10 * MIB + 500_000 * min(b, 4)

    capacity = reserved(100) + 30_000_000
    calls: list[int] = []

    def fits(b: int):
        calls.append(b)
        return reserved(b) <= capacity, reserved(b), None, allocated(b)

    check(search_max_batch(fits, capacity_bytes=capacity), calls, 130)
    assert calls == [1, 2, 4, 88, 130, 131]


def test_the_size_after_an_aimed_limit_is_checked_once():
    """Reserved peaks in 20 MiB segments over a smooth allocated peak: the aim at 20075 fits
    and is checked (20076 fits); the next aimed limit, 20173, is not checked again."""

    def allocated(b: int) -> int:
        return 900 * MIB + 40_000 * b

    def reserved(b: int) -> int:
        return -(-(allocated(b) + 10 * MIB) // (20 * MIB)) * 20 * MIB

    calls: list[int] = []

    def fits(b: int):
        calls.append(b)
        return reserved(b) <= 1763607680, reserved(b), None, allocated(b)

    check(search_max_batch(fits, capacity_bytes=1763607680), calls, 20185)
    assert calls[5:10] == [20075, 20076, 20124, 20173, 20222], calls


def test_the_gap_between_the_deciding_and_the_smooth_peak_grows_with_the_batch():
    """Bracket.gap_slope: over the widest span (from the largest fit at most half the
    largest's size), never negative, 0 without a smooth measure."""
    from memkit.probing.bracket import Bracket

    def bracket(peaks):
        s = Bracket(lambda b: peaks[b], min_batch=1, max_batch=1 << 20, clock=lambda: 0.0,
                    on_trial=None)  # fmt: skip
        for b in sorted(peaks):
            s.run(b)
        return s

    gpt2 = {4: (True, 140509184, None, 130448384), 256: (True, 3514826752, None, 3207154688)}
    slope = bracket(gpt2).gap_slope()
    assert slope == pytest.approx((307672064 - 10060800) / 252)
    shrinking = {4: (True, 140509184, None, 100000000), 256: (True, 3514826752, None, 3500000000)}
    assert bracket(shrinking).gap_slope() == 0.0
    no_smooth = {4: (True, 140509184), 256: (True, 3514826752)}
    assert bracket(no_smooth).gap_slope() == 0.0


def test_the_replay_oracle_interpolates_and_rounds_as_the_allocator_reserves():
    bench = _bench()
    record = json.loads((FIXTURES / "h200_probe_nanogpt_call1.json").read_text())
    oracle = bench.Replay(record)
    assert oracle(122) == (True, 3221225472, None, 3171573248)  # recorded as is
    ok, reserved, _, allocated = oracle(100)  # between 96 and 112
    assert ok and reserved % (2 * MIB) == 0 and allocated <= reserved
    assert 2545942528 < reserved < 2973761536 and 2535764480 < allocated < 2947731968
    assert oracle(123)[0] is False
    # an unrecorded failure needs at least what the largest smaller one needed, and more
    fails, need, _, _ = oracle(1000)
    assert fails is False and need > oracle(128)[1] > oracle.capacity


def test_a_step_with_linear_parts_and_a_convex_one_pays_at_most_two_oom_trials():
    """CLIP's step on the simulated device: each part's peaks as a real probe at 512 MiB
    recorded them at its sizes (1, 2, 4, 256, 3175, 4635, 5340), and elsewhere the parabola
    through three of the largest of them (so every part bends a little here, its linear ones
    too; the real linear parts were straighter): most parts grow about linearly with the
    batch, the B x B logits' part bends up and runs out first.
    A linear part's line, trusted, said the size that had just failed would fit (1750.6 after
    1750 failed, at 64 MiB): the search aimed at 1749 and failed again, although the failure
    had needed far more than a sample beyond the capacity. Near the limit the convex part's
    secants disagree (not steady), so the free memory went unused: at 256 MiB 3637 fit with
    1.2 samples free, then 3884 and 3638 ran out. Failures report what they needed at least
    (in use plus the request)."""
    recorded = json.loads((FIXTURES / "clip_probe_parts.json").read_text())["parts_by_batch"]
    sizes = sorted(int(b) for b in recorded)
    top = sizes[-4], sizes[-2], sizes[-1]

    def part(i: int, b: int) -> float:
        if str(b) in recorded:
            return recorded[str(b)][i]
        (x0, x1, x2), (y0, y1, y2) = top, [recorded[str(x)][i] for x in top]
        return (y0 * (b - x1) * (b - x2) / ((x0 - x1) * (x0 - x2))
                + y1 * (b - x0) * (b - x2) / ((x1 - x0) * (x1 - x2))
                + y2 * (b - x0) * (b - x1) / ((x2 - x0) * (x2 - x1)))  # fmt: skip

    def parts(b: int) -> tuple[int, ...]:
        return tuple(int(part(i, b)) for i in range(len(recorded["1"])))

    ooms = []
    for capacity_mib in (32, 64, 128, 256, 512):
        capacity = capacity_mib * MIB
        limit = bisect.bisect_right(range(1, 8192), capacity, key=lambda b: max(parts(b)))
        calls: list[int] = []

        def fits(b: int, capacity: int = capacity, calls: list[int] = calls):
            calls.append(b)
            peaks = parts(b)
            if max(peaks) > capacity:
                return False, capacity + (max(peaks) - capacity) // 2  # a lower bound
            return True, max(peaks), peaks

        result = search_max_batch(fits, capacity_bytes=capacity)
        check(result, calls, limit)
        ooms.append(sum(not t.fits for t in result.trials))
    assert max(ooms) <= 2, ooms


def _bench():
    path = ROOT / "benchmarks" / "search_trials.py"
    spec = importlib.util.spec_from_file_location("search_trials", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_probe_replays_from_its_json_to_the_sizes_it_ran():
    """A probe's JSON keeps the peaks of the step's parts the search aimed with: replayed
    (``benchmarks/search_trials.py --recorded``), the search runs the sizes the probe ran. A
    small CNN on the simulated device: without the parts the replay ran 1 2 4 8 13 16 17x
    where the probe ran 1 2 4 16 17x (a GPU's recording before 2026-11-28: 6 trials replayed
    against 9 run), so a replay could not say what the probe does."""
    import memkit

    cnn = runpy.run_path(str(ROOT / "examples" / "cnn.py"))
    model = cnn["build_model"]()
    optimizer = cnn["build_optimizer"](model.parameters())
    result = memkit.probe(
        model, cnn["make_batch"], optimizer=optimizer, train_step=cnn["train_step"],
        device="cpu", budget="48MiB",
    )  # fmt: skip
    record = json.loads(result.to_json())
    assert all(t.get("part_peaks") for t in record["trials"] if t["fits"]), record["trials"]
    n, found, sizes = _bench().replay(record, "memkit.probing.search")
    assert sizes == [t["batch_size"] for t in record["trials"]], sizes
    assert found == result.max_batch_size and n == len(result.trials)
    for t in record["trials"]:
        t.pop("part_peaks", None)
    assert _bench().replay(record, "memkit.probing.search")[2] != sizes  # (the parts matter)


SWEEP = json.loads((FIXTURES / "estimate_sweep_trials.json").read_text())["cases"]


def _sweep_ooms(name: str) -> tuple[int, list[int]]:
    record = SWEEP[name]
    trials, answer, sizes = _bench().replay(record, "memkit.probing.search")
    assert answer == record["max_batch_size"] and len(sizes) == len(set(sizes)) == trials
    return sum(b > answer for b in sizes), sizes


def test_the_estimate_sweep_replays_to_its_exact_answers():
    """memkit estimate on a new user's five models (issue 24): every recorded search replays
    (allocated and reserved peaks as recorded, interpolated between sizes, reserved rounded
    as the caching allocator reserves) to its exact answer, the answer's next size run."""
    for name, record in SWEEP.items():
        _, sizes = _sweep_ooms(name)
        assert record["max_batch_size"] + 1 in sizes, (name, sizes)


def test_two_measure_curves_are_exact_and_cost_no_more_than_measured(capsys):
    """500 random curves with a smooth peak under a deciding one (allocator segments, a gap
    that stops growing, blocks after the limit): every answer is doubling + bisection's (the
    benchmark asserts it), in 7911 trials with 1190 OOM trials where doubling + bisection
    takes 13424 with 3715 (2026-11-28; before the check after an aimed limit: 7827, 1195).
    The counts are ceilings."""
    _bench()._print_two_measures(500, "memkit.probing.search")
    out = capsys.readouterr().out
    trials, ooms = map(int, re.search(r"search (\d+) trials, (\d+) OOM", out).groups())
    assert trials <= 7911 and ooms <= 1190, out


def test_after_the_first_failure_no_plain_closing_of_the_bracket_meets_two_oom_trials(capsys):
    """Why the target below is still open: on the estimate's curves, the reserved peak's jump
    that ends the fits is found by running sizes, whatever the order. Closing each search's
    bracket after its first failure, the search fails 2.2 times a search, bisection 2.5, a
    quarter-way split 1.7 (at 21 more trials than the search's in all) and a gallop up from
    the largest fit 2.7: each, plus the first failure, is above 2."""
    bench = _bench()
    bench._print_after_failure(SWEEP, "memkit.probing.search")
    total = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [tuple(map(int, c)) for c in re.findall(r"(\d+) \((\d+) x\)", total)]
    (_, searched), (_, bisected), (_, quarter), (_, galloped) = cells
    assert 1 + min(searched, bisected, quarter, galloped) / len(SWEEP) > 2, total
    assert bench._close(10, 20, 10, bench.CLOSERS["bisection"]) == (3, 3)  # 15x 12x 11x
    assert bench._gallop(10, 20, 13) == (5, 3)  # 11 13 17x 15x 14x


@pytest.mark.xfail(strict=True, reason="issue 24: reserved peaks in allocator segments")
def test_the_estimate_sweep_pays_at_most_two_oom_trials():
    """Issue 24's target on the estimate's segment-rounded reserved peaks: at most 2 OOM
    trials per search. Not met yet (3-8 on 13 of 19 searches): the gap between reserved and
    allocated at the largest fit is no stable offset there (42 to 131 MiB on t5 at 2 GiB),
    so the aim overshoots, and the bracket after a failure is bisected."""
    over = {name: _sweep_ooms(name) for name in SWEEP}
    assert all(ooms <= 2 for ooms, _ in over.values()), over


def test_a_bend_from_a_floor_to_a_line_is_not_a_loss_over_pairs():
    """Review: a wide MLP's estimate peaks (16 -> 4096 -> 4096 -> 4096 -> 4, AdamW, 2 GiB) are
    flat where the optimizer step sets them and a line where backward does; a parabola fits
    that bend, and the report said the memory grew with the square of the batch. SimCLR's
    probe peaks (2N x 2N logits, sweep BT) are that parabola."""
    from memkit.probing.search import PairwiseFit, superlinear

    bend = [
        (1, 691065344),
        (2, 691065344),
        (4, 691065344),
        (8, 691065344),
        (16, 691065856),
        (32, 691066880),
        (2048, 691244032),
        (11285, 1347401216),
        (12392, 1440150016),
        (12629, 1461142528),
        (12652, 1461144576),
        (12664, 1461145088),
        (12670, 1461145600),
        (12671, 1461145600),
        (12672, 1461145600),
    ]
    assert PairwiseFit.from_points(bend) is None and not superlinear(bend)
    simclr = [(1, 6838308), (2, 6840356), (4, 6844452), (256, 11159080), (512, 24794664),
              (1024, 72513064), (2129, 268411884)]  # fmt: skip
    fit = PairwiseFit.from_points(simclr)
    assert fit is not None and 50 <= fit.per_pair_bytes <= 56  # 52 B a pair, by hand
