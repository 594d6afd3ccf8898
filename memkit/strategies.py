"""DataParallel vs DDP vs FSDP2 on N virtual devices: the largest global batch each fits, per
device.

``memkit probe model.py --device cpu --gpus 4 --budget 24GiB --strategies dp,ddp,fsdp`` (real
compute on the simulated device) and ``memkit estimate ... --gpus 4 --strategies dp,ddp,fsdp``
(meta tensors, no compute) call :func:`compare_strategies`. Each strategy's trials run on a
fresh :class:`~memkit.simulated.virtual_devices.VirtualDevices`:

* ``dp``: the model on ``cuda:0`` wrapped in :class:`memkit.simulated.parallel.DataParallel`, its
  optimizer there, the global batch made on ``cuda:0`` (the script's ``x.cuda()``) and
  scattered;
* ``ddp``: :func:`memkit.simulated.parallel.ddp_replicas` on every device (replica, optimizer,
  buckets), each running the per-rank batch (global / N); ranks run one after the other (their
  memory is independent) and gradients are not averaged across them (an in-place all-reduce
  adds no memory);
* ``fsdp``: :func:`memkit.simulated.fsdp.fsdp_ranks` on every device (the rank's shards, its
  optimizer over them, FSDP2's all-gathers and reduce-scatters around each unit), each running
  the per-rank batch, one rank after the other.

Each trial runs ``steps`` full steps (the probe's default step or the file's ``train_step``). A
size fits when no device ran out. The search doubles, then bisects (global batches for DP,
per-rank batches for DDP and FSDP). The models' weights change during the trials (optimizer
steps); sizes do not. Where cpu and meta run the same ops (everything but a few cpu kernels,
such as oneDNN's LSTM), they create the same storages: the comparison gives the same answers
on both, to the byte. ``memkit estimate`` hands in a :class:`StepTarget`, the target GPU's
rules each step runs under (its attention kernel, dropout, autocast policy, optimizer
implementation and cuBLAS workspaces, as for one card); a strategy whose step raises an
error that is not an out-of-memory error is reported with it, and the others' results stand.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from memkit import advice as rules
from memkit.advice import Advice
from memkit.advice.sharding import fsdp_gpus_needed, fsdp_saves, fsdp_wrap_unit
from memkit.errors import ConfigError, UserCodeError
from memkit.modelfile import (
    ModelSpec,
    batch_args,
    call_user,
    check_seq_len,
    load_model_file,
    make_optimizer,
)
from memkit.oom import is_oom
from memkit.probing.step import StepPlan
from memkit.render import strategies as layout
from memkit.results import Record, Result
from memkit.simulated.accountant import tensors_of
from memkit.simulated.fsdp import (
    fsdp_ranks,
    meta_optimizer_state,
    split_candidate,
    tensor_bytes,
    unit_sizes,
)
from memkit.simulated.parallel import DataParallel, ddp_replicas
from memkit.simulated.virtual_devices import SimulationError, VirtualDevices

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "StepTarget",
    "StrategyComparison",
    "StrategyResult",
    "compare_strategies",
]

STRATEGIES = ("dp", "ddp", "fsdp")
DEFAULT_STRATEGIES = ("dp", "ddp")
"""Compared when ``--strategies`` is not given."""


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a batch or an output (a tensor, a tuple/list/dict of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


MAX_GLOBAL_BATCH = 1 << 16

FSDP_NOT_COUNTED = (
    "fsdp: each rank's shards, optimizer state, all-gather and reduce-scatter buffers and "
    "unsharded parameters as FSDP2 allocates them; not counted: the collectives' own buffers "
    "(NCCL's, outside PyTorch's allocator), mixed precision, CPU offload, HSDP"
)
"""The comparison's note on what its fsdp peaks leave out (memkit.simulated.fsdp)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StrategyResult(Record):
    """One strategy's answer.

    Attributes:
        strategy: ``"dp"``, ``"ddp"`` or ``"fsdp"``.
        max_global_batch: the largest global batch that fits on every device (``None``: not
            even the smallest).
        per_device_peaks: each device's peak at that batch (bytes).
        excess_bytes: device 0's peak minus the mean of the others.
        excess_parts: what lives on device 0 only, at that batch: the input for the other
            devices (the batch is made on device 0), gathered outputs, loss, reduced gradients,
            optimizer state (bytes; DP only).
        trials: ``(global batch, fits)`` in the order run.
        largest_unit: FSDP only: the unit whose all-gather is the largest (its module path,
            ``""`` for the root) and its unsharded bytes.
        error: the strategy's step raised an error that is not an out-of-memory error (what,
            at which global batch, and what to change where memkit knows); its search
            stopped there and it has no batch. The other strategies' results stand.
        hit_max_batch: the search stopped at its ceiling (``--max-batch``, else
            :data:`MAX_GLOBAL_BATCH`) with the batch still fitting: ``max_global_batch`` is a
            lower bound, not a memory limit.
    """

    strategy: str
    max_global_batch: int | None
    per_device_peaks: tuple[int, ...]
    excess_bytes: int
    excess_parts: tuple[tuple[str, int], ...]
    trials: tuple[tuple[int, bool], ...]
    largest_unit: tuple[str, int] | None = None
    error: str | None = None
    hit_max_batch: bool = False

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["excess_parts"] = dict(self.excess_parts)
        out["trials"] = [{"global_batch": b, "fits": f} for b, f in self.trials]
        return out


@dataclass(frozen=True)
class StrategyComparison(Result):
    """DP, DDP and FSDP on ``gpus`` virtual devices: per strategy, the largest global batch and
    the per-device peaks, and the advice they back."""

    SCHEMA: ClassVar[str] = "memkit.StrategyComparison/1"
    HTML_TITLE: ClassVar[str] = "memkit: DP, DDP and FSDP on virtual GPUs"

    path: str
    device: str
    gpus: int
    budgets: tuple[int, ...]
    results: tuple[StrategyResult, ...]
    advice: tuple[Advice, ...] = ()
    notes: tuple[str, ...] = ()
    max_batch: int | None = None
    """The ``--max-batch`` given (``None``: memkit's ceiling, :data:`MAX_GLOBAL_BATCH`)."""

    def result(self, strategy: str) -> StrategyResult | None:
        """The result of one strategy, if it was run."""
        return next((r for r in self.results if r.strategy == strategy), None)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["strategies"] = out.pop("results")
        return out

    def __str__(self) -> str:
        return layout.comparison_text(self)

    def __repr__(self) -> str:
        best = ", ".join(
            f"{r.strategy}={'>=' if r.hit_max_batch else ''}{r.max_global_batch}"
            for r in self.results
        )
        return f"StrategyComparison({self.gpus} GPUs, {best})"

    def html_body(self) -> str:
        return layout.comparison_html_body(self)


class StepTarget(Protocol):
    """A target GPU's rules for the steps on meta tensors (``memkit estimate --gpus``:
    :class:`memkit.estimation.target_step.TargetStep`, handed in by the command line)."""

    def optimizer(self, spec: ModelSpec, model: torch.nn.Module) -> Any:
        """The file's optimizer over ``model`` as the target builds it."""
        ...

    def step(self) -> AbstractContextManager[Any]:
        """One training step runs inside (attention kernel, dropout, autocast)."""
        ...

    def workspaces(self, devices: VirtualDevices) -> AbstractContextManager[Any]:
        """A trial runs inside: the kernels' workspaces, counted on ``devices``."""
        ...

    def notes(self) -> tuple[str, ...]:
        """What the steps assumed of the target."""
        ...


class _Trials:
    def __init__(
        self,
        spec: ModelSpec,
        budgets: Sequence[int],
        device: str,
        steps: int,
        seq_len: int | None,
        target: StepTarget | None = None,
    ) -> None:
        self.spec = spec
        self.budgets = list(budgets)
        self.device = device
        self.steps = steps
        self.seq_len = seq_len
        self.target = target
        with torch.device(device):
            self.model = call_user(spec.build_model, what="build_model()", path=spec.path)
        self.plan = StepPlan("train", loss_fn=spec.loss_fn, train_step=spec.train_step)
        self.parts: dict[str, int] = {}
        self.tried: dict[tuple[str, int], tuple[bool, list[int]]] = {}  # (strategy, global)
        self.largest_unit: tuple[str, int] | None = None

    def _optimizer(self, model: torch.nn.Module) -> Any:
        if self.target is not None:
            return self.target.optimizer(self.spec, model)
        return make_optimizer(self.spec, model)[0]

    def _step(self, model: Any, batch: Any, optimizer: Any) -> None:
        """One training step, under the target's rules when there is one."""
        with self.target.step() if self.target is not None else contextlib.nullcontext():
            self.plan(model, batch, optimizer)

    def _batch(self, size: int) -> Any:
        args = batch_args(size, self.seq_len)
        with torch.device(self.device):
            return call_user(
                self.spec.make_batch, *args, what=f"make_batch({size})", path=self.spec.path
            )

    def _run(
        self, body: Callable[[VirtualDevices], None], budgets: Sequence[int | None] | None = None
    ) -> tuple[bool, list[int]]:
        vd = VirtualDevices(self.budgets if budgets is None else budgets, self.device)
        target = self.target
        try:
            with vd, target.workspaces(vd) if target is not None else contextlib.nullcontext():
                body(vd)
        except Exception as exc:
            if not is_oom(exc):
                raise UserCodeError(
                    f"the training step raised {type(exc).__name__} on the virtual devices: {exc}",
                    original=exc,
                ) from exc
            self.plan.release()
            gc.collect()
            return False, vd.peaks
        self.plan.release()
        peaks = vd.peaks
        gc.collect()
        return True, peaks

    def dp(self, global_batch: int) -> tuple[bool, list[int]]:
        model = self.model
        seen: dict[str, int] = {}

        def body(vd: VirtualDevices) -> None:
            vd.to(model, 0)
            opt = self._optimizer(model)
            dp = DataParallel(model)

            def out_hook(_m: Any, _a: Any, output: Any) -> None:
                size = _nbytes(output)
                seen["gathered outputs"] = max(seen.get("gathered outputs", 0), size)

            dp.register_forward_hook(out_hook)
            for _ in range(self.steps):
                batch = self._batch(global_batch)
                full = _nbytes(batch)
                n = min(len(self.budgets), global_batch)
                seen["input for the other devices"] = full - full // max(1, n)
                self._step(dp, batch, opt)
                del batch
            seen["reduced gradients"] = tensor_bytes(
                [p for p in model.parameters() if p.requires_grad]
            )
            seen["optimizer state"] = tensor_bytes(list(tensors_of(opt.state)))
            model.zero_grad(set_to_none=True)
            vd.to(model, -1)

        try:
            fits, peaks = self._run(body)
        finally:
            model.zero_grad(set_to_none=True)
        self.parts = seen
        return fits, peaks

    def ddp(self, per_rank: int) -> tuple[bool, list[int]]:
        def body(vd: VirtualDevices) -> None:
            replicas = ddp_replicas(self.model, self._optimizer)
            for rep in replicas:
                with vd.on(rep.device):
                    for _ in range(self.steps):
                        batch = self._batch(per_rank)
                        self._step(rep.model, batch, rep.optimizer)
                        del batch
                    self.plan.release()

        return self._run(body)

    def one_gpu(self, batch: int) -> int:
        """The peak of the plain step at ``batch`` on one device with no limit."""

        def body(vd: VirtualDevices) -> None:
            vd.to(self.model, 0)
            opt = self._optimizer(self.model)
            for _ in range(self.steps):
                self._step(self.model, self._batch(batch), opt)
            self.model.zero_grad(set_to_none=True)
            vd.to(self.model, -1)

        try:
            return self._run(body, [None])[1][0]
        finally:
            self.model.zero_grad(set_to_none=True)

    def fsdp(self, per_rank: int) -> tuple[bool, list[int]]:
        def body(vd: VirtualDevices) -> None:
            ranks = fsdp_ranks(self.model, self._optimizer)
            self.largest_unit = ranks[0].largest_unit
            for rank in ranks:
                with vd.on(rank.device):
                    for _ in range(self.steps):
                        batch = self._batch(per_rank)
                        self._step(rank.model, batch, rank.optimizer)
                        del batch
                    self.plan.release()

        return self._run(body)


class _StepFailed(Exception):
    """A strategy's step raised an error that is not an out-of-memory error."""


def _search(fits: Callable[[int], bool], max_size: int) -> tuple[int | None, list[int]]:
    """Largest ``n`` in ``[1, max_size]`` with ``fits(n)`` (doubling, then bisection)."""
    tried: list[int] = []

    def run(n: int) -> bool:
        tried.append(n)
        return fits(n)

    if not run(1):
        return None, tried
    lo, hi = 1, None
    while hi is None:
        nxt = min(lo * 2, max_size)
        if nxt == lo:
            return lo, tried
        if run(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


SCALAR_LOSS = "grad can be implicitly created only for scalar outputs"
"""PyTorch's error for ``backward()`` on a loss that is not a scalar."""


def _failure(strategy: str, size: int, exc: UserCodeError, gpus: int) -> str:
    """What a strategy's failed step says: the error, the strategy and global batch, and the
    change that fixes it where memkit knows it."""
    original = exc.original if exc.original is not None else exc
    if isinstance(original, SimulationError):  # memkit's own, not the model file's
        return (
            f"memkit's simulation of {strategy} failed at global batch {size}, an internal "
            f"error of memkit (not of the model file; please report it): "
            f"{type(original).__name__}: " + str(original).rstrip(". ")
        )
    said = f"the {strategy} step raised {type(original).__name__} at global batch {size}: "
    said += str(original).rstrip(". ")
    if strategy == "dp" and SCALAR_LOSS in str(original):
        said += (
            f". DataParallel gathers each replica's outputs, a loss among them: the model's "
            f"scalar loss arrives as a vector of {gpus}, one per GPU (nn.DataParallel does the "
            "same); reduce it with `.mean()` in loss_fn or train_step (`return "
            "output[1].mean()` for a model that returns (logits, loss))"
        )
    return said


def _strategy(trials: _Trials, strategy: str, gpus: int, max_batch: int) -> StrategyResult:
    record: dict[int, tuple[bool, list[int], dict[str, int]]] = {}
    order: list[tuple[int, bool]] = []

    def fits(n: int) -> bool:
        size = n if strategy == "dp" else n * gpus
        try:
            ok, peaks = getattr(trials, strategy)(n)
        except UserCodeError as exc:
            raise _StepFailed(_failure(strategy, size, exc, gpus)) from exc
        trials.tried[(strategy, size)] = (ok, peaks)
        record[size] = (ok, peaks, dict(trials.parts) if strategy == "dp" else {})
        order.append((size, ok))
        return ok

    limit = max_batch if strategy == "dp" else max(1, max_batch // gpus)
    try:
        best, _ = _search(fits, limit)
    except _StepFailed as failed:
        log.debug("the %s step failed", strategy, exc_info=True)
        return StrategyResult(strategy, None, (), 0, (), tuple(order), None, str(failed))
    size = None if best is None else (best if strategy == "dp" else best * gpus)
    peaks: list[int] = [] if size is None else record[size][1]
    parts = {} if size is None else record[size][2]
    others = peaks[1:]
    excess = peaks[0] - sum(others) // len(others) if peaks and others else 0
    names = (
        "input for the other devices",
        "gathered outputs",
        "reduced gradients",
        "optimizer state",
    )
    return StrategyResult(
        strategy,
        size,
        tuple(peaks),
        excess,
        tuple((k, parts[k]) for k in names if parts.get(k)),
        tuple(order),
        trials.largest_unit if strategy == "fsdp" else None,
        hit_max_batch=best == limit,  # it still fit where the search stops: a lower bound
    )


def _model_state(spec: ModelSpec) -> tuple[int, int, int] | None:
    """Parameters (and buffers), trainable parameters and the optimizer's device state after
    one step, in bytes, from the model built on meta tensors (``None`` if its optimizer
    cannot step there)."""
    with torch.device("meta"):
        model = call_user(spec.build_model, what="build_model()", path=spec.path)
    params = [*model.parameters(), *model.buffers()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        opt = make_optimizer(spec, model)[0]
    except Exception as exc:  # advice must never break the comparison
        log.debug("the optimizer could not be built on meta tensors: %s", exc)
        return None
    state = meta_optimizer_state(opt)
    return None if state is None else (tensor_bytes(params), tensor_bytes(trainable), state)


def _sharding_advice(trials: _Trials, results: Sequence[StrategyResult], gpus: int) -> list[Advice]:
    """``fsdp-gpus`` when a strategy fits no batch, ``fsdp-saves`` when DDP and FSDP ran,
    ``fsdp-wrap-unit`` when FSDP ran; from the model's state measured on meta tensors."""
    by = {r.strategy: r for r in results}
    failed = [r for r in results if r.max_global_batch is None and r.strategy != "fsdp"]
    fsdp, ddp = by.get("fsdp"), by.get("ddp")
    if not failed and fsdp is None:
        return []
    state = _model_state(trials.spec)
    if state is None:
        return []
    params, grads, opt_state = state
    units = unit_sizes(trials.model)
    out: list[Advice] = []
    if failed:
        other = max(0, trials.one_gpu(1) - sum(state))
        fits_on = (
            (gpus, fsdp.max_global_batch, max(fsdp.per_device_peaks))
            if fsdp is not None and fsdp.max_global_batch is not None
            else None
        )
        a = fsdp_gpus_needed(
            parameter_bytes=params,
            gradient_bytes=grads,
            optimizer_state_bytes=opt_state,
            other_bytes=other,
            capacity_bytes=min(trials.budgets),
            units=units,
            batch_size=1,
            measured_fit=fits_on,
        )
        out += [a] if a is not None else []
    if fsdp is not None and ddp is not None:
        a = fsdp_saves(
            parameter_bytes=params,
            gradient_bytes=grads,
            optimizer_state_bytes=opt_state,
            bucket_bytes=grads,  # DDP's buckets: a copy of the gradients
            gpus=gpus,
            units=units,
            largest_batches=(ddp.max_global_batch, fsdp.max_global_batch),
        )
        out += [a] if a is not None else []
    if fsdp is not None and fsdp.per_device_peaks:
        a = fsdp_wrap_unit(units, split_candidate(trials.model), max(fsdp.per_device_peaks))
        out += [a] if a is not None else []
    return out


def _ddp_peak_at(trials: _Trials, global_batch: int | None, gpus: int) -> int | None:
    """DDP's per-rank peak at ``global_batch`` (each rank ``ceil(global_batch / gpus)``, as
    ``DistributedSampler`` pads), from the search's trials or one more; ``None`` when it does
    not fit."""
    if global_batch is None:
        return None
    per_rank = -(-global_batch // gpus)
    fits, peaks = trials.tried.get(("ddp", per_rank * gpus)) or trials.ddp(per_rank)
    return max(peaks) if fits and peaks else None


def compare_strategies(
    path: str,
    *,
    gpus: int,
    budget: int | Sequence[int],
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    device: str = "cpu",
    steps: int = 2,
    seq_len: int | None = None,
    max_batch: int | None = None,
    target: StepTarget | None = None,
) -> StrategyComparison:
    """Run each strategy's search on ``gpus`` virtual devices of ``budget`` bytes each.

    Args:
        path: a model file (docs/probe.md).
        gpus: number of virtual GPUs (at least 2).
        budget: bytes per device, or one size per device.
        strategies: any of ``"dp"``, ``"ddp"``, ``"fsdp"``.
        device: ``"cpu"`` (real compute) or ``"meta"`` (shapes only, ``memkit estimate``).
        steps: full steps per trial.
        max_batch: the largest global batch tried (default 65536).
        target: on meta, the target GPU's rules every step runs under (``memkit estimate``:
            its attention kernel, dropout, autocast policy, optimizer implementation and
            cuBLAS workspaces); ``None``: the step as meta runs it, which counts what the
            simulated cpu device counts.
    """
    if gpus < 2:
        raise ConfigError(f"--gpus must be at least 2 to compare strategies, found {gpus}")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ConfigError(f"expected strategies among dp,ddp,fsdp, found {','.join(strategies)!r}")
    if len(set(strategies)) != len(strategies):
        raise ConfigError(f"each strategy once, found {','.join(strategies)!r}")
    budgets = [int(budget)] * gpus if isinstance(budget, int) else [int(b) for b in budget]
    if len(budgets) != gpus:
        raise ConfigError(f"{len(budgets)} budgets given for {gpus} GPUs; give one or {gpus}")
    if target is not None and device != "meta":
        raise ConfigError(f"a target GPU's step rules apply on meta tensors, not on {device!r}")
    spec = load_model_file(path)
    check_seq_len(spec, seq_len)
    trials = _Trials(spec, budgets, device, steps, seq_len, target)
    limit = max_batch or MAX_GLOBAL_BATCH
    results = tuple(_strategy(trials, s, gpus, limit) for s in strategies)
    if all(r.error is not None for r in results):
        raise UserCodeError("; ".join(str(r.error) for r in results))
    advice: list[Advice] = []
    ran = [r for r in results if r.error is None]  # the rules read the strategies that ran
    dp, ddp = (next((r for r in ran if r.strategy == s), None) for s in ("dp", "ddp"))
    ddp_at_dp = (  # DDP's rank at DataParallel's largest global batch, measured
        _ddp_peak_at(trials, dp.max_global_batch, gpus)
        if dp is not None and ddp is not None and len(dp.per_device_peaks) >= 2
        else None
    )
    for r in results:  # the tracker's DP rule, on each strategy's per-device peaks
        if len(r.per_device_peaks) >= 2:
            parts = dict(r.excess_parts)
            a = rules.dp_to_ddp(
                {f"cuda:{i}": p for i, p in enumerate(r.per_device_peaks)},
                "cuda:0",
                gradient_bytes=parts.get("reduced gradients", 0),
                optimizer_state_bytes=parts.get("optimizer state", 0),
                gathered_output_bytes=parts.get("gathered outputs", 0),
                parameter_bytes=tensor_bytes([*trials.model.parameters(), *trials.model.buffers()]),
                largest_batches=(
                    (dp.max_global_batch, ddp.max_global_batch)
                    if dp is not None and ddp is not None
                    else None
                ),
                ddp_peak=ddp_at_dp if r.strategy == "dp" else None,
            )
            if a is not None:
                advice.append(a)
    if dp is not None and ddp is not None:
        switch = rules.switch_to_ddp(dp, ddp, gpus)
        if switch is not None:
            advice.insert(0, switch)
    advice += _sharding_advice(trials, ran, gpus)
    notes = (FSDP_NOT_COUNTED,) if "fsdp" in strategies else ()
    if target is not None:
        notes = (*target.notes(), *notes)
    return StrategyComparison(
        path, device, gpus, tuple(budgets), results, tuple(advice), notes, max_batch
    )
