"""A one-block causal self-attention model (F.scaled_dot_product_attention, dropout): its
math path keeps the L x L attention matrix, the fused kernels of a GPU do not."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, EMBD, HEADS, SEQ = 64, 32, 2, 128


class TinyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBD)
        self.qkv = nn.Linear(EMBD, 3 * EMBD)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.drop(x + y.transpose(1, 2).reshape(b, t, c)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyAttention()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), batch.reshape(-1))
