"""What trainers need of the tracker: closure steps, held evaluation loops, parameterless
submodules run on their own, and cheap step records (memkit/integrations builds on these)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from memkit.tracking import track


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def same_steps(a, b) -> bool:
    strip = lambda s: dataclasses.replace(s, duration_s=0.0)  # noqa: E731
    return [strip(s) for s in a] == [strip(s) for s in b]


def test_closure_step_has_the_numbers_of_the_plain_step():
    """``optimizer.step(closure)`` runs forward and backward inside step() (Lightning, LBFGS):
    the optimizer phase starts when the closure returns, so the numbers are the plain loop's."""

    def run(closure: bool):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.Adam(model.parameters())
        with track(model, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(3):
                x = torch.randn(32, 64)

                def step(x: torch.Tensor = x) -> torch.Tensor:
                    opt.zero_grad()
                    loss = model(x).sum()
                    loss.backward()
                    return loss

                if closure:
                    opt.step(closure=step)
                else:
                    loss = step()
                    opt.step()
                    del loss
        return tracker.report().devices[0], model

    plain, model = run(False)
    closed, _ = run(True)
    assert closed.phase_peaks == plain.phase_peaks
    assert closed.breakdown == plain.breakdown
    assert closed.modules == plain.modules and same_steps(closed.steps, plain.steps)
    # independent count: Adam keeps two moments per parameter and a 0-dim float step each
    params = list(model.parameters())
    param_bytes = sum(p.numel() * 4 for p in params)
    bd = closed.breakdown
    assert bd is not None and bd.phase == "optimizer"
    assert bd.parameters == bd.gradients == param_bytes
    assert bd.optimizer_state == 2 * param_bytes + 4 * len(params)


def test_positional_closure_is_wrapped_too():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 64)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        opt.step(closure)
        opt.step(closure)
    dev = tracker.report().devices[0]
    # the momentum buffers are made in the optimizer phase, after the closure's backward
    assert [s.phase_peaks["optimizer"] is not None for s in dev.steps] == [True, True]
    momentum = sum(p.numel() * 4 for p in model.parameters())
    assert dev.steps[0].end_allocated - dev.steps[0].start_allocated >= momentum


def test_parameterless_submodule_run_alone_is_not_an_evaluation_pass():
    """A metric or loss module of the tracked model, called on its own under no_grad, is not
    the model: no eval pass, no row, and the training step's numbers do not change."""

    class Counter(nn.Module):  # a torchmetrics-like module: no parameters
        def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (logits.argmax(-1) == y).sum()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()
            self.accuracy = Counter()

    def run(metric: bool):
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with track(net, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(2):
                x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
                logits = net.body(x)
                if metric:
                    with torch.no_grad():
                        net.accuracy(logits, y)
                nn.functional.cross_entropy(logits, y).backward()
                opt.step()
                opt.zero_grad()
                del logits
        return tracker.report()

    with_metric, without = run(True), run(False)
    assert with_metric.eval_forwards == 0
    assert "accuracy" not in {m.path for m in with_metric.devices[0].modules}
    assert with_metric.devices[0].breakdown == without.devices[0].breakdown
    assert with_metric.devices[0].modules == without.devices[0].modules


def test_held_evaluation_loop_counts_what_follows_the_forward():
    """``begin_eval()``/``end_eval()`` (a framework's validation loop): the work after the
    model's forward (a metric buffer) is the eval phase and counts; without the hold it is
    host work between phases and does not."""
    metric = 1 << 20  # a 4 MiB float32 buffer made after each forward

    def run(hold: bool):
        torch.manual_seed(0)
        model = mlp().eval()
        with track(model, device="cpu", budget="64MiB") as tracker:
            windows = []
            for _ in range(2):
                if hold:
                    tracker.begin_eval()
                    tracker.begin_eval()  # nested: the inner end does not end the loop
                with torch.no_grad():
                    out = model(torch.randn(32, 64))
                    buffer = torch.zeros(metric)
                    del out, buffer
                if hold:
                    assert tracker.end_eval() is None
                    assert tracker.phase == "eval"
                    windows.append(tracker.end_eval())
                    assert tracker.phase == "other"
        return tracker.report(), windows

    held, windows = run(True)
    plain, _ = run(False)
    base = held.devices[0].baseline_allocated
    peak = held.devices[0].phase_peaks["eval"]
    assert peak is not None and peak >= base + 4 * metric
    assert windows == [peak, peak]  # each loop's own peak, the same loop twice
    assert plain.devices[0].phase_peaks["eval"] < base + 4 * metric
    assert held.eval_forwards == plain.eval_forwards == 2


def test_steps_since_and_open_step_peaks():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert [s.step for s in tracker.steps_since(1)] == [1, 2]
        assert tracker.steps_since(3) == []
        with torch.no_grad():
            model.eval()
            model(torch.randn(8, 64))
            model.train()
        open_step = tracker.open_step_peaks()
        assert open_step["eval"] is not None and open_step["forward"] is None
    report = tracker.report()
    assert list(tracker.steps_since(0)) == list(report.devices[0].steps)
    assert report.devices[0].phase_peaks["eval"] == open_step["eval"]


def test_accelerates_accumulation_reaches_an_oom_in_the_first_micro_batch():
    """``Accelerator(gradient_accumulation_steps=4)`` with ``accelerator.accumulate``: an OOM
    in step 0's first forward, before any optimizer step shows the accumulation, proposed
    accumulating over 2 (the effective batch divided by 4). accelerate's shared
    ``GradientState`` says 4: the advice builds on it."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    try:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
        model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256))
        opt = torch.optim.AdamW(model.parameters())
        model, opt = accelerator.prepare(model, opt)
        with (
            pytest.raises(torch.OutOfMemoryError),
            # (room for AdamW's state to come, now found through accelerate's wrapper)
            track(model, device="cpu", budget="24MiB") as tracker,
            accelerator.accumulate(model),
        ):
            accelerator.backward(model(torch.randn(2048, 256)).pow(2).mean())
            opt.step()
            opt.zero_grad()
        report = tracker.report()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert report.devices[0].setup.accumulation_steps == 4
    advice = {a.code: a for a in report.oom.advice}
    assert "already accumulates gradients over 4 micro-batches" in advice["oom-activations"].action


@pytest.mark.parametrize("framework", ["accelerate", "fabric"])
def test_the_optimizer_a_framework_wraps_given_to_track_counts_each_step(framework):
    """Sweep BK: ``memkit.track(model, optimizer)`` with the optimizer Fabric's ``setup`` or
    accelerate's ``prepare`` returns: torch's step hooks see the inner optimizer step, which
    was taken for a replacement of the one given, and its first step folded into the next: 2
    steps of 3, "up to 8 micro-batches per step"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    if framework == "fabric":
        fabric_module = pytest.importorskip("lightning.fabric")
        fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        backward = fabric.backward
    else:
        accelerate = pytest.importorskip("accelerate")
        from accelerate.state import AcceleratorState, GradientState

        # what ran before in this process left (a fresh-clone CI run: 12 steps of 3, a
        # Trainer's accumulation left in GradientState made the wrapper skip its steps)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        backward = accelerator.backward
    try:
        with track(model, opt, device="cpu", budget="64MiB") as tracker:
            for _ in range(3):
                for _ in range(4):
                    backward(model(torch.randn(16, 32)).pow(2).mean() / 4)
                opt.step()
                opt.zero_grad()
        report = tracker.report()
    finally:
        if framework == "accelerate":
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    assert report.steps == 3 and report.micro_batches == 4
    assert all(s.backward_passes == 4 for s in report.devices[0].steps)


def test_a_fabric_model_reads_as_the_model_it_wraps_with_its_precision():
    """Sweep BK: module rows under Fabric read ``_forward_module.lm_head``, and a
    ``precision="bf16-mixed"`` run (Fabric enters autocast inside its wrapper's forward, after
    the hooks) was told to add autocast."""
    fabric_module = pytest.importorskip("lightning.fabric")
    torch.manual_seed(0)
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            fabric.backward(model(torch.randn(256, 64)).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
    report = tracker.report()
    paths = {m.path for m in report.devices[0].modules}
    assert {"0", "1", "2"} <= paths and not any(p.startswith("_forward_module") for p in paths)
    assert report.autocast_forwards == 2
    assert "mixed-precision" not in {a.code for a in report.advice}
    setup = report.devices[0].setup
    assert setup is not None and setup.wrapper == "fabric"
