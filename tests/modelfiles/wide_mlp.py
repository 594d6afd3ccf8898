"""Large weights, small activations: DataParallel's cuda:0 holds the gradients and AdamW state."""

import torch


def build_model():
    layers = [torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 64)]
    return torch.nn.Sequential(*layers)


def make_batch(batch_size):
    return torch.randn(batch_size, 64)
