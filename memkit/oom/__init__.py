"""What an out-of-memory error looks like, and what to do after one.

This is the one place in memkit that decides whether an exception is an OOM. The rule:

1. **Type first.** ``torch.OutOfMemoryError`` (raised by the CUDA, HIP and XPU caching allocators
   and by memkit's simulated device) is an OOM, whatever its message. So is Python's own
   :class:`MemoryError` (a Python-level allocation failed: the process is out of host memory).
2. **Then the message**, but only for :class:`RuntimeError` and its subclasses, because that is
   the type every other PyTorch OOM arrives as (``TORCH_CHECK`` failures, ``torch.AcceleratorError``
   from ``C10_CUDA_CHECK`` in torch >= 2.8, ``torch.distributed.DistBackendError``). The message is
   matched, case-insensitively, against :data:`OOM_MESSAGE_FRAGMENTS`, a table of specific
   fragments each with the library it comes from and where that wording is produced.

What is deliberately **not** an OOM:

* generic words: "memory" alone, "illegal memory access", "shared memory", "out of resources";
* any other exception type, even with OOM words in it: ``ValueError("out of memory budget")`` is
  argument checking, ``OSError(ENOMEM)`` is a failed ``fork``/``mmap`` (a DataLoader worker, a
  checkpoint), neither is an allocation that a smaller batch would fix;
* memkit's own :class:`~memkit.errors.MemkitError` (a ``RuntimeError``): it is a verdict memkit
  raised on purpose (``DoesNotFitError`` quotes the OOM it saw), not an OOM to recover from;
* ``KeyboardInterrupt``, ``SystemExit`` and the like.

Wrapped OOMs: ``raise RuntimeError("step failed") from oom`` is not an OOM at the top level.
:func:`is_oom` looks only at the exception it is given unless ``follow_chain=True``;
:func:`find_oom` walks ``__cause__``, ``__context__`` (even when suppressed with ``from None``:
the OOM and its tensors are still referenced) and exception-group members, breadth first,
cycle-safe and bounded to :data:`MAX_CHAIN` exceptions.

After an OOM, call :func:`recover` **outside** the ``except`` block: the exception's traceback
keeps every frame of the failed step alive, and with them its tensors.

This package never imports torch: if torch is not imported yet, no exception can be a
``torch.OutOfMemoryError``.

Modules: :mod:`~memkit.oom.messages` (the fragment table), :mod:`~memkit.oom.recognising`
(:func:`is_oom`, :func:`find_oom`, :func:`oom_source`), :mod:`~memkit.oom.details`
(:func:`parse_oom_message`), :mod:`~memkit.oom.recovery` (:func:`recover`, :func:`catch_oom`).
Import them from here.
"""

from __future__ import annotations

from memkit.oom.details import OomDetails, parse_oom_message
from memkit.oom.messages import OOM_MESSAGE_FRAGMENTS, OomPattern, match_oom_message
from memkit.oom.recognising import (
    MAX_CHAIN,
    MEMORY_ERROR_SOURCE,
    TYPE_SOURCE,
    find_oom,
    is_oom,
    oom_source,
)
from memkit.oom.recovery import CaughtOom, RecoverableBackend, catch_oom, recover

__all__ = [
    "MAX_CHAIN",
    "MEMORY_ERROR_SOURCE",
    "OOM_MESSAGE_FRAGMENTS",
    "TYPE_SOURCE",
    "CaughtOom",
    "OomDetails",
    "OomPattern",
    "RecoverableBackend",
    "catch_oom",
    "find_oom",
    "is_oom",
    "match_oom_message",
    "oom_source",
    "parse_oom_message",
    "recover",
]
