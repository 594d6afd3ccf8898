"""The tracker over tensor subclasses: FSDP2's DTensor parameters (a wrapper subclass whose own
storage has no data pointer) are counted as the rank's local shards, and training goes on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memkit


def test_fsdp2_parameters_count_as_local_shards_and_training_goes_on(one_rank):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    for layer in model:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    with memkit.track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(3):
            model(torch.randn(32, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert report.steps == 3
    assert not any("stopped tracking" in n for n in report.notes), report.notes
    params = 4 * (256 * 256 + 256) * 4  # hand count: one rank holds every shard
    bd = report.devices[0].breakdown
    assert bd is not None and bd.parameters == params
    assert abs(bd.optimizer_state - 2 * params) <= 64  # exp_avg, exp_avg_sq (+ step)
