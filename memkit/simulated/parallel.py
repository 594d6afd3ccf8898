"""DataParallel and DDP on virtual devices (``memkit.simulate(..., devices=N)``).

:class:`DataParallel` is a stand-in for ``torch.nn.DataParallel`` that runs its data flow on
memkit's virtual devices, step for step as ``torch/nn/parallel/`` does it (read from
data_parallel.py, scatter_gather.py, replicate.py, comm.py and _functions.py):

1. check that the module's parameters and buffers are on ``device_ids[0]`` (PyTorch's message);
2. scatter the inputs along ``dim`` (``tensor.chunk(len(device_ids))``: chunks of
   ``ceil(B / n)``, fewer chunks when the batch is small); the chunk for the device the input is
   already on is a view, the others are copies;
3. replicate the module onto ``device_ids[:len(chunks)]``: ``device_ids[0]`` uses the original
   parameters, the others get copies through ``broadcast_coalesced`` (flat buckets of up to
   10 MiB, unflattened into views; a bucket of several tensors is first flattened on
   ``device_ids[0]``), buffers too;
4. run the replicas, **sequentially in the calling thread**, each with its device current
   (torch uses one thread per replica; dispatch modes are thread-local, and each device's
   memory depends only on its own replica's ops, so the order does not change a device's peak);
5. gather the outputs on ``output_device`` (one new tensor there, filled by copies).

In backward, Gather's backward scatters the output gradient back to the replicas' devices and
Broadcast's backward reduce-adds the replicas' gradients onto ``device_ids[0]``
(``reduce_add_coalesced``: per 10 MiB bucket, each device flattens its gradients, the
destination gets one result buffer, as with NCCL's reduce), where they accumulate into the
original parameters' ``.grad``.

Not modelled: CUDA streams and their caching-allocator pools, NCCL's internal buffers, the CUDA
context per device; exceptions in a replica propagate as they are (torch re-raises them from
the replica thread with "Caught ... in replica i").

:func:`ddp_replicas` builds what DistributedDataParallel puts on each device: a full replica,
its optimizer, its gradient buckets (``bucket_cap_mb`` 25, the first bucket 1 MiB; one flat
tensor per bucket, as the Reducer allocates them at construction whatever
``gradient_as_bucket_view`` says) and the Reducer's unused-parameter map (one int32 per
trainable parameter). With ``gradient_as_bucket_view=True`` each gradient, once accumulated, is
copied into its bucket view and replaced by it (the Reducer's autograd hook), so gradients take
no memory of their own beyond the one being handed over. The all-reduce itself is in place on
the bucket (gloo and NCCL alike) and its communication buffers are not tensor memory: not
modelled, and not counted by memkit's simulated device nor by ``torch.cuda.memory_allocated``.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd import Function

from memkit.simulated.virtual_devices import (
    HOST,
    VirtualDevices,
    active_virtual_devices,
    device_name,
)

__all__ = [
    "BROADCAST_BUFFER_BYTES",
    "DDP_BUCKET_CAP_MB",
    "DDP_FIRST_BUCKET_BYTES",
    "DataParallel",
    "DdpReplica",
    "bucket_indices",
    "bucket_sizes",
    "ddp_replicas",
    "gather",
    "replicate",
    "scatter_kwargs",
]

BROADCAST_BUFFER_BYTES = 10 * 1024 * 1024
"""``buffer_size`` of ``comm.broadcast_coalesced``/``reduce_add_coalesced``: 10 MiB buckets."""
DDP_BUCKET_CAP_MB = 25
"""DistributedDataParallel's default ``bucket_cap_mb``."""
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: DDP's first bucket is 1 MiB."""


def _vd() -> VirtualDevices:
    vd = active_virtual_devices()
    if vd is None:
        raise RuntimeError(
            "memkit.simulated.parallel works on virtual devices: run it inside "
            "`with memkit.simulate(budget, devices=N):`"
        )
    return vd


def _take(tensors: Sequence[torch.Tensor], limit: int, flush_after: bool) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets of one dtype, of about ``limit`` bytes.

    ``flush_after``: the C++ ``take_tensors`` (broadcast_coalesced) adds a tensor, then closes
    the bucket once it reaches the limit; the Python ``_take_tensors`` (reduce_add_coalesced)
    closes it before a tensor that would cross the limit.
    """
    out: list[list[int]] = []
    open_: dict[Any, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        size = t.numel() * t.element_size()
        key = (t.dtype, t.is_sparse)
        idx, total = open_.get(key, ([], 0))
        if not flush_after and idx and total + size > limit:
            out.append(idx)
            idx, total = [], 0
        idx.append(i)
        total += size
        if flush_after and total >= limit:
            out.append(idx)
            idx, total = [], 0
        open_[key] = (idx, total)
    out.extend(idx for idx, _ in open_.values() if idx)
    return out


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    devices: Sequence[int],
    buffer_size: int = BROADCAST_BUFFER_BYTES,
) -> list[list[torch.Tensor]]:
    """``comm.broadcast_coalesced`` on virtual devices: ``devices[0]`` keeps the originals."""
    vd = _vd()
    outputs: list[list[Any]] = [list(tensors)] + [[None] * len(tensors) for _ in devices[1:]]
    for idx in _take(tensors, buffer_size, flush_after=True):
        chunk = [tensors[i] for i in idx]
        with vd.on(devices[0]):
            flat = _flatten_dense_tensors(chunk)  # a view for one tensor, else a cat on the source
        for j, dev in enumerate(devices[1:], 1):
            copied = vd.to(flat, dev)
            for i, view in zip(idx, _unflatten_dense_tensors(copied, chunk), strict=True):
                outputs[j][i] = view
        del flat
    return outputs


def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: int,
    buffer_size: int = BROADCAST_BUFFER_BYTES,
) -> tuple[torch.Tensor, ...]:
    """``comm.reduce_add_coalesced`` on virtual devices, NCCL's path: per bucket, each device
    flattens its tensors and ``destination`` gets one result buffer (``empty_like``), reduced
    into in place; the results are views of it."""
    vd = _vd()
    output: list[Any] = [None] * len(inputs[0])
    for idx in _take(inputs[0], buffer_size, flush_after=False):
        flats = []
        for per_device in inputs:
            chunk = [per_device[i] for i in idx]
            with vd.on(vd.where(chunk[0])):
                flats.append(_flatten_dense_tensors(chunk))
        root = next(f for f in flats if vd.where(f) == destination)
        result = torch.empty_like(root)
        with vd.paused():  # NCCL reduces into `result` with no tensor memory of its own
            total = flats[0].clone()
            for f in flats[1:]:
                total.add_(f)
            result.copy_(total)
            del total
        del flats, root
        for i, t in zip(
            idx, _unflatten_dense_tensors(result, [inputs[0][k] for k in idx]), strict=False
        ):
            output[i] = t.data
    return tuple(output)


class _Broadcast(Function):
    @staticmethod
    def forward(ctx: Any, devices: Sequence[int], *inputs: torch.Tensor) -> Any:
        ctx.devices = list(devices)
        if not inputs:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = devices[0]
        outputs = broadcast_coalesced(inputs, devices)
        frozen: list[torch.Tensor] = []
        for idx, needs in enumerate(ctx.needs_input_grad[1:]):
            if not needs:
                frozen.extend(out[idx] for out in outputs)
        ctx.mark_non_differentiable(*frozen)
        return tuple(itertools.chain.from_iterable(outputs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, *_ReduceAddCoalesced.apply(ctx.input_device, ctx.num_inputs, *grads))


class _ReduceAddCoalesced(Function):
    @staticmethod
    def forward(ctx: Any, destination: int, num_inputs: int, *grads: torch.Tensor) -> Any:
        per_device = [grads[i : i + num_inputs] for i in range(0, len(grads), num_inputs)]
        return reduce_add_coalesced(per_device, destination)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # pragma: no cover - double backward
        raise RuntimeError("memkit's DataParallel stand-in does not support double backward")


def _scatter_tensor(tensor: torch.Tensor, devices: Sequence[int], sizes: Any, dim: int) -> Any:
    vd = _vd()
    chunks = (
        tensor.split(list(sizes), dim) if sizes is not None else tensor.chunk(len(devices), dim)
    )
    # the chunk already on its device stays a view (comm.scatter's .to(device, copy=False))
    return tuple(vd.to(c, d) for c, d in zip(chunks, devices, strict=False))


class _Scatter(Function):
    @staticmethod
    def forward(ctx: Any, devices: Sequence[int], sizes: Any, dim: int, input: torch.Tensor) -> Any:
        ctx.dim = dim
        ctx.input_device = _vd().where(input)
        return _scatter_tensor(input, devices, sizes, dim)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return None, None, None, _Gather.apply(ctx.input_device, ctx.dim, *grads)


class _Gather(Function):
    @staticmethod
    def forward(ctx: Any, target: int, dim: int, *inputs: torch.Tensor) -> torch.Tensor:
        vd = _vd()
        ctx.target = target
        ctx.dim = dim
        ctx.input_devices = tuple(vd.where(t) for t in inputs)
        if all(t.dim() == 0 for t in inputs) and dim == 0:
            inputs = tuple(t.view(1) for t in inputs)
            ctx.unsqueezed = True
        else:
            ctx.unsqueezed = False
        ctx.sizes = tuple(t.size(dim) for t in inputs)
        shape = list(inputs[0].shape)
        shape[dim] = sum(ctx.sizes)
        with vd.on(target):  # comm.gather: one empty result on the target, filled by copies
            result = torch.empty(shape, dtype=inputs[0].dtype, device=inputs[0].device)
        offset = 0
        for t, n in zip(inputs, ctx.sizes, strict=False):
            result.narrow(dim, offset, n).copy_(t)
            offset += n
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grads = _Scatter.apply(ctx.input_devices, ctx.sizes, ctx.dim, grad)
        if ctx.unsqueezed:
            grads = tuple(g[0] for g in grads)
        return (None, None, *grads)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(inputs: Any, devices: Sequence[int], dim: int = 0) -> Any:
    """``scatter_gather.scatter``: tensors split along ``dim``, other objects repeated."""

    def scatter_map(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _Scatter.apply(devices, None, dim, obj)
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(scatter_map, obj), strict=False)]
        if isinstance(obj, tuple) and obj:
            return list(zip(*map(scatter_map, obj), strict=False))
        if isinstance(obj, list) and obj:
            return [list(i) for i in zip(*map(scatter_map, obj), strict=False)]
        if isinstance(obj, dict) and obj:
            return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()), strict=False)]
        return [obj for _ in devices]

    return scatter_map(inputs)


def scatter_kwargs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, devices: Sequence[int], dim: int = 0
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """``scatter_gather.scatter_kwargs``, its padding rule included."""
    scattered_inputs = scatter(inputs, devices, dim) if inputs else []
    scattered_kwargs = scatter(kwargs, devices, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def gather(outputs: Sequence[Any], target: int, dim: int = 0) -> Any:
    """``scatter_gather.gather``: tensors concatenated along ``dim`` on ``target``."""

    def gather_map(outs: Sequence[Any]) -> Any:
        out = outs[0]
        if isinstance(out, torch.Tensor):
            return _Gather.apply(target, dim, *outs)
        if out is None:
            return None
        if isinstance(out, dict):
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs, strict=False)))
        return type(out)(map(gather_map, zip(*outs, strict=False)))

    return gather_map(outputs)


def _broadcast_reshape(
    tensors: Sequence[torch.Tensor], devices: Sequence[int], detach: bool
) -> list[list[torch.Tensor]]:
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return broadcast_coalesced(tensors, devices)
    copies = _Broadcast.apply(devices, *tensors)
    n = len(tensors)
    return [list(copies[i : i + n]) for i in range(0, len(copies), n)]


def replicate(network: torch.nn.Module, devices: Sequence[int], detach: bool = False) -> list[Any]:
    """``replicate.replicate``: one module copy per device sharing the structure; parameters
    and buffers broadcast from ``devices[0]`` (which keeps the originals)."""
    if not devices:
        return []
    params = list(network.parameters())
    param_idx = {p: i for i, p in enumerate(params)}
    param_copies = _broadcast_reshape(params, devices, detach)
    buffers = list(network.buffers())
    rg = [b for b in buffers if b.requires_grad and not detach]
    not_rg = [b for b in buffers if not (b.requires_grad and not detach)]
    rg_idx = {b: i for i, b in enumerate(rg)}
    not_rg_idx = {b: i for i, b in enumerate(not_rg)}
    rg_copies = _broadcast_reshape(rg, devices, detach)
    not_rg_copies = _broadcast_reshape(not_rg, devices, True)
    modules = list(network.modules())
    module_idx = {m: i for i, m in enumerate(modules)}
    copies: list[list[Any]] = [[] for _ in devices]
    for module in modules:
        for j in range(len(devices)):
            replica = module._replicate_for_data_parallel()
            replica._former_parameters = OrderedDict()
            copies[j].append(replica)
    for i, module in enumerate(modules):
        for key, child in module._modules.items():
            for j in range(len(devices)):
                if child is None:
                    copies[j][i]._modules[key] = None
                else:
                    setattr(copies[j][i], key, copies[j][module_idx[child]])
        for key, param in module._parameters.items():
            for j in range(len(devices)):
                if param is None:
                    copies[j][i]._parameters[key] = None
                else:
                    p = param_copies[j][param_idx[param]]
                    setattr(copies[j][i], key, p)
                    copies[j][i]._former_parameters[key] = p
        for key, buf in module._buffers.items():
            for j in range(len(devices)):
                if buf is None:
                    copies[j][i]._buffers[key] = None
                elif buf in rg_idx:
                    setattr(copies[j][i], key, rg_copies[j][rg_idx[buf]])
                else:
                    setattr(copies[j][i], key, not_rg_copies[j][not_rg_idx[buf]])
    return [copies[j][0] for j in range(len(devices))]


def _index(device: int | str | torch.device) -> int:
    if isinstance(device, torch.device):
        return HOST if device.type == "cpu" else int(device.index or 0)
    if isinstance(device, str):
        return _index(torch.device(device))
    return int(device)


class DataParallel(torch.nn.DataParallel):
    """``torch.nn.DataParallel`` on memkit's virtual devices (see the module docstring).

    Args:
        module: the model, placed on ``device_ids[0]`` first (``memkit.to_virtual(model, 0)``).
        device_ids: virtual device indices (default: every device of the active block).
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the dimension inputs are split along.

    It is a ``torch.nn.DataParallel`` (``isinstance`` holds, so memkit's tracker and advice
    treat it as one) whose ``forward`` runs the data flow on the virtual devices.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
    ) -> None:
        torch.nn.Module.__init__(self)
        ids = list(range(_vd().n)) if device_ids is None else [_index(d) for d in device_ids]
        self.module = module
        self.dim = dim
        self.device_ids = ids
        self.output_device = ids[0] if output_device is None else _index(output_device)
        self.src_device_obj = torch.device("cuda", ids[0])

    def parameter_devices(self) -> list[str]:
        """The virtual devices (``cuda:i``, or ``cpu``) of the module's parameters and buffers."""
        vd = _vd()
        tensors = itertools.chain(self.module.parameters(), self.module.buffers())
        return [device_name(vd.where(t)) for t in tensors]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        vd = _vd()
        src = self.device_ids[0]
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            if vd.where(t) != src:
                raise RuntimeError(
                    "module must have its parameters and buffers on device "
                    f"{device_name(src)} (device_ids[0]) but found one of them on device: "
                    f"{device_name(vd.where(t))}"
                )
        scattered, module_kwargs = scatter_kwargs(inputs, kwargs, self.device_ids, self.dim)
        if not scattered and not module_kwargs:
            scattered, module_kwargs = ((),), ({},)
        if len(self.device_ids) == 1:
            with vd.on(src):
                return self.module(*scattered[0], **module_kwargs[0])
        used = self.device_ids[: len(scattered)]
        replicas = replicate(self.module, used, not torch.is_grad_enabled())
        outputs = []
        for replica, args, kw, dev in zip(replicas, scattered, module_kwargs, used, strict=False):
            with vd.on(dev):
                outputs.append(replica(*args, **kw))
        del replicas, scattered, module_kwargs
        return gather(outputs, self.output_device, self.dim)


@dataclass
class DdpReplica:
    """What DistributedDataParallel keeps on one device: the replica, its optimizer, its
    gradient buckets and the Reducer's unused-parameter map."""

    device: int
    model: torch.nn.Module
    optimizer: Any
    buckets: list[torch.Tensor]
    used_map: torch.Tensor | None = None

    @property
    def bucket_bytes(self) -> int:
        """Bytes of the gradient buckets."""
        return sum(b.numel() * b.element_size() for b in self.buckets)


def bucket_indices(
    params: Sequence[torch.Tensor], bucket_cap_mb: float = DDP_BUCKET_CAP_MB
) -> list[list[int]]:
    """Indices into ``params`` (trainable, in order) of each of DDP's gradient buckets.

    Uses torch's own ``_compute_bucket_assignment_by_size`` with DDP's limits (1 MiB for the
    first bucket, ``bucket_cap_mb`` after) where this torch has it, else fills buckets up to
    ``bucket_cap_mb`` in reverse parameter order.
    """
    cap = int(bucket_cap_mb * 1024 * 1024)
    params = list(params)
    if not params:
        return []
    assign = getattr(torch.distributed, "_compute_bucket_assignment_by_size", None)
    if assign is not None:
        try:
            indices, _ = assign(params, [DDP_FIRST_BUCKET_BYTES, cap], [False] * len(params))
            return [list(bucket) for bucket in indices]
        except (RuntimeError, TypeError):  # pragma: no cover - torch drift
            pass
    out: list[list[int]] = []
    total, idx = 0, []
    for i in reversed(range(len(params))):
        total += params[i].numel() * params[i].element_size()
        idx.append(i)
        if total >= cap:
            out.append(idx)
            total, idx = 0, []
    if idx:
        out.append(idx)
    return out


def bucket_sizes(
    params: Sequence[torch.Tensor], bucket_cap_mb: float = DDP_BUCKET_CAP_MB
) -> list[int]:
    """Element counts of DDP's gradient buckets for ``params`` (:func:`bucket_indices`)."""
    params = list(params)
    return [sum(params[i].numel() for i in b) for b in bucket_indices(params, bucket_cap_mb)]


def ddp_replicas(
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], Any] | None,
    devices: Sequence[int] | None = None,
    *,
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB,
    gradient_as_bucket_view: bool = False,
) -> list[DdpReplica]:
    """What DDP puts on each virtual device: a full copy of ``model`` (its parameters and
    buffers), ``make_optimizer(copy)``, one flat gradient bucket per DDP bucket and an int32
    per trainable parameter (the Reducer's ``local_used_map``). With ``gradient_as_bucket_view``
    each accumulated gradient is moved into its bucket view by a post-accumulate-grad hook, as
    the Reducer does. ``model`` itself is not changed; each copy is on its device."""
    vd = _vd()
    ids = list(range(vd.n)) if devices is None else list(devices)
    out = []
    for dev in ids:
        with vd.paused():
            replica = copy.deepcopy(model)
        vd.to(replica, dev)
        with vd.on(dev):
            trainable = [p for p in replica.parameters() if p.requires_grad]
            buckets, used = _ddp_buckets(trainable, bucket_cap_mb, gradient_as_bucket_view)
            opt = make_optimizer(replica) if make_optimizer is not None else None
        out.append(DdpReplica(dev, replica, opt, buckets, used))
    return out


def _ddp_buckets(
    trainable: Sequence[torch.Tensor], bucket_cap_mb: float, as_view: bool
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The Reducer's flat buckets for ``trainable`` (and its hooks with ``as_view``)."""
    if not trainable:
        return [], None
    dtype, real = trainable[0].dtype, trainable[0].device
    buckets, views = [], {}
    for idx in bucket_indices(trainable, bucket_cap_mb):
        bucket = torch.empty(sum(trainable[i].numel() for i in idx), dtype=dtype, device=real)
        offset = 0
        for i in idx:  # bucket_views_in: each parameter's slice of its bucket
            n = trainable[i].numel()
            views[i] = bucket[offset : offset + n].view_as(trainable[i])
            offset += n
        buckets.append(bucket)
    used = torch.zeros(len(trainable), dtype=torch.int32, device=real)
    if as_view:
        for i, p in enumerate(trainable):
            p.register_post_accumulate_grad_hook(functools.partial(_to_bucket, views[i]))
    return buckets, used


def _to_bucket(view: torch.Tensor, param: torch.Tensor) -> None:
    """gradient_as_bucket_view: the gradient is copied into its bucket view and becomes it."""
    grad = param.grad
    if grad is None or grad.data_ptr() == view.data_ptr():
        return
    with torch.no_grad():
        view.copy_(grad)
    param.grad = view
