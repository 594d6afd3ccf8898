"""The tutorial loop with ``running_loss += loss`` (a tensor, not ``loss.item()``).

Imitates: the "Training a Classifier" tutorial's loop (``for epoch ...: running_loss = 0.0;
for i, data in enumerate(trainloader, 0): ...; running_loss += loss.item()``) as it is often
retyped, without the ``.item()``. Synthetic CIFAR-sized images, a small CNN, SGD.

memkit pitfall it exercises: after an ordinary ``loss.backward()`` (no ``retain_graph``) the
graph's saved activations are freed, but ``running_loss`` (a tensor with ``grad_fn``) keeps
every step's ``AddBackward`` chain and the 0-dim losses alive: the leak is real but small (a
few bytes and graph nodes per step, not activations), so a leak detector must neither miss
the variable nor blame it for megabytes. ``--healthy`` uses ``loss.item()``.

Run: ``python running_loss_graph.py`` (a second or two), or
``memkit run --device cpu --budget 64MiB running_loss_graph.py [--healthy]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)  # flatten all dimensions except batch
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


def train(args: argparse.Namespace) -> None:
    """Train for ``args.epochs`` epochs, printing the mean loss every ``args.print_every``."""
    images = torch.randn(args.samples, 3, 32, 32)
    labels = torch.randint(0, 10, (args.samples,))
    trainset = TensorDataset(images, labels)
    trainloader = DataLoader(trainset, batch_size=args.batch_size, shuffle=True)

    net = Net()
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(net.parameters(), lr=0.001, momentum=0.9)

    for epoch in range(args.epochs):  # loop over the dataset multiple times
        running_loss = 0.0
        for i, data in enumerate(trainloader, 0):
            # get the inputs; data is a list of [inputs, labels]
            inputs, labels = data

            # zero the parameter gradients
            optimizer.zero_grad()

            # forward + backward + optimize
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()

            # print statistics
            if args.healthy:
                running_loss += loss.item()
            else:
                running_loss += loss  # keeps every step's graph node and loss tensor alive
            if i % args.print_every == args.print_every - 1:
                print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / args.print_every:.3f}")
                running_loss = 0.0

    print("Finished Training")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--print-every", type=int, default=100)
    parser.add_argument("--healthy", action="store_true", help="running_loss += loss.item()")
    args = parser.parse_args()
    torch.manual_seed(0)
    train(args)


if __name__ == "__main__":
    main()
