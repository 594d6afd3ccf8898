"""What a probe searches for and how it runs its trials: one frozen, checked object.

The command line builds one from its flags, :func:`memkit.probe` from its keywords and
Lightning's ``probe_batch_size`` from its own; the runner, the ranks' agreement and the result
read it. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memkit.errors import ConfigError
from memkit.probing.search import check_bounds

__all__ = ["DEFAULT_MARGIN", "MAX_BATCH_CEILING", "ProbeOptions"]

DEFAULT_MARGIN = 0.05
"""Share of capacity the recommended batch leaves free (fragmentation, ragged batches)."""
MAX_BATCH_CEILING = 1 << 20
"""Largest batch ever tried when no ``max_batch`` is given."""


@dataclass(frozen=True)
class ProbeOptions:
    """A probe's search and trials.

    Attributes:
        mode: ``"train"`` (full steps) or ``"infer"`` (forward under ``inference_mode``).
        seq_len: passed to ``make_batch`` as its second argument.
        min_batch, max_batch: bounds of the search (``max_batch``: :data:`MAX_BATCH_CEILING`
            when ``None``).
        steps: full steps per trial (2: optimizer state appears on the first).
        margin: share of capacity, in bytes, the recommended size leaves free.
        target_batch: the effective batch wanted: ``accumulate`` advice, and the answer for the
            accumulating step it gives.
        accumulation: micro-batches per optimizer step in the script (``None`` or 1: none).
        ddp: wrap the model in ``DistributedDataParallel`` for the trials.
        timeout: seconds to wait for the other ranks at each agreement (``None``: the process
            group's).

    Raises:
        ConfigError: a value the probe cannot run with (exit code 2 on the command line).

    Examples:
        >>> ProbeOptions(max_batch=64).ceiling
        64
        >>> ProbeOptions(steps=0)
        Traceback (most recent call last):
        ...
        memkit.errors.ConfigError: steps must be at least 1, found 0
    """

    mode: str = "train"
    seq_len: int | None = None
    min_batch: int = 1
    max_batch: int | None = None
    steps: int = 2
    margin: float = DEFAULT_MARGIN
    target_batch: int | None = None
    accumulation: int | None = None
    ddp: bool = False
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("train", "infer"):
            raise ConfigError(f"mode must be 'train' or 'infer', found {self.mode!r}")
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, found {self.steps}")
        check_bounds(self.min_batch, self.max_batch, self.margin)
        if self.accumulation is not None and self.accumulation < 1:
            raise ConfigError(f"accumulation must be at least 1, found {self.accumulation}")
        if self.accumulation not in (None, 1) and self.mode != "train":
            raise ConfigError("gradient accumulation applies to --mode train only")

    @property
    def ceiling(self) -> int:
        """The largest batch the search may try."""
        return self.max_batch if self.max_batch is not None else MAX_BATCH_CEILING

    def for_length(self, seq_len: int | None) -> ProbeOptions:
        """The same options at another sequence length (one probe of a sweep)."""
        return dataclasses.replace(self, seq_len=seq_len)
