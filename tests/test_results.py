"""Every top-level result has the same interface (memkit/results.py), and its parts agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.advice import Advice
from memkit.estimation.result import Estimate, EstimateBreakdown, EstimateTrial
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


def estimate() -> Estimate:
    return Estimate(
        "model.py", "ampere", 24 << 30, 512 * MIB, "train",
        (EstimateTrial(8, 10 * MIB, 12 * MIB, 10 * MIB, True, 0.01),), 8, 8, 0.05, 1, None,
        breakdown=EstimateBreakdown(8, 4 * MIB, 4 * MIB, 1 * MIB, 1 * MIB, 0, 0),
        fixed_bytes=1.0, per_sample_bytes=2.0, advice=ADVICE, extra={"not": object()},
    )  # fmt: skip


def postmortem() -> OomPostMortem:
    breakdown = Breakdown(60 * MIB, 20 * MIB, 20 * MIB, 0, 20 * MIB, 0, 1, "backward", None)
    suspect = LeakSuspect("losses", "train", "train.py", 12, "losses.append(loss)", "container",
                          3, True)  # fmt: skip
    leak = LeakFinding("cpu", MIB, 1, 3, (suspect,))
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
    device = DeviceSnapshot("cpu", "simulated cpu", "simulated", "simulated", 64 * MIB,
                            allocated, "budget", allocated, allocated,
                            missing=(("utilization", "simulated"),))  # fmt: skip
    return Snapshot(
        1.0 if label == "before" else 2.0, (device,), HostSnapshot(MIB, 8 * MIB, 16 * MIB),
        (Categories("cpu", parameters=MIB, other=0, other_how="gc"),),
        (TensorInfo("fc.weight", "parameter", (4, 4), "float32", "cpu", 64),),
        advice=ADVICE, label=label,
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
    )
    return StrategyComparison("model.py", "cpu", 2, (64 * MIB, 64 * MIB), results, ADVICE)


def every_result() -> list[Result]:
    probe = probe_result()
    sweep = ProbeSweep((probe_result(128), probe_result(512)))
    return [
        probe,
        sweep,
        ProbeModes((probe, ProbeSweep((probe_result(128, "infer"),)))),
        estimate(),
        track_report(),
        postmortem(),
        ranks(),
        snapshot(MIB, "before"),
        snapshot(2 * MIB, "after") - snapshot(MIB, "before"),
        inspection(),
        comparison(),
    ]


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_result_class_is_covered_here():
    covered = {type(r) for r in every_result()}
    missing = {c for c in _subclasses(Result) if c.__module__.startswith("memkit.")} - covered
    assert not missing, f"add an instance of {sorted(c.__name__ for c in missing)} to this test"


@pytest.mark.parametrize("result", every_result(), ids=lambda r: type(r).__name__)
def test_the_five_methods_agree(result: Result, tmp_path: Path):
    data = result.to_dict()
    assert next(iter(data)) == "schema" and data["schema"] == type(result).SCHEMA
    assert data["schema"].startswith("memkit.") and data["schema"].endswith("/1")
    text = result.to_json()
    assert json.loads(text) == data  # JSON-ready: no tuples, nothing json.dumps converts
    assert json.loads(result.to_json(indent=None)) == data
    written = tmp_path / "result.json"
    assert result.to_json(written) == text and written.read_text() == text + "\n"

    fragment = result._repr_html_()
    body = result.html_body()
    assert body and body in fragment and result.html() == body
    page = result.to_html()
    assert page.startswith("<!DOCTYPE html>") and fragment in page and "<script" not in page
    assert result.to_html(tmp_path / "result.html") == page
    assert (tmp_path / "result.html").read_text() == page

    assert str(result) and not str(result).startswith(type(result).__name__ + "(")


def test_keys_the_outputs_had_before_the_common_interface():
    probe = probe_result().to_dict()
    assert probe["memory_model"] == {"fixed_bytes": 8.0 * MIB, "per_sample_bytes": 4.0 * MIB}
    assert "fixed_bytes" not in probe and "per_rank_capacities" not in probe
    assert probe["trials"][0]["seconds"] == 0.1 and "rank_peaks" not in probe["trials"][0]
    sweep = ProbeSweep((probe_result(128),)).to_dict()
    assert sweep["seq_lens"][0]["seq_len"] == 128
    text = str(ProbeSweep((probe_result(128), probe_result(512))))
    assert "[accumulate] seq_len 128: use gradient" in text  # each advice says whose it is
    assert "[accumulate] seq_len 512: use gradient" in text
    est = estimate().to_dict()
    assert est["usable_bytes"] == (24 << 30) - 512 * MIB and "extra" not in est
    assert est["breakdown"]["total"] == 10 * MIB
    report = track_report().to_dict()
    assert report["micro_batches"] == 1 and report["oom"]["where"] == "step 2, backward of fc"
    assert report["devices"][0]["timeline"][1] == [0.1, 1, "backward", None, 2 * MIB, 2 * MIB]
    assert "timeline" not in track_report().to_dict(timeline=False)["devices"][0]
    assert json.loads(track_report().to_json(timeline=False))["devices"][0].get("timeline") is None
    assert report["ranks"]["tightest_rank"] == 1 and report["ranks"]["world_size"] == 2
    snap = snapshot(MIB, "x").to_dict()
    assert snap["schema"] == "memkit.snapshot/1" and snap["devices"][0]["missing"]
    assert snap["devices"][0]["cached"] == 0 and snap["categories"][0]["categorised"] == MIB
    diff = (snapshot(2 * MIB, "after") - snapshot(MIB, "before")).to_dict()
    assert diff["schema"] == "memkit.snapshot-diff/1" and diff["elapsed"] == 1.0
    view = inspection().to_dict()["devices"][0]
    assert view["largest"][0]["frames"] == [{"filename": "train.py", "line": 3, "name": "step"}]
    assert view["categories"] == {"activation": MIB} and view["ooms"][0]["where"]
    strategies = comparison().to_dict()
    assert strategies["strategies"][0]["trials"][1] == {"global_batch": 16, "fits": False}


def test_older_positional_indent_still_works():
    assert probe_result().to_json(None) == probe_result().to_json()
    assert "\n" not in estimate().to_json(indent=None)
    assert estimate().to_json(4).startswith('{\n    "schema"')
