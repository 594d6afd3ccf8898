"""The advice's claimed savings against what applying the advice saves, on a GPU.

    python benchmarks/gpu/advice_checks.py [--cpu]            # every check (on a GPU all at once)
    python benchmarks/gpu/advice_checks.py CHECK VARIANT [--cpu]

Each check runs three fresh processes: ``track`` (under memkit, printing the advice's code and
claimed saving), ``plain`` (no memkit: the script's peak) and ``fixed`` (the advice applied, no
memkit). The measured saving is plain's peak minus fixed's: ``torch.cuda.max_memory_allocated()``
on a GPU, the simulated device's peak with ``--cpu``. Lines start with ``ADVICECHECK``; each
tracked report is written to ``$OUT/advice-CHECK.txt`` (``OUT`` unset: the current folder).

- ``gan``: Lightning, manual optimization, ``toggle_optimizer`` and ``zero_grad()`` right before
  each backward: the generator's step holds the discriminator's gradients
  (``zero-grad-keeps-grads``; fixed: ``zero_grad(set_to_none=True)`` after each step).
- ``dpo``: a DPO loop whose reference's log-probs are precomputed with grad on (its
  ``requires_grad_(False)`` forgotten) and kept for training (``eval-grad-enabled``; fixed: the
  precompute under ``no_grad``).
- ``mp_gpt2``, ``mp_encoder``, ``mp_lstm``: float32 training of a transformers GPT-2, an
  ``nn.TransformerEncoder`` and an LSTM tagger (``mixed-precision``; fixed:
  ``torch.autocast(device, torch.bfloat16)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import memkit

CPU = "--cpu" in sys.argv
DEV = "cpu" if CPU else "cuda"
BUDGET = {"budget": "2GiB"}  # above each peak; advice prices what matters against a capacity
CODES = {
    "gan": "zero-grad-keeps-grads",
    "dpo": "eval-grad-enabled",
    "mp_gpt2": "mixed-precision",
    "mp_encoder": "mixed-precision",
    "mp_lstm": "mixed-precision",
}


def gan(variant: str) -> dict:
    import lightning.pytorch as pl  # only this check needs Lightning
    from torch.utils.data import DataLoader, TensorDataset

    from memkit.integrations.lightning import MemkitCallback

    fixed, z_dim = variant == "fixed", 128

    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(
                nn.Linear(z_dim, 1024), nn.ReLU(), nn.Linear(1024, 2048), nn.ReLU(),
                nn.Linear(2048, 3072), nn.Tanh(),
            )  # fmt: skip
            self.discriminator = nn.Sequential(
                nn.Linear(3072, 2048), nn.LeakyReLU(0.2), nn.Linear(2048, 1024),
                nn.LeakyReLU(0.2), nn.Linear(1024, 1),
            )  # fmt: skip

        def training_step(self, batch, _):
            imgs = batch[0]
            opt_g, opt_d = self.optimizers()
            bce = F.binary_cross_entropy_with_logits
            ones = torch.ones(imgs.size(0), 1, device=self.device)
            self.toggle_optimizer(opt_g)
            fake = self.generator(torch.randn(imgs.size(0), z_dim, device=self.device))
            g_loss = bce(self.discriminator(fake), ones)
            if not fixed:
                opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            if fixed:
                opt_g.zero_grad(set_to_none=True)
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            real = bce(self.discriminator(imgs), ones)
            faked = bce(self.discriminator(fake.detach()), torch.zeros_like(ones))
            if not fixed:
                opt_d.zero_grad()
            self.manual_backward((real + faked) / 2)
            opt_d.step()
            if fixed:
                opt_d.zero_grad(set_to_none=True)
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self):
            adam = torch.optim.Adam
            return [
                adam(self.generator.parameters(), 2e-4, betas=(0.5, 0.999)),
                adam(self.discriminator.parameters(), 2e-4, betas=(0.5, 0.999)),
            ]

    callbacks = [MemkitCallback(device=DEV, **BUDGET)] if variant == "track" else []
    trainer = pl.Trainer(
        max_steps=8, callbacks=callbacks, accelerator="cpu" if CPU else "gpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(512, 3072)), batch_size=128)
    with measured(variant) as peak:
        trainer.fit(GAN(), data)
    return result(callbacks[0].report if callbacks else None, peak)


def dpo(variant: str) -> dict:
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=2048, n_positions=64, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(cfg).to(DEV).train()
    ref = copy.deepcopy(policy).eval()  # requires_grad_(False) forgotten
    opt = torch.optim.AdamW(policy.parameters(), 5e-5)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, 2048, (16, 48), generator=g).to(DEV) for _ in range(8)]

    def logps(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(2).sum(-1)

    track = memkit.track(optimizer=opt, device=DEV, **BUDGET)  # every model: the reference's too
    block = track if variant == "track" else None
    with measured(variant) as peak, block or contextlib.nullcontext():
        with torch.no_grad() if variant == "fixed" else contextlib.nullcontext():
            ref_cache = [logps(ref, ids) for ids in batches]
        for ids, ref_logps in zip(batches, ref_cache, strict=True):
            pol = logps(policy, ids)
            margin = (pol[:8] - ref_logps[:8]) - (pol[8:] - ref_logps[8:])
            loss = -F.logsigmoid(0.1 * margin).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return result(block.report() if block else None, peak)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 4096)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 256)
        self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(1024, 4096)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def mixed_precision(build, variant: str) -> dict:
    torch.manual_seed(0)
    model = build().to(DEV).train()
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (32, 128), generator=g).to(DEV) for _ in range(6)]
    amp = torch.autocast(DEV, torch.bfloat16, enabled=variant == "fixed")
    block = memkit.track(model, opt, device=DEV, **BUDGET) if variant == "track" else None
    with measured(variant) as peak, block or contextlib.nullcontext():
        for ids in batches:
            with amp:
                out = model(ids)
                logits = out.logits if hasattr(out, "logits") else out
                loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return result(block.report() if block else None, peak)


def gpt2_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=4096, n_positions=128, n_embd=256, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


CHECKS = {
    "gan": gan,
    "dpo": dpo,
    "mp_gpt2": lambda v: mixed_precision(gpt2_model, v),
    "mp_encoder": lambda v: mixed_precision(Encoder, v),
    "mp_lstm": lambda v: mixed_precision(Tagger, v),
}


@contextlib.contextmanager
def measured(variant: str):
    """The block's peak: the CUDA allocator's, or the simulated device's with --cpu (where
    memkit's own tracking brings the simulated device for the tracked variant)."""
    peak = [0]
    if CPU and variant == "track":
        yield peak
    elif CPU:
        with memkit.simulate(BUDGET["budget"]) as device:
            yield peak
        peak[0] = device.peak
    else:
        torch.cuda.reset_peak_memory_stats()
        yield peak
        peak[0] = torch.cuda.max_memory_allocated()


def result(report, peak: list[int]) -> dict:
    out = {"peak": peak[0]}
    if report is not None:
        out["advice"] = [(a.code, a.saving_bytes, a.title) for a in report.advice]
        out["report"] = str(report)
    return out


def one(check: str, variant: str) -> dict:
    cmd = [sys.executable, __file__, check, variant] + (["--cpu"] if CPU else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-3:]}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    if not CPU and not torch.cuda.is_available():
        print("ADVICECHECK skipped: no CUDA (--cpu runs them on the simulated device)")
        return 0
    if args:
        print("RESULT " + json.dumps(CHECKS[args[0]](args[1])))
        return 0
    jobs = [(c, v) for c in CHECKS for v in ("track", "plain", "fixed")]
    with ThreadPoolExecutor(len(jobs) if not CPU else 2) as pool:
        results = dict(zip(jobs, pool.map(lambda job: one(*job), jobs), strict=True))
    out = Path(os.environ.get("OUT", "."))
    for check, code in CODES.items():
        track, plain, fixed = (results[check, v] for v in ("track", "plain", "fixed"))
        if "report" in track:
            (out / f"advice-{check}.txt").write_text(track["report"])
        errors = [r["error"] for r in (track, plain, fixed) if "error" in r]
        if errors:
            print(f"ADVICECHECK {check}: error {errors}")
            continue
        claims = [a for a in track["advice"] if a[0] == code]
        claimed = claims[0][1] if claims else None
        saved = plain["peak"] - fixed["peak"]
        ratio = f"{claimed / saved:.2f}" if claimed and saved > 0 else "-"
        print(
            f"ADVICECHECK {check}: {code} claimed {claimed} B, saved {saved} B "
            f"(plain {plain['peak']}, fixed {fixed['peak']}, tracked {track['peak']}), "
            f"claim/saved {ratio}; advice {[a[0] for a in track['advice']]}"
        )
        if claims:
            print(f"ADVICECHECK {check}: title: {claims[0][2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
