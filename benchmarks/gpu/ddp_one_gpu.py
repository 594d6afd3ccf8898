"""A one-GPU DDP world under ``memkit run``, with the count to check its gradient buckets.

    torchrun --standalone --nproc-per-node 1 -m memkit run --device cuda --json $OUT/ddp.json \\
        benchmarks/gpu/ddp_one_gpu.py [--view]

nccl on cuda (gloo on cpu: ``--device cpu``). Four ``Linear(1024, 1024)`` + ReLU blocks and a
``Linear(1024, 16)`` head under DDP (``gradient_as_bucket_view`` with ``--view``), AdamW, 3
steps of a batch of 256. DDP's Reducer keeps flat buckets as large as the parameters; without
``--view`` the gradients are a second copy, with it they are views into the buckets. Lines start
with ``DDP1`` so a session log can be grepped.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(4)]
    model = DDP(
        nn.Sequential(*blocks, nn.Linear(1024, 16)).to(device),
        gradient_as_bucket_view="--view" in sys.argv,
    )
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 1024, device=device)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"DDP1 view={'--view' in sys.argv} parameters {params} B; buckets expected about {params} B"
    )
    if cuda:
        print(f"DDP1 torch.cuda.max_memory_allocated {torch.cuda.max_memory_allocated()} B")


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
