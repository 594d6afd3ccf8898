"""memkit.probe on real models and the simulated device: exactness, safety, errors."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fused_steps import check_finite, step_in_backward

import memkit
from memkit.devices import get_backend
from memkit.errors import ConfigError, UserCodeError
from memkit.modelfile import load_model_file
from memkit.probing.runner import ProbeOptions, probe, probe_file
from memkit.probing.step import StepPlan, call_model


def small_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )


def assert_exact(result) -> None:
    best = result.max_batch_size
    assert best is not None
    assert result.trial(best) is not None and result.trial(best).fits
    if not result.hit_max_batch:
        above = result.trial(best + 1)
        assert above is not None and not above.fits
    sizes = [t.batch_size for t in result.trials]
    assert len(sizes) == len(set(sizes)), "a size was run twice"


def test_probe_is_exact_and_verified_on_an_mlp():
    model = small_mlp()
    result = probe(model, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB")
    assert_exact(result)
    # the recommendation leaves the margin free, counted in bytes
    rec = result.recommended_batch_size
    assert rec is not None and rec <= result.max_batch_size
    budget = (1 - result.margin) * result.capacity_bytes
    fitted = [t for t in result.trials if t.fits]
    if result.trial(rec) is not None:  # run: its own peak leaves the margin
        assert result.trial(rec).peak_bytes <= budget
    else:  # interpolated: between a run size within the margin and a larger one that fit
        assert any(t.batch_size < rec and t.peak_bytes <= budget for t in fitted)
        assert any(t.batch_size > rec for t in fitted)
    assert "optimizer: AdamW (default)" in result.defaults
    assert result.device == "cpu"
    assert "simulated" in result.accounting


def test_probe_trial_count_is_logarithmic():
    model = small_mlp()
    result = probe(model, lambda n: torch.randn(n, 256), device="cpu", budget="12MiB")
    best = result.max_batch_size
    assert len(result.trials) <= math.ceil(math.log2(best)) + 3, [
        t.batch_size for t in result.trials
    ]


def test_a_bert_classifier_is_found_with_one_oom_trial():
    """A transformers BERT classifier: its 30522-word embedding makes the optimizer step and
    the embedding's dense gradient set the peak at batches 1, 2 and 4, flat, so a line
    through whole peaks jumped to 256 and paid four OOM trials (11 trials). The probe cuts
    each trial's peak into parts (module by module, the optimizer step) and aims with the
    part that grows."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=256
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, config.vocab_size, (n, 128)),
            "attention_mask": torch.ones(n, 128, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,)),
        }

    result = probe(model, make_batch, device="cpu", budget="64MiB")
    assert_exact(result)
    flat = [t.peak_bytes for t in result.trials[:3]]
    assert flat[2] - flat[0] < 1e-3 * flat[0]  # 1, 2, 4: the flat part sets the peak
    failed = [t.batch_size for t in result.trials if not t.fits]
    assert failed == [result.max_batch_size + 1], [t.batch_size for t in result.trials]
    assert len(result.trials) <= 6


def test_reported_peaks_match_a_direct_measurement():
    model = small_mlp()
    result = probe(model, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB")
    best = result.max_batch_size
    opt = torch.optim.AdamW(model.parameters())
    with memkit.simulate(None, track=(model, opt)) as acct:
        for _ in range(2):
            x = torch.randn(best, 256)
            out = model(x)  # a loop's `out` lives until the next forward rebinds it
            out.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x
        del out
    assert result.trial(best).peak_bytes == acct.peak
    assert any("kept: the model's output" in line for line in result.defaults)


@pytest.mark.parametrize("extra", [0, 1], ids=["max", "max+1"])
def test_an_ordinary_loop_trains_at_the_reported_max_and_not_above(extra):
    """nanoGPT-style: `logits, loss = model(X, Y)` keeps the logits until the next forward
    returns. The probe's step keeps its output the same way, so its answer holds for the loop."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU())
            self.head = torch.nn.Linear(512, 2048)

        def forward(self, x, y):
            logits = self.head(self.body(x))
            return logits, torch.nn.functional.cross_entropy(logits, y)

    def make_batch(n):
        return torch.randn(n, 256), torch.randint(0, 2048, (n,))

    torch.manual_seed(0)
    model = Net()
    result = probe(
        model, make_batch, device="cpu", budget="48MiB", loss_fn=lambda out, batch: out[1]
    )
    batch = result.max_batch_size + extra
    opt = torch.optim.AdamW(model.parameters())
    ran_out = False
    with memkit.simulate("48MiB", track=(model, opt)):
        try:
            for _ in range(3):
                x, y = make_batch(batch)
                _logits, loss = model(x, y)  # held until the next forward rebinds it
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        except torch.OutOfMemoryError:
            ran_out = True
    assert ran_out == bool(extra), (result.max_batch_size, batch)


def test_state_is_bit_identical_after_probing_a_cnn_with_batchnorm():
    spec = load_model_file("examples/cnn.py")
    cnn_batch, cnn_step = spec.make_batch, spec.train_step
    model = spec.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cnn_step(model, cnn_batch(4), opt)  # momentum buffers and BN statistics exist
    model.eval()  # the user's flag must survive
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state.items()}
    rng_before = torch.get_rng_state()
    result = probe(model, cnn_batch, optimizer=opt, train_step=cnn_step, device="cpu",
                   budget="32MiB", max_batch=64)  # fmt: skip
    assert result.max_batch_size is not None
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "parameters/buffers changed"
    assert int(after["features.1.num_batches_tracked"]) == 1  # one step before the probe
    for param, state in opt.state.items():
        assert torch.equal(state["momentum_buffer"], opt_before[param]["momentum_buffer"])
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(p.grad is None for p in model.parameters())


def test_a_step_that_unfreezes_the_backbone_leaves_it_frozen_after_the_probe():
    """Sweep CN: a train_step that unfreezes a frozen backbone at its 5th call (a fine-tuning
    schedule) left every parameter trainable after ``memkit.probe`` returned; a notebook
    user's next training would have trained the backbone from step 0."""
    model = small_mlp()
    frozen = [p.requires_grad_(i >= 2) for i, p in enumerate(model.parameters())]
    before = [p.requires_grad for p in frozen]
    calls = [0]

    def step(model, batch, optimizer):
        calls[0] += 1
        if calls[0] == 5:
            model.requires_grad_(True)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe(model, lambda n: torch.randn(n, 256), optimizer=opt, train_step=step, device="cpu",
          budget="8MiB")  # fmt: skip
    assert calls[0] > 5 and [p.requires_grad for p in model.parameters()] == before


def test_state_is_restored_after_ctrl_c():
    model = small_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    calls = {"n": 0}

    def make_batch(n):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return torch.randn(n, 256)

    with pytest.raises(KeyboardInterrupt):
        probe(model, make_batch, device="cpu", budget="8MiB")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert model.training


def test_non_oom_error_is_reported_not_retried():
    calls = {"n": 0}
    model = small_mlp()

    def step(model, batch, optimizer):
        calls["n"] += 1
        raise ValueError("labels are missing")  # a genuine bug

    with pytest.raises(UserCodeError) as info:
        probe(model, lambda n: torch.randn(n, 256), train_step=step, device="cpu",
              budget="8MiB")  # fmt: skip
    assert calls["n"] == 1
    assert "ValueError: labels are missing" in str(info.value)
    assert "not an out-of-memory error" in str(info.value)
    assert info.value.exit_code == 3


def test_no_hook_of_the_probe_stays_on_the_model_after_an_error():
    """The probe hooks the model and optimizer during each trial (to cut its peak into
    parts); a step that raises something else than an OOM must not leave them behind, or they
    would read and reset the device's peak counters on every later forward."""
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward_breaks_above_4(batch):
        if batch.shape[0] > 4:
            raise ValueError("a shape bug above batch 4")
        return batch

    model[0].register_forward_pre_hook(lambda m, args: forward_breaks_above_4(args[0]))
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    with pytest.raises(UserCodeError):
        probe(model, lambda n: torch.randn(n, 256), optimizer=opt, device="cpu", budget="8MiB")
    after = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    assert after == before
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_does_not_fit_even_at_min_batch():
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights; AdamW needs 16 MiB in all
    result = probe(model, lambda n: torch.randn(n, 1024), device="cpu", budget="10MiB")
    assert result.max_batch_size is None
    assert result.recommended_batch_size is None
    assert len(result.trials) == 1 and not result.trials[0].fits
    # AdamW needs 16 MiB of state alone: FSDP is advised next to does-not-fit
    assert [a.code for a in result.advice] == ["does-not-fit", "fsdp-gpus"]


def test_memory_returns_to_baseline_after_many_ooms():
    model = small_mlp()
    backend = get_backend("cpu", "24MiB")
    backend.track(model)
    baseline = backend.allocated()
    result = probe(model, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB")
    assert sum(not t.fits for t in result.trials) >= 1
    assert backend.allocated() == baseline


def test_target_batch_where_the_optimizer_steps_in_backward_is_not_advised_accumulation():
    """Sweep BH: the optimizer step fused into backward (post-accumulate-grad hooks) was told
    "call optimizer.step() and zero_grad() every 4 micro batches"; such a step cannot
    accumulate, and the probe ran its search again for an accumulating step."""
    model = small_mlp()
    step_in_backward(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.01))
    result = probe(model, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB",
                   target_batch=4096)  # fmt: skip
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    assert "which this step cannot accumulate" in advice.title
    assert f"Train with batch_size={result.recommended_batch_size}" in advice.action
    assert not any(d.startswith("without accumulation:") for d in result.defaults)
    # a hook that checks the gradient steps nothing (review): accumulation as ever
    checked = small_mlp()
    check_finite(checked.parameters())
    result = probe(checked, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB",
                   target_batch=4096)  # fmt: skip
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    assert "cannot accumulate" not in advice.title


def test_target_batch_advises_exact_accumulation():
    model = small_mlp()
    result = probe(model, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB",
                   target_batch=4096)  # fmt: skip
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    rec = result.recommended_batch_size
    steps = math.ceil(4096 / rec)
    assert f"over {steps} steps" in advice.title or f"over {steps + 1} steps" in advice.title
    assert "4096" in advice.evidence
    # the report's accumulation line names the advice's k (it named the first search's guess:
    # "standing for the 8" beside "9 steps of 29", sweep MM)
    advised = int(advice.title.split("over ")[1].split(" steps")[0])
    (line,) = [d for d in result.defaults if d.startswith("accumulation:")]
    assert f"standing for the {advised}:" in line, (line, advice.title)
    # both searches' trials are in the JSON: the plain step's answer is one more than the
    # accumulating step's (its gradients live through the next micro-batch's forward)
    plain = result.trials_without_accumulation
    assert plain and result.trials
    best_plain = max(t.batch_size for t in plain if t.fits)
    assert best_plain > result.max_batch_size
    assert f"without accumulation: {best_plain} fits" in " ".join(result.defaults)
    sent = json.loads(result.to_json())
    assert [t["batch_size"] for t in sent["trials_without_accumulation"]] == [
        t.batch_size for t in plain
    ]
    assert "trials_without_accumulation" not in json.loads(probe(
        model, lambda n: torch.randn(n, 256), device="cpu", budget="8MiB").to_json())  # fmt: skip


def test_infer_mode_fits_more_than_train():
    model = small_mlp()
    make = lambda n: torch.randn(n, 256)  # noqa: E731
    train = probe(model, make, device="cpu", budget="8MiB")
    infer = probe(model, make, device="cpu", budget="8MiB", mode="infer")
    assert infer.max_batch_size > train.max_batch_size
    assert "step: forward under torch.no_grad() (inference)" in infer.defaults


def test_infer_counts_the_temporaries_inside_a_composite_loss_as_an_eval_loop_allocates_them():
    """A model that computes its loss from labels (transformers' ``labels=``) in evaluation:
    ``cross_entropy`` makes fp32 log-probabilities as large as the logits. Under
    ``torch.inference_mode()`` the simulated device saw the op whole and never counted them,
    so ``--mode infer`` answered 23% above what the usual ``model.eval()`` + ``no_grad`` loop
    fits. The answer must be that loop's boundary."""

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(64, 4096)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.head(x), labels)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64), torch.randint(0, 4096, (n,))

    def eval_loop_fits(n: int) -> bool:
        torch.manual_seed(0)
        model = WithLoss().eval()
        try:
            with memkit.simulate("8MiB", track=[model]), torch.no_grad():
                for _ in range(2):
                    model(*batch(n))
        except torch.OutOfMemoryError:
            return False
        return True

    torch.manual_seed(0)
    result = probe(WithLoss(), batch, device="cpu", budget="8MiB", mode="infer")
    best = result.max_batch_size
    assert best is not None and eval_loop_fits(best) and not eval_loop_fits(best + 1)


def test_max_batch_cap_is_reported_as_such():
    result = probe(small_mlp(), lambda n: torch.randn(n, 256), device="cpu", budget="64MiB",
                   max_batch=20)  # fmt: skip
    assert result.max_batch_size == 20
    assert result.hit_max_batch
    assert result.trial(20).fits


def test_a_model_on_meta_or_device_meta_is_refused_with_a_way_that_works():
    model = small_mlp().to("meta")
    for device in ("cpu", None):
        with pytest.raises(ConfigError, match="model is on the meta device") as error:
            probe(model, lambda n: torch.randn(n, 256), device=device, budget="8MiB")
        assert "memkit.estimate" in str(error.value) and ".to(" not in str(error.value)
    with pytest.raises(ConfigError, match="device='meta': probe runs real steps"):
        probe(small_mlp(), lambda n: torch.randn(n, 256), device="meta", budget="8MiB")


def test_call_model_by_batch_type():
    class Echo(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args, kwargs

    echo = Echo()
    t = torch.ones(1)
    assert call_model(echo, t) == ((t,), {})
    assert call_model(echo, (t, t))[0] == (t, t)
    assert call_model(echo, {"x": t})[1] == {"x": t}


def test_probe_file_examples_cnn_and_gpt2_seq_len_sweep():
    options = ProbeOptions(max_batch=512, target_batch=512)  # the CLI's form; keywords below
    cnn = probe_file("examples/cnn.py", options, device="cpu", budget="48MiB")
    assert_exact(cnn)
    assert "optimizer: SGD (build_optimizer)" in cnn.defaults
    assert any("train_step" in d for d in cnn.defaults)
    sweep = probe_file("examples/gpt2.py", device="cpu", budget="40MiB", seq_len=[32, 128], steps=1)
    sizes = [r.max_batch_size for r in sweep.results]
    assert sizes[0] > sizes[1] > 0  # longer sequences fit fewer
    for r in sweep.results:
        assert_exact(r)
    assert any("output.loss" in d for d in sweep.results[0].defaults)


def test_probe_under_a_launcher_without_a_process_group_warns(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match="no process group is initialised") as said:
        probe(small_mlp(), lambda n: torch.randn(n, 256), device="cpu", budget="8MiB")
    assert said[0].filename == __file__  # the user's probe() line, not memkit's own


def _loss_viewing_a_buffer(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """A mean squared error returned as a 0-d view of the batch-sized buffer of squares, as
    CPU's ``F.mse_loss`` returns it: while the loss lives, the buffer does."""
    squares = (out - batch).pow(2)
    flat = squares.view(-1)
    flat[0] = squares.mean()
    return flat[0]


def test_the_default_step_keeps_the_loss_through_the_optimizer_step_as_a_loop_does():
    """An ordinary loop's `loss` lives until the next step's loss is computed, through
    optimizer.step(): the probe's answer must train in that loop, and the next size not."""

    def loop_fits(batch_size: int) -> bool:
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 1024)
        opt = torch.optim.AdamW(model.parameters())
        try:
            with memkit.simulate("26MiB", track=[model]):
                for _ in range(2):
                    x = torch.randn(batch_size, 1024)
                    out = model(x)
                    loss = _loss_viewing_a_buffer(out, x)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        except torch.OutOfMemoryError:
            return False
        return True

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    result = probe(model, lambda n: torch.randn(n, 1024), loss_fn=_loss_viewing_a_buffer,
                   device="cpu", budget="26MiB")  # fmt: skip
    best = result.max_batch_size
    assert best is not None and loop_fits(best) and not loop_fits(best + 1)


def test_a_collection_between_trials_walks_only_the_trials_objects_when_some_were_frozen():
    """Objects that a first step creates and keeps (lazily imported modules, caches: about
    100,000 on nanoGPT's first CUDA step) are frozen at the next clean-up, so later collections
    skip them, also when objects were frozen before the probe (Python 3.12 freezes some at
    start-up; this suite freezes after every test), where the probe used not to freeze."""
    import gc

    gc.freeze()  # as the interpreter or a caller may have done
    assert gc.get_freeze_count() > 0
    cache: list[list[int]] = []
    unfrozen: list[int] = []
    kept: list[torch.Tensor] = []

    def step(model, batch, optimizer):
        if not cache:
            cache.extend([i] for i in range(20_000))  # what a lazy import keeps
        output = model(batch)
        kept[:] = [output]  # as train.py keeps `logits`: more is held after a bigger trial
        output.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model = small_mlp()
    probe(model, lambda n: torch.randn(n, 256), optimizer=torch.optim.SGD(model.parameters()),
          train_step=step, device="cpu", budget="8MiB", max_batch=16,
          on_trial=lambda t: unfrozen.append(len(gc.get_objects())))  # fmt: skip
    assert len(unfrozen) >= 3
    assert max(unfrozen[1:]) < 10_000, unfrozen  # the cache of 20,000 lists was frozen
    assert len(gc.get_objects()) > 20_000  # and unfrozen when the probe ended


def test_trials_collect_garbage_only_when_memory_is_still_held(monkeypatch):
    """gc.collect() costs 0.15 s a call on a CUDA run with a large program loaded: the runner
    collects before the first trial, after an OOM (recover) and when memory is still held
    after a trial's clean-up (reference cycles), not before every trial; and at the probe's end
    only when the device still holds more than on entry."""
    import gc

    from memkit.probing import trials

    calls = {"n": 0}
    real = gc.collect

    def counting(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(trials.gc, "collect", counting)
    result = probe(small_mlp(), lambda n: torch.randn(n, 256), device="cpu", budget="8MiB")
    assert len(result.trials) >= 5
    ooms = sum(not t.fits for t in result.trials)
    # before the first trial, one per OOM (recover); none at the end: the device is back to
    # what it held on entry, so a whole-heap walk would give nothing back
    assert calls["n"] == 1 + ooms, [t.batch_size for t in result.trials]

    calls["n"] = 0

    def step_with_a_cycle(model, batch, optimizer):
        cycle: dict = {"grown": model(batch).sum(), "kept": batch * 2}
        cycle["self"] = cycle  # a reference cycle holding a tensor: only gc frees it
        cycle["grown"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model = small_mlp()
    backend = get_backend("cpu", "24MiB")
    backend.track(model)
    baseline = backend.allocated()
    gc.disable()  # no automatic collection between trials: the cycles stay until collected
    try:
        cyclic = probe(model, lambda n: torch.randn(n, 256), train_step=step_with_a_cycle,
                       device="cpu", budget="8MiB")  # fmt: skip
    finally:
        gc.enable()
    assert_exact(cyclic)
    ooms = sum(not t.fits for t in cyclic.trials)
    assert calls["n"] > 1 + ooms + 1  # collected where the cycles held memory
    assert backend.allocated() == baseline  # the last trial's cycle too, at the probe's end


def test_memory_made_once_by_the_first_trial_costs_one_more_collection(monkeypatch):
    """A workspace made at the first matmul (cuBLAS on CUDA) stays allocated after the first
    trial: one collection finds it is not garbage, and the next trials do not collect."""
    import gc

    from memkit.probing import trials

    calls = {"n": 0}
    real = gc.collect

    def counting(*args):
        calls["n"] += 1
        return real(*args)

    workspace: list[torch.Tensor] = []

    def step(model, batch, optimizer):
        if not workspace:
            workspace.append(torch.empty(1 << 16))  # made inside the first trial, kept
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    monkeypatch.setattr(trials.gc, "collect", counting)
    result = probe(small_mlp(), lambda n: torch.randn(n, 256), train_step=step, device="cpu",
                   budget="8MiB")  # fmt: skip
    assert_exact(result)
    ooms = sum(not t.fits for t in result.trials)
    assert len(result.trials) >= 5
    assert calls["n"] == 2 + ooms + 1, [t.batch_size for t in result.trials]


def test_accumulation_with_a_train_step_steps_the_optimizer_once_per_accumulated_step():
    """A model file's train_step is called once per micro-batch; the optimizer it receives
    steps and zeroes the gradients on the last micro-batch only, so the gradients of the
    first live through the second's forward as in an accumulating loop."""
    seen = []

    def step(model, batch, optimizer):
        out = model(batch).sum()
        seen.append(any(p.grad is not None for p in model.parameters()))
        out.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model = small_mlp()
    plain = probe(model, lambda n: torch.randn(n, 256), train_step=step, device="cpu",
                  budget="8MiB")  # fmt: skip
    assert not any(seen)  # every forward starts without gradients
    seen.clear()
    accumulating = probe(model, lambda n: torch.randn(n, 256), train_step=step, device="cpu",
                         budget="8MiB", accumulation=4)  # fmt: skip
    assert seen[:4] == [False, True, False, True]  # micro-batch 2 runs with 1's gradients
    assert_exact(accumulating)
    assert accumulating.max_batch_size < plain.max_batch_size
    assert any(d.startswith("accumulation:") for d in accumulating.defaults)


def test_the_accumulation_line_divides_the_loss_only_where_memkit_takes_it():
    """``--accumulate 4`` with a model file's train_step said "loss / k", a division memkit
    cannot make in the user's step (sweep II): the line says what each step does."""
    default = StepPlan("train", accumulation=4).describe()
    own = StepPlan("train", train_step=lambda m, b, o: None, accumulation=4).describe()
    (said,) = [d for d in default if d.startswith("accumulation:")]
    assert "2 run per optimizer step, standing for the 4" in said and "loss / 4" in said
    (said,) = [d for d in own if d.startswith("accumulation:")]
    assert "loss /" not in said and "train_step called for each" in said


def test_options_are_checked_before_the_model_file_loads():
    """One checked object: a bad bound is a ConfigError naming it, before any file is read."""
    with pytest.raises(ConfigError, match=r"max_batch \(2\) must be at least min_batch \(4\)"):
        probe_file("no/such/model.py", min_batch=4, max_batch=2)
    with pytest.raises(ConfigError, match="steps must be at least 1, found 0"):
        probe_file("no/such/model.py", ProbeOptions(), steps=0)
    assert ProbeOptions(max_batch=8).for_length(128) == ProbeOptions(max_batch=8, seq_len=128)


def test_accumulation_is_refused_where_it_means_nothing():
    with pytest.raises(ConfigError, match="--mode train only"):
        probe(small_mlp(), lambda n: torch.randn(n, 256), device="cpu", budget="8MiB",
              mode="infer", accumulation=4)  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_graph_the_script_keeps_from_a_step_that_ran_out_does_not_fail_the_next_trials(device):
    """A script that keeps its last output (nanoGPT's ``logits``, here a list of the model
    file) keeps the output's whole autograd graph when backward runs out: only a backward that
    completes frees it. The trials after such an OOM ran with that graph still allocated and
    ran out too (on the CUDA stand-in, nanoGPT's step probed 8 where its loop fits 21; on the
    H200, 116 where a fresh process fits 118). Here the trials run in the order a search
    that overshoots runs them: a size that fits, one whose backward runs out, then the largest
    size the script's own loop fits in a fresh process, which must fit. On the simulated device
    and on the CUDA stand-in (whose cap is lifted for the releasing step)."""
    from memkit.devices.cuda_standin import cuda_standin
    from memkit.probing.state import SavedState
    from memkit.probing.trials import TrialRunner

    kept: list[torch.Tensor] = []
    reached: list[str] = []

    def step(model, batch, optimizer):
        output = model(batch)
        kept[:] = [output]  # rebound by the next step, as a loop's variable is
        reached[:] = ["backward"]
        output.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).to(device)

    def loop_fits(batch_size: int) -> bool:
        model = mlp()
        opt = torch.optim.SGD(model.parameters())
        backend = get_backend(device, "8MiB")
        if device == "cpu":
            backend.track(model, opt)
        try:
            with backend.activate():
                for _ in range(2):
                    step(model, torch.randn(batch_size, 256).to(device), opt)
        except torch.OutOfMemoryError:
            return False
        finally:
            kept.clear()
        return True

    with cuda_standin("64MiB") if device == "cuda" else contextlib.nullcontext():
        low, high = 1, 4096  # the loop's boundary: low fits, high does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if loop_fits(mid) else (low, mid)
        largest = low

        model = mlp()
        opt = torch.optim.SGD(model.parameters())
        backend = get_backend(device, "8MiB")
        if device == "cpu":
            backend.track(model, opt)
        runner = TrialRunner(model, lambda n: torch.randn(n, 256), opt, StepPlan("train",
            train_step=step), backend, 2, 8 << 20, SavedState(model, opt))  # fmt: skip
        assert runner(4)[0]
        reached.clear()
        assert not runner(largest * 5 // 4)[0]
        assert reached == ["backward"]  # the forward fit: its graph was kept
        assert runner(largest)[0], runner.records
        assert runner.held_after_oom == {}
        kept.clear()


def test_memory_a_failed_step_leaves_held_is_reported_when_a_step_does_not_release_it():
    """A script that files each step's output under its batch size never rebinds the failed
    size's entry: the probe says how much stayed held after the OOM, and that the trials after
    it had that much less room."""
    by_size: dict[int, torch.Tensor] = {}

    def step(model, batch, optimizer):
        output = model(batch)
        by_size[len(batch)] = output
        output.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model = small_mlp()
    result = probe(model, lambda n: torch.randn(n, 256), optimizer=torch.optim.SGD(
        model.parameters()), train_step=step, device="cpu", budget="8MiB")  # fmt: skip
    failed = [t.batch_size for t in result.trials if not t.fits]
    notes = [line for line in result.defaults if "stayed allocated" in line]
    # the first OOM left its graph held (the trials after it then ran out in their forward,
    # keeping nothing more: the answer is conservative, as the note says)
    assert failed and notes, (failed, result.defaults)
    # one line for all the leftovers (sweep CN: ten near-identical paragraphs)
    (note,) = notes
    assert note.startswith((f"after the OOM at batch {failed[0]}, ", "after each of "))
    assert str(failed[0]) in note, (failed, note)
    assert "held by the model or the script (not by memkit)" in note
    assert any("stayed allocated" in line for line in str(result).splitlines())
    by_size.clear()


def test_leftovers_of_several_failed_trials_share_one_line():
    """Sweep CN: a model file's global list of losses left something after each of ten OOM
    trials, and the report printed ten near-identical paragraphs. Leftovers share one line; a
    copy of the model's parameters (an SWA copy) keeps its own."""
    from memkit.probing.runner import _held_notes

    weights = 4 << 20
    lines = _held_notes({1450: 92_000, 1875: 1_680_000, 1473: 377_000, 900: weights}, weights)
    assert len(lines) == 2, lines
    copy, rest = lines
    assert copy.startswith("after the OOM at batch 900, ") and "the model's parameters" in copy
    assert rest.startswith("after each of 3 OOM trials (batch 1450, 1473, 1875), 89.84 KiB to")
    assert "the model file's globals or in a class attribute" in rest
    # sweep CP: a leftover of the search's last trial had no trial after it to squeeze
    (only,) = _held_notes({2933: 27_000_000}, weights, last=2933)
    assert "(the last trial)" in only and "no trial ran after it" in only
    assert "less room" not in only and "may be below" not in only


def test_a_model_copy_made_in_a_failed_trial_is_said_to_be_state_the_script_makes():
    """Sweep BV: an SWA copy made once the trials' step count reached its epoch stayed after
    an OOM trial; the note called it a leftover and the answer possibly low, where the loop at
    the answer ran out once the copy existed (28% high)."""
    from torch.optim.swa_utils import AveragedModel

    kept: dict[str, Any] = {"calls": 0}

    def step(model, batch, optimizer):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        kept["calls"] += 1
        if kept["calls"] >= 9 and "swa" not in kept:  # SWA from the 9th step on
            kept["swa"] = AveragedModel(model)

    model = small_mlp()
    result = probe(model, lambda n: torch.randn(n, 256), optimizer=torch.optim.SGD(
        model.parameters()), train_step=step, device="cpu", budget="8MiB")  # fmt: skip
    # (made in the trial that ran out first: the clean-up after it sees it stay)
    (note,) = [line for line in result.defaults if "stayed allocated" in line]
    assert "the size of the model's parameters, so likely state the script made" in note
    assert "answer may be below" not in note and "swa" in kept
    kept.clear()


def test_a_cache_buffer_the_model_regrows_is_left_as_made_and_everything_else_restored():
    """Older transformers rotary embeddings (``_set_cos_sin_cache``) re-register their cos/sin
    buffers at the longest sequence seen and keep that length in a plain attribute. The probe
    crashed at its end copying the saved 32-row cache into the 64-row one ("internal error",
    the answer lost). The cache is now left as the model made it (consistent with its
    attribute), the report says so, and the parameters are restored bit for bit."""

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cached = 0
            self.grow(32)

        def grow(self, length: int) -> None:
            self.cached = length
            self.register_buffer("cos", torch.arange(length * 16.0).view(length, 16).cos())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] > self.cached:
                self.grow(x.shape[1])
            return x * self.cos[: x.shape[1]]

    model = torch.nn.Sequential(Rotary(), torch.nn.Linear(16, 16))
    before = [p.detach().clone() for p in model.parameters()]
    result = probe(model, lambda n, seq_len: torch.randn(n, seq_len, 16), device="cpu",
                   budget="4MiB", seq_len=64)  # fmt: skip
    assert_exact(result)
    assert any(
        line.endswith("left as the model remade them (another shape): 0.cos")
        for line in result.defaults
    ), result.defaults
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert model[0].cos.shape == (64, 16) and model[0].cached == 64
    model(torch.randn(2, 64, 16))  # still consistent


def test_a_history_that_skips_a_step_is_stepped_on_until_it_stops_growing():
    """LBFGS keeps a direction pair only where the curvature allows, so its history can stay
    level for a step and grow again (a new user's MLP: 0 1 2 3 4 5 6 6 7 8 8 9 10 pairs). The
    probe stopped at the first level step and answered 2 where the script's 15 steps fit
    nothing. Here a history on the model grows at every step but the fourth, up to 6 entries:
    the probe steps until two steps are level, and its answer trains for 10 steps."""

    def make() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        model.pairs, model.calls = [], 0
        return model

    def train_step(m, batch, optimizer):
        h = m[0](batch[0])
        torch.nn.functional.cross_entropy(m[1](h), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        m.calls += 1
        if m.calls != 4 and len(m.pairs) < 6:  # a pair of the batch's size
            m.pairs.append(h.detach().clone())

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 8), torch.randint(0, 2, (n,))

    def trains(n: int) -> bool:
        model = make()
        opt = torch.optim.SGD(model.parameters())
        try:
            with memkit.simulate("1MiB", track=(model, opt)):
                for _ in range(10):
                    train_step(model, batch(n), opt)
        except torch.OutOfMemoryError:
            return False
        return True

    model = make()
    optimizer = torch.optim.SGD(model.parameters())
    result = probe(model, batch, train_step=train_step, optimizer=optimizer, device="cpu",
                   budget="1MiB")  # fmt: skip
    best = result.max_batch_size
    assert_exact(result)
    assert result.trial(best).steps_run == 9, result.trial(best)  # 6 entries at step 7, 2 level
    assert trains(best) and not trains(best + 1)


def test_a_history_the_step_appends_to_starts_empty_in_every_trial():
    """A replay buffer on the model (``self.history = deque(maxlen=3)``, each step appends the
    batch's detached features) was carried from one trial to the next: the answer's trial
    started with an earlier trial's entries (the sweep's grow_replay.py: memkit 679, its loop
    fits 666), and grew "0 B after step 2". Each trial now starts from the deque as it was
    (empty, the same object: the script's reference stays true), and so does the model after
    the probe; a features attribute and a counter beside it go back too."""
    from collections import deque

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    history = model.history = deque(maxlen=3)
    model.last, model.seen = None, 0

    def train_step(m, batch, optimizer):
        h = m[0](batch[0])
        torch.nn.functional.cross_entropy(m[1](h), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        m.history.append(h.detach())
        m.last, m.seen = h.detach(), m.seen + 1

    result = probe(model, lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
                   train_step=train_step, optimizer=torch.optim.SGD(model.parameters()),
                   device="cpu", budget="2MiB")  # fmt: skip
    assert_exact(result)
    for trial in result.trials:
        if trial.fits and trial.batch_size > 1:  # entries 1 (step 1) to 3 (steps 3 to 5)
            entry = trial.batch_size * 16 * 4
            assert (trial.steps_run, trial.kept_growth_bytes) == (5, 2 * entry), trial
    assert model.history is history and not history and history.maxlen == 3
    assert model.last is None and model.seen == 0


def test_a_number_that_became_a_tensor_is_put_back_after_the_probe():
    """transformers' dynamic RoPE grows its cache past ``max_position_embeddings``:
    ``max_seq_len_cached`` goes from the int 16 to a tensor, and its ``inv_freq`` buffer is
    rewritten. The probe put the buffer back but left the tensor, a module changed in numbers
    only (review: a 40-token forward then used the original frequencies with a grown length)."""

    class Rope(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 2)
            self.max_seq_len_cached = 16

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > self.max_seq_len_cached:
                self.max_seq_len_cached = torch.tensor(x.shape[0])
            return super().forward(x)

    model = Rope()
    probe(model, lambda n: torch.randn(n, 8), device="cpu", budget="1MiB", max_batch=64)
    assert model.max_seq_len_cached == 16 and isinstance(model.max_seq_len_cached, int)


def test_a_fitting_trial_still_growing_at_the_step_limit_is_said_when_the_answers_is_not():
    """The report's ``steps:`` line looked only at the answer's trial: trials still growing
    when the step limit stopped them (the sweep's 512, 673 and 677) went unsaid. Here the step
    keeps every batch's features while the batch is small: the answer's trial is stable, the
    small ones still grow at step 16, and the line says so."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    model.kept = []

    def train_step(m, batch, optimizer):
        h = m[0](batch[0])
        torch.nn.functional.cross_entropy(m[1](h), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if len(h) < 8:
            m.kept.append(h.detach())

    result = probe(model, lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
                   train_step=train_step, optimizer=torch.optim.SGD(model.parameters()),
                   device="cpu", budget="2MiB")  # fmt: skip
    assert_exact(result)
    assert not result.trial(result.max_batch_size).still_growing
    growing = max(t.batch_size for t in result.trials if t.still_growing)
    assert growing < 8 and result.trial(growing).steps_run == 16
    (line,) = [d for d in result.defaults if d.startswith("steps:")]
    assert f"; but at batch {growing} still growing at step 16 (" in line, line


class _MomentsFrom(torch.optim.Optimizer):
    """Plain SGD with a step counter, then Adam-like moments from step ``first`` on (``None``:
    never, the state a counter only)."""

    def __init__(self, params, first: int | None = 3) -> None:
        super().__init__(params, {"lr": 1e-3})
        self.first = first

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if self.first is not None and state["n"] >= self.first:
                    state.setdefault("m", torch.zeros_like(p)).add_(p.grad)
                    state.setdefault("v", torch.zeros_like(p)).addcmul_(p.grad, p.grad)
                p.add_(p.grad, alpha=-group["lr"])


def test_optimizer_state_made_at_step_three_is_waited_for_and_trained_at():
    """An optimizer whose per-parameter state holds only a counter for its first steps (the
    sweep's grow_lazyopt.py: memkit 1924, its loop fits 1238 over 5 steps) ended each trial
    after 2 steps, nothing having grown. The first trial that completes now steps on while
    that state holds no tensor, and the trials run as many steps as it took to appear: the
    answer trains for 5 steps and one more does not."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 2))
    optimizer = _MomentsFrom(model.parameters())

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64), torch.randint(0, 2, (n,))

    def trains(n: int) -> bool:
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 2))
        opt = _MomentsFrom(fresh.parameters())
        try:
            with memkit.simulate("1MiB", track=(fresh, opt)):
                for _ in range(5):
                    x, y = batch(n)
                    torch.nn.functional.cross_entropy(fresh(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    del x, y
        except torch.OutOfMemoryError:
            return False
        return True

    result = probe(model, batch, optimizer=optimizer, device="cpu", budget="1MiB")
    best = result.max_batch_size
    assert_exact(result)
    assert result.trial(best).steps_run == 5 and result.trial(best).optimizer_growth_bytes
    assert trains(best) and not trains(best + 1)


def test_a_wait_for_optimizer_state_that_never_comes_is_no_longer_run():
    """An optimizer whose state is a counter only makes the first trial step on, waiting for
    tensors that never come: the report said "up to 16 per trial ... 0 B more ... then
    stable" (review). Nothing grew: the answer holds for the steps asked."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 2))
    counter_only = _MomentsFrom(model.parameters(), None)
    result = probe(model, lambda n: torch.randn(n, 64), optimizer=counter_only, device="cpu",
                   budget="1MiB")  # fmt: skip
    assert_exact(result)
    (line,) = [d for d in result.defaults if d.startswith("steps:")]
    assert line.startswith("steps: 2 per trial (steps=2), the memory kept between them stable")


def test_an_inputs_labels_batch_reaches_a_one_argument_forward_as_its_inputs():
    """docs/probe.md's ``(inputs, labels)`` batch with a ``loss_fn``, and ``--mode infer`` of
    examples/cnn.py: ``model(*batch)`` raised "forward() takes 2 positional arguments but 3
    were given". A forward of one argument gets the inputs; the loss gets the whole batch;
    a forward of two (nanoGPT's ``forward(idx, targets=None)``) still gets both."""

    class OneInput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class TwoInputs(OneInput):
        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            out = self.fc(x)
            return out if y is None else torch.nn.functional.cross_entropy(out, y)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 32), torch.randint(0, 10, (n,))

    def loss(out: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, b[1])

    for mode in ("train", "infer"):
        result = probe(OneInput(), batch, loss_fn=loss, device="cpu", budget="1MiB", mode=mode)
        assert_exact(result)
    assert (
        "loss: the scalar output (default)"
        in probe(TwoInputs(), batch, device="cpu", budget="1MiB", max_batch=8).defaults
    )
    # through the wrappers a probe may meet (--ddp, torch.compile, DataParallel)
    from memkit.probing.step import takes_one_input

    one = OneInput()
    assert takes_one_input(torch.compile(one)) and takes_one_input(torch.nn.DataParallel(one))
    assert not takes_one_input(torch.compile(TwoInputs()))
    # a list batch stays positional: forward(items) with a list of samples is not model(b[0])
    with pytest.raises(TypeError, match="positional argument"):
        call_model(one, [torch.randn(2, 32), torch.randn(2, 32)])


@pytest.mark.parametrize("keep", ["output", "loss"])
def test_the_answer_is_the_loops_whether_it_keeps_the_output_or_only_the_loss(keep):
    """nanoGPT keeps ``logits`` until the next forward; transformers' ``Trainer`` takes
    ``loss = model(**inputs).loss`` and drops the logits before backward. ``keep_output``
    (``--keep output|loss``) answers for each: B fits in that loop and B + 1 runs out. The
    loss-only answer is the larger (a tiny GPT-2 at 128 MiB: 31 against 27)."""
    ce = torch.nn.functional.cross_entropy

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2048)
        )

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64), torch.randint(0, 2048, (n,))

    def loop_fits(n: int) -> bool:
        net = model()
        opt = torch.optim.AdamW(net.parameters())
        try:
            with memkit.simulate("16MiB", track=[net]):
                for _ in range(3):
                    x, y = batch(n)
                    if keep == "output":
                        out = net(x)
                        loss = ce(out, y)
                    else:
                        loss = ce(net(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            return False
        return True

    result = probe(model(), batch, loss_fn=lambda out, b: ce(out, b[1]), device="cpu",
                   budget="16MiB", keep_output=keep == "output")  # fmt: skip
    best = result.max_batch_size
    assert best is not None and loop_fits(best) and not loop_fits(best + 1)
    assert any(line.startswith(f"kept: the {'model' if keep == 'output' else 'loss'}")
               for line in result.defaults)  # fmt: skip


def test_keep_loss_is_refused_where_the_model_files_train_step_runs():
    def step(model, batch, optimizer):
        model(batch).sum().backward()
        optimizer.step()

    with pytest.raises(ConfigError, match="train_step, which keeps what its own code keeps"):
        probe(small_mlp(), lambda n: torch.randn(n, 256), train_step=step, device="cpu",
              budget="8MiB", keep_output=False)  # fmt: skip


def test_the_part_hooks_leave_a_transformer_encoders_fused_inference_path_on():
    """``TransformerEncoderLayer`` runs its fused inference kernel only while no forward hook
    sits on it or inside it: the probe's part hooks must not send it down the op-by-op path
    (a ViT probed 156 at 32 MiB where its own eval loop fits 532)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memkit.probing.trials import PartPeaks

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ).eval()
    parts = PartPeaks((lambda: (0, 0, 0, 0), lambda: None), model, None)
    try:
        with torch.no_grad(), Ops() as ops:
            model(torch.randn(4, 10, 8))
    finally:
        parts.close()
    assert "_transformer_encoder_layer_fwd" in ops.names
    assert len(parts.parts) >= 2  # the model's own parts are still cut


def test_sparse_gradients_get_a_note_that_the_answer_depends_on_the_batchs_values():
    """A recommender's sparse embeddings: a sparse gradient holds a row per index a batch
    looks up, repeats included (uncoalesced: sweep BQ measured as many rows for 3000 equal
    indices as for 3000 distinct ones), so the same batch size needs more memory for a batch
    with more lookups. The answer stands for make_batch's batches, and the report says so."""

    class Recommender(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.users = torch.nn.Embedding(5000, 32, sparse=True)
            self.items = torch.nn.Embedding(5000, 32, sparse=True)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return (self.users(ids[:, 0]) * self.items(ids[:, 1])).sum(-1)

    model = Recommender()
    result = probe(
        model, lambda n: torch.randint(0, 5000, (n, 2)), device="cpu", budget="4MiB",
        optimizer=torch.optim.SparseAdam(model.parameters()), max_batch=4096,
    )  # fmt: skip
    notes = [d for d in result.defaults if d.startswith("sparse gradients")]
    assert notes and "users, items" in notes[0] and "repeats included" in notes[0]
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.zeros(30, dtype=torch.long)).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad._nnz() == 30  # one row a lookup
    dense = probe(small_mlp(), lambda n: torch.randn(n, 256), device="cpu", budget="8MiB")
    assert not [d for d in dense.defaults if d.startswith("sparse gradients")]


def test_a_step_that_trains_only_the_optimizers_parameters_is_not_called_untrained():
    """A linear probe: the optimizer holds the head alone while the backbone stays
    requires_grad. The step updates the head, so there is no 'parameters unchanged' warning."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU())
    head = torch.nn.Linear(256, 10)
    model = torch.nn.Sequential(backbone, head)
    result = probe(
        model, lambda n: torch.randn(n, 64), device="cpu", budget="8MiB", max_batch=256,
        optimizer=torch.optim.SGD(head.parameters(), lr=0.1),
    )  # fmt: skip
    assert not [d for d in result.defaults if "unchanged" in d]


def test_the_python_api_refuses_a_make_batch_that_ignores_its_batch_size():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with pytest.raises(ConfigError, match="ignore its batch_size"):
        probe(model, lambda n: torch.randn(4, 32), device="cpu", budget="16MiB")


def test_the_python_api_takes_any_batch_that_grows_and_leaves_the_rng_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def sequence_first(n: int) -> torch.Tensor:
        return torch.randn(5, n, 32)  # (seq, batch, features): the batch on dimension 1

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    result = probe(model, sequence_first, device="cpu", budget="16MiB", max_batch=8)
    assert torch.equal(torch.rand(3), expected)
    assert "batch dimension: 1 (inferred from make_batch(1) and make_batch(2))" in result.defaults
    # a list of one tensor a sample: the count grows, no dimension does; the step is the caller's
    listed = probe(
        model, lambda n: [torch.randn(32) for _ in range(n)], device="cpu", budget="16MiB",
        max_batch=4, train_step=lambda m, batch, opt: m(torch.stack(batch)).sum().backward(),
    )  # fmt: skip
    assert listed.max_batch_size == 4


def test_a_make_batch_that_cannot_take_the_batch_size_is_a_config_error():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"make_batch\(batch_size\): its signature is \(\)"):
        probe(model, lambda: torch.randn(2, 4), device="cpu", budget="16MiB")
    with pytest.raises(ConfigError, match="must be a function"):
        probe(model, 32, device="cpu", budget="16MiB")  # type: ignore[arg-type]


def test_api_arguments_of_the_wrong_kind_are_config_errors_naming_them():
    model, batch = small_mlp(), lambda n: torch.randn(n, 256)
    with pytest.raises(ConfigError, match=r"min_batch must be a whole number, found 2.5 \(float\)"):
        probe(model, batch, device="cpu", budget="8MiB", min_batch=2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"model must be a torch\.nn\.Module, found function"):
        probe(lambda x: x, batch, device="cpu", budget="8MiB")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="one probe per mode"):
        ProbeOptions(mode="train,infer")
    with pytest.raises(ConfigError, match=r"seq_len must be a whole number, found \[64, 128\]"):
        ProbeOptions(seq_len=[64, 128])  # type: ignore[arg-type]


def test_a_simulated_cpu_budget_above_the_available_ram_is_refused(monkeypatch):
    from memkit.devices.host import HostMemory

    monkeypatch.setattr(
        memkit.devices, "host_memory", lambda: HostMemory(None, 64 << 20, 128 << 20)
    )
    with pytest.raises(ConfigError, match=r"budget=.1TiB.*available: 64\.00 MiB"):
        probe(small_mlp(), lambda n: torch.randn(n, 256), device="cpu", budget="1TiB")


def test_the_learning_rate_schedulers_a_train_step_advances_are_put_back():
    """A train_step that steps the script's schedulers (a warm-up, then a plateau rule) moves
    them once per probe step; afterwards the schedule goes on from where it was, as if the
    probe had not run: the next learning rates are those of an unprobed twin."""

    def setup():
        torch.manual_seed(0)
        model = small_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=50)
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return model, opt, (warmup, decay, plateau)

    def schedule(opt, schedulers, steps):
        lrs = []
        for i in range(steps):
            opt.step()
            schedulers[0].step()
            schedulers[1].step()
            schedulers[2].step(1.0 / (i + 1))
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    model, opt, schedulers = setup()
    _, twin_opt, twin_schedulers = setup()
    schedule(opt, schedulers, 2)
    schedule(twin_opt, twin_schedulers, 2)

    def step(model, batch, optimizer):
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()
        for s in schedulers[:2]:
            s.step()
        schedulers[2].step(100.0)  # no improvement: the plateau rule cuts the rate

    result = probe(model, lambda n: torch.randn(n, 256), optimizer=opt, train_step=step,
                   device="cpu", budget="8MiB")  # fmt: skip
    assert result.max_batch_size is not None
    assert schedulers[0].last_epoch == twin_schedulers[0].last_epoch == 2
    assert schedule(opt, schedulers, 6) == schedule(twin_opt, twin_schedulers, 6)


def test_existing_optimizer_state_is_put_back_in_place_and_counted_once():
    """A script probed after some steps holds its momentum buffers elsewhere too (a checkpoint
    dict's ``optimizer.state_dict()``): the probe writes the saved values back into the same
    tensors, so each trial counts them once and the user's references stay true."""

    def trained():
        torch.manual_seed(0)
        model = small_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, opt

    def batch(n):
        return torch.randn(n, 256)

    model, opt = trained()
    alone = probe(model, batch, optimizer=opt, device="cpu", budget="6MiB")
    model, opt = trained()
    checkpoint = {"optimizer": opt.state_dict()}  # references to the live buffers
    buffers = [s["momentum_buffer"] for s in opt.state.values()]
    values = [b.clone() for b in buffers]
    held = probe(model, batch, optimizer=opt, device="cpu", budget="6MiB")
    assert alone.max_batch_size is not None
    assert held.max_batch_size == alone.max_batch_size
    after = [s["momentum_buffer"] for s in opt.state.values()]
    assert all(a is b for a, b in zip(after, buffers, strict=True))
    assert all(torch.equal(b, v) for b, v in zip(buffers, values, strict=True))
    assert checkpoint["optimizer"]["state"][0]["momentum_buffer"] is buffers[0]


def test_one_step_per_trial_still_meets_the_optimizer_state_the_first_step_made():
    """``steps=1`` with Adam: the state its first step creates is in memory from the second
    step's forward on, so each trial runs that second step and the answer is steps=2's."""

    def answer(steps: int):
        torch.manual_seed(0)
        model = small_mlp()
        opt = torch.optim.Adam(model.parameters())
        return probe(model, lambda n: torch.randn(n, 256), optimizer=opt, steps=steps,
                     device="cpu", budget="8MiB")  # fmt: skip

    one, two = answer(1), answer(2)
    assert one.max_batch_size is not None and one.max_batch_size == two.max_batch_size
    assert any(d.startswith("steps: 2 per trial (steps=1)") for d in one.defaults)


def test_a_model_with_uninitialised_lazy_modules_is_a_clear_error():
    model = torch.nn.Sequential(torch.nn.LazyLinear(64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with pytest.raises(ConfigError, match=r"lazy modules .*0 \(LazyLinear\).*Run one forward"):
        probe(model, lambda n: torch.randn(n, 32), device="cpu", budget="8MiB")
    model(torch.randn(1, 32))  # initialised: probed as any model
    assert probe(model, lambda n: torch.randn(n, 32), device="cpu",
                 budget="8MiB").max_batch_size  # fmt: skip


def test_optimizer_state_for_evaluation_trials_is_made_without_moving_the_weights():
    """``--mode train,infer``'s evaluation holds training's optimizer state, made by one step
    at a learning rate of 0 (a tensor rate too); LBFGS needs a closure; an optimizer that
    refuses dense gradients says why it has none."""
    from memkit.probing.runner import with_optimizer_state

    model = small_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    adamw = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1), weight_decay=0.5)
    assert with_optimizer_state(adamw) is None
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert len(adamw.state) == 4 and adamw.param_groups[0]["lr"].item() == pytest.approx(0.1)
    assert all(p.grad is None for p in model.parameters())
    assert with_optimizer_state(torch.optim.LBFGS(model.parameters())) is None
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    refused = with_optimizer_state(torch.optim.SparseAdam(embedding.parameters()))
    assert refused is not None and "dense gradients" in refused


def test_a_gradient_scalers_state_is_put_back():
    from memkit.probing.state import SavedState

    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", growth_interval=100)
    saved = SavedState(model, opt)
    for _ in range(3):
        scaler.scale(model(torch.randn(2, 256)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.state_dict()["_growth_tracker"] == 3
    saved.restore()
    assert scaler.state_dict()["_growth_tracker"] == 0


def test_a_step_that_runs_out_between_unscale_and_update_leaves_the_next_trial_a_ready_scaler():
    """fp16 training: ``scaler.unscale_(opt)``, clipping, ``scaler.step(opt)`` (where a first
    step creates Adam's state), ``scaler.update()``. An OOM after ``unscale_`` left the scaler
    waiting for ``update``: the next trial's ``unscale_`` raised "unscale_() has already been
    called on this optimizer since the last update()", and the probe stopped on it."""
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")

    def train_step(model, batch, optimizer):
        out = model(batch)
        scaler.scale(out.float().pow(2).mean()).backward()
        scaler.unscale_(optimizer)
        spare = out.detach().repeat(40, 1)  # a batch-sized temporary after unscale_  # noqa: F841
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    result = probe(model, lambda n: torch.randn(n, 256), optimizer=opt, train_step=train_step,
                   device="cpu", budget="24MiB")  # fmt: skip
    assert result.max_batch_size is not None
    assert any(not t.fits for t in result.trials)
    scaler.unscale_(opt)  # ready, as before the probe (it would raise otherwise)


def test_schedulers_of_a_wrapped_optimizer_and_of_other_libraries_are_put_back_too():
    """accelerate's optimizer wrapper holds the real optimizer as ``.optimizer`` (its scheduler
    steps the inner one); timm's schedulers are no ``LRScheduler``, but ``...Scheduler``
    classes with ``state_dict``/``load_state_dict``."""

    class Wrapped:  # the shape of accelerate's AcceleratedOptimizer
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def __getattr__(self, name: str):
            return getattr(self.optimizer, name)

    class CosineScheduler:  # the shape of timm's schedulers
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer, self.updates = optimizer, 0

        def step_update(self) -> None:
            self.updates += 1

        def state_dict(self) -> dict:
            return {"updates": self.updates}

        def load_state_dict(self, state: dict) -> None:
            self.updates = state["updates"]

    from memkit.probing.state import SavedState

    model = small_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    torch_scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    timm_like = CosineScheduler(inner)
    saved = SavedState(model, Wrapped(inner))
    for _ in range(3):
        inner.step()
        torch_scheduler.step()
        timm_like.step_update()
    saved.restore()
    assert torch_scheduler.last_epoch == 0 and timm_like.updates == 0


def test_a_step_errors_traceback_keeps_its_cause_and_drops_memkits_frames(monkeypatch):
    from memkit.modelfile import step_traceback

    def lookup(batch):
        try:
            return {}["input_ids"]
        except KeyError as exc:
            raise ValueError("the batch has no input_ids") from exc

    try:
        lookup(None)
    except ValueError as exc:
        caught = exc
    text = step_traceback(caught)
    assert "KeyError: 'input_ids'" in text and "direct cause" in text
    assert text.endswith("ValueError: the batch has no input_ids")
    monkeypatch.setenv("MEMKIT_TRACEBACK", "1")
    assert step_traceback(caught).count('File "') >= text.count('File "')


def test_infer_probes_of_a_model_with_gradients_hold_them_and_say_so():
    model = small_mlp()
    model(torch.randn(2, 256)).sum().backward()  # mid-training: the last step's gradients
    result = probe(model, lambda n: torch.randn(n, 256), mode="infer", device="cpu",
                   budget="4MiB")  # fmt: skip
    assert any(d.startswith("held through the trials: the gradients") for d in result.defaults)
    assert all(p.grad is not None for p in model.parameters())  # put back as they were
    model.zero_grad(set_to_none=True)
    freed = probe(model, lambda n: torch.randn(n, 256), mode="infer", device="cpu",
                  budget="4MiB")  # fmt: skip
    assert not any(d.startswith("held through") for d in freed.defaults)
    assert freed.max_batch_size > result.max_batch_size


def test_infer_with_a_loss_fn_takes_the_loss_as_an_eval_loop_does():
    """An evaluation loop takes its loss: ``logits = model(x)`` then ``total +=
    F.cross_entropy(logits.float(), y).item()`` under ``no_grad``, the float32 copy of a
    bfloat16 model's logits and its log-probabilities larger than the forward's own peak.
    An evaluation probe that ran the forward alone answered far above what that loop fits
    (471 where it fits 190). With ``loss_fn`` in the model file, the evaluation step takes
    the loss too."""

    def classifier() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 4096)).to(torch.bfloat16)  # fmt: skip

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64, dtype=torch.bfloat16), torch.randint(0, 4096, (n,))

    def loss_fn(logits: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), b[1])

    def eval_loop_fits(n: int) -> bool:
        model = classifier().eval()
        try:
            with memkit.simulate("8MiB", track=[model]), torch.no_grad():
                total = 0.0
                for _ in range(2):
                    x, y = batch(n)
                    logits = model(x)
                    total += loss_fn(logits, (x, y)).item()
        except torch.OutOfMemoryError:
            return False
        return True

    result = probe(classifier(), batch, loss_fn=loss_fn, device="cpu", budget="8MiB",
                   mode="infer")  # fmt: skip
    best = result.max_batch_size
    assert best is not None and eval_loop_fits(best) and not eval_loop_fits(best + 1)
    assert any("loss_fn(output, batch) under torch.no_grad()" in d for d in result.defaults)


def test_an_eval_step_under_inference_mode_counts_what_no_grad_counts():
    """Sweep BL: a scoring step under its own ``torch.inference_mode()`` answered 32 where 21
    fit: under inference mode ``cross_entropy`` reached the simulated device whole and its
    log-probabilities went uncounted. It runs as ``no_grad`` while probing (same bytes on a
    GPU), and is put back after."""
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512))

    def score(m: torch.nn.Module, ids: torch.Tensor) -> float:
        logits = m(ids)
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), ids.flatten(), reduction="none"
        )
        return nll.sum().item()

    def inference(m: torch.nn.Module, ids: torch.Tensor) -> float:
        with torch.inference_mode():
            return score(m, ids)

    def answer(step: Any) -> int | None:
        return probe(model, lambda n: torch.randint(0, 512, (n, 32)), mode="infer",
                     eval_step=step, device="cpu", budget="4MiB").max_batch_size  # fmt: skip

    plain = answer(score)
    assert plain is not None and answer(inference) == plain
    with torch.inference_mode():
        assert torch.is_inference_mode_enabled()  # (torch's own again)
    # where memory is not counted op by op (a GPU), the step's inference mode runs as written
    # (review: autocast caches no casts under it; an inference tensor may be written in it)
    from memkit.probing.step import StepPlan

    seen: list[bool] = []

    def look(m: torch.nn.Module, ids: torch.Tensor) -> None:
        with torch.inference_mode():
            seen.append(torch.is_inference_mode_enabled())

    batch = torch.zeros(1, 4, dtype=torch.long)
    StepPlan("infer", eval_step=look)(model, batch, None)
    StepPlan("infer", eval_step=look, counted_per_op=True)(model, batch, None)
    assert seen == [True, False]


def test_eval_step_runs_as_an_evaluation_loop_and_holds_what_it_returns():
    """``eval_step=`` replaces infer mode's forward: under ``torch.no_grad()``, what it returns
    held into the next call, as ``out = eval_step(model, batch)`` in a loop holds it (a T5
    ``generate()`` with its scores answered 64 where the loop ran out at 35: sweep PP), so
    an ``eval_step`` returning the output answers as the default step, below the one that
    keeps only the loss (``keep_output=False``), and one returning nothing as that one."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2048))
    grad_seen: list[bool] = []

    def eval_step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        grad_seen.append(torch.is_grad_enabled())
        return m(x)

    def answer(**kw: object) -> int | None:
        kw = {"mode": "infer", "device": "cpu", "budget": "2MiB", **kw}
        return probe(model, lambda n: torch.randn(n, 64), **kw).max_batch_size  # type: ignore[arg-type]

    dropped, kept = answer(keep_output=False), answer()
    assert dropped is not None and kept is not None and dropped > kept
    assert answer(eval_step=eval_step) == kept
    assert answer(eval_step=lambda m, x: eval_step(m, x).sum().item()) == dropped
    assert grad_seen and not any(grad_seen)


def test_train_step_holds_what_it_returns_as_a_loop_does():
    """Sweep VV: a train_step returning the model's output (a recommender's scores) answered
    4259 where the loop around it, `out = train_step(...)`, ran out at 4250: what it returns
    is now held until the next call returns, and the answer is the loop's."""
    torch.manual_seed(0)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1024))

    def train_step(m: torch.nn.Module, x: torch.Tensor, opt: Any) -> torch.Tensor:
        out = m(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.detach()

    def loop_fits(n: int) -> bool:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        try:
            with memkit.simulate("4MiB") as acct:
                acct.track(model)
                for _ in range(3):
                    out = train_step(model, torch.randn(n, 64), opt)  # noqa: F841
        except torch.OutOfMemoryError:
            return False
        return True

    def answer(step: Any) -> int:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        found = probe(model, lambda n: torch.randn(n, 64), optimizer=opt, train_step=step,
                      device="cpu", budget="4MiB").max_batch_size  # fmt: skip
        assert found is not None
        return found

    held = answer(train_step)
    assert loop_fits(held) and not loop_fits(held + 1)
    assert answer(lambda m, x, opt: train_step(m, x, opt).sum().item()) > held


def test_dropout_on_the_cpu_is_said_to_keep_more_than_cudas():
    """Sweep WW: a T5 with dropout, probed on the simulated CPU device, answered 22 where the
    estimate for the same room answered 32, and neither said why: CPU dropout keeps a mask of
    its input's dtype for backward (``empty_like(input).bernoulli_``), CUDA's fused
    ``native_dropout`` a 1-byte one. The probe now says so where the model drops out."""

    def net(p: float) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Dropout(p), torch.nn.Linear(256, 8)
        )

    def notes(p: float, mode: str = "train") -> list[str]:
        result = probe(net(p), lambda n: torch.randn(n, 64), device="cpu", budget="4MiB",
                       mode=mode, max_batch=64)  # fmt: skip
        return [d for d in result.defaults if d.startswith("dropout:")]

    (said,) = notes(0.1)
    assert "1 dropout layer(s)" in said and "1-byte" in said
    assert "memkit.estimate runs CUDA's dropout layers" in said
    assert notes(0.0) == [] and notes(0.1, mode="infer") == []
    x = torch.randn(8, 256, requires_grad=True)  # the fact the note rests on
    saved = torch.nn.functional.dropout(x, 0.1, True).grad_fn._saved_other
    assert saved.dtype == torch.float32
    assert torch.native_dropout(x, 0.1, True)[1].dtype == torch.bool  # CUDA's kernel's mask


class _Encoder(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def test_an_attentions_dropout_is_said_to_keep_its_weights_on_the_cpu():
    """Sweep CA: a Transformer answered 3 with dropout and 18 without at length 512, and the
    note spoke of 4-byte masks only: with dropout, CPU attention takes the math kernel, which
    keeps every head's length x length weights for backward."""

    def notes(model: torch.nn.Module) -> list[str]:
        result = probe(model, lambda n: torch.randn(n, 64, 32), device="cpu", budget="4MiB",
                       max_batch=16)  # fmt: skip
        return [d for d in result.defaults if d.startswith("dropout:")]

    (said,) = notes(_Encoder(0.1))
    assert said.startswith("dropout: the model's 1 attention(s) with dropout")
    assert "length x length" in said and "memkit.estimate runs CUDA's attention kernels" in said
    assert notes(_Encoder(0.0)) == []

    torch.manual_seed(0)  # the fact the note rests on
    x = torch.randn(2, 64, 32)
    assert _saved_bytes(_Encoder(0.1), x) - _saved_bytes(_Encoder(0.0), x) >= 2 * 4 * 64 * 64 * 4


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors ``model``'s forward on ``x`` saves for backward."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(x)
    return sum(t.numel() * t.element_size() for t in saved)


class _Tagger(torch.nn.Module):
    """A word_language_model-like stacked LSTM (its own ``dropout=``, no Dropout layer)."""

    def __init__(self, dropout: float, layers: int = 3) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 32, num_layers=layers, dropout=dropout, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_an_rnns_own_dropout_between_its_layers_is_said_too():
    """Sweep YY: an LSTM's ``dropout=`` (between its stacked layers) keeps a float32 mask per
    gap on the CPU, as a Dropout layer does, and the dropout note did not count it."""

    def notes(model: torch.nn.Module) -> list[str]:
        result = probe(model, lambda n: torch.randn(n, 20, 16), device="cpu", budget="4MiB",
                       max_batch=16)  # fmt: skip
        return [d for d in result.defaults if d.startswith("dropout:")]

    (said,) = notes(_Tagger(0.3))
    assert "2 dropout(s) between an RNN's stacked layers" in said and "layer(s)" not in said
    assert "estimate" not in said  # (which does not run cuDNN's RNN kernels)
    with pytest.warns(UserWarning, match="num_layers greater than 1"):  # torch's own
        one_layer = _Tagger(0.3, layers=1)  # (nothing between layers to drop out)
    assert notes(_Tagger(0.0)) == [] and notes(one_layer) == []

    torch.manual_seed(0)  # the fact the note rests on
    x = torch.randn(4, 20, 16)
    gap_masks = _saved_bytes(_Tagger(0.3), x) - _saved_bytes(_Tagger(0.0), x)
    assert gap_masks == 2 * 4 * 20 * 32 * 4  # two float32 masks of the layers' outputs


def test_the_default_call_hints_only_for_the_default_steps_own_call():
    """The "takes N positional arguments" line says how the default step called the model; a
    model calling its own inner module wrongly got it too, though the step's call was fine.
    And the batch-1 line needs batch size 1 and a statistic in the message: a NaN at batch 4,
    or a C++ ``std::`` at batch 1, gets none."""
    from memkit.probing.hints import step_hint

    class Inner(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class CallsInnerWrongly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x, x)

    plan = StepPlan("train")
    with pytest.raises(TypeError, match=r"forward\(\) takes 2 positional") as inside:
        call_model(CallsInnerWrongly(), torch.randn(2, 4))
    assert step_hint(inside.value, 2, plan) == ""
    with pytest.raises(TypeError, match=r"forward\(\) takes 2 positional") as outside:
        call_model(Inner(), [torch.randn(2, 4), torch.randn(2, 4)])
    said = step_hint(outside.value, 2, plan)
    assert "The default step calls model(*batch) for a tuple or list batch" in said
    # (sweep WW: a speech model's (features, lengths, labels) batch unpacked into a two-input
    # forward was told to return a tuple (inputs, labels), which does not help it)
    assert "write a train_step(model, batch, optimizer) that calls the model as" in said
    nan = ValueError("found invalid values: tensor([[nan, nan]])")
    assert "probe from min_batch=2" in step_hint(nan, 1, plan)  # (the Python API's spelling)
    assert step_hint(nan, 4, plan) == ""
    assert step_hint(RuntimeError("c10::Error at std::string const&"), 1, plan) == ""


def test_a_list_of_dicts_passed_as_the_models_arguments_is_said():
    """make_batch returned per-image target dicts only (sweep BO): the default step passed
    each dict as a positional argument and the detection model raised its own ValueError;
    the hint says how it was called and what to return instead."""
    from memkit.probing.hints import step_hint

    class Detector(torch.nn.Module):
        def forward(self, images: Any, targets: Any = None) -> torch.Tensor:
            if targets is None:
                raise ValueError("In training mode, targets should be passed")
            return torch.zeros(())

    plan = StepPlan("train")
    batch = [{"boxes": torch.zeros(2, 4), "labels": torch.zeros(2)} for _ in range(3)]
    with pytest.raises(ValueError, match="targets should be passed") as raised:
        call_model(Detector(), batch[:1])
    said = step_hint(raised.value, 1, plan)
    assert "model(*batch) for a list or tuple batch: here make_batch's 1 dict," in said
    assert "return a tuple (images, targets) from make_batch" in said
    with pytest.raises(ValueError) as other:
        call_model(Detector(), torch.zeros(2, 3))
    assert step_hint(other.value, 2, plan) == ""

    class OneInput(torch.nn.Module):  # a tuple batch goes in as model(batch[0]) (review)
        def forward(self, inputs: Any) -> torch.Tensor:
            raise KeyError("x")

    with pytest.raises(KeyError) as one:
        call_model(OneInput(), ({"x": torch.zeros(1)}, {"y": torch.zeros(1)}))
    assert step_hint(one.value, 2, plan) == ""


def _copying_step(copies: list[torch.nn.Module]):
    """A train_step that keeps an EMA (``AveragedModel``, made at its first call) and a
    ``copy.deepcopy`` of the model ("the best so far") in ``copies``."""
    from torch.optim.swa_utils import AveragedModel

    def train_step(model, batch, optimizer):  # type: ignore[no-untyped-def]
        if not copies:
            copies.append(AveragedModel(model))
        copies[1:] = [copy.deepcopy(model)]
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        copies[0].update_parameters(model)
        with torch.no_grad():
            copies[0](batch)

    return train_step


def test_a_train_step_that_deep_copies_the_model_is_probed_and_its_copies_hold_no_hook():
    """An EMA (``AveragedModel``) or a "best model" made by ``copy.deepcopy(model)`` in the
    train_step: the copy took the probe's hooks, bound methods whose ``__self__`` reached the
    device counters' lock ("cannot pickle '_thread.RLock' object", exit 3). The copies now get
    inert hooks (never run again, in later trials or after the probe), and the answer is the
    one the same loop gives under the simulated device."""
    from memkit.probing.hooks import inert

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        )
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    copies: list[torch.nn.Module] = []
    budget = "1MiB"
    model, opt = build()
    result = probe(model, lambda n: torch.randn(n, 64), optimizer=opt, device="cpu",
                   budget=budget, train_step=_copying_step(copies))  # fmt: skip
    assert_exact(result)
    hooks = [
        hook
        for copied in copies
        for module in copied.modules()
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    ]
    assert hooks and all(hook is inert for hook in hooks)
    assert pickle.loads(pickle.dumps(copies[1]))  # torch.save(copy) pickles its hooks too

    def loop_fits(n: int) -> bool:
        model, opt = build()
        step = _copying_step([])
        try:
            with memkit.simulate(budget, track=(model, opt)):
                for _ in range(2):
                    step(model, torch.randn(n, 64), opt)
        except torch.OutOfMemoryError:
            return False
        return True

    best = result.max_batch_size
    assert best is not None and loop_fits(best) and not loop_fits(best + 1)


AUTOCAST_FILE = """
import torch
CTX = torch.autocast("cuda", dtype=torch.bfloat16)

def build_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))

def make_batch(n):
    return torch.randn(n, 64)

def train_step(model, batch, optimizer):
    {open}
        loss = model(batch).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""


@pytest.mark.parametrize(
    ("region", "said"),
    [
        ("with CTX:", "bfloat16"),  # made at the file's top, as nanoGPT's ctx
        ('with torch.autocast("cuda", dtype=torch.float16):', "float16"),  # made in the step
        ('with torch.autocast("cuda", enabled=False):', None),  # fp32 on a GPU too
        ('with torch.autocast("cpu", dtype=torch.bfloat16):', None),
    ],
)
def test_a_steps_cuda_autocast_on_the_simulated_device_is_said_to_cast_nothing(
    tmp_path, region, said
):
    """A step written for a GPU (``torch.autocast("cuda", ...)``) probed on the simulated
    device runs in float32 (a CPU build disables CUDA autocast; on CUDA tensors only it casts):
    the report says so and where the GPU's numbers come from, once per dtype."""
    path = tmp_path / "amp.py"
    path.write_text(AUTOCAST_FILE.format(open=region))
    result = probe_file(str(path), device="cpu", budget="16MiB", max_batch=8, steps=1)
    notes = [d for d in result.defaults if "torch.autocast('cuda'" in d]
    if said is None:
        assert notes == []
    else:
        assert len(notes) == 1 and f"torch.autocast('cuda', {said}) regions" in notes[0]
        assert "float32 numbers" in notes[0] and f"memkit estimate {path}" in notes[0]
    assert torch.autocast.__init__.__module__ == "torch.amp.autocast_mode"  # put back
    assert torch.autocast.__enter__.__module__ == "torch.amp.autocast_mode"


def test_an_accelerated_optimizer_is_probed_through_the_optimizer_it_wraps():
    """``accelerator.prepare_optimizer(AdamW(...))`` in a model file, as an Accelerate user
    writes it (sweep PP): accelerate's ``AcceleratedOptimizer`` subclasses ``Optimizer``
    without its hooks' state, and the probe stopped with an internal error (exit 3) where it
    hooked the wrapper's steps. It now hooks the AdamW inside, which the wrapper steps, and
    answers as with the AdamW itself; the step's cycle names the probe's optimizer."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def step(model, batch, optimizer):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    answers = []
    AcceleratorState._reset_state(reset_partial_state=True)  # whatever ran before left
    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        for wrap in (False, True):
            torch.manual_seed(0)
            model = small_mlp()
            opt = torch.optim.AdamW(model.parameters())
            if wrap:
                opt = accelerator.prepare_optimizer(opt)
            result = probe(model, lambda n: torch.randn(n, 256), optimizer=opt,
                           train_step=step, device="cpu", budget="24MiB")  # fmt: skip
            answers.append(result.max_batch_size)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert answers[0] is not None and answers[1] == answers[0]


class _PackedLSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, batch):
        x, lengths, _ = batch
        packed = torch.nn.utils.rnn.pack_padded_sequence(
            self.embed(x), lengths, batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


@pytest.mark.parametrize("lengths", ["drawn", "drawn-below", "fixed"])
def test_per_sample_lengths_drawn_inside_a_padded_shape_are_said(lengths):
    """Sweep CA: every batch padded to 40 (docs/probe.md's advice), the lengths that
    ``pack_padded_sequence`` takes drawn from the data: the shapes never vary, so no line said
    the answer depends on the draw (the real epoch ran out at the answer). Labels that vary
    (one integer a sample too) are no lengths. Sweep CJ: padded to a fixed length that the
    draws stay below (2 of 30 real draws ran out at the answer), no line either."""

    def make_batch(n: int):
        if lengths == "drawn":
            sizes = torch.randint(1, 41, (n,))
            sizes[0] = 40
        elif lengths == "drawn-below":
            sizes = torch.randint(16, 31, (n,))
        else:
            sizes = torch.full((n,), 40)
        return torch.randint(0, 50, (n, 40)), sizes, torch.randint(0, 4, (n,))

    def step(model, batch, optimizer):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch), batch[2]).backward()
        optimizer.step()

    torch.manual_seed(0)
    result = probe(_PackedLSTM(), make_batch, train_step=step, device="cpu", budget="8MiB",
                   max_batch=3)  # fmt: skip
    said = [d for d in result.defaults if "per-sample lengths at one size" in d]
    assert len(said) == (0 if lengths == "fixed" else 1)
    assert not any("different shapes" in d for d in result.defaults)


def test_class_labels_as_large_as_the_batch_are_no_lengths():
    """Review 3: MNIST-like labels 0-9 probed from batch 8: the labels of make_batch(9) reach
    9, the batch's own size, and were taken for lengths up to a padded 9."""

    def make_batch(n: int):
        labels = torch.randint(0, 10, (n,))
        labels[0] = 9
        return torch.randn(n, 64), labels

    def loss_fn(output, batch):
        return torch.nn.functional.cross_entropy(output, batch[1])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    result = probe(model, make_batch, loss_fn=loss_fn, train_step=None, device="cpu",
                   budget="8MiB", min_batch=8, max_batch=12)  # fmt: skip
    assert not any("per-sample lengths" in d for d in result.defaults)


def test_lengths_are_read_beside_frames_in_either_layout_and_labels_are_not():
    """Review CI: channel-first audio (n, 80, 951) lost the lengths note when a features'
    last axis stopped counting; an image's side or a tabular batch's columns are no padded
    length for class labels."""
    from memkit.probing.step import drawn_lengths

    def draws(make):
        torch.manual_seed(0)
        return make(), make()

    def lengths() -> torch.Tensor:
        return torch.randint(100, 900, (4,))

    frames = draws(lambda: (torch.randn(4, 80, 951), lengths()))
    assert drawn_lengths(*frames, 4) == 951
    assert drawn_lengths(*draws(lambda: (torch.randn(4, 951, 80), lengths())), 4) == 951
    image = draws(lambda: (torch.randn(4, 3, 64, 64), torch.randint(0, 50, (4,))))
    assert drawn_lengths(*image, 4) is None
    tabular = draws(lambda: (torch.randn(4, 512), torch.randint(0, 200, (4,))))
    assert drawn_lengths(*tabular, 4) is None
    text = draws(lambda: {"input_ids": torch.randint(0, 99, (4, 128)),
                          "labels": torch.randint(0, 50, (4,))})  # fmt: skip
    assert drawn_lengths(*text, 4) is None
    packed = draws(lambda: {"input_ids": torch.randint(0, 99, (4, 128)), "lengths": lengths()})
    assert drawn_lengths(*packed, 4) is None  # (drawn up to 900: beyond the 128 ids)
    packed = draws(lambda: {"input_ids": torch.randint(0, 99, (4, 128)),
                            "lengths": torch.randint(64, 128, (4,))})  # fmt: skip
    assert drawn_lengths(*packed, 4) == 128


def test_class_labels_below_a_tabular_batchs_width_are_no_lengths():
    """Sweep CL: 200 classes beside 512 feature columns (and 64 beside 64) were taken for
    lengths drawn inside a padded 512, and the answer was said to depend on the draws."""

    def make_batch(n: int):
        return torch.randn(n, 512), torch.randint(0, 200, (n,))

    def loss_fn(output, batch):
        return torch.nn.functional.cross_entropy(output, batch[1])

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 200))
    result = probe(model, make_batch, loss_fn=loss_fn, train_step=None, device="cpu",
                   budget="8MiB", min_batch=8, max_batch=12)  # fmt: skip
    assert not any("per-sample lengths" in d for d in result.defaults)


def test_batches_of_random_lengths_are_said_to_decide_the_memory():
    """A CTC model's batch holds its targets concatenated, of random lengths (sweep TT): the
    answer fit or ran out with the draw, and the report did not say so. Two batches of one
    size with different shapes now get a line."""

    def make_batch(n: int):
        lengths = torch.randint(5, 30, (n,))
        return torch.randn(n, 64), torch.randint(1, 10, (int(lengths.sum()),))

    def loss_fn(output, batch):
        return output.square().mean()

    torch.manual_seed(0)
    result = probe(small_mlp_64(), make_batch, loss_fn=loss_fn, train_step=None,
                   device="cpu", budget="8MiB", max_batch=4)  # fmt: skip
    (said,) = [d for d in result.defaults if "different shapes at one size" in d]
    assert said.startswith("make_batch(2) gave batches") and "bound the lengths" in said
    # the margin is not said to protect (sweep VV: a GNN's random graphs ran out in 4 of 40
    # steps at the recommended size)
    assert "keep the recommended margin" not in said and "(2 a trial, steps=)" in said
    # the largest input the trials drew at the answer is named, of the tensors whose shapes
    # vary: the targets, not the fixed (n, 64) features (sweep BI: 6 to 8 from one script, the
    # lengths behind them nowhere)
    answer = result.max_batch_size
    (drawn,) = [d for d in result.defaults if d.startswith("shapes drawn:")]
    length = int(drawn.split(f"the answer, {answer}, fit with inputs up to ")[1].split(" ")[0])
    assert 5 * answer <= length < 30 * answer
    fixed = probe(small_mlp_64(), lambda n: torch.randn(n, 64), device="cpu", budget="8MiB",
                  max_batch=4)  # fmt: skip
    assert not any("different shapes" in d for d in fixed.defaults)


def test_a_list_of_images_of_their_own_sizes_is_named_by_its_padded_batch():
    """Sweep BO: a detector's batch is a list of images of random sizes, padded together in
    its step; the report named the largest single image of the first two places. What sets
    the memory is the padded batch: each dimension's largest over the whole list."""
    sizes: list[list[tuple[int, int]]] = []

    def make_batch(n: int) -> list[torch.Tensor]:
        hw = [(int(h), int(w)) for h, w in torch.randint(8, 40, (n, 2))]
        sizes.append(hw)
        return [torch.randn(3, h, w) for h, w in hw]

    def train_step(model, images, optimizer):
        h, w = (max(i.shape[d] for i in images) for d in (1, 2))
        x = images[0].new_zeros(len(images), 3, h, w)
        for k, image in enumerate(images):
            x[k, :, : image.shape[1], : image.shape[2]] = image
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1))  # fmt: skip
    result = probe(model, make_batch, train_step=train_step, device="cpu", budget="24MiB")
    answer = result.max_batch_size
    assert answer is not None and answer > 2
    (drawn,) = [d for d in result.defaults if d.startswith("shapes drawn:")]
    tallest = max(max(h for h, _ in hw) for hw in sizes if len(hw) == answer)
    widest = max(max(w for _, w in hw) for hw in sizes if len(hw) == answer)
    assert f"fit with {answer} inputs whose dimensions reach 3x{tallest}x{widest} " in drawn
    assert f"({answer}x3x{tallest}x{widest} padded together)" in drawn


def _contrastive_step(model, batch, optimizer):
    """SimCLR's shape: each sample against every other of the batch (a B x B logits matrix,
    its log-softmax and their gradients in backward)."""
    z = torch.nn.functional.normalize(model(batch), dim=-1)
    logits = z @ z.t() / 0.1
    labels = torch.arange(batch.shape[0]).roll(1)
    torch.nn.functional.cross_entropy(logits, labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_loss_over_pairs_of_the_batch_is_said_to_grow_with_its_square_and_not_to_split():
    """Sweep BT: a contrastive loss with in-batch negatives (B x B logits) was told to split
    its batch and accumulate, "the effective batch matches the target", and its memory model
    was a line. Its curvature, counted independently at three sizes under memkit.simulate (a
    second divided difference of the peaks), is the per-pair term the probe now reports."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = probe(model, lambda n: torch.randn(n, 32), optimizer=opt,
                   train_step=_contrastive_step, device="cpu", budget="48MiB",
                   target_batch=8192)  # fmt: skip
    assert result.per_pair_bytes is not None
    peaks = {}
    for n in (256, 512, 1024):
        with memkit.simulate("1GiB", track=(model, opt)) as acct:
            _contrastive_step(model, torch.randn(n, 32), opt)
            peaks[n] = acct.peak
    counted = ((peaks[1024] - peaks[512]) / 512 - (peaks[512] - peaks[256]) / 256) / 768
    assert abs(result.per_pair_bytes - counted) <= 0.05 * counted
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    assert advice.severity == "warning" and "in-batch negatives" in advice.action
    micro = int(advice.title.split(" steps of ")[1].split()[0])
    assert micro <= result.recommended_batch_size
    assert f"compared with {micro - 1} others, not 8191" in advice.action
    assert "per pair of samples" in str(result)
    # a step whose memory is a line keeps the plain advice and the line
    plain = probe(small_mlp_64(), lambda n: torch.randn(n, 64), device="cpu", budget="8MiB",
                  target_batch=8192)  # fmt: skip
    (advice,) = [a for a in plain.advice if a.code == "accumulate"]
    assert plain.per_pair_bytes is None and "negatives" not in advice.action


def test_a_compiled_train_step_is_said_to_run_eagerly_on_the_simulated_device():
    """Sweep BR: a model file whose ``train_step`` is ``@torch.compile``'d (pytorch/examples'
    shape) got eager numbers with no word that they are: the note was for compiled models."""

    def step(model, batch, optimizer):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    compiled = torch.compile(step, backend="eager")
    result = probe(small_mlp_64(), lambda n: torch.randn(n, 64), train_step=compiled,
                   device="cpu", budget="8MiB", max_batch=64)  # fmt: skip
    assert any("compiled code (a compiled model or step) ran eagerly" in d for d in result.defaults)
    plain = probe(small_mlp_64(), lambda n: torch.randn(n, 64), train_step=step, device="cpu",
                  budget="8MiB", max_batch=64)  # fmt: skip
    assert not any("ran eagerly" in d for d in plain.defaults)
    assert plain.max_batch_size == result.max_batch_size


def _prefetching_loop(
    batch: int, k: int, steps: int, budget: str, net: Callable[[], torch.nn.Module] | None = None
) -> bool:
    """transformers 5's Trainer with ``gradient_accumulation_steps=k``: an optimizer step's k
    micro-batches are all on the device (get_batch_samples) before the first runs; the list is
    rebound once the next step's are fetched. Whether ``steps`` steps fit."""
    torch.manual_seed(0)
    model = (net or _image_net)()
    opt = torch.optim.AdamW(model.parameters())
    with memkit.simulate(budget, track=(model, opt)):
        try:
            batches: list[tuple[torch.Tensor, torch.Tensor]] = []
            for _ in range(steps):
                batches = [_images(batch) for _ in range(k)]
                for x, y in batches:
                    loss = torch.nn.functional.cross_entropy(model(x), y) / k
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            return False
    return True


def _image_net() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 10))  # fmt: skip


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))


def test_prefetch_answers_for_a_trainer_that_holds_all_its_micro_batches():
    """Sweep BV: transformers 5's Trainer with gradient_accumulation_steps=8 fetches the 8
    micro-batches of an optimizer step onto the device before running them; the accumulating
    probe held one at a time and answered 43 where 35 fit. ``prefetch=True`` holds them so,
    and its answer fits that loop and one more does not."""
    torch.manual_seed(0)
    k = 4
    result = probe(_image_net(), _images, device="cpu", budget="16MiB", accumulation=k,
                   prefetch=True, keep_output=False,
                   loss_fn=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]))  # fmt: skip
    best = result.max_batch_size
    assert best is not None
    assert _prefetching_loop(best, k, 3, "16MiB")
    assert not _prefetching_loop(best + 1, k, 3, "16MiB")
    assert any(d.startswith("prefetch: all 4 micro-batches") for d in result.defaults)
    with pytest.raises(ConfigError, match="--accumulate K"):
        probe(_image_net(), _images, device="cpu", budget="16MiB", prefetch=True,
              target_batch=64)  # fmt: skip
    with pytest.raises(ConfigError, match="--mode train only"):  # (review: it changed the
        probe(_image_net(), _images, device="cpu", budget="16MiB", prefetch=True,
              mode="infer")  # fmt: skip  # answer of an inference probe unsaid)


def test_prefetch_without_accumulation_holds_the_last_batch_while_the_next_is_made():
    """Sweep CB: a DQN's loop makes each minibatch on the device (``b = rb.sample(n)``)
    while the last one is still bound; the probe let the last go first and answered 2554
    where 1563 fit. ``prefetch=True`` without accumulation holds it so."""

    def net() -> torch.nn.Module:  # its batch is most of a sample's memory, as a DQN's
        return torch.nn.Sequential(torch.nn.Conv2d(3, 1, 1), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(1, 10))  # fmt: skip

    def answer(prefetch: bool) -> int:
        torch.manual_seed(0)

        def loss(out: torch.Tensor, b: Any) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out, b[1])

        result = probe(net(), _images, device="cpu", budget="16MiB", prefetch=prefetch,
                       keep_output=False, loss_fn=loss)  # fmt: skip
        said = any(d.startswith("prefetch: the next batch is made") for d in result.defaults)
        assert result.max_batch_size is not None and said == prefetch
        return result.max_batch_size

    best, without = answer(True), answer(False)
    assert _prefetching_loop(best, 1, 3, "16MiB", net)
    assert not _prefetching_loop(best + 1, 1, 3, "16MiB", net)
    assert not _prefetching_loop(without, 1, 3, "16MiB", net)  # (the old answer runs out)


def test_target_batch_for_a_train_step_that_accumulates_itself():
    """Sweep BV: a train_step that steps the optimizer every 4th call was told "6 steps of
    667", as if it stepped every call (24 micro-batches an update), and its answer was
    searched again with memkit's own accumulation on top."""
    calls = [0]

    def step(model, batch, optimizer):
        (model(batch).square().mean() / 4).backward()
        calls[0] += 1
        if calls[0] % 4 == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    model = small_mlp_64()
    result = probe(model, lambda n: torch.randn(n, 64), optimizer=torch.optim.SGD(
        model.parameters()), train_step=step, device="cpu", budget="8MiB",
        target_batch=20_000)  # fmt: skip
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    assert "Your train_step steps the optimizer every 4 calls" in advice.evidence
    calls_now = int(advice.title.split(" every ")[1].split()[0])
    micro = int(advice.title.split(" calls of ")[1].split()[0])
    assert micro <= result.recommended_batch_size and calls_now * micro >= 20_000
    assert not any(d.startswith("without accumulation") for d in result.defaults)


def small_mlp_64() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def test_an_oom_inside_lbfgs_first_step_leaves_no_half_written_state_for_the_next_step():
    nn = torch.nn
    """Sweep BD: a PINN's LBFGS ran out in a later closure of its first step, which had set
    ``n_iter`` but not yet ``prev_flat_grad``; the step memkit runs after an OOM (to free what
    the script's globals held) began from that state and LBFGS raised TypeError, which the
    probe reported as the user's step failing at a size that had fit. The optimizer is now
    put back first, as at a trial's start."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=3)
    held: dict[str, torch.Tensor] = {}

    def step(model: nn.Module, batch: Any, optimizer: Any) -> None:
        x, y = batch
        calls = [0]

        def closure() -> torch.Tensor:
            calls[0] += 1
            optimizer.zero_grad()
            held["out"] = out = model(x)  # a global the loop keeps (nanoGPT's logits)
            if calls[0] == 2 and x.shape[0] > 64:  # the line search's closure needs more
                torch.empty(x.shape[0] << 16)
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            return loss

        optimizer.step(closure)

    result = probe(model, lambda n: (torch.randn(n, 16), torch.randn(n, 1)), optimizer=opt,
                   train_step=step, device="cpu", budget="16MiB", max_batch=512)  # fmt: skip
    assert result.max_batch_size == 64
    assert not [t for t in result.trials if t.error and "TypeError" in t.error]


def test_the_steps_line_where_the_answer_kept_no_more_says_so_not_that_it_grew():
    """Sweep BI: batches of random shapes made the kept memory rise from one step to the next
    at some sizes, and the line said "grew: at batch 6, 0 B more after step 5 than after step
    1"."""
    from memkit.probing.result import ProbeTrial
    from memkit.probing.runner import _kept_growth

    trials = [
        ProbeTrial(4, True, 1000, 0.1, steps_run=5, kept_growth_bytes=512),
        ProbeTrial(6, True, 1500, 0.1, steps_run=5),
        ProbeTrial(7, False, 2000, 0.1),
    ]
    (line,), growing = _kept_growth(trials, 6, 2, "train", 2, shapes_vary=True)
    assert growing is None and "0 B more" not in line
    assert "rose from one step to the next" in line and "at batch 6, no more after step 5" in line
    assert "its batch's random shape" in line
    # sweep CG: a trial "still growing" at 0 B more than after step 1 (a DLRM's sparse
    # gradients, sized by each step's draws) varies, it does not grow
    varying = (*trials, ProbeTrial(5, True, 1200, 0.1, steps_run=16, still_growing=True))
    (line,), growing = _kept_growth(varying, 6, 2, "train", 2, shapes_vary=True)
    assert growing is None and "still growing" not in line and "0 B more" not in line
    (line,), _ = _kept_growth(trials, 6, 2, "train", 2)
    assert "random" not in line and "varies from step to step" in line
    # sweep CN: an EMA copy made at the first trial's last step (--steps 41), kept in the
    # model file's globals by the later trials: the answer's trial kept no more
    ema = (
        ProbeTrial(1, True, 100, 0.1, steps_run=41, kept_growth_bytes=6 << 20, still_growing=True),
        ProbeTrial(2251, True, 1000, 0.1, steps_run=41),
        ProbeTrial(2252, False, 2000, 0.1),
    )
    (line,), growing = _kept_growth(ema, 2251, 41, "train", 41)
    assert growing is None and "0 B more" not in line and "grew:" not in line, line
    assert "at batch 2251 the memory kept between steps did not grow" in line
    assert "but at batch 1 still growing at step 41 (6.00 MiB more" in line
