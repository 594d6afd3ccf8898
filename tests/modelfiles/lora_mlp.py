"""LoRA-shaped: each block a frozen Linear with a trainable low-rank adapter beside it."""

import torch


class Block(torch.nn.Module):
    def __init__(self, d: int = 64, r: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.A = torch.nn.Linear(d, r, bias=False)
        self.B = torch.nn.Linear(r, d, bias=False)

    def forward(self, x):
        return torch.relu(self.base(x) + self.B(self.A(x)))


def build_model():
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(64, 1))


def make_batch(batch_size):
    return torch.randn(batch_size, 64)


def loss_fn(out, batch):
    return out.pow(2).mean()
