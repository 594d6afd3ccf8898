"""Scenario: out of memory in the backward pass of a named layer.

The forward pass fits, but backward needs the gradient of the wide ``projection`` output on top
of the saved activations, and the device is full. The post-mortem names the phase (backward)
and the module whose backward was running.

Run: ``memkit run --device cpu --budget 28MiB tests/scenarios/backward_oom.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
        self.projection = nn.Linear(256, 4096)
        self.activation = nn.GELU()
        self.classifier = nn.Linear(4096, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.activation(self.projection(self.encoder(x))))


def main(steps: int, batch: int) -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    main(args.steps, args.batch)
