"""Host memory (psutil): this process's RSS and the machine's RAM, and the simulated cpu
device's default size, which must fit in that RAM."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_BUDGET = 1024**3
"""The simulated cpu device's size when no budget is given: a modest device (1 GiB), so a
probe without --budget ends in seconds, not minutes and gigabytes of RAM."""
DEFAULT_CPU_BUDGET_SHARE = 0.5
"""Share of available RAM the default simulated cpu device is capped at, on a small machine."""


@dataclass(frozen=True)
class HostMemory:
    """Host RAM as psutil sees it. Values are ``None`` with a ``reason`` when unavailable."""

    process_rss: int | None
    available: int | None
    total: int | None
    reason: str | None = None


def host_memory() -> HostMemory:
    """This process's resident memory and the machine's available and total RAM."""
    try:
        import psutil
    except ImportError as exc:
        return HostMemory(None, None, None, f"psutil is not importable: {exc}")
    vm = psutil.virtual_memory()
    return HostMemory(int(psutil.Process().memory_info().rss), int(vm.available), int(vm.total))


def default_cpu_budget() -> int:
    """The simulated cpu device's default size: 1 GiB, or half the available RAM if less."""
    available = host_memory().available
    if available is None:
        return DEFAULT_CPU_BUDGET
    return min(DEFAULT_CPU_BUDGET, int(available * DEFAULT_CPU_BUDGET_SHARE))
