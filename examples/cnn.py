"""A small CNN classifier with BatchNorm and labels, and its own training step.

    memkit probe examples/cnn.py --device cpu --budget 128MiB --target-batch 512

``train_step`` replaces memkit's default step: the batch is ``(images, labels)`` and the loss
is cross-entropy. BatchNorm running statistics change during the probe and are restored after.
"""

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(),
                                  nn.Linear(256, num_classes))  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build_model() -> nn.Module:
    return SmallCNN()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_step(model: nn.Module, batch, optimizer: torch.optim.Optimizer) -> None:
    images, labels = batch
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
