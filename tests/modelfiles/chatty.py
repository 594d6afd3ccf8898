"""A model file that prints, like nanoGPT's "number of parameters: ...", and writes to file
descriptor 1 as C code does (a compiler's or a library's native logging): --json stays JSON."""

import os

import torch

print("loading chatty.py")
os.write(1, b"native: written to fd 1\n")


def build_model():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    return model


def make_batch(batch_size):
    print(f"make_batch({batch_size})")
    return torch.randn(batch_size, 32)
