"""``torch.compile``'d models run eagerly while memkit counts ops: how to tell, and the note.

TorchDynamo does not compile a frame while a ``TorchDispatchMode`` is active (the simulated
device's :class:`~memkit.simulated.accountant.MemoryAccountant`, the estimate's meta step), so a
compiled model runs its eager forward there. What track, probe on the simulated device and
estimate report for it are eager PyTorch's numbers, and they say so with :func:`eager_note`.
"""

from __future__ import annotations

import torch

__all__ = ["eager_note", "is_compiled"]


def is_compiled(module: torch.nn.Module) -> bool:
    """``torch.compile(model)`` (a wrapper with ``_orig_mod``) or ``model.compile()``.

    >>> is_compiled(torch.nn.Linear(2, 2))
    False
    """
    return isinstance(getattr(module, "_orig_mod", None), torch.nn.Module) or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def eager_note(counter: str, measure: str) -> str:
    """The report's note for a compiled model: ``counter`` counted the ops, ``measure`` says
    where to measure the compiled program.

    >>> eager_note("the simulated device (a TorchDispatchMode)", "on a GPU")[:40]
    'torch.compile: TorchDynamo does not comp'
    """
    return (
        f"torch.compile: TorchDynamo does not compile while {counter} counts ops, so the "
        "compiled code (a compiled model or step) ran eagerly and these are eager PyTorch's "
        "numbers; compiled kernels "
        f"fuse ops and often keep less activation memory (measure the compiled program {measure})"
    )
