"""An encoder-decoder learning to copy sequences, in the shape of lucidrains/x-transformers
``train_copy.py`` and its modules: ``XTransformer`` holds ``encoder`` (a ``TransformerWrapper``)
and ``decoder`` (an ``AutoregressiveWrapper`` around one, as ``decoder.net``); each wrapper's
``attn_layers.layers`` is a ``ModuleList`` of ``ModuleList([norms, block, residual])`` entries
(attention, cross-attention, feed-forward), and every ``Attention`` computes its scores in an
``Attend`` module that has a ``Dropout`` child. The loop is the script's: ``loss = model(src,
tgt, mask=src_mask)``, ``loss.backward()``, ``optim.step()``, ``optim.zero_grad()``.

Pitfalls for memkit: blocks inside blocks inside the model (which repeated block to
checkpoint), the layer entries are ``ModuleList``s (no forward of their own), and the largest
activations (the attention scores) live in a parent module (``Attend``), not a leaf.

Written here by hand (no download); small sizes by default, ``--dim``/``--depth``/``--batch``
scale it.

``memkit probe`` also reads this file as a model file (``build_model``, ``make_batch``,
``build_optimizer``; ``train`` is the loop its answer is checked against): 64 source tokens, 8
heads, about 7.6 MiB a sample next to a fixed 3 MiB. The pitfall there: a large cost per sample,
so a batch that fits can leave less than one sample's worth free, and the probe's search must
verify the next size at once, not jump past it and pay for several out-of-memory trials.
``memkit probe tests/realworld/scripts/x_transformers_copy.py --device cpu --budget 96MiB``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Attend(nn.Module):
    def __init__(self, dropout: float = 0.0, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        scale = q.shape[-1] ** -0.5
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if mask is not None:
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        if self.causal:
            i, j = sim.shape[-2:]
            causal = torch.ones(i, j, dtype=torch.bool, device=sim.device).triu(j - i + 1)
            sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0, causal=False):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attend = Attend(dropout=dropout, causal=causal)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, context=None, mask=None, context_mask=None):
        kv_input = x if context is None else context
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = (t.reshape(b, -1, h, t.shape[-1] // h).transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v, mask=mask if context is None else context_mask)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU()),
            nn.Dropout(dropout),
            nn.Linear(inner, dim),
        )

    def forward(self, x):
        return self.ff(x)


class Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads, causal=False, cross_attend=False, dropout=0.1):
        super().__init__()
        layer_types = ("a", "c", "f") if cross_attend else ("a", "f")
        self.layer_types = layer_types * depth
        self.layers = nn.ModuleList([])
        for kind in self.layer_types:
            if kind == "a":
                block = Attention(dim, heads=heads, dim_head=dim // heads, dropout=dropout,
                                  causal=causal)  # fmt: skip
            elif kind == "c":
                block = Attention(dim, heads=heads, dim_head=dim // heads, dropout=dropout)
            else:
                block = FeedForward(dim, dropout=dropout)
            norms = nn.ModuleList([nn.LayerNorm(dim), None, None])
            self.layers.append(nn.ModuleList([norms, block, Residual()]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None, context=None, context_mask=None):
        for kind, (norms, block, residual_fn) in zip(self.layer_types, self.layers, strict=True):
            residual = x
            x = norms[0](x)
            if kind == "a":
                out = block(x, mask=mask)
            elif kind == "c":
                out = block(x, context=context, context_mask=context_mask)
            else:
                out = block(x)
            x = residual_fn(out, residual)
        return self.final_norm(x)


class Encoder(AttentionLayers):
    def __init__(self, **kwargs):
        super().__init__(causal=False, **kwargs)


class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        super().__init__(causal=True, **kwargs)


class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers, emb_dropout=0.0):
        super().__init__()
        dim = attn_layers.final_norm.normalized_shape[0]
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, return_embeddings=False, mask=None, **kwargs):
        pos = torch.arange(x.shape[1], device=x.device)
        x = self.emb_dropout(self.token_emb(x) + self.pos_emb(pos))
        x = self.attn_layers(x, mask=mask, **kwargs)
        return x if return_embeddings else self.to_logits(x)


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, **kwargs):
        inp, target = x[:, :-1], x[:, 1:]
        logits = self.net(inp, **kwargs)
        return F.cross_entropy(logits.transpose(1, 2), target)


class XTransformer(nn.Module):
    def __init__(self, *, dim, num_tokens, enc_depth, dec_depth, heads, enc_max_seq_len,
                 dec_max_seq_len):  # fmt: skip
        super().__init__()
        self.encoder = TransformerWrapper(
            num_tokens=num_tokens, max_seq_len=enc_max_seq_len,
            attn_layers=Encoder(dim=dim, depth=enc_depth, heads=heads),
        )  # fmt: skip
        decoder = TransformerWrapper(
            num_tokens=num_tokens, max_seq_len=dec_max_seq_len,
            attn_layers=Decoder(dim=dim, depth=dec_depth, heads=heads, cross_attend=True),
        )  # fmt: skip
        self.decoder = AutoregressiveWrapper(decoder)

    def forward(self, src, tgt, mask=None):
        enc = self.encoder(src, mask=mask, return_embeddings=True)
        return self.decoder(tgt, context=enc, context_mask=mask)


def copy_batch(batch, enc_len, num_tokens):
    prefix = torch.ones((batch, 1), dtype=torch.long)
    src = torch.randint(2, num_tokens, (batch, enc_len)).long()
    tgt = torch.cat((prefix, src, src), 1)
    src_mask = torch.ones(batch, src.shape[1]).bool()
    return (src, tgt, src_mask)


def cycle(batch, enc_len, num_tokens):
    while True:
        yield copy_batch(batch, enc_len, num_tokens)


def train(model, optim, batches, num_batches):
    """The script's loop: ``loss = model(src, tgt, mask=src_mask)``, backward, step, zero_grad."""
    for i in range(num_batches):
        model.train()
        src, tgt, src_mask = next(batches)
        loss = model(src, tgt, mask=src_mask)
        loss.backward()
        print(f"{i}: {loss.item()}")
        optim.step()
        optim.zero_grad()


# -- the model file that memkit probe reads: longer sequences, so a sample costs more ---------

NUM_TOKENS, ENC_SEQ_LEN, DIM, DEPTH, HEADS = 16 + 2, 64, 64, 2, 8


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return XTransformer(
        dim=DIM, num_tokens=NUM_TOKENS, enc_depth=DEPTH, dec_depth=DEPTH, heads=HEADS,
        enc_max_seq_len=ENC_SEQ_LEN, dec_max_seq_len=2 * ENC_SEQ_LEN + 1,
    )  # fmt: skip


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-4)


def make_batch(batch_size: int):
    """``(src, tgt, src_mask)``: the default step calls ``model(src, tgt, src_mask)``."""
    return copy_batch(batch_size, ENC_SEQ_LEN, NUM_TOKENS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-batches", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--enc-seq-len", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--num-tokens", type=int, default=16 + 2)
    args = parser.parse_args()
    torch.manual_seed(0)
    dec_seq_len = 2 * args.enc_seq_len + 1
    model = XTransformer(
        dim=args.dim, num_tokens=args.num_tokens, enc_depth=args.depth, dec_depth=args.depth,
        heads=args.heads, enc_max_seq_len=args.enc_seq_len, dec_max_seq_len=dec_seq_len,
    )  # fmt: skip
    optim = torch.optim.Adam(model.parameters(), lr=3e-4)
    train(model, optim, cycle(args.batch, args.enc_seq_len, args.num_tokens), args.num_batches)
