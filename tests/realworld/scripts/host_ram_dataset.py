"""A big in-RAM ``TensorDataset`` feeding a small MLP: host memory that is not device memory.

Imitates: the common "load everything into a TensorDataset" script (tabular data or
precomputed features read with ``np.load``/``torch.load`` and wrapped in a ``TensorDataset``),
e.g. the PyTorch forums' and Kaggle notebooks' shape. Synthetic features, no files.

memkit pitfall it exercises: on a GPU the dataset lives in host RAM and only batches are copied
to the device; on CPU the dataset is an ordinary CPU tensor allocated *before* tracking-relevant
code runs and much larger than the model (default ~180 MiB, ``--dataset-mib``). A simulated
device that counted it (or every CPU tensor the script ever made) would report the dataset,
not the training, and a ``--budget`` that fits the training would "OOM" on the data.
``DataLoader(shuffle=True)`` indexes it per sample and collates batches.

Run: ``python host_ram_dataset.py`` (a second or two), or
``memkit run --device cpu --budget 64MiB host_ram_dataset.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(dataset_mib: int, features: int) -> TensorDataset:
    """float32 features and integer labels, about ``dataset_mib`` MiB in total."""
    n = dataset_mib * (1 << 20) // (4 * features)
    x = torch.randn(n, features)
    w = torch.randn(features, 10)
    y = (x @ w).argmax(1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-mib", type=int, default=180)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    t0 = time.perf_counter()
    dataset = make_dataset(args.dataset_mib, args.features)
    size_mib = sum(t.numel() * t.element_size() for t in dataset.tensors) / (1 << 20)
    print(f"dataset: {len(dataset)} samples, {size_mib:.0f} MiB, {time.perf_counter() - t0:.2f}s")

    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    model.train()
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                print(f"step {step}: loss {loss.item():.4f}")
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
