"""Rank, world size, and the few collectives memkit needs; no-ops without a process group.

:func:`gather_to_rank0` is no collective: it sends objects to rank 0 through the process
group's store, so it never meets the script's own collectives.

Every function here works in a single process: without an initialised ``torch.distributed``
process group (or with a world of one) the collectives return their local input unchanged and
:func:`rank`, :func:`local_rank` and :func:`world_size` fall back to torchrun's environment
variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), then to ``0``, ``0`` and ``1``.

The collectives run outside autograd (``torch.no_grad()``) on a small integer tensor placed
where the process group's backend wants it: a cpu tensor for gloo, the current device for
NCCL and other accelerator backends (asked of :func:`memkit.devices.collective_device`).

Timeouts: a collective given ``timeout`` seconds runs with ``async_op=True`` and
``work.wait(timeout=...)``; a rank that never arrives (dead, hung, or still recovering) turns
into a :class:`~memkit.errors.DistributedError` on the ranks that did, instead of a hang.
Without ``timeout`` the process group's own timeout applies (``init_process_group(timeout=)``,
30 minutes for gloo by default). After a timeout the process group has a collective that never
completed; it cannot be used further, and the job should end.

Examples:
    >>> from memkit import distributed
    >>> distributed.world_size(), distributed.any_true(False), distributed.all_max([3, 1])
    (1, False, [3, 1])
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memkit.devices import collective_device, set_current_device
from memkit.errors import ConfigError, DistributedError


class RankStatus(enum.IntEnum):
    """A rank's outcome of one attempt (a probe trial, a micro-batch step). Ranks agree by
    taking the largest: the worst outcome on any rank is every rank's."""

    OK = 0
    ABORTED = 1
    """Stopped because another rank failed."""
    OOM = 2
    FATAL_OOM = 3
    """Out of memory with no smaller size left to try (a micro-batch of 1)."""
    ERROR = 4
    """An error that is not an out-of-memory error."""


__all__ = [
    "Gathered",
    "all_gather_ints",
    "all_max",
    "all_reduce_sum_",
    "any_true",
    "broadcast_",
    "fill_missing_grads",
    "gather_to_rank0",
    "give_up_waiting",
    "is_distributed",
    "launched_rank",
    "local_rank",
    "process_group_from_env",
    "rank",
    "reduce_used_grads",
    "world_size",
]

log = logging.getLogger(__name__)


def _dist() -> Any:
    """``torch.distributed`` if it is available and initialised, else ``None``."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        log.debug("ignoring %s=%r: not an integer", name, value)
        return default


def is_ddp(model: Any) -> bool:
    """Whether ``model`` is a :class:`torch.nn.parallel.DistributedDataParallel`."""
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    return ddp is not None and isinstance(model, ddp)


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised in this process."""
    return _dist() is not None


def rank() -> int:
    """This process's global rank: the process group's, else ``$RANK``, else 0."""
    dist = _dist()
    if dist is not None:
        return int(dist.get_rank())
    return _env_int("RANK", 0)


def launched_rank() -> int | None:
    """This process's rank when it is part of a distributed run (a process group exists, or a
    launcher such as torchrun set ``$RANK``), else ``None``."""
    if _dist() is None and os.environ.get("RANK") is None:
        return None
    return rank()


def local_rank() -> int:
    """This process's rank on its node: ``$LOCAL_RANK`` (set by torchrun), else 0.

    ``torch.distributed`` itself has no notion of a local rank; launchers set the variable.
    """
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    """The number of ranks on this node: ``$LOCAL_WORLD_SIZE`` (set by torchrun), else 1."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", 1))


def world_size() -> int:
    """The number of ranks: the process group's, else ``$WORLD_SIZE``, else 1."""
    dist = _dist()
    if dist is not None:
        return int(dist.get_world_size())
    return max(1, _env_int("WORLD_SIZE", 1))


def _collective_device(dist: Any) -> torch.device:
    return collective_device(str(dist.get_backend()))


_IN_FLIGHT: collections.deque[Any] = collections.deque(maxlen=16)
"""The tensors and work objects of memkit's last collectives, kept referenced from Python.

A gloo work object is released by the process group's worker thread once the collective is
done, and with it the last C++ reference to its tensor; if Python had dropped the tensor
already, that release needs the GIL. When the group is destroyed right after (a probe's last
agreement before the script's ``destroy_process_group``; DDP's Reducer destroys the group when
the model is freed), the main thread joins the worker while holding the GIL and both wait
forever (seen: rank 0 hung at exit under torchrun, 5 of 7 runs, when the tracker still gathered
with a collective inside ``destroy_process_group``). Kept here, the tensor's last reference
is Python's, dropped with the GIL held. Only memkit's own small tensors are kept (the
users' gradients, which the probe reduces, stay the user's)."""


def _keep(*objects: Any) -> None:
    _IN_FLIGHT.extend(objects)


def all_max(values: Sequence[int], *, timeout: float | None = None) -> list[int]:
    """Element-wise maximum of ``values`` over all ranks (every rank gets the result).

    One all-reduce of a small int64 tensor. Every rank must call it with the same number of
    values. Without a process group (or with one rank) it returns ``list(values)``.

    Args:
        values: integers, the same count on every rank.
        timeout: seconds to wait for the other ranks; ``None`` uses the process group's timeout.

    Raises:
        DistributedError: the collective failed or timed out (a rank died or never arrived).

    Examples:
        >>> all_max([1, -5])  # single process: unchanged
        [1, -5]
    """
    local = [int(v) for v in values]
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return local
    device = _collective_device(dist)
    # Outside any dispatch mode: memkit's bookkeeping tensor is not the user's memory, and on a
    # simulated device it must never be the allocation that crosses the budget.
    with torch.no_grad(), _disable_current_modes():
        tensor = torch.tensor(local, dtype=torch.int64, device=device)
        _keep(tensor)
        try:
            if timeout is None:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            else:
                work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
                _keep(work)
                work.wait(timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as exc:
            wait = "the process group's timeout" if timeout is None else f"{timeout:g} s"
            raise DistributedError(
                f"rank {rank()} of {dist.get_world_size()}: an all-reduce of {len(local)} "
                f"value(s) failed or did not complete within {wait} ({exc}); another rank "
                "probably died, raised, or is stuck. The process group cannot be used further: "
                "end the job and look at the other ranks' logs"
            ) from exc
        return [int(v) for v in tensor.tolist()]


def any_true(flag: bool, *, timeout: float | None = None) -> bool:
    """Whether ``flag`` is true on any rank ("did any rank hit an OOM?").

    Without a process group it returns ``flag``.

    Raises:
        DistributedError: a rank did not take part within ``timeout`` seconds.

    Examples:
        >>> any_true(True), any_true(False)
        (True, False)
    """
    return bool(all_max([1 if flag else 0], timeout=timeout)[0])


def all_gather_ints(
    values: Sequence[int | None], *, timeout: float | None = None
) -> list[list[int | None]]:
    """Every rank's ``values`` (non-negative integers or ``None``), by rank, on every rank.

    One all-reduce (MAX) of ``world_size * len(values)`` slots, each rank filling its own:
    cheaper than ``all_gather_object`` (no pickling) and bounded by ``timeout`` like
    :func:`all_max`. Every rank must pass the same number of values.

    Raises:
        ConfigError: a value is negative.
        DistributedError: a rank did not take part within ``timeout`` seconds.

    Examples:
        >>> all_gather_ints([3, None])  # single process
        [[3, None]]
    """
    if any(v is not None and v < 0 for v in values):
        raise ConfigError(f"all_gather_ints takes non-negative integers or None, found {values}")
    n, me, size = len(values), rank(), world_size()
    if _dist() is None or size == 1:
        return [list(values)]
    slots = [0] * (n * size)
    for i, v in enumerate(values):
        slots[me * n + i] = 0 if v is None else int(v) + 1
    flat = all_max(slots, timeout=timeout)
    return [[None if v == 0 else v - 1 for v in flat[r * n : (r + 1) * n]] for r in range(size)]


def _wait_all(works: list[Any], what: str, timeout: float | None) -> None:
    dist = _dist()
    try:
        for work in works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as exc:
        size = "?" if dist is None else dist.get_world_size()
        raise DistributedError(
            f"rank {rank()} of {size}: {what} failed or timed out ({exc}); another rank "
            "probably died or is stuck. End the job and look at the other ranks' logs"
        ) from exc


def all_reduce_sum_(tensors: Sequence[torch.Tensor], *, timeout: float | None = None) -> None:
    """Sum each tensor in place over all ranks (no-op without a process group).

    Every rank must pass tensors of the same shapes in the same order. The all-reduces are
    launched asynchronously, then waited for, so no extra memory is allocated by torch.

    Raises:
        DistributedError: an all-reduce failed or timed out.
    """
    dist = _dist()
    if dist is None or dist.get_world_size() == 1 or not tensors:
        return
    with torch.no_grad():
        works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in tensors]
    _wait_all(works, f"an all-reduce of {len(works)} tensor(s)", timeout)


def fill_missing_grads(params: Sequence[torch.Tensor]) -> list[int]:
    """Give every ``None`` gradient a zero tensor (each rank must all-reduce the same tensors);
    return which parameters had one here (1) or not (0), for the ranks to agree on with
    :func:`all_max` before :func:`reduce_used_grads`."""
    used = []
    for param in params:
        used.append(0 if param.grad is None else 1)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return used


def reduce_used_grads(
    params: Sequence[torch.Tensor],
    used: Sequence[int],
    *,
    timeout: float | None = None,
    average: bool = False,
) -> None:
    """Sum over all ranks the gradients of the parameters some rank used (``used``: the
    agreed flags); one used on no rank goes back to ``None``, as DDP leaves it. ``average``
    divides the sums by the world size (DDP's mean), for gradients not pre-scaled by it.

    Raises:
        DistributedError: an all-reduce failed or timed out.
    """
    grads = []
    for param, flag in zip(params, used, strict=True):
        if flag:
            assert param.grad is not None
            grads.append(param.grad)
        else:
            param.grad = None
    all_reduce_sum_(grads, timeout=timeout)
    if average:
        world = world_size()
        with torch.no_grad():
            for grad in grads:
                grad.div_(world)


def broadcast_(
    tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float | None = None
) -> None:
    """Overwrite each tensor in place with rank ``src``'s (no-op without a process group).

    Raises:
        DistributedError: a broadcast failed or timed out.
    """
    dist = _dist()
    if dist is None or dist.get_world_size() == 1 or not tensors:
        return
    with torch.no_grad():
        works = [dist.broadcast(t, src=src, async_op=True) for t in tensors]
    _wait_all(works, f"a broadcast of {len(works)} tensor(s) from rank {src}", timeout)


@dataclass(frozen=True)
class Gathered:
    """What rank 0 collected with :func:`gather_to_rank0`.

    Attributes:
        objects: by rank, the objects that arrived (rank 0's own included).
        missing: the ranks whose object did not arrive within the timeout.
        gave_up: rank 0 stopped waiting before the timeout (:func:`give_up_waiting`).
        absent: of ``missing``, those that never announced the exchange (``only_announced``):
            not waited for.
    """

    objects: dict[int, Any]
    missing: tuple[int, ...] = ()
    gave_up: bool = False
    absent: tuple[int, ...] = ()


_GIVE_UP = threading.Event()
"""Set while the job is being stopped (``memkit run``'s SIGTERM outside the script's run, see
:func:`give_up_waiting`): rank 0 stops waiting for the other ranks' objects at once."""


def give_up_waiting(give_up: bool = True) -> None:
    """Make :func:`gather_to_rank0` on rank 0 stop waiting (now and until called with
    ``False``): the job is being stopped, and a rank that died would cost the full timeout,
    after which torchrun's SIGKILL takes the report with it."""
    if give_up:
        _GIVE_UP.set()
    else:
        _GIVE_UP.clear()


ANNOUNCE_GRACE = 0.5
"""Seconds rank 0 still looks for a rank's announcement of an exchange it had not made yet
(:func:`gather_to_rank0`'s ``only_announced``): ranks leave a ``barrier()`` together, and a
rank that enters the next block a few milliseconds after rank 0 finished its own is late,
not absent. A block rank 0 alone runs costs this much wait."""

_POLL = (0.01, 0.5)
"""Rank 0 looks for the other ranks' keys every 10 ms at first, backing off to 500 ms; between
looks Python runs its signal handlers (``memkit run``'s SIGTERM), which a blocking wait in
C++ would hold off until it returns."""


def _store(dist: Any) -> Any:
    """The default process group's store (what ``init_process_group`` rendezvoused through)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, AttributeError, RuntimeError, ValueError) as exc:
        raise DistributedError(
            f"rank {rank()}: the process group's store is not reachable ({exc})"
        ) from exc


def announce(key: str) -> bool:
    """Say in the process group's store that this rank runs the exchange ``key`` (a tracked
    block it entered), so that rank 0 waits only for the ranks that run it (see
    :func:`gather_to_rank0`'s ``only_announced``); whether it was said (a group, a store)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return False
    try:
        _store(dist).set(f"memkit/{key}/entered/{dist.get_rank()}", b"1")
    except (DistributedError, RuntimeError, ValueError):
        return False
    return True


def gather_to_rank0(
    obj: Any, key: str, *, timeout: float, only_announced: bool = False
) -> Gathered | None:
    """Send a picklable ``obj`` to rank 0 through the process group's store (c10d ``set`` and
    ``get``, never a collective): a :class:`Gathered` on rank 0, ``None`` elsewhere.

    The other ranks set their key and return at once; rank 0 waits up to ``timeout`` seconds
    for the others' keys (not at all after :func:`give_up_waiting`), reads and deletes them,
    and names the ranks that did not send as ``missing``. Nothing here takes part in the
    process group's collectives, so it cannot be matched against the user's (a rank that
    raised and went on to a ``barrier()`` while another gathers) and a rank that never sends
    costs rank 0 ``timeout``, never a hang.
    ``key`` names the exchange: every rank must pass the same one, and each exchange its own
    (an object left by a rank rank 0 gave up on stays behind under it). ``only_announced``:
    rank 0 waits only for the ranks that announced ``key`` (:func:`announce`) by now or within
    :data:`ANNOUNCE_GRACE` (a block only rank 0 runs, a validation, costs that much wait); the
    others are ``missing``. Without a
    process group (or with one rank) it returns ``Gathered({0: obj})``. Meant for small objects such
    as per-rank summaries.

    Raises:
        DistributedError: the store could not be reached or written.

    Examples:
        >>> gather_to_rank0({"peak": 1}, "example", timeout=1.0)
        Gathered(objects={0: {'peak': 1}}, missing=(), gave_up=False, absent=())
    """
    import pickle

    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return Gathered({0: obj})
    me, size = dist.get_rank(), dist.get_world_size()
    store = _store(dist)
    names = {r: f"memkit/{key}/{r}" for r in range(size)}
    try:
        if me != 0:
            store.set(names[me], pickle.dumps(obj))
            return None
        objects: dict[int, Any] = {0: obj}
        pending = [r for r in range(1, size)]
        absent: list[int] = []
        if only_announced:
            absent = _unannounced(store, key, pending, min(timeout, ANNOUNCE_GRACE))
            pending = [r for r in pending if r not in absent]
        deadline, pause = time.monotonic() + timeout, _POLL[0]
        while pending:
            for r in [r for r in pending if store.check([names[r]])]:
                objects[r] = pickle.loads(store.get(names[r]))
                store.delete_key(names[r])
                pending.remove(r)
            if not pending or time.monotonic() >= deadline or _GIVE_UP.is_set():
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _POLL[1])
    except (RuntimeError, ValueError, pickle.UnpicklingError) as exc:  # DistStoreError too
        raise DistributedError(
            f"rank {me} of {size}: exchanging objects through the process group's store "
            f"failed ({exc}); the store's host (torchrun's agent, or rank 0) may be gone"
        ) from exc
    for r in range(1, size):  # the ranks' announcements of this exchange are spent
        if r not in absent:
            with contextlib.suppress(RuntimeError, ValueError):
                store.delete_key(f"memkit/{key}/entered/{r}")
    missing = tuple(sorted([*pending, *absent]))
    return Gathered(objects, missing, bool(pending) and _GIVE_UP.is_set(), tuple(sorted(absent)))


def _unannounced(store: Any, key: str, ranks: list[int], grace: float) -> list[int]:
    """Of ``ranks``, those that have not announced ``key`` (:func:`announce`) within ``grace``
    seconds (looked for every 10 ms; not after :func:`give_up_waiting`)."""
    deadline = time.monotonic() + grace
    while True:
        left = [r for r in ranks if not store.check([f"memkit/{key}/entered/{r}"])]
        if not left or time.monotonic() >= deadline or _GIVE_UP.is_set():
            return left
        time.sleep(_POLL[0])


def _default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group_from_env(
    device: str | torch.device = "cpu",
    *,
    backend: str | None = None,
    timeout: float | None = None,
) -> Iterator[bool]:
    """Initialise a process group from torchrun's environment for the block, if needed.

    Yields whether a multi-rank group is in use. Nothing is done when a group already exists
    (it is used as it is) or when ``$WORLD_SIZE`` is unset or 1. Otherwise the group is
    created with ``init_method="env://"`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``: what torchrun sets), ``backend`` (default: ``nccl`` for cuda, ``gloo``
    otherwise; name ``gloo`` to put several ranks on one GPU, which NCCL refuses) and
    ``timeout`` seconds, and destroyed when the block exits. For cuda the rank's device
    (``device``'s index, else ``LOCAL_RANK``) is made current first, as
    ``torch.cuda.set_device(local_rank)`` would.

    Raises:
        DistributedError: the group could not be created (a rank missing, a bad address).
    """
    if _dist() is not None:
        yield world_size() > 1
        return
    if _env_int("WORLD_SIZE", 1) <= 1:
        yield False
        return
    import torch.distributed as dist

    dev = torch.device(device)
    name = backend or _default_backend(dev.type)
    if dev.type == "cuda":
        set_current_device(
            torch.device("cuda", dev.index if dev.index is not None else local_rank())
        )
    kwargs: dict[str, Any] = {"backend": name, "init_method": "env://"}
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=timeout)
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(
            f"rank {_env_int('RANK', 0)}: could not create a {name} process group from the "
            f"environment (MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {exc}. Launch with torchrun"
        ) from exc
    log.debug("rank %d of %d: %s process group created", rank(), world_size(), name)
    try:
        yield True
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
