"""The default training and inference steps, and what they do with a user's batch.

Default step: call the model by the batch's type (tensor: ``model(b)``, tuple/list:
``model(*b)``, dict: ``model(**b)``); loss = ``loss_fn(output, batch)`` if given, else
``output.loss`` if present (transformers models), else the output if it is a scalar, else the
sum of every floating-point tensor in the output; backward; optimizer step;
``zero_grad(set_to_none=True)``. Inference runs the forward (or the model file's
``eval_step(model, batch)``, never ``train_step``) under ``torch.no_grad()``: it allocates what
``torch.inference_mode()`` does on a GPU, and on the simulated device the temporaries inside
composite ops (``cross_entropy``'s log-probabilities) reach the counting mode only outside
inference mode, whose dispatch skips the keys where they decompose.

Like a training loop's ``out = model(x)`` (or nanoGPT's ``logits, loss = model(X, Y)``), the
step keeps the model's output alive through backward and the optimizer step, until the next
step's forward has returned: a loop's variable is only rebound then. So the second step of a
trial holds the first step's output during its forward, as every real loop does.

With gradient accumulation (``StepPlan(accumulation=k)``, ``k >= 2``) an optimizer step is
``k`` micro-batches: forward, ``loss / k``, backward each, and ``optimizer.step()`` and
``zero_grad(set_to_none=True)`` after the last. The gradients of micro-batch 1 stay alive
through the forwards of micro-batches 2..k (with the previous micro-batch's output, as in
transformers' ``run_clm_no_trainer.py``), which a step that frees them before every forward
never holds. Micro-batches 2..k hold the same memory, so the runner runs two micro-batches per
optimizer step (:attr:`StepPlan.micro_batches`). A ``train_step`` is called once per
micro-batch with an optimizer whose ``step()`` and ``zero_grad()`` act on the last only
(:class:`DeferredOptimizer`).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memkit.errors import ConfigError, ModelFileError
from memkit.patching import Restore

__all__ = [
    "DeferredOptimizer",
    "StepFn",
    "StepPlan",
    "batch_leading_dims",
    "batch_shapes",
    "call_model",
    "check_batch",
    "check_batch_grows",
    "resolve_loss",
    "to_device",
]

StepFn = Callable[[torch.nn.Module, Any, Any], None]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a tensor / tuple / list / dict batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """Call the model the way the batch's type suggests: a mapping as keyword arguments, a
    tuple or list as positional ones, except that an ``(inputs, labels)`` tuple goes in as
    ``model(inputs)`` when ``forward`` takes exactly one argument (the labels are the loss's,
    :func:`resolve_loss` gets the whole batch). A list stays positional arguments."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple) and len(batch) > 1 and takes_one_input(model):
        return model(batch[0])
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def takes_one_input(model: torch.nn.Module) -> bool:
    """Whether the model's ``forward`` takes exactly one positional argument; through
    ``torch.compile``'s, DataParallel's and DistributedDataParallel's wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, _PARALLEL):
            inner = model.module
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    forward = type(model).forward
    known = _ONE_INPUT.get(forward)
    if known is None:
        try:
            params = list(inspect.signature(forward).parameters.values())[1:]  # after self
        except (TypeError, ValueError):  # a builtin or a wrapper without a signature
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
        known = _ONE_INPUT[forward] = len(positional) == 1 and not variadic
    return known


_PARALLEL = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
_ONE_INPUT: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""``forward`` function -> :func:`takes_one_input`'s answer."""


def _float_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() or output.is_complex() else []
    if isinstance(output, Mapping):
        values: Any = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        return []
    return [t for v in values for t in _float_tensors(v)]


def resolve_loss(
    output: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None
) -> tuple[torch.Tensor, str]:
    """The loss to backpropagate, and which rule produced it (for the report)."""
    if loss_fn is not None:
        return loss_fn(output, batch), "loss_fn(output, batch)"
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, "output.loss"
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(()), "the scalar output"
    tensors = [t for t in _float_tensors(output) if t.requires_grad]
    if not tensors:
        raise ModelFileError(
            "cannot derive a loss: the model's output has no .loss, is not a scalar and holds "
            f"no floating-point tensor that requires grad (found {type(output).__name__}); "
            "define loss_fn(output, batch) in the model file"
        )
    total = tensors[0].sum()
    for t in tensors[1:]:
        total = total + t.sum()
    return total, "sum of the output"


class DeferredOptimizer:
    """An optimizer whose ``step()`` and ``zero_grad()`` do nothing until ``active`` (the last
    micro-batch of an accumulating step); ``step(closure)`` still runs the closure (the
    forward and backward inside it). Everything else is the optimizer's."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self.active = False

    @property
    def wrapped(self) -> Any:
        """The optimizer itself (its ``zero_grad()`` acts on every micro-batch)."""
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.active:
            return self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.active:
            self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


@contextlib.contextmanager
def inference_mode_as_no_grad(on: bool = True) -> Iterator[None]:
    """``torch.inference_mode()`` entered in the block (``on``; in this thread) runs as the
    ``no_grad`` around it: under inference mode composite ops reach a dispatch mode whole
    (``cross_entropy``, ``linear``), so the simulated device missed their intermediates and
    the estimate their kernels' workspaces (sweep BL: a scoring step answered 32 where 21
    fit). For counting op by op only: on a GPU inference mode is left as written (autocast
    caches no casts under it, and an inference tensor made outside may be written in it;
    review)."""
    if not on:
        yield
        return
    cls = torch.autograd.grad_mode.inference_mode
    thread = threading.get_ident()

    def __enter__(self: Any) -> None:
        # (its __exit__ exits this; InferenceMode(False) would turn autograd on)
        live = handle.live and self.mode and threading.get_ident() == thread
        guard = torch.no_grad() if live else torch._C._InferenceMode(self.mode)
        self._inference_mode_context = guard
        self._inference_mode_context.__enter__()

    handle = Restore(cls, "__enter__", cls.__enter__, __enter__)
    cls.__enter__ = __enter__  # type: ignore[method-assign]
    try:
        yield
    finally:
        handle.remove()


@dataclass
class StepPlan:
    """The step a probe runs, and the description of each default it used.

    ``accumulation``: micro-batches per optimizer step in the script (1: none).
    ``keep_output``: the default step keeps the model's output as a loop's ``out = model(x)``
    does (until the next forward has returned); ``False``: as ``loss = model(x).loss``, the
    output is dropped once the loss is taken (transformers' ``Trainer``).
    ``eval_step``: ``eval_step(model, batch)`` replacing the inference step's forward (run
    under ``torch.no_grad()``, its return value held as the output is, as ``out =
    eval_step(model, batch)`` in a loop holds it); ``train_step`` is training's only, its
    return value held the same way. ``counted_per_op``: memory is counted op by op (the
    simulated device): an ``eval_step``'s own ``torch.inference_mode()`` runs as ``no_grad``
    (:func:`inference_mode_as_no_grad`); on a GPU it runs as written.
    """

    mode: str
    loss_fn: Callable[[Any, Any], Any] | None = None
    train_step: Callable[[Any, Any, Any], Any] | None = None
    eval_step: Callable[[Any, Any], Any] | None = None
    step_label: str | None = None
    accumulation: int = 1
    keep_output: bool = True
    counted_per_op: bool = False
    prefetch: bool = False
    loss_rule: str | None = field(default=None, init=False)
    _kept: Any = field(default=None, init=False, repr=False)
    _kept_loss: Any = field(default=None, init=False, repr=False)

    @property
    def micro_batches(self) -> int:
        """Micro-batches the probe runs per optimizer step: 1, or 2 when accumulating
        (micro-batches 2..k hold the same memory)."""
        return 1 if self.mode == "infer" or self.accumulation < 2 else 2

    @property
    def name(self) -> str:
        """``"training step"`` or ``"evaluation step"``: what an error names."""
        return "evaluation step" if self.mode == "infer" else "training step"

    @property
    def user_step(self) -> str | None:
        """The name of the model file's function this mode runs (``train_step``,
        ``eval_step``), or ``None`` for the default step."""
        if self.mode == "infer":
            return None if self.eval_step is None else "eval_step"
        return None if self.train_step is None else "train_step"

    def __call__(
        self, model: torch.nn.Module, batch: Any, optimizer: Any, *, last: bool = True
    ) -> None:
        """One micro-batch; ``last``: the one that ends an optimizer step."""
        if self.mode == "infer":
            with torch.no_grad():
                if self.eval_step is not None:
                    # `out = eval_step(model, batch)` in a loop: the last result lives until
                    # this one returns (a generate()'s tokens and scores)
                    with inference_mode_as_no_grad(self.counted_per_op):
                        self._kept = self.eval_step(model, batch)
                    return
                output = call_model(model, batch)
                # the previous output lived until this forward returned
                self._kept = output if self.keep_output else None
                if self.loss_fn is not None:  # an eval loop's `test_loss += loss_fn(...).item()`
                    self.loss_fn(output, batch)
            return
        if self.train_step is not None:
            # `out = train_step(model, batch, optimizer)` in a loop: the last result lives
            # until this one returns (a step returning its output with the loss)
            if self.micro_batches == 1:
                self._kept = self.train_step(model, batch, optimizer)
                return
            deferred = DeferredOptimizer(optimizer)
            deferred.active = last
            self._kept = self.train_step(model, batch, deferred)
            return
        output = call_model(model, batch)
        self._kept = None  # `out = model(x)` rebinds the loop's variable only now
        loss, self.loss_rule = resolve_loss(output, batch, self.loss_fn)
        if not self.keep_output:
            output = None  # `loss = model(x).loss`: nothing else of the output is held
        if self.accumulation > 1:
            loss = loss / self.accumulation
        self._kept_loss = None  # and `loss = ...` now: a loop's loss lives through the step
        loss.backward()
        if last:
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        self._kept, self._kept_loss = output, loss

    @property
    def kept(self) -> Any:
        """The output (and loss) held from the last step (``None`` between trials)."""
        return self._kept if self._kept_loss is None else (self._kept, self._kept_loss)

    def hold(self, output: Any) -> None:
        """Hold ``output`` as if a previous step had returned it (estimates prime with it)."""
        self._kept = output

    def release(self) -> None:
        """Drop the output and loss kept from the last step (a trial is over: the loop has
        ended)."""
        self._kept = self._kept_loss = None

    def describe(self) -> list[str]:
        """Lines such as ``"step: default (forward, loss, backward, optimizer.step)"``."""
        kept = "kept: the model's output, until the next step's forward returns (`out = model(x)`)"
        if not self.keep_output:
            kept = "kept: the loss only (`loss = model(x).loss`): the output is dropped once "
            kept += "the loss is taken" if self.mode == "train" else "it returns"
        if self.mode == "infer":
            if self.eval_step is not None:
                return [
                    "step: eval_step(model, batch) under torch.no_grad() (evaluation; what it "
                    "returns is held until the next call returns, as `out = eval_step(model, "
                    "batch)` in a loop holds it)"
                ]
            ignored = (
                "; train_step is training's, not run here: an eval_step(model, batch) "
                "runs your evaluation instead"
                if self.train_step is not None
                else ""
            )
            if self.loss_fn is not None:
                return [
                    "step: forward and loss_fn(output, batch) under torch.no_grad() "
                    f"(evaluation, as a test loop takes its loss){ignored}",
                    kept,
                ]
            return [f"step: forward under torch.no_grad() (inference){ignored}", kept]
        accumulating = []
        if self.micro_batches > 1:
            k = self.accumulation
            each = (
                "train_step called for each, its optimizer's step() and zero_grad() acting on "
                "the second only"
                if self.train_step is not None
                else f"loss / {k}"
            )
            accumulating = [
                f"accumulation: gradients accumulated over micro-batches (2 run per optimizer "
                f"step, standing for the {k}: micro-batches 2..{k} hold the same memory; "
                f"{each}): the first's gradients live through the second's forward, as through "
                "every later one's"
            ]
            if self.prefetch:
                accumulating.append(
                    f"prefetch: all {k} micro-batches of an optimizer step are on the device "
                    "before the first runs, and the last step's while the next step's are "
                    "fetched (transformers 5's Trainer: get_batch_samples)"
                )
        elif self.prefetch:
            accumulating = [
                "prefetch: the next batch is made before the last step's is let go, as "
                "`batch = buffer.sample(n)` in a loop does with batches made on the device (a "
                "replay buffer's sample): two batches live at that moment"
            ]
        if self.train_step is not None:
            default = (
                "step: train_step(model, batch, optimizer) from the model file (what it "
                "returns is held until the next call returns, as `out = train_step(...)` in a "
                "loop holds it; what else a loop keeps between calls is not counted)"
            )
            return [self.step_label or default, *accumulating]
        loss = "loss_fn(output, batch)" if self.loss_fn else (self.loss_rule or "derived")
        first = (
            "no forward meets the last step's gradients"
            if self.micro_batches == 1
            else "the first micro-batch's forward meets no gradients, the later ones' meet "
            "those accumulated so far"
        )
        return [
            "step: default (forward, loss, backward, optimizer.step, zero_grad(set_to_none=True)"
            f": {first}; a loop calling zero_grad() after "
            "its forward keeps them through it and fits less: write that as a train_step)",
            f"loss: {loss}" + ("" if self.loss_fn else " (default)"),
            kept + ", and the loss through optimizer.step() (`loss = ...`)",
            *accumulating,
        ]


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors, in a fixed order (tensor, sequence, dict values)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from _tensors(v)


def drawn_lengths(first: Any, second: Any, batch_size: int) -> int | None:
    """The padded length that per-sample lengths reach, where two batches ``make_batch`` drew
    at ``batch_size`` carry such lengths and they differ: a 1-D integer tensor, one value a
    sample, whose largest value is a dimension (8 or more) of a tensor beside it, or (16 or
    more) fits in the longest length axis beside it: any of token ids' (integers), any of
    3-D features' (frames by features, or channels by frames; ``pack_padded_sequence``'s
    lengths beside the padded tokens, or frames padded to a fixed length: sweep CJ; not class
    labels, whose largest may be the batch's size, review 3, or below a tabular batch's 512
    columns, sweep CL, or an image's side; nor a dict batch's ``labels``: review CI, a text
    classifier's 50 classes beside 128 token ids). Memory of packed sequences follows the
    lengths, not the padded shape (sweep CA)."""
    named = first.items() if isinstance(first, Mapping) else ()
    labels = {id(v) for k, v in named if str(k).lower() in _LABEL_KEYS}
    for a, b in zip(_tensors(first), _tensors(second), strict=False):
        if a.dim() != 1 or a.numel() != batch_size or a.shape != b.shape or id(a) in labels:
            continue
        if a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
            continue
        if a.is_meta or b.is_meta or torch.equal(a.cpu(), b.cpu()):
            continue
        top, low = int(a.max()), int(a.min())
        axes = [
            (d, not t.dtype.is_floating_point or t.dim() == 3)
            for t in _tensors(first)
            if t is not a and batch_size in t.shape
            for i, d in enumerate(t.shape)
            if i != t.shape.index(batch_size)
        ]
        if top >= 8 and low >= 0 and top in (d for d, _ in axes):  # (not the batch's size)
            return top
        longest = max((d for d, length in axes if length), default=0)
        if top >= 16 and low >= 0 and top <= longest:
            return longest
    return None


_LABEL_KEYS = frozenset({"label", "labels", "target", "targets", "y", "class", "classes"})
"""A dict batch's keys (lower case) whose tensor holds classes, not lengths."""


def batch_leading_dims(batch: Any) -> list[int]:
    """First-dimension sizes of the batch's tensors (0-d tensors are skipped)."""
    return [t.shape[0] for t in _tensors(batch) if t.dim() > 0]


def batch_shapes(batch: Any) -> list[tuple[int, ...]]:
    """Shapes of the batch's tensors, in a fixed order (tensor, sequence, dict values)."""
    return [tuple(t.shape) for t in _tensors(batch)]


def check_batch(
    batch: Any,
    batch_size: int,
    where: str,
    bigger: Any = None,
    *,
    runs: bool = True,
    varies: bool = False,
) -> str | None:
    """Fail clearly when ``make_batch`` returned something a probe cannot use; return a note
    when the batch dimension is not the first.

    A batch is a tensor, a tuple/list or a dict of tensors. With ``bigger``, the batch made
    for ``batch_size + 1``, the batch dimension is inferred: the one dimension of a tensor that
    grows from ``batch_size`` to ``batch_size + 1`` (dimension 1 for a seq-first ``(seq,
    batch)`` LSTM batch). Without it, a tensor must have ``batch_size`` as its first dimension.
    ``runs``: a step will run on it (the probe), so meta tensors are refused; the estimate's
    own batches are meta. ``varies``: ``make_batch`` draws another shape at every call (random
    lengths, noted elsewhere); else a tensor whose length grows with the batch beside it
    (padded to the longest of its first n samples) is refused, as where no dimension grows.
    """
    if not isinstance(batch, (torch.Tensor, Mapping, tuple, list)):
        raise ModelFileError(
            f"{where} returned {type(batch).__name__}; expected a Tensor, a tuple/list or a "
            "dict of tensors"
        )
    meta = next((t for t in _tensors(batch) if t.is_meta), None) if runs else None
    if meta is not None:
        raise ModelFileError(
            f"{where} returned a tensor on the meta device (shape {tuple(meta.shape)}): it has "
            "no data to run a step on; make real tensors (on the CPU: memkit moves them to "
            "the device)"
        )
    dims = batch_leading_dims(batch)
    if not dims:
        raise ModelFileError(
            f"{where} returned a {type(batch).__name__} with no tensor of dimension >= 1; "
            "expected tensors with a batch dimension"
        )
    batch_dims = _batch_dims(batch, bigger, batch_size) if bigger is not None else {}
    if batch_dims:
        grows = None if varies else _why_no_batch_dim(batch, bigger, batch_size, batch_dims)
        if grows is not None:  # (sweep BI: a label tensor's growth let a padded length by)
            raise ModelFileError(grows)
        return _layout_note(batch_dims, batch_size)
    if bigger is None and batch_size in dims:
        return None
    if bigger is not None and _grown_list(batch, bigger, batch_size):
        return None  # a list of one item per sample (a detection model's images, targets)
    raise ModelFileError(
        _why_no_batch_dim(batch, bigger, batch_size)
        or f"{where} returned tensors with first dimensions {sorted(set(dims))}; expected "
        f"{batch_size} (the batch size) in one dimension of at least one tensor, growing with "
        f"it. {_IGNORES_SIZE}"
    )


def _why_no_batch_dim(
    small: Any, big: Any, batch_size: int, found: dict[int, int] | None = None
) -> str | None:
    """What is wrong when no dimension grows from ``batch_size`` to ``batch_size + 1`` between
    two batches, where it can be told: several dimensions change (a length that varies from
    batch to batch), or the first grows by another step (``batch_size + 1`` rows). With the
    batch dimensions ``found`` in other tensors: only a tensor whose dimensions change, one
    of them not as a batch's (a ``(n, n)`` similarity target grows in both as one)."""
    if big is None:
        return None
    before, after = batch_shapes(small), batch_shapes(big)
    if len(before) != len(after):
        return None
    pairs = [(a, b) for a, b in zip(before, after, strict=True) if len(a) == len(b)]
    made = f"make_batch({batch_size}) and make_batch({batch_size + 1})"

    def as_batch(x: int, y: int) -> bool:
        return x % batch_size == 0 and x // batch_size * (batch_size + 1) == y

    for a, b in pairs:
        changed = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        if found and all(as_batch(a[i], b[i]) for i in changed):
            continue
        if len(changed) > 1:
            return (
                f"{made} returned tensors of shapes {list(a)} and {list(b)}: besides the batch, "
                "another dimension changed (a length padded to the longest sample of each "
                "batch?). A probe compares batch sizes at one shape: pad to a fixed length in "
                "make_batch (the longest your data has: the worst case, which is what must "
                "fit), or give it as seq_len (--seq-len)"
            )
    if found:
        return None
    for a, b in pairs:
        if a and b and b[0] != a[0]:
            return (
                f"{made} returned tensors whose first dimension went from {a[0]} to {b[0]}; "
                f"expected {batch_size} and {batch_size + 1}, or a whole multiple of them (k "
                f"rows per sample: {batch_size * 2} and {(batch_size + 1) * 2} for two views). "
                "make_batch(n) must return n samples. Samples of different sizes concatenated "
                "(a GNN's graphs: nodes and edges of all graphs in one tensor) have no such "
                "dimension: make every sample the same size in make_batch, or probe with "
                "memkit.probe(model, make_batch, ...) in Python, which takes any batch its "
                "step runs"
            )
    return None


def _grown_list(small: Any, big: Any, batch_size: int) -> bool:
    """Whether a list or tuple in the batch holds ``batch_size`` items in ``small`` and one
    more in ``big``, at the same place: a batch of one item per sample (a detection model's
    list of images, of per-image target dicts, whose shapes differ from image to image)."""
    if isinstance(small, Mapping) and isinstance(big, Mapping):
        return any(_grown_list(small[k], big[k], batch_size) for k in small if k in big)
    if isinstance(small, (list, tuple)) and isinstance(big, (list, tuple)):
        if len(small) == batch_size and len(big) == batch_size + 1:  # of items holding tensors
            return all(next(_tensors(item), None) is not None for item in big)
        if len(small) == len(big):
            return any(_grown_list(a, b, batch_size) for a, b in zip(small, big, strict=True))
    return False


_IGNORES_SIZE = "Does make_batch ignore its batch_size argument?"


def check_batch_grows(batch: Any, bigger: Any, batch_size: int, where: str) -> str | None:
    """:func:`check_batch` for batches that need not follow the model-file protocol (the
    Python API's, Lightning's: the step is the caller's, any type may do): fail only when
    ``make_batch`` plainly ignores its batch size, its batches for ``batch_size`` and
    ``batch_size + 1`` holding tensors of the same shapes, where every trial would run the
    same batch; a note when the batch dimension is inferred and is not the first.

    Raises:
        ConfigError: the two batches hold tensors of the same shapes.

    Examples:
        >>> check_batch_grows(torch.zeros(1, 3), torch.zeros(2, 3), 1, "make_batch(1)") is None
        True
        >>> check_batch_grows(torch.zeros(3, 1), torch.zeros(3, 2), 1, "make_batch(1)")
        'batch dimension: 1 (inferred from make_batch(1) and make_batch(2))'
    """
    shapes = batch_shapes(batch)
    if shapes and shapes == batch_shapes(bigger):
        shown = ", ".join(str(list(s)) for s in shapes[:3]) + (", ..." if len(shapes) > 3 else "")
        raise ConfigError(
            f"{where} and make_batch({batch_size + 1}) returned tensors of the same shapes "
            f"({shown}): every trial would run the same batch, so the answer would mean "
            f"nothing. {_IGNORES_SIZE} Make a batch of batch_size samples"
        )
    return _layout_note(_batch_dims(batch, bigger, batch_size), batch_size)


def _layout_note(batch_dims: dict[int, int], batch_size: int) -> str | None:
    """The note for an inferred batch dimension that is not the first, or for k rows per
    sample (``None``: one row per sample in the first dimension)."""
    notes = []
    if batch_dims and set(batch_dims) != {0}:
        notes.append(
            f"batch dimension: {', '.join(str(d) for d in sorted(batch_dims))} (inferred from "
            f"make_batch({batch_size}) and make_batch({batch_size + 1}))"
        )
    rows = max(batch_dims.values(), default=1)
    if rows > 1:
        notes.append(
            f"make_batch(n) returns {rows} rows per sample ({rows}n rows): batch sizes "
            "here count samples, as make_batch's argument does"
        )
    return "; ".join(notes) or None


def _batch_dims(small: Any, big: Any, batch_size: int) -> dict[int, int]:
    """The dimensions that grow from ``batch_size`` to ``batch_size + 1`` between two
    batches, each with its rows per sample (1, or k: two augmented views per sample)."""
    found: dict[int, int] = {}
    before, after = batch_shapes(small), batch_shapes(big)
    if len(before) != len(after):
        return found
    for a, b in zip(before, after, strict=True):
        if len(a) != len(b):
            continue
        grew = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        if len(grew) != 1:
            continue
        x, y = a[grew[0]], b[grew[0]]
        if x % batch_size == 0 and x // batch_size * (batch_size + 1) == y:
            found[grew[0]] = max(found.get(grew[0], 1), x // batch_size)
    return found
