"""The torch functions a tracker replaces for its block, each put back by the handle returned
(:class:`Restore`, kept with the tracker's hook handles):

* ``torch.autograd.backward``: marks backward's start and end exactly;
* the autograd engine's entry (``torch.autograd.grad`` too): a backward of a training forward
  that did not go through ``torch.autograd.backward``;
* ``DataLoader`` iteration: a batch fetch is host work, which the simulated device does not
  count;
* ``GradScaler.step``: a step the scaler skips still ends the training step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memkit.patching import Restore

_R = TypeVar("_R")

__all__ = [
    "eager",
    "skipped_by_dynamo",
    "wrap_backward",
    "wrap_data_loading",
    "wrap_engine",
    "wrap_grad_scaler",
]


def eager(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn``, memkit's own code, run as it is where compiled code calls it (a compiled
    optimizer step's hooks, a compiled train step's backward): TorchDynamo neither traces it
    nor anything it calls, so it adds no graph, guard or recompilation, only a graph break
    at the call (sweep BR: a compiled ``opt.step`` traced memkit's hooks into 8 more graphs
    and hit the recompile limit)."""
    return torch.compiler.disable(fn, recursive=True)


def skipped_by_dynamo(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn``, a wrapper of memkit's around torch's own call (``torch.autograd.backward``,
    ``GradScaler.step``): TorchDynamo skips its frame but still compiles what it calls (the
    wrapped call: compiled autograd, a compiled optimizer step stay compiled)."""
    return torch.compiler.disable(fn, recursive=False)


def wrap_backward(
    begin: Callable[[Any, bool], None], end: Callable[[], None], failed: Callable[[], None]
) -> Restore:
    """Wrap ``torch.autograd.backward`` (what ``Tensor.backward`` calls) so that ``begin`` and
    ``end`` mark backward's start and end exactly (the first gradient hook comes too late: the
    loss's own backward, e.g. the gradient of the logits, runs before it); ``failed`` when it
    raises (the phase stays: a post-mortem reads it). ``begin`` gets the tensors backward
    starts from (the loss) and whether it keeps their graph (``retain_graph``, or
    ``create_graph``, which implies it)."""
    autograd = torch.autograd
    original = autograd.backward
    begin, end, failed = eager(begin), eager(end), eager(failed)

    @skipped_by_dynamo
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        if not handle.live:
            return original(*args, **kwargs)
        retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
        if retain is None:
            retain = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
        begin(args[0] if args else kwargs.get("tensors"), bool(retain))
        try:
            result = original(*args, **kwargs)
        except BaseException:
            failed()
            raise
        end()
        return result

    handle = Restore(autograd, "backward", original, backward)
    autograd.backward = backward
    return handle


def wrap_engine(
    begin: Callable[[], bool],
    end: Callable[[], None],
    failed: Callable[[], None],
    graph_grad: Callable[[int], None],
) -> Restore | None:
    """Wrap the call into the autograd engine that ``torch.autograd.backward`` and
    ``torch.autograd.grad`` make (``torch.autograd._engine_run_backward``, looked up at each
    call, so also for callers that imported ``backward``/``grad`` before the block): ``begin``
    says whether a backward begins there (one that :func:`wrap_backward` did not already mark),
    and then ``end`` marks its end, or ``failed`` when it raises (as in :func:`wrap_backward`:
    a script that catches the error and trains on must not be left inside a backward).

    A gradient taken with ``create_graph=True`` that does not accumulate into ``.grad``
    (``torch.autograd.grad`` for a gradient penalty, a meta-learning inner step) builds more
    graph for the loss: it is part of the forward, no backward pass. ``graph_grad(+1)`` and
    ``graph_grad(-1)`` bracket it. ``None`` where torch has no such function."""
    autograd = torch.autograd
    original = getattr(autograd, "_engine_run_backward", None)
    if original is None:
        return None
    begin, end, failed, graph_grad = eager(begin), eager(end), eager(failed), eager(graph_grad)

    @skipped_by_dynamo
    @functools.wraps(original)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        # run_backward(outputs, grad_outputs, keep_graph, create_graph, inputs, ...)
        if not handle.live:
            return original(*args, **kwargs)
        create_graph = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
        if create_graph and kwargs.get("accumulate_grad", True) is False:
            graph_grad(1)
            try:
                return original(*args, **kwargs)
            finally:
                graph_grad(-1)
        if not begin():
            return original(*args, **kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            failed()  # the phase stays (the post-mortem's), the backward is over
            raise
        end()
        return result

    handle = Restore(autograd, "_engine_run_backward", original, run_backward)
    autograd._engine_run_backward = run_backward
    return handle


def wrap_data_loading(sim: Any) -> Restore:
    """While a DataLoader fetches a batch (datasets, transforms, collation), the simulated
    device ``sim`` counts nothing: it is host work."""
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    original = cls.__next__

    @functools.wraps(original)
    def fetch(it: Any) -> Any:
        if not handle.live:
            return original(it)
        acct = sim.accountant
        if _only_mode(acct):  # the usual case: leave the dispatch mode for the fetch
            with _disable_current_modes():
                return original(it)
        if not _mode_active(acct):  # another thread (a prefetcher): it counts nothing
            return original(it)
        saved, work = (acct.counting, acct.adopting), acct.device_work
        sim.count_ops(False, False)
        acct.device_work = False  # (a batch collated from the model's outputs: host data)
        try:
            return original(it)
        finally:
            sim.count_ops(*saved)
            acct.device_work = work

    handle = Restore(cls, "__next__", original, fetch)
    cls.__next__ = fetch  # type: ignore[method-assign,assignment]
    return handle


def wrap_grad_scaler(calls: Callable[[], int], skipped: Callable[[Any], None]) -> Restore:
    """``GradScaler.step(optimizer)`` calls no ``optimizer.step()`` when it skips the step
    (inf or NaN gradients: fp16's first steps, while the scale settles): then ``skipped``
    gets the optimizer. ``calls()`` counts the optimizer steps seen, before and after."""
    from torch.amp import grad_scaler

    cls = grad_scaler.GradScaler
    original = cls.step
    calls, skipped = eager(calls), eager(skipped)

    @skipped_by_dynamo
    @functools.wraps(original)
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not handle.live:
            return original(scaler, optimizer, *args, **kwargs)
        before = calls()
        result = original(scaler, optimizer, *args, **kwargs)
        if calls() == before:
            skipped(optimizer)
        return result

    handle = Restore(cls, "step", original, step)
    cls.step = step  # type: ignore[method-assign]
    return handle


def _mode_active(mode: Any) -> bool:
    """``mode`` is on this thread's dispatch-mode stack."""
    stack = torch._C._get_dispatch_stack_at
    return any(stack(i) is mode for i in range(torch._C._len_torch_dispatch_stack()))


def _only_mode(mode: Any) -> bool:
    """``mode`` is the only dispatch mode active in this thread."""
    return torch._C._len_torch_dispatch_stack() == 1 and torch._C._get_dispatch_stack_at(0) is mode
