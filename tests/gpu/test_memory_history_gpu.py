"""The memory history on a real CUDA device: PyTorch records, memkit writes protocol 4, and
``memkit inspect`` agrees with the allocator's own counters."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz as viz

from memkit.inspection import inspect_snapshot
from memkit.tracking import track

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def test_track_records_the_cuda_allocator(tmp_path):
    path = tmp_path / "cuda.pickle"
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cuda:0", memory_history=path) as tracker:
        for _ in range(2):
            model(torch.randn(256, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        allocated = torch.cuda.memory_allocated(0)
        reserved = torch.cuda.memory_reserved(0)
    assert tracker.history_file == path
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04"  # protocol 4, what memory_viz reads
    data = pickle.loads(raw)
    dev = inspect_snapshot(path).device(0)
    assert (dev.allocated, dev.reserved) == (allocated, reserved)
    assert dev.trace_entries > 0 and dev.allocs > 0 and dev.peak_allocated is not None
    params = sum(p.numel() * 4 for p in model.parameters())
    assert dev.category("optimizer state") >= 2 * params  # exp_avg and exp_avg_sq
    assert "add_local_files" in viz.trace_plot(data) and "add_local_files" in viz.segment_plot(data)
    viz.segsum(data)
    # recording stopped with the block
    before = len(pickle.loads(raw)["device_traces"][0])
    torch.empty(1 << 20, device="cuda")
    assert len(torch.cuda.memory._snapshot()["device_traces"][0]) in (0, before)


def test_the_history_is_written_when_cuda_runs_out(tmp_path):
    path = tmp_path / "oom.pickle"
    free, _ = torch.cuda.mem_get_info()
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(device="cuda:0", memory_history=path, postmortem=None),
    ):
        torch.empty(free + (1 << 30), dtype=torch.uint8, device="cuda")
    ooms = inspect_snapshot(path).device(0).ooms
    assert ooms and ooms[-1].size >= free
