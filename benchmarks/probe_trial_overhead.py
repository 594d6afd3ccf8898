"""What a probe trial costs beyond its steps: clean-up, hooks, counter reads, state resets.

Run: ``python benchmarks/probe_trial_overhead.py [MODEL_FILE] --device cuda --budget 3GiB``
(default: ``examples/gpt2.py`` on the simulated cpu device, 1 GiB). For each size it runs a
probe of that one size (``min_batch = max_batch = size``: one trial) and the same number of
steps of the same step plainly, on the same model and device (on cpu inside the same simulated
device, whose counting is the device's cost, not the probe's; on CUDA followed by a
synchronisation). The trial's time is the search's clock around the whole trial (the clean-up
before it, the steps with the part hooks, the counter reads); overhead = trial - plain, the
median of ``--repeat`` rounds. The probe does not synchronise the device at the end of a
trial; the next trial's ``empty_cache`` does, so on CUDA the table's trial time can lag the
plain time by the last kernels' runtime.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import memkit
from memkit.devices import get_backend
from memkit.modelfile import build_model, load_model_file, make_optimizer
from memkit.probing.runner import probe
from memkit.probing.step import StepPlan, to_device


def plain_steps(
    spec: Any, model: Any, optimizer: Any, backend: Any, batch: int, steps: int
) -> float:
    """Seconds for ``steps`` steps of the probe's step at ``batch``, nothing else."""
    plan = StepPlan("train", loss_fn=spec.loss_fn, train_step=spec.train_step)
    started = time.perf_counter()
    with backend.activate():
        for _ in range(steps):
            plan(model, to_device(spec.make_batch(batch), backend.device), optimizer)
        plan.release()
    backend.synchronize()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    optimizer.state.clear()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_file", nargs="?", default="examples/gpt2.py")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    spec = load_model_file(args.model_file)
    backend = get_backend(args.device, args.budget)
    model = build_model(spec).to(backend.device)
    optimizer, _ = make_optimizer(spec, model)
    if isinstance(backend, memkit.devices.SimulatedBackend):
        backend.track(model, optimizer)
    plain_steps(spec, model, optimizer, backend, 1, 2)  # warm-up: kernels, CUDA context
    print(f"{args.model_file} on {backend.name()}, median of {args.repeat}")
    print(f"{'batch':>5} {'steps':>5} {'plain s':>8} {'trial s':>8} {'overhead ms':>11}")
    for size in (int(s) for s in args.sizes.split(",")):
        plains, trials, steps = [], [], 2
        for _ in range(args.repeat):
            result = probe(model, spec.make_batch, optimizer=optimizer, loss_fn=spec.loss_fn,
                           train_step=spec.train_step, device=args.device, budget=args.budget,
                           min_batch=size, max_batch=size)  # fmt: skip
            trial = result.trials[0]
            steps = getattr(trial, "steps_run", None) or 2  # older memkit: always 2
            trials.append(trial.seconds)
            plains.append(plain_steps(spec, model, optimizer, backend, size, steps))
        plain, trial_s = statistics.median(plains), statistics.median(trials)
        over = 1000 * (trial_s - plain)
        print(f"{size:>5} {steps:>5} {plain:>8.4f} {trial_s:>8.4f} {over:>11.1f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
