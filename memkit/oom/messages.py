"""The table of OOM message fragments, and matching text against it.

Only :class:`RuntimeError` subclasses are matched (:mod:`memkit.oom.recognising` decides that);
this module holds the wording, each fragment with the library it comes from and where that
wording is produced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OomPattern:
    """One message fragment that identifies an OOM.

    Attributes:
        fragment: text searched for in the message (case-insensitive substring).
        source: the library that ran out: ``CUDA``, ``cuBLAS``, ``cuDNN``, ``CPU``, ``MPS``,
            ``XPU``, ``HIP`` or ``NCCL``.
        origin: where PyTorch (or the library) produces this wording.
        ambiguous: the same wording is also produced by errors that are not OOMs.
    """

    fragment: str
    source: str
    origin: str
    ambiguous: bool = False


OOM_MESSAGE_FRAGMENTS: tuple[OomPattern, ...] = (
    # --- cuBLAS / cuDNN: allocation failures inside the libraries, raised as plain RuntimeError.
    OomPattern(
        "CUBLAS_STATUS_ALLOC_FAILED",
        "cuBLAS",
        "TORCH_CUDABLAS_CHECK in aten/src/ATen/cuda/Exceptions.h: 'CUDA error: "
        "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`' (handle creation in "
        "CublasHandlePool.cpp needs device memory; also seen from cublasLt workspaces)",
    ),
    OomPattern(
        "CUDNN_STATUS_ALLOC_FAILED",
        "cuDNN",
        "AT_CUDNN_CHECK in aten/src/ATen/cudnn/Exceptions.h: 'cuDNN error: "
        "CUDNN_STATUS_ALLOC_FAILED'",
    ),
    OomPattern(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
        "cuDNN",
        "AT_CUDNN_CHECK: 'cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you "
        "passed in a non-contiguous input.' cuDNN reports a failed workspace allocation this way "
        "(commonly an OOM on large convolutions), but also genuinely unsupported configurations; "
        "matched only with the 'cuDNN error: ' prefix (PyTorch <= 0.4 wording is not matched)",
        ambiguous=True,
    ),
    # --- NCCL: collectives that cannot allocate buffers. torch appends ncclGetLastError() to
    # the DistBackendError message ('Last error:'), and NCCL logs the same text as NCCL WARN.
    OomPattern(
        "Cuda failure 'out of memory'",
        "NCCL",
        "NCCL CUDACHECK (src/include/checks.h): WARN(\"Cuda failure '%s'\", "
        "cudaGetErrorString(err)) for cudaErrorMemoryAllocation",
    ),
    OomPattern(
        "Cuda failure 2 'out of memory'",
        "NCCL",
        "NCCL CUCHECK (src/include/checks.h): WARN(\"Cuda failure %d '%s'\", err, errStr) for "
        "CUDA_ERROR_OUT_OF_MEMORY (= 2)",
    ),
    # --- Apple MPS: TORCH_CHECK, so a plain RuntimeError, not torch.OutOfMemoryError.
    OomPattern(
        "MPS backend out of memory",
        "MPS",
        "aten/src/ATen/mps/MPSAllocator.mm: 'MPS backend out of memory (MPS allocated: ..., "
        "other allocations: ..., max allowed: ...). Tried to allocate ... on private pool.'",
    ),
    # --- Intel XPU: torch.OutOfMemoryError from c10/xpu/XPUCachingAllocator.cpp; intel
    # extension for pytorch (IPEX) raised it as RuntimeError with the older CUDA-like wording.
    OomPattern(
        "XPU out of memory",
        "XPU",
        "c10/xpu/XPUCachingAllocator.cpp: 'XPU out of memory. Tried to allocate'; IPEX: "
        "'XPU out of memory. Tried to allocate ... (GPU 0; ... total capacity; ...)'",
    ),
    # --- AMD ROCm: the CUDA sources are hipified, so the CUDA wordings appear with HIP.
    OomPattern(
        "HIP out of memory",
        "HIP",
        "hipified c10/cuda/CUDACachingAllocator.cpp on ROCm builds: 'HIP out of memory. Tried "
        "to allocate'",
    ),
    OomPattern(
        "HIP error: out of memory",
        "HIP",
        "hipErrorOutOfMemory via C10_HIP_CHECK (hipified C10_CUDA_CHECK): 'HIP error: out of "
        "memory'",
    ),
    OomPattern(
        "hipErrorOutOfMemory",
        "HIP",
        "C10_HIP_CHECK hint in newer ROCm builds: \"Search for `hipErrorOutOfMemory' in "
        'https://rocm.docs.amd.com/..."',
    ),
    # --- host memory: c10/core/impl/alloc_cpu.cpp (CAFFE_ENFORCE -> RuntimeError).
    OomPattern(
        "DefaultCPUAllocator: can't allocate memory",
        "CPU",
        "c10/core/impl/alloc_cpu.cpp (posix_memalign failed): 'DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)'",
    ),
    OomPattern(
        "DefaultCPUAllocator: not enough memory",
        "CPU",
        "c10/core/impl/alloc_cpu.cpp on Windows (_aligned_malloc), Android and mimalloc builds: "
        "'DefaultCPUAllocator: not enough memory: you tried to allocate N bytes.'",
    ),
    # --- CUDA itself. Checked last: the library-specific fragments above are more precise.
    OomPattern(
        "CUDA out of memory",
        "CUDA",
        "c10/cuda/CUDACachingAllocator.cpp: TORCH_CHECK_WITH(OutOfMemoryError, ..., 'CUDA out "
        "of memory. Tried to allocate'); a plain RuntimeError before torch 1.13, and the text "
        "survives when the exception is re-raised or stringified",
    ),
    OomPattern(
        "CUDA error: out of memory",
        "CUDA",
        "cudaErrorMemoryAllocation via C10_CUDA_CHECK (c10/cuda/CUDAException.h): 'CUDA error: "
        "out of memory' (torch.AcceleratorError from torch 2.8; e.g. context creation, "
        "cudaMalloc outside the caching allocator)",
    ),
    OomPattern(
        "CUDA driver error: out of memory",
        "CUDA",
        "CUDA_ERROR_OUT_OF_MEMORY via C10_CUDA_DRIVER_CHECK (c10/cuda/driver_api.h), e.g. "
        "cuMemCreate for PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    OomPattern(
        "cuda runtime error (2) : out of memory",
        "CUDA",
        "THCudaCheck in PyTorch <= 0.4 (THC): 'cuda runtime error (2) : out of memory at "
        ".../THCStorage.cu'",
    ),
)
"""Message fragments that identify an OOM, in precedence order (the first match wins).

Matching is a case-insensitive substring search, applied only to ``RuntimeError`` subclasses.
``ambiguous=True`` marks wording that non-OOM errors also produce (cuDNN's
``CUDNN_STATUS_NOT_SUPPORTED``): memkit treats it as an OOM, so a caller that must be sure (a
batch-size search) can retry smaller and report the ambiguity if the error persists.
"""

_LOWERED: tuple[tuple[str, OomPattern], ...] = tuple(
    (p.fragment.lower(), p) for p in OOM_MESSAGE_FRAGMENTS
)


def match_oom_message(message: str) -> OomPattern | None:
    """Return the first :data:`OOM_MESSAGE_FRAGMENTS` entry found in ``message``, or ``None``.

    This looks at text only (for logs, or errors gathered from other ranks as strings); for an
    exception use :func:`is_oom`, which also checks the type.
    """
    lowered = message.lower()
    for fragment, pattern in _LOWERED:
        if fragment in lowered:
            return pattern
    return None


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or ``""`` when its ``__str__`` raises."""
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not turn into a second error
        return ""
