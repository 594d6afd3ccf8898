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

This module never imports torch: if torch is not imported yet, no exception can be a
``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import builtins
import gc
import logging
import re
import sys
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from types import TracebackType
from typing import Protocol

from memkit.errors import MemkitError

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

logger = logging.getLogger(__name__)

MAX_CHAIN = 64
"""At most this many exceptions of one chain are examined (guards against pathological chains)."""

TYPE_SOURCE = "torch.OutOfMemoryError"
"""What :func:`oom_source` returns when the exception type alone decided."""

MEMORY_ERROR_SOURCE = "MemoryError"
"""What :func:`oom_source` returns for Python's own :class:`MemoryError`."""


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


# --------------------------------------------------------------------------------------------
# classification


def _torch_oom_types() -> tuple[type[BaseException], ...]:
    """``torch.OutOfMemoryError`` if torch is already imported; never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    found: list[type[BaseException]] = []
    for owner in (torch, getattr(torch, "cuda", None)):
        candidate = getattr(owner, "OutOfMemoryError", None)
        if isinstance(candidate, type) and issubclass(candidate, BaseException):
            found.append(candidate)
    return tuple(found)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not turn into a second error
        return ""


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


def _source_of(exc: BaseException) -> str | None:
    """The source that makes ``exc`` itself an OOM (no chain walking), or ``None``."""
    oom_types = _torch_oom_types()
    if oom_types and isinstance(exc, oom_types):
        return TYPE_SOURCE
    if isinstance(exc, MemoryError):
        return MEMORY_ERROR_SOURCE
    if isinstance(exc, RuntimeError) and not isinstance(exc, MemkitError):
        pattern = match_oom_message(_message(exc))
        if pattern is not None:
            return pattern.source
    return None


_EXCEPTION_GROUP: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),) if isinstance(t, type)
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then its causes, contexts and group members: breadth first, each once, bounded."""
    seen: set[int] = set()
    queue: deque[BaseException] = deque([exc])
    while queue and len(seen) < MAX_CHAIN:
        current = queue.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                queue.append(linked)
        if isinstance(current, _EXCEPTION_GROUP):
            queue.extend(getattr(current, "exceptions", ()))


def find_oom(exc: BaseException) -> BaseException | None:
    """Return the first OOM in ``exc``'s chain (``exc`` itself first), or ``None``.

    The chain is ``__cause__`` and ``__context__`` (also when suppressed by ``from None``) and
    the members of exception groups, walked breadth first, each exception once, at most
    :data:`MAX_CHAIN` of them.

    Examples:
        >>> try:
        ...     try:
        ...         raise MemoryError()
        ...     except MemoryError as oom:
        ...         raise RuntimeError("step failed") from oom
        ... except RuntimeError as e:
        ...     wrapped = e
        >>> type(find_oom(wrapped)).__name__, is_oom(wrapped), is_oom(wrapped, follow_chain=True)
        ('MemoryError', False, True)
    """
    for candidate in _chain(exc):
        if _source_of(candidate) is not None:
            return candidate
    return None


def is_oom(exc: BaseException, *, follow_chain: bool = False) -> bool:
    """Whether ``exc`` is an out-of-memory error.

    Args:
        exc: any exception.
        follow_chain: also look through ``__cause__``/``__context__`` (see :func:`find_oom`).
            Off by default: an OOM wrapped in another error is reported as that error.

    Known ambiguity: ``cuDNN error: CUDNN_STATUS_NOT_SUPPORTED`` is treated as an OOM (cuDNN
    says this when its workspace allocation fails), although cuDNN also says it for genuinely
    unsupported configurations. See :data:`OOM_MESSAGE_FRAGMENTS`.

    Examples:
        >>> is_oom(RuntimeError("CUDA error: out of memory"))
        True
        >>> is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
        False
        >>> is_oom(ValueError("out of memory budget"))
        False
    """
    if follow_chain:
        return find_oom(exc) is not None
    return _source_of(exc) is not None


def oom_source(exc: BaseException, *, follow_chain: bool = False) -> str | None:
    """Which rule made ``exc`` an OOM, or ``None`` if it is not one.

    Returns ``"torch.OutOfMemoryError"`` when the type decided, ``"MemoryError"`` for Python's
    own, otherwise the ``source`` of the matching :class:`OomPattern` (``"CUDA"``, ``"cuBLAS"``,
    ``"cuDNN"``, ``"CPU"``, ``"MPS"``, ``"XPU"``, ``"HIP"``, ``"NCCL"``).
    """
    target = find_oom(exc) if follow_chain else exc
    return None if target is None else _source_of(target)


# --------------------------------------------------------------------------------------------
# parsing the numbers out of a message


@dataclass(frozen=True)
class OomDetails:
    """Numbers found in an OOM message, in bytes; ``None`` where the message does not say.

    PyTorch prints sizes rounded to two decimals (``"6.88 MiB"``), so values are exact only to
    that precision. ``reserved_unallocated`` and ``reserved_total`` are derived from each other
    and ``allocated_by_pytorch`` when the message gives only one of them.

    Attributes:
        tried_to_allocate: the request that failed.
        capacity: total device memory (memkit's simulated device: its budget).
        free: free device memory as the driver reported it.
        allocated_by_pytorch: held by tensors ("already allocated"; memkit: "in use").
        reserved_unallocated: cached by the allocator but not in tensors.
        reserved_total: everything the allocator holds (allocated + cached).
        process_in_use: this process's total use, including non-PyTorch memory (CUDA context).
        allowed: the cap set by ``set_per_process_memory_fraction`` or MPS's high watermark.
        device_index: the ``GPU N`` the message names.
    """

    tried_to_allocate: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated_by_pytorch: int | None = None
    reserved_unallocated: int | None = None
    reserved_total: int | None = None
    process_in_use: int | None = None
    allowed: int | None = None
    device_index: int | None = None

    def held(self, now: int = 0) -> int:
        """Bytes held when the request failed: the allocator's whole reservation, else what
        tensors held; at least ``now``, a reading taken before unwinding freed anything."""
        return max(self.reserved_total or 0, self.allocated_by_pytorch or 0, now)

    def needed_at_least(self, now: int = 0) -> int | None:
        """A lower bound of the memory the failed attempt needed: :meth:`held` plus the
        request that failed; ``None`` when the message does not give the request.

        Examples:
            >>> OomDetails(tried_to_allocate=20, allocated_by_pytorch=90).needed_at_least()
            110
        """
        if self.tried_to_allocate is None:
            return None
        return self.held(now) + self.tried_to_allocate


# PyTorch's format_size prints binary multiples; the MPS allocator labels them "KB/MB/GB", so
# here those are binary too (unlike memkit.units.parse_size, which reads "GB" as 10**9).
_FACTORS: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1024,
    "kib": 1024,
    "mb": 1024**2,
    "mib": 1024**2,
    "gb": 1024**3,
    "gib": 1024**3,
    "tb": 1024**4,
    "tib": 1024**4,
}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes?|[kmgt]i?b|b)\b"


def _size_patterns(*templates: str) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(t.replace("{SIZE}", _SIZE), re.IGNORECASE) for t in templates)


_FIELDS: dict[str, tuple[re.Pattern[str], ...]] = {
    "tried_to_allocate": _size_patterns(r"tried to allocate {SIZE}"),
    "capacity": _size_patterns(
        r"total capaci?ty of {SIZE}",  # "capacty": the typo in torch 2.1-2.2
        r"{SIZE} total capacity",
        r"{SIZE} budget\b",
    ),
    "free": _size_patterns(r"of which {SIZE} is free", r"{SIZE} free\b"),
    "allocated_by_pytorch": _size_patterns(
        r"{SIZE} is allocated by pytorch",
        r"{SIZE} already allocated",
        r"{SIZE} in use by tensors memkit counts",
        r"MPS allocated: {SIZE}",
    ),
    "reserved_unallocated": _size_patterns(
        r"{SIZE} is reserved by pytorch but unallocated",
        r"{SIZE} cached\)",  # torch <= 1.3: cached = reserved - allocated
    ),
    "reserved_total": _size_patterns(r"{SIZE} reserved in total by pytorch"),
    "process_in_use": _size_patterns(r"this process has {SIZE} memory in use"),
    "allowed": _size_patterns(r"{SIZE} allowed;", r"max allowed: {SIZE}"),
}
_DEVICE = re.compile(r"\bGPU\s*(\d+)\b")


def _to_bytes(number: str, unit: str) -> int | None:
    factor = _FACTORS.get(unit.lower())
    if factor is None:
        return None
    try:
        return int((Decimal(number) * factor).to_integral_value(rounding=ROUND_HALF_EVEN))
    except InvalidOperation:
        return None


def _find_size(message: str, patterns: tuple[re.Pattern[str], ...]) -> int | None:
    for pattern in patterns:
        match = pattern.search(message)
        if match is not None:
            return _to_bytes(match.group(1), match.group(2))
    return None


def parse_oom_message(message: str | BaseException) -> OomDetails:
    """Read the sizes out of an OOM message; never raises, unknown fields are ``None``.

    Understands the CUDA/HIP/XPU caching allocator's current wording ("GPU 0 has a total
    capacity of ... of which ... is free"), its older one ("(GPU 0; ... total capacity; ...
    already allocated; ... free; ... reserved in total by PyTorch)", and the even older
    "... cached)"), memkit's simulated device ("... budget, ... in use by tensors memkit counts,
    ... free"), the MPS allocator's and the CPU allocator's ("you tried to allocate N bytes").
    An exception may be passed instead of its message.

    Examples:
        >>> d = parse_oom_message("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; "
        ...     "15.78 GiB total capacity; 12.96 GiB already allocated; 1.07 GiB free; "
        ...     "13.38 GiB reserved in total by PyTorch)")
        >>> d.tried_to_allocate, d.device_index
        (20971520, 0)
    """
    text = message if isinstance(message, str) else _message(message)
    try:
        values = {name: _find_size(text, patterns) for name, patterns in _FIELDS.items()}
        device = _DEVICE.search(text)
    except Exception:  # pragma: no cover - regexes on a str do not raise; belt and braces
        logger.debug("could not parse OOM message %r", text, exc_info=True)
        return OomDetails()
    allocated = values["allocated_by_pytorch"]
    if allocated is not None:
        if values["reserved_unallocated"] is None and values["reserved_total"] is not None:
            values["reserved_unallocated"] = max(0, values["reserved_total"] - allocated)
        elif values["reserved_total"] is None and values["reserved_unallocated"] is not None:
            values["reserved_total"] = allocated + values["reserved_unallocated"]
    return OomDetails(**values, device_index=None if device is None else int(device.group(1)))


# --------------------------------------------------------------------------------------------
# recovering


class RecoverableBackend(Protocol):
    """What :func:`recover` needs of a backend (every ``memkit.devices.MemoryBackend`` has it)."""

    def empty_cache(self) -> None: ...
    def reset_peak(self) -> None: ...


def _forget_last_exception(chain: list[BaseException], tracebacks: list[TracebackType]) -> None:
    """Drop ``sys.last_*`` (set by the REPL, IPython, pdb) when they hold this exception."""
    cleared = False
    for name in ("last_value", "last_exc"):
        held = getattr(sys, name, None)
        if held is not None and any(held is e for e in chain):
            setattr(sys, name, None)
            cleared = True
    held_tb = getattr(sys, "last_traceback", None)
    if held_tb is not None and (cleared or any(held_tb is tb for tb in tracebacks)):
        setattr(sys, "last_traceback", None)  # noqa: B010 - typeshed types it non-optional
        cleared = True
    if cleared and hasattr(sys, "last_type"):
        setattr(sys, "last_type", None)  # noqa: B010


def _clear_tracebacks(exc: BaseException) -> None:
    """Step 1 of :func:`recover`; a function of its own so its locals are gone before gc."""
    chain = list(_chain(exc))
    tracebacks = [e.__traceback__ for e in chain if e.__traceback__ is not None]
    _forget_last_exception(chain, tracebacks)
    for tb in tracebacks:
        try:
            traceback.clear_frames(tb)
        except RuntimeError:  # clear_frames already skips executing frames; just in case
            logger.debug("could not clear every frame of %r", tb, exc_info=True)
    for member in chain:
        member.__traceback__ = None
    logger.debug("recover: cleared %d traceback(s) of %d exception(s)", len(tracebacks), len(chain))


def recover(backend: RecoverableBackend | None = None, exc: BaseException | None = None) -> None:
    """Release what a failed step held; call it AFTER the ``except`` block, not inside it.

    Steps, in order:

    1. if ``exc`` is given, for it and every exception in its chain (``__cause__``,
       ``__context__``, group members): ``traceback.clear_frames`` on its traceback, then
       ``__traceback__ = None``. Clearing a finished frame drops its locals, which is what frees
       the failed step's tensors. Frames still executing (the caller's own) cannot be cleared and
       are skipped. ``sys.last_value``/``last_exc``/``last_traceback`` (kept by the REPL and
       IPython) are reset when they point at this exception;
    2. ``gc.collect()``, for reference cycles (autograd graphs, closures);
    3. ``backend.empty_cache()`` then ``backend.reset_peak()``, if a backend is given.

    Inside the ``except`` block the exception is still being handled and Python keeps it (and so
    every frame and tensor) alive; that is why the pattern below keeps only a reference and
    recovers after. Delete your own reference afterwards too. Log or format the traceback
    *before* calling this: afterwards the exception has none, and its frames have no locals.

    Args:
        backend: any object with ``empty_cache()`` and ``reset_peak()``, typically a
            ``memkit.devices.MemoryBackend``; ``None`` skips step 3.
        exc: the OOM that was caught; ``None`` skips step 1.

    Examples:
        >>> def step(batch):
        ...     raise MemoryError("pretend the batch did not fit")
        >>> backend, batch = None, [1, 2, 3]
        >>> failed = None
        >>> try:
        ...     step(batch)
        ... except Exception as e:
        ...     if not is_oom(e): raise
        ...     failed = e
        >>> if failed is not None:
        ...     recover(backend, failed); del failed

        Or, with :func:`catch_oom`:

        >>> with catch_oom() as caught:
        ...     step(batch)
        >>> if caught.oom:
        ...     recover(backend, caught.take())
    """
    if exc is not None:
        _clear_tracebacks(exc)
    collected = gc.collect()
    logger.debug("recover: gc.collect() found %d unreachable object(s)", collected)
    if backend is not None:
        backend.empty_cache()
        backend.reset_peak()


@dataclass
class CaughtOom:
    """What :func:`catch_oom` caught: ``oom`` is the exception, or ``None`` if nothing failed."""

    oom: BaseException | None = None

    def take(self) -> BaseException | None:
        """Return the exception and forget it, so this holder keeps nothing alive."""
        exc, self.oom = self.oom, None
        return exc

    def __bool__(self) -> bool:
        return self.oom is not None


class _OomCatcher:
    def __init__(self, follow_chain: bool) -> None:
        self._follow_chain = follow_chain
        self._caught = CaughtOom()

    def __enter__(self) -> CaughtOom:
        return self._caught

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None or not is_oom(exc, follow_chain=self._follow_chain):
            return False  # nothing raised, or not an OOM: let it propagate untouched
        self._caught.oom = exc
        return True


def catch_oom(*, follow_chain: bool = False) -> _OomCatcher:
    """Context manager that swallows OOMs only; every other exception propagates untouched.

    It yields a :class:`CaughtOom`; after the block, ``caught.oom`` is the OOM or ``None``. With
    ``follow_chain=True`` an error that wraps an OOM is swallowed too, and ``caught.oom`` is the
    outer exception (so :func:`recover` clears the whole chain).

    Examples:
        >>> with catch_oom() as caught:
        ...     raise MemoryError()
        >>> type(caught.take()).__name__, caught.oom
        ('MemoryError', None)
    """
    return _OomCatcher(follow_chain)
