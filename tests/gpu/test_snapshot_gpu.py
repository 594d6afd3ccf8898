"""Snapshots on a real CUDA device: the numbers move by what was allocated, and add up."""

from __future__ import annotations

import pytest
import torch

from memkit.snapshots import snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1024 * 1024


def test_allocated_grows_by_a_known_tensor_and_used_covers_reserved():
    torch.cuda.init()
    before = snapshot(device="cuda:0")
    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0")  # 64 MiB, a 512-multiple
    after = snapshot(device="cuda:0")
    b, a = before.devices[0], after.devices[0]
    assert a.allocated is not None and b.allocated is not None
    assert a.allocated - b.allocated == 64 * MIB
    assert a.reserved is not None and a.reserved >= a.allocated
    assert a.used is not None and a.total is not None
    assert a.used >= a.reserved  # device-wide used includes this process's reserve
    assert a.outside is not None and a.outside > 0  # at least the CUDA context
    diff = after - before
    assert any(c.what == "allocated" and c.delta == 64 * MIB for c in diff.changes)
    del x


def test_categories_on_cuda_are_exact_and_other_is_the_rest():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 10)).cuda()
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())
    opt = torch.optim.Adam(model.parameters())
    batch = torch.randn(256, 1024, device="cuda")
    model(batch).sum().backward()
    opt.step()
    snap = snapshot(model, opt, device="cuda:0")
    (cats,) = [c for c in snap.categories if c.device == "cuda:0"]
    # categories count allocator blocks (bytes rounded up to 512, as memory_allocated does):
    # the 10-float bias takes a 512-byte block, so the tensors' own bytes are 472 fewer
    tensor_bytes = sum(p.numel() * 4 for p in model.parameters())
    params = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    assert params - tensor_bytes == 512 - 40
    assert cats.parameters == params
    assert cats.gradients == params
    assert cats.counted_as.startswith("allocator blocks")
    assert cats.optimizer_state >= 2 * params  # exp_avg, exp_avg_sq (+ step on device)
    row = snap.devices[0]
    assert cats.other is not None and row.allocated is not None
    assert cats.categorised + cats.other == row.allocated
    assert cats.other >= batch.numel() * 4
    names = {t.name for t in snap.tensors}
    assert "0.weight" in names and "0.weight:exp_avg" in names


def test_every_visible_gpu_is_listed_in_cuda_order():
    snap = snapshot()
    assert [d.device for d in snap.devices if d.kind == "cuda"] == [
        f"cuda:{i}" for i in range(torch.cuda.device_count())
    ]
