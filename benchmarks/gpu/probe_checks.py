"""The probe's answer against each model file's own loop, for the step patterns sessions 8-15
changed without a GPU (docs/validation.md, "Not validated"): a ``GradScaler`` fp16 step whose
Adam state is made in its optimizer step, an EMA (``AveragedModel``) made inside
``train_step``, a WGAN-GP critic stepped 5 times a generator step, a CLIP-like contrastive
step (B x B logits), ``--mode infer`` of a ``TransformerEncoder`` model, and a scoring
``eval_step`` under its own ``torch.inference_mode()`` (session 21).

    python benchmarks/gpu/probe_checks.py                 # cuda, caps of a few hundred MiB
    python benchmarks/gpu/probe_checks.py --device cpu    # the simulated device, smaller caps

For each file: ``memkit.probe`` (``probe_file``) gives B; then the file's own loop runs
``--steps`` steps at B and at B + 1, each in a fresh process under the same cap (on CUDA
``set_per_process_memory_fraction``, on CPU ``memkit.simulate``) with no memkit hooks. A line
``PROBECHECK name: probe B (trials T, OOM K, S s); loop B fits|OOM at step i, B+1 ...; exact``
says whether B fits and B + 1 runs out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

COMMON = """
import torch
from torch import nn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
"""

FILES = {
    "gradscaler": COMMON
    + """
def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                         nn.Linear(2048, 10))

def make_batch(n):
    return torch.randn(n, 512), torch.randint(0, 10, (n,))

def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-4)

scaler = torch.amp.GradScaler(DEV)

def train_step(model, batch, optimizer):
    x, y = batch
    with torch.autocast(DEV, dtype=torch.float16 if DEV == "cuda" else torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # Adam's state is made here, at the first step
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
""",
    "ema": COMMON
    + """
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
_ema = []

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 512))

def make_batch(n):
    return torch.randn(n, 512)

def train_step(model, batch, optimizer):
    if not _ema:  # made at the first step, as scripts that build it lazily do
        _ema.append(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)))
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _ema[0].update_parameters(model)
""",
    "wgan_gp": COMMON
    + """
_calls = [0]
_opt_g = []

def build_model():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    critic = nn.Sequential(nn.Linear(1024, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1))
    return nn.ModuleDict({"gen": gen, "critic": critic})

def make_batch(n):
    return torch.randn(n, 1024)

def _optimizers(model):
    if not _opt_g:
        _opt_g.append(torch.optim.Adam(model["gen"].parameters(), 1e-4, betas=(0.0, 0.9)))
        _opt_g.append(torch.optim.Adam(model["critic"].parameters(), 1e-4, betas=(0.0, 0.9)))
    return _opt_g

def train_step(model, real, optimizer):
    opt_g, opt_c = _optimizers(model)  # its own two (memkit's default AdamW goes unused)
    z = torch.randn(real.shape[0], 128, device=real.device)
    fake = model["gen"](z).detach()
    eps = torch.rand(real.shape[0], 1, device=real.device)
    mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(model["critic"](mixed).sum(), mixed, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    loss_c = model["critic"](fake).mean() - model["critic"](real).mean() + 10 * penalty
    opt_c.zero_grad(set_to_none=True)
    loss_c.backward()
    opt_c.step()
    _calls[0] += 1
    if _calls[0] % 5 == 0:  # the generator every n_critic-th call
        loss_g = -model["critic"](model["gen"](z)).mean()
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
""",
    "clip": COMMON
    + """
def build_model():
    torch.manual_seed(0)
    img = nn.Sequential(nn.Linear(768, 1024), nn.GELU(), nn.Linear(1024, 256))
    txt = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256))
    return nn.ModuleDict({"img": img, "txt": txt})

def make_batch(n):
    return torch.randn(n, 768), torch.randn(n, 512)

def train_step(model, batch, optimizer):
    img, txt = batch
    a = nn.functional.normalize(model["img"](img), dim=-1)
    b = nn.functional.normalize(model["txt"](txt), dim=-1)
    logits = a @ b.t() / 0.07  # B x B
    labels = torch.arange(img.shape[0], device=img.device)
    loss = (nn.functional.cross_entropy(logits, labels)
            + nn.functional.cross_entropy(logits.t(), labels)) / 2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
""",
    "transformer_infer": COMMON
    + """
def build_model():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 4),
                         nn.Linear(256, 1000))

def make_batch(n):
    return torch.randint(0, 1000, (n, 128))

def eval_step(model, batch):
    return model(batch).argmax(-1)
""",
    "score_inference_mode": COMMON
    + """
def build_model():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 2),
                         nn.Linear(256, 1000))

def make_batch(n):
    return torch.randint(0, 1000, (n, 128))

def eval_step(model, batch):  # scoring: each sequence's log-likelihood
    with torch.inference_mode():
        logp = model(batch[:, :-1]).log_softmax(-1)
        return logp.gather(-1, batch[:, 1:, None]).squeeze(-1).sum(-1)
""",
}

MODES = {"transformer_infer": "infer", "score_inference_mode": "infer"}
CAPS = {  # (cpu, cuda): the parameters and optimizer state, and room for some hundreds of samples
    "gradscaler": ("128MiB", "384MiB"),
    "ema": ("192MiB", "448MiB"),
    "wgan_gp": ("64MiB", "256MiB"),
    "clip": ("64MiB", "256MiB"),
    "transformer_infer": ("64MiB", "256MiB"),
    "score_inference_mode": ("64MiB", "256MiB"),
}

LOOP = """
import sys, torch, memkit
from memkit.modelfile import build_model, load_model_file, make_optimizer
path, size, steps, device, cap, mode = sys.argv[1:7]
size, steps = int(size), int(steps)
spec = load_model_file(path)
model = build_model(spec).to(device)
opt = None if mode == "infer" else make_optimizer(spec, model)[0]
step = spec.eval_step if mode == "infer" else spec.train_step
def to(b):
    return tuple(t.to(device) for t in b) if isinstance(b, tuple) else b.to(device)
def loop():
    for i in range(steps):
        batch = to(spec.make_batch(size))
        try:
            if mode == "infer":
                model.eval()
                with torch.no_grad():
                    step(model, batch)
            else:
                step(model, batch, opt)
        except torch.OutOfMemoryError:
            return f"OOM at step {i}"
    return "fits"
if device == "cuda":
    from memkit.units import parse_size
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(parse_size(cap) / total)
    print(loop())
else:
    with memkit.simulate(cap):
        print(loop())
"""


def loop_outcome(path: Path, size: int, steps: int, device: str, cap: str, mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", LOOP, str(path), str(size), str(steps), device, cap, mode],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else f"error: {done.stderr[-300:]}"


def fresh_boundary(path: Path, best: int, args: Any, cap: str, mode: str) -> str:
    """The loop at ``best - K*S .. best + K*S`` in steps of ``S`` (``--stride``), each size in
    its own process, all at once: each size, marked ``x`` where it ran out."""
    k, stride = args.around, args.stride
    sizes = [best + i * stride for i in range(-k, k + 1) if best + i * stride > 0]
    with ThreadPoolExecutor(len(sizes)) as pool:
        outcomes = dict(zip(sizes, pool.map(
            lambda n: loop_outcome(path, n, args.steps, args.device, cap, mode), sizes
        ), strict=True))  # fmt: skip
    errors = {n: o for n, o in outcomes.items() if o.startswith("error")}
    if errors:
        return f"errors: {errors}"
    return " ".join(f"{n}{'' if outcomes[n] == 'fits' else 'x'}" for n in sizes)


def main() -> int:
    from memkit.probing.runner import probe_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default=None, help="comma-separated names")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--around", type=int, default=0, metavar="K",
                        help="also run the loop at B-K..B+K (every --stride-th size), each in its "
                        "own process, all at once (a GPU has room for many capped processes): "
                        "the fresh-process boundary")  # fmt: skip
    parser.add_argument("--stride", type=int, default=1, metavar="S",
                        help="with --around: every S-th size (B-K*S..B+K*S), to find a "
                        "boundary further off")  # fmt: skip
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(FILES)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = Path(tmp) / f"{name}.py"
            path.write_text(textwrap.dedent(FILES[name]))
            mode = MODES.get(name, "train")
            cap = CAPS[name][args.device != "cpu"]
            start = time.perf_counter()
            try:
                result = probe_file(str(path), device=args.device, budget=cap, mode=mode)
            except Exception as exc:  # one broken check must not hide the others
                print(f"PROBECHECK {name}: probe failed: {type(exc).__name__}: {exc}")
                continue
            seconds = time.perf_counter() - start
            best = result.max_batch_size
            trials = result.trials
            if best is None:
                print(f"PROBECHECK {name}: batch 1 does not fit under {cap}")
                continue
            ooms = sum(not t.fits for t in trials)
            at = loop_outcome(path, best, args.steps, args.device, cap, mode)
            above = loop_outcome(path, best + 1, args.steps, args.device, cap, mode)
            exact = at == "fits" and above.startswith("OOM")
            fresh = fresh_boundary(path, best, args, cap, mode) if args.around else None
            print(f"PROBECHECK {name}: probe {best} (trials {len(trials)}, OOM {ooms}, "
                  f"{seconds:.1f} s, steps {[t.steps_run for t in trials if t.fits]}); loop "
                  f"{best} {at}, {best + 1} {above}; {'exact' if exact else 'NOT EXACT'}"
                  + ("" if fresh is None else f"; fresh processes {fresh}"))  # fmt: skip
            out[name] = {"probe": result.to_dict(), "loop_at": at, "loop_above": above,
                         "fresh": fresh}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
