"""Advice: recommendations that fire on measured evidence and say what to do.

Every rule is a pure function of evidence (numbers, or the result objects the capabilities
produce) that returns an :class:`Advice` (or ``None``, or a list): capabilities measure,
advice never does. One module per subject:

* :mod:`memkit.advice.form`: :class:`Advice`, its severities and shared thresholds (its text
  and HTML layout: :mod:`memkit.render.advice`).
* :mod:`memkit.advice.training`: ``mixed-precision``, ``float64``, ``activation-checkpointing``,
  ``optimizer-state``, ``zero-grad-keeps-grads``.
* :mod:`memkit.advice.device`: ``fragmentation``, ``other-processes``, ``empty-cache``.
* :mod:`memkit.advice.distributed`: ``dp-*``, ``ddp-*``, ``switch-to-ddp``;
  :mod:`memkit.advice.sharding`: ``fsdp-gpus``, ``fsdp-saves``, ``fsdp-wrap-unit``.
* :mod:`memkit.advice.lightning`, :mod:`memkit.advice.transformers`: advice actions said in
  the terms of Lightning's and transformers' Trainers (``form.in_terms``).
* :mod:`memkit.advice.probe`: ``does-not-fit``, ``accumulate``; :mod:`memkit.advice.estimate`:
  an estimate's.
* :mod:`memkit.advice.track`: the rules fed with a track report; :mod:`memkit.advice.oom`: the
  OOM post-mortem's; :mod:`memkit.advice.leaks`: ``graph-retained``, ``memory-growth``.

This package re-exports the form and the rules of plain numbers.
"""

from __future__ import annotations

from memkit.advice.device import (
    device_advice,
    empty_cache,
    fragmentation,
    other_processes,
    processes_in_oom_message,
    snapshot_fragmentation,
)
from memkit.advice.distributed import (
    DP_IMBALANCE,
    check_data_parallel,
    dp_batch_too_small,
    dp_device_mismatch,
    dp_loss_on_replicas,
    dp_to_ddp,
    switch_to_ddp,
)
from memkit.advice.form import CUDA_CONTEXT_BYTES, MATERIAL, PRESSURE, SEVERITIES, Advice, MiB
from memkit.advice.probe import accumulation_advice, does_not_fit
from memkit.advice.training import (
    LIGHTER_OPTIMIZERS,
    ModuleActivation,
    activation_checkpointing,
    float64_training,
    mixed_precision,
    oom_retry_holds,
    optimizer_state,
    retain_graph_held,
    stale_gradients,
    zero_grad_keeps_grads,
)

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "DP_IMBALANCE",
    "LIGHTER_OPTIMIZERS",
    "MATERIAL",
    "PRESSURE",
    "SEVERITIES",
    "Advice",
    "MiB",
    "ModuleActivation",
    "accumulation_advice",
    "activation_checkpointing",
    "check_data_parallel",
    "device_advice",
    "does_not_fit",
    "dp_batch_too_small",
    "dp_device_mismatch",
    "dp_loss_on_replicas",
    "dp_to_ddp",
    "empty_cache",
    "float64_training",
    "fragmentation",
    "mixed_precision",
    "oom_retry_holds",
    "optimizer_state",
    "other_processes",
    "processes_in_oom_message",
    "retain_graph_held",
    "snapshot_fragmentation",
    "stale_gradients",
    "switch_to_ddp",
    "zero_grad_keeps_grads",
]
