import torch


def build_model():
    return torch.nn.Linear(2, 2)


def make_batch(n):
    return torch.randn(8, 2)  # always 8, whatever n is
