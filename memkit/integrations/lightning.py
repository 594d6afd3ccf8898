"""memkit in Lightning 2.x: a callback that tracks a fit, and the exact batch size for a module.

``MemkitCallback`` runs a :class:`~memkit.tracking.tracker.Tracker` on the LightningModule from
``on_fit_start`` to ``teardown``: per phase, step and module, with the OOM post-mortem from
``on_exception`` and the report (text, JSON, HTML) at the end, on ``callback.report``.
``probe_batch_size`` runs memkit's probe on the module's own ``training_step`` and
``configure_optimizers``. Needs ``pip install memkit[lightning]``; see docs/integrations.md.

Example::

    from memkit.integrations.lightning import MemkitCallback

    cb = MemkitCallback(device="cpu", budget="512MiB", html="memory.html")
    lightning.pytorch.Trainer(callbacks=[cb], max_steps=10).fit(module)
    print(cb.report)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memkit.advice.lightning import in_lightning_terms
from memkit.integrations._common import (
    MIB,
    TrackingCallback,
    missing,
    step_metrics,
)

try:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:
    raise missing("lightning", "memkit.integrations.lightning", "Lightning 2.x", exc) from exc

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memkit.devices import get_backend
from memkit.errors import ConfigError
from memkit.probing.runner import DEFAULT_MARGIN, ProbeOptions, probe_with
from memkit.probing.step import DeferredOptimizer

if TYPE_CHECKING:
    from memkit.advice.form import Advice
    from memkit.probing.result import ProbeResult

__all__ = ["MemkitCallback", "probe_batch_size"]

log = logging.getLogger(__name__)


class MemkitCallback(TrackingCallback, pl.Callback):
    """Track memory through ``Trainer.fit`` (also ``validate``/``test``/``predict``).

    The tracker runs for the whole stage on the LightningModule and its optimizers and
    classifies phases itself (forward, backward, optimizer, other, eval), exactly as
    :func:`memkit.track` does around a plain loop: Lightning's ``optimizer.step(closure)``
    runs the forward and backward inside the optimizer's step, and the optimizer phase starts
    when that closure returns (after ``on_before_optimizer_step`` and gradient clipping).
    Validation, test and predict loops are evaluation passes from their epoch start to end.

    Args:
        device: the device to track; ``None``: the module's device at the start of the stage
            (``cpu`` means memkit's simulated device).
        budget: the simulated device's size (``"512MiB"``), or a cap on a real GPU.
        per_module: hooks on every submodule (default), or on the module only.
        module_every: module hooks on steps 0, 1 and every ``module_every``-th step (default:
            100 on a GPU, every step on the simulated device); ``1``: every step.
        log_peaks: log each step's peaks (MiB) through ``pl_module.log``: ``memkit/peak_mib``,
            ``memkit/forward_peak_mib``, ``memkit/backward_peak_mib``,
            ``memkit/optimizer_peak_mib``; and each validation's ``memkit/eval_peak_mib``.
        text, json, html: files the report is written to when the stage ends (after an OOM
            too); under DDP each rank writes ``NAME.rankN.EXT``.
        postmortem: ``"stderr"`` prints the OOM post-mortem there; ``None`` only logs it.
        timeline_limit: counter readings kept.

    Raises:
        ConfigError: a bad option, or a report file that cannot be written (checked now).
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._next_step = 0
        self._manual = False  # the module's manual optimization: advice in its terms

    # -- starting and ending --------------------------------------------------------------
    def _start(self, trainer: Any, pl_module: Any) -> None:
        if self._tracker is not None:
            return
        device = self.device if self.device is not None else pl_module.device
        # only fit steps optimizers: a test(), validate() or predict() after fit() sets up
        # none, and on a GPU Lightning's teardown moved the fit's optimizer state to the CPU
        # (on the simulated device, tracking them would count that state as device memory)
        fitting = getattr(trainer.state, "fn", None) == TrainerFn.FITTING
        optimizers = list(getattr(trainer, "optimizers", None) or ()) if fitting else []
        tracker = self._new_tracker(
            pl_module,
            optimizers or None,
            device,
            accumulation_steps=trainer.accumulate_grad_batches if fitting else None,
        )
        self._tracker, self._report, self._next_step = tracker, None, 0
        self._manual = not pl_module.automatic_optimization

    def _finish(self, exc: BaseException | None) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        try:
            self._end_tracking(exc)
        finally:
            self._report = self._final_report(tracker)
            self.written = self.files.write(self._report)

    def _in_terms(self, advice: Iterable[Advice]) -> tuple[Advice, ...]:
        return in_lightning_terms(advice, manual_optimization=self._manual)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module)  # trainer.validate(): nothing started it

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls no teardown hook after an exception: the post-mortem and the report
        # are made here, and the exception goes on
        self._finish(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(None)

    # -- steps ----------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is not None:
            self._tracker.batch_on_device(batch)  # (Lightning moved it there just now)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        records = tracker.steps_since(self._next_step)
        if not records:  # gradient accumulation: the step has not ended yet
            return
        self._next_step = records[-1].step + 1
        if self.log_peaks:
            pl_module.log_dict(
                step_metrics(records[-1:]), on_step=True, on_epoch=False, batch_size=1
            )

    # -- evaluation loops -----------------------------------------------------------------
    def _begin_eval(self) -> None:
        if self._tracker is not None:
            self._tracker.begin_eval()

    def _end_eval(self, pl_module: Any, log_it: bool) -> None:
        if self._tracker is None:
            return
        peak = self._tracker.end_eval()
        if peak is not None and log_it and self.log_peaks:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            pl_module.log(
                "memkit/eval_peak_mib",
                peak / MIB,
                on_step=False,
                on_epoch=True,
                batch_size=1,
                reduce_fx="max",
                sync_dist=distributed,  # one all-reduce per validation: the largest rank's
            )

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin_eval()

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_eval(pl_module, log_it=True)

    def on_test_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin_eval()

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_eval(pl_module, log_it=True)

    def on_predict_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin_eval()

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_eval(pl_module, log_it=False)  # Lightning logs nothing while predicting


# -- the exact batch size -------------------------------------------------------------------


# Long for its signature and its docstring (what a trial runs, in Lightning's order); the body
# builds the step and batches and calls memkit.probe.
def probe_batch_size(
    module: Any,
    datamodule: Any = None,
    *,
    make_batch: Callable[[int], Any] | None = None,
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    min_batch: int = 1,
    max_batch: int | None = None,
    steps: int = 2,
    margin: float | None = None,
    target_batch: int | None = None,
    accumulate_grad_batches: int = 1,
    precision: str | int | None = None,
    on_trial: Callable[[Any], None] | None = None,
) -> ProbeResult:
    """The exact largest batch size a LightningModule's ``training_step`` trains at.

    Every trial runs ``steps`` steps the way Lightning's automatic optimization runs one:
    ``training_step(batch, i)``, the loss divided by ``accumulate_grad_batches``,
    ``optimizer_zero_grad``, backward, ``optimizer.step()``, on the first optimizer
    ``configure_optimizers`` returns (a fresh one: Lightning makes its own in ``fit``). With
    ``accumulate_grad_batches=k >= 2`` a step is micro-batches as in ``fit``: only the first
    calls ``optimizer_zero_grad`` (after its ``training_step``), only the last steps, so the
    later ones run their forward and backward with the gradients accumulated so far; they all
    hold the same memory, so two run per step (as :func:`memkit.probe` with
    ``accumulation``). As in :func:`memkit.probe`, the size reported ran and fit and the
    next one ran and did not, and the module (weights, ``training`` flags, RNG) is left as it
    was.

    Batches: ``make_batch(n)`` if given; else ``n`` samples of the training dataloader's
    dataset (``datamodule.train_dataloader()``, else ``module.train_dataloader()``) put together
    by that dataloader's ``collate_fn``, so the batch is the one ``fit`` would see at that size.
    ``prepare_data()`` and ``setup("fit")`` of the datamodule and the module are called first,
    as ``fit`` calls them.

    Args:
        module: the ``LightningModule``.
        datamodule: a ``LightningDataModule`` providing ``train_dataloader()``.
        make_batch: ``make_batch(batch_size)`` -> a batch, instead of the dataloader's.
        device: the device to probe (default: the current accelerator, else the simulated
            cpu device); the module is moved there for the probe and moved back after.
        budget, min_batch, max_batch, steps, margin, target_batch, on_trial: as in
            :func:`memkit.probe`.
        accumulate_grad_batches: the Trainer's setting: the loss is divided by it and the
            step accumulates gradients over micro-batches, as in ``fit`` (it fits less).
        precision: the Trainer's ``precision``: ``"bf16-mixed"`` and ``"16-mixed"`` run
            ``training_step`` under ``torch.autocast`` as Lightning's mixed-precision plugin
            does (sweep BX: a bf16-mixed fit trained at 63 where the fp32 probe said 45);
            ``None``, ``"32-true"`` or 32: as the module computes.

    Returns:
        A :class:`~memkit.probing.result.ProbeResult`; set ``module.batch_size`` (or your
        datamodule's) to its ``max_batch_size`` or ``recommended_batch_size``.

    Raises:
        ConfigError: manual optimization, no optimizer, or no way to build a batch.
        UserCodeError: ``training_step`` raised something that is not an OOM.
    """
    if not isinstance(module, pl.LightningModule):
        raise ConfigError(
            f"probe_batch_size expected a lightning.pytorch.LightningModule, found "
            f"{type(module).__name__}; for a plain nn.Module use memkit.probe"
        )
    if not module.automatic_optimization:
        raise ConfigError(
            "probe_batch_size runs Lightning's automatic optimization; this module sets "
            "automatic_optimization = False (its training_step calls the optimizers itself, "
            "which needs a Trainer). Probe the step with memkit.probe(model, make_batch, "
            "train_step=...) instead"
        )
    if accumulate_grad_batches < 1:
        raise ConfigError(
            f"accumulate_grad_batches must be at least 1, found {accumulate_grad_batches}"
        )
    autocast = _MIXED.get(str(precision)) if precision is not None else None
    if precision is not None and autocast is None and str(precision) not in ("32-true", "32"):
        raise ConfigError(
            f"precision={precision!r}: probe_batch_size runs Lightning's mixed precision "
            '("bf16-mixed", "16-mixed") or full precision ("32-true"); for a true '
            "half-precision model convert it (module.to(torch.bfloat16)) before probing"
        )
    _prepare(module, datamodule)
    if make_batch is None:
        make_batch = _dataloader_batches(module, datamodule)
    optimizer = _first_optimizer(module)
    step = _LightningStep(module, accumulate_grad_batches, autocast)

    backend_device = get_backend(device, budget).device
    original = _module_device(module)
    moved = original is not None and original != backend_device
    if moved:
        module.to(backend_device)
        optimizer = _first_optimizer(module)  # its parameters are the moved ones
    try:
        options = ProbeOptions(
            min_batch=min_batch,
            max_batch=max_batch,
            steps=steps,
            margin=DEFAULT_MARGIN if margin is None else margin,
            target_batch=target_batch,
            accumulation=accumulate_grad_batches,
        )
        result = probe_with(
            module,
            make_batch,
            options,
            optimizer=optimizer,
            train_step=step,
            device=device,
            budget=budget,
            on_trial=on_trial,
            defaults=[
                f"optimizer: {type(optimizer).__name__} (configure_optimizers)",
                f"precision: {precision or '32-true'}"
                + (
                    f" (training_step under torch.autocast, {autocast})"
                    if autocast
                    else " (as the module computes; give the Trainer's precision= if it is mixed)"
                ),
            ],
            step_label=(
                "step: Lightning's automatic optimization (training_step, "
                + (f"loss / {accumulate_grad_batches}, " if accumulate_grad_batches > 1 else "")
                + "optimizer_zero_grad, backward, optimizer.step"
                + (
                    "; accumulating: optimizer_zero_grad in the first micro-batch only, "
                    "optimizer.step in the last)"
                    if accumulate_grad_batches > 1
                    else ")"
                )
            ),
        )
        manual = not getattr(module, "automatic_optimization", True)
        return dataclasses.replace(
            result, advice=in_lightning_terms(result.advice, manual_optimization=manual)
        )
    finally:
        if moved and original is not None:
            module.to(original)


class _LightningStep:
    """One automatic-optimization micro-batch, outside a Trainer. Accumulating, the probe
    passes a :class:`DeferredOptimizer` that steps on the last of the two micro-batches it
    runs per optimizer step; the other is the first, the one that zeroes the gradients."""

    def __init__(self, module: Any, accumulate: int, autocast: str | None = None) -> None:
        self.module = module
        self.accumulate = accumulate
        self.autocast = autocast  # (a mixed precision's dtype name, or None)
        self.index = itertools.count()

    def __call__(self, model: Any, batch: Any, optimizer: Any) -> None:
        module = self.module
        i = next(self.index)
        with warnings.catch_warnings():  # self.log() without a Trainer warns and does nothing
            warnings.filterwarnings("ignore", message=r".*self\.log.*")
            batch = module.on_after_batch_transfer(batch, 0)
            with _autocast(module, self.autocast):
                output = module.training_step(batch, i)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                "training_step returned "
                + ("a dict without 'loss'" if isinstance(output, Mapping) else
                   type(output).__name__)
                + "; probe_batch_size needs the loss tensor (or a dict with 'loss'), as "
                "automatic optimization does"
            )  # fmt: skip
        loss = loss / self.accumulate  # Lightning backpropagates this copy
        del output
        if not isinstance(optimizer, DeferredOptimizer):
            module.optimizer_zero_grad(0, i, optimizer)
        elif not optimizer.active:  # the first micro-batch: the others keep its gradients
            module.optimizer_zero_grad(0, i, optimizer.wrapped)
        loss.backward()
        del loss
        optimizer.step()


_MIXED = {"bf16-mixed": "bfloat16", "16-mixed": "float16", "16": "float16", "bf16": "bfloat16"}
"""Lightning's mixed precisions: the autocast dtype its plugin runs ``training_step`` under."""


def _autocast(module: Any, dtype: str | None) -> Any:
    """Lightning's mixed-precision plugin around ``training_step``: ``torch.autocast`` on the
    module's device type with ``dtype`` (a no-op for ``None``)."""
    if dtype is None:
        return contextlib.nullcontext()
    kind = _module_device(module)
    return torch.autocast(kind.type if kind is not None else "cpu", dtype=getattr(torch, dtype))


def _prepare(module: Any, datamodule: Any) -> None:
    for obj in (datamodule, module):
        if obj is None:
            continue
        obj.prepare_data()
        obj.setup("fit")


def _first_optimizer(module: Any) -> torch.optim.Optimizer:
    """The first optimizer of ``configure_optimizers()`` (its forms: an optimizer, a list, a
    tuple of lists, a dict with ``"optimizer"``, a list of such dicts)."""
    found = _find_optimizer(module.configure_optimizers())
    if found is None:
        raise ConfigError(
            "configure_optimizers() returned no torch.optim.Optimizer; probe_batch_size steps "
            "the optimizer it returns (an optimizer, a list, ([optimizers], [schedulers]) or "
            "a dict with 'optimizer')"
        )
    return found


def _find_optimizer(value: Any) -> torch.optim.Optimizer | None:
    if isinstance(value, torch.optim.Optimizer):
        return value
    if isinstance(value, Mapping):
        return _find_optimizer(value.get("optimizer"))
    if isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            found = _find_optimizer(item)
            if found is not None:
                return found
    return None


def _module_device(module: Any) -> torch.device | None:
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return None


def _dataloader_batches(module: Any, datamodule: Any) -> Callable[[int], Any]:
    """``make_batch(n)``: ``n`` samples of the training dataloader's dataset, collated by it."""
    source = datamodule if datamodule is not None else module
    try:
        loader = source.train_dataloader()
    except Exception as exc:
        raise ConfigError(
            f"{type(source).__name__}.train_dataloader() raised {type(exc).__name__}: {exc}; "
            "define it, or pass make_batch=lambda n: ... to probe_batch_size"
        ) from exc
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if dataset is None or collate is None or getattr(loader, "batch_size", 1) is None:
        raise ConfigError(
            f"{type(source).__name__}.train_dataloader() returned {type(loader).__name__}, "
            "not a DataLoader that batches samples of a dataset; pass make_batch=lambda n: ... "
            "to probe_batch_size"
        )
    sized = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    if sized and len(dataset) == 0:
        raise ConfigError("the training dataset is empty; probe_batch_size needs samples")

    def make_batch(n: int) -> Any:
        # host work, as in a DataLoader: on the simulated device, indexing the dataset must
        # not make its whole storage device memory (the batch counts once an op reads it)
        with _disable_current_modes():
            if sized:
                samples = [dataset[i % len(dataset)] for i in range(n)]
            else:  # an IterableDataset: its first n samples, again from the start if it ends
                samples = list(itertools.islice(itertools.cycle(iter(dataset)), n))
            batch = collate(samples)
            return module.on_before_batch_transfer(batch, 0)

    return make_batch
