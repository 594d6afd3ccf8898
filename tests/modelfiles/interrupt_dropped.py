"""Ctrl-C that lands where Python drops it: in the second trial, a ``__del__`` raises
KeyboardInterrupt (Python prints "Exception ignored" and runs on), as a Ctrl-C landing in
the simulated device's weakref free callback does."""

import torch


class _FreedDuringCtrlC:
    def __del__(self) -> None:
        raise KeyboardInterrupt


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def make_batch(batch_size):
    return torch.randn(batch_size, 32)


def train_step(model, batch, optimizer):
    if batch.shape[0] == 2:
        _FreedDuringCtrlC()  # freed at once: its KeyboardInterrupt is dropped
    loss = model(batch).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
