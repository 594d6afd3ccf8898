"""memkit probe against Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size.

Run: ``pip install -e ".[bench]"`` then ``python benchmarks/probe_vs_peers.py``
(``--search-only`` prints just the search-strategy trial counts; ``--repeat 3`` repeats every
tool on every model, in alternating order, and reports the median wall time).

Every tool runs on memkit's simulated device, so all of them see the same deterministic
out-of-memory errors: ``memkit.simulate(budget, track=(model, optimizer))`` raises
``torch.OutOfMemoryError`` (a ``RuntimeError`` whose message contains "CUDA out of memory.")
from the op that crosses the budget. Accelerate's ``should_reduce_batch_size`` and Lightning's
``is_oom_error`` both recognise it (checked at start-up, :func:`check_oom_recognised`).

One *trial* at a batch size is the same work for every tool: ``STEPS`` (2) full training steps,
each forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``, starting from the
parameters and the optimizer's state, counted on the simulated device:

* memkit: ``memkit.probe(model, make_batch, train_step=step, device="cpu", budget=...)``.
* Accelerate: a function decorated with ``find_executable_batch_size(starting_batch_size=...)``
  that clears the optimizer state and runs the steps inside ``memkit.simulate(...)``, as a user
  function that builds its optimizer inside would. Accelerate only goes down (1.x multiplies
  the size by 0.9 after an OOM; older releases halved it), so it needs a start above the limit:
  ``Case.accelerate_start`` (1024 for the examples, about 10x their limits; 8192 for the small
  MLP), and once more with its default start, 128.
* Lightning: ``Tuner(trainer).scale_batch_size(module, mode=..., steps_per_trial=2)`` with its
  defaults otherwise (``init_val=2``, ``max_trials=25``, ``margin=0.05``, ``max_val=8192``).
  The tuner clears ``trainer.callbacks`` while it searches, so the simulated device is entered in
  the LightningModule's own ``optimizer_step`` hook, around ``optimizer.step(closure)``: the
  closure runs ``training_step`` (forward, loss), Lightning's ``zero_grad`` and the backward,
  then the optimizer steps, and the hook ends with ``zero_grad(set_to_none=True)`` so gradients
  do not outlive the step (as in memkit's and Accelerate's step; Lightning's own ``zero_grad``
  comes after the forward, which would keep the previous step's gradients alive through it).
  ``training_step`` also keeps its loss until ``on_after_backward``: Lightning backpropagates a
  copy (the loss divided by ``accumulate_grad_batches``) and drops the original before the
  backward, and on CPU ``mse_loss``'s 0-dim result holds the whole unreduced buffer (batch x
  features floats), so without this Lightning's step would peak lower than the plain step.
  So Lightning's OOMs happen in the same ops as memkit's: every size both ran is checked to have
  the same outcome, and the same peak (:func:`lightning_consistent`). The batch size the
  dataloader actually delivered is recorded at every step (``on_train_batch_start``).

For each tool the table shows the size it returns, whether that size was run (a trial at that
size completed) and whether it fits, the true limit (memkit's answer, verified independently:
B runs under the budget and B + 1 raises the OOM), the memory left unused at the returned size
(capacity minus that size's measured peak), the number of trials and the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memkit
from memkit.modelfile import load_model_file
from memkit.probing.search import doubling_bisection, search_max_batch
from memkit.render.text import table
from memkit.units import format_size, parse_size

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2
"""Full training steps per trial, for every tool (memkit's default)."""
PEAK_SLACK = 64
"""Bytes Lightning's step may hold beyond the plain step: two 0-dim copies of the loss."""
ACCELERATE_DEFAULT_START = 128
"""``find_executable_batch_size``'s default ``starting_batch_size``."""


# --------------------------------------------------------------------------------------------
# The models: the three of examples/, a small MLP whose limit lies in (4096, 8192), and a
# transformers BERT classifier
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    """A model, its batches, its loss and optimizer, and the simulated device's budget."""

    name: str
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    build_optimizer: Callable[[Any], torch.optim.Optimizer]
    budget: str
    accelerate_start: int = 1024
    """Accelerate only goes down, so it needs a start above the limit: ~10x the limit here."""

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = self.build_model()
        return model, self.build_optimizer(model.parameters())

    def step(self, model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> None:
        """One training step: the same code for every tool."""
        self.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def _mlp_case() -> Case:
    spec = load_model_file(ROOT / "examples" / "mlp.py")
    loss_fn = spec.loss_fn
    assert loss_fn is not None
    return Case(
        "mlp (examples/mlp.py)", spec.build_model, spec.make_batch,
        lambda model, batch: loss_fn(model(batch), batch), _adamw, "112MiB",
    )  # fmt: skip


def _cnn_case() -> Case:
    spec = load_model_file(ROOT / "examples" / "cnn.py")
    assert spec.build_optimizer is not None

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:  # examples/cnn.py's train_step
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels)

    return Case(
        "cnn (examples/cnn.py)", spec.build_model, spec.make_batch, loss, spec.build_optimizer,
        "192MiB",
    )  # fmt: skip


def _gpt2_case(seq_len: int = 32) -> Case:
    spec = load_model_file(ROOT / "examples" / "gpt2.py")
    make_batch = spec.make_batch
    return Case(
        f"gpt2 (examples/gpt2.py, seq {seq_len})", spec.build_model,
        lambda batch_size: make_batch(batch_size, seq_len),
        lambda model, batch: model(**batch).loss, _adamw, "288MiB",
    )  # fmt: skip


def _small_mlp_case() -> Case:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    return Case(
        "small mlp (64-256-64)", build, lambda batch_size: torch.randn(batch_size, 64),
        lambda model, batch: nn.functional.mse_loss(model(batch), batch), _adamw, "24MiB",
        accelerate_start=8192,
    )  # fmt: skip


def _bert_case(seq_len: int = 128) -> Case:
    """A transformers BERT classifier built from a tiny config (dropout on, as by default):
    its 30522-word embedding makes the optimizer step and the embedding's dense gradient set
    the peak at small batches, flat, while the activations' slope sets the limit."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
        num_labels=2,
    )  # fmt: skip

    def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, config.vocab_size, (batch_size, seq_len)),
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "labels": torch.randint(0, 2, (batch_size,)),
        }

    return Case(
        f"bert classifier (transformers, seq {seq_len})",
        lambda: BertForSequenceClassification(config), make_batch,
        lambda model, batch: model(**batch).loss, _adamw, "160MiB", accelerate_start=512,
    )  # fmt: skip


CASES: dict[str, Callable[[], Case]] = {
    "mlp": _mlp_case,
    "cnn": _cnn_case,
    "gpt2": _gpt2_case,
    "small-mlp": _small_mlp_case,
    "bert": _bert_case,
}


# --------------------------------------------------------------------------------------------
# Measuring one size independently of every tool
# --------------------------------------------------------------------------------------------


def _clear(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.zero_grad(set_to_none=True)
    optimizer.state.clear()
    gc.collect()


def run_trial(
    case: Case, model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int,
    budget: int | None,
) -> int:  # fmt: skip
    """``STEPS`` steps at ``batch_size`` from an empty optimizer state; returns the peak.

    Raises ``torch.OutOfMemoryError`` when the peak would exceed ``budget``.
    """
    _clear(model, optimizer)
    with memkit.simulate(budget, track=(model, optimizer)) as acct:
        for _ in range(STEPS):
            batch = case.make_batch(batch_size)
            case.step(model, batch, optimizer)
            del batch
    return acct.peak


class Meter:
    """Peaks of sizes, measured once each without a budget (so a size over it still gets one)."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.model, self.optimizer = case.fresh()
        self.peaks: dict[int, int] = {}

    def peak(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            self.peaks[batch_size] = run_trial(
                self.case, self.model, self.optimizer, batch_size, None
            )
        return self.peaks[batch_size]

    def oom_at(self, batch_size: int, budget: int) -> bool:
        """Whether ``batch_size`` raises the simulated OOM under ``budget``."""
        try:
            run_trial(self.case, self.model, self.optimizer, batch_size, budget)
        except torch.OutOfMemoryError:
            return True
        finally:
            _clear(self.model, self.optimizer)
        return False


# --------------------------------------------------------------------------------------------
# The tools
# --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one tool returned, and every trial it ran."""

    tool: str
    found: int | None
    trials: list[tuple[int, bool]]  # (size, fit) in the order run
    seconds: float
    peaks: dict[int, int] = field(default_factory=dict)  # sizes that fit: the tool's own peaks

    @property
    def ran_ok(self) -> set[int]:
        return {size for size, ok in self.trials if ok}


def run_memkit(case: Case, budget: int) -> list[Outcome]:
    model, optimizer = case.fresh()
    started = time.perf_counter()
    result = memkit.probe(
        model, case.make_batch, optimizer=optimizer, train_step=case.step, device="cpu",
        budget=budget, steps=STEPS,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    trials = [(t.batch_size, t.fits) for t in result.trials]
    peaks = {t.batch_size: t.peak_bytes for t in result.trials if t.fits and t.peak_bytes}
    return [
        Outcome("memkit: max_batch_size", result.max_batch_size, trials, seconds, peaks=peaks),
        Outcome(
            "memkit: recommended (5% of bytes free)", result.recommended_batch_size, trials,
            seconds, peaks=peaks,
        ),
    ]  # fmt: skip


def run_accelerate(case: Case, budget: int, start: int) -> Outcome:
    from accelerate.utils import find_executable_batch_size

    model, optimizer = case.fresh()
    trials: list[tuple[int, bool]] = []
    peaks: dict[int, int] = {}

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size: int) -> int:
        trials.append((batch_size, False))
        peaks[batch_size] = run_trial(case, model, optimizer, batch_size, budget)
        trials[-1] = (batch_size, True)
        return batch_size

    started = time.perf_counter()
    try:
        found: int | None = train()
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        if "reached zero" not in str(exc):
            raise
        found = None
    seconds = time.perf_counter() - started
    return Outcome(f"accelerate (start {start})", found, trials, seconds, peaks=peaks)


def _lightning_module(case: Case, budget: int) -> Any:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, IterableDataset

    class Batches(IterableDataset):  # type: ignore[type-arg]
        """Endless batches of one size; iterable, so Lightning does not cap the size by a
        dataset length."""

        def __init__(self, batch_size: int) -> None:
            self.batch_size = batch_size

        def __iter__(self) -> Iterator[Any]:
            while True:
                yield case.make_batch(self.batch_size)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = case.build_model()
            self.batch_size = 2  # the attribute the tuner scales
            self.steps: list[tuple[int, bool, int | None]] = []  # (delivered size, ok, peak)
            self._delivered = 0
            self._loss: torch.Tensor | None = None

        def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
            return DataLoader(Batches(self.batch_size), batch_size=None)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return case.build_optimizer(self.net.parameters())

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            first = batch[0] if isinstance(batch, (tuple, list)) else batch
            first = first["input_ids"] if isinstance(first, dict) else first
            self._delivered = int(first.shape[0])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self._loss = case.loss(self.net, batch)  # kept until the backward is over
            return self._loss

        def on_after_backward(self) -> None:
            self._loss = None

        def optimizer_step(  # type: ignore[override]
            self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
        ) -> None:
            raw = self.trainer.optimizers[0]
            try:
                with memkit.simulate(budget, track=(self.net, raw)) as acct:
                    optimizer.step(closure=optimizer_closure)
                    raw.zero_grad(set_to_none=True)
            except torch.OutOfMemoryError:
                self._loss = None
                raw.zero_grad(set_to_none=True)
                self.steps.append((self._delivered, False, None))
                raise
            self.steps.append((self._delivered, True, acct.peak))

    return Module()


def run_lightning(case: Case, budget: int, mode: str) -> Outcome:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    module = _lightning_module(case, budget)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root,
        )  # fmt: skip
        started = time.perf_counter()
        found = Tuner(trainer).scale_batch_size(module, mode=mode, steps_per_trial=STEPS)
        seconds = time.perf_counter() - started
    # A trial ends after STEPS steps that completed, or at the step that raised the OOM.
    trials: list[tuple[int, bool]] = []
    peaks: dict[int, int] = {}
    done = 0
    for size, ok, peak in module.steps:
        if done == 0:
            trials.append((size, ok))
        assert trials[-1][0] == size, f"the size changed inside a trial: {module.steps}"
        done += 1
        if not ok:
            trials[-1] = (size, False)
            done = 0
        else:
            assert peak is not None
            peaks[size] = max(peaks.get(size, 0), peak)
            done %= STEPS
    assert done == 0, f"a trial ran fewer than {STEPS} steps: {module.steps}"
    return Outcome(f"lightning {mode}", found, trials, seconds, peaks=peaks)


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


TOOLS: dict[str, Callable[[Case, int], list[Outcome]]] = {
    "memkit": run_memkit,
    "lightning power": lambda case, budget: [run_lightning(case, budget, "power")],
    "lightning binsearch": lambda case, budget: [run_lightning(case, budget, "binsearch")],
    "accelerate": lambda case, budget: [run_accelerate(case, budget, case.accelerate_start)],
    "accelerate default": (
        lambda case, budget: [run_accelerate(case, budget, ACCELERATE_DEFAULT_START)]
    ),
}


def check_oom_recognised() -> None:
    """The simulated OOM is an OOM to both peers (else they would re-raise, not retry)."""
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    layer = nn.Linear(256, 256)
    try:
        with memkit.simulate("64KiB", track=layer):
            layer(torch.randn(512, 256))
    except torch.OutOfMemoryError as exc:
        assert "CUDA out of memory." in str(exc), exc
        assert should_reduce_batch_size(exc), "Accelerate does not see the simulated OOM"
        assert is_oom_error(exc), "Lightning does not see the simulated OOM"
        return
    raise AssertionError("no simulated OOM")


def lightning_consistent(outcome: Outcome, meter: Meter, limit: int) -> str:
    """Lightning's own outcome and peak at every size it ran agree with the reference."""
    problems = []
    for size, ok in outcome.trials:
        if ok != (size <= limit):
            problems.append(f"{size}: Lightning {'fit' if ok else 'OOM'}, limit {limit}")
    for size, peak in outcome.peaks.items():
        if size in meter.peaks and abs(peak - meter.peak(size)) > PEAK_SLACK:
            problems.append(f"{size}: peak {peak} vs {meter.peak(size)}")
    return "; ".join(problems)


def compare(case: Case, repeat: int, tools: list[str]) -> tuple[list[list[object]], list[str]]:
    budget = parse_size(case.budget)
    runs: dict[str, list[list[Outcome]]] = {name: [] for name in tools}
    for round_ in range(repeat):  # alternate the order between rounds
        order = tools[round_ % len(tools) :] + tools[: round_ % len(tools)]
        for name in order:
            gc.collect()
            outcomes = TOOLS[name](case, budget)
            runs[name].append(outcomes)
            print(f"  {case.name}: {name}: found {outcomes[0].found} in "
                  f"{outcomes[0].seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    meter = Meter(case)
    for name in tools:  # memkit's and Accelerate's trials measure exactly what Meter does
        if name == "memkit" or name.startswith("accelerate"):
            meter.peaks.update(runs[name][0][0].peaks)
    memkit_max = runs["memkit"][0][0] if "memkit" in runs else None
    limit = None if memkit_max is None else memkit_max.found
    notes = []
    if limit is not None:
        # the true limit, verified independently of every tool
        assert meter.peak(limit) <= budget < meter.peak(limit + 1)
        assert not meter.oom_at(limit, budget) and meter.oom_at(limit + 1, budget)
        assert memkit_max is not None and memkit_max.peaks[limit] == meter.peak(limit)
        notes.append(
            f"{case.name}: budget {case.budget} = {budget} B; true limit {limit}, verified: "
            f"peak {meter.peak(limit)} B at {limit} runs, {meter.peak(limit + 1)} B at "
            f"{limit + 1} raises the OOM"
        )
    rows: list[list[object]] = []
    for name in tools:
        for i, outcome in enumerate(runs[name][0]):
            found = [r[i].found for r in runs[name]]
            assert len(set(found)) == 1, f"{outcome.tool}: answers differ between rounds {found}"
            seconds = statistics.median(r[i].seconds for r in runs[name])
            if outcome.found is None:
                ran = "-"
            elif outcome.found in outcome.ran_ok:
                ran = "yes"
            elif any(size > outcome.found for size in outcome.ran_ok):
                ran = "no, < a fit"  # not run, but below a size that ran and fit
            else:
                ran = "no"
            fits, unused, share = "-", None, None
            if outcome.found is not None:
                peak = meter.peak(outcome.found)
                fits = "yes" if peak <= budget else "NO"
                unused = budget - peak
                share = f"{100 * unused / budget:.2f}%"
            if outcome.tool.startswith("lightning") and limit is not None:
                problem = lightning_consistent(outcome, meter, limit)
                assert not problem, f"{outcome.tool} disagrees with the reference: {problem}"
            sizes = [f"{s}{'' if ok else 'x'}" for s, ok in outcome.trials]
            if not outcome.tool.startswith("memkit: recommended"):
                notes.append(f"  {outcome.tool}: {' '.join(sizes)}")
            human = None
            if unused is not None:
                human = format_size(unused) if unused >= 0 else "-" + format_size(-unused)
            rows.append([
                case.name if not rows else "", outcome.tool, outcome.found, ran, fits, limit,
                unused, human, share, len(outcome.trials), f"{seconds:.1f}",
            ])  # fmt: skip
    return rows, notes


HEADERS = ["model", "tool", "found", "run?", "fits?", "true limit", "unused bytes", "unused",
           "unused %", "trials", "wall s"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The search strategy alone: trials on pure oracles
# --------------------------------------------------------------------------------------------

MIB = 1 << 20
CURVES: dict[str, Callable[[int], float]] = {  # the curves of tests/test_search.py
    "linear": lambda b: 300 * MIB + 40_000 * b,
    "piecewise": lambda b: max(900 * MIB + 1_000 * b, 300 * MIB + 40_000 * b),
    "quadratic": lambda b: 300 * MIB + 40_000 * b + 3 * b * b,
}
LIMITS = (7, 100, 1000, 4097, 6000, 8191, 100_000)


def search_counts() -> str:
    rows: list[list[object]] = []
    for curve_name, curve in CURVES.items():
        for limit in LIMITS:

            def fits(b: int, curve: Callable[[int], float] = curve, limit: int = limit) -> Any:
                return b <= limit, int(curve(b))

            ours = search_max_batch(fits, capacity_bytes=int(curve(limit)))
            plain = doubling_bisection(fits)
            assert ours.max_batch_size == plain.max_batch_size == limit
            rows.append([curve_name, limit, len(ours.trials), len(plain.trials),
                         math.ceil(math.log2(limit)) + 3])  # fmt: skip
    return table(
        ["curve", "limit", "memkit", "doubling+bisection", "ceil(log2 B)+3"], rows,
        title="Trials to the exact limit (pure oracle: fits iff b <= limit, peaks on the curve)",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's info lines and warnings about this toy setup (no workers, no val loop)."""
    import lightning.pytorch  # noqa: F401  (sets its loggers' levels when imported)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="rounds, alternating tool order")
    parser.add_argument("--search-only", action="store_true")
    args = parser.parse_args()
    print(search_counts())
    if args.search_only:
        return
    tools = args.tools.split(",")
    if "memkit" not in tools:
        tools.insert(0, "memkit")  # the true limit comes from it
    started = time.perf_counter()
    with quiet():
        check_oom_recognised()
        rows: list[list[object]] = []
        notes: list[str] = []
        for name in args.models.split(","):
            case = CASES[name]()
            case_rows, case_notes = compare(case, args.repeat, tools)
            rows.extend(case_rows)
            notes.extend(case_notes)
    print()
    print(table(HEADERS, rows, title=f"memkit vs peers ({STEPS} steps per trial, simulated cpu)"))
    print()
    print("Sizes each tool ran, in order (x: raised the OOM):")
    print("\n".join(notes))
    print(f"\ntotal {time.perf_counter() - started:.0f} s, torch {torch.__version__}")


if __name__ == "__main__":
    main()
