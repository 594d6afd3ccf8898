"""A sequence-to-sequence copy task on a small attention model, trained close to the limit.

Imitates: lucidrains/x-transformers' ``examples/toy_tasks/enc_dec_copy.py`` (random token
sequences, the model learns to repeat them; attention written with ``einsum``, softmax and
dropout, pre-norm blocks, Adam at 3e-4), shrunk to run on a CPU in seconds.

memkit pitfall it exercises: a large cost per sample (the attention maps, about 10 MiB a
sample at the defaults) next to a small fixed part, so a batch that fits can leave less than
one sample's worth free: the probe's search must then verify the next size at once, not jump
past it and pay for several out-of-memory trials.

Run: ``python copy_task.py --batch-size 8``; the probe reads it as a model file:
``memkit probe tests/realworld/scripts/copy_task.py --device cpu --budget 256MiB``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

NUM_TOKENS = 16 + 2
SEQ_LEN = 128
DIM, DEPTH, HEADS = 64, 2, 8


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        dots = torch.einsum("bihd,bjhd->bhij", q, k) * self.scale
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        attn = self.dropout(dots.masked_fill(mask, float("-inf")).softmax(dim=-1))
        out = torch.einsum("bhij,bjhd->bihd", attn, v).reshape(b, n, d)
        return self.to_out(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class CopyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(NUM_TOKENS, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.logits = nn.Linear(DIM, NUM_TOKENS)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        x = self.emb(seq[:, :-1]) + self.pos[: seq.shape[1] - 1]
        for block in self.blocks:
            x = block(x)
        logits = self.logits(self.norm(x))
        return F.cross_entropy(logits.transpose(1, 2), seq[:, 1:])


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CopyModel()


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-4)


def make_batch(batch_size: int) -> torch.Tensor:
    """``[start, tokens..., start, the same tokens...]``: the second half copies the first."""
    half = torch.randint(2, NUM_TOKENS, (batch_size, SEQ_LEN // 2 - 1))
    start = torch.ones(batch_size, 1, dtype=torch.long)
    return torch.cat((start, half, start, half), dim=1)


def train(model: nn.Module, optim: torch.optim.Optimizer, batch_size: int, steps: int) -> None:
    """The example's loop: ``loss = model(seq)``, backward, step, zero_grad."""
    model.train()
    for _ in range(steps):
        seq = make_batch(batch_size)
        loss = model(seq)
        loss.backward()
        optim.step()
        optim.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = build_model()
    train(model, build_optimizer(model.parameters()), args.batch_size, args.steps)


if __name__ == "__main__":
    main()
