"""Ctrl-C during the probe: the step raises KeyboardInterrupt from the second trial on."""

import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def make_batch(batch_size):
    return torch.randn(batch_size, 32)


def train_step(model, batch, optimizer):
    if batch.shape[0] > 1:  # the first trial (batch 1) runs; the next one is interrupted
        raise KeyboardInterrupt
    loss = model(batch).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
