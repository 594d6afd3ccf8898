"""What does the memory history cost on the simulated device? Off (it must cost nothing) and on.

Run: ``python benchmarks/history_overhead.py`` (CPU). ``--baseline-rev REV`` also times the
accountant as it was at git revision ``REV`` (before the history's hooks existed), loaded from
``git show REV:memkit/simulated/accountant.py``, so "off" can be compared with "never there".

Each configuration trains the same model for ``--steps`` timed steps (after ``--warmup``),
alternating configurations ``--rounds`` times; a configuration's step time is the median of all
its steps. Configurations (all on the simulated device, the model and optimizer tracked):

* ``history off``: the accountant alone (what ``--device cpu`` costs without the option);
* ``history on``: the same with :class:`memkit.simulated.history.SimulatedHistory` recording
  (frames of every alloc and free, the default ring of 100000 events);
* ``baseline REV`` (with ``--baseline-rev``): the older accountant.

It also reports the events per step, and the time and size of writing the snapshot, and, per
allocation, ``--micro``: microseconds to make and free a 1 KiB tensor in a loop, plain, under
each accountant, and with the history at a shallow stack and 30 frames deeper (the frame walk
grows with the depth). Step times are reported as the median and the minimum over all steps.
The clock is the thread's CPU time (``time.thread_time``) with torch on one thread, so other
processes sharing the machine do not count as cost (as in tracker_overhead.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memkit.simulated.accountant import MemoryAccountant
from memkit.simulated.history import SimulatedHistory

CLOCK = time.thread_time
"""CPU time of this thread: what the history costs, whatever else the machine runs."""


def cnn() -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        block(3, 16, 1), block(16, 32, 2), block(32, 64, 2), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=2048, n_positions=256,
                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def workloads() -> dict[str, tuple[nn.Module, Callable[[nn.Module], Any]]]:
    def step_cnn(m: nn.Module) -> Any:
        x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
        return nn.functional.cross_entropy(m(x), y)

    def step_tf(m: nn.Module) -> Any:
        ids = torch.randint(0, 2048, (8, 128))
        return m(input_ids=ids, labels=ids).loss

    out: dict[str, tuple[nn.Module, Callable[[nn.Module], Any]]] = {"cnn": (cnn(), step_cnn)}
    try:
        out["gpt2 (2 layers)"] = (gpt2(), step_tf)
    except ImportError:
        print("transformers is not installed: the GPT-2 workload is skipped", file=sys.stderr)
    return out


def old_accountant(rev: str) -> type[Any]:
    """``MemoryAccountant`` as it was at git revision ``rev``."""
    root = Path(__file__).resolve().parent.parent
    for where in ("memkit/simulated/accountant.py", "memkit/accounting.py"):  # moved in 2026-11
        shown = subprocess.run(
            ["git", "show", f"{rev}:{where}"], cwd=root, capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "accounting_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("accounting_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MemoryAccountant  # type: ignore[no-any-return]


def configurations(rev: str | None) -> dict[str, Callable[..., Any]]:
    @contextlib.contextmanager
    def sim(model: nn.Module, opt: Any, history: bool, cls: type[Any]) -> Iterator[Any]:
        acct = cls("cpu", None)
        acct.track(model, opt)
        recorder = SimulatedHistory(acct).start() if history else None
        with acct:
            yield recorder
        if recorder is not None:
            recorder.stop()

    configs: dict[str, Callable[..., Any]] = {
        "history off": lambda m, o: sim(m, o, False, MemoryAccountant),
        "history on": lambda m, o: sim(m, o, True, MemoryAccountant),
    }
    if rev is not None:
        cls = old_accountant(rev)
        configs[f"baseline {rev}"] = lambda m, o: sim(m, o, False, cls)
    return configs


def micro(rev: str | None, repeats: int = 7, n: int = 20000) -> None:
    """Microseconds per alloc+free of a 1 KiB tensor, the minimum over ``repeats`` loops."""

    def loop(acct: Any) -> float:
        with acct if acct is not None else contextlib.nullcontext():
            t0 = CLOCK()
            for _ in range(n):
                torch.empty(256)
            return (CLOCK() - t0) / n * 1e6

    def deeper(depth: int, fn: Callable[[], float]) -> float:
        return fn() if depth == 0 else deeper(depth - 1, fn)

    def recorded(depth: int) -> float:
        acct = MemoryAccountant("cpu")
        history = SimulatedHistory(acct).start()
        try:
            return deeper(depth, lambda: loop(acct))
        finally:
            history.stop()

    cases: dict[str, Callable[[], float]] = {
        "plain torch": lambda: loop(None),
        "history off": lambda: loop(MemoryAccountant("cpu")),
        "history on": lambda: recorded(0),
        "history on, +30 frames": lambda: recorded(30),
    }
    if rev is not None:
        cls = old_accountant(rev)
        cases[f"baseline {rev}"] = lambda: loop(cls("cpu"))
    taken: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            taken[name].append(case())
    print("\nper allocation (make and free a 1 KiB tensor; 5 history events when on)")
    for name, values in taken.items():
        print(f"  {name:<24} {min(values):6.2f} us (median {statistics.median(values):.2f})")


def run_steps(model: nn.Module, opt: Any, make_loss: Callable[[nn.Module], Any], ctx: Any,
              warmup: int, steps: int) -> tuple[list[float], Any]:  # fmt: skip
    times = []
    with ctx as recorder:
        for i in range(warmup + steps):
            t0 = CLOCK()
            loss = make_loss(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= warmup:
                times.append(CLOCK() - t0)
            del loss
    return times, recorder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--baseline-rev", default=None, metavar="REV")
    parser.add_argument("--micro", action="store_true", help="only the per-allocation costs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the thread's CPU time is then the step's
    print(f"torch {torch.__version__}, 1 thread, thread CPU time")
    micro(args.baseline_rev)
    if args.micro:
        return 0
    configs = configurations(args.baseline_rev)
    for name, (model, make_loss) in workloads().items():
        opt = torch.optim.Adam(model.parameters())
        times: dict[str, list[float]] = {c: [] for c in configs}
        recorder = None
        for _ in range(args.rounds):
            for cname, factory in configs.items():
                taken, rec = run_steps(model, opt, make_loss, factory(model, opt), args.warmup,
                                       args.steps)  # fmt: skip
                times[cname].extend(taken)
                recorder = rec if rec is not None else recorder
        base, base_min = statistics.median(times["history off"]), min(times["history off"])
        print(f"\n{name}: ms/step, median and minimum (ratio to history off)")
        for cname, taken in times.items():
            med, low = statistics.median(taken), min(taken)
            print(f"  {cname:<22} {1000 * med:8.2f} (x{med / base:.3f})  "
                  f"{1000 * low:8.2f} (x{low / base_min:.3f})")  # fmt: skip
        if recorder is not None:
            steps = args.warmup + args.steps
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                path = recorder.dump(Path(tmp) / "h.pickle")
                dump_s = time.perf_counter() - t0
                size = path.stat().st_size
            events = recorder.events_recorded
            print(f"  events: {events / steps:.0f} per step; snapshot of the last "
                  f"{min(events, recorder.max_entries)} events: {size / 2**20:.2f} MiB, written "
                  f"in {dump_s:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
