"""DDP on virtual devices against real DistributedDataParallel: 2 gloo ranks on CPU.

Both ranks (in the launch the suite's 2-rank tests share, tests/rank_processes.py) run
DistributedDataParallel (gloo) on their own ``memkit.simulate`` device, with
``gradient_as_bucket_view`` off and on, and report their peak.
The same model, per-rank batch and optimizer run on ``memkit.simulate(devices=2)`` through
``memkit.simulated.parallel.ddp_replicas``; the per-device peaks must match the real ranks' within
1%.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_processes import rank_scenario

import memkit
from memkit.simulated.parallel import bucket_sizes, ddp_replicas

pytestmark = pytest.mark.slow

PER_RANK, STEPS = 64, 2

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)  # conv + BatchNorm (buffers DDP broadcasts every forward), and
        return nn.Sequential(  # a 2 MiB linear: two gradient buckets (1 MiB first bucket)
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10),
        )

    def batch(n):
        return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))

    def step(model, opt, n):
        x, y = batch(n)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    """
)

SCENARIO = textwrap.dedent(
    """
    import torch
    import memkit
    from fidelity_model import build, step

    def run(rank, args):
        per_rank, steps = args
        result = {}
        for as_view in (False, True):
            model = build()
            with memkit.simulate(None, track=model) as acct:
                ddp = torch.nn.parallel.DistributedDataParallel(
                    model, gradient_as_bucket_view=as_view)
                opt = torch.optim.AdamW(ddp.parameters())
                for _ in range(steps):
                    step(ddp, opt, per_rank)
                result[str(as_view)] = {"peak": acct.peak, "current": acct.current}
                del ddp, opt
        return result
    """
)

rank_scenario(
    "ddp-fidelity", SCENARIO, files={"fidelity_model.py": MODEL}, args=lambda: [PER_RANK, STEPS]
)


def _load(folder: Path) -> Any:
    spec = importlib.util.spec_from_file_location("fidelity_model", folder / "fidelity_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _virtual(code: Any, as_view: bool) -> tuple[list[int], list[int], int]:
    """Per-device peaks and current bytes of ddp_replicas on 2 virtual devices."""
    with memkit.simulate(None, devices=2) as vd:
        ranks = ddp_replicas(
            code.build(),
            lambda m: torch.optim.AdamW(m.parameters()),
            gradient_as_bucket_view=as_view,
        )
        for rank in ranks:
            with vd.on(rank.device):
                for _ in range(STEPS):
                    code.step(rank.model, rank.optimizer, PER_RANK)
        return vd.peaks, [vd.current_of(i) for i in range(2)], len(ranks[0].buckets)


def test_virtual_ddp_peaks_equal_real_gloo_ranks(gloo_ranks) -> None:
    ranks = gloo_ranks("ddp-fidelity")
    real = ranks.results
    assert real[0] == real[1]  # same model, same per-rank batch: the ranks agree
    code = _load(ranks.folder)
    model = code.build()
    params = list(model.parameters())
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    b_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    for as_view in (False, True):
        peaks, current, n_buckets = _virtual(code, as_view)
        measured = real[0][str(as_view)]
        for peak in peaks:
            assert abs(peak - measured["peak"]) <= 0.01 * measured["peak"], (as_view, peaks, real)
        # after the steps (gradients set to None): parameters, buffers, AdamW's two states, the
        # buckets (one parameter's worth) and the Reducer's used map, an int32 per parameter
        expected = 4 * p_bytes + b_bytes + 4 * len(params)
        assert measured["current"] == expected and current == [expected, expected]
        assert n_buckets == len(bucket_sizes(params)) == 2
    # with the gradients as bucket views they stop coexisting with the buckets: the real
    # ranks' peak drops, and the model's with it (checked above against each)
    assert real[0]["True"]["peak"] < real[0]["False"]["peak"]
