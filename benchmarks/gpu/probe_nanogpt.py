"""nanoGPT's shakespeare_char GPT stepped as its train.py steps it (bf16 autocast, logits kept
until the next forward, clip 1.0, fused AdamW), as a memkit probe model file."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "nanogpt"))
from model import GPT, GPTConfig

_kept = []


def build_model():
    torch.manual_seed(1337)
    return GPT(
        GPTConfig(
            block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384, dropout=0.2, bias=False
        )
    )


def make_batch(batch_size):
    x = torch.randint(0, 65, (batch_size, 256))
    return x, torch.roll(x, -1, 1)


def build_optimizer(params):
    return torch.optim.AdamW(
        params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=torch.cuda.is_available()
    )


def train_step(model, batch, optimizer):
    x, y = batch
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, loss = model(x, y)
    _kept[:] = [logits]  # train.py's `logits` lives until the next forward
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
