"""Probe a model: the largest batch size that fits on a device, the user's objects restored
afterwards.

:func:`probe` works on live objects; :func:`probe_file` loads a model file first. This module
sets a probe up (device, optimizer, the ranks' agreement, the DDP wrapper), hands the search
(:mod:`memkit.probing.search`) its oracle (:class:`memkit.probing.trials.TrialRunner`, one
trial per batch size), tears down and builds the :class:`ProbeResult`. Inside an initialised
process group every rank probes its own device and the ranks agree after each trial (see
:mod:`memkit.probing.ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import logging
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from memkit import cuda_autocast, devices, distributed
from memkit.advice.accumulation import plan_accumulation
from memkit.advice.probe import ModelState, probe_advice
from memkit.devices import CudaBackend, SimulatedBackend, VirtualDeviceBackend, get_backend
from memkit.distributed import is_ddp
from memkit.errors import (
    ConfigError,
    DoesNotFitError,
    MemkitError,
    ModelFileError,
    UserCodeError,
    spelled,
    warn_user,
)
from memkit.modelfile import (
    accepts_seq_len,
    batch_args,
    build_model,
    call_user,
    check_seq_len,
    load_model_file,
    make_optimizer,
    needs_seq_len,
    seq_len_missing,
)
from memkit.oom import is_oom, recover
from memkit.optimizers import state_tensors, steps_in_backward, unwrap_optimizer
from memkit.probing.hooks import ProbeHook
from memkit.probing.options import DEFAULT_MARGIN, MAX_BATCH_CEILING, ProbeOptions
from memkit.probing.ranks import RankSync, agree_settings, wrap_ddp
from memkit.probing.result import ProbeResult, ProbeSweep, ProbeTrial
from memkit.probing.schedule import Schedule
from memkit.probing.search import SearchResult, search_max_batch
from memkit.probing.state import SavedState
from memkit.probing.step import (
    StepPlan,
    batch_shapes,
    check_batch,
    check_batch_grows,
    drawn_lengths,
)
from memkit.probing.trials import (
    Backend,
    TrialCallback,
    TrialRunner,
    first_line,
    larger_shapes,
)
from memkit.progress import TrialProgress
from memkit.simulated.accountant import held_storages
from memkit.simulated.eager import eager_note, is_compiled
from memkit.simulated.fsdp import meta_optimizer_state, optimizer_on_meta, tensor_bytes, unit_sizes
from memkit.units import format_names, format_size

__all__ = [
    "DEFAULT_MARGIN",
    "MAX_BATCH_CEILING",
    "ProbeOptions",
    "probe",
    "probe_file",
    "probe_with",
    "sparse_embeddings",
]

log = logging.getLogger(__name__)


def _uninitialized_lazy_modules(model: torch.nn.Module) -> list[str]:
    """``name (LazyLinear)`` of each lazy module whose parameters are not materialised."""
    from torch.nn.modules.lazy import LazyModuleMixin

    return [
        f"{name or 'the model'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()  # type: ignore[misc]
    ]


def _resolve_backend(
    model: torch.nn.Module, device: str | torch.device | None, budget: int | str | None
) -> Backend:
    params = [p for p in model.parameters()] + [b for b in model.buffers()]
    model_device = devices.tensor_device(params[0]) if params else None
    if device is None and model_device is not None and model_device.type not in ("cpu", "meta"):
        device = model_device
    backend = get_backend(device, budget)
    if backend.device.type == "meta":
        raise ConfigError(
            "device='meta': probe runs real steps and measures them; meta tensors hold no "
            "data. Use memkit.estimate (memkit estimate FILE --device-memory SIZE) for "
            "meta-device estimates, or device='cpu', budget=SIZE for a simulated device that "
            "runs the steps"
        )
    if model_device is not None and model_device.type == "meta":
        raise ConfigError(
            "the model is on the meta device: its tensors hold no data, so no step can run, "
            "and it cannot be moved (there is nothing to copy). Build it on the CPU or the GPU "
            "(device='cpu', budget=SIZE simulates a GPU of that size); memkit.estimate "
            "(memkit estimate) is the tool that runs on meta tensors"
        )
    if isinstance(backend, SimulatedBackend) and backend.device.type == "cpu" and budget:
        host, size = devices.host_memory(), backend.budget
        if host.available is not None and size is not None and size > host.available:
            raise ConfigError(
                f"budget={budget!r}: the simulated cpu device holds real tensors, so it can be "
                f"at most the RAM this machine has available: {format_size(host.available)}; "
                "give a smaller budget (or free some RAM), or use a real GPU (device='cuda')"
            )
    if model_device is not None and model_device.type != backend.device.type:
        raise ConfigError(
            f"the model is on {model_device} but the probe runs on {backend.device}; move it "
            f"first (model.to('{backend.device}')) or pass device='{model_device}'"
        )
    return backend


_LARGE_SEGMENT = 20 << 20  # the caching allocator's segment for requests of 1-10 MiB
_ROUNDING = 2 << 20  # and its rounding of larger ones, each in a segment of its own


def _kept_segments_problem(backend: Backend, model: torch.nn.Module, optimizer: Any) -> str | None:
    """Under a budget on a real GPU, the cap binds new segments only. Segments that live
    tensors keep (cut from a large tensor freed earlier) cannot be given back, and where they
    hold more than the budget every trial's first new segment would fail: "batch 1 does not
    fit" for a step that fits. No trial can be exact then: what to say, and how to get one.
    Free space the weights' own segments leave (a 20 MiB segment's rest, 2 MiB rounding per
    tensor above 10 MiB) is a fresh process's too: the normal answer, not this."""
    if not isinstance(backend, CudaBackend) or backend.device.type != "cuda":
        return None
    if backend.budget is None:
        return None
    backend.empty_cache()
    held, allocated = backend.reserved(), backend.allocated()
    if not allocated <= backend.budget < held:
        return None
    state = list((getattr(optimizer, "state", None) or {}).values())
    tensors = [*model.parameters(), *model.buffers(), *state_tensors(state)]
    big = sum(t.untyped_storage().nbytes() > _LARGE_SEGMENT // 2 for t in tensors)
    if backend.inactive_split() <= _LARGE_SEGMENT + _ROUNDING * big:
        return None
    return (
        f"{format_size(held)} stays reserved on {backend.device} after "
        f"torch.cuda.empty_cache(), in segments that live tensors ({format_size(allocated)}) "
        f"keep, more than the budget ({format_size(backend.budget)}): under a cap at the "
        "budget every new segment would fail, so no trial could answer for a card of that "
        "size. Probe before the large tensor that left them is made (they are cut from its "
        "freed segment), in a fresh process (`memkit probe MODEL_FILE --budget ...`), or "
        "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set before CUDA starts"
    )


def _capacity(backend: Backend) -> int | None:
    """Bytes this process may hold on the device during a trial."""
    cap = backend.capacity()
    if isinstance(backend, SimulatedBackend):
        return cap.total
    if cap.free is None:
        return cap.total
    # what is reserved now stays usable: capacity = reserved + still free
    return min(cap.total or 1 << 62, backend.reserved() + cap.free)


# Long for its signature and its docstring (the API reference, with a doctest); the work is
# probe_with's.
def probe(
    model: torch.nn.Module,
    make_batch: Callable[..., Any],
    *,
    optimizer: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    train_step: Callable[[Any, Any, Any], Any] | None = None,
    eval_step: Callable[[Any, Any], Any] | None = None,
    mode: str = "train",
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    min_batch: int = 1,
    max_batch: int | None = None,
    steps: int = 2,
    margin: float = DEFAULT_MARGIN,
    target_batch: int | None = None,
    seq_len: int | None = None,
    on_trial: TrialCallback | None = None,
    progress: bool = False,
    defaults: Sequence[str] = (),
    ddp: bool = False,
    timeout: float | None = None,
    step_label: str | None = None,
    accumulation: int | None = None,
    keep_output: bool = True,
    prefetch: bool = False,
) -> ProbeResult:
    """Find the largest batch size that fits, exactly, and leave everything as it was.

    Each trial runs ``steps`` full steps (forward, loss, backward, optimizer step) at one batch
    size and measures the peak, and steps on while the memory kept between steps still grows
    (an optimizer's history, up to ``trials.MAX_STEPS``); for a ``train_step`` whose work
    varies from call to call (a generator stepped every n-th call), every trial runs the cycle
    and the step after it (:mod:`memkit.probing.schedule`). The search
    (:mod:`memkit.probing.search`) fits ``peak = fixed + per_sample * batch`` to the trials and
    jumps to the predicted limit, then verifies: the reported size was run and fit, and the
    next size was run and did not.

    The answer is for the step the script runs: with ``accumulation`` (micro-batches per
    optimizer step), an accumulating step, whose gradients live through the next
    micro-batches' forwards; and when ``target_batch`` needs accumulation, the probe searches
    again with the accumulating step and answers for it (the size without accumulation is
    noted in ``defaults``).

    Args:
        model: the model, on the device to probe (or on cpu for the simulated device).
        make_batch: ``make_batch(batch_size)`` (or ``(batch_size, seq_len)``) -> a tensor, a
            tuple/list or a dict of tensors.
        optimizer: stepped in ``train`` mode; ``None`` in train mode means a default AdamW.
        loss_fn: ``loss_fn(output, batch)``; default: ``output.loss``, a scalar output, or the
            sum of the output.
        train_step: ``train_step(model, batch, optimizer)`` replacing the default step.
        eval_step: ``eval_step(model, batch)`` replacing the forward in ``"infer"`` mode (run
            under ``torch.no_grad()``, what it returns dropped); ``train_step`` is not run there.
        mode: ``"train"`` or ``"infer"`` (forward, or ``eval_step``, under
            ``torch.no_grad()``).
        device: default: the model's accelerator, else the current one, else simulated cpu
            (not ``"meta"``: the steps run; :func:`memkit.estimate` is the meta tool).
        budget: cap on the device's memory (on cpu: the simulated device's size).
        min_batch, max_batch: bounds of the search (``max_batch`` defaults to 2**20).
        steps: full steps per trial (2: optimizer state appears on the first).
        margin: share of capacity, in bytes, the recommended size leaves free.
        target_batch: effective batch wanted; adds ``accumulate`` advice.
        seq_len: passed to ``make_batch`` as its second argument.
        on_trial: called after each trial.
        progress: show a live progress line (tqdm: a widget in a notebook, a line on
            standard error in a terminal) with each trial's outcome and the running trial's
            elapsed time.
        ddp: wrap the model in ``DistributedDataParallel`` for the trials, so its gradient
            buckets and gradient all-reduce are measured (needs a process group). A model that
            already is a DDP model is probed as such.
        timeout: seconds to wait for the other ranks at each agreement; ``None`` uses the
            process group's timeout.
        step_label: how the report describes ``train_step`` (default: the model file's).
        accumulation: micro-batches per optimizer step in the script (gradient
            accumulation); ``None`` or 1: none, unless ``target_batch`` needs it.
        keep_output: the default step keeps the model's output until the next forward has
            returned, as ``out = model(x)`` does; ``False``: only the loss, as
            ``loss = model(x).loss`` (transformers' ``Trainer``) does.
        prefetch: the accumulating script fetches all of an optimizer step's micro-batches
            onto the device before running them (transformers 5's ``Trainer`` with
            ``gradient_accumulation_steps``): the trials hold them so; without accumulation,
            the script makes each batch before letting the last go (``batch =
            buffer.sample(n)`` on the device): the trials hold the last while the next is
            made.

    Inside an initialised process group every rank must call ``probe`` with the same options:
    each probes its own device, the ranks agree after every trial (a size fits only if it fits
    on every rank) and all return the same answer, with each rank's peak in
    ``per_rank_peaks``. See docs/distributed.md.

    Returns:
        A :class:`ProbeResult`. Raises :class:`UserCodeError` when the step raises anything
        that is not an OOM (it is never retried); under a process group the other ranks raise
        :class:`~memkit.errors.DistributedError`.

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> result = memkit.probe(model, lambda n: torch.randn(n, 256), device="cpu",
        ...                       budget="16MiB")
        >>> result.trial(result.max_batch_size).fits, result.trial(result.max_batch_size + 1).fits
        (True, False)
    """
    options = ProbeOptions(
        mode=mode, seq_len=seq_len, min_batch=min_batch, max_batch=max_batch, steps=steps,
        margin=margin, target_batch=target_batch, accumulation=accumulation, ddp=ddp,
        timeout=timeout, keep_output=keep_output, prefetch=prefetch,
    )  # fmt: skip
    return probe_with(
        model, make_batch, options, optimizer=optimizer, loss_fn=loss_fn, train_step=train_step,
        eval_step=eval_step, device=device, budget=budget, on_trial=on_trial, progress=progress,
        defaults=defaults, step_label=step_label,
    )  # fmt: skip


def probe_with(
    model: torch.nn.Module,
    make_batch: Callable[..., Any],
    options: ProbeOptions,
    *,
    optimizer: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    train_step: Callable[[Any, Any, Any], Any] | None = None,
    eval_step: Callable[[Any, Any], Any] | None = None,
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    on_trial: TrialCallback | None = None,
    progress: bool = False,
    defaults: Sequence[str] = (),
    step_label: str | None = None,
    model_file: str | None = None,
) -> ProbeResult:
    """:func:`probe` with its search and trials as one :class:`ProbeOptions` (what the command
    line and Lightning's ``probe_batch_size`` build); the other arguments as in :func:`probe`.

    Before any trial, the batches for ``min_batch`` and ``min_batch + 1`` are made (the RNG
    left as it was) and checked: with ``model_file`` (the file ``make_batch`` comes from), as
    the model-file protocol asks (:func:`~memkit.probing.step.check_batch`); without it, only
    that they differ (:func:`~memkit.probing.step.check_batch_grows`)."""
    opts = options
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model must be a torch.nn.Module, found {type(model).__name__}: the probe saves "
            "and restores its parameters, buffers and training flags around the trials; pass "
            "the module (a plain function can be wrapped in one)"
        )
    lazy = _uninitialized_lazy_modules(model)
    if lazy:
        raise ConfigError(
            f"the model has lazy modules with no parameters yet ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): their weights get a shape at the first "
            "forward, so there is nothing to measure or restore. Run one forward on a batch "
            "before probing (in a model file: at the end of build_model)"
        )
    _check_make_batch(make_batch, opts.seq_len)
    backend = _resolve_backend(model, device, budget)
    checked, varying, per_sample, lengths = _check_batches(make_batch, opts, model_file)
    defaults = [*checked, *defaults]
    outside = _held_outside(make_batch, model)
    defaults += _outside_notes(outside, isinstance(backend, SimulatedBackend))
    optimizer, defaults = _resolve_optimizer(model, optimizer, opts.mode, defaults)
    said = any(d.startswith("held through the trials") for d in defaults)
    if opts.mode == "infer" and not said and any(p.grad is not None for p in model.parameters()):
        defaults.append(
            "held through the trials: the gradients the model has, as during an evaluation "
            "inside training (model.zero_grad(set_to_none=True) before probing: the answer "
            "of an evaluation without them)"
        )
    compiled = (  # the model, or the step a model file compiled (sweep BR: no note)
        is_compiled(model)
        or any(hasattr(f, "_torchdynamo_orig_callable") for f in (train_step, eval_step, loss_fn))
    )
    if isinstance(backend, SimulatedBackend | VirtualDeviceBackend) and compiled:
        defaults.append(eager_note("the simulated device (a TorchDispatchMode)", "on a GPU"))
    sparse = sparse_embeddings(model) if opts.mode == "train" else []
    if sparse:
        defaults.append(
            f"sparse gradients ({format_names(sparse)}): their bytes depend on the batch's "
            "values (a row per index looked up, repeats included: torch does not coalesce "
            "them; the optimizer's sparse work on the distinct rows too), so the answer holds "
            "for batches like make_batch's; one that looks up more (longer bags of multi-hot "
            "features) needs more: keep the recommended margin"
        )
    if budget is None and isinstance(backend, SimulatedBackend) and backend.device.type == "cpu":
        defaults.append(
            f"simulated device: {format_size(backend.budget)} (default; --budget to change)"
        )
    if isinstance(backend, SimulatedBackend):  # (with the modules held beside the model)
        backend.track(model, optimizer, *(h for _, _, h in outside if _is_module(h)))
    problem = _kept_segments_problem(backend, model, optimizer)
    if distributed.is_distributed() and distributed.any_true(
        problem is not None, timeout=opts.timeout
    ):  # every rank stops (the others would wait for it in the settings' agreement)
        problem = problem or (
            "another rank's GPU keeps segments above the budget that empty_cache() cannot give "
            "back (its error says how much): no rank can answer for a card of that size"
        )
    if problem is not None:
        raise ConfigError(problem)
    capacity = _capacity(backend)
    capacities = _agree_across_ranks(model, backend, capacity, opts)
    if opts.accumulation not in (None, 1) and capacities is not None:
        raise ConfigError(
            "gradient accumulation is not probed across ranks yet; probe one rank's step "
            "without a process group"
        )
    plan = StepPlan(
        opts.mode, loss_fn=loss_fn, train_step=train_step, eval_step=eval_step,
        step_label=step_label, accumulation=opts.accumulation or 1, keep_output=opts.keep_output,
        counted_per_op=isinstance(backend, SimulatedBackend), prefetch=opts.prefetch,
    )  # fmt: skip
    own = plan.user_step
    if not opts.keep_output and own is not None:
        raise ConfigError(
            "--keep loss (keep_output=False) changes what the default step keeps; this probe "
            f"runs the model file's {own}, which keeps what its own code keeps: leave "
            f"--keep out, or drop the output inside {own}"
        )
    # an infer trial never steps the optimizer: its state is held, not saved and put back
    saved = SavedState(model, optimizer if opts.mode == "train" else None)
    target = _wrap_agreed(model, backend, opts.timeout) if opts.ddp and not is_ddp(model) else model
    ranked_ddp = capacities is not None and is_ddp(target)
    sync = RankSync(target, optimizer, opts.timeout) if ranked_ddp else None
    label = f"memkit probe ({opts.mode}" + (f", seq {opts.seq_len})" if opts.seq_len else ")")
    bar = TrialProgress(label) if progress else None
    aim_at = capacity if capacities is None else _tightest(capacities)

    held: list[Any] = [target, sync]  # emptied before the clean-up: a DDP wrapper made here
    del target, sync
    started = None if bar is None else bar.started
    held_after_oom: dict[int, int] = {}
    largest_inputs: dict[int, list[tuple[int, ...]]] = {}
    untrained: list[int] = []
    plain_trials: tuple[ProbeTrial, ...] = ()  # the first search's, when the answer accumulates

    def search_with(
        step: StepPlan, top: int
    ) -> tuple[SearchResult, list[ProbeTrial], Schedule | None]:
        runner = TrialRunner(
            held[0], make_batch, optimizer, step, backend, opts.steps, capacity, saved,
            opts.seq_len, _both(on_trial, bar), held[1], capacities, opts.timeout, started,
        )  # fmt: skip
        search = functools.partial(
            search_max_batch, runner, capacity_bytes=aim_at, min_batch=opts.min_batch,
            max_batch=top, margin=opts.margin,
        )  # fmt: skip
        try:
            found = _retested(runner, search(), search)
            history = [
                dataclasses.replace(r, superseded=True) if runner.superseded(i) else r
                for i, r in enumerate(runner.history)
            ]
            schedule = runner.schedule
        finally:
            held_after_oom.update(runner.held_after_oom)
            for size, shapes in runner.largest_inputs.items():  # (both searches': the larger)
                largest_inputs[size] = larger_shapes(largest_inputs.get(size), shapes)
            if runner.untrained is not None:
                untrained.append(runner.untrained)
            del runner, search  # before the next search and the clean-up
        return found, history, schedule

    on_gpu = backend.device.type == "cuda"
    watch: contextlib.AbstractContextManager[set[torch.dtype]] = (
        contextlib.nullcontext(set()) if on_gpu else cuda_autocast.regions_entered()
    )
    stepped = [0]
    ours = {  # (Accelerate's wraps one; SAM and Lookahead step a base optimizer)
        id(o)
        for o in (optimizer, unwrap_optimizer(optimizer), *_base_optimizers(optimizer))
        if o is not None
    }

    def count_step(stepping: Any, *_: Any) -> None:
        if id(stepping) in ours:
            stepped[0] += 1

    counting = (
        register_optimizer_step_post_hook(count_step)
        if opts.mode == "train" and optimizer is not None
        else None
    )
    caching = [False]
    cache_look = _returns_keys(model, caching) if opts.mode == "train" else None
    with watch as half_regions, _probing(model, opts.mode, saved, backend, bar):
        try:
            search, history, schedule = search_with(plan, opts.ceiling)
            in_backward = _steps_in_backward(model)
            # a train_step that accumulates itself: its trials ran that accumulation already
            own_calls = _calls_per_step(schedule) if plan.accumulation == 1 else 1
            steps_advised = (
                None
                if in_backward or own_calls > 1
                else _advised_accumulation(search, opts, capacities, plan)
            )
            if capacities is not None and _advised_accumulation(search, opts, None, plan):
                # (sweep BW: under torchrun the advice's accumulation ran out at the
                # recommended size, and nothing said the answer was not for it)
                defaults.append(
                    "accumulation: the answer is for a step that does not accumulate "
                    "(accumulation is not probed across ranks yet); the accumulating step the "
                    "advice gives fits less (the first micro-batch's gradients live through "
                    "the next ones' forwards): probe one rank's step without a process group "
                    f"with {spelled('--accumulate K', 'accumulation=K')} for its answer"
                )
            if steps_advised is not None and search.max_batch_size is not None:
                # the advice accumulates: answer for the accumulating step
                defaults.append(_without_accumulation(search.max_batch_size, history))
                plain_trials = _timed_trials(search, history)
                plan = dataclasses.replace(plan, accumulation=steps_advised)
                search, history, schedule = search_with(plan, search.max_batch_size)
                # the advice's steps for the accumulating answer (2 micro-batches stand for
                # any k >= 2: the report names the k the advice gives, not the first guess)
                final = _advised_accumulation(
                    search, opts, capacities, dataclasses.replace(plan, accumulation=1)
                )
                if final is not None:
                    plan.accumulation = final  # (in place: the search's loss_rule stays)
        finally:
            held.clear()
            for handle in (counting, cache_look):
                if handle is not None:
                    handle.remove()
    if counting is not None and not stepped[0] and any(t.fits for t in search.trials):
        defaults = [
            f"{d}: passed to the step, which never stepped it (what optimizers of its own keep "
            "is counted as the step makes it)"
            if d.startswith("optimizer:")
            else d
            for d in defaults
        ]
    if half_regions:
        defaults.append(_autocast_note(half_regions, backend, model_file))
    if caching[0]:
        defaults.append(
            "use_cache: each training forward also returned every layer's keys and values "
            "(the model's config has use_cache=True): mostly storages backward keeps anyway, "
            "which a held output keeps past backward (the answer moves little where the peak "
            "is before that: sweep CQ, a Llama and a T5 answered the same either way); "
            "transformers 5's Trainer sets it to False (TrainingArguments.use_cache; 4.x's "
            "keeps the config's): to answer for it, set model.config.use_cache = False in "
            "build_model()"
        )
    dropouts = _dropouts(model) if not on_gpu and opts.mode == "train" else (0, 0, 0)
    if any(dropouts) and (note := _dropout_note(*dropouts, backend, model_file)):
        defaults.append(note)
    unfit = search.max_batch_size is None and opts.mode == "train" and capacities is None
    weights = tensor_bytes(list(model.parameters()))
    last = history[-1].batch_size if history else None
    defaults += _held_notes(held_after_oom, weights, last)
    if varying and search.max_batch_size is not None:
        defaults.append(
            _drawn_note(
                search.max_batch_size, largest_inputs, varying, history, per_sample, lengths
            )
        )
    if untrained:
        defaults.append(
            f"warning: the training step left the parameters unchanged (batch {untrained[0]}): "
            "no optimizer step ran (a train_step without optimizer.step(), or without "
            "backward), so no update and perhaps no gradients or optimizer state were "
            "counted; a training loop that steps may fit far less"
        )
    if saved.kept_as_made:
        defaults.append(
            "restored: parameters, gradients, optimizer state and schedulers, training flags and "
            f"RNG; left as the model remade them (another shape): {', '.join(saved.kept_as_made)}"
        )
    return _build_result(
        search, history, backend, plan, opts, defaults, capacities,
        batch_norm=_has_batch_norm(model), ddp=opts.ddp or is_ddp(model),
        steps_in_backward=_steps_in_backward(model), shapes_vary=bool(varying),
        state=_model_state(model, optimizer) if unfit else None, schedule=schedule,
        trials_without_accumulation=plain_trials, calls_per_step=own_calls,
    )  # fmt: skip


def _autocast_note(dtypes: set[torch.dtype], backend: Backend, model_file: str | None) -> str:
    """What the step's own CUDA autocast regions did on a device that is not CUDA."""
    said = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    how = (
        f"`memkit estimate {model_file} --device-memory SIZE` runs them as a GPU would"
        if model_file
        else "memkit.estimate runs them as a GPU would"
    )
    return (
        f"the step's torch.autocast('cuda', {said}) regions cast nothing on "
        f"{backend.device.type}: these are float32 numbers; on a GPU those regions run in "
        f"{said}, and more fits ({how})"
    )


def _base_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers a wrapper steps in its own step (SAM's ``base_optimizer``, timm's
    Lookahead's ``_base_optimizer``, a wrapper's ``optimizer``)."""
    names = ("optimizer", "_optimizer", "base_optimizer", "_base_optimizer")
    return [
        getattr(optimizer, name) for name in names if getattr(optimizer, name, None) is not None
    ]


def _returns_keys(module: torch.nn.Module, seen: list[bool]) -> Any:
    """A forward hook on ``module`` that sets ``seen[0]`` where a training forward returns each
    layer's keys and values (a transformers model whose config has ``use_cache=True``)."""

    def look(mod: torch.nn.Module, args: Any, out: Any) -> None:
        # a training forward (not generate()'s, which runs under no_grad) of a model whose
        # config asks for the cache; the output's key is "cache" from transformers 5 on
        if seen[0] or not (mod.training and torch.is_grad_enabled() and isinstance(out, dict)):
            return
        config = getattr(getattr(mod, "module", mod), "config", None)
        if getattr(config, "use_cache", False) is True:
            # (read as a dict: transformers 5's output answers for the old name with a
            # deprecation message to the script's log; sweep BK)
            seen[0] = any(dict.get(out, key) is not None for key in ("cache", "past_key_values"))

    return module.register_forward_hook(ProbeHook(look))  # (copied inert: an EMA's deepcopy)


def _dropouts(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(layers, between, attention)``: the model's dropout layers that drop something
    (``p > 0``), the dropouts its RNNs run between their stacked layers (``LSTM(...,
    num_layers=3, dropout=0.2)``: two), and its attentions with dropout on their weights
    (``nn.MultiheadAttention(dropout=0.1)``, ``nn.TransformerEncoderLayer``'s; a module with
    an ``attn_dropout`` layer: GPT-2's, nanoGPT's)."""
    layers = between = attention = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and 0 < m.p < 1:
            layers += 1
        elif isinstance(m, torch.nn.RNNBase) and 0 < m.dropout < 1:
            between += m.num_layers - 1
        weights = m.dropout if isinstance(m, torch.nn.MultiheadAttention) else None
        if isinstance(d := getattr(m, "attn_dropout", None), torch.nn.modules.dropout._DropoutNd):
            weights = d.p  # (GPT-2's, nanoGPT's attention)
        if weights is not None and 0 < weights < 1:
            attention += 1
    return layers, between, attention


def _dropout_note(
    layers: int, between: int, attention: int, backend: Backend, model_file: str | None
) -> str:
    """What the model's dropout keeps on a device that is not CUDA (its non-fused kernel), and
    what an attention with dropout keeps there (sweep CA: a Transformer answered 3 with
    dropout and 18 without, and the note spoke of masks only)."""
    how = (
        f"`memkit estimate {model_file} --device-memory SIZE` runs CUDA's"
        if model_file
        else "memkit.estimate runs CUDA's"
    )  # (not cuDNN's RNN kernels: the estimate says so of a model with RNNs)
    which = [f"{layers} dropout layer(s)"] if layers else []
    if between:
        which.append(f"{between} dropout(s) between an RNN's stacked layers (its dropout=)")
    cuda = " and ".join(
        (["CUDA's fused kernel keeps a 1-byte one"] if layers else [])
        + (["cuDNN's RNN keeps its own in its workspace"] if between else [])
    )
    scores = (
        f"{attention} attention(s) with dropout on their weights run "
        "scaled_dot_product_attention's math kernel on the CPU, which keeps every head's "
        "length x length weights for backward, where a GPU's memory-efficient kernel keeps "
        f"none: with long sequences most of the gap ({how} attention kernels, "
        "docs/simulated-device.md)"
        if attention and backend.device.type == "cpu"
        else ""
    )
    if not which:
        return f"dropout: the model's {scores}" if scores else ""
    return (
        f"dropout: the model's {' and '.join(which)} keep a mask of their input's dtype on "
        f"{backend.device.type} for backward (4 bytes an element in float32), where {cuda}: "
        f"a GPU holds less for them, and may fit more"
        + (f" ({how} dropout layers)" if layers else "")
        + (f"; and {scores}" if scores else "")
    )


def _retested(
    runner: TrialRunner,
    found: SearchResult,
    resume: Callable[..., SearchResult],
) -> SearchResult:
    """``found``; or, while its answer fit only over fewer steps than the step's cycle needs
    (it ran before a later trial saw the step's work vary), the search resumed from the trials
    that still hold (every failure, the fits over the cycle), starting at that answer: a size
    that fit too early is run again, never reported untested. The result's trials are all the
    trials run, in order."""
    while found.max_batch_size is not None and runner.answer_superseded(found.max_batch_size):
        assert len(found.trials) == len(runner.history)  # one record per trial, in order
        known = [t for i, t in enumerate(found.trials) if not runner.superseded(i)]
        again = resume(start=found.max_batch_size, known=known)
        found = dataclasses.replace(again, trials=found.trials + again.trials[len(known) :])
    return found


def sparse_embeddings(model: torch.nn.Module) -> list[str]:
    """The trainable ``nn.Embedding``/``nn.EmbeddingBag`` modules with ``sparse=True`` (their
    gradients are sparse), by name."""
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        and module.sparse
        and module.weight.requires_grad
    ]


def _held_notes(
    held_after_oom: dict[int, int], weights: int = 0, last: int | None = None
) -> list[str]:
    """The report's lines for memory failed trials left held (``TrialRunner.held_after_oom``),
    by batch size. Where it is one to three copies of the model's parameters (``weights``) it
    is likely state the script made in that trial, at a step count the trials reached (sweep
    BV: an SWA copy made at epoch 2 was called a leftover, and the answer "may be below" what
    fits, where it was 28% above): a line each. The other leftovers share one line (sweep CN:
    a model file's global list of losses gave ten near-identical paragraphs). ``last``: the
    size of the search's last trial, after which no trial had less room (sweep CP: "the
    trials after it had that much less room" where none followed, and the answer was exact)."""
    lines: list[str] = []
    left: list[tuple[int, int]] = []
    for batch_size, held in sorted(held_after_oom.items()):
        copies = round(held / weights) if weights else 0
        if not (1 <= copies <= 3 and abs(held - copies * weights) <= 0.02 * held):
            left.append((batch_size, held))
            continue
        lines.append(
            f"after the OOM at batch {batch_size}, {format_size(held)} stayed allocated, held "
            "by the model or the script (not by memkit) even after a step at the smallest size "
            f"that fit: the size of {_copies(copies)}'s parameters, so likely state the script "
            "made then, at a step count the trials reached (an SWA or EMA copy, an optimizer "
            "made after a warmup), which its loop keeps from then on: trials before it ran "
            "without it. If the script makes it at a later "
            "step of its own, the answer holds only for the steps before; probe with "
            f"{spelled('--steps N', 'steps=N')} past that step"
        )
    if len(left) == 1 and left[0][0] == last:
        ((batch_size, held),) = left
        return [
            *lines,
            f"after the OOM at batch {batch_size} (the last trial), {format_size(held)} stayed "
            "allocated, held by the model or the script (not by memkit) even after a step at "
            "the smallest size that fit; no trial ran after it. Keep no tensor of a step "
            "(outputs, losses) beyond the next step",
        ]
    if len(left) == 1:
        ((batch_size, held),) = left
        said = f"after the OOM at batch {batch_size}, {format_size(held)} stayed allocated"
        after = "the trials after it"
    elif left:
        sizes = ", ".join(str(b) for b, _ in left)
        low, high = min(h for _, h in left), max(h for _, h in left)
        said = (
            f"after each of {len(left)} OOM trials (batch {sizes}), {format_size(low)} to "
            f"{format_size(high)} stayed allocated"
        )
        after = "the trials after each"
    if left:
        lines.append(
            f"{said}, held by the model or the script (not by memkit) even after a step at the "
            f"smallest size that fit: {after} had that much less room, so the answer may be "
            "below what a fresh process fits. Keep no tensor of a step (outputs, losses) beyond "
            "the next step; a list the step appends to in the model file's globals or in a "
            "class attribute keeps them from trial to trial (memkit puts the model's instance "
            "attributes back before each trial, not those)"
        )
    return lines


def _copies(n: int) -> str:
    """``"the model"`` or ``"2 copies of the model"``."""
    return "the model" if n == 1 else f"{n} copies of the model"


def _model_state(model: torch.nn.Module, optimizer: Any) -> ModelState | None:
    """What the model holds whatever the batch, for the sharding advice when no batch fit:
    its parameters and buffers, its trainable parameters' gradients, and its optimizer's
    state after one step measured on meta copies (no device memory)."""
    twin = None if optimizer is None else optimizer_on_meta(optimizer)
    state = None if twin is None else meta_optimizer_state(twin)
    if state is None:
        return None
    return ModelState(
        parameter_bytes=tensor_bytes([*model.parameters(), *model.buffers()]),
        gradient_bytes=tensor_bytes([p for p in model.parameters() if p.requires_grad]),
        optimizer_state_bytes=state,
        units=tuple(unit_sizes(model)),
    )


def _advised_accumulation(
    search: SearchResult,
    opts: ProbeOptions,
    capacities: tuple[int | None, ...] | None,
    plan: StepPlan,
) -> int | None:
    """The accumulation steps the ``accumulate`` advice will give when the probe ran a step
    that does not accumulate; ``None`` when it gives none (or across ranks, not probed yet)."""
    micro, target_batch = search.recommended_batch_size, opts.target_batch
    if target_batch is None or micro is None or plan.accumulation > 1 or plan.mode != "train":
        return None
    if capacities is not None:
        return None
    steps = plan_accumulation(target_batch, micro).steps
    return steps if steps > 1 else None


def _without_accumulation(best: int, history: list[ProbeTrial]) -> str:
    """The report's line on the first search, when the answer is for an accumulating step."""
    above = next((t for t in reversed(history) if t.batch_size == best + 1), None)
    bracket = f", {best + 1} does not" if above is not None and not above.fits else ""
    return (
        f"without accumulation: {best} fits{bracket} ({len(history)} trials); accumulating "
        "keeps gradients alive through the micro-batches' forwards, so the answer above is for "
        "the accumulating step the advice gives"
    )


def _check_make_batch(make_batch: Callable[..., Any], seq_len: int | None) -> None:
    """The :class:`ConfigError` when ``make_batch`` is not a function of the batch size (and
    of the sequence length, when one is given)."""
    if not callable(make_batch):
        raise ConfigError(
            f"make_batch must be a function make_batch(batch_size) -> batch, found "
            f"{type(make_batch).__name__}"
        )
    if seq_len is not None and not accepts_seq_len(make_batch):
        raise ConfigError(
            f"{spelled(f'--seq-len {seq_len}', f'seq_len={seq_len}')} was given but make_batch "
            "takes no seq_len argument; define make_batch(batch_size, seq_len)"
        )
    if seq_len is None and needs_seq_len(make_batch):
        raise ConfigError(f"make_batch {seq_len_missing(make_batch)}")
    try:
        signature = inspect.signature(make_batch)
    except (TypeError, ValueError):  # a builtin without one: its call will tell
        return
    try:
        signature.bind(1, *([] if seq_len is None else [seq_len]))
    except TypeError as error:
        call = "make_batch(batch_size)" if seq_len is None else "make_batch(batch_size, seq_len)"
        other = (
            f", or make_batch(batch_size, seq_len) and give {spelled('--seq-len N', 'seq_len=N')}"
            if seq_len is None
            else ""
        )
        raise ConfigError(
            f"make_batch cannot be called as {call}: its signature is {signature} ({error}); "
            f"define {call}{other}"
        ) from error


def _held_outside(
    make_batch: Callable[..., Any], model: torch.nn.Module
) -> list[tuple[str, int, Any]]:
    """``(name, bytes, value)`` of what ``make_batch``'s module holds of 1 MiB or more outside the
    model, in tensors: its globals, the attributes of its own objects (``rb.obs``), lists and
    deques of tensors or of tuples of them (a replay buffer's transitions), other modules (an
    EMA copy of the model); largest first. Sweep CD: a DQN model file's replay buffer as
    globals was counted nowhere, the answer 1863 where its loop, the buffer on the device,
    fits 1563; sweep CG: a ViT's EMA copy, alive through its validation, 130 for 122."""
    scope = getattr(inspect.unwrap(make_batch), "__globals__", None)
    if not isinstance(scope, dict):
        return []
    weights = {
        t.untyped_storage().data_ptr()
        for t in itertools.chain(model.parameters(), model.buffers())
        if type(t) in (torch.Tensor, torch.nn.Parameter)
    }

    def model_own(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in weights

    def weights_of(value: Any) -> Any:  # a module's tensors, else the value
        if isinstance(value, torch.nn.Module):
            return [*value.parameters(), *value.buffers()]
        return value

    found: list[tuple[str, int, Any]] = []
    for name, value in list(scope.items()):
        if name.startswith("_") or isinstance(value, (type, types.ModuleType)):
            continue
        if callable(value) and not isinstance(value, torch.nn.Module):
            continue
        parts = [(name, value)]
        if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor | torch.nn.Module):
            parts = [(f"{name}.{k}", v) for k, v in list(vars(value).items())[:50]]
        for label, held in parts:
            size = sum(held_storages(weights_of(held), model_own).values())
            if size >= 1 << 20:
                found.append((label, size, held))
    return sorted(found, key=lambda f: -f[1])[:4]


def _is_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module)


def _outside_notes(found: list[tuple[str, int, Any]], simulated: bool) -> list[str]:
    """The notes on what the model file holds outside the model: on the simulated device,
    modules (an EMA copy) are counted in every trial, as the script keeps them beside the
    model (a GPU counts what is on it); tensors (a replay buffer, a dataset) may live on the
    host, and are not."""
    notes = []
    modules = [(n, s) for n, s, h in found if _is_module(h)]
    tensors = [(n, s) for n, s, h in found if not _is_module(h)]
    if modules:
        names = ", ".join(f"`{name}` ({format_size(size)})" for name, size in modules)
        notes.append(
            f"held outside the model: {names}, a module the model file keeps as a global (an "
            "EMA copy, a reference model): "
            + (
                "counted in every trial, as on the device beside the model; one the script "
                "keeps on the host, or never uses, is not: name it with a leading `_` to leave "
                "it out"
                if simulated
                else "the trials count what of it is on the device"
            )
        )
    if tensors:
        names = ", ".join(f"`{name}` ({format_size(size)})" for name, size in tensors)
        notes.append(
            f"held outside the model: {names}, tensors the model file keeps as globals (a "
            "replay buffer, a dataset): the trials do not count them. Where the script keeps "
            "them on the device, register them on the model (`model.register_buffer(...)` in "
            "build_model) to have the probe count them, or take their bytes off the device's "
            "size"
        )
    return notes


def _check_batches(
    make_batch: Callable[..., Any], opts: ProbeOptions, model_file: str | None
) -> tuple[list[str], tuple[int, ...], bool, bool]:
    """Make the batches for ``min_batch`` and ``min_batch + 1`` (twice: the RNG states as they
    were after) and check them; the notes for a batch dimension that is not the first and
    for batches whose shapes vary at one size (random lengths), which of their tensors (by
    place in :func:`batch_shapes`) do, whether the batch is a list of samples (one more
    tensor a sample: a detector's images of their own sizes), and whether it carries
    per-sample lengths that vary (:func:`~memkit.probing.step.drawn_lengths`)."""
    low, where = opts.min_batch, f"make_batch({opts.min_batch})"
    rng = devices.rng_state()
    try:
        small, big, again = (
            _sample_batch(make_batch, n, opts.seq_len, model_file) for n in (low, low + 1, low + 1)
        )
    finally:
        devices.restore_rng_state(rng)
    first, second = batch_shapes(big), batch_shapes(again)
    varies = first != second
    varying = (
        tuple(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
        if len(first) == len(second)
        else tuple(range(len(first)))
    )
    if model_file is not None:
        layout = check_batch(small, low, f"{where} in {model_file}", bigger=big, varies=varies)
    else:
        layout = check_batch_grows(small, big, low, where)
    notes = [] if layout is None else [layout]
    if varies:
        notes.append(
            f"make_batch({low + 1}) gave batches of different shapes at one size "
            f"({_shapes_text(first)}, then {_shapes_text(second)}): random lengths, so memory "
            f"follows the batch drawn and the answer holds for the draws the trials ran "
            f"({opts.steps} a trial, {spelled('--steps', 'steps=')}); a longer draw can run out "
            "below it, at the "
            "recommended size too (its margin is not sized to the spread): probe with more "
            f"draws ({spelled('--steps 20', 'steps=20')}), or bound the lengths (pad or cap them)"
        )
    padded = drawn_lengths(big, again, low + 1)
    if padded is not None and not varies:
        notes.append(
            f"make_batch({low + 1}) drew other per-sample lengths at one size (a tensor of "
            f"lengths up to the padded {padded}, as `pack_padded_sequence` takes): packed "
            "sequences' memory follows the lengths, not the padded shape, so the answer "
            f"holds for the draws the trials ran ({opts.steps} a trial); a draw with more long "
            "samples can run out below it, at the recommended size too: probe with more draws "
            f"({spelled('--steps 20', 'steps=20')}), or a make_batch whose lengths are the "
            "longest your data puts in one batch"
        )
    per_sample = len(first) > len(batch_shapes(small))
    return notes, varying, per_sample, padded is not None


def _drawn_note(
    answer: int,
    largest: dict[int, list[tuple[int, ...]]],
    varying: tuple[int, ...],
    history: Sequence[ProbeTrial],
    per_sample: bool = False,
    lengths: bool = False,
) -> str:
    """What the trials drew at the answer and at the smallest size that ran out, for a
    ``make_batch`` of random shapes: the largest of the tensors whose shapes vary (``varying``,
    by place; a VLM's fixed images are not what varies) (sweep BI: answers of 6 to 8 from one
    script, the lengths behind them named nowhere). For a list of samples (``per_sample``) it
    is the padded batch, each dimension's largest over the list: what a detector's
    collate makes of images of their own sizes (sweep BO: the largest single image was named,
    of the first two places only). With per-sample ``lengths`` (packed sequences) a batch no
    larger can hold more tokens (sweep CA: 104x800 from the real data ran out where the
    probe's 104x800 fit)."""

    def drawn_at(size: int) -> str:
        drawn = largest.get(size) or []
        shapes = [drawn[i] for i in varying if i < len(drawn)] or drawn
        top = max(shapes, key=math.prod, default=None)
        if top is None:
            return "inputs of shapes not recorded"
        alike = [s for s in drawn if len(s) == len(top)] if per_sample else []
        if len(alike) < 2:
            return f"inputs up to {'x'.join(map(str, top))}"
        padded = "x".join(str(max(dims)) for dims in zip(*alike, strict=True))
        n = len(alike)
        return f"{n} inputs whose dimensions reach {padded} ({n}x{padded} padded together)"

    failed = min((t.batch_size for t in history if not t.fits and t.batch_size > answer),
                 default=None)  # fmt: skip
    ran_out = f"; {failed} ran out with {drawn_at(failed)}" if failed is not None else ""
    holds = (
        "with per-sample lengths in the batch (packed sequences) memory follows the tokens, "
        "not the padded shape: a batch no larger with more long samples can run out below it"
        if lengths
        else "it holds for batches no larger than that"
    )
    return (
        f"shapes drawn: the answer, {answer}, fit with {drawn_at(answer)} (the largest its "
        f"trials drew of the tensors whose shapes vary){ran_out}: {holds}"
    )


def _shapes_text(shapes: list[tuple[int, ...]]) -> str:
    return " ".join("x".join(map(str, s)) or "scalar" for s in shapes)


def _sample_batch(
    make_batch: Callable[..., Any], batch_size: int, seq_len: int | None, model_file: str | None
) -> Any:
    args = batch_args(batch_size, seq_len)
    what = f"make_batch({', '.join(map(str, args))})"
    if model_file is not None:
        return call_user(make_batch, *args, what=what, path=model_file)
    try:
        return make_batch(*args)
    except Exception as exc:
        if is_oom(exc):
            raise
        raise UserCodeError(f"{what} raised {type(exc).__name__}: {exc}", exc) from exc


def _steps_in_backward(model: torch.nn.Module) -> bool:
    """Whether every trainable parameter of the model is stepped by its post-accumulate-grad
    hooks: an optimizer step fused into backward (each parameter stepped, its gradient
    freed), which no loop can accumulate over micro-batches (sweep BH; a hook that checks or
    logs the gradient steps nothing: review)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return bool(trained) and all(map(steps_in_backward, trained))


def _has_batch_norm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def with_optimizer_state(optimizer: Any) -> str | None:
    """Give ``optimizer`` the state its first step creates (Adam's moments, a momentum
    buffer): one step on zero gradients at a learning rate of 0 (the weights stay, except
    where an optimizer ignores the rate: Adafactor's relative step moves the probe's own
    copy a little, which changes no memory), then the gradients go. Returns why no state
    could be made (an optimizer that refuses dense gradients), else ``None``."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    rates = [g.get("lr") for g in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, rates, strict=True):
        if isinstance(lr, torch.Tensor):
            group["lr"] = torch.zeros_like(lr)
        elif isinstance(lr, float | int):
            group["lr"] = 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            optimizer.step()
        except TypeError:  # LBFGS: a closure is required
            optimizer.step(lambda: torch.zeros(()))
    except Exception as exc:  # best effort: the trials then hold what state there is
        return f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        for p in params:
            p.grad = None
    return None


def _resolve_optimizer(
    model: torch.nn.Module, optimizer: Any, mode: str, defaults: Sequence[str]
) -> tuple[Any, list[str]]:
    """The optimizer the trials step (a default AdamW when none is given; in infer mode none
    is stepped, and one given stays for its state) and the report's ``defaults`` with a line
    naming it."""
    defaults = list(defaults)
    if mode == "infer":
        pass
    elif optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
        defaults.append("optimizer: AdamW (default)")
    elif not any(d.startswith("optimizer:") for d in defaults):
        defaults.append(f"optimizer: {type(optimizer).__name__}")
    return optimizer, defaults


def _agree_across_ranks(
    model: torch.nn.Module, backend: Backend, capacity: int | None, opts: ProbeOptions
) -> tuple[int | None, ...] | None:
    """Inside a process group: check that every rank probes with the same settings, and return
    every rank's capacity. ``None`` outside one (with a warning under a launcher that set
    ``WORLD_SIZE`` but initialised no group); ``ddp`` without a group raises the
    :class:`ConfigError` that explains what is missing."""
    ranked = distributed.is_distributed()
    if not ranked and distributed.world_size() > 1:
        warn_user(
            f"memkit.probe runs under a launcher ({distributed.world_size()} ranks: WORLD_SIZE "
            "is set) but no process group is initialised: each rank probes its own device "
            "alone and the ranks may answer differently. Call "
            "torch.distributed.init_process_group() first so the ranks agree on one size, or "
            "use `torchrun ... memkit probe`, which does.",
            RuntimeWarning,
        )
    if not ranked:
        if opts.ddp:
            wrap_ddp(model, backend.device)  # raises the ConfigError that explains what is missing
        return None
    agree_settings(
        min_batch=opts.min_batch, max_batch=opts.max_batch, steps=opts.steps,
        infer=int(opts.mode == "infer"), ddp=int(opts.ddp or is_ddp(model)),
        seq_len=opts.seq_len,
    )  # fmt: skip
    return tuple(row[0] for row in distributed.all_gather_ints([capacity], timeout=opts.timeout))


def _tightest(capacities: tuple[int | None, ...]) -> int | None:
    """The capacity the search aims at across ranks: the smallest, ``None`` if any is unknown."""
    known = [c for c in capacities if c is not None]
    return min(known) if len(known) == len(capacities) else None


@contextlib.contextmanager
def _probing(
    model: torch.nn.Module,
    mode: str,
    saved: SavedState,
    backend: Backend,
    bar: TrialProgress | None,
) -> Iterator[None]:
    """The model in ``mode`` while the trials run; afterwards, whatever ends them, everything
    as it was: the model's training flag and its (and the optimizer's) state restored, the
    progress line closed, the trials' memory collected and the device's cache emptied.

    Everything alive on entry outlives the probe: it is frozen out of the collector's scans, so
    the gc.collect() before a trial only walks the trial's own objects (a full collection costs
    ~0.4 s with transformers imported on a slow CPU, 45-90 ms on the H200 machine); the last
    collection, after unfreezing, walks everything once (when needed, below).
    ``gc.unfreeze()`` cannot tell objects frozen before the probe from its own, so those become
    collectable as usual afterwards: the interpreter may have frozen some at start-up (375
    under Python 3.12.3 on the H200 machine, where a probe that froze only an unfrozen heap
    never froze, and each collection walked the whole heap).

    That last collection is there to give the device back what reference cycles among the
    trials' survivors still hold, before the cache is emptied. When the device holds no more
    than it did on entry, there is nothing to give back and it is skipped (host-only garbage
    is left to the interpreter's own collections).
    """
    training_flag = model.training
    read = devices.counter_reader(backend)[0]
    held_on_entry = read()[0]
    gc.freeze()
    try:
        if mode == "train":
            model.train()
        else:
            model.eval()
        yield
    finally:
        if bar is not None:
            bar.close()
        model.train(training_flag)
        saved.restore()
        gc.unfreeze()
        held = read()[0]
        if held > held_on_entry or held == 0:  # more held, or counters that cannot tell
            gc.collect()  # whole heap, once: garbage the trials left among frozen survivors too
        backend.empty_cache()


def _both(on_trial: TrialCallback | None, bar: TrialProgress | None) -> TrialCallback | None:
    """The user's callback, then the progress line's."""
    if bar is None:
        return on_trial

    def call(trial: ProbeTrial) -> None:
        if on_trial is not None:
            on_trial(trial)
        bar.finished(trial.batch_size, trial.fits, trial.peak_bytes)

    return call


_DDP_NOTE = (
    "ddp: DistributedDataParallel (buckets measured; gradients all-reduced by memkit after "
    "every rank's backward, not overlapped with it)"
)


def _wrap_agreed(model: torch.nn.Module, backend: Backend, timeout: float | None) -> Any:
    """Wrap in DDP on the probed device (its buckets are counted); every rank agrees it fit."""
    wrapped: Any = None
    failed: BaseException | None = None
    try:
        with backend.activate():
            wrapped = wrap_ddp(model, backend.device)
    except MemkitError:
        raise
    except Exception as exc:
        failed = exc
    anywhere = distributed.any_true(failed is not None, timeout=timeout)
    if failed is not None:
        if not is_oom(failed):
            raise UserCodeError(
                f"wrapping the model in DistributedDataParallel raised {first_line(failed)}",
                original=failed,
            ) from failed
        message = first_line(failed)
        recover(backend, failed)
        del failed
        raise DoesNotFitError(
            f"rank {distributed.rank()}: DistributedDataParallel's gradient buckets do not fit "
            f"next to the model on {backend.name()}: {message}"
        )
    if anywhere:
        raise DoesNotFitError(
            f"rank {distributed.rank()}: DistributedDataParallel's gradient buckets did not fit "
            "on another rank; see its error"
        )
    return wrapped


def _build_result(
    search: SearchResult,
    history: list[ProbeTrial],
    backend: Backend,
    plan: StepPlan,
    opts: ProbeOptions,
    defaults: list[str],
    capacities: tuple[int | None, ...] | None = None,
    *,
    batch_norm: bool = False,
    ddp: bool = False,
    state: ModelState | None = None,
    schedule: Schedule | None = None,
    calls_per_step: int = 1,
    trials_without_accumulation: tuple[ProbeTrial, ...] = (),
    steps_in_backward: bool = False,
    shapes_vary: bool = False,
) -> ProbeResult:
    trials = _timed_trials(search, history)
    records = {t.batch_size: t for t in trials}  # each size's last trial
    world = 1 if capacities is None else len(capacities)
    ran = opts.steps if schedule is None else max(opts.steps, schedule.trial_steps)
    grown, growing = _kept_growth(
        trials, search.max_batch_size, opts.steps, opts.mode, ran, shapes_vary
    )
    grown += _schedule_lines(schedule, trials)
    advice = probe_advice(
        search,
        backend.name(),
        opts.mode,
        target_batch=opts.target_batch,
        world_size=world,
        batch_norm=batch_norm,
        pairwise=search.superlinear,
        growing=growing,
        state=state,
        steps_in_backward=steps_in_backward,
        calls_per_step=calls_per_step,
    )
    model = search.pairwise or search.model
    return ProbeResult(
        max_batch_size=search.max_batch_size,
        recommended_batch_size=search.recommended_batch_size,
        trials=trials,
        device=str(backend.device),
        device_name=backend.name(),
        accounting=backend.accounting,
        capacity_bytes=search.capacity_bytes,
        mode=opts.mode,
        steps=opts.steps,
        margin=opts.margin,
        min_batch=opts.min_batch,
        max_batch=opts.max_batch,
        hit_max_batch=search.hit_max_batch and search.max_batch_size == opts.ceiling,
        seq_len=opts.seq_len,
        fixed_bytes=None if model is None else model.fixed_bytes,
        per_sample_bytes=None if model is None else model.per_sample_bytes,
        per_pair_bytes=None if search.pairwise is None else search.pairwise.per_pair_bytes,
        defaults=tuple(defaults + plan.describe() + grown) + ((_DDP_NOTE,) if ddp else ()),
        advice=tuple(advice),
        world_size=world,
        per_rank_peaks=_rank_peaks(search.max_batch_size, records) if world > 1 else (),
        per_rank_capacities=capacities if world > 1 and capacities is not None else (),
        ddp=ddp,
        trials_without_accumulation=trials_without_accumulation,
    )


def _timed_trials(search: SearchResult, history: list[ProbeTrial]) -> tuple[ProbeTrial, ...]:
    """The runner's records, in the order run, timed as the search timed them."""
    return tuple(
        dataclasses.replace(record, seconds=trial.seconds)
        for trial, record in zip(search.trials, history, strict=True)
    )


def _kept_growth(
    trials: tuple[ProbeTrial, ...],
    best: int | None,
    steps: int,
    mode: str = "train",
    ran: int | None = None,
    shapes_vary: bool = False,
) -> tuple[list[str], tuple[int, int, int] | None]:
    """The report's ``steps:`` line (``shapes_vary``: ``make_batch`` draws random shapes): for
    how many steps the answer holds (``ran`` per trial:
    ``steps``, or more to cover the step's cycle); when trials stepped on past that because the
    memory kept between steps grew, how far and what grew (naming the fitting trial nearest the
    answer that was still growing when the step limit stopped it, when the answer's own trial
    was not). Also ``(steps, grown, of it optimizer state)`` for the advice when the answer's
    trial was still growing at its last step."""
    ran = ran or steps

    # (a trial that stepped on only to wait for an optimizer's state that never came kept
    # nothing more: it does not count as a longer run; --steps 1's second step does)
    def flag(n: int) -> str:  # (sweep BV: "--steps 2" in a Python API report)
        return spelled(f"--steps {n}", f"steps={n}")

    longer = [
        t
        for t in trials
        if t.fits
        and not t.superseded
        and (
            ((t.steps_run or 0) > ran and (t.kept_growth_bytes or t.steps_run == 2))
            or t.still_growing
        )
    ]
    if not longer:
        if mode != "train" or best is None:
            return [], None
        kept = "" if ran == 1 else ", the memory kept between them stable"
        cycle = "" if ran == steps else ", more to cover the step's cycle: below"
        line = (
            f"steps: {ran} per trial ({flag(steps)}{cycle}){kept}: memory made at a later step "
            "(an optimizer that makes its state then, SWA from an epoch on) is not seen: "
            f"{spelled('--steps N', 'steps=N')} measures N steps"
        )
        return [line], None
    at = next((t for t in trials if t.batch_size == best), None) or longer[-1]
    most = max(t.steps_run or 0 for t in longer)
    if most == 2 and steps == 1 and not at.kept_growth_bytes:
        line = (
            f"steps: 2 per trial ({flag(1)}): the first step created the optimizer's state, "
            "which is in memory from the second step's forward on"
        )
        return [line], None
    grew = format_size(at.kept_growth_bytes or 0)
    state = format_size(at.optimizer_growth_bytes or 0)
    # (sweep CG: a DLRM's sparse gradients, sized by each step's draws, "still growing" at
    # 0 B more than after step 1: what a step keeps varies, it does not grow)
    others = [t for t in longer if t.still_growing and t is not at and t.kept_growth_bytes]
    if not at.kept_growth_bytes and not at.still_growing and not others:  # (sweep BI: 0 B)
        why = (
            "what a step keeps follows its batch's random shape"
            if shapes_vary
            else "what a step keeps varies from step to step"
        )
        line = (
            f"steps: up to {most} per trial ({flag(steps)}), while the memory kept between "
            f"steps rose from one step to the next ({why}); at batch {at.batch_size}, no more "
            f"after step {at.steps_run} than after step 1"
        )
        return [line], None
    if not at.kept_growth_bytes and not at.still_growing:
        # (sweep CN: "while the memory kept between steps grew: at batch 2251, 0 B more ...;
        # then stable; but at batch 1 still growing": an EMA copy made at a trial's last step)
        line = (
            f"steps: up to {most} per trial ({flag(steps)}): at batch {at.batch_size} the "
            f"memory kept between steps did not grow (no more after step {at.steps_run} than "
            "after step 1)"
        )
    else:
        line = (
            f"steps: up to {most} per trial ({flag(steps)}), while the memory kept between "
            f"steps grew: at batch {at.batch_size}, {grew} more after step {at.steps_run} than "
            f"after step 1, {state} of it the optimizer's state"
            + (f"; still growing at step {at.steps_run}" if at.still_growing else "; then stable")
        )
    if others and not at.still_growing:
        near = min(others, key=lambda t: abs(t.batch_size - at.batch_size))
        line += (
            f"; but at batch {near.batch_size} still growing at step {near.steps_run} "
            f"({format_size(near.kept_growth_bytes or 0)} more than after step 1), where the "
            "probe stops stepping: what a longer run keeps was not measured"
        )
    growing = None
    if at.still_growing and at.steps_run is not None:
        growing = (at.steps_run, at.kept_growth_bytes or 0, at.optimizer_growth_bytes or 0)
    return [line], growing


def _calls_per_step(schedule: Schedule | None) -> int:
    """The calls of a ``train_step`` per optimizer step where the step accumulates itself (its
    work repeats every ``c`` calls, each with a backward, one of which steps the optimizer
    once), else 1."""
    if schedule is None or schedule.cycle is None or schedule.cycle < 2:
        return 1
    cycle = schedule.works[: schedule.cycle]
    stepped = sum(times for w in cycle for _, times in w.stepped)
    if stepped == 1 and all(w.backwards >= 1 for w in cycle):
        return schedule.cycle
    return 1


def _schedule_lines(schedule: Schedule | None, trials: tuple[ProbeTrial, ...]) -> list[str]:
    """The report's line on a step whose work varies from call to call, and on the fits that
    were measured before that was seen."""
    if schedule is None:
        return []
    line = schedule.describe()
    early = sorted({t.batch_size for t in trials if t.superseded})
    if early:
        sizes = ", ".join(map(str, early))
        line += (
            f"; the fits measured before that was seen, over fewer steps, do not count (batch "
            f"{sizes}): the answer was run over the cycle"
        )
    return [line]


def _rank_peaks(batch_size: int | None, records: dict[int, ProbeTrial]) -> tuple[int | None, ...]:
    record = None if batch_size is None else records.get(batch_size)
    return () if record is None else record.rank_peaks


def probe_file(
    path: str,
    options: ProbeOptions | None = None,
    *,
    seq_len: int | Sequence[int] | None = None,
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    on_trial: TrialCallback | None = None,
    progress: bool = False,
    **option_values: Any,
) -> ProbeResult | ProbeSweep:
    """Load a model file (see :mod:`memkit.modelfile`) and probe it.

    ``options`` (a :class:`ProbeOptions`), or its fields as keywords (``max_batch=512``,
    ``steps=1``), say what to search; ``seq_len`` may be several lengths: then the result is a
    :class:`ProbeSweep` (one probe per length). Errors in the file become
    :class:`ModelFileError` (exit code 2).
    """
    opts = dataclasses.replace(options or ProbeOptions(), **option_values)
    with cuda_autocast.requests_recorded():  # the file's own CUDA autocast made at its top
        spec = load_model_file(path)
    lengths = [seq_len] if isinstance(seq_len, int) or seq_len is None else list(seq_len)
    check_seq_len(spec, lengths[0] if lengths else None)
    model = build_model(spec)
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        raise ModelFileError(
            f"build_model() in {spec.path} returned a model on the meta device: its tensors "
            "hold no data, so no step can run. Build it on the CPU (memkit moves it to the "
            "probe's device); `memkit estimate` is the command that runs on meta tensors"
        )
    model = model.to(get_backend(device, budget).device)
    optimizer = None
    defaults: list[str] = []
    if opts.mode == "train":
        optimizer, name = make_optimizer(spec, model)
        defaults.append(f"optimizer: {name}")
    elif opts.training_state:
        optimizer, name = make_optimizer(spec, model)
        failed = with_optimizer_state(optimizer)
        # the last step's gradients too: a loop that zeroes them before its forward
        # (pytorch/examples, Lightning's closure) evaluates with them alive
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        held = f"{name}'s state and the gradients" if failed is None else "the gradients"
        defaults.append(
            f"held through the trials: {held}, as during an evaluation inside training that "
            "a loop reaches with the last step's gradients alive (zero_grad() before the "
            "forward; --mode infer alone: an evaluation-only script, without either)"
            + (
                ""
                if failed is None
                else f"; no optimizer state: {name} could not make it on zero gradients "
                f"({failed}), an evaluation inside training also holds it"
            )
            # (sweep CN: evaluation at twice the training batch, min(2161, 3988 / 2) = 1994,
            # ran out in evaluation, which the loop reached with x, out and loss bound; 1836
            # fit, and 1994 with them deleted first)
            + "; not the last training step's batch, output and loss, which a loop that "
            "evaluates inside its training loop still holds unless it deletes them first "
            "(`del x, out, loss` before evaluating)"
        )
    results = [
        probe_with(
            model,
            spec.make_batch,
            opts.for_length(length),
            optimizer=optimizer,
            loss_fn=spec.loss_fn,
            train_step=spec.train_step,
            eval_step=spec.eval_step,
            device=device,
            budget=budget,
            on_trial=on_trial,
            progress=progress,
            defaults=defaults,
            model_file=spec.path,
        )
        for length in lengths
    ]
    return results[0] if len(results) == 1 else ProbeSweep(tuple(results))
