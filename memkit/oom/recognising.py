"""Whether an exception is an OOM: the type first, then the message (see :mod:`memkit.oom`).

Also walks an exception's chain (``__cause__``, ``__context__``, group members) to find an OOM
wrapped in another error. Never imports torch.
"""

from __future__ import annotations

import builtins
import sys
from collections import deque
from collections.abc import Iterator

from memkit.errors import MemkitError
from memkit.oom.messages import exception_text, match_oom_message

MAX_CHAIN = 64
"""At most this many exceptions of one chain are examined (guards against pathological chains)."""

TYPE_SOURCE = "torch.OutOfMemoryError"
"""What :func:`oom_source` returns when the exception type alone decided."""

MEMORY_ERROR_SOURCE = "MemoryError"
"""What :func:`oom_source` returns for Python's own :class:`MemoryError`."""


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


def _source_of(exc: BaseException) -> str | None:
    """The source that makes ``exc`` itself an OOM (no chain walking), or ``None``."""
    oom_types = _torch_oom_types()
    if oom_types and isinstance(exc, oom_types):
        return TYPE_SOURCE
    if isinstance(exc, MemoryError):
        return MEMORY_ERROR_SOURCE
    if isinstance(exc, RuntimeError) and not isinstance(exc, MemkitError):
        pattern = match_oom_message(exception_text(exc))
        if pattern is not None:
            return pattern.source
    return None


_EXCEPTION_GROUP: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),) if isinstance(t, type)
)


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
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
    for candidate in exception_chain(exc):
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
