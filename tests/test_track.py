"""memkit.track on real models, on the simulated device: phases, steps, modules, leaks, OOMs."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import json
import re
import threading
from typing import Any

import pytest
import torch
from fused_steps import check_finite, step_in_backward
from gan_cases import two_step_gan
from torch import nn

from memkit import simulate
from memkit.advice.leaks import graph_retained_advice
from memkit.errors import ConfigError
from memkit.tracking import TrackReport, device_set, track
from memkit.tracking.leaks import GrowthDetector, compare_scans, graph_size, scan_frames
from memkit.tracking.report import LeakFinding
from memkit.units import format_size


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int = 8) -> None:
    for _ in range(steps):
        x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def no_hooks_left(model: nn.Module) -> bool:
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    local = all(
        not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks)
        for mod in model.modules()
    )
    glob = not (
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
        or o._global_optimizer_pre_hooks
        or o._global_optimizer_post_hooks
    )
    return local and glob


def test_phases_steps_modules_and_breakdown():
    model = cnn()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="256MiB") as tracker:
        train(model, opt, 3)
    report = tracker.report()
    assert report.steps == 3 and report.mode == "per-module"
    dev = report.devices[0]
    assert dev.device == "cpu" and dev.capacity == 256 * 1024**2
    assert all(dev.phase_peaks[p] is not None for p in ("forward", "backward", "optimizer"))
    assert len(dev.steps) == 3
    assert dev.peak_allocated >= max(s.peak_allocated for s in dev.steps)
    paths = {m.path for m in dev.modules}
    assert {"Sequential", "0", "1", "8"} <= paths
    conv = next(m for m in dev.modules if m.path == "0")
    assert conv.calls == 3 and conv.leaf and conv.activation_bytes > 0
    assert conv.peak_allocated >= conv.activation_bytes
    bd = dev.breakdown
    assert bd is not None
    assert bd.total == dev.peak_allocated
    assert sum(v for _, v in bd.parts()) == bd.total
    params = sum(p.numel() * 4 for p in model.parameters())
    assert bd.parameters >= params
    phases = {p.phase for p in dev.timeline}
    assert {"forward", "backward", "optimizer"} <= phases
    assert any(p.phase == "backward" and p.module == "8" for p in dev.timeline)
    assert model.training and no_hooks_left(model)


def test_a_users_own_pre_hook_is_inside_its_modules_forward():
    """``spectral_norm`` computes the layer's weight in a forward pre-hook the user's code
    registered first. With the model given, memkit's pre-hook ran after it: the 1 MiB weight
    landed in the parent's row. torch's global hooks (no model given) run before every
    module hook and saw it in the layer's: both must say the same."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(),
                             nn.utils.spectral_norm(nn.Linear(512, 512)))  # fmt: skip

    kept = []
    for given in (True, False):
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with track(model if given else None, opt, device="cpu", budget="64MiB") as t:
            for _ in range(2):
                model(torch.randn(64, 256)).sum().backward()
                opt.step()
                opt.zero_grad()
        rows = {m.path: m.activation_bytes for m in t.report().devices[0].modules}
        kept.append(rows["2"])
    assert kept[0] == kept[1] >= 512 * 512 * 4  # the weight spectral_norm made in the layer


def test_an_oom_after_more_backward_passes_than_the_trainer_accumulates_stays_in_its_step():
    """A trainer said it accumulates over 4, yet no optimizer ever steps (manual SGD): an OOM
    at the 8th pass is in step 7, not folded into step 0 as a micro-batch would be."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    tracker = track(model, device="cpu", budget="4MiB", postmortem=None)
    tracker.trainer_settings(accumulation_steps=4)
    with pytest.raises(torch.OutOfMemoryError), tracker:
        for i in range(10):
            loss = model(torch.randn(32 if i < 7 else 4096, 64)).pow(2).mean()
            model.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
    oom = tracker.report().oom
    assert oom is not None and oom.step == 7


def test_json_text_and_html_render():
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="128MiB") as tracker:
        train(model, opt, 2)
    report = tracker.report()
    data = json.loads(report.to_json())
    assert data["schema"] == "memkit.TrackReport/1" and data["steps"] == 2
    assert data["devices"][0]["timeline_fields"][0] == "t"
    assert "devices" in str(report) and "top modules" in str(report)
    page = report.to_html()
    assert "<svg" in page and "<script" not in page
    # self-contained: nothing fetched from elsewhere (the SVG's xmlns is a name, not a fetch)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|url\(\s*["']?https?:""", page)
    assert "Memory over time" in page and "<table>" in report._repr_html_()


def test_a_tracker_kept_for_its_report_does_not_keep_the_model_alive():
    # a notebook keeps `tracker` in its globals: `del model, opt` must free the weights
    import weakref

    model = cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with track(model, opt, device="cpu", budget="128MiB") as tracker:
        train(model, opt, 3)
    held = [weakref.ref(model), weakref.ref(opt), weakref.ref(next(model.parameters()))]
    before = tracker.report()
    breakdown = before.devices[0].breakdown
    assert breakdown is not None and breakdown.parameters >= params
    del model, opt
    gc.collect()
    assert [r() for r in held] == [None, None, None]
    assert tracker.report().to_json() == before.to_json()  # what was seen while they lived


def test_a_caught_error_that_is_no_oom_leaves_the_micro_batch_count_alone():
    """A loop that skips a bad sample's micro-batch (ValueError in the forward) keeps the
    gradients of the others: they are the step's micro-batches (an OOM's retry is not)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.isnan(x).any():
                raise ValueError("bad sample")
            return self.fc(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(3):
            for micro in range(4):
                x = torch.randn(8, 16)
                if micro == 2:
                    x[0, 0] = float("nan")
                try:
                    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,)))
                except ValueError:
                    continue
                (loss / 4).backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert [s.backward_passes for s in report.devices[0].steps] == [3, 3, 3]
    assert report.micro_batches == 3


GROWING_SCRIPT = """\
import torch
from torch import nn

class Growing(nn.Module):
    \"\"\"A model that grows a block mid-run (progressive growing, net2net).\"\"\"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64)])
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)

def train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if step in (2, 4):
            model.blocks.append(nn.Linear(64, 64))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        model(torch.randn(64, 64)).square().mean().backward()
        opt.step()

if __name__ == "__main__":
    train(Growing())
"""
_GROWING: dict[str, Any] = {"__name__": "growing"}
exec(GROWING_SCRIPT, _GROWING)  # the same model and loop in process and as a script
Growing = _GROWING["Growing"]


@pytest.mark.parametrize("given", [True, False])
def test_an_optimizer_made_anew_in_the_block_is_the_one_that_counts(given):
    """A script grows its model and makes its optimizer anew over all its parameters (sweep
    QQ). The tracker held the optimizer it was given, so the old one's Adam state stayed
    alive (the peak 2 MiB above the script's own), and the new one's steps had no hooks: 8
    steps reported of 16. Without one given, an old optimizer the script still holds (a
    scheduler not made anew) kept counting the steps: now the new one, over its parameters
    and more, takes its place."""
    import weakref

    torch.manual_seed(0)
    model = Growing()
    opt = torch.optim.Adam(model.parameters())
    kept, old = [], []

    def loop():
        nonlocal opt
        for epoch in range(4):
            if epoch == 2:
                model.blocks.append(nn.Linear(64, 64))
                old.append(weakref.ref(opt))
                if not given:
                    kept.append(opt)  # a scheduler made on it still holds it
                opt = torch.optim.Adam(model.parameters())
            for _ in range(4):
                opt.zero_grad()
                model(torch.randn(256, 64)).square().mean().backward()
                opt.step()

    with simulate("64MiB", track=(model, opt)) as direct:
        loop()
    direct_peak = direct.peak
    torch.manual_seed(0)
    model, kept, old = Growing(), [], []
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt if given else None, device="cpu", budget="64MiB") as tracker:
        loop()
        gc.collect()
        assert (old[0]() is None) == given  # nothing of memkit's holds it
    report = tracker.report()
    assert report.steps == 16
    if given:
        assert report.devices[0].peak_allocated == direct_peak


def test_a_block_added_mid_run_is_a_row_of_its_own_and_its_weights_are_no_activations():
    """A block appended to a model mid-run (sweep QQ) got a row named after its class alone
    (``Linear``), where every such block added up (``memkit run``), or none (a given model),
    and on the simulated device its weights, adopted at its first call, counted as that
    call's activations (1.13 MiB kept, 128 KiB of it the output)."""
    model = Growing()
    with track(model, device="cpu", budget="64MiB") as tracker:
        _GROWING["train"](model)
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    assert {"blocks.1", "blocks.2"} <= set(rows) and "Linear" not in rows
    # hooked from the step after the new optimizer first stepped (a given model's hooks are
    # put on again then): the first call of each block is not in its row
    assert rows["blocks.1"].calls == 3 and rows["blocks.2"].calls == 1
    # each block's output dies in torch.relu (which keeps its own): the blocks keep nothing,
    # where their adopted weights counted as their first call's activations before
    assert rows["blocks.0"].activation_bytes == 0
    assert rows["blocks.1"].activation_bytes == rows["blocks.2"].activation_bytes == 0


def test_memkit_run_names_a_block_added_mid_run_by_its_path(tmp_path):
    """The same growing model as a script under ``memkit run`` (torch's global hooks): every
    call of each new block in a row of its own, its weights no activations."""
    from memkit.tracking.run import run_script

    script = tmp_path / "growing.py"
    script.write_text(GROWING_SCRIPT)
    report = run_script(script, (), device="cpu", budget="64MiB").report
    rows = {m.path.removeprefix("Growing."): m for m in report.devices[0].modules}
    assert rows["blocks.1"].calls == 4 and rows["blocks.2"].calls == 2
    # (their outputs die in torch.relu: weights counted as activations would show here)
    assert rows["blocks.1"].activation_bytes == rows["blocks.2"].activation_bytes == 0


@pytest.mark.parametrize("head_first", [True, False])
def test_the_given_optimizers_place_is_taken_only_by_one_that_replaces_it(head_first):
    """Two reviews' cases: an optimizer over all parameters stepping beside the given one over
    the head took its place (after it: at once, the first step counted twice; before it, at
    step 0, when the given one had not stepped yet); a GAN's generator optimizer made anew
    each epoch (the given one freed) handed the steps to the discriminator's for good."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    head = torch.optim.Adam(model[1].parameters())
    every = torch.optim.SGD(model.parameters(), lr=0.01)
    order = (head, every) if head_first else (every, head)
    with track(model, head, device="cpu", budget="64MiB") as tracker:
        for _ in range(6):
            model(torch.randn(4, 8)).sum().backward()
            for opt in order:
                opt.step()
            model.zero_grad()
    assert tracker.report().steps == 6 and tracker.models.optimizers == [head]

    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    with track(g, opt_g, device="cpu", budget="64MiB") as tracker:
        for epoch in range(3):
            if epoch:
                opt_g = torch.optim.SGD(g.parameters(), lr=0.1)  # the old one freed
            for _ in range(2):
                fake = g(torch.randn(2, 4))
                d(fake.detach()).sum().backward()
                opt_d.step()
                opt_d.zero_grad()
                d(fake).sum().backward()
                opt_g.step()
                opt_g.zero_grad()
    assert tracker.report().steps == 6 and tracker.models.optimizers == [opt_g]


@pytest.mark.parametrize("closure", [False, True])
def test_an_optimizer_made_anew_while_a_scheduler_holds_the_old_one_takes_over(closure):
    """The old optimizer stays alive (a scheduler made on it), so the new one, over all the
    parameters, takes its place from its second step (its first merges into the next: no
    step of the old one between them is what tells it apart from one stepping beside the
    given one). With a closure, the backward inside ``step()`` is no step of the old one's
    missed (a review: two steps were lost)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = torch.optim.lr_scheduler.StepLR(opt, 1)  # noqa: F841 - holds the old optimizer
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for i in range(6):
            if i == 3:
                model.append(nn.Linear(1, 1))
                opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def loss() -> torch.Tensor:
                model.zero_grad()
                value = model(torch.randn(4, 8)).sum()
                value.backward()
                return value

            if closure:
                opt.step(loss)
            else:
                loss()
                opt.step()
    assert tracker.report().steps == 5 and tracker.models.optimizers == [opt]


def test_a_block_list_replaced_mid_run_is_named_by_the_modules_in_it_now():
    """A model's blocks replaced by a longer list (a review): a new block whose address a
    freed one had kept that one's name (``blocks`` for a Linear), and a block added through
    ``add_param_group`` to a given model got no row."""
    model = Growing()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, device="cpu", budget="64MiB") as tracker:
        for step in range(6):
            if step == 2:
                model.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if step == 4:
                model.blocks.append(nn.Linear(64, 64))
                opt.add_param_group({"params": model.blocks[-1].parameters()})
            opt.zero_grad()
            model(torch.randn(64, 64)).square().mean().backward()
            opt.step()
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    assert {"blocks.0", "blocks.1", "blocks.2", "blocks.3"} <= set(rows)
    assert all(m.type_name == "Linear" for p, m in rows.items() if p.startswith("blocks."))


def test_hooks_removed_and_training_flag_kept_on_exception():
    model = cnn().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="boom"), track(model, opt, device="cpu", budget="64MiB"):
        model(torch.randn(2, 3, 16, 16))
        raise ValueError("boom")
    assert not model.training and no_hooks_left(model)
    with pytest.raises(ValueError), track(None, device="cpu", budget="64MiB"):
        model(torch.randn(2, 3, 16, 16))
        raise ValueError("boom")
    assert no_hooks_left(model)


def test_frozen_backbone_and_parameterless_modules():
    backbone = cnn()[:7]
    backbone.requires_grad_(False)
    head = nn.Sequential(nn.Flatten(), nn.Linear(16, 10))
    model = nn.Sequential(backbone, head)
    opt = torch.optim.AdamW(head.parameters())
    with track(model, opt, device="cpu", budget="128MiB") as tracker:
        train(model, opt, 3)
    dev = tracker.report().devices[0]
    assert dev.breakdown is not None
    head_bytes = sum(p.numel() * 4 for p in head.parameters())
    assert dev.breakdown.gradients <= head_bytes
    assert dev.breakdown.optimizer_state <= 2 * head_bytes + 64
    assert {"0.2", "0.6", "1.0"} <= {m.path for m in dev.modules}  # ReLU, pool, Flatten
    # the frozen backbone keeps no activation for backward: its backward peak is the batch,
    # the model's state and the head's few bytes, less than the first conv's output (8 x 8 x
    # 16 x 16 float32) more
    state = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    batch = 8 * 3 * 16 * 16 * 4
    assert state + batch <= dev.phase_peaks["backward"] < state + batch + 8 * 8 * 16 * 16 * 4


def test_global_hooks_on_tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters())
    with track(device="cpu", budget="256MiB") as tracker:
        for _ in range(2):
            ids = torch.randint(0, 128, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert report.steps == 2
    paths = {m.path for m in report.devices[0].modules}
    assert {"GPT2LMHeadModel", "transformer.h.0.attn", "transformer.h.1.mlp.c_fc"} <= paths
    bw = {p.module for p in report.devices[0].timeline if p.phase == "backward"}
    assert {"lm_head", "transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_attn"} <= bw
    assert no_hooks_left(model)


def test_manual_steps_and_steps_only_mode():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    with track(model, device="cpu", budget="64MiB", per_module=False) as tracker:
        for _ in range(4):
            model(torch.randn(8, 32)).sum().backward()
            tracker.step()
    report = tracker.report()
    assert report.steps == 4 and report.mode == "steps-only"
    assert [m.path for m in report.devices[0].modules] == ["Sequential"]
    # no zero_grad: from the second step on, backward holds the parameters and their gradients
    params = sum(p.numel() * 4 for p in model.parameters())
    assert report.devices[0].phase_peaks["backward"] >= 2 * params


def test_oom_post_mortem_names_module_and_propagates():
    model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, opt, device="cpu", budget="16MiB", postmortem=None) as tracker,
    ):
        for batch in (16, 4096):
            model(torch.randn(batch, 256)).sum().backward()
            opt.step()
    pm = tracker.report().oom
    assert pm is not None
    assert (pm.step, pm.phase, pm.module) == (1, "forward", "0")
    assert pm.tried_to_allocate == 4096 * 2048 * 4
    assert pm.capacity == 16 * 1024**2 and pm.breakdown is not None
    # hand count at the failed forward: the parameters, step 0's gradients (never zeroed) and
    # the batch of 4096 x 256 float32 whose first layer's output did not fit: on the device
    # when the forward began ("other", as a GPU script's .to("cuda")), no activation yet
    params = (256 * 2048 + 2048 + 2048 * 10 + 10) * 4
    assert pm.breakdown.parameters == pm.breakdown.gradients == params
    assert pm.breakdown.other == 4096 * 256 * 4 and pm.breakdown.activations == 0
    assert pm.breakdown.optimizer_state == 0
    assert "step 1, forward of 0" in str(pm)
    assert any(a.code.startswith("oom-") for a in pm.advice)
    assert no_hooks_left(model)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad-enabled"])
def test_an_evaluation_oom_counts_its_own_batch_as_other_and_its_outputs_as_activations(
    grad: bool,
) -> None:
    """A ``test()`` after training ran out in its pass over a large test batch: the batch (made
    before the pass, as ``data.to(device)``) was filed as activations, since an evaluation
    pass's base was the last training forward's. Hand count: the pass added the first layer's
    output (2048 x 1024 float32) before the ReLU's request failed; the test batch (2048 x
    256) is other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                          nn.ReLU(), nn.Linear(1024, 10))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, opt, device="cpu", budget="32MiB", postmortem=None) as tracker,
    ):
        for _ in range(3):
            x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)  # (after the forward: the gradients stay)
            loss.backward()
            opt.step()
        del x, y, loss
        model.eval()
        with torch.set_grad_enabled(grad):
            test_batch = torch.randn(2048, 256)
            model(test_batch)
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "eval" and pm.breakdown is not None
    bd = pm.breakdown
    params = sum(p.numel() * 4 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))  # Adam's float32 step counts
    assert bd.parameters == bd.gradients == params and bd.optimizer_state == 2 * params + steps
    assert bd.activations == 2048 * 1024 * 4  # the first layer's output
    assert bd.other == bd.total - 4 * params - steps - bd.activations >= 2048 * 256 * 4
    assert bd.other < 2048 * 256 * 4 + (1 << 20)  # (and at most the loader's odds and ends)


def test_oom_post_mortem_printed_to_stderr(capsys):
    model = nn.Linear(64, 64)
    with pytest.raises(torch.OutOfMemoryError), track(model, device="cpu", budget="1MiB"):
        model(torch.randn(8192, 64))
    assert "memkit: out of memory on cpu" in capsys.readouterr().err


def accumulate_leak(steps: int, tracker_box: list) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    running_loss = 0.0
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        tracker_box.append(tracker)
        for _ in range(steps):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
            running_loss += loss
    del running_loss


def test_leak_named_by_variable():
    box: list = []
    accumulate_leak(8, box)
    report: TrackReport = box[0].report()
    leak = report.devices[0].leak
    assert leak is not None and leak.growth_per_step > 0
    top = leak.suspects[0]
    assert top.name == "running_loss" and top.growing and top.function == "accumulate_leak"
    assert "running_loss += loss" in top.code
    advice = [a for a in report.advice if a.code == "graph-retained"]
    assert advice and "loss.item()" in advice[0].action


def lstm_bptt(steps: int, detach: bool) -> TrackReport:
    """pytorch/examples' word_language_model loop (truncated BPTT, manual SGD), with its
    ``repackage_hidden`` or without it (``retain_graph=True`` silencing the error that
    follows): then ``hidden`` carries every earlier step's graph into the next."""
    torch.manual_seed(0)
    encoder, rnn, decoder = nn.Embedding(100, 16), nn.LSTM(16, 32, 2), nn.Linear(32, 100)
    params = [*encoder.parameters(), *rnn.parameters(), *decoder.parameters()]
    corpus = torch.randint(0, 100, (10 * steps + 1, 4))
    with track(device="cpu", budget="64MiB") as tracker:
        hidden = (torch.zeros(2, 4, 32), torch.zeros(2, 4, 32))
        for i in range(0, 10 * steps, 10):
            if detach:
                hidden = tuple(h.detach() for h in hidden)
            output, hidden = rnn(encoder(corpus[i : i + 10]), hidden)
            loss = nn.functional.cross_entropy(decoder(output).flatten(0, 1),
                                               corpus[i + 1 : i + 11].flatten())  # fmt: skip
            for p in params:
                p.grad = None
            loss.backward(retain_graph=not detach)
            for p in params:
                p.data.add_(p.grad, alpha=-0.1)
    return tracker.report()


def test_a_hidden_state_never_detached_is_named_with_its_fix():
    """The graph grows through the LSTM's ``hidden`` tuple (its length stays 2): ``hidden`` is
    the suspect, and the fix is to detach it where a step begins, not ``.item()``."""
    report = lstm_bptt(9, detach=False)
    leak = report.devices[0].leak
    assert leak is not None
    top = leak.suspects[0]
    assert top.name == "hidden" and top.growing and top.carried
    assert top.code.startswith("output, hidden = rnn(")
    advice = [a for a in report.advice if a.code == "graph-retained"]
    assert advice and "Detach `hidden`" in advice[0].action and ".item()" not in advice[0].action
    healthy = lstm_bptt(9, detach=True)
    assert healthy.leaks == [] and not [a for a in healthy.advice if a.code == "graph-retained"]


def test_the_leak_named_is_the_variable_kept_not_what_is_derived_from_it():
    """``total_loss += loss`` then ``logs = {"loss": total_loss / step}``: the suspect is
    ``total_loss`` (the dict only shows it), with the ``.item()`` fix; a list that grows by
    ``append(logits)`` gets the append fix for tensors of their own size (``.detach().cpu()``,
    never ``.item()``), not 'detach a carried state'."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        total_loss = 0
        all_logits = []
        for step in range(1, 9):
            logits = model(torch.randn(32, 64))
            loss = nn.functional.cross_entropy(logits, torch.randint(0, 10, (32,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss
            logs = {"train_loss": total_loss / step, "lr": 0.1}
            all_logits.append(logits)
    assert logs and all_logits
    leak = tracker.report().devices[0].leak
    assert leak is not None
    names = [s.name for s in leak.suspects]
    assert names.index("total_loss") < names.index("logs")

    def only(*kept: str) -> LeakFinding:
        return dataclasses.replace(leak, suspects=tuple(s for s in leak.suspects if s.name in kept))

    assert (
        "`total_loss += loss.item()`"
        in graph_retained_advice([only("total_loss", "logs")])[0].action
    )
    lists = only("all_logits")
    assert not lists.suspects[0].carried
    # (32, 10) logits: `.item()` would raise; detached, their own bytes stay: off the device
    action = graph_retained_advice([lists])[0].action
    assert "`all_logits.append(logits.detach().cpu())`" in action and ".item()" not in action


def ppo_style_logging() -> TrackReport:
    """A PPO-style loop that logs a dict of per-step metric dicts: ``pg`` keeps its graph
    two levels deep."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics: dict[str, dict[str, Any]] = {}
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for step in range(10):
            out = model(torch.randn(32, 64))
            pg = out.logsumexp(-1).mean()
            vf = out.pow(2).mean()
            loss = pg + vf
            opt.zero_grad()
            loss.backward()
            opt.step()
            metrics[f"step{step}"] = {"pg": pg, "vf": vf.item()}
    return tracker.report()


def test_a_dict_of_per_step_metric_dicts_is_scanned_and_its_fix_fits_a_dict():
    """The suspect is ``metrics``, at the line that fills it, and the fix is a dict
    assignment, not ``.append``."""
    leak = ppo_style_logging().devices[0].leak
    assert leak is not None
    top = leak.suspects[0]
    assert top.name == "metrics" and top.growing
    assert top.code == 'metrics[f"step{step}"] = {"pg": pg, "vf": vf.item()}'
    advice = graph_retained_advice([leak])[0]
    assert advice.code == "graph-retained" and "`metrics[key] = x.item()`" in advice.action


def test_growth_from_kept_batches_is_not_blamed_on_the_steps_loss():
    """A list of batches built before training: on the simulated device each batch counts
    from the step that first feeds it to the model, so memory climbs batch by batch while no
    graph grows. The step's ``loss`` held a graph at each boundary but is not the cause:
    ``memory-growth`` says so and counts the batches still alive; no ``graph-retained``."""
    torch.manual_seed(0)
    batches = [(torch.randn(128, 256), torch.randint(0, 10, (128,))) for _ in range(8)]
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for x, y in batches:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = tracker.report()
    leak = report.devices[0].leak
    assert leak is not None and not leak.suspects[0].growing
    # the batches counted while it grew (the climb began at step 2)
    assert leak.held_batches >= 4 and leak.held_batch_bytes >= 4 * 128 * 256 * 4
    codes = [a.code for a in report.advice]
    assert "graph-retained" not in codes and "memory-growth" in codes
    growth = report.advice[codes.index("memory-growth")]
    assert "still alive" in growth.evidence and "the simulated device counts" in growth.evidence
    # on a GPU nothing grows: information, no warning and no saving promised
    assert growth.severity == "info" and growth.saving_bytes is None
    assert "no leak" in growth.title


@pytest.mark.parametrize("schedule", ["curriculum", "length-buckets"])
def test_a_batch_that_grows_on_schedule_is_no_leak(schedule):
    """Progressive batch sizes and sorted length buckets: the level at each step boundary
    rises with the live batch (the loop's ``x``), three rises in a row, yet nothing is kept
    from step to step. The boundary discounts the last training forward's input while it
    lives: no leak, no advice about one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for step in range(16):
            if schedule == "curriculum":
                batch, length = 8 * 2 ** (step // 2), 16
            else:
                batch, length = 8, 8 * 2 ** (step % 4)
            x = torch.randint(0, 100, (batch, length))
            loss = model(x).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = tracker.report()
    assert report.leaks == []
    assert not [a for a in report.advice if a.code in ("memory-growth", "graph-retained")]


def progressive_unfreezing(epochs: int, steps: int) -> TrackReport:
    """ULMFiT-style: the head trains first, then one frozen layer more per epoch. Each
    epoch's ``loss`` is a new graph, larger than the last (one more layer requires grad),
    and memory rises once an epoch by the new layer's gradient and optimizer state."""
    torch.manual_seed(0)
    backbone = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
    head = nn.Linear(64, 10)
    model = nn.Sequential(*[m for layer in backbone for m in (layer, nn.ReLU())], head)
    backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for epoch in range(epochs):
            if 0 < epoch <= len(backbone):
                backbone[-epoch].requires_grad_(True)
            for _ in range(steps):
                loss = nn.functional.cross_entropy(
                    model(torch.randn(16, 64)), torch.randint(0, 10, (16,))
                )
                loss.backward()
                opt.step()
                opt.zero_grad()
    return tracker.report()


def test_progressive_unfreezing_with_gradients_kept_across_steps_is_no_leak():
    """Review: with `zero_grad(set_to_none=False)` and plain SGD (no state) the new layers'
    gradients are the rise, alive at every boundary; once gradients were left out of the
    bytes a rise is compared with, it was called a leak. The trainable parameters' bytes
    stand for their gradients now: no leak, the note. The gradients the advice quotes are the
    last steps', which grew with each unfrozen layer."""
    torch.manual_seed(0)
    layers = [nn.Linear(128, 128) for _ in range(5)]
    model = nn.Sequential(*layers).requires_grad_(False)
    layers[-1].requires_grad_(True)
    opt = torch.optim.SGD(layers[-1].parameters(), lr=1e-3)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for step in range(16):
            if step and step % 4 == 0:
                layers[-1 - step // 4].requires_grad_(True)
                opt.add_param_group({"params": layers[-1 - step // 4].parameters()})
            model(torch.randn(8, 128)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    report = tracker.report()
    assert report.leaks == [] and [n for n in report.notes if "not a leak" in n]
    # zero-grad-keeps-grads quotes the gradients the peak's backward began with, all four
    # layers', not the first steps' one (sweep CH: the head's 20 KiB of 6 MiB)
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert trained == 4 * (128 * 128 + 128) * 4
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    assert adv.title.startswith(f"{format_size(trained)} of gradients"), adv.title


def test_a_state_a_module_keeps_undetached_makes_the_steps_loss_a_growing_graph():
    """Truncated backprop with the state inside the model: ``self.h`` is never detached, so
    each step's ``loss`` (a new root) reaches every earlier step's nodes. It is the leak
    (graph-retained), not generic memory growth."""

    class Stateful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.Linear(64, 64)
            self.h = torch.zeros(32, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.h = torch.tanh(self.cell(x + self.h))  # never detached
            return self.h

    torch.manual_seed(0)
    model = Stateful()
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(12):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            for p in model.parameters():
                p.grad = None
            loss.backward(retain_graph=True)
            for p in model.parameters():  # .data: the retained graph's versions stay
                p.data.add_(p.grad, alpha=-0.01)
    report = tracker.report()
    leak = report.devices[0].leak
    assert leak is not None and [(s.name, s.growing) for s in leak.suspects][:1] == [("loss", True)]
    assert "graph-retained" in [a.code for a in report.advice]


def test_progressive_unfreezing_is_not_blamed_on_the_steps_loss():
    """``loss``'s graph is larger at each scan, but built afresh each step: it holds none of
    the nodes an earlier scan saw, so it did not grow and is no suspect (``graph-retained``
    named it, with a ``.item()`` fix)."""
    report = progressive_unfreezing(5, 4)
    assert len(report.devices[0].steps) == 20
    assert "graph-retained" not in [a.code for a in report.advice]
    assert not [s for leak in report.leaks for s in leak.suspects if s.growing]
    # and the rises are the new layers' gradients and AdamW moments: no leak at all, a note
    assert report.leaks == []
    layer = (64 * 64 + 64) * 4  # a Linear(64, 64)'s weight and bias
    # its two moments and AdamW's two step counters: its gradients are freed by zero_grad()
    # before the next forward, where the level a step leaves behind is read
    per_layer = 2 * layer + 2 * 4
    (note,) = [n for n in report.notes if "not a leak" in n]
    assert note.startswith(f"cpu: memory rose by {format_size(4 * per_layer)} at step(s) 4, 8, ")


def test_growth_every_n_steps_is_described_by_its_rises():
    """A cache that keeps a 4 KiB tensor every 4th step: the finding says 4 KiB every 4
    steps, from the step before the first rise (it said the average since the warm-up:
    3.53 KiB every 3 steps here)."""
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cache = []
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for step in range(20):
            out = model(torch.randn(8, 64))
            if step % 4 == 3:  # made in the step: the simulated device counts it
                cache.append(out.detach().repeat(2, 1))
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (leak,) = tracker.report().leaks
    assert len(cache) == 5  # 16 x 64 floats each, kept at steps 3, 7, 11, 15, 19
    assert leak.period == 4 and leak.growth_per_step * leak.period == 16 * 64 * 4
    # the rise at step 19 is not read: a step's level is read where the next step's forward
    # begins (what it left behind), and none follows the last one
    assert leak.first_step == 2 and leak.steps == 15 - 2


def test_no_leak_reported_for_healthy_loop():
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        train(model, opt, 7)
    report = tracker.report()
    assert report.leaks == [] and not [a for a in report.advice if a.code == "graph-retained"]


def dcgan_keeping_fakes(keep: str, steps: int = 8) -> tuple[TrackReport, list[torch.Tensor]]:
    """pytorch/examples' DCGAN loop (D's update, then G's), with the generated batch kept
    every step by a nested ``train()`` closing over ``fakes``: with its graph (``"fake"``),
    detached (``"detach"``); ``D_losses`` keeps D's loss with its graph."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 3 * 16 * 16), nn.Tanh(), nn.Unflatten(1, (3, 16, 16)))
    disc = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 1), nn.Sigmoid())
    opt_d, opt_g = torch.optim.Adam(disc.parameters()), torch.optim.Adam(gen.parameters())
    bce = nn.BCELoss()
    fakes: list[torch.Tensor] = []
    D_losses: list[Any] = []

    def train() -> None:
        for _ in range(steps):
            real, ones, zeros = torch.randn(8, 3, 16, 16), torch.ones(8), torch.zeros(8)
            opt_d.zero_grad()
            fake = gen(torch.randn(8, 16))
            err_d = bce(disc(real).squeeze(1), ones) + bce(disc(fake.detach()).squeeze(1), zeros)
            err_d.backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake).squeeze(1), ones).backward()
            opt_g.step()
            D_losses.append(err_d if keep == "errD" else err_d.item())
            if keep == "fake":
                fakes.append(fake)
            if keep == "detach":
                fakes.append(fake.detach())

    with track(device="cpu", budget="64MiB") as tracker:
        train()
    return tracker.report(), fakes


def test_a_list_of_detached_device_tensors_that_grows_is_named():
    """``fakes.append(fake.detach())``: no graph, but the images stay on the device, one
    batch a step. The list is named at its line (once, though ``main`` holds it too), with
    the bytes a step adds (an image batch, counted here), and the fix moves them off the
    device (detaching alone is what the script does already)."""
    report, fakes = dcgan_keeping_fakes("detach")
    batch = fakes[0].numel() * fakes[0].element_size()
    leak = report.devices[0].leak
    assert leak is not None and leak.growth_per_step == batch
    top = leak.suspects[0]
    assert (top.name, top.graph, top.growing) == ("fakes", False, True)
    assert top.code == "fakes.append(fake.detach())" and top.function == "train"
    assert top.item_bytes == batch and top.bytes_per_step == batch
    assert top.item_shape == (8, 3, 16, 16) and top.tensor_bytes == top.length * batch
    assert top.length < len(fakes)  # scanned when the growth was confirmed, not at the end
    assert [s.name for s in leak.suspects].count("fakes") == 1
    codes = [a.code for a in report.advice]
    assert "tensors-kept" in codes and "memory-growth" not in codes
    advice = report.advice[codes.index("tensors-kept")]
    assert "`fakes.append(fake.detach().cpu())`" in advice.action
    # the growth measured over the climb, not a step's: what the fix frees by its end
    assert advice.saving_bytes == leak.grown_bytes == batch * leak.steps


def test_a_kept_image_batch_with_its_graph_gets_a_fix_that_fits_its_shape():
    """``fakes.append(fake)`` keeps (8, 3, 16, 16) images with their graph: ``.item()`` would
    raise, and ``.detach()`` keeps the images' bytes; backward freed the graph's saved
    tensors, so detaching saves nothing on the device: what the detached twin grows by."""
    report, _ = dcgan_keeping_fakes("fake")
    leak = report.devices[0].leak
    assert leak is not None and leak.suspects[0].name == "fakes" and leak.suspects[0].graph
    advice = next(a for a in report.advice if a.code == "graph-retained")
    assert ".item()" not in advice.action and "`fakes.append(fake.detach().cpu())`" in advice.action
    detached, _ = dcgan_keeping_fakes("detach")
    twin = detached.devices[0].leak
    assert twin is not None
    saved_by_detach = leak.growth_per_step - twin.growth_per_step
    assert f"({format_size(saved_by_detach)} per step here" in advice.action
    assert advice.saving_bytes == leak.grown_bytes  # `.cpu()` frees all of it


def test_a_list_a_nested_function_closes_over_is_named_once():
    report, _ = dcgan_keeping_fakes("errD")
    leak = report.devices[0].leak
    assert leak is not None
    names = [s.name for s in leak.suspects]
    assert names[0] == "D_losses" and names.count("D_losses") == 1
    advice = next(a for a in report.advice if a.code == "graph-retained")
    assert advice.evidence.count("`D_losses`") == 1


class ReplayMemory:
    """The DQN tutorial's replay memory: a deque with a capacity."""

    def __init__(self, capacity: int) -> None:
        self.memory: collections.deque[tuple[torch.Tensor, ...]]
        self.memory = collections.deque(maxlen=capacity)

    def push(self, *transition: torch.Tensor) -> None:
        self.memory.append(transition)


def test_a_replay_memory_filling_up_is_named_and_said_to_level_off():
    """DQN: each step's state is made then (on a GPU too) and pushed into the replay memory,
    a deque with a maxlen: memory grows while it fills, then levels off. The deque is named
    (an attribute of the script's object, at the method that grows it) with where it stops;
    not explained as batches the simulated device counts late."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Flatten(), nn.Linear(4 * 12 * 12, 4))
    opt = torch.optim.AdamW(policy.parameters())
    memory = ReplayMemory(40)
    with track(policy, opt, device="cpu", budget="64MiB") as tracker:
        state = torch.randn(1, 4, 12, 12)
        for _ in range(12):
            with torch.no_grad():
                action = policy(state).argmax(1, keepdim=True)
            next_state = torch.randn(1, 4, 12, 12)
            memory.push(state, action, next_state, torch.ones(1))
            state = next_state
            batch = torch.cat([t[0] for t in list(memory.memory)[-4:]])
            loss = policy(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = tracker.report()
    leak = report.devices[0].leak
    assert leak is not None
    top = leak.suspects[0]
    assert (top.name, top.function, top.maxlen, top.graph) == (
        "memory.memory",
        "ReplayMemory.push",
        40,
        False,
    )
    assert top.code == "self.memory.append(transition)"
    # one more transition: a new state (the last one's next_state), an action and a reward
    state_bytes = 4 * 12 * 12 * 4
    assert top.item_bytes == state_bytes + 8 + 4
    # what the deque held when scanned, each storage once (its first transition's two states)
    held = list(memory.memory)[: top.length]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for tr in held
                for t in tr}  # fmt: skip
    assert top.tensor_bytes == sum(storages.values())
    codes = [a.code for a in report.advice]
    assert "tensors-kept" in codes and "memory-growth" not in codes
    advice = report.advice[codes.index("tensors-kept")]
    assert advice.severity == "info" and "maxlen=40" in advice.evidence
    # full: 40 transitions hold 41 states, 40 actions and 40 rewards
    assert f"about {format_size(41 * state_bytes + 40 * 12)}" in advice.evidence
    assert "simulated device counts" not in advice.evidence


def test_growth_detector_and_scan_helpers():
    det = GrowthDetector(warmup=1, window=3)
    flags = [det.observe(i, level) for i, level in enumerate([5, 10, 10, 20, 30, 40])]
    assert flags == [False, False, False, False, False, True]
    # the climb began at step 2 (level 10, just before the first rise): 30 bytes in 3 steps
    assert det.finding == (10, 2, 3) and det.period == 1
    # a staircase: a rise every third step (an evaluation every 3 steps keeping its graph)
    det = GrowthDetector(warmup=1, window=3)
    levels = [5, 10, 10, 10, 20, 20, 20, 30, 30, 30, 40]
    flags = [det.observe(i, level) for i, level in enumerate(levels)]
    assert flags.index(True) == 10 and det.finding == (3, 3, 7) and det.period == 3
    # a staircase of 1000 bytes every 4 steps, with a 1-byte bump a step before each stair:
    # the bumps count as rises but do not set the period (old: every 2 steps)
    det = GrowthDetector(warmup=1, window=3)
    levels = [0, 0, 0, 1, 1001, 1001, 1001, 1002, 2002, 2002, 2002, 2003, 3003]
    assert [det.observe(i, level) for i, level in enumerate(levels)].count(True) == 4
    assert det.period == 4 and det.finding == (250, 2, 10)  # a typical rise of 1000 per 4
    # a stair seen over two boundaries (a PPO rollout's kept values, part before the update's
    # first step): one stair of 1000 every 5 steps, not two rises 1 step apart (old: every 2)
    det = GrowthDetector(warmup=1, window=3)
    levels = [0, 0, 0, 300, 1000, 1000, 1000, 1000, 1300, 2000, 2000, 2000, 2000, 2300, 3000]
    assert [det.observe(i, level) for i, level in enumerate(levels)].count(True) == 4
    assert det.period == 5 and det.finding is not None and det.finding[0] == 200
    # but steady growth that skips one boundary is still steady (review: one missed rise made
    # the merge fold the climb into one "stair every 23 steps"), and so is a stair every 2
    # steps with a small bump between whose one bump is missing
    steady = lambda i: 0 if i == 7 else 1000  # noqa: E731
    stairs = lambda i: 1000 if i % 2 == 0 else (0 if i == 9 else 50)  # noqa: E731
    for rise_at, period in ((steady, 1), (stairs, 2)):
        det, level = GrowthDetector(warmup=1, window=3), 0
        for i in range(30):
            level += rise_at(i) if i else 0
            det.observe(i, level)
        assert det.period == period
    # healthy noise: levels that come back down never add up to a leak
    det = GrowthDetector(warmup=1, window=3)
    levels = [5, 10, 12, 10, 14, 11, 16, 10, 18, 12, 20]
    assert not any(det.observe(i, level) for i, level in enumerate(levels))
    x = torch.randn(3, requires_grad=True)
    kept = [x * 2, x * 3]
    held = (x * 2).sum()
    assert graph_size(held) >= 2
    found = {c.name: c for c in scan_frames()}
    assert found["kept"].kind == "container" and found["held"].kind == "tensor"
    held = held + (x * 4).sum()
    later = scan_frames()
    suspects = compare_scans(list(found.values()), later)
    assert [s.name for s in suspects if s.growing] == ["held"]
    del kept


def test_a_graph_built_afresh_does_not_grow_and_one_built_on_the_last_does():
    """Between two scans ``loss`` became a larger graph (more layers require grad) made
    afresh: it holds no node of the earlier scan, so it did not grow; ``total`` holds the
    earlier ``total``'s graph and grew. Without ``since`` the sizes alone decide."""
    w = torch.randn(4, requires_grad=True)
    loss = (w * 2).sum()
    total = loss * 1
    before = scan_frames()
    loss = (w * 2).sin().cos().sum()
    total = total + loss
    after = scan_frames(since=before)
    was, now = {c.name: c for c in before}, {c.name: c for c in after}
    assert now["loss"].size > was["loss"].size and now["loss"].carries is False
    assert now["total"].carries is True
    assert [s.name for s in compare_scans(before, after) if s.growing] == ["total"]
    blind = scan_frames()
    assert {s.name for s in compare_scans(before, blind) if s.growing} == {"loss", "total"}


def test_growth_of_persistent_bytes_is_explained_not_a_leak():
    """Rises that parameters, gradients and optimizer state account for (progressive
    unfreezing) are not counted; a leak climbing meanwhile is, at its own rate. The detector
    asks for the persistent bytes only at rises (and once after the warm-up)."""

    def run(levels: list[int], persistent: list[int]) -> tuple[GrowthDetector, list[bool], int]:
        det, flags, asked = GrowthDetector(warmup=1, window=3), [], 0
        for i, (level, p) in enumerate(zip(levels, persistent, strict=True)):
            wanted = det.wants_persistent(level)
            asked += wanted
            flags.append(det.observe(i, level, p if wanted else None))
        return det, flags, asked

    stairs = [100, 100, 150, 150, 200, 200, 250, 250, 300, 300]
    det, flags, asked = run(stairs, [s - 60 for s in stairs])
    assert not any(flags) and det.explained == [(2, 50), (4, 50), (6, 50), (8, 50)]
    assert asked == 5  # step 1 (after the warm-up), then the four rises
    det, flags, _ = run(stairs, [40] * len(stairs))  # nothing persistent grew: a leak
    assert flags[6] and det.finding == (25, 1, 7) and det.period == 2 and not det.explained
    leaking = [100 + 10 * i + (50 if i >= 4 else 0) for i in range(8)]
    det, flags, _ = run(leaking, [40 if i < 4 else 90 for i in range(8)])
    assert flags.index(True) == 4 and det.explained == [(4, 50)]
    assert det.finding == (10, 1, 6)  # 110 -> 220 over steps 1..7, less the explained 50


def test_eval_without_no_grad_advice():
    model = cnn()
    model.eval()
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(torch.randn(4, 3, 16, 16))
        with torch.no_grad():
            model(torch.randn(4, 3, 16, 16))
    report = tracker.report()
    assert report.eval_grad_forwards == 2
    assert [a.code for a in report.advice] == ["eval-grad-enabled"]


def test_results_precomputed_with_grad_and_kept_into_training_lower_its_peak():
    """Sweep CI: a DPO reference's log-probs precomputed over the data with grad on (a
    reference frozen by ``.eval()`` only), kept in a list that training reads: the graphs
    stay alive under every step, and the advice said "Training sets the peak: no_grad lowers
    the evaluation's memory, not the peak". The claim is what no_grad takes off training's
    peak, measured by running the same script with it."""

    def run(no_grad: bool) -> TrackReport:
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 1)).eval()
        model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 1))
        opt = torch.optim.AdamW(model.parameters())
        data = [torch.randn(256, 64) for _ in range(6)]
        with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                cache = [ref(x) for x in data]
            for x, r in zip(data, cache, strict=True):
                (model(x) - r).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return tracker.report()

    report, fixed = run(False), run(True)
    (adv,) = [a for a in report.advice if a.code == "eval-grad-enabled"]
    assert "lowers training's peak too" in adv.evidence
    saved = report.devices[0].peak_allocated - fixed.devices[0].peak_allocated
    assert saved > 4 << 20
    assert adv.saving_bytes is not None and saved <= adv.saving_bytes <= 1.15 * saved


def test_a_model_frozen_by_requires_grad_records_no_graph_in_eval():
    """Sweep CI: a DPO reference frozen by ``requires_grad_(False)`` alone, run in eval mode
    with autograd on, was told its 8 passes "kept 1.00 MiB of activations for a backward
    that never comes": its output has no graph, and its peaks equal a no_grad reference's."""
    model = cnn().eval().requires_grad_(False)
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(torch.randn(4, 3, 16, 16))
    report = tracker.report()
    assert report.eval_grad_forwards == 0
    assert "eval-grad-enabled" not in {a.code for a in report.advice}

    # review: a trainable model's pass records a graph whatever it returns (VQ codes, argmax)
    class Codes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = cnn()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).argmax(-1)

    codes = Codes().eval()
    with track(codes, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            codes(torch.randn(4, 3, 16, 16))
    assert tracker.report().eval_grad_forwards == 2

    # sweep CL: a perceptual loss's frozen feature net, fed the trained model's output, is
    # part of training's graph: its backward comes
    features = cnn().eval().requires_grad_(False)
    decoder = nn.Conv2d(3, 3, 3, padding=1)
    opt = torch.optim.SGD(decoder.parameters(), lr=0.1)
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            x = torch.randn(4, 3, 16, 16)
            features(decoder(x)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert report.eval_grad_forwards == 0
    assert "eval-grad-enabled" not in {a.code for a in report.advice}


def test_per_device_routing_with_replica_threads(monkeypatch):
    """DataParallel-like: one replica per thread, each on its own (simulated meta) device."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    local = threading.local()
    monkeypatch.setattr(device_set, "current_device_index", lambda kind: local.index)
    local.index = 0
    with track(model.to("meta"), device="meta:0", budget="1GiB", postmortem=None) as tracker:
        tracker.state.single = None  # pretend several devices are visible
        tracker.devices.add(torch.device("meta", 1))
        # Stand-ins for CUDA devices, whose counters count everything made on them: the
        # tracker's switches (and its adoption of the batch) belong to its one simulated device,
        # and put replica 1's batch on device 0's count (freed mid-forward of replica 0, it
        # shrank device 0's growth when the threads interleaved so)
        tracker.devices.sim = None
        for dev in tracker.devices.records.values():
            dev.backend.count_ops(True, True)
        replicas = [copy.deepcopy(model) for _ in range(2)]  # shares the hooks, like replicate()
        # deepcopy leaves cyclic garbage holding counted storages: freed by a collection that
        # could land inside a replica's forward and shrink its measured growth (under load)
        gc.collect()
        errors: list[BaseException] = []

        def run(i: int, batch: int) -> None:
            local.index = i
            try:
                with tracker.devices.records[i].backend.activate():
                    replicas[i](torch.randn(batch, 64, device="meta")).sum()
            except BaseException as exc:  # pragma: no cover - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i, b)) for i, b in ((0, 512), (1, 64))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    report = tracker.report()
    assert [d.device for d in report.devices] == ["meta:0", "meta:1"]
    d0, d1 = report.devices
    assert {m.path for m in d0.modules} == {m.path for m in d1.modules} >= {"0", "2"}
    act0 = next(m for m in d0.modules if m.path == "0").activation_bytes
    act1 = next(m for m in d1.modules if m.path == "0").activation_bytes
    assert act0 >= 512 * 256 * 4 and 64 * 256 * 4 <= act1 < act0
    assert d0.peak_allocated > d1.peak_allocated


def test_deepcopy_of_a_tracked_model_inside_the_block():
    """An EMA copy made during tracking must not try to copy the tracker."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with track(model, device="cpu", budget="8MiB") as tracker:
        ema = copy.deepcopy(model)
        ema(torch.randn(2, 8))
    assert tracker.report().devices[0].modules
    ema(torch.randn(2, 8))  # its copied hooks are inert after the block


def test_a_loader_in_another_thread_leaves_the_counting_alone():
    """A prefetch thread's DataLoader must not switch off the simulated device for the
    training thread (the fetch wrapper is on the class, so it runs in every thread)."""
    import threading

    from torch.utils.data import DataLoader, Dataset

    seen = []

    class Data(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            seen.append((acct.counting, acct.adopting))
            return torch.zeros(1)

    with track(device="cpu", budget="64MiB") as tracker:
        acct = tracker.devices.sim.accountant
        acct.counting = acct.adopting = True  # the training thread is mid-step
        worker = threading.Thread(target=lambda: list(DataLoader(Data())))
        worker.start()
        worker.join()
    assert seen and all(flags == (True, True) for flags in seen)


def test_the_users_own_warning_filter_survives_the_block():
    import warnings

    from memkit.tracking.hooks import _COMPILE_WARNING

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
        mine = warnings.filters[0]
        with track(device="cpu", budget="64MiB"):
            pass
        assert mine in warnings.filters


def test_track_takes_the_trackers_arguments():
    """``track()`` once dropped two of ``Tracker``'s arguments: their signatures must match."""
    import inspect

    from memkit.tracking import Tracker

    tracker = dict(inspect.signature(Tracker.__init__).parameters)
    del tracker["self"]
    assert list(inspect.signature(track).parameters.values()) == list(tracker.values())


def test_postmortem_bytes_in_use_are_those_at_the_failure(tmp_path):
    """The post-mortem's bytes in use are those when the allocation failed, exactly (the
    memory history's OOM event is the independent count), not the last hook's reading: a
    tiny GPT-2 failing in training held 64 KiB more than that reading."""
    transformers = pytest.importorskip("transformers")
    from memkit.inspection import inspect_snapshot

    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (4, 32))
    path = tmp_path / "oom.pickle"
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(
            model, device="cpu", budget="600KiB", postmortem=None, memory_history=path
        ) as tracker,  # fmt: skip
    ):
        model(input_ids=ids, labels=ids).loss.backward()
    pm = tracker.report().oom
    (event,) = inspect_snapshot(path).device(0).ooms
    assert pm is not None and pm.allocated == event.allocated
    assert pm.free == pm.capacity - pm.allocated


def test_a_model_fed_a_non_leaf_tensor_draws_no_warning_from_memkit():
    """A GAN's D(G(z)): the batch is a non-leaf that requires grad, whose ``.grad`` torch warns
    about reading. Tracking must not read it (the user would see torch's warning point into
    memkit)."""
    import warnings

    generator, discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with track(device="cpu", budget="64MiB") as tracker:
            for _ in range(2):
                discriminator(generator(torch.randn(8, 4))).mean().backward()
    assert tracker.report().steps == 2


def test_a_gan_is_not_gradient_accumulation_but_accumulation_is():
    """Two optimizers, each stepping after its own backward (a GAN's D and G): one backward
    per optimizer step, not two micro-batches; four backward passes before one step are."""
    gen, disc = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_d, opt_g = torch.optim.Adam(disc.parameters()), torch.optim.Adam(gen.parameters())
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(4):
            fake = gen(torch.randn(16, 8))
            opt_d.zero_grad()
            disc(fake.detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            (-disc(fake).mean()).backward()
            opt_g.step()
    gan = tracker.report()
    assert gan.steps == 4 and gan.micro_batches == 1
    assert "gradient accumulation" not in str(gan)

    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())  # its first step (state made) is the peak
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            for _ in range(4):
                model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    accumulated = tracker.report()
    assert accumulated.steps == 3 and accumulated.micro_batches == 4
    assert "gradient accumulation: up to 4 backward passes per optimizer step" in str(accumulated)
    # the breakdown's step is one of the report's steps (not a micro-batch's number, counted
    # before the first optimizer step showed they were micro-batches)
    dev = accumulated.devices[0]
    assert dev.breakdown is not None
    assert [s.step for s in dev.steps] == [0, 1, 2]
    assert dev.breakdown.step in (0, 1, 2)


def test_a_gan_forward_peak_counts_the_gradients_alive_then_not_those_left_at_its_end():
    """Sweep KK's GAN (two optimizers, G's update then D's): the peak is D's loss after its
    forwards, when G's and D's gradients (both from G's backward) are alive; ``opt_d.zero_grad()``
    frees D's before the forward phase ends. The breakdown had G's only and D's in "other";
    gradients at a forward's peak are those alive at the last mark before it (a model's
    forward returning), never more than the forward began with."""
    report, gen, disc = two_step_gan(False)
    bd = report.devices[0].breakdown
    assert bd is not None and bd.phase == "forward"
    # hand count: every parameter of both models has a float32 gradient there
    g_bytes = sum(p.numel() * 4 for p in gen.parameters())  # 41,728
    d_bytes = sum(p.numel() * 4 for p in disc.parameters())  # 33,796
    assert bd.gradients == g_bytes + d_bytes
    assert dict(bd.gradient_models) == {"Sequential": g_bytes, "Sequential#2": d_bytes}
    # other: the batch x, z and the generated batch (and a few scalars), not D's gradients
    batch = (32 * 64 + 32 * 16 + 32 * 64) * 4
    assert batch <= bd.other < batch + 1024


def test_an_optimizer_step_holding_another_optimizers_gradients_prices_freeing_them():
    """Sweep CK: a Lightning GAN with manual optimization (``toggle_optimizer``: the other
    model frozen for each update), each optimizer zeroing right before its own backward: a
    phase of one model's update holds the other's gradients, kept from its step (the sweep's
    peak: the generator's step with the discriminator's; here: the discriminator's backward
    with the frozen generator's). zero-grad-keeps-grads said "Training's peak came in
    optimizer, not in a forward: ... no saving is claimed"; following its own action (zero_grad
    right after each step) saved 2.04 MiB there. The claim is the gradients of the parameters
    the peak's work does not update, measured by applying it."""

    def run(fixed: bool) -> TrackReport:
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 784))
        disc = nn.Sequential(nn.Linear(784, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))
        opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)

        def update(opt: torch.optim.Optimizer, trained: nn.Module, loss: Any) -> None:
            for model in (gen, disc):  # Lightning's toggle_optimizer
                model.requires_grad_(model is trained)
            if not fixed:
                opt.zero_grad()  # right before its own backward, as the sweep's script did
            loss().backward()
            opt.step()
            if fixed:  # the advice's action
                opt.zero_grad(set_to_none=True)
            gen.requires_grad_(True)
            disc.requires_grad_(True)

        with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
            for _ in range(4):
                real, fake = torch.randn(64, 784), gen(torch.randn(64, 64))
                update(opt_g, gen, lambda f=fake: bce(disc(f), ones))

                def d_loss(r: torch.Tensor = real, f: torch.Tensor = fake) -> torch.Tensor:
                    return (bce(disc(r), ones) + bce(disc(f.detach()), zeros)) / 2

                update(opt_d, disc, d_loss)
        return tracker.report()

    report, fixed = run(False), run(True)
    bd = report.devices[0].breakdown
    assert bd is not None and bd.phase == "backward" and bd.idle_gradients > 0, bd
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    saved = report.devices[0].peak_allocated - fixed.devices[0].peak_allocated
    assert saved > 512 << 10
    assert adv.saving_bytes is not None and 0.95 * saved <= adv.saving_bytes <= 1.05 * saved


def test_a_discriminator_frozen_for_the_generators_update_trains_in_its_own():
    """pix2pix/CycleGAN's ``set_requires_grad(netD, False)`` for G's update, ``True`` for D's,
    each optimizer zeroing its own gradients: D's forwards in its own update are training
    (not evaluation: D was frozen when first seen); and at D's optimizer step, the peak, the
    breakdown has D's gradients though G's (the optimizer seen first) are freed by then: one
    witness per optimizer."""
    torch.manual_seed(0)
    batch = 8
    gen = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256))
    layers = [nn.Linear(256, 1024)] + [nn.Linear(1024, 1024) for _ in range(3)]
    disc = nn.Sequential(*layers, nn.Linear(1024, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4)
    opt_d = torch.optim.Adam(disc.parameters(), 2e-4, foreach=True)
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(batch, 1), torch.zeros(batch, 1)
    with track(device="cpu", budget="128MiB") as tracker:
        for _ in range(4):
            real, fake = torch.randn(batch, 256), gen(torch.randn(batch, 64))
            disc.requires_grad_(False)
            bce(disc(fake), ones).backward()
            opt_g.step()
            opt_g.zero_grad()
            disc.requires_grad_(True)
            ((bce(disc(real), ones) + bce(disc(fake.detach()), zeros)) / 2).backward()
            opt_d.step()
            opt_d.zero_grad()
    report = tracker.report()
    assert report.eval_forwards == 0
    rows = {m.path: m for m in report.devices[0].modules}
    assert rows["Sequential#2"].calls == 12 and rows["Sequential#2"].eval_calls == 0
    peak = report.devices[0].breakdown
    assert peak is not None and peak.phase == "optimizer"
    assert peak.gradients == sum(p.numel() * p.element_size() for p in disc.parameters())


def test_sparse_gradients_are_gradients_in_the_breakdown():
    """nn.Embedding(sparse=True) under SparseAdam: its gradient is a sparse COO tensor whose
    memory is its indices and values (sweep F: the breakdown counted 0 for it and filed it
    under activations)."""
    torch.manual_seed(0)
    emb = nn.EmbeddingBag(20_000, 32, mode="mean", sparse=True)
    head = nn.Linear(32, 1)
    sparse_opt = torch.optim.SparseAdam(emb.parameters())
    dense_opt = torch.optim.Adam(head.parameters())
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            idx = torch.randint(0, 20_000, (256 * 4,))
            head(emb(idx, torch.arange(0, 256 * 4, 4))).mean().backward()
            sparse_opt.step()
            dense_opt.step()
    grad = emb.weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo
    sparse_bytes = grad._indices().nbytes + grad._values().nbytes
    dense_bytes = sum(p.grad.nbytes for p in head.parameters())
    peak = tracker.report().devices[0].breakdown
    assert peak is not None and peak.phase == "optimizer"
    assert peak.gradients == sparse_bytes + dense_bytes
    assert sum(v for _, v in peak.parts()) == peak.total


class _Recommender(nn.Module):
    """A DLRM-shaped model: dense features through an MLP, categorical ones looked up in
    embedding tables (one row each a sample), an MLP on top."""

    def __init__(self, rows: int, sparse: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, 16, sparse=sparse) for _ in range(3))
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 16))
        self.top = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
        if tied:  # an output layer sharing the first table's weight
            self.out = nn.Linear(16, rows, bias=False)
            self.out.weight = self.tables[0].weight

    def forward(self, dense: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        looked = [t(cats[:, i]) for i, t in enumerate(self.tables)]
        out = self.top(torch.cat([self.bottom(dense), *looked], 1))
        return self.out(out) if hasattr(self, "out") else out


def _train_recommender(rows: int, *, sparse: bool = False, tied: bool = False):
    torch.manual_seed(0)
    model = _Recommender(rows, sparse, tied)
    tables = list(model.tables.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("tables")]
    opts = (
        [torch.optim.Adam(rest), torch.optim.SparseAdam(tables)]
        if sparse
        else [torch.optim.Adam(model.parameters())]
    )
    with track(model, opts[0], device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            cats = torch.randint(0, rows, (128, 3))
            model(torch.randn(128, 13), cats).square().mean().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return tracker.report()


def test_dense_gradients_of_embedding_tables_that_a_step_barely_looks_up_are_advised_sparse():
    """Sweep BQ: a recommender's tables (3 x 20,000 rows) got a gradient of every row from
    each step that looked up 128 of them, and Adam's dense update of them; nothing said that
    ``sparse=True`` with SparseAdam keeps a row per lookup. The claimed saving is checked by
    training the sparse model the advice describes."""
    dense = _train_recommender(20_000)
    (advice,) = [a for a in dense.advice if a.code == "dense-embedding-gradients"]
    assert "tables.0 (1.22 MiB, 128 rows a step)" in advice.evidence
    assert "SparseAdam" in advice.action
    sparse = _train_recommender(20_000, sparse=True)
    assert not [a for a in sparse.advice if a.code == "dense-embedding-gradients"]
    measured = dense.devices[0].peak_allocated - sparse.devices[0].peak_allocated
    assert advice.saving_bytes is not None
    assert abs(advice.saving_bytes - measured) <= 0.05 * measured
    # a table tied to an output layer keeps its dense gradient (the output layer's), and one
    # whose steps look up most of its rows has nothing to gain
    tied = _train_recommender(20_000, tied=True)
    assert "tables.0 " not in " ".join(a.evidence for a in tied.advice)
    assert not [a for a in _train_recommender(256).advice
                if a.code == "dense-embedding-gradients"]  # fmt: skip


def test_what_an_evaluation_between_steps_holds_is_evaluation_not_training():
    """A test loop after training keeps its outputs (here with their graph: no no_grad) while
    it computes its metric: that memory is the evaluation's, so the training peak and its
    breakdown stay training's. A teacher's no_grad forward inside a step (after the student's)
    goes back to the step's forward, where the loss is counted."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher = nn.Linear(256, 10).eval()
    with track(device="cpu", budget="256MiB") as tracker:  # every module: the teacher too
        for _ in range(3):
            model.train()
            x = torch.randn(16, 256)
            student = model(x)
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = nn.functional.cross_entropy(student, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        outs = model(torch.randn(512, 256))  # the graph of 512 x 1024 activations is kept
        _accuracy = (outs.argmax(1) == 0).float().mean()  # as an eval loop reads the outputs
    report = tracker.report()
    dev = report.devices[0]
    held = 2 * 512 * 1024 * 4  # the first Linear's output and ReLU's, kept by the graph
    assert dev.phase_peaks["eval"] >= held > dev.phase_peaks["other"]
    assert dev.breakdown is not None and dev.breakdown.phase != "other"
    assert report.eval_forwards == 4  # the teacher's three and the test's one
    assert report.steps == 3
    # the teacher's row stays in the records (its evaluation calls), not in the table of what
    # training forwards kept
    teacher_rows = [m for m in dev.modules if m.path == "Linear"]
    assert teacher_rows and teacher_rows[0].eval_calls == 3 and teacher_rows[0].calls == 0
    assert "Linear" not in [m.path for m in dev.top_modules(25)]
    assert outs.requires_grad  # the graph the eval peak holds


def test_an_oom_in_a_teachers_forward_gets_the_steps_remedies_not_evaluations():
    """Distillation: the frozen teacher runs under no_grad in eval mode on every training
    batch. Running out there is the training step's problem (smaller micro-batch and
    accumulation, a bf16 teacher), not an evaluation batch to lower; a validation pass of the
    trained model still gets ``oom-eval``."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                            nn.Linear(2048, 10)).eval()  # fmt: skip
    teacher.requires_grad_(False)
    student = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(student.parameters())

    def distill(batch: int) -> None:
        x = torch.randn(batch, 256)
        logits = student(x)
        with torch.no_grad():  # on the step's training batch
            target = teacher(x).softmax(-1)
        loss = nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()

    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="24MiB") as tracker:
        for batch in (16, 16, 1024):
            distill(batch)
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "eval" and pm.step == 2
    size = sum(p.numel() * 4 for p in teacher.parameters())
    # not written in place: fixed; bf16 would free half of its float32 bytes
    assert pm.frozen_model == ("Sequential#2", size, False, size // 2)
    codes = [a.code for a in pm.advice]
    assert "oom-frozen-model" in codes and "oom-eval" not in codes
    assert "offline" in pm.advice[codes.index("oom-frozen-model")].action

    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="24MiB") as tracker:
        distill(16)
        student.eval()
        with torch.no_grad():
            student(torch.randn(60_000, 256))  # a validation batch far too large
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "eval" and pm.frozen_model is None
    assert "oom-eval" in [a.code for a in pm.advice]
    # a copy no optimizer trains (an EMA model) validated on its own batch size: evaluation
    ema = copy.deepcopy(student).eval().requires_grad_(False)
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="24MiB") as tracker:
        distill(16)
        with torch.no_grad():
            ema(torch.randn(60_000, 256))
    pm = tracker.report().oom
    assert pm is not None and pm.frozen_model is None
    assert "oom-eval" in [a.code for a in pm.advice]


def test_a_teacher_called_first_that_runs_out_in_step_0_is_the_steps_not_evaluation():
    """The tutorials' order: the teacher's forward first, then the student's. Running out in
    the teacher in step 0, before any training forward, is the training step's problem; its
    module is named in the teacher's terms (the model seen second would make it so). A model
    with no trainable parameter in a script with no optimizer (inference) stays evaluation."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 10)).eval()
    teacher.requires_grad_(False)
    student = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(student.parameters())
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="4MiB") as tracker:
        x = torch.randn(256, 256)
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = nn.functional.cross_entropy(student(x), target)
        loss.backward()
        opt.step()
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "eval" and pm.step == 0
    size = sum(p.numel() * 4 for p in teacher.parameters())
    assert pm.frozen_model == ("Sequential", size, False, size // 2)
    assert pm.module is not None and pm.module.startswith("Sequential.")
    codes = [a.code for a in pm.advice]
    assert "oom-frozen-model" in codes and "oom-eval" not in codes

    def infer() -> None:  # a script with no optimizer in reach
        with torch.no_grad():
            teacher(torch.randn(256, 256))

    del opt
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="4MiB") as tracker:
        infer()
    pm = tracker.report().oom
    assert pm is not None and pm.frozen_model is None
    assert "oom-eval" in [a.code for a in pm.advice]


def kd_run(teacher: nn.Module, steps: int = 4, eval_batch: int = 16) -> TrackReport:
    """The distillation tutorial's loop: the teacher's forward on the training batch first,
    the student's, one optimizer step; a validation pass of the student after each step."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(student.parameters())
    dtype = next(teacher.parameters()).dtype
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(steps):
            x = torch.randn(128, 256)
            with torch.no_grad():
                target = teacher(x.to(dtype)).float().softmax(-1)
            loss = nn.functional.cross_entropy(student(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            student.eval()
            with torch.no_grad():
                student(torch.randn(eval_batch, 256))
            student.train()
    return tracker.report()


def test_a_teachers_forward_that_sets_the_peak_is_the_steps_not_evaluations():
    """The teacher's forwards on the training batch are evaluation passes (the eval column)
    and peak above training: that is the step's memory, not evaluation's, whose own batch is
    small. The advice names the teacher, not a smaller evaluation batch; its bf16 saving is
    what the same loop with a bf16 teacher saves."""
    teacher = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 10)).eval()
    teacher.requires_grad_(False)
    report = kd_run(teacher)
    dev = report.devices[0]
    assert report.frozen_forwards == 4 and report.frozen_input_shape == (128, 256)
    assert report.eval_input_shape == (16, 256) and report.eval_forwards == 8
    # the teacher's peak: its weights, the batch, its hidden layer and the ReLU's output, on
    # top of the student's weights, gradients and AdamW's two moments (and a few scalars)
    frozen = report.frozen_peaks["cpu"]
    assert frozen == dev.phase_peaks["eval"]
    student = (256 * 64 + 64 + 64 * 10 + 10) * 4
    held = sum(p.numel() * 4 for p in teacher.parameters()) + 128 * 256 * 4 + 4 * student
    assert held + 2 * 128 * 2048 * 4 <= frozen <= held + 2 * 128 * 2048 * 4 + 8 * 1024
    codes = [a.code for a in report.advice]
    assert "frozen-model-peak" in codes and "eval-peak" not in codes
    advice = report.advice[codes.index("frozen-model-peak")]
    assert "`Sequential`" in advice.title and "(128, 256)" in advice.evidence
    assert "bfloat16" in advice.action and advice.saving_bytes is not None
    half = kd_run(teacher.to(torch.bfloat16))
    saved = report.peak_allocated - half.peak_allocated
    assert advice.saving_bytes <= saved  # the claim is the weights' half; activations add
    assert "evaluation: 8 forward pass(es), 4 of them by `Sequential`" in str(report)
    # evaluation on a batch of its own far larger than the step: eval-peak, with its shape
    small = nn.Sequential(nn.Linear(256, 10)).eval().requires_grad_(False)
    report = kd_run(small, eval_batch=4096)
    codes = [a.code for a in report.advice]
    assert "eval-peak" in codes and "frozen-model-peak" not in codes
    assert "(4096, 256)" in report.advice[codes.index("eval-peak")].evidence


def test_one_oversized_batch_is_the_steps_own_not_memory_kept_across_steps():
    """A giant batch (a long-sequence or bucketed one) after small ones: it is allocated
    before the forward, so the breakdown files it under "other"; it is the step's own batch,
    not kept memory (no ``oom-other``): ``oom-batch`` gives its bytes and what the step asked
    for. Outputs a script does keep across steps still get ``oom-other``, the batch left out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="64MiB") as tracker:
        for batch in (64, 64, 50_000):
            x, y = torch.randn(batch, 128), torch.randint(0, 10, (batch,))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    pm = tracker.report().oom
    assert pm is not None and pm.step == 2 and pm.phase == "forward"
    assert pm.batch_bytes == 50_000 * 128 * 4
    codes = [a.code for a in pm.advice]
    assert "oom-batch" in codes and "oom-other" not in codes
    said = pm.advice[codes.index("oom-batch")].evidence
    assert "(50000, 128)" in said and format_size(50_000 * 128 * 4) in said
    assert format_size(50_000 * 512 * 4) in said  # the first layer's output it asked for

    wide = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 10))
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    kept: list[torch.Tensor] = []
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="17MiB") as tracker:
        for _ in range(8):
            hidden = wide[:2](torch.randn(128, 256))
            loss = wide[2](hidden).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept.append(hidden.detach())
    pm = tracker.report().oom
    assert pm is not None and pm.leak is None and pm.batch_bytes == 128 * 256 * 4
    codes = [a.code for a in pm.advice]
    assert "oom-other" in codes and "oom-batch" not in codes
    # what was kept: the outputs, and the last step's loss (a scalar)
    assert (
        pm.advice[codes.index("oom-other")].saving_bytes
        == sum(t.numel() * t.element_size() for t in kept) + loss.numel() * loss.element_size()
    )


def test_an_oom_in_the_first_optimizer_step_after_accumulation_is_that_steps():
    """Two micro-batches, then the first ``optimizer.step()`` runs out while it creates
    AdamW's state: step 0 with 2 micro-batches (the steps counted from backward passes fold
    into it when the optimizer step begins), and the state is said to be partial, priced as
    it will be (two buffers of the parameters' size)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="5MiB") as tracker:
        for i in range(8):
            x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
            (nn.functional.cross_entropy(model(x), y) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
    report = tracker.report()
    pm = report.oom
    assert pm is not None and pm.phase == "optimizer"
    assert (pm.step, pm.micro_batches, report.steps) == (0, 2, 0)
    assert pm.optimizer_state_partial
    params = sum(p.numel() * 4 for p in model.parameters())
    assert pm.breakdown is not None and 0 < pm.breakdown.optimizer_state < 2 * params
    state = next(a for a in pm.advice if a.code == "oom-optimizer-state")
    assert "partial" in state.evidence and format_size(2 * params) in state.evidence
    assert "1.2x" not in state.evidence


def test_a_peak_inside_the_optimizer_step_advises_no_mixed_precision():
    """At an Adam step's peak, what the breakdown calls activations is the optimizer's
    temporaries (backward has freed the graph): autocast would not shrink them, so the
    advice must not quote them, and the text says what they are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with track(model, opt, device="cpu", budget="32MiB") as tracker:
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(torch.randn(64, 128)),
                                               torch.randint(0, 10, (64,)))  # fmt: skip
            loss.backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    bd = report.devices[0].breakdown
    assert bd is not None and bd.phase == "optimizer" and bd.activations > 0.25 * bd.total
    assert "mixed-precision" not in {a.code for a in report.advice}
    assert "note: in the optimizer phase, activations are the optimizer's temporaries" in str(
        report
    )


def test_an_oom_names_a_bare_module_index_with_its_type():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 200_000))
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, device="cpu", budget="64MiB", postmortem=None) as tracker,
    ):
        model(torch.randn(256, 64))  # the second layer's output: 195 MiB
    oom = tracker.report().oom
    assert oom is not None and oom.module == "1" and oom.module_type == "Linear"
    assert oom.where == "step 0, forward of 1 (Linear)"


def test_a_step_the_grad_scaler_skips_still_ends_the_step():
    """fp16 training: GradScaler skips optimizer.step() when the gradients overflow (the
    first steps, while the scale settles). The step still ends there; its backward is no
    micro-batch of the next step."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for i in range(4):
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).sum() * (float("inf") if i == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)  # skipped at i == 1: inf gradients
            scaler.update()
    assert scaler.get_scale() < 2.0**16  # one step was skipped
    report = tracker.report()
    assert report.steps == 4 and report.micro_batches == 1
    assert torch.amp.GradScaler.step.__name__ == "step" and not hasattr(
        torch.amp.GradScaler.step, "__wrapped__"
    )  # put back after the block


def test_evaluation_after_a_manual_sgd_step_is_evaluation():
    """Without an optimizer (manual SGD), a step ends with its backward: an evaluation that
    follows and keeps its outputs is between steps, so what it holds is evaluation's, not
    the training peak."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    with track(device="cpu", budget="256MiB") as tracker:
        for _ in range(4):
            model.train()
            model(torch.randn(16, 64)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
                model.eval()
                kept = [model(torch.randn(2048, 64)) for _ in range(3)]  # outputs kept
            del kept
    report = tracker.report()
    bd = report.devices[0].breakdown
    assert report.step_rule == "backward" and bd is not None and bd.phase != "other"
    assert report.devices[0].phase_peaks["eval"] > report.devices[0].phase_peaks["other"]


def test_keyword_arguments_are_a_forward_s_inputs():
    """transformers models are called with keywords (``model(**batch)``): the evaluation's
    largest input is still named, and accelerate-style autocast around ``forward`` counts."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters())
    with track(model, opt, device="cpu", budget="256MiB") as tracker:
        for _ in range(2):
            ids = torch.randint(0, 128, (4, 32))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (8, 32)))
    report = tracker.report()
    assert report.eval_input_shape == (8, 32) and report.steps == 2
    assert report.autocast_forwards == 0


def test_an_autocast_wrapping_forward_counts_as_autocast():
    """accelerate's mixed precision enters autocast inside a wrapped ``forward``, after the
    forward pre-hooks: the training forwards still count as run under autocast."""
    import functools

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = model.forward
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with autocast:
            return inner(*args, **kwargs)

    model.forward = forward
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            model(torch.randn(4, 16)).float().sum().backward()
            opt.step()
            opt.zero_grad()
    assert tracker.report().autocast_forwards == 3


@pytest.mark.xfail(
    strict=True,
    reason="known limitation (docs/simulated-device.md): a CPU run cannot see the .to() that "
    "tells a dataset's own tensors from tensors kept on the device",
)
def test_images_a_dataset_keeps_count_only_while_their_batch_lives():
    """torchvision's detection loop (sweep CJ): the dataset keeps its images, the loader's
    ``collate_fn`` (``tuple(zip(*batch))``) hands them over as they are, and on a CPU
    ``image.to(device)`` returns them as they are; on a GPU it copies them for the step. The
    simulated device counted each image from the step that fed it to the run's end: an 8 MiB
    dataset came to be device memory, and a loop that fits ran out. Each step's peak, and the
    evaluation's after the first pass, must equal the same loop's with the images cloned; a
    batch fed at every step stays counted."""
    torch.manual_seed(0)
    train_set = [(torch.randn(3, 64, 64 + 8 * i), torch.randint(0, 5, (4,))) for i in range(16)]
    val_set = [torch.randn(3, 64, 96) for _ in range(8)]

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, images: list[torch.Tensor], targets: Any = None) -> torch.Tensor:
            return sum(self.conv(img).relu().mean() for img in images)  # type: ignore[return-value]

    def run(clone: bool) -> TrackReport:
        torch.manual_seed(0)
        model = Detector()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fixed = torch.randn(3, 64, 64)  # fed at every step
        loader = torch.utils.data.DataLoader(
            train_set, batch_size=4, shuffle=False, collate_fn=lambda b: tuple(zip(*b, strict=True))
        )
        with track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
            for _ in range(2):
                for images, targets in loader:
                    images = [img.clone() if clone else img for img in images] + [fixed]
                    targets = [t.clone() if clone else t for t in targets]
                    model(images, targets).backward()
                    opt.step()
                    opt.zero_grad()
                with torch.no_grad():
                    for i in range(0, 8, 2):
                        model([img.clone() if clone else img for img in val_set[i : i + 2]])
        return tracker.report()

    kept, copied = run(clone=False), run(clone=True)
    assert [s.peak_allocated for s in kept.devices[0].steps] == [
        s.peak_allocated for s in copied.devices[0].steps
    ]
    assert kept.devices[0].peak_allocated == copied.devices[0].peak_allocated
    eval_kept, eval_copied = (r.devices[0].phase_peaks["eval"] or 0 for r in (kept, copied))
    # the first pass counts the training loop's last batch beside its own (it may live on)
    assert eval_copied <= eval_kept <= eval_copied + 4 * 3 * 64 * 120 * 4 + 16 * 8


def test_a_batch_sliced_from_a_dataset_in_ram_counts_its_own_rows_not_the_dataset():
    """The loop of PyTorch's "What is torch.nn really?" tutorial, ``xb = x_train[i:i + bs]``:
    each batch is a view of a 48 MiB tensor in RAM. On a GPU ``.to("cuda")`` copies the rows;
    the simulated device used to count the whole storage the view reads, ran out of its 16 MiB
    and blamed the activations. Each step's peak must equal the same loop's with the batch
    cloned (a tensor of its own, counted whole), through the tracker and through the probe."""
    from memkit.probing.runner import probe

    torch.manual_seed(0)
    x_train = torch.randn(16_384, 768)  # 48 MiB
    y_train = torch.randint(0, 10, (16_384,))

    def peaks(clone: bool) -> list[int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(768, 128), nn.ReLU(), nn.Linear(128, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with track(model, opt, device="cpu", budget="16MiB", postmortem=None) as tracker:
            for i in range(0, 256, 64):
                xb, yb = x_train[i : i + 64], y_train[i : i + 64]
                if clone:
                    xb, yb = xb.clone(), yb.clone()
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return [s.peak_allocated for s in tracker.report().devices[0].steps]

    sliced = peaks(clone=False)
    assert len(sliced) == 4 and max(sliced) < 2 << 20, sliced
    assert sliced == peaks(clone=True)

    def best(clone: bool) -> int | None:
        model = nn.Sequential(nn.Linear(768, 128), nn.ReLU(), nn.Linear(128, 10))
        rows = (lambda n: x_train[:n].clone()) if clone else (lambda n: x_train[:n])
        return probe(model, rows, loss_fn=lambda out, x: out.square().mean(), device="cpu",
                     budget="4MiB").max_batch_size  # fmt: skip

    assert best(clone=False) == best(clone=True) > 64

    # two views of one storage in a batch (x, y = chunk[:, :-1], chunk[:, 1:]): both count
    from memkit.simulated.accountant import MemoryAccountant

    chunk = torch.zeros(64, 257, dtype=torch.long)
    x, y = chunk[:, :-1], chunk[:, 1:]
    acct = MemoryAccountant("cpu").track((x, y), inputs=True)
    assert acct.current == 2 * 64 * 256 * 8
    acct.track((x, y), inputs=True)  # counted once, however often it is handed over
    assert acct.current == 2 * 64 * 256 * 8


@pytest.mark.parametrize(
    ("model", "optimizer", "message"),
    [
        ("pair", None, r"follows one model, found a list of 2 modules.*memkit.track\(optimizer="),
        ("one", "adam", r"optimizer: expected a torch.optim.Optimizer.*found 'adam' \(str\)"),
        ("one", "module", r"optimizer: expected .*found Linear\(in_fea.*\(Linear\)"),
        ("path", None, r"model: expected the torch.nn.Module you train .*found 'model.pt' \(str\)"),
    ],
)
def test_what_is_not_a_model_or_an_optimizer_is_named_before_the_block(model, optimizer, message):
    """A GAN's ``track([generator, discriminator], [opt_g, opt_d])`` and other wrong arguments
    get an error that says what was expected and what to pass, not an AttributeError from
    inside the tracker's first hook."""
    g, d = nn.Linear(2, 2), nn.Linear(2, 2)
    models = {"pair": [g, d], "one": g, "path": "model.pt"}
    optimizers = {None: None, "adam": "adam", "module": [d]}
    with pytest.raises(ConfigError, match=message):
        track(models[model], optimizers[optimizer])


class CheckpointedBlocks(nn.Module):
    """Four MLP blocks, each under non-reentrant ``torch.utils.checkpoint`` (``residual``:
    ``x + block(x)``)."""

    def __init__(self, width: int = 64, residual: bool = False) -> None:
        super().__init__()
        self.residual = residual
        self.h = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 512), nn.GELU(), nn.Linear(512, width)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            x = x + out if self.residual else out
        return x


def test_an_oom_inside_checkpointed_blocks_does_not_advise_checkpointing_them():
    """Blocks under ``torch.utils.checkpoint`` run out in backward's recomputation: the
    post-mortem says checkpointing already runs, names the blocks, proposes the other remedies
    and names no module inside a block as keeping activations (what those keep is freed when
    the block's forward ends)."""

    def run(budget: int | None) -> TrackReport:
        torch.manual_seed(0)
        model = CheckpointedBlocks()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with (
            pytest.raises(torch.OutOfMemoryError) if budget else contextlib.nullcontext(),
            track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker,
        ):
            for _ in range(2):
                model(torch.randn(256, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return tracker.report()

    peak = run(None).devices[0].peak_allocated
    pm = run(int(peak * 0.9)).oom
    assert pm is not None and pm.phase == "backward", pm
    # the blocks recomputed before it ran out (backward runs h.3 first), never their layers
    blocks = ("h.0", "h.1", "h.2", "h.3")
    assert pm.checkpointed and pm.checkpointed == blocks[-len(pm.checkpointed) :], pm.checkpointed
    inside = tuple(block + "." for block in pm.checkpointed)
    assert not any(path.startswith(inside) for path, _ in pm.top_modules), pm.top_modules
    (advice,) = [a for a in pm.advice if a.code == "oom-activations"]
    assert "checkpoint the largest blocks" not in advice.action
    assert f"Activation checkpointing already runs ({pm.checkpointed[0]}, " in advice.evidence
    # what no module kept is backward's own (sweep CK: a checkpointed GPT-2's was called a
    # contrastive loss's batch x batch matrix, and in-batch negatives were warned of)
    assert pm.made_outside is not None
    assert "by the recomputed forwards of the checkpointed blocks" in advice.evidence
    assert "batch x batch" not in advice.evidence


@pytest.mark.parametrize(
    "region", ["checkpoint", "checkpoint-reentrant", "no_grad", "checkpointed-forward"]
)
def test_what_a_checkpointed_or_no_grad_region_leaves_inside_is_not_kept_for_backward(region):
    """Inside a checkpointed block (or an encoder run under ``no_grad``, MoCo's key encoder)
    autograd saves nothing: the layers' outputs die inside the block. The module table gives
    those layers no kept bytes (the sweep saw a block's Linear 'keep' 4 MiB while the block
    kept 1 MiB); the block itself keeps what it returns, and no child keeps more than it.
    ``checkpointed-forward``: the block checkpoints its own ``forward``, not its call
    (transformers' ``gradient_checkpointing_enable()``): its hooks run outside the region and
    its layers share one region inside it (each 'kept' its output before)."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if region == "checkpointed-forward":
                return checkpoint(super().forward, x, use_reentrant=False)
            return super().forward(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList(
                Block(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64)) for _ in range(2)
            )
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.h:
                if region == "no_grad":
                    with torch.no_grad():
                        x = block(x)
                elif region.startswith("checkpoint-") or region == "checkpoint":
                    x = checkpoint(block, x, use_reentrant=region.endswith("reentrant"))
                else:
                    x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(torch.randn(256, 64, requires_grad=True)).sum().backward()
            opt.step()
            opt.zero_grad()
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    output = 256 * 64 * 4
    for block in ("h.0", "h.1"):
        # what it returns, where the next block's checkpoint or the head saves it (under
        # no_grad the next block does not: h.0's output dies in h.1)
        kept = 0 if region == "no_grad" and block == "h.0" else output
        assert rows[block].activation_bytes == kept
        for layer in ("0", "1", "2"):
            inner = rows[f"{block}.{layer}"]
            assert inner.calls == 2 and inner.activation_bytes == 0
            assert inner.peak_over_entry >= 256 * 512 * 4 * (layer != "2")  # it did allocate


def test_no_checkpointing_advice_where_layers_checkpoint_their_own_forward():
    """transformers' ``gradient_checkpointing_enable()`` checkpoints each layer's ``forward``:
    the layers' children are what backward recomputes. Checkpointing runs already: no advice
    to turn it on (given once the children no longer each 'kept' their outputs)."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(super().forward, x, use_reentrant=False)

    torch.manual_seed(0)
    model = nn.Sequential(
        *[Block(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64)) for _ in range(4)]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="17MiB") as tracker:  # activations 74%
        for _ in range(2):
            model(torch.randn(1024, 64, requires_grad=True)).sum().backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert any(m.recompute_calls for m in report.devices[0].modules)
    assert "activation-checkpointing" not in [a.code for a in report.advice]


def test_layers_checkpointed_one_by_one_each_keep_what_they_return():
    """``x = checkpoint(layer, x)`` for each layer of a block: every layer is its own region's
    outermost call, and what it returns is saved by the next region: each keeps its output."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 512), nn.Linear(512, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.up, x, use_reentrant=False)
            return checkpoint(self.down, x, use_reentrant=False)

    model = nn.Sequential(Block(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB", module_every=1) as tracker:
        for _ in range(2):
            model(torch.randn(256, 64, requires_grad=True)).sum().backward()
            opt.step()
            opt.zero_grad()
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    assert rows["0.up"].activation_bytes == 256 * 512 * 4
    assert rows["0.down"].activation_bytes == 256 * 64 * 4
    assert rows["0"].activation_bytes == 256 * 512 * 4 + 256 * 64 * 4


def test_two_sibling_regions_are_two_even_when_the_first_saves_nothing():
    """A frozen block's checkpoint region saves nothing and frees its hook; the next region's
    hook may take its address. Regions are told apart by the hook itself, not its ``id``:
    each block keeps its output and their caller keeps nothing of its own (review finding)."""
    from torch.utils.checkpoint import checkpoint

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
            self.trained = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.frozen, x, use_reentrant=False)
            return checkpoint(self.trained, h, use_reentrant=False)

    torch.manual_seed(0)
    model = nn.Sequential(Pair(), nn.Linear(256, 1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with track(model, opt, device="cpu", budget="256MiB", module_every=1) as tracker:
        for _ in range(3):
            model(torch.randn(1024, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    output = 1024 * 256 * 4
    assert rows["0.frozen"].activation_bytes == rows["0.trained"].activation_bytes == output
    assert rows["0"].self_activation_bytes == 0 and rows["0"].activation_bytes == 2 * output


def test_a_forward_that_ran_out_and_was_retried_smaller_adds_nothing_to_the_retry():
    """A script that catches an OOM and halves the batch: the failed forwards' calls kept what
    they kept at the time, but the pass was given up; the retry's kept bytes start again, so no
    row exceeds the device's peak and the model's row is one pass at the batch that fitted (the
    sweep saw 96 MiB kept a step on an 88 MiB peak)."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())])
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model: nn.Module, opt: torch.optim.Optimizer, batch: int) -> tuple[int, int]:
        failures = 0
        while True:
            try:
                model(torch.randn(batch, 256)).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return failures, batch
            except torch.OutOfMemoryError:
                failures += 1
                opt.zero_grad(set_to_none=True)
                batch //= 2

    model, opt = make()
    with track(model, opt, device="cpu", budget="16MiB", module_every=1) as tracker:
        failures, fitted = train(model, opt, 8192)
    assert failures >= 2  # 8192 and 4096 run out in the forward
    retried = tracker.report().devices[0]
    tracker_notes = tracker.report().notes
    model, opt = make()
    with track(model, opt, device="cpu", budget="16MiB", module_every=1) as tracker:
        assert train(model, opt, fitted) == (0, fitted)
    clean = tracker.report().devices[0]
    rows = {m.path: m for m in retried.modules}
    assert all(m.activation_bytes_per_step <= retried.peak_allocated for m in retried.modules)
    clean_model = next(m for m in clean.modules if m.path == "Sequential")
    assert rows["Sequential"].activation_bytes_per_step == clean_model.activation_bytes_per_step
    assert rows["Sequential"].activation_bytes_per_step >= 4 * fitted * 256 * 4  # ReLUs' outputs
    # the OOMs the script caught are said, not hidden: nothing else in the report shows them
    (note,) = [n for n in tracker_notes if "ran out of memory" in n]
    assert note.startswith(f"cpu ran out of memory {failures} times and the script caught it")
    assert not [n for n in tracker.report().notes if "ran out of memory" in n]  # clean run


def test_a_training_peak_in_an_attempt_that_ran_out_and_was_skipped_is_said_so():
    """fairseq's habit: a batch that runs out of memory is skipped ("OOM, skipping batch") and
    training goes on. The training peak, its breakdown and the advice were the skipped batch's,
    up to its failed request, and the report named it as any step's peak. It now says the
    moment is of an attempt that ran out, and which; a completed step that goes higher later
    (a retry at a smaller batch whose step needs more than the failed attempt reached) takes
    the peak back, unmarked."""

    def run(
        sizes: list[int], adam: bool = True, sanity: int = 0, model: nn.Module | None = None
    ) -> tuple[list[int], Any, list[str], str]:
        torch.manual_seed(0)
        if model is None:
            model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                  nn.ReLU(), nn.Linear(1024, 10))  # fmt: skip
        opt = torch.optim.Adam(model.parameters(), 1e-3) if adam else torch.optim.SGD(
            model.parameters(), 1e-3)  # fmt: skip
        skipped = []
        with track(model, opt, device="cpu", budget="32MiB") as tracker:
            if sanity:  # Lightning's sanity validation before training
                with torch.no_grad():
                    model.eval()(torch.randn(sanity, 256))
                model.train()
            for size in sizes:
                x, y = torch.randn(size, 256), torch.randint(0, 10, (size,))
                try:
                    loss = nn.functional.cross_entropy(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                except torch.OutOfMemoryError:
                    skipped.append(size)
                    loss = None
                    opt.zero_grad(set_to_none=True)
        report = tracker.report()
        notes = [n for n in report.notes if "ran out" in n]
        return skipped, report.devices[0], notes, str(report)

    skipped, dev, notes, text = run([64, 64, 1024, 64, 64])
    assert skipped == [1024]
    completed = max(s.peak_allocated for s in dev.steps if s.step != 2)
    bd = dev.breakdown
    assert dev.breakdown_ran_out and bd.step == 2 and bd.phase == "forward"
    assert bd.total == dev.peak_allocated > completed  # the skipped batch's, up to the OOM
    (note,) = notes
    assert (
        "the training peak is of an attempt that ran out (step 2, input shape (1024, 256))" in note
    )
    assert "forward, 1 (ReLU), input 1024x256; in an attempt that then ran out of memory):" in text
    assert '"breakdown_ran_out": true' in json.dumps(dataclasses.asdict(dev))

    skipped, dev, notes, _ = run([64, 64, 8192, 512, 64])  # 8192 fails at its first layer
    assert skipped == [8192] and not dev.breakdown_ran_out and dev.breakdown.phase != "forward"
    (note,) = notes
    assert "the script caught it" in note and "training peak" not in note
    _, clean, notes, _ = run([64, 64, 512, 64])  # the same peak, nothing skipped: nothing said
    assert clean.breakdown.total == dev.breakdown.total and not clean.breakdown_ran_out
    assert notes == []

    # review: a retry whose forward goes higher in the same (forward) phase is its own peak
    class Temporary(nn.Module):  # a forward-only temporary, freed before backward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0 * x.repeat(1, 16).sum(-1, keepdim=True)

    torch.manual_seed(0)
    model = nn.Sequential(Temporary(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    skipped, dev, _, _ = run([64, 8192, 1024, 64], adam=False, model=model)  # out in Temporary
    assert skipped == [8192] and not dev.breakdown_ran_out and dev.breakdown.phase == "forward"
    assert dev.breakdown.total == max(s.peak_allocated for s in dev.steps)
    # review: a sanity validation before training, then a first batch skipped
    skipped, dev, notes, _ = run([8192, 64, 64], adam=False, sanity=2600)
    assert skipped == [8192] and dev.breakdown_ran_out and dev.breakdown.step == 0


def dqn_rows(acting: int, keep_q: bool) -> tuple[int, dict[str, tuple[int, int]]]:
    """cleanRL's DQN, tiny: every env step acts with ``q_network(obs).argmax()`` with grad on
    (no backward), every few steps one training forward and backward. The peak, and each
    row's (calls, kept/step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB", module_every=1) as tracker:
        for _ in range(2):
            for _ in range(acting):
                if keep_q:  # `q_values = q_network(obs)`: bound until the next acting forward
                    q_values = model(torch.randn(16, 64))
                    q_values.argmax(1)
                else:
                    model(torch.randn(16, 64)).argmax(1)
            loss = model(torch.randn(128, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    dev = tracker.report().devices[0]
    return dev.peak_allocated, {m.path: (m.calls, m.activation_bytes_per_step) for m in dev.modules}


def test_acting_forwards_with_grad_that_never_run_backward_add_nothing_to_kept_per_step():
    """A DQN's acting forwards keep a graph no backward frees: it dies with their output.
    kept/step summed every forward since the last backward (sweep GG: 7.95 MiB on an
    841.65 KiB peak); now a pass counts while its graph lives: none when the output is dropped
    at once, one acting pass when the loop's `q_values` still holds the last one."""
    acting_peak, dropped = dqn_rows(8, False)
    kept_peak, kept = dqn_rows(8, True)
    training_pass = 128 * (256 + 4) * 4  # what a forward keeps: the ReLU's and last output
    assert dropped["Sequential"] == (18, training_pass)  # the acting calls still count
    assert kept["Sequential"] == (18, training_pass + 16 * (256 + 4) * 4)
    assert all(k <= acting_peak for _, k in dropped.values())
    assert all(k <= kept_peak for _, k in kept.values())


def test_a_pass_freed_between_two_kept_ones_adds_nothing_to_kept_per_step():
    """Review: `out1 = model(x)` (kept), pseudo-labels from a grad-on pass dropped at once,
    `out3 = model(u)` (kept): kept/step summed 3 passes where 2 graphs live at once (only
    passes at the front were dropped when freed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB", module_every=1) as tracker:
        for _ in range(3):
            out1 = model(torch.randn(128, 64))
            pseudo = model(torch.randn(128, 64)).softmax(-1).detach()
            out3 = model(torch.randn(128, 64))
            loss = out1.pow(2).mean() + (out3 - pseudo).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            del out1, out3, loss, pseudo
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    assert rows["Sequential"].activation_bytes_per_step == 2 * 128 * (256 + 4) * 4


def test_a_cached_output_gets_one_node_hook_however_many_passes_return_it(monkeypatch):
    """Review: a model returning the same cached tensor (backward with retain_graph=True) got
    one more no-op pre-hook on its node each pass, all run by every backward: 1 + 2 + ... +
    30 = 465 calls over 30 steps; one hook, one call a backward."""
    import memkit.tracking.hooks as hooks

    calls = [0]

    def counting(grad):
        calls[0] += 1

    monkeypatch.setattr(hooks, "_no_op", counting)

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.out = nn.Linear(16, 16), None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.out is None:
                self.out = self.lin(x)
            return self.out

    model = Cached()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 16)
    with track(model, opt, device="cpu", budget="8MiB", module_every=1):
        for _ in range(10):
            model(x).pow(2).mean().backward(retain_graph=True)
            opt.step()
            opt.zero_grad()
    assert calls[0] == 10


def _kfold(keep: str, forgotten: bool = False) -> tuple[Any, list[nn.Module]]:
    """A k-fold run in one process, as a Kaggle notebook writes it: per fold a new model and
    AdamW, zero_grad before each forward; each fold's model kept for an ensemble (``keep``:
    ``"as is"``, ``"zeroed"``: gradients freed first). ``forgotten``: the models' last layer
    is left out of the optimizer (it still requires grad)."""
    kept: list[nn.Module] = []
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
            params = model[0].parameters() if forgotten else model.parameters()
            opt = torch.optim.AdamW(params, lr=1e-3)
            for _ in range(3):
                opt.zero_grad()
                loss = model(torch.randn(32, 128)).pow(2).mean()
                loss.backward()
                opt.step()
            if keep == "zeroed":
                model.zero_grad(set_to_none=True)
            kept.append(model)
    return tracker.report(), kept


def test_models_kept_with_their_gradients_are_named_and_the_saving_holds():
    """Sweep QQ: each fold's model kept for an ensemble keeps its gradients; nothing named
    them, and zero-grad-keeps-grads counted them at the next fold's first forward (the
    loop zeroes before every forward). Now stale-gradients names the kept models, and
    freeing their gradients lowers the peak by what it claims."""
    report, kept = _kfold("as is")
    codes = {a.code: a for a in report.advice}
    assert "zero-grad-keeps-grads" not in codes, codes["zero-grad-keeps-grads"]
    stale = codes["stale-gradients"]
    grad_bytes = sum(p.grad.nbytes for m in kept[:2] for p in m.parameters())
    assert stale.saving_bytes == grad_bytes  # the two earlier folds' (the third still trains)
    assert "`Sequential`" in stale.evidence and "`Sequential#2`" in stale.evidence
    fixed, _ = _kfold("zeroed")
    assert "stale-gradients" not in {a.code for a in fixed.advice}
    assert report.devices[0].peak_allocated - fixed.devices[0].peak_allocated == stale.saving_bytes


def test_parameters_left_out_of_the_optimizer_are_named_with_their_gradients():
    """A layer that requires grad but that no optimizer holds: its gradients accumulate and
    stay; stale-gradients names them."""
    report, _ = _kfold("zeroed", forgotten=True)
    (stale,) = [a for a in report.advice if a.code == "stale-gradients"]
    assert stale.saving_bytes == (256 * 10 + 10) * 4  # the last Linear's weight and bias


def test_a_gans_discriminator_gradients_from_the_generators_loss_are_not_stale():
    """Review: generator first, the discriminator not frozen for the generator's loss (its
    gradients made there, zeroed before its own backward): the step ended at the
    generator's step, before the discriminator's optimizer had stepped, and its gradients
    were called stale with a saving that applying the advice did not give. They are looked
    at over a whole step now: its optimizer stepped them."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64))
    disc = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    bce = nn.BCEWithLogitsLoss()
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(5):
            fake = gen(torch.randn(16, 32))
            g_loss = bce(disc(fake), torch.ones(16, 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            d_loss = bce(disc(torch.randn(16, 64)), torch.ones(16, 1)) + bce(
                disc(fake.detach()), torch.zeros(16, 1)
            )
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
    report = tracker.report()
    assert report.stale_gradients == () and report.steps == 5
    assert "stale-gradients" not in {a.code for a in report.advice}


def test_gradients_stale_only_before_the_peak_claim_no_saving():
    """Review: a head warmed up alone (the backbone still requiring grad: its gradients
    stale), then a new optimizer over everything: at the peak they are that optimizer's, and
    freeing them in the warm-up saves nothing there. Named, without a saving."""

    def run(frozen: bool) -> Any:
        torch.manual_seed(0)
        backbone = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
        model = nn.Sequential(backbone, nn.Linear(64, 10))
        with track(device="cpu", budget="64MiB") as tracker:
            backbone.requires_grad_(not frozen)
            for params in (model[1].parameters(), model.parameters()):
                opt = torch.optim.AdamW(params)
                for _ in range(4):
                    opt.zero_grad()
                    model(torch.randn(32, 64)).pow(2).mean().backward()
                    opt.step()
                backbone.requires_grad_(True)
        return tracker.report()

    report, fixed = run(False), run(True)
    (stale,) = [a for a in report.advice if a.code == "stale-gradients"]
    assert report.stale_gradients and stale.saving_bytes is None
    assert report.devices[0].peak_allocated == fixed.devices[0].peak_allocated


@pytest.mark.parametrize("keep", ["optimizers", "freed"])
def test_a_kfold_run_whose_earlier_optimizers_stay_alive_counts_every_folds_steps(keep: str):
    """Review: a trainer that keeps each fold's optimizer alive (Accelerate's accelerator, a
    kept LightningModule's trainer) left the first fold's optimizer the steps' owner: later
    folds' steps were not counted (3 of 9), and their kept models' gradients not named. A new
    optimizer over a model first seen after the owner began now takes over at its second step
    if the owner did not step between (its first step counts with the step before).
    ``freed``: each optimizer deleted before the next is made, which may take its id (seen as
    the same one before)."""
    kept: list[nn.Module] = []
    optimizers: list[Any] = []
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(16):  # (folds longer than an optimizer stepping every k-th step)
                opt.zero_grad()
                model(torch.randn(16, 64)).pow(2).mean().backward()
                opt.step()
            kept.append(model)
            if keep == "optimizers":
                optimizers.append(opt)
            del opt
    report = tracker.report()
    merged = 2 if keep == "optimizers" else 0  # each later fold's first step
    assert report.steps == 48 - merged
    grads = [sum(p.grad.nbytes for p in m.parameters()) for m in kept[:2]]
    (stale,) = [a for a in report.advice if a.code == "stale-gradients"]
    assert sum(n for _, n in report.stale_gradients) == sum(grads)  # both earlier folds'
    # the saving: what the last look before the peak found (the second fold's optimizer had
    # stepped within the last steps there, and counted as stepping: a lower bound)
    assert stale.saving_bytes is not None and grads[0] <= stale.saving_bytes <= sum(grads)


def test_two_backward_passes_through_one_forward_are_no_micro_batches_to_the_advice():
    """Review: one forward, two losses backpropagated apart (retain_graph), zero_grad after
    the forward: two backward passes a step, and zero-grad-keeps-grads spoke of micro-batches
    and gradient accumulation; there is one forward a step."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(4):
            out = model(torch.randn(16, 64))
            opt.zero_grad()
            out.pow(2).mean().backward(retain_graph=True)
            out.abs().mean().backward()
            opt.step()
    report = tracker.report()
    (adv,) = [a for a in report.advice if a.code == "zero-grad-keeps-grads"]
    assert report.micro_batches == 2 and "micro-batches" not in adv.evidence


def test_a_parameterless_part_called_alone_is_no_frozen_model():
    """Sweep WW: a seq-first Transformer's greedy decode called its positional encoding (no
    parameters) on its own, on inputs whose first dimension (the sequence) equals the training
    batch's; it was reported as "a model no optimizer trains on the training batch". A
    module without parameters is no model."""

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.pos = nn.Embedding(50, 32), nn.Dropout(0.1)
            self.out = nn.Linear(32, 50)

        def forward(self, src: torch.Tensor) -> torch.Tensor:
            return self.out(self.pos(self.embed(src)))

        def encode(self, src: torch.Tensor) -> torch.Tensor:  # a decode's own path
            return self.pos(self.embed(src))

    model = Seq2Seq()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            src = torch.randint(0, 50, (12, 4))  # (sequence, batch): seq-first
            opt.zero_grad()
            model(src).pow(2).mean().backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                model.encode(torch.randint(0, 50, (12, 64)))
            model.train()
    report = tracker.report()
    assert report.frozen_model is None and report.frozen_forwards == 0


def test_a_critic_stepping_in_a_row_never_takes_the_generators_steps():
    """Review 2: a WGAN-GP written generator first, its critic stepping five times after
    each generator step (a model trained from the start beside the owner's), took the steps'
    ownership at its second step: 60 steps for 12 iterations. The generator's steps count."""
    torch.manual_seed(0)
    gen, critic = nn.Linear(8, 32), nn.Linear(32, 1)
    opt_g, opt_c = torch.optim.Adam(gen.parameters()), torch.optim.Adam(critic.parameters())
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(6):
            opt_g.zero_grad()
            (-critic(gen(torch.randn(16, 8))).mean()).backward()
            opt_g.step()
            for _ in range(5):
                opt_c.zero_grad()
                fake = gen(torch.randn(16, 8)).detach()
                (critic(fake).mean() - critic(torch.randn(16, 32)).mean()).backward()
                opt_c.step()
    assert tracker.report().steps == 6


def test_a_trained_averaged_model_subclass_is_trained():
    """Review 2: an AveragedModel's forwards are evaluation, but a subclass that an optimizer
    trains had every training forward counted as evaluation."""
    from torch.optim.swa_utils import AveragedModel

    class Trained(AveragedModel):
        pass

    model = Trained(nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
    report = tracker.report()
    assert report.steps == 3 and report.eval_forwards == 0
    assert report.devices[0].phase_peaks["forward"] is not None


def test_a_kfold_run_with_kept_optimizers_counts_every_fold_on_the_cuda_stand_in():
    """On a GPU, models are found at sampled steps only: a k-fold run's next model, whose
    optimizer takes the steps' ownership, was not known there, and only the first fold's
    steps counted (16 of 48). Models are looked for from a new optimizer's first step on."""
    from memkit.devices.cuda_standin import cuda_standin

    kept, optimizers = [], []
    with cuda_standin("1GiB"), track(device="cuda") as tracker:
        for _ in range(3):
            model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to("cuda")
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(16):
                opt.zero_grad()
                model(torch.randn(16, 64).to("cuda")).pow(2).mean().backward()
                opt.step()
            kept.append(model)
            optimizers.append(opt)
        report = tracker.report()
    assert report.steps == 48 - 2  # each later fold's first step counts with the step before
    assert report.devices[0].leak is None  # the folds' state is no leak
    assert report.stale_gradients


def test_a_one_off_optimizer_kept_alive_does_not_silence_the_zero_grad_check():
    """Review 3: an optimizer over another parameter that steps once (and is kept alive) was a
    pending successor for the rest of the run, and zero-grad-keeps-grads counted 1 step of 11
    whose forward began with the gradients. The owner stepping again ends the candidacy."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with track(device="cpu", budget="64MiB") as tracker:
        for i in range(8):
            x = torch.randn(16, 64)
            loss = model(x).pow(2).mean()
            opt.zero_grad()  # after the forward: it began with the last step's gradients
            loss.backward()
            opt.step()
            if i == 0:
                scale = nn.Parameter(torch.ones(1))
                kept.append(torch.optim.SGD([scale], lr=0.1))
                (scale * model(x).detach().mean()).pow(2).backward()
                kept[-1].step()
    report = tracker.report()
    assert report.steps == 8 and report.steps_with_grads_at_forward == 7


def test_an_owner_that_steps_again_takes_its_steps_back():
    """Review 3: a policy optimizer over every parameter, then an optimizer over the value
    head alone stepping five times in a row (a part of the owner's parameters): it took the
    steps over for good, 40 steps for 8 iterations. The owner stepping again takes them back
    (the first iteration's value steps after the takeover still count)."""

    class ActorCritic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk, self.pi, self.v = nn.Linear(16, 64), nn.Linear(64, 4), nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.trunk(x).relu()
            return self.pi(h), self.v(h)

    model = ActorCritic()
    opt, value_opt = torch.optim.Adam(model.parameters()), torch.optim.Adam(model.v.parameters())
    with track(device="cpu", budget="64MiB") as tracker:
        for _ in range(8):
            x = torch.randn(32, 16)
            opt.zero_grad()
            pi, v = model(x)
            (pi.pow(2).mean() + v.pow(2).mean()).backward()
            opt.step()
            for _ in range(5):
                value_opt.zero_grad()
                model(x)[1].pow(2).mean().backward()
                value_opt.step()
    assert tracker.report().steps == 8 + 4


def _swa(no_grad: bool) -> Any:
    """Stochastic weight averaging as PyTorch's SWA example writes it: an AveragedModel updated
    after each epoch from epoch 2, and its predictions on a test batch each epoch, with grad
    on (``no_grad``: under ``torch.no_grad()``)."""
    from torch.optim.swa_utils import SWALR, AveragedModel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    swa_model, sched = AveragedModel(model), None
    x, y, test = torch.randn(16, 64), torch.randint(0, 10, (16,)), torch.randn(256, 64)
    with track(device="cpu", budget="64MiB") as tracker:
        for epoch in range(4):
            for _ in range(3):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            if epoch >= 2:
                swa_model.update_parameters(model)
                sched = sched or SWALR(opt, swa_lr=0.05)
                sched.step()
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                preds = swa_model(test)  # noqa: F841 (held into the next epoch, as a script does)
    return tracker.report()


def test_an_averaged_models_forwards_are_evaluation_not_training():
    """Sweep QQ: SWA's `preds = swa_model(test_input)` with grad on, in training mode, counted
    as a training forward (its rows, the training peak in its forward, and steps begun by it);
    an AveragedModel is never stepped by an optimizer: its forwards are evaluation now, and
    eval-grad-enabled claims what no_grad saves."""
    report = _swa(no_grad=False)
    assert report.steps == 12 and report.eval_forwards == 4
    assert not any("AveragedModel" in m.path and m.calls for d in report.devices for m in d.modules)
    (adv,) = [a for a in report.advice if a.code == "eval-grad-enabled"]
    fixed = _swa(no_grad=True)
    assert "eval-grad-enabled" not in {a.code for a in fixed.advice}
    saved = report.devices[0].peak_allocated - fixed.devices[0].peak_allocated
    assert adv.saving_bytes == saved == 256 * 512 * 4  # the ReLU output (it and the Linear save it)


class _SlotsOutput:
    """A forward's output object that takes no weak reference (``__slots__``)."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def test_an_output_object_without_weak_references_is_tracked_through():
    """A model returning a ``__slots__`` object: the step's own objects keep weak references,
    and this one takes none; it is passed over (not walked), and every step is counted."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> _SlotsOutput:
            return _SlotsOutput(self.lin(x))

    model = Head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="8MiB") as tracker:
        for _ in range(4):
            loss = model(torch.randn(16, 32)).logits.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = tracker.report()
    assert report.steps == 4
    assert not any("stopped tracking" in n for n in report.notes), report.notes


class RaisesOnce(nn.Module):
    """A layer whose forward raises ``error`` once when armed (Ctrl-C landing in it)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 64)
        self.error: BaseException | None = None
        self.armed_error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.linear(x)


def interrupted_then_evaluated(error: BaseException, given: bool) -> TrackReport:
    """catch_kbi.py's shape: the script catches the error raised in the model's forward in its
    third step, then runs one evaluation forward under ``no_grad`` (``given``: the model
    passed to track(), else global hooks)."""
    torch.manual_seed(0)
    layer = RaisesOnce(error)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), layer, nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model if given else None, opt, device="cpu", budget="64MiB") as tracker:
        try:
            for step in range(4):
                layer.error = layer.armed_error if step == 2 else None
                model(torch.randn(32, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
        except (KeyboardInterrupt, ValueError):
            pass
        with torch.no_grad():
            model.eval()
            model(torch.randn(256, 64))
    return tracker.report()


@pytest.mark.parametrize("given", [True, False], ids=["model", "global-hooks"])
@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("bad batch")], ids=repr)
def test_a_forward_interrupted_and_caught_leaves_no_call_running(
    error: BaseException, given: bool
) -> None:
    """torch runs always-call forward hooks for an ``Exception`` only: Ctrl-C in a forward left
    the model's call on memkit's stack, so the evaluation forward the script ran after catching
    it was taken as nested in it: "eval_forwards 0" and the training peak put at the
    evaluation's (sweep HH). The model's next forward drops the calls no longer running, as
    the post-hooks of an ``Exception`` (a bad batch skipped) do."""
    report = interrupted_then_evaluated(error, given)
    dev = report.devices[0]
    assert report.eval_forwards == 1 and report.steps == 2
    assert dev.phase_peaks["eval"] is not None and dev.phase_peaks["eval"] == dev.peak_allocated
    assert dev.breakdown is not None and dev.breakdown.phase != "forward"  # training's: smaller
    rows = {m.path: m for m in dev.modules}
    assert (rows["Sequential"].calls, rows["Sequential"].eval_calls) == (3, 1)


def test_a_model_entered_after_ctrl_c_in_a_loss_module_is_tracked_again() -> None:
    """Global hooks: Ctrl-C in a loss module's forward (not the model: once an ignored call
    was left on the stack, and everything after it was ignored, forever)."""

    class InterruptedLoss(nn.Module):
        armed = False

        def forward(self, out: torch.Tensor) -> torch.Tensor:
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return out.square().mean()

    torch.manual_seed(0)
    model, loss_fn = nn.Sequential(nn.Linear(64, 32), nn.ReLU()), InterruptedLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(None, device="cpu", budget="64MiB", module_every=1) as tracker:
        for step in range(5):
            loss_fn.armed = step == 1
            with contextlib.suppress(KeyboardInterrupt):
                loss_fn(model(torch.randn(8, 64))).backward()
                opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert report.steps == 4
    assert {m.path: m.calls for m in report.devices[0].modules}["Sequential"] == 5


def test_the_rows_of_a_linear_relu_chain_add_up_to_what_the_model_keeps() -> None:
    """Sweep ZZ: in ``Linear -> ReLU`` (not in place) the ReLU keeps its own output and the
    Linear's dies when the ReLU returns, but both rows counted one: the leaves added up to
    twice what the model kept (and the OOM post-mortem's largest activations with them).
    Counted independently: the simulated device's growth across the same forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))  # fmt: skip
    x = torch.randn(64, 256)
    with simulate("64MiB", track=(model,)) as acct:
        acct.track(x, inputs=True)
        before = acct.current
        loss = model(x).sum()  # what the forward keeps until backward: the logits die here
        kept = acct.current - before - loss.untyped_storage().nbytes()
        del loss
    with track(model, device="cpu", budget="64MiB") as tracker:
        model(x).sum().backward()
    rows = {m.path: m.activation_bytes_per_step for m in tracker.report().devices[0].modules}
    assert rows["Sequential"] == kept == sum(rows[k] for k in ("0", "1", "2", "3", "4"))
    assert rows["0"] == rows["2"] == rows["4"] == 0 and rows["1"] == rows["3"] == 64 * 256 * 4


def test_outputs_that_die_levels_up_and_outputs_dropped_from_a_tuple_are_not_kept() -> None:
    """Sweep AA: a dropout's output returned by its MLP and freed by the block's residual add
    (two levels up) stayed in the dropout's row and the MLP's; ``a, _ = mha(x, x, x)`` drops
    the averaged attention weights at once, and MHA's row kept them (its row was larger than
    the whole model's). Counted independently: the forward's growth on the simulated device;
    each row by what autograd saves (the dropout keeps its mask, 4 bytes an element on the
    CPU; the MLP its hidden layer twice, GELU's input and the second Linear's, and the mask)."""
    batch, width, hidden, length = 32, 64, 256, 16

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(width, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(),
                                     nn.Linear(hidden, width), nn.Dropout(0.1))  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, _ = self.mha(x, x, x)  # need_weights=True by default: the weights are dropped
            x = x + a
            return x + self.mlp(x)

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(batch, length, width)
    with simulate("64MiB", track=(model,)) as acct:
        acct.track(x, inputs=True)
        before = acct.current
        loss = model(x).sum()  # kept until backward: the model's output dies here
        kept = acct.current - before - loss.untyped_storage().nbytes()
        del loss
    with track(model, device="cpu", budget="64MiB") as tracker:
        model(x).sum().backward()
    rows = {m.path: m.activation_bytes_per_step for m in tracker.report().devices[0].modules}
    tokens = batch * length
    assert rows["0.mlp.3"] == tokens * width * 4  # the mask, not the output
    assert rows["0.mlp"] == tokens * (2 * hidden + width) * 4
    assert rows["Sequential"] == kept == rows["0"] + rows["1"]
    assert rows["0.mha"] < rows["0"]


def test_a_module_returning_a_tensor_subclass_keeps_tracking() -> None:
    """Review: a wrapper tensor subclass (DTensor under tensor parallelism; here torch's own
    test ``TwoTensor``) has no storage address, and reading one in the module rows stopped
    tracking at step 0 ("its own hook failed")."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.l(x)
            return two_tensor.TwoTensor(y, y * 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.head = Wrap(), nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = self.w(x)
            return self.head(t.a + t.b)

    model = Net()
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            model(torch.randn(32, 64)).sum().backward()
    report = tracker.report()
    assert not any("stopped tracking" in n for n in report.notes), report.notes
    assert report.steps == 3 and {"w", "w.l", "head"} <= {m.path for m in report.devices[0].modules}


@pytest.mark.parametrize("by_keyword", [True, False])
def test_a_tensor_a_block_is_given_and_returns_on_is_not_its_own(by_keyword: bool) -> None:
    """Review: T5 passes ``position_bias`` to every layer by keyword, and each returns it
    on; forward hooks get no keywords, so the bias was taken for the block's own output, and
    where it died at the model's end every block's row lost it: 0 where a block keeps its
    tanh output (512 KiB here). By position it was right; now by keyword too."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(256, 256)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(self.l(x) + bias), bias

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias, self.head = nn.Linear(256, 256), nn.Linear(256, 1)
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = self.bias(x) * 2
            for block in self.blocks:
                x, b = block(x, bias=b) if by_keyword else block(x, b)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    with track(model, device="cpu", budget="64MiB") as tracker:
        model(torch.randn(512, 256)).sum().backward()
    rows = {m.path: m.activation_bytes for m in tracker.report().devices[0].modules}
    assert rows["blocks.0"] == rows["blocks.2"] == 512 * 256 * 4  # its tanh's output


def test_logits_a_model_returns_beside_its_loss_and_the_loop_drops_are_in_no_row() -> None:
    """Sweep BB: a transformers model computes its loss and returns the logits beside it;
    ``loss = model(**batch).loss`` drops them before backward, but the model's row and the
    head's kept them (250 KiB in a tiny GPT-2, 785 MiB for GPT-2 small at 4 x 1024). What the
    model returns is settled when the backward begins. Counted independently: the simulated
    device's growth across the forward, the output dropped as the loop drops it."""

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Sequential(nn.Linear(64, 256), nn.Tanh()), nn.Linear(256, 512)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.head(self.body(x))
            return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}

    torch.manual_seed(0)
    model = LM()
    x, y = torch.randn(128, 64), torch.randint(0, 512, (128,))
    with simulate("64MiB", track=(model,)) as acct:
        acct.track(x, y, inputs=True)
        before = acct.current
        loss = model(x, y)["loss"]
        kept = acct.current - before  # (the loss included: alive as its backward begins)
        del loss
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(x, y)["loss"].backward()
    rows = {m.path: m.activation_bytes_per_step for m in tracker.report().devices[0].modules}
    assert rows["head"] == 0 and rows["LM"] == kept  # (the logits: 256 KiB)


def test_many_acting_forwards_without_a_backward_do_not_add_up_in_the_models_row() -> None:
    """Review: with the model's own keep settled at the next forward, a pass the record of
    pass graphs had pruned (every 64 passes) as dead was taken to live, and stayed in the
    model's per-step sum: a DQN acting with grad on for 300 steps before it learns had its
    model's row at 5 times one pass's bytes. It is the same whatever the acting steps."""

    def row(acting: int) -> int:
        torch.manual_seed(0)
        q = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 4))
        opt = torch.optim.Adam(q.parameters())
        with track(q, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(acting):
                q(torch.randn(1, 8)).argmax(1)  # acting: the graph is dropped at once
            for _ in range(2):
                q(torch.randn(1, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        rows = {m.path: m for m in tracker.report().devices[0].modules}
        return rows["Sequential"].activation_bytes_per_step

    assert row(300) == row(3) == 256 * 4 + 4 * 4  # the ReLU's output, the output (square saves it)


@pytest.mark.parametrize("nested", [False, True])
def test_kept_passes_add_up_and_dropped_ones_do_not_whatever_their_mix(nested: bool) -> None:
    """Review: a rollout keeping 64 passes' outputs for one backward, 64 acting passes that
    drop theirs, and 64 kept more: the record of pass graphs, cleared when 64 of them lived,
    then pruned, took the first 64 for dead (65 passes where 128 were kept). And a policy
    returning its output nested (``((logits,),)``) had no graph node found: every acting
    pass added up (301 passes after 300). Now 128 and 1 pass's bytes."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 4))

        def forward(self, x: torch.Tensor) -> Any:
            out = self.net(x)
            return ((out,),) if nested else out

    def row(kept: int, acting: int) -> int:
        torch.manual_seed(0)
        policy = Policy()
        opt = torch.optim.Adam(policy.parameters())
        unwrap = (lambda o: o[0][0]) if nested else (lambda o: o)
        with track(policy, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(2):
                outs = [unwrap(policy(torch.randn(1, 8))) for _ in range(kept)]
                for _ in range(acting):
                    unwrap(policy(torch.randn(1, 8))).argmax(1)
                outs += [unwrap(policy(torch.randn(1, 8))) for _ in range(kept)]
                torch.stack(outs).square().mean().backward()
                opt.step()
                opt.zero_grad()
        rows = {m.path: m for m in tracker.report().devices[0].modules}
        return rows["Policy"].activation_bytes_per_step

    one = row(1, 0) // 2
    assert row(64, 64) == 128 * one and row(1, 300) == 2 * one


def test_a_model_called_inside_a_loss_module_is_the_model() -> None:
    """Global hooks (``memkit run``): fairseq's ``loss = criterion(model, sample)``, the loss
    module calling the model. Everything inside the loss module's call was ignored: no
    forward phase, no module table, the activations left to the optimizer phase."""

    class Criterion(nn.Module):
        def forward(self, model: nn.Module, sample: dict[str, torch.Tensor]) -> torch.Tensor:
            return nn.functional.cross_entropy(model(sample["x"]), sample["y"])

    torch.manual_seed(0)
    model, criterion = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), Criterion()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(None, device="cpu", budget="64MiB", module_every=1) as tracker:
        for _ in range(3):
            sample = {"x": torch.randn(32, 64), "y": torch.randint(0, 10, (32,))}
            criterion(model, sample).backward()
            opt.step()
            opt.zero_grad()
    dev = tracker.report().devices[0]
    rows = {m.path: m for m in dev.modules}
    assert set(rows) == {"Sequential", "0", "1", "2"}
    assert rows["0"].activation_bytes == 0  # its output dies in the ReLU, which keeps its own
    assert rows["1"].activation_bytes == 32 * 256 * 4
    assert dev.phase_peaks["forward"] is not None


def test_the_batch_reaching_the_model_is_not_its_activations_on_the_simulated_device():
    """On the simulated device the batch is counted when it reaches the model, after the
    transition's reading: the model's row kept it as its own (4 MiB for a Linear keeping 2)."""
    model = nn.Sequential(nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(torch.randn(1024, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    # the output dies in .sum() (which keeps no input), the batch is the input the Linear
    # saves: nothing of the model's own is kept for backward (it was 4 MiB, then 2)
    assert rows["Sequential"].activation_bytes == rows["0"].activation_bytes == 0
    assert rows["0"].peak_over_entry >= 1024 * 512 * 4


def test_a_saved_tensor_hook_that_keeps_tensors_leaves_the_module_table_as_it_is():
    """Only the hooks known to keep nothing on the device (checkpointing's, save_on_cpu's)
    empty the module table's kept bytes; an identity hook (logging, a compression that stays
    on the device) keeps what it packs."""

    def run(hooked: bool) -> dict[str, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        region = (
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            if hooked
            else contextlib.nullcontext()
        )
        with track(model, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(2):
                with region:
                    loss = model(torch.randn(256, 64)).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
        return {m.path: m.activation_bytes for m in tracker.report().devices[0].modules}

    plain = run(False)
    assert plain["0"] >= 256 * 512 * 4
    assert run(True) == plain


def test_the_trainers_settings_reach_the_advice_before_a_step_shows_them():
    """A framework callback tells the tracker the trainer's accumulation and checkpointing
    (``Tracker.trainer_settings``) when training starts. An OOM in the first micro-batch,
    before an optimizer step or a recompute could show them, then advises on top of them:
    accumulate over twice the trainer's micro-batches, no 'checkpoint the blocks'. Without
    them, the same OOM advises both."""

    def oom(**settings: object):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with (
            pytest.raises(torch.OutOfMemoryError),
            track(model, opt, device="cpu", budget="3MiB", postmortem=None) as tracker,
        ):
            tracker.trainer_settings(**settings)  # type: ignore[arg-type]
            model(torch.randn(256, 64)).square().mean().backward()
        report = tracker.report()
        pm = report.oom
        assert pm is not None and pm.step == 0 and pm.checkpointed == ()
        return report, {a.code: a for a in pm.advice}["oom-activations"]

    told, advice = oom(accumulation_steps=4, checkpointing=True)
    assert told.oom is not None and told.oom.micro_batches == 4
    setup = told.devices[0].setup
    assert setup is not None and (setup.accumulation_steps, setup.checkpointing) == (4, True)
    assert json.loads(told.to_json())["oom"]["setup"]["accumulation_steps"] == 4
    assert "accumulates gradients over 4 micro-batches" in advice.action
    assert "accumulate over 8" in advice.action
    assert "torch.utils.checkpoint" not in advice.action
    assert "checkpointing is already on" in advice.evidence
    _, untold = oom()
    assert "accumulate gradients over 2 steps" in untold.action
    # (sweep XX: nanoGPT, accumulating over 2 already, ran out in its first micro-batch and
    # was told to accumulate over 2: followed, that halves its effective batch)
    assert "2 times what your loop already accumulates, if it does" in untold.action
    assert "torch.utils.checkpoint" in untold.action
    with pytest.raises(ConfigError, match=r"accumulation_steps: expected a whole number of micro"):
        track(nn.Linear(2, 2), device="cpu").trainer_settings(accumulation_steps=0)


def test_an_ema_copy_updated_between_steps_is_device_memory():
    """A diffusion or vision script keeps an EMA of its model and updates it after each
    optimizer step, between memkit's steps. On a GPU the copy lives on the device, so it is in
    every later step's peak; the simulated device only counted it at its first forward (an
    evaluation at the end), 10% low on a DDPM-like script. Work between steps that reads
    device memory is device work: the peak with the EMA is the peak without it plus the
    copy's bytes."""

    def peak(ema: bool) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
        shadow = copy.deepcopy(model).requires_grad_(False)
        opt = torch.optim.Adam(model.parameters())
        with track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
            for _ in range(3):
                model(torch.randn(32, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if ema:
                    with torch.no_grad():
                        for s, p in zip(shadow.parameters(), model.parameters(), strict=True):
                            s.lerp_(p, 0.01)
        return tracker.report().devices[0].peak_allocated

    copy_bytes = (64 * 512 + 512 + 512 * 64 + 64) * 4
    assert peak(ema=True) - peak(ema=False) == copy_bytes


def test_two_live_models_of_one_class_keep_their_own_rows():
    """cleanrl's PPO agent has an actor and a critic, both ``nn.Sequential``. Found by the
    global hooks (``memkit run``), their rows were merged: the last layer showed 32 calls and a
    blend of the actor's 1 KiB and the critic's 256 B. A model alive beside another of its
    class gets ``Class#2``; one re-created after its predecessor died shares the rows."""
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    critic = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam([*actor.parameters(), *critic.parameters()])
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(3):
            obs = torch.randn(64, 8)
            (actor(obs).square().mean() + critic(obs).square().mean()).backward()
            opt.step()
            opt.zero_grad()
    rows = {m.path: m for m in tracker.report().devices[0].modules}
    assert rows["Sequential.2"].calls == rows["Sequential#2.2"].calls == 3
    assert rows["Sequential.2"].activation_bytes == 64 * 4 * 4  # the actor's logits
    assert rows["Sequential#2.2"].activation_bytes == 64 * 1 * 4  # the critic's value

    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(2):  # a model rebuilt each round, the old one freed
            model = nn.Sequential(nn.Linear(8, 4))
            model(torch.randn(2, 8)).sum().backward()
            del model
    paths = {m.path for m in tracker.report().devices[0].modules}
    assert not any("#" in path for path in paths), paths


def test_host_work_between_steps_that_reads_the_model_or_the_dataset_stays_host_work():
    """What an EMA's update is (a write into tensors from device ones) and what it is not: an
    early-stopping snapshot ``{k: v.cpu().clone()}`` (a host copy on a GPU) and a reshuffle of
    the dataset that the last batch views (host data: only the batch's copy is on the device)
    must not count. The reshuffle of a 48 MiB dataset used to raise a false OOM on 16 MiB."""
    torch.manual_seed(0)
    x_train = torch.randn(16_384, 768)

    def peaks(snapshot: bool) -> list[int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(768, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = x_train
        with track(model, opt, device="cpu", budget="16MiB", postmortem=None) as tracker:
            for _ in range(2):
                for i in range(0, 128, 64):
                    xb = data[i : i + 64]
                    model(xb).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if snapshot:
                        best = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                        assert len(best) == 4
                data = data[torch.randperm(len(data))]  # while xb still views the old one
        return [s.peak_allocated for s in tracker.report().devices[0].steps]

    assert peaks(snapshot=True) == peaks(snapshot=False)


def test_an_oom_in_a_model_checkpointed_whole_names_the_model_as_checkpointed():
    """``checkpoint(model, x)``: the model itself is recomputed; its layers' rows have no
    prefix of its name, yet all of them are inside it."""
    from torch.utils.checkpoint import checkpoint

    def run(budget: int | None) -> TrackReport:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with (
            pytest.raises(torch.OutOfMemoryError) if budget else contextlib.nullcontext(),
            track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker,
        ):
            for _ in range(2):
                x = torch.randn(2048, 64, requires_grad=True)
                checkpoint(model, x, use_reentrant=False).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return tracker.report()

    pm = run(int(run(None).devices[0].peak_allocated * 0.9)).oom
    assert pm is not None and pm.checkpointed == ("Sequential",), pm.checkpointed
    assert [path for path, _ in pm.top_modules] in ([], ["Sequential"])


def test_blocks_in_two_threads_each_take_their_own_backward_passes():
    """torch.autograd.backward is wrapped process-wide: with a block in each of two threads,
    each block counts the backward passes of its own thread only (not one micro-batch too many,
    not the other thread's forward filed as 'other')."""

    def work(width: int, batch: int, out: dict[int, Any]) -> None:
        torch.manual_seed(width)
        model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with track(model, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(3):
                model(torch.randn(batch, 64)).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[width] = tracker

    alone: dict[int, Any] = {}
    work(1024, 256, alone)
    together: dict[int, Any] = {}
    threads = [
        threading.Thread(target=work, args=(w, b, together)) for w, b in ((128, 32), (1024, 256))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tracker in together.values():
        report = tracker.report()
        assert report.micro_batches == 1
        assert [s.backward_passes for s in report.devices[0].steps] == [1, 1, 1]
    big, big_alone = together[1024].report().devices[0], alone[1024].report().devices[0]
    assert big.phase_peaks == big_alone.phase_peaks


def test_blocks_that_end_out_of_order_put_torch_back():
    """Blocks in two threads can end in any order: the first one out leaves its wrappers dead
    under the other's, and the last one out puts torch's own functions back."""
    backward, engine = torch.autograd.backward, torch.autograd._engine_run_backward
    model = nn.Linear(8, 2)
    first, second = track(model, device="cpu"), track(model, device="cpu")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    model(torch.randn(4, 8)).sum().backward()
    second.__exit__(None, None, None)
    assert torch.autograd.backward is backward
    assert torch.autograd._engine_run_backward is engine
    autocast = torch.amp.autocast_mode.autocast  # (cuda_autocast's watch: it was left on)
    owners = {autocast.__init__.__module__, autocast.__enter__.__module__}
    assert owners == {"torch.amp.autocast_mode"}
    assert first.report().devices[0].steps == ()  # the dead wrapper counted nothing
    assert second.report().micro_batches == 1


def test_a_parametrization_read_outside_a_forward_is_not_a_training_forward():
    """spectral_norm evaluates its parametrization when it is registered, and a script's
    logging reads the weight between steps: under `memkit run`'s global hooks neither call is
    a training forward (it used to start the counting at model build, so the 8 MiB host
    dataset made next counted as device memory, and the logging read counted as a call)."""
    from torch.nn.utils.parametrizations import spectral_norm

    with track(device="cpu", budget="256MiB") as tracker:  # no model: global hooks
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        spectral_norm(model[0])
        data = torch.randn(8192, 256)  # 8 MiB of host data
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            x = data[torch.randint(0, 8192, (64,))]
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _ = model[0].weight.norm().item()  # logging
    report = tracker.report()
    assert report.steps == 2
    assert report.devices[0].peak_allocated < 2 << 20  # the model and its step, not the data
    linear = next(m for m in report.devices[0].modules if m.path == "0")
    assert linear.calls == 2


def test_an_oom_in_a_mean_teachers_forward_is_an_ema_s_and_the_students_activations_count():
    """A mean teacher (an EMA of the student, updated in place after every step, run under
    no_grad on the training batch): running out in its forward, the breakdown still counts
    what the student's forward keeps as activations (the pass inside the step does not start
    a new forward base), and the advice knows it changes every step: no offline outputs, no
    bf16 weights (the small updates would be lost), autocast for its forward."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                            nn.Linear(1024, 10))  # fmt: skip
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def step(batch: int) -> None:
        x = torch.randn(batch, 256)
        logits = student(x)
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters(), strict=True):
                t.mul_(0.99).add_(s, alpha=0.01)

    with pytest.raises(torch.OutOfMemoryError), track(device="cpu", budget="32MiB") as tracker:
        for batch in (16, 16, 1024):
            step(batch)
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "eval" and pm.step == 2
    assert pm.frozen_model is not None and pm.frozen_model[2] is True
    # the student's forward at 1024 keeps three 1024 x 1024 fp32 outputs for backward (4 MiB
    # each: Linear, ReLU, Linear; the last ReLU's too) before the teacher's forward begins
    assert pm.breakdown.activations >= 3 * 4 * 2**20
    advice = next(a for a in pm.advice if a.code == "oom-frozen-model")
    assert "EMA" in advice.evidence and "offline" not in advice.action
    assert "autocast" in advice.action


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        ("history.append(logits.detach())", "`history.append(logits.detach().cpu())`"),
        ("history[step] = out.hidden", "`history[key] = out.hidden.detach().cpu()`"),
        ("history.append((a, b))", "`history.append(x.detach().cpu())`"),
        ("self.history.append(out.clone().detach())", "`history.append(out.detach().cpu())`"),
    ],
)
def test_the_fix_names_the_tensor_the_line_keeps(code, fix):
    """Sweep HH: the fix said `history.append(x.detach().cpu())` for the line
    `history.append(logits.detach())`, whose `x` was the input batch: copied, it kept the
    wrong tensor. A line too complex to read keeps the placeholder."""
    from memkit.advice.leaks import graph_retained_advice
    from memkit.tracking.report import LeakFinding, LeakSuspect

    top = LeakSuspect("history", "train", "t.py", 11, code, "container", 8, True,
                      graph=False, length=8, item_shape=(64, 512), item_bytes=1 << 17,
                      tensor_bytes=1 << 20)  # fmt: skip
    (advice,) = graph_retained_advice([LeakFinding("cuda:0", 1 << 17, 2, 8, (top,))])
    assert fix in advice.action, advice.action


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_tensors_a_line_moves_to_the_cpu_are_the_simulated_devices_count(device):
    """``features.append(out.detach().cpu())`` frees a GPU; on the simulated device (the
    CPU) ``.cpu()`` keeps the same tensor: it proposed that very line as the fix. Where the
    device is a GPU's, the container's tensors were seen there: still a leak."""
    from memkit.advice.leaks import graph_retained_advice
    from memkit.tracking.report import LeakFinding, LeakSuspect

    code = "features.append(out.detach().cpu())"
    top = LeakSuspect("features", "hook", "h.py", 11, code, "container", 8, True,
                      graph=False, length=8, item_shape=(64, 512), item_bytes=1 << 17,
                      tensor_bytes=1 << 20)  # fmt: skip
    leak = LeakFinding(device, 1 << 17, 2, 8, (top,), grown_bytes=1 << 20)
    (advice,) = graph_retained_advice([leak])
    assert advice.code == "tensors-kept"
    if device == "cpu":
        assert advice.severity == "info" and advice.saving_bytes is None
        assert "simulated device" in advice.title and "x.detach().cpu()" not in advice.action
    else:
        assert advice.severity == "warning" and advice.saving_bytes == 1 << 20
    # a line that keeps a device tensor beside a number it takes (`.item()`) keeps the tensor
    kept = dataclasses.replace(top, code="hist.append((out.detach(), loss.item()))")
    (advice,) = graph_retained_advice([dataclasses.replace(leak, suspects=(kept,))])
    assert advice.severity == "warning" and advice.saving_bytes == 1 << 20
    # lines that end in the move, however they close (review)
    for code in (
        "buf.append((x.cpu(), y.cpu()))",
        "feats += [f.cpu()]",
        "out2 = out.to('cpu', non_blocking=True)",
        "o.append(out.detach().cpu()[:, 0])",
    ):
        moved = dataclasses.replace(top, code=code)
        (advice,) = graph_retained_advice([dataclasses.replace(leak, suspects=(moved,))])
        assert (advice.severity == "info") == (device == "cpu"), code


def test_the_breakdown_after_an_oom_in_backward_is_not_called_the_training_peak():
    """The segment an OOM ends is the post-mortem's, not the breakdown's: the breakdown is
    the highest moment before it (a forward), below the backward peak the table shows; its
    heading said "at the training peak"."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, opt, device="cpu", budget="4MiB") as tr,
    ):
        for step in range(4):
            x, y = torch.randn(128 << step, 64), torch.randint(0, 10, (128 << step,))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    report = tr.report()
    dev = report.devices[0]
    assert report.oom is not None and report.oom.phase == "backward"
    assert dev.breakdown is not None and dev.breakdown.phase == "forward"
    backward = dev.phase_peaks["backward"]
    assert backward is not None and backward > dev.breakdown.total
    text = str(report)
    assert "at the training peak" not in text
    assert "at the highest training moment measured before the error (step 1, forward" in text
    assert f"the backward peak, {format_size(backward)}, was where it failed" in text
    page = report._repr_html_()  # the HTML heading says the same
    assert "At the highest training moment measured before the error" in page


def test_gradients_an_optimizer_not_given_steps_are_not_stale():
    """track(model, optimizer=dense) while SparseAdam-like, a second optimizer steps the
    embedding: its gradients are that optimizer's, not stale."""

    class Rec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mlp = nn.Embedding(1000, 32), nn.Linear(32, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.emb(ids).mean(1))

    model = Rec()
    dense = torch.optim.Adam(model.mlp.parameters())
    embed = torch.optim.SGD(model.emb.parameters(), lr=0.1)
    with track(model, optimizer=dense, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            loss = model(torch.randint(0, 1000, (16, 8))).pow(2).mean()
            loss.backward()
            dense.step()
            embed.step()
    assert "stale-gradients" not in {a.code for a in tracker.report().advice}


@pytest.mark.parametrize("alternate", [False, True], ids=["adam-then-lbfgs", "side-by-side"])
def test_lbfgs_after_adam_takes_the_steps_over_at_its_second_closure_step(alternate: bool):
    """The two-stage PINN recipe (sweep BD): Adam for a while, then ``lbfgs.step(closure)``.
    LBFGS's first step ran its backward passes inside its closure, after its step() call, so
    the owner Adam seemed to have stepped right before it, and LBFGS never took the steps
    over: 10 steps for 12, the LBFGS stage one step that never ended, and the setup (and so
    the advice) Adam's. It now takes over at its second step (its first counts with the step
    before, as a k-fold run's next optimizer's); an LBFGS over the head stepped beside Adam in
    every iteration (review) never does."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    x, y = torch.randn(256, 2), torch.randn(256, 1)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = model[4].parameters() if alternate else model.parameters()
    lbfgs = torch.optim.LBFGS(params, max_iter=5, history_size=7)
    closures = [0]

    def closure() -> torch.Tensor:
        closures[0] += 1
        lbfgs.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    def adam_step() -> None:
        adam.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        adam.step()

    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(5):
            adam_step()
            if alternate:
                lbfgs.step(closure)
        for _ in range(0 if alternate else 3):
            lbfgs.step(closure)
    (dev,) = tracker.report().devices
    assert closures[0] > 3  # several closures a step: backward passes, not steps
    assert dev.setup is not None
    if alternate:
        assert [s.step for s in dev.steps] == list(range(5))
        assert dev.setup.optimizer == "Adam"
    else:  # Adam's 5 (its last with LBFGS's first), then LBFGS's other 2
        assert [s.step for s in dev.steps] == list(range(7))
        assert (dev.setup.optimizer, dev.setup.history_size) == ("LBFGS", 7)


def test_an_evaluation_ooms_batch_bound_leaves_out_what_earlier_passes_hold():
    """Sweep BC: an embedding loop with grad on keeps every pass's graph in a list and runs
    out; oom-eval's bound on the evaluation batch counted the earlier passes' graphs as this
    pass's, which scale with its batch. Checked against the same loop under memkit.simulate:
    beside what the earlier passes hold, the bound fits and one more sample does not."""

    def embed(model: nn.Module, outs: list[torch.Tensor]) -> None:
        for _ in range(100):
            outs.append(model(torch.randn(256, 256)))  # grad on: each keeps its graph

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()

    with (
        contextlib.suppress(torch.OutOfMemoryError),
        track(device="cpu", budget="16MiB", postmortem=None) as tracker,
    ):
        embed(model(), [])
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "eval" and pm.breakdown is not None
    (said,) = [a.evidence for a in pm.advice if a.code == "oom-eval"]
    bound = int(re.search(r"no evaluation batch above about (\d+) fits", said).group(1))

    def fits(size: int) -> bool:
        net, outs = model(), []
        with simulate("16MiB"):
            with contextlib.suppress(torch.OutOfMemoryError):
                embed(net, outs)
            try:
                net(torch.randn(size, 256))
            except torch.OutOfMemoryError:
                return False
        return True

    assert fits(bound) and not fits(bound + 1)


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(1000, 64), nn.Linear(64, 1000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _chat(model: nn.Module, history: list[Any]) -> None:
    """A generate()-like loop (greedy decoding, scores stacked), turn after turn, keeping each
    turn's tokens and scores on the device."""
    for _ in range(6):
        ids = torch.randint(0, 1000, (4, 8))
        scores = []
        with torch.no_grad():
            for _ in range(8):
                logits = model(ids)[:, -1]  # (the model's passes; the rest is between them)
                scores.append(logits.float())
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        history.append((ids, torch.stack(scores, 1)))


def test_what_ops_make_between_model_passes_from_its_outputs_is_device_memory():
    """Sweep BC: a chat loop keeping every generate() output (tokens, stacked scores) on the
    device measured 1.19 MiB on the simulated device where every tensor counted says 4.13: the
    ops between the model's passes (stacking, argmax, cat) were host work to the simulated
    device's rule. An op reading counted tensors now counts what it makes, as on a GPU.
    Checked against memkit.simulate, which counts every tensor."""
    torch.manual_seed(0)
    model = _TinyLM().eval()
    history: list[Any] = []
    with track(model, device="cpu", budget="64MiB") as tracker:
        _chat(model, history)
    tracked = tracker.report().devices[0]
    torch.manual_seed(0)
    model, every = _TinyLM().eval(), []
    with simulate("64MiB", track=model) as sim:
        _chat(model, every)
        counted_at_end = sim.current
    kept = sum(t.numel() * t.element_size() for turn in every for t in turn)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert counted_at_end == params + kept  # (the independent count's own check)
    assert tracked.final_allocated == params + kept
    assert tracked.peak_allocated == sim.peak


def test_a_models_deepcopy_between_steps_is_counted_as_made():
    """Sweep BC: ``snapshots.append(copy.deepcopy(model))`` every epoch (never run) measured
    4.76 MiB where every tensor counted says 19.87: a copy made between steps was counted only
    from its first forward or update."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshots = []
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(4):
            model(torch.randn(32, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            snapshots.append(copy.deepcopy(model))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    dev = tracker.report().devices[0]
    assert dev.final_allocated == params * (1 + len(snapshots))


def test_an_oom_in_a_no_grad_pass_inside_the_step_counts_the_steps_forward_as_activations():
    """Review: a no-grad pass of the trained model inside a step (FixMatch-style pseudo-labels
    after the labelled forward, before backward) ran out; with the evaluation pass's own base
    the labelled forward's graph, alive, was filed as "other". Inside a step's forward the
    base stays the step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, opt, device="cpu", budget="24MiB", postmortem=None) as tracker,
    ):
        for unlabeled in (64, 6000):
            logits = model(torch.randn(512, 256))  # the labelled forward: its graph alive
            with torch.no_grad():
                pseudo = model(torch.randn(unlabeled, 256)).argmax(-1)
            loss = nn.functional.cross_entropy(logits, pseudo[:512] if unlabeled > 512 else
                                               torch.zeros(512, dtype=torch.long))  # fmt: skip
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    pm = tracker.report().oom
    assert pm is not None and pm.breakdown is not None
    assert pm.breakdown.activations >= 2 * 512 * 1024 * 4  # the labelled forward's, kept


def test_module_cpu_and_a_worker_between_steps_keep_the_model_and_count_nothing_new():
    """Review: with ``.cpu()`` returning host copies, Lightning's teardown
    (``lightning_module.cpu()``) swapped the weights for uncounted clones; and a forked
    DataLoader worker kept ``device_work`` on and could run out. ``.cpu()`` between steps
    now returns a view (a parameter: itself), and a forked child does no device work."""
    from memkit.simulated.accountant import MemoryAccountant, _stop_counting_in_child

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(torch.randn(32, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        before = [p.data_ptr() for p in model.parameters()]
        model.cpu()  # (Strategy.teardown)
        snapshot = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        assert [p.data_ptr() for p in model.parameters()] == before
        # the script runs as without memkit: a parameter's .cpu() is the parameter (its
        # deepcopy works), a tensor's .cpu() shares its storage (in-place reaches it)
        kept = copy.deepcopy({k: p.cpu() for k, p in model.named_parameters()})
        assert all(p.cpu() is p for p in model.parameters()) and len(kept) == 4
        weight = model[0].weight.detach()
        weight.cpu().add_(1.0)
        weight.cpu().sub_(1.0)
        assert model[0].weight.data_ptr() == weight.cpu().data_ptr()
        model(torch.randn(32, 256)).square().mean().backward()
    assert tracker.report().devices[0].final_allocated >= params
    assert len(snapshot) == 4
    acct = MemoryAccountant("cpu")
    acct.device_work = True
    _stop_counting_in_child()  # (the fork hook)
    assert not (acct.counting or acct.adopting or acct.device_work)


def test_an_oom_between_steps_files_the_snapshot_as_other_and_says_where():
    """Review: with what ops make between steps counted, a best-model snapshot
    (``copy.deepcopy``) can run out after the optimizer step; the post-mortem filed the
    copies as activations and spoke only of the optimizer state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    opt = torch.optim.Adam(model.parameters())
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, opt, device="cpu", budget="46MiB", postmortem=None) as tracker,
    ):
        for _ in range(3):
            loss = model(torch.randn(64, 1024)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # (the gradients stay until the next zero_grad)
            snapshots = [copy.deepcopy(model.state_dict()), copy.deepcopy(model)]
            del snapshots
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "other" and pm.breakdown is not None
    assert pm.breakdown.activations == 0 and pm.breakdown.other >= 8 << 20  # a whole copy
    assert "oom-between-steps" in {a.code for a in pm.advice}


def test_an_oom_between_backward_and_the_optimizer_step_is_not_said_to_be_between_steps():
    """Review: SAM's perturbation (``e_w = p.grad * rho``) ran out after backward and before
    the optimizer step: phase other, outside any module, and oom-between-steps said "after an
    optimizer step" and to free the gradients, which the step still needs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(model, opt, device="cpu", budget="36MiB", postmortem=None) as tracker,
    ):
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(64, 1024)).pow(2).mean().backward()
            perturbed = [p.grad * 0.05 for p in model.parameters() for _ in range(step // 2 * 2)]
            opt.step()
            del perturbed
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "other" and pm.after_backward
    assert "oom-between-steps" not in {a.code for a in pm.advice}


def test_a_failure_of_the_host_view_never_reaches_the_scripts_cpu_call(monkeypatch):
    """memkit's own error in ``.cpu()``'s host view (between steps) leaves the script's
    ``.cpu()`` as torch's: the tensor itself."""
    from memkit.simulated.accountant import MemoryAccountant

    def broken(self: Any, tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("memkit's own bug")

    monkeypatch.setattr(MemoryAccountant, "host_view", broken)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB"):
        for _ in range(2):
            out = model(torch.randn(4, 8))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            kept = out.detach()
            assert kept.cpu() is kept


def fused_backward_steps(
    iterations: int, tracked: bool, budget: str = "64MiB", batch: int = 128
) -> tuple[Any, int]:
    """PyTorch's tutorial "fusing the optimizer step into the backward pass": one Adam per
    parameter, stepped and zeroed by ``register_post_accumulate_grad_hook``; no
    ``optimizer.step()`` in the loop. ``(the report, 0)`` tracked, else ``(None, the peak
    of the whole run counted by the simulated device alone)``."""
    torch.manual_seed(0)
    counting = simulate("64MiB") if not tracked else contextlib.nullcontext()
    with counting as counted:
        model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3)))
        step_in_backward(model.parameters(), lambda ps: torch.optim.Adam(ps, foreach=False))
        block = (
            track(model, device="cpu", budget=budget, postmortem=None)
            if tracked
            else contextlib.nullcontext()
        )
        with contextlib.suppress(torch.OutOfMemoryError), block as t:
            for _ in range(iterations):
                model(torch.randn(batch, 256)).pow(2).mean().backward()
    return (t.report(), 0) if tracked else (None, counted.peak)


def test_an_optimizer_step_fused_into_backward_ends_the_step_with_the_backward():
    """Sweep BH: each step ended at the first per-parameter ``step()``, mid-backward: step 0's
    peak read 5.03 MiB where its iteration reached 13.85, and backward's work between the
    per-parameter steps was filed as "other". The steps now end with their backward, whose
    phase the optimizers' work stays in."""
    report, _ = fused_backward_steps(3, tracked=True)
    dev = report.devices[0]
    assert dev.peak_allocated == fused_backward_steps(3, tracked=False)[1]
    assert report.steps == 3 and len(dev.steps) == 3
    for s in dev.steps:
        peaks = s.phase_peaks
        assert peaks["optimizer"] is None
        assert s.peak_allocated == peaks["backward"] > (peaks["other"] or 0)
    params = sum(p.numel() * 4 for p in nn.Linear(256, 256).parameters()) * 3
    steps = 6 * 4  # each Adam's float32 ``step`` of its one parameter
    assert dev.breakdown is not None and dev.breakdown.optimizer_state == 2 * params + steps


def test_an_oom_where_the_optimizer_steps_in_backward_advises_no_accumulation():
    """Sweep BH: the post-mortem counted every parameter's gradient to come, where one lives
    at a time, and advised accumulating micro-batches, which a step inside backward cannot."""
    report, _ = fused_backward_steps(2, tracked=True, budget="8MiB", batch=2048)
    pm = report.oom
    assert pm is not None and pm.setup is not None
    largest = 256 * 256 * 4
    assert pm.setup.stepped_in_backward_bytes == (largest, 3 * (largest + 256 * 4))
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    assert f"one parameter at a time, the largest's ({format_size(largest)}" in adv.evidence
    assert "accumulate gradients over" not in adv.action
    assert "gradients cannot accumulate over micro-batches" in adv.action


class Bigram(nn.Module):
    def __init__(self, vocab: int = 2000) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.lm_head = nn.Linear(16, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.emb(x))


def bigram_loop(budget: str | int, iterations: int = 3, accumulate: int = 1) -> TrackReport:
    """The usual ``logits = model(x)`` loop: the last step's (micro-batch's) logits stay
    bound until the next forward returns."""
    torch.manual_seed(0)
    model = Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = track(model, opt, device="cpu", budget=budget, postmortem=None)
    with contextlib.suppress(torch.OutOfMemoryError), tracker:
        for _ in range(iterations):
            for _ in range(accumulate):
                x, y = torch.randint(0, 2000, (8, 64)), torch.randint(0, 2000, (8, 64))
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.view(-1, 2000), y.view(-1))
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.report()


def test_the_last_steps_output_freed_when_the_forward_returns_is_not_other_in_backward():
    """Sweep BI: the breakdown at a backward peak called the last step's logits "other" (they
    were alive when the forward began, and freed when it returned), and an OOM there was
    advised ``oom-other``, "free what you keep across steps": deleting them saves nothing."""
    report = bigram_loop("64MiB")
    bd = report.devices[0].breakdown
    logits = 8 * 64 * 2000 * 4
    batch = 2 * 8 * 64 * 8  # x and y, int64
    assert bd is not None and bd.phase == "backward"
    assert bd.other <= batch < logits
    ran_out = bigram_loop(report.devices[0].peak_allocated - 1)
    assert ran_out.oom is not None and ran_out.oom.phase == "backward"
    assert ran_out.oom.breakdown.other <= batch
    assert "oom-other" not in {a.code for a in ran_out.oom.advice}
    # review: under accumulation, the last micro-batch's logits are this step's own
    accumulating = bigram_loop("64MiB", accumulate=2).devices[0]
    assert accumulating.breakdown is not None and accumulating.breakdown.other <= batch


def test_an_oom_in_step_0_of_a_checkpointed_model_does_not_advise_checkpointing():
    """Sweep BH: an OOM inside a checkpointed block at step 0, before any backward recomputed
    one, was told "or checkpoint the largest blocks"; the forward's checkpoint regions show
    it already runs."""
    torch.manual_seed(0)
    model = CheckpointedBlocks(128, residual=True)
    opt = torch.optim.AdamW(model.parameters())
    tracker = track(model, opt, device="cpu", budget="16MiB", postmortem=None)
    with pytest.raises(torch.OutOfMemoryError), tracker:
        model(torch.randn(4096, 128)).square().mean().backward()
    pm = tracker.report().oom
    assert pm is not None and pm.step == 0 and pm.phase == "forward"
    (advice,) = [a for a in pm.advice if a.code == "oom-activations"]
    assert "checkpointing is already on" in advice.evidence
    assert "checkpoint the largest blocks" not in advice.action


def test_offloading_with_save_on_cpu_on_the_simulated_device_is_said_to_stay_counted():
    """Sweep BH: on the simulated device ``save_on_cpu``'s host copy is the tensor itself, so
    what a GPU moves off stays counted (22.78 MiB where the CUDA stand-in reads 8.29); the
    report said nothing of it."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            with torch.autograd.graph.save_on_cpu():
                loss = model(torch.randn(32, 64)).square().mean()
            loss.backward()
    notes = [n for n in tracker.report().notes if n.startswith("save_on_cpu:")]
    assert len(notes) == 1 and "stay counted" in notes[0]


def test_a_tensor_subclass_batch_keeps_tracking_on():
    """Review: a tensor subclass's storage (a DTensor's, a TwoTensor's) has no data pointer to
    read; the snapshot of the last step's outputs raised at step 1 and tracking stopped."""
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            x = torch.randn(8, 16)
            pair = TwoTensor(x, x.clone())  # (alive at the next forward's start, as its output)
            out = model(pair)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    assert report.steps == 3 and not any("stopped tracking" in n for n in report.notes)


def test_an_optimizer_stepped_outside_backward_beside_one_inside_owns_the_steps():
    """Review: an embedding stepped by a post-accumulate-grad hook beside an AdamW over the
    rest. The hook's optimizer took the steps: each ended with the backward, and AdamW's step,
    the one that makes its state included, fell into the next."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 500))
    emb = model[0].weight
    step_in_backward([emb], lambda ps: torch.optim.SGD(ps, lr=0.1))
    main = torch.optim.AdamW([p for p in model.parameters() if p is not emb])
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            x = torch.randint(0, 500, (8, 16))
            nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            main.step()
            main.zero_grad()
    report = tracker.report()
    assert report.steps == 3 and report.optimizer_name == "AdamW"
    assert all(s.phase_peaks["optimizer"] for s in report.devices[0].steps)


def test_a_half_models_gradients_copied_to_fp32_master_weights_are_not_stale():
    """Sweep BJ: an apex/Megatron-style loop (a bf16 model, fp32 master copies stepped by the
    optimizer, the model's gradients copied over and freed after each step) was told its
    model's gradients belong to parameters no optimizer steps, "saving ~4.99 MiB"; they live
    for a backward, not a step (freeing them sooner left the peak where it was)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)).to(torch.bfloat16)
    master = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-4)
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(4):
            model(torch.randn(32, 128, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            for p, m in zip(model.parameters(), master, strict=True):
                m.grad = p.grad.float()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, m in zip(model.parameters(), master, strict=True):
                    p.copy_(m)
            model.zero_grad(set_to_none=True)
    assert "stale-gradients" not in {a.code for a in tracker.report().advice}


def test_a_post_accumulate_grad_hook_that_steps_nothing_is_no_step_in_backward():
    """Review: any post-accumulate-grad hook (a NaN check) was read as the optimizer stepping
    in backward: the post-mortem of an accumulating AdamW loop counted one parameter's
    gradient to come and said no step could accumulate."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3)))
    check_finite(model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    tracker = track(model, opt, device="cpu", budget="8MiB", postmortem=None)
    with contextlib.suppress(torch.OutOfMemoryError), tracker:
        for _ in range(2):
            model(torch.randn(2048, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    pm = tracker.report().oom
    assert pm is not None and pm.setup is not None
    assert pm.setup.stepped_in_backward_bytes is None
    (adv,) = [a for a in pm.advice if a.code == "oom-activations"]
    assert "one parameter at a time" not in adv.evidence
    assert "accumulate gradients over" in adv.action


def test_steps_in_backward_after_a_kfold_fold_whose_optimizer_is_gone_are_counted():
    """Review: fold 1 trains with AdamW (its optimizer then deleted), fold 2 steps each
    parameter inside backward; the dead owner's weak reference was taken for an owner and
    fold 2's steps went uncounted (3 steps of 6)."""
    torch.manual_seed(0)
    with track(device="cpu", budget="64MiB") as tracker:
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
        del model, opt
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        step_in_backward(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
        for _ in range(3):
            model(torch.randn(8, 32)).sum().backward()
    assert tracker.report().steps == 6


def test_tracker_step_with_the_optimizer_stepping_in_backward_adds_no_empty_step():
    """Review: ``tracker.step()`` once an iteration, the optimizer stepping inside backward:
    the step pending from the backward ended once more at the next forward (6 of 5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    step_in_backward(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(5):
            model(torch.randn(8, 32)).sum().backward()
            tracker.step()
    assert tracker.report().steps == 5


def test_memory_growth_does_not_say_a_list_without_a_graph_held_one():
    """A leak of inference-mode samples found late in a run (sweep BM: a diffusion trainer's
    ``self.all_samples``): the scans saw the list but not growing. The advice says it kept
    tensors without a graph, names the loss as the only graph, and its title gives the leak's
    period."""
    from memkit.advice.leaks import graph_retained_advice
    from memkit.tracking.report import LeakFinding, LeakSuspect

    samples = LeakSuspect("self.all_samples", "train", "t.py", 88, "x.append(s)", "container",
                          0, False, graph=False, length=3)  # fmt: skip
    loss = LeakSuspect("loss", "train", "t.py", 68, "loss = f(x)", "tensor", 9, False)
    leak = LeakFinding("cpu", 12 << 10, 6, 9, (samples, loss), period=4, grown_bytes=144 << 10)
    (advice,) = graph_retained_advice([leak])
    assert advice.code == "memory-growth" and advice.title.startswith("memory grows every 4 ")
    assert "`loss` (t.py:train():68) held an autograd graph" in advice.evidence
    assert "`self.all_samples` (t.py:train():88) kept device tensors without a graph and was" in (
        advice.evidence
    )


def test_a_model_called_with_a_list_of_images_has_its_input_shape_and_batch_bytes():
    """A detection model takes a list of images of different sizes (torchvision's references,
    DETR): the OOM's input shape is the count and the first image's shape, and the batch's
    bytes are all the images' (sweep BO: no shape, 0 bytes, so oom-batch could never fire)."""

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU())

        def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
            h = max(i.shape[1] for i in images)
            w = max(i.shape[2] for i in images)
            padded = torch.zeros(len(images), 3, h, w)
            for k, image in enumerate(images):
                padded[k, :, : image.shape[1], : image.shape[2]] = image
            return self.body(padded).mean()

    model = Detector()
    images = [torch.randn(3, 96, 64), torch.randn(3, 64, 96), torch.randn(3, 80, 80)]
    with (
        simulate("2MiB"),
        pytest.raises(torch.OutOfMemoryError),
        track(model, postmortem=None) as tracker,
    ):
        model(images).backward()
    pm = tracker.report().oom
    assert pm is not None and pm.input_shape == (3, 3, 96, 64)
    assert pm.batch_bytes == sum(i.numel() * 4 for i in images)


def test_targets_a_dataset_keeps_explain_no_growth_after_the_epoch_that_counted_them():
    """A detection dataset keeps its target tensors and feeds the same ones each epoch (sweep
    BO): the simulated device counts each the first time it reaches the model, in the first
    epoch. Outputs kept on the device each epoch then grow the level; the targets, all counted
    before that climb began, are not offered as its explanation (they said "no leak")."""

    class Det(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(64, 16)

        def forward(self, x: torch.Tensor, targets: list[torch.Tensor]) -> torch.Tensor:
            return self.net(x).sum() + sum(t.float().sum() for t in targets) * 0

    torch.manual_seed(0)
    data = [(torch.randn(4, 64), [torch.randint(0, 9, (2000,)) for _ in range(4)])
            for _ in range(3)]  # fmt: skip
    model = Det()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(5):
            for x, targets in data:
                loss = model(x, targets)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                kept.append(model.net(torch.randn(64, 64)))  # outputs kept on the device
    leak = tracker.report().devices[0].leak
    assert leak is not None and leak.period == 3
    assert leak.held_batches == 0 and leak.held_batch_bytes == 0


def test_checkpointing_and_precision_advice_count_every_pass_a_step_keeps():
    """A triplet step calls the model three times before one backward (sweep BP): all three
    passes' activations live until it. The advice priced one pass: checkpointing promised
    3.08 MiB where applying it saved 9.44 MiB, mixed precision 1.44 where it saved 5.84."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.net(x)

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    opt = torch.optim.Adam(model.parameters())
    loss_fn = nn.TripletMarginLoss()
    for micro in (1, 4):  # with accumulation too: each micro-batch keeps its three passes
        with track(model, opt, device="cpu", budget="12MiB", module_every=1) as tracker:
            for _ in range(3):
                for _ in range(micro):
                    a, p, n = (model(torch.randn(256, 128)) for _ in range(3))
                    (loss_fn(a, p, n) / micro).backward()
                opt.step()
                opt.zero_grad()
        report = tracker.report()
        blocks = [m for m in report.devices[0].modules if m.path in ("0", "1", "2", "3")]
        one_pass = sum(m.activation_bytes for m in blocks)  # what the blocks keep per call
        assert sum(m.activation_bytes_per_step or 0 for m in blocks) == 3 * one_pass
        by_code = {a.code: a for a in report.advice}
        saving = by_code["activation-checkpointing"].saving_bytes  # less the blocks' outputs
        assert saving is not None and saving > one_pass, micro  # (one pass's: 786,432 B)


def test_a_list_of_the_models_parameters_is_no_leak_candidate():
    """``params = list(model.parameters())`` (for clip_grad_norm_ or an optimizer) holds the
    weights, never what grows: not named among the lists of device tensors (sweep BO's
    memory-growth advice offered it); a list of kept outputs still is."""
    from memkit.tracking.leaks import scan_frames

    model = nn.Linear(4, 4)
    params = list(model.parameters())
    kept = [model(torch.randn(2, 4)).detach() for _ in range(3)]
    names = {c.name for c in scan_frames(holders=lambda t: True)}
    assert "kept" in names and "params" not in names
    del params, kept


def test_optimizer_state_that_grows_every_step_is_not_called_no_leak():
    """SGD's momentum on sparse gradients appends each step's rows without coalescing (sweep
    BQ: a DLRM's buffer went from 768 rows to 38,387 in 60 steps): persistent bytes rising at
    every step are no one-off (unfreezing, a grown mask), so the note does not say "not a
    leak"; it names the cause and the optimizers that keep a fixed size."""
    torch.manual_seed(0)
    emb = nn.Embedding(4000, 16, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    with track(emb, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(14):
            emb(torch.randint(0, 4000, (256,))).sum().backward()
            opt.step()
            opt.zero_grad()
    notes = " ".join(tracker.report().notes)
    assert "grows step after step runs out in a long run" in notes
    assert "SparseAdam or Adagrad" in notes and "not a leak" not in notes


def test_persistent_growth_that_stopped_stays_no_leak_however_many_steps_it_took():
    """A buffer grown to the longest input over 14 sorted length buckets, then a second epoch
    of the same buckets (review): the persistent bytes rose at many steps but stopped, so the
    note says "not a leak", not that the state grows step after step."""

    class CachedMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(1, 1))
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[1]
            if self.mask.shape[0] < n:  # grown to the longest input so far, as HF's caches
                self.mask = torch.ones(n, n).tril()
            return self.proj(x).sum() + self.mask[:n, :n].sum() * 0

    model = CachedMask()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            for length in range(64, 64 * 15, 64):
                model(torch.randn(2, length, 8)).backward()
                opt.step()
                opt.zero_grad()
    notes = " ".join(tracker.report().notes)
    assert "runs out in a long run" not in notes


def test_a_dict_that_began_with_parameters_and_grows_with_outputs_stays_a_candidate():
    """``store = dict(model.named_parameters())`` then kept outputs added (review): its first
    items are parameters, its last are not: still a candidate."""
    from memkit.tracking.leaks import scan_frames

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    store: dict[str, torch.Tensor] = dict(model.named_parameters())
    for i in range(10):
        store[f"out{i}"] = model(torch.randn(2, 4)).detach()
    assert "store" in {c.name for c in scan_frames(holders=lambda t: True)}
    del store


def test_tracker_step_after_each_optimizer_step_counts_each_iteration_once():
    """A loop that calls ``optimizer.step()`` and then ``tracker.step()`` (sweep BQ: 61 steps
    for 60 iterations): the first call is the boundary the optimizer's step just made, not an
    empty step; later ones are the only boundaries, as documented."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for evaluate in (False, True):  # (a no_grad validation pass between them too: review)
        with track(model, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(5):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                if evaluate:
                    with torch.no_grad():
                        model(torch.randn(16, 8))
                tracker.step()
        report = tracker.report()
        assert report.steps == 5 == len(report.devices[0].steps), evaluate
        assert report.step_rule == "manual"


def test_an_lstm_fed_packed_sequences_has_its_backward_attributed_to_it():
    """Sweep CA: an LSTM's output is ``(PackedSequence, (h, c))``; no backward hook was put
    on it, and its backward (most of the step's memory) was labelled with the head called
    before it (``fc``): the timeline and the OOM's module said ``backward of fc``."""
    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            self.lstm = nn.LSTM(32, 64, batch_first=True)
            self.fc = nn.Linear(64, 4)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(
                self.emb(x), lengths, batch_first=True, enforce_sorted=False
            )
            _, (h, _) = self.lstm(packed)
            return self.fc(h[-1])

    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(2):
            lengths = torch.randint(50, 200, (16,))
            out = model(torch.randint(0, 100, (16, 200)), lengths)
            nn.functional.cross_entropy(out, torch.randint(0, 4, (16,))).backward()
            opt.step()
            opt.zero_grad()
    bd = tracker.report().devices[0].breakdown
    assert bd is not None and bd.phase == "backward" and bd.module == "lstm"


def test_an_evaluations_kept_tensors_are_not_explained_by_gradients_alive_at_a_boundary():
    """Sweep CE: a nanoGPT loop (zero_grad right after the step) whose MoE router appends
    its logits to a list on every forward, evaluation's every 5 steps: the note said the rise
    at the evaluation's step was "all of it the model's parameters ..., gradients and
    optimizer state: not a leak". The gradients alive at a boundary were compared with bytes
    measured where they were freed; they are left out of that comparison now."""

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(64, 64)
            self.history: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            self.history.append(y.detach()[:, :4])  # 1 KiB a forward
            return y

    torch.manual_seed(0)
    model = Router()
    opt = torch.optim.AdamW(model.parameters())
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for it in range(16):
            if it % 5 == 0:
                with torch.no_grad():
                    for _ in range(8):
                        model(torch.randn(64, 64))
            model(torch.randn(64, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    report = tracker.report()
    assert not [n for n in report.notes if "not a leak" in n], report.notes
    assert report.leaks and report.leaks[0].growth_per_step >= 1024


def test_a_models_method_run_outside_its_forward_is_one_evaluation_pass():
    """Sweep CF: pytorch/examples' VAE samples with `model.decode(z)` after its test loop:
    its fc3, fc4 and dec called alone were 3 evaluation passes ("10 forward pass(es)" where
    6 ran), and dec's input, (64, 64, 7, 7), was called the largest evaluation input."""

    class VAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.fc3, self.fc4 = nn.Linear(784, 20), nn.Linear(20, 64), nn.Linear(64, 784)

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.fc4(nn.functional.relu(self.fc3(z))))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decode(self.enc(x))

    model = VAE()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            nn.functional.mse_loss(model(torch.rand(32, 784)), torch.rand(32, 784)).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for _ in range(3):
                model(torch.rand(16, 784))
            model.decode(torch.randn(256, 20))  # the sample grid
            model.decode(torch.randn(64, 20))  # (sweep CH: decodes in a row are passes each)
            model.enc(torch.rand(16, 784))  # (and an encode after a decode)
    report = tracker.report()
    assert report.eval_forwards == 6 and report.eval_input_shape == (16, 784)


def test_an_ema_copy_validated_now_and_then_on_the_training_batch_size_is_evaluation():
    """Sweep CG: a timm-style ViT validated its EMA copy every 5 steps with the training
    batch size, and the report called it "a model no optimizer trains on the training batch"
    (a teacher). A frozen model that runs in fewer than half of the steps is evaluation; one
    run in every step (a teacher) stays one."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters())
    with track(device="cpu", budget="64MiB") as tracker:  # (global hooks, as `memkit run`)
        for step in range(10):
            nn.functional.cross_entropy(
                model(torch.randn(16, 64)), torch.zeros(16).long()
            ).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 0.01)
                if (step + 1) % 5 == 0:
                    for _ in range(3):
                        ema(torch.randn(16, 64))  # validation, the training batch's size
    report = tracker.report()
    assert report.frozen_model is None and report.frozen_forwards == 0
    assert report.eval_forwards == 6 and report.eval_input_shape == (16, 64)


def test_a_backward_oom_in_a_functional_op_names_the_autograd_node():
    """Sweep CO: pytorch/examples' MNIST ran out in backward at the functional ReLU after
    conv2, and the post-mortem said "backward of fc1": backward hooks sit on modules with
    parameters, so the label is the last one backward reached, whose backward had ended. On
    the simulated device the autograd node that ran out is named, beside that module."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 4096), nn.Linear(4096, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = Net()
    tracker = track(model, device="cpu", budget="5.5MiB", postmortem=None)
    with pytest.raises(torch.OutOfMemoryError), tracker:
        model(torch.randn(64, 64)).sum().backward()
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "backward" and pm.module == "down"
    assert pm.node == "ReluBackward0"
    assert pm.where.endswith("backward, in ReluBackward0, after the gradient reached down (Linear)")


def test_the_autograd_node_of_an_earlier_caught_oom_is_not_named_for_another_error():
    """Review CK: a simulated OOM at ReluBackward0, caught (a retry at a smaller batch), then
    a cuBLAS allocation failure in another backward: the post-mortem named ReluBackward0."""

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 4096), nn.Linear(4096, 64)

        def forward(self, x: torch.Tensor, boom: bool) -> torch.Tensor:
            h = torch.relu(self.up(x))
            return self.down(Boom.apply(h) if boom else h)

    torch.manual_seed(0)
    model = Net()
    tracker = track(model, device="cpu", budget="5.5MiB", postmortem=None)
    with pytest.raises(RuntimeError, match="CUBLAS"), tracker:
        with pytest.raises(torch.OutOfMemoryError):
            model(torch.randn(64, 64), False).sum().backward()
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 64), True).sum().backward()
    pm = tracker.report().oom
    assert pm is not None and pm.phase == "backward" and pm.node is None


def test_an_oom_before_the_growth_window_names_a_list_of_losses_kept_with_graphs():
    """Sweep CO: pytorch/examples' MNIST keeping every loss tensor (backward with
    retain_graph) in a list ran out at step 4, before the growth detector's window: only the
    generic oom-other, with no variable. The post-mortem scans the failing frames for a list
    the script grows with losses that keep their graphs, and names it with its line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    tracker = track(model, opt, device="cpu", budget="24MiB", postmortem=None)
    with pytest.raises(torch.OutOfMemoryError), tracker:
        for _ in range(50):
            loss = nn.functional.cross_entropy(model(torch.randn(512, 64)), torch.zeros(512).long())
            loss.backward(retain_graph=True)  # (the script's own reason: a second use)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
    pm = tracker.report().oom
    assert pm is not None and pm.leak is None and pm.step < 10, pm
    (advice,) = [a for a in pm.advice if a.code == "oom-other"]
    assert "`losses` (" in advice.evidence and "test_track.py:" in advice.evidence
    assert advice.action.startswith("Append the losses' values (`loss.item()`)")
    losses.clear()
