"""How much does memkit.track slow a training step? Compared with torch's own tools.

Run: ``python benchmarks/tracker_overhead.py`` (CPU) or ``--device cuda`` (a GPU).
``--counters`` (no GPU needed): the default mode on the CUDA stand-in
(:mod:`memkit.devices.cuda_standin`) for ``--counter-steps`` steps of the transformer: memkit's
CUDA code paths as they run on a GPU, counting ``torch._C._cuda_memoryStats`` calls a step and
the hooks' microseconds per module call, which predict the GPU cost (about 18 us a read there).

Each configuration trains the same model for ``--steps`` timed steps (after ``--warmup``), and
the configurations are run in alternation, ``--rounds`` times, so that drifts of the machine
(frequency scaling, other processes) hit them all alike. The step time of a configuration is
the median over all its timed steps; ratios are against the matching baseline:

* ``plain``: no tracking at all.
* ``hooks: steps-only`` / ``hooks: per-module``: memkit's tracker with its counters made
  constant (the simulated device is not activated), so this is the cost of the hooks
  themselves on plain CPU tensors: what memkit adds on a GPU, where reading a counter is one
  C++ call. Ratio against ``plain``.
* ``sim: baseline``: the simulated device's dispatch mode counting every tensor, no hooks.
  That is what ``--device cpu`` costs (it is how memory is measured without a GPU, not tracker
  overhead). ``sim: steps-only`` / ``sim: per-module``: the tracker on the simulated device;
  ratio against ``sim: baseline``.
* ``torch.profiler(profile_memory=True)`` and ``MemTracker`` (``torch.distributed._tools``):
  ratio against ``plain``.

On CUDA the configurations are ``plain``, ``steps-only``, ``per-module``, the profiler and
MemTracker, each step ending with a device synchronisation (same for all).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memkit.devices import SimulatedBackend, get_backend
from memkit.tracking import track


def cnn(width: int) -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        block(3, width, 1),
        block(width, 2 * width, 2),
        block(2 * width, 4 * width, 2),
        block(4 * width, 8 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8 * width, 10),
    )


def gpt2(layers: int, width: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=2048,
        n_positions=512, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def workloads(device: str, size: str) -> dict[str, tuple[nn.Module, Callable[[nn.Module], Any]]]:
    dev = torch.device(device)
    big = size == "large"
    model_cnn = cnn(32 if big else 16).to(dev)
    img = 64 if big else 32
    batch_cnn = 32 if dev.type == "cpu" else 128

    def step_cnn(m: nn.Module) -> Any:
        x = torch.randn(batch_cnn, 3, img, img, device=dev)
        y = torch.randint(0, 10, (batch_cnn,), device=dev)
        return nn.functional.cross_entropy(m(x), y)

    model_tf = gpt2(4 if big else 2, 256 if big else 128).to(dev)
    seq, batch_tf = (256, 8) if big else (128, 8)

    def step_tf(m: nn.Module) -> Any:
        ids = torch.randint(0, 2048, (batch_tf, seq), device=dev)
        return m(input_ids=ids, labels=ids).loss

    return {"cnn": (model_cnn, step_cnn), "transformer": (model_tf, step_tf)}


@contextlib.contextmanager
def constant_counters() -> Iterator[None]:
    """Make the simulated device count nothing: the tracker's hooks run, its counters are
    constant, and no dispatch mode slows the ops."""
    original = SimulatedBackend.activate
    SimulatedBackend.activate = lambda self: contextlib.nullcontext()  # type: ignore[method-assign]
    try:
        with without_model_finder():  # the simulated device's own hook: none on a GPU
            yield
    finally:
        SimulatedBackend.activate = original  # type: ignore[method-assign]


@contextlib.contextmanager
def without_model_finder() -> Iterator[None]:
    """No global hook finding the other models that run (the simulated device installs one
    beside a given model: ``Hooks._find_other_models``)."""
    from memkit.tracking.hooks import Hooks

    original = Hooks._find_other_models
    Hooks._find_other_models = lambda self, model: _NoHandle()  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hooks._find_other_models = original  # type: ignore[method-assign]


class _NoHandle:
    def remove(self) -> None:
        """Nothing was installed."""


def configurations(device: str) -> dict[str, tuple[Callable[..., Any], str]]:
    """name -> (context factory(model, opt), baseline name)."""
    cpu = device == "cpu"

    def plain(model: nn.Module, opt: Any) -> Any:
        return contextlib.nullcontext()

    def profiler(model: nn.Module, opt: Any) -> Any:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if not cpu:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=acts, profile_memory=True)

    def memtracker(model: nn.Module, opt: Any) -> Any:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, opt)
        return mt

    configs: dict[str, tuple[Callable[..., Any], str]] = {"plain": (plain, "plain")}
    if cpu:

        @contextlib.contextmanager
        def hooks(model: nn.Module, opt: Any, per_module: bool) -> Iterator[Any]:
            with (
                constant_counters(),
                track(model, opt, device="cpu", budget="64GiB", per_module=per_module) as t,
            ):
                yield t

        @contextlib.contextmanager
        def sim(model: nn.Module, opt: Any, per_module: bool | None) -> Iterator[Any]:
            if per_module is None:
                backend = get_backend("cpu", "64GiB")
                backend.track(model, opt)
                with backend.activate():
                    yield None
            else:
                with track(model, opt, device="cpu", budget="64GiB", per_module=per_module) as t:
                    yield t

        configs["hooks: steps-only"] = (lambda m, o: hooks(m, o, False), "plain")
        configs["hooks: per-module"] = (lambda m, o: hooks(m, o, True), "plain")
        configs["sim: baseline"] = (lambda m, o: sim(m, o, None), "sim: baseline")
        configs["sim: steps-only"] = (lambda m, o: sim(m, o, False), "sim: baseline")
        configs["sim: per-module"] = (lambda m, o: sim(m, o, True), "sim: baseline")
    else:
        configs["steps-only"] = (
            lambda m, o: track(m, o, device=device, per_module=False),
            "plain",
        )
        configs["per-module"] = (lambda m, o: track(m, o, device=device), "plain")
    configs["torch.profiler(profile_memory)"] = (profiler, "plain")
    configs["MemTracker"] = (memtracker, "plain")
    return configs


def run_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    make_loss: Callable[[nn.Module], Any],
    ctx: Any,
    warmup: int,
    steps: int,
    sync: Callable[[], None],
    clock: Callable[[], float],
) -> list[float]:
    times = []
    with ctx as entered:
        reset = getattr(entered, "reset_mod_stats", None)  # MemTracker: one iteration at a time
        for i in range(warmup + steps):
            if reset is not None:
                reset()
            sync()
            t0 = clock()
            loss = make_loss(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sync()
            if i >= warmup:
                times.append(clock() - t0)
            del loss
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=["small", "large"], default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--skip", default="", help="comma-separated configurations to skip")
    parser.add_argument(
        "--clock",
        choices=["thread", "wall"],
        default=None,
        help="thread: CPU time of the training thread (default on cpu, with --threads 1: "
        "immune to other processes on a shared machine); wall: perf_counter (default on GPUs)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--micro", action="store_true", help="also the per-module-call cost")
    parser.add_argument("--counters", action="store_true",
                        help="only: counter reads a step and hook us per module call, default "
                        "mode, through the CUDA stand-in")  # fmt: skip
    parser.add_argument("--counter-steps", type=int, default=120)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = args.device
    on_cpu = device == "cpu"
    threads = args.threads if args.threads is not None else (1 if on_cpu else None)
    if threads is not None:
        torch.set_num_threads(threads)
    clock_name = args.clock or ("thread" if on_cpu else "wall")
    clock = time.thread_time if clock_name == "thread" else time.perf_counter
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    if args.counters:
        counters(args.counter_steps, args.rounds, clock)
        return 0
    configs = configurations(device)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    configs = {k: v for k, v in configs.items() if k not in skip}
    loads = workloads(device, args.size)
    print(f"torch {torch.__version__}, device {device}, size {args.size}, {args.rounds} rounds "
          f"x {args.steps} steps (+{args.warmup} warm-up), threads {torch.get_num_threads()}, "
          f"clock {clock_name}")  # fmt: skip
    for model_name in args.models.split(","):
        model, make_loss = loads[model_name]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        nmod = sum(1 for _ in model.modules())
        samples: dict[str, list[float]] = {name: [] for name in configs}
        failed: dict[str, str] = {}
        for _ in range(args.rounds):
            for name, (factory, _) in configs.items():
                if name in failed:
                    continue
                try:
                    samples[name] += run_steps(
                        model,
                        opt,
                        make_loss,
                        factory(model, opt),
                        args.warmup,
                        args.steps,
                        sync,
                        clock,
                    )
                except Exception as exc:  # a tool that cannot run this model
                    failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        print(f"\n{model_name}: {nmod} modules")
        print(f"{'configuration':34} {'median':>10} {'ratio':>7} {'min':>10} {'ratio':>7}  vs")
        for name, (_, base) in configs.items():
            if name in failed:
                print(f"{name:34} {'failed':>10}  {failed[name]}")
                continue
            med, low = statistics.median(samples[name]), min(samples[name])
            ref_med = statistics.median(samples[base]) if samples[base] else float("nan")
            ref_low = min(samples[base]) if samples[base] else float("nan")
            print(
                f"{name:34} {med * 1e3:8.2f}ms {med / ref_med:7.3f} {low * 1e3:8.2f}ms "
                f"{low / ref_low:7.3f}  {base}"
            )
    if args.micro:
        micro(device, clock, sync)
    return 0


def micro(device: str, clock: Callable[[], float], sync: Callable[[], None]) -> None:
    """Cost of the hooks per module call: 200 tiny modules (alternating Linear(8, 8), which
    gets a gradient hook, and Tanh, which does not) on a tiny tensor, so the step is almost
    nothing but module calls; (tracked - plain) / calls."""
    n = 200
    layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.Tanh() for i in range(n)]
    model = nn.Sequential(*layers).to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)

    def step() -> float:
        sync()
        t0 = clock()
        model(x).sum().backward()
        sync()
        return clock() - t0

    def measure(ctx: Any) -> float:
        with ctx:
            for _ in range(5):
                step()
            return min(step() for _ in range(50))

    per_module: list[float] = []
    steps_only: list[float] = []
    plain: list[float] = []
    for _ in range(5):
        plain.append(measure(contextlib.nullcontext()))
        with constant_counters() if device == "cpu" else contextlib.nullcontext():
            per_module.append(measure(track(model, device=device, budget=None)))
            steps_only.append(measure(track(model, device=device, per_module=False)))
    base = min(plain)
    cost = (min(per_module) - base) / n
    print(
        f"\nmicro: {n} module calls per step (forward + backward): plain "
        f"{base * 1e6:.0f} us/step; per-module hooks add {cost * 1e6:.1f} us per module call "
        f"(forward pre/post + backward); steps-only adds "
        f"{(min(steps_only) - base) * 1e6:.0f} us per step (min over rounds)"
    )
    if device == "cpu":  # the simulated device's model finder, with its counting on
        timed: dict[tuple[bool, bool], list[float]] = {}
        for _ in range(5):
            for per in (False, True):
                with without_model_finder():
                    ctx = track(model, device="cpu", per_module=per)
                    timed.setdefault((per, False), []).append(measure(ctx))
                ctx = track(model, device="cpu", per_module=per)
                timed.setdefault((per, True), []).append(measure(ctx))
        for per in (False, True):
            without, found = min(timed[(per, False)]), min(timed[(per, True)])
            print(
                f"micro: simulated device, {'per-module' if per else 'steps-only'}: finding "
                f"other models (a global pre-hook beside a given model) adds "
                f"{(found - without) / n * 1e6:.1f} us per module call to a "
                f"{without * 1e6:.0f} us step ({found / without:.3f}x, min over rounds)"
            )


HOOK_ENTRIES = (
    "_pre", "_post", "_global_pre", "_bw", "_opt_pre", "_opt_post", "_begin_backward",
    "_end_backward", "_end_queued", "_engine_begins", "_graph_grad",
)  # fmt: skip
"""What torch calls of the tracker: every hook's way in (memkit/tracking/hooks.py)."""


@contextlib.contextmanager
def hook_timer() -> Iterator[list[float]]:
    """Time spent inside the tracker's hooks (outermost calls only), and inside the counter
    calls they make (the stand-in's, slower than CUDA's), in seconds of this thread's CPU time
    (a machine shared with other processes would otherwise charge their time to the hooks).

    ``spent``: [inside the hooks, inside the counter calls, hook calls, counter calls]. The
    timer's own cost that lands inside a hook's time (``time.thread_time`` is a system call,
    about 1.7 us here; two per timed call) is measured by :func:`timer_cost` and taken off by
    the caller."""
    from memkit.tracking.hooks import Hooks

    spent = [0.0, 0.0, 0, 0]
    originals = {name: getattr(Hooks, name) for name in HOOK_ENTRIES}
    counter_calls = {
        name: getattr(torch._C, name)
        for name in ("_cuda_memoryStats", "_cuda_resetPeakMemoryStats")
        if hasattr(torch._C, name)
    }
    timed, timed_counter = _timers(spent)
    for name, fn in originals.items():
        setattr(Hooks, name, timed(fn))
    for name, fn in counter_calls.items():
        setattr(torch._C, name, timed_counter(fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(Hooks, name, fn)
        for name, fn in counter_calls.items():
            setattr(torch._C, name, fn)


def _timers(
    spent: list[Any],
) -> tuple[Callable[[Callable[..., Any]], Any], Callable[[Callable[..., Any]], Any]]:
    """``(timed, timed_counter)``: wrappers adding to ``spent`` (see :func:`hook_timer`)."""
    depth = [0]

    def timed_counter(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[1] += time.thread_time() - t0
                spent[3] += 1

        return wrapper

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] = 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - t0
                spent[2] += 1
                depth[0] = 0

        return wrapper

    return timed, timed_counter


def timer_cost(n: int = 20000) -> tuple[float, float]:
    """``(per hook call, per counter call)``: seconds of the timer's own work that
    :func:`hook_timer` counts as the hooks' (a hook that does nothing, and one more counter
    call inside a hook that does nothing), fastest of five loops."""

    def noop(*args: Any) -> None:
        return None

    def cost(calls_inside: int) -> float:
        best = float("inf")
        for _ in range(5):
            spent = [0.0, 0.0, 0, 0]
            timed, timed_counter = _timers(spent)
            counter = timed_counter(noop)

            def hook(counter: Callable[[], None] = counter) -> None:
                for _ in range(calls_inside):
                    counter()

            entry = timed(hook)
            for _ in range(n):
                entry()
            best = min(best, (spent[0] - spent[1]) / n)
        return best

    per_hook = cost(0)
    return per_hook, max(0.0, (cost(4) - per_hook) / 4)


def traced_work(run: Callable[[], None]) -> tuple[int, int]:
    """``(lines, calls)`` of memkit's own code (the CUDA stand-in and the simulated device
    left out) while ``run`` runs: the hooks' work counted without a timer, the same on any
    machine."""
    import memkit

    root = os.path.dirname(memkit.__file__)
    skip = (os.path.join(root, "devices", "cuda_standin.py"), os.path.join(root, "simulated"))
    counted = [0, 0]

    def line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            counted[0] += 1
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if not name.startswith(root) or name.startswith(skip):
            return None
        counted[1] += 1
        return line

    sys.settrace(call)
    try:
        run()
    finally:
        sys.settrace(None)
    return counted[0], counted[1]


def counters(steps: int, rounds: int, clock: Callable[[], float]) -> None:
    """The default tracking mode on the CUDA stand-in (memkit's CUDA code paths): counter
    reads and peak resets a step, and the time inside the hooks per module call (timed at the
    hooks themselves: on a CPU the simulated device's op counting is a thousand times larger
    than the hooks, so a difference of step times could not show them)."""
    from memkit.devices.cuda_standin import cuda_standin

    torch.manual_seed(0)
    model = gpt2(2, 128)
    calls = [0]

    def count(module: nn.Module, args: Any) -> None:
        calls[0] += 1

    with cuda_standin("8GiB") as gpu:
        model.to("cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 2048, (8, 128)).to("cuda")

        def train(n: int) -> None:
            for _ in range(n):
                loss = model(input_ids=ids, labels=ids).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                del loss

        handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
        train(1)
        handle.remove()
        per_step = calls[0]
        train(2)  # warm-up: optimizer state, allocator segments
        per_hook, per_counter = timer_cost()
        rows = []
        for every in (None, 1):
            best = float("inf")
            for _ in range(rounds):
                r0, z0 = gpu.stat_reads, gpu.peak_resets
                gc.collect()
                gc.disable()  # a collection lands in whatever allocates: not the hooks' cost
                try:
                    with hook_timer() as spent, track(model, opt, device="cuda",
                                                      module_every=every) as tracker:  # fmt: skip
                        train(steps)
                finally:
                    gc.enable()
                timer = spent[2] * per_hook + spent[3] * per_counter
                best = min(best, spent[0] - spent[1] - timer)
            reads, resets = gpu.stat_reads - r0, gpu.peak_resets - z0
            rows.append((tracker.report().mode, reads / steps, resets / steps, best))
        steady = float("inf")
        gc.collect()
        gc.disable()
        try:
            with hook_timer() as spent, track(model, opt, device="cuda"):
                train(5)  # past the sampled steps 0 and 1 and the first graph scans (2-4)
                lines, calls = traced_work(lambda: train(20))
                for _ in range(rounds):  # the fastest 20 steps hold no module detail or scan
                    before = [*spent]
                    train(20)
                    hook_calls, counter_calls = spent[2] - before[2], spent[3] - before[3]
                    timer = hook_calls * per_hook + counter_calls * per_counter
                    steady = min(steady, spent[0] - before[0] - (spent[1] - before[1]) - timer)
        finally:
            gc.enable()
    print(f"transformer (GPT-2, 2 layers): {per_step} module calls a step, {steps} steps, on "
          f"the CUDA stand-in; time inside the hooks less the stand-in's counter calls (on a "
          f"GPU add about 18 us a read) and less the timer's own cost "
          f"({per_hook * 1e6:.2f} us a hook call, {per_counter * 1e6:.2f} us a counter call), "
          f"fastest of {rounds}")  # fmt: skip
    for mode, reads, resets, spent in rows:
        print(f"  {mode}: {reads:.2f} reads, {resets:.2f} resets a step; hooks "
              f"{spent / steps * 1e6:.0f} us a step, {spent / (steps * per_step) * 1e6:.2f} us "
              "per module call")  # fmt: skip
    print(f"  memkit's own code a step between sampled steps (sys.settrace, 20 steps): "
          f"{lines / 20:.0f} lines, {calls / 20:.0f} calls; hooks {steady / 20 * 1e6:.0f} us a "
          f"step, {steady / (20 * per_step) * 1e6:.2f} us per module call")  # fmt: skip
    _, reads, _, spent = rows[0]
    print(f"counter reads per step: {reads:.2f}")
    print(f"hook us per module call: {spent / (steps * per_step) * 1e6:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
