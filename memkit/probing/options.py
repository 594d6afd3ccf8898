"""What a batch-size search looks for (:class:`SearchOptions`, the same for ``memkit probe``
and ``memkit estimate``) and how a probe runs its trials (:class:`ProbeOptions`): frozen objects,
checked when built.

The command line builds them from its flags, :func:`memkit.probe` and :func:`memkit.estimate`
from their keywords, Lightning's ``probe_batch_size`` from its own; the runner, the estimate's
search, the ranks' agreement and the results read them. No torch.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

from memkit.errors import ConfigError
from memkit.probing.search import check_bounds

__all__ = ["DEFAULT_MARGIN", "MAX_BATCH_CEILING", "ProbeOptions", "SearchOptions"]

DEFAULT_MARGIN = 0.05
"""Share of capacity the recommended batch leaves free (fragmentation, ragged batches)."""
MAX_BATCH_CEILING = 1 << 20
"""Largest batch ever tried when no ``max_batch`` is given."""


@dataclass(frozen=True)
class SearchOptions:
    """What a batch-size search looks for.

    Attributes:
        mode: ``"train"`` (full steps) or ``"infer"`` (forward, or the model file's
            ``eval_step``, under ``no_grad``).
        seq_len: passed to ``make_batch`` as its second argument.
        min_batch, max_batch: bounds of the search (``max_batch``: :data:`MAX_BATCH_CEILING`
            when ``None``).
        margin: share of capacity, in bytes, the recommended size leaves free.

    Raises:
        ConfigError: a value no search can run with (exit code 2 on the command line).

    Examples:
        >>> SearchOptions(max_batch=64).ceiling
        64
        >>> SearchOptions(mode="eval")
        Traceback (most recent call last):
        ...
        memkit.errors.ConfigError: mode must be 'train' or 'infer', found 'eval'
        >>> SearchOptions(min_batch=2.5)
        Traceback (most recent call last):
        ...
        memkit.errors.ConfigError: min_batch must be a whole number, found 2.5 (float)
    """

    mode: str = "train"
    seq_len: int | None = None
    min_batch: int = 1
    max_batch: int | None = None
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        if self.mode not in ("train", "infer"):
            both = (
                "; for both, run one probe per mode (memkit probe --mode train,infer does, and "
                "puts the two results in a ProbeModes)"
                if isinstance(self.mode, str) and "," in self.mode
                else ""
            )
            raise ConfigError(f"mode must be 'train' or 'infer', found {self.mode!r}{both}")
        _whole("min_batch", self.min_batch)
        if self.max_batch is not None:
            _whole("max_batch", self.max_batch)
        if self.seq_len is not None:
            _whole(
                "seq_len", self.seq_len, "one length; for several, run one search per length, as "
                "the command line's --seq-len L1,L2 does",
            )  # fmt: skip
            if self.seq_len < 1:
                raise ConfigError(f"seq_len must be at least 1, found {self.seq_len}")
        check_bounds(self.min_batch, self.max_batch, self.margin)

    @property
    def ceiling(self) -> int:
        """The largest batch the search may try."""
        return self.max_batch if self.max_batch is not None else MAX_BATCH_CEILING

    def for_length(self, seq_len: int | None) -> Self:
        """The same options at another sequence length (one search of a sweep)."""
        return dataclasses.replace(self, seq_len=seq_len)


def _whole(name: str, value: object, expected: str = "") -> None:
    """The :class:`ConfigError` unless ``value`` is a whole number (``bool`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        more = f": {expected}" if expected else ""
        raise ConfigError(
            f"{name} must be a whole number, found {value!r} ({type(value).__name__}){more}"
        )


@dataclass(frozen=True)
class ProbeOptions(SearchOptions):
    """A probe's search (:class:`SearchOptions`) and how it runs its trials.

    Attributes:
        steps: full steps per trial (2: optimizer state appears on the first).
        target_batch: the effective batch wanted: ``accumulate`` advice, and the answer for the
            accumulating step it gives.
        accumulation: micro-batches per optimizer step in the script (``None`` or 1: none).
        ddp: wrap the model in ``DistributedDataParallel`` for the trials.
        keep_output: the default step keeps the model's output until the next forward
            (``out = model(x)``); ``False``: only the loss (``loss = model(x).loss``, as
            transformers' ``Trainer`` does), for a larger answer where the script drops it.
        timeout: seconds to wait for the other ranks at each agreement (``None``: the process
            group's).
        training_state: infer mode from a model file: the trials hold the optimizer state a
            training run keeps (an evaluation inside training: ``--mode train,infer``).
        prefetch: an accumulating script fetches all of an optimizer step's micro-batches
            onto the device before the first runs (transformers 5's ``Trainer``:
            ``get_batch_samples``, each moved to the device as accelerate yields it): the
            trials hold them so, and the last step's while the next step's are fetched;
            without accumulation, the next batch is made while the last is held (a loop
            ``batch = buffer.sample(n)`` making batches on the device: sweep CB's DQN).

    Raises:
        ConfigError: a value the probe cannot run with (exit code 2 on the command line).

    Examples:
        >>> ProbeOptions(steps=0)
        Traceback (most recent call last):
        ...
        memkit.errors.ConfigError: steps must be at least 1, found 0
    """

    steps: int = 2
    target_batch: int | None = None
    accumulation: int | None = None
    ddp: bool = False
    timeout: float | None = None
    keep_output: bool = True
    training_state: bool = False
    prefetch: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, found {self.steps}")
        if self.accumulation is not None and self.accumulation < 1:
            raise ConfigError(f"accumulation must be at least 1, found {self.accumulation}")
        if self.accumulation not in (None, 1) and self.mode != "train":
            raise ConfigError("gradient accumulation applies to --mode train only")
        if self.prefetch and self.mode != "train":
            raise ConfigError("--prefetch (prefetch=True) applies to --mode train only")
        if self.prefetch and self.accumulation is None and self.target_batch is not None:
            # (not with --target-batch alone: the K micro-batches held are the advice's own
            # choice, and the advice's K changes with the answer: review)
            raise ConfigError(
                "--prefetch (prefetch=True) with --target-batch holds the K micro-batches of an "
                "accumulating optimizer step; give the script's accumulation with --accumulate "
                "K (accumulation=K), the Trainer's gradient_accumulation_steps, or --accumulate "
                "1 for a script that makes each batch before letting the last go"
            )
