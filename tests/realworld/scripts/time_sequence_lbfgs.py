"""A sine-wave LSTM trained with LBFGS in float64, in the shape of pytorch/examples
``time_sequence_prediction/train.py`` (two ``LSTMCell`` layers unrolled over the sequence,
``seq.double()``, ``optimizer.step(closure)`` with the forward and backward inside the closure,
a no-grad prediction of the future after each step).

Pitfalls for memkit: LBFGS keeps its history as lists of tensors inside ``optimizer.state``
(``old_dirs``, ``old_stps``: two flat copies of the parameters per entry), which grows for the
first steps and then stays flat once ``history_size`` entries are kept; the model is float64;
one ``optimizer.step`` runs several forward/backward passes.

Synthetic data (the example's generate_sine_wave.py, made here): ``--samples`` sine waves of
``--length`` points. Defaults run in a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn, optim


class Sequence(nn.Module):
    def __init__(self, hidden: int) -> None:
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
        output = torch.zeros(n, 1, dtype=torch.double)
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
    optimizer = optim.LBFGS(
        seq.parameters(), lr=0.8, history_size=opt.history_size, max_iter=opt.max_iter,
        tolerance_grad=0.0, tolerance_change=0.0,
    )  # fmt: skip
    for i in range(opt.steps):
        print("STEP: ", i)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", loss.item())
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            pred = seq(test_input, future=opt.future)
            loss = criterion(pred[:, : -opt.future], test_target)
            print("test loss:", loss.item())
            y = pred.detach().numpy()
