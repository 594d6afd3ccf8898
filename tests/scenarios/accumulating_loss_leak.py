"""Scenario: the accumulating-loss leak.

``loss.backward(retain_graph=True)`` (copied from a GAN example) keeps the graph's saved
activations, and ``running_loss += loss`` keeps every step's graph alive: device memory grows by
one step of activations per step until it runs out. Fix: ``running_loss += loss.item()``.

Run: ``memkit run --device cpu --budget 64MiB tests/scenarios/accumulating_loss_leak.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def train(steps: int, batch: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    running_loss = 0.0
    for _ in range(steps):
        x, y = torch.randn(batch, 128), torch.randint(0, 10, (batch,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward(retain_graph=True)
        optimizer.step()
        running_loss += loss  # the leak: keeps this step's graph (and its activations)
    return float(running_loss) / steps


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    print(f"mean loss {train(args.steps, args.batch):.4f}")
