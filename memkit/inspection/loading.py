"""Reading a memory snapshot safely: a pickle of dicts, lists, strings and numbers (every class
is refused), or the same data already in memory, checked to be a memory snapshot."""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path
from typing import Any

from memkit.errors import ConfigError

__all__ = ["load_snapshot", "normalise"]


class _Refused(Exception):
    """The pickle asked for a class: not a memory snapshot."""


class _SnapshotUnpickler(pickle.Unpickler):
    """Builds only dicts, lists, tuples, strings and numbers; refuses every class."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id (torch.save's storages)")


_EXPECTED = (
    "expected a PyTorch memory snapshot: the pickle torch.cuda.memory._dump_snapshot() writes, "
    "or memkit run --memory-history FILE"
)


def load_snapshot(path: str | Path) -> tuple[dict[str, Any], int | None]:
    """Read a snapshot pickle: ``(snapshot, pickle protocol)``.

    Raises:
        ConfigError: no such file, not a pickle, a pickle of something else, a protocol this
            Python cannot read; the message says which and what was expected (exit 2).
    """
    path = Path(path)
    where = str(path)
    if not path.exists():
        raise ConfigError(f"{where!r}: no such file; {_EXPECTED}")
    if path.is_dir():
        raise ConfigError(f"{where!r} is a folder; {_EXPECTED}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where!r}: cannot be read ({exc.strerror or exc}); {_EXPECTED}"
        ) from None
    if not data:
        raise ConfigError(f"{where!r} is empty; {_EXPECTED}")
    if data[:4] == b"PK\x03\x04":
        raise ConfigError(
            f"{where!r} is a zip archive (what torch.save writes), not a pickled snapshot; "
            f"{_EXPECTED}"
        )
    protocol = data[1] if data[0] == 0x80 and len(data) > 1 else None
    try:
        loaded = _SnapshotUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise ConfigError(
            f"{where!r} is a pickle of other objects (it names {exc}); a memory snapshot holds "
            f"only dicts, lists, strings and numbers, and memkit loads nothing else (unpickling "
            f"objects can run code); {_EXPECTED}"
        ) from None
    except ValueError as exc:
        if protocol is not None and protocol > pickle.HIGHEST_PROTOCOL:
            raise ConfigError(
                f"{where!r} is pickle protocol {protocol}, newer than this Python "
                f"({sys.version.split()[0]}) reads (up to {pickle.HIGHEST_PROTOCOL}); inspect it "
                "with the Python that wrote it, or have it saved with protocol 4"
            ) from None
        raise ConfigError(f"{where!r} is not a readable pickle ({exc}); {_EXPECTED}") from None
    except Exception as exc:  # UnpicklingError, EOFError, and whatever garbage bytes cause
        raise ConfigError(
            f"{where!r} is not a pickle (or a truncated one: {type(exc).__name__}: "
            f"{str(exc)[:200]}); {_EXPECTED}"
        ) from None
    return normalise(loaded, where), protocol


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        keys = sorted(map(str, value))[:8]
        return f"a dict with keys {keys}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"a {type(value).__name__}"


def normalise(data: Any, where: str) -> dict[str, Any]:
    """The snapshot as ``{"segments": [...], "device_traces": [[...], ...], ...}``; a list of
    segments (``torch.cuda.memory_snapshot()``, older dumps) is accepted, as memory_viz does."""
    if isinstance(data, list) and all(isinstance(s, dict) and "blocks" in s for s in data):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise ConfigError(
            f"{where!r} holds {_describe(data)}, not a memory snapshot ('segments' and "
            f"'device_traces'); {_EXPECTED}"
        )
    segments = data["segments"]
    traces = data.get("device_traces", data.get("traces", []))
    if not isinstance(segments, list) or not all(
        isinstance(s, dict) and isinstance(s.get("blocks"), list) for s in segments
    ):
        raise ConfigError(
            f"{where!r}: 'segments' should be a list of segments with 'blocks', found "
            f"{_describe(segments)}; {_EXPECTED}"
        )
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ConfigError(
            f"{where!r}: 'device_traces' should be a list with one list of events per device, "
            f"found {_describe(traces)}; {_EXPECTED}"
        )
    for i, seg in enumerate(segments):
        if not _count(seg.get("total_size")):
            raise ConfigError(
                f"{where!r}: segment {i}'s 'total_size' is not a non-negative integer; {_EXPECTED}"
            )
        for b in seg["blocks"]:
            if not isinstance(b, dict) or not _count(b.get("size")):
                raise ConfigError(
                    f"{where!r}: segment {i} has a block whose 'size' is not a non-negative "
                    f"integer; {_EXPECTED}"
                )
            if b.get("state", "inactive") not in _BLOCK_STATES:
                raise ConfigError(
                    f"{where!r}: segment {i} has a block in state {b['state']!r}, not one of "
                    f"PyTorch's ({', '.join(_BLOCK_STATES)}); {_EXPECTED}"
                )
    for d, trace in enumerate(traces):
        for e in trace:
            if not isinstance(e, dict) or not isinstance(e.get("action"), str):
                raise ConfigError(
                    f"{where!r}: device {d}'s trace has an event without an 'action'; {_EXPECTED}"
                )
            bad = [k for k in ("addr", "size") if not _count(e.get(k, 0))]
            if bad:
                raise ConfigError(
                    f"{where!r}: device {d}'s trace has a {e['action']!r} event whose "
                    f"{' and '.join(repr(k) for k in bad)} is not a non-negative integer; "
                    f"{_EXPECTED}"
                )
    for i, seg in enumerate(segments):
        if not _count(seg.get("device", 0)):
            raise ConfigError(
                f"{where!r}: segment {i}'s 'device' is not a non-negative integer; {_EXPECTED}"
            )
    return {**data, "segments": segments, "device_traces": traces}


_BLOCK_STATES = ("active_allocated", "active_awaiting_free", "active_pending_free", "inactive")
"""A block's states in ``torch.cuda.memory._snapshot()``: its C++ writes
``active_pending_free``, its type hints say ``active_awaiting_free``; both are accepted."""


def _count(value: Any) -> bool:
    """A non-negative integer (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
