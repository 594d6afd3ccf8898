"""``@memkit.find_batch_size``: the Accelerate-style retry decorator, without its flaws.

The decorated function takes the batch size as its first argument and usually runs a whole
training loop, so a call that succeeds is final: sizes above it cannot be tried afterwards. What
can be done better than blind halving is the way *down* after an OOM:

* memory is recovered outside the ``except`` block (:func:`memkit.oom.recover`), so the next
  attempt does not start with the failed attempt's tensors still alive;
* the next size comes from what the OOM measured: the memory in use before the call (model,
  optimizer state) is the fixed part, the bytes held plus the failed allocation at the OOM give a
  per-sample cost, and the next size is the largest the resulting line fits in the capacity
  (less ``margin``). That estimate is optimistic (the peak would have gone higher), so after two
  misses in a row the policy falls back to halving; each attempt is strictly smaller than the
  last, so it ends;
* errors that are not OOMs propagate at once, never retried.

For the exact largest size, verified from both sides, use :func:`memkit.probe` on a step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from memkit.devices import accelerator_available, get_backend
from memkit.errors import DoesNotFitError
from memkit.oom import is_oom, parse_oom_message, recover
from memkit.units import format_size

__all__ = ["Attempt", "find_batch_size"]

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(frozen=True)
class Attempt:
    """One call of the decorated function."""

    batch_size: int
    ok: bool
    needed_bytes: int | None = None


def _next_size(
    failed: int, fixed: int, needed: int | None, capacity: int | None, margin: float, misses: int
) -> int:
    halved = failed // 2
    if needed is None or capacity is None or misses >= 2 or needed <= fixed:
        return halved
    per_sample = (needed - fixed) / failed
    predicted = int((capacity * (1 - margin) - fixed) / per_sample)
    return max(1, min(failed - 1, predicted)) if predicted >= 1 else halved


def find_batch_size(
    func: Callable[..., R] | None = None,
    *,
    start: int = 128,
    min_batch: int = 1,
    device: Any = None,
    margin: float = 0.05,
) -> Any:
    """Retry ``func(batch_size, *args, **kwargs)`` on OOM with smaller, measured sizes.

    Args:
        start: the first batch size tried.
        min_batch: below this, give up with :class:`~memkit.errors.DoesNotFitError`.
        device: the device whose memory is at stake (default: the current accelerator, else
            none: recovery then still clears frames and runs the garbage collector).
        margin: share of capacity left free when aiming the next size.

    The wrapper records its calls in ``wrapper.attempts`` (a list of :class:`Attempt`).

    Examples:
        >>> import torch, memkit
        >>> @memkit.find_batch_size(start=4096)
        ... def train(batch_size):
        ...     with memkit.simulate("8MiB"):
        ...         return torch.ones(batch_size, 1024).sum().item() and batch_size
        >>> train() < 4096
        True
    """

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        attempts: list[Attempt] = []

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> R:
            backend = _backend(device)
            capacity = None if backend is None else backend.capacity().free
            fixed = 0 if backend is None else backend.allocated()
            size = start
            attempts.clear()
            while True:
                if size < min_batch:
                    raise DoesNotFitError(
                        f"{fn.__name__} ran out of memory at every batch size tried "
                        f"({', '.join(str(a.batch_size) for a in attempts)}), down to "
                        f"min_batch={min_batch}",
                        needed_bytes=attempts[-1].needed_bytes if attempts else None,
                        capacity_bytes=capacity,
                    )
                failed: BaseException | None = None
                try:
                    result = fn(size, *args, **kwargs)
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    failed = exc
                if failed is None:
                    attempts.append(Attempt(size, True))
                    return result
                details = parse_oom_message(failed)
                needed = details.needed_at_least()
                if capacity is None and details.capacity is not None:
                    capacity = details.capacity
                recover(backend, failed)
                del failed
                attempts.append(Attempt(size, False, needed))
                next_size = _next_size(size, fixed, needed, capacity, margin, len(attempts) - 1)
                log.info(
                    "batch %d ran out of memory (needed >= %s); trying %d",
                    size, format_size(needed), next_size,
                )  # fmt: skip
                size = next_size

        wrapper.attempts = attempts  # type: ignore[attr-defined]
        return wrapper

    return decorate(func) if func is not None else decorate


def _backend(device: Any) -> Any:
    if device is None and not accelerator_available():
        return None
    return get_backend(device) if device not in (None, "cpu") else None
