"""Scenario: a frozen backbone (BatchNorm, in-place ReLU) with a trainable head.

Trackers that wrap every module in full backward hooks crash here: the backbone's outputs do not
require grad and its in-place ReLUs modify hooked outputs. memkit tracks it, and the report
shows gradients and optimizer state for the head only.

Run: ``memkit run --device cpu --budget 128MiB tests/scenarios/frozen_backbone.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def backbone() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def main(steps: int, batch: int) -> None:
    torch.manual_seed(0)
    features = backbone()
    features.requires_grad_(False)
    features.eval()
    head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 10))
    model = nn.Sequential(features, head)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    main(args.steps, args.batch)
