"""Periodic validation that keeps its graph: memory grows every ``--eval-every`` steps.

Imitates: hand-written training loops (research repos, Kaggle kernels) that compute a
validation loss every N steps with the model's ordinary forward, forgetting ``torch.no_grad()``,
and append the loss *tensor* to a history list for plotting later.

memkit pitfall it exercises: the growth is not per step. Between evaluations memory at step
boundaries is flat; at every evaluation it jumps by one validation forward's saved activations
(the whole graph, kept by ``val_losses``), so a detector that compares consecutive steps, or
looks at too short a window, misses it; and the variable to name is a list element
(``val_losses[k]``). ``--healthy`` evaluates under ``torch.no_grad()`` and appends ``.item()``.
``--eval-mode`` calls ``model.eval()``/``model.train()`` around the evaluation (the graph is
kept all the same).

Run: ``python periodic_eval_leak.py`` (a second or two), or
``memkit run --device cpu --budget 128MiB periodic_eval_leak.py [--healthy]``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def build_model(width: int) -> nn.Module:
    """A small residual-free MLP classifier."""
    return nn.Sequential(
        nn.Linear(128, width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--val-batch-size", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--eval-mode", action="store_true", help="model.eval() while validating")
    parser.add_argument("--healthy", action="store_true", help="no_grad + val_loss.item()")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build_model(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    teacher = torch.randn(128, 10)
    val_x = torch.randn(args.val_batch_size, 128)
    val_y = (val_x @ teacher).argmax(1)

    train_losses: list[float] = []
    val_losses = []
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, 128)
        y = (x @ teacher).argmax(1)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train_losses.append(loss.item())

        if step % args.eval_every == 0:
            if args.eval_mode:
                model.eval()
            if args.healthy:
                with torch.no_grad():
                    val_loss = loss_fn(model(val_x), val_y)
                val_losses.append(val_loss.item())
            else:
                val_loss = loss_fn(model(val_x), val_y)
                val_losses.append(val_loss)  # the whole validation graph stays alive
            if args.eval_mode:
                model.train()
            recent = sum(train_losses[-args.eval_every :]) / args.eval_every
            print(f"step {step}: train loss {recent:.4f}, val loss {float(val_losses[-1]):.4f}")

    best = min(float(v) for v in val_losses)
    print(f"best val loss {best:.4f} over {len(val_losses)} evaluations")


if __name__ == "__main__":
    main()
