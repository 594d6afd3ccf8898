"""Estimate a training (or inference) step's peak memory on a GPU you do not have.

:func:`estimate` takes a model file (the protocol of :mod:`memkit.modelfile`), builds the model
under ``torch.device("meta")`` (no host RAM: a multi-billion-parameter model costs nothing), and
runs the same batch-size search as ``memkit probe`` (:func:`memkit.probing.search.search_max_batch`)
with the same step (:class:`memkit.probing.step.StepPlan`). Every trial runs on ``meta`` tensors
under the accounting mode (:class:`memkit.simulated.accountant.MemoryAccountant`, CUDA 512-byte
rounding): nothing is computed and no memory is used, but every storage's size is exact. On top of
that:

* **allocator**: each allocation and free is replayed through a model of the CUDA caching
  allocator (:mod:`memkit.simulated.allocator`), which gives the estimated ``memory_allocated`` and
  ``memory_reserved`` peaks; the reserved peak decides the fit, as in ``memkit probe``;
* **CUDA context**: the card's memory minus a documented constant per device family
  (:data:`DEVICE_FAMILIES`, overridable) is what the allocator may use; the cuBLAS workspace
  (one per thread that runs matmuls: two in training, where autograd's device thread has its
  own handle) is counted as allocated;
* **AMP**: autocast's dtype policy (:mod:`memkit.estimation.autocast`), not a cast of the model:
  master weights stay fp32, listed ops run in bf16/fp16 and their cast copies are counted;
* **attention**: ``F.scaled_dot_product_attention`` is replaced by the footprint of the kernel
  PyTorch would choose on the target (:mod:`memkit.estimation.attention`), and the report says
  which;
* **optimizer**: on a CUDA device PyTorch's optimizers default to the ``foreach``
  (multi-tensor) implementation, whose temporaries are part of the peak; on meta the default
  would be the per-parameter loop, so ``foreach=True`` is set on every param group that left
  it unset. Adam's ``step`` counter is a CPU scalar on a GPU too, and is not counted.

The model file's ``make_batch`` runs under ``with torch.device("meta"):``, so
``torch.randn(...)``/``torch.randint(...)`` without a ``device`` land on meta (factory functions
honour the device context manager); tensors it puts elsewhere explicitly are moved to meta.

Each trial runs one step after an unaccounted warm-up step that creates the optimizer state (its
peak equals the larger of a probe's two steps from an empty state: the second).

The package (one job per module): :mod:`~memkit.estimation.search` (the entry point and the
batch-size search), the models of the target (:mod:`~memkit.estimation.attention`,
:mod:`~memkit.estimation.autocast`, :mod:`~memkit.estimation.workspaces`; the caching
allocator's is :mod:`memkit.simulated.allocator`). Its public names load on first use: the
command line reads the device families (torch-free) for ``memkit estimate --help``, and the
search imports torch.

Examples:
    >>> import memkit
    >>> est = memkit.estimate("examples/gpt2_small.py", device_memory="24GiB",
    ...                       amp="bf16")  # doctest: +SKIP
    >>> est.max_batch_size, est.recommended_batch_size  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AMP_DTYPES",
    "DEFAULT_FAMILY",
    "DEFAULT_MARGIN",
    "DEVICE_FAMILIES",
    "DeviceFamily",
    "Estimate",
    "EstimateBreakdown",
    "EstimateTrial",
    "estimate",
    "simulated_peak",
]

_HOME: dict[str, str] = {
    "AMP_DTYPES": "memkit.estimation.search",
    "DEFAULT_MARGIN": "memkit.estimation.search",
    "estimate": "memkit.estimation.search",
    "DEFAULT_FAMILY": "memkit.estimation.families",
    "DEVICE_FAMILIES": "memkit.estimation.families",
    "DeviceFamily": "memkit.estimation.families",
    "Estimate": "memkit.estimation.result",
    "EstimateBreakdown": "memkit.estimation.result",
    "EstimateTrial": "memkit.estimation.result",
    "simulated_peak": "memkit.estimation.validation",
}

if TYPE_CHECKING:
    from memkit.estimation.families import DEFAULT_FAMILY, DEVICE_FAMILIES, DeviceFamily
    from memkit.estimation.result import Estimate, EstimateBreakdown, EstimateTrial
    from memkit.estimation.search import AMP_DTYPES, DEFAULT_MARGIN, estimate
    from memkit.estimation.validation import simulated_peak


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'memkit.estimation' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
