"""Leave the user's objects exactly as they were: parameters, buffers, gradients, optimizer
state, the learning-rate schedulers stepping that optimizer, ``training`` flags, the modules'
plain attributes (:class:`ModuleAttributes`) and RNG states, also after an error or Ctrl-C.

Copies are kept in host memory (never on the device being probed, where they would distort
what is measured), and restored in place with ``copy_`` so parameter identity, and with it the
optimizer's references, survive.
"""

from __future__ import annotations

import collections
import copy
import gc
import logging
from typing import Any

import torch

from memkit.devices import restore_rng_state, rng_state

__all__ = ["ModuleAttributes", "SavedState"]

log = logging.getLogger(__name__)


def _stateful_of(optimizer: Any) -> list[Any]:
    """The learning-rate schedulers of ``optimizer`` and the AMP gradient scalers alive: a
    scheduler holds its optimizer and the optimizer knows nothing of it, and a scaler is
    given the optimizer only at each ``step``, so they are found among the collector's
    objects (one scan: tens of milliseconds, about a second with millions of live objects).
    A scheduler is torch's (``LRScheduler``, ``ReduceLROnPlateau``) or a class named
    ``...Scheduler`` with ``state_dict``/``load_state_dict`` (timm's); its optimizer is
    ``optimizer`` or the one ``optimizer`` wraps (accelerate's ``AcceleratedOptimizer``
    holds it as ``.optimizer``). A scaler is ``torch.amp.GradScaler`` (its growth tracker
    moves with each step a trial runs)."""
    from torch.amp import GradScaler
    from torch.optim import lr_scheduler

    kinds = tuple(
        k for k in (getattr(lr_scheduler, n, None) for n in ("LRScheduler", "ReduceLROnPlateau"))
        if isinstance(k, type)
    )  # fmt: skip
    targets = {id(optimizer)}
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        targets.add(id(inner))

    def verdict_of(kind: type) -> int:
        """1: a scheduler, 2: a scaler, 0: neither."""
        # issubclass on type(o), not isinstance(o): the latter reads ``__class__``, which
        # some module-level objects turn into a deprecation warning
        if issubclass(kind, GradScaler):
            return 2
        return int(
            issubclass(kind, kinds)
            or (
                kind.__name__.endswith("Scheduler")
                and callable(getattr(kind, "state_dict", None))
                and callable(getattr(kind, "load_state_dict", None))
            )
        )

    verdicts: dict[type, int] = {}
    found = []
    for o in gc.get_objects():
        kind = type(o)
        verdict = verdicts.get(kind)
        if verdict is None:
            verdict = verdicts[kind] = verdict_of(kind)
        if verdict == 2 or (verdict == 1 and id(getattr(o, "optimizer", None)) in targets):
            found.append(o)
    return found


def _stateful_states(optimizer: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Each scheduler of ``optimizer`` and each gradient scaler with a copy of its state (one
    whose state cannot be copied is left out: best effort, as restoring it is)."""
    if optimizer is None:
        return []
    out = []
    for obj in _stateful_of(optimizer):
        try:
            state = copy.deepcopy(obj.state_dict())
            stages = getattr(obj, "_per_optimizer_states", None)  # a GradScaler's
            if stages is not None:
                state = {_STAGES: copy.deepcopy(stages), **state}
            out.append((obj, state))
        except Exception:  # a user scheduler with uncopyable state
            log.debug("state of %s not copied", type(obj).__name__, exc_info=True)
    return out


_STAGES = "memkit: per-optimizer stages"
"""Where a gradient scaler's per-optimizer stages (``unscale_`` called, stepped) are kept with
its state: ``state_dict`` leaves them out, and a step that ran out of memory between
``unscale_`` and ``update`` leaves them waiting for an ``update`` (the next ``unscale_``
raises "unscale_() has already been called on this optimizer since the last update()")."""


def _load(obj: Any, state: dict[str, Any]) -> None:
    """Put ``state`` (from :func:`_stateful_states`) back into ``obj``."""
    if _STAGES in state:
        obj._per_optimizer_states = copy.deepcopy(state[_STAGES])
        state = {k: v for k, v in state.items() if k != _STAGES}
    obj.load_state_dict(copy.deepcopy(state))


def _to_host(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _restore_in_place(optimizer: Any, saved: dict[str, Any]) -> bool:
    """Write ``saved`` (a host copy of ``optimizer.state_dict()``) into the optimizer's live
    state tensors and hyperparameters; ``False`` (nothing changed) where a tensor is missing
    or has another shape or dtype, for ``load_state_dict`` to rebuild."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        return False
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    entries: dict[Any, dict[str, Any]] = {}
    for index, entry in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            return False
        live = optimizer.state.get(params[index])
        if not isinstance(live, dict):
            return False
        values = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                target = live.get(key)
                if not (
                    isinstance(target, torch.Tensor)
                    and target.shape == value.shape
                    and target.dtype == value.dtype
                ):
                    return False
                writes.append((target, value))
                values[key] = target
            elif _holds_tensor(value):  # LBFGS's history lists: load_state_dict casts them
                return False
            else:
                values[key] = copy.deepcopy(value)
        entries[params[index]] = values
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    for param in list(optimizer.state):  # state the trials created: gone, as before them
        if param not in entries:
            del optimizer.state[param]
    for param, values in entries.items():
        live = optimizer.state[param]
        live.clear()
        live.update(values)
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"})
    return True


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {"_compiled_call_impl"}
"""``nn.Module``'s own attributes (parameters, buffers, submodules, hooks, ``training``):
handled elsewhere, never by :class:`ModuleAttributes`."""
_NOT_THE_SCRIPTS = ("torch.nn.parallel", "torch.distributed", "torch._dynamo")
"""Where the wrappers whose attributes are their own bookkeeping come from (DDP rebuilds its
buckets once, after a first step; FSDP's and ``torch.compile``'s wrappers): left alone."""
_LARGEST_CONTAINER = 10_000
"""A container with more items than this at the probe's start is left alone (its copy and the
comparison before each trial are bounded by it)."""
_SCALARS = (type(None), bool, int, float)
_MISSING = object()
_CONTAINERS = (list, collections.deque, dict, set)


def _is_tensors(value: Any) -> bool:
    """A tensor, or a tuple or list of tensors (a replay entry ``(x, y)``), no parameter."""
    if isinstance(value, (tuple, list)):
        return all(_is_tensors(v) and not isinstance(v, (tuple, list)) for v in value)
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _of_tensors(container: Any) -> bool:
    """Whether ``container`` (empty, or up to :data:`_LARGEST_CONTAINER` items) holds only
    tensors or ``None`` (a dict: as values)."""
    if len(container) > _LARGEST_CONTAINER:
        return False
    items = container.values() if isinstance(container, dict) else container
    return all(v is None or _is_tensors(v) for v in items)


def _restorable(value: Any) -> bool:
    """What :class:`ModuleAttributes` puts back or removes: a scalar, tensors, a container."""
    return isinstance(value, _SCALARS + _CONTAINERS) or _is_tensors(value)


def _same_contents(container: Any, saved: Any) -> bool:
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return all(container.get(k, _MISSING) is v for k, v in saved.items())
    if isinstance(container, set):
        return container == saved
    return all(a is b for a, b in zip(container, saved, strict=True))


def _put_back(container: Any, saved: Any) -> None:
    """``container``'s contents as ``saved`` (a shallow copy), in place: the script's own
    references to the container stay true."""
    if isinstance(container, list):
        container[:] = saved
    elif isinstance(container, dict):
        container.clear()
        container.update(saved)
    else:  # a deque (its maxlen kept) or a set
        container.clear()
        if isinstance(container, set):
            container.update(saved)
        else:
            container.extend(saved)


class ModuleAttributes:
    """The modules' plain attributes (in ``__dict__``, outside parameters, buffers, submodules
    and hooks) as they were at the start, put back before each trial and at the end.

    A replay or history buffer the step appends to (``self.history = deque(maxlen=K)``), the
    last batch's features (``self.h = out.detach()``) would otherwise carry one trial's
    tensors into the next: the next trial starts with them held, and its buffer is never its
    own. In a module where a tensor, ``None`` or container attribute changed (or one was
    added): ``None``, numbers and tensors are rebound to their start value (a cache's length
    goes back with its tensor); a list, deque, dict or set that held only tensors (or was
    empty) gets its contents back in place (the script may hold the container itself);
    attributes of those kinds that the trials added are removed. Strings, other objects and
    larger containers are left alone, and so are the attributes of DDP's, FSDP's and
    ``torch.compile``'s wrappers.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        # each module, the attributes put back and the names it had at the start
        self._start: list[tuple[torch.nn.Module, dict[str, Any], frozenset[str]]] = []
        self._contents: dict[int, Any] = {}  # id(container) -> a shallow copy of its items
        for module in model.modules():
            if type(module).__module__.startswith(_NOT_THE_SCRIPTS):
                continue
            start: dict[str, Any] = {}
            for name, value in vars(module).items():
                if name in _MODULE_INTERNALS:
                    continue
                if isinstance(value, _CONTAINERS):
                    if _of_tensors(value):
                        start[name] = value
                        self._contents[id(value)] = copy.copy(value)
                elif isinstance(value, _SCALARS) or _is_tensors(value):
                    start[name] = value
            self._start.append((module, start, frozenset(vars(module))))

    def restore(self) -> None:
        """Each module's attributes as they were at the start (see the class)."""
        for module, start, names in self._start:
            attributes = vars(module)
            added = [
                name
                for name, value in attributes.items()
                if name not in names and name not in _MODULE_INTERNALS and _restorable(value)
            ]
            tensors_added = any(not isinstance(attributes[name], _SCALARS) for name in added)
            if not tensors_added and not any(
                self._moved(attributes, name, value) for name, value in start.items()
            ):
                continue  # its numbers too: a counter alone is the module's own business
            for name in added:
                del attributes[name]
            for name, value in start.items():
                saved = self._contents.get(id(value))
                if saved is not None and not _same_contents(value, saved):
                    _put_back(value, saved)
                attributes[name] = value

    def _moved(self, attributes: dict[str, Any], name: str, value: Any) -> bool:
        """Whether a tensor, ``None`` or container attribute is not as it was at the start, or
        a number is now something else (transformers' dynamic RoPE: ``max_seq_len_cached``
        becomes a tensor as it grows its cache)."""
        if isinstance(value, _SCALARS) and value is not None:
            return not isinstance(attributes.get(name, value), _SCALARS)
        if attributes.get(name, _MISSING) is not value:
            return True
        saved = self._contents.get(id(value))
        return saved is not None and not _same_contents(value, saved)


class SavedState:
    """A host-memory copy of a model's and optimizer's state, restorable bit for bit.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> saved = SavedState(model)
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(1)
        >>> saved.restore()
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._tensors = {
            name: t.detach().to("cpu", copy=True)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        }
        self._grads = {
            name: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
            for name, p in model.named_parameters()
        }
        self._training = {name: m.training for name, m in model.named_modules()}
        # (sweep CN: a train_step that unfreezes a backbone at its 5th call left it trainable)
        self._requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
        self._attributes = ModuleAttributes(model)
        self._optimizer_state = None if optimizer is None else _to_host(optimizer.state_dict())
        self._stateful = _stateful_states(optimizer)  # schedulers, gradient scalers
        self._rng = rng_state()
        self.kept_as_made: list[str] = []
        """Buffers :meth:`restore` left as the model remade them (another shape or dtype)."""

    def reset_optimizer(self) -> None:
        """Put the optimizer's state back (cheap when it was empty, the usual case), and the
        gradient scalers' (:meth:`reset_scalers`). Existing state tensors are written in place: a
        reference the user holds to them (a checkpoint dict, a list of momentum buffers)
        stays true and keeps no second copy alive."""
        optimizer, saved = self.optimizer, self._optimizer_state
        if optimizer is None or saved is None:
            return
        if not saved["state"]:
            optimizer.state.clear()
            optimizer.load_state_dict(saved)
        elif not _restore_in_place(optimizer, saved):
            optimizer.load_state_dict(copy.deepcopy(saved))
        self.reset_scalers()

    def reset_attributes(self) -> None:
        """Put the modules' plain attributes back (:class:`ModuleAttributes`): each trial
        starts from them, not from what the previous trial's steps appended."""
        self._attributes.restore()

    def reset_scalers(self) -> None:
        """Put the gradient scalers' scale and per-optimizer stages back (:data:`_STAGES`):
        each trial starts from them, as does the step run after an out-of-memory error."""
        for obj, state in self._stateful:
            if _STAGES in state:
                _load(obj, state)

    def restore(self) -> None:
        """Copy everything back into the live objects.

        A buffer (or, rarer, a parameter) the model replaced by one of another shape or dtype
        (a rotary embedding's cos/sin cache grown to a longer sequence, with the length it now
        covers in a plain attribute) is left as the model made it, consistent with its
        attributes; its name is added to :attr:`kept_as_made`."""
        tensors = dict([*self.model.named_parameters(), *self.model.named_buffers()])
        with torch.no_grad():
            for name, saved in self._tensors.items():
                live = tensors.get(name)
                if live is None:
                    continue
                if live.shape != saved.shape or live.dtype != saved.dtype:
                    if name not in self.kept_as_made:
                        self.kept_as_made.append(name)
                    continue
                live.copy_(saved)
        for name, param in self.model.named_parameters():
            grad = self._grads.get(name)
            param.grad = None if grad is None else grad.to(param.device)
            flag = self._requires_grad.get(name)
            if flag is not None and param.requires_grad != flag:
                param.requires_grad_(flag)
        for name, module in self.model.named_modules():
            if name in self._training:
                module.training = self._training[name]
        self.reset_attributes()
        self.reset_optimizer()
        for obj, state in self._stateful:  # after the optimizer: its lr is the schedulers'
            if _STAGES not in state:  # (the scalers: put back with the optimizer just now)
                _load(obj, state)
        restore_rng_state(self._rng)
