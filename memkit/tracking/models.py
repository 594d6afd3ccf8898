"""The models and optimizers a tracker follows: those given to ``track()``, else those found
running (global hooks), with the module keys of each model and whether one is compiled.

Torch only for the types; nothing here reads memory.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memkit.errors import ConfigError, found
from memkit.optimizers import unwrap_optimizer
from memkit.simulated.eager import is_compiled
from memkit.tracking.fsdp import user_class_name, wrapped_module
from memkit.tracking.records import RootInfo

__all__ = ["TrackedModels", "forward_autocast", "is_compiled"]

_UNREAD = object()
"""Not in :meth:`TrackedModels.forward_autocast`'s cache yet."""

ModelFound = Callable[[torch.nn.Module, bool], None]
"""Called with a model seen running for the first time, and whether that made the tracking
compiled (it was the first compiled model)."""


def _checked_model(model: Any) -> torch.nn.Module | None:
    """``model`` if it is a module or ``None``; otherwise what to pass instead."""
    if model is None or isinstance(model, torch.nn.Module):
        return model
    if isinstance(model, (list, tuple)) and all(isinstance(m, torch.nn.Module) for m in model):
        raise ConfigError(
            f"model: memkit.track follows one model, found a {type(model).__name__} of "
            f"{len(model)} modules. For several models (a GAN's generator and discriminator), "
            "leave model out: every model that runs a forward in the block is tracked, e.g. "
            "memkit.track(optimizer=[opt_g, opt_d])"
        )
    raise ConfigError(
        f"model: expected the torch.nn.Module you train (or None: every model that runs), "
        f"found {found(model)}"
    )


def _checked_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers given, as a list; an error naming what is not an optimizer."""
    if optimizer is None:
        return []
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for item in optimizers:
        if not (hasattr(item, "param_groups") and callable(getattr(item, "step", None))):
            raise ConfigError(
                "optimizer: expected a torch.optim.Optimizer, a list of them, or None (every "
                f"optimizer that steps), found {found(item)}"
            )
    # the one that steps: torch's step hooks see a wrapper's inner optimizer (sweep BK:
    # Fabric's and accelerate's, given, made its first step a replacement's: 2 steps of 3)
    return [unwrap_optimizer(item) or item for item in optimizers]


def _param_ids(optimizer: Any) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def replaces(optimizer: Any, others: Sequence[Any]) -> bool:
    """Whether ``optimizer`` holds every parameter of one of ``others`` (an optimizer a script
    made anew over its model's parameters, when the model grew or a range test reset it)."""
    held = _param_ids(optimizer)
    return any(_param_ids(o) <= held for o in others)


class TrackedModels:
    """The tracked models and optimizers, and the top-level modules seen running a forward.

    Args:
        model: the model given to ``track()``, or ``None`` (every model found running).
        optimizer: an optimizer, several, or ``None`` (every optimizer seen stepping).
        lock: the tracker's lock (replica threads meet a new model at the same time).

    Attributes:
        roots: ``id(module)`` -> what is known of each top-level module seen.
        owners: ``id(submodule)`` -> the model it belongs to.
        seen_optimizers: ``id(optimizer)`` -> a weak reference to each optimizer seen stepping.
        compiled: a ``torch.compile``'d model is tracked: no module hooks inside it.
        on_model: told of each model found running (the tracker wires the other parts to it).
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        lock: threading.RLock,
    ) -> None:
        checked, optimizers = _checked_model(model), _checked_optimizers(optimizer)
        self._model_ref = None if checked is None else weakref.ref(checked)
        # weakly, in the block too: a script that replaces its optimizer (a model grown,
        # an LR range test restored) frees the old one and its state, with memkit as without
        self._optimizer_refs = [weakref.ref(o) for o in optimizers]
        # id of a counted optimizer -> it, and the backward passes when it last stepped
        self._stepped: dict[int, tuple[weakref.ref[Any], int]] = {}
        # optimizers that may replace a given one: the backward passes at their last step
        self._pending: dict[int, tuple[weakref.ref[Any], int]] = {}
        # optimizers that replace none given, and whether any given one was alive then
        self._foreign: dict[int, tuple[weakref.ref[Any], bool]] = {}
        self.roots: dict[int, RootInfo] = {}
        self.owners: dict[int, RootInfo] = {}
        self.seen_optimizers: dict[int, weakref.ref[Any]] = {}
        self.optimizers_seen = 0  # how many were first seen (an id reused counts anew)
        # id -> the optimizer that began a step, and the last step it did (stepping())
        self._stepping: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._in_frames: list[weakref.ref[Any]] = []  # found_in_frames
        # DDP models that wrap a tracked model (their forward called it): their buckets
        self._ddp_wrappers: dict[int, weakref.ref[torch.nn.Module]] = {}
        self.compiled = False
        # compiled code runs eagerly here (the simulated device): module hooks break no graph
        self.eager = False
        self.on_model: ModelFound | None = None
        self._lock = lock
        # forward function -> forward_autocast's answer (its wrapper chain is made once)
        self._autocast: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._last_autocast: tuple[weakref.ref[Any], str | None] | None = None
        self._frozen: dict[tuple[int, int], tuple[str, int, int] | None] = {}
        self._versions: dict[int, int] = {}  # a frozen model's first parameter's _version
        self._updated: set[int] = set()  # frozen models seen written in place (an EMA)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model given to ``track()`` (``None``: none given, or freed since). Held weakly,
        as the optimizers are: a tracker kept for its report (a notebook's ``tracker``) keeps
        none of them alive after ``del`` (the report reads them while they live, else what it
        remembered)."""
        ref = self._model_ref
        return None if ref is None else ref()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers given to ``track()`` that are still alive."""
        return [o for o in (r() for r in self._optimizer_refs) if o is not None]

    def counts(self, optimizer: Any, passes: int, begins: bool = True) -> bool:
        """Whether ``optimizer``'s steps are the block's (``passes``: the backward passes in
        the block so far): any optimizer's where none was given; else a given one's, or one's
        that replaced them: over the parameters of one given (and more: made anew after the
        model grew) that did not step between two of its steps (an old one a scheduler still
        holds steps no more; one over a part of them, stepping beside it, stays), from its
        second step on; or, given none still alive, one over parameters of the model given (a
        GAN's generator optimizer made anew, not its discriminator's). A replacement takes
        place where a step ``begins`` (its pre-hook), never at its end alone (a closure's
        backward between the two is no step of the given one's missed)."""
        if not self._optimizer_refs:
            return True
        key = id(optimizer)
        stepped = self._stepped.get(key)
        if stepped is not None and stepped[0]() is optimizer:  # a counted one (each step)
            if begins:  # (where its step begins: a closure's backward comes after)
                self._stepped[key] = (stepped[0], passes)
            return True
        foreign = self._foreign.get(key)
        if foreign is not None and foreign[0]() is optimizer and foreign[1] == self._alive():
            return False  # another model's (a GAN's other optimizer), as found before
        given = self.optimizers
        if any(o is optimizer for o in given):
            self._stepped[key] = (weakref.ref(optimizer), passes)
            return True
        if not self._takes_over(optimizer, given):
            if len(self._foreign) > 64:
                self._foreign.clear()
            self._foreign[key] = (weakref.ref(optimizer), bool(given))  # while that holds
            return False
        if given:  # it replaces one that stopped: none stepped between two of its steps
            if not begins:
                return False
            pending = self._pending.get(key)
            self._pending[key] = (weakref.ref(optimizer), passes)
            if pending is None or pending[0]() is not optimizer or pending[1] == passes:
                return False  # (the first seen: a step of its own, no other between yet)
            idle = [o for o in given if self._last_step(o) < pending[1]]
            if not replaces(optimizer, idle):
                return False
        else:
            idle = []
        kept = [o for o in given if o not in idle or not replaces(optimizer, [o])]
        self._optimizer_refs = [weakref.ref(o) for o in (*kept, optimizer)]
        self._stepped = {id(o): (weakref.ref(o), self._last_step(o)) for o in kept}
        self._stepped[key] = (weakref.ref(optimizer), passes)
        self._foreign.clear()  # (found against the optimizers replaced)
        self._pending.clear()
        return True

    def _alive(self) -> bool:
        """Whether a given optimizer is alive."""
        return any(ref() is not None for ref in self._optimizer_refs)

    def _takes_over(self, optimizer: Any, given: list[Any]) -> bool:
        """Whether ``optimizer`` may ever replace the given optimizers: it holds every
        parameter of one of them; with none alive, some parameter of the model given."""
        if given:
            return replaces(optimizer, given)
        model = self.model
        if model is None:
            return True
        held = _param_ids(optimizer)
        return any(id(p) in held for p in model.parameters())

    def _last_step(self, optimizer: Any) -> int:
        """The backward passes when ``optimizer`` (a counted one) last stepped; -1: never."""
        stepped = self._stepped.get(id(optimizer))
        return -1 if stepped is None or stepped[0]() is not optimizer else stepped[1]

    def root_modules(self) -> list[torch.nn.Module]:
        """The model given to track(), or else the outermost modules seen running a forward."""
        model = self.model
        if model is not None:
            return [model]
        out = []
        for root in self.roots.values():
            mod = root.ref()
            if mod is not None and root.model:
                out.append(mod)
        return out

    def all_optimizers(self) -> list[Any]:
        """The optimizers given, or else those seen stepping that are still alive, or else
        those an OOM's frames held before any stepped (:meth:`found_in_frames`)."""
        optimizers = self.optimizers
        if optimizers:
            return list(optimizers)
        seen = [o for o in (r() for r in self.seen_optimizers.values()) if o is not None]
        return seen or [o for o in (r() for r in self._in_frames) if o is not None]

    def may_succeed(self, optimizer: Any, owner: Any, owner_since: int) -> bool:
        """Whether ``optimizer``, first seen stepping beside the steps' ``owner`` (its steps
        counted since ``owner_since`` backward passes), may take its place: it steps part of the
        owner's parameters (a warm-up over all, then the head alone), or a model first seen
        after the owner began (a k-fold run's next model). Not another model trained from the
        start beside it (a GAN's, an actor-critic's, SAC's temperature): its steps interleave
        with the owner's even where it steps several times in a row."""
        held = _param_ids(optimizer)
        if held <= _param_ids(owner):
            return True
        for root in list(self.roots.values()):
            module = root.ref()
            if module is None or root.first_pass is None or root.first_pass <= owner_since:
                continue
            if any(id(p) in held for p in module.parameters()):
                return True
        return False

    def optimizes(self, module: torch.nn.Module) -> bool:
        """Whether an optimizer known (given, or seen stepping) holds ``module``'s first
        parameter."""
        first = next(module.parameters(), None)
        refs = [*self._optimizer_refs, *self.seen_optimizers.values()]
        return first is not None and any(
            o is not None and id(first) in _param_ids(o) for o in (r() for r in refs)
        )

    def stepping(self, optimizer: Any, step: int) -> None:
        """``optimizer`` (any, counted or not) begins a step in step ``step`` (:meth:`stepped`)."""
        entry = self._stepping.get(id(optimizer))
        if entry is not None and entry[0]() is optimizer:
            self._stepping[id(optimizer)] = (entry[0], step)
            return
        if len(self._stepping) > 64:  # (the dead ones' entries)
            self._stepping = {k: v for k, v in self._stepping.items() if v[0]() is not None}
        self._stepping[id(optimizer)] = (weakref.ref(optimizer), step)

    def stepped(self, since: int) -> list[Any]:
        """The optimizers alive that began a step in step ``since`` or later."""
        return [o for ref, s in self._stepping.values() if s >= since and (o := ref()) is not None]

    def wrapped_by(self, ddp: torch.nn.Module) -> None:
        """``ddp`` (a DDP model) wraps a tracked model: its gradient buckets count."""
        self._ddp_wrappers[id(ddp)] = weakref.ref(ddp)

    def ddp_wrappers(self) -> list[torch.nn.Module]:
        """The DDP models seen wrapping a tracked model, still alive."""
        return [m for m in (r() for r in self._ddp_wrappers.values()) if m is not None]

    def found_in_frames(self, optimizers: list[Any]) -> None:
        """Optimizers found in the user's frames while none is known (an OOM in step 0's
        forward, under ``memkit run``): the post-mortem counts the state they will hold."""
        self._in_frames = [weakref.ref(o) for o in optimizers]

    def see_optimizer(self, optimizer: Any) -> bool:
        """Note an optimizer stepping; whether it is the first time (an optimizer made where a
        freed one was has its id: a new one)."""
        ref = self.seen_optimizers.get(id(optimizer))
        if ref is not None and ref() is optimizer:
            return False
        self.seen_optimizers[id(optimizer)] = weakref.ref(optimizer)
        self.optimizers_seen += 1
        return True

    def frozen_model(
        self, module: torch.nn.Module, root: RootInfo
    ) -> tuple[str, int, bool, int] | None:
        """``(name, parameter bytes, updated, bf16 saving)`` of ``module``, a model running an
        evaluation pass, if no optimizer trains it (a distillation teacher, a DPO reference model
        run on each training batch), else ``None`` (the trained model's validation). Before an
        optimizer is known, a model none of whose parameters requires grad. ``updated``: its
        parameters were written in place between its passes (an EMA or mean teacher, updated
        from the trained model: its outputs cannot be computed once, offline). Read once per
        model and number of parameters the optimizers known hold (``add_param_group``); the
        in-place writes by the first parameter's version counter, at every pass. ``bf16
        saving``: what holding it in bf16 frees of its parameters (those wider than 2 bytes
        a value; 0 for a model held in bf16 already)."""
        updated = self._updated_in_place(module)  # at every pass, frozen or not (yet)
        optimizers = self.all_optimizers()
        key = (id(module), sum(len(g["params"]) for o in optimizers for g in o.param_groups))
        if key in self._frozen:
            found = self._frozen[key]
        else:
            params = list(module.parameters())
            if not params:  # no model (a trained one's parameterless part called on its own:
                frozen = False  # a positional encoding in a greedy decode)
            elif optimizers:
                trained = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
                frozen = not any(id(p) in trained for p in params)
            else:
                frozen = not any(p.requires_grad for p in params)
            size = sum(p.numel() * p.element_size() for p in params)
            wide = sum(
                p.numel() * (p.element_size() - 2)
                for p in params
                if p.is_floating_point() and p.element_size() > 2
            )
            name = root.keys.get(id(module)) or type(module).__name__
            found = (name, size, wide) if frozen else None
            if len(self._frozen) > 256:
                self._frozen.clear()
            self._frozen[key] = found
        return None if found is None else (found[0], found[1], updated, found[2])

    def _updated_in_place(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s first parameter was written in place since an earlier pass
        (once seen, for good)."""
        param = next(module.parameters(), None)
        if param is None:
            return False
        version, last = param._version, self._versions.get(id(module))
        if len(self._versions) > 256:
            self._versions.clear()
        self._versions[id(module)] = version
        if last is not None and last != version:
            self._updated.add(id(module))
        return id(module) in self._updated

    def forward_autocast(self, module: torch.nn.Module) -> str | None:
        """:func:`forward_autocast` of ``module``, read once per ``forward`` function: a
        wrapper chain is built once (accelerate replaces ``forward``: a new function, read
        anew), and walking it is the costliest part of a training forward's first hook."""
        fn = module.__dict__.get("forward") or getattr(type(module), "forward", None)
        last = self._last_autocast  # the usual case: the same forward as last time
        if last is not None and fn is not None and last[0]() is fn:
            return last[1]
        try:
            cached = self._autocast.get(fn, _UNREAD)
            found = forward_autocast(module) if cached is _UNREAD else cached
            if cached is _UNREAD:
                self._autocast[fn] = found
            self._last_autocast = (weakref.ref(fn), found)
            return found
        except TypeError:  # a forward that takes no weak reference: read it every time
            return forward_autocast(module)

    def root_info(self, module: torch.nn.Module) -> RootInfo:
        """The model ``module`` heads: its module keys (``GPT.transformer.h.0``), seen once."""
        entry = self.roots.get(id(module))
        if entry is not None and entry.ref() is module:
            return entry
        with self._lock:  # replica threads (DataParallel) meet new roots at the same time
            return self._new_root(module)

    def _distinct(self, name: str, module: torch.nn.Module) -> str:
        """``name``, or ``name#2``, ``name#3``... while other models of the class are alive (a
        PPO agent's actor and critic, both ``Sequential``). A model re-created after its
        predecessor died, and DataParallel's replicas, share the name: their rows add up."""
        if getattr(module, "_is_replica", False):
            return name
        taken = set()
        for root in self.roots.values():
            other = root.ref()
            if other is not None and other is not module and root.model and root.keys:
                taken.add(root.keys.get(id(other)))
        if name not in taken:
            return name
        return next(f"{name}#{n}" for n in range(2, len(taken) + 3) if f"{name}#{n}" not in taken)

    def key_of(self, root: RootInfo, module: torch.nn.Module, step: int) -> str | None:
        """``module``'s key in ``root``'s model, also for a module added to it since its keys
        were made (a block a growing model appended: the model is walked again, once a step
        at most); ``""`` when it is not the model's (a module made inside a forward)."""
        key = root.keys.get(id(module), "")
        if key == "" and root.walked_step != step:
            root.walked_step = step
            self.rewalk(root)
            key = root.keys.get(id(module), "")
        return key

    def rewalk(self, root: RootInfo) -> None:
        """``root``'s keys anew from its model as it is now (in place: the hooks hold them): a
        module added since (a grown block) gets its path, and one that left the model (a block
        replaced, whose address a new module may take) loses its own."""
        model = root.ref()
        if model is None:
            return
        with self._lock:
            keys: dict[int, str | None] = {id(model): root.keys.get(id(model))}
            self._walk(model, keys[id(model)] or "", keys)
            for sub_id in root.keys.keys() - keys.keys():
                if self.owners.get(sub_id) is root:
                    del self.owners[sub_id]
            root.keys.clear()
            root.keys.update(keys)
            for sub_id in keys:
                if sub_id != id(model):
                    self.owners[sub_id] = root

    def trained_count(self) -> int:
        """The parameters the optimizers known hold: it changes when a model grows (an
        optimizer made anew, ``add_param_group``)."""
        return sum(len(g["params"]) for o in self.all_optimizers() for g in o.param_groups)

    @staticmethod
    def _walk(module: torch.nn.Module, name: str, keys: dict[int, str | None]) -> None:
        """``keys`` of ``module``'s submodules (``name.path``); the model a wrapper holds (a
        compiled model's, Fabric's: :func:`wrapped_module`) is transparent (``None``)."""
        inner = module
        for _ in range(4):
            target = wrapped_module(inner)
            if target is None:
                break
            inner = target
            keys[id(inner)] = None
        for path, sub in inner.named_modules():
            if path:
                keys[id(sub)] = f"{name}.{path}"

    def _new_root(self, module: torch.nn.Module) -> RootInfo:
        name = self._distinct(user_class_name(module), module)
        keys: dict[int, str | None] = {id(module): name}
        self._walk(module, name, keys)
        if len(self.roots) > 256:
            self.roots = {k: v for k, v in self.roots.items() if v.ref() is not None}
            self.owners = {k: v for k, v in self.owners.items() if v.ref() is not None}
        root = RootInfo(module, keys)
        self.roots[id(module)] = root
        if not root.model:
            return root
        # module hooks inside a compiled graph would break it or make TorchDynamo recompile:
        # from now on, hooks on the models alone (steps and phases stay exact); another model
        # found beside a given one (a compiled teacher) changes nothing of the given one's
        newly_compiled = (
            self.model is None and not self.compiled and not self.eager and is_compiled(module)
        )
        if newly_compiled:
            self.compiled = True
        for sub_id in keys:
            if sub_id != id(module):
                self.owners[sub_id] = root
        if self.on_model is not None:
            self.on_model(module, newly_compiled)
        return root


def forward_autocast(module: torch.nn.Module) -> str | None:
    """The dtype (``"bfloat16"``) of a ``torch.autocast`` that wraps ``module``'s ``forward``
    attribute itself, else ``None``.

    accelerate's mixed precision replaces ``model.forward`` with ``convert_outputs_to_fp32(
    autocast(forward))``; ``@torch.autocast(...)`` on a ``forward`` is the same. Such an
    autocast is entered inside the call, after the forward pre-hooks, so a hook never sees it
    on: this reads the wrapper chain instead (``__wrapped__``, ``model_forward``, ``__func__``
    and the closures' autocast instances). Lightning Fabric's ``_FabricModule`` enters its
    precision's autocast inside its ``forward`` too: its ``precision="bf16-mixed"`` says so
    (sweep BK: the mixed-precision advice told a bf16-mixed run to add autocast).
    """
    if type(module).__name__ == "_FabricModule":
        precision = getattr(module.__dict__.get("_strategy"), "precision", None)
        mode = getattr(precision, "precision", None)
        # (the plugins that enter torch.autocast in forward_context; DeepSpeed's does not)
        autocasts = type(precision).__name__ in ("MixedPrecision", "FSDPPrecision")
        if autocasts and isinstance(mode, str) and mode.endswith("-mixed"):
            return "bfloat16" if mode.startswith("bf16") else "float16"
    autocast_type = getattr(torch.amp, "autocast", None)
    if autocast_type is None:
        return None
    fn: Any = module.__dict__.get("forward") or getattr(type(module), "forward", None)
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen and len(seen) < 16:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, autocast_type) and getattr(value, "_enabled", True):
                dtype = getattr(value, "fast_dtype", None)
                return None if dtype is None else str(dtype).replace("torch.", "")
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)
    return None
