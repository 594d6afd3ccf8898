"""A denoiser whose forward takes the timesteps too (``forward(x, t)``), with a train_step that
samples them: the default step's ``model(batch)`` cannot call it (``--mode infer`` without an
eval_step)."""

import torch
from torch import nn


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.net = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(x + self.embed(t))


def build_model() -> nn.Module:
    return Denoiser()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 32)


def train_step(model, x, optimizer):
    t = torch.randint(0, 10, (x.shape[0],), device=x.device)
    loss = nn.functional.mse_loss(model(x, t), x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
