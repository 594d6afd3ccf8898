"""Snapshots: every device at a glance, and what changed between two moments.

:func:`snapshot` reads each visible device (through :mod:`memkit.devices`, the one module that
touches hardware), the host's memory, and, when given a model and an optimizer, what this
process's memory is made of: parameters, buffers, gradients, optimizer state and other tensors.
The result is a frozen :class:`Snapshot` that renders as a text table (``repr``), an HTML table
with a stacked bar per device (``_repr_html_``, shown by notebooks) and JSON (:meth:`~Snapshot.
to_json`). Subtracting two snapshots gives a :class:`SnapshotDiff` that lists only what changed.

Three numbers people mix up, each on the rendering:

* **allocated**: bytes of live tensors this process made (``torch.cuda.memory_allocated``);
* **reserved**: allocated plus blocks PyTorch's caching allocator keeps for reuse; the gap is
  cache and fragmentation, and ``torch.cuda.empty_cache()`` gives it back to the driver;
* **used** (what nvidia-smi shows): reserved plus the CUDA context of every process on the device
  (a few hundred MiB each) plus the memory of other processes.

Reading device-wide memory never creates a CUDA context on a device this process has not used:
the driver's view (NVML through nvidia-ml-py, else nvidia-smi through GPUtil) is read first,
``cudaMemGetInfo`` only for devices this process
already holds memory on or that were named explicitly. A value that cannot be read is ``None``
with a reason (:meth:`DeviceSnapshot.why`), never a crash.

Examples:
    >>> import torch, memkit
    >>> model = torch.nn.Linear(8, 8)
    >>> snap = memkit.snapshot(model)
    >>> snap.categories[0].parameters
    288
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch

from memkit import advice as advice_rules
from memkit import devices
from memkit.accounting import MemoryAccountant, cuda_rounded, tensors_of
from memkit.advice import Advice, advice_html, advice_text
from memkit.errors import ConfigError
from memkit.render import html as h
from memkit.render import text
from memkit.units import format_size

__all__ = [
    "Categories",
    "Change",
    "DeviceSnapshot",
    "HostSnapshot",
    "Snapshot",
    "SnapshotDiff",
    "TensorInfo",
    "snapshot",
]

log = logging.getLogger(__name__)

SCHEMA = "memkit.snapshot/1"

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

BAR_LABELS = (
    "allocated (this process's tensors)",
    "reserved, not allocated (cache, fragmentation)",
    "CUDA context + other processes",
)
FREE_COLOR = "#e6e6e6"

CATEGORY_FIELDS = ("parameters", "buffers", "gradients", "optimizer_state", "other")
_KIND_RANK = {"parameter": 0, "buffer": 1, "gradient": 2, "optimizer state": 3, "tensor": 4}
_KIND_FIELD = {
    "parameter": "parameters",
    "buffer": "buffers",
    "gradient": "gradients",
    "optimizer state": "optimizer_state",
}

DeviceArg = str | torch.device | MemoryAccountant | devices.CudaBackend | devices.SimulatedBackend
"""What ``snapshot(device=...)`` accepts (or a sequence of them)."""


# --------------------------------------------------------------------------------------------
# result objects
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSnapshot:
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus the derived ``free``, ``cached`` and ``outside``."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "missing"}
        out.update(free=self.free, cached=self.cached, outside=self.outside)
        out["missing"] = dict(self.missing)
        return out


@dataclass(frozen=True)
class HostSnapshot:
    """Host RAM: this process's resident memory and the machine's available and total RAM."""

    process_rss: int | None
    available: int | None
    total: int | None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "process_rss": self.process_rss,
            "available": self.available,
            "total": self.total,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Categories:
    """What one device's memory is made of, from the objects passed to :func:`snapshot`.

    Each tensor storage is counted once, in the first category that holds it (parameters,
    buffers, gradients, optimizer state), so tied or shared weights are not counted twice.
    On CUDA, bytes are counted as the caching allocator counts them (512-byte blocks).

    Attributes:
        device: the device the storages are on (``"cuda:0"``, ``"cpu"``...).
        parameters: bytes of parameter storages (of the modules, and of the optimizers' groups).
        buffers: bytes of module buffers (running statistics...) not shared with a parameter.
        gradients: bytes of ``.grad`` storages.
        optimizer_state: bytes of tensors in ``optimizer.state`` (Adam's moments...).
        other: every other live tensor on the device, or ``None`` (see ``other_how``).
        other_how: how ``other`` was obtained, or why it is ``None``.
    """

    device: str
    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    other: int | None = None
    other_how: str = ""

    @property
    def categorised(self) -> int:
        """Parameters + buffers + gradients + optimizer state."""
        return self.parameters + self.buffers + self.gradients + self.optimizer_state

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus ``categorised``."""
        return {
            "device": self.device,
            "parameters": self.parameters,
            "buffers": self.buffers,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "other": self.other,
            "other_how": self.other_how,
            "categorised": self.categorised,
        }


@dataclass(frozen=True)
class TensorInfo:
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "nbytes": self.nbytes,
            "aliases": list(self.aliases),
        }


def _na(reason: str | None) -> h.Raw:
    return h.Raw(f'<span class="na" title="{h.escape(reason or "unavailable")}">n/a</span>')


def _size_cell(value: int | None, reason: str | None = None) -> object:
    return format_size(value) if value is not None else _na(reason)


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}%"


def _temp(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f} °C"


def _used_of_total(dev: DeviceSnapshot) -> str:
    if dev.total is None:
        return "n/a"
    used = "n/a" if dev.used is None else format_size(dev.used)
    return f"{used} / {format_size(dev.total)}"


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _explain_text() -> str:
    return "\n".join(f"  {name}: {line}" for name, line in EXPLAIN)


def _explain_html() -> str:
    items = "".join(f"<li><b>{h.escape(n)}</b>: {h.escape(line)}</li>" for n, line in EXPLAIN)
    return f'<ul class="note explain">{items}</ul>'


_LOCAL_STYLE = (
    "<style>.memkit-snapshot td,.memkit-diff td{white-space:nowrap}"
    ".memkit-snapshot td .note{white-space:normal;max-width:280px}"
    ".memkit ul.note{margin:4px 0;padding-left:18px}</style>"
)


def _bar_legend_html() -> str:
    return h.legend(BAR_LABELS).replace(
        "</div>",
        f'<span><i class="swatch" style="background:{FREE_COLOR}"></i>free</span></div>',
    )


@dataclass(frozen=True)
class Snapshot:
    """Every device and the host at one moment; see :func:`snapshot`.

    Renders as text (``repr``/``str``), HTML (``_repr_html_``) and JSON (:meth:`to_json`);
    ``later - earlier`` is a :class:`SnapshotDiff`.

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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (sizes in bytes)."""
        return {
            "schema": SCHEMA,
            "taken_at": self.taken_at,
            "label": self.label,
            "pid": self.pid,
            "top": self.top,
            "devices": [d.to_dict() for d in self.devices],
            "host": self.host.to_dict(),
            "categories": [c.to_dict() for c in self.categories],
            "tensors": [t.to_dict() for t in self.tensors],
            "notes": list(self.notes),
            "advice": [a.to_dict() for a in self.advice],
            "explain": dict(EXPLAIN),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The snapshot as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    # -- arithmetic -------------------------------------------------------------------------
    def diff(self, earlier: Snapshot) -> SnapshotDiff:
        """What changed from ``earlier`` to this snapshot (same as ``self - earlier``)."""
        return SnapshotDiff.between(earlier, self)

    def __sub__(self, other: object) -> SnapshotDiff:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return SnapshotDiff.between(other, self)

    # -- renderings -------------------------------------------------------------------------
    def device_rows_text(self) -> list[list[object]]:
        """The device table's rows as text cells (used by the CLI's watch mode too)."""
        rows: list[list[object]] = []
        for d in self.devices:
            rows.append(
                [
                    d.device,
                    d.name,
                    _used_of_total(d),
                    format_size(d.allocated),
                    format_size(d.reserved),
                    format_size(d.peak_allocated),
                    _pct(d.utilization) or "n/a",
                    _temp(d.temperature) or "n/a",
                ]
            )
        return rows

    def watch_lines(self) -> list[str]:
        """One line per device and one for the host: the CLI's non-TTY watch output."""
        stamp = datetime.fromtimestamp(self.taken_at).isoformat(timespec="seconds")
        lines = []
        for d in self.devices:
            if d.kind == "none":
                lines.append(f"{stamp}  none  {d.name}")
                continue
            lines.append(
                f"{stamp}  {d.device}  allocated {format_size(d.allocated)}  reserved "
                f"{format_size(d.reserved)}  used {_used_of_total(d)}"
            )
        lines.append(
            f"{stamp}  host  rss {format_size(self.host.process_rss)}  available "
            f"{format_size(self.host.available)} / {format_size(self.host.total)}"
        )
        return lines

    def missing_lines(self) -> list[str]:
        """One line per distinct reason a value is missing, naming the device and fields."""
        lines: list[str] = []
        for d in self.devices:
            by_reason: dict[str, list[str]] = {}
            for name, reason in d.missing:
                by_reason.setdefault(reason, []).append(name)
            for reason, names in by_reason.items():
                if d.kind == "none":
                    lines.append(f"{d.name}: {reason}")
                else:
                    lines.append(f"{d.device} {', '.join(names)}: {reason}")
        if self.host.reason:
            lines.append(f"host: {self.host.reason}")
        return lines

    def __str__(self) -> str:
        title = f"memkit snapshot  {_stamp(self.taken_at)}" + (
            f"  [{self.label}]" if self.label else ""
        )
        headers = [
            "device",
            "name",
            "used / total",
            "allocated",
            "reserved",
            "peak alloc",
            "util",
            "temp",
        ]
        parts = [text.table(headers, self.device_rows_text(), align="llrrrrrr", title=title)]
        host = self.host
        parts.append(
            f"host: process RSS {format_size(host.process_rss)}, available "
            f"{format_size(host.available)} of {format_size(host.total)}"
        )
        if self.categories:
            rows = [
                [
                    c.device,
                    format_size(c.parameters),
                    format_size(c.buffers),
                    format_size(c.gradients),
                    format_size(c.optimizer_state),
                    format_size(c.other),
                    c.other_how,
                ]
                for c in self.categories
            ]
            parts.append(
                text.table(
                    [
                        "device",
                        "parameters",
                        "buffers",
                        "gradients",
                        "optimizer state",
                        "other",
                        "other = ",
                    ],
                    rows,
                    align="lrrrrrl",
                    title="\nwhat it holds",
                )
            )
        if self.tensors:
            rows = self._tensor_rows("x")
            parts.append(
                text.table(
                    ["bytes", "shape", "dtype", "device", "kind", "name"],
                    rows,
                    align="rlllll",
                    title="\nlargest tensors",
                )
            )
        missing = self.missing_lines()
        if missing:
            parts.append("\nmissing values:\n" + "\n".join(f"  {m}" for m in missing))
        if self.notes:
            parts.append("\nnotes:\n" + "\n".join(f"  {n}" for n in self.notes))
        if self.advice:
            parts.append("\nadvice:\n" + advice_text(self.advice))
        parts.append("\n" + _explain_text())
        return "\n".join(parts)

    def __repr__(self) -> str:
        return str(self)

    def _tensor_rows(self, times: str) -> list[list[str]]:
        """Rows of the largest-tensors table; ``times`` joins the shape (``x`` or ``×``)."""
        return [
            [
                format_size(t.nbytes),
                times.join(map(str, t.shape)) or "scalar",
                t.dtype,
                t.device,
                t.kind,
                t.label,
            ]
            for t in self.tensors
        ]

    def html(self) -> str:
        """The snapshot as an HTML fragment (without the scoped style; see ``_repr_html_``)."""
        title = f"memkit snapshot · {_stamp(self.taken_at)}" + (
            f" · {h.escape(self.label)}" if self.label else ""
        )
        rows: list[list[object]] = []
        for d in self.devices:
            if d.total:
                bar: object = h.stacked_bar(d.bar_parts(), d.total)
            else:
                bar = _na(d.why("total"))
            rows.append(
                [
                    h.Raw(f"<b>{h.escape(d.device)}</b>"),
                    h.Raw(
                        h.escape(d.name)
                        + (
                            f'<div class="note">{h.escape(d.accounting)}</div>'
                            if d.accounting
                            else ""
                        )
                    ),
                    bar,
                    h.Raw(
                        f"{_size_cell(d.used, d.why('used'))} / "
                        f"{_size_cell(d.total, d.why('total'))}"
                    )
                    if d.total is not None or d.used is not None
                    else _na(d.why("total")),
                    _size_cell(d.allocated, d.why("allocated")),
                    _size_cell(d.reserved, d.why("reserved")),
                    _size_cell(d.peak_allocated, d.why("peak_allocated")),
                    _pct(d.utilization) or _na(d.why("utilization")),
                    _temp(d.temperature) or _na(d.why("temperature")),
                ]
            )
        body = [
            _LOCAL_STYLE,
            f"<h3>{title}</h3>",
            h.table(
                [
                    "device",
                    "name",
                    "memory",
                    "used / total",
                    "allocated",
                    "reserved",
                    "peak alloc",
                    "util",
                    "temp",
                ],
                rows,
            ),
        ]
        if any(d.total for d in self.devices):
            body.append(_bar_legend_html())
        host = self.host
        body.append(
            f'<p class="host"><b>host</b>: process RSS {_size_cell(host.process_rss, host.reason)}'
            f", available {_size_cell(host.available, host.reason)} of "
            f"{_size_cell(host.total, host.reason)}</p>"
        )
        if self.categories:
            crow = [
                [
                    c.device,
                    format_size(c.parameters),
                    format_size(c.buffers),
                    format_size(c.gradients),
                    format_size(c.optimizer_state),
                    _size_cell(c.other, c.other_how),
                    h.Raw(f'<span class="note">{h.escape(c.other_how)}</span>'),
                ]
                for c in self.categories
            ]
            body.append("<h3>what it holds</h3>")
            body.append(
                h.table(
                    [
                        "device",
                        "parameters",
                        "buffers",
                        "gradients",
                        "optimizer state",
                        "other tensors",
                        "other = ",
                    ],
                    crow,
                )
            )
        if self.tensors:
            trow = self._tensor_rows("×")
            body.append("<h3>largest tensors</h3>")
            body.append(h.table(["bytes", "shape", "dtype", "device", "kind", "name"], trow))
        missing = self.missing_lines()
        if missing:
            items = "".join(f"<li>{h.escape(m)}</li>" for m in missing)
            body.append(f'<p class="note">Missing values:</p><ul class="note missing">{items}</ul>')
        if self.notes:
            items = "".join(f"<li>{h.escape(n)}</li>" for n in self.notes)
            body.append(f'<ul class="note notes">{items}</ul>')
        if self.advice:
            body.append(advice_html(self.advice))
        body.append(_explain_html())
        return f'<div class="memkit-snapshot">{"".join(body)}</div>'

    def _repr_html_(self) -> str:
        return h.fragment(self.html())

    def plot(self, ax: Any = None) -> Any:
        """Draw one stacked bar per device with matplotlib; returns the Axes.

        Raises:
            ConfigError: matplotlib is not installed (the message says how to install it).
        """
        from memkit.render import plot

        rows = [
            (d.device, [*d.bar_parts(), ("free", d.free or 0)]) for d in self.devices if d.total
        ]
        return plot.stacked_bars(
            rows,
            ax=ax,
            title=f"memkit snapshot {_stamp(self.taken_at)}"
            + (f" [{self.label}]" if self.label else ""),
            colors=[*h.PALETTE[:3], FREE_COLOR],
        )


@dataclass(frozen=True)
class Change:
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus ``delta``."""
        return {
            "where": self.where,
            "what": self.what,
            "before": self.before,
            "after": self.after,
            "unit": self.unit,
            "delta": self.delta,
        }


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
class SnapshotDiff:
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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "schema": "memkit.snapshot-diff/1",
            "before_at": self.before_at,
            "after_at": self.after_at,
            "before_label": self.before_label,
            "after_label": self.after_label,
            "elapsed": self.elapsed,
            "changes": [c.to_dict() for c in self.changes],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The diff as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def _title(self) -> str:
        names = ""
        if self.before_label or self.after_label:
            names = f"  {self.before_label or 'before'} -> {self.after_label or 'after'}"
        return f"memkit snapshot diff  ({self.elapsed:+.1f} s){names}"

    def __str__(self) -> str:
        if not self.changes:
            return f"{self._title()}\nno changes"
        rows = [
            [c.where, c.what, c.format_value(c.before), c.format_value(c.after), c.format_delta()]
            for c in self.changes
        ]
        return text.table(
            ["where", "what", "before", "after", "change"], rows, align="llrrr", title=self._title()
        )

    def __repr__(self) -> str:
        return str(self)

    def html(self) -> str:
        """The diff as an HTML fragment (without the scoped style; see ``_repr_html_``)."""
        title = f"<h3>{h.escape(self._title())}</h3>"
        if not self.changes:
            return f'<div class="memkit-diff">{title}<p class="note">no changes</p></div>'
        rows: list[list[object]] = []
        for c in self.changes:
            delta = c.delta
            if delta and c.what == "available":
                delta = -delta  # more available memory is good news
            color = "#c0392b" if delta and delta > 0 else ("#2e7d32" if delta else "#555")
            rows.append(
                [
                    c.where,
                    c.what,
                    c.format_value(c.before),
                    c.format_value(c.after),
                    h.Raw(f'<b style="color:{color}">{h.escape(c.format_delta())}</b>'),
                ]
            )
        table_html = h.table(["where", "what", "before", "after", "change"], rows)
        return f'<div class="memkit-diff">{_LOCAL_STYLE}{title}{table_html}</div>'

    def _repr_html_(self) -> str:
        return h.fragment(self.html())


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------
class _Entry:
    """One storage seen while categorising (internal, mutable)."""

    __slots__ = ("device", "kind", "names", "nbytes", "storage", "tensor")

    def __init__(self, storage: Any, tensor: torch.Tensor, kind: str, name: str | None) -> None:
        self.storage = storage
        self.tensor = tensor
        self.kind = kind
        self.names: list[str] = [name] if name else []
        self.device = str(storage.device)
        self.nbytes = int(storage.nbytes())


class _Census:
    """Unique storages of the objects passed (and, optionally, of the gc scan)."""

    def __init__(self) -> None:
        self.entries: dict[int, _Entry] = {}
        self.param_names: dict[int, str] = {}

    @staticmethod
    def _storage(tensor: torch.Tensor) -> Any:
        try:
            if tensor.layout != torch.strided:
                return None
            return tensor.untyped_storage()
        except Exception:  # storage-less subclasses, functional/fake tensors
            return None

    def add(self, tensor: torch.Tensor, kind: str, name: str | None) -> None:
        storage = self._storage(tensor)
        if storage is None:
            return
        key = id(storage)
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = _Entry(storage, tensor, kind, name)
            return
        if _KIND_RANK[kind] < _KIND_RANK[entry.kind]:
            entry.kind = kind
            entry.tensor = tensor
            if name:
                if name in entry.names:
                    entry.names.remove(name)
                entry.names.insert(0, name)
        elif name and name not in entry.names:
            entry.names.append(name)

    def add_module(self, module: torch.nn.Module, prefix: str) -> None:
        for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False):
            self.param_names.setdefault(id(param), name)
            self.add(param, "parameter", name)
        for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False):
            if param.grad is not None:
                self.add(param.grad, "gradient", f"{name}.grad")
        for name, buf in module.named_buffers(prefix=prefix, remove_duplicate=False):
            self.add(buf, "buffer", name)

    def add_optimizer(self, opt: torch.optim.Optimizer, prefix: str) -> None:
        for gi, group in enumerate(opt.param_groups):
            for pi, param in enumerate(group["params"]):
                pname = self.param_names.setdefault(id(param), f"{prefix}param_groups[{gi}][{pi}]")
                self.add(param, "parameter", pname)
                if param.grad is not None:
                    self.add(param.grad, "gradient", f"{pname}.grad")
        for param, state in opt.state.items():
            pname = self.param_names.get(id(param), f"{prefix}state[?]")
            items = state.items() if isinstance(state, dict) else [("state", state)]
            for key, value in items:
                for i, tensor in enumerate(tensors_of(value)):
                    suffix = "" if i == 0 else f"[{i}]"
                    self.add(tensor, "optimizer state", f"{pname}:{key}{suffix}")

    def add_object(self, obj: Any, name: str) -> None:
        if isinstance(obj, torch.nn.Module):
            self.add_module(obj, name)
        elif isinstance(obj, torch.optim.Optimizer):
            self.add_optimizer(obj, f"{name}." if name else "")
        elif isinstance(obj, torch.Tensor):
            self.add(obj, "tensor", name or "tensor")
            if obj.grad is not None:
                self.add(obj.grad, "gradient", f"{name or 'tensor'}.grad")
        elif isinstance(obj, dict):
            for key, value in obj.items():
                self.add_object(value, f"{name}.{key}" if name else str(key))
        elif isinstance(obj, (list, tuple, set)):
            for i, value in enumerate(obj):
                self.add_object(value, f"{name}[{i}]")

    def scan_gc(self) -> int:
        found = 0
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance consults __class__, which some module-level
            # proxies (deprecated torch aliases, lazy modules) compute with side effects
            if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
                found += 1
                self.add(obj, "tensor", None)
        return found


def _counted(entry: _Entry, rounding: str) -> int:
    return cuda_rounded(entry.nbytes) if rounding == "cuda" else entry.nbytes


def _categorise(
    census: _Census,
    rows: Sequence[DeviceSnapshot],
    accountants: dict[str, MemoryAccountant],
    scanned: bool,
    notes: list[str],
) -> tuple[Categories, ...]:
    by_device: dict[str, list[_Entry]] = {}
    for entry in census.entries.values():
        by_device.setdefault(entry.device, []).append(entry)
    allocated = {r.device: r.allocated for r in rows if r.kind not in ("simulated", "none")}
    out = []
    for dev_name in sorted(by_device, key=lambda d: (d == "cpu", d)):
        entries = by_device[dev_name]
        acct = accountants.get(dev_name)
        if acct is not None:
            rounding = acct.rounding
        else:
            rounding = "cuda" if dev_name.startswith("cuda") else "none"
        sums = dict.fromkeys(CATEGORY_FIELDS[:4], 0)
        passed_other = 0
        for entry in entries:
            if entry.kind in _KIND_FIELD:
                sums[_KIND_FIELD[entry.kind]] += _counted(entry, rounding)
            else:
                passed_other += _counted(entry, rounding)
        categorised = sum(sums.values())
        other: int | None
        if acct is not None:
            live = {id(s): n for s, n in acct.live_storages()}
            keys = {id(e.storage) for e in entries if e.kind in _KIND_FIELD}
            other = sum(n for k, n in live.items() if k not in keys)
            how = "the simulated device's live storages minus the categorised ones"
            uncounted = sum(
                _counted(e, rounding)
                for e in entries
                if e.kind in _KIND_FIELD and id(e.storage) not in live
            )
            if uncounted:
                notes.append(
                    f"{format_size(uncounted)} of the categorised tensors on {dev_name} are not "
                    "counted by the simulated device: pass them to simulate(track=...) or "
                    "acct.track(...) to count them."
                )
        elif allocated.get(dev_name) is not None:
            alloc = allocated[dev_name] or 0
            other = alloc - categorised
            how = "allocated minus the categorised tensors (activations, batches, caches...)"
            if other < 0:
                notes.append(
                    f"on {dev_name} the categorised tensors ({format_size(categorised)}) exceed "
                    f"allocated ({format_size(alloc)}): some were freed or made elsewhere "
                    "while reading"
                )
                other = None
                how = "unknown: categorised tensors exceed allocated"
        elif scanned:
            other = passed_other
            how = "tensors found by the gc scan (misses tensors only C++ holds, e.g. autograd)"
        else:
            other = passed_other if passed_other else None
            how = (
                "tensors passed to snapshot()"
                if passed_other
                else f"unknown: nothing counts {dev_name} tensors; pass "
                "device=memkit.simulate(...) or scan_gc=True"
            )
        out.append(Categories(dev_name, **sums, other=other, other_how=how))
    return tuple(out)


def _largest(census: _Census, top: int) -> tuple[TensorInfo, ...]:
    entries = sorted(census.entries.values(), key=lambda e: -e.nbytes)[: max(0, top)]
    out = []
    for e in entries:
        t = e.tensor
        out.append(
            TensorInfo(
                name=e.names[0] if e.names else None,
                kind=e.kind,
                shape=tuple(int(s) for s in t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                device=e.device,
                nbytes=e.nbytes,
                aliases=tuple(e.names[1:]),
            )
        )
    return tuple(out)


def _no_accelerator_reason() -> str:
    build = (
        "a CPU-only build" if getattr(torch.version, "cuda", None) is None else "built with CUDA"
    )
    if getattr(torch.version, "hip", None):
        build = "built with ROCm"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    env = "unset" if visible is None else repr(visible)
    return (
        f"torch sees no CUDA/XPU/MPS device (torch {torch.__version__}, {build}; "
        f"CUDA_VISIBLE_DEVICES={env})"
    )


def _simulated_row(acct: MemoryAccountant, name: str, accounting: str) -> DeviceSnapshot:
    why = "a simulated device has no such reading"
    missing: list[tuple[str, str]] = [("utilization", why), ("temperature", why)]
    if acct.budget is None:
        missing += [(f, "the simulated device has no budget") for f in ("total", "used")]
    return DeviceSnapshot(
        device=str(acct.device),
        name=name,
        kind="simulated",
        accounting=accounting,
        total=acct.budget,
        used=acct.current if acct.budget is not None else None,
        used_source="budget" if acct.budget is not None else None,
        allocated=acct.current,
        reserved=acct.current,
        peak_allocated=acct.peak,
        peak_reserved=acct.peak,
        missing=tuple(missing),
    )


def _cuda_row(
    backend: devices.CudaBackend,
    stats: devices.GpuStats | None,
    smi_reason: str | None,
    explicit: bool,
) -> DeviceSnapshot:
    missing: list[tuple[str, str]] = []
    allocated, reserved = backend.allocated(), backend.reserved()
    total = used = None
    source = None
    if explicit or reserved > 0:
        info = backend.device_wide()
        if info is not None:
            free, total = info
            used, source = total - free, "cudaMemGetInfo"
    if used is None and stats is not None and stats.memory_total is not None:
        total, used, source = stats.memory_total, stats.memory_used, stats.source
    if used is None:
        why = (
            f"nvidia-smi gives none ({smi_reason or 'no matching GPU'}), and cudaMemGetInfo "
            "would create a CUDA context on a device this process has not used; pass "
            f"device={str(backend.device)!r} to read it anyway"
        )
        missing += [("total", why), ("used", why)] if total is None else [("used", why)]
    if stats is None:
        why = smi_reason or "nvidia-smi lists no GPU with this device's UUID"
        missing += [("utilization", why), ("temperature", why)]
    else:
        if stats.utilization is None:
            missing.append(("utilization", "nvidia-smi reports none for this GPU"))
        if stats.temperature is None:
            missing.append(("temperature", "nvidia-smi reports none for this GPU"))
    try:
        name = stats.name if stats is not None else backend.name()
    except Exception as exc:  # driver trouble must not break a snapshot
        name = str(backend.device)
        log.debug("no name for %s: %s", backend.device, exc)
    return DeviceSnapshot(
        device=str(backend.device),
        name=name,
        kind=backend.kind,
        accounting=backend.accounting,
        total=total,
        used=used,
        used_source=source,
        allocated=allocated,
        reserved=reserved,
        peak_allocated=backend.peak_allocated(),
        peak_reserved=backend.peak_reserved(),
        utilization=None if stats is None else stats.utilization,
        temperature=None if stats is None else stats.temperature,
        uuid=None if stats is None else stats.uuid,
        missing=tuple(missing),
    )


def _smi_only_row(stats: devices.GpuStats, position: int) -> DeviceSnapshot:
    why = (
        "torch in this process cannot see this GPU (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, or a CPU-only torch build)"
    )
    return DeviceSnapshot(
        device=f"nvidia-smi:{position}",
        name=stats.name,
        kind="nvidia-smi",
        accounting="nvidia-smi (device-wide only; not visible to this process's torch)",
        total=stats.memory_total,
        used=stats.memory_used,
        used_source=stats.source,
        utilization=stats.utilization,
        temperature=stats.temperature,
        uuid=stats.uuid,
        missing=tuple(
            (f, why) for f in ("allocated", "reserved", "peak_allocated", "peak_reserved")
        ),
    )


def _none_row(reason: str) -> DeviceSnapshot:
    fields = (
        "total",
        "used",
        "allocated",
        "reserved",
        "peak_allocated",
        "peak_reserved",
        "utilization",
        "temperature",
    )
    return DeviceSnapshot(
        device="none",
        name="no accelerator visible",
        kind="none",
        accounting="",
        missing=tuple((f, reason) for f in fields),
    )


def _resolve(device: Any) -> list[Any]:
    if device is None:
        return []
    if isinstance(device, (str, torch.device, MemoryAccountant)) or hasattr(device, "allocated"):
        return [device]
    if isinstance(device, Iterable):
        return [d for item in device for d in _resolve(item)]
    raise ConfigError(
        "expected device= to be a device string, a torch.device, a backend from "
        f"memkit.get_backend, a memkit.simulate(...) accountant, or a list of them; found "
        f"{type(device).__name__}"
    )


def snapshot(
    *objects: Any,
    device: DeviceArg | Sequence[DeviceArg] | None = None,
    scan_gc: bool = False,
    top: int = 10,
    nvidia_smi: bool = True,
    label: str | None = None,
) -> Snapshot:
    """Read every device and the host now; with objects, say what their memory is made of.

    Args:
        *objects: models, optimizers, tensors, or dicts/lists of them (a dict's keys name its
            tensors). Their storages are categorised per device as parameters, buffers,
            gradients and optimizer state, each storage counted once (tied weights too), and
            they feed the largest-tensor list with their parameter names.
        device: which devices to read. ``None``: every accelerator torch sees, in index order
            (plus GPUs only nvidia-smi sees; a "none" row with the reason when there are none).
            Otherwise a device string (``"cuda:1"``), a backend (``memkit.get_backend(...)``),
            a ``memkit.simulate(...)`` accountant, or a list of them: only those are read. A
            simulated device reports its counters and budget, and its "other tensors" are its
            live storages that are not categorised. A ``"cpu"``/``"meta"`` string makes a fresh
            simulated device that counts only the objects passed.
        scan_gc: also walk ``gc.get_objects()`` for tensors (slow on big heaps): unnamed tensors
            join the largest list, and "other tensors" of devices without an allocator
            counter (host tensors) are the tensors found.
        top: how many of the largest tensors to keep.
        nvidia_smi: read utilisation, temperature and device-wide memory from the driver
            (NVML in process, else nvidia-smi through GPUtil in a subprocess; never call
            :func:`snapshot` from a hot path).
        label: a name for this moment, shown on renderings and diffs.

    Returns:
        A frozen :class:`Snapshot`.

    Raises:
        ConfigError: ``device`` is not something memkit can read.

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Linear(256, 256)
        >>> before = memkit.snapshot(model)
        >>> model(torch.randn(4, 256)).sum().backward()
        >>> diff = memkit.snapshot(model) - before
        >>> [c.after for c in diff.changes if c.what == "gradients"]
        [263168]
    """
    taken_at = time.time()
    census = _Census()
    ordered = sorted(
        enumerate(objects),
        key=lambda item: 0 if isinstance(item[1], torch.nn.Module) else 1,
    )
    modules = sum(isinstance(o, torch.nn.Module) for o in objects)
    for i, obj in ordered:
        if isinstance(obj, torch.nn.Module):
            prefix = f"{type(obj).__name__}[{i}]" if modules > 1 else ""
        elif isinstance(obj, (torch.optim.Optimizer, dict)):
            prefix = ""  # optimizers are named by their parameters, dicts by their keys
        else:
            prefix = f"objects[{i}]"
        census.add_object(obj, prefix)
    notes: list[str] = []
    if scan_gc:
        found = census.scan_gc()
        notes.append(f"gc scan: {found} tensor objects examined")

    rows: list[DeviceSnapshot] = []
    accountants: dict[str, MemoryAccountant] = {}
    targets = _resolve(device)
    stats: list[devices.GpuStats] = []
    smi_reason: str | None = "not read (nvidia_smi=False)"
    wants_smi = nvidia_smi and (
        not targets
        or any(getattr(t, "kind", None) == "cuda" or str(t).startswith("cuda") for t in targets)
    )
    if wants_smi:
        stats, smi_reason = devices.gpu_stats()
    by_index = {s.cuda_index: s for s in stats if s.cuda_index is not None}

    if not targets:
        for dev in devices.visible_devices():
            backend = devices.get_backend(dev)
            if isinstance(backend, devices.CudaBackend):
                rows.append(_cuda_row(backend, by_index.get(backend.index), smi_reason, False))
        unseen = [s for s in stats if s.cuda_index is None]
        if not rows and stats and all(s.cuda_index is None for s in stats):
            notes.append(_no_accelerator_reason() + "; the GPUs below are nvidia-smi's view")
        for pos, s in enumerate(unseen):
            rows.append(_smi_only_row(s, pos))
        if not rows:
            rows.append(_none_row(_no_accelerator_reason()))
    for target in targets:
        if isinstance(target, MemoryAccountant):
            size = "no budget" if target.budget is None else format_size(target.budget)
            accounting = (
                f"memkit simulated device: live tensor storages on {target.device} "
                f"({'CUDA 512-byte rounding' if target.rounding == 'cuda' else 'exact bytes'})"
            )
            rows.append(_simulated_row(target, f"{target.name} ({size})", accounting))
            accountants[str(target.device)] = target
            continue
        if isinstance(target, (str, torch.device)):
            backend = devices.get_backend(target)
            if isinstance(backend, devices.SimulatedBackend):
                backend.track(*objects)
                notes.append(
                    f"{backend.device}: a fresh simulated device counting only the objects passed"
                )
            target = backend
        if isinstance(target, devices.SimulatedBackend):
            acct = target.accountant
            rows.append(_simulated_row(acct, target.name(), target.accounting))
            accountants[str(acct.device)] = acct
        elif isinstance(target, devices.CudaBackend):
            rows.append(_cuda_row(target, by_index.get(target.index), smi_reason, True))
        else:
            raise ConfigError(
                f"expected a memkit backend, found {type(target).__name__} for device="
            )

    hm = devices.host_memory()
    host = HostSnapshot(hm.process_rss, hm.available, hm.total, hm.reason)
    categories = _categorise(census, rows, accountants, scan_gc, notes) if census.entries else ()
    tensors = _largest(census, top)
    # advice (issue #5): other-processes, fragmentation, empty-cache from each row's readings
    advice = tuple(
        a
        for row in rows
        for a in advice_rules.device_advice(
            row.device,
            total=row.total,
            used=row.used,
            allocated=row.allocated,
            reserved=row.reserved,
            peak_allocated=row.peak_allocated,
        )
    )
    return Snapshot(
        taken_at=taken_at,
        devices=tuple(rows),
        host=host,
        categories=categories,
        tensors=tensors,
        notes=tuple(notes),
        label=label,
        top=top,
        advice=advice,
    )
