"""Rules on data parallelism: ``nn.DataParallel`` (``dp-*``: its unbalanced devices, what
DDP would cost instead, its setup mistakes) and DDP runs (``ddp-*``: per-rank readings
gathered to rank 0 by :mod:`memkit.tracking.rank_gather`).

Pure functions (no torch, no collectives) of measured numbers, so tests construct them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memkit.advice.form import CUDA_CONTEXT_BYTES, Advice, MiB, percent_of
from memkit.units import format_names, format_size

if TYPE_CHECKING:
    from memkit.strategies import StrategyResult

__all__ = [
    "DP_IMBALANCE",
    "ContextReading",
    "DdpEstimate",
    "check_data_parallel",
    "ddp_gpu0_context",
    "ddp_unused_parameters",
    "dp_batch_too_small",
    "dp_device_mismatch",
    "dp_loss_on_replicas",
    "dp_to_ddp",
    "switch_to_ddp",
]

DP_IMBALANCE = 1.2
"""``dp-to-ddp`` fires when the primary device's peak is at least this many times the mean of
the others."""


# -- DataParallel -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DdpEstimate:
    """What DDP would hold per device, against DataParallel's measured peaks.

    Attributes:
        top: the primary device's peak under DataParallel.
        mean: the mean peak of the other devices (a replica's).
        buckets: DDP's bucket copy of the gradients (0 with ``gradient_as_bucket_view``).
        loss: the loss on the rank's share of the outputs, and its gradient (a heuristic).
        per_device: DDP's per-rank peak: measured at the same global batch when
            ``measured_peak``, else the high end of the estimate.
        largest_batches: measured largest global batches ``(DataParallel, DDP)``, if any.
        measured_peak: whether ``per_device`` was measured (DDP run on the same devices).
        low: the low end of the estimate (``per_device`` when measured or when the weights'
            size is unknown).
        weights: the weights a DDP rank keeps through backward where a replica may not.
    """

    top: int
    mean: float
    buckets: int
    loss: int
    per_device: int
    largest_batches: tuple[int | None, int | None] | None
    measured_peak: bool = False
    low: int | None = None
    weights: int = 0

    @property
    def lowest(self) -> int:
        """The low end of DDP's per-rank peak (``per_device`` when it is one number)."""
        return self.per_device if self.low is None else self.low

    @property
    def span(self) -> str:
        """DDP's per-rank peak as text: one size, or the estimate's range."""
        if self.lowest >= self.per_device:
            return format_size(self.per_device)
        return f"{format_size(self.lowest)} to {format_size(self.per_device)}"

    @property
    def measured(self) -> bool:
        """Whether largest batches were measured (they decide, not the estimate)."""
        dp_b, ddp_b = self.largest_batches or (None, None)
        return dp_b is not None or ddp_b is not None

    @property
    def tie(self) -> bool:
        """Whether DDP and DataParallel fit the same largest global batch (measured)."""
        dp_b, ddp_b = self.largest_batches or (None, None)
        return self.measured and dp_b == ddp_b

    def imbalance(self, primary: str) -> str:
        """How much more ``primary`` holds than the others, for the titles."""
        return f"DataParallel puts {self.top / self.mean:.1f}x the memory on {primary}"

    @property
    def saves(self) -> bool:
        """Whether DDP saves memory: fits a larger global batch, or the same one (or, with no
        measured batches, any) at a lower peak per device than the primary's."""
        dp_b, ddp_b = self.largest_batches or (None, None)
        if self.measured and not self.tie:
            return (ddp_b or 0) > (dp_b or 0)
        return self.per_device < self.top

    @property
    def unsure(self) -> bool:
        """Whether the estimate's range straddles the primary's peak: DDP may or may not
        save memory (only measuring DDP tells; not when batches or the peak were measured)."""
        return not self.measured and self.lowest < self.top <= self.per_device


def dp_to_ddp(
    peaks: Mapping[str, int],
    primary: str,
    *,
    gradient_bytes: int = 0,
    optimizer_state_bytes: int = 0,
    gradient_as_bucket_view: bool = False,
    parameter_bytes: int = 0,
    gathered_output_bytes: int = 0,
    largest_batches: tuple[int | None, int | None] | None = None,
    ddp_peak: int | None = None,
) -> Advice | None:
    """``dp-to-ddp``: under ``nn.DataParallel`` the primary device holds far more than the rest,
    and what DDP would cost instead.

    Args:
        peaks: peak allocated bytes per device (``{"cuda:0": ..., "cuda:1": ...}``).
        primary: the output device (``device_ids[0]`` unless ``output_device`` says otherwise).
        gradient_bytes: the reduced gradients (they live on the primary device only).
        optimizer_state_bytes: optimizer state (on the primary device only).
        gradient_as_bucket_view: the DDP flag: without it, DDP's buckets copy the gradients.
        parameter_bytes: the parameters (for DDP's optimizer-step floor).
        gathered_output_bytes: the outputs DataParallel gathers on ``primary`` per forward.
        largest_batches: measured largest global batches ``(DataParallel, DDP)``, when known.
        ddp_peak: DDP's per-rank peak measured at the same global batch (the strategy
            comparison runs it); it replaces the estimate.

    DDP's per-rank peak is estimated as a range. Its low end is the larger of a replica's
    peak (its weight copy, its share of the activations and its gradients before the
    reduction) plus DDP's buckets, the optimizer state and the loss on the rank's share of the
    outputs (that share and its gradient, twice ``gathered_output_bytes / N``: a heuristic,
    right where the loss runs outside the model; where the model computes it, the share is
    kept once), and parameters + gradients + buckets + optimizer state (the optimizer step).
    Its high end adds ``parameter_bytes`` to the first: a replica's weights are broadcast
    copies that DataParallel frees during backward once no layer's backward needs them (a
    first ``Linear`` whose input needs no gradient saves no weight), so a replica's peak may
    not hold them when a DDP rank's, which keeps its weights all step, does (a 64-1024-64
    MLP with AdamW on 2 GPUs: the replica's peak 1.82 MiB + the rest 1.57 MiB = 3.39 MiB, a
    real DDP rank 3.86 MiB, the high end 3.90 MiB). ``ddp_peak`` replaces both.
    Measured largest batches, when given, decide whether DDP fits more; at the same largest
    batch, the lower peak per device decides. The rule advises DDP for memory only when the
    measurement, or the estimate's high end, says it saves memory; when the range straddles
    the primary's peak it says that only measuring DDP tells.

        >>> a = dp_to_ddp({"cuda:0": 50 * MiB, "cuda:1": 40 * MiB}, "cuda:0",
        ...               gradient_bytes=8 * MiB, optimizer_state_bytes=8 * MiB)
        >>> a.severity, a.saving_bytes  # 40 + 8 (buckets) + 8 (state) = 56 MiB > 50 MiB
        ('info', None)
    """
    others = [v for k, v in peaks.items() if k != primary]
    if primary not in peaks or not others:
        return None
    top, mean = peaks[primary], sum(others) / len(others)
    if top < DP_IMBALANCE * mean or top - mean < 1 * MiB:
        return None
    buckets = 0 if gradient_as_bucket_view else gradient_bytes
    fixed = buckets + optimizer_state_bytes
    loss = 2 * gathered_output_bytes // len(peaks)
    step = parameter_bytes + gradient_bytes + fixed
    low = max(int(mean) + fixed + loss, step)
    high = max(int(mean) + parameter_bytes + fixed + loss, step)
    if ddp_peak is not None:
        low = high = ddp_peak
    est = DdpEstimate(
        top, mean, buckets, loss, high, largest_batches, ddp_peak is not None, low, parameter_bytes
    )
    evidence = _dp_evidence(peaks, primary, est, gradient_bytes, optimizer_state_bytes)
    if est.unsure:
        return _measure_ddp_first(est, primary, len(peaks), evidence)
    if not est.saves:
        return _keep_data_parallel(est, primary, len(peaks), evidence)
    return _switch_to_ddp(est, primary, len(peaks), evidence)


def _dp_evidence(
    peaks: Mapping[str, int],
    primary: str,
    est: DdpEstimate,
    gradient_bytes: int,
    optimizer_state_bytes: int,
) -> str:
    """``dp-to-ddp``'s evidence: the peaks, what the primary holds, DDP's estimated peak."""
    top, ddp = est.top, est.per_device
    dp_b, ddp_b = est.largest_batches or (None, None)
    others = len(peaks) - 1
    table = ", ".join(f"{k} {format_size(v)}" for k, v in peaks.items())
    estimate = (
        f"Under DDP each rank peaks at {format_size(ddp)} at the same global batch (measured "
        "on these devices: its replica, gradients, their bucket copy and the optimizer state)"
        if est.measured_peak
        else f"Under DDP each rank would peak near {est.span} (estimated: a replica's "
        f"{format_size(int(est.mean))} + DDP's bucket copy of the gradients "
        f"({format_size(est.buckets)}) + the optimizer state ({format_size(optimizer_state_bytes)})"
        f" + the loss on its share of the outputs ({format_size(est.loss)})"
        + (
            f", + up to its weights ({format_size(est.weights)}), which a DDP rank keeps "
            "through backward while a replica's broadcast copy is freed once no layer needs it"
            if est.lowest < ddp
            else ""
        )
        + ", on every device)"
    )
    if est.measured:
        estimate += (
            f"; measured on these devices, the largest global batch is {dp_b if dp_b else '-'} "
            f"with DataParallel and {ddp_b if ddp_b else '-'} with DDP"
        )
    return (
        f"Peak per device: {table}. {primary} holds {format_size(top)} against a mean of "
        f"{format_size(int(est.mean))} on the other {others}: the gathered outputs, the "
        f"loss, the reduced gradients ({format_size(gradient_bytes)}) and the optimizer "
        f"state ({format_size(optimizer_state_bytes)}) live there. {estimate}."
    )


def _keep_data_parallel(est: DdpEstimate, primary: str, n: int, evidence: str) -> Advice:
    """``dp-to-ddp`` (info) when DDP would not save memory: what relieves the primary instead."""
    top, ddp = est.top, est.per_device
    dp_b, ddp_b = est.largest_batches or (None, None)
    return Advice(
        code="dp-to-ddp",
        title=(
            f"{est.imbalance(primary)}, but DDP would not "
            f"save memory here (about {est.span} per device vs {format_size(top)})"
            if not est.measured
            else f"{est.imbalance(primary)}, but DDP fits the same global batch here "
            f"({dp_b or '-'}) at no lower peak ({format_size(ddp)} per device vs "
            f"{format_size(top)})"
            if est.tie
            else f"{est.imbalance(primary)}, but DDP "
            f"fits a smaller global batch here ({ddp_b or '-'} vs {dp_b or '-'})"
        ),
        evidence=evidence,
        action=(
            "Keep DataParallel if memory is the limit: DDP puts gradients, their buckets and "
            f"the optimizer state on all {n} devices, where DataParallel keeps one copy on "
            f"{primary}. To relieve {primary}, compute the loss inside the replicas "
            "(dp-loss-on-replicas) or give it a smaller share with `output_device`. DDP is "
            "still faster (no weight broadcast per step, one process per GPU)."
        ),
        saving_bytes=None,
        severity="info",
    )


def _measure_ddp_first(est: DdpEstimate, primary: str, n: int, evidence: str) -> Advice:
    """``dp-to-ddp`` (info) when DDP's estimated range straddles the primary's peak."""
    return Advice(
        code="dp-to-ddp",
        title=(
            f"{est.imbalance(primary)}; DDP may not save memory here ({est.span} per device "
            f"vs {format_size(est.top)}): measure it before switching"
        ),
        evidence=evidence,
        action=(
            f"Measure DDP on the same devices before switching for memory: `memkit probe "
            f"model.py --device cpu --gpus {n} --budget SIZE --strategies dp,ddp` runs both "
            f"and compares their largest global batches. To relieve {primary} meanwhile, "
            "compute the loss inside the replicas (dp-loss-on-replicas) or give it a smaller "
            "share with `output_device`. DDP is faster either way (no weight broadcast per "
            "step, one process per GPU)."
        ),
        saving_bytes=None,
        severity="info",
    )


def _switch_to_ddp(est: DdpEstimate, primary: str, n: int, evidence: str) -> Advice:
    """``dp-to-ddp`` (warning) when DDP saves memory: how to switch."""
    top, ddp = est.top, est.per_device
    dp_b, ddp_b = est.largest_batches or (None, None)
    return Advice(
        code="dp-to-ddp",
        title=(
            f"{est.imbalance(primary)}; DDP would peak near {est.span} per device"
            if not est.measured
            else f"{est.imbalance(primary)}; DDP fits the same global batch ({dp_b}) at "
            f"{format_size(ddp)} per device against {format_size(top)} on {primary}"
            if est.tie
            else f"{est.imbalance(primary)}; DDP fits a "
            f"global batch of {ddp_b} (DataParallel {dp_b or '-'})"
        ),
        evidence=evidence,
        action=(
            f"Use DistributedDataParallel: `torchrun --nproc_per_node {n} train.py`; in the "
            "script `dist.init_process_group('nccl')`, `local_rank = int(os.environ["
            "'LOCAL_RANK'])`, `torch.cuda.set_device(local_rank)`, `model = DDP(model.to("
            "local_rank), device_ids=[local_rank])`, and a `DistributedSampler` for the data "
            "(per-rank batch = the DataParallel batch / "
            f"{n}, so the effective batch is unchanged)."
        ),
        saving_bytes=top - ddp if ddp < top else None,
        severity="warning",
    )


def dp_loss_on_replicas(
    gathered_output_bytes: int, primary: str, n_devices: int, primary_peak: int | None = None
) -> Advice | None:
    """``dp-loss-on-replicas``: large outputs gathered on the output device.

    Fires when the gathered outputs are at least 1 MiB and 5% of the primary device's peak
    (when known). Computing the loss inside the wrapped module gathers ``n_devices`` scalars
    instead; the outputs' gradient (the same size) is not created on the primary either.
    """
    if n_devices < 2 or gathered_output_bytes < 1 * MiB:
        return None
    if primary_peak is not None and gathered_output_bytes < 0.05 * primary_peak:
        return None
    share = (
        ""
        if primary_peak is None
        else f" ({percent_of(gathered_output_bytes, primary_peak)} of its peak)"
    )
    return Advice(
        code="dp-loss-on-replicas",
        title=f"DataParallel gathers {format_size(gathered_output_bytes)} of outputs on {primary}",
        evidence=(
            f"Each forward gathered {format_size(gathered_output_bytes)} of outputs from "
            f"{n_devices} devices on {primary}{share}; the loss then runs there and its "
            "gradient of the same size is scattered back from there."
        ),
        action=(
            "Compute the loss inside the wrapped module (a wrapper whose forward(x, y) returns "
            "`loss_fn(model(x), y).unsqueeze(0)`), then `loss = dp_model(x, y).mean()`: only "
            f"{n_devices} scalars are gathered."
        ),
        saving_bytes=gathered_output_bytes,
        severity="warning",
    )


def dp_batch_too_small(batch_size: int, device_ids: Sequence[int]) -> Advice | None:
    """``dp-batch-too-small``: fewer samples than devices in ``device_ids``."""
    n = len(device_ids)
    if n < 2 or batch_size >= n:
        return None
    return Advice(
        code="dp-batch-too-small",
        title=f"batch {batch_size} is smaller than the {n} DataParallel devices",
        evidence=(
            f"DataParallel splits the batch of {batch_size} along dim 0 over device_ids="
            f"{list(device_ids)}: only {batch_size} device(s) get a chunk, {n - batch_size} sit "
            "idle while still holding a replica of the weights, and batch norm sees 1-sample "
            "chunks (it raises in training)."
        ),
        action=(
            f"Use a batch of at least {n} (a multiple of {n} balances the devices), or "
            f"`nn.DataParallel(model, device_ids=list(range({batch_size})))`; the last, smaller "
            "batch of an epoch: `DataLoader(..., drop_last=True)`."
        ),
        severity="warning",
    )


def dp_device_mismatch(param_devices: Iterable[str], device_ids: Sequence[int]) -> Advice | None:
    """``dp-device-mismatch``: parameters or buffers not on ``device_ids[0]``.

    ``param_devices`` are the devices of the wrapped module's parameters and buffers
    (``"cpu"``, ``"cuda:1"``). DataParallel requires all of them on ``cuda:device_ids[0]``
    and otherwise raises "module must have its parameters and buffers on device cuda:0
    (device_ids[0]) but found one of them on device: ...".
    """
    if not device_ids:
        return None
    want = f"cuda:{device_ids[0]}"
    wrong = sorted({d for d in param_devices if d != want})
    if not wrong:
        return None
    return Advice(
        code="dp-device-mismatch",
        title=f"parameters are on {', '.join(wrong)}, DataParallel needs them on {want}",
        evidence=(
            f"device_ids={list(device_ids)}, so the module must live on {want} "
            f"(device_ids[0]); found parameters or buffers on {', '.join(wrong)}. DataParallel "
            f"raises 'module must have its parameters and buffers on device {want} "
            "(device_ids[0]) but found one of them on device: "
            f"{wrong[0]}' at the first forward."
        ),
        action=(
            f"Move the model first: `model.to('{want}')` then `nn.DataParallel(model, "
            f"device_ids={list(device_ids)})`; or list the GPU it is on first in device_ids. "
            "Inputs may stay on the CPU: DataParallel scatters them."
        ),
        severity="critical",
    )


def check_data_parallel(model: Any, batch_size: int | None = None) -> list[Advice]:
    """``dp-batch-too-small`` and ``dp-device-mismatch`` for a DataParallel-wrapped model.

    Works on any object with ``device_ids`` and ``module`` (``nn.DataParallel``). Without
    CUDA, torch builds ``nn.DataParallel`` with ``device_ids=[]`` (it just calls the module),
    so nothing fires on a CPU-only machine: there is nothing to split.

    Examples:
        >>> import torch
        >>> check_data_parallel(torch.nn.Linear(2, 2), 1)
        []
    """
    device_ids = getattr(model, "device_ids", None)
    module = getattr(model, "module", None)
    if not device_ids or module is None:
        return []
    ids = [int(getattr(d, "index", d)) for d in device_ids]
    out: list[Advice] = []
    virtual = getattr(model, "parameter_devices", None)  # memkit.simulated.parallel's stand-in
    if callable(virtual):
        found = set(virtual())
    else:
        found = {str(t.device) for t in (*module.parameters(), *module.buffers())}
    mismatch = dp_device_mismatch(found, ids)
    if mismatch is not None:
        out.append(mismatch)
    if batch_size is not None:
        small = dp_batch_too_small(batch_size, ids)
        if small is not None:
            out.append(small)
    return out


# -- DistributedDataParallel ------------------------------------------------------------------


def _modules(names: Sequence[str]) -> list[str]:
    """``"module.head.weight"`` -> ``"head"``: the modules owning the parameters, in order."""
    out: list[str] = []
    for name in names:
        parts = name.split(".")
        if parts and parts[0] == "module":  # DDP's wrapper prefix
            parts = parts[1:]
        owner = ".".join(parts[:-1]) or "(the model itself)"
        if owner not in out:
            out.append(owner)
    return out


def ddp_unused_parameters(
    unused_by_rank: Mapping[int, Sequence[str]],
    *,
    unused_bytes: int | None = None,
    find_unused_parameters: bool | None = None,
) -> Advice | None:
    """``ddp-unused-parameters``: trainable parameters that got no gradient in a DDP step.

    Args:
        unused_by_rank: per rank, the names of trainable parameters whose ``.grad`` was
            ``None`` at an optimizer step.
        unused_bytes: their size, if known (memory that trains nothing, plus its bucket share).
        find_unused_parameters: the DDP model's setting, if known.

    Examples:
        >>> ddp_unused_parameters({0: [], 1: []}) is None
        True
        >>> ddp_unused_parameters({0: ["module.aux.weight"], 1: ["module.aux.weight"]}).code
        'ddp-unused-parameters'
    """
    names = sorted({n for names in unused_by_rank.values() for n in names})
    if not names:
        return None
    ranks = sorted(r for r, n in unused_by_rank.items() if n)
    modules = _modules(names)
    shown = format_names(modules, 8)
    # ``unused_bytes`` is their bytes and their bucket slots: the parameters are half of it
    size = f" ({format_size(unused_bytes // 2)})" if unused_bytes else ""
    both = f", {format_size(unused_bytes)}" if unused_bytes else ""
    if find_unused_parameters:
        cost = (
            "find_unused_parameters=True is on: DDP walks the autograd graph after every "
            "forward to find them, which costs time on every step."
        )
    else:
        cost = (
            "Without find_unused_parameters=True, DDP waits for their gradients and fails on "
            "the next step ('Expected to have finished reduction in the prior iteration'); "
            "with it, DDP walks the autograd graph after every forward, which costs time."
        )
    return Advice(
        code="ddp-unused-parameters",
        title=f"{len(names)} parameter(s) get no gradient under DDP",
        evidence=(
            f"At an optimizer step, {len(names)} trainable parameter(s){size} had no gradient "
            f"(on rank(s) {', '.join(map(str, ranks))}); they belong to: {shown}. {cost}"
        ),
        action=(
            "Remove the modules that do not take part in the loss (saves their bytes and their "
            f"slots in DDP's gradient buckets{both}), "
            "or freeze them (requires_grad_(False)) so DDP does not wait for them (saves "
            "their bucket slots, half of that; they stay on the device); only if they are used "
            "on some steps and not others, keep find_unused_parameters=True and accept its cost."
        ),
        saving_bytes=unused_bytes,
        severity="warning",
    )


@dataclass(frozen=True)
class ContextReading:
    """One rank's CUDA context reading.

    Attributes:
        rank: global rank.
        local_rank: ``LOCAL_RANK`` (the GPU it should use on its node).
        cuda_initialized: whether this process initialised CUDA.
        current_device: the current CUDA device index (``torch.cuda.current_device()``).
        node: a host name, so ranks on different nodes are not mixed up.
    """

    rank: int
    local_rank: int
    cuda_initialized: bool
    current_device: int | None
    node: str = ""


def ddp_gpu0_context(readings: Sequence[ContextReading]) -> Advice | None:
    """``ddp-gpu0-context``: several ranks of a node made GPU 0 current (a context each there).

    Fires when, on one node, at least two ranks initialised CUDA with device 0 current while
    their ``LOCAL_RANK`` differs: the ranks other than local rank 0 forgot
    ``torch.cuda.set_device(local_rank)``, so each created a CUDA context (and often tensors)
    on GPU 0, which runs out of memory first.

    Examples:
        >>> ok = [ContextReading(0, 0, True, 0), ContextReading(1, 1, True, 1)]
        >>> ddp_gpu0_context(ok) is None
        True
        >>> bad = [ContextReading(0, 0, True, 0), ContextReading(1, 1, True, 0)]
        >>> ddp_gpu0_context(bad).code
        'ddp-gpu0-context'
    """
    by_node: dict[str, list[ContextReading]] = {}
    for reading in readings:
        if reading.cuda_initialized and reading.current_device == 0:
            by_node.setdefault(reading.node, []).append(reading)
    wrong = [r for group in by_node.values() if len(group) >= 2 for r in group if r.local_rank != 0]
    if not wrong:
        return None
    ranks = ", ".join(str(r.rank) for r in wrong)
    extra = len(wrong) * CUDA_CONTEXT_BYTES
    return Advice(
        code="ddp-gpu0-context",
        title=f"{len(wrong) + 1} ranks use GPU 0: torch.cuda.set_device(local_rank) is missing",
        evidence=(
            f"Rank(s) {ranks} have LOCAL_RANK other than 0 but GPU 0 as their current device, "
            "so each created a CUDA context (about 300-600 MiB) on GPU 0, and any tensor made "
            "with device='cuda' lands there too: GPU 0 runs out of memory first."
        ),
        action=(
            "At the start of every rank, before any CUDA call: local_rank = "
            "int(os.environ['LOCAL_RANK']); torch.cuda.set_device(local_rank); then create "
            "tensors on f'cuda:{local_rank}' and wrap with DDP(model, device_ids=[local_rank])."
        ),
        saving_bytes=extra,
        severity="critical",
    )


def switch_to_ddp(dp: StrategyResult, ddp: StrategyResult, gpus: int) -> Advice | None:
    """``switch-to-ddp``: in the strategy comparison, DDP fits a larger global batch than
    DataParallel on the same devices."""
    if ddp.max_global_batch is None or (dp.max_global_batch or 0) >= ddp.max_global_batch:
        return None
    x, y = dp.max_global_batch or 0, ddp.max_global_batch
    gain = f"+{100.0 * (y - x) / x:.0f}%" if x else "DP fits no batch"
    parts = ", ".join(f"{k} {format_size(v)}" for k, v in dp.excess_parts)
    return Advice(
        code="switch-to-ddp",
        title=f"switch to DDP: largest global batch {x} -> {y} ({gain})",
        evidence=(
            f"On {gpus} GPUs, DataParallel's largest global batch is {x}, with cuda:0 at "
            f"{format_size(dp.per_device_peaks[0]) if dp.per_device_peaks else '-'}, "
            f"{format_size(dp.excess_bytes)} above the others' mean (on cuda:0 only: {parts}). "
            f"Under DDP every device holds the same, and the largest global batch is {y}."
        ),
        action=(
            f"torchrun --nproc-per-node {gpus} train.py with DistributedDataParallel and a "
            f"DistributedSampler, per-rank batch {y // gpus}."
        ),
        severity="warning",
    )
