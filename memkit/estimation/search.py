"""The entry point of ``memkit estimate``: the target resolved, the model built on meta, the
batch-size search of ``memkit probe`` run over meta trials, and the :class:`Estimate` assembled."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from memkit.cuda_autocast import requests_recorded
from memkit.errors import ConfigError
from memkit.estimation.assumptions import (
    PADDING_PROBE_BATCH,
    RNN_NOTE,
    outcome_lines,
    padded_masks,
    target_lines,
)
from memkit.estimation.attention import ATTENTION_KERNELS
from memkit.estimation.autocast import autocast_lists
from memkit.estimation.evidence import advice_for
from memkit.estimation.families import DEFAULT_FAMILY, DeviceFamily, TargetCard, target_card
from memkit.estimation.meta_model import (
    build_meta_model,
    build_target_optimizer,
    refuse_sparse_gradients,
)
from memkit.estimation.meta_step import MetaSession, run_guarded
from memkit.estimation.result import Estimate, EstimateBreakdown, EstimateTrial
from memkit.modelfile import ModelSpec, batch_args, check_seq_len, load_model_file
from memkit.probing.options import DEFAULT_MARGIN, SearchOptions
from memkit.probing.search import SearchResult, Trial, search_max_batch
from memkit.probing.step import StepPlan, check_batch
from memkit.simulated.eager import eager_note, is_compiled

log = logging.getLogger(__name__)

__all__ = ["AMP_DTYPES", "DEFAULT_MARGIN", "autocast_name", "estimate"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_name(amp: str | None) -> str | None:
    """``amp`` as the estimate runs it, for ``--amp`` and ``estimate(amp=...)`` alike: a key of
    :data:`AMP_DTYPES`, or ``None`` for no mixed precision (``None`` or ``"fp32"``); any case.

    Examples:
        >>> autocast_name("BF16"), autocast_name("fp32"), autocast_name(None)
        ('bf16', None, None)
    """
    name = amp.lower() if isinstance(amp, str) else amp
    if name is None or name == "fp32":
        return None
    if not isinstance(name, str) or name not in AMP_DTYPES:
        raise ConfigError(
            f"amp must be one of fp32, {', '.join(AMP_DTYPES)} or None, found {amp!r}"
        )
    return name


def estimate(
    model_file: str | Path | ModelSpec,
    *,
    device_memory: int | str,
    mode: str = "train",
    seq_len: int | None = None,
    amp: str | None = None,
    attention: str = "auto",
    arch: str | DeviceFamily | None = None,
    context: int | str | None = None,
    min_batch: int = 1,
    max_batch: int | None = None,
    margin: float = DEFAULT_MARGIN,
    foreach: bool | None = None,
    workspace: int | str | None = None,
    keep_output: bool = True,
) -> Estimate:
    """Estimate the largest batch of a model file that fits on a GPU, without one.

    (Over 80 lines for its twelve documented arguments and the 25 fields of the
    :class:`Estimate` it returns, written out by name; each step is a helper.)

    Args:
        model_file: a model file's path (see docs/probe.md), or a loaded ``ModelSpec``.
        device_memory: the card's total memory (``"24GiB"``, ``"40GiB"``; ``GB`` is decimal).
        mode: ``"train"`` or ``"infer"``.
        seq_len: passed to ``make_batch(batch_size, seq_len)``.
        amp: ``None`` or ``"fp32"`` (no autocast), ``"bf16"`` or ``"fp16"``: autocast's
            policy on the forward.
        attention: ``"auto"`` (what PyTorch picks on the target), ``"math"``, ``"efficient"``
            or ``"flash"`` (falls back when the inputs do not allow it), or ``"cpu-flash"``
            (PyTorch's CPU kernel: what the simulated device runs, see
            :func:`~memkit.estimation.validation.simulated_peak`).
        arch: the GPU family (a key of :data:`DEVICE_FAMILIES`, as ``--arch``; default
            ``"ampere"``): context, cuBLAS workspace, which attention kernels exist.
        context: the CUDA context's size; default: the family's.
        min_batch, max_batch: bounds of the search (``max_batch`` defaults to 2**20).
        margin: share of the usable memory the recommended batch leaves free.
        foreach: the optimizer's implementation where the model file leaves it unset; ``None``
            means the CUDA default (foreach). ``False`` reproduces the simulated cpu device.
        workspace: one cuBLAS workspace; default: the family's; ``0`` for none.
        keep_output: the step keeps the model's output as a loop's ``out = model(x)`` does
            (probe's default step: through backward, and in inference until the next forward
            returns); ``False``: a loop that keeps only the loss (``loss = model(x).loss``).

    Returns:
        An :class:`Estimate`.

    Raises:
        ConfigError: a bad argument. ModelFileError: an unusable model file.
    """
    started = time.perf_counter()
    search_for = SearchOptions(
        mode=mode, seq_len=seq_len, min_batch=min_batch, max_batch=max_batch, margin=margin
    )
    amp = autocast_name(amp)
    _check_attention(attention)
    card = target_card(DEFAULT_FAMILY if arch is None else arch, device_memory, context, workspace)
    spec = _spec_of(model_file)
    check_seq_len(spec, seq_len)
    model = build_meta_model(spec)
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    weights = _weights_dtype(params)
    assumptions = target_lines(card, mode, amp, num_params, trainable, weights)
    if is_compiled(model):
        assumptions.append(eager_note("the meta step (a TorchDispatchMode)", "on a GPU"))
    rnns = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.RNNBase)})
    if rnns:
        assumptions.append(RNN_NOTE.format(layers=", ".join(rnns)))
    session = _start_session(
        spec, model, card, search_for, amp=amp, attention=attention, foreach=foreach,
        assumptions=assumptions, keep_output=keep_output,
    )  # fmt: skip
    search = search_max_batch(
        _fits(session),
        capacity_bytes=session.usable,
        min_batch=min_batch,
        max_batch=search_for.ceiling,
        margin=margin,
    )
    recommended = _held_recommendation(session, search, margin)
    breakdown = _breakdown(session, recommended or min_batch)
    if session.file_dtypes:  # the file's own torch.autocast("cuda") regions: they decide
        given = "" if amp is None else f" (--amp {amp} outside them)"
        amp = "/".join(sorted(n for n, d in AMP_DTYPES.items() if d in session.file_dtypes))
        assumptions = [
            f"amp: the file's own torch.autocast('cuda', {amp}) regions, autocast's policy "
            f"inside them{given}; op lists from {autocast_lists().source}"
            if line.startswith("amp: ")
            else line
            for line in assumptions
        ]
    if session.cpu_dtypes:
        said = " and ".join(sorted(n for n, d in AMP_DTYPES.items() if d in session.cpu_dtypes))
        assumptions.append(
            f"the file's own torch.autocast('cpu', {said}) regions cast nothing on a GPU (its "
            "tensors are CUDA ones): estimated as the step runs there"
            + (
                ""
                if session.file_dtypes or amp is not None
                else ", in fp32; for mixed precision on the GPU, torch.autocast('cuda', ...) "
                "(--amp estimates it); `memkit probe` on the CPU runs them"
            )
        )
    kernels = tuple(sorted(session.kernels))
    assumptions += outcome_lines(
        attention, kernels, card.family, session.plan.describe(), session.data_checks,
        session.generate_checks,
        search.max_batch_size if search.max_batch_size in session.unstepped else None,
        padded=_padding(spec, seq_len) if session.data_checks else (),
        step_reads=session.step_reads,
    )  # fmt: skip
    fit = search.pairwise or search.model
    return Estimate(
        model_file=spec.path,
        device=card.family.name,
        device_memory=card.total,
        context_bytes=card.context_bytes,
        mode=mode,
        trials=tuple(_trial(t, session) for t in search.trials),
        max_batch_size=search.max_batch_size,
        recommended_batch_size=recommended,
        margin=margin,
        min_batch=min_batch,
        max_batch=max_batch,
        hit_max_batch=search.hit_max_batch,
        seq_len=seq_len,
        amp=amp,
        weights_dtype=weights,
        attention=attention,
        attention_kernels=kernels,
        num_parameters=num_params,
        trainable_parameters=trainable,
        breakdown=breakdown,
        fixed_bytes=None if fit is None else fit.fixed_bytes,
        per_sample_bytes=None if fit is None else fit.per_sample_bytes,
        per_pair_bytes=None if search.pairwise is None else search.pairwise.per_pair_bytes,
        assumptions=tuple(assumptions),
        advice=tuple(advice_for(search, session, breakdown, amp, mode, card)),
        seconds=time.perf_counter() - started,
    )


def _padding(spec: ModelSpec, seq_len: int | None) -> tuple[str, ...]:
    """The masks of a batch make_batch builds on the CPU that hold padding
    (:func:`~memkit.estimation.assumptions.padded_masks`): where a data-dependent check read
    as true took it for a batch without. A make_batch that fails on the CPU (it ran on meta
    already) says nothing here."""
    args = batch_args(PADDING_PROBE_BATCH, seq_len)
    try:
        with torch.device("cpu"):
            return padded_masks(spec.make_batch(*args))
    except Exception:  # (the estimate stands; only this line is not known)
        log.debug("make_batch on the CPU, to look for padding, failed", exc_info=True)
        return ()


def _spec_of(model_file: str | Path | ModelSpec) -> ModelSpec:
    """The :class:`ModelSpec` of ``estimate``'s first argument.

    Raises:
        ConfigError: it is neither a path nor a ``ModelSpec`` (a model object, say).
    """
    if isinstance(model_file, ModelSpec):
        return model_file
    if not isinstance(model_file, str | Path):
        hint = (
            "; to estimate a model object, wrap it: ModelSpec('name', lambda: model, "
            "make_batch) from memkit.modelfile (memkit estimates a meta copy and leaves the "
            "model as it is)"
            if isinstance(model_file, torch.nn.Module)
            else ""
        )
        raise ConfigError(
            "estimate's first argument must be a model file's path or a ModelSpec, found "
            f"{type(model_file).__name__}{hint}"
        )
    with requests_recorded():  # the file's own CUDA autocast objects made at its top
        return load_model_file(model_file)


def _check_attention(attention: str) -> None:
    """The :class:`ConfigError` for an attention choice the target has not."""
    if attention not in ATTENTION_KERNELS:
        raise ConfigError(
            f"attention must be one of {', '.join(ATTENTION_KERNELS)}, found {attention!r}"
        )


def _start_session(
    spec: ModelSpec,
    model: torch.nn.Module,
    card: TargetCard,
    search_for: SearchOptions,
    *,
    amp: str | None,
    attention: str,
    foreach: bool | None,
    assumptions: list[str],
    keep_output: bool = True,
) -> MetaSession:
    """The trials' session: the optimizer (train), make_batch's layout checked, one unaccounted
    warm-up step run (its errors surface before the search; each trial starts from an empty
    optimizer state again). Appends to ``assumptions``."""
    mode, low = search_for.mode, search_for.min_batch
    optimizer = None
    if mode == "train":
        refuse_sparse_gradients(model, spec.path)
        model.train()
        optimizer, optimizer_line = build_target_optimizer(spec, model, foreach)
        assumptions.append(optimizer_line)
    else:
        model.eval()
    plan = _plan(spec, mode, keep_output)
    session = MetaSession(
        spec=spec, model=model, optimizer=optimizer, plan=plan, seq_len=search_for.seq_len,
        usable=card.usable, workspace=card.workspace_bytes,
        policy_dtype=None if amp is None else AMP_DTYPES[amp], attention=attention,
        sm=card.family.sm, keep_output=keep_output,
    )  # fmt: skip
    layout = check_batch(
        session.batch(low), low, f"make_batch({low}) in {spec.path}", bigger=session.batch(low + 1),
        runs=False,  # the estimate's batches are meta tensors
    )  # fmt: skip
    if layout is not None:
        assumptions.append(layout)
    # warm-up (not accounted): the step's errors surface before the search
    run_guarded(lambda: session.warm_up(low), low, session.plan.mode)
    return session


def _plan(spec: ModelSpec, mode: str, keep_output: bool) -> StepPlan:
    """Probe's step, or (``keep_output=False``, training, no ``train_step`` in the file) the
    default step that drops the output once the loss is taken."""
    keep = keep_output or mode != "train" or spec.train_step is not None
    return StepPlan(
        mode, loss_fn=spec.loss_fn, train_step=spec.train_step, eval_step=spec.eval_step,
        keep_output=keep,
    )  # fmt: skip


def _fits(session: MetaSession) -> Callable[[int], tuple[bool, int | None, None, int]]:
    """The search's oracle: a batch fits when the allocator model never ran out and its
    reserved peak is within the usable memory. It aims with the allocated peak, as the probe
    does on CUDA: the reserved peak moves in 2 and 20 MiB segments, so its secants jump."""

    def oracle(batch_size: int) -> tuple[bool, int | None, None, int]:
        peaks = run_guarded(lambda: session.run(batch_size), batch_size, session.plan.mode)
        fits = peaks.ooms == 0 and peaks.reserved <= session.usable
        return fits, peaks.reserved, None, peaks.allocated

    return oracle


def _weights_dtype(params: Sequence[torch.Tensor]) -> str | None:
    """The dtype of most of the model's floating parameter bytes, where it is not float32 (a
    model cast to bf16 whole: ``"bfloat16"``), else ``None``."""
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
    dtype = max(sizes, key=lambda d: sizes[d], default=torch.float32)
    return None if dtype == torch.float32 else str(dtype).removeprefix("torch.")


def _held_recommendation(session: MetaSession, search: SearchResult, margin: float) -> int | None:
    """The search's recommended batch, run where it was interpolated between two measured
    sizes: reserved memory moves in allocator segments, so such a size can break the margin
    (sweep BF: 3860 'leaves 5% free' held 4.8%). Then lowered once by what it overshot, at
    the per-sample rate between it and the measured size below, and from there bisected
    between the largest size that holds and the smallest that does not (eight more steps at
    most; else the largest that held). Before, it went on lowering by the rate: on a flat
    reserved plateau each step moved a little and six missed (sweep BL: 44 recommended of
    426, where 276 held)."""
    size = search.recommended_batch_size
    if size is None or search.recommended_measured:
        return size
    budget = session.usable * (1.0 - margin)

    def over(batch_size: int) -> float:  # bytes above the margin (<= 0: it holds)
        peaks = run_guarded(lambda: session.run(batch_size), batch_size, session.plan.mode)
        return budget + 1 if peaks.ooms else peaks.reserved - budget

    below = [t.batch_size for t in search.trials if t.fits and t.batch_size < size]
    lo = max((b for b in below if session.cache[b].reserved <= budget), default=None)
    excess = over(size)
    if lo is None or excess <= 0:
        return size
    rate = max(1.0, (session.cache[size].reserved - session.cache[lo].reserved) / (size - lo))
    hi, aimed = size, False
    for _ in range(8):
        if hi - lo <= 1:
            break
        step = (lo + hi) // 2 if aimed else hi - math.ceil(excess / rate)
        aimed = True
        size = min(hi - 1, max(lo + 1, step))
        excess = over(size)
        if excess <= 0:
            lo = size
        else:
            hi = size
    return lo


def _breakdown(session: MetaSession, batch_size: int) -> EstimateBreakdown:
    """What the allocated peak of ``batch_size`` is made of."""
    peaks = run_guarded(lambda: session.run(batch_size), batch_size, session.plan.mode)
    return EstimateBreakdown(
        batch_size=batch_size,
        parameters=peaks.parts["parameters"],
        gradients=peaks.parts["gradients"],
        optimizer_state=peaks.parts["optimizer_state"],
        activations=peaks.parts["activations"],
        workspace=peaks.workspace,
        allocator_slack=max(0, peaks.allocated - peaks.workspace - peaks.counted),
    )


def _trial(trial: Trial, session: MetaSession) -> EstimateTrial:
    peaks = session.cache[trial.batch_size]
    return EstimateTrial(
        trial.batch_size, peaks.allocated, peaks.reserved, peaks.counted, trial.fits,
        peaks.seconds, ran_out=peaks.ooms > 0,
    )  # fmt: skip
