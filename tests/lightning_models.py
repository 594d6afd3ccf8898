"""The Lightning module, data and Trainer settings of tests/test_integrations_lightning.py, in a
module of their own so that Lightning is imported when those tests run, not when they are
collected."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

B, STEPS, HIDDEN, VAL_BATCHES = 16, 4, 256, 2


class Net(pl.LightningModule):
    """An MLP classifier; ``zero_after_step`` frees the gradients right after each step."""

    def __init__(self, zero_after_step: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
        self.zero_after_step = zero_after_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        if self.zero_after_step:
            optimizer.zero_grad(set_to_none=True)


class ManualNet(Net):
    """``Net`` with manual optimization, zeroing the gradients between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = B, samples: int = B * STEPS) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples
        self.setups = 0

    def setup(self, stage: str) -> None:
        self.setups += 1
        g = torch.Generator().manual_seed(0)
        n = self.samples
        self.train = TensorDataset(
            torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)


def trainer(callbacks=(), **options) -> pl.Trainer:
    settings = dict(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=VAL_BATCHES,
    )  # fmt: skip
    settings.update(options)
    return pl.Trainer(callbacks=list(callbacks), **settings)


class RankNet(Net):
    """Three batches per rank; rank 1's are 8x rank 0's (8x the activations)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self) -> DataLoader:
        batch = 8 if self.global_rank == 0 else 64
        g = torch.Generator().manual_seed(self.global_rank)
        n = 3 * batch
        x, y = torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        data = TensorDataset(x, y)
        return DataLoader(data, batch_size=batch)

    train_dataloader = val_dataloader = _loader
