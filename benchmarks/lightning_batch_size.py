"""probe_batch_size against Lightning's BatchSizeFinder, on the same LightningModule.

Run: ``pip install -e ".[lightning]"`` then ``python benchmarks/lightning_batch_size.py``.

A small MLP classifier (``Linear(32, 256) -> ReLU -> Linear(256, 10)``, Adam) with a datamodule,
on memkit's simulated cpu device at a few budgets. For each budget:

* memkit: ``probe_batch_size(module, datamodule, device="cpu", budget=...)`` (2 steps a trial);
* Lightning: ``Tuner(trainer).scale_batch_size(module, datamodule=..., mode=...,
  steps_per_trial=2)`` with its defaults otherwise. The tuner clears the trainer's callbacks
  while it searches, so the simulated device is entered in the module's ``optimizer_step``,
  around ``optimizer.step(closure)`` (the closure runs ``training_step``, Lightning's
  ``zero_grad`` and the backward, as in a fit);
* every answer is then checked the same way, independently of the tool that gave it: a real
  ``Trainer.fit`` of 2 steps at that batch size with ``MemkitCallback`` on the same budget
  either trains or raises the simulated OOM; the unused share is the budget minus that fit's
  peak.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memkit
from memkit.render.text import table
from memkit.units import format_size, parse_size

STEPS = 2


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def classes(budget: int | None) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    class Data(pl.LightningDataModule):
        def __init__(self, batch_size: int = 2) -> None:
            super().__init__()
            self.batch_size = batch_size  # the attribute the tuner scales

        def setup(self, stage: str) -> None:
            g = torch.Generator().manual_seed(0)
            n = 1 << 14
            self.data = TensorDataset(
                torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
            )

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=self.batch_size)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
            self.trials: list[tuple[int, bool]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self._size = int(x.shape[0])
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def optimizer_step(  # type: ignore[override]
            self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
        ) -> None:
            if budget is None:  # a plain fit (the callback measures it)
                optimizer.step(closure=optimizer_closure)
                return
            raw = self.trainer.optimizers[0]
            try:
                with memkit.simulate(budget, track=(self, raw)):
                    optimizer.step(closure=optimizer_closure)
            except torch.OutOfMemoryError:
                self.trials.append((self._size, False))
                raise
            self.trials.append((self._size, True))

    return Net, Data


def real_fit(budget: int, batch_size: int) -> tuple[bool, int | None]:
    """Does a real 2-step fit train at this size? (and its peak)."""
    import lightning.pytorch as pl

    from memkit.integrations.lightning import MemkitCallback

    Net, Data = classes(None)
    cb = MemkitCallback(device="cpu", budget=budget, postmortem=None, log_peaks=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
    )  # fmt: skip
    try:
        trainer.fit(Net(), datamodule=Data(batch_size))
    except torch.OutOfMemoryError:
        return False, None
    assert cb.report is not None
    return True, cb.report.peak_allocated


def run_memkit(budget: int) -> tuple[int | None, str, int, float, str]:
    from memkit.integrations.lightning import probe_batch_size

    Net, Data = classes(None)
    started = time.perf_counter()
    result = probe_batch_size(Net(), Data(), device="cpu", budget=budget, steps=STEPS)
    seconds = time.perf_counter() - started
    order = " ".join(f"{t.batch_size}{'' if t.fits else 'x'}" for t in result.trials)
    return result.max_batch_size, "yes", len(result.trials), seconds, order


def run_lightning(budget: int, mode: str) -> tuple[int | None, str, int, float, str]:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    Net, Data = classes(budget)
    module, data = Net(), Data()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root,
        )  # fmt: skip
        started = time.perf_counter()
        found = Tuner(trainer).scale_batch_size(
            module, datamodule=data, mode=mode, steps_per_trial=STEPS
        )
        seconds = time.perf_counter() - started
    sizes: dict[int, bool] = {}
    order = []
    for size, ok in module.trials:
        if size not in sizes or not ok:
            if size not in sizes:
                order.append(size)
            sizes[size] = sizes.get(size, True) and ok
    ran = "yes" if sizes.get(found or -1) else "no"
    text = " ".join(f"{s}{'' if sizes[s] else 'x'}" for s in order)
    return found, ran, len(order), seconds, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1MiB,4MiB,12MiB")
    args = parser.parse_args()
    quiet()
    rows, orders = [], []
    for text in args.budgets.split(","):
        budget = parse_size(text)
        for tool, run in (
            ("memkit probe_batch_size", run_memkit),
            ("lightning power", lambda b: run_lightning(b, "power")),
            ("lightning binsearch", lambda b: run_lightning(b, "binsearch")),
        ):
            found, ran, trials, seconds, order = run(budget)
            fits, peak = real_fit(budget, found) if found else (False, None)
            unused = "" if peak is None else f"{100 * (budget - peak) / budget:.2f}%"
            rows.append([text, tool, found, ran, "yes" if fits else "NO", unused, trials,
                         f"{seconds:.1f}"])  # fmt: skip
            orders.append(f"{text} {tool}: {order}")
        rows.append(["", "", "", "", "", "", "", ""])
    headers = ["budget", "tool", "found", "run?", "fits a real fit?", "unused", "trials", "wall s"]
    print(table(headers, rows[:-1], title="LightningModule batch size (simulated cpu, 2 steps)"))
    print("\nSizes each tool ran, in order (x: out of memory):")
    print("\n".join(orders))
    print(f"\n(budgets in bytes: {[format_size(parse_size(b)) for b in args.budgets.split(',')]})")


if __name__ == "__main__":
    main()
