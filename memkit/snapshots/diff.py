"""What changed between two snapshots: :class:`Change` and :class:`SnapshotDiff`.

Layout in :mod:`memkit.render.snapshots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memkit.render import snapshots as layout
from memkit.results import Record, Result
from memkit.snapshots.results import CATEGORY_FIELDS, Snapshot
from memkit.units import format_size

__all__ = ["Change", "SnapshotDiff"]


@dataclass(frozen=True)
class Change(Record):
    """One value that differs between two snapshots.

    Attributes:
        where: ``"cuda:0"``, ``"host"``, ``"cuda:0 holds"`` (categories) or ``"tensor"``.
        what: the field (``"allocated"``) or, for tensors, the tensor's name.
        before: the earlier value (``None``: absent or unreadable).
        after: the later value.
        unit: ``"bytes"``, ``"%"``, ``"°C"`` or ``""`` (text).
    """

    where: str
    what: str
    before: Any
    after: Any
    unit: str = "bytes"

    @property
    def delta(self) -> int | float | None:
        """``after - before`` for numbers, else ``None``."""
        if isinstance(self.before, (int, float)) and isinstance(self.after, (int, float)):
            return self.after - self.before
        return None

    def format_value(self, value: Any) -> str:
        """A value in this change's unit (``"n/a"`` for ``None``)."""
        if value is None:
            return "n/a"
        if self.unit == "bytes":
            return format_size(value)
        if self.unit == "%":
            return f"{value:.0f}%"
        if self.unit == "°C":
            return f"{value:.0f} °C"
        return str(value)

    def format_delta(self) -> str:
        """The signed change, or ``"new"``/``"gone"``/``"changed"``."""
        delta = self.delta
        if delta is None:
            if self.before is None:
                return "new"
            if self.after is None:
                return "gone"
            return "changed"
        if self.unit == "bytes":
            return format_size(delta, signed=True)
        if self.unit in ("%", "°C"):
            return f"{delta:+.0f}{' °C' if self.unit == '°C' else '%'}"
        return f"{delta:+}"

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["delta"] = self.delta
        return out


_DEVICE_DIFF_FIELDS: tuple[tuple[str, str], ...] = (
    ("name", ""),
    ("total", "bytes"),
    ("used", "bytes"),
    ("allocated", "bytes"),
    ("reserved", "bytes"),
    ("peak_allocated", "bytes"),
    ("peak_reserved", "bytes"),
    ("utilization", "%"),
    ("temperature", "°C"),
)
_HOST_DIFF_FIELDS = (("process_rss", "process RSS"), ("available", "available"), ("total", "total"))


def _tensor_changes(before: Snapshot, after: Snapshot) -> list[Change]:
    """Tensors whose size changed, that appeared or that went, among the largest lists.

    A tensor missing from a full list that is smaller than everything on it may still be
    alive (it only fell out of the top), so it is not reported.
    """

    def off_list(snap: Snapshot, nbytes: int) -> bool:
        full = len(snap.tensors) >= snap.top
        return full and nbytes <= min(t.nbytes for t in snap.tensors)

    old_t = {t.key: t for t in before.tensors}
    new_t = {t.key: t for t in after.tensors}
    out = []
    for key, nt in new_t.items():
        ot = old_t.get(key)
        if ot is None and off_list(before, nt.nbytes):
            continue
        if ot is None or ot.nbytes != nt.nbytes:
            out.append(Change("tensor", key, None if ot is None else ot.nbytes, nt.nbytes))
    for key, ot in old_t.items():
        if key not in new_t and not off_list(after, ot.nbytes):
            out.append(Change("tensor", key, ot.nbytes, None))
    return out


@dataclass(frozen=True)
class SnapshotDiff(Result):
    """What changed between two snapshots: only the values that differ.

    Build it with ``later - earlier`` (or :meth:`between`). Renders as text, HTML and JSON like
    a :class:`Snapshot`; sizes are signed (``+512.00 MiB``).

    Attributes:
        before_at: Unix time of the earlier snapshot.
        after_at: Unix time of the later one.
        changes: every value that differs, devices first, then host, categories, and the
            largest tensors (compared only when both snapshots list tensors).
        before_label: the earlier snapshot's label.
        after_label: the later snapshot's label.
    """

    SCHEMA: ClassVar[str] = "memkit.snapshot-diff/1"
    HTML_TITLE: ClassVar[str] = "memkit snapshot diff"

    before_at: float
    after_at: float
    changes: tuple[Change, ...]
    before_label: str | None = None
    after_label: str | None = None

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot) -> SnapshotDiff:
        """The changes from ``before`` to ``after``."""
        changes: list[Change] = []
        old_devices = {d.key: d for d in before.devices}
        new_keys = {d.key for d in after.devices}
        for dev in after.devices:
            old = old_devices.get(dev.key)
            if old is None:
                changes.append(Change(dev.device, "device", None, dev.name, ""))
                continue
            for name, unit in _DEVICE_DIFF_FIELDS:
                a, b = getattr(old, name), getattr(dev, name)
                if a != b:
                    changes.append(Change(dev.device, name.replace("_", " "), a, b, unit))
        for dev in before.devices:
            if dev.key not in new_keys:
                changes.append(Change(dev.device, "device", dev.name, None, ""))
        for name, label in _HOST_DIFF_FIELDS:
            a, b = getattr(before.host, name), getattr(after.host, name)
            if a != b:
                changes.append(Change("host", label, a, b))
        old_cats = {c.device: c for c in before.categories}
        new_cats = {c.device: c for c in after.categories}
        for dev_name in [*new_cats, *(k for k in old_cats if k not in new_cats)]:
            oc, nc = old_cats.get(dev_name), new_cats.get(dev_name)
            for name in CATEGORY_FIELDS:
                a = None if oc is None else getattr(oc, name)
                b = None if nc is None else getattr(nc, name)
                if a != b:
                    changes.append(Change(f"{dev_name} holds", name.replace("_", " "), a, b))
        if before.tensors and after.tensors:
            changes.extend(_tensor_changes(before, after))
        return cls(
            before.taken_at,
            after.taken_at,
            tuple(changes),
            before.label,
            after.label,
        )

    @property
    def elapsed(self) -> float:
        """Seconds between the two snapshots."""
        return self.after_at - self.before_at

    def __bool__(self) -> bool:
        return bool(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["elapsed"] = self.elapsed
        return out

    def __str__(self) -> str:
        return layout.diff_text(self)

    def __repr__(self) -> str:
        return str(self)

    def html_body(self) -> str:
        """The diff as HTML (no page shell, no style; ``html()`` is the same)."""
        return layout.diff_html(self)
