"""Advice rules (issue #5): each fires on a reproduced scenario and stays silent when healthy.

Real models on the simulated device wherever the evidence can be produced on a CPU; the CUDA
caching allocator's readings (fragmentation, other processes, empty_cache) and DataParallel's
per-device peaks are constructed numbers (DataParallel needs several GPUs).
"""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from gan_cases import two_step_gan
from torch import nn
from torch.nn import functional as F

import memkit
from memkit import advice as A
from memkit.advice.accumulation import exact_split, plan_accumulation
from memkit.advice.leaks import graph_retained_advice
from memkit.advice.probe import accumulation_advice
from memkit.advice.track import eval_peak, measured_advice, track_advice
from memkit.oom import parse_oom_message
from memkit.render.advice import advice_html, advice_text
from memkit.tracking import track
from memkit.tracking.report import (
    Breakdown,
    DeviceReport,
    LeakFinding,
    LeakSuspect,
    StepRecord,
    TrackReport,
    TrainingSetup,
)
from memkit.units import format_size

MiB = 1024**2
GiB = 1024**3


def codes(advice) -> list[str]:
    return [a.code for a in advice]


def run_steps(model, opt, batch, steps=3, *, budget="256MiB", zero="before", autocast=False):
    """A training loop on the simulated cpu device; returns the track report."""
    with track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker:
        for _ in range(steps):
            if zero == "before":
                opt.zero_grad()
            elif zero == "keep":
                opt.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(batch).float().pow(2).mean()
            loss.backward()
            opt.step()
    return tracker.report()


def blocks(n: int, width: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)))


def mlp_blocks(n: int, width: int) -> nn.Module:
    """Transformer-style MLP blocks: each keeps 4x its output inside (what checkpointing saves)."""
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(n)
        )
    )


# -- rules fed by the tracker (real models) ---------------------------------------------------


def test_zero_grad_set_to_none_false_fires_and_default_is_silent():
    """``zero_grad(set_to_none=False)``: the gradients stay allocated into backward, which
    adds into them, so the backward peak holds them all. The advice claimed no saving where
    the peak came in backward; applied, the peak falls by 279,552 B here. The saving is a
    bound (backward's peak holds some gradients either way): within 5% of what applying it
    measures."""
    model = blocks(2, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = run_steps(model, opt, torch.randn(8, 256), zero="keep")
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    assert report.steps_with_grads_at_forward == 2  # steps 1 and 2
    assert report.steps_with_grads_into_backward == 2
    grads = sum(p.numel() * 4 for p in model.parameters())
    bd = report.devices[0].breakdown
    assert bd is not None and bd.phase == "backward"
    fresh = blocks(2, 256)
    healthy = run_steps(fresh, torch.optim.SGD(fresh.parameters(), lr=0.01), torch.randn(8, 256))
    assert healthy.steps_with_grads_at_forward == 0
    assert "zero-grad-keeps-grads" not in codes(healthy.advice)
    measured = report.devices[0].peak_allocated - healthy.devices[0].peak_allocated
    assert adv.saving_bytes is not None and measured <= adv.saving_bytes <= 1.05 * measured
    assert format_size(grads) in adv.title and "began with them still allocated" in adv.evidence
    assert "set_to_none=True" in adv.action


def test_zero_grad_between_forward_and_backward_claims_what_the_forward_alone_holds():
    """``zero_grad()`` between forward and backward frees the gradients before backward: its
    peak does not hold them, so moving the call before the forward lowers the peak only down
    to backward's, as applying it measures."""

    def peak_and_advice(late: bool) -> tuple[int, list]:
        torch.manual_seed(0)
        model = blocks(2, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with track(model, opt, device="cpu", budget="256MiB", postmortem=None) as tracker:
            for _ in range(3):
                if not late:
                    opt.zero_grad()
                loss = model(torch.randn(8, 256)).pow(2).mean()
                if late:
                    opt.zero_grad()
                loss.backward()
                opt.step()
        report = tracker.report()
        assert report.steps_with_grads_into_backward == 0
        found = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
        return report.devices[0].peak_allocated, found

    peak, (adv,) = peak_and_advice(late=True)
    fixed_peak, none = peak_and_advice(late=False)
    assert not none and adv.saving_bytes == peak - fixed_peak > 0
    assert "but the peak only by" in adv.evidence


def test_zero_grad_saving_compares_steps_net_of_a_list_that_grows():
    """Sweep BG: a loop keeping every step's softmax on the device, ``zero_grad()`` between
    forward and backward. The earlier steps' forwards peaked lower for what the list held
    then, were taken for steps that began without the gradients, and all 2.46 MiB of them was
    promised; moving the call before the forward lowers the peak to the last step's backward.
    (Freed right after the step, they lower what the loop keeps after it as well.)"""

    def run(late: bool) -> tuple[int, list]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1000))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        kept = []
        with track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
            for _ in range(10):
                x, y = torch.randn(128, 256), torch.randint(0, 1000, (128,))
                if not late:
                    opt.zero_grad()
                out = model(x)
                loss = nn.functional.cross_entropy(out, y)
                if late:
                    opt.zero_grad()
                loss.backward()
                opt.step()
                kept.append(out.detach().softmax(1))
        report = tracker.report()
        assert report.devices[0].leak is not None
        found = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
        return report.devices[0].peak_allocated, found

    peak, (adv,) = run(late=True)
    fixed_peak, none = run(late=False)
    measured = peak - fixed_peak  # 255 KiB: the last step's forward down to its backward
    assert not none and adv.saving_bytes is not None
    assert measured <= adv.saving_bytes <= 1.02 * measured
    assert "but the peak only by" in adv.evidence


def test_zero_grad_advice_quotes_the_gradients_alive_when_the_forward_began():
    """A DCGAN loop: the generator's step runs ``netD(fake)`` right after
    ``optimizerD.step()``, with the discriminator's gradients still allocated and the
    generator's just zeroed. The advice quoted the breakdown's gradients (both models',
    alive only mid-step: 395.62 KiB on the sweep's DCGAN) instead of what the forward began
    with (the discriminator's: 167.75 KiB there)."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(16, 64), nn.Linear(64, 1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(4):
            fake = gen(torch.randn(32, 16))
            disc.zero_grad()
            disc(fake.detach()).mean().backward()
            opt_d.step()
            gen.zero_grad()
            disc(fake).mean().backward()  # begins with the discriminator's gradients
            opt_g.step()
    report = tracker.report()
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    disc_grads = (64 + 1) * 4
    assert report.grads_at_forward_bytes == disc_grads
    assert f"with the {format_size(disc_grads)} of gradients" in adv.evidence


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(196, 64), nn.LeakyReLU(0.2, True), nn.Linear(64, 32), nn.LeakyReLU(0.2, True),
            nn.Linear(32, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(16, 32), nn.LeakyReLU(0.2, True), nn.Linear(32, 64), nn.BatchNorm1d(64),
            nn.LeakyReLU(0.2, True), nn.Linear(64, 196), nn.Tanh(),
        )  # fmt: skip

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z)


def wgan_gp(free_after_step: bool, budget: str | None) -> Any:
    """Four critic iterations of a WGAN-GP (eriklindernoren's loop), the generator stepped
    in every second; its optimizer's ``zero_grad`` comes after the next critic step, so its
    gradients live through that iteration (``free_after_step``: zeroed right after its
    step). The track report, or untracked (``budget=None``) the simulated device's peak."""
    torch.manual_seed(0)
    gen, critic = Generator(), Critic()
    opt_g, opt_c = torch.optim.Adam(gen.parameters()), torch.optim.Adam(critic.parameters())

    def loop() -> None:
        for i in range(4):
            real, z = torch.randn(128, 196), torch.randn(128, 16)
            opt_c.zero_grad()
            fake = gen(z)
            critic_loss = critic(fake).mean() - critic(real).mean()
            alpha = torch.rand(128, 1)
            mid = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
            out = critic(mid)
            (grad,) = torch.autograd.grad(out, mid, torch.ones_like(out), create_graph=True)
            (critic_loss + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()).backward()
            opt_c.step()
            opt_g.zero_grad()
            if i % 2 == 0:
                (-critic(gen(z)).mean()).backward()
                opt_g.step()
                if free_after_step:
                    opt_g.zero_grad(set_to_none=True)

    if budget is None:
        with memkit.simulate("1GiB", device="cpu") as sim:
            loop()
        return sim.peak
    with track(device="cpu", budget=budget, postmortem=None) as tracker:
        loop()
    return tracker.report()


def test_zero_grad_advice_names_the_gradients_alive_at_the_peak():
    """Sweep FF's WGAN-GP: the advice quoted the critic's gradients, which the generator's
    forward begins with, and promised 16.57 KiB (freeing them saves nothing); the
    generator's, kept through the next critic iteration, were at the peak (its forward) and
    in that iteration's backward, and freeing them after its step lowers the peak by all of
    them. Fixed, the peak's forward holds none: no saving is claimed."""
    report = wgan_gp(False, "4MiB")
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    gen_grads = sum(p.numel() * 4 for p in Generator().parameters())
    measured = wgan_gp(False, None) - wgan_gp(True, None)
    assert measured == gen_grads
    assert adv.saving_bytes == measured
    assert adv.title.startswith(f"`Generator`'s {format_size(gen_grads)} of gradients")
    assert "on the optimizer that steps `Generator`, right after its `step()`" in adv.action
    fixed = wgan_gp(True, "4MiB")
    (adv,) = [a for a in fixed.advice if a.code == "zero-grad-keeps-grads"]
    assert adv.saving_bytes is None and "held none" in adv.evidence


def test_zero_grad_advice_under_accumulation_says_only_the_first_forward_falls():
    """Sweep UU: with accumulate_grad_batches=4 the advice said freeing the gradients before
    the forward lowers the forward's memory; micro-batches 2-4 run theirs with the
    accumulated gradients anyway (the forward peak stayed at 1,543,132 B when applied)."""
    kw = {"steps_with_grads": 3, "gradient_bytes": 1 << 20, "peak_phase": "optimizer"}
    plain = A.zero_grad_keeps_grads(**kw)
    accumulating = A.zero_grad_keeps_grads(**kw, micro_batches=4)
    assert plain is not None and accumulating is not None
    assert plain.saving_bytes is None and accumulating.saving_bytes is None
    assert "lowers the forward's memory" in plain.evidence
    assert "lowers the forward's memory" not in accumulating.evidence
    assert "with 4 micro-batches a step" in accumulating.evidence


def test_zero_grad_saving_counts_the_partial_last_steps_phases_that_hold_them():
    """Sweep KK: the peak, D's loss in the partial step after the last boundary, held G's and
    D's gradients; D's backward and step after it hold G's (never zeroed before G's next
    step). The advice said 40.75 KiB (G's only) and a saving of 260 B (the partial step's
    backward peak counted as not holding them); freeing both after G's step lowers the peak by
    7,948 B, as the fixed script's simulated peak reads."""
    report = two_step_gan(False)[0]
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    grads = 41_728 + 33_796  # both models' float32 parameters, by hand
    assert adv.title.endswith(
        f"{format_size(grads)} of gradients stay allocated through the forward"
    )
    measured = report.devices[0].peak_allocated - two_step_gan(True)[0].devices[0].peak_allocated
    assert adv.saving_bytes == measured


def test_zero_grad_saving_counts_the_phases_that_hold_the_gradients_too():
    """Sweep FF's WGAN-GP at batch 361 (its report's numbers): the generator's gradients live
    through the critic iteration after its step, its forward (the peak) and its backward
    alike, which peaks 16.57 KiB below. That was the saving promised; freeing them after the
    generator's step lowered the peak by all 950.56 KiB, as the iterations that began without
    them show (every phase 973,376 B lower)."""
    gen_grads, critic_grads = 973_376, 935_940

    def step(i: int, held: bool) -> StepRecord:
        extra = gen_grads if held else 0
        peaks = {
            "forward": 15_786_692 + extra,
            "backward": 15_769_729 + extra,
            "optimizer": 13_868_708 + (1024 if held else 0),
            "other": 12_263_076,
        }
        return StepRecord(i, 12_263_076, 12_263_076, 15_786_692 + extra, 0, peaks, 0.1)

    steps = [step(i, i in (1, 6)) for i in range(1, 11)]
    peak = 15_786_692 + gen_grads
    bd = Breakdown(peak, 1_911_372, gen_grads, 3_818_688, 6_565_028, 3_491_604, 1, "forward",
                   None, gradient_models=(("Generator", gen_grads),))  # fmt: skip
    phases = {"forward": peak, "backward": 15_769_729 + gen_grads, "optimizer": 13_869_732}
    dev = DeviceReport("cpu", "cpu", "sim", 16 * MiB, 0, 0, peak, peak, phases,
                       steps=tuple(steps), breakdown=bd)  # fmt: skip
    report = TrackReport(
        devices=(dev,), steps=11, mode="per-module", duration_s=1.0,
        steps_with_grads_at_forward=3, grads_at_forward_bytes=critic_grads,
    )  # fmt: skip
    (adv,) = [a for a in measured_advice(report) if a.code == "zero-grad-keeps-grads"]
    assert adv.saving_bytes == gen_grads and "hold them too" in adv.evidence
    # sweep CL: the critic's own zero_grad stays before its backward (the generator's loss
    # backward fills the critic's gradients): the action frees the generator's only
    assert "keep zeroing those right before their own backward" in adv.action
    assert f"with the {format_size(critic_grads)} of gradients" in adv.evidence
    # where every iteration keeps them (no step began without them), the backward that
    # peaks below is taken not to hold them, as before
    always = [step(i, True) for i in range(1, 11)]
    dev = dataclasses.replace(dev, steps=tuple(always))
    (adv,) = [a for a in measured_advice(dataclasses.replace(report, devices=(dev,)))
              if a.code == "zero-grad-keeps-grads"]  # fmt: skip
    assert adv.saving_bytes == 15_786_692 - 15_769_729


def test_optimizer_state_fires_for_adam_on_a_large_model_and_not_for_sgd():
    model = blocks(4, 1024)  # 16 MiB of weights; Adam adds 32 MiB of moments
    x = torch.randn(4, 1024)
    report = run_steps(model, torch.optim.Adam(model.parameters(), foreach=True), x, budget="96MiB")
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    assert "Adam" in adv.evidence and "2.0x" in adv.evidence
    assert "ZeroRedundancyOptimizer" in adv.action and "8-bit Adam" in adv.action
    assert "foreach=False" in adv.action  # the step's temporaries were measured
    assert adv.saving_bytes == pytest.approx(16 * MiB, rel=0.05)
    # torch's default on cpu parameters is the single-tensor step already (sweep C: the
    # advice proposed foreach=False there, which would change nothing)
    single = blocks(4, 1024)
    report = run_steps(single, torch.optim.Adam(single.parameters()), x, budget="96MiB")
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    assert "foreach=False" not in adv.action and "8-bit Adam" in adv.action
    sgd = run_steps(blocks(4, 1024), torch.optim.SGD(model.parameters(), lr=0.1), x, budget="96MiB")
    assert "optimizer-state" not in codes(sgd.advice)


_SPARSE_CAPABLE = {  # how each option the advice may name is built, to run it on sparse grads
    "SGD with momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "Adagrad": lambda params: torch.optim.Adagrad(params),
}


def test_optimizer_state_for_sparse_embeddings_offers_only_what_takes_sparse_gradients():
    """Sweep F: SparseAdam's advice opened with `SparseAdam(..., foreach=False)` (a TypeError:
    it has no such option) and offered Adafactor and 8-bit Adam (neither takes sparse
    gradients) and FSDP."""
    emb = nn.EmbeddingBag(20_000, 128, mode="sum", sparse=True)  # 10 MiB; SparseAdam adds 20
    opt = torch.optim.SparseAdam(emb.parameters())
    idx = torch.randint(0, 20_000, (64, 8))
    report = run_steps(emb, opt, idx, budget="40MiB")
    (adv,) = [a for a in report.advice if a.code == "optimizer-state"]
    assert "SparseAdam" in adv.evidence
    for absent in ("foreach", "Adafactor", "8-bit Adam", "or FSDP"):
        assert absent not in adv.action
    assert "ZeroRedundancyOptimizer" in adv.action
    offered = [name for name in _SPARSE_CAPABLE if name in adv.action]
    assert offered == [o.name for o in A.training.lighter_optimizers(sparse=True)]
    assert "SGD with momentum" not in adv.action  # (sweep VV, below)
    for name in _SPARSE_CAPABLE:  # each one offered steps on these sparse gradients, and its
        # state stays the size of its first step's: SGD's sparse momentum buffer appends every
        # step's rows uncoalesced (sweep VV: 13.38 MiB after 3 steps, 75.46 after 120)
        other = _SPARSE_CAPABLE[name](list(emb.parameters()))
        sizes = []
        for _ in range(3):  # (a new batch of ids each step)
            emb(torch.randint(0, 20_000, (64, 8))).sum().backward()
            other.step()
            other.zero_grad()
            sizes.append(sum(t.nbytes for s in other.state.values() for t in s.values()
                             if isinstance(t, torch.Tensor) and not t.is_sparse)
                         + sum(t._values().nbytes + t._indices().nbytes
                               for s in other.state.values() for t in s.values()
                               if isinstance(t, torch.Tensor) and t.is_sparse))  # fmt: skip
        assert (sizes[0] == sizes[-1]) == (name in offered), (name, sizes)
    # dense gradients, same optimizer family: the dense options, foreach only where set
    model = blocks(2, 512)
    dense = run_steps(
        model,
        torch.optim.Adam(model.parameters(), foreach=True),
        torch.randn(4, 512),
        budget="16MiB",
    )
    (adv,) = [a for a in dense.advice if a.code == "optimizer-state"]
    assert (
        "Adafactor" in adv.action and "foreach=False" in adv.action and "Adagrad" not in adv.action
    )


def test_oom_optimizer_state_names_what_takes_sparse_gradients():
    setup = TrainingSetup(optimizer="SparseAdam", sparse_gradients=True)
    bd = Breakdown(100, 30, 0, 60, 10, 0, 1, "optimizer", None)
    share = {"optimizer state": 0.6}

    def pm(setup: Any) -> Any:  # what the rule reads of a post-mortem
        return SimpleNamespace(setup=setup, optimizer_state_partial=False)

    sparse = A.oom.oom_optimizer_state(bd, share, pm(setup))
    assert "Adagrad" in sparse.action and "Adafactor" not in sparse.action
    assert "8-bit" not in sparse.action and "or FSDP" not in sparse.action
    dense = A.oom.oom_optimizer_state(bd, share, pm(None))
    assert "Adafactor" in dense.action and "FSDP" in dense.action and "Adagrad" not in dense.action
    # FSDP2 shards it already (sweep CC: told to shard it with FSDP)
    fsdp = A.oom.oom_optimizer_state(bd, share, pm(TrainingSetup(optimizer="AdamW",
                                                                  sharding=(2, None))))  # fmt: skip
    assert "it is FSDP2's 1/2 shard already, and 4 ranks halve it again" in fsdp.action
    assert "ZeroRedundancyOptimizer" not in fsdp.action
    # the precision remedy a post-mortem offers: FSDP2's policy, none under a bf16 one (CD)

    def precision(sharding: Any) -> str:
        setup = TrainingSetup(param_dtype="float32", sharding=sharding)
        return A.oom._precision_option(SimpleNamespace(setup=setup, autocast_forwards=0,
                                                       breakdown=None))  # fmt: skip

    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in precision((2, None))
    assert precision((2, "bfloat16")) == "" and "autocast" in precision(None)


def test_activation_checkpointing_names_the_blocks_and_stays_silent_without_pressure():
    x = torch.randn(512, 128)  # each block keeps 2.25 MiB: 4x 1 MiB inside, 0.25 MiB out
    model = mlp_blocks(8, 128)
    report = run_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), x, 2, budget="40MiB")
    (adv,) = [a for a in report.advice if a.code == "activation-checkpointing"]
    assert "8 blocks" in adv.title and "torch.utils.checkpoint" in adv.action
    # 8 x 2.25 MiB kept - 8 x 0.25 MiB outputs (each block's last Linear) - one block's
    # recompute (2 MiB), at most the activations at the peak less the outputs and a recompute
    # (checked against checkpointing applied in test_advice_training)
    assert "their outputs (kept when checkpointed) are about 2.00 MiB" in adv.evidence
    assert 11 * MiB <= adv.saving_bytes <= 14 * MiB
    # where the trainer's settings say checkpointing is on (a framework callback told the
    # tracker), the rule stays silent: the same measurements, that one fact changed
    dev = report.devices[0]
    assert dev.setup is not None and dev.setup.checkpointing is None
    told = dataclasses.replace(dev, setup=dataclasses.replace(dev.setup, checkpointing=True))
    assert "activation-checkpointing" not in codes(
        track_advice(dataclasses.replace(report, devices=(told,)))
    )
    roomy = mlp_blocks(8, 128)
    big = run_steps(roomy, torch.optim.SGD(roomy.parameters(), lr=0.01), x, 2, budget="1GiB")
    assert "activation-checkpointing" not in codes(big.advice)
    # Linear+ReLU blocks keep only their output: checkpointing them would save nothing
    flat = blocks(8, 256)
    rep = run_steps(
        flat, torch.optim.SGD(flat.parameters(), lr=0.01), torch.randn(1024, 256), 2, budget="20MiB"
    )
    assert "activation-checkpointing" not in codes(rep.advice)


def test_mixed_precision_fires_for_fp32_and_not_under_autocast():
    model = blocks(3, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(512, 256)
    report = run_steps(model, opt, x, steps=2, budget="8MiB")
    assert report.param_dtype == "float32" and report.autocast_forwards == 0
    (adv,) = [a for a in report.advice if a.code == "mixed-precision"]
    assert "torch.autocast" in adv.action and adv.saving_bytes and adv.saving_bytes > 0
    # the same saving on a device 128x larger is under 5% of it and the peak far from full:
    # memory is no problem there, so no advice (issue #25)
    assert adv.saving_bytes < A.MATERIAL * GiB
    roomy = run_steps(blocks(3, 256), opt, x, steps=2, budget="1GiB")
    assert roomy.param_dtype == "float32" and "mixed-precision" not in codes(roomy.advice)
    amp = run_steps(blocks(3, 256), opt, x, steps=2, autocast=True, budget="8MiB")
    assert amp.autocast_forwards == 2 and "mixed-precision" not in codes(amp.advice)
    bf16 = blocks(3, 256).to(torch.bfloat16)
    low = run_steps(bf16, torch.optim.SGD(bf16.parameters(), lr=0.01), x.bfloat16(), steps=2,
                    budget="8MiB")  # fmt: skip
    assert low.param_dtype == "bfloat16" and "mixed-precision" not in codes(low.advice)
    # under FSDP2 (sweep CC): its MixedPrecisionPolicy is the switch to name, and where the
    # policy computes in bf16 already, no autocast is advised (promised 205 KiB, saved 0 B)
    dev = report.devices[0]
    assert dev.setup is not None

    def sharded(half: str | None) -> list[str]:
        setup = dataclasses.replace(dev.setup, sharding=(2, half))
        fsdp = dataclasses.replace(report, devices=(dataclasses.replace(dev, setup=setup),))
        return [a.action for a in track_advice(fsdp) if a.code == "mixed-precision"]

    (policy,) = sharded(None)
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in policy
    assert sharded("bfloat16") == []


def test_eval_grad_enabled_claims_what_the_graph_keeps_and_only_where_evaluation_peaks():
    """The bytes an evaluation forward left allocated include its output, which no_grad
    keeps too (sweep QQ: 2.01 MiB claimed, 1.50 saved); where training sets the device's
    peak, no_grad does not lower it, and no saving is claimed."""
    torch.manual_seed(0)
    model = blocks(2, 128)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 128)

    def advice(eval_batch: int):
        with track(model, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(2):
                model.train()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                model.eval()
                out = model(torch.randn(eval_batch, 128))  # no no_grad: a graph kept
                del out
        (found,) = [a for a in tracker.report().advice if a.code == "eval-grad-enabled"]
        return found

    # kept for backward: each ReLU's output (ReLU saves it, the next Linear its input: the
    # same tensor); the last one's is the forward's output, which no_grad keeps as well
    big = advice(512)
    assert big.saving_bytes == 512 * 128 * 4
    small = advice(8)
    assert small.saving_bytes is None and "Training sets the peak" in small.evidence


def test_eval_grad_enabled_fires_without_no_grad_and_not_with_it():
    model = blocks(2, 128).eval()
    with track(model, device="cpu", budget="64MiB") as tracker:
        model(torch.randn(64, 128))
    assert codes(tracker.report().advice) == ["eval-grad-enabled"]
    with track(model, device="cpu", budget="64MiB") as tracker, torch.no_grad():
        model(torch.randn(64, 128))
    assert tracker.report().advice == ()


# -- DataParallel (constructed per-device peaks; a stand-in for device_ids) -------------------


def test_dp_to_ddp_estimates_the_rank_peak():
    peaks = {"cuda:0": 30 * GiB, "cuda:1": 12 * GiB, "cuda:2": 12 * GiB, "cuda:3": 12 * GiB}
    adv = A.dp_to_ddp(peaks, "cuda:0", gradient_bytes=2 * GiB, optimizer_state_bytes=4 * GiB)
    assert adv is not None and adv.code == "dp-to-ddp"
    # a replica's peak already holds its gradients (before the reduction): DDP adds its
    # bucket copy and the optimizer state on every rank
    assert adv.saving_bytes == 30 * GiB - (12 + 2 + 4) * GiB
    assert adv.severity == "warning" and "18.00 GiB per device" in adv.title
    assert "torchrun --nproc_per_node 4" in adv.action
    assert "LOCAL_RANK" in adv.action and "DistributedSampler" in adv.action
    assert "2.5x" in adv.title
    # heavy gradients and state: DDP's estimate (12 + 8 + 8 = 28 GiB, and the optimizer
    # step's 4 + 8 + 8 + 8 = 28 GiB) does not beat cuda:0's 24 GiB: no switch promised
    heavy = {"cuda:0": 24 * GiB, "cuda:1": 12 * GiB}
    info = A.dp_to_ddp(heavy, "cuda:0", gradient_bytes=8 * GiB, optimizer_state_bytes=8 * GiB,
                       parameter_bytes=4 * GiB)  # fmt: skip
    assert info is not None and info.severity == "info" and info.saving_bytes is None
    assert "would not save memory" in info.title and "28.00 GiB to 32.00 GiB per" in info.title
    # a replica may have freed its weights by its peak, a DDP rank keeps them: up to 4 GiB
    # more (12 + 2 + 4 = 18 to 22 GiB); against 20 GiB on cuda:0 only measuring DDP tells
    unsure = A.dp_to_ddp({"cuda:0": 20 * GiB, "cuda:1": 12 * GiB}, "cuda:0",
                         gradient_bytes=2 * GiB, optimizer_state_bytes=4 * GiB,
                         parameter_bytes=4 * GiB)  # fmt: skip
    assert unsure is not None and unsure.severity == "info" and unsure.saving_bytes is None
    assert "DDP may not save memory here (18.00 GiB to 22.00 GiB per device" in unsure.title
    assert "up to its weights (4.00 GiB)" in unsure.evidence
    assert "--strategies dp,ddp" in unsure.action and "DistributedSampler" not in unsure.action
    surely = A.dp_to_ddp({"cuda:0": 23 * GiB, "cuda:1": 12 * GiB}, "cuda:0",
                         gradient_bytes=2 * GiB, optimizer_state_bytes=4 * GiB,
                         parameter_bytes=4 * GiB)  # fmt: skip
    assert surely is not None and surely.severity == "warning"
    assert surely.saving_bytes == 1 * GiB  # against the high end
    assert "Keep DataParallel" in info.action and "DistributedSampler" not in info.action
    # measured batches decide over the estimate
    fits_less = A.dp_to_ddp(peaks, "cuda:0", gradient_bytes=2 * GiB, largest_batches=(104, 84))
    assert fits_less is not None and fits_less.severity == "info"
    assert "(84 vs 104)" in fits_less.title and "104 with DataParallel" in fits_less.evidence
    fits_more = A.dp_to_ddp(heavy, "cuda:0", gradient_bytes=8 * GiB, largest_batches=(64, 96))
    assert fits_more is not None and fits_more.severity == "warning"
    assert "global batch of 96" in fits_more.title
    # the loss on a rank's share of the outputs: the share and its gradient, 2 x 4 GiB / 4
    outputs = A.dp_to_ddp(peaks, "cuda:0", gradient_bytes=2 * GiB, optimizer_state_bytes=4 * GiB,
                          gathered_output_bytes=4 * GiB)  # fmt: skip
    assert outputs is not None and outputs.saving_bytes == 30 * GiB - (12 + 2 + 4 + 2) * GiB
    assert "the loss on its share of the outputs (2.00 GiB)" in outputs.evidence
    balanced = {"cuda:0": 13 * GiB, "cuda:1": 12 * GiB}
    assert A.dp_to_ddp(balanced, "cuda:0") is None
    assert A.dp_to_ddp({"cuda:0": 30 * GiB}, "cuda:0") is None


def test_dp_to_ddp_takes_a_measured_rank_peak_and_words_a_tie_in_batch_as_a_tie():
    peaks = {"cuda:0": 30 * GiB, "cuda:1": 12 * GiB}
    # the comparison ran DDP at the same global batch: its peak, not the estimate
    lower = A.dp_to_ddp(peaks, "cuda:0", gradient_bytes=2 * GiB, largest_batches=(8, 8),
                        ddp_peak=25 * GiB)  # fmt: skip
    assert lower is not None and lower.severity == "warning"
    assert "DDP fits the same global batch (8) at 25.00 GiB per device" in lower.title
    assert "smaller" not in lower.title and "Use DistributedDataParallel" in lower.action
    assert lower.saving_bytes == 5 * GiB
    assert "each rank peaks at 25.00 GiB at the same global batch (measured" in lower.evidence
    higher = A.dp_to_ddp(peaks, "cuda:0", largest_batches=(8, 8), ddp_peak=31 * GiB)
    assert higher is not None and higher.severity == "info" and higher.saving_bytes is None
    assert "same global batch here (8) at no lower peak" in higher.title
    smaller = A.dp_to_ddp(peaks, "cuda:0", largest_batches=(8, 6), ddp_peak=25 * GiB)
    assert smaller is not None and "smaller global batch here (6 vs 8)" in smaller.title


def test_dp_loss_on_replicas():
    adv = A.dp_loss_on_replicas(3 * GiB, "cuda:0", 4, primary_peak=20 * GiB)
    assert adv is not None and adv.saving_bytes == 3 * GiB and "4 scalars" in adv.action
    assert A.dp_loss_on_replicas(16 * 1024, "cuda:0", 4, primary_peak=20 * GiB) is None
    assert A.dp_loss_on_replicas(3 * GiB, "cuda:0", 1) is None


def test_track_report_of_a_data_parallel_run_feeds_the_dp_rules():
    def dev(name: str, peak: int, bd: Breakdown | None = None) -> DeviceReport:
        return DeviceReport(name, name, "cuda", 80 * GiB, 0, 0, peak, peak, {}, breakdown=bd)

    bd = Breakdown(30 * GiB, 2 * GiB, 2 * GiB, 4 * GiB, 12 * GiB, 10 * GiB, 3, "forward", None)
    report = TrackReport(
        devices=(dev("cuda:0", 30 * GiB, bd), dev("cuda:1", 12 * GiB)),
        steps=4,
        mode="per-module",
        duration_s=1.0,
        dp_device_ids=(0, 1),
        dp_output_device="cuda:0",
        dp_output_bytes=6 * GiB,
    )
    got = codes(measured_advice(report))
    assert "dp-to-ddp" in got and "dp-loss-on-replicas" in got
    plain = TrackReport(devices=report.devices, steps=4, mode="per-module", duration_s=1.0)
    assert not {"dp-to-ddp", "dp-loss-on-replicas"} & set(codes(measured_advice(plain)))


def test_check_data_parallel_batch_and_device_mismatch():
    stand_in = SimpleNamespace(device_ids=[0, 1, 2, 3], module=nn.Linear(4, 4))  # on cpu
    got = A.check_data_parallel(stand_in, batch_size=2)
    assert codes(got) == ["dp-device-mismatch", "dp-batch-too-small"]
    assert "model.to('cuda:0')" in got[0].action and "cpu" in got[0].evidence
    assert "drop_last=True" in got[1].action
    assert A.dp_device_mismatch({"cuda:0"}, [0, 1]) is None
    assert A.dp_batch_too_small(8, [0, 1, 2, 3]) is None
    assert A.check_data_parallel(nn.Linear(4, 4), 1) == []
    # without CUDA torch builds DataParallel with device_ids=[]: a pass-through, nothing fires
    assert A.check_data_parallel(nn.DataParallel(nn.Linear(4, 4)), 1) == []


# -- the caching allocator and the device (constructed CUDA readings) -------------------------

OOM_FRAGMENTED = (
    "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 23.65 GiB "
    "of which 301.56 MiB is free. Process 4242 has 6.00 GiB memory in use. Including non-PyTorch "
    "memory, this process has 17.34 GiB memory in use. Of the allocated memory 13.10 GiB is "
    "allocated by PyTorch, and 3.72 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)


def test_fragmentation_at_an_oom_and_in_a_snapshot():
    d = parse_oom_message(OOM_FRAGMENTED)
    assert d.allocated_by_pytorch is not None and d.reserved_unallocated is not None
    adv = A.fragmentation(
        reserved=d.allocated_by_pytorch + d.reserved_unallocated,
        allocated=d.allocated_by_pytorch,
        tried_to_allocate=d.tried_to_allocate,
        capacity=d.capacity,
        device="cuda:0",
    )
    assert adv is not None and adv.severity == "critical"
    assert "expandable_segments:True" in adv.action and "3.72 GiB" in adv.evidence
    assert (
        A.fragmentation(
            reserved=10 * GiB, allocated=10 * GiB - MiB, tried_to_allocate=GiB, capacity=24 * GiB
        )
        is None
    )
    rest = A.fragmentation(reserved=12 * GiB, allocated=4 * GiB, peak_allocated=8 * GiB)
    assert rest is not None and rest.saving_bytes == 4 * GiB
    assert A.fragmentation(reserved=9 * GiB, allocated=4 * GiB, peak_allocated=8 * GiB) is None


def test_other_processes_from_readings_and_from_an_oom_message():
    adv = A.other_processes(used=20 * GiB, this_process=4 * GiB, total=24 * GiB, device="cuda:0")
    assert adv is not None and adv.saving_bytes == 16 * GiB - A.CUDA_CONTEXT_BYTES
    assert "CUDA_VISIBLE_DEVICES" in adv.action
    assert A.other_processes(used=4 * GiB + 400 * MiB, this_process=4 * GiB, total=24 * GiB) is None
    d = parse_oom_message(OOM_FRAGMENTED)
    assert d.capacity and d.free is not None and d.process_in_use
    named = A.other_processes(
        used=d.capacity - d.free,
        this_process=d.process_in_use,
        total=d.capacity,
        includes_context=True,
        processes=A.processes_in_oom_message(OOM_FRAGMENTED),
    )
    assert named is not None and "pid 4242 (6.00 GiB)" in named.evidence


def test_empty_cache_helps_only_when_another_process_needs_the_memory():
    helps = A.empty_cache(reserved=10 * GiB, allocated=4 * GiB, other_bytes=8 * GiB, free=GiB)
    assert helps is not None and helps.saving_bytes == 6 * GiB
    costs = A.empty_cache(reserved=4 * GiB, allocated=4 * GiB, cache_releases=10, steps=10)
    assert costs is not None and costs.saving_bytes is None and "only costs time" in costs.title
    assert A.empty_cache(reserved=10 * GiB, allocated=4 * GiB, other_bytes=0, free=10 * GiB) is None
    assert (
        A.empty_cache(
            reserved=10 * GiB,
            allocated=4 * GiB,
            cache_releases=10,
            steps=10,
            other_bytes=8 * GiB,
            free=20 * GiB,
        )
        is None
    )


def test_device_advice_of_a_busy_and_a_healthy_gpu():
    busy = A.device_advice(
        "cuda:0",
        total=24 * GiB,
        used=22 * GiB,
        allocated=4 * GiB,
        reserved=10 * GiB,
        peak_allocated=6 * GiB,
    )
    assert set(codes(busy)) == {"other-processes", "fragmentation", "empty-cache"}
    healthy = A.device_advice(
        "cuda:0",
        total=24 * GiB,
        used=10 * GiB + 400 * MiB,
        allocated=9 * GiB,
        reserved=10 * GiB,
        peak_allocated=9 * GiB,
    )
    assert healthy == []


def test_a_snapshot_of_a_healthy_process_has_no_advice():
    import memkit

    snap = memkit.snapshot(nn.Linear(8, 8), device="cpu", nvidia_smi=False)
    assert snap.advice == ()


# -- accumulate, and the renderings -----------------------------------------------------------


def test_accumulate_per_world_size():
    plan = plan_accumulation(960, 48, world_size=4)
    assert plan.exact and (plan.micro_batch, plan.steps) == (48, 5)
    adv = accumulation_advice(plan, 48, "cuda:0")
    assert f"{plan.steps} steps of {plan.micro_batch}" in adv.title
    assert "x 4 ranks" in adv.evidence and "learning-rate" in adv.action
    odd = accumulation_advice(plan_accumulation(1001, 48), 48, "cuda:0")
    assert "scale the learning rate" in odd.action
    fits = accumulation_advice(plan_accumulation(32, 48), 48, "cuda:0")
    assert "without accumulation" in fits.title


def test_accumulation_words_match_the_numbers():
    # 256 with at most 60 per micro batch: 5 steps of 52 overshoot to 260, but 8 of 32 is exact
    plan = plan_accumulation(256, 60)
    adv = accumulation_advice(plan, 60, "cpu")
    assert plan.effective_batch == 260
    assert "the recommended batch size on cpu is 60" in adv.evidence
    assert "an exact split needs 8 steps of 32" in adv.evidence
    assert "matches the target" not in adv.action and "260, 4 above the target" in adv.action
    assert "no micro batch <= 60 divides" not in adv.evidence.lower()
    exact = accumulation_advice(plan_accumulation(256, 64), 64, "cpu")
    assert "matches the target" in exact.action and "Batch-norm" not in exact.action
    with_bn = accumulation_advice(plan_accumulation(256, 64), 64, "cpu", batch_norm=True)
    assert "Batch-norm statistics see micro batches of 64" in with_bn.action
    assert (exact_split(1001, 48).micro_batch, exact_split(1001, 48).steps) == (13, 77)  # 7x11x13


def test_renderings():
    adv = [
        A.other_processes(used=20 * GiB, this_process=4 * GiB, total=24 * GiB),
        A.dp_device_mismatch({"cpu"}, [0, 1]),
    ]
    items = [a for a in adv if a is not None]
    text = advice_text(items)
    assert text.startswith("[dp-device-mismatch]") and "saving: ~" in text  # most severe first
    data = json.loads(json.dumps([a.to_dict() for a in items]))
    assert data[0]["code"] == "other-processes" and "detail" in data[0]
    html = advice_html(items)
    assert "<table" in html and "dp-device-mismatch" in html
    with pytest.raises(ValueError):
        A.Advice("x", "t", "e", "a", severity="loud")


def test_oom_post_mortem_gets_fragmentation_and_other_processes_from_the_message():
    from memkit.advice.track import oom_advice
    from memkit.tracking.report import OomPostMortem

    d = parse_oom_message(OOM_FRAGMENTED)
    pm = OomPostMortem(
        "cuda:0", 3, "backward", None, True, True, "OutOfMemoryError: " + OOM_FRAGMENTED,
        "torch.OutOfMemoryError", d.tried_to_allocate, d.capacity, d.free,
        d.allocated_by_pytorch, None, (), None, (),
    )  # fmt: skip
    got = codes(oom_advice(pm, details=d))
    assert "fragmentation" in got and "other-processes" in got
    calm = parse_oom_message(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB "
        "of which 1.00 GiB is free. Including non-PyTorch memory, this process has 22.60 GiB "
        "memory in use. Of the allocated memory 22.00 GiB is allocated by PyTorch, and 100.00 MiB "
        "is reserved by PyTorch but unallocated."
    )
    assert not {"fragmentation", "other-processes"} & set(codes(oom_advice(pm, details=calm)))


def test_eval_peak_asks_for_inference_mode_only_where_autograd_ran():
    """An evaluation under no_grad already keeps nothing for backward: its batch is the fix."""
    phases = {"forward": 40 * MiB, "backward": 47 * MiB, "eval": 75 * MiB}
    dev = DeviceReport("cpu", "cpu", "sim", 256 * MiB, 0, 0, 75 * MiB, 75 * MiB, phases)
    report = TrackReport(devices=(dev,), steps=4, mode="per-module", duration_s=1.0)
    (no_grad,) = eval_peak(report)
    assert no_grad.saving_bytes == 28 * MiB
    assert "already runs without autograd" in no_grad.action
    assert "inference_mode" not in no_grad.action
    grad = dataclasses.replace(report, eval_grad_forwards=3)
    assert "`torch.inference_mode()`" in eval_peak(grad)[0].action


def test_eval_peak_claims_no_saving_where_the_leak_grown_in_evaluation_is_the_gap():
    """An evaluation every 4 steps keeps its losses with their graphs: the eval/training gap
    is the newest evaluation's graphs on top of the kept ones. "Give evaluation its own,
    smaller batch size ... saving ~7.25 MiB" claimed what fixing the leak frees; where the
    leak grew in training steps instead, the gap is evaluation's own (the old advice)."""

    def step(i: int, rise: int, evaluated: bool) -> StepRecord:
        start = 10 * MiB + 6 * MiB * (i // 4)
        peaks = {"forward": start + MiB, "eval": start + rise + MiB if evaluated else None}
        return StepRecord(i, start, start + rise, start + MiB, start + MiB, peaks, 0.1)

    steps = [step(i, 6 * MiB if i % 4 == 3 else 0, i % 4 == 3) for i in range(12)]
    phases = {"forward": 23 * MiB, "backward": 22 * MiB, "eval": 29 * MiB}
    leak = LeakFinding("cpu", 6 * MiB // 4, 2, 9, (), period=4, grown_bytes=18 * MiB)
    dev = DeviceReport("cpu", "cpu", "sim", 256 * MiB, 0, 0, 29 * MiB, 29 * MiB, phases,
                       steps=tuple(steps), leak=leak)  # fmt: skip
    report = TrackReport(devices=(dev,), steps=12, mode="per-module", duration_s=1.0)
    (advice,) = eval_peak(report)
    assert advice.saving_bytes is None and "leak" in advice.title
    assert "smaller batch size" not in advice.action
    in_training = [dataclasses.replace(s, phase_peaks={**s.phase_peaks, "eval": None})
                   for s in steps]  # fmt: skip
    moved = dataclasses.replace(dev, steps=(*in_training[:-1], steps[-1]))
    (own,) = eval_peak(dataclasses.replace(report, devices=(moved,)))
    assert own.saving_bytes == 6 * MiB and "smaller batch size" in own.action
    # a small leak in evaluation over a long run, beside an evaluation batch whose own peak is
    # far above training's: the run's whole growth (4 MiB) exceeds the gap (3 MiB), but the
    # device kept only one evaluation's 256 KiB more when evaluation peaked (review): the
    # saving is the gap less that

    def long(i: int) -> StepRecord:
        start = 10 * MiB + (MiB // 4) * (i // 4)
        evaluated = i % 4 == 3
        rise = MiB // 4 if evaluated else 0
        peaks = {"forward": start + MiB, "eval": start + 4 * MiB if evaluated else None}
        return StepRecord(i, start, start + rise, start + MiB, start + MiB, peaks, 0.1)

    runs = tuple(long(i) for i in range(64))
    top = runs[-1].start_allocated
    phases = {"forward": top + MiB, "eval": runs[-1].phase_peaks["eval"]}
    leak = dataclasses.replace(leak, grown_bytes=4 * MiB)
    longer = DeviceReport("cpu", "cpu", "sim", 256 * MiB, 0, 0, top + 4 * MiB, top + 4 * MiB,
                          phases, steps=runs, leak=leak)  # fmt: skip
    # the evaluation that peaked ran after the last step's end (the block ended before another
    # step closed): what the device held as the block ended is what it kept by then
    tail = dataclasses.replace(
        dev, steps=tuple(steps[:11]), final_allocated=steps[11].end_allocated
    )
    (untracked,) = eval_peak(dataclasses.replace(report, devices=(tail,)))
    assert untracked.saving_bytes is None and "leak" in untracked.title
    (kept,) = eval_peak(dataclasses.replace(report, devices=(longer,)))
    assert kept.saving_bytes == 3 * MiB - MiB // 4 and "smaller batch size" in kept.action
    assert "256.00 KiB of the gap is what the leak kept by then" in kept.evidence


def test_the_oom_accumulation_saving_holds_when_the_advice_is_applied():
    """ "Halve the micro-batch and accumulate over 2" claimed half the activations, but the
    first micro-batch's gradients then stay allocated through the second: sweep C measured
    17.98 MiB where 38.05 MiB was claimed. The claim now counts them; applied, the advice saves
    at least what it claims."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))

    def peak(batch: int, micro: int, budget: str | None) -> TrackReport:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        tracker = track(net, opt, device="cpu", budget=budget, postmortem=None)
        try:
            with tracker:
                for _ in range(2):
                    for _ in range(micro):
                        (net(torch.randn(batch // micro, 512)).square().mean() / micro).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            assert budget is not None
        return tracker.report()

    full = peak(2048, 1, None).devices[0].peak_allocated
    pm = peak(2048, 1, str(int(full * 0.95))).oom
    assert pm is not None and pm.breakdown is not None
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    assert adv.saving_bytes is not None
    assert adv.saving_bytes < pm.breakdown.activations // 2  # the gradients counted
    applied = peak(2048, 2, None).devices[0].peak_allocated
    assert full - applied >= adv.saving_bytes
    # sweep CM: the need at half is printed beside what the failed step needed at least, and
    # the saving is their difference (it was what the memory held would lose: 5.87 MiB
    # where the step's need fell by 15.39)
    need = re.search(
        r"At half the micro-batch the step would need about ([\d.]+) MiB", adv.evidence
    )
    failed = re.search(r"the step that failed needed at least ([\d.]+) MiB", adv.evidence)
    assert need and failed, adv.evidence
    said = (float(failed.group(1)) - float(need.group(1))) * MiB
    assert abs(adv.saving_bytes - said) < 0.01 * MiB
    assert applied <= float(need.group(1)) * MiB <= 1.1 * applied


def test_a_failed_request_that_grows_with_the_batch_is_something_a_smaller_batch_frees():
    """Weights filling 94% of the device and a forward whose failed request (a pairwise
    product, as an LM's logits or attention scores) grows with the batch: 'no smaller batch
    makes it fit' compared the activations held (512 KiB) alone with the 9 MiB lacked, and
    batch 8 fits."""
    from memkit.tracking import track

    class Pairwise(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(2048, 2048).requires_grad_(False)
            self.bias = torch.nn.Parameter(torch.zeros(2048))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = (self.body(x) + self.bias)[:, :256]
            return (h.unsqueeze(2) * h.unsqueeze(1)).mean()

    def run(batch: int) -> Any:
        torch.manual_seed(0)
        model = Pairwise()
        opt = torch.optim.SGD([model.bias], lr=0.01)
        tracker = track(model, opt, device="cpu", budget="24MiB")
        try:
            with tracker:
                for _ in range(2):
                    model(torch.randn(batch, 2048)).backward()
                    opt.step()
                    opt.zero_grad()
        except torch.OutOfMemoryError:
            pass
        return tracker.report()

    failed = run(64)
    assert failed.oom is not None
    (params,) = [a for a in failed.oom.advice if a.code == "oom-parameters"]
    assert "no smaller batch" not in params.evidence and "may make up for it" in params.evidence
    assert run(8).oom is None  # a smaller batch fits


class _Returns(nn.Module):
    """Keeps ``h`` (64 x 128 floats) for backward; returns its output in various shapes."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(128, 128), nn.Linear(128, 128)

    def forward(self, x: torch.Tensor):
        y = self.b(torch.relu(self.a(x)))
        if self.kind == "twice":
            return y, y
        if self.kind == "chunks":
            return y.chunk(4, dim=1)
        if self.kind == "with_input":  # a VAE's (recon, input, ...)
            return y, x
        if self.kind == "nested":  # a key-value cache
            return {"logits": y, "cache": ((torch.relu(self.a(x)), torch.relu(self.b(x))),)}
        return y


@pytest.mark.parametrize("kind", ["plain", "twice", "chunks", "with_input", "nested"])
def test_eval_grad_enabled_takes_off_the_output_once_whatever_its_shape(kind):
    """What an evaluation forward kept for a backward is what it left allocated less what
    it returned (a review): a tensor returned twice or as views was taken off once per
    reference (0 B claimed), the input returned beside the output was taken off though the
    forward never made it, and a nested cache was not taken off (3x claimed)."""
    torch.manual_seed(0)
    model = _Returns(kind).eval()
    with track(model, device="cpu", budget="64MiB") as tracker:
        out = model(torch.randn(64, 128))
        del out
    (found,) = [a for a in tracker.report().advice if a.code == "eval-grad-enabled"]
    assert found.saving_bytes == 64 * 128 * 4  # the ReLU's output the second Linear saved


def test_does_not_fit_in_inference_offers_no_optimizer_or_checkpointing():
    """Sweep WW: an inference probe or estimate that fit nothing was told to checkpoint
    activations, take a lighter optimizer and shard optimizer state: an inference step holds
    none of those."""
    for card in ({}, {"total_bytes": 1 << 30, "context_bytes": 1 << 28}):
        kw = {"batch_size": 1, "need_bytes": 2 << 30, "capacity_bytes": 1 << 30, **card}
        infer = A.does_not_fit(mode="infer", device="cpu", **kw)  # type: ignore[arg-type]
        train = A.does_not_fit(mode="train", device="cpu", **kw)  # type: ignore[arg-type]
        for said in ("checkpointing", "optimizer"):
            assert said not in infer.action and said in train.action
        assert "quantized" in infer.action


def test_an_oom_no_part_of_which_dominates_still_gets_advice():
    """Sweep WW: a PPO agent ran out with activations 39%, optimizer state 24%, other 14%,
    parameters and gradients 12% each: every post-mortem rule has its threshold, none fired,
    and the post-mortem advised nothing. Now it says what filled the device and what to do,
    the batch first; where a part's own rule fires, that rule alone speaks."""
    from memkit.advice.track import oom_advice
    from memkit.tracking.report import Breakdown, OomPostMortem

    def post_mortem(bd: Breakdown) -> OomPostMortem:
        return OomPostMortem(
            "cpu", 1, "forward", "Sequential.1", True, True, "OutOfMemoryError: out of memory",
            "torch.OutOfMemoryError", 30 * 1024, 580 * 1024, 0, bd.total, bd, (), None, (),
        )  # fmt: skip

    k = 1024
    mixed = Breakdown(565 * k, 68 * k, 68 * k, 136 * k, 220 * k, 73 * k, 1, "forward", None)
    (adv,) = oom_advice(post_mortem(mixed))
    assert adv.code == "oom-no-dominant-part" and adv.saving_bytes is None
    assert "activations 39%, optimizer state 24%" in adv.evidence
    assert "lacked" in adv.evidence and "batch size" in adv.action
    heavy = Breakdown(565 * k, 68 * k, 68 * k, 40 * k, 350 * k, 39 * k, 1, "forward", None)
    assert "oom-no-dominant-part" not in codes(oom_advice(post_mortem(heavy)))


def test_a_large_request_outside_the_models_modules_is_named():
    """Sweep XX: a 16 MiB logging buffer made after the loss on a 32 MiB device ran out; the
    only advice was to switch AdamW for SGD, which, applied, ran out in backward. A failed
    request made outside the modules that alone is a quarter of the device or more, and half
    of what was held, is the thing to look at; not where a module made it."""
    from memkit.advice.track import oom_advice
    from memkit.tracking.report import Breakdown, OomPostMortem

    def post_mortem(module: str | None, tried: int) -> OomPostMortem:
        bd = Breakdown(17 * MiB, 5 * MiB, 0, 10 * MiB, 2 * MiB, 0, 2, "forward", module)
        return OomPostMortem(
            "cpu", 2, "forward", module, True, True, "OutOfMemoryError: out of memory",
            "torch.OutOfMemoryError", tried, 32 * MiB, 0, bd.total, bd, (), None, (),
        )  # fmt: skip

    (adv,) = [a for a in oom_advice(post_mortem(None, 16 * MiB)) if a.code == "oom-large-request"]
    assert "16.00 MiB failed: 50% of the 32.00 MiB device" in adv.evidence
    assert "outside any module" in adv.evidence and adv.saving_bytes is None
    assert "oom-large-request" not in codes(oom_advice(post_mortem("fc1", 16 * MiB)))
    assert "oom-large-request" not in codes(oom_advice(post_mortem(None, 4 * MiB)))
    # an LM's loss over the logits it holds (review 4): the activations' rule speaks
    lm = Breakdown(150 * MiB, 5 * MiB, 0, 10 * MiB, 130 * MiB, 5 * MiB, 2, "forward", None)
    loss = dataclasses.replace(post_mortem(None, 125 * MiB), breakdown=lm, capacity=200 * MiB)
    assert "oom-large-request" not in codes(oom_advice(loss))
    # a capacity of 0 (set_per_process_memory_fraction(0)'s message) raised ZeroDivisionError
    assert "oom-large-request" not in codes(
        oom_advice(dataclasses.replace(post_mortem(None, 16 * MiB), capacity=0))
    )


def test_an_evaluation_oom_bounds_the_evaluation_batch():
    """Sweep XX: 1000 test images ran out at conv1 and oom-eval gave no size to lower the
    evaluation batch to (40 fit at 32 MiB). It now bounds it from above: what the pass held
    beyond the persistent memory, and the failed request, scale with the batch."""
    from memkit.advice.track import oom_advice
    from memkit.tracking.report import Breakdown, OomPostMortem

    bd = Breakdown(22 * MiB, 5 * MiB, 5 * MiB, 9 * MiB, 3 * MiB, 0, 4, "eval", "conv1")
    pm = OomPostMortem(
        "cpu", 4, "eval", "conv1", False, False, "OutOfMemoryError: out of memory",
        "torch.OutOfMemoryError", 83 * MiB, 32 * MiB, 0, bd.total, bd, (), None, (),
        input_shape=(1000, 1, 28, 28),
    )  # fmt: skip
    (adv,) = [a for a in oom_advice(pm) if a.code == "oom-eval"]
    # (32 - 19) MiB of room for (3 + 83) MiB per 1000 samples; an upper bound only where memory
    # grows in proportion to the first dimension (review 4: a seq-first LSTM's, an in-batch
    # similarity matrix's do not), and the text says so
    assert f"no evaluation batch above about {13 * 1000 // 86} fits" in adv.evidence
    assert "first dimension (1000: the batch, for most models)" in adv.evidence
    assert "sequence-first input" in adv.evidence


def test_weights_that_are_half_of_what_was_held_but_not_of_what_was_needed_are_not_blamed():
    """Review 4: an evaluation's 80 MiB request failed beside 5 MiB of weights and 3 MiB of
    activations on 64 MiB, and oom-parameters said the weights take most of the device."""
    from memkit.advice.track import oom_advice
    from memkit.tracking.report import Breakdown, OomPostMortem

    def post_mortem(tried: int) -> OomPostMortem:
        bd = Breakdown(8 * MiB, 5 * MiB, 0, 0, 3 * MiB, 0, 3, "eval", "conv1")
        return OomPostMortem(
            "cpu", 3, "eval", "conv1", False, False, "OutOfMemoryError: out of memory",
            "torch.OutOfMemoryError", tried, 64 * MiB, 0, bd.total, bd, (), None, (),
        )  # fmt: skip

    assert "oom-parameters" not in codes(oom_advice(post_mortem(80 * MiB)))
    assert "oom-parameters" in codes(oom_advice(post_mortem(1 * MiB)))


def _train_then_test(keep_tensor: bool) -> tuple[int, dict[str, Any]]:
    """pytorch/examples mnist's shape: train(), then test() summing its loss, under autograd
    (no no_grad), as a tensor (``test_loss += loss``) or as a number (``.item()``)."""
    torch.manual_seed(0)
    model = blocks(3, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model.train()
            for _ in range(2):
                model(torch.randn(64, 256)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            model.eval()
            test_loss: Any = 0
            for _ in range(12):
                loss = model(torch.randn(64, 256)).square().mean()
                test_loss += loss if keep_tensor else loss.item()
            del loss, test_loss
    report = tracker.report()
    return report.devices[0].peak_allocated, {a.code: a for a in report.advice}


def test_an_evaluation_that_keeps_its_losses_graphs_is_not_told_to_shrink_its_batch():
    """Sweep BC: test() summing ``test_loss += F.nll_loss(...)`` under autograd keeps every
    pass's graph until it returns; eval-peak said to give evaluation a smaller batch (19.91
    MiB; applied: 0.07 MiB). What the passes carry from pass to pass is now measured:
    eval-peak names it, claims no smaller batch, and its saving holds when the losses are kept
    as numbers; eval-grad-enabled points at it (no_grad alone frees the graphs, not kept
    results, so it claims one pass's graph)."""
    peak, advice = _train_then_test(keep_tensor=True)
    fixed_peak, fixed = _train_then_test(keep_tensor=False)
    saved = peak - fixed_peak
    keeps = advice["eval-peak"]
    assert "what its passes keep" in keeps.title and "smaller" not in keeps.action
    assert "test_loss += loss" in keeps.evidence
    claimed = keeps.saving_bytes
    assert claimed is not None and abs(claimed - saved) <= 0.1 * saved, (claimed, saved)
    graph = advice["eval-grad-enabled"]  # (one pass's graph; what is carried, eval-peak's)
    assert graph.saving_bytes is not None and graph.saving_bytes < claimed
    assert "see eval-peak" in graph.evidence
    assert "eval-peak" not in fixed  # as numbers: evaluation stays below training


def test_the_oom_accumulation_says_when_the_cut_does_not_keep_the_batch_whole():
    """Sweep BI: "Halve the micro-batch (7 -> 3) and accumulate gradients over 2 steps (same
    effective batch)": 3 x 2 is 6."""

    def action(batch: int) -> str:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        tracker = track(net, opt, device="cpu", budget="6MiB", postmortem=None)
        with pytest.raises(torch.OutOfMemoryError), tracker:
            for _ in range(2):
                net(torch.randn(batch, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        pm = tracker.report().oom
        assert pm is not None
        (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
        return adv.action

    odd = action(1023)
    assert (
        "(1023 -> 255 or fewer)" in odd
        and "4 x 255 = 1020 samples a step where the step had 1023" in odd
    )
    assert "same effective batch" in action(1024)


def test_probe_state_grows_in_an_evaluation_speaks_of_what_it_keeps_not_of_training():
    """Sweep BL: an evaluation keeping its logits on the device was told to "train with less
    than the answer" and given LBFGS's history_size."""
    from memkit.advice.probe import state_still_grows

    infer = state_still_grows(48, 16, 8 << 20, 0, mode="infer")
    assert "Evaluate with less" in infer.action and "LBFGS" not in infer.action
    assert "Train with less" in state_still_grows(48, 16, 8 << 20, 0).action


def test_a_list_of_tensors_of_varying_sizes_is_never_more_than_its_growth():
    """Sweep CB: REINFORCE episodes' log-probs (10 to 60 of them) kept with their graphs: the
    scans' estimate of the list's bytes a step (786 B) came out above the growth measured
    (141 B), and the advice said "786 B of the 141 B it grew by"."""
    top = LeakSuspect(
        name="logp_history", function="finish_episode", filename="reinforce.py", line=91,
        code="logp_history.append(torch.cat(policy.saved_log_probs))", kind="container",
        graph_nodes=60, growing=True, item_shape=(60,), item_bytes=240, bytes_per_step=786,
    )  # fmt: skip
    leak = LeakFinding(device="cpu", growth_per_step=141, first_step=2, steps=36,
                       suspects=(top,), grown_bytes=36 * 141)  # fmt: skip
    (adv,) = graph_retained_advice([leak])
    assert "are about 141 B of the 141 B it grew by" in adv.evidence
    assert "`logp_history.append(torch.cat(policy.saved_log_probs).detach().cpu())`" in adv.action


def test_a_stored_class_instance_is_not_told_to_detach():
    """Sweep CD: the DQN tutorial stores ``Transition(*args)`` (a namedtuple): the fix read
    ``memory.memory[key] = Transition(*args).detach().cpu()``, which raises."""
    from memkit.advice.leaks import _stored

    def suspect(code: str) -> LeakSuspect:
        return LeakSuspect(name="memory.memory", function="push", filename="dqn.py", line=14,
                           code=code, kind="container", graph_nodes=0, growing=True)  # fmt: skip

    assert _stored(suspect("self.memory[self.position] = Transition(*args)")) == "x"
    assert _stored(suspect("self.memory.append(torch.cat(parts))")) == "torch.cat(parts)"


def test_an_evaluation_oom_with_grad_on_claims_what_no_grad_takes_off_the_failing_op():
    """Sweep CO: pytorch/examples' MNIST ``test()`` without no_grad ran out at a ReLU after
    conv2 and was told no_grad saves 28.56 MiB, all the activations the pass held; no_grad
    lowered the pass's peak by 10.55 MiB: the ReLU still holds its input beside its output.
    The claim is within 5% of that drop."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
            self.fc = nn.Linear(64 * 12 * 12, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.relu(self.conv2(F.relu(self.conv1(x))))
            return self.fc(F.max_pool2d(x, 2).flatten(1))

    torch.manual_seed(0)
    model = Net().eval()
    images = torch.randn(128, 1, 28, 28)

    def evaluate(grad: bool, budget: str | None) -> TrackReport:
        tracker = track(model, device="cpu", budget=budget, postmortem=None)
        try:
            with tracker, torch.set_grad_enabled(grad):
                model(images).sum()
        except torch.OutOfMemoryError:
            assert budget is not None
        return tracker.report()

    with_grad = evaluate(True, None).devices[0].peak_allocated
    without = evaluate(False, None).devices[0].peak_allocated
    failed = evaluate(True, str(with_grad - (1 << 20)))
    pm = failed.oom
    assert pm is not None
    # (sweep CP: the report said 11.56 MiB beside the post-mortem's 16.00: one figure now)
    assert not [a for a in failed.advice if a.code == "eval-grad-enabled"]
    (advice,) = [a for a in pm.advice if a.code == "eval-grad-enabled"]
    drop = with_grad - without
    assert advice.saving_bytes is not None and abs(advice.saving_bytes - drop) <= 0.05 * drop
