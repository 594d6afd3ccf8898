"""A GPT learning to add n-digit numbers, in the shape of karpathy/minGPT ``projects/adder``
with ``mingpt/trainer.py``'s loop: ``logits, self.loss = model(x, y)``, then
``model.zero_grad(set_to_none=True)`` just before ``self.loss.backward()``,
``clip_grad_norm_``, ``self.optimizer.step()``; AdamW over decay/no-decay groups.

Pitfall for memkit: gradients are freed between the forward and the backward, so each step's
forward runs with the previous step's gradients allocated, while backward starts without them
(``--healthy``: ``zero_grad`` right after the step, the twin to measure the saving against).

The adder dataset is made here (no download): ``a + b = c`` with ``c`` reversed, as minGPT
does; ``--ndigit``, ``--n-embd``, ``--n-layer`` and ``--batch-size`` scale it.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)
        causal = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", causal.view(1, 1, block_size, block_size))
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd),
            act=nn.GELU(), dropout=nn.Dropout(0.1),
        ))  # fmt: skip
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.1),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))  # fmt: skip
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)  # fmt: skip
        return logits, loss


def adder_batch(batch: int, ndigit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """minGPT's AdditionDataset: digits of a, b and the reversed sum c; the loss only on c."""
    a = torch.randint(0, 10**ndigit, (batch,))
    b = torch.randint(0, 10**ndigit, (batch,))
    rows = []
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        astr, bstr = f"%0{ndigit}d" % x, f"%0{ndigit}d" % y
        cstr = (f"%0{ndigit + 1}d" % (x + y))[::-1]
        rows.append([int(s) for s in astr + bstr + cstr])
    dix = torch.tensor(rows, dtype=torch.long)
    x, y = dix[:, :-1], dix[:, 1:].clone()
    y[:, : ndigit * 2 - 1] = -1
    return x, y


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ndigit", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-iters", type=int, default=4)
    parser.add_argument("--healthy", action="store_true",
                        help="zero_grad right after the optimizer step instead")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    block_size = 3 * args.ndigit + 1 - 1
    model = GPT(10, block_size, args.n_layer, args.n_head, args.n_embd)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n
             and "wte" not in n and "wpe" not in n]  # fmt: skip
    ids = {id(p) for p in decay}
    no_decay = [p for p in model.parameters() if id(p) not in ids]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=5e-4, betas=(0.9, 0.95),
    )  # fmt: skip
    model.train()
    for it in range(args.max_iters):
        x, y = adder_batch(args.batch_size, args.ndigit)
        logits, loss = model(x, y)
        if not args.healthy:
            model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.healthy:
            model.zero_grad(set_to_none=True)
        print(f"iter {it}: train loss {loss.item():.5f}")
