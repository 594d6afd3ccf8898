"""memkit estimate: meta-tensor estimates agree with the simulated device, and the GPU model."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from memkit.cli import _ESTIMATE_ARCHS, cli
from memkit.errors import ConfigError, ModelFileError, UserCodeError
from memkit.estimation import DEVICE_FAMILIES, Estimate, estimate, simulated_peak
from memkit.estimation.attention import choose_kernel, fused_attention, kernel_mask
from memkit.estimation.autocast import (
    BUILTIN_LISTS,
    AutocastPolicy,
    autocast_lists,
    header_path,
    parse_header,
)
from memkit.estimation.meta_step import run_guarded, target_mode, target_rules_on
from memkit.estimation.result import EstimateSweep
from memkit.simulated.accountant import MemoryAccountant
from memkit.simulated.allocator import K_SMALL_BUFFER, CachingAllocatorModel

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

GPT2_FILE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

def build_model():
    return GPT2LMHeadModel(CONFIG)

def make_batch(batch_size, seq_len=32):
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids}
"""

CNN_FILE = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

def make_batch(batch_size):
    return torch.randn(batch_size, 3, 32, 32)

def loss_fn(output, batch):
    return output.float().pow(2).mean()
"""

BERT_FILE = """
import torch
from transformers import BertConfig, BertForSequenceClassification

def build_model():  # dropout 0.1 in attention and hidden layers, as BertConfig defaults
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128, max_position_embeddings=128)
    return BertForSequenceClassification(config)

def make_batch(batch_size):
    return {"input_ids": torch.randint(0, 1000, (batch_size, 64)),
            "attention_mask": torch.ones(batch_size, 64, dtype=torch.long),
            "labels": torch.randint(0, 2, (batch_size,))}
"""

FROZEN_FILE = """
import torch

def build_model():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model[0].requires_grad_(False)
    return model

def make_batch(batch_size):
    return torch.randn(batch_size, 256)
"""

SEQ_FILE = """
import torch

def build_model():
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))

def make_batch(batch_size, seq_len):
    return torch.randint(0, 64, (batch_size, seq_len))

def loss_fn(output, batch):
    return output.float().pow(2).mean()
"""

CKPT_FILE = """
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

REENTRANT = {reentrant}

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    def forward(self, x):
        return x + F.dropout(self.fc2(F.gelu(self.fc1(x))), 0.1, self.training)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=REENTRANT)
        return x

def build_model():
    return Net()

def make_batch(batch_size):
    return torch.randn(batch_size, 32, 64, requires_grad=REENTRANT)

def loss_fn(output, batch):
    return output.float().pow(2).mean()
"""


MHA_FILE = """
import torch

NEED_WEIGHTS, LAYER = {need_weights}, {layer!r}
D, H, T = 64, 4, 64

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        if LAYER == "mha":
            layers = [torch.nn.MultiheadAttention(D, H, batch_first=True) for _ in range(2)]
        else:
            layers = [torch.nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0) for _ in range(2)]
        self.layers = torch.nn.ModuleList(layers)
    def forward(self, x):
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        batch = x.shape[0 if LAYER == "mha" else 1]
        padding = torch.zeros(batch, T, dtype=torch.bool, device=x.device)
        for layer in self.layers:
            if LAYER == "mha":  # both masks: one B*H x T x T float mask, kept for backward
                masks = {{"attn_mask": causal, "key_padding_mask": padding}}
                x = x + layer(x, x, x, need_weights=NEED_WEIGHTS, **masks)[0]
            else:
                x = layer(x, src_mask=causal, src_key_padding_mask=padding)
        return x

def build_model():
    return Net()

def make_batch(batch_size):
    return torch.randn(batch_size, T, D) if LAYER == "mha" else torch.randn(T, batch_size, D)
"""


LOSS_FILE = """
import torch
import torch.nn.functional as F

def build_model():  # an upsampling decoder trained with a reduced pixel loss
    return torch.nn.Sequential(torch.nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1))

def make_batch(batch_size):
    return torch.randn(batch_size, 16, 32, 32), torch.randn(batch_size, 8, 64, 64)

def loss_fn(output, batch):
    return F.{loss}(output, batch[1])
"""


MOE_FILE = """
import torch
from torch import nn


class Experts(nn.Module):
    '''A mixture of experts as transformers 5's grouped_mm experts run it: tokens sorted by
    expert, one torch._grouped_mm per projection, in the parameters' dtype (fp32 here).'''

    def __init__(self, dim=64, hidden=128, experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden) * 0.02)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        self.experts, self.top_k = experts, top_k
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, -1)
        flat = chosen.reshape(-1)
        order = flat.argsort()
        counts = torch.zeros(self.experts, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.float))
        offs = counts.cumsum(0).to(torch.int32)
        tokens = x.repeat_interleave(self.top_k, 0)[order]
        out = torch._grouped_mm(torch.relu(torch._grouped_mm(tokens, self.up, offs=offs)),
                                self.down, offs=offs)
        mixed = torch.zeros_like(tokens).index_copy(0, order, out)
        mixed = (mixed.view(-1, self.top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)
        return self.head(mixed)


def build_model():
    return Experts()


def make_batch(n):
    return torch.randn(n, 64), torch.randint(0, 10, (n,))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("estimate_models")
    out = {}
    for name, text in (
        ("gpt2", GPT2_FILE), ("cnn", CNN_FILE), ("frozen", FROZEN_FILE), ("bert", BERT_FILE),
        ("seq", SEQ_FILE),
    ):  # fmt: skip
        path = folder / f"{name}_model.py"
        path.write_text(textwrap.dedent(text))
        out[name] = str(path)
    for reentrant in (False, True):
        path = folder / f"ckpt_{reentrant}_model.py"
        path.write_text(textwrap.dedent(CKPT_FILE.format(reentrant=reentrant)))
        out[f"ckpt_{reentrant}"] = str(path)
    for name, need_weights, layer in (
        ("mha", False, "mha"), ("mha_weights", True, "mha"), ("encoder", False, "encoder")
    ):  # fmt: skip
        path = folder / f"{name}_model.py"
        path.write_text(textwrap.dedent(MHA_FILE.format(need_weights=need_weights, layer=layer)))
        out[name] = str(path)
    for loss in ("mse_loss", "smooth_l1_loss", "soft_margin_loss"):
        path = folder / f"{loss}_model.py"
        path.write_text(textwrap.dedent(LOSS_FILE.format(loss=loss)))
        out[loss] = str(path)
    path = folder / "moe_model.py"
    path.write_text(MOE_FILE)
    out["moe"] = str(path)
    out["mlp"] = str(EXAMPLES / "mlp.py")
    return out


_GROUPED_MM = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm")


def _counted(path: str, batch: int, mode: str, seq_len: int | None = None) -> int:
    est = estimate(
        path, device_memory="1TiB", mode=mode, seq_len=seq_len, min_batch=batch,
        max_batch=batch, foreach=False, attention="cpu-flash", workspace=0,
    )  # fmt: skip
    trial = est.trial(batch)
    assert trial is not None
    return trial.counted_peak


@pytest.mark.parametrize(
    ("name", "mode", "batch", "seq_len"),
    [
        ("mlp", "train", 8, None),
        ("mlp", "train", 48, None),
        ("mlp", "infer", 32, None),
        ("cnn", "train", 4, None),
        ("cnn", "train", 16, None),
        ("cnn", "infer", 16, None),
        ("gpt2", "train", 2, 32),
        ("gpt2", "train", 4, 64),
        ("gpt2", "infer", 4, 64),
        ("bert", "train", 8, None),  # attention dropout in training: PyTorch runs math on CPU
        ("bert", "infer", 8, None),
        ("ckpt_False", "train", 8, None),  # checkpointed blocks: recomputed in backward
        ("ckpt_True", "train", 8, None),
        # SDPA inside F.multi_head_attention_forward, with a float mask the kernel keeps
        ("mha", "train", 4, None),
        ("mha_weights", "train", 4, None),  # need_weights: the explicit B*H x T x T path
        ("encoder", "train", 4, None),  # batch_first=False; no fast path in training
        # a reduced loss keeps an input-sized storage under its 0-d value (Loss.cpp)
        ("mse_loss", "train", 4, None),
        ("smooth_l1_loss", "train", 4, None),
        ("soft_margin_loss", "train", 4, None),
        # fp32 torch._grouped_mm (a mixture of experts): CUDA's fallback, which torch's bf16-only
        # meta kernel refused (sweep BF: every fp32 Mixtral stopped with exit 3)
        pytest.param("moe", "train", 16, None, marks=_GROUPED_MM),
        pytest.param("moe", "infer", 16, None, marks=_GROUPED_MM),
    ],
)
def test_meta_estimate_matches_simulated_device(
    files: dict[str, str], name: str, mode: str, batch: int, seq_len: int | None
) -> None:
    real = simulated_peak(files[name], batch, mode=mode, seq_len=seq_len)
    est = _counted(files[name], batch, mode, seq_len)
    assert abs(est - real) <= 0.02 * real, (est, real)


SAM_FILE = """
import torch
from torch import nn


class SAM(torch.optim.Optimizer):
    '''Sharpness-aware minimization as davda54/sam writes it: a wrapper of a base optimizer.'''

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        norm = torch.norm(torch.stack([p.grad.norm(2) for g in self.param_groups
                                       for p in g["params"] if p.grad is not None]), 2)
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


def build_model():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))


def make_batch(n):
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


def build_optimizer(params):
    return SAM(params, torch.optim.Adam, lr=1e-3)


def train_step(model, batch, optimizer):
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.first_step(zero_grad=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.second_step(zero_grad=True)
"""


def test_a_wrapped_optimizers_state_and_swapped_parameters_keep_their_categories(
    tmp_path: Path,
) -> None:
    """SAM (davda54/sam): its base optimizer steps, SAM itself never does, and its
    ``p.data = old_p`` gives the parameters its copy's storage. The breakdown said 0 B of
    parameters and of optimizer state, all of it "activations"; now the parameters are the
    model's, and the optimizer state holds Adam's two moments and SAM's copy."""
    path = tmp_path / "sam.py"
    path.write_text(SAM_FILE)
    est = estimate(str(path), device_memory="64MiB", context=0, min_batch=64, max_batch=64,
                   workspace=0)  # fmt: skip
    bd = est.breakdown
    assert bd is not None
    weights = sum(-(-n // 512) * 512 for n in (256 * 1024 * 4, 1024 * 4, 1024 * 10 * 4, 10 * 4))
    assert bd.parameters == bd.gradients == weights
    assert 2 * weights <= bd.optimizer_state <= 3 * weights + 4 * 512  # moments, SAM's copy


def test_multi_billion_model_needs_no_host_ram(tmp_path: Path) -> None:
    path = tmp_path / "big.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel
            # 4.0 B parameters in 12 wide layers (48 narrower ones: 4 times the meta ops)
            CONFIG = GPT2Config(n_layer=12, n_embd=5120, n_head=32, n_positions=1024)
            def build_model():
                return GPT2LMHeadModel(CONFIG)
            def make_batch(batch_size, seq_len=128):
                return {"input_ids": torch.randint(0, 50257, (batch_size, seq_len))}
            """
        )
    )
    before = psutil.Process().memory_info().rss
    est = estimate(str(path), device_memory="80GiB", mode="infer", max_batch=1, arch="hopper")
    grown = psutil.Process().memory_info().rss - before
    assert est.num_parameters > 3_000_000_000
    assert est.breakdown is not None and est.breakdown.parameters > 12 * 10**9
    assert grown < 300 * 2**20, grown  # the fp32 weights alone would be > 12 GB


def test_rounding_reserved_and_context(files: dict[str, str]) -> None:
    est = estimate(files["mlp"], device_memory="2GiB", context="300MiB", max_batch=64)
    assert est.context_bytes == 300 * 2**20
    assert est.usable_bytes == 2 * 2**30 - 300 * 2**20
    for trial in est.trials:
        assert trial.allocated_peak % 512 == 0 and trial.counted_peak % 512 == 0
        assert trial.reserved_peak >= trial.allocated_peak >= trial.counted_peak
        assert trial.reserved_peak % K_SMALL_BUFFER == 0
    default = estimate(files["mlp"], device_memory="2GiB", max_batch=2)
    assert default.context_bytes == DEVICE_FAMILIES["ampere"].context_bytes
    data = json.loads(est.to_json())
    assert data["usable_bytes"] == est.usable_bytes
    assert isinstance(est, Estimate) and "Estimated largest batch" in str(est)
    assert "<table" in est._repr_html_()


def test_does_not_fit_when_context_leaves_too_little(files: dict[str, str]) -> None:
    est = estimate(files["mlp"], device_memory="520MiB")  # ampere context: 500 MiB
    assert est.max_batch_size is None
    assert est.advice[0].code == "does-not-fit"


def test_amp_cuts_activations_and_keeps_fp32_weights(files: dict[str, str]) -> None:
    kwargs = {"device_memory": "1TiB", "seq_len": 64, "min_batch": 8, "max_batch": 8}
    fp32 = estimate(files["gpt2"], **kwargs)
    bf16 = estimate(files["gpt2"], amp="bf16", **kwargs)
    assert fp32.breakdown is not None and bf16.breakdown is not None
    assert bf16.breakdown.parameters == fp32.breakdown.parameters  # master weights stay fp32
    assert bf16.breakdown.activations < 0.9 * fp32.breakdown.activations
    assert bf16.trials[0].allocated_peak < fp32.trials[0].allocated_peak
    assert any(a.code == "mixed-precision" for a in fp32.advice)


def test_mixed_precision_advice_of_an_inference_estimate_speaks_of_inference(
    files: dict[str, str],
) -> None:
    """An fp32 inference estimate advised "fp32 training" with "the optimizer stays fp32"
    (sweep PP)."""
    kwargs = {"device_memory": "1TiB", "seq_len": 64, "min_batch": 64, "max_batch": 64}
    est = estimate(files["gpt2"], mode="infer", **kwargs)
    (mp,) = [a for a in est.advice if a.code == "mixed-precision"]
    assert mp.title.startswith("fp32 inference") and "optimizer" not in mp.action
    assert "Trainable" not in mp.evidence


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_model_estimates_with_and_without_amp(
    files: dict[str, str], reentrant: bool
) -> None:
    """The recompute in backward runs CUDA's fused dropout and autocast as the forward did:
    non-reentrant checkpointing used to stop with CheckpointError (a bool mask saved, a float
    one recomputed), and under --amp the recompute ran in fp32."""
    kwargs = {"device_memory": "1TiB", "min_batch": 64, "max_batch": 64, "workspace": 0}
    fp32 = estimate(files[f"ckpt_{reentrant}"], **kwargs)
    bf16 = estimate(files[f"ckpt_{reentrant}"], amp="bf16", **kwargs)
    assert fp32.breakdown is not None and bf16.breakdown is not None
    # the peak is in a block's backward, where its recomputed activations live: bf16 halves them
    assert bf16.breakdown.activations < 0.75 * fp32.breakdown.activations


@pytest.mark.parametrize(("reentrant", "made"), [(False, "in_step"), (True, "at_the_top")])
def test_the_files_own_cuda_autocast_is_estimated_as_the_target_runs_it(
    tmp_path: Path, reentrant: bool, made: str
) -> None:
    """A step written for a GPU (``with torch.autocast("cuda", bf16)``, made in the step or at
    the file's top as nanoGPT's ``ctx``; checkpointed blocks inside it) is estimated as under
    ``--amp bf16``: a CPU build disables CUDA autocast, and the estimate was fp32 (nanoGPT's
    model under 3 GiB: 71 where the H200 fit 118; 120 now). Inside the region autocast reads
    as on (the step asserts it); an ``enabled=False`` region inside it (an fp32 loss) stays
    fp32."""
    top = 'CTX = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)\n'
    step = """
def train_step(model, batch, optimizer):
    {open}
        assert torch.is_autocast_enabled("cuda") == {on}
        out = model(batch)
        {inner}
            loss = loss_fn(out, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""
    base = textwrap.dedent(CKPT_FILE.format(reentrant=reentrant)) + top
    own, plain = tmp_path / "own.py", tmp_path / "plain.py"
    opened = "with CTX:" if made == "at_the_top" else (
        'with torch.autocast("cuda", dtype=torch.bfloat16):'
    )  # fmt: skip
    own.write_text(base + step.format(
        open=opened, on=True, inner='with torch.autocast(device_type="cuda", enabled=False):',
    ))  # fmt: skip
    plain.write_text(base + step.format(open="if True:", on=False, inner="if True:"))
    kwargs = {"device_memory": "1TiB", "min_batch": 64, "max_batch": 64, "workspace": 0}
    theirs, flag, fp32 = (
        estimate(own, **kwargs),
        estimate(plain, amp="bf16", **kwargs),
        estimate(plain, **kwargs),
    )
    assert theirs.trials[0].allocated_peak == flag.trials[0].allocated_peak
    assert theirs.trials[0].allocated_peak < 0.8 * fp32.trials[0].allocated_peak
    assert theirs.amp == "bf16" and "the file's own torch.autocast('cuda', bf16)" in str(theirs)
    assert not any(a.code == "mixed-precision" for a in theirs.advice)
    assert not torch.is_autocast_enabled("cuda")  # nothing left on, and torch's class restored
    assert torch.autocast.__init__.__module__ == "torch.amp.autocast_mode"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_files_own_cpu_autocast_leaves_amp_as_it_is(tmp_path: Path, dtype: str) -> None:
    """A step under ``torch.autocast("cpu", ...)`` (written to train on a CPU) with
    non-reentrant checkpoints, estimated with ``--amp bf16``: CPU autocast does nothing on the
    target's CUDA step, and the estimate is the plain step's. Its region's dtype took the
    place of the policy's mark, the recompute ran in fp32, and the estimate stopped with
    torch's CheckpointError (exit 3)."""
    base = textwrap.dedent(CKPT_FILE.format(reentrant=False))
    step = """
def train_step(model, batch, optimizer):
    {open}
        loss = loss_fn(model(batch), batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""
    cpu, plain = tmp_path / "cpu.py", tmp_path / "plain.py"
    cpu.write_text(base + step.format(open=f'with torch.autocast("cpu", dtype=torch.{dtype}):'))
    plain.write_text(base + step.format(open="if True:"))
    kwargs = {"device_memory": "1TiB", "min_batch": 64, "max_batch": 64, "workspace": 0}
    theirs, amp = estimate(cpu, amp="bf16", **kwargs), estimate(plain, amp="bf16", **kwargs)
    assert theirs.trials[0].allocated_peak == amp.trials[0].allocated_peak
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # CPU autocast's default, put back
    # the report says so (sweep VV: "amp: none (fp32)" beside a step written with CPU bf16)
    said = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    (line,) = [a for a in theirs.assumptions if "torch.autocast('cpu'" in a]
    assert f"torch.autocast('cpu', {said}) regions cast nothing on a GPU" in line
    assert "in fp32" not in line  # --amp bf16 is on
    fp32 = estimate(cpu, **kwargs)
    (line,) = [a for a in fp32.assumptions if "torch.autocast('cpu'" in a]
    assert "in fp32" in line and "(--amp estimates it)" in line
    assert not [a for a in amp.assumptions if "torch.autocast('cpu'" in a]


def test_a_region_that_runs_backward_inside_goes_on_after_it(tmp_path: Path) -> None:
    """Two micro-batches under one autocast region, each with its backward inside it (a
    review's case): the second forward is bf16 too, as on a GPU (the policy used to stay off
    after the first backward: the fp32 peak); an fp32 region is no error, as on a GPU."""
    base = textwrap.dedent(CKPT_FILE.format(reentrant=False)).replace(
        "checkpoint(block, x, use_reentrant=REENTRANT)", "block(x)"
    )  # no checkpoint: backward(inputs=...) runs outside memkit's mode, recomputes included
    step = """
def train_step(model, batch, optimizer):
    with torch.autocast("cuda", dtype={dtype}):
        for _ in range(2):
            loss = loss_fn(model(batch), batch) / 2
            loss.backward(inputs=list(model.parameters()))  # (a path of its own in memkit)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""
    kwargs = {"device_memory": "1TiB", "min_batch": 64, "max_batch": 64, "workspace": 0}
    peaks = {}
    for dtype in ("torch.bfloat16", "torch.float32"):
        path = tmp_path / f"{dtype[6:]}.py"
        path.write_text(base + step.format(dtype=dtype))
        peaks[dtype] = estimate(path, **kwargs).trials[0].allocated_peak
    single = tmp_path / "single.py"
    single.write_text(base + step.format(dtype="torch.bfloat16").replace("range(2)", "range(1)"))
    one = estimate(single, **kwargs).trials[0].allocated_peak
    assert peaks["torch.bfloat16"] < 0.8 * peaks["torch.float32"]
    assert peaks["torch.bfloat16"] < 1.2 * one


def test_an_autocast_off_decorator_at_the_files_top_stays_off(tmp_path: Path) -> None:
    """``@torch.autocast("cuda", enabled=False)`` on a function (forcing fp32, as RoPE and
    loss code do) is made when the file loads, where a CPU build drops its ``enabled``: it was
    taken as an fp16 region (a review: 36% under the fp32 peak, labelled fp16)."""
    base = textwrap.dedent(CKPT_FILE.format(reentrant=False))
    path = tmp_path / "off.py"
    path.write_text(base + textwrap.dedent("""
        @torch.autocast("cuda", enabled=False)
        def forward_fp32(model, batch):
            return model(batch)

        def train_step(model, batch, optimizer):
            loss_fn(forward_fp32(model, batch), batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        """))  # fmt: skip
    plain = tmp_path / "plain.py"
    plain.write_text(path.read_text().replace('@torch.autocast("cuda", enabled=False)', ""))
    kwargs = {"device_memory": "1TiB", "min_batch": 64, "max_batch": 64, "workspace": 0}
    off, fp32 = estimate(path, **kwargs), estimate(plain, **kwargs)
    assert off.amp is None and off.trials[0].allocated_peak == fp32.trials[0].allocated_peak


def test_a_value_read_in_make_batch_says_it_runs_on_meta(tmp_path: Path) -> None:
    """make_batch drawing a padded length with torch (a new user's padded batches): the error
    says why there is no value and what to do instead, not only torch's meta message."""
    path = tmp_path / "padded.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(8, 8)\n"
        "def make_batch(n):\n"
        "    length = torch.randint(1, 8, ()).item()\n"
        "    return torch.randn(n, length, 8)\n"
    )
    with pytest.raises(ModelFileError, match=r"(?s)item\(\) cannot be called.*Python's random"):
        estimate(path, device_memory="1GiB")
    path.write_text(path.read_text().replace("length = ", "length = {}['metadata'] or "))
    with pytest.raises(ModelFileError) as raised:  # a "meta" that is no meta tensor
        estimate(path, device_memory="1GiB")
    assert "KeyError" in str(raised.value) and "Python's random" not in str(raised.value)
    # a batch copied to the CPU (sweep CI: make_batch ending in .to(device)) read no value
    path.write_text(path.read_text().replace("{}['metadata'] or ", "8 or ") + "\n")
    path.write_text(path.read_text().replace("length, 8)", "length, 8).to('cpu')"))
    with pytest.raises(ModelFileError, match=r"(?s)copy out of meta.*Return the tensors as made"):
        estimate(path, device_memory="1GiB")
    # one moved to CUDA on a machine without it (sweep CL)
    path.write_text(path.read_text().replace(".to('cpu')", ".to('cuda')"))
    if not torch.cuda.is_available():
        with pytest.raises(ModelFileError, match=r"(?s)asked for CUDA.*memkit moves them"):
            estimate(path, device_memory="1GiB")


def test_frozen_parameters_have_no_gradients_or_state(files: dict[str, str]) -> None:
    est = estimate(files["frozen"], device_memory="1TiB", min_batch=4, max_batch=4)
    assert est.breakdown is not None
    assert est.trainable_parameters == 256 * 256 + 256
    assert est.num_parameters == 2 * est.trainable_parameters
    # AdamW: two fp32 moments per trainable parameter only (each tensor rounded to 512 bytes)
    assert est.breakdown.optimizer_state == 2 * (256 * 256 * 4 + 256 * 4)


def test_attention_kernel_assumption_changes_long_sequence_peak(files: dict[str, str]) -> None:
    kwargs = {"device_memory": "1TiB", "seq_len": 256, "min_batch": 4, "max_batch": 4}
    math = estimate(files["gpt2"], attention="math", **kwargs)
    efficient = estimate(files["gpt2"], attention="efficient", **kwargs)
    assert math.trials[0].allocated_peak > efficient.trials[0].allocated_peak
    assert math.attention_kernels == ("math",) and efficient.attention_kernels == ("efficient",)
    auto_bf16 = estimate(files["gpt2"], amp="bf16", **kwargs)
    assert auto_bf16.attention_kernels == ("flash",)  # sm80, bf16, no mask
    volta = estimate(files["gpt2"], amp="fp16", arch="volta", **kwargs)
    assert volta.attention_kernels == ("efficient",)
    volta_bf16 = estimate(files["gpt2"], amp="bf16", arch="volta", **kwargs)
    assert volta_bf16.attention_kernels == ("math",)  # no bf16 kernels before sm80
    assert any("flash kernel" in a for a in auto_bf16.assumptions)
    hopper = estimate(files["gpt2"], amp="bf16", arch="hopper", **kwargs)
    assert any("cuDNN attention" in a for a in hopper.assumptions)


def _qkv(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, keys: int = 64
) -> list[torch.Tensor]:
    shapes = ((2, heads, 64, dim), (2, kv_heads, keys, dim), (2, kv_heads, keys, dim))
    return [torch.empty(s, device="meta", dtype=dtype, requires_grad=True) for s in shapes]


def test_attention_kernel_choice_follows_sdp_utils() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_kernel("auto", *_qkv(8, 8, 64, bf16), None, 80) == "flash"
    assert choose_kernel("auto", *_qkv(8, 2, 64, bf16), None, 80) == "flash"  # grouped-query
    assert choose_kernel("auto", *_qkv(8, 8, 60, bf16), None, 80) == "flash"  # padded to 64
    assert choose_kernel("auto", *_qkv(8, 8, 320, bf16), None, 80) == "efficient"  # > 256
    mask = torch.empty(64, 64, device="meta")
    assert choose_kernel("auto", *_qkv(8, 8, 64, bf16), mask, 80) == "efficient"
    assert choose_kernel("auto", *_qkv(8, 8, 64, fp32), None, 80) == "efficient"
    assert choose_kernel("auto", *_qkv(8, 8, 6, fp32), None, 80) == "math"  # not 4-aligned
    assert choose_kernel("auto", *_qkv(8, 8, 6, fp32), None, 75) == "efficient"
    assert choose_kernel("flash", *_qkv(8, 8, 64, fp32), None, 80) == "efficient"
    # is_causal, key and query lengths differ: no flash (check_flash_causal_non_square_seqlens)
    assert choose_kernel("auto", *_qkv(8, 8, 64, bf16, keys=32), None, 80, 0.0, True) == (
        "efficient"
    )
    assert choose_kernel("auto", *_qkv(8, 8, 64, bf16, keys=32), None, 80, 0.0, False) == "flash"


def test_grouped_query_attention_takes_no_memory_efficient_kernel() -> None:
    """Sweep BF: a Llama with 8 query and 2 key/value heads in fp32 (transformers passes
    ``enable_gqa=True`` without a mask) was estimated with the memory-efficient kernel, 2-15x
    the batch that fits: sdp_utils.cpp gives that kernel
    ``check_batch_size_and_num_heads_dense<false>`` (no grouped-query), so fp32 runs math,
    which keeps the scores; flash (fp16/bf16, sm80+) does take it."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert choose_kernel("auto", *_qkv(8, 2, 64, fp32), None, 80) == "math"
    assert choose_kernel("auto", *_qkv(8, 2, 64, fp16), None, 75) == "math"  # no flash on T4
    assert choose_kernel("auto", *_qkv(8, 2, 64, bf16), torch.empty(64, 64, device="meta"),
                         80) == "math"  # flash takes no mask  # fmt: skip
    assert choose_kernel("efficient", *_qkv(8, 2, 64, fp32), None, 80) == "math"
    assert choose_kernel("auto", *_qkv(8, 2, 64, bf16), None, 80) == "flash"
    assert choose_kernel("auto", *_qkv(8, 8, 64, fp32), None, 80) == "efficient"  # expanded
    from memkit.estimation.assumptions import attention_line
    from memkit.estimation.families import family_of

    line = attention_line("efficient", ["math"], family_of("ampere"))
    assert "math kernel (efficient was requested and cannot take these inputs on sm80" in line


def test_efficient_alignment_is_sdp_utils_minimum_gemm_alignment() -> None:
    fp16, fp32 = torch.float16, torch.float32
    # sm70 runs fp16 on tensor cores: head dims must be multiples of 8, as from sm75
    assert choose_kernel("auto", *_qkv(4, 4, 12, fp16), None, 70) == "math"
    assert choose_kernel("auto", *_qkv(4, 4, 16, fp16), None, 70) == "efficient"
    assert choose_kernel("auto", *_qkv(4, 4, 12, fp16), None, 75) == "math"
    assert choose_kernel("auto", *_qkv(4, 4, 12, fp16), None, 60) == "efficient"  # no tensor cores
    assert choose_kernel("auto", *_qkv(4, 4, 6, fp32), None, 70) == "efficient"  # fp32, < sm80: 1


def test_flash_on_sm86_to_89_refuses_training_head_dims_over_192() -> None:
    bf16 = torch.bfloat16
    for sm in (86, 89):
        assert choose_kernel("auto", *_qkv(2, 2, 256, bf16), None, sm, 0.1) == "efficient"
        assert choose_kernel("auto", *_qkv(2, 2, 208, bf16), None, sm, 0.0) == "efficient"
        assert choose_kernel("auto", *_qkv(2, 2, 256, bf16), None, sm, 0.0) == "flash"
        assert choose_kernel("auto", *_qkv(2, 2, 192, bf16), None, sm, 0.1) == "flash"
        with torch.no_grad():  # no gradient: flash's forward takes any head dim up to 256
            assert choose_kernel("auto", *_qkv(2, 2, 256, bf16), None, sm, 0.1) == "flash"
    assert choose_kernel("auto", *_qkv(2, 2, 256, bf16), None, 80, 0.1) == "flash"
    assert choose_kernel("auto", *_qkv(2, 2, 256, bf16), None, 90, 0.1) == "flash"


def test_flash_footprint_pads_odd_heads_and_expands_grouped_query_grads() -> None:
    def counted(heads: int, kv_heads: int, dim: int) -> int:
        q, k, v = _qkv(heads, kv_heads, dim, torch.bfloat16)
        with MemoryAccountant(torch.device("meta"), None) as acc:
            fused_attention(q, k, v, "flash").sum().backward()
        return acc.peak

    # head dim 60 is padded to 64 (copies kept for backward): more than head dim 64 itself
    assert counted(8, 8, 60) > counted(8, 8, 64)
    # grouped-query (8 query heads, 2 key/value heads), in bytes, bf16, B=2, L=64, D=64:
    head = 2 * 64 * 64 * 2
    inputs, out, lse = (8 + 2 + 2) * head, 8 * head, 2 * 8 * 64 * 4
    grads, dq_accum, softmax_d = (8 + 2 + 2) * head, 2 * 128 * 8 * 64 * 4, 2 * 8 * 128 * 4
    expanded = 2 * 8 * head  # dk and dv at the query's 8 heads
    assert counted(8, 2, 64) >= inputs + out + lse + grads + dq_accum + softmax_d + expanded


def test_a_card_name_is_its_family_and_an_unknown_one_lists_the_cards() -> None:
    from memkit.estimation.families import family_of

    assert family_of("H100").name == family_of("hopper").name == "hopper"
    assert family_of("rtx-4090").name == "ada" and family_of("A100").name == "ampere"
    # as torch.cuda.get_device_name() writes them
    assert family_of("NVIDIA A100-SXM4-80GB").name == "ampere"
    assert family_of("NVIDIA GeForce RTX 3090").name == "ampere-sm86"
    assert family_of("Tesla V100-PCIE-32GB").name == "volta"
    assert family_of("NVIDIA H100 80GB HBM3").name == "hopper"  # a digit after a space
    # sweep BF: "A1000" (an RTX A1000, sm86) was taken for an A100 by its prefix
    assert family_of("A1000").name == family_of("RTX A1000").name == "ampere-sm86"
    assert family_of("RTX 4060 Ti").name == "ada" and family_of("rtx3050").name == "ampere-sm86"
    with pytest.raises(ConfigError, match=r"pascal.*hopper \(H100, H200, GH200"):
        family_of("pascal")
    with pytest.raises(ConfigError, match="unknown device family 'H1000'"):
        family_of("H1000")


def test_bad_arguments_are_config_errors(files: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        estimate(files["mlp"], device_memory="lots")
    with pytest.raises(ConfigError):
        estimate(files["mlp"], device_memory="8GiB", amp="fp8")
    with pytest.raises(ConfigError):
        estimate(files["mlp"], device_memory="8GiB", arch="pascal")
    with pytest.raises(ConfigError):
        estimate(files["mlp"], device_memory="100MiB")  # smaller than the context
    for memory in (16, "16"):  # sweep BF: a card's GiB without the unit, said as bytes
        with pytest.raises(ConfigError, match=r"give a unit, e\.g\. '16GiB'"):
            estimate(files["mlp"], device_memory=memory)
    for context in (500, "500"):  # bytes: a unit left out
        with pytest.raises(ConfigError, match=r"CUDA context of 500 B .* unit mistake"):
            estimate(files["mlp"], device_memory="8GiB", context=context)
    with pytest.raises(ConfigError, match="found Sequential; to estimate a model object"):
        estimate(torch.nn.Sequential(), device_memory="8GiB")  # type: ignore[arg-type]
    for lengths in ([64, 128], "128"):
        with pytest.raises(ConfigError, match="seq_len must be a whole number"):
            estimate(files["gpt2"], device_memory="8GiB", seq_len=lengths)  # type: ignore[arg-type]


def test_cli_json_and_exit_codes(files: dict[str, str]) -> None:
    runner = CliRunner()
    ok = runner.invoke(
        cli, ["estimate", files["mlp"], "--device-memory", "2GiB", "--max-batch", "64", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    for key in ("max_batch_size", "recommended_batch_size", "trials", "breakdown",
                "context_bytes", "usable_bytes", "assumptions", "advice", "attention"):  # fmt: skip
        assert key in data
    assert {"allocated_peak", "reserved_peak", "fits"} <= set(data["trials"][0])
    nofit = runner.invoke(cli, ["estimate", files["mlp"], "--device-memory", "520MiB"])
    assert nofit.exit_code == 1
    assert "Estimated not to fit" in nofit.stdout
    missing = runner.invoke(cli, ["estimate", files["mlp"]])
    assert missing.exit_code == 2 and "--device-memory" in missing.output
    bad = runner.invoke(cli, ["estimate", files["mlp"], "--device-memory", "lots"])
    assert bad.exit_code == 2 and "lots" in bad.output
    amp = runner.invoke(cli, ["estimate", files["mlp"], "--device-memory", "8GiB", "--amp", "x"])
    assert amp.exit_code == 2
    nofile = runner.invoke(cli, ["estimate", "nope.py", "--device-memory", "8GiB"])
    assert nofile.exit_code == 2 and "not found" in nofile.output
    assert sorted(_ESTIMATE_ARCHS) == sorted(DEVICE_FAMILIES)
    arch = runner.invoke(cli, ["estimate", files["mlp"], "--device-memory", "8GiB", "--arch", "x"])
    assert arch.exit_code == 2 and "hopper (H100, H200" in arch.output


def test_cli_amp_takes_fp32_its_default_and_any_case(files: dict[str, str]) -> None:
    """Sweep W: --help says "[default: fp32]" but --amp fp32 was refused, and --amp BF16."""
    runner = CliRunner()
    for given, precision in (("FP32", "fp32"), ("BF16", "bf16 autocast")):
        result = runner.invoke(cli, ["estimate", files["mlp"], "--device-memory", "2GiB",
                                     "--max-batch", "2", "--amp", given])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"Estimated largest batch (train, {precision}) on")


def test_cli_seq_lens_are_one_sweep_result(files: dict[str, str]) -> None:
    """``--seq-len 16,100000``: one estimate per length in an EstimateSweep (JSON, text); the
    longer length does not fit in the 100 MiB left after the context, so the exit code is 1."""
    args = ["estimate", files["seq"], "--device-memory", "600MiB", "--max-batch", "64",
            "--seq-len", "16,100000"]  # fmt: skip
    as_json = CliRunner().invoke(cli, [*args, "--json"])
    assert as_json.exit_code == 1, as_json.output
    data = json.loads(as_json.stdout)
    assert list(data) == ["schema", "seq_lens"] and data["schema"] == EstimateSweep.SCHEMA
    short, long = data["seq_lens"]
    alone = estimate(files["seq"], device_memory="600MiB", max_batch=64, seq_len=16)
    assert short["seq_len"] == 16 and short["max_batch_size"] == alone.max_batch_size == 64
    assert [t["reserved_peak"] for t in short["trials"]] == [t.reserved_peak for t in alone.trials]
    assert long["seq_len"] == 100000 and long["max_batch_size"] is None

    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 1, text.output
    rows = [line.split() for line in text.stdout.splitlines()[4:6]]
    assert rows[0][:3] == ["16", ">=64", str(alone.recommended_batch_size)]  # the --max-batch
    assert rows[1] == ["100000", "-", "-", "-", "-"]
    assert "Estimated not to fit: batch 1 (train, seq_len 100000, fp32)" in text.stdout


def test_allocator_model_split_merge_and_release() -> None:
    alloc = CachingAllocatorModel(capacity=30 << 20)
    alloc.malloc("a", 3 << 20)  # large pool, 20 MiB segment, split
    alloc.malloc("b", 3 << 20)  # from the same segment
    assert alloc.reserved == 20 << 20 and alloc.allocated == 6 << 20
    alloc.free("a")
    alloc.free("b")
    assert alloc.allocated == 0 and alloc.reserved == 20 << 20  # cached, merged
    alloc.malloc("c", 15 << 20)  # fits in the merged free segment
    assert alloc.reserved == 20 << 20
    alloc.free("c")
    alloc.malloc("d", 25 << 20)  # needs a new segment: cache released to stay in capacity
    assert alloc.reserved == 26 << 20 and alloc.num_ooms == 0
    alloc.malloc("e", 10 << 20)
    assert alloc.num_ooms == 1
    small = CachingAllocatorModel()
    small.malloc("x", 1)
    assert small.allocated == 512 and small.reserved == 2 << 20


def test_autocast_policy_lists_and_weight_cache() -> None:
    policy = AutocastPolicy(torch.bfloat16)
    weight = torch.nn.Parameter(torch.randn(4, 4, device="meta"))
    x = torch.randn(2, 4, device="meta")
    args, _ = policy.cast_args("linear", (x, weight), {})
    assert all(a.dtype == torch.bfloat16 for a in args)
    again, _ = policy.cast_args("matmul", (x, weight), {})
    assert again[1] is args[1]  # the weight's cast is cached
    low = torch.randn(2, 4, device="meta", dtype=torch.bfloat16)
    (soft,), _ = policy.cast_args("softmax", (low,), {})
    assert soft.dtype == torch.float32
    (keep,), _kw = policy.cast_args("softmax", (low,), {"dtype": torch.bfloat16})
    assert keep.dtype == torch.bfloat16
    a, b = policy.cast_args("addcmul", (low, x, x), {})[0][:2]
    assert a.dtype == b.dtype == torch.float32  # promote: the widest dtype present
    (same,), _ = policy.cast_args("relu", (low,), {})
    assert same is low
    (matmul_in, _w), _ = policy.cast_args("__matmul__", (x, weight), {})
    assert matmul_in.dtype == torch.bfloat16
    image = torch.randn(1, 3, 8, 8, device="meta", dtype=torch.bfloat16)
    (nearest,), _ = policy.cast_args("interpolate", (image,), {"scale_factor": 2})
    assert nearest.dtype == torch.float32  # upsample_nearest2d is on the fp32 list
    (area,), _ = policy.cast_args("interpolate", (image,), {"size": 4, "mode": "area"})
    assert area is image  # adaptive pooling: not on a list


def _aten_base(op: str) -> str:
    return op.removeprefix("aten::").split(".")[0]


def test_autocast_lists_come_from_the_installed_torch() -> None:
    """The header parse agrees with the dispatcher's AutocastCUDA registrations, op for op."""
    lists = autocast_lists()
    if not header_path().exists():
        pytest.skip("this torch install ships no ATen/autocast_mode.h")
    assert lists.source.startswith(f"torch {torch.__version__}'s")
    listed = lists.lower_precision | lists.fp32 | lists.fp32_set_opt_dtype | lists.promote
    registered = {
        _aten_base(op)
        for op in torch._C._dispatch_get_all_op_names()
        if torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA")
    }
    cuda_only = {"cudnn_convolution", "cudnn_convolution_transpose"}  # reached from C++ only
    assert registered - cuda_only == listed | lists.banned
    assert {"mm", "linear", "conv2d"} <= lists.lower_precision
    assert {"layer_norm", "nll_loss", "exp"} <= lists.fp32
    assert {"softmax", "sum", "norm"} <= lists.fp32_set_opt_dtype
    if torch.__version__.startswith("2.13."):
        for name in ("lower_precision", "fp32", "fp32_set_opt_dtype", "promote", "banned"):
            assert getattr(lists, name) == getattr(BUILTIN_LISTS, name), name


def test_autocast_lists_fall_back_to_the_builtin_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="AT_FORALL_FP32"):
        parse_header("#define AT_FORALL_LOWER_PRECISION_FP(_) \\\n  _(mm)\n", "a test")
    broken = tmp_path / "autocast_mode.h"
    broken.write_text("// no lists here\n")
    monkeypatch.setattr("memkit.estimation.autocast.header_path", lambda: broken)
    autocast_lists.cache_clear()
    try:
        assert autocast_lists() is BUILTIN_LISTS
    finally:
        autocast_lists.cache_clear()


def test_autocast_refuses_binary_cross_entropy_as_a_gpu_would() -> None:
    policy = AutocastPolicy(torch.float16)
    prob = torch.rand(4, device="meta")
    with pytest.raises(UserCodeError, match="BCEWithLogitsLoss"):
        policy.cast_args("binary_cross_entropy", (prob, prob), {})


def test_estimate_reports_a_spread_memory_model(files: dict[str, str]) -> None:
    est = estimate(files["mlp"], device_memory="8GiB", foreach=False)
    assert est.per_sample_bytes is not None and est.fixed_bytes is not None
    fitting = sorted((t.batch_size, t.reserved_peak) for t in est.trials if t.fits)
    (b1, p1), (b2, p2) = fitting[0], fitting[-1]
    slope = (p2 - p1) / (b2 - b1)
    assert est.per_sample_bytes == pytest.approx(slope, rel=0.05)
    assert est.fixed_bytes + est.per_sample_bytes * b2 == pytest.approx(p2, rel=0.01)


def test_amp_estimate_of_a_bce_model_fails_like_the_gpu_run(tmp_path: Path) -> None:
    path = tmp_path / "bce_model.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch

            def build_model():
                return torch.nn.Sequential(torch.nn.Linear(16, 1), torch.nn.Sigmoid())

            def make_batch(batch_size):
                return torch.randn(batch_size, 16)

            def loss_fn(output, batch):
                return torch.nn.functional.binary_cross_entropy(output, torch.ones_like(output))
            """
        )
    )
    assert estimate(str(path), device_memory="1GiB").max_batch_size is not None  # fp32 runs
    result = CliRunner().invoke(cli, ["estimate", str(path), "--device-memory", "1GiB",
                                      "--amp", "fp16"])  # fmt: skip
    assert result.exit_code == 3
    assert "binary_cross_entropy" in result.output and "BCEWithLogitsLoss" in result.output


def test_sparse_gradients_cannot_be_estimated_on_meta_and_the_error_says_so(
    tmp_path: Path,
) -> None:
    """Sweep F: on meta an nn.Embedding(sparse=True)'s gradient holds no rows (nnz 0): the
    estimate ran and counted 0 B of gradients. An EmbeddingBag's ended in PyTorch's list of
    dispatch keys (SparseMeta has no _coalesce)."""
    for module, batch in (("Embedding", "(batch_size,)"), ("EmbeddingBag", "(batch_size, 4)")):
        path = tmp_path / f"sparse_{module}.py"
        path.write_text(
            textwrap.dedent(
                f"""
                import torch

                def build_model():
                    return torch.nn.{module}(1000, 8, sparse=True)

                def make_batch(batch_size):
                    return torch.randint(0, 1000, {batch})

                def build_optimizer(params):
                    return torch.optim.SparseAdam(params)
                """
            )
        )
        result = CliRunner().invoke(cli, ["estimate", str(path), "--device-memory", "1GiB"])
        assert result.exit_code == 2, result.output
        assert "sparse=True" in result.output and "--device cpu" in result.output
        assert "registered at" not in result.output
        infer = ["estimate", str(path), "--device-memory", "1GiB", "--mode", "infer"]
        assert CliRunner().invoke(cli, infer).exit_code == 0


def test_a_sparse_op_without_a_meta_kernel_is_named_not_listed() -> None:
    with pytest.raises(UserCodeError) as info:
        run_guarded(lambda: torch.ones(3, device="meta").to_sparse(), 1)
    message = str(info.value)
    assert "aten::_to_sparse" in message and "sparse tensors" in message
    assert "memkit probe FILE --device cpu" in message and "\n" not in message


def test_an_op_without_a_meta_kernel_is_named_with_the_way_out() -> None:
    """CTC loss has no meta kernel: the estimate said to move "code that reads values" out of
    the step, which the user cannot do for a torch op (sweep O)."""
    log_probs = torch.randn(50, 2, 20, device="meta").log_softmax(-1)
    targets = torch.ones(2, 10, dtype=torch.long, device="meta")
    lengths = torch.full((2,), 50, dtype=torch.long, device="meta")
    target_lengths = torch.full((2,), 10, dtype=torch.long, device="meta")
    with pytest.raises(UserCodeError) as info:
        run_guarded(lambda: F.ctc_loss(log_probs, targets, lengths, target_lengths), 1)
    message = str(info.value)
    assert "no meta kernel for aten::_ctc_loss" in message
    assert "memkit probe FILE --device cpu" in message and "move it out" not in message


def test_allocator_constants_match_the_installed_torch() -> None:
    """kSmallSize and friends, as the installed PyTorch's c10/core/AllocatorConfig.h has them."""
    import re

    from memkit.simulated import allocator as am

    header = Path(torch.__file__).parent / "include" / "c10" / "core" / "AllocatorConfig.h"
    if not header.exists():
        pytest.skip("this torch install ships no c10/core/AllocatorConfig.h")
    found = dict(re.findall(r"constexpr size_t (k\w+) = (\d+);", header.read_text()))
    ours = {
        "kSmallBuffer": am.K_SMALL_BUFFER,
        "kMinBlockSize": am.K_MIN_BLOCK,
        "kSmallSize": am.K_SMALL_SIZE,
        "kMinLargeAlloc": am.K_MIN_LARGE_ALLOC,
        "kRoundLarge": am.K_ROUND_LARGE,
    }
    assert {name: int(found[name]) for name in ours} == ours
    large = re.search(r"large_segment_size_\{(\d+)\}", header.read_text())
    assert large is not None and int(large.group(1)) == am.K_LARGE_BUFFER


def test_data_dependent_mask_check_is_approximated_and_said(files: dict[str, str]) -> None:
    """transformers reads `attention_mask.all()` to skip an all-ones mask: meta tensors hold no
    value, so the estimate takes such checks as true and says so instead of failing."""
    est = estimate(files["bert"], device_memory="1GiB", max_batch=8)
    assert est.max_batch_size == 8
    assert any("data-dependent checks" in line for line in est.assumptions)
    assert not any("holds padding" in line for line in est.assumptions)


def test_a_padded_mask_is_said_to_take_the_path_the_estimate_left_out(tmp_path: Path) -> None:
    """Sweep CQ: with padding, `mask.all()` is false on a GPU, and the padded path (an
    additive mask, repeated key/value heads) can cost more than the one the estimate ran
    (3-7% on small transformers), silently. make_batch is built once on the CPU: a mask
    holding zeros gets a warning; an all-ones one does not."""
    from memkit.estimation.validation import simulated_peak

    model = textwrap.dedent(
        """
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.head = torch.nn.Embedding(100, 256), torch.nn.Linear(256, 2)
            def forward(self, input_ids, attention_mask):
                h = self.emb(input_ids)
                if not attention_mask.all():  # padding: positions zeroed, a tensor kept more
                    h = torch.relu(h) * attention_mask[..., None]
                return self.head(h)
        def build_model():
            return Net()
        def make_batch(batch_size):
            mask = torch.ones(batch_size, 64, dtype=torch.long)
            mask[::2, 40:] = PAD
            return {"input_ids": torch.randint(0, 100, (batch_size, 64)), "attention_mask": mask}
        """
    )
    said = {}
    for pad in (0, 1):
        path = tmp_path / f"net_{pad}.py"
        path.write_text(model.replace("PAD", str(pad)))
        est = estimate(str(path), device_memory="1GiB", max_batch=8)
        said[pad] = [line for line in est.assumptions if "holds padding" in line]
        assert any("data-dependent checks" in line for line in est.assumptions)
    assert said[1] == [] and len(said[0]) == 1
    assert said[0][0].startswith("warning: make_batch's `attention_mask` holds padding")
    # what it warns of: the padded step costs more on the simulated device, which runs it
    padded, unpadded = (simulated_peak(str(tmp_path / f"net_{p}.py"), 8) for p in (0, 1))
    assert padded > unpadded


def test_a_step_returning_loss_item_is_estimated_as_one_returning_nothing(tmp_path: Path):
    """Sweep CQ: docs/probe.md has a train_step return `loss.item()`; the probe ran such a
    file and the estimate exited 3 ("cannot be called on meta tensors"). The step's own
    `.item()` now gives a number that can be returned or logged (it holds no device memory),
    said among the assumptions: the estimate is the same as for the step returning nothing."""
    head = textwrap.dedent(
        """
        import torch
        def build_model():
            return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 4))
        def make_batch(n):
            return torch.randn(n, 64)
        def train_step(model, batch, optimizer):
            loss = model(batch).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        """
    )
    found = {}
    for name, tail in (("item", "    return loss.item()\n"), ("none", "    return None\n")):
        path = tmp_path / f"{name}.py"
        path.write_text(head + tail)
        found[name] = estimate(str(path), device_memory="1GiB", max_batch=4096)
    item, none = found["item"], found["none"]
    assert item.max_batch_size == none.max_batch_size and item.max_batch_size is not None
    assert [t.allocated_peak for t in item.trials] == [t.allocated_peak for t in none.trials]
    assert any(".item() in its own lines" in line for line in item.assumptions)
    assert not any(".item() in its own lines" in line for line in none.assumptions)
    guarded = tmp_path / "guarded.py"  # a NaN guard goes on to backward, as on a GPU
    guarded.write_text(
        "import math\n"
        + head.replace(
            "    loss.backward()\n",
            "    if not math.isfinite(loss.item()):\n        return None\n    loss.backward()\n",
        )
    )
    went_on = estimate(str(guarded), device_memory="1GiB", max_batch=4096)
    assert [t.allocated_peak for t in went_on.trials] == [t.allocated_peak for t in none.trials]
    # review CL: a value decided on (a loss spike skipped) or computed with (a length that
    # trims the batch) has none on meta: the step stops, as .item() itself did (read as 0,
    # the trimmed batch answered 1336x too high)
    # (review CM: a NaN guard read through C code went on with NaN underneath and skipped
    # backward; a length read from an integer tensor sliced the batch to nothing unasked)
    for tail in ("    if loss.item() < 1e-3:\n        return None\n",
                 "    return 1.0 / loss.item()\n",
                 "    n = int(batch.shape[0] + 0 * batch.sum().long().item())\n"):  # fmt: skip
        path = tmp_path / "decides.py"
        path.write_text(head.replace("    loss.backward()\n", tail + "    loss.backward()\n"))
        with pytest.raises(UserCodeError, match="hold no values"):
            estimate(str(path), device_memory="1GiB", max_batch=4096)


def test_a_shape_bug_is_not_blamed_on_meta_tensors(tmp_path: Path) -> None:
    head = "import torch\ndef build_model():\n    return torch.nn.Linear(4, 4)\n"
    shape_bug = tmp_path / "shape_bug.py"
    shape_bug.write_text(head + "def make_batch(n):\n    return torch.randn(n, 5)\n")
    reads_value = tmp_path / "reads_value.py"
    reads_value.write_text(
        head + "def make_batch(n):\n    return torch.randn(n, 4)\n"
        "def train_step(model, batch, optimizer):\n"
        "    loss = model(batch).sum()\n    print(loss.tolist())\n    loss.backward()\n"
    )
    with pytest.raises(UserCodeError) as shape:
        estimate(str(shape_bug), device_memory="1GiB")
    assert "would stop this step on a GPU" in str(shape.value) and "hold no values" not in str(
        shape.value
    )
    assert ".." not in str(shape.value)
    with pytest.raises(UserCodeError, match="meta tensors, which hold no values") as info:
        estimate(str(reads_value), device_memory="1GiB")
    assert "define train_step without it" in str(info.value)
    # where: the user's line (sweep WW's `lengths.cpu()` for pack_padded_sequence had none)
    assert "reads_value.py" in str(info.value) and "print(loss.tolist())" in str(info.value)
    # an evaluation's metric read in eval_step: the fix names eval_step (it said train_step,
    # sweep MM) and the loss_fn the estimate runs
    evaluates = tmp_path / "evaluates.py"
    evaluates.write_text(
        head + "def make_batch(n):\n    return torch.randn(n, 4)\n"
        "def eval_step(model, batch):\n    print(model(batch).argmax(-1).tolist())\n"
    )
    with pytest.raises(UserCodeError, match="hold no values") as info:
        estimate(str(evaluates), device_memory="1GiB", mode="infer")
    assert "define eval_step without it" in str(info.value) and "loss_fn(output, batch)" in str(
        info.value
    )


def test_a_cpu_tensor_made_in_the_forward_is_named_as_a_gpu_would_fail_on_it() -> None:
    """``pos = torch.arange(x.shape[1])`` in a forward (no device=): on meta torch says
    "Tensor on device meta is not on the expected device cpu!", which memkit called a
    meta-only problem ("code that reads them cannot run there"); a GPU fails the same way."""

    def step() -> torch.Tensor:
        return torch.ones(3, device="meta") + torch.arange(3)

    with pytest.raises(UserCodeError) as info:
        run_guarded(step, 1)
    said = str(info.value)
    assert "made a tensor on the CPU" in said and "device=x.device" in said
    assert "hold no values" not in said and "cpu!." not in said
    # and where: the user's frame (it said nothing of where, even with MEMKIT_TRACEBACK=1)
    assert 'test_estimate.py", line' in said and "in step" in said


def test_a_models_own_data_dependent_routing_is_sent_to_the_simulated_device() -> None:
    """A mixture of experts routes tokens with ``nonzero`` (top-k routing): the shape depends
    on values, which meta tensors lack. "Move it out of the step" cannot be done where the
    routing is the model; the error names the run that works (sweep Z)."""

    def route() -> torch.Tensor:
        scores = torch.randn(8, 4, device="meta")
        return torch.nonzero(scores.argmax(-1) == 0)

    with pytest.raises(UserCodeError) as info:
        run_guarded(route, 8)
    said = str(info.value)
    assert "hold no values" in said and "routing" in said
    assert "--device cpu --budget <the GPU's memory less its CUDA context>" in said


def test_infer_takes_the_files_loss_as_probes_evaluation_step_does(tmp_path: Path) -> None:
    """``memkit probe --mode infer`` takes the file's ``loss_fn`` after the forward (an eval
    loop's ``test_loss += loss_fn(...).item()``); the estimate ran the forward alone and
    answered for a step the loop does not run (a bfloat16 classifier's float32 loss: 2560
    where the loss-taking step fits 896 on a 564 MiB ampere)."""
    body = (
        "import torch\n"
        "def build_model():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(64, 4096)).to(torch.bfloat16)\n"
        "def make_batch(n):\n"
        "    return torch.randn(n, 64, dtype=torch.bfloat16), torch.randint(0, 4096, (n,))\n"
    )
    loss = (
        "def loss_fn(logits, batch):\n"
        "    return torch.nn.functional.cross_entropy(logits.float(), batch[1])\n"
    )
    answers = []
    for text in (body, body + loss):
        path = tmp_path / f"cls{len(answers)}.py"
        path.write_text(text)
        answers.append(estimate(str(path), device_memory="564MiB", mode="infer").max_batch_size)
    forward_only, with_loss = answers
    assert forward_only is not None and with_loss is not None
    assert with_loss < 0.5 * forward_only  # float32 logits and log-probabilities: 10 B a logit


def test_a_float64_model_fed_float32_fails_as_on_a_gpu(tmp_path: Path) -> None:
    """Meta kernels do not check dtypes; the GPU's (and probe's real run) refuse the mix, so
    the estimate must fail too (it used to answer, exit 0). The CLI gives exit code 3."""
    path = tmp_path / "double.py"
    path.write_text(
        "import torch\ndef build_model():\n    return torch.nn.Linear(4, 4).double()\n"
        "def make_batch(n):\n    return torch.randn(n, 4)\n"
    )
    with pytest.raises(UserCodeError, match=r"torch\.float32 and torch\.float64") as err:
        estimate(str(path), device_memory="1GiB")
    assert "would stop this step on a GPU" in str(err.value)
    assert err.value.exit_code == 3


def test_the_headline_claims_the_margin_only_where_the_recommended_size_leaves_it(
    files: dict[str, str],
) -> None:
    """examples/mlp.py at batch 1 reserves 122 MiB, and 123 MiB are usable: the headline said
    "recommended 1 (leaves 5% free)" over a reserved peak of 99% of it. It now says what is
    left, as the probe's does."""
    est = estimate(files["mlp"], device_memory="623MiB", max_batch=64)  # ampere: 500 MiB context
    rec = est.recommended_batch_size
    ran = next(t for t in est.trials if t.batch_size == rec)
    free = 1 - ran.reserved_peak / est.usable_bytes
    assert free < est.margin  # the case this test is for
    assert f"no size leaves 5% free (batch {rec} leaves {free:.1%})" in str(est).splitlines()[0]


COMPILED_FILE = """
import torch

def build_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return {compile}

def make_batch(batch_size):
    return torch.randn(batch_size, 16)

def loss_fn(output, batch):
    return output.pow(2).mean()
"""


def test_a_compiled_model_is_counted_eagerly_and_the_reports_say_so(tmp_path: Path) -> None:
    """TorchDynamo does not compile under memkit's counting: estimate and probe on the
    simulated device count the eager model (the same numbers) and say so, text and JSON."""
    from torch._dynamo.utils import counters

    from memkit import probe_file

    paths = {}
    for name, wrap in (("eager", "model"), ("compiled", "torch.compile(model)")):
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(textwrap.dedent(COMPILED_FILE.format(compile=wrap)))
    counters.clear()
    kwargs = {"device_memory": "1GiB", "min_batch": 32, "max_batch": 32}
    eager, compiled = (estimate(str(paths[n]), **kwargs) for n in ("eager", "compiled"))
    assert not counters["frames"]  # nothing compiled, the unaccounted warm-up included
    peaks = [(t.allocated_peak, t.reserved_peak, t.counted_peak) for t in eager.trials]
    assert [(t.allocated_peak, t.reserved_peak, t.counted_peak) for t in compiled.trials] == peaks
    notes = [a for a in compiled.assumptions if a.startswith("torch.compile:")]
    assert len(notes) == 1 and "ran eagerly" in notes[0]
    assert not any(a.startswith("torch.compile:") for a in eager.assumptions)
    assert notes[0] in json.loads(compiled.to_json())["assumptions"]
    probed = probe_file(str(paths["compiled"]), device="cpu", budget="64MiB", max_batch=64)
    assert any(d.startswith("torch.compile:") for d in probed.defaults)
    assert any(d.startswith("torch.compile:") for d in json.loads(probed.to_json())["defaults"])
    assert "torch.compile:" in str(probed)


def test_a_spec_returning_a_live_model_leaves_it_in_place_and_copies_no_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memkit.modelfile import ModelSpec

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.register_buffer("scale", torch.ones(4))
    model[0].weight.requires_grad_(False)  # frozen: the copy has no gradient for it either
    before = {name: t.clone() for name, t in model.state_dict().items()}

    def no_tensor_copies(self: torch.Tensor, memo: dict[int, object]) -> torch.Tensor:
        raise AssertionError("a tensor's data was deep-copied")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", no_tensor_copies)
    spec = ModelSpec("notebook", lambda: model, lambda n: torch.randn(n, 16))
    est = estimate(spec, device_memory="1GiB", max_batch=64)
    assert est.max_batch_size == 64
    assert (est.num_parameters, est.trainable_parameters) == (16 * 32 + 32 + 32 * 4 + 4, 32 + 132)
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad


def test_attention_inside_a_python_function_gets_the_target_kernel() -> None:
    """F.multi_head_attention_forward calls SDPA inside: the mode sees it (not the math path)."""
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True, device="meta")
    x = torch.randn(2, 128, 64, device="meta")

    def peak(attention: str) -> tuple[int, set[str]]:
        mode = target_mode(None, attention, 80)
        with target_rules_on(mode), MemoryAccountant(torch.device("meta"), None) as acc:
            mha(x, x, x, need_weights=False)[0].sum().backward()
        return acc.peak, mode.kernels

    fused, kernels = peak("auto")
    math, _ = peak("math")
    assert kernels == {"efficient"}
    assert math - fused >= 2 * 4 * 128 * 128 * 4  # at least the B x H x L x L fp32 scores


def test_autocast_policy_reaches_the_linears_inside_multi_head_attention() -> None:
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True, device="meta")
    x = torch.randn(2, 16, 64, device="meta")
    mode = target_mode(torch.bfloat16, "auto", 80)
    with target_rules_on(mode):
        out = mha(x, x, x, need_weights=False)[0]
    assert out.dtype == torch.bfloat16  # the out projection ran on the cast weight
    assert mode.kernels == {"flash"}  # bf16 queries, no mask


def test_fused_kernels_keep_the_mask_they_run_on_for_backward() -> None:
    q, k, v = _qkv(4, 4, 64, torch.float32)
    length = q.shape[-2]

    def alive_after_forward(dtype: torch.dtype | None, kernel: str) -> int:
        with MemoryAccountant(torch.device("meta"), None) as acc:
            shape = (length, length)
            mask = None if dtype is None else torch.zeros(shape, dtype=dtype, device="meta")
            out = fused_attention(q, k, v, kernel, 80, mask)
            del mask  # the caller's reference: what stays is what the kernel keeps
            alive = acc.current
            out.sum().backward()
        return alive

    additive = length * length * 4
    for kernel in ("efficient", "cpu-flash"):
        unmasked = alive_after_forward(None, kernel)
        assert alive_after_forward(torch.float32, kernel) - unmasked == additive
        # a boolean mask runs (and is kept) as an additive copy in the query's dtype
        assert alive_after_forward(torch.bool, kernel) - unmasked == additive
    # memory-efficient: a last dim that is not a multiple of 8 is padded (by 8 - S % 8)
    odd = torch.zeros(length, 60, device="meta")
    padded = kernel_mask(odd, torch.float32, "efficient")
    assert padded.shape == odd.shape and padded.untyped_storage().nbytes() == length * 64 * 4
    assert kernel_mask(odd, torch.float32, "cpu-flash") is odd


def test_flash_output_follows_the_query_layout_efficient_does_not() -> None:
    batch, heads, length, dim = 2, 4, 32, 64
    base = torch.empty(length, batch, heads, dim, device="meta", dtype=torch.bfloat16)
    q = base.permute(1, 2, 0, 3)  # B x H x L x D laid out as L x B x H x D (nn.MultiheadAttention)
    for kernel in ("flash", "cpu-flash"):
        assert fused_attention(q, q, q, kernel).stride() == q.stride()
    out = fused_attention(q, q, q, "efficient")
    assert out.transpose(1, 2).is_contiguous()  # B x L x H x D


def test_inference_of_a_transformer_encoder_with_a_padding_mask_is_estimated(
    tmp_path: Path,
) -> None:
    """``nn.TransformerEncoder`` in eval checks its padding mask's values for the fused path
    (``_nested_tensor_from_mask_left_aligned``, no meta kernel) before it looks at where the
    tensors are: the estimate crashed with exit 3 (sweep O). The fused path is off in the meta
    step; the estimate counts the Python path, at least what the fused one keeps."""
    path = tmp_path / "encoder_model.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
                    self.enc = torch.nn.TransformerEncoder(layer, 2)

                def forward(self, x, pad):
                    return self.enc(x, src_key_padding_mask=pad)[:, 0]

            def build_model():
                return Net()

            def make_batch(batch_size):
                pad = torch.zeros(batch_size, 32, dtype=torch.bool)
                pad[:, -8:] = True
                return torch.randn(batch_size, 32, 64), pad
            """
        )
    )
    est = estimate(str(path), device_memory="1GiB", mode="infer", min_batch=4, max_batch=4)
    assert est.max_batch_size == 4
    assert torch.backends.mha.get_fastpath_enabled()  # put back after the step


def test_infer_runs_the_files_eval_step_as_probes_evaluation_step_does(tmp_path: Path) -> None:
    """A ``forward(x, t)`` model: ``memkit estimate --mode infer`` called ``model(batch)``
    (a TypeError, exit 3) where the file's ``eval_step`` says how its evaluation calls it; the
    estimate runs it, as ``memkit probe --mode infer`` does, and its report says so."""
    source = Path(__file__).parent / "modelfiles" / "timestep_model.py"
    path = tmp_path / "denoiser.py"
    path.write_text(source.read_text())
    with pytest.raises(UserCodeError, match="missing 1 required positional argument: 't'"):
        estimate(str(path), device_memory="1GiB", mode="infer", max_batch=8)
    path.write_text(
        source.read_text() + "def eval_step(model, x):\n"
        "    return model(x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device))\n"
    )
    est = estimate(str(path), device_memory="1GiB", mode="infer", max_batch=8)
    assert est.max_batch_size == 8
    assert any(line.startswith("step: eval_step(model, batch)") for line in est.assumptions)


def test_amp_fp32_is_no_autocast_in_python_as_on_the_command_line(files: dict[str, str]) -> None:
    """``memkit estimate --amp fp32`` (its default) ran, ``estimate(amp="fp32")`` raised a
    ConfigError (sweep): one rule reads both, and fp32 is no mixed precision."""
    fp32 = estimate(files["mlp"], device_memory="2GiB", max_batch=64, amp="fp32")
    plain = estimate(files["mlp"], device_memory="2GiB", max_batch=64)
    assert fp32.amp is None and fp32.max_batch_size == plain.max_batch_size
    assert estimate(files["mlp"], device_memory="2GiB", max_batch=64, amp="BF16").amp == "bf16"
    with pytest.raises(ConfigError, match="amp must be one of fp32, bf16, fp16 or None"):
        estimate(files["mlp"], device_memory="2GiB", amp="fp8")


GENERATE_FILE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128,
                                      n_positions=64))

def make_batch(n):
    return torch.randint(0, 128, (n, 8))

def eval_step(model, batch):
    return model.generate(batch, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)
"""


def test_a_generate_on_meta_is_said_to_stop_at_its_first_token(tmp_path: Path) -> None:
    """transformers' generate() reads whether every sequence finished from a tensor: on meta
    it has no value and read as true, so the estimate counted one new token of 16 (sweep PP:
    388 KiB a sample where the probe measured 1.32 MiB), saying only that data checks were
    taken as true. It now warns, and names the probe."""
    pytest.importorskip("transformers")
    path = tmp_path / "gen.py"
    path.write_text(GENERATE_FILE)
    est = estimate(path, device_memory="1TiB", mode="infer", min_batch=4, max_batch=4)
    (line,) = [a for a in est.assumptions if "generate() ran on meta tensors" in a]
    assert "memkit probe FILE --mode infer" in line  # (the goldens hold the plain lines)


def test_a_step_that_steps_every_fourth_call_is_said_to_miss_the_optimizer(
    tmp_path: Path,
) -> None:
    """Accumulation written in the step (accelerate's ``sync_gradients``, sweep PP): the
    estimate's 2 steps a trial ran no optimizer step, its answer counted no optimizer state,
    and nothing said so; the probe runs the step's cycle."""
    path = tmp_path / "every_fourth.py"
    path.write_text(
        textwrap.dedent(
            """
            import itertools
            import torch

            CALLS = itertools.count()

            def build_model():
                return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))

            def make_batch(n):
                return torch.randn(n, 64)

            def train_step(model, batch, optimizer):
                (model(batch).square().mean() / 4).backward()
                if next(CALLS) % 4 == 3:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            """
        )
    )
    est = estimate(path, device_memory="1TiB", min_batch=8, max_batch=8)
    (line,) = [a for a in est.assumptions if "no optimizer stepped" in a]
    assert "(batch 8:" in line and "`memkit probe` runs the step's cycle" in line


def searched_recommendation(
    reserved: Callable[[int], int], usable: int, max_batch: int
) -> tuple[Any, Any, list[int]]:
    """A search over a reserved-peak curve as the estimate runs it (a stand-in session that
    records the sizes run): ``(session, search result, sizes run)``."""
    from types import SimpleNamespace

    from memkit.probing.search import search_max_batch

    ran: list[int] = []

    def run(batch: int) -> SimpleNamespace:
        ran.append(batch)
        session.cache[batch] = SimpleNamespace(reserved=reserved(batch), ooms=0)
        return session.cache[batch]

    session = SimpleNamespace(usable=usable, cache={}, run=run, plan=SimpleNamespace(mode="train"))
    search = search_max_batch(
        lambda b: (reserved(b) <= usable, run(b).reserved, None, reserved(b)),
        capacity_bytes=usable, min_batch=1, max_batch=max_batch, margin=0.05,
    )  # fmt: skip
    return session, search, ran


def test_an_interpolated_recommendation_is_run_and_kept_within_the_margin() -> None:
    """Sweep BF: 3860 was recommended for BART "(leaves 5% free)" and held 4.8%: the search
    interpolates the recommendation between two measured sizes, and reserved memory moves in
    allocator segments. The estimate now runs it, and bisects down where it breaks the margin."""
    import dataclasses

    from memkit.estimation.search import _held_recommendation

    segment = 20 << 20

    def reserved(batch: int) -> int:  # a step up of a whole segment at 95 samples
        return 100 * (1 << 20) + batch * (1 << 20) + (segment if batch >= 95 else 0)

    usable = 220 << 20
    session, search, ran = searched_recommendation(reserved, usable, 512)
    assert not search.recommended_measured and search.recommended_batch_size is not None
    interpolated = search.recommended_batch_size
    assert reserved(interpolated) > 0.95 * usable  # the search's own answer breaks the margin
    searched = len(ran)
    held = _held_recommendation(session, search, 0.05)
    assert held is not None and reserved(held) <= 0.95 * usable < reserved(held + 1)
    assert 1 <= len(ran) - searched <= 5  # the interpolated size, then at most four more
    # a measured recommendation is taken as it is; an interpolated one that holds is kept
    measured = dataclasses.replace(search, recommended_batch_size=held, recommended_measured=True)
    assert _held_recommendation(session, measured, 0.05) == held


def test_an_interpolated_recommendation_on_a_reserved_plateau_is_bisected() -> None:
    """Sweep BL: a generate() estimate recommended 44 of 426 where 276 held the margin: on a
    flat reserved plateau above it, each step lowered by the overshoot's rate moved a few
    samples, six missed, and the measured size far below was taken. After one aimed step the
    recommendation is bisected."""
    from memkit.estimation.search import _held_recommendation

    def reserved(batch: int) -> int:  # 0.1 MiB a sample, then a plateau 6 MiB over the margin
        return (100 << 20) + batch * (1 << 20) // 10 if batch < 300 else 215 << 20

    session, search, ran = searched_recommendation(reserved, 220 << 20, 1024)
    assert not search.recommended_measured
    searched = len(ran)
    held = _held_recommendation(session, search, 0.05)
    assert held is not None and 290 <= held < 300  # (299 is the largest that holds)
    assert len(ran) - searched <= 9


def test_a_model_cast_to_bf16_whole_is_said_to_be_so_not_fp32(tmp_path: Path) -> None:
    """Sweep BF: a Llama cast to bf16 (``model.to(torch.bfloat16)``) was estimated as it runs
    but labelled "(train, fp32)" and "amp: none (fp32)"."""
    path = tmp_path / "bf16_model.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(256, 8)).to(torch.bfloat16)\n"
        "def make_batch(n):\n"
        "    return torch.randn(n, 64, dtype=torch.bfloat16), torch.randint(0, 8, (n,))\n"
    )
    est = estimate(str(path), device_memory="1GiB", max_batch=64)
    assert est.weights_dtype == "bfloat16" and est.amp is None
    assert "(train, bfloat16 weights)" in str(est)
    assert "amp: none (the model's own bfloat16 weights)" in est.assumptions
    fp32 = estimate(str(EXAMPLES / "mlp.py"), device_memory="1GiB", max_batch=64)
    assert fp32.weights_dtype is None and "(train, fp32)" in str(fp32)
