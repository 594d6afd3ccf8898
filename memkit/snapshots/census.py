"""The tensor census: the unique storages of the objects passed to :func:`~memkit.snapshots.
snapshot`, named and categorised per device, and the largest tensors among them.

Each storage is counted once, in the first category that holds it (parameters, buffers,
gradients, optimizer state), so tied or shared weights are not counted twice.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch

from memkit.devices import tensor_device
from memkit.simulated.accountant import MemoryAccountant, counted_bytes, strided_parts, tensors_of
from memkit.snapshots.identity import storage_serial
from memkit.snapshots.results import CATEGORY_FIELDS, Categories, DeviceSnapshot, TensorInfo
from memkit.units import format_size

__all__ = ["Census", "categorise", "largest"]

_KIND_RANK = {"parameter": 0, "buffer": 1, "gradient": 2, "optimizer state": 3, "tensor": 4}
_KIND_FIELD = {
    "parameter": "parameters",
    "buffer": "buffers",
    "gradient": "gradients",
    "optimizer state": "optimizer_state",
}


class _Entry:
    """One storage seen while categorising (internal, mutable)."""

    __slots__ = ("device", "kind", "names", "nbytes", "storage", "tensor")

    def __init__(self, storage: Any, tensor: torch.Tensor, kind: str, name: str | None) -> None:
        self.storage = storage
        self.tensor = tensor
        self.kind = kind
        self.names: list[str] = [name] if name else []
        self.device = str(tensor_device(tensor))  # the CUDA stand-in's tensors are cuda:0
        self.nbytes = int(storage.nbytes())


class Census:
    """Unique storages of the objects passed (and, optionally, of the gc scan)."""

    def __init__(self) -> None:
        self.entries: dict[int, _Entry] = {}
        self.param_names: dict[int, str] = {}

    def add(self, tensor: torch.Tensor, kind: str, name: str | None) -> None:
        """Count ``tensor``'s storages: a strided tensor's one, a sparse tensor's parts (its
        indices and values, each named after the tensor: ``emb.weight.grad.values``)."""
        for part_name, part in strided_parts(tensor):
            if part_name and name:
                self._add(part, kind, f"{name}.{part_name}")
            else:
                self._add(part, kind, name)

    def _add(self, tensor: torch.Tensor, kind: str, name: str | None) -> None:
        try:
            storage = tensor.untyped_storage()
        except Exception:  # a functional or fake tensor: no storage of its own
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
            # a non-leaf's .grad is None unless retain_grad() was called (reading it warns)
            if (obj.is_leaf or obj.retains_grad) and obj.grad is not None:
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


_COUNTED_AS = {
    "cuda": "allocator blocks: each storage's bytes rounded up to 512, as memory_allocated "
    "counts them (a tensor's own bytes can be up to 511 fewer)",
    "none": "each storage's bytes",
}


def _counted(entry: _Entry, rounding: str) -> int:
    return counted_bytes(entry.nbytes, rounding)


def _simulated_other(
    dev_name: str, entries: list[_Entry], acct: MemoryAccountant, notes: list[str]
) -> tuple[int | None, str]:
    """Other tensors on a simulated device: its live storages that are not categorised."""
    live = {id(s): n for s, n in acct.live_storages()}
    keys = {id(e.storage) for e in entries if e.kind in _KIND_FIELD}
    other = sum(n for k, n in live.items() if k not in keys)
    uncounted = sum(
        _counted(e, acct.rounding)
        for e in entries
        if e.kind in _KIND_FIELD and id(e.storage) not in live
    )
    if uncounted:
        notes.append(
            f"{format_size(uncounted)} of the categorised tensors on {dev_name} are not "
            "counted by the simulated device: pass them to simulate(track=...) or "
            "acct.track(...) to count them."
        )
    return other, "the simulated device's live storages minus the categorised ones"


def _allocated_other(
    dev_name: str, alloc: int, categorised: int, notes: list[str]
) -> tuple[int | None, str]:
    """Other tensors on a device with an allocator counter: allocated minus categorised."""
    other = alloc - categorised
    if other < 0:
        notes.append(
            f"on {dev_name} the categorised tensors ({format_size(categorised)}) exceed "
            f"allocated ({format_size(alloc)}): some were freed or made elsewhere "
            "while reading"
        )
        return None, "unknown: categorised tensors exceed allocated"
    return other, "allocated minus the categorised tensors (activations, batches, caches...)"


def _passed_other(dev_name: str, passed_other: int, scanned: bool) -> tuple[int | None, str]:
    """Other tensors on a device nothing counts: the uncategorised tensors passed or found."""
    if scanned:
        return (
            passed_other,
            "tensors found by the gc scan (misses tensors only C++ holds, e.g. autograd)",
        )
    if passed_other:
        return passed_other, "tensors passed to snapshot()"
    return None, (
        f"unknown: nothing counts {dev_name} tensors; pass "
        "device=memkit.simulate(...) or scan_gc=True"
    )


def categorise(
    census: Census,
    rows: Sequence[DeviceSnapshot],
    accountants: dict[str, MemoryAccountant],
    scanned: bool,
    notes: list[str],
) -> tuple[Categories, ...]:
    """Per device, the bytes of each category, and the other tensors by the best count there
    is: the simulated device's live storages, the allocator's counter, or the tensors seen.
    Remarks about the counting are appended to ``notes``."""
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
        alloc = allocated.get(dev_name)
        if acct is not None:
            other, how = _simulated_other(dev_name, entries, acct, notes)
        elif alloc is not None:
            other, how = _allocated_other(dev_name, alloc, sum(sums.values()), notes)
        else:
            other, how = _passed_other(dev_name, passed_other, scanned)
        out.append(
            Categories(
                dev_name, **sums, other=other, other_how=how, counted_as=_COUNTED_AS[rounding]
            )
        )
    return tuple(out)


def largest(census: Census, top: int) -> tuple[TensorInfo, ...]:
    """The ``top`` largest storages, largest first, with their names, aliases and the number
    that says which storage each is (:func:`~memkit.snapshots.identity.storage_serial`)."""
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
                storage_id=storage_serial(e.storage),
            )
        )
    return tuple(out)
