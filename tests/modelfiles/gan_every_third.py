"""A tiny GAN in the shape of PyTorch-GAN's wgan_gp.py: each train_step is one loop iteration,
a critic step, and every 3rd call (a global counter) also a generator step, with the
generator's own optimizer made in the file's globals (the probe is given the critic's). The
critic sees the generator's output detached; the generator step keeps the generator's
activations for its backward, and peaks."""

import torch
from torch import nn

LATENT, IMG, N_CRITIC = 16, 64, 3
_STATE: dict = {"model": None, "opt_G": None, "i": 0}


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(LATENT, 256), nn.ReLU(), nn.Linear(256, 512),
                               nn.ReLU(), nn.Linear(512, IMG))  # fmt: skip
        self.D = nn.Sequential(nn.Linear(IMG, 64), nn.ReLU(), nn.Linear(64, 1))


def build_model() -> nn.Module:
    _STATE["model"] = GAN()
    return _STATE["model"]


def build_optimizer(params):
    return torch.optim.Adam(_STATE["model"].D.parameters())


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, IMG)


def iteration(G, D, real, optimizer_D, optimizer_G, i: int) -> None:
    optimizer_D.zero_grad()
    fake = G(torch.randn(real.shape[0], LATENT)).detach()
    d_loss = -D(real).mean() + D(fake).mean()
    d_loss.backward()
    optimizer_D.step()
    if i % N_CRITIC == 0:
        g_loss = -D(G(torch.randn(real.shape[0], LATENT))).mean()
        g_loss.backward()
        optimizer_G.step()
        optimizer_G.zero_grad()


def generator_optimizer(model) -> torch.optim.Optimizer:
    if _STATE["opt_G"] is None:
        _STATE["opt_G"] = torch.optim.Adam(model.G.parameters())
    return _STATE["opt_G"]


def train_step(model, batch, optimizer) -> None:
    i = _STATE["i"]
    _STATE["i"] += 1
    iteration(model.G, model.D, batch, optimizer, generator_optimizer(model), i)
