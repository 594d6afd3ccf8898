"""build_model builds its model on the meta device (shapes only, no data): no step can run."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to("meta")


def make_batch(n):
    return torch.randn(n, 64)
