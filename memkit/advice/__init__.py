"""Advice: recommendations that fire on measured evidence and say what to do.

Each :class:`Advice` has a stable ``code`` (tests and users match on it; docs/advice.md has one
section per code), the ``evidence`` with the measured numbers (device, bytes, ratios), a concrete
``action`` (a code line, an environment variable, a flag) and, where it can be computed, the
expected ``saving_bytes``. This module holds the form, the renderings shared by probe, track,
run and snapshot reports, and the rules that are functions of measured numbers (no torch, no
hardware access); the capabilities call them with what they measured. Rules that read a
capability's own records live beside it (listed below, one place per code).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memkit.render import html as h
from memkit.units import format_size, parse_size

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "PRESSURE",
    "SEVERITIES",
    "Advice",
    "ModuleActivation",
    "activation_checkpointing",
    "advice_html",
    "advice_text",
    "check_data_parallel",
    "device_advice",
    "does_not_fit",
    "dp_batch_too_small",
    "dp_device_mismatch",
    "dp_loss_on_replicas",
    "dp_to_ddp",
    "empty_cache",
    "fragmentation",
    "mixed_precision",
    "optimizer_state",
    "other_processes",
    "processes_in_oom_message",
    "zero_grad_keeps_grads",
]

log = logging.getLogger(__name__)

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Advice:
    """One recommendation.

    Attributes:
        code: stable identifier, e.g. ``"accumulate"``, ``"dp-to-ddp"``.
        title: one line.
        evidence: what was measured, with numbers.
        action: what to do, concretely.
        saving_bytes: expected memory saved, if it can be estimated.
        severity: ``"info"``, ``"warning"`` or ``"critical"``.
    """

    code: str
    title: str
    evidence: str
    action: str
    saving_bytes: int | None = None
    severity: str = "info"

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, found {self.severity!r}")

    @property
    def detail(self) -> str:
        """Evidence, action and saving in one paragraph."""
        saving = (
            f" Expected saving: {format_size(self.saving_bytes)}."
            if self.saving_bytes is not None
            else ""
        )
        return f"{self.evidence} {self.action}{saving}".strip()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field plus ``detail``."""
        return {**asdict(self), "detail": self.detail}

    def __str__(self) -> str:
        return f"[{self.code}] {self.title}\n    {self.evidence}\n    -> {self.action}" + (
            f"\n    saving: ~{format_size(self.saving_bytes)}"
            if self.saving_bytes is not None
            else ""
        )


def advice_text(advice: Iterable[Advice]) -> str:
    """Advice as indented text, most severe first; empty string when there is none."""
    items = sorted(advice, key=lambda a: -SEVERITIES.index(a.severity))
    return "\n".join(str(a) for a in items)


def advice_html(advice: Sequence[Advice]) -> str:
    """Advice as an HTML table (code, title, evidence, action, saving)."""
    if not advice:
        return '<p class="note">No advice: nothing measured calls for a change.</p>'
    rows = [[a.code, a.title, a.evidence, a.action, format_size(a.saving_bytes)] for a in advice]
    return h.table(["code", "advice", "evidence", "action", "saving"], rows)


# ============================================================================================
# Rules. Each takes measured numbers (plain ints and strings, no torch) and returns an
# Advice, or None when the evidence is not there. Codes produced elsewhere (one place each):
#   accumulate          memkit.probing.accumulate.accumulation_advice
#   graph-retained      memkit.tracking.leaks.graph_retained_advice (memory-growth likewise)
#   eval-grad-enabled   memkit.tracking.rules.eval_grad_enabled / oom_advice
#   oom-*               memkit.tracking.rules.oom_advice (the post-mortem's own breakdown rules)
#   ddp-unused-parameters, ddp-gpu0-context   the distributed rules
# ============================================================================================

MiB = 1024**2

PRESSURE = 0.5
"""Trade-off rules (activation checkpointing costs recompute, a lighter optimizer changes
training) fire only when the peak reached this share of the device's capacity, or capacity is
unknown: advice to save memory when memory is not short is noise."""

CUDA_CONTEXT_BYTES = 512 * MiB
"""A CUDA context's size, roughly (300-600 MiB depending on the GPU and the CUDA version)."""

DP_IMBALANCE = 1.2
"""``dp-to-ddp`` fires when the primary device's peak is at least this many times the mean of
the others."""


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _under_pressure(peak: int, capacity: int | None, pressure: float = PRESSURE) -> bool:
    return capacity is None or capacity <= 0 or peak >= pressure * capacity


# -- DataParallel -----------------------------------------------------------------------------


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

    DDP's per-rank peak is estimated as the larger of a replica's peak (its weight copy, its
    share of the activations and its gradients before the reduction) plus DDP's buckets, the
    optimizer state and the loss on the rank's share of the outputs (that share and its
    gradient, twice ``gathered_output_bytes / N``: a heuristic), and parameters + gradients +
    buckets + optimizer state (the optimizer step). Measured largest batches, when given,
    decide whether DDP fits more. The rule advises DDP for memory only when that estimate (or
    the measurement) says it saves memory.

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
    ddp = max(int(mean) + fixed + loss, parameter_bytes + gradient_bytes + fixed)
    dp_b, ddp_b = largest_batches or (None, None)
    measured = dp_b is not None or ddp_b is not None
    saves = (ddp_b or 0) > (dp_b or 0) if measured else ddp < top
    n = len(peaks)
    table = ", ".join(f"{k} {format_size(v)}" for k, v in peaks.items())
    estimate = (
        f"Under DDP each rank would peak near {format_size(ddp)} (estimated: a replica's "
        f"{format_size(int(mean))} + DDP's bucket copy of the gradients "
        f"({format_size(buckets)}) + the optimizer state ({format_size(optimizer_state_bytes)})"
        f" + the loss on its share of the outputs ({format_size(loss)}), on every device)"
    )
    if measured:
        estimate += (
            f"; measured on these devices, the largest global batch is {dp_b if dp_b else '-'} "
            f"with DataParallel and {ddp_b if ddp_b else '-'} with DDP"
        )
    evidence = (
        f"Peak per device: {table}. {primary} holds {format_size(top)} against a mean of "
        f"{format_size(int(mean))} on the other {len(others)}: the gathered outputs, the "
        f"loss, the reduced gradients ({format_size(gradient_bytes)}) and the optimizer "
        f"state ({format_size(optimizer_state_bytes)}) live there. {estimate}."
    )
    if not saves:
        return Advice(
            code="dp-to-ddp",
            title=(
                f"DataParallel puts {top / mean:.1f}x the memory on {primary}, but DDP would not "
                f"save memory here (about {format_size(ddp)} per device vs {format_size(top)})"
                if not measured
                else f"DataParallel puts {top / mean:.1f}x the memory on {primary}, but DDP "
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
    saving = top - ddp if ddp < top else None
    return Advice(
        code="dp-to-ddp",
        title=(
            f"DataParallel puts {top / mean:.1f}x the memory on {primary}; DDP would peak "
            f"near {format_size(ddp)} per device"
            if not measured
            else f"DataParallel puts {top / mean:.1f}x the memory on {primary}; DDP fits a "
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
        saving_bytes=saving,
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
        else f" ({_pct(gathered_output_bytes, primary_peak)} of its peak)"
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
    virtual = getattr(model, "parameter_devices", None)  # memkit.parallel's stand-in
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


# -- what a step holds ------------------------------------------------------------------------


def mixed_precision(
    *,
    param_dtype: str | None,
    autocast: bool,
    activation_bytes: int,
    peak_bytes: int,
    parameter_bytes: int = 0,
    device: str = "the device",
    half: str | None = "bf16",
    saving_bytes: int | None = None,
    min_share: float = 0.2,
) -> Advice | None:
    """``mixed-precision``: fp32 training whose activations are a large share of the peak.

    Args:
        param_dtype: the model's floating parameters' dtype (``"float32"``).
        autocast: a forward ran under ``torch.autocast``: already mixed precision.
        activation_bytes: activations at the peak.
        peak_bytes: the peak.
        parameter_bytes: parameters (autocast caches a half copy of each weight it casts).
        device: where it ran, for the text.
        half: the half type the device supports (``"bf16"``, ``"fp16"``), ``None`` for none.
        saving_bytes: a measured saving (an estimate's bf16 rerun) overrides the estimate
            ``activations / 2 - parameters / 2``.
        min_share: activations must be at least this share of the peak.
    """
    if half is None or autocast or param_dtype not in ("float32", "torch.float32"):
        return None
    if peak_bytes <= 0 or activation_bytes < min_share * peak_bytes:
        return None
    if saving_bytes is None:
        saving_bytes = max(0, activation_bytes // 2 - parameter_bytes // 2) or None
    dtype = "torch.bfloat16" if half == "bf16" else "torch.float16"
    scaler = (
        "" if half == "bf16" else " With fp16 also use `torch.amp.GradScaler()` to scale the loss."
    )
    kind = device.split(":")[0] if device.startswith(("cuda", "xpu", "mps")) else "cuda"
    return Advice(
        code="mixed-precision",
        title="fp32 training: mixed precision would cut activation memory",
        evidence=(
            f"Parameters are {param_dtype} and no forward ran under autocast; activations were "
            f"{format_size(activation_bytes)} ({_pct(activation_bytes, peak_bytes)}) of the "
            f"{format_size(peak_bytes)} peak on {device}. In {half} most activations take half "
            "the bytes (autocast keeps a half copy of the weights it casts)."
        ),
        action=(
            f"`with torch.autocast('{kind}', dtype={dtype}):` around the forward and the loss "
            f"(weights and the optimizer stay fp32).{scaler}"
        ),
        saving_bytes=saving_bytes,
    )


@dataclass(frozen=True)
class ModuleActivation:
    """What :func:`activation_checkpointing` needs of a module (a ``ModuleRecord`` has it)."""

    path: str
    activation_bytes: int
    leaf: bool


def _checkpoint_blocks(
    modules: Sequence[ModuleActivation],
) -> tuple[list[ModuleActivation], dict[str, int]]:
    """The non-leaf, non-root blocks at the depth whose blocks keep the most activations, and
    the estimated output (kept when checkpointed) of each: its largest leaf descendant's."""
    if not modules:
        return [], {}
    root = max(modules, key=lambda m: m.activation_bytes)
    blocks = [m for m in modules if m is not root and not m.leaf]
    by_depth: dict[int, list[ModuleActivation]] = {}
    for m in blocks:
        by_depth.setdefault(m.path.count("."), []).append(m)
    if not by_depth:
        return [], {}
    best = max(by_depth.values(), key=lambda ms: (sum(m.activation_bytes for m in ms), -len(ms)))
    outputs: dict[str, int] = {}
    for b in best:
        leaves = [m.activation_bytes for m in modules if m.leaf and m.path.startswith(b.path + ".")]
        outputs[b.path] = max(leaves, default=0)
    return sorted(best, key=lambda m: -m.activation_bytes), outputs


def activation_checkpointing(
    *,
    activation_bytes: int,
    peak_bytes: int,
    modules: Sequence[ModuleActivation],
    capacity: int | None = None,
    device: str = "the device",
    min_share: float = 0.5,
) -> Advice | None:
    """``activation-checkpointing``: activations dominate the peak; which blocks to checkpoint.

    The blocks are the non-leaf submodules at the depth whose blocks keep the most activation
    memory (a transformer's layers, a ResNet's stages). Checkpointing k blocks keeps each
    one's output (estimated as its largest leaf module's activation) and, during backward,
    recomputes one block at a time: saving ~ sum(kept) - sum(outputs) - max(kept). Fires when
    activations are at least ``min_share`` of the peak and memory is short (:data:`PRESSURE`).
    """
    if peak_bytes <= 0 or activation_bytes < min_share * peak_bytes:
        return None
    if not _under_pressure(peak_bytes, capacity):
        return None
    blocks, outputs = _checkpoint_blocks(modules)
    if len(blocks) < 2:
        return None
    kept = sum(b.activation_bytes for b in blocks)
    saving = kept - sum(outputs.values()) - max(b.activation_bytes for b in blocks)
    if saving <= 0:
        return None
    names = ", ".join(f"{b.path} ({format_size(b.activation_bytes)})" for b in blocks[:5])
    more = f" and {len(blocks) - 5} more" if len(blocks) > 5 else ""
    cap = "" if not capacity else f" (capacity {format_size(capacity)})"
    first = blocks[0].path
    return Advice(
        code="activation-checkpointing",
        title=f"activations are {_pct(activation_bytes, peak_bytes)} of the peak: checkpoint "
        f"{len(blocks)} blocks",
        evidence=(
            f"Activations were {format_size(activation_bytes)} of the {format_size(peak_bytes)} "
            f"peak on {device}{cap}. The blocks that keep the most: {names}{more}; together "
            f"{format_size(kept)}, of which their outputs (kept when checkpointed) are about "
            f"{format_size(sum(outputs.values()))}."
        ),
        action=(
            "Recompute those blocks in backward: in the parent's forward, `x = torch.utils."
            f"checkpoint.checkpoint(block, x, use_reentrant=False)` for each (e.g. `{first}`); "
            "Hugging Face models: `model.gradient_checkpointing_enable()`. Costs about one "
            "extra forward of those blocks per step."
        ),
        saving_bytes=saving,
        severity="warning",
    )


LIGHTER_OPTIMIZERS = (
    ("SGD with momentum (one buffer per parameter)", 1 / 2),
    ("8-bit Adam (bitsandbytes.optim.Adam8bit, ~1/4 of the bytes)", 3 / 4),
    ("Adafactor (factored second moment, no first moment)", 0.95),
)
"""``(option, share of Adam's state saved)`` for the ``optimizer-state`` advice."""


def does_not_fit(
    *,
    batch_size: int,
    mode: str,
    need_bytes: int | None,
    capacity_bytes: int | None,
    device: str | None = None,
    total_bytes: int | None = None,
    context_bytes: int | None = None,
) -> Advice:
    """``does-not-fit``: even the smallest batch tried does not fit; what every step can shed.

    Measured by ``memkit probe`` (``device`` names where it ran) or estimated by
    ``memkit estimate`` (``total_bytes`` and ``context_bytes`` describe the card: the capacity is
    what the allocator may reserve, the card minus its CUDA context).

    Args:
        batch_size: the batch that did not fit.
        mode: ``"train"`` or ``"infer"``.
        need_bytes: what it needed (probe: at least this; estimate: the reserved peak).
        capacity_bytes: what the step may use.
        device: where a probe ran (its backend's name).
        total_bytes: the estimated card's memory.
        context_bytes: the estimated card's CUDA context.
    """
    shard = "shard parameters and optimizer state across GPUs (FSDP/ZeRO)."
    if total_bytes is None or context_bytes is None:  # measured by a probe
        need = format_size(need_bytes) if need_bytes else "more"
        return Advice(
            code="does-not-fit",
            title=f"Even batch {batch_size} does not fit",
            evidence=(
                f"Batch {batch_size} ({mode}) needed at least {need} on {device}, "
                f"capacity {format_size(capacity_bytes)}."
            ),
            action=(
                "Reduce what every step holds: mixed precision (torch.autocast), activation "
                "checkpointing (torch.utils.checkpoint), a lighter optimizer (SGD keeps no "
                f"moments; Adam keeps two per parameter), or {shard}"
            ),
            severity="critical",
        )
    return Advice(
        code="does-not-fit",
        title=f"Even batch {batch_size} is estimated not to fit",
        evidence=(
            f"Batch {batch_size} ({mode}) needs an estimated {format_size(need_bytes)} "
            f"reserved; the card has {format_size(capacity_bytes)} usable "
            f"({format_size(total_bytes)} minus a {format_size(context_bytes)} CUDA context)."
        ),
        action=(
            "Use a larger card, or reduce what every step holds: mixed precision "
            f"(--amp bf16), activation checkpointing, a lighter optimizer, or {shard}"
        ),
        severity="critical",
    )


def optimizer_state(
    *,
    optimizer_state_bytes: int,
    parameter_bytes: int,
    peak_bytes: int,
    capacity: int | None = None,
    optimizer: str | None = None,
    optimizer_transient_bytes: int | None = None,
    ranks: int | None = None,
    device: str = "the device",
    min_share: float = 0.3,
) -> Advice | None:
    """``optimizer-state``: optimizer state dominates the peak; the options and their savings.

    Args:
        optimizer_state_bytes: state at the peak (Adam: two moments per parameter).
        parameter_bytes: the parameters, for the ratio.
        peak_bytes: the peak.
        capacity: the device's size (see :data:`PRESSURE`).
        optimizer: its class name, for the text.
        optimizer_transient_bytes: what the optimizer step allocated on top of its state (the
            ``foreach`` implementation's temporaries): ``foreach=False`` saves most of it.
        ranks: ranks to shard across (the world size); the text shows 2, 4 and 8 when unknown.
        device: where it ran, for the text.
        min_share: state must be at least this share of the peak.
    """
    if peak_bytes <= 0 or optimizer_state_bytes < min_share * peak_bytes:
        return None
    if not _under_pressure(peak_bytes, capacity):
        return None
    name = optimizer or "the optimizer"
    ratio = optimizer_state_bytes / parameter_bytes if parameter_bytes else 0.0
    options = [
        f"{opt}: saves ~{format_size(int(optimizer_state_bytes * share))}"
        for opt, share in LIGHTER_OPTIMIZERS
    ]
    shard_ns = [ranks] if ranks and ranks > 1 else [2, 4, 8]
    shards = ", ".join(
        f"{n} ranks save {format_size(optimizer_state_bytes * (n - 1) // n)}" for n in shard_ns
    )
    options.append(
        "shard it across ranks (torch.distributed.optim.ZeroRedundancyOptimizer, or FSDP which "
        f"also shards weights and gradients): {shards} per rank"
    )
    if optimizer_transient_bytes:
        options.insert(
            0,
            f"`{name}(..., foreach=False)`: the step's temporaries "
            f"({format_size(optimizer_transient_bytes)}) shrink to one parameter's worth",
        )
    return Advice(
        code="optimizer-state",
        title=f"optimizer state is {_pct(optimizer_state_bytes, peak_bytes)} of the peak",
        evidence=(
            f"{name} state was {format_size(optimizer_state_bytes)} "
            f"({ratio:.1f}x the {format_size(parameter_bytes)} of parameters; Adam keeps two "
            f"moments per parameter) of the {format_size(peak_bytes)} peak on {device}."
        ),
        action="Options: " + "; ".join(options) + ".",
        saving_bytes=optimizer_state_bytes // 2,
        severity="warning",
    )


def zero_grad_keeps_grads(
    *,
    steps_with_grads: int,
    gradient_bytes: int,
    peak_phase: str | None = None,
    device: str = "the device",
) -> Advice | None:
    """``zero-grad-keeps-grads``: gradients were allocated when a step's first forward began.

    ``steps_with_grads`` counts steps after the first whose first forward began with gradients
    allocated: ``optimizer.zero_grad(set_to_none=False)`` (zeros, still allocated), or
    ``zero_grad()`` called between the forward and backward instead of before the forward.
    Under gradient accumulation the later micro batches of a step legitimately start with
    gradients; only a step's first forward counts.
    """
    if steps_with_grads < 1 or gradient_bytes <= 0:
        return None
    at_peak = peak_phase == "forward"
    return Advice(
        code="zero-grad-keeps-grads",
        title=f"{format_size(gradient_bytes)} of gradients stay allocated through the forward",
        evidence=(
            f"On {device}, {steps_with_grads} step(s) began their forward with the "
            f"{format_size(gradient_bytes)} of gradients still allocated"
            + (", and the peak came in a forward, so they are part of it." if at_peak else ".")
        ),
        action=(
            "Free them before the forward: `optimizer.zero_grad(set_to_none=True)` (the "
            "default since PyTorch 2.0; drop `set_to_none=False`) right after "
            "`optimizer.step()` or before `model(x)`, not between forward and backward."
        ),
        saving_bytes=gradient_bytes,
        severity="warning" if at_peak else "info",
    )


# -- the caching allocator and the device -----------------------------------------------------


def fragmentation(
    *,
    reserved: int,
    allocated: int,
    device: str = "the device",
    tried_to_allocate: int | None = None,
    capacity: int | None = None,
    peak_allocated: int | None = None,
) -> Advice | None:
    """``fragmentation``: memory reserved by the caching allocator but not usable.

    At an OOM (``tried_to_allocate`` given): fires when reserved-unallocated memory is at least
    the failed request, or 10% of the capacity. Otherwise (a snapshot): fires when ``reserved``
    exceeds the most ever allocated at once (``peak_allocated``) by 20% of reserved and at
    least 256 MiB: the cache grew past any real need, so its blocks could not be reused.
    """
    cached = reserved - allocated
    if tried_to_allocate is not None:
        big = cached >= tried_to_allocate or (capacity is not None and cached >= 0.1 * capacity)
        if cached <= 0 or not big:
            return None
        evidence = (
            f"When {format_size(tried_to_allocate)} could not be allocated on {device}, "
            f"{format_size(cached)} was reserved by PyTorch but unallocated "
            f"({format_size(reserved)} reserved, {format_size(allocated)} in tensors): free "
            "blocks too small or split to hold the request."
        )
        severity = "critical" if cached >= tried_to_allocate else "warning"
        saving = cached
    else:
        if peak_allocated is None:
            return None
        slack = reserved - peak_allocated
        if slack < 256 * MiB or slack < 0.2 * reserved:
            return None
        evidence = (
            f"{device} has {format_size(reserved)} reserved while the most ever allocated at "
            f"once is {format_size(peak_allocated)}: {format_size(slack)} of cached blocks "
            "could not be reused for later requests (fragmentation)."
        )
        severity, saving = "info", slack
    return Advice(
        code="fragmentation",
        title=f"{format_size(saving)} reserved but unusable (fragmentation)",
        evidence=evidence,
        action=(
            "Start the process with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (segments "
            "grow instead of splitting; set before CUDA initialises); inputs of varying shapes "
            "fragment most: pad them to a few fixed sizes."
        ),
        saving_bytes=saving,
        severity=severity,
    )


def other_processes(
    *,
    used: int,
    this_process: int,
    device: str = "the device",
    total: int | None = None,
    context_bytes: int = CUDA_CONTEXT_BYTES,
    processes: Sequence[tuple[int, str, int]] | None = None,
    includes_context: bool = False,
) -> Advice | None:
    """``other-processes``: device-wide used memory far above this process's share.

    Args:
        used: device-wide used bytes (nvidia-smi, ``cudaMemGetInfo``).
        this_process: this process's reserved bytes, or (``includes_context=True``) its whole
            use as an OOM message gives it ("this process has X memory in use").
        total: the device's size.
        context_bytes: the CUDA context allowance (ignored with ``includes_context``).
        processes: ``(pid, name, bytes)`` of the other processes, where the driver lists them.

    Fires when the rest is at least 512 MiB and 5% of ``total``.
    """
    mine = this_process + (0 if includes_context else context_bytes)
    rest = used - mine
    if rest < 512 * MiB or (total and rest < 0.05 * total):
        return None
    named = (
        "; the driver lists "
        + ", ".join(
            f"pid {pid}{' ' + name if name else ''} ({format_size(b)})"
            for pid, name, b in processes
        )
        if processes
        else ""
    )
    share = f" of {format_size(total)}" if total else ""
    context = "" if includes_context else f" + ~{format_size(context_bytes)} CUDA context"
    return Advice(
        code="other-processes",
        title=f"other processes hold {format_size(rest)} on {device}",
        evidence=(
            f"{device} has {format_size(used)}{share} in use, this process "
            f"{format_size(this_process)}{context}: {format_size(rest)} belongs to other "
            f"processes{named}."
        ),
        action=(
            "Find them with `nvidia-smi --query-compute-apps=pid,process_name,used_memory "
            "--format=csv` (a stale notebook kernel, a previous run, a dataloader worker that "
            "initialised CUDA) and stop them, or choose a free GPU: `CUDA_VISIBLE_DEVICES=<n>`."
        ),
        saving_bytes=rest,
        severity="warning",
    )


def empty_cache(
    *,
    reserved: int,
    allocated: int,
    device: str = "the device",
    other_bytes: int = 0,
    free: int | None = None,
    cache_releases: int = 0,
    steps: int = 0,
) -> Advice | None:
    """``empty-cache``: when ``torch.cuda.empty_cache()`` helps, and when it only costs time.

    Helps: at least 256 MiB is cached (reserved, unallocated) while other processes hold at
    least 512 MiB of the device and its free memory is below what is cached: releasing the
    cache gives them room. Costs: the cache was released ``cache_releases`` times over
    ``steps`` steps (reserved dropping between readings) with no other process needing it:
    each call makes the next step ``cudaMalloc`` everything again, and frees nothing this
    process can use (the allocator reuses its cache anyway).
    """
    cached = max(0, reserved - allocated)
    needed = other_bytes >= 512 * MiB and (free is None or free < cached)
    if cached >= 256 * MiB and needed:
        return Advice(
            code="empty-cache",
            title=f"empty_cache() would give {format_size(cached)} back to other processes",
            evidence=(
                f"{device}: {format_size(cached)} reserved but unallocated "
                f"({format_size(reserved)} reserved, {format_size(allocated)} in tensors), while "
                f"other processes hold {format_size(other_bytes)}"
                + ("" if free is None else f" and only {format_size(free)} is free")
                + "."
            ),
            action=(
                "Call `torch.cuda.empty_cache()` once at the point where another process needs "
                "the memory (after training, before evaluation in a second process); not in "
                "the training loop."
            ),
            saving_bytes=cached,
            severity="info",
        )
    if cache_releases >= 2 and steps >= 2 and other_bytes < 512 * MiB:
        return Advice(
            code="empty-cache",
            title="empty_cache() in the loop only costs time",
            evidence=(
                f"{device}: the allocator's cache was released {cache_releases} times in "
                f"{steps} steps (reserved memory dropped between readings) and no other "
                "process needs it: every step then reserves the memory again from the driver."
            ),
            action=(
                "Remove `torch.cuda.empty_cache()` from the loop: it does not lower this "
                "process's peak (the allocator reuses its cache) and each call forces slow "
                "cudaMalloc/cudaFree calls. For fragmentation use expandable_segments instead."
            ),
            severity="info",
        )
    return None


def device_advice(
    device: str,
    *,
    total: int | None,
    used: int | None,
    allocated: int | None,
    reserved: int | None,
    peak_allocated: int | None = None,
    context_bytes: int = CUDA_CONTEXT_BYTES,
) -> list[Advice]:
    """``other-processes``, ``fragmentation`` and ``empty-cache`` from one device's readings
    (a snapshot's row); ``None`` readings make the rules that need them stay silent."""
    out: list[Advice | None] = []
    if used is not None and reserved is not None:
        out.append(
            other_processes(
                used=used,
                this_process=reserved,
                total=total,
                device=device,
                context_bytes=context_bytes,
            )
        )
    if reserved is not None and allocated is not None:
        out.append(
            fragmentation(
                reserved=reserved,
                allocated=allocated,
                peak_allocated=peak_allocated,
                device=device,
            )
        )
        other = 0 if used is None else max(0, used - reserved - context_bytes)
        free = None if used is None or total is None else max(0, total - used)
        out.append(
            empty_cache(
                reserved=reserved, allocated=allocated, device=device, other_bytes=other, free=free
            )
        )
    return [a for a in out if a is not None]


_PROCESS = re.compile(r"Process (\d+) has ([0-9.]+ ?[KMGT]i?B) memory in use")


def processes_in_oom_message(message: str) -> list[tuple[int, str, int]]:
    """``(pid, "", bytes)`` of the other processes a CUDA OOM message names ("Process 1234 has
    3.00 GiB memory in use", PyTorch >= 2.1 where the driver allows it).

    Examples:
        >>> processes_in_oom_message("... Process 4242 has 3.00 GiB memory in use. ...")
        [(4242, '', 3221225472)]
    """
    out = []
    for pid, size in _PROCESS.findall(message):
        try:
            out.append((int(pid), "", parse_size(size.replace(" ", ""))))
        except Exception:  # a size we cannot read: leave that process out
            log.debug("unreadable size %r in an OOM message", size)
    return out
