"""cuBLAS and cuBLASLt workspaces: device memory a GPU step holds that no tensor shows.

PyTorch gives each (cuBLAS handle, stream) pair a workspace from the caching allocator at the
handle's first use (``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``setWorkspaceForHandle``, called
by ``getCurrentCUDABlasHandle``) and keeps it in a map that ``empty_cache()`` does not free.
Handles are per thread: the forward runs on the Python thread, backward on autograd's device
thread, so a training step holds two. Its size is ``CUBLAS_WORKSPACE_CONFIG``'s, by default
``:4096:2:16:8`` (8.125 MiB), 32 MiB on sm90 (the family's ``cublas_workspace_bytes``).

A reduced ``mse_loss``, ``smooth_l1_loss``, ``soft_margin_loss`` or ``binary_cross_entropy``
is 0-d but keeps an input-sized storage on every device: ``Loss.cpp``'s structured meta
functions build the unreduced output and ``resize_({})`` it (mse, smooth L1; CPU and CUDA share
them), ``soft_margin_loss`` reduces into its ``neg_out`` output the same way, and CUDA's
``binary_cross_entropy_out_cuda`` ``resize_as_``-es its ``empty_like(input)`` loss. The meta
kernels return a fresh 0-d tensor instead, so :class:`KernelWorkspaces` gives such a loss its
input-sized storage (the loss is kept through backward: a step's peak may hold it).

``torch._grouped_mm`` (a mixture of experts' batched expert matmuls, transformers 5's default
``grouped_mm`` experts) has a meta kernel that takes bf16 only, where CUDA runs other dtypes
through ``_grouped_mm_fallback`` (one ``mm`` per group into the output): for those,
:class:`KernelWorkspaces` makes the output as ``create_grouped_gemm_output_tensor`` does (its
last dimension's stride padded to 16 bytes), which is all that the fallback allocates.

``addmm`` with a 1-D bias (``nn.Linear`` with a bias) runs through cuBLASLt (``Blas.cpp``:
``useLtInterface``). Unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``, ``getCUDABlasLtWorkspace``
allocates a second, separate workspace per (handle, stream) of ``CUBLASLT_WORKSPACE_SIZE`` KiB,
1024 by default (capped at the cuBLAS workspace). 1 MiB is a small-pool request.

:class:`KernelWorkspaces` watches the aten ops of a meta step and allocates each workspace in
the allocator model the first time its thread would create it. Given ``device_of``, it keeps
them per device as well (the handles are per device and thread): the ``--gpus`` comparison of
``memkit estimate`` gives each virtual GPU its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CUBLASLT_WORKSPACE_BYTES", "CUBLAS_OPS", "KernelWorkspaces", "uses_cublaslt"]

CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
"""PyTorch's default ``CUBLASLT_WORKSPACE_SIZE`` (1024 KiB) on CUDA."""

CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
                        "_addmm_activation"})  # fmt: skip
"""aten ops whose CUDA kernels call cuBLAS through the current thread's handle."""

_LT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_REDUCED_LOSSES = {"mse_loss": 2, "smooth_l1_loss": 2, "soft_margin_loss": 2,
                   "binary_cross_entropy": 3}  # fmt: skip
"""Losses whose reduced (0-d) result keeps an input-sized storage: the position of their
``reduction`` argument (see the module docstring)."""


def _input_sized_loss(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """``out`` as the kernel leaves it: for a reduced loss of :data:`_REDUCED_LOSSES`, the same
    0-d value on a storage the size of its (broadcast) inputs; else ``out`` itself."""
    where = _REDUCED_LOSSES.get(name)
    if where is None or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out
    reduction = kwargs.get("reduction", args[where] if len(args) > where else 1)
    inputs = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if reduction == 0 or len(inputs) < 2:
        return out
    shape = torch.broadcast_shapes(inputs[0].shape, inputs[1].shape)
    full = torch.empty(shape, dtype=out.dtype, device=out.device)
    return full.as_strided((), ())


def _grouped_mm_output(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The output CUDA's ``_grouped_mm`` makes for inputs the meta kernel refuses (not bf16),
    or ``None`` for what it takes (its own output then)."""
    mat_a, mat_b = args[0], args[1]
    if mat_a.dtype == torch.bfloat16 or not mat_a.is_meta or mat_a.dim() not in (2, 3):
        return None
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or mat_a.dtype
    a2d, b2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a2d and b2d:  # (groups, m, n)
        if offs is None:
            return None  # (torch's own error)
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a2d:  # tokens sorted by expert x (experts, k, n)
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b2d:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:  # a batched matmul
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    align = max(1, 16 // dtype.itemsize)
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if a2d == b2d else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def uses_cublaslt(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``addmm(bias, mat1, mat2)`` takes PyTorch's cuBLASLt path (``useLtInterface``):
    a contiguous 1-D bias as long as the output's rows, ``beta == 1``, a matrix ``mat2`` with
    both dimensions over 1, a floating dtype."""
    if name not in ("addmm", "_addmm_activation") or len(args) < 3:
        return False
    bias, _mat1, mat2 = args[:3]
    if not all(isinstance(t, torch.Tensor) for t in (bias, mat2)):
        return False
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    return (
        beta == 1
        and bias.dim() == 1
        and bias.is_contiguous()
        and mat2.dim() == 2
        and bias.shape[0] == mat2.shape[1]
        and mat2.shape[0] > 1
        and mat2.shape[1] > 1
        and bias.dtype in _LT_DTYPES
    )


class KernelWorkspaces(TorchDispatchMode):
    """Allocates the cuBLAS and cuBLASLt workspaces of each thread at its first use.

    Args:
        allocate: ``allocate(key, nbytes)``, the allocator model's ``malloc``.
        cublas_bytes: one cuBLAS workspace (``0``: no workspaces at all).
        cublaslt_bytes: one cuBLASLt workspace (capped at ``cublas_bytes``, as PyTorch does).
        device_of: the device an op ran on, from its output (``None``: one device); the
            workspaces are then keyed by it too, and ``allocate`` gets it as the key's last item.

    Attributes:
        allocated: bytes of the workspaces created so far.
        created: their keys, ``("cublas" | "cublaslt", "forward" | "backward")`` (and the
            device, with ``device_of``).
    """

    def __init__(
        self,
        allocate: Callable[[Hashable, int], None],
        cublas_bytes: int,
        cublaslt_bytes: int = CUBLASLT_WORKSPACE_BYTES,
        device_of: Callable[[Any], Hashable] | None = None,
    ) -> None:
        super().__init__()
        self._allocate = allocate
        self.cublas_bytes = cublas_bytes
        self.cublaslt_bytes = min(cublaslt_bytes, cublas_bytes)
        self._device_of = device_of
        self.allocated = 0
        self.created: list[tuple[Hashable, ...]] = []

    def _ensure(self, key: tuple[Hashable, ...], nbytes: int) -> None:
        if nbytes <= 0 or key in self.created:
            return
        self.created.append(key)
        self.allocated += nbytes
        self._allocate(("workspace", *key), nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = _grouped_mm_output(args, kwargs) if name == "_grouped_mm" else None
        if out is None:
            out = func(*args, **kwargs)
        if name in _REDUCED_LOSSES:
            return _input_sized_loss(name, args, kwargs, out)
        if name in CUBLAS_OPS and self.cublas_bytes:
            # autograd's engine runs backward on its own thread on a GPU (here: a node is set)
            thread = "forward" if torch._C._current_autograd_node() is None else "backward"
            where = () if self._device_of is None else (self._device_of(out),)
            self._ensure(("cublas", thread, *where), self.cublas_bytes)
            if uses_cublaslt(name, args, kwargs):
                self._ensure(("cublaslt", thread, *where), self.cublaslt_bytes)
        return out
