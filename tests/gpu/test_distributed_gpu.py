"""memkit probe / run across 2 ranks on ONE real GPU: gloo on cuda:0 (NCCL refuses two ranks
on one GPU). Rank 1 gets a smaller --budget, so it runs out first, with real CUDA OOMs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]

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
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "--no-python", "memkit"]
    proc = subprocess.Popen(
        cmd + args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun did not finish within {limit} s (a hang)")
    return subprocess.CompletedProcess(cmd + args, proc.returncode, out, err)


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
