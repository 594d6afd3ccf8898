"""Scenario: evaluation without ``torch.no_grad()``.

``model.eval()`` switches dropout and batch norm to inference behaviour, but autograd keeps
recording: every validation batch keeps its activations for a backward that never comes, and
``val_loss += loss`` keeps all of them alive until the device is full.

Run: ``memkit run --device cpu --budget 48MiB tests/scenarios/eval_without_no_grad.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def main(train_steps: int, val_batches: int, batch: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024),
        nn.BatchNorm1d(1024),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(1024, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(train_steps):
        x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    val_loss = 0.0
    for _ in range(val_batches):  # the bug: no `with torch.no_grad():`
        x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
        val_loss += nn.functional.cross_entropy(model(x), y)
    print(f"validation loss {float(val_loss) / val_batches:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    main(args.train_steps, args.val_batches, args.batch)
