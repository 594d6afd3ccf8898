import torch


def build_model():
    return torch.nn.Linear(2, 2)


def make_batch(n):
    return "not a tensor"
