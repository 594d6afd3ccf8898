"""An MLP autoencoder: the smallest model file for ``memkit probe``.

    memkit probe examples/mlp.py --device cpu --budget 128MiB

``make_batch`` returns one tensor, so the default step calls ``model(batch)`` and
``loss_fn(output, batch)``; AdamW is the default optimizer.
"""

import torch


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 1024),
    )


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 1024)


def loss_fn(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch)
