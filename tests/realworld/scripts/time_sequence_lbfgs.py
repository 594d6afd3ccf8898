"""A sine-wave LSTM trained with LBFGS in float64, in the shape of pytorch/examples
``time_sequence_prediction/train.py`` (two ``LSTMCell`` layers unrolled over the sequence,
``seq.double()``, ``optim.LBFGS(lr=0.8)``, ``optimizer.step(closure)`` with the forward and
backward inside the closure, a no-grad prediction of the future after each step).

Pitfalls for memkit: LBFGS keeps its history as lists of tensors inside ``optimizer.state``
(``old_dirs``, ``old_stps``: two flat copies of the parameters per entry), which grows for the
first steps and then stays flat once ``history_size`` entries are kept; the model is float64;
one ``optimizer.step`` runs several forward/backward passes.

Two uses, one script:

* run as a script (``memkit run``/``track``): synthetic data (the example's
  generate_sine_wave.py, made here), ``--samples`` sine waves of ``--length`` points, LBFGS with
  tolerances of zero so that every step runs ``--max-iter`` passes. Defaults run in a few
  seconds on a CPU.
* read as a model file by ``memkit probe`` (``build_model``, ``make_batch``,
  ``build_optimizer``, ``train_step``; ``train`` is the loop the probe's answer is checked
  against): waves of ``LENGTH`` points, LBFGS with its default tolerances, ``MAX_ITER`` 3 and
  ``HISTORY`` 4. The pitfall there: memory that keeps growing after the probe's steps. LBFGS
  keeps up to ``history_size`` direction pairs, up to ``max_iter`` more per step (the example's
  20 of 100: about 10 MiB a step for its 32,000 double parameters, full after 5 steps; here 3
  of 4: 2 pairs, about 1 MiB a step, full after 3). A probe that measured 2 steps answers for a
  history of 3 pairs, and the script runs out at its third step.
  ``memkit probe tests/realworld/scripts/time_sequence_lbfgs.py --device cpu --budget 4.6MiB``.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn, optim

# the model file's sizes (the example: 1000 points, max_iter 20, history_size 100)
LENGTH = 3  # time steps per wave
MAX_ITER, HISTORY = 3, 4  # LBFGS: inner iterations per step, kept pairs
HIDDEN = 51


class Sequence(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input: torch.Tensor, future: int = 0) -> torch.Tensor:
        outputs = []
        n = input.size(0)
        h_t = torch.zeros(n, self.hidden, dtype=torch.double)
        c_t = torch.zeros(n, self.hidden, dtype=torch.double)
        h_t2 = torch.zeros(n, self.hidden, dtype=torch.double)
        c_t2 = torch.zeros(n, self.hidden, dtype=torch.double)
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


def build_optimizer(params, history_size: int = HISTORY, max_iter: int = MAX_ITER,
                    **tolerances: float) -> optim.Optimizer:  # fmt: skip
    return optim.LBFGS(params, lr=0.8, max_iter=max_iter, history_size=history_size,
                       **tolerances)  # fmt: skip


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` sine waves with phases drawn once (the example's ``np.random.seed(2)``):
    ``(input, target)``, the target one time step on."""
    draw = torch.Generator().manual_seed(2)
    phase = torch.randint(-80, 80, (batch_size, 1), generator=draw).double()
    t = torch.arange(LENGTH + 1, dtype=torch.double)
    data = torch.sin((t + phase) / 20 * math.pi / 2)
    return data[:, :-1], data[:, 1:]


def train_step(seq: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer,
               log: bool = False) -> None:  # fmt: skip
    """The example's step: the forward and backward in a closure that LBFGS calls."""
    input, target = batch
    criterion = nn.MSELoss()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        if log:
            print("loss:", loss.item())
        loss.backward()
        return loss

    optimizer.step(closure)


def train(seq: nn.Module, optimizer, batch_size: int, steps: int) -> None:
    """The model file's loop: a step, then a ``no_grad`` prediction of the future."""
    input, target = make_batch(batch_size)
    for _ in range(steps):
        train_step(seq, (input, target), optimizer)
        with torch.no_grad():
            future = 10
            pred = seq(input[:3], future=future)
            del pred


def sine_waves(samples: int, length: int, period: int = 20) -> torch.Tensor:
    shift = torch.randint(-4 * period, 4 * period, (samples, 1)).double()
    x = torch.arange(length, dtype=torch.double).unsqueeze(0) + shift
    return torch.sin(x / period * 2 * math.pi / 2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12, help="steps to run")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=51)
    parser.add_argument("--history-size", type=int, default=28)
    parser.add_argument("--max-iter", type=int, default=4)
    parser.add_argument("--future", type=int, default=20)
    opt = parser.parse_args()
    torch.manual_seed(0)
    data = sine_waves(opt.samples, opt.length)
    input = data[3:, :-1]
    target = data[3:, 1:]
    test_input = data[:3, :-1]
    test_target = data[:3, 1:]
    seq = Sequence(opt.hidden)
    seq.double()
    criterion = nn.MSELoss()
    # tolerances of zero: every step runs max_iter passes and adds max_iter history entries
    optimizer = build_optimizer(
        seq.parameters(), opt.history_size, opt.max_iter, tolerance_grad=0.0, tolerance_change=0.0
    )
    for i in range(opt.steps):
        print("STEP: ", i)
        train_step(seq, (input, target), optimizer, log=True)
        with torch.no_grad():
            pred = seq(test_input, future=opt.future)
            loss = criterion(pred[:, : -opt.future], test_target)
            print("test loss:", loss.item())
            y = pred.detach().numpy()
