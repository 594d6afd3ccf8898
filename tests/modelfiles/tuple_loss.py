"""A model that returns (logits, loss), as nanoGPT does; loss_fn takes the loss as it is."""

import torch
import torch.nn.functional as F
from torch import nn


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return logits, F.cross_entropy(logits, y)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return WithLoss()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 64), torch.randint(0, 256, (batch_size,))


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], batch: object) -> torch.Tensor:
    return output[1]  # under DataParallel: one loss per replica, gathered into a vector
