"""The simulated device: count the bytes of live tensor storages on one device.

:class:`MemoryAccountant` is a ``TorchDispatchMode``. Every ATen op that runs while it is active
passes through it; it looks at the op's tensors, and each storage on its device that it has not
seen yet is counted once (views share a storage and are not counted twice). A weak reference with a
callback takes the bytes off again when the storage is freed. So ``current`` is the memory a GPU
would have allocated for those tensors, ``peak`` its high-water mark, and with a ``budget`` the
accountant raises the same :class:`torch.OutOfMemoryError` a GPU would, from inside the op that
crossed the line.

What is counted:

* storages created by ops while the mode is active (activations, gradients, optimizer state);
* storages of the objects passed to :meth:`MemoryAccountant.track` (parameters, buffers, existing
  gradients and optimizer state of a model or optimizer), counted when tracking starts;
* storages created earlier that an op reads for the first time (an input batch made before the
  block): they are live on the device, so they are *adopted* and counted from then on.

Two switches narrow this to what a training step would put on an accelerator (memkit's tracker
sets them; see docs/simulated-device.md): ``counting`` (count storages that ops create) and
``adopting`` (adopt storages that ops read). Both are on for a plain ``simulate`` block. A forked
child process (a DataLoader worker) never counts: its tensors live in another process.

What is not: memory that no ATen op returns (kernel workspaces, the CUDA context, a caching
allocator's unused reserve) and tensors made in *other threads*: dispatch modes are thread-local,
so under ``nn.DataParallel`` replica threads are invisible to an accountant entered in the main
thread (memkit's tracker reads real device counters there instead).

Rounding: with ``rounding="cuda"`` each storage is counted the way the CUDA caching
allocator counts it in ``torch.cuda.memory_allocated``: a request of ``n > 0`` bytes
occupies ``max(512, ceil(n / 512) * 512)`` bytes (``kMinBlockSize`` in
``c10/cuda/CUDACachingAllocator.cpp``), and an empty storage occupies nothing. The default
``rounding="none"`` counts exact bytes.

Works on ``cpu`` tensors (real compute) and ``meta`` tensors (no compute), and nests: an
accountant inside another forwards each op to the outer one, and both count it.

Examples:
    >>> import torch, memkit
    >>> model = torch.nn.Linear(1024, 1024)
    >>> with memkit.simulate("64MiB", device="cpu", track=model) as acct:
    ...     model(torch.randn(32, 1024)).sum().backward()
    >>> acct.peak > 2 * 1024 * 1024 * 4
    True
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)

from memkit.simulated.allocator import round_size
from memkit.simulated.storage_resizes import counting_resizes, fsdp2_loaded
from memkit.units import format_size, parse_size

__all__ = [
    "MemoryAccountant",
    "StorageObserver",
    "active_accountant",
    "counted_bytes",
    "counting_now",
    "cuda_rounded",
    "held_storages",
    "storages_of",
    "strided_parts",
    "tensors_of",
]

cuda_rounded = round_size
"""Bytes the CUDA caching allocator counts as allocated for a request of ``nbytes``
(:func:`memkit.simulated.allocator.round_size`, the one statement of the rule)."""


_EAGER_LOCK = threading.Lock()
_eager: list[Any] = []  # the stance set by the first accountant in, restored by the last out
_eager_users = [0]


def _eager_acquire() -> None:
    """Compiled code runs eagerly while any accountant counts (one stance for all of them:
    blocks in two threads may end in any order, and a context entered per block would put
    back the stance the other set)."""
    with _EAGER_LOCK:
        if _eager_users[0] == 0:
            _eager.append(torch.compiler.set_stance("force_eager"))  # (set when made)
        _eager_users[0] += 1


def _eager_release() -> None:
    with _EAGER_LOCK:
        _eager_users[0] -= 1
        if _eager_users[0] == 0 and _eager:
            _eager.pop().__exit__(None, None, None)


def counting_now() -> bool:
    """Whether a :class:`MemoryAccountant` counts this thread's ops now (then compiled code
    runs eagerly: :meth:`MemoryAccountant.__enter__`)."""
    return any(isinstance(m, MemoryAccountant) for m in _get_current_dispatch_mode_stack())


def counting(accountant: MemoryAccountant) -> bool:
    """Whether ``accountant`` counts this thread's ops now (its ``with`` block is open here)."""
    return any(m is accountant for m in _get_current_dispatch_mode_stack())


def active_accountant(device: str | torch.device = "cpu") -> MemoryAccountant | None:
    """The innermost :class:`MemoryAccountant` counting ``device``'s tensors in this thread
    with a budget (an outer ``memkit.simulate(budget)`` block), or ``None``."""
    device = torch.device(device)
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if (
            isinstance(mode, MemoryAccountant)
            and mode.budget is not None
            and (mode.device.type, mode.device.index) == (device.type, device.index)
        ):
            return mode
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that are never wrapper subclasses (asked first: the check costs more)."""


_SPARSE_PARTS: dict[torch.layout, tuple[tuple[str, Any], ...]] = {
    torch.sparse_coo: (("indices", torch.Tensor._indices), ("values", torch.Tensor._values)),
    **{
        layout: (
            ("crow_indices", torch.Tensor.crow_indices),
            ("col_indices", torch.Tensor.col_indices),
            ("values", torch.Tensor.values),
        )
        for layout in (torch.sparse_csr, torch.sparse_bsr)
    },
    **{
        layout: (
            ("ccol_indices", torch.Tensor.ccol_indices),
            ("row_indices", torch.Tensor.row_indices),
            ("values", torch.Tensor.values),
        )
        for layout in (torch.sparse_csc, torch.sparse_bsc)
    },
}
"""The strided tensors a sparse layout keeps its memory in: ``(name, getter)`` per part."""


def strided_parts(tensor: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...]:
    """The strided tensors whose storages hold a tensor's memory, each with its part's name:
    ``(("", tensor),)`` for a strided tensor; a sparse COO tensor's indices and values; a
    CSR/BSR (CSC/BSC) tensor's compressed indices, plain indices and values; a wrapper
    subclass's (``DTensor``) first inner tensor's parts; none for other layouts (mkldnn).

    The one way memkit finds what memory a tensor holds, so that every count (the simulated
    device, the tracker's breakdown, :func:`memkit.snapshot`'s census) agrees on it.

    Examples:
        >>> sparse = torch.eye(3).to_sparse()
        >>> [(name, tuple(part.shape)) for name, part in strided_parts(sparse)]
        [('indices', (2, 3)), ('values', (3,))]
    """
    try:
        if type(tensor) not in _PLAIN and is_traceable_wrapper_subclass(tensor):
            # a wrapper (DTensor: a rank's shard in ``_local_tensor``) holds no memory of its
            # own: its first inner tensor does
            names, _ = tensor.__tensor_flatten__()
            inner = getattr(tensor, names[0], None) if names else None
            return strided_parts(inner) if isinstance(inner, torch.Tensor) else ()
        layout = tensor.layout
        if layout == torch.strided:
            return (("", tensor),)
        parts = _SPARSE_PARTS.get(layout, ())
        # reading the parts is no op of the program: no dispatch mode (the simulated device)
        # must see it
        with torch._C._DisableTorchDispatch():
            return tuple((name, get(tensor)) for name, get in parts)
    except Exception:  # storage-less subclasses, functional/fake tensors
        return ()


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages a tensor keeps alive (those of its :func:`strided_parts`); none for a
    tensor without storages of its own (storage-less subclasses, functional or fake tensors).

    Counts deduplicated by storage agree on what a storage is: views and tied weights share
    one.

    Examples:
        >>> [s.nbytes() for s in storages_of(torch.eye(3).to_sparse())]
        [48, 12]
    """
    found = []
    for _, part in strided_parts(tensor):
        storage = _own_storage(part)
        if storage is not None:
            found.append(storage)
    return found


def _own_storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """A strided tensor's storage, or ``None`` where it has none of its own."""
    try:
        return tensor.untyped_storage()
    except Exception:  # functorch or functional wrappers, fake tensors
        return None


def autograd_node() -> str | None:
    """The name of the autograd node running now (inside a backward: ``ReluBackward0``),
    else ``None``."""
    current = getattr(torch._C, "_current_autograd_node", None)
    node = current() if current is not None else None
    return None if node is None else str(node.name())


def node_of(accountant: Any, error: BaseException) -> str | None:
    """The autograd node ``accountant`` ran out in, where ``error`` (or one it wraps, by its
    text) is that error: not an earlier one a script caught, nor another allocator's."""
    found = getattr(accountant, "node_at_oom", None)
    return found[1] if found is not None and found[0] in str(error) else None


def op_inputs_of(accountant: Any, error: BaseException) -> int | None:
    """The counted bytes of the inputs (parameters left out) of the op ``accountant`` refused,
    where ``error`` (or one it wraps, by its text) is that refusal (:func:`node_of`)."""
    found = getattr(accountant, "inputs_at_oom", None)
    return found[1] if found is not None and found[0] in str(error) else None


def counted_bytes(nbytes: int, rounding: str) -> int:
    """Bytes a storage of ``nbytes`` counts for: CUDA's 512-byte blocks with
    ``rounding="cuda"`` (:data:`cuda_rounded`), else exact."""
    return cuda_rounded(nbytes) if rounding == "cuda" else nbytes


def held_storages(value: Any, skip: Callable[[torch.Tensor], bool]) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of the storages of the plain strided tensors in ``value``: a
    tensor, or a list, deque or tuple of them or of tuples of them (one level in: a replay
    buffer's transitions), the first 100,000 items; those ``skip`` names left out."""
    items = value if isinstance(value, (list, tuple, collections.deque)) else (value,)
    found: dict[int, int] = {}
    for item in itertools.islice(items, 100_000):
        for t in item if isinstance(item, tuple) else (item,):
            if type(t) not in (torch.Tensor, torch.nn.Parameter):  # (a DTensor, a subclass)
                continue
            if t.layout is not torch.strided or t.is_meta or skip(t):
                continue
            storage = t.untyped_storage()
            found[storage.data_ptr()] = int(storage.nbytes())
    return found


def tensors_of(obj: Any, depth: int = 8) -> Iterator[torch.Tensor]:
    """Yield the tensors an object holds: a tensor, a module (parameters, their gradients,
    buffers), an optimizer (its state), a list/tuple/dict of those, or (``depth`` levels down)
    the attributes of another object (a model output's key-value cache)."""
    if depth < 0:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        # a non-leaf's .grad is None unless retain_grad() was called (reading it warns)
        if (obj.is_leaf or obj.retains_grad) and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for param in obj.parameters():
            yield param
            if param.grad is not None:
                yield param.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from tensors_of(state)
        for group in obj.param_groups:
            yield from tensors_of(group["params"])
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_of(value, depth - 1)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from tensors_of(value, depth - 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from tensors_of(value, depth - 1)


def _eval_frame_api() -> Any:
    """torch's C-level Dynamo frame controls, where this torch has them (2.8+), else None."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:
        return None
    wanted = ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction")
    return eval_frame if all(hasattr(eval_frame, name) for name in wanted) else None


_EVAL_FRAME = _eval_frame_api()


def _existed(tensor: torch.Tensor) -> str:
    """How a storage counted because it existed before is named in a memory history."""
    return "parameter" if isinstance(tensor, torch.nn.Parameter) else "tensor"


class StorageObserver(Protocol):
    """What a recorder (:class:`memkit.simulated.history.SimulatedHistory`) hears from an
    accountant.

    The calls come under the accountant's lock, so an observer must not call back into it.
    ``key`` identifies a storage while it lives (its ``id``); ``counted`` is the bytes counted for
    it (rounded with ``rounding="cuda"``) and ``requested`` the storage's own bytes.
    """

    def already_counted(self, storages: list[tuple[int, int, int]]) -> None:
        """The ``(key, counted, requested)`` of every storage counted when observing began."""

    def allocated(self, key: int, counted: int, requested: int, existed: str | None) -> None:
        """A storage is counted. ``existed``: ``None`` for one an op made; ``"parameter"`` or
        ``"tensor"`` for one made earlier and counted now (first read, or given to track())."""

    def freed(self, key: int, counted: int) -> None:
        """A counted storage is freed (or resized: freed, then allocated again)."""

    def out_of_memory(self, tried: int, free: int) -> None:
        """An op tried to add ``tried`` bytes with ``free`` left in the budget."""


class _StorageRef(weakref.ref):
    """A weak reference to a counted storage that carries its key to the free callback (made
    by ``weakref.ref``'s own constructor: no Python ``__init__`` per storage)."""

    __slots__ = ("key",)
    key: int


class MemoryAccountant(TorchDispatchMode):
    """Counts live tensor-storage bytes on one device, optionally against a budget.

    Args:
        device: the device whose tensors are counted (``"cpu"``, ``"meta"``, ``"cuda:0"``...).
        budget: bytes (or a size string such as ``"512MiB"``); crossing it raises
            ``torch.OutOfMemoryError``. ``None`` counts without a limit.
        rounding: ``"none"`` (exact bytes) or ``"cuda"`` (the caching allocator's 512-byte blocks).
        name: how the device is named in OOM messages.

    The counters are safe to read from any thread; the counting itself happens only in the
    thread(s) where the mode is active.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        budget: int | str | None = None,
        *,
        rounding: str = "none",
        name: str | None = None,
    ) -> None:
        super().__init__()
        if rounding not in ("none", "cuda"):
            raise ValueError(f"rounding must be 'none' or 'cuda', found {rounding!r}")
        self.device = torch.device(device)
        self.budget: int | None = None if budget is None else parse_size(budget)
        self.rounding = rounding
        # what a plain tensor is checked with in the per-op path (building tensor.device for
        # each tensor of each op costs more than the rest of the check)
        self._on_cpu = self.device.type == "cpu"
        self._on_meta = self.device.type == "meta"
        self.name = name or f"simulated {self.device}"
        # reentrant: a garbage collection can run inside a locked section (any allocation, a
        # weak reference made) and free a tensor only a reference cycle held: its storage's
        # callback takes the lock again on the same thread
        self._lock = threading.RLock()
        self._live: dict[int, tuple[weakref.ref[Any], int]] = {}
        # storages counted as a view's own elements, while that view lives (_input_entry)
        self._partial: set[int] = set()
        self._refused: set[int] = set()  # storages whose growth in place was refused
        self._inputs: set[int] = set()  # storages counted as batches reaching the model
        self._freed = self._ref_freed  # one bound method for every storage's weak reference
        self._current = 0
        self._peak = 0
        self.num_allocs = 0
        self.num_ooms = 0
        self.counting = True
        """Count storages that ops create (off: host-side work such as data loading)."""
        self.adopting = True
        """Adopt storages that existed before and that an op reads for the first time."""
        self.device_work = False
        """While ``counting`` is off (between a tracker's steps): an op that reads counted
        tensors is device work, as on a GPU, where both sides are device tensors: what it
        writes into tensors not counted yet is adopted (an EMA's ``lerp_`` from the model's
        parameters, its ``copy_`` of ``d * e + (1 - d) * m``), and what it makes is counted
        (``copy.deepcopy(model)``, ``generate()``'s tokens and scores, a metric of the
        outputs). What ops make from a host view (:meth:`host_view`: what ``.cpu()`` returns
        between steps) stays host work (``{k: v.cpu().clone()}``, a host snapshot of the
        weights)."""
        # id(tensor) -> weak reference: the host views .cpu() returned between steps
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}
        self.adopted_past_budget = 0
        """The most bytes by which tensors made before and counted by :meth:`track` (a model,
        a batch: it never raises) took ``current`` past the budget; 0 if they never did."""
        _ACCOUNTANTS.add(self)
        self.in_use_at_oom: int | None = None
        """Exact bytes in use when the last out-of-memory error was raised (the message
        rounds them), for a post-mortem read after the unwinding freed some."""
        self.node_at_oom: tuple[str, str] | None = None
        """``(message, node)``: the last out-of-memory error raised inside a backward and the
        autograd node that ran then (``ReluBackward0``), else ``None``: a module's backward hook
        names the last module with parameters backward reached, not the functional ops after
        it. The message tells the error that left a block from an earlier one a script caught
        (:func:`node_of`)."""
        self.inputs_at_oom: tuple[str, int] | None = None
        """``(message, bytes)``: the last out-of-memory error and the counted bytes of the
        refused op's inputs, parameters left out (:func:`op_inputs_of`)."""
        self._observer: StorageObserver | None = None
        # While observed: id(storage) -> "parameter"/"tensor", for each storage counted because
        # it existed before (an op read it for the first time, or track() was given it). None
        # while nobody observes: nothing is noted (no cost).
        self._adopted: dict[int, str] | None = None
        # per entry of the block: FSDP2's storage resizes made visible (storage_resizes)
        self._resizes: list[contextlib.ExitStack] = []

    # -- counters ---------------------------------------------------------------------------
    @property
    def current(self) -> int:
        """Bytes of live counted storages now."""
        return self._current

    @property
    def peak(self) -> int:
        """Highest ``current`` since creation or the last :meth:`reset_peak`."""
        return self._peak

    @property
    def free(self) -> int | None:
        """Budget left, or ``None`` without a budget."""
        return None if self.budget is None else max(0, self.budget - self._current)

    def counters(self) -> tuple[int, int]:
        """``(current, peak)`` in one call, for hooks that read them once per module call."""
        return self._current, self._peak

    def reset_peak(self) -> None:
        """Set the peak to the current bytes."""
        with self._lock:
            self._peak = self._current

    # -- entering ---------------------------------------------------------------------------
    def __enter__(self) -> MemoryAccountant:
        """Count ops in this thread; FSDP2's storage resizes too when FSDP2 is imported (its
        unsharded parameters are freed by resizing, which no op shows). A ``torch.compile``'d
        function runs eagerly meanwhile (``set_stance("force_eager")``): TorchDynamo compiles
        no frame under a dispatch mode, and a frame it skipped it skips for good, so a model
        first called here would never compile afterwards (sweep NN: nor after a probe)."""
        resizes = contextlib.ExitStack()
        _eager_acquire()
        resizes.callback(_eager_release)
        if fsdp2_loaded():
            resizes.enter_context(counting_resizes())
        self._resizes.append(resizes)
        try:
            super().__enter__()
        except BaseException:
            self._resizes.pop().close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._resizes:
                self._resizes.pop().close()

    # -- observing --------------------------------------------------------------------------
    @property
    def observed(self) -> bool:
        """Whether an observer is attached (see :meth:`observe`)."""
        return self._observer is not None

    def observe(self, observer: StorageObserver) -> None:
        """Tell ``observer`` about every counted storage from now on, after telling it (in
        ``already_counted``) about those counted now. One observer at a time.

        Raises:
            RuntimeError: another observer is attached.
        """
        alive = []  # strong references, dropped after the lock: a free then takes it itself
        with self._lock:
            if self._observer is not None:
                raise RuntimeError("another observer already records this accountant")
            live = []
            # a copy made in one call: a collection (which may free a counted tensor and
            # re-enter this lock) can start at any allocation, one per item of a list built
            for key, (ref, counted) in self._live.copy().items():
                storage = self._stored(ref)
                if storage is not None:
                    alive.append(storage)
                    requested = counted if key in self._partial else int(storage.nbytes())
                    live.append((key, counted, requested))
            observer.already_counted(live)
            self._observer = observer
            self._adopted = {}
        del alive

    def stop_observing(self) -> None:
        """Detach the observer, if any."""
        with self._lock:
            self._observer = None
            self._adopted = None

    def live_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        """The counted storages that are still alive, with the bytes counted for each."""
        with self._lock:
            entries = list(self._live.values())
        out = []
        for ref, nbytes in entries:
            storage = self._stored(ref)
            if storage is not None:
                out.append((storage, nbytes))
        return out

    # -- registration -------------------------------------------------------------------------
    def _size(self, storage: torch.UntypedStorage) -> int:
        return counted_bytes(storage.nbytes(), self.rounding)

    def _input_entry(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> tuple[Any, int]:
        """How a host tensor that reaches the device is counted: ``(what its count lives as
        long as, bytes)``. Its storage, whole; but a view of a larger storage (a batch sliced
        from a dataset in RAM, ``x_train[i:i + 64]``) counts its own elements while the view
        lives, as the copy ``.to("cuda")`` makes of it would."""
        own = tensor.numel() * tensor.element_size()
        if own >= storage.nbytes():
            return storage, self._size(storage)
        self._partial.add(id(storage))
        return tensor, counted_bytes(own, self.rounding)

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is counted now (whole, or as a view's elements)."""
        return id(tensor.untyped_storage()) in self._live

    def _stored(self, ref: weakref.ref[Any]) -> torch.UntypedStorage | None:
        """The storage a live entry counts (a view's, for a view counted by its elements)."""
        held = ref()
        return held.untyped_storage() if isinstance(held, torch.Tensor) else held

    def _on_free(self, key: int, _ref: object = None) -> None:
        if self._partial:
            self._partial.discard(key)
        if self._refused:
            self._refused.discard(key)
        with self._lock:
            self._inputs.discard(key)
            entry = self._live.pop(key, None)
            if entry is not None:
                self._current -= entry[1]
                if self._observer is not None:
                    self._observer.freed(key, entry[1])

    def _matches(self, tensor: torch.Tensor) -> bool:
        dev = tensor.device
        if dev == self.device:  # the common case, without building dev.type
            return True
        if dev.type != self.device.type:
            return False
        return self.device.index is None or dev.index is None

    def _storage(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        """The storage of a strided ``tensor`` on this device, else None (a sparse or wrapper
        tensor's memory is in its parts: :meth:`_split`)."""
        kind = type(tensor)
        if kind is not _TENSOR and kind is not _PARAMETER:
            if not self._matches(tensor) or is_traceable_wrapper_subclass(tensor):
                return None
        # a plain tensor, nearly every tensor of every op: the device read as one flag where
        # the device is cpu or meta (building tensor.device costs more than the rest)
        elif self._on_cpu:
            if not tensor.is_cpu:
                return None
        elif self._on_meta:
            if not tensor.is_meta:
                return None
        elif not self._matches(tensor):
            return None
        if tensor.layout is not _STRIDED:
            return None
        try:
            return tensor.untyped_storage()
        except Exception:  # a functorch or functional wrapper: no storage of its own
            return None

    def _split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The strided parts (:func:`strided_parts`) of a sparse or wrapper ``tensor`` on this
        device, whose storages hold its memory; none for a strided plain tensor."""
        kind = type(tensor)
        if (kind is _TENSOR or kind is _PARAMETER) and tensor.layout is _STRIDED:
            return []
        if not self._matches(tensor):
            return []
        return [part for _, part in strided_parts(tensor) if part is not tensor]

    def _located(self, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.UntypedStorage]]:
        """Each storage of ``tensor`` on this device, with the strided part that holds it."""
        storage = self._storage(tensor)
        if storage is not None:
            return [(tensor, storage)]
        return [(part, s) for part in self._split(tensor) if (s := self._storage(part)) is not None]

    def track(self, *objects: Any, inputs: bool = False) -> MemoryAccountant:
        """Count the storages of existing objects (modules, optimizers, tensors) from now on;
        ``inputs``: the objects are data reaching the device (a batch), counted as copying
        them there would allocate (:meth:`_input_entry`).

        Tracking never raises an OOM: the objects already exist. Past the budget the excess is
        kept in :attr:`adopted_past_budget`, and the next OOM message says why in use exceeds
        the budget.
        """
        pending: dict[int, tuple[Any, int]] = {}
        adopted = self._adopted
        views: set[tuple[Any, ...]] = set()
        for tensor, storage in (
            located for whole in tensors_of(objects) for located in self._located(whole)
        ):
            key = id(storage)
            if key in self._live:
                continue
            if not inputs:
                pending[key] = (storage, self._size(storage))
            else:
                view = (key, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
                if view in views:
                    continue
                views.add(view)
                held, size = self._input_entry(tensor, storage)
                if key in pending and key in self._partial:
                    # another view of it in the batch (x, y = chunk[:, :-1], chunk[:, 1:]):
                    # its own copy too, while the first view lives
                    first, before = pending[key]
                    held, size = first, before + size
                pending[key] = (held, size)
            if adopted is not None:
                adopted[key] = _existed(tensor)
        with self._lock:
            self._register(pending)
            if inputs:
                self._inputs.update(pending)
            self._note_past_budget()
        return self

    def held_input_bytes(self) -> tuple[int, int]:
        """``(count, bytes)`` of the batches counted when they reached the model
        (:meth:`track` with ``inputs``) that are still alive: a script that keeps the batches
        it fed (a list built before training) holds them all."""
        with self._lock:
            live = self._live
            held = [live[k][1] for k in self._inputs if k in live]
        return len(held), sum(held)

    def _register(self, pending: dict[int, tuple[Any, int]]) -> None:
        # caller holds the lock
        live = self._live
        freed = self._freed
        observer = self._observer
        for key, (storage, nbytes) in pending.items():
            if key in live:
                continue
            ref = _StorageRef(storage, freed)
            ref.key = key
            live[key] = (ref, nbytes)
            self._current += nbytes
            self.num_allocs += 1
            if observer is not None:
                adopted = self._adopted
                existed = adopted.pop(key, None) if adopted else None
                requested = nbytes if key in self._partial else int(storage.nbytes())
                observer.allocated(key, nbytes, requested, existed)
        if self._current > self._peak:
            self._peak = self._current

    def _note_past_budget(self) -> None:
        # caller holds the lock; after counting tensors that existed before, which never raises
        if self.budget is not None and self._current - self.budget > self.adopted_past_budget:
            self.adopted_past_budget = self._current - self.budget

    def _ref_freed(self, ref: _StorageRef) -> None:
        self._on_free(ref.key)

    # -- the dispatch hook ------------------------------------------------------------------
    def _held_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> int:
        """The counted bytes of an op's input storages, each once, leaving out parameters and
        their views (a Linear's transposed weight): what a forward under ``no_grad`` would
        still hold beside the op's output. Read at an OOM only."""
        live, seen, total = self._live, set(), 0
        for tensor in _inputs(args, kwargs):
            base = tensor._base if tensor._is_view() else tensor
            if isinstance(base, torch.nn.Parameter):
                continue
            for storage in storages_of(tensor):
                key = id(storage)
                entry = live.get(key)
                if entry is not None and key not in seen:
                    seen.add(key)
                    total += entry[1]
        return total

    def _scan(
        self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> tuple[dict[int, tuple[Any, int]] | None, dict[int, tuple[Any, Any]] | None]:
        """Storages an op's outputs (or first-seen inputs) add (``None``: none), and the live
        storages resized in place (key -> ``(entry, storage)``, each once however many
        outputs view it: review; ``None``: none), which the caller counts once the budget
        allows them.

        The per-op cost of the simulated device, so written for speed: one pass over the
        outputs and, while adopting, one over the inputs; a plain tensor's storage read inline
        (:meth:`_storage` for the rest), where a non-strided layout raises. A sparse result
        (``to_sparse()``, a sparse gradient) adds the storages of its parts (:meth:`_split`):
        they are made inside the op, never an output of their own."""
        live = self._live
        plain_cpu = self._on_cpu
        new: dict[int, tuple[Any, int]] | None = None
        resized: dict[int, tuple[Any, Any]] | None = None
        adopting = self.adopting
        read: set[int] | None = None  # storages of the inputs, when not adopting
        storage: torch.UntypedStorage | None
        outputs = [out] if type(out) is _TENSOR else _tensors(out)
        for tensor in outputs:  # grows by the parts of sparse outputs, visited in turn
            if plain_cpu and type(tensor) is _TENSOR:
                if not tensor.is_cpu:
                    continue
                try:
                    storage = tensor.untyped_storage()
                except Exception:  # sparse: its parts hold the memory; mkldnn: none
                    outputs.extend(self._split(tensor))
                    continue
            else:
                storage = self._storage(tensor)
                if storage is None:
                    outputs.extend(self._split(tensor))
                    continue
            key = id(storage)
            entry = live.get(key)
            if entry is None:
                # without adopting, a view (or in-place result) of a storage this op read is
                # not new memory
                if not adopting and read is None:
                    read = self._read(_inputs(args, kwargs))
                if read is None or key not in read:
                    if new is None:
                        new = {key: (storage, self._size(storage))}
                    elif key not in new:
                        new[key] = (storage, self._size(storage))
            # a live storage's bytes are its count unless rounded, counted as a view's own
            # (_input_entry), or resized in place (by resize_ or an out= op)
            elif (
                storage.nbytes() != entry[1]
                and self._size(storage) != entry[1]
                and key not in self._partial
            ):
                if resized is None:
                    resized = {}
                resized[key] = (entry, storage)
        if not adopting:
            return new, resized
        # Inputs first seen now (created before the mode, e.g. the batch) are live on the
        # device: adopt them. Positional arguments are walked here, lists and keyword
        # arguments by _adopt.
        for arg in args:
            if plain_cpu and type(arg) is _TENSOR:
                if not arg.is_cpu:
                    continue
                try:
                    storage = arg.untyped_storage()
                except Exception:  # sparse: its parts' storages
                    new = self._adopt([arg], new)
                    continue
                if id(storage) not in live:
                    new = self._adopt([arg], new)
            elif isinstance(arg, (_TENSOR, list, tuple)):
                new = self._adopt(_tensors(arg), new)
        if kwargs:
            new = self._adopt(_tensors(kwargs), new)
        return new, resized

    def _adopt(
        self, tensors: list[torch.Tensor], new: dict[int, tuple[Any, int]] | None
    ) -> dict[int, tuple[Any, int]] | None:
        """``new`` with the storages of ``tensors`` that are not counted yet."""
        for whole in tensors:
            for tensor, storage in self._located(whole):
                if id(storage) in self._live:
                    continue
                if new is None:
                    new = {}
                key = id(storage)
                if key not in new:
                    new[key] = self._input_entry(tensor, storage)
                if self._adopted is not None:  # only for first-seen storages: no per-op cost
                    self._adopted[key] = _existed(whole)
        return new

    def _read(self, inputs: list[torch.Tensor]) -> set[int]:
        """The keys of the storages of an op's input tensors (:func:`_inputs`)."""
        return {id(s) for t in inputs for _, s in self._located(t)}

    def _on_device(self, keys: Iterable[int]) -> bool:
        """Whether any of these storages is device memory: counted, and not as a view's own
        elements (a batch sliced from a dataset: host data)."""
        live, partial = self._live, self._partial
        return any(k in live and k not in partial for k in keys)

    def _resized(self, key: int, entry: tuple[Any, int], storage: torch.UntypedStorage) -> None:
        """Count a live storage at its new size."""
        size = self._size(storage)
        with self._lock:
            if key not in self._live:
                return
            self._live[key] = (entry[0], size)
            self._current += size - entry[1]
            if self._observer is not None:
                self._observer.freed(key, entry[1])
                self._observer.allocated(key, size, int(storage.nbytes()), None)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Dynamo must never trace this handler (a compiled model calls it for every op). torch
        # wraps it in torch._disable_dynamo, which imports torch._dynamo at the first op
        # (1.3 s, sympy included) and adds a wrapper to every op; a code-level skip set below
        # does the same without either, where this torch has it.
        return _EVAL_FRAME is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # an OpOverload's __call__ is this call of its C++ op, one Python frame less per op
        run = func._op if type(func) is _OP_OVERLOAD else func
        out = run(*args, **kwargs) if kwargs else run(*args)
        if not self.counting:
            if not self.device_work:
                return out
            new, resized = self._device_write(func, args, kwargs, out), None
        else:
            new, resized = self._scan(out, args, kwargs)
        if new is None and resized is None:
            return out  # most ops: a view, an in-place op, or outputs counted already
        added = 0
        for _, size in new.values() if new is not None else ():
            added += size
        # a storage grown in place (resize_, an out= op, FSDP2's alloc_storage seen through
        # storage_resizes) is a request of its growth: refused past the budget, uncounted
        # (sweep CC: 'Tried to allocate 0 B', the growth already counted past the budget)
        refused = 0  # growth of a storage whose growth was refused before: counted (the op
        if resized:  # ran; on a GPU it would not have: refusing it again would fail every
            for key, (entry, storage) in resized.items():  # later op on the tensor: review)
                grown = self._size(storage) - entry[1]
                added += grown
                if key in self._refused:
                    refused += grown
        if (
            self.budget is not None
            and added - refused > 0
            and self._current + added - refused > self.budget
        ):
            self.num_ooms += 1
            self.in_use_at_oom = self._current
            node = autograd_node()
            if self._observer is not None:
                with self._lock:
                    observer = self._observer  # read again under the lock: it may have gone
                    if observer is not None:
                        if self._adopted:
                            self._adopted.clear()  # the op's storages are never counted
                        observer.out_of_memory(added, self.free or 0)
            if self._partial:  # nor counted as views
                self._partial.intersection_update(self._live)
            if resized:
                self._refused.update(resized)
            message = self._oom_message(added)
            self.node_at_oom = None if node is None else (message, node)
            self.inputs_at_oom = (message, self._held_inputs(args, kwargs))
            # Drop this frame's references so the failed outputs are freed right away
            # (the traceback keeps this frame alive until the caller recovers).
            del out, new
            raise torch.OutOfMemoryError(message)
        if resized:
            for key, (entry, storage) in resized.items():
                self._resized(key, entry, storage)
        if new:
            if self._adopted is not None and func is _LIFT_FRESH:
                for key in new:  # torch.tensor(...): a fresh tensor, not an older one read
                    self._adopted.pop(key, None)
            with self._lock:
                self._register(new)
        else:  # resized in place
            with self._lock:
                self._peak = max(self._peak, self._current)
        return out

    def _device_write(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, out: Any
    ) -> dict[int, tuple[Any, int]] | None:
        """Between steps (:attr:`device_work`), for an op that read counted storages (a
        view's partial count is host data, not device memory): adopt the tensors it wrote
        into (counted at once, never raising); else the new storages it made, to count as a
        step's op's are (``None``: none, or host work: an op on a host view)."""
        inputs, host = _inputs(args, kwargs), self._host
        if host and any((ref := host.get(id(t))) is not None and ref() is t for t in inputs):
            for t in _tensors(out):  # (a view of it, ``v.cpu().t()``, is host data too)
                self._mark_host(t)
            return None
        read = self._read(inputs)
        if not self._on_device(read):
            return None
        written = _written(func, args, kwargs)
        if written:
            pending = self._adopt(written, None)
            if pending:
                with self._lock:
                    self._register(pending)
                    self._note_past_budget()
            return None
        live, made = self._live, None
        for whole in _tensors(out):
            for _, storage in self._located(whole):
                key = id(storage)
                if key not in live and key not in read:  # (a view of what it read: no memory)
                    if made is None:
                        made = {}
                    made[key] = (storage, self._size(storage))
        return made

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """What ``tensor.cpu()`` returns between steps, for a counted plain tensor that needs
        no gradient: a GPU script's copy to the host, where this CPU device returns the
        tensor itself; here a view of it (no copy, the same storage: in-place changes and the
        bytes it keeps alive as without memkit), marked as host data, so that what ops make
        from it, and views of it, are host work (a ``{k: v.cpu().clone()}`` snapshot). Else
        ``tensor`` itself: a parameter's ``p.cpu()`` stays the parameter, so that the script
        runs as without memkit (a deepcopy of it, autograd through it)."""
        if (
            type(tensor) is not torch.Tensor  # (a Parameter, a subclass: kept as it is)
            or tensor.requires_grad  # (a view of it would be no leaf: deepcopy refuses it)
            or not self._on_device(id(s) for _, s in self._located(tensor))
        ):
            return tensor
        view = tensor.detach()
        self._mark_host(view)
        return view

    def _mark_host(self, tensor: torch.Tensor) -> None:
        host, key = self._host, id(tensor)

        def gone(ref: weakref.ref[torch.Tensor]) -> None:
            if host.get(key) is ref:
                del host[key]

        host[key] = weakref.ref(tensor, gone)

    def _oom_message(self, tried: int) -> str:
        budget = self.budget or 0
        free = max(0, budget - self._current)
        return (
            f"Simulated device {self.device} out of memory. "
            f"Tried to allocate {format_size(tried)}. {format_size(budget)} budget, "
            f"{format_size(self._current)} in use by tensors memkit counts, "
            f"{format_size(free)} free. "
            + (_PAST_BUDGET if self._current > budget else "")
            + "[memkit.simulate: worded like 'CUDA out of memory.' so OOM handlers recognise it]"
        )

    def __repr__(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {format_size(self.budget)}"
        return (
            f"MemoryAccountant({self.device}, {budget}, current {format_size(self._current)}, "
            f"peak {format_size(self._peak)})"
        )


_PAST_BUDGET = (
    "In use exceeds the budget because tensors made before were counted past it when first "
    "used (a model, a batch; counting them never raises): on a GPU of this size moving them "
    "there (`.to(device)`) would have failed. "
)
"""Said in an OOM message when ``current`` is above the budget (:meth:`MemoryAccountant.track`
counted existing tensors past it)."""

_WRITES: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}
"""op -> the positions and keyword names of the arguments its schema writes into."""


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The tensors an op writes into (``lerp_``'s ``self``, an ``out=``), by its schema."""
    where = _WRITES.get(func)
    if where is None:
        schema = getattr(func, "_schema", None)
        arguments = [] if schema is None else schema.arguments
        writes = [(i, a) for i, a in enumerate(arguments) if a.alias_info and a.alias_info.is_write]
        where = _WRITES[func] = (
            tuple(i for i, a in writes if not a.kwarg_only),
            tuple(a.name for _, a in writes if a.kwarg_only),
        )
    positions, names = where
    if not positions and not names:
        return []
    found = [t for i in positions if i < len(args) for t in _tensors(args[i])]
    if kwargs and names:
        found += [t for name in names if name in kwargs for t in _tensors(kwargs[name])]
    return found


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """An op's input tensors, positional and keyword."""
    return _tensors(args) + _tensors(kwargs) if kwargs else _tensors(args)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result: ATen ops take and return tensors, and lists
    or tuples of them one level deep (``cat``, ``_foreach_add``); a dict for keyword arguments.
    A hand-written walk: the hot path of the simulated device, several times faster than
    pytree's."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return []
    found: list[torch.Tensor] = []
    for item in value:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            found.extend(_tensors(item))
    return found


if _EVAL_FRAME is not None:  # skip the handler and everything it calls, as _disable_dynamo does
    _SKIP = _EVAL_FRAME._FrameAction.SKIP
    _EVAL_FRAME.set_code_exec_strategy(
        MemoryAccountant.__torch_dispatch__.__code__, _EVAL_FRAME._FrameExecStrategy(_SKIP, _SKIP)
    )

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided
_OP_OVERLOAD = torch._ops.OpOverload

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
"""What ``torch.tensor(data)`` dispatches: its input is the new tensor itself."""

_ACCOUNTANTS: weakref.WeakSet[MemoryAccountant] = weakref.WeakSet()


def _stop_counting_in_child() -> None:
    """A forked child (a DataLoader worker) holds copies of the parent's accountants: their
    tensors live in the child's memory, never on the simulated device, so they count nothing."""
    for accountant in list(_ACCOUNTANTS):
        accountant.counting = False
        accountant.adopting = False
        accountant.device_work = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_counting_in_child)
