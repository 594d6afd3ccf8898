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

from memkit._version import __version__

_LAZY: dict[str, str] = {
    "simulate": "memkit.simulated",
    "MemoryAccountant": "memkit.simulated.accountant",
    "get_backend": "memkit.devices",
    "is_oom": "memkit.oom",
    "recover": "memkit.oom",
    "parse_size": "memkit.units",
    "format_size": "memkit.units",
    "MemkitError": "memkit.errors",
    "ConfigError": "memkit.errors",
    "probe": "memkit.probing.runner",
    "probe_file": "memkit.probing.runner",
    "ProbeResult": "memkit.probing.result",
    "find_batch_size": "memkit.probing.decorator",
    "snapshot": "memkit.snapshots",
    "track": "memkit.tracking",
    "Tracker": "memkit.tracking",
    "TrackReport": "memkit.tracking",
    "OomPostMortem": "memkit.tracking",
    "estimate": "memkit.estimation",
    "Estimate": "memkit.estimation",
    "microbatch": "memkit.microbatching",
    "MicroBatchStep": "memkit.microbatching",
    "Snapshot": "memkit.snapshots",
    "SnapshotDiff": "memkit.snapshots",
    "inspect_snapshot": "memkit.inspection",
    "SnapshotInspection": "memkit.inspection",
}

__all__ = [
    "ConfigError",
    "Estimate",
    "MemkitError",
    "MemoryAccountant",
    "MicroBatchStep",
    "OomPostMortem",
    "ProbeResult",
    "Snapshot",
    "SnapshotDiff",
    "SnapshotInspection",
    "TrackReport",
    "Tracker",
    "__version__",
    "estimate",
    "find_batch_size",
    "format_size",
    "get_backend",
    "inspect_snapshot",
    "is_oom",
    "microbatch",
    "parse_size",
    "probe",
    "probe_file",
    "recover",
    "simulate",
    "snapshot",
    "track",
]

if TYPE_CHECKING:
    from memkit.devices import get_backend
    from memkit.errors import ConfigError, MemkitError
    from memkit.estimation import Estimate, estimate
    from memkit.inspection import SnapshotInspection, inspect_snapshot
    from memkit.microbatching import MicroBatchStep, microbatch
    from memkit.oom import is_oom, recover
    from memkit.probing.decorator import find_batch_size
    from memkit.probing.result import ProbeResult
    from memkit.probing.runner import probe, probe_file
    from memkit.simulated import MemoryAccountant, simulate
    from memkit.snapshots import Snapshot, SnapshotDiff, snapshot
    from memkit.tracking import OomPostMortem, Tracker, TrackReport, track
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
