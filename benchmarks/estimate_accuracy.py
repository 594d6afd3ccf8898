"""Accuracy of ``memkit estimate``: meta-tensor estimates against real peaks.

    python benchmarks/estimate_accuracy.py            # GPU part if CUDA is there, CPU part always
    python benchmarks/estimate_accuracy.py --cpu-only
    python benchmarks/estimate_accuracy.py --gpu-only --models mlp,gpt2 --json out.json
    python benchmarks/estimate_accuracy.py --recorded tests/data/estimate_h200_call1.json

* **CPU part** (any machine): the estimate's counted peak on ``meta`` against the simulated cpu
  device's real runs of the same model files (same accounting, so it checks the meta path; the
  estimate uses ``foreach=False``, ``attention="cpu-flash"``, no workspace, like the cpu run).
* **GPU part** (CUDA only): the estimate (``device`` family from the card's compute capability,
  context measured) against ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of two
  real steps (fresh optimizer state, as ``memkit probe``), for 5 models (MLP, CNN with BatchNorm,
  ViT-like, GPT-2-like, BERT-like) x train/infer x fp32/bf16 autocast x several batch sizes.
  Autocast wraps the forward and the loss (the standard recipe), not backward or the step. The
  step is probe's default step (the estimate's): the output is kept through backward and, in
  inference, until the next forward returns (``"keeps_output": true`` in the JSON).
* **Recorded** (``--recorded FILE``, any machine): the cases of a GPU part's ``--json`` file
  re-estimated on CPU for the family and CUDA context they were measured with, against the
  recorded real peaks; prints the GPU part's table and summary line. Files written before
  ``keeps_output`` was recorded ran fp32 cases with probe's step and bf16 cases keeping only
  the loss (their output dropped at once): each case is re-estimated with the step it ran.

Prints a table with each error and the median and worst absolute errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from memkit.estimation import DEVICE_FAMILIES, estimate, simulated_peak
from memkit.modelfile import load_model_file
from memkit.probing.step import StepPlan, call_model, resolve_loss, to_device
from memkit.render.text import table
from memkit.units import format_size

log = logging.getLogger("estimate_accuracy")

MODELS = {
    "mlp": """
        import torch
        def build_model():
            return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                       torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                       torch.nn.Linear(4096, 1024))
        def make_batch(batch_size):
            return torch.randn(batch_size, 1024)
        def loss_fn(output, batch):
            return torch.nn.functional.mse_loss(output.float(), batch)
    """,
    "cnn": """
        import torch
        from torch import nn
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())
        def build_model():
            return nn.Sequential(block(3, 64), block(64, 64), nn.MaxPool2d(2), block(64, 128),
                                 block(128, 128), nn.MaxPool2d(2), block(128, 256),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000))
        def make_batch(batch_size):
            return torch.randn(batch_size, 3, 64, 64)
        def loss_fn(output, batch):
            return output.float().logsumexp(-1).mean()
    """,
    "vit": """
        import torch
        from torch import nn
        import torch.nn.functional as F
        class Block(nn.Module):
            def __init__(self, dim, heads):
                super().__init__()
                self.heads = heads
                self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
                self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
                self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                         nn.Linear(4 * dim, dim))
            def forward(self, x):
                b, n, d = x.shape
                qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads)
                q, k, v = qkv.permute(2, 0, 3, 1, 4)
                a = F.scaled_dot_product_attention(q, k, v)
                x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
                return x + self.mlp(self.norm2(x))
        class ViT(nn.Module):
            def __init__(self, dim=384, depth=6, heads=6):
                super().__init__()
                self.patch = nn.Conv2d(3, dim, 16, 16)
                self.pos = nn.Parameter(torch.zeros(1, 196, dim))
                self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
                self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 1000)
            def forward(self, x):
                x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
                return self.head(self.norm(self.blocks(x)).mean(1))
        def build_model():
            return ViT()
        def make_batch(batch_size):
            return torch.randn(batch_size, 3, 224, 224)
        def loss_fn(output, batch):
            return output.float().logsumexp(-1).mean()
    """,
    "gpt2": """
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        CONFIG = GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=1024,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        def build_model():
            return GPT2LMHeadModel(CONFIG)
        def make_batch(batch_size, seq_len=256):
            ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
            return {"input_ids": ids, "labels": ids}
    """,
    "bert": """
        import torch
        from transformers import BertConfig, BertForMaskedLM
        CONFIG = BertConfig(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                            intermediate_size=2048, vocab_size=8192,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        def build_model():
            return BertForMaskedLM(CONFIG)
        def make_batch(batch_size, seq_len=256):
            ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
            return {"input_ids": ids, "labels": ids}
    """,
    # a classifier as people build one: BertConfig's dropout (0.1, attention included) and an
    # attention mask that transformers checks with mask.all() (data-dependent on meta tensors)
    "bert-cls": """
        import torch
        from transformers import BertConfig, BertForSequenceClassification
        CONFIG = BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                            intermediate_size=1024, vocab_size=8192)
        def build_model():
            return BertForSequenceClassification(CONFIG)
        def make_batch(batch_size, seq_len=128):
            return {"input_ids": torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len)),
                    "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
                    "labels": torch.randint(0, 2, (batch_size,))}
    """,
    # grouped-query attention (2 key/value heads for 8): fp32 takes no memory-efficient kernel
    "llama-gqa": """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        CONFIG = LlamaConfig(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                             num_key_value_heads=2, intermediate_size=1408, vocab_size=8192,
                             max_position_embeddings=1024, attn_implementation="sdpa")
        def build_model():
            return LlamaForCausalLM(CONFIG)
        def make_batch(batch_size, seq_len=512):
            ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
            return {"input_ids": ids, "labels": ids}
    """,
    # transformers 5's mixture-of-experts experts: torch._grouped_mm
    "mixtral": """
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM
        CONFIG = MixtralConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8,
                               num_key_value_heads=2, intermediate_size=512, vocab_size=8192,
                               num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=1024, attn_implementation="sdpa")
        def build_model():
            return MixtralForCausalLM(CONFIG)
        def make_batch(batch_size, seq_len=256):
            ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
            return {"input_ids": ids, "labels": ids}
    """,
}
SEQ_MODELS = {"gpt2": 256, "bert": 256, "bert-cls": 128, "llama-gqa": 512, "mixtral": 256}
CPU_CASES = [  # (model, mode, batch): small enough for a 2-core CPU
    ("mlp", "train", 16), ("mlp", "train", 64), ("mlp", "infer", 64),
    ("cnn", "train", 4), ("cnn", "train", 8), ("cnn", "infer", 8),
    ("vit", "train", 2), ("vit", "infer", 4),
    ("gpt2", "train", 2), ("gpt2", "train", 4), ("gpt2", "infer", 4),
    ("bert", "train", 2), ("bert", "infer", 4),
    ("bert-cls", "train", 4), ("bert-cls", "infer", 8),
]  # fmt: skip
GPU_BATCHES = {
    "mlp": (64, 512), "cnn": (16, 64), "vit": (16, 64), "gpt2": (4, 16), "bert": (4, 16),
    "bert-cls": (16, 64), "llama-gqa": (2, 8), "mixtral": (4, 16),
}  # fmt: skip


def write_models(folder: Path) -> dict[str, str]:
    """Write the model files; returns name -> path."""
    paths = {}
    for name, text in MODELS.items():
        path = folder / f"acc_{name}.py"
        path.write_text(textwrap.dedent(text))
        paths[name] = str(path)
    return paths


def _err(est: int, real: int) -> float:
    return (est - real) / real if real else 0.0


def cpu_part(paths: dict[str, str]) -> list[float]:
    """Estimate (meta) vs the simulated cpu device (real runs); prints a table."""
    rows, errors = [], []
    for name, mode, batch in CPU_CASES:
        if name not in paths:
            continue
        seq = SEQ_MODELS.get(name)
        started = time.perf_counter()
        real = simulated_peak(paths[name], batch, mode=mode, seq_len=seq)
        real_s = time.perf_counter() - started
        started = time.perf_counter()
        est = estimate(
            paths[name], device_memory="1TiB", mode=mode, seq_len=seq, min_batch=batch,
            max_batch=batch, foreach=False, attention="cpu-flash", workspace=0,
        )  # fmt: skip
        est_s = time.perf_counter() - started
        trial = est.trial(batch)
        assert trial is not None
        err = _err(trial.counted_peak, real)
        errors.append(abs(err))
        rows.append([name, mode, batch, format_size(real), format_size(trial.counted_peak),
                     f"{err:+.3%}", f"{real_s:.2f}", f"{est_s:.2f}"])  # fmt: skip
    headers = ["model", "mode", "batch", "simulated cpu", "estimate", "error", "real s", "est. s"]
    print(table(headers, rows, title="CPU: estimate on meta vs simulated device"))
    print(f"median |error| {statistics.median(errors):.3%}, worst {max(errors):.3%}\n")
    return errors


def _family_for_gpu() -> str:
    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    best = max((f for f in DEVICE_FAMILIES.values() if f.sm <= sm), key=lambda f: f.sm)
    return best.name


def _fresh_gpu() -> None:
    """Free what earlier cases left: cached blocks and the cuBLAS workspaces.

    The workspaces live in PyTorch's handle map, not in a tensor: ``empty_cache`` does not free
    them, so without this an inference case would carry the autograd thread's workspace of an
    earlier training case (8-32 MiB counted that the estimate rightly does not count).
    """
    import gc

    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def _real_gpu_peak(path: str, mode: str, batch: int, amp: bool, seq: int | None) -> tuple[int, int]:
    _fresh_gpu()
    spec = load_model_file(path)
    device = torch.device("cuda")
    model = spec.build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters()) if mode == "train" else None
    model.train(mode == "train")
    plan = StepPlan(mode, loss_fn=spec.loss_fn)
    args = [batch] if seq is None else [batch, seq]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    output: object = None  # kept as probe's step keeps it (the estimate's step)
    for _ in range(2):
        data = to_device(spec.make_batch(*args), device)
        if not amp:
            plan(model, data, optimizer)
        elif mode == "infer":
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                output = call_model(model, data)  # the previous output lived until now
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                new_output = call_model(model, data)
                output = None  # `out = model(x)` rebinds the loop's variable only now
                loss, _ = resolve_loss(new_output, data, spec.loss_fn)
            output, new_output = new_output, None
            loss.backward()
            assert optimizer is not None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        del data
    torch.cuda.synchronize()
    peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    plan.release()
    del model, optimizer, output
    torch.cuda.empty_cache()
    return peaks


def _measured_context() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def gpu_part(paths: dict[str, str]) -> dict[str, object]:
    """Estimate vs torch.cuda.max_memory_allocated / max_memory_reserved; prints a table.

    Returns the cases and the summary, JSON-ready (``--json``).
    """
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    family = _family_for_gpu()
    context = _measured_context()
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"GPU: {torch.cuda.get_device_name()} ({family}), total {format_size(total)}, "
          f"measured context {format_size(context)} (table: "
          f"{format_size(DEVICE_FAMILIES[family].context_bytes)})")  # fmt: skip
    rows, alloc_err, res_err = [], [], []
    cases: list[dict[str, object]] = []
    for name in paths:
        seq = SEQ_MODELS.get(name)
        for mode in ("train", "infer"):
            for amp in (False, True):
                for batch in GPU_BATCHES[name]:
                    try:
                        real_a, real_r = _real_gpu_peak(paths[name], mode, batch, amp, seq)
                    except Exception as exc:  # one case failing must not lose the others
                        failure = f"{type(exc).__name__}: {exc}"
                        rows.append([name, mode, "bf16" if amp else "fp32", batch,
                                     f"failed: {failure[:70]}"] + [""] * 6)  # fmt: skip
                        cases.append({"model": name, "mode": mode, "amp": amp,
                                      "batch": batch, "failed": failure})  # fmt: skip
                        continue
                    est = estimate(
                        paths[name], device_memory=total, mode=mode, seq_len=seq,
                        amp="bf16" if amp else None, arch=family, context=context,
                        min_batch=batch, max_batch=batch,
                    )  # fmt: skip
                    trial = est.trial(batch)
                    assert trial is not None
                    ea, er = _err(trial.allocated_peak, real_a), _err(trial.reserved_peak, real_r)
                    alloc_err.append(abs(ea))
                    res_err.append(abs(er))
                    cases.append({"model": name, "mode": mode, "amp": amp, "batch": batch,
                                  "real_allocated": real_a, "est_allocated": trial.allocated_peak,
                                  "real_reserved": real_r, "est_reserved": trial.reserved_peak,
                                  "kernels": list(est.attention_kernels),
                                  "keeps_output": True})  # fmt: skip
                    rows.append([name, mode, "bf16" if amp else "fp32", batch,
                                 format_size(real_a), format_size(trial.allocated_peak),
                                 f"{ea:+.1%}", format_size(real_r),
                                 format_size(trial.reserved_peak), f"{er:+.1%}",
                                 ",".join(est.attention_kernels) or "-"])  # fmt: skip
    print(table(["model", "mode", "amp", "batch", "real alloc", "est alloc", "err",
                 "real reserved", "est reserved", "err", "attention"], rows,
                title="GPU: estimate vs torch.cuda max_memory_allocated / reserved"))  # fmt: skip
    summary: dict[str, object] = {"device": torch.cuda.get_device_name(), "family": family,
                                  "measured_context": context, "total_memory": total,
                                  "torch": torch.__version__, "cases": cases}  # fmt: skip
    return summarised(summary, alloc_err, res_err)


def summarised(
    summary: dict[str, object], alloc_err: list[float], res_err: list[float]
) -> dict[str, object]:
    """``summary`` with the medians and worst errors, printed as the summary line."""
    if alloc_err:
        print(summary_line(alloc_err, res_err))
        summary |= {"allocated_median": statistics.median(alloc_err),
                    "allocated_worst": max(alloc_err),
                    "reserved_median": statistics.median(res_err),
                    "reserved_worst": max(res_err)}  # fmt: skip
    return summary


_HEADERS = ["model", "mode", "amp", "batch", "real alloc", "est alloc", "err", "real reserved",
            "est reserved", "err", "attention"]  # fmt: skip


def _row(case: dict[str, Any], est_a: int, est_r: int, kernels: list[str]) -> list[object]:
    ra, rr = int(case["real_allocated"]), int(case["real_reserved"])
    return [case["model"], case["mode"], "bf16" if case["amp"] else "fp32", case["batch"],
            format_size(ra), format_size(est_a), f"{_err(est_a, ra):+.1%}", format_size(rr),
            format_size(est_r), f"{_err(est_r, rr):+.1%}", ",".join(kernels) or "-"]  # fmt: skip


def summary_line(alloc_err: list[float], res_err: list[float]) -> str:
    """The summary both the GPU part and ``--recorded`` print."""
    return (
        f"allocated: median |error| {statistics.median(alloc_err):.2%}, worst {max(alloc_err):.2%}"
        f"; reserved: median {statistics.median(res_err):.2%}, worst {max(res_err):.2%}"
    )


def keeps_output(case: dict[str, Any]) -> bool:
    """The step a recorded case ran: files without ``keeps_output`` (call1, 2026-11-26) ran
    probe's step in fp32 and kept only the loss under bf16 autocast."""
    return bool(case.get("keeps_output", not case["amp"]))


def recorded_part(record: dict[str, Any], paths: dict[str, str]) -> dict[str, object]:
    """Re-estimate a GPU part's recorded cases on CPU; prints the table and the summary line.

    Returns the recorded summary with the new estimates (``est_*``) and errors.
    """
    family, context = str(record["family"]), int(record["measured_context"])
    total = int(record.get("total_memory") or 1 << 40)  # peaks do not depend on it below OOM
    rows, alloc_err, res_err = [], [], []
    cases: list[dict[str, object]] = []
    for case in record["cases"]:
        if "failed" in case or case["model"] not in paths:
            continue
        name, batch = case["model"], int(case["batch"])
        est = estimate(
            paths[name], device_memory=total, mode=case["mode"], seq_len=SEQ_MODELS.get(name),
            amp="bf16" if case["amp"] else None, arch=family, context=context,
            min_batch=batch, max_batch=batch, keep_output=keeps_output(case),
        )  # fmt: skip
        trial = est.trial(batch)
        assert trial is not None
        ea = _err(trial.allocated_peak, int(case["real_allocated"]))
        er = _err(trial.reserved_peak, int(case["real_reserved"]))
        alloc_err.append(abs(ea))
        res_err.append(abs(er))
        kernels = list(est.attention_kernels)
        rows.append(_row(case, trial.allocated_peak, trial.reserved_peak, kernels))
        cases.append(case | {"est_allocated": trial.allocated_peak,
                             "est_reserved": trial.reserved_peak, "kernels": kernels,
                             "allocated_error": ea, "reserved_error": er})  # fmt: skip
    print(table(_HEADERS, rows, title=f"Recorded on {record.get('device')} ({family}): "
                "estimate re-run on CPU vs the recorded real peaks"))  # fmt: skip
    summary: dict[str, object] = {k: v for k, v in record.items() if k != "cases"}
    summary["cases"] = cases
    return summarised(summary, alloc_err, res_err)


def main(argv: list[str] | None = None) -> int:
    """Run the CPU part, and the GPU part when CUDA is available."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}"
    )
    parser.add_argument("--json", type=Path, help="write the GPU cases and summary here")
    parser.add_argument("--recorded", type=Path, metavar="FILE",
                        help="re-estimate the cases of a GPU part's --json FILE on CPU and "
                        "compare them with its real peaks (no GPU needed)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.recorded is not None and not args.recorded.is_file():
        parser.error(f"--recorded {args.recorded}: no such file (expected a GPU part's --json "
                     "output, e.g. tests/data/estimate_h200_call1.json)")  # fmt: skip
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; expected some of {', '.join(MODELS)}")
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: v for k, v in write_models(Path(tmp)).items() if k in chosen}
        if args.recorded is not None:
            summary = recorded_part(json.loads(args.recorded.read_text()), paths)
            if args.json is not None:
                args.json.write_text(json.dumps(summary, indent=2))
            return 0
        if not args.gpu_only:
            cpu_part(paths)
        if args.cpu_only:
            return 0
        if not torch.cuda.is_available():
            print("GPU part skipped: CUDA is not available on this machine.")
            return 0
        summary = gpu_part(paths)
        if args.json is not None:
            args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
