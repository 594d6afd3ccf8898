"""FSDP2 on virtual devices (memkit.simulated.fsdp) against real FSDP2: 2 gloo ranks on CPU.

In the launch the suite's 2-rank tests share (tests/rank_processes.py: torchrun's environment,
without its start-up), each rank runs ``fully_shard`` (every layer, then the model) with AdamW
on its own plain ``memkit.simulate`` device (which counts FSDP2's storage resizes itself: its
frees of the unsharded parameters once stayed counted, the whole parameter set too many bytes),
and reports its peak.
The same model, per-rank batch and optimizer run through ``fsdp_ranks`` on
``memkit.simulate(devices=2)``. Equal to the byte but for what the simulated cpu device counts
and CUDA would not: AdamW's ``step`` scalars (host tensors beside CUDA parameters, 4 B per
parameter) and gloo's own temporaries, which come and go on its threads (up to 64.5 KiB on
one rank, not on every run): the smaller rank peak is checked exactly, the other within that.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
from rank_processes import rank_scenario

from memkit.simulated.fsdp import fsdp_ranks
from memkit.simulated.virtual_devices import VirtualDevices

PER_RANK, STEPS, LAYERS = 48, 2, 5

MODEL = textwrap.dedent(
    """
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)],
                                   torch.nn.Linear(256, 10))

    def step(model, opt, n):
        model(torch.randn(n, 256)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    """
)

SCENARIO = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import memkit
    from fidelity_fsdp_model import build, step

    def run(rank, args):
        per_rank, steps = args
        model = build()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        with memkit.simulate(None) as sim:
            sim.track(model)
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(steps):
                step(model, opt, per_rank)
        return {"rank": dist.get_rank(), "peak": sim.peak}
    """
)

if importlib.util.find_spec("torch.distributed.fsdp") is not None:
    rank_scenario(
        "fsdp-fidelity",
        SCENARIO,
        files={"fidelity_fsdp_model.py": MODEL},
        args=lambda: [PER_RANK, STEPS],
    )


def _virtual_peaks(device: str, world: int = 2) -> tuple[list[int], tuple[str, int]]:
    """The model's steps through ``fsdp_ranks`` on ``world`` virtual devices over ``device``
    tensors (cpu: ``memkit probe``; meta: ``memkit estimate``)."""
    namespace: dict[str, object] = {}
    exec(MODEL, namespace)  # the same model and step as the ranks
    build, step = namespace["build"], namespace["step"]
    with torch.device(device):
        model = build()  # type: ignore[operator]
    with VirtualDevices([None] * world, device) as vd:
        ranks = fsdp_ranks(model, lambda m: torch.optim.AdamW(m.parameters()))
        for rank in ranks:
            with vd.on(rank.device), torch.device(device):  # the step's batch
                for _ in range(STEPS):
                    step(rank.model, rank.optimizer, PER_RANK)  # type: ignore[operator]
        return vd.peaks, ranks[0].largest_unit


def test_fsdp_ranks_peak_matches_real_fsdp2_on_gloo(gloo_ranks) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    rows = gloo_ranks("fsdp-fidelity").results
    assert [r["rank"] for r in rows] == [0, 1]
    real = [r["peak"] for r in rows]
    virtual, largest = _virtual_peaks("cpu")
    # meta tensors (memkit estimate) count what the cpu run counts, to the byte
    assert _virtual_peaks("meta") == (virtual, largest)
    assert virtual[0] == virtual[1]  # 256 rows and 10 rows split evenly over 2 ranks
    step_scalars = 2 * LAYERS * 4  # AdamW's step per parameter: host memory beside CUDA
    # each rank within 66,048 B of the model: gloo's own temporaries (freed on gloo's thread)
    # can be alive at a rank's backward peak, and one run in a few (both sides: real 3,145,344
    # and modelled 3,112,024 B a rank, against 3,046,528 and 3,046,488 usually) another 64 KiB
    # activation is: not explained yet, so the test holds the bound, not the byte. Once, in a
    # loaded CI run, rank 1 peaked at 3,375,232 B: the model exactly (as rank 0) plus 263,168 B,
    # one more unsharded unit. The real FSDP2's all-gathers finish on gloo's thread, so whether a
    # unit is freed before the next one's prefetch is timing (a part of one too: rank 0 at
    # 3,292,800 B, 180,776 B above, in a full-suite run). So: at least one rank to the bound,
    # the other to it or up to one unit more.
    unit = (256 * 256 + 256) * 4
    excess = [r - step_scalars - virtual[0] for r in real]
    assert min(abs(e) for e in excess) <= 66_048, (real, virtual)
    assert all(-66_048 <= e <= unit + 66_048 for e in excess), (real, virtual)
    assert largest == ("0", (256 * 256 + 256) * 4)  # the first 256 x 256 layer, unsharded


def test_fsdp_ranks_put_their_shards_on_the_models_device() -> None:
    # the shards, all-gather and reduce-scatter buffers FSDP allocates are on the parameters'
    # real device, counted by a meta accountant as by a cpu one (they once went to the host)
    for world in (2, 3):
        peaks = {device: _virtual_peaks(device, world)[0] for device in ("cpu", "meta")}
        assert peaks["meta"] == peaks["cpu"], world
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
    with VirtualDevices([None] * 3, "meta") as vd:
        ranks = fsdp_ranks(model, None)
        shards = [p for rank in ranks for unit in rank.units for p in unit.shards]
        assert {p.device.type for p in shards} == {"meta"}
        # each rank holds its padded shards: ceil(256 / 3) = 86 and ceil(10 / 3) = 4 rows
        padded = (86 * 256 + 86 + 4 * 256 + 4) * 4
        assert [vd.current_of(i) for i in range(3)] == [padded] * 3


def test_fsdp_ranks_hold_the_unsharded_buffers_on_their_device() -> None:
    """FSDP2 shards parameters, not buffers: each rank holds BatchNorm's running statistics on
    its device, and a batch-norm model trains there (they were left on the host once, and
    every convolutional model with batch norm failed with a device mismatch)."""
    with torch.device("cpu"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8))
    with VirtualDevices([None, None], "cpu") as vd:
        ranks = fsdp_ranks(model, None)
        # 8 rows over 2 ranks: 4 each of the weight (x 16), the bias, BN's weight and bias
        shards = (4 * 16 + 4 + 4 + 4) * 4
        buffers = 8 * 4 + 8 * 4 + 8  # running mean and var (float32), the int64 step count
        assert [vd.current_of(i) for i in range(2)] == [shards + buffers] * 2
        for rank in ranks:
            with vd.on(rank.device):
                rank.model(vd.to(torch.randn(4, 16), rank.device)).sum().backward()
            assert all(vd.where(b) == rank.device for b in rank.model.buffers())
