"""DDP's gradient buckets on the simulated device, counted where a GPU allocates them: when
the model is wrapped. ``DistributedDataParallel.__init__`` builds its ``Reducer``
(``torch.distributed.Reducer``), which allocates one flat tensor per bucket (see
memkit/tracking/ddp.py). A tracker counts no ops between its steps (host work), where a script
wraps its model; :func:`counting_buckets` counts the storages ops create while a Reducer is
built. Nothing is imported for anyone else: a torch without ``torch.distributed`` is left as
it is."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

from memkit.simulated.accountant import MemoryAccountant

__all__ = ["counting_buckets"]


@contextlib.contextmanager
def counting_buckets(accountant: MemoryAccountant) -> Iterator[None]:
    """While the block runs, a ``torch.distributed.Reducer`` built in this process counts the
    storages it creates on ``accountant`` (its buckets), whatever the tracker's counting."""
    dist = sys.modules.get("torch.distributed")
    reducer = getattr(dist, "Reducer", None) if dist is not None else None
    if reducer is None or getattr(reducer, "__memkit_wrapped__", None) is not None:
        yield
        return

    @functools.wraps(reducer, updated=())
    def counted(*args: Any, **kwargs: Any) -> Any:
        before, accountant.counting = accountant.counting, True
        try:
            return reducer(*args, **kwargs)
        finally:
            accountant.counting = before

    counted.__memkit_wrapped__ = reducer  # type: ignore[attr-defined]
    dist.Reducer = counted  # type: ignore[union-attr]
    try:
        yield
    finally:
        if dist.Reducer is counted:  # type: ignore[union-attr]
            dist.Reducer = reducer  # type: ignore[union-attr]
