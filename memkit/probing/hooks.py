"""The probe's hooks on the user's modules, optimizer and tensors, safe to copy.

A training step may copy the model it is given: ``copy.deepcopy(model)`` for an EMA
(``torch.optim.swa_utils.AveragedModel``, timm's ``ModelEmaV2``), a "best model so far", or
``torch.save(model)``. The copy takes the module's hook dictionaries with it. A bound method of
the probe there would drag the probe and its device counters (their lock cannot be copied)
into the copy; a plain closure would stay callable in the copy, counting the copy's work as
the model's, in later trials and after the probe. A :class:`ProbeHook` is copied (and
pickled) as :func:`inert`, and it does nothing once :meth:`ProbeHook.close` has run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ProbeHook", "inert"]


def inert(*_: Any) -> None:
    """What a copy of a hooked module or optimizer holds in place of a probe's hook."""


def _copied() -> Callable[..., None]:
    return inert


class ProbeHook:
    """Calls ``call`` until closed; its copies are :func:`inert`."""

    __slots__ = ("call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call: Callable[..., Any] | None = call

    def __call__(self, *args: Any) -> Any:
        return None if self.call is None else self.call(*args)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _copied, ()

    def close(self) -> None:
        """From now on the hook does nothing (where a handle could not reach it)."""
        self.call = None
