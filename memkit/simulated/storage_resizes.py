"""Storage resizes the simulated device would not see on its own: FSDP2 (``fully_shard``)
allocates and frees each unit's unsharded parameters by resizing their storages
(``alloc_storage``/``free_storage`` in torch/distributed/fsdp/_fully_shard/, torch 2.11 to
2.13), outside any op. :func:`counting_resizes` follows each such resize by a no-op view the
device does see (an ``alias`` of the tensor, which the accountant reads as the storage's new
size). :class:`~memkit.simulated.accountant.MemoryAccountant` enters it for its block when
FSDP2 is already imported (:func:`fsdp2_loaded`): nothing is imported for anyone else."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["counting_resizes", "fsdp2_loaded"]

_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"


def fsdp2_loaded() -> bool:
    """Whether FSDP2's parameter code was imported (``torch.distributed.fsdp`` imports it)."""
    return _FSDP_PARAM in sys.modules


def _seen_by_the_device(resize: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    @functools.wraps(resize)
    def resized(tensor: torch.Tensor) -> None:
        resize(tensor)
        torch.ops.aten.alias.default(tensor)  # an op on the storage: its new size is read

    resized.__memkit_wrapped__ = resize  # type: ignore[attr-defined]
    return resized


@contextlib.contextmanager
def counting_resizes() -> Iterator[None]:
    """While the block runs, FSDP2's storage resizes are followed by an op the simulated
    device sees (see the module docstring). A torch whose FSDP2 has no such functions is left
    as it is; nested blocks patch once."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:
        yield
        return
    patched: list[tuple[Any, str, Any]] = []
    for mod in (_fsdp_param, _fsdp_param_group):
        for name in ("alloc_storage", "free_storage"):
            fn = getattr(mod, name, None)
            if callable(fn) and not hasattr(fn, "__memkit_wrapped__"):
                patched.append((mod, name, fn))
                setattr(mod, name, _seen_by_the_device(fn))
    try:
        yield
    finally:
        for mod, name, fn in reversed(patched):
            setattr(mod, name, fn)
