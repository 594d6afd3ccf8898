"""The OOM-proof training step: :class:`MicroBatchStep` and :func:`microbatch` (see
:mod:`memkit.microbatching` for the rules)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard, overload

import torch

from memkit import distributed
from memkit.devices import get_backend, restore_rng_state, rng_state
from memkit.distributed import RankStatus
from memkit.errors import ConfigError, DistributedError, DoesNotFitError
from memkit.microbatching.policy import SplitPolicy, oom_size_bound
from memkit.microbatching.splitting import batch_size_of, chunk_sizes, split_batch
from memkit.oom import OomDetails, is_oom, parse_oom_message, recover
from memkit.results import Record
from memkit.simulated.accountant import active_accountant
from memkit.units import format_size

__all__ = ["MicroBatchStep", "StepInfo", "Weight", "microbatch"]

log = logging.getLogger("memkit.microbatching")


Weight = Callable[[Any], "float | int | torch.Tensor"]


@dataclass(frozen=True)
class StepInfo(Record):
    """What happened to one batch; ``to_dict()`` is JSON-ready (``micro_batch_size`` added).

    Attributes:
        batch_size: samples in the batch (1 when it has no batch dimension).
        chunks: micro-batches in the attempt that stepped.
        chunk_sizes: their sizes.
        attempts: attempts made (1 + retries after OOMs).
        ooms: OOMs on this rank during this batch.
    """

    batch_size: int
    chunks: int
    chunk_sizes: tuple[int, ...]
    attempts: int
    ooms: int

    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch that ran."""
        return self.chunk_sizes[0]

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["micro_batch_size"] = self.micro_batch_size
        return out


def _bare_copy(exc: BaseException) -> BaseException:
    """``exc`` anew, its type and message without its traceback or chain (the frames of a
    failed attempt hold its tensors)."""
    try:
        return type(exc)(*exc.args)
    except Exception:
        return RuntimeError(str(exc))


def _guarded(fn: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``(fn(*args), None)``, or ``(None, exc)``: the caller recovers outside any except."""
    try:
        return fn(*args), None
    except Exception as exc:
        return None, exc


_SEQUENCE_FIRST = (
    torch.nn.RNNBase,
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer,
    torch.nn.Transformer,
)


def _default_batch_dim(model: torch.nn.Module) -> int:
    """0, unless ``model`` has sequence-first layers (``batch_first=False``): then its
    batches may be ``(seq, batch, ...)`` (pytorch/examples' word_language_model), or it may
    transpose batch-first inputs itself; only the user knows."""
    for name, module in model.named_modules():
        if isinstance(module, _SEQUENCE_FIRST) and not getattr(module, "batch_first", True):
            raise ConfigError(
                f"{name or 'the model'} ({type(module).__name__}) takes sequence-first input "
                "(batch_first=False): pass batch_dim=1 to microbatch if your batches are "
                "(seq, batch, ...), or batch_dim=0 if they are batch-first (memkit would "
                "otherwise split them along time, and the gradient would be wrong)"
            )
    return 0


def _put_back(buffers: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    """Undo what a failed attempt's forwards did to the buffers (running statistics)."""
    with torch.no_grad():
        for buffer, copy in zip(buffers, saved, strict=True):
            buffer.copy_(copy)


def _needs_two_samples(exc: BaseException) -> bool:
    """BatchNorm's error for a training batch of one sample."""
    return isinstance(exc, ValueError) and "Expected more than 1 value per channel" in str(exc)


_BACKWARD_DONE = (
    "backward through the graph a second time",  # train_step ran loss.backward() itself
    "does not require grad and does not have a grad_fn",  # ... and returned loss.detach()
)


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()``; torch's bare error for a train_step that ran the backward itself
    (or also ``optimizer.step()``) gets a hint. An OOM passes unchanged (it is retried)."""
    try:
        loss.backward()
    except RuntimeError as exc:
        if is_oom(exc) or not any(text in str(exc) for text in _BACKWARD_DONE):
            raise
        raise ConfigError(
            "memkit could not back-propagate train_step's loss "
            f"({str(exc).splitlines()[0][:120]}): train_step must return the loss (a "
            "tensor with its graph, the mean over its micro-batch) and leave the rest to "
            "memkit, which runs loss.backward() per micro-batch, accumulates, then calls "
            "optimizer.step() and zero_grad() once per batch. Remove loss.backward(), "
            "optimizer.step() and optimizer.zero_grad() from train_step, and return the loss "
            "undetached (not loss.detach() or loss.item()); a loss that does not depend on a "
            "trainable parameter (computed under torch.no_grad()) gives the second error too"
        ) from exc


def _scaled_by(loss: torch.Tensor, scaler: Any) -> bool:
    """Whether ``loss`` is ``scaler.scale(x)``: a product with the scaler's scale tensor."""
    scale = getattr(scaler, "_scale", None)
    node = loss.grad_fn
    if not isinstance(scale, torch.Tensor) or node is None or node.name() != "MulBackward0":
        return False
    other = getattr(node, "_saved_other", None)
    return isinstance(other, torch.Tensor) and other.data_ptr() == scale.data_ptr()


def _refuse_a_scaler_of_its_own(*fns: Callable[..., Any] | None) -> None:
    """A ``train_step`` or ``before_step`` that uses a GradScaler it was not given as
    ``scaler=`` scales the loss memkit back-propagates, or unscales and updates where memkit
    cannot skip the step (sweep BS: NaN parameters): refuse it, saying what works."""
    for fn in fns:
        if fn is None:
            continue
        try:
            found = inspect.getclosurevars(fn)
        except (TypeError, ValueError):  # not a Python function (a callable object, a builtin)
            continue
        names = {**found.globals, **found.nonlocals}
        for name, value in names.items():
            if isinstance(value, torch.amp.GradScaler) and value.is_enabled():
                raise ConfigError(
                    f"{getattr(fn, '__name__', 'a function')} uses the GradScaler {name!r}: "
                    f"pass it as microbatch(..., scaler={name}) and let train_step return the "
                    "unscaled loss. memkit then scales each micro-batch's loss, unscales once "
                    "after accumulation (before before_step, so clipping sees true gradients), "
                    "and calls scaler.step(optimizer) and scaler.update() once per batch: a "
                    "batch with inf/NaN gradients is skipped, as in a plain AMP loop"
                )


ITEM_COUNT_KEY = "num_items_in_batch"
IGNORE_INDEX = -100  # cross_entropy's default ignore_index, transformers' padding label


def _is_label_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    """An integer tensor of labels with at least one dimension (class ids, token ids)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


def _carries_item_count(batch: Any) -> bool:
    """Whether ``batch`` is, or holds, a mapping with a ``num_items_in_batch`` count (an int or
    a tensor: transformers' Trainer convention, the loss is a sum over the batch's items
    divided by that count)."""
    if isinstance(batch, Mapping):
        count = batch.get(ITEM_COUNT_KEY)  # (None: transformers' models then take a mean)
        counted = isinstance(count, (int, torch.Tensor)) and not isinstance(count, bool)
        return counted or any(_carries_item_count(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return any(_carries_item_count(v) for v in batch)
    return False


class MicroBatchStep:
    """A training step that splits a batch into micro-batches when it does not fit.

    Built by :func:`microbatch`; see the module documentation for the rules.

    Attributes:
        policy: the :class:`SplitPolicy` (``policy.micro_size`` is the remembered size).
        steps: batches stepped (one optimizer step each; a batch that a ``scaler`` skips for
            inf/NaN gradients counts too).
        ooms: OOMs recovered from on this rank, over all batches.
        last: the :class:`StepInfo` of the last batch, or ``None``.
    """

    def __init__(
        self,
        train_step: Callable[[Any], torch.Tensor],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        backend: Any = None,
        grow_after: int | None = 50,
        weight: Weight | None = None,
        before_step: Callable[[], Any] | None = None,
        scaler: Any = None,
        timeout: float | None = None,
        restore_buffers: str = "norm",
        batch_dim: int | None = None,
    ) -> None:
        if restore_buffers not in ("norm", "all", "none"):
            raise ConfigError(
                f"restore_buffers must be 'norm', 'all' or 'none', found {restore_buffers!r}"
            )
        if batch_dim not in (None, 0, 1):
            raise ConfigError(f"batch_dim must be 0 or 1, found {batch_dim!r}")
        if not callable(train_step):
            raise ConfigError(f"train_step must be callable, found {train_step!r}")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, found {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, found {type(optimizer).__name__}"
            )
        if scaler is not None and not all(
            callable(getattr(scaler, name, None))
            for name in ("scale", "unscale_", "step", "update")
        ):
            raise ConfigError(
                f"scaler must be a torch.amp.GradScaler, found {type(scaler).__name__}"
            )
        if scaler is None:
            _refuse_a_scaler_of_its_own(train_step, before_step)
        self.train_step = train_step
        self.model = model
        self.optimizer = optimizer
        self.backend = backend if backend is not None else self._default_backend(model)
        self.policy = SplitPolicy(grow_after=grow_after)
        self.weight = weight
        self.before_step = before_step
        self.scaler = scaler
        self.timeout = timeout
        self.restore_buffers = restore_buffers
        self.batch_dim = batch_dim if batch_dim is not None else _default_batch_dim(model)
        self.steps = 0
        self.ooms = 0
        self.last: StepInfo | None = None
        self._loss_caveat_said = False  # the split warning's loss caveat: once per step object
        self._labels_warned = False  # the padded-labels warning: once per step object
        functools.update_wrapper(self, train_step)

    @staticmethod
    def _default_backend(model: torch.nn.Module) -> Any:
        param = next(model.parameters(), None)
        if param is None or param.device.type in ("cpu", "meta"):
            return None  # never wrap a cpu model in a new simulated device implicitly

        return get_backend(param.device)

    @property
    def micro_batch_size(self) -> int | None:
        """The remembered micro-batch size (``None`` until the first OOM)."""
        return self.policy.micro_size

    # -- helpers -----------------------------------------------------------------------------
    def _ddp(self) -> bool:
        return distributed.is_ddp(self.model) and distributed.world_size() > 1

    def _allocated(self) -> int | None:
        if self.backend is None:
            return None
        try:
            return int(self.backend.allocated())
        except Exception:  # a counter that cannot be read only disables the jump heuristic
            log.debug("backend.allocated() failed", exc_info=True)
            return None

    def _capacity(self) -> int | None:
        """The device's exact size: the backend's, or without one (a cpu model) the budget of
        an outer ``memkit.simulate`` block counting the model's device (OOM messages round)."""
        if self.backend is None:
            param = next(self.model.parameters(), None)
            outer = active_accountant(param.device if param is not None else "cpu")
            return None if outer is None else outer.budget
        try:
            total = self.backend.capacity().total
        except Exception:
            log.debug("backend.capacity() failed", exc_info=True)
            return None
        return None if total is None else int(total)

    def _buffers_to_restore(self) -> list[torch.Tensor]:
        if self.restore_buffers == "none":
            return []
        if self.restore_buffers == "all":
            return list(self.model.buffers())
        norm_base = getattr(torch.nn.modules.batchnorm, "_NormBase", None)
        if norm_base is None:  # pragma: no cover - every torch >= 1.x has it
            return []
        return [b for m in self.model.modules() if isinstance(m, norm_base) for b in m.buffers()]

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _accumulate(
        self, batch: Any, chunks: int, batch_size: int, world: int, check_labels: bool = False
    ) -> torch.Tensor:
        """Forward and backward every micro-batch; return the full-batch loss (detached).
        ``check_labels``: look for padded labels that sample weights get wrong (a device sync;
        on the attempts that follow an OOM)."""
        self._zero_grads()
        parts = split_batch(batch, chunks, batch_size, self.batch_dim)
        sizes = chunk_sizes(batch_size, chunks)
        # each micro-batch's loss is already divided by the whole batch's num_items_in_batch
        # (given unchanged to every micro-batch): their sum is the full batch's loss
        summed = self.weight is None and chunks > 1 and _carries_item_count(batch)
        if summed:
            weights: list[float] = [1.0] * chunks
        elif self.weight is None:
            weights = [float(n) for n in sizes]
            if check_labels and chunks > 1 and not self._labels_warned:
                self._warn_if_padded_labels(batch, parts, sizes)
        else:
            # numbers, read in one go: a tensor weight costs one device sync per batch, not
            # one per micro-batch, and a zero weight is known before its backward runs
            found = [self.weight(part) for part in parts]
            device = next((w.device for w in found if isinstance(w, torch.Tensor)), None)
            weights = torch.stack(
                [torch.as_tensor(w, dtype=torch.float64, device=device).reshape(()) for w in found]
            ).tolist()
        no_sync: Any = getattr(self.model, "no_sync") if self._ddp() else contextlib.nullcontext  # noqa: B009
        with self._no_buffer_broadcast():
            return self._micro_steps(parts, weights, summed, no_sync, world)

    def _warn_if_padded_labels(self, batch: Any, parts: list[Any], sizes: list[int]) -> None:
        """Warn (once) when a mapping batch's ``labels`` hold -100 and its micro-batches' shares
        of counted labels differ from their shares of samples: a loss averaged over counted
        tokens (transformers' ``labels=``, ``ignore_index=-100``) then gets a wrong gradient
        from the default weights (sweep BS: 127% off on a GPT-2)."""
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if not _is_label_tensor(labels) or labels.device.type == "meta":
            return
        found: list[torch.Tensor] = [
            t for p in parts if isinstance(p, Mapping) and _is_label_tensor(t := p.get("labels"))
        ]
        if len(found) != len(parts) or labels.numel() != sum(t.numel() for t in found):
            return  # the labels are not split with the samples
        counts = torch.stack([(t != IGNORE_INDEX).sum() for t in found])
        per_part = [int(c) for c in counts.tolist()]  # one sync, after an OOM only
        total = sum(per_part)
        if total in (0, labels.numel()):
            return  # nothing counted, or nothing ignored
        samples = sum(sizes)
        factors = [(n / samples) / (c / total) for n, c in zip(sizes, per_part, strict=True) if c]
        if max(factors) - min(factors) < 1e-6:
            return  # every micro-batch holds its samples' share of counted labels: exact
        self._labels_warned = True
        log.warning(
            "microbatch: the batch's 'labels' hold %d (ignored positions) and the split "
            "weights its %d micro-batches by their samples; a loss averaged over the counted "
            "labels (transformers' labels=, cross_entropy(ignore_index=%d)) then gets a wrong "
            "gradient: in this batch the micro-batches' gradients are weighted %.2fx to %.2fx "
            "what the full batch gives them, and each later split batch by its own padding. "
            "Pass the micro-batch's count of counted labels "
            "as weight=: for a causal LM that shifts its labels (transformers' *ForCausalLM) "
            "weight=lambda b: (b['labels'][:, 1:] != -100).sum(); for unshifted labels "
            "(masked LM, token classification, ignored samples) weight=lambda b: "
            "(b['labels'] != -100).sum(). A loss that is a mean over samples is exact already: "
            "weight=lambda b: len(b['labels']) says so and silences this (docs/microbatch.md, "
            "Exactness; said once)",
            IGNORE_INDEX,
            len(sizes),
            IGNORE_INDEX,
            min(factors),
            max(factors),
        )

    @contextlib.contextmanager
    def _no_buffer_broadcast(self) -> Iterator[None]:
        """No DDP collective may run inside an attempt: not the bucket all-reduce (no_sync) and
        not the buffer broadcast DDP does before a forward that follows a synced one. The
        flag is put back afterwards, so the user's own next forward broadcasts as it would
        have."""
        if not self._ddp():
            yield
            return
        before = getattr(self.model, "require_forward_param_sync", True)
        setattr(self.model, "require_forward_param_sync", False)  # noqa: B010
        try:
            yield
        finally:
            setattr(self.model, "require_forward_param_sync", before)  # noqa: B010

    def _micro_steps(
        self, parts: list[Any], weights: list[float], summed: bool, no_sync: Any, world: int
    ) -> torch.Tensor:
        """Micro-batch ``i``'s loss is back-propagated with weight ``weights[i] / sum(weights)``,
        or 1 when the losses are ``summed`` (each already divided by the whole batch's count)."""
        total = 1.0 if summed else sum(weights)
        if total <= 0:  # nothing counted in the whole batch (every label ignored): nothing
            # to learn, and its loss is a mean over nothing, as the full batch's would be
            self._zero_grads()
            return torch.tensor(float("nan"))
        loss_sum: torch.Tensor | None = None
        # sample-count weights (the default) cannot see a micro-batch whose labels are all
        # ignored: its loss is NaN (a mean over nothing) and its gradient zero. While the
        # gradients stay finite, the loss returned is the mean over the others, as the full
        # batch's would be (on the device: no sync); NaN gradients (a real divergence) or
        # every micro-batch NaN still return NaN
        counted: torch.Tensor | None = None
        mask_nan = self.weight is None and len(parts) > 1 and not summed
        for part, w in zip(parts, weights, strict=True):
            if w == 0:  # nothing counted in it: no gradient (its loss is NaN, a mean over
                continue  # nothing, whose backward can make NaN gradients)
            with no_sync():
                loss = self.train_step(part)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ConfigError(
                        "train_step must return the loss as a one-element tensor (the mean over "
                        f"its micro-batch), found {type(loss).__name__}"
                        + (
                            f" of shape {tuple(loss.shape)}"
                            if isinstance(loss, torch.Tensor)
                            else ""
                        )
                    )
                share = w / total
                weighted = loss.reshape(()) * (share / world)
                if self.scaler is not None:
                    if _scaled_by(loss, self.scaler):
                        raise ConfigError(
                            "train_step returned scaler.scale(loss): return the loss itself; "
                            "with scaler= memkit scales it (the gradients would be scaled "
                            "twice)"
                        )
                    weighted = self.scaler.scale(weighted)
                _backward(weighted)
                value = loss.detach().reshape(())
                if mask_nan:
                    finite = ~torch.isnan(value)
                    part_share = finite.to(value.dtype) * share
                    counted = part_share if counted is None else counted + part_share
                    value = torch.where(finite, value, 0.0)
                contrib = value * share
                loss_sum = contrib if loss_sum is None else loss_sum + contrib
            del loss, part
        assert loss_sum is not None
        if counted is None:
            return loss_sum
        grads = [p.grad for p in self._trained() if p.grad is not None]
        if not grads:
            return loss_sum / counted
        healthy = torch.nn.utils.get_total_norm(grads).isfinite()
        return torch.where(healthy, loss_sum / counted, float("nan")).to(loss_sum.dtype)

    def _trained(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _prepare_sync(self) -> list[int]:
        """Give every local ``None`` gradient a zero tensor; return which ones were used here."""
        return distributed.fill_missing_grads(self._trained())

    def _sync(self, used: list[int]) -> None:
        """After every rank finished: sum the gradients (pre-scaled by 1/world: their mean)."""
        distributed.reduce_used_grads(self._trained(), used, timeout=self.timeout)

    def _sync_buffers(self) -> None:
        if getattr(self.model, "broadcast_buffers", False):
            buffers = list(self.model.buffers())
            distributed.broadcast_(buffers, src=0, timeout=self.timeout)

    def _step(self) -> None:
        """``before_step`` and ``optimizer.step()``; with a ``scaler``, as a plain AMP loop:
        unscale once (clipping in ``before_step`` sees true gradients), then ``scaler.step``
        (skipped when a gradient is not finite) and ``scaler.update``."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.before_step is not None:
            self.before_step()
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    # -- the call ------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> torch.Tensor:
        """Train on one full batch; return its mean loss (a detached 0-d tensor).

        Raises:
            DoesNotFitError: the batch does not fit even at micro-batch size 1, or the optimizer
                step itself ran out of memory (micro-batching cannot shrink it).
            DistributedError: under DDP, another rank failed, or a collective timed out.
            Exception: any error from ``train_step`` that is not an OOM, at once, unchanged.
        """
        activate = self.backend.activate() if self.backend is not None else None
        with activate if activate is not None else contextlib.nullcontext():
            return self._call(batch)

    def _call(self, batch: Any) -> torch.Tensor:
        """Attempts at smaller micro-batch sizes until every rank's succeeds, then the step.

        Exceptions are dropped (``del``) as soon as recovered from, before the next attempt
        or the raise, so that their tracebacks do not keep the failed attempt's memory alive.
        """
        found = batch_size_of(batch, self.batch_dim)
        size = found if found is not None else 1
        ddp = self._ddp()
        world = distributed.world_size() if ddp else 1
        attempts = ooms = smallest_oom = 0
        buffers = self._buffers_to_restore()
        with torch.no_grad():
            saved = [b.clone() for b in buffers]
        # a failed attempt's forwards drew random numbers (dropout masks): the retry draws
        # from where the batch started, as a run that had split from the start would
        rng = rng_state()
        while True:
            attempts += 1
            chunks = self.policy.chunks_for(size) if found is not None else 1
            if ddp:
                chunks = self._agree_on_chunks(chunks, size)
            tried = chunk_sizes(size, chunks)[0]
            baseline = self._allocated()
            loss, exc = _guarded(self._accumulate, batch, chunks, size, world, attempts > 1)
            status, status_all, used, exc = self._agree_on_status(exc, tried, ddp)
            if status == RankStatus.ERROR:
                loss = None
                assert exc is not None
                _put_back(buffers, saved)
                self._zero_grads()
                if _needs_two_samples(exc) and chunk_sizes(size, chunks)[-1] == 1:
                    raise self._one_sample_error(exc, size, chunks, smallest_oom) from exc
                raise exc  # not an OOM: at once, unchanged, never retried
            if status_all == RankStatus.ERROR:
                loss = None
                if exc is not None:
                    recover(self.backend, exc)
                    del exc
                raise DistributedError(
                    f"rank {distributed.rank()}: another rank's train_step raised an error that "
                    "is not an OOM; see that rank's traceback"
                )
            if status_all == RankStatus.OK:
                break
            # Some rank (maybe only another one) ran out of memory: recover, then retry.
            loss = None
            _put_back(buffers, saved)
            restore_rng_state(rng)
            details = parse_oom_message(exc) if exc is not None else None
            message = str(exc) if exc is not None else ""
            last = _bare_copy(exc) if exc is not None else None
            if exc is not None:
                ooms += 1
                self.ooms += 1
                smallest_oom = tried
                recover(self.backend, exc)
                del exc
            self._zero_grads()
            self._raise_if_no_smaller_size(
                status, status_all, size, details, message, baseline, last
            )
            if details is not None:
                self._shrink_after_oom(tried, size, chunks, details, baseline)
        assert loss is not None
        del saved, rng
        self._step_once(used, ddp)
        self.steps += 1
        self.policy.on_success(tried)
        self.last = StepInfo(size, chunks, tuple(chunk_sizes(size, chunks)), attempts, ooms)
        return loss

    @staticmethod
    def _one_sample_error(
        exc: BaseException, size: int, chunks: int, smallest_oom: int
    ) -> DoesNotFitError | ConfigError:
        """BatchNorm cannot train on a micro-batch of one sample: where that was memkit's
        split, say so instead of BatchNorm's bare error."""
        why = (
            f"the model's BatchNorm fails on a micro-batch of 1 sample "
            f"({str(exc).splitlines()[0]}): in training it needs at least 2 per channel"
        )
        if chunks == size:  # micro-batch size 1: size 2 ran out of memory
            return DoesNotFitError(
                f"a batch of {size} ran out of memory at micro-batch size {smallest_oom} and "
                f"cannot be split further: {why}. Reduce what one sample needs (activation "
                "checkpointing, mixed precision) or use a larger device"
            )
        sizes = chunk_sizes(size, chunks)
        return ConfigError(
            f"a batch of {size} split into micro-batches of {sizes[0]} leaves one of 1 sample "
            f"({size} = {sizes.count(sizes[0])} x {sizes[0]} + ...): {why}. Give the batch a "
            "size that splits evenly (DataLoader(drop_last=True) drops a short last batch)"
        )

    def _agree_on_chunks(self, chunks: int, size: int) -> int:
        """DDP: the largest split count any rank needs (every rank must run as many)."""
        agreed, neg_min = distributed.all_max([chunks, -size], timeout=self.timeout)
        if agreed > -neg_min:
            raise DistributedError(
                f"rank {distributed.rank()}: the ranks need {agreed} micro-batches, but "
                f"the smallest per-rank batch has {-neg_min} samples; give every rank "
                "the same batch size (DistributedSampler(drop_last=True))"
            )
        return agreed

    def _agree_on_status(
        self, exc: Exception | None, tried: int, ddp: bool
    ) -> tuple[int, int, list[int], Exception | None]:
        """This rank's status, the worst over the ranks, the gradients used (DDP) and the
        exception of this attempt (or of preparing the gradient sync)."""
        used: list[int] = []
        if ddp:
            # every rank sends the same number of values, whatever happened to it
            used = [0] * sum(1 for p in self.model.parameters() if p.requires_grad)
            if exc is None:
                used_or_none, exc = _guarded(self._prepare_sync)
                used = used_or_none if used_or_none is not None else used
        status = RankStatus.OK
        if exc is not None:
            status = RankStatus.ERROR
            if is_oom(exc):
                status = RankStatus.OOM if tried > 1 else RankStatus.FATAL_OOM
        if not ddp:
            return status, status, used, exc
        agreed_flags = distributed.all_max([status, *used], timeout=self.timeout)
        return status, agreed_flags[0], agreed_flags[1:], exc

    def _raise_if_no_smaller_size(
        self,
        status: int,
        status_all: int,
        size: int,
        details: OomDetails | None,
        message: str,
        baseline: int | None,
        last: BaseException | None,
    ) -> None:
        """After an OOM at micro-batch size 1 (here or on another rank): does not fit, raised
        from ``last``, a copy of this rank's OOM without its traceback (which held the failed
        attempt's tensors): an OOM in its chain, so ``memkit run`` and a tracked block take
        it for the out-of-memory ending it is (exit 1, a post-mortem; sweep BS: exit 3, "an
        error the script raised")."""
        if status == RankStatus.FATAL_OOM:
            raise self._does_not_fit(size, details, message, baseline) from last
        if status_all == RankStatus.FATAL_OOM:
            raise DoesNotFitError(
                f"rank {distributed.rank()}: another rank's batch does not fit even at "
                "micro-batch size 1; see that rank's error for the numbers"
            )

    def _shrink_after_oom(
        self, tried: int, size: int, chunks: int, details: OomDetails, baseline: int | None
    ) -> None:
        """Pick the next micro-batch size from this rank's OOM, and say so."""
        bound = oom_size_bound(tried, details, baseline, self._capacity())
        new = self.policy.on_oom(tried, bound)
        log.warning(
            "microbatch: out of memory at micro-batch size %d of %d (%d chunk(s)); "
            "retrying the same batch at micro-batch size %s%s%s",
            tried,
            size,
            chunks,
            new,
            "" if bound is None or new != bound else " (size bound from the OOM message)",
            self._batch_statistics_note() + self._loss_note(new, size),
        )

    def _loss_note(self, new: int | None, size: int) -> str:
        """Once per step object, at its first split: what splitting does to a loss that is not
        a mean of per-sample losses (memkit cannot see the loss)."""
        if self._loss_caveat_said or new is None or new >= size:
            return ""
        self._loss_caveat_said = True
        if self.weight is not None:  # (sweep CQ: the caveat below read as if weight= were unset)
            return (
                "; each micro-batch's loss is weighted by weight=, which keeps the gradient "
                "for a loss that is a mean over what weight= counts; in-batch negatives "
                "(contrastive losses) still see fewer negatives (docs/microbatch.md, "
                "Exactness; said once)"
            )
        return (
            "; splitting keeps the gradient only for a loss that is a mean of per-sample "
            "losses: a sum (reduction='sum') comes out divided by the number of micro-batches, "
            "class-weighted cross-entropy is off unless weight= sums the class weights, and "
            "in-batch negatives (contrastive losses) see fewer negatives (the loss drops by "
            "about ln(micro-batches)) (docs/microbatch.md, Exactness; said once)"
        )

    def _batch_statistics_note(self) -> str:
        """A caveat when the model normalises with batch statistics (BatchNorm in training
        mode, or without running statistics): each micro-batch then has its own, and the
        gradient is not the full batch's."""
        norms = [
            type(m).__name__
            for m in self.model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and (m.training or not m.track_running_stats)  # (no running stats: batch ones)
        ]
        if not norms:
            return ""
        return (
            f"; the model's {len(norms)} {norms[0]} layer(s) using batch statistics now normalise "
            "each micro-batch with its own statistics: the gradient is the micro-batched "
            "model's, not the full batch's (docs/microbatch.md, Exactness)"
        )

    def _step_once(self, used: list[int], ddp: bool) -> None:
        """Sync the gradients (DDP), step the optimizer, zero the gradients, sync buffers.

        Raises:
            DoesNotFitError: the optimizer step ran out of memory.
        """
        if ddp:
            self._sync(used)
        failed: Exception | None
        _, failed = _guarded(self._step)
        if failed is not None:
            if not is_oom(failed):
                raise failed
            message = str(failed)
            last = _bare_copy(failed)  # (raised from: an OOM ending, exit 1 under memkit run)
            recover(self.backend, failed)
            del failed
            self._zero_grads()
            raise DoesNotFitError(
                "the optimizer step (with before_step) ran out of memory after the gradients "
                "were accumulated; micro-batching cannot shrink it (it holds parameters, "
                "gradients and optimizer state, not activations), and parameters may be "
                "partially updated. Reduce optimizer state (a lighter optimizer, 8-bit or "
                f"foreach=False) or use a larger device. Last OOM: {message}",
                capacity_bytes=self._capacity(),
            ) from last
        self._zero_grads()
        if ddp:
            self._sync_buffers()

    def _does_not_fit(
        self, size: int, details: OomDetails | None, message: str, baseline: int | None
    ) -> DoesNotFitError:
        d = details or OomDetails()
        needed = d.needed_at_least()
        capacity = self._capacity()  # exact when a backend is known; the message rounds
        if capacity is None:
            capacity = d.capacity
        parts = [f"a batch of {size} does not fit even at micro-batch size 1"]
        if needed is not None:
            parts.append(
                f"the attempt needed at least {format_size(needed)} "
                f"({format_size(d.held())} held + {format_size(d.tried_to_allocate or 0)} "
                "requested)"
            )
        if capacity is not None:
            parts.append(f"the device has {format_size(capacity)}")
        if baseline is not None:
            parts.append(
                f"{format_size(baseline)} were in use before the batch (parameters, optimizer "
                "state, whatever else is alive)"
            )
        advice = (
            "memkit cannot split further: reduce what one sample needs (activation "
            "checkpointing, mixed precision, shorter sequences) or what stays on the device "
            "between steps (a lighter optimizer; batches or outputs a list keeps alive), or use "
            "a larger device"
        )
        return DoesNotFitError(
            "; ".join(parts) + f". {advice}. Last OOM: {message}",
            needed_bytes=needed,
            capacity_bytes=capacity,
        )

    def __repr__(self) -> str:
        name = getattr(self.train_step, "__name__", repr(self.train_step))
        return (
            f"MicroBatchStep({name}, micro_batch_size={self.policy.micro_size}, "
            f"steps={self.steps}, ooms={self.ooms})"
        )


# The two overloads repeat the signature because mypy needs them to type both uses: with
# train_step, microbatch returns the step; without it (the decorator form), a decorator. Keep
# their keyword arguments the same as the implementation's (mypy checks that they agree).
@overload
def microbatch(
    train_step: Callable[[Any], torch.Tensor],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    backend: Any = None,
    grow_after: int | None = 50,
    weight: Weight | None = None,
    before_step: Callable[[], Any] | None = None,
    scaler: Any = None,
    timeout: float | None = None,
    restore_buffers: str = "norm",
    batch_dim: int | None = None,
) -> MicroBatchStep: ...


@overload
def microbatch(
    train_step: None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    backend: Any = None,
    grow_after: int | None = 50,
    weight: Weight | None = None,
    before_step: Callable[[], Any] | None = None,
    scaler: Any = None,
    timeout: float | None = None,
    restore_buffers: str = "norm",
    batch_dim: int | None = None,
) -> Callable[[Callable[[Any], torch.Tensor]], MicroBatchStep]: ...


def microbatch(
    train_step: Callable[[Any], torch.Tensor] | None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    backend: Any = None,
    grow_after: int | None = 50,
    weight: Weight | None = None,
    before_step: Callable[[], Any] | None = None,
    scaler: Any = None,
    timeout: float | None = None,
    restore_buffers: str = "norm",
    batch_dim: int | None = None,
) -> MicroBatchStep | Callable[[Callable[[Any], torch.Tensor]], MicroBatchStep]:
    """Wrap ``train_step`` into an OOM-proof step that keeps the effective batch.

    Args:
        train_step: ``train_step(batch) -> loss``: forward and loss of one (micro-)batch, the
            loss a mean over it (or a sum divided by the batch's ``num_items_in_batch``,
            transformers' convention). memkit does ``backward``, accumulation, ``optimizer.step()``
            and ``zero_grad(set_to_none=True)``. Omit it to use ``microbatch`` as a decorator.
        model: the model (``DistributedDataParallel`` is recognised and coordinated).
        optimizer: the optimizer; it steps once per batch.
        backend: a :class:`~memkit.devices.MemoryBackend` to recover on and read counters from
            (a simulated one is activated around each call). Default: the backend of the
            model's device; for a cpu model none (OOMs then come from whatever is active, e.g.
            an outer ``memkit.simulate`` block).
        grow_after: clean steps before a larger micro-batch size is tried; ``None`` never.
        weight: ``weight(micro_batch) -> number`` the micro-batch's loss averages over; default
            its sample count. For token-mean losses with padding, count the tokens.
        before_step: called after accumulation, before ``optimizer.step()`` (gradient
            clipping); with ``scaler``, after ``scaler.unscale_(optimizer)``.
        scaler: a ``torch.amp.GradScaler`` for float16 autocast. ``train_step`` returns the
            unscaled loss; memkit back-propagates ``scaler.scale(...)`` of each micro-batch's
            weighted loss, then per batch ``scaler.unscale_(optimizer)``, ``before_step``,
            ``scaler.step(optimizer)`` (skipped for inf/NaN gradients) and
            ``scaler.update()``. A ``train_step`` or ``before_step`` that uses a GradScaler
            without it is refused (``ConfigError``), as is a returned ``scaler.scale(loss)``.
        timeout: seconds to wait for other ranks in memkit's collectives; ``None`` uses the
            process group's timeout.
        restore_buffers: which buffers are put back as they were before the batch when an
            attempt fails, since its forward passes already updated them: ``"norm"`` (running
            statistics of BatchNorm/InstanceNorm layers, the default), ``"all"`` (every buffer;
            costs a copy of them per batch) or ``"none"``.
        batch_dim: the dimension the batch is split along: 0, or 1 for sequence-first
            batches ``(seq, batch, ...)``. Required (0 or 1) for a model with sequence-first
            layers (an ``nn.LSTM`` without ``batch_first``): split along time, the gradient
            would be silently wrong.

    Returns:
        A :class:`MicroBatchStep`; call it with a full batch.

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = microbatch(lambda b: model(b).pow(2).mean(), model=model, optimizer=opt)
        >>> with memkit.simulate(None):
        ...     _ = step(torch.randn(8, 4))
        >>> step.steps
        1
    """
    options: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "backend": backend,
        "grow_after": grow_after,
        "weight": weight,
        "before_step": before_step,
        "scaler": scaler,
        "timeout": timeout,
        "restore_buffers": restore_buffers,
        "batch_dim": batch_dim,
    }
    if train_step is None:

        def decorate(fn: Callable[[Any], torch.Tensor]) -> MicroBatchStep:
            return MicroBatchStep(fn, **options)

        return decorate
    return MicroBatchStep(train_step, **options)
