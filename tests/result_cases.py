"""Results built from fixed numbers, one table of cases for every result kind: the interface
test (test_results.py) and the golden files (test_golden.py) both run over :data:`CASES`.

Nothing here varies between runs or machines: no clock, no host name, a fixed ``pid``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memkit.advice import Advice
from memkit.estimation.result import Estimate, EstimateBreakdown, EstimateSweep, EstimateTrial
from memkit.inspection.frames import Frame
from memkit.inspection.results import Allocation, DeviceInspection, OomEvent, SnapshotInspection
from memkit.probing.result import ProbeModes, ProbeResult, ProbeSweep, ProbeTrial
from memkit.results import Result
from memkit.snapshots.results import Categories, DeviceSnapshot, HostSnapshot, Snapshot, TensorInfo
from memkit.strategies import StrategyComparison, StrategyResult
from memkit.tracking.rank_gather import RanksReport, RankSummary
from memkit.tracking.report import (
    Breakdown,
    DeviceReport,
    LeakFinding,
    LeakSuspect,
    ModuleRecord,
    OomPostMortem,
    StepRecord,
    TimelinePoint,
    TrackReport,
)

MIB = 2**20
ADVICE = (Advice("accumulate", "use gradient accumulation", "batch 8 fits", "run 4 x 8"),)


def probe_result(seq_len: int | None = None, mode: str = "train") -> ProbeResult:
    trials = (
        ProbeTrial(8, True, 40 * MIB, 0.1, 40 * MIB),
        ProbeTrial(16, False, 90 * MIB, 0.2, error="out of memory"),
    )
    return ProbeResult(
        8, 8, trials, "cpu", "simulated cpu", "simulated", 64 * MIB, mode, 2, 0.05, 1, None,
        seq_len=seq_len, fixed_bytes=8.0 * MIB, per_sample_bytes=4.0 * MIB, advice=ADVICE,
    )  # fmt: skip


def probe_across_ranks() -> ProbeResult:
    """Two DDP ranks, the second one tighter; the first size that did not fit is a lower bound."""
    trials = (
        ProbeTrial(4, True, 50 * MIB, 0.25, 44 * MIB, rank_peaks=(40 * MIB, 50 * MIB), steps_run=3,
                   kept_growth_bytes=2 * MIB, optimizer_growth_bytes=2 * MIB),
        ProbeTrial(8, False, 70 * MIB, 0.5, error="CUDA out of memory",
                   rank_peaks=(None, 70 * MIB)),
    )  # fmt: skip
    return ProbeResult(
        4, 3, trials, "cuda:0", "NVIDIA H100 80GB HBM3", "torch.cuda reserved", 64 * MIB, "train",
        2, 0.05, 1, None, defaults=("steps: 2 (default)",), world_size=2,
        per_rank_peaks=(40 * MIB, 50 * MIB), per_rank_capacities=(80 * MIB, 64 * MIB), ddp=True,
    )  # fmt: skip


def estimate(seq_len: int | None = None) -> Estimate:
    return Estimate(
        "model.py", "ampere", 24 << 30, 512 * MIB, "train",
        (EstimateTrial(8, 10 * MIB, 12 * MIB, 10 * MIB, True, 0.01),), 8, 8, 0.05, 1, None,
        seq_len=seq_len, breakdown=EstimateBreakdown(8, 4 * MIB, 4 * MIB, 1 * MIB, 1 * MIB, 0, 0),
        fixed_bytes=200.0 * MIB, per_sample_bytes=1.25 * MIB, assumptions=("amp: none (fp32)",),
        advice=ADVICE,
        extra={"not": object()},
    )  # fmt: skip


def estimate_does_not_fit(seq_len: int) -> Estimate:
    """Batch 1 needs more than the card: no largest batch, no breakdown, no memory model."""
    trial = EstimateTrial(1, 30 << 30, 31 << 30, 29 << 30, False, 0.02)
    return Estimate(
        "model.py", "hopper", 24 << 30, 600 * MIB, "train", (trial,), None, None, 0.05, 1, None,
        seq_len=seq_len, amp="bf16", attention_kernels=("flash",), num_parameters=1000,
        trainable_parameters=1000, assumptions=("amp: bf16 autocast",), seconds=0.5,
        advice=ADVICE,
    )  # fmt: skip


def postmortem() -> OomPostMortem:
    breakdown = Breakdown(60 * MIB, 20 * MIB, 20 * MIB, 0, 20 * MIB, 0, 1, "backward", None)
    suspect = LeakSuspect("losses", "train", "train.py", 12, "losses.append(loss)", "container",
                          3, True)  # fmt: skip
    leak = LeakFinding("cpu", MIB, 1, 3, (suspect,), grown_bytes=3 * MIB)
    return OomPostMortem(
        "cpu", 2, "backward", "fc", True, True, "OutOfMemoryError: out of memory", "CPU",
        4 * MIB, 64 * MIB, 0, 60 * MIB, breakdown, (("fc", 8 * MIB),), leak, ADVICE,
        input_shape=(8, 3),
    )  # fmt: skip


def ranks() -> RanksReport:
    return RanksReport(
        (
            RankSummary(0, 0, "host", "cuda:0", 10 * MIB, 12 * MIB, 64 * MIB, "forward", 1, 2),
            RankSummary(
                1,
                1,
                "host",
                "cuda:1",
                20 * MIB,
                24 * MIB,
                64 * MIB,
                "backward",
                1,
                2,
                unused_parameters=("head.bias",),
            ),
        ),
        ADVICE,
    )


def track_report() -> TrackReport:
    phases = {"forward": 30 * MIB, "backward": 40 * MIB, "optimizer": None, "other": None,
              "eval": None}  # fmt: skip
    device = DeviceReport(
        "cpu",
        "simulated cpu",
        "simulated",
        64 * MIB,
        0,
        10 * MIB,
        40 * MIB,
        40 * MIB,
        phases,
        steps=(StepRecord(0, 0, 10 * MIB, 40 * MIB, 40 * MIB, phases, 0.1),),
        modules=(ModuleRecord("fc", "cpu", 1, MIB, MIB, MIB, 30 * MIB, MIB, True),),
        timeline=(
            TimelinePoint(0.0, 0, "forward", "fc", MIB, MIB),
            TimelinePoint(0.1, 1, "backward", None, 2 * MIB, 2 * MIB),
        ),
    )
    return TrackReport((device,), 1, "per-module", 0.2, ADVICE, postmortem(),
                       eval_input_shape=(4, 3), ranks=ranks())  # fmt: skip


def snapshot(allocated: int, label: str) -> Snapshot:
    """``before``: fc.weight; later (the diff's rows): the same storage, now unnamed, and two
    new unnamed tensors of one shape (one row with their count)."""
    device = DeviceSnapshot("cpu", "simulated cpu", "simulated", "simulated", 64 * MIB,
                            allocated, "budget", allocated, allocated,
                            missing=(("utilization", "simulated"),))  # fmt: skip
    weight = TensorInfo("fc.weight", "parameter", (4, 4), "float32", "cpu", 64, storage_id=1)
    tensors = (weight,)
    if label != "before":
        tensors = (
            dataclasses.replace(weight, name=None, kind="tensor"),
            *(dataclasses.replace(weight, name=None, kind="tensor", storage_id=i) for i in (2, 3)),
        )
    return Snapshot(
        1.0 if label == "before" else 2.0, (device,), HostSnapshot(MIB, 8 * MIB, 16 * MIB),
        (Categories("cpu", parameters=MIB, other=0, other_how="gc"),), tensors,
        advice=ADVICE, label=label, pid=4242,
    )  # fmt: skip


def inspection() -> SnapshotInspection:
    frames = (Frame("train.py", 3, "step"),)
    alloc = Allocation(0x1000, 512, 500, "activation", frames)
    device = DeviceInspection(
        0, 1, 2 * MIB, MIB, MIB, 0, MIB, 0, 0, MIB, MIB, (("activation", MIB),), (alloc,),
        ooms=(OomEvent(3, MIB, 0, MIB, 2 * MIB, frames, final=True),),
        timeline=((0, 0, 0), (1, MIB, 2 * MIB)),
    )  # fmt: skip
    return SnapshotInspection("mem.pickle", "memkit", True, 4, (device,), advice=ADVICE)


def comparison() -> StrategyComparison:
    results = (
        StrategyResult(
            "dp",
            8,
            (40 * MIB, 30 * MIB),
            10 * MIB,
            (("gradients", 10 * MIB),),
            ((8, True), (16, False)),
        ),
        StrategyResult("ddp", 16, (40 * MIB, 40 * MIB), 0, (), ((16, True),)),
        StrategyResult("fsdp", 24, (50 * MIB, 50 * MIB), 0, (), ((24, True), (32, False)),
                       largest_unit=("layers.0", 2 * MIB)),
    )  # fmt: skip
    return StrategyComparison("model.py", "cpu", 2, (64 * MIB, 64 * MIB), results, ADVICE)


CASES: dict[str, Callable[[], Result]] = {
    "probe": probe_result,
    "probe_across_ranks": probe_across_ranks,
    "probe_sweep": lambda: ProbeSweep((probe_result(128), probe_result(512))),
    "probe_modes": lambda: ProbeModes(
        (probe_result(), ProbeSweep((probe_result(128, "infer"), probe_result(512, "infer"))))
    ),
    "estimate": estimate,
    "estimate_does_not_fit": lambda: estimate_does_not_fit(4096),
    "estimate_sweep": lambda: EstimateSweep((estimate(128), estimate_does_not_fit(4096))),
    "track_report": track_report,
    "oom_postmortem": postmortem,
    "ranks_report": ranks,
    "snapshot": lambda: snapshot(MIB, "before"),
    "snapshot_diff": lambda: snapshot(2 * MIB, "after") - snapshot(MIB, "before"),
    "snapshot_inspection": inspection,
    "strategy_comparison": comparison,
}
"""Every result kind built from fixed numbers (name: the golden files' name), a kind more than
once where its layout branches (across ranks, does not fit)."""


def every_result() -> list[Result]:
    """One of each case, built afresh."""
    return [build() for build in CASES.values()]
