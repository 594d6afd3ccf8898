"""The result objects of :func:`memkit.snapshots.snapshot`: one device, the host, what the objects
passed hold, the largest tensors, the :class:`Snapshot` that gathers them, and what changed
between two (:class:`SnapshotDiff`).

Frozen dataclasses with the shared result methods (:class:`memkit.results.Result`); their text
and HTML layout is in :mod:`memkit.render.snapshots`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from memkit.advice import Advice
from memkit.render import html as h
from memkit.render import plot
from memkit.render import snapshots as layout
from memkit.render.snapshots import BAR_LABELS, FREE_COLOR
from memkit.results import Record, Result
from memkit.units import format_size

__all__ = [
    "CATEGORY_FIELDS",
    "EXPLAIN",
    "SCHEMA",
    "Categories",
    "Change",
    "DeviceSnapshot",
    "HostSnapshot",
    "Snapshot",
    "SnapshotDiff",
    "TensorInfo",
]

EXPLAIN: tuple[tuple[str, str], ...] = (
    ("allocated", "live tensors of this process (torch.cuda.memory_allocated)."),
    (
        "reserved",
        "allocated + blocks the caching allocator keeps (cache, fragmentation); "
        "torch.cuda.empty_cache() releases them.",
    ),
    (
        "used",
        "what nvidia-smi shows: reserved + each process's CUDA context (~300-600 MiB) "
        "+ other processes.",
    ),
)
"""One line each for the gaps people get confused by; shown under every rendering."""

SCHEMA = "memkit.snapshot/1"

CATEGORY_FIELDS = ("parameters", "buffers", "gradients", "optimizer_state", "other")


@dataclass(frozen=True)
class DeviceSnapshot(Record):
    """One device at one moment. Sizes in bytes; ``None`` where unreadable (see :meth:`why`).

    Attributes:
        device: ``"cuda:0"``, ``"cpu"`` (simulated), ``"nvidia-smi:1"`` (a GPU torch cannot
            see) or ``"none"`` (no accelerator visible).
        name: the device's product name, or what the row stands for.
        kind: ``"cuda"`` (or another accelerator type), ``"simulated"``, ``"nvidia-smi"``,
            ``"none"``.
        accounting: which counters produced the numbers.
        total: the device's size (a simulated device's budget).
        used: device-wide used memory, every process and context included.
        used_source: where ``used``/``total`` come from (``"cudaMemGetInfo"``, ``"nvidia-smi"``,
            ``"budget"``).
        allocated: this process's bytes in live tensors.
        reserved: this process's bytes held by the caching allocator.
        peak_allocated: highest ``allocated`` since the process start or the last peak reset.
        peak_reserved: highest ``reserved`` likewise.
        utilization: GPU utilisation in percent (nvidia-smi).
        temperature: GPU temperature in °C (nvidia-smi).
        uuid: the GPU's UUID where known (diffs match devices by it).
        missing: ``(field, reason)`` for every ``None`` value above that has a reason.
    """

    device: str
    name: str
    kind: str
    accounting: str
    total: int | None = None
    used: int | None = None
    used_source: str | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    utilization: float | None = None
    temperature: float | None = None
    uuid: str | None = None
    missing: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        """How diffs match this device between snapshots (UUID where known, else the name)."""
        return self.uuid or self.device

    @property
    def free(self) -> int | None:
        """``total - used`` where both are known."""
        if self.total is None or self.used is None:
            return None
        return max(0, self.total - self.used)

    @property
    def cached(self) -> int | None:
        """Reserved but not allocated: the caching allocator's reserve and fragmentation."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def outside(self) -> int | None:
        """Used but not reserved by this process: CUDA contexts and other processes."""
        if self.used is None or self.reserved is None:
            return None
        return max(0, self.used - self.reserved)

    def why(self, field_name: str) -> str | None:
        """Why ``field_name`` is ``None`` (``None`` if it is not, or no reason is known)."""
        for name, reason in self.missing:
            if name == field_name:
                return reason
        return None

    def bar_parts(self) -> list[tuple[str, int]]:
        """The stacked-bar segments (label, bytes): allocated, cached, context + others."""
        return [
            (BAR_LABELS[0], self.allocated or 0),
            (BAR_LABELS[1], self.cached or 0),
            (BAR_LABELS[2], self.outside or 0),
        ]

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """Plus the derived ``free``, ``cached`` and ``outside``; ``missing`` as a dict."""
        del out["missing"]
        out.update(free=self.free, cached=self.cached, outside=self.outside)
        out["missing"] = dict(self.missing)
        return out


@dataclass(frozen=True)
class HostSnapshot(Record):
    """Host RAM: this process's resident memory and the machine's available and total RAM."""

    process_rss: int | None
    available: int | None
    total: int | None
    reason: str | None = None


@dataclass(frozen=True)
class Categories(Record):
    """What one device's memory is made of, from the objects passed to :func:`snapshot`.

    Each tensor storage is counted once, in the first category that holds it (parameters,
    buffers, gradients, optimizer state), so tied or shared weights are not counted twice.
    On CUDA a storage counts as the caching allocator's block for it: its bytes rounded up to
    512 (``memory_allocated`` counts the same), so that categorised + other = allocated; a
    tensor's own bytes can be up to 511 fewer (``counted_as`` says which was used).

    Attributes:
        device: the device the storages are on (``"cuda:0"``, ``"cpu"``...).
        parameters: bytes of parameter storages (of the modules, and of the optimizers' groups).
        buffers: bytes of module buffers (running statistics...) not shared with a parameter.
        gradients: bytes of ``.grad`` storages.
        optimizer_state: bytes of tensors in ``optimizer.state`` (Adam's moments...).
        other: every other live tensor on the device, or ``None`` (see ``other_how``).
        other_how: how ``other`` was obtained, or why it is ``None``.
        counted_as: what a storage counts as on this device (its allocator block, or its bytes).
    """

    device: str
    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    other: int | None = None
    other_how: str = ""
    counted_as: str = ""

    @property
    def categorised(self) -> int:
        """Parameters + buffers + gradients + optimizer state."""
        return self.parameters + self.buffers + self.gradients + self.optimizer_state

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["categorised"] = self.categorised
        return out


@dataclass(frozen=True)
class TensorInfo(Record):
    """One live tensor (one storage) among the largest.

    Attributes:
        name: the module parameter/buffer name (``"encoder.layers.0.weight"``), the gradient
            (``"fc.weight.grad"``) or optimizer state (``"fc.weight:exp_avg"``) it is, the key
            it was passed under, or ``None`` for a tensor found only by the gc scan.
        kind: ``"parameter"``, ``"buffer"``, ``"gradient"``, ``"optimizer state"``, ``"tensor"``.
        shape: the tensor's shape.
        dtype: e.g. ``"float32"``.
        device: e.g. ``"cuda:0"``.
        nbytes: bytes of its storage (a view reports the storage it keeps alive).
        aliases: other names of the same storage (tied weights).
    """

    name: str | None
    kind: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    aliases: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The name with its aliases, or a placeholder for an unnamed tensor."""
        base = self.name or "(unnamed)"
        return f"{base} (= {', '.join(self.aliases)})" if self.aliases else base

    @property
    def key(self) -> str:
        """How diffs match a tensor between snapshots."""
        if self.name:
            return self.name
        return f"{self.dtype}{list(self.shape)}@{self.device}"


@dataclass(frozen=True)
class Snapshot(Result):
    """Every device and the host at one moment; see :func:`snapshot`.

    Renders as text (``str``; ``repr`` is one line), HTML (``_repr_html_``, ``to_html``) and JSON
    (``to_json``); ``later - earlier`` is a :class:`SnapshotDiff`.

    Attributes:
        taken_at: Unix time of the reading.
        devices: one row per device, in CUDA index order.
        host: host RAM.
        categories: per device, what the objects passed to :func:`snapshot` hold (empty when
            none were passed).
        tensors: the largest live tensors seen, largest first.
        notes: remarks about the reading (what was not counted, and why).
        advice: recommendations from the readings (``other-processes``, ``fragmentation``,
            ``empty-cache``; see docs/advice.md).
        label: an optional name for the moment (``"after step 1"``).
        pid: the process that took it.
        top: how many tensors the largest-tensor list was asked to keep.
    """

    SCHEMA: ClassVar[str] = SCHEMA
    HTML_TITLE: ClassVar[str] = "memkit snapshot"
    EXPLAIN: ClassVar[tuple[tuple[str, str], ...]] = EXPLAIN

    taken_at: float
    devices: tuple[DeviceSnapshot, ...]
    host: HostSnapshot
    categories: tuple[Categories, ...] = ()
    tensors: tuple[TensorInfo, ...] = ()
    notes: tuple[str, ...] = ()
    advice: tuple[Advice, ...] = ()
    label: str | None = None
    pid: int = field(default_factory=os.getpid)
    top: int = 10

    # -- data -------------------------------------------------------------------------------
    def device(self, key: str) -> DeviceSnapshot:
        """The row of a device by name (``"cuda:0"``) or UUID.

        Raises:
            KeyError: no such device in this snapshot.
        """
        for dev in self.devices:
            if key in (dev.device, dev.uuid, dev.key):
                return dev
        raise KeyError(
            f"no device {key!r} in this snapshot; found {[d.device for d in self.devices]}"
        )

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """Sizes in bytes; plus what each device column means (``explain``)."""
        out["explain"] = dict(self.EXPLAIN)
        return out

    # -- arithmetic -------------------------------------------------------------------------
    def diff(self, earlier: Snapshot) -> SnapshotDiff:
        """What changed from ``earlier`` to this snapshot (same as ``self - earlier``)."""
        return SnapshotDiff.between(earlier, self)

    def __sub__(self, other: object) -> SnapshotDiff:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return SnapshotDiff.between(other, self)

    # -- renderings (layout in memkit.render.snapshots) --------------------------------------
    def device_rows_text(self) -> list[list[object]]:
        """The device table's rows as text cells (used by the CLI's watch mode too)."""
        return layout.device_rows_text(self)

    def watch_lines(self) -> list[str]:
        """One line per device and one for the host: the CLI's non-TTY watch output."""
        return layout.watch_lines(self)

    def missing_lines(self) -> list[str]:
        """One line per distinct reason a value is missing, naming the device and fields."""
        return layout.missing_lines(self)

    def __str__(self) -> str:
        return layout.snapshot_text(self)

    def __repr__(self) -> str:
        """One line: the label, and this process's allocated and reserved bytes over every
        device that reads them (the text is ``str()``)."""
        allocated = [d.allocated for d in self.devices if d.allocated is not None]
        reserved = [d.reserved for d in self.devices if d.reserved is not None]
        return (
            f"Snapshot(label={self.label!r}, devices={len(self.devices)}, "
            f"allocated={format_size(sum(allocated) if allocated else None)!r}, "
            f"reserved={format_size(sum(reserved) if reserved else None)!r})"
        )

    def html_body(self) -> str:
        """The snapshot as HTML (no page shell, no style)."""
        return layout.snapshot_html(self)

    def plot(self, ax: Any = None) -> Any:
        """Draw one stacked bar per device with matplotlib; returns the Axes.

        Raises:
            ConfigError: matplotlib is not installed (the message says how to install it).
        """
        rows = [
            (d.device, [*d.bar_parts(), ("free", d.free or 0)]) for d in self.devices if d.total
        ]
        return plot.stacked_bars(
            rows,
            ax=ax,
            title=layout.snapshot_title(self, " "),
            colors=[*h.PALETTE[:3], FREE_COLOR],
        )


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
        return (
            f"SnapshotDiff({self.before_label!r} -> {self.after_label!r}, "
            f"changes={len(self.changes)}, elapsed={self.elapsed:.3f})"
        )

    def html_body(self) -> str:
        """The diff as HTML (no page shell, no style)."""
        return layout.diff_html(self)
