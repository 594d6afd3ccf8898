"""Is the probe's answer the boundary of the script's own loop? On the CUDA stand-in, no GPU.

A small GPT stepped as nanoGPT's train.py steps it (autocast, the last logits kept until the
next forward, gradient clipping, AdamW) is probed under a cap; then the same step runs as a
plain loop (no memkit) in a fresh process per size under the same cap, at the answer and one
more. Prints the trials and both outcomes:

    python benchmarks/probe_vs_loop.py --budget 64MiB

The logits kept in a global are what made a trial after an OOM in backward run out too
(their graph is freed only by a backward that completes). At 64 MiB: before the fix of
2026-11-26 (session 7) `1 2 4 32x 18 20 26x 23x 21 22x`, answer 21; after it `... 26x 23 24x`,
answer 23; the plain loop fits 21 and 23 and runs out at 22 and 24 (near the cap the segments
pack differently at each size: the boundary is not monotone). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
from torch import nn

_kept: list[torch.Tensor] = []


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True, dropout=0.2)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 65, block: int = 64, width: int = 128, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, 4) for _ in range(layers)))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]).to(idx.device))
        logits = self.head(self.blocks(x))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def build_model() -> nn.Module:
    torch.manual_seed(1337)
    return GPT()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 65, (batch_size, 64))
    return x, torch.roll(x, -1, 1)


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)


def train_step(model: nn.Module, batch, optimizer) -> None:
    x, y = batch
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
        logits, loss = model(x, y)
    _kept[:] = [logits]  # train.py's `logits` lives until the next forward
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def loop(size: int, budget: str, steps: int) -> str:
    """The plain loop at ``size`` on a fresh stand-in capped at ``budget``: fits or OOM."""
    from memkit.devices import get_backend
    from memkit.devices.cuda_standin import cuda_standin

    with cuda_standin("4GiB"):
        model = build_model().to("cuda")
        opt = build_optimizer(model.parameters())
        with get_backend("cuda", budget).activate():
            for step in range(steps):
                x, y = make_batch(size)
                try:
                    train_step(model, (x.to("cuda"), y.to("cuda")), opt)
                except torch.OutOfMemoryError:
                    return f"OOM at step {step}"
    return "fits"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64MiB")
    parser.add_argument("--steps", type=int, default=6, help="steps of the plain loop")
    parser.add_argument("--loop", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop is not None:  # the child: one size in a fresh process
        print(loop(args.loop, args.budget, args.steps))
        return

    import memkit
    from memkit.devices.cuda_standin import cuda_standin

    with cuda_standin("4GiB"):
        model = build_model().to("cuda")
        result = memkit.probe(
            model, make_batch, optimizer=build_optimizer(model.parameters()),
            train_step=train_step, device="cuda", budget=args.budget, margin=0,
        )  # fmt: skip
    best = result.max_batch_size
    trials = " ".join(f"{t.batch_size}{'' if t.fits else 'x'}" for t in result.trials)
    print(f"probe ({args.budget}, CUDA stand-in): {best} in {len(result.trials)} trials: {trials}")
    for line in result.defaults:
        if "stayed allocated" in line:
            print(f"  {line}")
    if best is None:
        return
    for size in (best, best + 1):
        child = [sys.executable, __file__, "--budget", args.budget, "--steps", str(args.steps)]
        done = subprocess.run([*child, "--loop", str(size)], capture_output=True, text=True)
        outcome = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
        print(f"plain loop, fresh process, {args.steps} steps at {size}: {outcome}")


if __name__ == "__main__":
    main()
