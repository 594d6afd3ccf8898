"""The split policy: how many micro-batches a batch gets, how the size shrinks after an OOM
and grows back after clean steps, and the size bound an OOM message gives."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from memkit.errors import ConfigError
from memkit.oom import OomDetails

__all__ = ["SplitPolicy", "oom_size_bound"]

log = logging.getLogger("memkit.microbatching")


@dataclass
class SplitPolicy:
    """Which micro-batch size to use, learned from OOMs and clean steps.

    Attributes:
        grow_after: clean steps before a larger micro-batch size is tried once; ``None`` never.
        micro_size: the largest micro-batch size known to work (``None``: no OOM seen yet, run
            whole batches).
        oom_size: the smallest micro-batch size that ran out of memory (most recent evidence).
        patience: clean steps needed before the next growth trial (doubles after a failed one).
        clean_steps: clean steps since the last OOM or growth.
    """

    grow_after: int | None = 50
    micro_size: int | None = None
    oom_size: int | None = None
    patience: int | None = None
    clean_steps: int = 0
    _grow_pending: bool = False

    def __post_init__(self) -> None:
        if self.grow_after is not None and self.grow_after < 1:
            raise ConfigError(f"grow_after must be >= 1 or None, found {self.grow_after}")
        if self.patience is None:
            self.patience = self.grow_after

    def trial_chunks(self, batch_size: int) -> int | None:
        """The chunk count a growth trial would use for ``batch_size``, or ``None``.

        Half way (in chunk counts) between the chunks the remembered size needs and the chunks
        at which the smallest failing size ran; half the chunks if nothing failed. ``None``
        when nothing is remembered or no smaller count exists.
        """
        if self.micro_size is None:
            return None
        chunks = math.ceil(batch_size / self.micro_size)
        if self.oom_size is None or self.oom_size <= self.micro_size:
            trial = math.ceil(batch_size / (2 * self.micro_size))
        else:
            failed = math.ceil(batch_size / self.oom_size)
            trial = max(failed, (chunks + failed) // 2)
        return trial if trial < chunks else None

    def chunks_for(self, batch_size: int) -> int:
        """How many micro-batches to cut a batch of ``batch_size`` into."""
        if self.micro_size is None or batch_size <= 1:
            return 1
        chunks = math.ceil(batch_size / self.micro_size)
        if self._grow_pending:
            trial = self.trial_chunks(batch_size)
            if trial is not None:
                log.info(
                    "microbatch: trying %d micro-batch(es) of up to %d (known to work: %d) "
                    "after %d clean steps",
                    trial,
                    math.ceil(batch_size / trial),
                    self.micro_size,
                    self.clean_steps,
                )
                return trial
        return min(chunks, batch_size)

    def on_oom(self, tried: int, bound: int | None = None) -> int | None:
        """Record an OOM at micro-batch size ``tried``; return the size to retry with.

        A failed growth trial (``tried`` above the remembered size) goes back to the remembered
        size and doubles the patience. Otherwise the next size is ``ceil(tried / 2)``, or
        ``bound`` when that is smaller: ``bound`` comes from the OOM message (see
        :func:`oom_size_bound`) and is an upper bound on any size that can fit. Returns
        ``None`` when ``tried`` is already 1: nothing smaller exists.
        """
        self.clean_steps = 0
        self._grow_pending = False
        if self.micro_size is not None and tried > self.micro_size:
            self.oom_size = tried
            if self.patience is not None:
                self.patience *= 2
            return self.micro_size
        if tried <= 1:
            self.oom_size = 1
            return None
        new = (tried + 1) // 2
        if bound is not None and bound < new:
            new = max(1, bound)
        self.oom_size = tried
        self.micro_size = new
        return new

    def on_success(self, ran: int) -> None:
        """Record a batch that stepped, whose largest micro-batch had ``ran`` samples."""
        if self.micro_size is None:
            return
        if ran > self.micro_size:  # a growth trial worked
            self.micro_size = ran
            if self.oom_size is not None and ran >= self.oom_size:
                self.oom_size = None
            self.clean_steps = 0
            self._grow_pending = False
            return
        self.clean_steps += 1
        if self.patience is not None and self.clean_steps >= self.patience:
            self._grow_pending = True


def oom_size_bound(
    tried: int, details: OomDetails, baseline: int | None, capacity: int | None = None
) -> int | None:
    """An upper bound on the micro-batch size that can fit, from one OOM at size ``tried``.

    When the attempt started with ``baseline`` bytes in use and failed needing at least
    ``need = in_use + tried_to_allocate - baseline`` bytes of ``avail`` (what was free for it),
    then under the model ``peak(m) = c + k*m`` with ``c >= 0`` every size that fits satisfies
    ``m <= tried * avail / need``. Returns ``None`` when the message lacks the numbers, or
    when they do not show a shortfall (fragmentation, other processes).
    """
    used, want = details.allocated_by_pytorch, details.tried_to_allocate
    if baseline is None or used is None or want is None:
        return None
    if details.free is not None:
        avail = used - baseline + details.free + (details.reserved_unallocated or 0)
    else:
        cap = details.capacity if details.capacity is not None else capacity
        if cap is None:
            return None
        avail = cap - baseline
    need = used + want - baseline
    if avail <= 0 or need <= avail:
        return None
    return max(1, (tried * avail) // need)
