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

``--breakdown`` also times the pieces of a trial, each the median of ``--repeat`` rounds of
the same steps (synchronised at the end): ``warm`` (the steps with the allocator's cache kept
from the last steps), ``cold`` (the same steps right after ``empty_cache()``: every segment
allocated anew), ``hooks`` (warm, with the part hooks of :class:`PartPeaks` on the model),
and the clean-up before a trial: ``gc`` (``gc.collect()``) and ``empty`` (``empty_cache()``).
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


def _timed(backend: Any, run: Any) -> float:
    backend.synchronize()
    started = time.perf_counter()
    run()
    backend.synchronize()
    return time.perf_counter() - started


def breakdown(spec: Any, model: Any, optimizer: Any, backend: Any, size: int, repeat: int) -> str:
    """One row: the median ms of each piece of a trial at ``size`` (see the module doc)."""
    import gc

    from memkit.devices import counter_reader
    from memkit.probing.trials import PartPeaks

    def steps() -> None:
        plain_steps(spec, model, optimizer, backend, size, 2)

    def hooked() -> None:
        split = PartPeaks(counter_reader(backend), model, optimizer)
        try:
            steps()
        finally:
            split.close()

    pieces: dict[str, list[float]] = {k: [] for k in ("warm", "cold", "hooks", "gc", "empty")}
    steps()  # the cache holds this size's segments
    for _ in range(repeat):
        pieces["warm"].append(_timed(backend, steps))
        pieces["hooks"].append(_timed(backend, hooked))
        pieces["gc"].append(_timed(backend, gc.collect))
        pieces["empty"].append(_timed(backend, backend.empty_cache))
        pieces["cold"].append(_timed(backend, steps))
    return f"{size:>5} " + " ".join(f"{1000 * statistics.median(v):>8.1f}" for v in pieces.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_file", nargs="?", default="examples/gpt2.py")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true", help="time each piece of a trial")
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
    if args.breakdown:
        print(f"pieces of a trial, ms (median of {args.repeat}; steps: 2)")
        print(f"{'batch':>5} {'warm':>8} {'cold':>8} {'hooks':>8} {'gc':>8} {'empty':>8}")
        for size in (int(s) for s in args.sizes.split(",")):
            print(breakdown(spec, model, optimizer, backend, size, args.repeat))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
