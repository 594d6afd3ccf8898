"""The training-step advice against what the alternative it offers really does (sweep M):
``optimizer-state`` priced every optimizer as Adam, ``mixed-precision`` promised autocast's
saving to a LoRA on a bf16 or int8 frozen base, and the OOM post-mortem offered autocast to a
forward already under it. Real models on the simulated device; each claimed saving is checked
by running the alternative (another optimizer, autocast) and counting."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import memkit
from memkit.advice.oom import oom_optimizer_state
from memkit.advice.track import track_advice
from memkit.advice.training import ModuleActivation, activation_checkpointing, mixed_precision
from memkit.tracking import track
from memkit.tracking.report import TrackReport
from memkit.units import format_size


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


OPTIMIZERS = {  # the sweep's optimizers with unusual state
    "sgdm": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The independent count: every tensor of the optimizer's state, each storage once."""
    seen: dict[int, int] = {}
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def train(name: str, budget: str | None) -> tuple[TrackReport, torch.optim.Optimizer]:
    model = mlp()
    opt = OPTIMIZERS[name](model.parameters())
    with track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker:
        for _ in range(3):
            F.cross_entropy(model(torch.randn(64, 256)), torch.randint(0, 10, (64,))).backward()
            opt.step()
            opt.zero_grad()
    return tracker.report(), opt


@pytest.mark.parametrize(
    ("name", "budget", "buffers"), [("amsgrad", "12MiB", 3), ("rmsprop", "9MiB", 3)]
)
def test_optimizer_state_prices_sgd_momentum_from_the_state_held_now(name, budget, buffers):
    """Three buffers per parameter: SGD with momentum saves two of them (3.05 MiB here; the
    Adam-shaped rule said 2.29 MiB)."""
    report, opt = train(name, budget)
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    _, sgdm = train("sgdm", None)
    saving = state_bytes(opt) - state_bytes(sgdm)  # run the alternative and count
    assert adv.saving_bytes == saving
    assert f"SGD with momentum (one buffer per parameter): saves ~{format_size(saving)}" in (
        adv.action
    )
    assert type(opt).__name__ in adv.evidence and f"({buffers} buffers" in adv.evidence
    assert "two moments" not in adv.evidence
    # 8-bit Adam keeps two 1-byte moments per element: the saving is at most the rest
    elements = sum(p.numel() for group in opt.param_groups for p in group["params"])
    (eight,) = [part for part in adv.action.split("; ") if part.startswith("8-bit Adam")]
    bound = state_bytes(opt) - 2 * elements
    assert bound * 0.97 <= _size_of(eight.rsplit("~", 1)[1]) <= bound


def _size_of(text: str) -> float:
    """Bytes of a :func:`format_size` text (``"3.80 MiB"``)."""
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_optimizer_state_never_offers_the_optimizer_in_use():
    """SGD with momentum keeps one buffer: the rule offered SGD with momentum (780 KiB
    "saved") and 8-bit Adam at 1.14 MiB, where two 1-byte moments save at most 0.76 MiB."""
    report, opt = train("sgdm", "5.3MiB")
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    assert "SGD with momentum" not in adv.action
    assert "SGD state was" in adv.evidence and "(1 buffer of their size)" in adv.evidence
    elements = sum(p.numel() for p in mlp().parameters())
    assert adv.saving_bytes is not None
    assert adv.saving_bytes <= state_bytes(opt) - 2 * elements  # 8-bit Adam, the smallest
    # the OOM post-mortem's rule reads the same facts
    dev = report.devices[0]
    bd = dev.breakdown
    assert bd is not None and dev.setup is not None
    share = {"optimizer state": 0.5}
    oom = oom_optimizer_state(bd, share, _post_mortem(dev.setup))
    assert oom is not None and "SGD with momentum" not in oom.action
    assert "8-bit Adam" in oom.action and oom.saving_bytes == adv.saving_bytes


def _post_mortem(setup):
    from types import SimpleNamespace

    return SimpleNamespace(setup=setup, optimizer_state_partial=False)


def test_adafactor_saving_is_no_more_than_running_it_saves():
    transformers = pytest.importorskip("transformers.optimization")
    report, opt = train("amsgrad", "12MiB")
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    model = mlp()
    other = transformers.Adafactor(
        model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False
    )
    F.cross_entropy(model(torch.randn(64, 256)), torch.randint(0, 10, (64,))).backward()
    other.step()
    (part,) = [p for p in adv.action.split("; ") if p.startswith("Adafactor")]
    claimed = _size_of(part.rsplit("~", 1)[1])
    real = state_bytes(opt) - state_bytes(other)
    assert 0.95 * real <= claimed <= real


# -- mixed precision on a half or quantized frozen base (LoRA) --------------------------------


class LoRALinear(nn.Module):
    """A frozen bf16 base and trainable float32 adapters, as the sweep's hand-written LoRA."""

    def __init__(self, d: int, r: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).to(torch.bfloat16).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, d) / math.sqrt(d))
        self.B = nn.Parameter(torch.zeros(d, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x.to(torch.bfloat16)).float()
        return y + (x @ self.A.t() @ self.B.t()) * 2


def lora_peak(amp: bool, budget: str | None) -> TrackReport:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (LoRALinear(512), nn.GELU())]
    model = nn.Sequential(*layers, nn.Linear(512, 10).requires_grad_(False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(torch.randn(256, 512)), torch.randint(0, 10, (256,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return tracker.report()


def test_mixed_precision_is_not_promised_to_a_lora_on_a_bf16_base():
    """Sweep M: "saves ~1.13 MiB" where autocast measured 0.22 MiB: the base is bf16 already
    and the adapters' code casts back to float32 on purpose."""
    plain = lora_peak(False, "9MiB")
    dev = plain.devices[0]
    assert "mixed-precision" not in [a.code for a in plain.advice]
    assert dev.setup is not None and dev.setup.narrow_weight_bytes == 4 * (512 * 512 + 512) * 2
    assert dev.setup.optimized_bytes == 4 * 2 * 8 * 512 * 4  # the adapters the optimizer steps
    measured = dev.peak_allocated - lora_peak(True, None).devices[0].peak_allocated
    # without the narrow weights' count, the rule promises several times what autocast saves
    unknown = dataclasses.replace(dev, setup=dataclasses.replace(dev.setup, narrow_weight_bytes=0))
    blind = track_advice(dataclasses.replace(plain, devices=(unknown,)))
    (adv,) = [a for a in blind if a.code == "mixed-precision"]
    assert adv.saving_bytes is not None and adv.saving_bytes > 3 * measured


def test_optimizer_state_counts_the_parameters_stepped_not_a_frozen_backbone_it_holds():
    """Sweep BH: fastai-style fine-tuning, ``AdamW(model.parameters())`` with the backbone
    frozen (``requires_grad_(False)``). Its state was called 0.8x "the 1.26 MiB of parameters
    it steps", and SGD with momentum was not offered; it steps the head's 10 KiB (2.0x)."""
    torch.manual_seed(0)
    backbone = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)))
    model = nn.Sequential(backbone.requires_grad_(False), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters())
    with track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(2):
            F.cross_entropy(model(torch.randn(64, 256)), torch.randint(0, 10, (64,))).backward()
            opt.step()
            opt.zero_grad()
    setup = tracker.report().devices[0].setup
    assert setup is not None and setup.optimized_bytes == (256 * 10 + 10) * 4


def test_mixed_precision_counts_only_the_float32_share_of_the_activations():
    kwargs = {"param_dtype": "float32", "autocast": False, "peak_bytes": 100 << 20}
    whole = mixed_precision(**kwargs, activation_bytes=80 << 20, parameter_bytes=8 << 20)
    part = mixed_precision(
        **kwargs, activation_bytes=80 << 20, parameter_bytes=8 << 20, narrow_weight_bytes=2 << 20
    )
    assert whole is not None and whole.saving_bytes == (40 - 4) << 20
    assert part is not None and part.saving_bytes == (30 - 3) << 20  # 3/4 of them float32
    assert "the estimate counts 75% of the activations" in part.evidence
    assert (
        mixed_precision(
            **kwargs,
            activation_bytes=80 << 20,
            parameter_bytes=8 << 20,
            narrow_weight_bytes=5 << 20,
        )
        is None
    )


# -- the OOM post-mortem of a forward under autocast -------------------------------------------


def autocast_oom(amp: bool) -> TrackReport:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU())
    opt = torch.optim.Adam(model.parameters())
    tracker = track(model, opt, device="cpu", budget="40MiB", postmortem=None)
    with pytest.raises(torch.OutOfMemoryError), tracker:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = model(torch.randn(4096, 512)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return tracker.report()


def test_oom_under_autocast_does_not_offer_autocast():
    """Sweep K: "or train in bf16/fp16 autocast" to a forward under torch.autocast."""
    under = autocast_oom(True).oom
    assert under is not None
    (adv,) = [a for a in under.advice if a.code == "oom-activations"]
    assert "autocast" not in adv.action
    assert under.autocast_forwards >= 1
    plain = autocast_oom(False).oom
    assert plain is not None and plain.autocast_forwards == 0
    (adv,) = [a for a in plain.advice if a.code == "oom-activations"]
    assert "or train in bf16/fp16 autocast" in adv.action


# -- a tiny language model: checkpointing, mixed precision, the OOM's micro-batch (sweep V) ----


class Block(nn.Module):
    """A pre-norm residual MLP block: it keeps 4x its output inside, returns x + f(x)
    (``dropout``: f ends in a dropout, as GPT-2's MLP does)."""

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.act(self.up(self.ln(x)))))


class TinyLM(nn.Module):
    """Embedding, residual blocks, a final norm, a vocabulary head and the loss computed in
    float32 in the forward, as a Hugging Face causal LM; ``checkpointed``: each block under
    ``torch.utils.checkpoint`` (what the advice proposes)."""

    def __init__(
        self, width: int = 64, vocab: int = 1024, checkpointed: bool = False, dropout: float = 0.0
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(4))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def lm_steps(
    model: nn.Module,
    batch: int = 8,
    micro: int = 1,
    *,
    budget: str | None = None,
    amp: bool = False,
    tracked: bool = True,
) -> TrackReport | int | None:
    """Two AdamW steps of ``batch`` sequences in ``micro`` micro-batches: the track report
    (its post-mortem on an OOM), or, untracked, the simulated device's peak (the independent
    count; ``None`` on an OOM)."""
    torch.manual_seed(1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    vocab = model.head.out_features  # type: ignore[union-attr]

    def steps() -> None:
        for _ in range(2):
            for _ in range(micro):
                ids = torch.randint(0, vocab, (batch // micro, 64))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = model(ids) / micro
                loss.backward()
            opt.step()
            opt.zero_grad()

    return counted(steps, model, opt, budget, tracked)


def counted(
    steps: Callable[[], None],
    model: nn.Module | None,
    opt: torch.optim.Optimizer,
    budget: str | None,
    tracked: bool,
) -> TrackReport | int | None:
    """``steps`` under ``memkit.track`` (its report, with the post-mortem of an OOM), or,
    untracked, on the simulated device alone (its peak: the independent count; ``None`` on an
    OOM)."""
    block = (
        track(model, opt, device="cpu", budget=budget, postmortem=None)
        if tracked
        else memkit.simulate(budget or "1GiB", device="cpu")
    )
    try:
        with block as run:
            steps()
    except torch.OutOfMemoryError:
        if not tracked:
            return None
    return run.report() if tracked else run.peak


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_saving_is_what_checkpointing_the_blocks_saves(dropout):
    """Sweep V: "saving ~4.89 MiB" where checkpointing GPT-2's blocks saved 26.43 MiB: each
    block's output was taken as its largest leaf's (a GELU's 4 MiB, not the 256 KiB the block
    returns). A block's output is what its forward returned; backward frees the head before
    the last block is recomputed. With a dropout last (GPT-2's MLP), its last leaf keeps a
    mask beside its output: that leaf's bytes made the outputs 1.25x too large."""
    report = lm_steps(TinyLM(dropout=dropout), budget="16MiB")
    assert isinstance(report, TrackReport)
    (adv,) = [a for a in report.advice if a.code == "activation-checkpointing"]
    assert "checkpoint 4 blocks" in adv.title
    output = 8 * 64 * 64 * 4  # each block returns a (8, 64, 64) float32 tensor
    assert f"their outputs (kept when checkpointed) are about {format_size(4 * output)}" in (
        adv.evidence
    )
    plain = lm_steps(TinyLM(dropout=dropout), tracked=False)
    applied = lm_steps(TinyLM(checkpointed=True, dropout=dropout), tracked=False)
    assert isinstance(plain, int) and isinstance(applied, int)
    assert plain == report.devices[0].peak_allocated
    assert adv.saving_bytes is not None and 0.9 * (plain - applied) <= adv.saving_bytes
    assert adv.saving_bytes <= plain - applied


def test_a_gpu_scripts_own_cuda_autocast_on_the_simulated_cpu_is_said_and_not_advised():
    """Sweep ZZ: a script written for a GPU, its forward under ``torch.autocast("cuda",
    dtype=torch.bfloat16)``, tracked on the simulated CPU device: torch disables the region
    (a warning), the numbers are float32, and the report said "no forward ran under autocast"
    and advised the very autocast the script has. Now a note says what ran, and the
    mixed-precision advice is not given; without the region it is, with how to measure it on
    a CPU."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())

    def steps(region: bool) -> TrackReport:
        with track(model, opt, device="cpu", budget="16MiB", postmortem=None) as tracker:
            for _ in range(2):
                ids = torch.randint(0, 1024, (8, 64))
                ctx = torch.autocast("cuda", dtype=torch.bfloat16) if region else nullcontext()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (CPU torch: "Disabling autocast")
                    with ctx:
                        loss = model(ids)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return tracker.report()

    asked = steps(region=True)
    assert "mixed-precision" not in [a.code for a in asked.advice]
    assert any("torch.autocast('cuda', bfloat16) regions cast nothing on cpu" in n
               for n in asked.notes), asked.notes  # fmt: skip
    plain = steps(region=False)
    (advice,) = [a for a in plain.advice if a.code == "mixed-precision"]
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in advice.evidence
    assert not any("cast nothing" in n for n in plain.notes)


@pytest.mark.parametrize("container", [True, False])
def test_checkpointing_a_modulelist_block_says_to_wrap_its_childrens_calls(container):
    """Sweep AA: vit-pytorch's layers are ``ModuleList([attn, ff])`` entries with no forward;
    the advice said ``checkpoint(block, x)`` "e.g. transformer.layers.0", which raises
    NotImplementedError there. For such a block it says to checkpoint a function that calls
    the children; for a block with a forward (a row of its own), it does not."""
    mib = 1 << 20
    rows = [ModuleActivation("ViT", 40 * mib, False, "ViT", 0, None)]
    for i in range(3):
        if not container:
            rows.append(ModuleActivation(f"layers.{i}", 12 * mib, False, "Block", 1 + 4 * i, mib))
        for j, (kind, kept) in enumerate((("Attention", 6), ("FeedForward", 5), ("Dropout", 1))):
            rows.append(ModuleActivation(f"layers.{i}.{j}", kept * mib, True, kind,
                                         2 + 4 * i + j))  # fmt: skip
    advice = activation_checkpointing(activation_bytes=38 * mib, peak_bytes=40 * mib,
                                      modules=rows)  # fmt: skip
    assert advice is not None and "e.g. `layers.0`" in advice.action
    assert ("container with no forward of its own" in advice.action) is container


def test_what_backward_frees_before_the_last_block_is_the_students_with_a_teacher_first():
    """Review: the model's own row (the first called) prices what the forward kept after the
    blocks; a teacher called first (``memkit run``'s global hooks) was taken for it, with its
    0 bytes kept, and the head's 4 MiB left out. A first row that keeps less than the blocks
    is no model's own: what the modules called after the blocks kept is used."""
    mib = 1 << 20
    rows = [ModuleActivation("Teacher", 0, False, "Teacher", 0, None)]
    rows += [ModuleActivation(f"blocks.{i}", 8 * mib, False, "Block", 1 + i, mib)
             for i in range(4)]  # fmt: skip
    rows.append(ModuleActivation("head", 4 * mib, True, "Linear", 5))
    from memkit.advice.training import _kept_after

    assert _kept_after([f"blocks.{i}" for i in range(4)], rows) == 4 * mib


def test_the_cuda_regions_seen_on_a_cpu_nest_and_end_as_entered():
    """Review: a disabled region nested in an enabled one read as inside, a nested watch or a
    region entered twice (a recursive ``@autocast`` function) left it inside for good."""
    from memkit import cuda_autocast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (CPU torch: "Disabling autocast")
        with cuda_autocast.regions_entered(), cuda_autocast.regions_entered():
            outer = torch.autocast("cuda", dtype=torch.bfloat16)
            with outer:
                assert cuda_autocast.inside()
                with torch.autocast("cuda", enabled=False):
                    assert not cuda_autocast.inside()
                with outer:  # the same region again
                    assert cuda_autocast.inside()
                assert cuda_autocast.inside()
            assert not cuda_autocast.inside()
        with cuda_autocast.regions_entered():  # a region still open when the watch ends
            region = torch.autocast("cuda", dtype=torch.bfloat16)
            region.__enter__()
        region.__exit__(None, None, None)
    assert not cuda_autocast.inside()


def test_mixed_precision_counts_what_autocast_keeps_in_float32():
    """Sweep V: "saving ~17.83 MiB" where CPU bf16 autocast saved 10.61 MiB on a GPT-2 LM, and
    4.41 MiB promised to a checkpointed one whose peak autocast raised: norms and embeddings
    stay float32, and the loss reads the logits in float32 (a float32 copy replaces the half
    one)."""
    report = lm_steps(TinyLM(), budget="16MiB")
    assert isinstance(report, TrackReport)
    (adv,) = [a for a in report.advice if a.code == "mixed-precision"]
    plain = lm_steps(TinyLM(), tracked=False)
    under = lm_steps(TinyLM(), tracked=False, amp=True)
    assert isinstance(plain, int) and isinstance(under, int)
    assert adv.saving_bytes is not None and "stay float32 under autocast" in adv.evidence
    # (1.15: 2.30 MB claimed where CPU autocast and the estimate's CUDA rules save 2.03: since
    # the embedding's weight is no longer taken for a cached half copy, sweep CG, nothing
    # offsets the activations' own over-count here)
    assert 0.8 * (plain - under) <= adv.saving_bytes <= 1.15 * (plain - under)
    # checkpointed, what is left is mostly float32: autocast saves nothing, the rule is silent
    ckpt = lm_steps(TinyLM(checkpointed=True), budget="8MiB")
    assert isinstance(ckpt, TrackReport)
    assert "mixed-precision" not in [a.code for a in ckpt.advice]
    applied = lm_steps(TinyLM(checkpointed=True), tracked=False, amp=True)
    assert isinstance(applied, int) and applied >= ckpt.devices[0].peak_allocated - (64 << 10)
    # the report says checkpointing ran (the text's setup lines)
    said = "activation checkpointing: on (the model's or the trainer's setting); 4 module(s) "
    assert said + "recomputed their forward in backward " in str(ckpt)
    assert "(blocks.0 ... blocks.3)" in str(ckpt)
    assert "activation checkpointing" not in str(report).split("\n\n")[0]


def test_the_oom_micro_batch_leaves_room_for_the_gradients_and_state_to_come():
    """Sweep V: an OOM in step 0's forward, before any gradient or optimizer state existed,
    was told "halve the micro-batch": applied, step 1 ran out with AdamW's state and the
    gradients. The cut now fits beside them: quarter it here, where half does not fit."""
    model = TinyLM(width=128, vocab=2048)
    report = lm_steps(model, 16, budget="36MiB")
    assert isinstance(report, TrackReport)
    pm = report.oom
    assert pm is not None and pm.step == 0 and pm.phase == "forward" and pm.breakdown
    assert pm.breakdown.gradients == pm.breakdown.optimizer_state == 0
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    trained = sum(p.numel() * p.element_size() for p in model.parameters())
    assert "Quarter the micro-batch (16 -> 4 or fewer) and accumulate gradients over 4 steps" in (
        adv.action
    )
    assert f"({format_size(trained)})" in adv.evidence  # the gradients to come
    assert f"AdamW's state (2 buffers of their size), {format_size(2 * trained)}" in adv.evidence
    # inside the model's forward it had kept only part: no "made outside its modules", and
    # checkpointing stays offered (sweep BX: withdrawn at a transformers model's forward OOM)
    assert "outside its modules" not in adv.evidence and "checkpoint" in adv.action
    assert lm_steps(TinyLM(128, 2048), 16, 4, budget="36MiB", tracked=False) is not None
    assert lm_steps(TinyLM(128, 2048), 16, 2, budget="36MiB", tracked=False) is None


def test_the_oom_state_to_come_is_found_without_a_given_optimizer():
    """Sweep JJ: under ``memkit run`` (no optimizer given, none stepped before step 0's OOM)
    the advice left SGD's momentum out of what the step will hold; ``track(model, opt)``
    counted it. The optimizer is found in the failing frames now."""
    model = TinyLM(width=128, vocab=2048)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(None, device="cpu", budget="40MiB", postmortem=None) as tracker,
    ):
        model(torch.randint(0, 2048, (16, 64))).backward()
        opt.step()
    pm = tracker.report().oom
    assert pm is not None and pm.step == 0 and pm.phase == "forward"
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    trained = sum(p.numel() * p.element_size() for p in model.parameters())
    assert f"SGD's state (1 buffer of their size), {format_size(trained)}" in adv.evidence


def test_the_oom_gradients_to_come_are_the_trained_parameters_only():
    """Sweep V: a LoRA whose adapters train (96 KiB) was told the first micro-batch's gradients
    would be "up to 4.18 MiB", every parameter's."""
    model = TinyLM(width=128, vocab=2048)
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("down.bias"))
    report = lm_steps(model, 16, budget="24MiB")
    assert isinstance(report, TrackReport)
    pm = report.oom
    assert pm is not None and pm.phase == "forward"
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert trained == 4 * 128 * 4
    said = f"the gradients of the parameters it trains not yet allocated ({format_size(trained)})"
    assert said in adv.evidence
    assert lm_steps(model, 16, 2, budget="24MiB", tracked=False) is not None  # halved, it fits


def reference_steps(batch: int, budget: str, tracked: bool = True) -> TrackReport | int | None:
    """DPO's shape: a large frozen reference model's forward under ``no_grad`` on the training
    batch, then the small policy's; the models found by the global hooks (``memkit run``)."""
    reference = TinyLM(width=256, vocab=2048).eval().requires_grad_(False)
    policy = TinyLM(width=32, vocab=2048)
    opt = torch.optim.AdamW(policy.parameters())

    def steps() -> None:
        for _ in range(2):
            ids = torch.randint(0, 2048, (batch, 64))
            with torch.no_grad():
                reference_loss = reference(ids)
            (policy(ids) - reference_loss).backward()
            opt.step()
            opt.zero_grad()

    return counted(steps, None, opt, budget, tracked)


def test_oom_parameters_says_a_smaller_batch_helps_where_it_can():
    """Sweep V: a DPO reference model's forward ran out with the parameters 54% of the memory:
    ``oom-parameters`` said a smaller batch would not help much while ``oom-frozen-model``
    said to lower it, and a quarter of the batch fitted. Now the activations (and a request
    made in forward) decide: more
    than the failure lacked, a smaller batch may fit; less, none does, and neither says so."""

    def advice(budget: str) -> dict[str, Any]:
        report = reference_steps(16, budget)
        assert isinstance(report, TrackReport) and report.oom is not None
        assert report.oom.phase == "eval" and report.oom.frozen_model is not None
        return {a.code: a for a in report.oom.advice}

    helps = advice("24MiB")
    assert "may make up for it" in helps["oom-parameters"].evidence
    assert "cannot" not in helps["oom-parameters"].action
    assert "Lower the training micro-batch" in helps["oom-frozen-model"].action
    assert reference_steps(4, "24MiB", tracked=False) is not None
    # the weights and one sample's forward exceed it, by more than the activations and the
    # failed request (which a smaller batch may shrink, where a forward made it) together
    hopeless = advice("12.5MiB")
    assert "no smaller batch makes it fit" in hopeless["oom-parameters"].evidence
    assert "Lower the training micro-batch" not in hopeless["oom-frozen-model"].action
    assert reference_steps(1, "12.5MiB", tracked=False) is None


# -- distillation: a student of its teacher's class, a frozen teacher's weights (sweep FF) ------


class KDBlock(nn.Module):
    """A pre-norm residual MLP block (the sweep's distillation blocks)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class KDNet(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.Sequential(*(KDBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class KDTeacher(KDNet):
    """The teacher under a class of its own."""


def distil(teacher_class: type[KDNet], budget: str | None, amp: bool = False) -> Any:
    """Two steps of a student (3 blocks) distilled from a larger frozen teacher (4 wider
    blocks, eval mode, under ``no_grad``): the track report, or with ``amp`` (bf16 autocast
    around the student) untracked, the simulated device's peak."""
    torch.manual_seed(0)
    teacher = teacher_class(4, 64).eval().requires_grad_(False)
    student = KDNet(3, 32)
    opt = torch.optim.AdamW(student.parameters())

    def steps() -> None:
        for _ in range(2):
            x = torch.randn(512, 32)
            with torch.no_grad():
                soft = teacher(x).softmax(-1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits = student(x)
            F.kl_div(logits.float().log_softmax(-1), soft, reduction="batchmean").backward()
            opt.step()
            opt.zero_grad()

    if budget is None:
        with memkit.simulate("1GiB", device="cpu") as sim:
            steps()
        return sim.peak
    with track(device="cpu", budget=budget, postmortem=None) as tracker:
        steps()
    return tracker.report()


@pytest.mark.parametrize("teacher_class", [KDNet, KDTeacher])
def test_distillation_advice_is_about_the_student(teacher_class):
    """Sweep FF: with teacher and student of one class the student's rows are ``Net#2``, which
    the precision rule did not take for a model's row: all its activations counted as
    temporaries and the rule was silent, where bf16 autocast lowered the peak by 18.76 MiB.
    With the teacher of its own class it promised 10.59 MiB: it took a half copy of every
    weight off, the frozen teacher's too, whose casts autocast does not cache (it caches
    leaves that require grad). Checkpointing counted the teacher's blocks (0 B) among those
    to checkpoint."""
    report = distil(teacher_class, "4MiB")
    student = "KDNet#2" if teacher_class is KDNet else "KDNet"
    advice = {a.code: a for a in report.advice}
    measured = distil(teacher_class, None) - distil(teacher_class, None, amp=True)
    saving = advice["mixed-precision"].saving_bytes
    assert saving is not None and 0.8 * measured <= saving <= 1.05 * measured
    ckpt = advice["activation-checkpointing"]
    assert "checkpoint 3 blocks" in ckpt.title
    assert f"{student}.blocks.0 ... {student}.blocks.2 (3 blocks" in ckpt.evidence
    assert f"{teacher_class.__name__}.blocks" not in ckpt.evidence


class Attention(nn.Module):
    """A pre-norm attention block as GPT-2's: its own code (sdpa with dropout, on CPU the
    math path, which computes in float32 under autocast) keeps the scores and probabilities."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            t.unflatten(-1, (4, -1)).transpose(1, 2) for t in self.qkv(self.ln(x)).chunk(3, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return x + self.proj(y.transpose(1, 2).flatten(2))


class AttentionLM(TinyLM):
    """TinyLM with an attention block before each of its MLP blocks."""

    def __init__(self) -> None:
        super().__init__(dropout=0.1)
        self.blocks = nn.ModuleList(m for b in self.blocks for m in (Attention(64), b))


def test_mixed_precision_keeps_an_attention_s_own_math_in_float32():
    """Sweep II: GPT-2 was promised 4.79 MiB where bf16 autocast saved 2.94 MiB: the
    attention's own code (softmax, sdpa's math path) keeps its scores and probabilities
    float32; a norm's output feeding a linear is replaced by the linear's half copy."""
    report = lm_steps(AttentionLM(), budget="24MiB")
    assert isinstance(report, TrackReport)
    (adv,) = [a for a in report.advice if a.code == "mixed-precision"]
    plain = lm_steps(AttentionLM(), tracked=False)
    under = lm_steps(AttentionLM(), tracked=False, amp=True)
    assert isinstance(plain, int) and isinstance(under, int)
    assert adv.saving_bytes is not None
    # CPU's sdpa math path also makes float32 copies of the half q, k, v under autocast, which
    # the records cannot show: still over (1.41x; 2.39x before)
    assert 0.8 * (plain - under) <= adv.saving_bytes <= 1.45 * (plain - under)


class _MixedHead(nn.Module):
    """A float32 body with a float64 head (sweep BD: a physics head kept in double)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 256))
        self.head = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).double())


def _peak_and_advice(model: nn.Module, steps: int = 3) -> tuple[int, dict[str, Any]]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with track(model, opt, device="cpu", budget="32MiB") as tracker:
        for _ in range(steps):
            x = torch.randn(256, 64)
            y = torch.randn(256, 1, dtype=next(model.parameters()).dtype)
            out = model(x)
            loss = F.mse_loss(out, y.to(out.dtype))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    report = tracker.report()
    return report.devices[0].peak_allocated, {a.code: a for a in report.advice}


def test_float64_advice_on_a_float64_head_halves_only_its_share():
    """``float64`` halved every byte of a model whose float32 body held 36% of the weights:
    ~10.21 MiB promised where making the head float32 saved 7.02. The saving now counts the
    float64 share; checked by making the head float32 and counting."""
    torch.manual_seed(0)
    mixed = _MixedHead()
    peak, advice = _peak_and_advice(mixed)
    said = advice["float64"]
    assert "of the trainable parameters' bytes" in said.evidence
    assert "torch.set_default_dtype(torch.float64)" in said.action
    torch.manual_seed(0)
    single = _MixedHead()
    single.head.float()
    single.forward = lambda x: single.head(single.body(x))  # type: ignore[method-assign]
    saved = peak - _peak_and_advice(single)[0]
    assert said.saving_bytes is not None
    assert abs(said.saving_bytes - saved) <= 0.15 * saved, (said.saving_bytes, saved)


class _Spectral(nn.Module):
    """A Fourier layer (an FNO's): complex64 weights, trained like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(64, 64)
        self.weights = nn.Parameter(torch.randn(64, 33, dtype=torch.cfloat) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(self.lift(x), dim=-1)
        return torch.fft.irfft(spectrum * self.weights[0], n=x.shape[-1], dim=-1)


def _train_spectral(model: nn.Module, batch: int) -> TrackReport:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for _ in range(3):
            loss = model(torch.randn(batch, 64)).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return tracker.report()


def test_complex_weights_are_trainable_and_get_no_autocast_advice():
    """An FNO's complex64 spectral weights (99% of its parameters) were left out of the
    trainable bytes: the report spoke of "float32 weights that require no grad (a frozen
    model's)" and offered bf16 autocast, under which cuFFT refuses the FFTs (memkit's own
    estimate says so)."""
    torch.manual_seed(0)
    model = _Spectral()
    report = _train_spectral(model, 512)
    setup = report.devices[0].setup
    assert setup is not None and setup.param_dtype == "complex64"
    assert setup.trainable_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert "mixed-precision" not in {a.code for a in report.advice}
    assert "require no grad" not in str(report)


def test_complex128_weights_under_a_float64_default_get_the_float64_advice():
    """Review: under ``torch.set_default_dtype(torch.float64)`` (PINN and FNO code) the
    spectral weights are complex128; counted as trainable, they made the model's dtype
    complex128, and the float64 advice (which single precision halves) was lost."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _Spectral()
        model.weights = nn.Parameter(torch.randn(64, 33, dtype=torch.cdouble) * 0.02)
        report = _train_spectral(model, 2048)
    finally:
        torch.set_default_dtype(default)
    advice = {a.code: a for a in report.advice}
    assert "Parameters are complex128" in advice["float64"].evidence
    assert "`.to(torch.complex64)`" in advice["float64"].action


class MnistNet(nn.Module):
    """pytorch/examples' MNIST net: its activations and pooling are the forward's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(x, dim=1)


def mnist_peak(amp: bool, tracked: bool) -> Any:
    torch.manual_seed(0)
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    block = track(model, opt, device="cpu", budget="96MiB", postmortem=None) if tracked else None
    with block or memkit.simulate("96MiB") as counted:
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.nll_loss(model(torch.randn(64, 1, 28, 28)), torch.randint(0, 10, (64,)))
            loss.backward()
            opt.step()
    return block.report() if block is not None else counted.peak


def test_mixed_precision_names_the_switch_of_the_framework_that_wrapped_the_model():
    """Sweep BK: a loop under accelerate or Fabric was told to write `torch.autocast(...)`
    around its forward, where the framework's own switch does it."""
    kwargs = {"param_dtype": "float32", "autocast": False, "activation_bytes": 80 << 20,
              "peak_bytes": 100 << 20, "parameter_bytes": 8 << 20}  # fmt: skip
    plain = mixed_precision(**kwargs)
    accelerate = mixed_precision(**kwargs, wrapper="accelerate")
    fabric = mixed_precision(**kwargs, wrapper="fabric")
    assert plain is not None and accelerate is not None and fabric is not None
    assert "torch.autocast" in plain.action
    assert accelerate.action.startswith('`Accelerator(mixed_precision="bf16")`')
    assert fabric.action.startswith('`Fabric(precision="bf16-mixed")`')
    assert plain.saving_bytes == accelerate.saving_bytes == fabric.saving_bytes


def test_a_run_under_cpu_autocast_says_its_op_lists_are_not_cudas():
    """Sweep BJ: a report of a run under CPU bf16 autocast read as a GPU's would, where a
    loss in the region makes a float32 copy of its bf16 input on the CPU only."""
    report = mnist_peak(True, tracked=True)
    notes = [n for n in report.notes if n.startswith("torch.autocast on the CPU")]
    assert len(notes) == 1 and "estimate --amp bf16" in notes[0]
    assert not any(n.startswith("torch.autocast on the CPU") for n in mnist_peak(False, True).notes)


def test_an_oom_in_a_contrastive_loss_names_what_the_loss_made_not_the_model_blocks():
    """Sweep BT: a SimCLR loss's 2N x 2N logits, their log-softmax and gradients held most of
    the activations when backward ran out; the post-mortem named the encoder's layers and
    offered checkpointing them (applied: the peak fell 10% and it still ran out), and said a
    split batch is the "same effective batch" for a loss over the batch's pairs."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
    n = 1024
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(encoder, opt, device="cpu", budget="40MiB", postmortem=None) as tracker,
    ):
        for _ in range(2):
            views = torch.randn(2 * n, 32)
            z = F.normalize(encoder(views), dim=-1)
            logits = z @ z.t() / 0.1  # 2N x 2N
            labels = torch.arange(2 * n).roll(n)
            F.cross_entropy(logits, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "backward" and pm.breakdown is not None
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    pair_matrix = (2 * n) ** 2 * 4  # one float32 2N x 2N tensor
    assert pm.made_outside is not None
    kept, outside = pm.made_outside
    assert kept < pair_matrix and outside == pm.breakdown.activations - kept
    assert outside >= pair_matrix  # the logits' log-softmax, at least, is the loss's
    assert f"the other {format_size(outside)} were made outside its modules" in adv.evidence
    assert "checkpoint" not in adv.action and "in-batch negatives" in adv.action
    # where it fits, the report's breakdown says the same of its peak (no module row shows it)
    with track(encoder, opt, device="cpu", budget="256MiB") as fitted:
        for _ in range(2):
            z = F.normalize(encoder(torch.randn(2 * n, 32)), dim=-1)
            F.cross_entropy(z @ z.t() / 0.1, torch.arange(2 * n).roll(n)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    dev = fitted.report().devices[0]
    bd = dev.breakdown
    (root,) = [m for m in dev.modules if m.path == m.type_name]
    made = bd.activations - (root.activation_bytes_per_step or root.activation_bytes)
    assert made >= pair_matrix and bd.note is not None
    assert f"the other {format_size(made)} were made outside its modules, by the loss" in bd.note


def test_an_ensemble_of_one_class_is_the_models_own_activations():
    """Review: the second model of a class is named ``Sequential#2``; its row was not taken
    for a model's, and its activations were said to be made outside the model's modules."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8)) for _ in range(3)]
    opt = torch.optim.SGD([p for m in members for p in m.parameters()], lr=0.1)
    with track(device="cpu", budget="256MiB") as tracker:
        for _ in range(3):
            x = torch.randn(256, 64)
            sum(m(x).square().mean() for m in members).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    dev = tracker.report().devices[0]
    assert {m.path for m in dev.modules if "." not in m.path} >= {"Sequential#2", "Sequential#3"}
    assert dev.breakdown is not None and "outside its modules" not in (dev.breakdown.note or "")


@pytest.mark.parametrize("loss", ["BCELoss", "BCEWithLogitsLoss"])
def test_mixed_precision_tells_a_bce_loss_to_take_logits_first(loss):
    """Sweep BY: a DCGAN's discriminator ends in a Sigmoid and trains with ``nn.BCELoss``,
    which CUDA's autocast refuses ('unsafe to autocast'): the advice to autocast must say to
    switch to the logits form first, or it raises on a GPU. Its loss is a sum of two."""
    torch.manual_seed(0)
    head = [nn.Sigmoid()] if loss == "BCELoss" else []
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1), *head)
    criterion = getattr(nn, loss)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(2):
            x = torch.randn(2048, 256)
            ones, zeros = torch.ones(2048, 1), torch.zeros(2048, 1)
            err = criterion(model(x), ones) + criterion(model(-x), zeros)
            err.backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    (adv,) = [a for a in report.advice if a.code == "mixed-precision"]
    assert ("BCEWithLogitsLoss" in adv.action) == (loss == "BCELoss")
    assert report.unsafe_loss == ("binary_cross_entropy" if loss == "BCELoss" else None)


class _LossNet(nn.Module):
    """Blocks, a head and a loss computed in the model's own code (a Hugging Face model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)
        )
        self.head = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x), y)


class _Wrapper(nn.Module):
    """peft's PeftModel, in three lines: one module, called with what it was given."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        return self.model(*args)


def test_a_wrapper_around_the_model_changes_no_saving():
    """Sweep BZ: peft's PeftModelForCausalLM > LoraModel > GPT2LMHeadModel; the savings read
    the outermost row's own bytes (the head and the loss), 0 for a wrapper: checkpointing
    came out 24% low and mixed precision 15% high, for the same memory."""
    savings = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model: nn.Module = _LossNet()
        if wrap:
            model = _Wrapper(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
            for _ in range(2):
                model(torch.randn(1024, 256), torch.randint(0, 512, (1024,))).backward()
                opt.step()
                opt.zero_grad()
        report = tracker.report()
        savings.append({a.code: a.saving_bytes for a in report.advice})
    assert {"activation-checkpointing", "mixed-precision"} <= savings[0].keys()
    assert savings[0] == savings[1]


RESBLOCK_FILE = """
import torch
from torch import nn
from torch.nn import functional as F


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, ch), nn.Conv2d(ch, ch, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, ch), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(x + h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(32), ResBlock(32))
        self.out = nn.Conv2d(32, 3, 3, padding=1)

    def forward(self, x):
        return self.out(self.blocks(self.inc(x)))


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(n):
    return torch.randn(n, 3, 32, 32)


def loss_fn(out, batch):
    return F.mse_loss(out, batch)
"""


def _cuda_rules_saving(path: Any, text: str, batch: int, peak: str) -> tuple[int, dict[str, Any]]:
    """What CUDA's autocast rules save on model file ``text`` (written to ``path``) at
    ``batch``: the estimate's fp32 less its bf16 ``peak`` (``"counted"`` or
    ``"allocated"``), and the file's names, to train its model as the file says."""
    path.write_text(text)
    kwargs: dict[str, Any] = {"device_memory": "1TiB", "min_batch": batch, "max_batch": batch}
    fp32, bf16 = (
        memkit.estimate(str(path), **kwargs),
        memkit.estimate(str(path), amp="bf16", **kwargs),
    )
    field = f"{peak}_peak"
    scope: dict[str, Any] = {}
    exec(compile(text, str(path), "exec"), scope)
    return getattr(fp32.trials[0], field) - getattr(bf16.trials[0], field), scope


def test_mixed_precision_keeps_a_conv_nets_norms_float32(tmp_path):
    """Sweep BY: a DDPM UNet (GroupNorm, then a functional SiLU, then a conv; residual sums
    into the norms) was promised 11.79 MiB where CUDA's autocast rules (the estimate's rerun,
    an emulation on CPU) saved 2.55-2.62: the norms keep their float32 output (the SiLU reads
    it) and a float32 copy of the half sum they are fed. Checked against the estimate's."""
    rules, scope = _cuda_rules_saving(tmp_path / "resblock_model.py", RESBLOCK_FILE, 16, "counted")
    model = scope["build_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(2):
            batch = scope["make_batch"](16)
            scope["loss_fn"](model(batch), batch).backward()
            opt.step()
            opt.zero_grad()
    (adv,) = [a for a in tracker.report().advice if a.code == "mixed-precision"]
    assert adv.saving_bytes is not None and 0.7 * rules <= adv.saving_bytes <= 1.3 * rules


class _Block(nn.Module):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, width), nn.Linear(width, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _NamedBlocks(nn.Module):
    """A hand-written model whose blocks are attributes, not a ModuleList (sweep BY's UNet:
    down1, down2, mid, up2, up1)."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)

        self.enc1, self.enc2, self.mid, self.dec = _Block(), _Block(), _Block(), _Block()
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in (self.enc1, self.enc2, self.mid, self.dec):
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return x


def test_checkpointing_finds_blocks_that_are_named_attributes():
    """Sweep BY: a UNet's ResBlocks as attributes (down1 ... up1) got no checkpointing
    advice at 95% of the device, activations 86%; in a ModuleList they did. Named children of
    one block class are blocks too, in the order they ran; the saving is checked against
    checkpointing applied."""

    def peak(model: nn.Module, budget: str) -> TrackReport:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with track(device="cpu", budget=budget, postmortem=None) as tracker:
            for _ in range(2):
                model(torch.randn(512, 128)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return tracker.report()

    report = peak(_NamedBlocks(), "16MiB")
    (adv,) = [a for a in report.advice if a.code == "activation-checkpointing"]
    assert "enc1 ... dec (4 blocks" in adv.evidence
    applied = peak(_NamedBlocks(checkpointed=True), "16MiB")
    measured = report.devices[0].peak_allocated - applied.devices[0].peak_allocated
    assert adv.saving_bytes is not None and 0.9 * measured <= adv.saving_bytes <= 1.1 * measured


def _distill_peak(teacher_bf16: bool, autocast: bool = False) -> tuple[int, TrackReport]:
    """A distillation step (PyTorch's tutorial shape: a conv teacher with no_grad, a small
    student, KL + CE), its teacher as given or held in bf16 as the advice says: the peak
    and the report."""
    torch.manual_seed(0)
    teacher = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16 * 16, 10),
    ).requires_grad_(False)  # fmt: skip
    student = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
                            nn.Flatten(), nn.Linear(8 * 8 * 8, 10))  # fmt: skip
    if teacher_bf16:
        teacher.to(torch.bfloat16)
    opt = torch.optim.Adam(student.parameters())
    with track(device="cpu", budget="256MiB") as tracker:
        for _ in range(3):
            x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                t = teacher(x.to(torch.bfloat16)).float() if teacher_bf16 else teacher(x)
            s = student(x)
            kd = F.kl_div(F.log_softmax(s / 2, -1), F.softmax(t / 2, -1), reduction="batchmean")
            loss = kd + F.cross_entropy(s, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = tracker.report()
    return report.devices[0].peak_allocated, report


def test_a_teacher_held_in_bf16_saves_what_the_advice_claims_once():
    """Sweep CF: `frozen-model-peak` claimed half the teacher's parameters (2.26 MiB) where
    holding it in bf16 saved 33.89: its forward's activations halve too. Applied, the claim
    holds within 15% (8.99 MB claimed, 7.94 saved: the bf16 max-pool's int64 indices do not
    halve); the teacher in bf16 is not told to go to bf16 again."""
    before, report = _distill_peak(False)
    after, held = _distill_peak(True)
    advice = next(a for a in report.advice if a.code == "frozen-model-peak")
    assert "bfloat16" in advice.action and advice.saving_bytes is not None
    assert abs(advice.saving_bytes - (before - after)) <= 0.15 * (before - after)
    again = [a for a in held.advice if a.code == "frozen-model-peak"]
    assert all("Hold it in bf16" not in a.action and a.saving_bytes is None for a in again)
    # its forward under autocast already (review): only its parameters' bf16 saving
    _, under = _distill_peak(False, autocast=True)
    (adv,) = [a for a in under.advice if a.code == "frozen-model-peak"]
    assert "under autocast already" in adv.action
    assert adv.saving_bytes == under.frozen_model[3]  # type: ignore[index]


def _two_views(model: nn.Module, budget: str) -> TrackReport:
    """Three SGD steps of a self-supervised model on two views of a batch of images (the
    second a shifted copy of the first), tracked on a simulated device of ``budget``."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker:
        for _ in range(3):
            x = torch.randn(32, 3, 32, 32)
            loss = model(x, x + 0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return tracker.report()


class _Encoder(nn.Module):
    """MoCo's base encoder (a ResNet there): convolutions, pooling, a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.fc = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class _MoCo(nn.Module):
    """MoCo's shape (facebookresearch/moco builder.py): a query encoder, a momentum key
    encoder of the same class run under no_grad after it, a queue of keys."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder_q, self.encoder_k = _Encoder(), _Encoder()
        self.encoder_k.requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(32, 1024), dim=0))
        self.checkpointed = checkpointed

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            q = checkpoint(self.encoder_q, im_q, use_reentrant=False)
        else:
            q = self.encoder_q(im_q)
        q = F.normalize(q, dim=1)
        with torch.no_grad():
            k = F.normalize(self.encoder_k(im_k), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue], dim=1) / 0.07
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))


def test_checkpointing_names_the_encoder_that_keeps_activations_at_a_forward_peak():
    """Sweep CF: MoCo was told to checkpoint `encoder_q ... encoder_k` for ~3.03 MiB; the key
    encoder runs under no_grad and keeps nothing, and checkpointing the query encoder saved
    12.16 MiB: the peak came in the key encoder's forward, over the query encoder's kept
    activations, and backward peaks lower. Applied, the claim holds within 25% (it leaves
    out the block's own backward temporaries on top of its recomputation)."""

    def run(model: nn.Module) -> TrackReport:
        return _two_views(model, "24MiB")

    report = run(_MoCo())
    (adv,) = [a for a in report.advice if a.code == "activation-checkpointing"]
    assert "`encoder_q`" in adv.title and "encoder_k" not in adv.evidence
    applied = run(_MoCo(True)).devices[0]
    measured = report.devices[0].peak_allocated - applied.peak_allocated
    assert adv.saving_bytes is not None and measured > 0
    # checkpointed, the peak's bytes made in backward are its recomputation, not the loss's
    assert applied.breakdown is not None and applied.breakdown.phase == "backward"
    assert "recomputed forwards of the checkpointed encoder_q" in (applied.breakdown.note or "")
    assert 0.75 * measured <= adv.saving_bytes <= 1.25 * measured, (adv.saving_bytes, measured)


LORA_GPT2_FILE = '''
import math
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D


class LoRA(nn.Module):
    """minLoRA's shape: y = base(x) + dropout(x) @ A^T @ B^T * scaling."""

    def __init__(self, base, dropout, r=8):
        super().__init__()
        self.base = base
        fin, fout = base.weight.shape  # (Conv1D: in, out)
        self.lora_A = nn.Parameter(torch.randn(r, fin) / math.sqrt(fin))
        self.lora_B = nn.Parameter(torch.zeros(fout, r))
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return self.base(x) + self.drop(x) @ self.lora_A.t() @ self.lora_B.t() * 2.0


def build_model(dropout=DROPOUT):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in ("c_attn", "c_fc", "c_proj") and isinstance(child, Conv1D):
                setattr(module, name, LoRA(child, dropout))
    return model


def make_batch(batch_size):
    ids = torch.randint(0, 512, (batch_size, 64))
    return {"input_ids": ids, "labels": ids}


def build_optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)
'''


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_mixed_precision_on_a_lora_of_a_float32_base_agrees_with_cudas_rules(tmp_path, dropout):
    """Research for sweep BZ: on a LoRA GPT-2 of a float32 base the run claimed 12.50 MiB
    where CUDA's autocast rules (the estimate's bf16 rerun) save 6.60: autocast keeps a half
    copy of each frozen weight whose layer's input requires grad (not cached: only leaves
    that require grad are), gelu_new's `pow` is on CUDA's float32 list, and a CPU dropout's
    float32 noise is a 1-byte mask on CUDA. Checked against the estimate's rerun, within 30%."""
    text = LORA_GPT2_FILE.replace("DROPOUT", str(dropout))
    rules, scope = _cuda_rules_saving(tmp_path / "lora_model.py", text, 8, "allocated")
    model = scope["build_model"]()
    opt = scope["build_optimizer"](model.parameters())
    with track(model, opt, device="cpu", budget="48MiB", postmortem=None) as tracker:
        for _ in range(2):
            model(**scope["make_batch"](8)).loss.backward()
            opt.step()
            opt.zero_grad()
    (adv,) = [a for a in tracker.report().advice if a.code == "mixed-precision"]
    assert "half copies" in adv.evidence
    assert adv.saving_bytes is not None and 0.7 * rules <= adv.saving_bytes <= 1.3 * rules, (
        adv.saving_bytes,
        rules,
    )


class _GCN(nn.Module):
    """Message passing as PyG's layers take a batch of graphs: ``x`` (nodes x features),
    ``edge_index`` (2 x edges), sums with ``index_add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        for lin in self.lins:
            x = F.relu(torch.zeros_like(x).index_add_(0, dst, lin(x)[src]))
        return x.mean()


def test_an_oom_of_a_graph_batch_does_not_count_its_nodes_as_samples():
    """Sweep CF: a GNN's batch of 20 graphs (1601 nodes) ran out, and the advice said "halve
    the micro-batch (1601 -> 800 or fewer)": the first input's first dimension counts nodes.
    With an edge index among the inputs, no batch size is read from it."""
    torch.manual_seed(0)
    model = _GCN()
    opt = torch.optim.Adam(model.parameters())
    nodes = 1601
    x, edges = torch.randn(nodes, 64), torch.randint(0, nodes, (2, 40 * nodes))
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="24MiB") as tracker:
        for _ in range(2):
            model(x, edges).backward()
            opt.step()
            opt.zero_grad()
    pm = tracker.report().oom
    assert pm is not None and pm.input_shape is None
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    assert "the micro-batch and accumulate" in adv.action and str(nodes) not in adv.action


RECSYS_FILE = '''
import torch
from torch import nn


class Recommender(nn.Module):
    """DLRM's shape: a large embedding table, a bottom and a top MLP."""

    def __init__(self):
        super().__init__()
        self.table = nn.EmbeddingBag(200000, 64, mode="sum")
        self.bottom = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, dense, ids):
        pooled = self.table(ids)
        return self.top(torch.cat([self.bottom(dense), pooled], 1)).squeeze(1)


def build_model():
    torch.manual_seed(0)
    return Recommender()


def make_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 200000, (batch_size, 8))


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


def loss_fn(output, batch):
    return nn.functional.binary_cross_entropy_with_logits(output, torch.ones_like(output))
'''


def test_mixed_precision_takes_no_half_copy_of_an_embedding_table():
    """Sweep CG: a DLRM was promised 734.72 KiB where bf16 autocast saved 21.18 MiB: half of
    every trainable float32 weight was taken off for autocast's cached copies, 25.3 MiB of
    them EmbeddingBag tables, which no autocast list casts; only the half layers' weights are
    now, and the table is not called frozen. Against CPU autocast applied (64.3 MB saved;
    at twice the batch, 128.9, the estimate's CUDA rules saved the same): 27.3 MB claimed,
    where session 24's code claimed 1.7; still low, as the gradients flowing back through
    backward's peak are counted float32 (half under autocast), which the evidence says."""
    scope: dict[str, Any] = {}
    exec(compile(RECSYS_FILE, "recsys_model.py", "exec"), scope)

    def peak(amp: bool) -> int:
        model = scope["build_model"]()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with memkit.simulate(None, device="cpu") as counted:
            for _ in range(2):
                batch = scope["make_batch"](16384)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = scope["loss_fn"](model(*batch), batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return counted.peak

    saved = peak(False) - peak(True)
    model = scope["build_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(model, opt, device="cpu", budget="224MiB", postmortem=None) as tracker:
        for _ in range(2):
            batch = scope["make_batch"](16384)
            scope["loss_fn"](model(*batch), batch).backward()
            opt.step()
            opt.zero_grad()
    (adv,) = [a for a in tracker.report().advice if a.code == "mixed-precision"]
    assert "require no grad" not in adv.evidence
    assert adv.saving_bytes is not None and 0.4 * saved <= adv.saving_bytes <= saved


def test_checkpointing_claims_nothing_for_a_forward_peak_before_its_blocks():
    """Review: a frozen block under no_grad with a wide transient first, then a trained one:
    the forward's peak comes before the trained block keeps anything, so checkpointing it
    cannot lower that peak (4 MiB claimed, 0 saved); the rule is silent."""

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.a, self.act, self.b = nn.Linear(256, width), nn.ReLU(), nn.Linear(width, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act(self.a(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([Block(8192), Block(2048)])
            self.blocks[0].requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                h = self.blocks[0](x)
            return self.blocks[1](h).pow(2).mean()

    model = Model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with track(model, opt, device="cpu", budget="72MiB", postmortem=None) as tracker:
        for _ in range(3):
            loss = model(torch.randn(512, 256))
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = tracker.report()
    assert report.devices[0].breakdown is not None
    assert report.devices[0].breakdown.phase == "forward"
    assert "activation-checkpointing" not in [a.code for a in report.advice]


def test_optimizer_state_of_two_optimizers_prices_the_one_that_holds_it():
    """Sweep CG: a DLRM steps its embedding tables with SparseAdam and its MLPs with Adam;
    the advice said "SparseAdam state was 51.15 MiB" (Adam's 8.42 in it) and promised 25.57
    where replacing SparseAdam saved 21.36; with a stateless SGD first, "SGD state was ...".
    The optimizer with the most state is named and priced alone; applied, the claim holds."""

    def run(sparse_optimizer: Callable[[Any], torch.optim.Optimizer]) -> TrackReport:
        torch.manual_seed(0)
        table = nn.Embedding(200000, 32, sparse=True)
        mlp = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
        opts = [torch.optim.SGD(mlp.parameters(), lr=0.01), sparse_optimizer(table.parameters())]
        with track(device="cpu", budget="96MiB", postmortem=None) as tracker:
            for _ in range(3):
                ids = torch.randint(0, 200000, (512,))
                mlp(table(ids)).pow(2).mean().backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
        return tracker.report()

    report = run(lambda p: torch.optim.SparseAdam(list(p)))
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    assert adv.evidence.startswith("SparseAdam state was") and "Beside it: SGD" in adv.evidence
    applied = run(lambda p: torch.optim.Adagrad(list(p)))  # the option it offers
    measured = report.devices[0].peak_allocated - applied.devices[0].peak_allocated
    assert "Adagrad" in adv.action and adv.saving_bytes is not None
    assert 0.9 * measured <= adv.saving_bytes <= 1.1 * measured, (adv.saving_bytes, measured)


class _BYOL(nn.Module):
    """BYOL's shape: an online encoder run on both views before one backward, a target
    encoder of the same class under no_grad."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.online, self.target = _Encoder(), _Encoder()
        self.target.requires_grad_(False)
        self.checkpointed = checkpointed

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        run = (
            (lambda x: checkpoint(self.online, x, use_reentrant=False))
            if self.checkpointed
            else self.online
        )
        q1, q2 = run(v1), run(v2)
        with torch.no_grad():
            k1, k2 = self.target(v1), self.target(v2)
        return -(F.cosine_similarity(q1, k2).mean() + F.cosine_similarity(q2, k1).mean())


def test_checkpointing_recomputes_one_call_of_a_block_run_on_two_views():
    """Sweep CH: BYOL's online encoder keeps both views' activations until backward, which
    recomputes one call at a time; "re-creates up to 144.14 MiB" (both views) made the claim
    8.60 MiB where checkpointing it saved 80.31. Applied, the claim holds within 15%."""

    def run(model: nn.Module) -> TrackReport:
        return _two_views(model, "40MiB")

    report = run(_BYOL())
    (adv,) = [a for a in report.advice if a.code == "activation-checkpointing"]
    measured = report.devices[0].peak_allocated - run(_BYOL(True)).devices[0].peak_allocated
    assert "`online`" in adv.title and adv.saving_bytes is not None
    assert 0.85 * measured <= adv.saving_bytes <= 1.15 * measured, (adv.saving_bytes, measured)


def test_two_teachers_of_one_class_are_priced_together():
    """Sweep CH: two teachers of one class (an ensemble distilled into a student): their
    forwards were counted together and priced as the last one's parameters. Both are named,
    and the bf16 saving is both of theirs; applied to both, the claim holds within 15%."""

    def run(bf16: bool) -> TrackReport:
        torch.manual_seed(0)
        teachers = [
            nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).requires_grad_(
                False
            )
            for _ in range(2)
        ]
        student = nn.Linear(512, 10)
        if bf16:
            for t in teachers:
                t.to(torch.bfloat16)
        opt = torch.optim.SGD(student.parameters(), lr=0.01)
        with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
            for _ in range(3):
                x = torch.randn(512, 512)
                with torch.no_grad():
                    target = sum(t(x.to(torch.bfloat16) if bf16 else x).float() for t in teachers)
                loss = F.mse_loss(student(x), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return tracker.report()

    report = run(False)
    (adv,) = [a for a in report.advice if a.code == "frozen-model-peak"]
    assert "Sequential and Sequential#2" in adv.title and "models no optimizer" in adv.title
    measured = report.devices[0].peak_allocated - run(True).devices[0].peak_allocated
    assert adv.saving_bytes is not None
    assert 0.85 * measured <= adv.saving_bytes <= 1.15 * measured, (adv.saving_bytes, measured)


def test_checkpointing_lowers_a_forward_peak_the_models_own_code_makes_after_its_blocks():
    """Review 2: a pairwise mask the model's own forward makes under no_grad after its blocks
    sets the forward's peak, charged to the model's own row, which is called before its
    blocks: that was taken for a peak before them, and the rule went silent where
    checkpointing the blocks saved 6 MiB."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.a(x)))

    class Model(nn.Module):
        def __init__(self, checkpointed: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(Block() for _ in range(6))
            self.head, self.checkpointed = nn.Linear(256, 8), checkpointed

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
            with torch.no_grad():  # a B x B x W pairwise mask
                near = ((x[:, None, :] - x[None, :, :]).abs().sum(-1) < 1.0).float()
            return self.head(x) * near.mean()

    def run(model: nn.Module) -> TrackReport:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(256, 256)
        with track(model, opt, device="cpu", budget="160MiB", postmortem=None) as tracker:
            for _ in range(2):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return tracker.report()

    report = run(Model())
    (adv,) = [a for a in report.advice if a.code == "activation-checkpointing"]
    measured = report.devices[0].peak_allocated - run(Model(True)).devices[0].peak_allocated
    assert adv.saving_bytes is not None
    assert 0.85 * measured <= adv.saving_bytes <= 1.15 * measured, (adv.saving_bytes, measured)


def test_optimizer_state_of_two_optimizers_of_one_class_is_pooled():
    """Review 2: a GAN's two Adams were priced as one of them (8.01 MiB where switching both
    saves 16.02) and the other's state was said nowhere: optimizers of one class pool."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(1024, 1024), nn.Linear(1024, 1024)
    opts = [torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())]
    with track(device="cpu", budget="44MiB", postmortem=None) as tracker:
        for _ in range(3):
            disc(gen(torch.randn(64, 1024))).pow(2).mean().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    (adv,) = [a for a in tracker.report().advice if a.code == "optimizer-state"]
    state = sum(
        t.untyped_storage().nbytes()
        for opt in opts
        for st in opt.state.values()
        for t in st.values()
        if t.dim()
    )
    assert adv.evidence.startswith(f"Adam state was {format_size(state)}"), adv.evidence
    assert "Beside it" not in adv.evidence


def test_activation_advice_claims_no_saving_where_evaluation_sets_the_peak():
    """Sweep CM: a Lightning run whose validation batch (96) set the peak at 55.62 MiB over
    training's 40.87 was told bf16-mixed saves 7.26 MiB: training fell by that, validation
    rose (CPU autocast keeps a float32 copy of the logits) and ran out. Where evaluation
    sets the peak, mixed precision and checkpointing say they lower training's peak, by how
    much, and claim no saving; where training sets it, the same loop's claim stands."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(8)], nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    peaks: dict[int, dict[str, int | None]] = {}

    def run(eval_batch: int) -> dict[str, Any]:
        with track(model, opt, device="cpu", budget="40MiB", postmortem=None) as tracker:
            for _ in range(3):
                model(torch.randn(512, 128)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    model(torch.randn(eval_batch, 128)).sum()
        report = tracker.report()
        peaks[eval_batch] = report.devices[0].phase_peaks
        return {a.code: a for a in report.advice}

    trained = run(16)
    assert {"mixed-precision", "activation-checkpointing"} <= set(trained)
    assert all(trained[c].saving_bytes for c in ("mixed-precision", "activation-checkpointing"))
    evaluated = run(6144)
    assert "eval-peak" in evaluated
    for code in ("mixed-precision", "activation-checkpointing"):
        advice = evaluated[code]
        assert advice.saving_bytes is None, advice
        assert "Evaluation sets the peak on cpu" in advice.evidence
        assert format_size(trained[code].saving_bytes) in advice.evidence
    # sweep CP: evaluation just below training bounds what the device's peak can lose (31.02
    # MiB claimed where it fell by 13.09 to evaluation's)
    close = run(3072)
    phases = peaks[3072]
    room = max(v or 0 for k, v in phases.items() if k != "eval" and k != "other") - (
        phases["eval"] or 0
    )
    assert 0 < room < trained["activation-checkpointing"].saving_bytes
    for code in ("mixed-precision", "activation-checkpointing"):
        want = min(trained[code].saving_bytes, room)
        assert close[code].saving_bytes == want, (code, close[code], room)


def _checkpointing_against_applied(
    model_of: Callable[[bool], nn.Module], loss_of: Callable[[nn.Module], torch.Tensor], budget: str
) -> tuple[Any, int]:
    """``(the activation-checkpointing advice, what checkpointing saved)``: two SGD steps of
    ``model_of(False)`` tracked under ``budget``, against the peak of ``model_of(True)``."""

    def peak(ckpt: bool) -> tuple[int, dict[str, Any]]:
        model = model_of(ckpt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker:
            for _ in range(2):
                loss_of(model).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        report = tracker.report()
        return report.peak_allocated, {a.code: a for a in report.advice}

    plain, advice = peak(False)
    applied, _ = peak(True)
    return advice["activation-checkpointing"], plain - applied


class _TinyLM(nn.Module):
    """Two MLP blocks and a vocabulary head; the loss is the loop's (a LightningModule's
    ``training_step`` computes it outside the model)."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(512, 128)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(128, 512)
        self.ckpt = ckpt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x)


def test_checkpointing_counts_the_loss_backward_frees_before_the_last_recompute():
    """Sweep CM: a Lightning LM (loss in ``training_step``) was told checkpointing saves 9.53
    MiB; applied it saved 17.04, what the blocks keep less their outputs: the recompute of the
    last block comes after backward freed the loss's saved tensors and the logits' gradient,
    which no module kept. The claim is within 10% of the saving measured."""

    def lm_loss(model: nn.Module) -> torch.Tensor:
        ids = torch.randint(0, 512, (8, 256))
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())

    advice, saved = _checkpointing_against_applied(_TinyLM, lm_loss, "64MiB")
    claim = advice.saving_bytes
    assert claim is not None and "made outside the modules" in advice.evidence
    assert 0.9 * saved <= claim <= 1.1 * saved, (claim, saved)


def test_activation_advice_stands_where_a_frozen_copy_inside_the_step_sets_the_eval_column():
    """Review CK: a frozen copy of the student run under no_grad inside each step on 4x the
    batch (multi-crop views) is booked in the eval column, above training's peak; the
    activation rules were told evaluation sets the peak and claimed nothing, where
    checkpointing the student lowered that peak from 54.84 to 30.84 MiB: they stand."""
    import copy

    torch.manual_seed(0)
    student = nn.Sequential(*[_Block() for _ in range(6)], nn.Linear(128, 64))
    teacher = copy.deepcopy(student).requires_grad_(False).eval()
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    both = nn.ModuleDict({"student": student, "teacher": teacher})
    with track(both, opt, device="cpu", budget="60MiB", postmortem=None) as tracker:
        for _ in range(3):
            x = torch.randn(1024, 128)
            q = student(x)
            with torch.no_grad():
                k = teacher(torch.randn(4096, 128))[:1024]  # (the views' first crop)
            (q - k).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    report = tracker.report()
    dev = report.devices[0]
    assert dev.eval_in_step == dev.phase_peaks["eval"] > 1.1 * dev.phase_peaks["backward"]
    advice = {a.code: a for a in report.advice}
    assert advice["mixed-precision"].saving_bytes
    assert "Evaluation sets the peak" not in advice["mixed-precision"].evidence


def test_checkpointing_absorbs_no_temporaries_where_the_peak_is_inside_a_block():
    """Review CK: two wide blocks on 4096 rows peak inside the last block's backward, where
    what no module kept is that block's gradient buffers, alive beside the recompute: the
    claim took them as freed (46.52 MiB where checkpointing saved 32). Within 10% now."""

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(_Block(1024) for _ in range(2))
            self.head = nn.Linear(128, 10)
            self.ckpt = ckpt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
            return self.head(x)

    def loss(model: nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(torch.randn(4096, 128)), torch.randint(0, 10, (4096,)))

    advice, saved = _checkpointing_against_applied(Net, loss, "104MiB")
    claim = advice.saving_bytes
    assert claim is not None and 0.9 * saved <= claim <= 1.1 * saved, (claim, saved)
