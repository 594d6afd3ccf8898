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
from collections.abc import Callable

import pytest
import torch
from rank_processes import rank_scenario

from memkit.simulated.fsdp import fsdp_ranks
from memkit.simulated.virtual_devices import HOST, SimulationError, VirtualDevices

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
    import importlib
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import memkit

    def run(rank, args):
        module, per_rank, steps = args
        model_file = importlib.import_module(module)
        model = model_file.build()
        for block in model:
            fully_shard(block)
        fully_shard(model)
        with memkit.simulate(None) as sim:
            sim.track(model)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            for _ in range(steps):
                model_file.step(model, opt, per_rank)
        return {"rank": dist.get_rank(), "peak": sim.peak}
    """
)
"""Real FSDP2 on the gloo ranks: each block and the model ``fully_shard``-ed, the model file's
steps under a plain simulated device (no budget), AdamW over the trainable parameters."""

if importlib.util.find_spec("torch.distributed.fsdp") is not None:
    rank_scenario(
        "fsdp-fidelity",
        SCENARIO,
        files={"fidelity_fsdp_model.py": MODEL},
        args=lambda: ["fidelity_fsdp_model", PER_RANK, STEPS],
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


# LoRA: each block a frozen Linear with a trainable low-rank adapter beside it, the middle
# block frozen whole, a trainable head. FSDP2 reshards a unit in its post-backward, which runs
# when the gradients of the unit's inputs are in (RegisterPostBackwardFunction), not when its
# parameters' are: the frozen base weight is still needed then, for the input's gradient. The
# simulation resharded on the adapters' gradients once, and every frozen model's fsdp failed
# ("cuda:0 and cpu!", blamed on the user's tensor placement).
LORA = textwrap.dedent(
    """
    import torch

    class Lora(torch.nn.Module):
        def __init__(self, trainable=True):
            super().__init__()
            self.base = torch.nn.Linear(256, 256)
            self.base.requires_grad_(False)
            self.A = torch.nn.Linear(256, 8, bias=False)
            self.B = torch.nn.Linear(8, 256, bias=False)
            self.A.requires_grad_(trainable)
            self.B.requires_grad_(trainable)

        def forward(self, x):
            return torch.relu(self.base(x) + self.B(self.A(x)))

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(Lora(), Lora(trainable=False), Lora(), torch.nn.Linear(256, 10))

    def optimizer(model):
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step(model, opt, n):
        model(torch.randn(n, 256)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    """
)

LORA_PER_RANK = 96

if importlib.util.find_spec("torch.distributed.fsdp") is not None:
    rank_scenario(
        "fsdp-lora-fidelity",
        SCENARIO,
        files={"fidelity_lora_model.py": LORA},
        args=lambda: ["fidelity_lora_model", LORA_PER_RANK, STEPS],
    )

LORA_UNIT = (256 * 256 + 256 + 2 * 8 * 256) * 4  # a block's parameters, unsharded: 279,552 B
# a rank's padded shards (2 ranks): half of every parameter's rows, frozen ones too
LORA_SHARDS = (3 * LORA_UNIT + (256 * 10 + 10) * 4) // 2
# the trainable ones (adapters of blocks 0 and 2, the head): their sharded gradients and
# AdamW's two moments; none for the frozen base weights and the frozen block
LORA_TRAINABLE = (2 * 2 * 8 * 256 + 256 * 10 + 10) * 4 // 2
LORA_STEP_SCALARS = 6 * 4  # AdamW's step per trainable parameter: counted by a plain cpu device


def _lora(device: str = "cpu", steps: int = STEPS, per_rank: int = LORA_PER_RANK) -> dict:
    """The LoRA model through ``fsdp_ranks`` on 2 virtual devices, with what a rank holds at
    the points a hand count can name."""
    namespace: dict[str, object] = {}
    exec(LORA, namespace)
    build, optimizer, step = namespace["build"], namespace["optimizer"], namespace["step"]
    seen: dict[str, object] = {"gathered": []}
    with torch.device(device):
        model = build()  # type: ignore[operator]
    with VirtualDevices([None, None], device) as vd:
        ranks = fsdp_ranks(model, optimizer)  # type: ignore[arg-type]
        rank = ranks[0]
        seen["built"] = vd.current_of(0)

        def on_device(block: torch.nn.Module) -> int:  # its parameters' bytes on cuda:0
            return sum(p.numel() * 4 for p in block.parameters() if vd.where(p) == 0)

        def inside(i: int) -> Callable[[torch.Tensor], None]:
            # in block i's backward: its base's or adapter's output gradient, then the frozen
            # base weight gives the input's gradient (block 0: no input gradient, the adapter)
            def hook(_grad: torch.Tensor) -> None:
                gathered = seen["gathered"]
                assert isinstance(gathered, list)
                if i not in [j for j, _ in gathered]:
                    gathered.append((i, [on_device(b) for b in rank.model]))

            return hook

        def watch(i: int) -> Callable[..., None]:
            def forward_hook(_m: torch.nn.Module, _a: object, out: torch.Tensor) -> None:
                if out.requires_grad:  # the first block's base output needs none
                    out.register_hook(inside(i))

            return forward_hook

        handles = [
            layer.register_forward_hook(watch(i))
            for i in range(3)
            for layer in (rank.model[i].base, rank.model[i].A)
        ]
        with vd.on(rank.device), torch.device(device):
            rank.model(torch.randn(per_rank, 256)).sum().backward()
            seen["after_backward"] = vd.current_of(0)
            for handle in handles:
                handle.remove()
            seen["grads"] = [
                [s.grad is not None for s in unit.shards] for unit in rank.units if unit.params
            ]
            rank.optimizer.step()
            rank.optimizer.zero_grad(set_to_none=True)
            seen["after_step"] = vd.current_of(0)
            for _ in range(steps - 1):
                step(rank.model, rank.optimizer, per_rank)  # type: ignore[operator]
        for other in ranks[1:]:
            with vd.on(other.device), torch.device(device):
                for _ in range(steps):
                    step(other.model, other.optimizer, per_rank)  # type: ignore[operator]
        seen["peaks"] = vd.peaks
    return seen


def test_fsdp_ranks_with_frozen_parameters_hold_what_fsdp2_holds_by_hand_count() -> None:
    seen = _lora()
    # built: each rank's padded shards of every parameter, the frozen ones too
    assert seen["built"] == LORA_SHARDS
    # in each block's backward it is gathered whole (the frozen block too: its input's gradient
    # flows to block 0's adapters), and no block after it still is; the old code had moved
    # block 2 back to the host once its adapters' gradients arrived, before its base was used
    gathered = seen["gathered"]
    assert [i for i, _ in gathered] == [2, 1, 0]  # type: ignore[union-attr]
    for i, on in gathered:  # type: ignore[union-attr]
        assert on[i] == LORA_UNIT and all(on[j] == 0 for j in range(i + 1, 3)), gathered
    # after backward: the shards and the sharded gradients of the trainable parameters only
    # (nothing gathered, no reduce-scatter buffer left); the frozen shards have no gradient
    assert seen["after_backward"] == LORA_SHARDS + LORA_TRAINABLE
    adapter = [False, False, True, True]  # base weight, base bias, A, B
    assert seen["grads"] == [adapter, [False] * 4, adapter, [True, True]]
    # after the step: AdamW's two moments over the trainable shards only (its step counts
    # are host scalars beside the device's parameters, as on CUDA)
    assert seen["after_step"] == LORA_SHARDS + 2 * LORA_TRAINABLE
    peaks = seen["peaks"]
    assert peaks[0] == peaks[1]  # every dim0 even: the same shards on both ranks
    # meta tensors (memkit estimate) count what the cpu run counts, to the byte
    assert _lora("meta")["peaks"] == peaks


def test_fsdp_ranks_with_frozen_parameters_peak_matches_real_fsdp2_on_gloo(gloo_ranks) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    rows = gloo_ranks("fsdp-lora-fidelity").results
    assert [r["rank"] for r in rows] == [0, 1]
    virtual = _lora()["peaks"]
    # 1,651,328 B a rank modelled, 1,651,352 real (+ AdamW's 6 step scalars) on this machine;
    # the bounds of the test above for gloo's temporaries and its timing of one unit
    excess = [r["peak"] - LORA_STEP_SCALARS - virtual[0] for r in rows]
    assert min(abs(e) for e in excess) <= 66_048, (rows, virtual)
    assert all(-66_048 <= e <= LORA_UNIT + 66_048 for e in excess), (rows, virtual)


def test_a_parameter_the_simulation_left_on_the_host_is_memkits_error_not_the_users() -> None:
    # the frozen-model failure read "tensors are placed with memkit.to_virtual(tensor, i)": the
    # user's mistake. A parameter memkit's FSDP had resharded to the host is memkit's.
    with torch.device("cpu"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with VirtualDevices([None, None], "cpu") as vd:
        rank = fsdp_ranks(model, None)[0]
        with vd.on(rank.device):
            out = rank.model(torch.randn(4, 8))

            def reshard_too_early(_grad: torch.Tensor) -> None:  # after FSDP's pre-backward
                vd.to([rank.model[1].weight], HOST)

            out.register_hook(reshard_too_early)
            out = out.sum()
            with pytest.raises(SimulationError, match="cuda:0 and cpu") as raised:
                out.backward()
            assert "an internal error of memkit's simulation" in str(raised.value)
            assert "memkit.to_virtual" not in str(raised.value)
            # the user's own host tensor beside a device one still gets the placement hint
            with vd.on(HOST):
                mine = torch.ones(2)
            with pytest.raises(RuntimeError, match=r"memkit\.to_virtual") as user:
                rank.model[0](torch.randn(4, 8)).sum(0)[:2] + mine
            assert not isinstance(user.value, SimulationError)
