"""The FSDP rules (memkit.advice.sharding) on constructed numbers, and the units they read."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

from memkit.advice.sharding import (
    fsdp_gpus_needed,
    fsdp_saves,
    fsdp_wrap_unit,
    gathered_bytes,
)
from memkit.simulated.fsdp import split_candidate, unit_sizes

MiB = 1024**2
FILES = Path(__file__).parent / "modelfiles"
BLOCKS = [("layers.0", 100 * MiB), ("layers.1", 100 * MiB), ("", 40 * MiB)]


def _gpus(**kw: int) -> int | None:
    a = fsdp_gpus_needed(units=BLOCKS, batch_size=4, **kw)
    if a is None:
        return None
    assert a.code == "fsdp-gpus"
    return int(a.title.split()[2]) if a.title.startswith("FSDP needs") else -1


def test_gathered_is_three_of_the_largest_unit_and_the_prefetched_next() -> None:
    assert gathered_bytes(BLOCKS) == 3 * 100 * MiB + 100 * MiB
    assert gathered_bytes([("", 7)]) == 21 and gathered_bytes([]) == 0


def test_gpus_needed_is_the_fewest_whose_shard_fits_next_to_the_unsharded_part() -> None:
    # a 1 B-parameter model in fp32 with AdamW: 4 + 4 + 8 GB of state on an 80 GiB card
    p, cap, other = 4 * 10**9, 80 * 1024**3, 6 * 1024**3
    kw = dict(parameter_bytes=p, gradient_bytes=p, optimizer_state_bytes=2 * p,
              other_bytes=other, capacity_bytes=cap)  # fmt: skip
    assert _gpus(**kw) is None  # 16 GB + 6 GiB fit on one card: no advice
    big = {**kw, "parameter_bytes": 5 * p, "gradient_bytes": 5 * p, "optimizer_state_bytes": 10 * p}
    state, fixed = 80 * 10**9, 400 * MiB + other  # 20 + 20 + 40 GB of state
    expected = math.ceil(state / (cap - fixed))
    assert _gpus(**big) == expected == 2
    a = fsdp_gpus_needed(units=BLOCKS, batch_size=4, **big)
    assert a is not None and a.saving_bytes == state - math.ceil(state / expected)
    assert "--nproc-per-node 2" in a.action and "fully_shard(model)" in a.action
    assert "--budget 80GiB --strategies fsdp" in a.action  # a size as the option takes it
    assert "--device-memory SIZE --arch CARD" in a.action  # (--device-memory H100 is refused)
    assert "3 x the largest, model.layers.0" in a.evidence
    # a card a quarter the size needs more GPUs, by the same arithmetic
    small = {**big, "capacity_bytes": cap // 4}
    assert _gpus(**small) == math.ceil(state / (cap // 4 - fixed)) == 6


def test_gpus_needed_says_when_no_count_of_gpus_fits_and_defers_to_a_measurement() -> None:
    kw = dict(parameter_bytes=100 * MiB, gradient_bytes=100 * MiB,
              optimizer_state_bytes=200 * MiB, other_bytes=200 * MiB,
              capacity_bytes=300 * MiB)  # fmt: skip
    a = fsdp_gpus_needed(units=BLOCKS, batch_size=4, **kw)  # 400 MiB all-gathered > 300 MiB
    assert a is not None and a.title.startswith("Sharding with FSDP alone does not fit")
    measured = fsdp_gpus_needed(
        parameter_bytes=100, gradient_bytes=100, optimizer_state_bytes=200, other_bytes=10,
        capacity_bytes=150, units=[("0", 10)], batch_size=1, measured_fit=(2, 8, 140),
    )  # fmt: skip
    # 400 B of state / (150 - 40) B of room: 4 GPUs estimated, 2 measured
    assert measured is not None and "FSDP needs 2 GPUs" in measured.title
    assert "Measured on 2 GPUs: a global batch of 8" in measured.evidence


def test_fsdp_saves_counts_the_state_ddp_replicates_and_the_traffic_it_adds() -> None:
    p = 64 * MiB
    a = fsdp_saves(parameter_bytes=p, gradient_bytes=p, optimizer_state_bytes=2 * p,
                   bucket_bytes=p, gpus=4, units=[("0", 8 * MiB)] * 8)  # fmt: skip
    assert a is not None and a.code == "fsdp-saves"
    assert a.saving_bytes == (5 * p) - (4 * p // 4 + 32 * MiB)  # 320 - 96 MiB
    assert "1.5x" in a.title  # (2 x params + grads) against 2 x grads
    assert "144.00 MiB" in a.evidence and "96.00 MiB" in a.evidence  # per-rank traffic, N = 4
    one_unit = [("", p)]  # the whole model one unit: 3 x it unsharded, more than DDP holds
    assert fsdp_saves(parameter_bytes=p, gradient_bytes=p, optimizer_state_bytes=0,
                      bucket_bytes=0, gpus=2, units=one_unit) is None  # fmt: skip
    measured = fsdp_saves(parameter_bytes=p, gradient_bytes=p, optimizer_state_bytes=0,
                          bucket_bytes=0, gpus=2, units=one_unit,
                          largest_batches=(8, 16))  # fmt: skip
    assert measured is not None and "global batch of 16 on 2 GPUs (DDP 8)" in measured.title


def test_wrap_unit_names_the_module_that_splits_the_largest_unit() -> None:
    units = [("blocks.0", 10), ("blocks.1", 10), ("", 200)]
    a = fsdp_wrap_unit(units, ("head", 120), peak_bytes=1000)
    assert a is not None and a.code == "fsdp-wrap-unit"
    assert "fully_shard(model.head)` before `fully_shard(model)" in a.action
    assert a.saving_bytes == (3 * 200 + 10) - (3 * 120 + 80)
    assert fsdp_wrap_unit(units, ("head", 120), peak_bytes=10_000) is None  # not the peak
    assert fsdp_wrap_unit([("0", 100), ("1", 90)], ("0.a", 50), peak_bytes=300) is None
    assert fsdp_wrap_unit(units, None, peak_bytes=1000) is None


def test_units_of_a_model_with_its_embedding_and_head_in_the_root() -> None:
    model = runpy.run_path(str(FILES / "big_root.py"))["build_model"]()
    embed, head, block = 4096 * 64 * 4, (64 * 4096 + 4096) * 4, (64 * 64 + 64) * 4
    assert unit_sizes(model) == [*[(f"blocks.{i}", block) for i in range(4)], ("", embed + head)]
    assert split_candidate(model) == ("head", head)


def test_estimate_says_how_many_gpus_from_its_breakdown() -> None:
    from click.testing import CliRunner

    from memkit.cli import cli

    out = CliRunner().invoke(cli, ["estimate", str(FILES / "huge.py"), "--device-memory",
                                   "590MiB", "--json"])  # fmt: skip
    assert out.exit_code == 1, out.output
    data = json.loads(out.stdout)
    advice = {a["code"]: a for a in data["advice"]}
    assert "does-not-fit" in advice and "fsdp-gpus" in advice
    weight = (2048 * 2048 + 2048) * 4  # the one Linear: a single unit, the root
    state = 4 * weight  # parameters, gradients, AdamW's two moments
    assert data["breakdown"]["optimizer_state"] == 2 * weight
    rest = data["trials"][0]["reserved_peak"] - state  # activations, workspace, rounding
    room = data["usable_bytes"] - 3 * weight - rest  # 3 x the unit stays unsharded
    gpus = math.ceil(state / room)
    assert gpus > 2 and f"FSDP needs {gpus} GPUs for batch 1" in advice["fsdp-gpus"]["title"]
    assert advice["fsdp-gpus"]["saving_bytes"] == state - math.ceil(state / gpus)


def test_a_plain_probe_whose_model_state_does_not_fit_says_how_many_gpus_fsdp_needs() -> None:
    """`memkit probe` without --strategies: the state (parameters + gradients + Adam's moments,
    measured on meta copies of the optimizer) exceeds the budget, so next to does-not-fit the
    probe names the GPUs FSDP needs; with a budget the state fits in, only does-not-fit."""
    import torch

    from memkit.probing.runner import probe
    from memkit.units import format_size

    def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        return model, torch.optim.Adam(model.parameters())

    params = 4 * (512 * 512 + 512) * 4  # 4,202,496 B, and as many of gradients
    model, opt = model_and_optimizer()
    result = probe(model, lambda n: torch.randn(n, 512), optimizer=opt, device="cpu",
                   budget="12MiB", max_batch=4)  # fmt: skip
    assert result.max_batch_size is None
    advice = {a.code: a for a in result.advice}
    assert set(advice) == {"does-not-fit", "fsdp-gpus"}
    gpus = advice["fsdp-gpus"]
    # the failed trial's bytes are a lower bound of the step (sweep PP: "FSDP needs 3 GPUs",
    # "plus 0 B of the rest of the step", where 3 GPUs fit nothing): a least number of GPUs
    assert gpus.title.startswith("FSDP needs at least ") and " GPUs for batch 1" in gpus.title
    assert "the step ran out before its end" in gpus.evidence and "At least " in gpus.evidence
    # Adam's exp_avg and exp_avg_sq on the device (its step counters stay on the host)
    assert f"parameters {format_size(params)} + gradients {format_size(params)} + optimizer " \
        f"state {format_size(2 * params)}" in gpus.evidence  # fmt: skip
    assert not opt.state  # measured on copies: the user's optimizer did not step

    model, opt = model_and_optimizer()
    result = probe(model, lambda n: torch.randn(n, 512), optimizer=opt, device="cpu",
                   budget="24MiB", min_batch=8192, max_batch=16384)  # fmt: skip
    assert result.max_batch_size is None  # the activations of 8192 samples do not fit
    assert [a.code for a in result.advice] == ["does-not-fit"]  # the state (16 MiB) does
