"""A train_step that runs backward but forgets optimizer.step(): nothing trains."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def make_batch(n):
    return torch.randn(n, 64)


def train_step(model, batch, optimizer):
    optimizer.zero_grad()
    model(batch).square().mean().backward()
