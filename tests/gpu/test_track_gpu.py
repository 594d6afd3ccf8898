"""memkit.track on real CUDA devices: counters, a real OOM post-mortem, DataParallel per device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memkit.devices import counter_reader, get_backend
from memkit.tracking import track

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1024 * 1024


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def test_fast_counters_match_the_public_api():
    torch.cuda.init()
    read, reset = counter_reader(get_backend("cuda:0"))
    x = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda:0")
    a, r, p, pr = read()
    assert a == torch.cuda.memory_allocated(0) and r == torch.cuda.memory_reserved(0)
    assert p == torch.cuda.max_memory_allocated(0) and pr == torch.cuda.max_memory_reserved(0)
    del x
    reset()
    assert read()[2] == torch.cuda.memory_allocated(0)


def test_tracks_phases_and_modules_on_cuda():
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cuda:0") as tracker:
        for _ in range(3):
            model(torch.randn(256, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    dev = report.device("cuda:0")
    assert report.steps == 3 and dev.peak_reserved >= dev.peak_allocated > 0
    assert all(dev.phase_peaks[p] is not None for p in ("forward", "backward", "optimizer"))
    # the ReLU keeps its output for backward; the Linear's output is freed once the ReLU ran
    rows = {m.path: m for m in dev.modules}
    assert rows["1"].activation_bytes >= 256 * 4096 * 4 > rows["0"].activation_bytes
    assert dev.breakdown is not None and dev.breakdown.optimizer_state >= 2 * sum(
        p.numel() * 4 for p in model.parameters()
    )


def test_real_cuda_oom_post_mortem():
    model = mlp().cuda()
    free, _ = torch.cuda.mem_get_info()
    batch = int(free // (4096 * 4)) + 1  # the first Linear's output alone cannot fit
    with pytest.raises(torch.OutOfMemoryError), track(model, device="cuda:0", postmortem=None) as t:
        model(torch.randn(batch, 1024, device="cuda"))
    torch.cuda.empty_cache()  # its input's segment (a quarter of the card): not the next tests'
    pm = t.report().oom
    assert pm is not None and pm.device == "cuda:0" and pm.phase == "forward"
    assert pm.module == "0" and pm.tried_to_allocate is not None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs 2 CUDA devices")
def test_data_parallel_records_each_replica_on_its_device():
    model = nn.DataParallel(mlp().cuda(), device_ids=[0, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(model, opt) as tracker:
        for _ in range(2):
            model(torch.randn(512, 1024, device="cuda:0")).sum().backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    names = [d.device for d in report.devices]
    assert "cuda:0" in names and "cuda:1" in names
    d0, d1 = report.device("cuda:0"), report.device("cuda:1")
    assert any(m.path == "module.0" for m in d1.modules)  # replica thread on cuda:1
    assert d0.peak_allocated > d1.peak_allocated  # GPU 0 holds weights, grads, the gather


@pytest.mark.parametrize("ends", ["normally", "out-of-memory"])
def test_the_users_peak_survives_a_capped_block(ends):
    """A budget's cap empties the cache when the block begins (and an OOM empties it again):
    after the block, torch.cuda.max_memory_allocated() still reads the user's earlier peak, and
    the post-mortem states the cap as the capacity."""
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters())

    def step(batch: int) -> None:
        model(torch.randn(batch, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(64)  # Adam's state, then what a step at 64 needs on top (its foreach temporaries)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(64)
    need = torch.cuda.max_memory_allocated() - before
    step(8192)
    users_peak = torch.cuda.max_memory_allocated()
    step(64)
    # twice the need and a segment's rounding to spare; a step at 16384 needs over 256 MiB more
    budget = torch.cuda.memory_allocated() + 2 * need + 64 * MIB
    tracker = track(model, opt, device="cuda:0", budget=budget, postmortem=None)
    try:
        with tracker:
            step(64 if ends == "normally" else 16384)
    except torch.OutOfMemoryError:
        assert ends == "out-of-memory"
    assert torch.cuda.max_memory_allocated() >= users_peak
    if ends == "out-of-memory":
        pm = tracker.report().oom
        assert pm is not None and pm.capacity is not None and pm.capacity <= budget + 2 * MIB
