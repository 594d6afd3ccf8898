"""GPU checks of tracker paths changed since the last GPU run (docs/validation.md, sessions 9-15),
each against an independent count. Lines start with ``CHECK`` so a session log can be grepped.

    python benchmarks/gpu/session_checks.py            # needs CUDA

- ``gan``: a two-optimizer GAN (Adam for G, SGD+momentum for D) under ``memkit.track``; the
  report's gradients and optimizer state at the peak against the parameters' and states' bytes.
- ``buckets``: a transformers GPT-2 (2 layers, width 128) trained on length-sorted buckets
  (32, 64, 128 tokens); changing batch shapes are no leak, so no leak may be reported.
- ``leak``: the same model keeping every step's logits in a list (16 x length x 1000 floats a
  step): a leak of that rate must be reported.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import memkit

DEV = "cuda" if torch.cuda.is_available() or "--cpu" not in sys.argv else "cpu"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        nbytes([v])
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.device.type == DEV
    )


def breakdown_line(report) -> str:
    b = report.devices[0].breakdown
    if b is None:
        return "(none)"
    names = (
        "total",
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "other",
        "phase",
        "module",
    )
    return " ".join(f"{k}={getattr(b, k)}" for k in names) + f" gradient_models={b.gradient_models}"


def gan() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 4096)).to(DEV)
    disc = nn.Sequential(nn.Linear(4096, 4096), nn.LeakyReLU(0.2), nn.Linear(4096, 1)).to(DEV)
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4)
    opt_d = torch.optim.SGD(disc.parameters(), 1e-2, momentum=0.9)
    bce = nn.functional.binary_cross_entropy_with_logits
    with memkit.track(device=DEV, optimizer=[opt_g, opt_d], module_every=1) as tracker:
        for _ in range(3):
            x, z = torch.randn(512, 4096, device=DEV), torch.randn(512, 256, device=DEV)
            fake = gen(z)
            g_loss = bce(disc(fake), torch.ones(512, 1, device=DEV))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            real, faked = disc(x), disc(fake.detach())
            d_loss = (bce(real, torch.ones_like(real)) + bce(faked, torch.zeros_like(faked))) / 2
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
    report = tracker.report()
    g_p, d_p = nbytes(gen.parameters()), nbytes(disc.parameters())
    print(
        f"CHECK gan: hand params G {g_p} D {d_p} total {g_p + d_p}; "
        f"state G {state_bytes(opt_g)} D {state_bytes(opt_d)}"
    )
    if DEV == "cuda":
        print(f"CHECK gan: max_memory_allocated {torch.cuda.max_memory_allocated()}")
    print(
        f"CHECK gan: report peak {report.devices[0].peak_allocated} "
        f"breakdown {breakdown_line(report)}"
    )
    print(str(report)[:3000])


def gpt2(keep_losses: bool) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        vocab_size=1000,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    kept = []
    with memkit.track(model, opt, device=DEV) as tracker:
        for length in (32, 32, 32, 32, 64, 64, 64, 64, 128, 128, 128, 128):
            ids = torch.randint(0, 1000, (16, length), device=DEV)
            out = model(ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            if keep_losses:
                kept.append(out.logits)
    report = tracker.report()
    name = "leak" if keep_losses else "buckets"
    print(f"CHECK {name}: leaks {[str(f)[:200] for f in report.leaks]}")
    print(f"CHECK {name}: advice {[a.code for a in report.advice]}")


def main() -> int:
    if DEV == "cuda" and not torch.cuda.is_available():
        print("CHECK skipped: no CUDA (--cpu runs it on the CPU, untracked by CUDA counters)")
        return 0
    for check in (gan, lambda: gpt2(False), lambda: gpt2(True)):
        try:
            check()
        except Exception as e:  # a check that breaks must not hide the others
            print(f"CHECK error: {type(e).__name__}: {e}")
        if DEV == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
