"""Reading the numbers out of an OOM message: :func:`parse_oom_message` -> :class:`OomDetails`."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from memkit.oom.messages import exception_text

log = logging.getLogger(__name__)


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
    text = message if isinstance(message, str) else exception_text(message)
    try:
        values = {name: _find_size(text, patterns) for name, patterns in _FIELDS.items()}
        device = _DEVICE.search(text)
    except Exception:  # pragma: no cover - regexes on a str do not raise; belt and braces
        log.debug("could not parse OOM message %r", text, exc_info=True)
        return OomDetails()
    allocated = values["allocated_by_pytorch"]
    if allocated is not None:
        if values["reserved_unallocated"] is None and values["reserved_total"] is not None:
            values["reserved_unallocated"] = max(0, values["reserved_total"] - allocated)
        elif values["reserved_total"] is None and values["reserved_unallocated"] is not None:
            values["reserved_total"] = allocated + values["reserved_unallocated"]
    return OomDetails(**values, device_index=None if device is None else int(device.group(1)))
