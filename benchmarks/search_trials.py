"""How many trials does the batch-size search take? Compared with doubling + bisection.

Run: ``python benchmarks/search_trials.py`` (no torch, no GPU: the oracle is a formula).

For each memory curve and each limit L, the oracle says "fits" exactly for ``b <= L`` and
reports the curve's peak for sizes that fit (``None`` for failures); the capacity is the
curve's peak at L. The table gives the trials :func:`search_max_batch` ran, the trials the
plain reference :func:`doubling_bisection` ran, and ``ceil(log2 L) + 3``.

``--module`` compares another implementation of the same API (a dotted module path
importable from ``PYTHONPATH``), e.g. a candidate strategy kept outside the tree.

``--recorded FILE`` replays a probe recorded on a real device (``memkit probe ... --json``, e.g.
``tests/fixtures/h200_probe_nanogpt_call1.json``), or an estimate's (``memkit estimate ... --json``:
its ``reserved_peak`` and ``allocated_peak``), or a file of such records under ``"cases"``
(``tests/fixtures/estimate_sweep_trials.json``): the sizes up to the recorded answer fit and
the larger ones do not; a size's peaks are the recorded ones, or, between recorded sizes, the
straight line between their neighbours, the reserved peak then rounded up as the caching
allocator reserves (whole 2 MiB multiples, ``memkit.simulated.allocator.K_ROUND_LARGE``). A
failure reports what it needed at least, as a real out-of-memory error does (in use plus the
request): the recorded bytes at a recorded size, else the straight line through the largest
fit's reserved peak and the recorded failures' bytes (their own slope beyond the last; at
least the capacity plus one; ``None`` when no failure recorded its bytes). The
search aims with the allocated peak and decides with the reserved one, as on the device, and
with the peaks of the step's parts where every fit recorded as many (``part_peaks``, in a
probe's JSON since 2026-11-28; each part interpolated as the allocated peak is): then it runs
the sizes the probe ran. It prints ``trials N, answer B`` and the sizes run.

``--two-measures N`` runs N random curves with a smooth (allocated) peak under a deciding
(reserved) one, as on CUDA: a per-sample cost, a gap between the two that grows and then stops,
the reserved peak rounded to 1 B, 2 MiB or 20 MiB, and sometimes a 50-400 MiB block from one
size on (often the limit's next); it prints the search's trials and OOM trials against doubling
+ bisection's (seeded: the same curves every run).

``--recorded FILE --after-failure`` prints, for each record, what the search ran after its first
failure against three plain ways of closing the same bracket that use fit/no fit only (which an
allocator's blocks leave as the only sure reading): bisection, a split a quarter of the way up
from the largest fit, and galloping up from it (1, 2, 4 ... sizes) then bisecting.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _interpolate(points: list[tuple[int, int]], b: int) -> float:
    """The straight line between the recorded neighbours of ``b`` (the end segments beyond)."""
    sizes = [x for x, _ in points]
    if len(points) == 1:
        return float(points[0][1])
    i = min(max(bisect.bisect_left(sizes, b), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


def _probe_trial(trial: dict) -> dict:
    """A trial in the probe's keys; ``memkit estimate --json`` names its peaks
    ``reserved_peak`` (decides the fit) and ``allocated_peak``."""
    if "peak_bytes" in trial:
        return trial
    return {**trial, "peak_bytes": trial["reserved_peak"],
            "peak_allocated_bytes": trial["allocated_peak"]}  # fmt: skip


class Replay:
    """An oracle that replays a recorded probe (see the module docstring)."""

    def __init__(self, record: dict) -> None:
        from memkit.simulated.allocator import K_ROUND_LARGE

        self.segment = K_ROUND_LARGE
        trials = [_probe_trial(t) for t in record["trials"]]
        fit = sorted(
            (t["batch_size"], t["peak_bytes"], t.get("peak_allocated_bytes") or t["peak_bytes"])
            for t in trials
            if t["fits"]
        )
        parts = {t["batch_size"]: tuple(t.get("part_peaks") or ()) for t in trials if t["fits"]}
        counts = {len(p) for p in parts.values()}
        width = counts.pop() if len(counts) == 1 else 0  # (the search's rule: all or none)
        self.parts = [[(b, parts[b][i]) for b, _, _ in fit] for i in range(width)]
        failed = [t["batch_size"] for t in trials if not t["fits"]]
        self.limit = record["max_batch_size"]
        if not fit or any(b <= self.limit for b in failed) or fit[-1][0] != self.limit:
            raise SystemExit("the record does not bracket its answer (B fit, larger sizes failed)")
        self.capacity = int(record.get("capacity_bytes") or record["usable_bytes"])
        self.reserved = [(b, r) for b, r, _ in fit]
        self.allocated = [(b, a) for b, _, a in fit]
        self.needs = {t["batch_size"]: t["peak_bytes"] for t in trials if not t["fits"]}
        self.calls: list[int] = []

    def __call__(self, b: int) -> tuple[bool, int | None, tuple[int, ...] | None, int | None]:
        self.calls.append(b)
        if b > self.limit:
            return False, self._need(b), None, None
        parts = tuple(int(_interpolate(points, b)) for points in self.parts) or None
        recorded = dict(self.reserved)
        if b in recorded:
            return True, recorded[b], parts, dict(self.allocated)[b]
        reserved = math.ceil(_interpolate(self.reserved, b) / self.segment) * self.segment
        reserved = min(reserved, self.capacity)  # it fit: it reserved at most the capacity
        allocated = min(int(_interpolate(self.allocated, b)), reserved)
        return True, reserved, parts, allocated

    def _need(self, b: int) -> int | None:
        """What a failure at ``b`` needed at least (see the module docstring)."""
        if b in self.needs or not any(self.needs.values()):
            return self.needs.get(b)
        points = [self.reserved[-1], *sorted((f, n) for f, n in self.needs.items() if n)]
        return max(self.capacity + 1, int(_interpolate(points, b)))


def replay(record: dict, module: str) -> tuple[int, int | None, list[int]]:
    """``(trials, answer, sizes run)`` of the search on a recorded probe or estimate."""
    mod = importlib.import_module(module)
    oracle = Replay(record)
    result = mod.search_max_batch(
        oracle,
        capacity_bytes=oracle.capacity,
        min_batch=record.get("min_batch") or 1,
        max_batch=record.get("max_batch"),
    )
    return len(oracle.calls), result.max_batch_size, oracle.calls


def _close(lo: int, hi: int, limit: int, step: Callable[[int, int, int], int]) -> tuple[int, int]:
    """``(trials, failures)`` closing the bracket ``(lo, hi)`` on a limit, ``step`` choosing."""
    trials = failures = 0
    run = 0  # sizes galloped so far (for the gallop)
    while hi - lo > 1:
        b = min(max(step(lo, hi, run), lo + 1), hi - 1)
        trials, run = trials + 1, run + 1
        if b <= limit:
            lo = b
        else:
            hi, failures = b, failures + 1
    return trials, failures


CLOSERS: dict[str, Callable[[int, int, int], int]] = {
    "bisection": lambda lo, hi, run: (lo + hi) // 2,
    "quarter": lambda lo, hi, run: lo + (hi - lo) // 4,
}


def _gallop(lo: int, hi: int, limit: int) -> tuple[int, int]:
    trials, step = 0, 1
    while hi - lo > 1:
        b, trials = min(lo + step, hi - 1), trials + 1
        if b > limit:
            rest = _close(lo, b, limit, CLOSERS["bisection"])
            return trials + rest[0], 1 + rest[1]
        lo, step = b, step * 2
    return trials, 0


def _print_after_failure(records: dict[str, dict], module: str) -> None:
    names = ("search", "bisection", "quarter", "gallop")
    print(f"{'record':<28} {'bracket':>14} {'answer':>6}  " + "  ".join(f"{n:>10}" for n in names))
    totals = dict.fromkeys(names, (0, 0))
    for name, record in records.items():
        _, answer, sizes = replay(record, module)
        assert answer is not None
        first = next((i for i, b in enumerate(sizes) if b > answer), None)
        if first is None:
            continue
        lo, hi = max(b for b in sizes[:first] if b <= answer), sizes[first]
        after = sizes[first + 1 :]
        row = {
            "search": (len(after), sum(b > answer for b in after)),
            **{n: _close(lo, hi, answer, f) for n, f in CLOSERS.items()},
            "gallop": _gallop(lo, hi, answer),
        }
        totals = {n: (totals[n][0] + row[n][0], totals[n][1] + row[n][1]) for n in names}
        cells = "  ".join(f"{t:>4} ({o} x)" for t, o in row.values())
        print(f"{name:<28} {f'({lo}, {hi})':>14} {answer:>6}  {cells}")
    cells = "  ".join(f"{t:>4} ({o} x)" for t, o in totals.values())
    print(f"{'total (trials, failures)':<28} {'':>14} {'':>6}  {cells}")


def two_measures(seed: int) -> tuple[Callable[[int], tuple[bool, int, None, int | None]], int]:
    """``(oracle, capacity)`` of one random two-measure curve (see the module docstring)."""
    rng = random.Random(seed)
    per = rng.choice([20_000, 40_000, 100_000, 1_000_000, 12_000_000])
    fixed = rng.choice([100, 300, 900]) * MIB
    gap_slope, gap_until = rng.choice([0, per // 4, per // 2]), rng.choice([64, 256, 1000, 1 << 40])
    block, step = rng.choice([0, 50, 200, 400]) * MIB, rng.choice([1, 2 * MIB, 20 * MIB])
    limit = rng.randint(3, 20000)
    block_at = limit + rng.choice([1, 1, 2, 5, 50, 1 << 40])

    def reserved(b: int) -> int:
        r = fixed + per * b + 10 * MIB + gap_slope * min(b, gap_until)
        return -(-r // step) * step + (block if b >= block_at else 0)

    capacity = reserved(limit) + rng.choice([0, per // 3, 3 * per, 50 * per])

    def fits(b: int) -> tuple[bool, int, None, int | None]:
        ok = reserved(b) <= capacity
        return ok, reserved(b), None, (fixed + per * b) if ok else None

    return fits, capacity


def _recording(fits: Callable[[int], Any]) -> tuple[Callable[[int], Any], list[int]]:
    """``fits``, and the list of the sizes it is called with."""
    calls: list[int] = []

    def recorded(b: int) -> Any:
        calls.append(b)
        return fits(b)

    return recorded, calls


def _print_two_measures(n: int, module: str) -> None:
    mod = importlib.import_module(module)
    trials = ooms = over = ref_trials = ref_ooms = 0
    for seed in range(n):
        fits, capacity = two_measures(seed)
        ours, calls = _recording(fits)
        theirs, ref = _recording(lambda b, fits=fits: fits(b)[:2])
        result = mod.search_max_batch(ours, capacity_bytes=capacity)
        plain = mod.doubling_bisection(theirs)
        answer = result.max_batch_size
        assert answer == plain.max_batch_size and len(calls) == len(set(calls)), seed
        failed = sum(b > answer for b in calls)
        trials, ooms, over = trials + len(calls), ooms + failed, over + (failed > 2)
        ref_trials, ref_ooms = ref_trials + len(ref), ref_ooms + sum(b > answer for b in ref)
    print(f"{n} two-measure curves: search {trials} trials, {ooms} OOM ({over} searches above 2); "
          f"doubling + bisection {ref_trials} trials, {ref_ooms} OOM")  # fmt: skip


def _print_replay(record: dict, module: str) -> None:
    trials, answer, sizes = replay(record, module)
    recorded = " ".join(f"{t['batch_size']}{'' if t['fits'] else 'x'}" for t in record["trials"])
    ran = " ".join(f"{b}{'' if b <= record['max_batch_size'] else 'x'}" for b in sizes)
    answer_was = record["max_batch_size"]
    print(f"recorded: trials {len(record['trials'])}, answer {answer_was}: {recorded}")
    print(f"replayed: {ran}")
    print(f"trials {trials}, answer {answer}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="memkit.probing.search")
    parser.add_argument("--recorded", type=Path, default=None, metavar="FILE")
    parser.add_argument("--after-failure", action="store_true")
    parser.add_argument("--two-measures", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.two_measures:
        _print_two_measures(args.two_measures, args.module)
        return
    if args.after_failure and args.recorded is None:
        parser.error("--after-failure needs --recorded FILE")
    if args.recorded is not None and not args.recorded.is_file():
        parser.error(f"--recorded {args.recorded}: no such file (expected a probe's --json output, "
                     "e.g. tests/fixtures/h200_probe_nanogpt_call1.json)")  # fmt: skip
    if args.recorded is not None:
        data = json.loads(args.recorded.read_text())
        sweep = {f"seq_len {r['seq_len']}": r for r in data.get("seq_lens", ())}  # --seq-len
        records = sweep or data.get("cases", {"": data})
        if args.after_failure:
            _print_after_failure(records, args.module)
            return
        for name, record in records.items():
            if name:
                print(f"{name}: {record.get('command', '')}")
            _print_replay(record, args.module)
        return
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
