"""memkit.integrations.lightning with a real Lightning Trainer on CPU, on the simulated device.

The callback's numbers are checked against ``memkit.track`` around the same fit, against a
plain loop doing the same tensor work as Lightning's automatic optimization, and against hand
counts from the model's shapes; ``probe_batch_size``'s answer against real fits at that size
and one more; and a 2-rank DDP fit (gloo) against each rank's own report.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memkit
from memkit.errors import ConfigError, MissingDependencyError

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning")

ROOT = Path(__file__).resolve().parents[1]
MIB = float(1 << 20)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        yield
    logger.setLevel(level)


@pytest.fixture(autouse=True, scope="module")
def _lightning():
    """Lightning (about 4 s to import) only when these tests run, not when they are collected:
    the module's names below are bound here."""
    global pl, Net, ManualNet, Data, RankNet, trainer, MemkitCallback, probe_batch_size
    global B, STEPS, HIDDEN, VAL_BATCHES
    import lightning.pytorch as pl
    from lightning_models import (
        HIDDEN,
        STEPS,
        VAL_BATCHES,
        B,
        Data,
        ManualNet,
        Net,
        RankNet,
        trainer,
    )

    from memkit.integrations.lightning import MemkitCallback, probe_batch_size


def batch_on_device(tracker: Any) -> Any:
    """A Lightning callback telling ``tracker`` that the batch is on the device."""

    class Told(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            tracker.batch_on_device(batch)

    return Told()


def fit_with_callback(
    budget: str | int = "64MiB", zero_after_step: bool = False, accumulate_grad_batches=1, **files
):
    torch.manual_seed(0)
    module = Net(zero_after_step)
    cb = MemkitCallback(device="cpu", budget=budget, postmortem=None, **files)
    t = trainer([cb], accumulate_grad_batches=accumulate_grad_batches)
    t.fit(module, datamodule=Data())
    return cb, t, module


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def same_steps(a, b) -> bool:
    strip = lambda s: dataclasses.replace(s, duration_s=0.0)  # noqa: E731
    return [strip(s) for s in a] == [strip(s) for s in b]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One fit with the callback (writing its three files), one under memkit.track."""
    folder = tmp_path_factory.mktemp("lightning")
    cb, t, module = fit_with_callback(
        text=folder / "report.txt", json=folder / "report.json", html=folder / "report.html"
    )
    torch.manual_seed(0)
    plain = Net()
    with memkit.track(plain, device="cpu", budget="64MiB", postmortem=None) as tracker:
        # the batch on the device from the step's start, as the callback counts it (Lightning
        # moved it there: on the simulated device memkit.track alone counts it at the forward)
        trainer([batch_on_device(tracker)]).fit(plain, datamodule=Data())
    return cb, t, module, tracker.report(), folder


def test_callback_gives_the_numbers_of_track_around_the_same_fit(fitted):
    cb, _, module, tracked, _ = fitted
    report = cb.report
    assert report is not None and cb.tracker is None
    dev, ref = report.devices[0], tracked.devices[0]
    assert report.steps == tracked.steps == STEPS and report.step_rule == "optimizer"
    assert dev.phase_peaks == ref.phase_peaks
    assert dev.breakdown == ref.breakdown
    assert dev.modules == ref.modules
    assert same_steps(dev.steps, ref.steps)
    assert report.eval_forwards == tracked.eval_forwards == VAL_BATCHES
    # the Trainer's accumulate_grad_batches, told to the tracker (memkit.track is not told)
    assert dev.setup is not None and ref.setup is not None
    assert (dev.setup.accumulation_steps, ref.setup.accumulation_steps) == (1, None)
    # hand counts from the shapes
    p = param_bytes(module)
    bd = dev.breakdown
    assert bd is not None and bd.phase == "optimizer"
    assert bd.parameters == bd.gradients == p
    assert bd.optimizer_state == 2 * p + 4 * len(list(module.parameters()))  # Adam: 2 moments
    kept = {m.path: m.activation_bytes for m in dev.modules}
    assert kept["net.0"] == 0  # the Linear's output dies in the ReLU, which keeps its own
    assert kept["net.1"] == B * HIDDEN * 4
    assert kept["net.2"] == 0  # the logits die in the loss, which keeps its log-softmax
    assert all(m.calls == STEPS and m.eval_calls == VAL_BATCHES for m in dev.modules)


def test_lightning_steps_have_the_peaks_of_the_same_plain_loop(fitted):
    """The tensor work of Lightning's automatic optimization written as a plain loop (forward,
    the loss divided by accumulate_grad_batches with a detached copy kept, zero_grad, backward,
    step) under memkit.track: the same forward, backward and optimizer peaks."""
    cb = fitted[0]
    torch.manual_seed(0)
    module = Net()
    opt = module.configure_optimizers()
    data = Data()
    data.setup("fit")
    with memkit.track(module, opt, device="cpu", budget="64MiB") as tracker:
        for i, batch in enumerate(data.train_dataloader()):
            tracker.batch_on_device(batch)  # Lightning's batch_to_device
            out = module.training_step(batch, i)
            loss = out / 1
            copy = loss.detach().clone()
            del out
            opt.zero_grad()
            loss.backward()
            opt.step()
            del loss, copy
    plain = tracker.report().devices[0].phase_peaks
    lightning = cb.report.devices[0].phase_peaks
    for phase in ("forward", "backward", "optimizer"):
        assert lightning[phase] == plain[phase], phase


def test_peaks_are_logged_through_the_module(fitted):
    cb, t, *_ = fitted
    last = cb.report.devices[0].steps[-1]
    logged = {k: float(v) for k, v in t.callback_metrics.items() if k.startswith("memkit/")}
    assert logged["memkit/peak_mib"] == pytest.approx(last.peak_allocated / MIB, rel=1e-6)
    for phase in ("forward", "backward", "optimizer"):
        value = last.phase_peaks[phase] / MIB
        assert logged[f"memkit/{phase}_peak_mib"] == pytest.approx(value, rel=1e-6)
    eval_peak = cb.report.devices[0].phase_peaks["eval"] / MIB
    assert logged["memkit/eval_peak_mib"] == pytest.approx(eval_peak, rel=1e-6)


def test_report_files_are_written_at_teardown(fitted):
    cb, *_, folder = fitted
    assert sorted(p.name for p in cb.written) == ["report.html", "report.json", "report.txt"]
    assert json.loads((folder / "report.json").read_text()) == json.loads(cb.report.to_json())
    assert (folder / "report.txt").read_text().startswith("memkit track: 4 step(s)")
    assert "<svg" in (folder / "report.html").read_text()


def test_advice_names_lightnings_own_settings():
    """Lightning already validates under inference_mode: the advice says what is left to do,
    in Lightning's terms, and names the Trainer's settings (a loader's batch_size, precision,
    accumulate_grad_batches) instead of plain PyTorch's; other advice is untouched."""
    from memkit.advice import Advice
    from memkit.advice.lightning import in_lightning_terms

    given = (
        Advice("eval-peak", "t", "e", "... run it under `torch.inference_mode()`."),
        Advice("oom-eval", "t", "e", "Lower the evaluation batch size (`--test-batch-size`)"),
        Advice("mixed-precision", "t", "e",
               "`with torch.autocast('cuda', dtype=torch.bfloat16):` around the forward"),
        Advice("oom-activations", "t", "e", "Halve the micro-batch and accumulate gradients "
               "over 2 steps; or train in bf16/fp16 autocast."),
        Advice("optimizer-state", "t", "e", "a"),
    )  # fmt: skip
    said = {a.code: a.action for a in in_lightning_terms(given)}
    assert "val_dataloader()" in said["eval-peak"] and "already runs" in said["eval-peak"]
    assert "test_dataloader()" in said["oom-eval"] and "--test-batch-size" not in said["oom-eval"]
    assert 'precision="bf16-mixed"' in said["mixed-precision"]
    assert said["oom-activations"].startswith(given[3].action)
    assert "accumulate_grad_batches=N" in said["oom-activations"]
    assert said["optimizer-state"] == "a"


def test_zero_grad_advice_speaks_lightning_and_its_fix_works(fitted):
    """Lightning zeroes gradients after training_step: they are alive through the forward.
    The fix the advice gives (zero them after the step) removes them from the forward peak."""
    cb = fitted[0]
    advice = {a.code: a for a in cb.report.advice}
    assert "optimizer_step" in advice["zero-grad-keeps-grads"].action
    fixed, _, module = fit_with_callback(zero_after_step=True)
    assert "zero-grad-keeps-grads" not in {a.code for a in fixed.report.advice}
    before = cb.report.devices[0].phase_peaks["forward"]
    after = fixed.report.devices[0].phase_peaks["forward"]
    assert before - after == param_bytes(module)  # exactly the gradients


def test_zero_grad_advice_counts_no_micro_batch_of_the_first_step():
    """Accumulating, the later micro-batches of step 0 meet the earlier ones' gradients, as
    they must (the last runs inside optimizer.step(closure), after the optimizer was seen):
    with the fix no step began with the previous step's; without it, steps 1.. did."""

    def advice(zero_after_step: bool) -> dict:
        torch.manual_seed(0)
        cb = MemkitCallback(device="cpu", budget="64MiB", postmortem=None, log_peaks=False)
        run = trainer([cb], accumulate_grad_batches=4, limit_val_batches=0)
        run.fit(Net(zero_after_step), datamodule=Data(samples=4 * B * STEPS))  # one epoch
        return {a.code: a for a in cb.report.advice}

    assert "zero-grad-keeps-grads" not in advice(zero_after_step=True)
    evidence = advice(zero_after_step=False)["zero-grad-keeps-grads"].evidence
    assert f"{STEPS - 1} step(s) began their forward" in evidence


def test_zero_grad_advice_with_manual_optimization_names_the_users_own_step():
    """With manual optimization Lightning calls no optimizer_step (the advice's override for
    automatic optimization would never run): the action is about the module's own zero_grad,
    and accumulation is not Trainer(accumulate_grad_batches=N), which Lightning refuses."""
    from memkit.advice import Advice
    from memkit.advice.lightning import in_lightning_terms

    torch.manual_seed(0)
    cb = MemkitCallback(device="cpu", budget="64MiB", postmortem=None, log_peaks=False)
    trainer([cb], max_steps=3, limit_val_batches=0).fit(ManualNet(), datamodule=Data())
    action = {a.code: a.action for a in cb.report.advice}["zero-grad-keeps-grads"]
    assert "optimizer_step(" not in action
    assert "right after each `opt.step()`" in action and "manual_backward" in action
    oom = Advice("oom-activations", "t", "e", "Halve the micro-batch and accumulate gradients.")
    (said,) = in_lightning_terms([oom], manual_optimization=True)
    assert "accumulate_grad_batches=N" not in said.action and "every N batches" in said.action


@pytest.mark.parametrize("manual", [False, True])
def test_memkit_run_says_the_advice_in_lightnings_terms(tmp_path, manual):
    """Under ``memkit run`` (no callback) a Lightning script was told the plain loop's fix
    ("drop `set_to_none=False`", zero "right after `optimizer.step()`"), code it does not
    have (sweep KK); the LightningModule found running now says it as the callback does."""
    from memkit.tracking.run import run_script

    script = tmp_path / "fit.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import torch\nfrom lightning_models import Data, ManualNet, Net, trainer\n"
        "torch.manual_seed(0)\n"
        f"trainer([], max_steps=3, limit_val_batches=0).fit({'ManualNet' if manual else 'Net'}()"
        ", datamodule=Data())\n"
    )
    report = run_script(script, (), device="cpu", budget="64MiB").report
    action = {a.code: a.action for a in report.advice}["zero-grad-keeps-grads"]
    if manual:
        assert "right after each `opt.step()`" in action and "manual_backward" in action
    else:
        assert "def optimizer_step(" in action


def test_each_optimizer_step_is_logged_once_with_its_own_peaks(monkeypatch):
    """Sweep UU: with accumulate_grad_batches=4 the callback logged the first micro-batches'
    provisional records (steps counted from backward passes before the first optimizer step),
    which the tracker then folded into step 0: steps 0 and 1 were logged with one
    micro-batch's peaks (1.07 MiB where they peaked at 1.81 MiB, in the optimizer). Now each
    optimizer step is logged once, with the report's numbers for it."""
    import memkit.integrations.lightning as lightning

    logged: list[Any] = []
    real = lightning.step_metrics

    def recording(records: Any) -> dict[str, float]:
        logged.extend(records)
        return real(records)

    monkeypatch.setattr(lightning, "step_metrics", recording)
    cb, _, _ = fit_with_callback(accumulate_grad_batches=4)
    steps = cb.report.devices[0].steps
    assert cb.report.micro_batches == 4
    assert [r.step for r in logged] == [s.step for s in steps]
    assert [r.peak_allocated for r in logged] == [s.peak_allocated for s in steps]
    assert logged[0].phase_peaks["optimizer"] is not None  # step 0 made Adam's state


def test_the_batch_counts_from_the_step_start_as_lightning_moved_it_there():
    """Sweep UU: a manual-optimization GAN's generator half ran before the discriminator read
    the real images; on the simulated device the batch counted only from that read, where on
    a GPU Lightning's batch_to_device put it there before training_step (8,624,420 B
    reported, 8,644,212 B true). The batch now counts from on_train_batch_start: the
    generator step's peak follows the batch's size."""

    class GeneratorFirst(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.gen = nn.Sequential(nn.Linear(16, 4096), nn.Linear(4096, 16))
            self.disc = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            fake = self.gen(torch.randn(256, 16))  # 4 MiB inside: the step's forward peak
            opt_g.zero_grad()
            self.manual_backward(fake.pow(2).mean())
            opt_g.step()
            opt_d.zero_grad()
            self.manual_backward(self.disc(real).mean())  # the batch read only now
            opt_d.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.gen.parameters(), lr=0.1), torch.optim.SGD(
                self.disc.parameters(), lr=0.1
            )

    def generator_peak(rows: int) -> int:
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(2 * rows, 16))
        cb = MemkitCallback(device="cpu", budget="64MiB", postmortem=None)
        loader = torch.utils.data.DataLoader(data, batch_size=rows)
        trainer([cb], max_steps=4, limit_val_batches=0).fit(GeneratorFirst(), loader)
        (first,) = [s for s in cb.report.devices[0].steps if s.step == 1]
        return first.phase_peaks["forward"]

    rows = 4096  # 256 KiB of real images a batch
    assert generator_peak(2 * rows) - generator_peak(rows) == rows * 16 * 4


def test_validate_after_fit_counts_no_optimizer_state():
    """validate()/test()/predict() set up no optimizers (on a GPU, teardown moved the fit's
    optimizer state to the CPU): the report of a validate() after fit() holds none, and its
    eval peak (also in the returned metrics) is what memkit.track around the same validate()
    counts."""
    cb, t, module = fit_with_callback(accumulate_grad_batches=2)
    fit = cb.report
    assert fit is not None and fit.devices[0].breakdown.optimizer_state > 0
    assert fit.micro_batches == fit.devices[0].setup.accumulation_steps == 2
    assert t.optimizers  # still held by the Trainer after fit()
    metrics = t.validate(module, datamodule=Data(), verbose=False)[0]
    report = cb.report
    dev = report.devices[0]
    assert report.steps == 0 and dev.breakdown is not None
    assert dev.breakdown.optimizer_state == 0
    assert dev.breakdown.parameters == param_bytes(module)
    assert dev.setup is not None and dev.setup.accumulation_steps is None  # validate: no steps
    assert metrics["memkit/eval_peak_mib"] == pytest.approx(dev.phase_peaks["eval"] / MIB)
    with memkit.track(module, device="cpu", budget="64MiB", postmortem=None) as tracker:
        trainer().validate(module, datamodule=Data(), verbose=False)
    assert dev.phase_peaks["eval"] == tracker.report().devices[0].phase_peaks["eval"]
    assert "at the peak (" in str(report) and "training peak" not in str(report)  # none ran


def test_out_of_memory_gets_a_post_mortem_from_on_exception(tmp_path):
    budget = 200_000  # the parameters, gradients and Adam's state do not all fit
    with pytest.raises(torch.OutOfMemoryError):
        fit_with_callback(budget=budget, json=tmp_path / "oom.json")
    # the fit raised, so no callback object came back: read the file it wrote
    written = json.loads((tmp_path / "oom.json").read_text())
    assert torch._C._len_torch_dispatch_stack() == 0  # the simulated device was left
    assert getattr(torch.autograd.backward, "__wrapped__", None) is None
    torch.manual_seed(0)
    module = Net()
    with (
        pytest.raises(torch.OutOfMemoryError),
        memkit.track(module, device="cpu", budget=budget, postmortem=None) as tracker,
    ):
        trainer().fit(module, datamodule=Data())
    ref = tracker.report().oom
    assert ref is not None
    assert written["oom"]["where"] == ref.where == "step 0, optimizer, outside any module"
    assert written["oom"]["allocated"] == ref.allocated
    assert [a["code"] for a in written["oom"]["advice"]] == [a.code for a in ref.advice]


def test_out_of_memory_in_a_later_micro_batch_is_in_its_optimizer_step():
    """accumulate_grad_batches=4, out of memory in the second micro-batch's forward (its
    gradients and the first's): Lightning's global_step is 0, and so is memkit's step."""
    torch.manual_seed(0)
    cb = MemkitCallback(device="cpu", budget=120_000, postmortem=None, log_peaks=False)
    run = trainer([cb], accumulate_grad_batches=4, limit_val_batches=0)
    with pytest.raises(torch.OutOfMemoryError):
        run.fit(Net(), datamodule=Data())
    oom = cb.report.oom
    assert run.global_step == 0 and oom is not None
    assert oom.step == 0 and oom.where.startswith("step 0, forward")
    assert oom.breakdown.gradients == param_bytes(Net())  # the first micro-batch's


@pytest.mark.parametrize("accumulate", [1, 4])
def test_probe_batch_size_is_the_size_a_real_fit_trains_at(accumulate):
    """Also accumulating: the later micro-batches meet the gradients of the earlier ones (and
    their backward adds to them), so fewer fit than without (271 against 282 here)."""
    torch.manual_seed(0)
    module, data = Net(), Data()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    budget = "1MiB"
    result = probe_batch_size(
        module, data, device="cpu", budget=budget, steps=2, accumulate_grad_batches=accumulate
    )
    assert data.setups == 1
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert any("configure_optimizers" in d for d in result.defaults)
    assert any("automatic optimization" in d for d in result.defaults)
    size = result.max_batch_size
    assert size is not None and result.trial(size + 1).fits is False

    def fits(batch_size: int) -> bool:
        torch.manual_seed(0)
        cb = MemkitCallback(device="cpu", budget=budget, postmortem=None, log_peaks=False)
        try:
            run = trainer(
                [cb], max_steps=2, limit_val_batches=0, accumulate_grad_batches=accumulate
            )
            run.fit(Net(), datamodule=Data(batch_size, samples=2 * accumulate * batch_size))
        except torch.OutOfMemoryError:
            return False
        return True

    assert fits(size) and not fits(size + 1)


def test_probe_batch_size_with_the_trainers_mixed_precision_is_what_that_fit_trains_at():
    """Sweep BX: a bf16-mixed fit trained at 63 where probe_batch_size, which never saw the
    Trainer's precision plugin, said 45 and did not say it had measured fp32."""
    torch.manual_seed(0)
    budget = "1MiB"
    result = probe_batch_size(Net(), Data(), device="cpu", budget=budget, precision="bf16-mixed")
    assert any(d.startswith("precision: bf16-mixed (training_step under torch.autocast")
               for d in result.defaults)  # fmt: skip
    size = result.max_batch_size
    assert size is not None

    def fits(batch_size: int) -> bool:
        torch.manual_seed(0)
        cb = MemkitCallback(device="cpu", budget=budget, postmortem=None, log_peaks=False)
        try:
            trainer([cb], max_steps=2, limit_val_batches=0, precision="bf16-mixed").fit(
                Net(), datamodule=Data(batch_size, samples=2 * batch_size)
            )
        except torch.OutOfMemoryError:
            return False
        return True

    assert fits(size) and not fits(size + 1)
    plain = probe_batch_size(Net(), Data(), device="cpu", budget=budget)
    assert any("give the Trainer's precision= if it is mixed" in d for d in plain.defaults)
    assert plain.max_batch_size is not None and plain.max_batch_size < size  # (fp32's)
    with pytest.raises(ConfigError, match="mixed precision"):
        probe_batch_size(Net(), Data(), device="cpu", budget=budget, precision="bf16-true")


def test_probe_batch_size_advises_accumulation_in_the_trainers_terms():
    """Sweep BV: probe_batch_size's accumulate advice said to call optimizer.step() every N
    micro batches, which the Trainer does itself; and its steps line named --steps."""
    torch.manual_seed(0)
    result = probe_batch_size(Net(), Data(), device="cpu", budget="1MiB", target_batch=4000)
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    steps = int(advice.title.split(" over ")[1].split()[0])
    micro = int(advice.title.split(" steps of ")[1].split()[0])
    assert f"`batch_size={micro}` in your DataLoader" in advice.action
    assert f"`Trainer(accumulate_grad_batches={steps})`" in advice.action
    assert "call optimizer.step()" not in advice.action
    assert not any("--steps" in d for d in result.defaults)


def test_bad_input_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        MemkitCallback(json=tmp_path / "missing" / "r.json")
    with pytest.raises(ConfigError, match="postmortem"):
        MemkitCallback(postmortem="file")
    with pytest.raises(ConfigError, match=r"memkit\.probe"):
        probe_batch_size(nn.Linear(2, 2), make_batch=lambda n: torch.randn(n, 2))

    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ConfigError, match="automatic_optimization"):
        probe_batch_size(Manual(), Data())
    monkeypatch.delitem(sys.modules, "memkit.integrations.lightning")
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install memkit\[lightning\]"):
        import memkit.integrations.lightning  # noqa: F401


@pytest.mark.slow
def test_ddp_fit_on_two_gloo_ranks_is_gathered_on_rank0(tmp_path):
    """A real 2-rank DDP fit on gloo (Lightning forks the two ranks from this process): each
    rank writes its report, rank 0's holds every rank's summary, and it matches each rank's
    own numbers. A watchdog kills the ranks if they hang, so a hang fails the test."""
    import multiprocessing
    import threading

    saved_env = dict(os.environ)
    hung = []

    def watchdog() -> None:
        for child in multiprocessing.active_children():
            hung.append(child.pid)
            os.kill(child.pid, signal.SIGKILL)

    timer = threading.Timer(90.0, watchdog)
    timer.start()
    torch.manual_seed(0)
    cb = MemkitCallback(device="cpu", budget="64MiB", json=tmp_path / "report.json")
    run = trainer(
        [cb], devices=2, strategy="ddp_fork", max_steps=3, limit_val_batches=1,
        use_distributed_sampler=False,
    )  # fmt: skip
    try:
        run.fit(RankNet())
    except Exception:
        if hung:
            pytest.fail(f"the 2-rank fit did not finish within 90 s; killed ranks {hung}")
        raise
    finally:
        timer.cancel()
        os.environ.clear()  # the launcher sets MASTER_PORT & co. in this process
        os.environ.update(saved_env)
    r0 = json.loads((tmp_path / "report.rank0.json").read_text())
    r1 = json.loads((tmp_path / "report.rank1.json").read_text())
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    assert r0["steps"] == r1["steps"] == 3 and "ranks" not in r1
    ranks = r0["ranks"]
    own = [r0["devices"][0], r1["devices"][0]]
    assert [r["peak_allocated"] for r in ranks["ranks"]] == [d["peak_allocated"] for d in own]
    assert ranks["tightest_rank"] == 1
    # parameters are checked for gradients when the optimizer steps: after the closure's
    # backward, so none is unused
    assert all(r["unused_parameters"] == [] for r in ranks["ranks"])
    kept = [{m["path"]: m["activation_bytes"] for m in d["modules"]} for d in own]
    assert kept[0]["net.1"] == 8 * HIDDEN * 4 and kept[1]["net.1"] == 64 * HIDDEN * 4  # ReLU
    # the eval peak is logged with sync_dist: the largest rank's (rank 0's metrics come back)
    eval_peaks = [d["phase_peaks"]["eval"] for d in own]
    logged = float(run.callback_metrics["memkit/eval_peak_mib"])
    assert logged == pytest.approx(max(eval_peaks) / MIB, rel=1e-6)
