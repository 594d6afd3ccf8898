"""Autocast's dtype policy, applied where ``torch.autocast`` cannot run: on ``meta`` tensors.

``torch.autocast("cuda")`` works through the ``AutocastCUDA`` dispatch key, which only CUDA tensors
carry (meta tensors have none, and a CPU-only build disables CUDA autocast altogether). memkit
estimate therefore applies the same *policy* itself, from a ``TorchFunctionMode`` (above autograd,
where autocast sits, so the cast copies are what autograd saves for backward, as on a GPU):

* ops on the **lower-precision list** (matmuls, linear, convolutions, attention) get their
  floating-point inputs (fp32/fp16/bf16, never fp64) cast to the low dtype;
* ops on the **fp32 list** (norms, softmax, losses, exp/log, ...) get them cast to fp32; those
  with an optional ``dtype`` argument (softmax, sum, cumsum...) run in fp32 unless it is given;
* ops on the **promote list** (cat, stack, addcmul...) get them cast to the widest dtype present;
* everything else runs on its inputs as they are (type promotion does the rest, as on a GPU);
* casts of leaf tensors that require grad (the parameters) to the low dtype are **cached** for
  the autocast region, as autocast's weight cache does: a weight used twice is cast once.

The lists are CUDA autocast's (``aten/src/ATen/autocast_mode.cpp``, PyTorch 2.x), matched by the
Python name of the function or ``Tensor`` method that was called.

Limits: Python functions that are not on a list but call listed ops internally are seen as one
call (the mode is not re-entered while it handles a call); the one that matters,
``F.multi_head_attention_forward`` (``nn.MultiheadAttention``), is treated as lower-precision
as a whole. Ops reached only from C++ (inside another op) are not seen, but those run inside one
listed op anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "FP32_OPS",
    "FP32_SET_OPT_DTYPE_OPS",
    "LOWER_PRECISION_OPS",
    "PROMOTE_OPS",
    "AutocastPolicy",
]

LOWER_PRECISION_OPS = frozenset(
    {
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv",
        "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot",
        "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
        "multi_head_attention_forward",
    }
)  # fmt: skip
"""Ops autocast runs in the low dtype (fp16/bf16)."""

FP32_OPS = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm",
        "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
        "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
        "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
        "upsample_bicubic2d", "interpolate", "grid_sample", "polar", "quantile",
        "nanquantile", "stft", "trace", "cross_entropy", "rms_norm",
    }
)  # fmt: skip
"""Ops autocast runs in fp32 (``cross_entropy`` stands for its log_softmax + nll_loss)."""

FP32_SET_OPT_DTYPE_OPS = frozenset(
    {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm", "linalg_vector_norm",
     "linalg_matrix_norm"}
)  # fmt: skip
"""Ops that run in fp32 unless a ``dtype`` argument is given."""

PROMOTE_OPS = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "scatter_add",
     "tensordot", "cat", "concat", "concatenate", "stack"}
)  # fmt: skip
"""Ops whose floating inputs are cast to the widest floating dtype among them."""

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


class AutocastPolicy:
    """Casts an op's inputs as CUDA autocast would, with autocast's weight-cast cache.

    Args:
        dtype: the low dtype, ``torch.bfloat16`` or ``torch.float16``.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast dtype must be bfloat16 or float16, found {dtype}")
        self.dtype = dtype
        self.enabled = True
        self._cache: dict[int, torch.Tensor] = {}
        self.num_casts = 0

    def clear_cache(self) -> None:
        """Drop the cached weight casts (autocast does so when its region exits)."""
        self._cache.clear()

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not isinstance(value, torch.Tensor) or value.dtype not in _CASTABLE:
            return value
        if value.dtype == dtype:
            return value
        cacheable = (
            dtype == self.dtype
            and value.dtype == torch.float32
            and value.is_leaf
            and value.requires_grad
            and not torch.is_inference_mode_enabled()
        )
        if cacheable:
            cached = self._cache.get(id(value))
            if cached is None:
                cached = value.to(dtype)
                self._cache[id(value)] = cached
                self.num_casts += 1
            return cached
        self.num_casts += 1
        return value.to(dtype)

    def cast_args(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments the op ``name`` runs on under the policy (unchanged when not listed)."""
        if not self.enabled:
            return args, kwargs
        target: torch.dtype | None = None
        if name in LOWER_PRECISION_OPS:
            target = self.dtype
        elif name in FP32_OPS:
            target = torch.float32
        elif name in FP32_SET_OPT_DTYPE_OPS:
            if kwargs.get("dtype") is not None:
                return args, kwargs
            target = torch.float32
        elif name in PROMOTE_OPS:
            dtypes = {t.dtype for t in _tensors((args, kwargs)) if t.dtype in _CASTABLE}
            if len(dtypes) <= 1:
                return args, kwargs
            target = max(dtypes, key=lambda d: torch.finfo(d).bits)
        if target is None:
            return args, kwargs
        cast: Callable[[Any], Any] = lambda v: self._cast(v, target)  # noqa: E731
        return tree_map(cast, args), tree_map(cast, kwargs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
