import torch


def build_model(:
    return torch.nn.Linear(2, 2)
