"""`memkit run` on training scripts written the way real projects write them (tests/realworld/
scripts/): each test checks the report's numbers against an independent count (a hand
computation from the script's shapes, or a plain accountant around the same step), not only
that the script ran. The points refer to the issue "memkit run and memkit.track: true numbers on
real training code".
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import warm
from torch import nn

import memkit
from memkit.tracking.report import TrackReport
from memkit.tracking.run import RunOutcome, run_script

SCRIPTS = Path(__file__).parent / "scripts"


def run(script: str | Path, *args: str, budget: str = "300MiB", per_module: bool = True
        ) -> RunOutcome:  # fmt: skip
    path = script if isinstance(script, Path) else SCRIPTS / script
    return run_script(path, list(args), device="cpu", budget=budget, per_module=per_module)


def codes(report: TrackReport) -> set[str]:
    return {a.code for a in report.advice}


def module(report: TrackReport, path: str):
    return next(m for m in report.devices[0].modules if m.path == path)


# -- 1. evaluation passes are not training -------------------------------------------------

NANOGPT = {"batch": 8, "block": 64, "embd": 64, "accum": 2, "iters": 6, "interval": 3, "eval": 4}


@pytest.fixture(scope="module")
def nanogpt() -> TrackReport:
    c = NANOGPT
    outcome = run(
        "nanogpt_train.py",
        "--max_iters", str(c["iters"]), "--eval_interval", str(c["interval"]),
        "--eval_iters", str(c["eval"]), "--batch_size", str(c["batch"]),
        "--block_size", str(c["block"]), "--n_embd", str(c["embd"]),
        "--gradient_accumulation_steps", str(c["accum"]), "--log_interval", "100",
    )  # fmt: skip
    assert outcome.exit_code == 0, outcome.traceback
    return outcome.report


def test_nanogpt_eval_loop_is_not_summed_into_training(nanogpt):
    c = NANOGPT
    steps = c["iters"] + 1  # nanoGPT runs iterations 0..max_iters
    evals = len(range(0, steps, c["interval"]))
    assert nanogpt.steps == steps and nanogpt.step_rule == "optimizer"
    # estimate_loss(): eval_iters batches for train and for val, under @torch.no_grad()
    assert nanogpt.eval_forwards == evals * c["eval"] * 2
    assert nanogpt.micro_batches == c["accum"]
    assert "gradient accumulation" in str(nanogpt) and "evaluation:" in str(nanogpt)
    # hand count: c_fc keeps its output (B, T, 4C) fp32 for GELU's backward, per micro-batch
    c_fc = module(nanogpt, "transformer.h.0.mlp.c_fc")
    one = c["batch"] * c["block"] * 4 * c["embd"] * 4
    assert c_fc.type_name == "Linear"
    assert c_fc.calls == steps * c["accum"] and c_fc.eval_calls == nanogpt.eval_forwards
    assert c_fc.self_activation_bytes == one
    # one micro-batch's: each backward frees its own (not the sum, not + every eval forward)
    assert c_fc.activation_bytes_per_step == one
    dev = nanogpt.devices[0]
    assert dev.breakdown is not None and dev.breakdown.phase != "eval"
    # an evaluation forward under no_grad holds the model and its optimizer state, never a
    # training step's graph: its peak lies between the two
    bd = dev.breakdown
    assert bd.parameters + bd.optimizer_state <= dev.phase_peaks["eval"] < dev.peak_allocated
    # no module's row exceeds the device's peak (the micro-batches' sum did: GPT 12.57 MiB
    # against a 10.36 MiB peak)
    assert all((m.activation_bytes_per_step or 0) <= dev.peak_allocated for m in dev.modules)


# -- 2. evidence captured while training runs ----------------------------------------------

LOOP = """
for _ in range(4):
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
HEADER = """import torch
from torch import nn
torch.manual_seed(0)
"""
BUILD = (
    "model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))\n"
    "opt = torch.optim.Adam(model.parameters())\n"
)


def _indent(text: str) -> str:
    return "".join("    " + line + "\n" for line in text.strip("\n").splitlines())


# A last training forward, then an evaluation forward left recording a graph (no no_grad)
# inside that step, as a distillation teacher runs after the student: the peak is in the
# step's forward when the script ends, and main()'s model is gone by the time it is
# categorised (the gradients of the last step are still alive)
EVAL_AT_THE_END = """
loss = nn.functional.cross_entropy(model(torch.randn(128, 256)), torch.randint(0, 10, (128,)))
model.eval()
outs = model(torch.randn(512, 256))
"""


@pytest.mark.parametrize("tail", ["", EVAL_AT_THE_END], ids=["training", "eval-at-the-end"])
@pytest.mark.parametrize("per_module", [True, False], ids=["per-module", "steps-only"])
def test_main_function_and_module_level_get_the_same_report(tmp_path, per_module, tail):
    flat = tmp_path / "flat.py"
    flat.write_text(HEADER + BUILD + LOOP + tail)
    wrapped = tmp_path / "wrapped.py"
    wrapped.write_text(
        HEADER + "def main():\n" + _indent(BUILD + LOOP + tail)
        + "\nif __name__ == '__main__':\n    main()\n"
    )  # fmt: skip
    reports = [run(p, per_module=per_module).report for p in (flat, wrapped)]
    params = (256 * 1024 + 1024 + 1024 * 10 + 10) * 4  # hand count, fp32
    for report in reports:
        bd = report.devices[0].breakdown
        assert bd is not None and report.param_dtype == "float32"
        assert report.optimizer_name == "Adam"
        assert bd.parameters == params and bd.gradients in (0, params)
        assert abs(bd.optimizer_state - 2 * params) <= 64  # exp_avg, exp_avg_sq (+ step)
        if tail:  # the gradients of the last step are alive at the end
            assert bd.phase == "forward" and bd.step == 4 and bd.gradients == params
    a, b = reports
    assert codes(a) == codes(b) and "zero-grad-keeps-grads" in codes(a)  # zero_grad after forward
    assert a.devices[0].breakdown == b.devices[0].breakdown
    assert a.devices[0].peak_allocated == b.devices[0].peak_allocated


# -- 3. host data is not device memory -----------------------------------------------------


def test_in_ram_dataset_is_not_counted_on_the_simulated_device():
    outcome = run("host_ram_dataset.py", "--dataset-mib", "96", "--steps", "6",
                  budget="64MiB")  # fmt: skip
    assert outcome.exit_code == 0, outcome.traceback  # the 96 MiB dataset stays on the host
    report = outcome.report
    # independent count: a plain accountant around the same model's steady-state step
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with memkit.simulate(None, track=(model, opt)) as acct:
        for _ in range(2):
            acct.reset_peak()
            x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    expected = acct.peak
    measured = report.devices[0].steps[-1].peak_allocated
    assert abs(measured - expected) <= 0.02 * expected, (measured, expected)
    assert report.devices[0].peak_allocated < 8 * 2**20


# -- 4 and 9. pytorch/examples: transform modules, eval OOMs -----------------------------------


def test_transform_modules_are_not_the_model_and_eval_is_apart():
    outcome = run("mnist_examples.py", "--epochs", "1", "--train-size", "512",
                  "--test-size", "512", "--test-batch-size", "256")  # fmt: skip
    assert outcome.exit_code == 0, outcome.traceback
    report = outcome.report
    from_script = {"Net", "conv1", "conv2", "dropout1", "dropout2", "fc1", "fc2"}
    assert {m.path for m in report.devices[0].modules} == from_script
    assert report.steps == 512 // 64 and report.eval_forwards == 512 // 256
    # the script zeroes gradients before its forward: the transform's "forward" in the data
    # loader is not the model's, so nothing says otherwise
    assert "zero-grad-keeps-grads" not in codes(report)
    assert all(m.calls == report.steps for m in report.devices[0].modules)


def test_out_of_memory_in_test_gets_evaluation_advice():
    outcome = run("mnist_examples.py", "--epochs", "1", "--train-size", "256",
                  "--test-size", "1000", "--test-batch-size", "1000", budget="48MiB")  # fmt: skip
    assert outcome.exit_code == 1 and outcome.oom
    pm = outcome.report.oom
    assert pm is not None and pm.phase == "eval" and pm.input_shape == (1000, 1, 28, 28)
    assert pm.training is False and pm.grad_enabled is False
    found = {a.code for a in pm.advice}
    assert "oom-eval" in found and "oom-activations" not in found
    text = str(pm)
    assert "accumulat" not in text.replace("Gradient accumulation does not apply", "")
    assert "(1000, 1, 28, 28)" in text and "an evaluation pass" in text
    assert "evaluation batch size" in text


# -- 5. gradient checkpointing ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_runs() -> dict[bool, TrackReport]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = {}
    for checkpointing in (False, True):
        args = ["--max-steps", "4", "--grad-accum", "2", "--eval-steps", "4"]
        outcome = run("hf_trainer_bert.py", *args,
                      *(["--gradient-checkpointing"] if checkpointing else []))  # fmt: skip
        assert outcome.exit_code == 0, outcome.traceback
        out[checkpointing] = outcome.report
    return out


def test_checkpointed_recompute_is_backward_with_the_same_module_paths(hf_runs):
    plain, checkpointed = hf_runs[False], hf_runs[True]
    assert {m.path for m in plain.devices[0].modules} == {
        m.path for m in checkpointed.devices[0].modules
    }
    invented = [m.path for m in checkpointed.devices[0].modules if m.path.startswith("Bert")]
    assert invented == ["BertForSequenceClassification"]  # the model's own row, nothing more
    # transformers recomputes each layer's forward (the layer's children run again in backward)
    attention = module(checkpointed, "bert.encoder.layer.0.attention")
    assert attention.recompute_calls == attention.calls > 0
    assert module(plain, "bert.encoder.layer.0.attention").recompute_calls == 0
    for report in (plain, checkpointed):
        assert report.steps == 4 and report.micro_batches == 2
        for _, points in itertools.groupby(report.devices[0].timeline, key=lambda p: p.step):
            phases = [k for k, _ in itertools.groupby(p.phase for p in points)]
            # one forward then one backward per micro-batch: recomputation is no forward
            assert phases.count("forward") <= 2 and phases.count("backward") <= 2
    peaks = [r.devices[0].phase_peaks["forward"] for r in (plain, checkpointed)]
    assert peaks[1] < peaks[0]  # checkpointing keeps less in forward


# -- 6. torch.compile ---------------------------------------------------------------------------


def test_compiled_model_is_named_plainly_and_says_it_ran_eagerly():
    proc = subprocess.run(
        warm([sys.executable, "-m", "memkit", "run", "--device", "cpu", "--budget", "128MiB",
              str(SCRIPTS / "compiled_model.py"), "--backend", "aot_eager", "--steps", "4"]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "global hooks" not in proc.stderr  # memkit adds no noise of its own
    assert "torch.compile" in proc.stderr and "ran eagerly" in proc.stderr
    assert "_orig_mod" not in proc.stderr and "OptimizedModule" not in proc.stderr


# -- 7 and 8. manual SGD without an optimizer; a reloaded model -----------------------------------


def test_manual_sgd_counts_steps_from_backward_and_reload_keeps_names():
    args = ["--epochs", "1", "--train-tokens", "7000", "--batch_size", "20", "--bptt", "35"]
    outcome = run("word_language_model.py", *args)
    assert outcome.exit_code == 0, outcome.traceback
    report = outcome.report
    batches = len(range(0, 7000 // 20 - 1, 35))  # batchify, then bptt-long chunks
    assert report.step_rule == "backward" and report.steps == batches
    assert "counted from backward passes" in str(report)
    rnn = module(report, "rnn")
    assert rnn.calls == batches and rnn.activation_bytes_per_step == rnn.activation_bytes
    paths = {m.path for m in report.devices[0].modules}
    assert paths == {"RNNModel", "encoder", "rnn", "decoder", "drop"}
    # the model reloaded by torch.load evaluates the test set under the same names
    assert rnn.eval_calls > 0


# -- 10. leaks --------------------------------------------------------------------------------


def test_periodic_eval_leak_is_named_at_the_line_that_grows_it():
    report = run("periodic_eval_leak.py", "--steps", "60", "--eval-every", "10").report
    (leak,) = report.leaks
    top = leak.suspects[0]
    assert top.name == "val_losses" and top.growing
    assert top.code == "val_losses.append(val_loss)  # the whole validation graph stays alive"
    assert "graph-retained" in codes(report)
    healthy = run("periodic_eval_leak.py", "--steps", "60", "--eval-every", "10", "--healthy")
    assert healthy.report.leaks == [] and "graph-retained" not in codes(healthy.report)


def test_running_loss_graph_is_caught_while_device_memory_stays_flat():
    args = ["--epochs", "1", "--samples", "160", "--batch-size", "4", "--print-every", "1000"]
    report = run("running_loss_graph.py", *args).report
    (leak,) = report.leaks
    assert leak.growth_per_step == 0 and leak.graph_growth > 0
    assert leak.suspects[0].name == "running_loss"
    assert leak.suspects[0].code.startswith("running_loss += loss") and ".item()" not in (
        leak.suspects[0].code
    )
    assert "graph-retained" in codes(report) and "nodes per step" in str(report)
    healthy = run("running_loss_graph.py", *args, "--healthy").report
    assert healthy.leaks == [] and "graph-retained" not in codes(healthy)


# -- the example a new user tries first --------------------------------------------------------


def test_example_training_script_reports_training_and_evaluation_apart():
    example = Path(__file__).parents[2] / "examples" / "train.py"
    outcome = run(example, budget="256MiB")  # 1024 training samples, 256 for evaluation
    assert outcome.exit_code == 0, outcome.traceback
    report = outcome.report
    assert report.steps == 1024 // 64 and report.eval_forwards == 1  # one batch of 256
    dev = report.devices[0]
    # hand count: the first conv keeps its output (64, 32, 32, 32) fp32 for BatchNorm's backward
    assert module(report, "0").self_activation_bytes == 64 * 32 * 32 * 32 * 4
    assert dev.phase_peaks["eval"] > dev.phase_peaks["backward"]  # eval batch 256 vs 64
    assert "eval-peak" in codes(report)
