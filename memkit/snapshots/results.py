"""The result objects of :func:`memkit.snapshots.snapshot`: one device, the host, what the objects
passed hold, the largest tensors, the :class:`Snapshot` that gathers them, and what changed
between two (:class:`SnapshotDiff`).

Frozen dataclasses with the shared result methods (:class:`memkit.results.Result`); their text
and HTML layout is in :mod:`memkit.render.snapshots`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from memkit.advice import Advice
from memkit.render import html as h
from memkit.render import plot
from memkit.render import snapshots as layout
from memkit.render.snapshots import BAR_LABELS, FREE_COLOR
from memkit.results import Record, Result
from memkit.snapshots.identity import still_holds
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

SIMULATED_EXPLAIN: tuple[tuple[str, str], ...] = (
    ("allocated", "the live tensor storages the simulated device counts (exact bytes)."),
    ("reserved", "equal to allocated: the simulated device keeps no cache."),
    (
        "used",
        "equal to allocated: no driver, no CUDA context, no other process; total is its budget.",
    ),
)
"""The same lines for a snapshot of simulated devices only (sweep CO: its text explained
``torch.cuda.memory_allocated`` and nvidia-smi)."""

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
        storage_id: which storage it is: two snapshots of one process give the same number to
            the same live storage, and a storage made later at the same address gets another
            (``None``: unknown). Diffs match tensors by it before they match names.
    """

    name: str | None
    kind: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    aliases: tuple[str, ...] = ()
    storage_id: int | None = None

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

    def explain(self) -> tuple[tuple[str, str], ...]:
        """What each device column means: :data:`SIMULATED_EXPLAIN` where every device is a
        simulated one, else :data:`EXPLAIN`."""
        kinds = {d.kind for d in self.devices}
        return SIMULATED_EXPLAIN if kinds == {"simulated"} else self.EXPLAIN

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """Sizes in bytes; plus what each device column means (``explain``)."""
        out["explain"] = dict(self.explain())
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
        what: the field (``"allocated"``) or, for tensors, the tensor's name (its earlier one
            when it changed), or ``dtype[shape]@device`` for an unnamed tensor.
        before: the earlier value (``None``: absent or unreadable); for tensors, bytes summed
            over the ``count`` tensors of the row.
        after: the later value.
        unit: ``"bytes"``, ``"%"``, ``"°C"`` or ``""`` (text).
        count: how many tensors the row stands for (tensors of one name, or unnamed ones of
            one shape, that appeared or went together), else 1.
        note: what happened when the value alone does not say it: ``"now unnamed"``,
            ``"now named X"``, ``"renamed to X"`` (the same storage in both snapshots), or
            ``"still alive, not in the later snapshot"``; else ``""``.
    """

    where: str
    what: str
    before: Any
    after: Any
    unit: str = "bytes"
    count: int = 1
    note: str = ""

    @property
    def label(self) -> str:
        """``what``, with the number of tensors when the row stands for several."""
        return f"{self.what} ({self.count} tensors)" if self.count > 1 else self.what

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
        """The signed change, or ``"new"``/``"gone"``/``"changed"``, or the note."""
        delta = self.delta
        if self.note:
            if not delta:
                return self.note
            return f"{format_size(delta, signed=True)}, {self.note}"
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


def _off_list(snap: Snapshot, nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` could be alive yet missing from ``snap``'s full list (it
    is no larger than everything on it)."""
    full = len(snap.tensors) >= snap.top
    return full and nbytes <= min(t.nbytes for t in snap.tensors)


def _grouped(tensors: list[TensorInfo]) -> dict[str, list[TensorInfo]]:
    """The tensors by key, in the order their keys first appear."""
    out: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        out.setdefault(t.key, []).append(t)
    return out


_Pairs = list[tuple[TensorInfo, TensorInfo]]


def _pair_by_storage(
    old: list[TensorInfo], new: list[TensorInfo]
) -> tuple[_Pairs, list[TensorInfo], list[TensorInfo]]:
    """Earlier and later entries of the same storage; then the entries left on each side."""
    by_id = {t.storage_id: i for i, t in enumerate(old) if t.storage_id is not None}
    pairs: _Pairs = []
    paired: set[int] = set()
    new_rest = []
    for nt in new:
        i = by_id.pop(nt.storage_id, None) if nt.storage_id is not None else None
        if i is None:
            new_rest.append(nt)
        else:
            pairs.append((old[i], nt))
            paired.add(i)
    return pairs, [t for i, t in enumerate(old) if i not in paired], new_rest


def _pair_by_key(
    old: list[TensorInfo], new: list[TensorInfo]
) -> tuple[_Pairs, list[TensorInfo], list[TensorInfo]]:
    """Entries of one key on both sides, largest with largest; then the entries left."""
    pairs: _Pairs = []
    old_rest: list[TensorInfo] = []
    new_rest: list[TensorInfo] = []
    old_by_key = _grouped(old)
    new_by_key = _grouped(new)
    for key in [*new_by_key, *(k for k in old_by_key if k not in new_by_key)]:
        ots = sorted(old_by_key.get(key, ()), key=lambda t: -t.nbytes)
        nts = sorted(new_by_key.get(key, ()), key=lambda t: -t.nbytes)
        pairs.extend(zip(ots, nts, strict=False))
        old_rest.extend(ots[len(nts) :])
        new_rest.extend(nts[len(ots) :])
    return pairs, old_rest, new_rest


_MODULE_PREFIX = re.compile(r"^(?!objects\[)[A-Z]\w*\[\d+\]\.")
"""The prefix a snapshot of several modules gives each one's tensors (``TinyResNet[0].``)."""


def _unprefixed(name: str | None) -> str | None:
    """``name`` without the prefix of a snapshot of several modules: the same parameter in a
    snapshot of the model alone and of the model and its EMA copy is no rename."""
    return None if name is None else _MODULE_PREFIX.sub("", name, count=1)


def _pair_change(old: TensorInfo, new: TensorInfo) -> Change | None:
    """The row for one tensor in both snapshots: its size or its name changed, or nothing."""
    note = ""
    if _unprefixed(old.name) != _unprefixed(new.name):  # only a storage match pairs them
        if new.name is None:
            note = "now unnamed"
        elif old.name is None:
            note = f"now named {new.name}"
        else:
            note = f"renamed to {new.name}"
    if not note and old.nbytes == new.nbytes:
        return None
    return Change("tensor", old.key, old.nbytes, new.nbytes, note=note)


def _tensor_changes(before: Snapshot, after: Snapshot) -> list[Change]:
    """Tensors that appeared, went, or changed size or name, among the largest lists.

    Tensors are matched by storage first (:attr:`TensorInfo.storage_id`, in one process): one
    storage is one tensor whatever its names in each snapshot, and a storage freed and another
    made at its address are two. Named tensors left over are then matched by name (a batch
    replaced by the next one under one key); unnamed ones (the gc scan's) by ``dtype[shape]``
    only where storages are unknown (another process, records built by hand). Tensors left
    over that share a key are one row, with their count and summed bytes.

    A tensor missing from a full list that is smaller than everything on it may still be
    alive (it only fell out of the top), so it is not reported; one whose storage is still
    alive with the same bytes is not gone either (the later snapshot did not look at it).
    """
    same_process = before.pid == after.pid
    if same_process:
        pairs, old_rest, new_rest = _pair_by_storage(list(before.tensors), list(after.tensors))
    else:
        pairs, old_rest, new_rest = [], list(before.tensors), list(after.tensors)

    def by_key(t: TensorInfo) -> bool:
        return t.name is not None or not same_process or t.storage_id is None

    more, old_left, new_left = _pair_by_key(
        [t for t in old_rest if by_key(t)], [t for t in new_rest if by_key(t)]
    )
    old_rest = [t for t in old_rest if not by_key(t)] + old_left
    new_rest = [t for t in new_rest if not by_key(t)] + new_left
    out = [c for ot, nt in [*pairs, *more] if (c := _pair_change(ot, nt)) is not None]

    appeared = [t for t in new_rest if not _off_list(before, t.nbytes)]
    for key, ts in _grouped(appeared).items():
        out.append(Change("tensor", key, None, sum(t.nbytes for t in ts), count=len(ts)))

    def still_alive(t: TensorInfo) -> bool:
        return (
            before.pid == os.getpid()
            and t.storage_id is not None
            and still_holds(t.storage_id, t.nbytes)
        )

    went = [t for t in old_rest if not _off_list(after, t.nbytes)]
    for alive, note in ((False, ""), (True, "still alive, not in the later snapshot")):
        for key, ts in _grouped([t for t in went if still_alive(t) == alive]).items():
            nbytes = sum(t.nbytes for t in ts)
            out.append(Change("tensor", key, nbytes, None, count=len(ts), note=note))
    return out


def _device_words(dev: DeviceSnapshot) -> str:
    """``cpu: simulated cpu (8.00 MiB)``, ``cuda:0: NVIDIA H100 (79.19 GiB)``."""
    if dev.kind == "none":
        return dev.name
    size = "" if dev.total is None else format_size(dev.total)
    shown = f" ({size})" if size and size not in dev.name else ""
    return f"{dev.device}: {dev.name}{shown}"


def _same_device(was: DeviceSnapshot, now: DeviceSnapshot) -> bool:
    """Whether two readings matched by key are one device: the same kind; for a simulated
    device the same budget; for GPUs the same UUID where both are known (a GPU's total is no
    identity: nvidia-smi's before CUDA is used, cudaMemGetInfo's after, differ)."""
    if was.kind != now.kind:
        return False
    if now.kind == "simulated":
        return was.total == now.total
    return was.uuid is None or now.uuid is None or was.uuid == now.uuid


def _different_devices(before: Snapshot, after: Snapshot) -> tuple[str, ...]:
    """Notes where the two sides did not read the same devices: a device matched by its key
    that is not the same device (:func:`_same_device`), or sides whose kinds of device
    differ."""
    notes = []
    old = {d.key: d for d in before.devices}
    for dev in after.devices:
        was = old.get(dev.key)
        if was is not None and not _same_device(was, dev):
            notes.append(
                f"{dev.device} is not one device over time: {_device_words(was)} before, "
                f"{_device_words(dev)} after; its rows compare two devices"
            )
    kinds = [sorted({d.kind for d in snap.devices}) for snap in (before, after)]
    if kinds[0] != kinds[1]:
        sides = ["; ".join(_device_words(d) for d in snap.devices) for snap in (before, after)]
        notes.append(
            f"the snapshots read different kinds of device (before: {sides[0] or 'none'}; "
            f"after: {sides[1] or 'none'}): rows of the same name ('cpu holds') count "
            "different memory"
        )
    return tuple(notes)


def _comparison_notes(before: Snapshot, after: Snapshot) -> tuple[str, ...]:
    """Notes where the diff does not read as what changed over time: ``before`` taken after
    ``after`` (``s1 - s2`` for ``s2 - s1``), and a category gone to 0 on a device whose
    "other" grew by it (the later snapshot was not given the objects that hold it: an
    optimizer left out) (sweep BU: both read as memory freed)."""
    notes = []
    if after.taken_at < before.taken_at:
        notes.append(
            f"the subtracted snapshot{f' ({before.label!r})' if before.label else ''} was "
            f"taken {before.taken_at - after.taken_at:.1f} s after the one it is subtracted "
            "from: this diff runs backward "
            "in time (earlier - later); what it shows as freed was made, and what it shows as "
            "made was freed. Subtract the earlier snapshot from the later one: `later - earlier`"
        )
    old = {c.device: c for c in before.categories}
    for cat in after.categories:
        was = old.get(cat.device)
        if was is None or was.other is None or cat.other is None:
            continue
        grew = cat.other - was.other
        # what an object passed holds (not gradients: zero_grad(set_to_none=True) frees those
        # while a forward's activations grow 'other', review)
        for name in ("parameters", "buffers", "optimizer_state"):
            held = getattr(was, name)
            if held and not getattr(cat, name) and grew >= 0.9 * held:
                words = name.replace("_", " ")
                notes.append(
                    f"{cat.device}'s {words} went from {format_size(held)} to 0 while its "
                    f"'other' grew by {format_size(grew)}: the later snapshot was likely not "
                    f"given the objects that hold the {words} (an optimizer or a model left "
                    "out of memkit.snapshot(...)), so they count as 'other' there, not freed"
                )
    return tuple(notes)


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
        notes: remarks on the comparison: the two sides read different devices (a host
            snapshot and a simulated one, two simulated devices of different budgets).
    """

    SCHEMA: ClassVar[str] = "memkit.snapshot-diff/1"
    HTML_TITLE: ClassVar[str] = "memkit snapshot diff"

    before_at: float
    after_at: float
    changes: tuple[Change, ...]
    before_label: str | None = None
    after_label: str | None = None
    notes: tuple[str, ...] = ()

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
                # (sweep CO: a snapshot without objects, then one with: "parameters n/a -> 0 B")
                if a != b and (a or b):
                    changes.append(Change(f"{dev_name} holds", name.replace("_", " "), a, b))
        if before.tensors and after.tensors:
            changes.extend(_tensor_changes(before, after))
        return cls(
            before.taken_at,
            after.taken_at,
            tuple(changes),
            before.label,
            after.label,
            _different_devices(before, after) + _comparison_notes(before, after),
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
