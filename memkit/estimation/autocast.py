"""Autocast's dtype policy, applied where ``torch.autocast`` cannot run: on ``meta`` tensors.

``torch.autocast("cuda")`` works through the ``AutocastCUDA`` dispatch key, which only CUDA tensors
carry (meta tensors have none, and a CPU-only build disables CUDA autocast altogether). memkit
estimate therefore applies the same *policy* itself, from a ``TorchFunctionMode`` (above autograd,
where autocast sits, so the cast copies are what autograd saves for backward, as on a GPU):

* ops on the **lower-precision list** (matmuls, linear, convolutions, attention) get their
  floating-point inputs (fp32/fp16/bf16, never fp64) cast to the low dtype;
* ops on the **fp32 list** (norms, losses, exp/log, upsampling, ...) get them cast to fp32;
  those that take an optional ``dtype`` (softmax, sum, cumsum, norm...) run in fp32 unless given;
* ops on the **promote list** (addcmul, dot, grid_sampler...) get them cast to the widest dtype
  present;
* ops on the **banned list** (``binary_cross_entropy``) raise, as autocast does;
* everything else runs on its inputs as they are (type promotion does the rest, as on a GPU);
* casts of leaf tensors that require grad (the parameters) to the low dtype are **cached** for
  the autocast region, as autocast's weight cache does: a weight used twice is cast once.

**Where the lists come from.** The installed PyTorch ships its CUDA autocast lists as the
``AT_FORALL_*`` macros of ``torch/include/ATen/autocast_mode.h``; :func:`autocast_lists` reads
them from there, so the policy follows the PyTorch that runs the estimate. When the header is
missing (an install stripped of headers) or unreadable, a built-in copy of PyTorch 2.13's lists
is used; :attr:`AutocastLists.source` says which. Ops are matched by the Python name of the
function or ``Tensor`` method that was called (``__matmul__`` as ``matmul``, ``grid_sample`` as
``grid_sampler``, ``interpolate`` as the upsampling op it runs).

Python functions (``F.multi_head_attention_forward``, ``F.layer_norm``...) run with the mode
back on (``torch.overrides.redispatch_function``), so the ops they call get the policy one by
one, as autocast casts them at the aten level; on a PyTorch without it they are one call, and
``F.multi_head_attention_forward`` is then taken as lower-precision as a whole.
``F.cross_entropy`` runs as PyTorch's composite kernel does under autocast
(:meth:`AutocastPolicy.cross_entropy`). Ops reached only from C++ (inside another op) are not
seen, but those run inside one listed op anyway.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from memkit.errors import UserCodeError

__all__ = ["BUILTIN_LISTS", "AutocastLists", "AutocastPolicy", "autocast_lists", "parse_header"]


@dataclass(frozen=True)
class AutocastLists:
    """CUDA autocast's op lists (aten op names without their overloads)."""

    lower_precision: frozenset[str]
    fp32: frozenset[str]
    fp32_set_opt_dtype: frozenset[str]
    """Run in fp32 unless a ``dtype`` argument is given (``fp32_append_dtype`` ops included)."""
    promote: frozenset[str]
    banned: frozenset[str]
    source: str


_BANNED = frozenset({"binary_cross_entropy"})
"""Registered in ``autocast_mode.cpp`` itself (not in the header): raise under autocast."""

BUILTIN_LISTS = AutocastLists(
    lower_precision=frozenset(
        {
            "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv",
            "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
            "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
            "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
            "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
        }
    ),
    fp32=frozenset(
        {
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
            "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm",
            "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm",
            "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
            "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
            "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
            "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
            "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
            "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
            "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
            "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
            "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        }
    ),
    fp32_set_opt_dtype=frozenset(
        {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
         "linalg_matrix_norm", "sum", "norm"}
    ),
    promote=frozenset(
        {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
         "index_put", "tensordot", "scatter_add"}
    ),
    banned=_BANNED,
    source="memkit's built-in copy of PyTorch 2.13's CUDA autocast lists",
)  # fmt: skip
"""PyTorch 2.13's lists, for an install without ``ATen/autocast_mode.h``."""

_MACROS = {
    "AT_FORALL_LOWER_PRECISION_FP": "lower_precision",
    "AT_FORALL_FP32": "fp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
    "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE": "fp32_set_opt_dtype",
    "AT_FORALL_PROMOTE": "promote",
}
_ENTRY = re.compile(r"^\s*_\(\s*(?:ADD_NS\(\s*)?(\w+)")


def parse_header(text: str, source: str) -> AutocastLists:
    """The lists in the text of ``ATen/autocast_mode.h``.

    Raises:
        ValueError: a list is missing or empty (the header's layout changed).
    """
    found: dict[str, set[str]] = {field: set() for field in set(_MACROS.values())}
    seen: set[str] = set()
    lines = iter(text.splitlines())
    for line in lines:
        match = re.match(r"^#define (AT_FORALL_\w+)\(_\)", line)
        if match is None or match.group(1) not in _MACROS:
            continue
        seen.add(match.group(1))
        names = found[_MACROS[match.group(1)]]
        while line.rstrip().endswith("\\"):
            line = next(lines, "")
            entry = _ENTRY.match(line)
            if entry is not None:
                names.add(entry.group(1))
    missing = sorted(set(_MACROS) - seen)
    empty = sorted(field for field, names in found.items() if not names)
    if missing or empty:
        raise ValueError(f"autocast header {source}: missing {missing}, empty {empty}")
    return AutocastLists(
        lower_precision=frozenset(found["lower_precision"]),
        fp32=frozenset(found["fp32"]),
        fp32_set_opt_dtype=frozenset(found["fp32_set_opt_dtype"]),
        promote=frozenset(found["promote"]),
        banned=_BANNED,
        source=source,
    )


def header_path() -> Path:
    """Where the installed PyTorch keeps ``ATen/autocast_mode.h``."""
    return Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


@functools.cache
def autocast_lists() -> AutocastLists:
    """The installed PyTorch's CUDA autocast lists, else :data:`BUILTIN_LISTS`."""
    path = header_path()
    try:
        return parse_header(
            path.read_text(encoding="utf-8"),
            f"torch {torch.__version__}'s ATen/autocast_mode.h",
        )
    except (OSError, ValueError):
        return BUILTIN_LISTS


_ALIASES = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__ipow__": "pow",
    "grid_sample": "grid_sampler",
    "cross_entropy": "nll_loss",  # only where cross_entropy() below does not apply
}
"""Python names of functions and methods that run (or stand for) a listed aten op."""

if not hasattr(torch.overrides, "redispatch_function"):
    # The estimate's mode cannot see the calls inside a Python function on this PyTorch
    # (meta_step.TargetMode._call): nn.MultiheadAttention's linears and SDPA are one call.
    _ALIASES["multi_head_attention_forward"] = "scaled_dot_product_attention"

_INTERPOLATE = {
    "nearest": "upsample_nearest2d",
    "nearest-exact": "_upsample_nearest_exact2d",
    "linear": "upsample_linear1d",
    "bilinear": "upsample_bilinear2d",
    "bicubic": "upsample_bicubic2d",
    "trilinear": "upsample_trilinear3d",
}
"""``F.interpolate``'s modes and the upsampling op each runs (``area`` runs adaptive pooling)."""

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


class AutocastPolicy:
    """Casts an op's inputs as CUDA autocast would, with autocast's weight-cast cache.

    Args:
        dtype: the low dtype, ``torch.bfloat16`` or ``torch.float16``.
        lists: the op lists; the installed PyTorch's by default.
    """

    def __init__(
        self, dtype: torch.dtype, lists: AutocastLists | None = None, inference: bool = False
    ) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast dtype must be bfloat16 or float16, found {dtype}")
        self.dtype = dtype
        self.lists = lists or autocast_lists()
        self.enabled = True
        self.weak = False
        """The cache holds its casts by weak reference (in backward's recomputes)."""
        self.inference = inference
        """The region runs under ``torch.inference_mode()`` on the GPU (whatever runs on meta):
        autocast then caches no weight cast (``cached_cast``'s ``InferenceMode`` check)."""
        self._cache: dict[int, torch.Tensor] = {}
        self._held: dict[int, weakref.ref[torch.Tensor]] = {}
        self.num_casts = 0

    def clear_cache(self) -> None:
        """Drop the cached weight casts (autocast does so when its region exits)."""
        self._cache.clear()

    def end_region(self) -> None:
        """The forward's region ends (backward starts): the policy is off and its cached casts
        dropped. From here it is on only in a checkpoint's recompute, where autocast's cache
        lasts to the recompute's end: its casts are shared while a tensor holds them (autograd
        saved them), not kept by the cache, whose end memkit does not see."""
        self.enabled = False
        self.clear_cache()
        self.weak = True

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
            and not (self.inference or torch.is_inference_mode_enabled())
        )
        if cacheable and self.weak:
            held = self._held.get(id(value))
            cached = None if held is None else held()
            if cached is None:
                cached = value.to(dtype)
                self._held[id(value)] = weakref.ref(cached)
                self.num_casts += 1
            return cached
        if cacheable:
            cached = self._cache.get(id(value))
            if cached is None:
                cached = value.to(dtype)
                self._cache[id(value)] = cached
                self.num_casts += 1
            return cached
        self.num_casts += 1
        return value.to(dtype)

    @staticmethod
    def op_name(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The aten op a Python function or method of this name runs."""
        if name == "interpolate":
            mode = args[3] if len(args) > 3 else kwargs.get("mode", "nearest")
            return _INTERPOLATE.get(mode, name)
        return _ALIASES.get(name, name)

    def cross_entropy(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``F.cross_entropy`` as autocast runs it, or ``NotImplemented`` where it cannot tell.

        Autocast does not list ``cross_entropy_loss``: its composite kernel runs under autocast
        and calls ``log_softmax(input, class_dim, input.scalar_type())``. That dtype is given,
        so the ``fp32_set_opt_dtype`` policy keeps it: the log-probabilities stay in the
        input's dtype (bf16 logits give bf16 log-probabilities, saved for backward); then
        ``nll_loss`` (fp32 list) casts them to fp32, a copy its backward saves. Class-index
        targets without label smoothing only; the other forms run as one fp32 op.
        """
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction", "label_smoothing")  # fmt: skip
        bound = dict(zip(names, args, strict=False)) | kwargs
        logits, target = bound.get("input"), bound.get("target")
        if (
            not self.enabled
            or not isinstance(logits, torch.Tensor)
            or not isinstance(target, torch.Tensor)
            or logits.dtype not in _CASTABLE
            or target.is_floating_point()
            or float(bound.get("label_smoothing") or 0.0) > 0.0
        ):
            return NotImplemented
        reduction = bound.get("reduction", "mean")
        if bound.get("size_average") is not None or bound.get("reduce") is not None:
            from torch.nn import _reduction

            reduction = _reduction.legacy_get_string(bound.get("size_average"), bound.get("reduce"))
        class_dim = 0 if logits.dim() == 1 else 1
        log_probs = torch.log_softmax(logits, class_dim, dtype=logits.dtype)
        weight = bound.get("weight")
        return torch.nn.functional.nll_loss(
            self._cast(log_probs, torch.float32),
            target,
            None if weight is None else self._cast(weight, torch.float32),
            ignore_index=bound.get("ignore_index", -100),
            reduction=reduction,
        )

    def cast_args(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments the op ``name`` runs on under the policy (unchanged when not listed).

        Raises:
            UserCodeError: the op is one autocast refuses (as ``torch.autocast`` would).
        """
        if not self.enabled:
            return args, kwargs
        op = self.op_name(name, args, kwargs)
        lists = self.lists
        target: torch.dtype | None = None
        if op in lists.lower_precision:
            target = self.dtype
        elif op in lists.fp32:
            target = torch.float32
        elif op in lists.fp32_set_opt_dtype:
            if kwargs.get("dtype") is not None:
                return args, kwargs
            target = torch.float32
        elif op in lists.promote:
            dtypes = {t.dtype for t in _tensors((args, kwargs)) if t.dtype in _CASTABLE}
            if len(dtypes) <= 1:
                return args, kwargs
            target = max(dtypes, key=lambda d: torch.finfo(d).bits)
        elif op in lists.banned:
            raise UserCodeError(
                f"the step calls {name}, which torch.autocast('cuda') refuses as unsafe: with "
                "--amp it fails on a GPU. Use its *_with_logits form (nn.BCEWithLogitsLoss), "
                "which autocast runs in fp32, or estimate without --amp."
            )
        if target is None:
            return args, kwargs
        cast: Callable[[Any], Any] = lambda v: self._cast(v, target)  # noqa: E731
        return tree_map(cast, args), tree_map(cast, kwargs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
