"""Small weights, a wide output: DataParallel gathers every replica's output on cuda:0."""

import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 4096))


def make_batch(batch_size):
    return torch.randn(batch_size, 64)
