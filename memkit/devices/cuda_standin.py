"""A stand-in for ``torch.cuda``'s memory API, backed by the simulated device.

CI and most dev machines have no GPU, so memkit's CUDA paths (``CudaBackend``, the hooks' fast
counters, ``set_per_process_memory_fraction`` as a cap, CUDA OOM messages) would never run in a
test. ``with cuda_standin("1GiB") as gpu:`` makes torch, for the block, report one CUDA device
whose memory is the simulated device's:

* a :class:`StandInAccountant` (a :class:`~memkit.simulated.accountant.MemoryAccountant` with CUDA's
  512-byte rounding) counts the storages that live on the "GPU", and every one of them is
  replayed through :class:`~memkit.simulated.allocator.CachingAllocatorModel`, so
  ``memory_allocated`` counts blocks and ``memory_reserved`` moves in segments (2 MiB small-pool
  segments, 20 MiB or rounded large ones) as PyTorch's CUDACachingAllocator does;
* an allocation that needs a segment past the capacity (or past
  ``set_per_process_memory_fraction``'s cap) raises ``torch.OutOfMemoryError`` worded as CUDA's;
* torch's C entry points behind its memory functions (``torch._C._cuda_memoryStats``,
  ``_cuda_resetPeakMemoryStats``, ``_cuda_emptyCache``, ``_cuda_setMemoryFraction``,
  ``_cuda_getMemoryFraction``) answer from the stand-in, and the functions that would initialise
  CUDA (``is_available``, ``device_count``, ``current_device``, ``is_initialized``,
  ``get_device_properties``, ``get_device_name``, ``mem_get_info``, ``synchronize``, the CUDA RNG
  functions) are replaced. torch's own
  ``memory_allocated``, ``max_memory_reserved``, ``memory_stats``, ``reset_peak_memory_stats``,
  ``empty_cache`` and ``set_per_process_memory_fraction`` then run unchanged on top.

Tensors stay cpu tensors (a CPU build cannot make CUDA ones). Which of them are on the GPU follows
CUDA's rules, kept by the accountant: ``t.to("cuda")`` / ``t.cuda()`` / ``module.to("cuda")``
copy a host tensor onto the device (a tensor already there is returned as is), ``t.cpu()`` /
``t.to("cpu")`` copy a device tensor back to the host, an op's outputs are on the device when one
of its tensor inputs is, and a tensor made without device inputs (``torch.randn(n)``) is on the
host. ``memkit.devices.tensor_device`` answers ``cuda:0`` for device tensors. Everything is
restored exactly when the block ends.

Not covered (each raises or is simply not counted): factories given ``device="cuda"`` (torch
checks for CUDA in C before any Python code runs: use ``.to("cuda")``), ``tensor.is_cuda`` and
``tensor.device`` (still cpu), pinned memory, streams and events, CUDA graphs, the allocator's
trace (``torch.cuda.memory._record_memory_history``), ops run in other threads (dispatch modes
are thread-local), and memory no ATen op returns (workspaces, the CUDA context).

Examples:
    >>> import torch
    >>> from memkit.devices.cuda_standin import cuda_standin
    >>> with cuda_standin("64MiB") as gpu:
    ...     x = torch.ones(1000).to("cuda")  # 4000 bytes -> one 4096-byte block
    ...     torch.cuda.memory_allocated(), torch.cuda.memory_reserved() >> 20
    (4096, 2)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memkit.devices import state
from memkit.simulated.accountant import (
    _EVAL_FRAME,
    MemoryAccountant,
    _tensors,
    counted_bytes,
    storages_of,
)
from memkit.simulated.allocator import (
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_SIZE,
    CachingAllocatorModel,
    round_size,
)
from memkit.units import parse_size

__all__ = ["StandIn", "StandInAccountant", "StandInProperties", "cuda_format_size", "cuda_standin"]

_CPU = torch.device("cpu")
_CUDA0 = torch.device("cuda", 0)
_STATS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "requested_bytes",
    "inactive_split_bytes",
)
_COUNTS = ("allocation", "segment", "active", "inactive_split")
_POOLS = ("all", "small_pool", "large_pool")
_ACTIVE: list[StandIn] = []  # the stand-in whose block is running (they do not nest)


def cuda_format_size(nbytes: int) -> str:
    """Sizes as the CUDA caching allocator prints them in its OOM message (``format_size``)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1 << 20:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1 << 30:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / (1 << 30):.2f} GiB"


def _segment_bytes(nbytes: int) -> int:
    """What ``cudaMalloc`` is asked for when a request of ``nbytes`` needs a new segment."""
    size = round_size(nbytes)
    if size <= K_SMALL_SIZE:
        return 2 << 20
    if size < K_MIN_LARGE_ALLOC:
        return 20 << 20
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(frozen=True)
class StandInProperties:
    """What ``torch.cuda.get_device_properties(0)`` returns for the stand-in."""

    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132
    uuid: str = "00000000-5374-616e-642d-696e00000000"
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


class _Stat:
    """One ``memory_stats`` entry: current, peak, and the running totals up and down."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def set(self, value: int) -> None:
        if value > self.current:
            self.allocated += value - self.current
            self.peak = max(self.peak, value)
        else:
            self.freed += self.current - value
        self.current = value

    def as_dict(self) -> dict[str, int]:
        return {
            "current": self.current,
            "peak": self.peak,
            "allocated": self.allocated,
            "freed": self.freed,
        }


class StandInAccountant(MemoryAccountant):
    """The accountant of a :class:`StandIn`: counts the storages on its "GPU" (see the module
    docstring for which those are) with CUDA rounding, and replays each through the stand-in's
    caching-allocator model, raising CUDA's OOM when a segment does not fit."""

    def __init__(self, standin: StandIn) -> None:
        super().__init__("cpu", None, rounding="cuda", name=standin.name)
        self.standin = standin
        self.forcing = False
        """Count what ops make now even without device inputs (a host-to-device copy)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage (a sparse tensor's: any of its parts') is on the
        stand-in GPU."""
        if tensor.device.type != "cpu":
            return False
        return any(id(storage) in self._live for storage in storages_of(tensor))

    @contextlib.contextmanager
    def forced(self, on_device: bool) -> Iterator[None]:
        """Ops in the block make device memory (``True``) or host memory (``False``)."""
        saved = self.forcing, self.counting
        self.forcing, self.counting = on_device, on_device
        try:
            yield
        finally:
            self.forcing, self.counting = saved

    def _on_free(self, key: int, _ref: object = None) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._current -= entry[1]
                self.standin._freed(key)
                if self._observer is not None:
                    self._observer.freed(key, entry[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        live = self._live
        if not self.forcing:
            for tensor in _tensors(args) + (_tensors(kwargs) if kwargs else []):
                if tensor.device.type == "cpu" and any(id(s) in live for s in storages_of(tensor)):
                    break
            else:
                return out  # no device input: host work
        new: dict[int, tuple[Any, int]] = {}
        made = [s for t in _tensors(out) if t.device.type == "cpu" for s in storages_of(t)]
        for storage in made:
            key = id(storage)
            size = counted_bytes(storage.nbytes(), "cuda")
            entry = live.get(key)
            if entry is not None and entry[1] != size:  # resized in place: freed, made again
                self._on_free(key)
                entry = None
            if entry is None and size > 0:
                new.setdefault(key, (storage, size))
        if new:
            with self._lock:
                failed = self.standin._malloc(new)
                if failed is None:
                    self._register(new)
            if failed is not None:  # nothing of the op counted; its outputs freed right away
                del out, new
                raise torch.OutOfMemoryError(failed)
        return out


class StandIn:
    """One stand-in CUDA device: its accountant, its caching-allocator model and the counters
    that benchmarks read. Use :func:`cuda_standin`.

    Attributes:
        accountant: the :class:`StandInAccountant` counting the device's storages.
        allocator: the :class:`~memkit.simulated.allocator.CachingAllocatorModel` behind
            ``memory_allocated``/``memory_reserved``.
        properties: what ``get_device_properties(0)`` returns.
        stat_reads: calls of ``torch._C._cuda_memoryStats`` (every torch memory reading,
            memkit's fast counters included).
        peak_resets: calls of ``torch._C._cuda_resetPeakMemoryStats``.
        num_ooms: allocations refused.
    """

    def __init__(self, capacity: int | str = "1GiB", *, name: str = "Stand-in H200") -> None:
        self.total = parse_size(capacity)
        self.name = name
        self.properties = StandInProperties(name, self.total)
        self.allocator = CachingAllocatorModel(capacity=self.total)
        self.fraction: float | None = None
        self.stat_reads = 0
        self.peak_resets = 0
        self.num_ooms = 0
        self._requested: dict[int, tuple[int, bool]] = {}
        self._requested_by_pool = {True: 0, False: 0}
        self._blocks_by_pool = {True: 0, False: 0}
        self._stats = {name: {pool: _Stat() for pool in _POOLS} for name in _STATS + _COUNTS}
        self._rng = torch.zeros(16, dtype=torch.uint8)
        self.accountant = StandInAccountant(self)
        self._patches: list[tuple[Any, str, bool, Any]] = []

    # -- the counters -------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """``torch.cuda.memory_allocated()``: bytes of the blocks handed out."""
        return self.allocator.allocated

    @property
    def reserved(self) -> int:
        """``torch.cuda.memory_reserved()``: bytes of the segments held."""
        return self.allocator.reserved

    @property
    def peak_allocated(self) -> int:
        return self._stats["allocated_bytes"]["all"].peak

    @property
    def peak_reserved(self) -> int:
        return self._stats["reserved_bytes"]["all"].peak

    @property
    def limit(self) -> int:
        """Bytes the allocator may reserve: the capacity, or the fraction's cap."""
        if self.fraction is None:
            return self.total
        return int(self.fraction * self.total)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on the stand-in GPU."""
        return self.accountant.holds(tensor)

    def _sync(self) -> None:
        alloc, stats = self.allocator, self._stats
        per_pool = (
            ("allocated_bytes", alloc.allocated_by_pool),
            ("active_bytes", alloc.allocated_by_pool),
            ("reserved_bytes", alloc.reserved_by_pool),
            ("segment", alloc.segments_by_pool),
            ("requested_bytes", self._requested_by_pool),
        )
        for name, values in per_pool:
            entry = stats[name]
            entry["small_pool"].set(values[True])
            entry["large_pool"].set(values[False])
            entry["all"].set(values[True] + values[False])
        blocks = self._blocks_by_pool
        for name in ("allocation", "active"):
            entry = stats[name]
            entry["small_pool"].set(blocks[True])
            entry["large_pool"].set(blocks[False])
            entry["all"].set(blocks[True] + blocks[False])

    def _malloc(self, new: dict[int, tuple[Any, int]]) -> str | None:
        """Give each new storage a block, in order; on a segment past the limit, give back the
        ones given so far and return CUDA's OOM message. The caller holds the accountant's
        lock."""
        alloc = self.allocator
        alloc.capacity = self.limit
        done: list[int] = []
        for key, (storage, _) in new.items():
            nbytes = int(storage.nbytes())
            peaks = alloc.peak_allocated, alloc.peak_reserved
            ooms = alloc.num_ooms
            alloc.malloc(key, nbytes)
            if alloc.num_ooms != ooms:
                # the model went on past the limit: take that segment back, as if never made
                alloc.free(key)
                alloc.release_cached()
                alloc.peak_allocated, alloc.peak_reserved = peaks
                self.num_ooms += 1
                message = self._oom_message(nbytes)
                for earlier in done:
                    self._freed(earlier)
                self._sync()
                acct = self.accountant
                acct.num_ooms += 1
                acct.in_use_at_oom = alloc.allocated
                acct.node_at_oom = None  # (CUDA's error leaves the engine before it is read)
                if acct._observer is not None:
                    acct._observer.out_of_memory(round_size(nbytes), self.limit - alloc.reserved)
                return message
            small = round_size(nbytes) <= K_SMALL_SIZE
            self._requested[key] = (nbytes, small)
            self._requested_by_pool[small] += nbytes
            self._blocks_by_pool[small] += 1
            done.append(key)
        self._sync()
        return None

    def _freed(self, key: int) -> None:
        """A device storage is gone: its block goes back to the cache."""
        self.allocator.free(key)
        entry = self._requested.pop(key, None)
        if entry is not None:
            self._requested_by_pool[entry[1]] -= entry[0]
            self._blocks_by_pool[entry[1]] -= 1
        self._sync()

    def _oom_message(self, nbytes: int) -> str:
        """CUDA's wording (``c10/cuda/CUDACachingAllocator.cpp``) for a failed request."""
        alloc = self.allocator
        free = max(0, self.total - alloc.reserved)
        allowed = f"{cuda_format_size(self.limit)} allowed; " if self.fraction is not None else ""
        return (
            f"CUDA out of memory. Tried to allocate {cuda_format_size(_segment_bytes(nbytes))}. "
            f"GPU 0 has a total capacity of {cuda_format_size(self.total)} of which "
            f"{cuda_format_size(free)} is free. Including non-PyTorch memory, this process has "
            f"{cuda_format_size(self.total - free)} memory in use. {allowed}Of the allocated "
            f"memory {cuda_format_size(alloc.allocated)} is allocated by PyTorch, and "
            f"{cuda_format_size(alloc.reserved - alloc.allocated)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    # -- what torch's functions call ----------------------------------------------------------
    def _check(self, device: Any) -> int:
        index = _index(device)
        if index != 0:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def memory_stats(self, device: Any = 0) -> dict[str, Any]:
        """``torch._C._cuda_memoryStats(index)``: the nested dict, shaped as CUDA's."""
        self._check(device)
        self.stat_reads += 1
        with self.accountant._lock:
            split = self.allocator.inactive_split()  # sampled here: its peaks are the reads'
            for i, name in enumerate(("inactive_split", "inactive_split_bytes")):
                pools = self._stats[name]
                pools["small_pool"].set(split[True][i])
                pools["large_pool"].set(split[False][i])
                pools["all"].set(split[True][i] + split[False][i])
            out: dict[str, Any] = {
                name: {pool: stat.as_dict() for pool, stat in pools.items()}
                for name, pools in self._stats.items()
            }
        out.update(
            num_alloc_retries=0,
            num_ooms=self.num_ooms,
            num_sync_all_streams=0,
            num_device_alloc=out["segment"]["all"]["allocated"],
            num_device_free=out["segment"]["all"]["freed"],
            max_split_size=-1,
            # max_split_size is unset: no block counts as oversize, as on CUDA by default
            oversize_allocations=_Stat().as_dict(),
            oversize_segments=_Stat().as_dict(),
        )
        return out

    def reset_peak_memory_stats(self, device: Any = 0) -> None:
        """``torch._C._cuda_resetPeakMemoryStats(index)``: every peak to its current value."""
        self._check(device)
        self.peak_resets += 1
        with self.accountant._lock:
            for pools in self._stats.values():
                for stat in pools.values():
                    stat.peak = stat.current
            self.allocator.reset_peak()
        self.accountant.reset_peak()

    def empty_cache(self) -> None:
        """``torch._C._cuda_emptyCache()``: free every segment without a live block."""
        with self.accountant._lock:
            self.allocator.release_cached()
            self._sync()

    def set_memory_fraction(self, fraction: float, device: Any = 0) -> None:
        """``torch._C._cuda_setMemoryFraction``: cap reserved at ``fraction * total``."""
        self._check(device)
        self.fraction = float(fraction)

    def get_memory_fraction(self, device: Any = 0) -> float:
        self._check(device)
        return 1.0 if self.fraction is None else self.fraction

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """``(free, total)`` as ``cudaMemGetInfo`` sees the device: total less what is reserved."""
        if device is not None:
            self._check(device)
        return max(0, self.total - self.allocator.reserved), self.total

    def get_device_properties(self, device: Any = None) -> StandInProperties:
        if device is not None:
            self._check(device)
        return self.properties

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def synchronize(self, device: Any = None) -> None:
        """Ops run synchronously here."""
        if device is not None:
            self._check(device)

    def set_device(self, device: Any) -> None:
        self._check(device)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self._rng.clone()]

    def set_rng_state_all(self, states: Any) -> None:
        self._rng = torch.as_tensor(next(iter(states)), dtype=torch.uint8).clone()

    def manual_seed(self, seed: int) -> None:
        self._rng = torch.tensor(
            list(int(seed).to_bytes(8, "little", signed=True)) + [0] * 8, dtype=torch.uint8
        )

    # -- the block ----------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        self._patches.append((owner, name, had, vars(owner).get(name)))
        setattr(owner, name, value)

    def _install(self) -> None:
        cuda, memory = torch.cuda, torch.cuda.memory
        one = lambda *_, **__: 1  # noqa: E731
        zero = lambda *_, **__: 0  # noqa: E731
        yes = lambda *_, **__: True  # noqa: E731
        for owner in (cuda, memory):
            self._patch(owner, "is_initialized", yes)
            self._patch(owner, "mem_get_info", self.mem_get_info)
        self._patch(memory, "_lazy_init", lambda: None)  # set_per_process_memory_fraction's
        # torch's C code calls torch.cuda._lazy_init before it makes a CUDA tensor, and never
        # again once that returned: it must keep failing (is_initialized is patched to True)
        self._patch(cuda, "_lazy_init", _no_cuda_tensors)
        for name, value in {
            "is_available": yes,
            "device_count": one,
            "current_device": zero,
            "get_device_properties": self.get_device_properties,
            "get_device_name": self.get_device_name,
            "synchronize": self.synchronize,
            "set_device": self.set_device,
            "get_rng_state_all": self.get_rng_state_all,
            "set_rng_state_all": self.set_rng_state_all,
            "manual_seed": self.manual_seed,
            "manual_seed_all": self.manual_seed,
        }.items():
            self._patch(cuda, name, value)
        for name, value in {
            "_cuda_memoryStats": self.memory_stats,
            "_cuda_resetPeakMemoryStats": self.reset_peak_memory_stats,
            "_cuda_emptyCache": self.empty_cache,
            "_cuda_setMemoryFraction": self.set_memory_fraction,
            "_cuda_getMemoryFraction": self.get_memory_fraction,
        }.items():
            self._patch(torch._C, name, value)
        acct = self.accountant
        to, standin = torch.Tensor.to, self

        def tensor_to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            target, args, kwargs = _target(args, kwargs, acct)
            if target is None:
                return to(tensor, *args, **kwargs)
            to_gpu = target.type == "cuda"
            if to_gpu:
                standin._check(target)  # cuda:1 on a one-GPU machine fails as on CUDA
            if acct.holds(tensor) == to_gpu:  # already there: a dtype change at most
                return to(tensor, *args, **kwargs)
            with acct.forced(to_gpu):  # a copy onto the other side
                out = to(tensor, *args, **kwargs)
                if out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                    out = out.clone()
            return out

        def tensor_cpu(tensor: torch.Tensor, memory_format: Any = torch.preserve_format) -> Any:
            return tensor_to(tensor, _CPU, memory_format=memory_format)

        def tensor_cuda(
            tensor: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any
        ) -> Any:
            target = _CUDA0 if device is None else torch.device("cuda", _index(device))
            return tensor_to(tensor, target, non_blocking=non_blocking, **kwargs)

        self._patch(torch.Tensor, "to", tensor_to)
        self._patch(torch.Tensor, "cpu", tensor_cpu)
        self._patch(torch.Tensor, "cuda", tensor_cuda)
        self._patch(state, "cuda_standin", self)

    # -- what memkit.devices asks the active stand-in (state.cuda_standin) ---------------------
    def tensor_device(self, tensor: torch.Tensor) -> torch.device:
        """``cuda:0`` for the stand-in's device tensors (cpu tensors), else ``tensor.device``."""
        return _CUDA0 if self.accountant.holds(tensor) else tensor.device

    def cached_free_blocks(self, index: int) -> list[tuple[int, bool]]:
        """The modelled allocator's free blocks."""
        return self.allocator.free_blocks()

    def empty_on(self, index: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` on the stand-in's device."""
        return torch.empty(nbytes, dtype=torch.uint8).to("cuda")

    def _restore(self) -> None:
        while self._patches:
            owner, name, had, old = self._patches.pop()
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)

    def __enter__(self) -> StandIn:
        if _ACTIVE:
            raise RuntimeError("a CUDA stand-in is already active; they do not nest")
        try:
            self._install()
            self.accountant.__enter__()
        except BaseException:
            self._restore()
            raise
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
            try:
                self.accountant.__exit__(*exc)
            finally:
                self._restore()

    def __repr__(self) -> str:
        return (
            f"StandIn({self.name!r}, {cuda_format_size(self.total)}, allocated "
            f"{self.allocated}, reserved {self.reserved})"
        )


def _no_cuda_tensors() -> None:
    raise AssertionError(
        "Torch not compiled with CUDA enabled (memkit's CUDA stand-in keeps its tensors on the "
        "cpu: make them there and move them with .to('cuda'))"
    )


def _index(device: Any) -> int:
    """The CUDA index of ``device`` (an int, ``"cuda:1"``, a ``torch.device``; ``None``: 0)."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {dev}")
    return dev.index or 0


def _target(
    args: tuple[Any, ...], kwargs: dict[str, Any], acct: StandInAccountant
) -> tuple[torch.device | None, tuple[Any, ...], dict[str, Any]]:
    """The device a ``Tensor.to`` call moves to, with its arguments rewritten for the cpu
    tensors underneath (``"cuda"`` -> ``cpu``); ``None`` for a call that moves nothing."""
    target: torch.device | None = None
    new_args = list(args)
    if args and isinstance(args[0], (str, torch.device)):
        target = torch.device(args[0])
        new_args[0] = _CPU
    elif args and isinstance(args[0], torch.Tensor):
        other = args[0]
        target = _CUDA0 if acct.holds(other) else other.device
    elif "device" in kwargs and kwargs["device"] is not None:
        kwargs = dict(kwargs)
        target = torch.device(kwargs["device"])
        kwargs["device"] = _CPU
    if target is None or target.type not in ("cuda", "cpu"):
        return None, args, kwargs
    return target, tuple(new_args), kwargs


if _EVAL_FRAME is not None:  # Dynamo skips this handler too, as it does the base class's
    _SKIP = _EVAL_FRAME._FrameAction.SKIP
    _EVAL_FRAME.set_code_exec_strategy(
        StandInAccountant.__torch_dispatch__.__code__, _EVAL_FRAME._FrameExecStrategy(_SKIP, _SKIP)
    )


def cuda_standin(capacity: int | str = "1GiB", *, name: str = "Stand-in H200") -> StandIn:
    """A stand-in CUDA device of ``capacity`` bytes for the ``with`` block (see the module
    docstring): ``with cuda_standin("2GiB") as gpu: ...``; ``gpu.stat_reads``,
    ``gpu.peak_resets``, ``gpu.accountant`` and ``gpu.allocator`` stay readable after it."""
    return StandIn(capacity, name=name)
