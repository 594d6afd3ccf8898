"""A training step with a genuine bug (a shape mismatch) that is not an OOM."""

import torch

CALLS = {"n": 0}


def build_model():
    return torch.nn.Linear(16, 16)


def make_batch(n):
    return torch.randn(n, 16)


def train_step(model, batch, optimizer):
    CALLS["n"] += 1
    wrong = torch.randn(3, 7)
    (model(batch) @ wrong).sum().backward()
