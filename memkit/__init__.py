"""memkit: measure, explain and fix PyTorch out-of-memory errors.

``import memkit`` is cheap: it imports neither torch nor CUDA. Each public name below is loaded
on first use.

Examples:
    >>> import memkit
    >>> with memkit.simulate("512MiB", device="cpu") as acct:  # a 512 MiB device on any machine
    ...     pass
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "simulate": "memkit.accounting",
    "MemoryAccountant": "memkit.accounting",
    "get_backend": "memkit.devices",
    "is_oom": "memkit.oom",
    "recover": "memkit.oom",
    "parse_size": "memkit.units",
    "format_size": "memkit.units",
    "MemkitError": "memkit.errors",
}

__all__ = [
    "MemkitError",
    "MemoryAccountant",
    "__version__",
    "format_size",
    "get_backend",
    "is_oom",
    "parse_size",
    "recover",
    "simulate",
]

if TYPE_CHECKING:
    from memkit.accounting import MemoryAccountant, simulate
    from memkit.devices import get_backend
    from memkit.errors import MemkitError
    from memkit.oom import is_oom, recover
    from memkit.units import format_size, parse_size


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
