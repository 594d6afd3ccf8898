"""Reading a snapshot: one row per device (through :mod:`memkit.devices`, the one module that
touches hardware), the host's memory, and the census of the objects passed.

Reading device-wide memory never creates a CUDA context on a device this process has not used:
the driver's view (NVML, else nvidia-smi) is read first, ``cudaMemGetInfo`` only for devices
this process already holds memory on or that were named explicitly.
"""

from __future__ import annotations

import logging
import os
import reprlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from memkit import advice as advice_rules
from memkit import devices
from memkit.advice import Advice
from memkit.errors import ConfigError, check_flag, check_whole
from memkit.simulated.accountant import MemoryAccountant, counting
from memkit.snapshots.census import Census, categorise, largest
from memkit.snapshots.results import DeviceSnapshot, HostSnapshot, Snapshot
from memkit.units import format_size

__all__ = ["DeviceArg", "snapshot"]

log = logging.getLogger("memkit.snapshots")

DeviceArg = str | torch.device | MemoryAccountant | devices.CudaBackend | devices.SimulatedBackend
"""What ``snapshot(device=...)`` accepts (or a sequence of them)."""


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
        ConfigError: an object is none of those kinds (checked before anything is read), or
            ``device`` is not something memkit can read.

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Linear(256, 256)
        >>> before = memkit.snapshot(model)
        >>> model(torch.randn(4, 256)).sum().backward()
        >>> diff = memkit.snapshot(model) - before
        >>> [c.after for c in diff.changes if c.what == "gradients"]
        [263168]
    """
    check_flag("scan_gc", scan_gc)
    check_flag("nvidia_smi", nvidia_smi)
    check_whole("top", top, 0, "tensors to list")
    taken_at = time.time()
    notes: list[str] = []
    census = _census_of(objects, scan_gc, notes)
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
    rows = [] if targets else _visible_rows(stats, smi_reason, notes)
    by_index = {s.cuda_index: s for s in stats if s.cuda_index is not None}
    for target in targets:
        rows.append(_target_row(target, objects, by_index, smi_reason, accountants, notes))

    hm = devices.host_memory()
    host = HostSnapshot(hm.process_rss, hm.available, hm.total, hm.reason)
    categories = categorise(census, rows, accountants, scan_gc, notes) if census.entries else ()
    return Snapshot(
        taken_at=taken_at,
        devices=tuple(rows),
        host=host,
        categories=categories,
        tensors=largest(census, top),
        notes=tuple(notes),
        label=label,
        top=top,
        advice=_device_advice(rows),
    )


_OBJECT_KINDS = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, dict, list, tuple, set)
"""What :func:`snapshot` takes as objects (inside a dict or a list, other values are skipped:
a checkpoint's ``{"step": 3, "model": ...}``)."""


def _checked_objects(objects: Sequence[Any]) -> None:
    """Each object passed is one :func:`snapshot` can say something about, not silently
    nothing (``snapshot("before")`` meant ``label="before"``)."""
    for i, obj in enumerate(objects):
        if not isinstance(obj, _OBJECT_KINDS):
            hint = f"; to name this moment, pass label={obj!r}" if isinstance(obj, str) else ""
            raise ConfigError(
                f"objects[{i}]: expected a model, an optimizer, a tensor, or a dict, list, tuple "
                f"or set of them, found {reprlib.repr(obj)} ({type(obj).__name__}){hint}"
            )


def _census_of(objects: Sequence[Any], scan_gc: bool, notes: list[str]) -> Census:
    """The storages of the objects passed (modules first, so parameters get their names)."""
    _checked_objects(objects)
    census = Census()
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
    if scan_gc:
        found = census.scan_gc()
        notes.append(f"gc scan: {found} tensor objects examined")
    return census


def _visible_rows(
    stats: list[devices.GpuStats], smi_reason: str | None, notes: list[str]
) -> list[DeviceSnapshot]:
    """Every accelerator torch sees, then GPUs only nvidia-smi sees, else a "none" row."""
    by_index = {s.cuda_index: s for s in stats if s.cuda_index is not None}
    rows: list[DeviceSnapshot] = []
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
    return rows


def _target_row(
    target: Any,
    objects: Sequence[Any],
    by_index: dict[int, devices.GpuStats],
    smi_reason: str | None,
    accountants: dict[str, MemoryAccountant],
    notes: list[str],
) -> DeviceSnapshot:
    """The row of one device named in ``device=``; simulated ones join ``accountants``."""
    if isinstance(target, MemoryAccountant):
        size = "no budget" if target.budget is None else format_size(target.budget)
        accounting = (
            f"memkit simulated device: live tensor storages on {target.device} "
            f"({'CUDA 512-byte rounding' if target.rounding == 'cuda' else 'exact bytes'})"
        )
        accountants[str(target.device)] = target
        if not counting(target):  # (sweep BU: a notebook's next cell, after the block)
            notes.append(
                f"{target.device}: this simulated device counts nothing now (its `with "
                "memkit.simulate(...)` block has ended, or is open in another thread): its "
                "numbers are as they were when it stopped; tensors made or freed since, and "
                "those passed here that it never counted, are not in them. Take the snapshot "
                "inside the block"
            )
        return _simulated_row(target, f"{target.name} ({size})", accounting)
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
        accountants[str(acct.device)] = acct
        return _simulated_row(acct, target.name(), target.accounting)
    if isinstance(target, devices.CudaBackend):
        return _cuda_row(target, by_index.get(target.index), smi_reason, True)
    raise ConfigError(f"expected a memkit backend, found {type(target).__name__} for device=")


def _device_advice(rows: Sequence[DeviceSnapshot]) -> tuple[Advice, ...]:
    """Advice (issue #5): other-processes, fragmentation, empty-cache from each row's readings."""
    return tuple(
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
