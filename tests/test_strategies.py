"""DP, DDP and FSDP on virtual devices: the strategy table (text, JSON, HTML) and its advice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memkit.cli import cli
from memkit.strategies import compare_strategies
from memkit.units import format_size

FILES = Path(__file__).parent / "modelfiles"
MiB = 1024**2


def test_dp_gathering_wide_outputs_loses_to_ddp_and_the_advice_says_by_how_much() -> None:
    result = compare_strategies(str(FILES / "wide_output.py"), gpus=4, budget=8 * MiB,
                                device="meta", max_batch=4096)  # fmt: skip
    dp, ddp = result.result("dp"), result.result("ddp")
    assert dp is not None and ddp is not None
    assert dp.max_global_batch is not None and ddp.max_global_batch is not None
    assert ddp.max_global_batch % 4 == 0 and ddp.max_global_batch > dp.max_global_batch
    # every peak fits its device; DDP's are equal, DP's device 0 carries the excess
    assert max(dp.per_device_peaks) <= 8 * MiB and max(ddp.per_device_peaks) <= 8 * MiB
    assert len(set(ddp.per_device_peaks)) == 1 and ddp.excess_bytes == 0
    others = dp.per_device_peaks[1:]
    assert dp.excess_bytes == dp.per_device_peaks[0] - sum(others) // 3 > 0
    parts = dict(dp.excess_parts)
    b = dp.max_global_batch
    assert parts["gathered outputs"] == b * 4096 * 4  # the full output, on cuda:0
    assert parts["input for the other devices"] == b * 64 * 4 - (b * 64 * 4) // 4
    x, y = dp.max_global_batch, ddp.max_global_batch
    codes = [a.code for a in result.advice]
    assert codes[0] == "switch-to-ddp"
    assert result.advice[0].title == (
        f"switch to DDP: largest global batch {x} -> {y} (+{100.0 * (y - x) / x:.0f}%)"
    )
    # the tracker's DP rule fires on DP's per-device peaks and stays silent on DDP's
    assert codes.count("dp-to-ddp") == 1 and "cuda:0" in result.advice[1].title
    text = str(result)
    assert f"dp  {x:>12}" in text.replace("      dp", "dp") and "switch to DDP" in text
    payload = json.loads(result.to_json())
    assert [s["max_global_batch"] for s in payload["strategies"]] == [x, y]
    assert payload["strategies"][0]["per_device_peaks"] == list(dp.per_device_peaks)
    html = result._repr_html_()
    assert "<table" in html and "switch-to-ddp" in html and str(y) in html


WORKSPACES = 2 * 8_519_680 + MiB
"""An ampere card's cuBLAS workspaces in a training step (forward, autograd's thread) and the
cuBLASLt one of a Linear with a bias (forward)."""


def test_cli_probe_and_estimate_compare_strategies() -> None:
    from memkit.estimation.target_step import TargetStep

    runner = CliRunner()
    args = [str(FILES / "wide_mlp.py"), "--gpus", "2", "--strategies", "dp,ddp", "--json"]
    usable = 4 * MiB + WORKSPACES
    est = runner.invoke(cli, ["estimate", *args, "--device-memory", str(500 * MiB + usable),
                              "--context", "500MiB", "--max-batch", "256"])  # fmt: skip
    assert est.exit_code == 0, est.output
    got = json.loads(est.output)  # what PyTorch may use on each GPU after the CUDA context
    assert got["device"] == "meta" and got["gpus"] == 2 and got["budgets"] == [usable] * 2
    # the estimate runs the target card's step: the comparison on meta with its rules
    on_card = compare_strategies(str(FILES / "wide_mlp.py"), gpus=2, budget=usable,
                                 device="meta", max_batch=256,
                                 target=TargetStep(_card(usable)))  # fmt: skip
    assert got["strategies"] == json.loads(on_card.to_json())["strategies"]
    probe = runner.invoke(cli, ["probe", *args, "--device", "cpu", "--budget", "4MiB",
                                "--max-batch", "256"])  # fmt: skip
    assert probe.exit_code == 0, probe.output
    on_cpu = json.loads(probe.output)
    # real compute and meta tensors count the same storages: the same answers
    on_meta = compare_strategies(str(FILES / "wide_mlp.py"), gpus=2, budget=4 * MiB,
                                 device="meta", max_batch=256)  # fmt: skip
    assert on_cpu["strategies"] == json.loads(on_meta.to_json())["strategies"]
    bad = runner.invoke(cli, ["probe", str(FILES / "wide_mlp.py"), "--strategies", "dp"])
    assert bad.exit_code == 2


def test_nothing_fits_is_exit_1_with_a_table_not_a_crash() -> None:
    out = CliRunner().invoke(cli, ["probe", str(FILES / "wide_mlp.py"), "--device", "cpu",
                                   "--gpus", "2", "--budget", "1KiB"])  # fmt: skip
    assert out.exit_code == 1, out.output
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:3] in ("dp ", "ddp")]
    assert [row[:4] for row in rows] == [["dp", "-", "-", "-"], ["ddp", "-", "-", "-"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["probe", "--device", "cpu", "--gpus", "2"], "memory with --budget"),
        (["probe", "--device", "cpu", "--strategies", "dp", "--budget", "8MiB"], "give --gpus N"),
        (["probe", "--device", "cpu", "--gpus", "2", "--budget", "8MiB", "--mode", "infer",
          "--margin", "10"], "--mode, --margin: not used by the --gpus comparison"),
        (["probe", "--device", "cpu", "--gpus", "2", "--budget", "-8MiB"], "--budget '-8MiB'"),
        (["probe", "--device", "cpu", "--gpus", "4", "--budget", "8MiB,8MiB"], "4 sizes"),
        (["probe", "--device", "cpu", "--gpus", "2", "--budget", "8MiB", "--seq-len", "8,16"],
         "one --seq-len"),
        (["estimate", "--device-memory", "2GiB", "--gpus", "2", "--mode", "infer"], "--mode: not"),
        (["estimate", "--device-memory", "256MiB", "--gpus", "2"], "CUDA context"),
    ],
)  # fmt: skip
def test_options_the_comparison_cannot_honour_are_refused(args, message) -> None:
    command, *rest = args
    out = CliRunner().invoke(cli, [command, str(FILES / "wide_mlp.py"), *rest])
    assert out.exit_code == 2, out.output
    assert message in out.stderr


def test_estimate_comparison_takes_the_cuda_context_off_every_gpu() -> None:
    from memkit.estimation.target_step import TargetStep

    common = [str(FILES / "wide_mlp.py"), "--gpus", "2", "--strategies", "ddp", "--json"]
    small = CliRunner().invoke(cli, ["estimate", *common, "--device-memory", "540MiB",
                                     "--context", "500MiB"])  # fmt: skip
    alone = compare_strategies(str(FILES / "wide_mlp.py"), gpus=2, budget=40 * MiB,
                               strategies=["ddp"], device="meta",
                               target=TargetStep(_card(40 * MiB)))  # fmt: skip
    assert small.exit_code == 0, small.output
    data = json.loads(small.stdout)
    assert data["budgets"] == [40 * MiB, 40 * MiB]  # what the allocator may use on each
    assert data["strategies"][0]["max_global_batch"] == alone.results[0].max_global_batch
    assert "500.00 MiB CUDA context" in data["notes"][0]


def test_fsdp_shards_what_ddp_replicates() -> None:
    on_cpu = compare_strategies(str(FILES / "wide_mlp.py"), gpus=2, budget=4 * MiB,
                                strategies=["ddp", "fsdp"], max_batch=256)  # fmt: skip
    ddp, fsdp = on_cpu.result("ddp"), on_cpu.result("fsdp")
    assert ddp is not None and fsdp is not None and fsdp.max_global_batch is not None
    # FSDP's ranks hold half the parameters, gradients and AdamW state of DDP's and no
    # gradient buckets: a batch at least as large, balanced, each rank lower at the cap
    assert fsdp.max_global_batch >= (ddp.max_global_batch or 0)
    assert len(set(fsdp.per_device_peaks)) == 1 and fsdp.excess_bytes == 0
    assert fsdp.per_device_peaks[0] < ddp.per_device_peaks[0]
    assert fsdp.largest_unit == ("0", (64 * 1024 + 1024) * 4)  # Linear(64, 1024) unsharded
    assert "the largest unit all-gathered: 0" in str(on_cpu)
    assert json.loads(on_cpu.to_json())["strategies"][1]["largest_unit"] == ["0", 266240]


def test_fsdp_on_meta_agrees_with_probe_on_cpu_to_the_byte() -> None:
    # 3 GPUs: uneven shards (1024 rows -> 342, 342, 340; 64 -> 22, 22, 20) and padding rows.
    # Meta runs the step under a cpu target's rules (the optimizer's for-loop, no
    # workspaces): it counts the storages the probe counts on cpu.
    from memkit.estimation.target_step import TargetStep

    budget = 1_455_000
    common = [str(FILES / "wide_mlp.py"), "--gpus", "3", "--strategies", "fsdp",
              "--max-batch", "24", "--json"]  # fmt: skip
    probe = CliRunner().invoke(cli, ["probe", *common, "--device", "cpu", "--budget", str(budget)])
    assert probe.exit_code == 0, probe.output
    cpu_target = TargetStep(_card(budget, workspace=0), "cpu-flash", foreach=False)
    result = compare_strategies(str(FILES / "wide_mlp.py"), gpus=3, budget=budget,
                                strategies=["fsdp"], device="meta", max_batch=24,
                                target=cpu_target)  # fmt: skip
    on_meta, on_cpu = json.loads(result.to_json()), json.loads(probe.stdout)
    assert on_meta["device"] == "meta" and on_meta["budgets"] == on_cpu["budgets"] == [budget] * 3
    fsdp = on_meta["strategies"][0]
    # the same search, trial for trial, and the same peak on every GPU, to the byte
    assert fsdp == on_cpu["strategies"][0]
    assert [t["fits"] for t in fsdp["trials"]].count(False) >= 1  # the search met the budget
    peaks = fsdp["per_device_peaks"]
    assert max(peaks) <= budget and peaks[0] == peaks[1]
    # rank 2 holds 2 rows fewer of each parameter: AdamW's two moments over them (its
    # padded shards and gradients are as large as the others')
    rows = 64 * 4 + 4 + 1024 * 4 + 4  # a row of each: 2 weights and 2 biases, fp32
    assert peaks[0] - peaks[2] == 2 * 2 * rows
    assert fsdp["largest_unit"] == ["2", 3 * 22 * (1024 + 1) * 4]  # padded to 66 rows
    assert any("NCCL" in note for note in on_meta["notes"])


def test_estimate_shows_fsdp_in_text_json_and_html_with_its_advice() -> None:
    # wide_mlp: 2.02 MiB of state with AdamW, more than the 2 MiB a GPU leaves next to its
    # workspaces: DDP fits nothing
    from memkit.estimation.target_step import TargetStep

    usable = 2 * MiB + WORKSPACES
    args = ["estimate", str(FILES / "wide_mlp.py"), "--device-memory", f"{500 * MiB + usable}",
            "--context", "500MiB", "--gpus", "2", "--strategies", "ddp,fsdp",
            "--max-batch", "64"]  # fmt: skip
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 1, out.output  # a strategy fits nothing
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split()[:1] in (["ddp"], ["fsdp"])}  # fmt: skip
    # fsdp still fits at --max-batch 64: a lower bound, said so (it read as the answer once)
    assert rows["ddp"][1] == "-" and rows["fsdp"][1:4] == ["at", "least", "64"]
    assert "fsdp: at least 64 (the --max-batch limit, not a memory limit" in out.stdout
    assert "the largest unit all-gathered: 0" in out.stdout and "[fsdp-gpus]" in out.stdout
    assert "NCCL" in out.stdout
    result = compare_strategies(str(FILES / "wide_mlp.py"), gpus=2, budget=usable,
                                strategies=["ddp", "fsdp"], device="meta", max_batch=64,
                                target=TargetStep(_card(usable)))  # fmt: skip
    fsdp = result.result("fsdp")
    assert fsdp is not None and str(fsdp.max_global_batch) == rows["fsdp"][3]
    assert fsdp.hit_max_batch and result.max_batch == 64
    payload = json.loads(result.to_json())
    assert [s["strategy"] for s in payload["strategies"]] == ["ddp", "fsdp"]
    page = result.to_html()
    assert "<title>memkit: DP, DDP and FSDP on virtual GPUs</title>" in page
    assert f"<tr><td>fsdp</td><td>at least {fsdp.max_global_batch}</td>" in page
    assert "fsdp-gpus" in page


def test_fsdp_gpus_when_ddp_fits_nothing_and_fsdp_fits_on_that_many() -> None:
    # wide_mlp: 132 K parameters, AdamW: 2.02 MiB of state, more than a 2 MiB GPU
    path = str(FILES / "wide_mlp.py")
    result = compare_strategies(path, gpus=2, budget=2 * MiB, strategies=["ddp"], max_batch=8)
    advice = {a.code: a for a in result.advice}
    assert result.results[0].max_global_batch is None and "fsdp-gpus" in advice
    params = (64 * 1024 + 1024 + 1024 * 64 + 64) * 4
    assert "= 2.02 MiB" in advice["fsdp-gpus"].evidence  # 4 x params: weights, grads, 2 moments
    gpus = int(advice["fsdp-gpus"].title.split()[2])
    assert advice["fsdp-gpus"].saving_bytes == 4 * params - -(-4 * params // gpus)
    # the count is safe: FSDP on that many 2 MiB GPUs fits, measured on the virtual devices
    fsdp = compare_strategies(path, gpus=gpus, budget=2 * MiB, strategies=["fsdp"],
                              max_batch=gpus).result("fsdp")  # fmt: skip
    assert fsdp is not None and fsdp.max_global_batch == gpus


def test_fsdp_names_the_unit_that_sets_its_peak_and_what_it_saves_against_ddp() -> None:
    result = compare_strategies(str(FILES / "big_root.py"), gpus=2, budget=16 * MiB,
                                strategies=["ddp", "fsdp"], max_batch=8)  # fmt: skip
    advice = {a.code: a for a in result.advice}
    embed, head = 4096 * 64 * 4, (64 * 4096 + 4096) * 4  # the root's unit: both
    wrap = advice["fsdp-wrap-unit"]
    assert "`fully_shard(model.head)` before `fully_shard(model)`" in wrap.action
    block = (64 * 64 + 64) * 4  # the prefetched next unit, before and after the split
    # 3 x (embed + head) + a block unsharded now; 3 x head + embed once head is its own unit
    assert wrap.saving_bytes == (3 * (embed + head) + block) - (3 * head + embed)
    saves = advice["fsdp-saves"]
    assert "global batch of 8 on 2 GPUs (DDP 8)" in saves.title and "1.5x" in saves.title
    assert "[fsdp-wrap-unit]" in str(result)


def _card(usable: int, workspace: int | None = None):
    from memkit.estimation.families import target_card

    return target_card("ampere", 500 * MiB + usable, 500 * MiB, workspace)


def test_estimate_runs_each_strategys_step_as_the_one_card_estimate_does() -> None:
    # meta alone runs SDPA's math path (the L x L matrix kept for backward); on an sm80 card
    # PyTorch runs the memory-efficient kernel, which the one-card estimate counts
    from memkit.estimation import estimate
    from memkit.estimation.target_step import TargetStep

    path, usable = str(FILES / "tiny_attention.py"), 20 * MiB
    out = CliRunner().invoke(cli, ["estimate", path, "--device-memory", f"{500 * MiB + usable}",
                                   "--context", "500MiB", "--gpus", "2", "--strategies",
                                   "dp,ddp", "--max-batch", "64", "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert any("attention: efficient kernel" in note for note in got["notes"])
    dp, ddp = got["strategies"]
    workspaces = 2 * 8_519_680 + MiB  # 2 cuBLAS (forward, backward), 1 cuBLASLt (forward)
    plain = compare_strategies(path, gpus=2, budget=usable - workspaces, strategies=["ddp"],
                               device="meta", max_batch=64).results[0]  # fmt: skip
    assert plain.max_global_batch is not None  # the math path keeps the L x L matrix
    assert ddp["max_global_batch"] > 2 * plain.max_global_batch
    # a DDP rank is the one-card step at the per-rank batch plus DDP's bucket copy of the
    # gradients; the one-card estimate rounds each tensor to 512 bytes, the comparison not
    per_rank = ddp["max_global_batch"] // 2
    one = estimate(path, device_memory=500 * MiB + usable, context="500MiB",
                   min_batch=per_rank, max_batch=per_rank)  # fmt: skip
    buckets = (64 * 32 + 32 * 96 + 96 + 32 * 64 + 64) * 4  # fp32 gradients
    rank = ddp["per_device_peaks"][0] - buckets
    assert one.breakdown.workspace == workspaces
    assert 0 <= one.trials[0].allocated_peak - rank < 0.001 * rank
    # under DP each GPU has its own workspaces: cuda:1 ran its replica's matmuls
    assert min(dp["per_device_peaks"]) > one.breakdown.workspace
    # the rules are the estimate's: a cpu target (cpu flash attention, dropout's noise tensor,
    # the optimizer's for-loop, no workspaces) counts on meta what the cpu probe counts
    cpu_target = TargetStep(_card(MiB + MiB // 2, workspace=0), "cpu-flash", foreach=False)
    on_meta = compare_strategies(path, gpus=2, budget=MiB + MiB // 2, strategies=["ddp"],
                                 device="meta", max_batch=32, target=cpu_target)  # fmt: skip
    on_cpu = compare_strategies(path, gpus=2, budget=MiB + MiB // 2, strategies=["ddp"],
                                max_batch=32)  # fmt: skip
    assert on_meta.results == on_cpu.results


def test_dp_to_ddp_quotes_ddps_rank_measured_at_dataparallels_batch() -> None:
    path = str(FILES / "wide_output.py")
    result = compare_strategies(path, gpus=4, budget=8 * MiB, device="meta", max_batch=4096)
    dp = result.result("dp")
    advice = next(a for a in result.advice if a.code == "dp-to-ddp")
    assert dp is not None and dp.max_global_batch is not None
    # DDP alone at DataParallel's global batch, on GPUs too large to run out: its rank peak
    alone = compare_strategies(path, gpus=4, budget=64 * MiB, strategies=["ddp"], device="meta",
                               max_batch=dp.max_global_batch).results[0]  # fmt: skip
    assert alone.max_global_batch == dp.max_global_batch  # (a multiple of 4 here)
    rank = format_size(max(alone.per_device_peaks))
    assert f"each rank peaks at {rank} at the same global batch (measured" in advice.evidence


def test_a_strategy_whose_step_fails_is_reported_and_the_others_stand() -> None:
    path = str(FILES / "tuple_loss.py")
    result = compare_strategies(path, gpus=2, budget=1 * MiB, device="meta", max_batch=64)
    dp, ddp = result.result("dp"), result.result("ddp")
    assert dp is not None and ddp is not None
    # batch 1 runs on one replica (a scalar loss); at 2 DataParallel gathers two losses
    assert dp.max_global_batch is None and dp.trials == ((1, True),)
    assert dp.error is not None and dp.error.startswith(
        "the dp step raised RuntimeError at global batch 2: grad can be implicitly created"
    )
    assert "a vector of 2" in dp.error and "`.mean()`" in dp.error
    assert ddp.error is None and ddp.max_global_batch is not None and ddp.max_global_batch > 2
    assert not any(a.code in ("switch-to-ddp", "dp-to-ddp", "fsdp-gpus") for a in result.advice)
    assert json.loads(result.to_json())["strategies"][0]["error"] == dp.error
    out = CliRunner().invoke(cli, ["probe", path, "--device", "cpu", "--gpus", "2", "--budget",
                                   "1MiB", "--max-batch", "64"])  # fmt: skip
    assert out.exit_code == 3, out.output  # a step failed; the table is printed all the same
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split()[:1] in (["dp"], ["ddp"])}  # fmt: skip
    assert ddp.hit_max_batch and ddp.max_global_batch == 64  # still fits at --max-batch
    assert rows["dp"][1] == "failed" and rows["ddp"][1:4] == ["at", "least", "64"]
    assert "dp: failed: the dp step raised RuntimeError at global batch 2" in out.stdout
    # when every strategy fails, the command fails with their errors (exit 3)
    alone = CliRunner().invoke(cli, ["probe", path, "--device", "cpu", "--gpus", "2", "--budget",
                                     "1MiB", "--strategies", "dp"])  # fmt: skip
    assert alone.exit_code == 3 and "the dp step raised RuntimeError" in alone.stderr
    twice = CliRunner().invoke(cli, ["probe", path, "--device", "cpu", "--gpus", "2",
                                     "--budget", "1MiB", "--strategies", "fsdp,fsdp"])  # fmt: skip
    assert twice.exit_code == 2 and "each strategy once" in twice.stderr


def test_fsdp_of_a_model_with_frozen_parameters_runs() -> None:
    # LoRA (frozen base Linears, trainable adapters): the simulated FSDP failed on every such
    # model ("cuda:0 and cpu!", worded as the user's tensor placement); a new-user sweep
    path = str(FILES / "lora_mlp.py")
    result = compare_strategies(path, gpus=2, budget=64 * MiB, strategies=["ddp", "fsdp"],
                                device="meta", max_batch=8)  # fmt: skip
    ddp, fsdp = result.result("ddp"), result.result("fsdp")
    assert ddp is not None and fsdp is not None
    assert ddp.error is None and fsdp.error is None and fsdp.max_global_batch == 8
    # a block all-gathered: its frozen base with its adapters (18,688 B)
    assert fsdp.largest_unit == ("0", (64 * 64 + 64 + 2 * 4 * 64) * 4)


def test_an_internal_error_of_the_simulation_is_not_worded_as_the_users() -> None:
    from memkit.errors import UserCodeError
    from memkit.simulated.virtual_devices import SimulationError
    from memkit.strategies import _failure

    mixed = "Expected all tensors to be on the same device, but found at least two devices"
    ours = SimulationError(f"{mixed}, cuda:0 and cpu! [memkit virtual devices: ...]")
    said = _failure("fsdp", 2, UserCodeError("x", original=ours), 2)
    assert said.startswith(
        "memkit's simulation of fsdp failed at global batch 2, an internal error of memkit "
        "(not of the model file; please report it): SimulationError: Expected all tensors"
    )
    theirs = RuntimeError(f"{mixed}, cuda:0 and cpu! [... memkit.to_virtual(tensor, i) ...]")
    said = _failure("fsdp", 2, UserCodeError("x", original=theirs), 2)
    assert said.startswith("the fsdp step raised RuntimeError at global batch 2: Expected")


def test_a_search_that_stops_at_its_ceiling_says_at_least(monkeypatch) -> None:
    # the default ceiling (65,536) read as the largest batch that fits, with 89% left free
    import memkit.strategies

    monkeypatch.setattr(memkit.strategies, "MAX_GLOBAL_BATCH", 16)
    path = str(FILES / "ok_mlp.py")
    result = compare_strategies(path, gpus=2, budget=64 * MiB, strategies=["ddp"], device="meta")
    ddp = result.results[0]
    assert ddp.max_global_batch == 16 and ddp.hit_max_batch and result.max_batch is None
    text = str(result)
    assert "\n     ddp   at least 16  1.52 MiB" in text  # the table's row
    assert "ddp: at least 16 (memkit's search ceiling, not a memory limit: it leaves" in text
    assert "--max-batch to search higher" in text
    payload = json.loads(result.to_json())
    assert payload["strategies"][0]["hit_max_batch"] is True and payload["max_batch"] is None
    assert "ddp=>=16" in repr(result)
    # --max-batch given: its limit, per rank rounded down (3 GPUs: 3 a rank, 9 in all)
    capped = compare_strategies(path, gpus=3, budget=64 * MiB, strategies=["ddp"],
                                device="meta", max_batch=10)  # fmt: skip
    assert capped.results[0].max_global_batch == 9 and capped.results[0].hit_max_batch
    assert "ddp: at least 9 (the --max-batch limit, not a memory limit" in str(capped)
    # a search that met the budget is no lower bound
    tight = compare_strategies(path, gpus=2, budget=64 * MiB, strategies=["ddp"], device="meta",
                               max_batch=10**6)  # fmt: skip
    assert not tight.results[0].hit_max_batch and "at least" not in str(tight)
