"""A model with BatchNorm1d: a training batch of 1 cannot normalise (for the --min-batch hint)."""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 2))


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)
