"""memkit probe / run across 2 ranks on ONE real GPU: gloo on cuda:0 (NCCL refuses two ranks
on one GPU). Rank 1 gets a smaller --budget, so it runs out first, with real CUDA OOMs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


MODEL = textwrap.dedent(
    """
    import torch

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                   torch.nn.Linear(4096, 1024))

    def make_batch(batch_size):
        return torch.randn(batch_size, 1024)
    """
)


def _torchrun(tmp_path: Path, args: list[str], limit: float = 300.0) -> subprocess.CompletedProcess:
    # python -m memkit: a GPU machine's memkit may be importable without its console script
    return torchrun(tmp_path, [sys.executable, "-m", "memkit", *args], limit=limit)


@pytest.mark.parametrize("ddp", [False, True])
def test_probe_two_ranks_on_cuda0_with_gloo(tmp_path: Path, ddp: bool) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    args = ["probe", "model.py", "--device", "cuda:0", "--dist-backend", "gloo", "--budget",
            "2GiB,1GiB", "--json", "--timeout", "120", "--max-batch", "65536"]  # fmt: skip
    done = _torchrun(tmp_path, args + (["--ddp"] if ddp else []))
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(done.stdout)
    assert data["world_size"] == 2 and data["ddp"] is ddp
    assert data["tightest_rank"] == 1 and data["max_batch_size"] < 65536
    best = data["max_batch_size"]
    after = [t for t in data["trials"] if t["batch_size"] == best + 1]
    assert after and not after[0]["fits"] and "rank(s) 1" in after[0]["error"]
