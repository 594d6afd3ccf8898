"""Rules on what a training step holds: mixed precision, activation checkpointing, the
optimizer's state, gradients kept through the forward. Functions of measured numbers (no
torch); the track report and the estimate feed them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memkit.advice.form import Advice, matters, percent_of, under_pressure
from memkit.units import format_size

__all__ = [
    "LIGHTER_OPTIMIZERS",
    "STATE_BUFFERS",
    "BlockGroup",
    "EmbeddingTable",
    "LighterOptimizer",
    "ModuleActivation",
    "StepPass",
    "activation_checkpointing",
    "autocast_casts_to_half",
    "autocast_keeps_float32",
    "checkpoint_groups",
    "dense_embedding_gradients",
    "float64_training",
    "lbfgs_history",
    "lighter_optimizers",
    "lighter_options",
    "mixed_precision",
    "optimizer_state",
    "shard_option",
    "stale_gradients",
    "state_buffers",
    "state_per_parameter",
    "zero_grad_keeps_grads",
]


FLOAT32_MATH = ("NewGELUActivation", "NewGELU", "AccurateGELUActivation")
"""Activations whose own code runs an op of CUDA autocast's float32 list: GPT-2's
``gelu_new`` (transformers' ``NewGELUActivation``, minGPT's ``NewGELU``) calls
``torch.pow(x, 3.0)``, and ``pow`` is on CUDA's list (not on the CPU's): its float32 result
makes the rest of its math float32. Float32 training keeps four tensors of its input's size
(``tanh``'s output, ``1 + tanh``, ``0.5 * x``, the product) and its input; under CUDA autocast
``tanh``'s and ``1 + tanh`` stay float32, ``pow`` keeps a float32 copy of the (half) input in
the input's place, and ``0.5 * x`` and the product's copy are half: 3/4 of its own bytes stay
float32 (sweep BZ's LoRA GPT-2: 6 MiB of the 12.50 claimed went to it; a CPU autocast run,
whose list has no ``pow``, halves all of it)."""

_FLOAT32_LAYERS = (
    "LayerNorm", "GroupNorm", "RMSNorm", "Softmax", "LogSoftmax", "Softmin", "Softplus",
    "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "CosineSimilarity", "Embedding",
    "EmbeddingBag",
)  # fmt: skip
"""Layers whose output ``torch.autocast`` keeps in float32 on CUDA (the device its advice
names): those that run ops of its float32 lists (``layer_norm``, ``group_norm``,
``rms_norm``, ``softmax``, ``log_softmax``, ``softplus``, ``upsample_*``, ``cosine_similarity``:
ATen/autocast_mode.h's ``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE``),
and embeddings, which no autocast list casts (their float32 weight makes a float32 output).
Losses (``*Loss``) are float32 on CUDA and CPU alike. CPU autocast keeps norms, softmax and
upsampling in their input's dtype (float32 after an embedding or a residual sum, half after
a convolution), so on CPU a norm after a half layer halves after all."""


def autocast_keeps_float32(type_name: str | None) -> bool:
    """Whether autocast keeps a layer of class ``type_name`` float32 (:data:`_FLOAT32_LAYERS`,
    a norm of any library by its name's end, a loss).

    Examples:
        >>> [autocast_keeps_float32(t) for t in ("LlamaRMSNorm", "CrossEntropyLoss", "Linear")]
        [True, True, False]
    """
    if not type_name:
        return False
    return type_name in _FLOAT32_LAYERS or type_name.endswith(
        ("LayerNorm", "RMSNorm", "GroupNorm", "Loss")
    )


_HALF_LAYERS = (
    "Bilinear", "Conv1D", "LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell",
    "MultiheadAttention", "PReLU",
)  # fmt: skip
"""Layers whose op autocast runs in half precision (ATen/autocast_mode.h's
``AT_FORALL_LOWER_PRECISION_FP``: ``linear``, ``addmm``, ``matmul``, the convolutions, the RNN
cells, ``prelu``, ``scaled_dot_product_attention``), besides any class named ``*Linear`` or
``Conv*``. Each casts its float32 input to half and keeps that copy for backward: where a
norm feeds one, the norm's float32 output is freed and the half copy kept in its place."""


def autocast_casts_to_half(type_name: str | None) -> bool:
    """Whether autocast runs a layer of class ``type_name`` in half precision
    (:data:`_HALF_LAYERS`, a ``*Linear``, a ``Conv*``).

    Examples:
        >>> [autocast_casts_to_half(t) for t in ("Linear", "Conv2d", "Conv1D", "LayerNorm", "GELU")]
        [True, True, True, False, False]
    """
    if not type_name:
        return False
    return type_name in _HALF_LAYERS or type_name.endswith("Linear") or type_name.startswith("Conv")


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
    capacity: int | None = None,
    narrow_weight_bytes: int = 0,
    float32_bytes: int = 0,
    temporary_bytes: int = 0,
    cached_weight_bytes: int | None = None,
    frozen_copy_bytes: int = 0,
    trainable_weight_bytes: int | None = None,
    inference: bool = False,
    wrapper: str | None = None,
    unsafe_loss: str | None = None,
) -> Advice | None:
    """``mixed-precision``: fp32 training (``inference``: an fp32 inference, worded so) whose
    activations are a large share of the peak.

    Args:
        param_dtype: the trainable floating parameters' dtype (``"float32"``).
        autocast: a forward ran under ``torch.autocast``: already mixed precision.
        activation_bytes: activations at the peak.
        peak_bytes: the peak.
        parameter_bytes: the models' weights, trainable or frozen (autocast caches a half copy
            of those of ``cached_weight_bytes``; where that is not known, of all).
        device: where it ran, for the text.
        half: the half type the device supports (``"bf16"``, ``"fp16"``), ``None`` for none.
        saving_bytes: a measured saving (an estimate's bf16 rerun) overrides the estimate.
        min_share: activations must be at least this share of the peak.
        capacity: the device's size: with it, the saving must matter (:func:`matters`).
        narrow_weight_bytes: of ``parameter_bytes``, those held in 16 bits or fewer (a bf16 or
            int8 frozen base under LoRA adapters). The layers of such weights compute in low
            precision already, or cast back to float32 on purpose, which autocast does not
            undo: with most weights narrow the rule is silent (a LoRA sweep measured 0.22 MiB
            saved where 1.13 MiB was claimed); else the estimate counts only the float32
            weights' share of the activations.
        float32_bytes: of ``activation_bytes``, what the forward kept that stays float32
            under autocast: the outputs of the layers it runs in float32
            (:func:`autocast_keeps_float32`), what the model's own code kept around its layers
            (a Hugging Face model's loss), and the last layer's output, which the loss reads
            in float32 (a float32 copy of it replaces the half one).
        temporary_bytes: of ``activation_bytes``, what no forward kept: at a peak in backward,
            the gradients of the loss math, float32 under autocast too.
        cached_weight_bytes: the weights that require grad (the trained ones) of the layers
            autocast runs in half: it caches its half casts of float32 leaves that require grad
            only (``cached_cast`` in ATen/autocast_mode.cpp), and casts no embedding table; a
            frozen model's (a distillation teacher's) are cast anew at each use and freed.
            ``None``: not known, all the float32 weights.
        trainable_weight_bytes: all the weights that require grad (``None``: taken as
            ``cached_weight_bytes``): the rest are the frozen ones the text names.
        frozen_copy_bytes: the half copies of frozen float32 weights that half layers keep for
            backward, where their input requires grad (the gradient of the input needs the
            weight): a frozen base's layers under LoRA adapters, not a frozen encoder run under
            ``no_grad``. Autocast adds them; float32 training keeps the weights themselves.
        wrapper: the framework that wrapped the model (``"accelerate"``, ``"fabric"``): the
            action names its switch, which enters the autocast for the script (sweep BK);
            ``"fsdp"``: FSDP2's ``MixedPrecisionPolicy``.
        unsafe_loss: an op in the loss that CUDA's autocast refuses (``binary_cross_entropy``):
            the action says to replace it first, or the advice would raise on a GPU.

    The estimate is ``(activations - float32 - temporaries) * share / 2 - cached / 2 -
    frozen copies`` (``share``: the float32 weights' share of the weights, 1 without narrow
    ones; ``cached``: the half layers' float32 weights that require grad); silent unless
    positive. float64
    models get ``float64`` (:func:`float64_training`) instead.
    """
    if half is None or autocast or param_dtype not in ("float32", "torch.float32"):
        return None
    if peak_bytes <= 0 or activation_bytes < min_share * peak_bytes:
        return None
    wide = max(0, parameter_bytes - narrow_weight_bytes)
    share = wide / parameter_bytes if parameter_bytes > 0 else 1.0
    if share < 0.5:
        return None
    bound = ""
    kept32 = ""
    cached = wide if cached_weight_bytes is None else min(wide, cached_weight_bytes)
    if wrapper == "fsdp":  # FSDP2's policy gathers half copies in place of the float32 ones:
        cached = 0  # no autocast cache beside them (review: 11.16 MiB promised, 13.17 saved)
    frozen = ""
    trained = cached if trainable_weight_bytes is None else trainable_weight_bytes
    untrained = wide - min(wide, trained)
    if saving_bytes is None:
        halved = max(0, activation_bytes - float32_bytes - temporary_bytes)
        saving_bytes = int(halved * share) // 2 - cached // 2 - frozen_copy_bytes
        if frozen_copy_bytes:
            frozen = (
                f" It caches none of the {format_size(untrained)} of float32 weights "
                "that require no grad (a frozen base's): it casts them anew at each use, and "
                f"the layers whose input requires grad keep their {format_size(frozen_copy_bytes)}"
                " of half copies for backward (float32 training keeps the weights themselves)."
            )
        elif untrained and untrained // 2 >= saving_bytes // 20:  # (not a norm's stats)
            frozen = (
                f" It caches none of the {format_size(untrained)} of float32 weights "
                "that require no grad (a frozen model's): it casts them anew at each use."
            )
        if float32_bytes + temporary_bytes > 0:
            kept32 = (
                f" Of them, {format_size(float32_bytes + temporary_bytes)} stay float32 under "
                "autocast: the outputs of norms, embeddings and losses, what the model's own "
                "code kept around its layers, the last layer's output (the loss reads it in "
                "float32) and the loss's gradients at the peak."
            )
        measure = (
            "Rerun under autocast to measure it."
            if device.split(":")[0] != "cpu"
            else "On this CPU run a torch.autocast('cuda', ...) region is disabled (torch "
            "warns, nothing changes): measure it here under torch.autocast('cpu', "
            "dtype=torch.bfloat16), whose op lists differ from CUDA's, or estimate a GPU with "
            "`memkit estimate`."
        )
        bound = (
            " The saving is an estimate: layers fed float32 (a dropout after a norm) keep "
            f"float32; half-precision temporaries in backward save more. {measure}"
        )
    if saving_bytes <= 0 or not matters(saving_bytes, peak_bytes, capacity):
        return None
    narrow = (
        f" {format_size(narrow_weight_bytes)} of the {format_size(parameter_bytes)} of weights "
        f"are 16-bit or narrower already: the estimate counts {share:.0%} of the activations, "
        "the float32 weights' share."
        if narrow_weight_bytes > 0
        else ""
    )
    dtype = "torch.bfloat16" if half == "bf16" else "torch.float16"
    scaler = (
        "" if half == "bf16" else " With fp16 also use `torch.amp.GradScaler()` to scale the loss."
    )
    kind = device.split(":")[0] if device.startswith(("cuda", "xpu", "mps")) else "cuda"
    weights = "The parameters" if inference else "Trainable parameters"
    action = f"`with torch.autocast('{kind}', dtype={dtype}):` around the forward" + (
        " (the weights stay fp32)."
        if inference
        else f" and the loss (weights and the optimizer stay fp32).{scaler}"
    )
    if wrapper == "accelerate":
        action = (
            f'`Accelerator(mixed_precision="{half}")`: it runs the forward under autocast '
            "(weights and the optimizer stay fp32)."
        )
    elif wrapper == "fsdp":  # (sweep CC: FSDP2's own policy also halves the all-gathers)
        action = (
            "`fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch."
            f"{'bfloat16' if half == 'bf16' else 'float16'}, reduce_dtype=torch.float32))` on "
            "every unit: FSDP2 gathers and computes in half precision (the gathered "
            "parameters halve too) and keeps the float32 shards for the optimizer."
        )
    elif wrapper == "fabric":
        action = (
            f'`Fabric(precision="{"bf16" if half == "bf16" else "16"}-mixed")`: it runs the '
            "forward under autocast (weights and the optimizer stay fp32)."
        )
    if unsafe_loss == "binary_cross_entropy":
        action += (
            " First replace `nn.BCELoss` / `F.binary_cross_entropy` with `nn.BCEWithLogitsLoss`"
            " / `F.binary_cross_entropy_with_logits` on the logits (drop the Sigmoid before "
            "it), or compute that loss after the autocast region on `.float()` inputs: CUDA's "
            "autocast refuses binary_cross_entropy ('unsafe to autocast') and raises."
        )
    return Advice(
        code="mixed-precision",
        title=(
            f"fp32 {'inference' if inference else 'training'}: mixed precision would cut "
            "activation memory"
        ),
        evidence=(
            f"{weights} are {param_dtype} and no forward ran under autocast; "
            f"activations were {format_size(activation_bytes)} "
            f"({percent_of(activation_bytes, peak_bytes)}) of the {format_size(peak_bytes)} "
            f"peak on {device}. In {half} most activations take half the bytes (autocast keeps "
            f"a half copy of the weights it casts).{kept32}{frozen}{narrow}{bound}"
        ),
        action=action,
        saving_bytes=saving_bytes,
    )


def float64_training(
    *,
    param_dtype: str | None,
    peak_bytes: int,
    parameter_bytes: int,
    gradient_bytes: int = 0,
    optimizer_state_bytes: int = 0,
    activation_bytes: int = 0,
    capacity: int | None = None,
    device: str = "the device",
    float64_share: float = 1.0,
) -> Advice | None:
    """``float64``: a float64 (or complex128) model; float32 halves its parameters, gradients,
    optimizer state and activations (saving: half of their sum at the peak, times ``float64_share``,
    the float64 part of the trainable parameters' bytes: a float64 head on a float32 body
    halves only its own part). Fires when the saving matters (:func:`matters`)."""
    double = str(param_dtype).removeprefix("torch.")
    if double not in ("float64", "complex128") or peak_bytes <= 0:
        return None
    floating = parameter_bytes + gradient_bytes + optimizer_state_bytes + activation_bytes
    share = min(1.0, max(0.0, float64_share))
    saving = int(min(floating, peak_bytes) * share) // 2
    if saving <= 0 or not matters(saving, peak_bytes, capacity):
        return None
    part = (
        ""
        if share >= 0.995
        else f" ({share:.0%} of the trainable parameters' bytes; the rest are float32, and "
        "the saving counts that share of each part, an estimate)"
    )
    return Advice(
        code="float64",
        title="float64 training: float32 would halve the model's memory",
        evidence=(
            f"Parameters are {double}{part}. Parameters, gradients, optimizer state and "
            f"activations were {format_size(floating)} ({percent_of(floating, peak_bytes)}) of "
            f"the {format_size(peak_bytes)} peak on {device}; in float32 (complex64) each takes "
            "half the bytes (bf16/fp16 autocast applies to float32 models, not to this one)."
        ),
        action=(
            "Train in float32: drop `model.double()` or `torch.set_default_dtype("
            "torch.float64)` (or call `model.float()`) and make the inputs float32 "
            "(`x.float()`); keep float64 only where a computation needs its precision (a "
            "Cholesky factor). "
            + (
                "Complex weights take `.to(torch.complex64)` (`model.float()` leaves them); "
                "autocast does not apply to complex ops."
                if double == "complex128"
                else "Then mixed precision (`torch.autocast`) halves the activations again."
            )
        ),
        saving_bytes=saving,
        severity="warning" if under_pressure(peak_bytes, capacity) else "info",
    )


@dataclass(frozen=True)
class ModuleActivation:
    """What :func:`activation_checkpointing` needs of a module (a ``ModuleRecord`` has it).

    ``first_call``: its place in the order the modules were first called (``None``: not
    known; a block whose modules' order is unknown is priced as keeping all it keeps);
    ``output_bytes``: what its training forward returned (``None``: not measured);
    ``passes``: how many of its calls a step keeps alive together (both views of a
    BYOL step), whose bytes the others are the sum of: backward recomputes one at a time."""

    path: str
    activation_bytes: int
    leaf: bool
    type_name: str | None = None
    first_call: int | None = None
    output_bytes: int | None = None
    passes: float = 1.0


@dataclass(frozen=True)
class StepPass:
    """A run of evaluation-pass readings inside a training step (a frozen teacher's
    forward), as :func:`activation_checkpointing` prices it: its ``peak``, and ``held``, what
    the step's training forward had allocated when it began (0: it ran before that forward,
    or between steps)."""

    peak: int
    held: int

    def after(self, freed: int) -> int:
        """Its peak once the training forward keeps ``freed`` bytes less (checkpointed
        blocks): lower by as much as it held of them.

        Examples:
            >>> StepPass(peak=300, held=120).after(100), StepPass(peak=300, held=0).after(100)
            (200, 300)
        """
        return self.peak - min(max(0, self.held), max(0, freed))


@dataclass(frozen=True)
class BlockGroup:
    """Repeated blocks under one parent (``transformer.h``: ``transformer.h.0`` ...), the
    unit people wrap in ``torch.utils.checkpoint``.

    Attributes:
        parent: the container's path (``""`` for the model's own indexed children).
        blocks: ``(path, kept bytes, output bytes)`` of each block; a block with no hooks of
            its own (a ``ModuleList`` entry) keeps what its outermost recorded modules keep.
    """

    parent: str
    blocks: tuple[tuple[str, int, int], ...]

    @property
    def kept(self) -> int:
        return sum(b[1] for b in self.blocks)

    def describe(self) -> str:
        """``decoder.layers.0 ... decoder.layers.11 (12 blocks, 40.00 MiB)``."""
        paths = [b[0] for b in self.blocks]
        span = paths[0] if len(paths) == 1 else f"{paths[0]} ... {paths[-1]}"
        count = "1 block" if len(paths) == 1 else f"{len(paths)} blocks"
        return f"{span} ({count}, {format_size(self.kept)})"


def _index_prefixes(path: str) -> list[str]:
    """The prefixes of ``path`` (itself included) whose last part is an index: ``h.0.attn``
    -> ``["h.0"]``."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i, p in enumerate(parts) if p.isdigit()]


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _inside(path: str, block: str) -> bool:
    return block == "" or path == block or path.startswith(block + ".")


def _block_output(block: str, kept: int, modules: Sequence[ModuleActivation]) -> int:
    """What ``block`` keeps when checkpointed: its output (the next block's input, which
    checkpointing saves), as its forward returned it where the tracker measured that.
    Otherwise what the last leaf its forward called kept, of those that kept anything: a
    block ends in a layer whose output is the block's output, or is added to the block's
    input (a residual sum of that size); that leaf's bytes may hold a little more (a norm's
    statistics, a dropout's mask). An in-place or pass-through leaf (``ReLU(inplace=True)``,
    ``Dropout(p=0)``, ``Identity``) keeps nothing and is skipped. Without the call order (or
    a leaf that kept anything): ``kept``, all of it."""
    own = next((m.output_bytes for m in modules if m.path == block), None)
    if own:
        return min(kept, own)
    leaves = [
        m for m in modules
        if m.leaf and m.path != block and _inside(m.path, block) and m.activation_bytes > 0
    ]  # fmt: skip
    if not leaves or any(m.first_call is None for m in leaves):
        return kept
    last = max(leaves, key=lambda m: m.first_call or 0)
    return min(kept, last.activation_bytes)


_CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})


def checkpoint_groups(modules: Sequence[ModuleActivation]) -> list[BlockGroup]:
    """The outermost groups of repeated blocks: indexed children (``ModuleList``,
    ``Sequential``) of one parent, of one type where their types are known, none a leaf;
    else named children of one parent of one block class (not a container), in the order
    they ran; none inside a block of another group (so no byte counts twice). A block's kept
    bytes are its own record's, else the sum of its outermost recorded descendants'; its
    output (kept when checkpointed) is what its forward returned (:func:`_block_output`)."""
    by_path = {m.path: m for m in modules}
    members: dict[str, set[str]] = {}
    for m in modules:
        for block in _index_prefixes(m.path):
            members.setdefault(_parent(block), set()).add(block)

    def kept(block: str) -> int:
        if block in by_path:
            return by_path[block].activation_bytes
        outer = [
            m for m in modules
            if _inside(m.path, block)
            and not any(a in by_path for a in _ancestors_between(m.path, block))
        ]  # fmt: skip
        return sum(m.activation_bytes for m in outer)

    groups: list[BlockGroup] = []
    for parent, paths in members.items():
        recorded = [by_path[p] for p in paths if p in by_path]
        if any(m.leaf for m in recorded):
            paths = {p for p in paths if p not in by_path or not by_path[p].leaf}
        types = [m.type_name for m in recorded if m.type_name and not m.leaf]
        if types:  # the blocks are the most common type among them
            common = max(set(types), key=types.count)
            paths = {p for p in paths if p not in by_path or by_path[p].type_name == common}
        if len(paths) < 2:
            continue
        ordered = sorted(paths, key=lambda p: int(p.rpartition(".")[2]))
        blocks = []
        for p in ordered:
            k = kept(p)
            blocks.append((p, k, _block_output(p, k, modules)))
        _add_group(groups, parent, blocks)
    # named siblings of one block class (a hand-written UNet's down1, down2, mid, up2, up1:
    # ResBlocks as attributes, not in a ModuleList: sweep BY found the rule silent), in the
    # order they ran, where no indexed group holds them
    siblings: dict[tuple[str, str], list[ModuleActivation]] = {}
    for m in modules:
        name = m.path.rpartition(".")[2]
        if m.leaf or not m.type_name or name.isdigit() or m.type_name in _CONTAINERS:
            continue
        if m.first_call is None or m.first_call == 0:  # (the model's own row)
            continue
        siblings.setdefault((_parent(m.path), m.type_name), []).append(m)
    for (parent, _), found in siblings.items():
        if len(found) < 2 or any(_inside(m.path, b[0]) for g in groups for b in g.blocks
                                 for m in found):  # fmt: skip
            continue
        found.sort(key=lambda m: m.first_call or 0)
        blocks = [(m.path, m.activation_bytes, _block_output(m.path, m.activation_bytes, modules))
                  for m in found]  # fmt: skip
        _add_group(groups, parent, blocks)
    outermost = [
        g for g in groups
        if not any(h is not g and any(_inside(g.parent, b[0]) for b in h.blocks) for h in groups)
    ]  # fmt: skip
    return sorted(outermost, key=lambda g: -g.kept)


def _add_group(groups: list[BlockGroup], parent: str, blocks: list[tuple[str, int, int]]) -> None:
    """Add the group of ``blocks`` that keep more than their output (one that ran under
    ``no_grad``, MoCo's key encoder beside its query encoder, keeps nothing to recompute:
    sweep CF was told to checkpoint it), where any does."""
    kept = tuple(b for b in blocks if b[1] > b[2])
    if kept:
        groups.append(BlockGroup(parent, kept))


def _ancestors_between(path: str, block: str) -> list[str]:
    """The paths strictly between ``block`` and ``path`` (``block`` excluded, ``path`` too)."""
    rest = path[len(block) + 1 :].split(".") if block else path.split(".")
    head = block
    out = []
    for part in rest[:-1]:
        head = f"{head}.{part}" if head else part
        out.append(head)
    return out


def _kept_after(blocks: Sequence[str], modules: Sequence[ModuleActivation]) -> int:
    """What the forward kept after every module of ``blocks`` ran (a head, a final norm, the
    loss the model computes): backward frees it before it reaches the blocks. The model's own
    row (the first called) less what its outermost modules called up to the blocks kept; where
    there is no such row, what the outermost modules called after them kept (the loss's own
    tensors not included). 0 where the call order is not known."""
    inside = [m.first_call for m in modules if any(_inside(m.path, b) for b in blocks)]
    if not inside or any(c is None for c in inside):
        return 0
    last = max(c for c in inside if c is not None)
    roots = [m for m in modules if m.first_call == 0]
    rest = [m for m in modules if m.first_call is not None and m.first_call > 0]
    while True:
        paths = {m.path for m in rest}
        outermost = [m for m in rest if not any(p in paths for p in _ancestors(m.path))]
        if (
            len(roots) != 1
            or len(outermost) != 1
            or not all(_inside(b, outermost[0].path) for b in blocks)
        ):
            break
        # a wrapper (peft's PeftModel, a user's own) whose one module holds the blocks: the
        # model it wraps is the model (sweep BZ: its head and loss counted 0, 24% low)
        roots, rest = outermost, [m for m in rest if m is not outermost[0]]
    before = sum(m.activation_bytes for m in outermost if (m.first_call or 0) <= last)
    if len(roots) == 1 and roots[0].activation_bytes >= before:  # (not a teacher run first)
        return roots[0].activation_bytes - before
    after = [m for m in rest if (m.first_call or 0) > last]
    later = {m.path for m in after}
    return sum(m.activation_bytes for m in after if not any(p in later for p in _ancestors(m.path)))


def _ancestors(path: str) -> list[str]:
    """Every proper prefix of ``path`` (``a.b.c`` -> ``a``, ``a.b``)."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def activation_checkpointing(
    *,
    activation_bytes: int,
    peak_bytes: int,
    modules: Sequence[ModuleActivation],
    capacity: int | None = None,
    device: str = "the device",
    min_share: float = 0.5,
    phase_peaks: Mapping[str, int | None] | None = None,
    peak_phase: str | None = None,
    peak_module: str | None = None,
    temporary_bytes: int = 0,
    step_passes: Sequence[StepPass] | None = None,
) -> Advice | None:
    """``activation-checkpointing``: activations dominate the peak; which blocks to checkpoint.

    The blocks are the outermost repeated blocks (:func:`checkpoint_groups`: a transformer's
    layers, a ResNet stage's blocks), never the model itself and never a block inside
    another. Checkpointed, each keeps only its output (the next block's input); in backward
    one block at a time is recomputed, re-creating what it kept besides its output
    (``recompute``: the most of any block). The last block is recomputed after backward has
    freed what the modules called after the blocks kept (a head: ``after``), the first near
    backward's end, when the gradients are allocated (the breakdown counts them beside the
    activations at the peak); by then backward has also freed what no module kept at the peak
    (``temporary_bytes``: the loss's saved tensors and the logits' gradient, made outside the
    modules; sweep CM: 9.53 MiB claimed, 17.04 saved, what the blocks keep less their outputs),
    where the peak is backward's outside the blocks and each block ran once.
    Saving ~ min(sum(kept) - sum(outputs) - max(0, recompute - after - temporaries),
    activations at the peak - sum(outputs) - recompute). Where the peak came in the
    forward (``peak_phase``) above backward's peak (``phase_peaks``), over the blocks' kept
    activations (sweep CF: MoCo's key encoder under no_grad after the query encoder), the
    forward's peak falls by what the blocks keep, backward's by the saving above, and the
    peak to the highest phase after; not where the peak's module (``peak_module``) ran
    before the blocks (review: a frozen block's wide transient first), which they cannot
    lower. Fires when activations are at least ``min_share`` of the
    peak and memory is short (:data:`PRESSURE`).

    ``step_passes``: where the eval column is passes run inside the training step (a frozen
    teacher's forward), those passes (:class:`StepPass`) in its place: one that began after
    the training forward holds its blocks' activations and falls with them (by what the
    blocks keep less their outputs, at most what it held), so it is no floor for the forward
    (a teacher after the student's forward: silent where checkpointing saved 120.38 MiB);
    where such a pass peaks above training (``peak_bytes``), the device's peak is its, and
    the saving is that peak's fall to the highest phase after. ``None``: the eval column's
    peak as it is (evaluation between steps, which checkpointing does not lower).
    """
    if peak_bytes <= 0 or activation_bytes < min_share * peak_bytes:
        return None
    passes_top = max((p.peak for p in step_passes or ()), default=0)
    if not under_pressure(max(peak_bytes, passes_top), capacity):
        return None
    groups = checkpoint_groups(modules)
    blocks = [b for g in groups for b in g.blocks]
    if not blocks:
        return None
    kept = sum(b[1] for b in blocks)
    outputs = sum(b[2] for b in blocks)
    passes = {m.path: m.passes for m in modules}  # (one call recomputed at a time: sweep CH)
    recompute = max(round((b[1] - b[2]) / max(1.0, passes.get(b[0], 1.0))) for b in blocks)
    after = _kept_after([b[0] for b in blocks], modules)
    # the temporaries are the peak's: freed before the last block's recompute where the peak
    # is backward's and each block runs once (a block run on two views is recomputed twice,
    # the first view's after the loss's temporaries are long gone: its first one absorbs them)
    once = peak_phase != "forward" and all(passes.get(b[0], 1.0) <= 1.0 for b in blocks)
    # (review CK: a peak inside a block's backward holds that block's gradient buffers, not
    # the loss's tensors, and they stay beside the recompute: 46.52 MiB claimed, 32 saved)
    in_block = peak_module is not None and any(
        peak_module == b[0] or peak_module.startswith(f"{b[0]}.") for b in blocks
    )
    absorbed = temporary_bytes if once and not in_block else 0
    at_backward = kept - outputs - max(0, recompute - after - absorbed)
    saving = min(at_backward, activation_bytes - outputs - recompute)
    phases = dict(phase_peaks or {})
    if step_passes is not None:  # the eval column is the step's passes: each falls by what it held
        phases["eval"] = max((p.after(kept - outputs) for p in step_passes), default=None)
    training_saving = saving
    backward = phases.pop("backward", None)
    if peak_phase == "forward" and backward is not None and backward < peak_bytes:
        phases.pop("forward", None)
        calls = {m.path: m.first_call for m in modules}
        at = calls.get(peak_module or "")
        starts = [calls.get(b[0]) for b in blocks]
        # (the model's own row, or a module holding the blocks, runs its code after them too:
        # review 2, a pairwise mask in the root's forward after its blocks)
        holds = not at or any(b[0].startswith(f"{peak_module}.") for b in blocks)
        before = (
            at is not None and not holds and None not in starts and at < min(c or 0 for c in starts)
        )
        forward = peak_bytes if before else peak_bytes - (kept - outputs)
        after_peak = max(forward, backward - at_backward, *(v for v in phases.values() if v))
        saving = max(peak_bytes, passes_top) - after_peak
        training_saving = peak_bytes - max(forward, backward - at_backward)
    elif len(blocks) < 2:  # one block, recomputed in the backward it peaks in: ~ the head
        return None
    elif passes_top > peak_bytes:  # a pass of the step peaks above training: the device's peak
        forward_peak = phases.pop("forward", None)
        lowered = [
            peak_bytes - max(0, saving),
            (forward_peak or 0) - (kept - outputs),
            *(v for v in phases.values() if v),
        ]
        saving = passes_top - max(lowered)
    if saving <= 0:
        return None
    names = "; ".join(g.describe() for g in groups[:3])
    more = f"; and {len(groups) - 3} more groups" if len(groups) > 3 else ""
    cap = "" if not capacity else f" (capacity {format_size(capacity)})"
    first = blocks[0][0]
    freed = (
        f", after backward has freed the {format_size(after)} the modules called after them kept"
        if after > 0
        else ""
    ) + (
        f"{' and' if after > 0 else ', after backward has freed'} the "
        f"{format_size(absorbed)} made outside the modules at the peak (the loss's)"
        if absorbed > 0
        else ""
    )
    held = max((p for p in step_passes or () if p.held > 0), key=lambda p: p.peak, default=None)
    in_step = (
        f" A forward inside the step after the training forward (a frozen teacher's) began "
        f"with {format_size(held.held)} of it alive and peaked at {format_size(held.peak)}: "
        f"it falls with the blocks' activations, to about "
        f"{format_size(held.after(kept - outputs))}"
        + (
            f" (training's own peak falls by about {format_size(max(0, training_saving))})."
            if held.peak > peak_bytes
            else "."
        )
        if held is not None
        else ""
    )
    return Advice(
        code="activation-checkpointing",
        title=f"activations are {percent_of(activation_bytes, peak_bytes)} of the peak: checkpoint "
        + (f"{len(blocks)} blocks" if len(blocks) > 1 else f"`{blocks[0][0]}`"),
        evidence=(
            f"Activations were {format_size(activation_bytes)} of the {format_size(peak_bytes)} "
            f"peak on {device}{cap}. The repeated blocks: {names}{more}; together "
            f"{format_size(kept)}, of which their outputs (kept when checkpointed) are about "
            f"{format_size(outputs)}. Recomputing one block in backward re-creates up to "
            f"{format_size(recompute)}{freed}.{in_step}"
        ),
        action=(
            "Recompute those blocks in backward: in the parent's forward, `x = torch.utils."
            f"checkpoint.checkpoint(block, x, use_reentrant=False)` for each (e.g. `{first}`"
            + (
                "; it is a container with no forward of its own, a ModuleList: put the calls "
                "of its children in a function, `def run(x): ...`, and checkpoint `run`"
                if not any(m.path == first for m in modules)
                else ""
            )
            + "); Hugging Face models: `model.gradient_checkpointing_enable()`. Costs about one "
            "extra forward of those blocks per step."
        ),
        saving_bytes=saving,
        severity="warning",
    )


@dataclass(frozen=True)
class LighterOptimizer:
    """An optimizer with little state, as the ``optimizer-state`` advice offers it.

    What it would keep for parameters of ``P`` bytes with ``e``-byte elements is
    ``buffers * P + element_bytes * P / e`` (:meth:`kept`).

    Attributes:
        name: how the advice names it (``"Adafactor"``).
        how: why its state is small, for the text.
        buffers: state buffers per parameter in the parameters' dtype (SGD's momentum: 1).
        element_bytes: state bytes per parameter element whatever the dtype (8-bit Adam: two
            1-byte moments and a float32 scale per 256-element block of each).
        sparse: it takes sparse gradients (``nn.Embedding(sparse=True)``): Adam8bit and
            Adafactor raise on them.
        classes: the class names it goes by: never offered to an optimizer of one of them.
        sparse_only: offered only for sparse gradients (where the others cannot run).
    """

    name: str
    how: str
    buffers: float
    element_bytes: float
    sparse: bool
    classes: tuple[str, ...]
    sparse_only: bool = False

    def kept(self, parameter_bytes: int, element_size: int = 4) -> int:
        """The state it would keep for ``parameter_bytes`` of ``element_size``-byte elements.

        Examples:
            >>> LIGHTER_OPTIMIZERS[1].kept(4096, 4)  # 8-bit Adam: 1024 elements
            2080
        """
        elements = parameter_bytes / max(1, element_size)
        return round(self.buffers * parameter_bytes + self.element_bytes * elements)


LIGHTER_OPTIMIZERS = (
    # (on sparse gradients SGD's momentum buffer is sparse, and each step appends its rows
    # uncoalesced: it grows without bound, so it is not offered there)
    LighterOptimizer(
        "SGD with momentum", "one buffer per parameter", 1, 0, sparse=False, classes=("SGD",)
    ),
    LighterOptimizer(
        "8-bit Adam",
        "bitsandbytes.optim.Adam8bit, two 1-byte moments per parameter",
        0,
        2 + 2 * 4 / 256,
        sparse=False,
        classes=("Adam8bit", "AdamW8bit", "PagedAdam8bit", "PagedAdamW8bit"),
    ),
    LighterOptimizer(
        "Adafactor",
        "factored second moment (a row and a column per matrix), no first moment",
        0.05,  # a full buffer per vector (biases, norms): a few percent at most
        0,
        sparse=False,
        classes=("Adafactor",),
    ),
    LighterOptimizer(
        "Adagrad",
        "one accumulator per parameter",
        1,
        0,
        sparse=True,
        classes=("Adagrad",),
        sparse_only=True,
    ),
)
"""What the ``optimizer-state`` advice may offer instead (:func:`lighter_options`)."""

_ELEMENT_SIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the parameters' dtypes (``param_dtype``'s names)."""


def lighter_optimizers(sparse: bool) -> tuple[LighterOptimizer, ...]:
    """The lighter optimizers that can run where the gradients are ``sparse`` (or not).

    Examples:
        >>> [o.name for o in lighter_optimizers(sparse=True)]
        ['Adagrad']
    """
    return tuple(o for o in LIGHTER_OPTIMIZERS if (o.sparse if sparse else not o.sparse_only))


def lighter_options(
    state_bytes: int,
    optimized_bytes: int,
    *,
    optimizer: str | None,
    param_dtype: str | None,
    sparse: bool,
) -> list[tuple[LighterOptimizer, int]]:
    """The optimizers that would keep less than the state held now, each with its saving:
    ``state_bytes`` (what the current ``optimizer`` keeps for the ``optimized_bytes`` of
    parameters it steps) less what it would keep (:meth:`LighterOptimizer.kept`). Only those
    saving at least a quarter of it, never the optimizer in use.

    Examples:
        >>> mib = 1 << 20
        >>> [(o.name, s // mib) for o, s in lighter_options(
        ...     3 * mib, mib, optimizer="Adam", param_dtype="float32", sparse=False)]
        [('SGD with momentum', 2), ('8-bit Adam', 2), ('Adafactor', 2)]
        >>> [o.name for o, _ in lighter_options(
        ...     mib, mib, optimizer="SGD", param_dtype="float32", sparse=False)]
        ['8-bit Adam', 'Adafactor']
    """
    if state_bytes <= 0 or optimized_bytes <= 0:
        return []
    size = _ELEMENT_SIZE.get((param_dtype or "").removeprefix("torch."), 4)
    out = []
    for opt in lighter_optimizers(sparse):
        saving = state_bytes - opt.kept(optimized_bytes, size)
        if optimizer not in opt.classes and saving >= state_bytes / 4:
            out.append((opt, saving))
    return out


def shard_option(sparse: bool) -> str:
    """How optimizer state is sharded across ranks: ZeRO, or FSDP (which also shards weights
    and gradients) where the gradients are dense; FSDP reduce-scatters gradients through dense
    flat buffers, so sparse ones get ZeRO only (each rank keeps whole parameters' state)."""
    if sparse:
        return (
            "torch.distributed.optim.ZeroRedundancyOptimizer; not FSDP, whose gradient "
            "reduce-scatter is dense"
        )
    return (
        "torch.distributed.optim.ZeroRedundancyOptimizer, or FSDP which also shards weights "
        "and gradients"
    )


def lbfgs_history(
    optimizer_state_bytes: int, parameter_bytes: int, history_size: int | None
) -> tuple[str, str, int] | None:
    """LBFGS's state, explained: ``(evidence, action, saving)``, or ``None`` when it is not
    mostly history. LBFGS keeps up to ``history_size`` pairs of flat copies of the parameters
    (``old_dirs``, ``old_stps``) plus a few more (``d``, ``prev_flat_grad``); a smaller
    ``history_size`` keeps fewer pairs (the saving assumes the history is full)."""
    pair = 2 * parameter_bytes
    if pair <= 0 or optimizer_state_bytes < 2 * pair:
        return None
    kept = max(0, round((optimizer_state_bytes - pair) / pair))  # pairs held now
    size = history_size if history_size is not None else kept
    smaller = 10 if size > 20 else max(1, size // 2)
    saving = max(0, min(kept, size) - smaller) * pair
    if saving <= 0:
        return None
    of = f"history_size={history_size}" if history_size is not None else "its history"
    growing = (
        f" The history was still filling: full, its {history_size} pairs take "
        f"{format_size(history_size * pair)}."
        if history_size is not None and kept < history_size
        else ""
    )
    evidence = (
        f"LBFGS keeps {of}: about {kept} pairs of flat copies of the parameters (old_dirs, "
        f"old_stps), {format_size(pair)} a pair ({format_size(parameter_bytes)} of "
        f"parameters); its state was {format_size(optimizer_state_bytes)}, "
        f"{optimizer_state_bytes / parameter_bytes:.0f}x the parameters.{growing}"
    )
    action = (
        f"`torch.optim.LBFGS(..., history_size={smaller})` keeps {smaller} pairs: saves "
        f"~{format_size(saving)} (fewer pairs approximate the curvature from fewer steps; "
        "the default is 100)"
    )
    return evidence, action, saving


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
    history_size: int | None = None,
    foreach: bool | None = None,
    sparse_gradients: bool = False,
    optimized_bytes: int | None = None,
    param_dtype: str | None = None,
    optimizers: Sequence[tuple[str, int, int]] = (),
) -> Advice | None:
    """``optimizer-state``: optimizer state dominates the peak; the options and their savings.

    Args:
        optimizer_state_bytes: state at the peak.
        parameter_bytes: the parameters (all of them: stand-in for ``optimized_bytes``).
        peak_bytes: the peak.
        capacity: the device's size (see :data:`PRESSURE`).
        optimizer: its class name, for the text; never offered as an option.
        optimizer_transient_bytes: what the optimizer step allocated on top of its state (the
            ``foreach`` implementation's temporaries): ``foreach=False`` saves most of it.
        ranks: ranks to shard across (the world size); the text shows 2, 4 and 8 when unknown.
        device: where it ran, for the text.
        min_share: state must be at least this share of the peak.
        history_size: LBFGS's ``history_size``: its state is a history of parameter copies,
            and a smaller history is the option (:func:`lbfgs_history`).
        foreach: whether it steps with ``foreach``: only then is ``foreach=False`` offered
            (``False``: single-tensor or fused already, or an optimizer without the option,
            such as SparseAdam; ``None``: unknown).
        sparse_gradients: some gradients are sparse (``nn.Embedding(sparse=True)``; implied by
            SparseAdam): only optimizers that take them are offered, and ZeRO, not FSDP.
        optimized_bytes: the parameters the optimizer steps: its state over these is the
            buffers per parameter it keeps, which each option's saving is measured against
            (:func:`lighter_options`).
        param_dtype: the trained parameters' dtype (8-bit state is per element).
        optimizers: where several step, ``(class name, state bytes, stepped bytes)`` of each:
            the one with the most state is the one priced and named (``optimizer`` and
            ``optimized_bytes`` are then its), the others said beside it (sweep CG: a DLRM's
            SparseAdam was given Adam's state too, and a stateless SGD all of it).

    The saving claimed is the smallest offered optimizer's (else two ranks' sharding).
    """
    if peak_bytes <= 0 or optimizer_state_bytes < min_share * peak_bytes:
        return None
    if not under_pressure(peak_bytes, capacity):
        return None
    if optimizer == "LBFGS":
        found = lbfgs_history(optimizer_state_bytes, parameter_bytes, history_size)
        if found is not None:
            evidence, action, saving = found
            return Advice(
                code="optimizer-state",
                title=f"LBFGS's history is {percent_of(optimizer_state_bytes, peak_bytes)} of "
                "the peak",
                evidence=f"{evidence} Peak: {format_size(peak_bytes)} on {device}.",
                action=f"{action}.",
                saving_bytes=saving,
                severity="warning",
            )
    own, beside = optimizer_state_bytes, ""
    classes: dict[str, tuple[int, int]] = {}  # (optimizers of one class pooled: a GAN's Adams)
    for n, s, p in optimizers:
        state, stepped = classes.get(n, (0, 0))
        classes[n] = (state + s, stepped + p)
    if len(classes) > 1 and any(state for state, _ in classes.values()):
        optimizer = max(classes, key=lambda n: classes[n][0])
        own, optimized_bytes = classes[optimizer]
        own = min(own, optimizer_state_bytes)  # (on this device)
        beside = ", ".join(
            f"{n} {format_size(s)}" for n, (s, _) in classes.items() if n != optimizer
        )
    name = optimizer or "the optimizer"
    sparse = sparse_gradients or optimizer == "SparseAdam"
    stepped = optimized_bytes or parameter_bytes
    offered = lighter_options(
        own, stepped, optimizer=optimizer, param_dtype=param_dtype, sparse=sparse
    )
    options = [
        f"{opt.name} ({opt.how}{', takes sparse gradients' if sparse else ''}): saves "
        f"~{format_size(saving)}"
        for opt, saving in offered
    ]
    shard_ns = [ranks] if ranks and ranks > 1 else [2, 4, 8]
    shards = ", ".join(
        f"{n} ranks save {format_size(optimizer_state_bytes * (n - 1) // n)}" for n in shard_ns
    )
    options.append(f"shard it across ranks ({shard_option(sparse)}): {shards} per rank")
    if optimizer_transient_bytes and foreach:
        options.insert(
            0,
            f"`{name}(..., foreach=False)`: the step's temporaries "
            f"({format_size(optimizer_transient_bytes)}) shrink to one parameter's at a "
            "time: at most twice the largest (Adam's `sqrt` and division)",
        )
    return Advice(
        code="optimizer-state",
        title=f"optimizer state is {percent_of(optimizer_state_bytes, peak_bytes)} of the peak",
        evidence=(
            f"{name} state was {format_size(own)} of the {format_size(peak_bytes)} peak on "
            f"{device}: {state_per_parameter(own, stepped)}."
            + (
                f" Beside it: {beside} (optimizer state {format_size(optimizer_state_bytes)} "
                "in all; the options below replace "
                f"{name} alone)."
                if beside
                else ""
            )
        ),
        action="Options: " + "; ".join(options) + ".",
        saving_bytes=min(s for _, s in offered)
        if offered
        else _shard_saving(optimizer_state_bytes, ranks),
        severity="warning",
    )


STATE_BUFFERS = {
    "Adam": 2,  # exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad)
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,  # exp_avg, exp_inf
    "Adadelta": 2,  # square_avg, acc_delta
    "Adagrad": 1,  # sum
}
"""Buffers of the parameters' size that torch's optimizers keep per parameter whatever their
settings (but ``amsgrad``): what a state still being created will be (torch/optim sources)."""


def state_buffers(optimizer: str | None, group: Mapping[str, object]) -> int | None:
    """Buffers of the parameters' size a torch optimizer's state holds per parameter once it
    has stepped, read from its class and its param group's settings (``None``: an optimizer
    it does not know): what the first ``optimizer.step()`` will add.

    Examples:
        >>> state_buffers("AdamW", {"amsgrad": False}), state_buffers("SGD", {"momentum": 0})
        (2, 0)
        >>> state_buffers("RMSprop", {"momentum": 0.9, "centered": True})
        3
    """
    if optimizer in ("Adam", "AdamW"):
        return 2 + bool(group.get("amsgrad"))
    if optimizer in STATE_BUFFERS:
        return STATE_BUFFERS[optimizer]
    if optimizer == "SGD":
        return int(bool(group.get("momentum")))  # the momentum buffer, with momentum only
    if optimizer == "RMSprop":  # square_avg, momentum_buffer, grad_avg (centered)
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    return None


def state_per_parameter(state_bytes: int, optimized_bytes: int) -> str:
    """The state as buffers of the parameters' size, for the evidence.

    Examples:
        >>> state_per_parameter(3 << 20, 1 << 20)
        '3.0x the 1.00 MiB of parameters it steps (3 buffers of their size)'
    """
    if optimized_bytes <= 0:
        return "no parameters seen"
    ratio = state_bytes / optimized_bytes
    buffers = round(ratio)
    kept = (
        f" ({buffers} buffer{'s' if buffers != 1 else ''} of their size)"
        if buffers >= 1 and abs(ratio - buffers) < 0.05
        else ""
    )
    return f"{ratio:.1f}x the {format_size(optimized_bytes)} of parameters it steps{kept}"


def _shard_saving(state_bytes: int, ranks: int | None) -> int:
    """What sharding the state across ``ranks`` (two when unknown) saves per rank."""
    n = ranks if ranks and ranks > 1 else 2
    return state_bytes * (n - 1) // n


def _model_names(holders: Sequence[tuple[str, int]]) -> str:
    """The models holding the gradients, for the text: ```Generator```, ```A` and `B```."""
    names = [f"`{name}`" for name, _ in holders]
    return " and ".join(names) if len(names) <= 2 else ", ".join(names)


def zero_grad_keeps_grads(
    *,
    steps_with_grads: int,
    gradient_bytes: int,
    peak_phase: str | None = None,
    device: str = "the device",
    peak_bytes: int | None = None,
    next_peak_bytes: int | None = None,
    peak_gradient_bytes: int | None = None,
    holders: Sequence[tuple[str, int]] = (),
    held_elsewhere: bool = False,
    micro_batches: int = 1,
    into_backward: bool = False,
    idle_bytes: int = 0,
) -> Advice | None:
    """``zero-grad-keeps-grads``: gradients were allocated when a step's first forward began.

    ``steps_with_grads`` counts steps after the first whose first forward began with gradients
    allocated (``gradient_bytes``, the most such a forward found):
    ``optimizer.zero_grad(set_to_none=False)`` (zeros, still allocated), or ``zero_grad()``
    called between the forward and backward instead of before the forward. Under gradient
    accumulation the later micro batches of a step legitimately start with gradients; only a
    step's first forward counts.

    The saving is on the peak: claimed only when the peak came in a forward (``peak_phase``)
    and for the gradients alive there (``peak_gradient_bytes``, where known: with two
    optimizers they may be another model's than the first forward found, a GAN's
    generator's kept from its step through the critic's forward; 0, none; at a backward's
    peak that began with them, the peak's own, which grow as layers are unfrozen), by the models
    ``holders`` (``(name, bytes)``, named in the text), and then at most ``peak_bytes -
    next_peak_bytes`` (the highest other training phase's peak that does not hold them,
    which freeing them does not lower; under 1% of them, none; ``held_elsewhere``: phases
    that peak higher hold them too, as the steps that began without them show).
    ``micro_batches``: backward passes per optimizer step (gradient accumulation): only the
    first micro-batch's forward can begin without them. ``into_backward``: most such steps'
    backward began with them too (``set_to_none=False``: backward adds into them, where
    freed it creates each as it goes), so a peak in backward holds them as well: the saving
    there is at most them, down to ``next_peak_bytes`` (the forward's peak without them,
    the optimizer's). ``idle_bytes``: at a peak in backward or an optimizer's step, the
    gradients alive then on frozen parameters (a GAN's generator's, kept from its step
    through the discriminator's): freed right after their step, the peak falls by them, down
    to ``next_peak_bytes``.
    """
    if steps_with_grads < 1 or gradient_bytes <= 0:
        return None
    optimizer = peak_phase == "optimizer"
    if (optimizer or peak_phase == "backward") and idle_bytes > 0:
        falls = idle_bytes
        if peak_bytes is not None and next_peak_bytes is not None:
            falls = min(falls, peak_bytes - next_peak_bytes)
        if falls > idle_bytes // 100:
            return Advice(
                code="zero-grad-keeps-grads",
                title=f"{format_size(idle_bytes)} of gradients stay allocated through another "
                "model's update",
                evidence=(
                    f"On {device}, {steps_with_grads} step(s) began their forward with up to "
                    f"{format_size(gradient_bytes)} of gradients still allocated, and "
                    f"training's peak came in {'an optimizer step' if optimizer else 'a backward'}"
                    f" that held {format_size(idle_bytes)} of gradients of frozen parameters "
                    "(another optimizer's, kept from its last step through this update, for "
                    "which they were frozen: a GAN's generator's through the discriminator's). "
                    f"Freed right after their own step, they lower the peak by up to "
                    f"{format_size(falls)}"
                    + (
                        f": down to another phase's peak ({format_size(next_peak_bytes or 0)})."
                        if falls < idle_bytes
                        else "."
                    )
                ),
                action="Call each optimizer's `zero_grad(set_to_none=True)` right after its own "
                "`step()`, not right before its next backward: its gradients are then freed "
                "before the other model's update runs.",
                saving_bytes=falls,
                severity="warning",
            )
    in_forward = peak_phase == "forward"
    in_backward = peak_phase == "backward" and into_backward and micro_batches == 1
    alive = (
        peak_gradient_bytes
        if peak_gradient_bytes is not None and (in_forward or (in_backward and peak_gradient_bytes))
        else None
    )
    subject = alive or gradient_bytes
    names = _model_names(holders) if alive else ""
    whose = f"{names}'s " if names else ""
    saving: int | None = None
    if (in_forward or in_backward) and alive != 0:
        saving = subject
        if peak_bytes is not None and next_peak_bytes is not None:
            saving = min(saving, peak_bytes - next_peak_bytes)
        saving = saving if saving > subject // 100 else None  # (4 B: a loss's scalar)
    other = (
        f"; the {peak_phase} that peaked held {whose}{format_size(alive)} of gradients, kept from "
        "their optimizer's step"
        if alive and alive != gradient_bytes
        else ""
    )
    if alive == 0:
        where = (
            ". Training's peak came in a forward that held none (another pass of the step, after "
            "they were freed): freeing them sooner lowers the forwards they are alive in, "
            "not the peak, so no saving is claimed."
        )
    elif in_backward and saving is not None:
        where = (
            ", and training's peak came in backward, which began with them still allocated "
            "(`set_to_none=False`, or a `zero_grad()` that comes only after this backward: a "
            "GAN's generator's, kept from its step): backward adds each gradient into them, "
            "where freed it creates each as it goes, so they are all alive from its start. "
            f"Freed before the forward, they lower the peak by up to {format_size(saving)}"
            + (
                f": down to another phase's peak ({format_size(next_peak_bytes or 0)})."
                if saving < subject
                else "; by less where backward's peak comes after most gradients exist."
            )
        )
    elif saving is None:
        where = (
            f". Training's peak came in {peak_phase or 'another phase'}, not in a forward"
            if not in_forward
            else ". Training's peak came in a forward, but another phase peaks as high without them"
        ) + (
            (
                f": with {micro_batches} micro-batches a step, freeing them before the first "
                "one's forward lowers that forward only (the later ones run with the gradients "
                "accumulated so far), so no saving is claimed."
            )
            if micro_batches > 1
            else ": freeing them before the forward lowers the forward's memory; the peak moves "
            "only where they stayed allocated into it (`set_to_none=False`), so no saving is "
            "claimed."
        )
    elif saving < subject:
        where = (
            ", and training's peak came in a forward. Freed before the forward, they would lower "
            f"the forward by {format_size(subject)} but the peak only by "
            f"{format_size(saving)}: down to another training phase's peak "
            f"({format_size(next_peak_bytes or 0)}), which does not hold them."
        )
    elif held_elsewhere:
        where = (
            ", and training's peak came in a forward, so they are part of it. The backward and "
            "optimizer phases that peak within as much of it hold them too: in the steps "
            "that began without them, those phases peaked that much lower."
        )
    else:
        where = ", and training's peak came in a forward, so they are part of it."
    step = (
        (
            f"on the optimizer that steps {names}, right after its `step()`"
            if len(holders) == 1
            else f"on the optimizers that step {names}, right after their `step()`"
        )
        if names
        else "right after `optimizer.step()`"
    )
    return Advice(
        code="zero-grad-keeps-grads",
        title=f"{whose}{format_size(subject)} of gradients stay allocated through the forward",
        evidence=(
            f"On {device}, {steps_with_grads} step(s) began their forward with the "
            f"{format_size(gradient_bytes)} of gradients still allocated{other}{where}"
        ),
        action=(
            f"Free {whose + 'gradients' if whose else 'them'} before the forward: "
            "`optimizer.zero_grad(set_to_none=True)` (the default since PyTorch 2.0; drop "
            f"`set_to_none=False`) {step}, or before `model(x)`; not between forward and "
            "backward."
            + (  # (sweep CL: moving every zero_grad() after its step saved 66 of 766 KiB)
                " Only those named: where a backward also reaches another trained model's "
                "parameters (a generator's loss through the critic), it fills that model's "
                "too, so keep zeroing those right before their own backward."
                if names
                else ""
            )
        ),
        saving_bytes=saving,
        severity="warning" if saving else "info",
    )


def stale_gradients(
    *,
    holders: Sequence[tuple[str, int]],
    step: int | None,
    device: str = "the device",
    peak_step: int | None = None,
    looks: Sequence[tuple[int, int]] = (),
) -> Advice | None:
    """``stale-gradients``: parameters held gradients that no optimizer stepped over a whole
    step (``holders``: ``(model, bytes)``, the most found at once, at ``step``): a model kept
    after its training (a k-fold run keeping each fold's model for an ensemble), or
    parameters left out of the optimizer that still require grad. The saving is what the last
    look at or before training's peak (``peak_step``) found (``looks``: ``(step, bytes)``):
    none where they were stepped or freed by then (a head warmed up alone, then all trained)."""
    total = sum(n for _, n in holders)
    if total <= 0:
        return None
    names = _model_names(holders)
    before = [n for s, n in looks if peak_step is None or s <= peak_step]
    at_peak = before[-1] if before else None
    return Advice(
        code="stale-gradients",
        title=f"{format_size(total)} of gradients belong to parameters no optimizer steps",
        evidence=(
            f"On {device}, after step {step}, {names} held {format_size(total)} of gradients "
            "that no optimizer updated or zeroed through the next step: a model kept after its "
            "training (each fold's model kept for an ensemble) or parameters that require grad "
            "but are not in the optimizer. "
            + (
                f"The last look before training's peak found {format_size(at_peak)} of them."
                if at_peak
                else "None were left at the last look before training's peak: no saving there."
            )
        ),
        action=(
            "When a model's training ends, free its gradients: `model.zero_grad(set_to_none="
            "True)`, and `model.requires_grad_(False)` for a model kept for inference (or keep "
            "its `state_dict()` on the host); for parameters meant to stay fixed, "
            "`requires_grad_(False)`, or add them to the optimizer if they should train."
        ),
        saving_bytes=at_peak or None,
        severity="warning" if at_peak else "info",
    )


def oom_retry_holds(
    held: tuple[int, int, Sequence[str]] | None, device: str = "the device"
) -> Advice | None:
    """``oom-retry-holds``: the script caught an OOM and retried, and the retry's first
    forward began with the failed attempt's autograd graph still held (``held``: the step,
    the bytes its saved tensors hold, the variables holding it): an inline
    step's ``out`` and ``loss`` outlive the ``except`` block, so the smaller retry runs with
    the larger attempt's activations beside it."""
    if held is None:
        return None
    step, extra, holders = held
    names = ", ".join(holders)
    return Advice(
        code="oom-retry-holds",
        title=f"The retry after an OOM carried {format_size(extra)} of the failed attempt",
        evidence=(
            f"On {device}, the script caught an out-of-memory error and retried; when the "
            f"retry's first forward began (step {step}), {names} still held the failed "
            f"attempt's autograd graph, whose saved tensors were {format_size(extra)}: a step "
            "written inline keeps its outputs and loss in the loop's variables after the "
            "error, beside the retry's own."
        ),
        action=(
            "Drop them before retrying: in the `except` block set them to None (`out = loss "
            "= None`), or run the step in a function, whose locals are freed when the error "
            "leaves it; then `torch.cuda.empty_cache()` can return their memory."
        ),
        saving_bytes=extra,
        severity="warning",
    )


def retain_graph_held(
    held: tuple[int, int, Sequence[str]] | None, device: str = "the device"
) -> Advice | None:
    """``retain-graph-held``: a ``backward(retain_graph=True)`` ran through graphs that the
    script's variables still held, saving tensors, after a later backward (``held``: the
    step, the bytes, the variables): no backward will use them, and they sit beside the
    next passes' activations until the variables are reassigned (a GAN's discriminator loss
    on an undetached ``fake``)."""
    if held is None:
        return None
    step, extra, holders = held
    names = ", ".join(holders)
    return Advice(
        code="retain-graph-held",
        title=f"A graph kept with retain_graph=True holds {format_size(extra)} no backward uses",
        evidence=(
            f"On {device}, {names} held autograd graphs that a `backward(retain_graph=True)` "
            f"had run through; after a later backward (step {step}) they still saved "
            f"{format_size(extra)} of tensors, which stay beside the next passes' activations "
            "until the variable is reassigned. A GAN whose discriminator step backprops "
            "through an undetached `fake` needs retain_graph only because the generator's "
            "graph is shared with it."
        ),
        action=(
            "Detach what the retained backward does not need (`netD(fake.detach())` for the "
            "discriminator's step) and drop `retain_graph=True`; or, after its last backward, "
            "drop every variable that holds that graph (the loss and what was built from it: "
            "`errD = errD_real + errD_fake` holds it too)."
        ),
        saving_bytes=extra,
        severity="warning",
    )


@dataclass(frozen=True)
class EmbeddingTable:
    """An ``nn.Embedding`` trained with dense gradients (:func:`dense_embedding_gradients`):
    its ``path``, its weight's ``table_bytes``, one row's ``row_bytes`` and the rows a step
    looks up (indices, repeats included: what a sparse gradient holds)."""

    path: str
    table_bytes: int
    row_bytes: int
    rows_looked_up: int

    @property
    def sparse_bytes(self) -> int:
        """A sparse gradient's bytes: a row of values and an int64 index per lookup."""
        return self.rows_looked_up * (self.row_bytes + 8)


_SPARSE_STEPPERS = {
    "SGD": (
        "SGD without momentum or weight_decay takes them as they are (with momentum its buffer "
        "is sparse and grows by each step's rows, uncoalesced: step the tables with Adagrad "
        "or SparseAdam then)"
    ),
    "Adagrad": "Adagrad takes sparse gradients as they are",
    "SparseAdam": "SparseAdam takes them as they are",
}


def dense_embedding_gradients(
    *,
    tables: Sequence[EmbeddingTable],
    gradient_bytes: int,
    phase: str | None,
    optimizer_transient_bytes: int,
    optimized_bytes: int | None,
    peak_bytes: int,
    capacity: int | None = None,
    device: str = "the device",
    optimizer: str | None = None,
) -> Advice | None:
    """``dense-embedding-gradients``: embedding tables whose steps look up few of their rows
    get a gradient of the whole table (``sparse=False``, the default); ``sparse=True`` makes
    it a row per lookup. Saving: the tables' gradients at the peak less their sparse ones,
    and at a peak inside the optimizer step the dense update's temporaries in the tables'
    share of the parameters stepped (a sparse step touches only the rows looked up). Only
    tables whose sparse gradient is under a quarter of the table; fires when the saving is
    a tenth of the peak and matters (:func:`matters`)."""
    few = [t for t in tables if 0 < t.sparse_bytes < t.table_bytes / 4]
    if not few or peak_bytes <= 0:
        return None
    table_bytes = sum(t.table_bytes for t in few)
    gradients = max(0, min(gradient_bytes, table_bytes) - sum(t.sparse_bytes for t in few))
    update = (
        round(optimizer_transient_bytes * min(1.0, table_bytes / optimized_bytes))
        if phase == "optimizer" and optimized_bytes
        else 0
    )
    saving = gradients + update
    held = min(gradient_bytes, table_bytes)
    if saving < peak_bytes / 10 or not matters(saving, peak_bytes, capacity):
        return None
    shown = sorted(few, key=lambda t: -t.table_bytes)
    names = ", ".join(
        f"{t.path} ({format_size(t.table_bytes)}, {t.rows_looked_up:,} rows a step)"
        for t in shown[:4]
    ) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
    parts = f"~{format_size(gradients)} of gradients" + (
        f" and ~{format_size(update)} of the dense update's temporaries" if update else ""
    )
    stepper = _SPARSE_STEPPERS.get(optimizer or "")
    if stepper is None:
        step_with = (
            f"{optimizer or 'the optimizer'} does not take sparse gradients: step the tables "
            "with `torch.optim.SparseAdam(tables)` (Adam's two moments, of the whole table, "
            "updated at the rows looked up; no weight decay) and the rest with the optimizer "
            "you have"
        )
    else:
        step_with = stepper
    return Advice(
        code="dense-embedding-gradients",
        title="Embedding tables get gradients of every row; a step looks up few of them",
        evidence=(
            f"On {device}, backward gives each of these tables a dense gradient as large as "
            f"the table: {names}. Their gradients were {format_size(held)} of the "
            f"{format_size(peak_bytes)} peak ({percent_of(saving, peak_bytes)} would go)."
        ),
        action=(
            f"`nn.Embedding(..., sparse=True)` for them: the gradient holds a row per index "
            f"looked up, saving {parts}. {step_with}. Not under FSDP (its gradient "
            "reduce-scatter is dense), and not for a table tied to an output layer."
        ),
        saving_bytes=saving,
        severity="warning" if under_pressure(peak_bytes, capacity) else "info",
    )
