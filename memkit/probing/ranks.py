"""Probing across ranks: every rank runs the same size; it fits only if it fits on every rank.

Under an initialised ``torch.distributed`` process group, :func:`memkit.probe` runs the same
deterministic search on every rank over an *agreed* oracle: after each trial the ranks exchange
their outcome (one all-reduce, :func:`memkit.distributed.all_gather_ints`) and every rank sees
the same ``(fits, peak)``, so every rank walks the same sizes and ends with the same answer.

With different capacities per rank (``--budget 1GiB,512MiB``), the search aims at the tightest
rank: the capacity it is given is the smallest one, and a trial's peak is, over the ranks, the
largest ``peak_r + (capacity_min - capacity_r)``: each rank's peak shifted by the capacity it
has beyond the smallest. A size fits on every rank exactly when that value is within the
smallest capacity, and a line fitted to it still has the per-sample slope of the tightest rank.
With equal capacities it is simply the largest peak over the ranks. Each rank's own peak is
kept (``ProbeTrial.rank_peaks``).

DDP (``ddp=True`` or a ``DistributedDataParallel`` model): a rank that runs out of memory in
backward would leave the others inside DDP's bucket all-reduce, waiting for a rank that never
comes. So no collective of DDP's own runs during a trial: the forward and backward run under
``model.no_sync()`` (and without DDP's pre-forward buffer broadcast), and memkit's
:class:`RankSync` places *checkpoints* where every rank reports "ok" or "failed":

* in an optimizer step pre-hook (after backward): one all-reduce of ``[status, used flags]``;
  if every rank is ok, memkit all-reduces (and averages) the gradients itself, in place, and the
  optimizer steps;
* after each step: one all-reduce of ``[status]``.

A rank that fails (OOM, or any other error) reports it at the next checkpoint, which is exactly
the one the other ranks are waiting at; they then stop the trial too (an internal
:class:`PeerFailed`), and all ranks recover. What DDP costs in memory is measured: its gradient
buckets (``bucket_cap_mb`` each, allocated when the model is wrapped and alive through every
trial) and an all-reduce of every gradient per step; what is not reproduced is the overlap of
communication with backward, and ``gradient_as_bucket_view=True`` (there gradients live in the
buckets; here they are separate tensors, so the probe errs on the safe side by one gradient
copy). See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memkit import distributed
from memkit.distributed import RankStatus
from memkit.errors import ConfigError
from memkit.oom import is_oom
from memkit.optimizers import unwrap_optimizer
from memkit.probing.hooks import ProbeHook

__all__ = [
    "PeerFailed",
    "RankSync",
    "agree_settings",
    "agreed_outcome",
    "wrap_ddp",
]

log = logging.getLogger(__name__)


class PeerFailed(Exception):
    """Raised inside a rank's step when a checkpoint shows that another rank failed."""


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Wrap ``model`` in DDP for ``device`` (``device_ids=[index]`` on an accelerator).

    Raises:
        ConfigError: no process group is initialised.
    """
    if not distributed.is_distributed():
        raise ConfigError(
            "ddp=True (--ddp) needs an initialised process group; launch with torchrun "
            "(torchrun --nproc-per-node N --no-python memkit probe model.py --ddp) or call "
            "torch.distributed.init_process_group first"
        )
    ids = None if device.type in ("cpu", "meta") else [device.index or 0]
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def agree_settings(**settings: int | None) -> None:
    """Check that every rank probes with the same settings (the searches must match).

    Raises:
        ConfigError: a setting differs between ranks.
    """
    values = [-1 if v is None else int(v) for v in settings.values()]
    both = distributed.all_max([*values, *(-v for v in values)])
    n = len(values)
    for i, name in enumerate(settings):
        high, low = both[i], -both[n + i]
        if high != low:
            raise ConfigError(
                f"rank {distributed.rank()}: {name} differs between ranks ({low} to {high}); "
                "every rank must probe with the same options"
            )


@dataclass(frozen=True)
class AgreedOutcome:
    """The outcome of one trial that every rank computes from the same exchanged values."""

    fits: bool
    peak_bytes: int | None
    peak_allocated_bytes: int | None
    rank_peaks: tuple[int | None, ...]
    failed_ranks: tuple[int, ...]
    status: int
    """Attributes: ``failed_ranks`` ran out (or over capacity) themselves; ranks that only
    stopped because another failed are not in it. ``status`` is the worst status."""


def agreed_outcome(
    rows: Sequence[Sequence[int | None]], capacities: Sequence[int | None]
) -> AgreedOutcome:
    """Combine every rank's ``[status, fits, peak, peak_allocated, need]`` into one outcome.

    Pure (no collective): every rank runs it on the same exchanged rows and gets the same
    answer. A size fits only if it fits on every rank; the peak is the largest over the ranks
    of ``value_r + (min capacity - capacity_r)`` (see the module docstring), where ``value_r``
    is the rank's peak, or for a failed rank the bytes known to be needed.

    Examples:
        >>> # both ranks have 10 bytes left: on the smallest (80-byte) scale the peak is 70
        >>> o = agreed_outcome([[0, 1, 90, 90, None], [0, 1, 70, 70, None]], [100, 80])
        >>> o.fits, o.peak_bytes, o.rank_peaks
        (True, 70, (90, 70))
        >>> agreed_outcome([[0, 1, 50, 50, None], [2, 0, None, None, 95]], [100, 80]).fits
        False
    """
    known = all(c is not None for c in capacities)
    cmin = min(c for c in capacities if c is not None) if known else None
    fits = all(r[0] == RankStatus.OK and r[1] == 1 for r in rows)
    values: list[int | None] = []
    for r in rows:
        values.append(r[2] if r[0] == RankStatus.OK else r[4] if r[0] == RankStatus.OOM else None)
    shifted: list[int] = []
    for r, v, cap in zip(rows, values, capacities, strict=True):
        if v is None or (not fits and r[0] == RankStatus.OK and r[1] == 1):
            continue  # a failure's peak comes from the ranks that failed
        shifted.append(v + (cmin - cap) if cmin is not None and cap is not None else v)
    allocs = [r[3] for r in rows if r[3] is not None and r[0] == RankStatus.OK]
    return AgreedOutcome(
        fits=fits,
        peak_bytes=max(shifted) if shifted else None,
        peak_allocated_bytes=max(allocs) if allocs else None,
        rank_peaks=tuple(values),
        failed_ranks=tuple(
            i
            for i, r in enumerate(rows)
            if r[0] != RankStatus.ABORTED and not (r[0] == RankStatus.OK and r[1] == 1)
        ),
        status=max(int(r[0] or 0) for r in rows),
    )


class RankSync:
    """The checkpoints of a DDP trial (see the module docstring).

    Every rank makes the same sequence of checkpoint all-reduces; a rank that failed makes
    exactly one more (:meth:`fail`), which pairs with the one the other ranks are waiting at.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, timeout: float | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.timeout = timeout
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.announced = False
        self.checkpoints = 0

    def _checkpoint(self, status: int, used: Sequence[int] = ()) -> list[int]:
        vector = [status, *used] + [0] * (len(self.params) - len(used))
        agreed = distributed.all_max(vector, timeout=self.timeout)
        self.checkpoints += 1
        if agreed[0] != RankStatus.OK:
            self.announced = True
        return agreed

    def fail(self, status: int) -> None:
        """Report this rank's failure at the checkpoint the other ranks are waiting at."""
        if not self.announced:
            self._checkpoint(status)

    def end_step(self) -> None:
        """The checkpoint after each step.

        Raises:
            PeerFailed: another rank failed.
        """
        if self._checkpoint(RankStatus.OK)[0] != RankStatus.OK:
            raise PeerFailed("another rank failed in this step")

    def _before_step(self, *_args: Any) -> None:
        used: list[int] = []
        failed: BaseException | None = None
        try:
            used = distributed.fill_missing_grads(self.params)
        except Exception as exc:  # reported at this very checkpoint, re-raised below
            failed = exc

        status = (
            RankStatus.OK
            if failed is None
            else RankStatus.OOM
            if is_oom(failed)
            else RankStatus.ERROR
        )
        agreed = self._checkpoint(status, used)
        if failed is not None:
            raise failed
        if agreed[0] != RankStatus.OK:
            raise PeerFailed("another rank failed before the optimizer step")
        distributed.reduce_used_grads(self.params, agreed[1:], timeout=self.timeout, average=True)

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        """DDP without its own collectives, and the pre-step checkpoint, for one trial."""
        self.announced = False
        forward_sync = getattr(self.model, "require_forward_param_sync", None)
        handle = None
        hook = ProbeHook(self._before_step)  # copied inert (memkit.probing.hooks)
        stepping = unwrap_optimizer(self.optimizer)
        if stepping is not None:
            handle = stepping.register_step_pre_hook(hook)
        no_sync: Any = getattr(self.model, "no_sync", contextlib.nullcontext)
        try:
            if forward_sync is not None:
                setattr(self.model, "require_forward_param_sync", False)  # noqa: B010
            with no_sync():
                yield
        finally:
            if handle is not None:
                handle.remove()
            hook.close()
            if forward_sync is not None:
                setattr(self.model, "require_forward_param_sync", forward_sync)  # noqa: B010
