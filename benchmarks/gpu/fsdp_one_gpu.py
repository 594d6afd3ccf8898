"""A one-GPU FSDP2 world under ``memkit run``, with an independent count to check its report.

    torchrun --standalone --nproc-per-node 1 -m memkit run --device cuda --json $OUT/fsdp.json \\
        benchmarks/gpu/fsdp_one_gpu.py

nccl on cuda (gloo on cpu where CUDA is unavailable: ``--device cpu``). Four blocks of
``Linear(1024, 1024)`` + ReLU and a ``Linear(1024, 16)`` head, ``fully_shard`` on each block and
on the root (``reshard_after_forward=True``), AdamW, 3 steps of a batch of 256. With one rank a
shard is the whole parameter, so the counts below are exact: parameters 4 x 4,198,400 B + the
head's 65,600 B, AdamW's state twice that (+ its step scalars), one block's all-gather 4,198,400 B
(flat buffer and unsharded parameters: twice that while both live). Lines start with ``FSDP1``
so a session log can be grepped; a failure prints its traceback and exits 1 (no hang: the
process group times out after 60 s).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BLOCKS, WIDTH, HEAD, BATCH, STEPS = 4, 1024, 16, 256, 3


def fully_shard_fn() -> Callable[..., Any]:
    """FSDP2's ``fully_shard`` (public from torch 2.6; the composable path before)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of a tensor: a DTensor's local shard, else the tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """AdamW's state on the training device and elsewhere (its step scalars sit on the host)."""
    on_device = elsewhere = 0
    for state in opt.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.device.type == "cpu" and torch.cuda.is_available():
                elsewhere += local_bytes(value)
            else:
                on_device += local_bytes(value)
    return on_device, elsewhere


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    device = device or torch.device("cpu")
    print(f"FSDP1 rank {rank}/{world} on {device}, torch {torch.__version__}", flush=True)
    fully_shard = fully_shard_fn()

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, HEAD)).to(device)
    for block in blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(BATCH, WIDTH, device=device)

    grads = 0
    start = time.perf_counter()
    for _ in range(STEPS):
        model(x).square().mean().backward()
        grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    params = sum(local_bytes(p) for p in model.parameters())
    unit = (WIDTH * WIDTH + WIDTH) * 4
    expected_params = (BLOCKS * unit + (WIDTH * HEAD + HEAD) * 4) // world
    state_device, state_host = optimizer_state_bytes(opt)
    print(f"FSDP1 parameters (local shards) {params} B (expected {expected_params} B)")
    print(f"FSDP1 gradients (local shards, before zero_grad) {grads} B")
    print(f"FSDP1 optimizer state {state_device} B on {device.type}, {state_host} B elsewhere")
    print(f"FSDP1 one block all-gathered {unit} B; activations of a block {BATCH * WIDTH * 4} B")
    if cuda:
        print(f"FSDP1 torch.cuda.max_memory_allocated {torch.cuda.max_memory_allocated()} B, "
              f"memory_allocated now {torch.cuda.memory_allocated()} B")  # fmt: skip
    else:
        print("FSDP1 torch.cuda.max_memory_allocated n/a (cpu): compare memkit's own peak")
    print(f"FSDP1 {STEPS} steps in {seconds:.2f} s")


if __name__ == "__main__":
    code = 0
    try:
        main()
    except Exception:  # a lent GPU session must go on: say what failed, exit 1
        print("FSDP1 FAILED:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)
