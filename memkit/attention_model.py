"""The memory footprint of the fused attention kernels, for estimates on ``meta``.

On ``meta`` (and on CPU with autograd), ``F.scaled_dot_product_attention`` runs the *math* path:
it materialises the ``B x H x L x S`` attention matrix (and keeps it for backward). On a GPU the
fused kernels do not. :func:`choose_kernel` picks what PyTorch would pick on the target, and
:func:`fused_attention` replaces the call by a custom autograd function that allocates exactly
what the chosen kernel allocates (on ``meta``: nothing is computed):

=============  ======================================================  ========================
kernel         forward (kept for backward)                             backward temporaries
=============  ======================================================  ========================
``flash``      output; logsumexp ``B x H x L`` fp32                     ``dq`` accumulator
                                                                       ``B x L128 x H x D32``
                                                                       fp32, ``B x H x L128``
                                                                       fp32 (``softmax_d``)
``efficient``  output; logsumexp ``B x H x ceil(L/32)*32`` fp32          delta ``B x H x L`` fp32;
               (only when a gradient is needed)                        fp32 ``dq`` accumulator
                                                                       for fp16/bf16
``math``       the real decomposition (``L x S`` scores, softmax,       as autograd does
               dropout mask) is run unchanged
=============  ======================================================  ========================

``L128``/``D32``: rounded up to 128 / 32 (64 above 128), as flash-attention's backward does.
Gradients of ``q``, ``k``, ``v`` have their shapes and dtypes. The numbers follow PyTorch's
``aten/src/ATen/native/transformers/cuda`` (flash-attention 2 and the xformers/CUTLASS
memory-efficient kernel); workspaces below 1 MiB are ignored.

Choice (``"auto"``), for a target of compute capability ``sm`` (PyTorch's ``sdp_utils``): flash
when ``sm >= 80``, the inputs are fp16/bf16, 4-D, head dim <= 256 and a multiple of 8, and there
is no ``attn_mask``; else memory-efficient when ``sm >= 50`` and the inputs are 4-D
fp32/fp16/bf16; else math.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATTENTION_KERNELS", "choose_kernel", "fused_attention"]

ATTENTION_KERNELS = ("auto", "math", "efficient", "flash", "cpu-flash")
"""Accepted requests. ``"cpu-flash"`` is PyTorch's CPU flash kernel (output and logsumexp, no
backward temporaries): what the simulated cpu device runs, for validating estimates on CPU."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def choose_kernel(
    requested: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    sm: int,
) -> str:
    """The kernel that runs: ``requested`` unless it is ``"auto"`` or cannot take the inputs."""
    four_d = query.dim() == 4 and key.dim() == 4 and value.dim() == 4
    half = query.dtype in (torch.float16, torch.bfloat16)
    head = query.shape[-1] if query.dim() else 0
    flash_ok = sm >= 80 and four_d and half and attn_mask is None and head <= 256 and head % 8 == 0
    efficient_ok = sm >= 50 and four_d and query.dtype in (torch.float32, *_HALF)
    if requested == "cpu-flash":
        return "cpu-flash" if four_d else "math"
    if requested == "flash":
        return "flash" if flash_ok else ("efficient" if efficient_ok else "math")
    if requested == "efficient":
        return "efficient" if efficient_ok else "math"
    if requested == "math":
        return "math"
    if flash_ok:
        return "flash"
    return "efficient" if efficient_ok else "math"


_HALF = (torch.float16, torch.bfloat16)


def _blhd(like: torch.Tensor, dim: int) -> torch.Tensor:
    """A ``B x H x L x dim`` tensor laid out as ``B x L x H x dim``, as the kernels allocate."""
    batch, heads, length = like.shape[0], like.shape[1], like.shape[2]
    return like.new_empty((batch, length, heads, dim)).transpose(1, 2)


class _FusedAttention(torch.autograd.Function):
    """Allocates what a fused attention kernel allocates; computes nothing meaningful."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kernel: str,
        needs_grad: bool,
    ) -> torch.Tensor:
        batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
        out = _blhd(query, value.shape[-1])
        lse: torch.Tensor | None = None
        if kernel in ("flash", "cpu-flash") or needs_grad:
            lse_len = length if kernel != "efficient" else _round_up(length, 32)
            lse = query.new_empty((batch, heads, lse_len), dtype=torch.float32)
        ctx.kernel = kernel
        if needs_grad:
            ctx.save_for_backward(query, key, value, out, lse)
        else:
            del lse
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, _out, _lse = ctx.saved_tensors
        batch, heads, length, dim = query.shape
        grad_q = _blhd(query, query.shape[-1])
        grad_k = _blhd(key, key.shape[-1])
        grad_v = _blhd(value, value.shape[-1])
        if ctx.kernel == "cpu-flash":
            pass
        elif ctx.kernel == "flash":
            len_r = _round_up(length, 128)
            dim_r = _round_up(dim, 32 if dim <= 128 else 64)
            accum = query.new_empty((batch, len_r, heads, dim_r), dtype=torch.float32)
            softmax_d = query.new_empty((batch, heads, len_r), dtype=torch.float32)
            del accum, softmax_d
        else:
            delta = query.new_empty((batch, heads, length), dtype=torch.float32)
            accum = (
                query.new_empty(query.shape, dtype=torch.float32) if query.dtype in _HALF else None
            )
            del delta, accum
        return grad_q, grad_k, grad_v, None, None


def fused_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel: str
) -> torch.Tensor:
    """The output of a fused attention kernel (``"flash"`` or ``"efficient"``), on meta.

    Grouped-query attention (fewer key/value heads) is handled: the kernels broadcast heads,
    so only ``query``'s heads shape the output and the temporaries.
    """
    if kernel not in ("flash", "efficient", "cpu-flash"):
        raise ValueError(f"kernel must be 'flash', 'efficient' or 'cpu-flash', found {kernel!r}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = _FusedAttention.apply(query, key, value, kernel, needs_grad)
    assert isinstance(out, torch.Tensor)
    return out
