"""A plain training script to try ``memkit run`` on: nothing in it knows about memkit.

A small CNN on synthetic 32x32 images, written the ordinary way: ``main()`` with argparse, a
``DataLoader``, ``train()`` and an ``evaluate()`` under ``torch.no_grad()`` after each epoch.

    python examples/train.py
    memkit run --device cpu --budget 256MiB examples/train.py --epochs 2
    memkit run --device cpu --budget 256MiB --html report.html examples/train.py

The report separates the evaluation passes from training, names the layers that keep the most
memory for backward, and says what to do about it (docs/track.md).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(images, labels)


def train(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer) -> float:
    model.train()
    total = 0.0
    for images, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(loader)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = 0
    for images, labels in loader:
        correct += (model(images).argmax(1) == labels).sum().item()
    return correct / len(loader.dataset)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--eval-batch-size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=1024)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_loader = DataLoader(synthetic(args.samples, 0), args.batch_size, shuffle=True)
    eval_loader = DataLoader(synthetic(args.samples // 4, 1), args.eval_batch_size)
    for epoch in range(1, args.epochs + 1):
        loss = train(model, train_loader, optimizer)
        accuracy = evaluate(model, eval_loader)
        print(f"epoch {epoch}: train loss {loss:.3f}, eval accuracy {accuracy:.1%}")


if __name__ == "__main__":
    main()
