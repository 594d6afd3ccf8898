"""The machine's RAM runs out (the host allocator fails) before the simulated device's budget."""

import torch


def build_model():
    return torch.nn.Linear(16, 16)


def make_batch(batch_size):
    return torch.randn(batch_size, 16)


def train_step(model, batch, optimizer):
    if batch.shape[0] > 4:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1152921504606846976 bytes. Error code 12 (Cannot "
            "allocate memory)"
        )
    model(batch).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
