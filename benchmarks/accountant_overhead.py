"""What does one op cost under the simulated device? Microseconds per ATen op.

Run: ``python benchmarks/accountant_overhead.py`` (CPU; ``--rounds 15``, ``--json out.json``).
``--baseline OLD.py`` adds an older ``memkit/simulated/accountant.py`` (``git show
REV:memkit/simulated/accountant.py > OLD.py``) to the same rounds: before and after, measured alike.

The simulated device (``memkit run --device cpu``, ``memkit.simulate``) is a
``TorchDispatchMode``, :class:`memkit.simulated.accountant.MemoryAccountant`, that every ATen op
passes through. Two workloads, each run in-process with one intra-op thread:

* ``small ops``: a loop of 16x16 ``mm`` and ``relu``, each op allocating its output;
* ``lstm loop``: one Adam step of pytorch/examples ``time_sequence_prediction``'s model (two
  ``LSTMCell`` over a float64 sine wave, 25 time steps): views, in-place updates, autograd's
  backward ops and the optimizer's, many of them tiny.

Each workload runs under these variants, round-robin for ``--rounds`` rounds, the first variant
rotating every round:

* ``plain``: no mode;
* ``no-op mode``: a ``TorchDispatchMode`` that only calls the op: the floor any dispatch mode
  pays (torch's own Python dispatch), not memkit's;
* ``accountant``: the accountant counting and adopting (a ``simulate`` block; the tracker's
  backward and optimizer phases);
* ``accountant, no adopting``: counting only (the tracker's forward phase);
* with ``--baseline``: the same two with the older accountant.

Times are the thread's CPU time (steadier than wall time on a shared machine), the median over
the rounds, divided by the ops the workload dispatches. The table gives microseconds per op,
what each variant adds to plain, and what the accountant adds to the no-op mode: the part of the
cost memkit's code pays.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memkit.simulated.accountant import MemoryAccountant


class NoOpMode(TorchDispatchMode):
    """A dispatch mode that only runs the op: the floor of any such mode."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._disable_dynamo wrapper: the bare cost of a mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Sequence(nn.Module):
    """time_sequence_prediction's model: two LSTMCells and a Linear, unrolled."""

    def __init__(self, hidden: int = 51) -> None:
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        n = input.size(0)
        h_t, c_t, h_t2, c_t2 = (torch.zeros(n, self.hidden, dtype=torch.double) for _ in range(4))
        outputs = []
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs.append(self.linear(h_t2))
        return torch.cat(outputs, dim=1)


def small_ops_workload() -> Callable[[], None]:
    a, b = torch.randn(16, 16), torch.randn(16, 16)

    def run() -> None:
        x = a
        for _ in range(300):
            x = torch.relu(torch.mm(x, b))

    return run


def lstm_workload(length: int = 25) -> Callable[[], None]:
    torch.manual_seed(0)
    seq = Sequence().double()
    optimizer = torch.optim.Adam(seq.parameters())
    phase = torch.randint(-80, 80, (21, 1)).double()
    data = torch.sin((torch.arange(length + 1, dtype=torch.double) + phase) / 20 * math.pi)

    def run() -> None:
        optimizer.zero_grad()
        loss = ((seq(data[:, :-1]) - data[:, 1:]) ** 2).mean()
        loss.backward()
        optimizer.step()

    return run


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_of(run: Callable[[], None]) -> int:
    """The ATen ops one run dispatches."""
    with _OpCounter() as counter:
        run()
    return counter.ops


def accountant(cls: type[Any], adopting: bool) -> Callable[[], Any]:
    def make() -> Any:
        acct = cls("cpu")
        acct.adopting = adopting
        return acct

    return make


def variants(baseline: Path | None) -> dict[str, Callable[[], Any] | None]:
    """The variants, with the accountant of ``baseline`` (an accounting.py file) if given."""
    found: dict[str, Callable[[], Any] | None] = {
        "plain": None,
        "no-op mode": NoOpMode,
        "accountant": accountant(MemoryAccountant, True),
        "accountant, no adopting": accountant(MemoryAccountant, False),
    }
    if baseline is not None:
        spec = importlib.util.spec_from_file_location("baseline_accounting", baseline)
        if spec is None or spec.loader is None:
            raise SystemExit(f"expected a Python file for --baseline, found {baseline}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found["baseline accountant"] = accountant(module.MemoryAccountant, True)
        found["baseline, no adopting"] = accountant(module.MemoryAccountant, False)
    return found


def measure(
    run: Callable[[], None], rounds: int, table: dict[str, Callable[[], Any] | None]
) -> dict[str, list[float]]:
    """Thread CPU seconds of each variant, per round."""
    names = list(table)
    times: dict[str, list[float]] = {name: [] for name in names}
    run()  # warm up: lazy initialisation, allocator
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            make = table[name]
            t0 = time.thread_time()
            if make is None:
                run()
            else:
                with make():
                    run()
            times[name].append(time.thread_time() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="an older accountant module to compare"
    )
    args = parser.parse_args(argv)
    table = variants(args.baseline)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds, thread CPU time")
    raw: dict[str, Any] = {}
    for label, run in (("small ops", small_ops_workload()), ("lstm loop", lstm_workload())):
        ops = ops_of(run)
        times = measure(run, args.rounds, table)
        us = {name: statistics.median(t) / ops * 1e6 for name, t in times.items()}
        print(f"\n{label}: {ops} ops a run")
        print("| variant | us/op | added to plain | added to the no-op mode |")
        print("|---|---:|---:|---:|")
        for name, value in us.items():
            counts = name not in ("plain", "no-op mode")
            over_noop = f"{value - us['no-op mode']:+.2f}" if counts else ""
            print(f"| {name} | {value:.2f} | {value - us['plain']:+.2f} | {over_noop} |")
        raw[label] = {"ops": ops, "seconds": times}
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=2))
        print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
