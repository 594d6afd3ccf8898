"""The model file's model and optimizer, built on ``meta`` as the target GPU would run them."""

from __future__ import annotations

import copy
import logging

import torch

from memkit.errors import ConfigError
from memkit.estimation.meta_step import META
from memkit.modelfile import ModelSpec, build_model, make_optimizer
from memkit.probing.runner import sparse_embeddings
from memkit.units import format_names

__all__ = [
    "build_meta_model",
    "build_target_optimizer",
    "meta_copy",
    "refuse_sparse_gradients",
]

log = logging.getLogger(__name__)


def build_meta_model(spec: ModelSpec) -> torch.nn.Module:
    """``build_model()`` under ``torch.device("meta")``. When it put tensors elsewhere (or
    returned a model that already existed, as a notebook's :class:`ModelSpec` may), a copy
    on meta is estimated: the returned module itself is left as it was."""
    with torch.device(META):
        model = build_model(spec)
    off_meta = [
        t.device for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"
    ]
    if off_meta:
        log.info("build_model() put tensors on %s; estimating a copy on meta", off_meta[0])
        model = meta_copy(model, spec.path)
    return model


def meta_copy(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same
    shape, dtype and ``requires_grad``; no tensor data is copied and ``model`` is untouched.

    Raises:
        ConfigError: the model cannot be deep-copied.
    """
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(
            torch.empty_like(param, device=META), requires_grad=param.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device=META)
    try:
        return copy.deepcopy(model, memo)
    except Exception as error:
        raise ConfigError(
            f"build_model() in {path} returned a {type(model).__name__} with tensors off meta, "
            f"and memkit estimate could not copy it to meta without moving yours "
            f"({type(error).__name__}: {error}); build it inside build_model() (memkit runs "
            "that under torch.device('meta'))"
        ) from error


def refuse_sparse_gradients(model: torch.nn.Module, path: str) -> None:
    """Stop a training estimate whose model makes sparse gradients: on meta tensors a sparse
    gradient holds no rows (how many depends on the indices a batch looks up), so it would
    silently count 0 bytes.

    Raises:
        ConfigError: an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True`` trains.
    """
    sparse = sparse_embeddings(model)
    if sparse:
        raise ConfigError(
            f"memkit estimate cannot count sparse gradients: {format_names(sparse)} in {path} "
            f"{'has' if len(sparse) == 1 else 'have'} sparse=True, and on meta tensors a sparse "
            "gradient holds no rows (their number depends on the indices a batch looks up), so "
            "it would count 0 bytes. Measure the step on the simulated device, which counts a "
            f"sparse tensor's indices and values: memkit probe {path} --device cpu --budget "
            "<the GPU's memory less its CUDA context>; or estimate a copy with sparse=False, "
            "whose dense gradients take the whole table's bytes. --mode infer needs no "
            "gradients and runs."
        )


def build_target_optimizer(
    spec: ModelSpec, model: torch.nn.Module, foreach: bool | None
) -> tuple[torch.optim.Optimizer, str]:
    """The file's optimizer with the implementation a CUDA device would use, and the
    assumption line that says which.

    ``foreach`` is set on every param group that left it unset: ``None`` means the CUDA
    default (foreach), which on meta would otherwise be the per-parameter loop.
    """
    optimizer, name = make_optimizer(spec, model)
    impl = "foreach (CUDA default)" if foreach is None else ("foreach" if foreach else "for-loop")
    if not any("foreach" in group for group in optimizer.param_groups):
        impl = "its own (no foreach option)"  # SparseAdam, LBFGS
    use = True if foreach is None else foreach
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = use
    return optimizer, f"optimizer: {name}, {impl} implementation"
