"""Sine waves predicted by two LSTM cells, trained with LBFGS and a closure.

Imitates: pytorch/examples ``time_sequence_prediction/train.py`` (``Sequence``: two
``nn.LSTMCell(…, 51)`` and a ``Linear``, in double precision; ``optim.LBFGS(lr=0.8)``;
``optimizer.step(closure)`` with the forward and backward inside the closure; a ``no_grad``
prediction after each step), with shorter waves and fewer LBFGS iterations so that it runs on
a CPU in seconds.

memkit pitfall it exercises: memory that keeps growing after the probe's steps. LBFGS keeps up
to ``history_size`` direction pairs in ``optimizer.state``, up to ``max_iter`` more per step
(the example's 20 of 100: about 10 MiB a step for its 32,000 double parameters, full after 5
steps; here 3 of 4: 2 pairs, about 1 MiB a step, full after 3). A probe that measured 2 steps
answers for a history of 3 pairs, and the script runs out at its third step.

Run: ``python lbfgs_sequence.py --batch-size 97``; the probe reads it as a model file:
``memkit probe tests/realworld/scripts/lbfgs_sequence.py --device cpu --budget 96MiB``.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

LENGTH = 3  # time steps per wave (the example: 1000)
MAX_ITER, HISTORY = 3, 4  # LBFGS: inner iterations per step, kept pairs (the example: 20, 100)
HIDDEN = 51


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, HIDDEN)
        self.lstm2 = nn.LSTMCell(HIDDEN, HIDDEN)
        self.linear = nn.Linear(HIDDEN, 1)

    def forward(self, input: torch.Tensor, future: int = 0) -> torch.Tensor:
        outputs = []
        h_t = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        c_t = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        output = input[:, :1]
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Sequence().double()


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(params, lr=0.8, max_iter=MAX_ITER, history_size=HISTORY)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` sine waves with phases drawn once (the example's ``np.random.seed(2)``):
    ``(input, target)``, the target one time step on."""
    draw = torch.Generator().manual_seed(2)
    phase = torch.randint(-80, 80, (batch_size, 1), generator=draw).double()
    t = torch.arange(LENGTH + 1, dtype=torch.double)
    data = torch.sin((t + phase) / 20 * math.pi / 2)
    return data[:, :-1], data[:, 1:]


def train_step(seq: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer) -> None:
    """The example's step: the forward and backward in a closure that LBFGS calls."""
    input, target = batch
    criterion = nn.MSELoss()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        loss.backward()
        return loss

    optimizer.step(closure)


def train(seq: nn.Module, optimizer, batch_size: int, steps: int) -> None:
    """The example's loop: a step, then a ``no_grad`` prediction of the future."""
    input, target = make_batch(batch_size)
    for _ in range(steps):
        train_step(seq, (input, target), optimizer)
        with torch.no_grad():
            future = 10
            pred = seq(input[:3], future=future)
            del pred


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=97)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    seq = build_model()
    train(seq, build_optimizer(seq.parameters()), args.batch_size, args.steps)


if __name__ == "__main__":
    main()
