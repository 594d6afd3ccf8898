"""memkit.integrations.transformers with a real ``Trainer.train()`` on a tiny BERT, on CPU and
the simulated device: the callback's numbers against ``memkit.track`` around the same training
and hand counts, the peaks it adds to the Trainer's logs against its report, and the OOM
post-mortem when the callback is the context around ``train()``."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import pytest
import torch

import memkit
from memkit.errors import ConfigError, MissingDependencyError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from memkit.integrations.transformers import MemkitCallback  # noqa: E402

MIB = float(1 << 20)
STEPS, ACCUM, EVAL_STEPS, BATCH, SEQ, VOCAB = 4, 2, 2, 8, 16, 128


class Pairs(torch.utils.data.Dataset):
    """Random token sequences with a label (what is learnt does not matter here)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Recorder(transformers.TrainerCallback):
    """Runs after memkit's callback: what the next callbacks (loggers, printers) receive."""

    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.evaluations: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append(dict(metrics))


def make_trainer(folder, callbacks=(), **settings) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=BATCH, per_device_eval_batch_size=16,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, eval_strategy="steps",
        eval_steps=EVAL_STEPS, logging_steps=EVAL_STEPS, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, learning_rate=5e-4, **settings,
    )  # fmt: skip
    return transformers.Trainer(
        model=transformers.BertForSequenceClassification(config), args=args,
        train_dataset=Pairs(BATCH * ACCUM * STEPS, 0), eval_dataset=Pairs(16, 1),
        callbacks=list(callbacks),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    cb, recorder = MemkitCallback(device="cpu", budget="256MiB", json=folder / "r.json"), Recorder()
    trainer = make_trainer(folder, [cb, recorder])
    with cb:
        trainer.train()
    plain = make_trainer(folder)
    with memkit.track(plain.model, device="cpu", budget="256MiB") as tracker:
        plain.train()
    return cb, recorder, trainer, tracker.report()


def test_callback_gives_the_numbers_of_track_around_the_same_training(trained):
    cb, _, trainer, tracked = trained
    report = cb.report
    assert report is not None and cb.tracker is None
    dev, ref = report.devices[0], tracked.devices[0]
    assert report.steps == tracked.steps == STEPS
    assert report.micro_batches == tracked.micro_batches == ACCUM
    assert report.eval_forwards == tracked.eval_forwards == STEPS // EVAL_STEPS
    assert dev.phase_peaks == ref.phase_peaks
    assert dev.breakdown == ref.breakdown
    assert dev.modules == ref.modules

    def strip(s):
        return dataclasses.replace(s, duration_s=0.0)

    assert [strip(s) for s in dev.steps] == [strip(s) for s in ref.steps]
    assert not any("micro-batch" in n for n in report.notes)  # the Trainer's count agreed
    # the Trainer's settings, told to the tracker (memkit.track is not told)
    assert dev.setup is not None and ref.setup is not None
    assert (dev.setup.accumulation_steps, dev.setup.checkpointing) == (ACCUM, False)
    assert (ref.setup.accumulation_steps, ref.setup.checkpointing) == (None, None)
    # hand counts: every parameter trains; AdamW keeps two moments and a 0-dim step each
    params = list(trainer.model.parameters())
    grads = sum(p.numel() * p.element_size() for p in params)
    bd = dev.breakdown
    assert bd is not None and bd.gradients == grads
    assert bd.optimizer_state == 2 * grads + 4 * len(params)
    assert [p.name for p in cb.written] == ["r.json"]


def test_peaks_are_added_to_the_trainers_logs(trained):
    cb, recorder, trainer, _ = trained
    steps = cb.report.devices[0].steps
    train_logs = [log for log in recorder.logs if "loss" in log]
    eval_logs = [log for log in recorder.logs if "eval_loss" in log]
    assert len(train_logs) == len(eval_logs) == STEPS // EVAL_STEPS
    for i, log in enumerate(train_logs):  # each log: the peaks of the steps since the last
        window = steps[i * EVAL_STEPS : (i + 1) * EVAL_STEPS]
        assert log["memkit/peak_mib"] == max(s.peak_allocated for s in window) / MIB
        for phase in ("forward", "backward", "optimizer"):
            peak = max(s.phase_peaks[phase] for s in window)
            assert log[f"memkit/{phase}_peak_mib"] == peak / MIB
    # an evaluation runs after its step's boundary: the first one is in step 2's record; the
    # last one after the last step, in no record (the same data and shapes: the same peak)
    first = steps[EVAL_STEPS].phase_peaks["eval"]
    assert first is not None and first == cb.report.devices[0].phase_peaks["eval"]
    for log, metrics in zip(eval_logs, recorder.evaluations, strict=True):
        assert log["memkit/eval_peak_mib"] == metrics["memkit/eval_peak_mib"] == first / MIB
    history = [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    assert all(("memkit/peak_mib" in h) or ("memkit/eval_peak_mib" in h) for h in history)


def test_the_same_callback_passed_twice_gives_the_same_report(trained, tmp_path):
    """callbacks=[cb, cb]: the Trainer calls each event twice in a row. The second
    on_train_begin restarted tracking and the doubled on_substep_end made a false note ("the
    Trainer ran 3 micro-batch(es) but memkit saw 2"); now the report is the one of a single
    registration."""
    once = trained[0].report
    cb = MemkitCallback(device="cpu", budget="256MiB")
    trainer = make_trainer(tmp_path, [cb, cb])
    with cb:
        trainer.train()
    report = cb.report
    assert report is not None and not any("micro-batch" in n for n in report.notes)
    assert (report.steps, report.micro_batches) == (once.steps, once.micro_batches)
    dev, ref = report.devices[0], once.devices[0]
    assert dev.phase_peaks == ref.phase_peaks
    assert [s.peak_allocated for s in dev.steps] == [s.peak_allocated for s in ref.steps]
    logged = [h["memkit/peak_mib"] for h in trainer.state.log_history if "memkit/peak_mib" in h]
    assert len(logged) == STEPS // EVAL_STEPS


def test_out_of_memory_in_train_gets_a_post_mortem(tmp_path):
    budget = 600_000
    cb = MemkitCallback(device="cpu", budget=budget, postmortem=None)
    trainer = make_trainer(tmp_path, [cb])
    with pytest.raises(torch.OutOfMemoryError), cb:
        trainer.train()
    assert torch._C._len_torch_dispatch_stack() == 0 and cb.tracker is None
    plain = make_trainer(tmp_path)
    with (
        pytest.raises(torch.OutOfMemoryError),
        memkit.track(plain.model, device="cpu", budget=budget, postmortem=None) as tracker,
    ):
        plain.train()
    oom, ref = cb.report.oom, tracker.report().oom
    assert oom is not None and ref is not None
    assert (oom.where, oom.allocated) == (ref.where, ref.allocated)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences for a causal language model (labels: the inputs)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 1000, (n, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_an_oom_in_the_first_micro_batch_knows_the_trainers_accumulation_and_checkpointing(
    tmp_path, capsys
):
    """gradient_accumulation_steps=4 and gradient checkpointing on; the OOM comes in the
    first micro-batch's backward, in the LM head, before any optimizer step or recompute has
    shown either: the advice builds on both (accumulate over a multiple of 4; no 'checkpoint
    the blocks')."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64
    )
    fields = transformers.TrainingArguments.__dataclass_fields__
    # transformers 5 renamed gradient_checkpointing (a deprecated alias there)
    name = next(n for n in ("activation_checkpointing", "gradient_checkpointing") if n in fields)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=4,
        max_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        **{name: True},
    )  # fmt: skip
    cb = MemkitCallback(device="cpu", budget="3500KiB")
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(64),
        callbacks=[cb],
    )  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError), cb:
        trainer.train()
    pm = cb.report.oom
    assert pm is not None and pm.where.startswith("step 0, backward")
    assert pm.checkpointed == ()  # no recompute had run yet
    setup = pm.setup
    assert setup is not None and (setup.accumulation_steps, setup.checkpointing) == (4, True)
    assert pm.micro_batches == 4
    advice = {a.code: a for a in pm.advice}["oom-activations"]
    assert "accumulates gradients over 4 micro-batches" in advice.action
    # a multiple of the trainer's 4: the cut beside the gradients and AdamW's state to come
    # (quarter here; the cut is a lower bound: run here, 2 x 16 still peaks at 3.58 MiB)
    assert "accumulate over 16" in advice.action
    assert "torch.utils.checkpoint" not in advice.action
    assert "checkpointing is already on" in advice.evidence
    # in the Trainer's terms, and printed so once (by the callback, not also by the tracker)
    assert advice.action.endswith(
        "In TrainingArguments: `per_device_train_batch_size` and `gradient_accumulation_steps`, "
        "`bf16=True`."
    )
    err = capsys.readouterr().err
    assert err.count("memkit: out of memory") == 1 and "gradient_accumulation_steps`" in err


def test_advice_names_the_trainers_own_settings():
    """In the Trainer, the remedies are TrainingArguments: per_device_eval_batch_size, not
    plain PyTorch's `--test-batch-size`; bf16=True, not `torch.autocast`; and what it already
    does (evaluation under no_grad) is not asked for. Other advice is untouched."""
    from memkit.advice import Advice
    from memkit.advice.transformers import checkpointing_flag, in_transformers_terms

    given = (
        Advice("oom-eval", "t", "e", "Lower the evaluation batch size (`--test-batch-size`)"),
        Advice("eval-peak", "t", "e", "... run it under `torch.inference_mode()`."),
        Advice("mixed-precision", "t", "e",
               "`with torch.autocast('cuda', dtype=torch.float16):` around the forward"),
        Advice("activation-checkpointing", "t", "e", "`torch.utils.checkpoint.checkpoint`"),
        Advice("oom-activations", "t", "e", "Halve the micro-batch and accumulate gradients "
               "over 2 steps; or checkpoint the largest blocks (`torch.utils.checkpoint`)."),
        Advice("optimizer-state", "t", "e", "a"),
    )  # fmt: skip
    said = {a.code: a for a in in_transformers_terms(given)}
    assert "per_device_eval_batch_size" in said["oom-eval"].action
    assert "--test-batch-size" not in said["oom-eval"].action
    assert "per_device_eval_batch_size" in said["eval-peak"].action
    assert said["mixed-precision"].action.startswith("`fp16=True` in TrainingArguments")
    # the installed transformers' switch (5.24 warns that gradient_checkpointing is an alias)
    flag = checkpointing_flag()
    fields = transformers.TrainingArguments.__dataclass_fields__
    assert flag in fields and (flag == "activation_checkpointing") == (
        "activation_checkpointing" in fields
    )
    assert f"`{flag}=True` in TrainingArguments" in said["activation-checkpointing"].action
    assert said["oom-activations"].action == given[4].action + (
        " In TrainingArguments: `per_device_train_batch_size` and "
        f"`gradient_accumulation_steps`, `{flag}=True`."
    )
    assert said["optimizer-state"] == given[5]
    assert all(said[a.code].evidence == a.evidence for a in given)


def test_without_with_a_warning_says_how_to_end_tracking_after_an_exception(tmp_path):
    """The Trainer tells callbacks nothing when train() raises: outside `with callback:` the
    simulated device would stay on for the rest of the process. The callback says so when
    training starts, and close() ends it; in the except block, with the OOM's post-mortem."""
    cb = MemkitCallback(device="cpu", budget=600_000, postmortem=None)
    trainer = make_trainer(tmp_path, [cb])
    caught = None
    with pytest.warns(RuntimeWarning, match=r"with callback: trainer.train\(\)"):
        try:
            trainer.train()
        except torch.OutOfMemoryError as exc:
            caught = exc
            assert torch._C._len_torch_dispatch_stack() == 1  # still counting: as warned
            cb.close()
    assert caught is not None
    assert torch._C._len_torch_dispatch_stack() == 0 and cb.tracker is None
    # close() still gives the report, of the callback's own 600,000 B device, with the OOM
    assert cb.report is not None and cb.report.devices[0].capacity == 600_000
    assert cb.report.oom is not None and cb.report.oom.exception.startswith("OutOfMemoryError")


def test_bad_input_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        MemkitCallback(html=tmp_path / "missing" / "r.html")
    monkeypatch.delitem(sys.modules, "memkit.integrations.transformers")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install memkit\[transformers\]"):
        import memkit.integrations.transformers  # noqa: F401


def test_a_model_that_checkpoints_is_known_to_before_any_recompute_without_a_warning():
    """Sweep BH: a step-0 OOM in a GPT-2 after ``gradient_checkpointing_enable()`` was told to
    checkpoint. The model's flag says so; transformers 5 warns on its old name
    (``is_gradient_checkpointing``), which must not reach the script (review: with warnings
    as errors, tracking a model that does not checkpoint stopped)."""
    import warnings

    def setup(checkpointing: bool) -> Any:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16
        )
        model = transformers.GPT2LMHeadModel(config)
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # (renamed in transformers 5)
                model.gradient_checkpointing_enable()
        model.train()
        ids = torch.randint(0, 100, (2, 16))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            with memkit.track(model, device="cpu", budget="64MiB") as tracker:
                for _ in range(2):
                    model(input_ids=ids, labels=ids).loss.backward()
        report = tracker.report()
        assert not any("stopped tracking" in n for n in report.notes), report.notes
        return report.devices[0].setup

    assert setup(True).checkpointing is True
    assert setup(False).checkpointing is None
    # turned on after the first steps (review: the flag was read once per model)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, 100, (2, 16))
    with memkit.track(model, device="cpu", budget="64MiB") as tracker:
        for i in range(4):
            if i == 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    model.gradient_checkpointing_enable(
                        gradient_checkpointing_kwargs={"use_reentrant": True}
                    )
            model(input_ids=ids, labels=ids).loss.backward()
    late = tracker.report().devices[0].setup
    assert late is not None and late.checkpointing is True
