"""The memory footprint of the fused attention kernels, for estimates on ``meta``.

On ``meta`` (and on CPU with autograd), ``F.scaled_dot_product_attention`` runs the *math* path:
it materialises the ``B x H x L x S`` attention matrix (and keeps it for backward). On a GPU the
fused kernels do not. :func:`choose_kernel` picks what PyTorch would pick on the target, and
:func:`fused_attention` replaces the call by a custom autograd function that allocates exactly
what the chosen kernel allocates (on ``meta``: nothing is computed):

=============  ======================================================  ========================
kernel         forward (kept for backward)                             backward temporaries
=============  ======================================================  ========================
``flash``      output; logsumexp ``B x H x L`` fp32; q/k/v padded       ``dq`` accumulator
               to a head dim multiple of 8 when it is not (copies)      ``B x L128 x H x D32``
                                                                       fp32, ``B x H x L128``
                                                                       fp32 (``softmax_d``);
                                                                       grouped-query: ``dk``,
                                                                       ``dv`` expanded to
                                                                       ``H`` heads
``efficient``  output; logsumexp ``B x H x ceil(L/32)*32`` fp32          delta ``B x H x L`` fp32;
               (only when a gradient is needed); fp16/bf16 with a      fp32 ``dq`` accumulator
               head dim over 128: an fp32 output accumulator           (sm70+, or fp16/bf16)
``math``       the real decomposition (``L x S`` scores, softmax,       as autograd does
               dropout mask) is run unchanged
=============  ======================================================  ========================

The output is laid out as the query is (``empty_like``, dense layouts kept) by the flash
kernels, CUDA's and CPU's, and as ``B x L x H x D`` by the memory-efficient kernel: it decides
whether a later ``transpose(1, 2).reshape(...)`` copies.

``L128``/``D32``: rounded up to 128 / 32 (64 above 128), as flash-attention's backward does.
Gradients of ``q``, ``k``, ``v`` have their shapes and dtypes. The numbers follow PyTorch's
``aten/src/ATen/native/transformers/cuda`` (``flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_bwd``,
``attention.cu``/``attention_backward.cu`` and the CUTLASS memory-efficient kernel's
``kernel_forward.h``/``kernel_backward.h``). Not modelled: flash's split-KV accumulators
(small inference batches only), the memory-efficient kernel's key/value gradient accumulators
(bounded in recent releases).

An ``attn_mask`` is kept for backward by the fused kernels (their backward takes it), as the
kernel gets it: a boolean mask as an additive copy in the query's dtype, and for the
memory-efficient kernel a mask with unaligned strides as a padded copy (:func:`kernel_mask`).

Choice (``"auto"``), for a target of compute capability ``sm`` (PyTorch's ``sdp_utils.cpp``):

* **flash** when ``sm >= 80``, the inputs are fp16/bf16 and 4-D, the head dims agree and are at
  most 256, there is no ``attn_mask``, key/value have as many heads as the query or divide
  them (grouped-query attention), ``is_causal`` comes with as many keys as queries, and, on
  sm86-sm89 when a gradient is needed, the head dim is at most 192 (or over 224 without
  dropout): flash's backward there takes no other;
* else **memory-efficient** when ``sm >= 50``, the inputs are 4-D fp16/fp32 (bf16 from sm80)
  with as many key/value heads as query heads (it takes no grouped-query attention: fp32 GQA
  runs math), and the head dim is a multiple of ``minimum_gemm_alignment``: 8 for fp16/bf16
  from sm70 (tensor cores), 4 for fp32 from sm80, 1 otherwise;
* else **math**.

On sm90/sm100, PyTorch builds with cuDNN newer than 9.15 try **cuDNN attention** first. Its
forward keeps the same tensors as flash (output, fp32 logsumexp ``B x H x L``) and its backward
workspace is cuDNN's to size, so flash's footprint stands in for it; the report says so.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATTENTION_KERNELS", "choose_kernel", "fused_attention", "kernel_mask"]

ATTENTION_KERNELS = ("auto", "math", "efficient", "flash", "cpu-flash")
"""Accepted requests. ``"cpu-flash"`` is PyTorch's CPU flash kernel (output and logsumexp, no
backward temporaries): what the simulated cpu device runs, for validating estimates on CPU."""

_HALF = (torch.float16, torch.bfloat16)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _flash_ok(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    sm: int,
    dropout_p: float,
    is_causal: bool,
) -> bool:
    if sm < 80 or query.dtype not in _HALF or not _four_d(query, key, value):
        return False
    head, heads_q, heads_kv = query.shape[-1], query.shape[1], key.shape[1]
    return (
        mask is None
        and key.shape[-1] == head == value.shape[-1]
        and head <= 256
        and heads_kv == value.shape[1]
        and heads_q % heads_kv == 0
        and not (is_causal and query.shape[-2] != key.shape[-2])
        and _flash_trains_head_dim(query, key, value, sm, dropout_p)
    )


def _flash_trains_head_dim(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm: int, dropout_p: float
) -> bool:
    """sdp_utils.cpp's ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``:
    on sm86-sm89 and sm120-sm121, flash's backward takes no head dim in (192, 224], nor one in
    (224, 256] with dropout, so PyTorch does not pick flash when a gradient is needed."""
    if not (86 <= sm <= 89 or 120 <= sm <= 121) or not _needs_grad(query, key, value):
        return True
    head = query.shape[-1]
    return head <= 192 or (dropout_p == 0.0 and head > 224)


def _needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))


def _efficient_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm: int) -> bool:
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if sm >= 80 else ())
    if sm < 50 or query.dtype not in dtypes or not _four_d(query, key, value):
        return False
    align = _gemm_alignment(query.dtype, sm)
    return (
        key.shape[-1] == query.shape[-1]
        and query.shape[-1] % align == 0
        and value.shape[-1] % align == 0
        # check_batch_size_and_num_heads_dense<false>: no grouped-query attention (an
        # ``enable_gqa=True`` call with fewer key/value heads runs math or flash)
        and query.shape[0] == key.shape[0] == value.shape[0]
        and query.shape[1] == key.shape[1] == value.shape[1]
    )


def _gemm_alignment(dtype: torch.dtype, sm: int) -> int:
    """sdp_utils.cpp's ``minimum_gemm_alignment``: 4 from sm80 (1 before), raised to 128 bits
    (8 halves, 4 floats) where tensor cores run: sm80+, and fp16/bf16 on sm70-sm75."""
    half = dtype in _HALF
    tensor_cores = sm >= 80 or (sm >= 70 and half)
    align = 4 if sm >= 80 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def _four_d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """All three inputs are 4-D (``B x H x L x D``), as the fused kernels need."""
    return query.dim() == key.dim() == value.dim() == 4


def choose_kernel(
    requested: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    sm: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> str:
    """The kernel that runs: ``requested`` unless it is ``"auto"`` or cannot take the inputs.

    PyTorch's CPU flash kernel takes no dropout (``torch._fused_sdp_choice`` on CPU answers
    MATH for ``dropout_p > 0``); the CUDA flash and memory-efficient kernels do."""
    flash_ok = _flash_ok(query, key, value, attn_mask, sm, dropout_p, is_causal)
    efficient_ok = _efficient_ok(query, key, value, sm)
    if requested == "cpu-flash":
        return "cpu-flash" if _four_d(query, key, value) and dropout_p == 0.0 else "math"
    if requested == "math":
        return "math"
    if requested == "efficient":
        return "efficient" if efficient_ok else "math"
    if flash_ok:  # "flash" or "auto"
        return "flash"
    return "efficient" if efficient_ok else "math"


def _blhd(like: torch.Tensor, dim: int, heads: int | None = None) -> torch.Tensor:
    """A ``B x H x L x dim`` tensor laid out as ``B x L x H x dim``, as the kernels allocate."""
    batch, length = like.shape[0], like.shape[2]
    heads = like.shape[1] if heads is None else heads
    return like.new_empty((batch, length, heads, dim)).transpose(1, 2)


class _FusedAttention(torch.autograd.Function):
    """Allocates what a fused attention kernel allocates; computes nothing meaningful."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        kernel: str,
        needs_grad: bool,
        sm: int,
    ) -> torch.Tensor:
        batch, heads, length, dim = query.shape
        saved: tuple[torch.Tensor, ...] = (query, key, value)
        if kernel == "flash" and dim % 8:  # padded copies; the kernel runs (and saves) those
            saved = tuple(t.new_empty((*t.shape[:-1], _round_up(t.shape[-1], 8))) for t in saved)
        if kernel != "efficient" and value.shape[-1] == dim:
            out = torch.empty_like(saved[0])  # flash: empty_like(q) keeps the query's layout
        else:
            out = _blhd(query, value.shape[-1])  # efficient: B x L x H x D whatever q's
        lse: torch.Tensor | None = None
        if kernel in ("flash", "cpu-flash") or needs_grad:
            lse_len = length if kernel != "efficient" else _round_up(length, 32)
            lse = query.new_empty((batch, heads, lse_len), dtype=torch.float32)
        if kernel == "efficient" and query.dtype in _HALF and value.shape[-1] > 128:
            accum = out.new_empty(out.shape, dtype=torch.float32)
            del accum
        ctx.kernel = kernel
        ctx.sm = sm
        ctx.dims = (dim, key.shape[-1], value.shape[-1])
        if needs_grad:  # the kernel's backward takes the mask (attn_bias) too
            ctx.save_for_backward(*saved, out, lse, mask)
        else:
            del lse
        del saved
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, _out, _lse, mask = ctx.saved_tensors  # padded: flash, dim % 8
        batch, heads, length, dim = query.shape
        grad_q, grad_k, grad_v = (
            _blhd(t, d) for t, d in zip((query, key, value), ctx.dims, strict=True)
        )
        if ctx.kernel == "cpu-flash":
            pass
        elif ctx.kernel == "flash":
            len_r = _round_up(length, 128)
            dim_r = _round_up(dim, 32 if dim <= 128 else 64)
            accum = query.new_empty((batch, len_r, heads, dim_r), dtype=torch.float32)
            softmax_d = query.new_empty((batch, heads, len_r), dtype=torch.float32)
            expanded = (
                (_blhd(key, key.shape[-1], heads), _blhd(value, value.shape[-1], heads))
                if key.shape[1] != heads
                else ()
            )
            del accum, softmax_d, expanded
        else:
            delta = query.new_empty((batch, heads, length), dtype=torch.float32)
            needs_accum = ctx.sm >= 70 or query.dtype in _HALF
            accum = query.new_empty(query.shape, dtype=torch.float32) if needs_accum else None
            del delta, accum
        grad_mask = mask.new_empty(mask.shape) if ctx.needs_input_grad[3] else None
        return grad_q, grad_k, grad_v, grad_mask, None, None, None


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel: str,
    sm: int = 80,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The output of a fused attention kernel (``"flash"`` or ``"efficient"``), on meta.

    Grouped-query attention (fewer key/value heads) is handled: the output and the forward
    temporaries follow ``query``'s heads; flash's backward expands ``dk``/``dv`` to them.
    An ``attn_mask`` is kept for backward as the kernel gets it (:func:`kernel_mask`).
    """
    if kernel not in ("flash", "efficient", "cpu-flash"):
        raise ValueError(f"kernel must be 'flash', 'efficient' or 'cpu-flash', found {kernel!r}")
    needs_grad = _needs_grad(query, key, value)
    mask = None if attn_mask is None else kernel_mask(attn_mask, query.dtype, kernel)
    out = _FusedAttention.apply(query, key, value, mask, kernel, needs_grad, sm)
    assert isinstance(out, torch.Tensor)
    return out


_MASK_ALIGNMENT = 8
"""``mem_eff_alignment`` of ``preprocess_mask`` (``attention.cpp``)."""


def kernel_mask(mask: torch.Tensor, dtype: torch.dtype, kernel: str) -> torch.Tensor:
    """The mask a fused kernel runs on (and its backward keeps), as ``attention.cpp``'s
    ``scaled_dot_product_attention`` makes it: a boolean mask becomes an additive one of the
    query's dtype (``convert_boolean_attn_mask``, a new tensor of the mask's shape); for the
    memory-efficient kernel, a mask whose strides are not multiples of 8 elements (or whose
    last stride is not 1) is copied into one whose last dim is padded by
    ``8 - S % 8`` and sliced back (``preprocess_mask``/``pad_bias``), then broadcast (a view).
    """
    if mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=dtype)
    if kernel != "efficient":
        return mask
    strides = mask.stride()
    if strides[-1] == 1 and all(s % _MASK_ALIGNMENT == 0 for s in strides[:-1]):
        return mask
    last = mask.shape[-1]
    pad = _MASK_ALIGNMENT - last % _MASK_ALIGNMENT
    return torch.nn.functional.pad(mask, (0, pad))[..., :last]
