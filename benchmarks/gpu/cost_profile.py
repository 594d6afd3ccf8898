"""Where the tracker's GPU-only costs go (issue 23; run 6 left two unexplained).

1. ``--micro``: ``tracker_overhead.py --micro``'s 200-module step, plain, default mode and
   steps-only, alternated. On the H200 steps-only added 1739-1850 us a step where the default
   mode added about 220 us, and on the CUDA stand-in both modes make the same Python calls and
   counter reads: so the time is GPU-side (a synchronisation, a slow driver call) or in torch's
   own paths that memkit's hooks switch on. Steps are timed whole, the device synchronised
   before and after each (``torch.cuda.synchronize``); each mode's steps then run once more
   under cProfile, and the functions with the most time of their own are printed.
2. ``--compiled``: a small GPT-like model compiled with ``torch.compile``, plain and tracked
   (``memkit.track``, default mode and steps-only), alternated, with cProfile of the tracked
   steps: nanoGPT under ``memkit run`` cost 1.13x and 1.16x (runs 5, 6; one pair each) where
   the eager loop costs about 1.03x.

    python benchmarks/gpu/cost_profile.py --micro --compiled

Prints ``COSTPROFILE`` lines (medians of alternated rounds, microseconds a step) and the top
functions of each profile. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memkit


def _timed_steps(step: Callable[[], None], n: int) -> list[float]:
    """``n`` steps' wall times in seconds, each between two device synchronisations."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _modes(model: nn.Module, optimizer: Any) -> dict[str, Callable[[], Any]]:
    return {
        "plain": contextlib.nullcontext,
        "default": lambda: memkit.track(model, optimizer, device="cuda"),
        "steps-only": lambda: memkit.track(model, optimizer, device="cuda", per_module=False),
    }


def _profile(label: str, ctx: Callable[[], Any], step: Callable[[], None], n: int) -> None:
    """``n`` steps of ``step`` under ``ctx`` and cProfile: the top functions by own time."""
    with ctx():
        for _ in range(5):
            step()
        profile = cProfile.Profile()
        torch.cuda.synchronize()
        profile.enable()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    print(f"--- profile {label}: {n} steps, top functions by own time")
    for line in out.getvalue().splitlines():
        if line.strip() and (line.lstrip()[:1].isdigit() or "ncalls" in line):
            print(line[:160])


def _compare(name: str, model: nn.Module, optimizer: Any, step: Callable[[], None]) -> None:
    """Plain, default and steps-only, alternated over 5 rounds; then a profile of each."""
    modes = _modes(model, optimizer)
    medians: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(5):
        for mode, ctx in modes.items():
            with ctx():
                for _ in range(5):
                    step()
                medians[mode].append(statistics.median(_timed_steps(step, 40)))
    plain = statistics.median(medians["plain"])
    for mode, values in medians.items():
        value = statistics.median(values)
        print(
            f"COSTPROFILE {name} {mode}: {value * 1e6:.0f} us a step "
            f"({value / plain:.3f}x plain; rounds {', '.join(f'{v * 1e6:.0f}' for v in values)})"
        )
    for mode in ("default", "steps-only"):
        _profile(f"{name} {mode}", modes[mode], step, 40)


def micro() -> None:
    """tracker_overhead.py --micro's model: 200 tiny modules, no optimizer."""
    layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.Tanh() for i in range(200)]
    model = nn.Sequential(*layers).cuda()
    x = torch.randn(4, 8).cuda().requires_grad_()  # (made on the host: the stand-in runs it too)

    def step() -> None:
        model(x).sum().backward()

    _compare("micro", model, None, step)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def compiled() -> None:
    """A 6-block model of nanoGPT's shakespeare_char size, compiled, bf16 autocast, AdamW."""
    torch.manual_seed(0)
    dim, vocab = 384, 65
    model = nn.Sequential(
        nn.Embedding(vocab, dim), *[_Block(dim) for _ in range(6)], nn.Linear(dim, vocab)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled_model = torch.compile(model)
    ids = torch.randint(0, vocab, (64, 256)).cuda()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled_model(ids)
            loss = nn.functional.cross_entropy(logits.view(-1, vocab), ids.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compile outside the measured rounds
        step()
    _compare("compiled", compiled_model, optimizer, step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.micro:
        micro()
    if args.compiled:
        compiled()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
