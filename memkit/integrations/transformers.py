"""memkit in the transformers ``Trainer``: a ``TrainerCallback`` that tracks ``train()``.

The tracker runs from ``on_train_begin`` to ``on_train_end`` on the Trainer's model and
optimizer (accelerate's wrapper unwrapped), per phase, step and module; ``on_log`` adds each
logging window's peaks to the Trainer's logs, and the report (text, JSON, HTML) is on
``callback.report`` when training ends. Needs ``pip install memkit[transformers]``; see
docs/integrations.md.

Example::

    from memkit.integrations.transformers import MemkitCallback

    cb = MemkitCallback(html="memory.html")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    with cb:  # optional: an OOM inside train() gets its post-mortem, tracking stops
        trainer.train()
    print(cb.report)
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from memkit.advice.transformers import in_transformers_terms
from memkit.integrations._common import (
    MIB,
    TrackingCallback,
    missing,
    step_metrics,
    unwrap_optimizer,
)

try:
    import transformers
except ImportError as exc:
    raise missing(
        "transformers", "memkit.integrations.transformers", "transformers>=4.40", exc
    ) from exc


from memkit.devices import SimulatedBackend
from memkit.errors import warn_user
from memkit.tracking.evidence import checkpointing_flag
from memkit.tracking.tracker import Tracker

if TYPE_CHECKING:
    from memkit.advice.form import Advice

__all__ = ["MemkitCallback"]

log = logging.getLogger(__name__)


class MemkitCallback(TrackingCallback, transformers.TrainerCallback):
    """Track memory through ``Trainer.train()``.

    Hooks: ``on_train_begin`` starts a :class:`~memkit.tracking.tracker.Tracker` (which
    classifies forward, backward, optimizer, other and evaluation passes itself, as
    :func:`memkit.track` does); ``on_step_begin``/``on_substep_end``/``on_step_end`` count the
    Trainer's micro-batches and close each optimizer step's record; ``on_log`` adds the peaks
    since the last log to the logs (``memkit/peak_mib``, ``memkit/forward_peak_mib``,
    ``memkit/backward_peak_mib``, ``memkit/optimizer_peak_mib``; an evaluation's log gets
    ``memkit/eval_peak_mib``, which ``on_evaluate`` also adds to the metrics ``evaluate()``
    returns); ``on_train_end`` ends tracking and writes the report.

    The transformers Trainer has no hook for an exception: use the callback as a context
    manager around ``trainer.train()`` to get the OOM post-mortem and to stop tracking when
    ``train()`` raises (else tracking stops at the next ``on_train_begin``).

    Args:
        device: the device to track; ``None``: the Trainer's (``args.device``; ``cpu`` means
            memkit's simulated device).
        budget: the simulated device's size (``"512MiB"``), or a cap on a real GPU.
        per_module: hooks on every submodule (default), or on the model only.
        module_every: module hooks on steps 0, 1 and every ``module_every``-th step (default:
            100 on a GPU, every step on the simulated device); ``1``: every step.
        log_peaks: add memkit's peaks to the Trainer's logs.
        text, json, html: files the report is written to at the end; under a distributed
            run each rank writes ``NAME.rankN.EXT``.
        postmortem: ``"stderr"`` prints the OOM post-mortem there; ``None`` only logs it.
        timeline_limit: counter readings kept.

    Raises:
        ConfigError: a bad option, or a report file that cannot be written (checked now).
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._logged_step = 0  # the first tracker step not yet in a log
        self._micro = 0
        self._micro_mismatch: tuple[int, int, int] | None = None
        self._entered = False
        # the same instance passed twice (callbacks=[cb, cb]) gets each event twice in a row:
        # the train() whose TrainerState started tracking, and how many times it is registered
        self._train_state: Any = None
        self._copies = 1
        self._ended_step = -1  # the global step whose on_step_end was handled

    # -- as a context manager: the exception train() raised ------------------------------
    def __enter__(self) -> MemkitCallback:
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered = False
        self._finish(exc)

    def close(self, exc: BaseException | None = None) -> None:
        """End tracking now (after a ``train()`` that raised, outside ``with callback:``).

        The exception that ended training gets its post-mortem on :attr:`report`: ``exc``, or,
        called in an ``except`` block, the exception being handled there."""
        self._finish(exc if exc is not None else sys.exc_info()[1])

    # -- starting and ending --------------------------------------------------------------
    def _finish(self, exc: BaseException | None) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        try:
            self._end_tracking(exc)
        finally:
            if self._micro_mismatch is not None:
                step, hf, seen = self._micro_mismatch
                tracker.notes.append(
                    f"at step {step} the Trainer ran {hf} micro-batch(es) but memkit saw {seen} "
                    "training backward pass(es): a backward memkit did not see is not in the "
                    "phases"
                )
            self._report = self._final_report(tracker)
            self.written = self.files.write(self._report)
            self._train_state = None

    def _in_terms(self, advice: Iterable[Advice]) -> tuple[Advice, ...]:
        return in_transformers_terms(advice)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if self._tracker is not None and state is self._train_state:
            self._copies += 1  # the same train() again: this instance is registered twice
            return
        if self._tracker is not None:
            # the last train() ended without on_train_end (it raised, or auto_find_batch_size
            # is retrying at a smaller batch): that tracking ends here, without a post-mortem
            log.info("memkit: a train() ended without on_train_end; its tracking ends now")
            self._finish(None)
        device = self.device if self.device is not None else getattr(args, "device", None)
        raw = unwrap_optimizer(optimizer)
        tracker = self._new_tracker(
            model,
            raw,
            device,
            accumulation_steps=getattr(args, "gradient_accumulation_steps", None),
            checkpointing=_checkpointing(args, model),
        )
        if isinstance(tracker.backend, SimulatedBackend) and not self._entered:
            warn_user(
                "memkit: MemkitCallback tracks on the simulated device, which counts every "
                "tensor op of this thread until tracking ends; the Trainer tells callbacks "
                "nothing when train() raises, so after an exception (an OOM) the simulated "
                "device would stay on. Use `with callback: trainer.train()`, or call "
                "callback.close() after a train() that raised.",
                RuntimeWarning,
            )
        self._tracker, self._report = tracker, None
        self._logged_step, self._micro, self._micro_mismatch = 0, 0, None
        self._train_state, self._copies, self._ended_step = state, 1, -1

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish(None)

    # -- steps ----------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._micro = 0

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._micro += 1  # a micro-batch of gradient accumulation, not the step's last

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tracker = self._tracker
        step = getattr(state, "global_step", None)
        if tracker is None or step == self._ended_step:  # a second registration's call
            return
        self._ended_step = -1 if step is None else step
        micro, self._micro = self._micro // self._copies + 1, 0
        records = tracker.steps_since(tracker.current_step - 1)
        if records and self._micro_mismatch is None and records[-1].backward_passes != micro:
            self._micro_mismatch = (records[-1].step, micro, records[-1].backward_passes)

    # -- logs -----------------------------------------------------------------------------
    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        tracker = self._tracker
        if tracker is None or logs is None or not self.log_peaks:
            return
        before = dict(logs)
        if any(k.startswith("eval_") for k in logs):
            added = self._eval_metrics(tracker)
        else:
            records = tracker.steps_since(self._logged_step)
            if records:
                self._logged_step = records[-1].step + 1
            added = step_metrics(records)
        if not added:
            return
        logs.update(added)
        # the Trainer stored a copy of these logs in its history before calling us
        history = getattr(state, "log_history", None)
        if history and all(_same(history[-1].get(k), v) for k, v in before.items()):
            history[-1].update(added)

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        tracker = self._tracker
        if tracker is not None and metrics is not None and self.log_peaks:
            metrics.update(self._eval_metrics(tracker))

    @staticmethod
    def _eval_metrics(tracker: Tracker) -> dict[str, float]:
        """The evaluation that just ran: the eval peak since the last step boundary."""
        peak = tracker.open_step_peaks().get("eval")
        return {} if peak is None else {"memkit/eval_peak_mib": peak / MIB}


def _checkpointing(args: Any, model: Any) -> bool | None:
    """Whether the Trainer's model checkpoints activations: the model's own flag (the Trainer
    sets it from ``args`` before ``on_train_begin``; a script may have set it itself), else
    the arguments' (``activation_checkpointing``, before transformers 5 ``gradient_checkpointing``);
    ``None``: neither says."""
    flag = checkpointing_flag(model)
    if flag is not None:
        return flag
    with warnings.catch_warnings():  # gradient_checkpointing: a deprecated alias in 5.x
        warnings.simplefilter("ignore", FutureWarning)
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            value = getattr(args, name, None)
            if value is not None:
                return bool(value)
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal, or both NaN (a NaN loss is the same logged value)."""
    return bool(a == b) or (a != a and b != b)
