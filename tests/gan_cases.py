"""Sweep KK's GAN (two optimizers), shared by the tests of the breakdown and of the advice."""

from __future__ import annotations

import torch
from torch import nn

from memkit.tracking import TrackReport, track


def two_step_gan(fixed: bool) -> tuple[TrackReport, nn.Module, nn.Module]:
    """Sweep KK's GAN, two batches (G's update, then D's; steps counted at ``opt_g.step()``,
    so the last batch's D update is a partial step after the last boundary, where the peak,
    D's loss, is); ``fixed``: both optimizers' gradients freed right after G's step. The
    report, the generator and the discriminator."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64))
    disc = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4)
    opt_d = torch.optim.SGD(disc.parameters(), 1e-2, momentum=0.9)
    bce = nn.functional.binary_cross_entropy_with_logits
    with track(device="cpu", budget="32MiB", optimizer=[opt_g, opt_d]) as tracker:
        for _ in range(2):
            x, z = torch.randn(32, 64), torch.randn(32, 16)
            fake = gen(z)
            g_loss = bce(disc(fake), torch.ones(32, 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            if fixed:
                opt_g.zero_grad()
                opt_d.zero_grad()
            real, faked = disc(x), disc(fake.detach())
            d_loss = (bce(real, torch.ones_like(real)) + bce(faked, torch.zeros_like(faked))) / 2
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
    return tracker.report(), gen, disc
