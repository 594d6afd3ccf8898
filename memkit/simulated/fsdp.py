"""FSDP2 (``fully_shard``) on virtual devices: what each rank allocates, step for step as
torch/distributed/fsdp/_fully_shard/ does it (read from _fsdp_param.py, _fsdp_param_group.py,
_fsdp_collectives.py and _fsdp_state.py, torch 2.11 to 2.13).

:func:`fsdp_ranks` gives each virtual device (rank ``r`` of ``N``) the model's units, each
``fully_shard``-ed as :func:`fsdp_units` chooses, and the rank's optimizer over its shards:

* each parameter's shard is ``ceil(dim0 / N)`` rows padded (``_sharded_param_data``); the rank's
  parameter is its first ``min(ceil, dim0 - r * ceil)`` rows, so the optimizer state is the
  unpadded shard's;
* forward, per unit: the flat all-gather buffer (``N x`` the unit's padded shard) is allocated
  while the previous unit's is still kept (``AllGatherState``), that one is freed, then the
  unsharded parameters (``N x`` padded shard each) are allocated and the unit runs; after it,
  non-root units are resharded (``reshard_after_forward``); after the root, the kept buffer
  is freed;
* backward, per unit in reverse: the unit is all-gathered again (buffer, unsharded
  parameters, buffer freed) and the unit before it is prefetched (its buffer allocated now);
  once the gradients of the unit's forward inputs are in (``post_backward``, hooked on them by
  ``RegisterPostBackwardFunction``: after the unit's whole backward, frozen weights' use for
  the input's gradient included; in the final callback for a unit whose inputs need none):
  the unsharded parameters are freed, the previous unit's reduce-scatter input is freed, the
  unit's input (padded unsharded gradients of the parameters that got one: none of a frozen
  parameter) allocated, the unsharded gradients freed, and the reduce-scatter output (the
  padded shards) becomes the sharded gradients, added to existing ones (then freed). The
  root's final callback frees the last input. A unit whose outputs need no gradient (frozen,
  its inputs needing none) is not gathered in backward.

The unit's compute runs on the real (full) parameters, placed on the device while unsharded
(their bytes are the unsharded parameters; the padding rows are held apart). Every storage
FSDP itself allocates (padded shards, all-gather buffers, padding rows, reduce-scatter input
and output) is made on the real device of the parameters it stands for: ``cpu`` for
``memkit probe``, ``meta`` for ``memkit estimate``. Never on the ambient default device: the
comparison builds only its models and batches under ``torch.device("meta")``, and even under
it a backward runs its hooks with no device context (a ``TorchFunctionMode`` is off while it
handles a call, here ``backward``); a ``meta`` accountant counts no ``cpu`` storage, so these
(half the peak on a wide MLP) once went uncounted on meta. Not modelled: mixed precision
(``MixedPrecisionPolicy``), CPU offload, HSDP, explicit prefetching, and the collectives' own
buffers (NCCL's are outside the caching allocator; gloo's are host memory).
Ranks run one after another; the collectives move no values (sizes do not depend on them).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memkit.simulated.accountant import tensors_of
from memkit.simulated.virtual_devices import HOST, VirtualDevices, active_virtual_devices

log = logging.getLogger(__name__)

__all__ = [
    "FsdpRank",
    "fsdp_ranks",
    "fsdp_units",
    "meta_optimizer_state",
    "optimizer_on_meta",
    "split_candidate",
    "tensor_bytes",
    "unit_sizes",
]


def fsdp_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules :func:`fsdp_ranks` shards as units, in forward order, the root last: the
    children of the model's largest ``ModuleList``/``Sequential`` (its blocks), else the
    model's children with parameters; the root takes the parameters left."""
    best: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = [
                (f"{name}.{k}" if name else k, c)
                for k, c in mod.named_children()
                if any(True for _ in c.parameters())
            ]
            if len(kids) > len(best):
                best = kids
    if len(best) < 2:
        best = [(k, c) for k, c in model.named_children() if any(True for _ in c.parameters())]
    return [*best, ("", model)]


def _owned(
    picked: Sequence[tuple[str, torch.nn.Module]],
) -> list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]]:
    """Each unit with the parameters it shards: its own, not an earlier unit's."""
    owned: set[int] = set()
    out = []
    for name, mod in picked:
        params = [p for p in mod.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        out.append((name, mod, params))
    return out


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors' elements (any device, meta too)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def unit_sizes(model: torch.nn.Module) -> list[tuple[str, int]]:
    """Each unit of :func:`fsdp_units` and its unsharded parameter bytes (any device, meta too)."""
    return [(name, tensor_bytes(params)) for name, _, params in _owned(fsdp_units(model))]


def meta_optimizer_state(optimizer: Any) -> int | None:
    """Bytes of device state that ``optimizer``, built over meta parameters, holds after one
    step (Adam's moments, momentum buffers; not host scalars); ``None`` when it cannot step on
    meta tensors. The sharded state FSDP advice divides among GPUs."""
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        optimizer.step()
    except Exception as exc:  # advice must never break what it advises on
        log.debug("the optimizer did not step on meta tensors: %s", exc)
        return None
    return tensor_bytes([t for t in tensors_of(optimizer.state) if t.device.type == "meta"])


def optimizer_on_meta(optimizer: Any) -> Any | None:
    """The same optimizer (class, settings, groups) over meta copies of its parameters: no
    device memory, so it can be measured when the model does not fit. ``None`` when its class
    cannot be rebuilt from ``param_groups`` and ``defaults``."""
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [
                torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                for p in group["params"]
            ],
        }
        for group in optimizer.param_groups
    ]
    cls = type(optimizer)
    try:  # the settings its constructor takes (AdamW's defaults hold one it sets itself)
        accepted = inspect.signature(cls).parameters
        return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except Exception as exc:
        log.debug("%s could not be rebuilt on meta tensors: %s", type(optimizer).__name__, exc)
        return None


def split_candidate(model: torch.nn.Module) -> tuple[str, int] | None:
    """The largest module inside the largest unit that is not a unit and holds only part of
    that unit's parameters (its path and bytes): the one to ``fully_shard`` on its own."""
    units = _owned(fsdp_units(model))
    name, unit, params = max(units, key=lambda u: tensor_bytes(u[2]))
    total, mine = tensor_bytes(params), {id(p) for p in params}
    best: tuple[str, int] | None = None
    for path, mod in unit.named_modules():
        size = tensor_bytes([p for p in mod.parameters() if id(p) in mine])
        if mod is not unit and 0 < size < total and (best is None or size > best[1]):
            best = (f"{name}.{path}" if name else path, size)
    return best


@dataclass
class _Unit:
    name: str
    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    rows: list[int]  # padded shard rows (ceil(dim0 / N)) per parameter
    root: bool
    shards: list[torch.nn.Parameter] = field(default_factory=list)
    pads: list[torch.Tensor] = field(default_factory=list)
    gathered: bool = False
    post_backward_done: bool = False

    @property
    def like(self) -> dict[str, Any]:
        """The dtype and real device (cpu, or meta) of the unit's flat buffers: its
        parameters', never the ambient default device (which hooks run without)."""
        first = self.params[0]
        return {"dtype": first.dtype, "device": first.device}

    def padded_numel(self, world: int) -> int:
        """Elements of the unit's unsharded, padded parameters (= its all-gather buffer's)."""
        return sum(world * r * _row(p) for p, r in zip(self.params, self.rows, strict=True))


def _row(p: torch.Tensor) -> int:
    return math.prod(p.shape[1:]) if p.dim() else 1


@dataclass
class FsdpRank:
    """What FSDP2 keeps on one rank: the model (full parameters on the host, on the device
    while a unit is unsharded), the rank's shards and the optimizer over them."""

    device: int
    model: torch.nn.Module
    optimizer: Any
    units: list[_Unit]
    handles: list[Any]

    @property
    def largest_unit(self) -> tuple[str, int]:
        """The unit with the most unsharded (padded) parameter bytes, and them."""
        world = _vd().n
        best = max(self.units, key=lambda u: u.padded_numel(world))
        size = best.padded_numel(world) * (best.params[0].element_size() if best.params else 0)
        return (best.name or type(self.model).__name__, size)


def _vd() -> VirtualDevices:
    vd = active_virtual_devices()
    if vd is None:
        raise RuntimeError(
            "memkit.simulated.fsdp works inside `with memkit.simulate(..., devices=N):`"
        )
    return vd


class _PostBackward(torch.autograd.Function):
    """FSDP2's ``RegisterPostBackwardFunction``: the identity on a unit's forward inputs that
    require gradients; its backward runs once all of their gradients are in, which is after
    the unit's whole backward (a frozen weight's use for the input's gradient included)."""

    @staticmethod
    def forward(ctx: Any, post: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.post = post
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.post()
        return (None, *grads)


class _Rank:
    """The hooks of one rank's units (FSDP2's pre/post forward, pre/post backward)."""

    def __init__(self, vd: VirtualDevices, dev: int, units: list[_Unit]) -> None:
        self.vd, self.dev, self.units = vd, dev, units
        self.kept: torch.Tensor | None = None  # forward's AllGatherState buffer
        self.prefetched: dict[int, torch.Tensor] = {}  # unit index -> its all-gather buffer
        self.rs_input: torch.Tensor | None = None  # the last reduce-scatter input
        self.order: list[int] = []  # units in post-forward order
        self.final_queued = False

    def _buffer(self, unit: _Unit) -> torch.Tensor:
        with self.vd.on(self.dev):
            return torch.empty(unit.padded_numel(self.vd.n), **unit.like)

    def _unshard(self, i: int, forward: bool) -> None:
        unit = self.units[i]
        if unit.gathered or not unit.params:
            return
        buf = self.prefetched.pop(i, None)
        if buf is None:
            buf = self._buffer(unit)  # foreach_all_gather's output
        if forward:
            self.kept = None  # the previous unit's, freed after this all-gather
        for p in unit.params:  # alloc_all_gather_outputs + copy-out
            self.vd.to([p], self.dev)  # in place (a list): the unsharded parameter
        with self.vd.on(self.dev):
            unit.pads = [
                torch.empty((self.vd.n * r - p.shape[0]) * _row(p), dtype=p.dtype, device=p.device)
                for p, r in zip(unit.params, unit.rows, strict=True)
                if self.vd.n * r > p.shape[0]
            ]
        unit.gathered = True
        if forward:
            self.kept = buf
        del buf

    def _reshard(self, unit: _Unit) -> None:
        if not unit.gathered:
            return
        for p in unit.params:
            self.vd.to([p], HOST)
        unit.pads = []
        unit.gathered = False

    def pre_forward(
        self, i: int, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if i == len(self.units) - 1:
            self.order = []
        unit = self.units[i]
        unit.post_backward_done = False
        self._unshard(i, forward=True)
        # FSDP2's post-backward: on the gradients of the unit's inputs (_register_post_backward_
        # hook), not of its parameters, so a unit is resharded after its whole backward;
        # a unit whose inputs need no gradient (the first, the root) in the final callback
        if not unit.params or not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        where = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return None
        outs = _PostBackward.apply(
            functools.partial(self.post_backward, i), *[flat[k] for k in where]
        )
        for k, t in zip(where, outs, strict=True):
            flat[k] = t
        new_args, new_kwargs = tree_unflatten(flat, spec)
        return new_args, new_kwargs

    def post_forward(self, i: int, _module: Any, _args: Any, output: Any) -> None:
        unit = self.units[i]
        self.order.append(i)
        if unit.root:
            self.kept = None  # the root flushes the kept all-gather buffer
        else:
            self._reshard(unit)
        # FSDP2's pre-backward: a hook on the outputs' gradients (_register_pre_backward_hook);
        # a frozen unit whose inputs need no gradient has none: it is not gathered in backward
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self.pre_backward, i))

    def pre_backward(self, i: int, *_: Any) -> None:
        if not self.final_queued:  # the root's final callback, queued by any unit's
            self.final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
        self._unshard(i, forward=False)
        pos = self.order.index(i) if i in self.order else -1
        if pos > 0:  # prefetch the unit that ran before this one
            j = self.order[pos - 1]
            if not self.units[j].gathered and j not in self.prefetched and self.units[j].params:
                self.prefetched[j] = self._buffer(self.units[j])

    def post_backward(self, i: int) -> None:
        """FSDPParamGroup.post_backward: the unsharded gradients (of the parameters that have
        one: a frozen parameter has none) are taken, the unit resharded, the previous unit's
        reduce-scatter input freed (also by a unit with no gradients), then this unit's input
        (its gradients' padded sizes) allocated, the gradients copied in and freed, and the
        output (the padded shards) becomes the sharded gradients, added to existing ones."""
        unit = self.units[i]
        unit.post_backward_done = True
        if not unit.params:
            return
        with_grad = [
            (p, shard, rows)
            for p, shard, rows in zip(unit.params, unit.shards, unit.rows, strict=True)
            if p.grad is not None
        ]
        grads = [p.grad for p, _, _ in with_grad]
        for p, _, _ in with_grad:
            p.grad = None
        self._reshard(unit)
        self.rs_input = None  # the previous unit's reduce-scatter input
        if not with_grad:
            return
        numel = sum(self.vd.n * rows * _row(p) for p, _, rows in with_grad)
        with self.vd.on(self.dev):
            rs_input = torch.empty(numel, **unit.like)
        grads.clear()  # copied in
        with self.vd.on(self.dev):
            out = torch.empty(numel // self.vd.n, **unit.like)
        offset = 0
        for p, shard, rows in with_grad:
            view = out[offset : offset + shard.numel()].view_as(shard)
            if shard.grad is None:
                shard.grad = view
            else:
                shard.grad.add_(view)
            offset += rows * _row(p)
        del out, view
        self.rs_input = rs_input

    def _final(self) -> None:
        """The root's post-backward final callback: the post-backward of each unit whose
        inputs needed no gradient (the root first, then the units in module order, as FSDP2's
        ``all_states``), then the last reduce-scatter input and any unused prefetch freed."""
        for i in [len(self.units) - 1, *range(len(self.units) - 1)]:
            if not self.units[i].post_backward_done:
                self.post_backward(i)
        for unit in self.units:
            unit.post_backward_done = False
        self.rs_input = None
        self.prefetched.clear()
        self.final_queued = False


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (itself, or in a tuple, list or dict, one level)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def fsdp_ranks(
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], Any] | None,
    devices: Sequence[int] | None = None,
) -> list[FsdpRank]:
    """What FSDP2 puts on each virtual device (the module docstring): a copy of ``model`` run
    with FSDP2's unshard and reshard, the rank's shards and ``make_optimizer`` over them (a
    module holding the shards as its parameters)."""
    vd = _vd()
    ids = list(range(vd.n)) if devices is None else list(devices)
    world = vd.n
    out = []
    for rank_index, dev in enumerate(ids):
        with vd.paused():
            replica = copy.deepcopy(model)
        vd.to(replica, HOST)
        units: list[_Unit] = []
        for name, mod, params in _owned(fsdp_units(replica)):
            rows = [-(-(p.shape[0] if p.dim() else 1) // world) for p in params]
            units.append(_Unit(name, mod, params, rows, root=mod is replica))
            vd.managed(params, "memkit's simulated FSDP")  # gathered and resharded by it
        holder = torch.nn.Module()
        with vd.on(dev):
            for u_i, unit in enumerate(units):
                for p_i, (p, pad_rows) in enumerate(zip(unit.params, unit.rows, strict=True)):
                    dim0 = p.shape[0] if p.dim() else 1
                    mine = max(0, min(pad_rows, dim0 - rank_index * pad_rows))
                    # _sharded_param_data, on the real device of p (cpu, or meta)
                    padded = torch.empty(pad_rows * _row(p), dtype=p.dtype, device=p.device)
                    shard = torch.nn.Parameter(
                        padded[: mine * _row(p)].view(mine, *p.shape[1:]) if p.dim() else padded,
                        requires_grad=p.requires_grad,
                    )
                    unit.shards.append(shard)
                    holder.register_parameter(f"u{u_i}_p{p_i}", shard)
            for mod in replica.modules():  # buffers are not sharded: each rank holds them
                for key, buf in mod._buffers.items():
                    if buf is not None:
                        mod._buffers[key] = vd.to(buf, dev)  # a tensor's copy, as .to() gives
            opt = make_optimizer(holder) if make_optimizer is not None else None
        rank = _Rank(vd, dev, units)
        handles = []
        for i, unit in enumerate(units):
            handles.append(
                unit.module.register_forward_pre_hook(
                    functools.partial(rank.pre_forward, i), with_kwargs=True
                )
            )
            handles.append(
                unit.module.register_forward_hook(functools.partial(rank.post_forward, i))
            )
        out.append(FsdpRank(dev, replica, opt, units, handles))
    return out
