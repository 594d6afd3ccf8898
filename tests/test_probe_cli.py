"""`memkit probe FILE`: output, JSON, exit codes and the errors bad model files get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import memkit
from memkit.cli import cli

FILES = Path(__file__).parent / "modelfiles"


def run(*args: str):
    return CliRunner().invoke(cli, ["probe", *args])


def test_json_output_has_the_documented_fields():
    result = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "12MiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("max_batch_size", "recommended_batch_size", "device", "capacity_bytes", "mode",
                "trials", "advice"):  # fmt: skip
        assert key in data
    assert data["device"] == "cpu" and data["mode"] == "train"
    assert data["capacity_bytes"] == 12 * 1024**2
    best = data["max_batch_size"]
    by_size = {t["batch_size"]: t for t in data["trials"]}
    assert by_size[best]["fits"] and not by_size[best + 1]["fits"]
    for trial in data["trials"]:
        assert set(trial) >= {"batch_size", "fits", "peak_bytes", "seconds"}


@pytest.mark.parametrize("json_flag", [False, True])
def test_progress_line_on_a_terminal_only_and_never_under_json(monkeypatch, json_flag):
    flag = ["--json"] if json_flag else []
    args = [str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "12MiB", *flag]
    quiet = run(*args)  # CliRunner's stderr is not a terminal: as in a log or CI
    assert quiet.exit_code == 0 and "trials" not in quiet.stderr
    monkeypatch.setattr("memkit.cli.probe._stderr_is_terminal", lambda: True)
    shown = run(*args)
    assert shown.exit_code == 0, shown.output
    if json_flag:
        assert "trials" not in shown.stderr
        json.loads(shown.stdout)
        return
    trials = shown.stdout.split("\n\n")[1]  # the report's trial table
    count = sum(1 for line in trials.splitlines() if line.strip()[:1].isdigit())
    last = shown.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith(f"memkit probe (train): trials done {count}, batch ")
    assert "OOM" in last or "fits" in last


def test_a_long_trial_shows_it_is_alive(monkeypatch):
    import io
    import time

    from memkit import progress

    monkeypatch.setattr(progress, "REFRESH_SECONDS", 0.02)
    out = io.StringIO()
    bar = progress.TrialProgress("memkit probe (train, seq 512)", file=out)
    bar.finished(4, True, 3 << 20)
    bar.started(256)
    time.sleep(0.3)
    drawn = out.getvalue()
    bar.close()
    assert "memkit probe (train, seq 512): trials done 1, batch 4 fits (3.00 MiB)" in drawn
    assert drawn.count("running batch 256 (0 s)") >= 3  # redrawn by the ticker meanwhile


def test_human_output_table_and_defaults():
    result = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "12MiB",
                 "--target-batch", "1000")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Largest batch that fits (train)" in result.stdout
    assert "optimizer: AdamW (default)" in result.stdout
    assert "[accumulate]" in result.stdout


def test_does_not_fit_exits_1_with_the_numbers():
    result = run(str(FILES / "huge.py"), "--device", "cpu", "--budget", "20MiB")
    assert result.exit_code == 1
    assert "Does not fit" in result.stdout
    assert "[does-not-fit]" in result.stdout


def test_step_bug_exits_3_with_its_traceback():
    result = run(str(FILES / "step_bug.py"), "--device", "cpu", "--budget", "64MiB")
    assert result.exit_code == 3
    assert "RuntimeError" in result.stderr
    assert "not an out-of-memory error" in result.stderr
    assert "step_bug.py" in result.stderr  # the traceback points into the user's file


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("does_not_exist.py", ["not found", "def build_model()", "def make_batch"]),
        ("syntax_error.py", ["syntax error in", "syntax_error.py:4"]),
        (
            "missing_make_batch.py",
            [
                "does not define make_batch",
                "make_batches",
                "def make_batch",
                "functions: build_model, make_batches; classes: Agent",
            ],
        ),
        ("build_raises.py", ["build_model() in", "IndexError", "build_raises.py", "line 6"]),
        ("bad_batch.py", ["make_batch(1)", "returned str", "expected a Tensor"]),
        ("meta_batch.py", ["make_batch(1)", "on the meta device", "no data"]),
        ("meta_model.py", ["build_model() in", "on the meta device", "memkit estimate"]),
        ("small_dataset.py", ["raised ValueError: the dataset has only 100", "--max-batch"]),
        ("ignores_batch_size.py", ["first dimensions [8]", "ignore its batch_size"]),
        ("padded_to_longest.py", ["shapes [1, 8] and [2, 11]", "pad to a fixed length"]),
        ("padded_with_labels.py", ["shapes [1, 8] and [2, 11]", "pad to a fixed length"]),
        ("one_row_extra.py", ["first dimension went from 2 to 3", "n samples", "memkit.probe("]),
    ],
)
def test_bad_model_files_exit_2_with_a_clear_error(name, expected):
    result = run(str(FILES / name), "--device", "cpu", "--budget", "64MiB")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memkit: error: ")
    assert "Traceback (most recent call last)" not in result.stderr.splitlines()[0]
    for fragment in expected:
        assert fragment in result.stderr, (fragment, result.stderr)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--budget", "lots"], "lots"),
        (["--margin", "150"], "percentage"),
        (["--margin", "0.05"], "margin=0.05 is 5%): write 5 or 5%"),
        (["--seq-len", "a,b"], "--seq-len"),
        (["--min-batch", "8", "--max-batch", "4"], "--max-batch"),
        (["--device", "gpu0"], "expected a device"),
        (["--budget", "0"], "--budget '0': expected a positive size"),
        (["--device", "cpu", "--budget", "1GiB,2GiB"], "single process"),
    ],
)
def test_bad_options_exit_2(args, fragment):
    result = run(str(FILES / "ok_mlp.py"), *args)
    assert result.exit_code == 2
    assert fragment in result.output


def test_a_margin_below_one_percent_needs_its_percent_sign():
    result = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "8MiB",
                 "--max-batch", "4", "--margin", "0.5%", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert '"margin": 0.005' in result.stdout


def test_seq_len_needs_make_batch_with_seq_len():
    result = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "12MiB",
                 "--seq-len", "128")  # fmt: skip
    assert result.exit_code == 2
    assert "takes no seq_len" in result.stderr


def test_batchnorm_at_min_batch_1_says_to_start_at_2():
    model = str(FILES / "batchnorm_mlp.py")
    result = run(model, "--device", "cpu", "--budget", "16MiB")
    assert result.exit_code == 3, result.output
    assert "Expected more than 1 value per channel" in result.stderr
    assert "probe from --min-batch 2" in result.stderr
    result = run(model, "--device", "cpu", "--budget", "16MiB", "--min-batch", "2")
    assert result.exit_code == 0, result.output


def test_words_match_the_numbers_in_the_trial_table_and_headline():
    # batch 1 already takes ~96 MiB of a 100 MiB device: sizes fit, none leaves 5% free
    result = run("examples/mlp.py", "--device", "cpu", "--budget", "100MiB", "--max-batch", "64")
    assert result.exit_code == 0, result.output
    headline = result.stdout.splitlines()[0]
    assert "no size leaves 5% free" in headline and "recommended None" not in headline
    assert "(batch 1 leaves 3." in headline  # what the recommended size really leaves
    # an OOM trial's row is a lower bound ("needs >= X"), never a peak above the capacity
    result = run("examples/mlp.py", "--device", "cpu", "--budget", "128MiB")
    oom_rows = [line for line in result.stdout.splitlines() if " OOM " in line]
    assert oom_rows and all("needs >= " in line for line in oom_rows)


def test_seq_first_batches_are_probed_with_their_inferred_batch_dimension():
    result = run(str(FILES / "seq_first_lstm.py"), "--device", "cpu", "--budget", "24MiB",
                 "--max-batch", "64", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # 64 sequences of 35 tokens: logits of 35 x 64 x 500 float32 (4.3 MiB) and the LSTM's
    # states fit in 24 MiB, so --max-batch caps the answer
    assert data["max_batch_size"] == 64 and data["hit_max_batch"]
    assert any("batch dimension: 1 (inferred from make_batch(1) and make_batch(2))" in line
               for line in data["defaults"])  # fmt: skip


def test_a_batch_of_two_views_per_sample_is_probed_in_samples(tmp_path: Path):
    """SimCLR-like: make_batch(n) returns 2n rows (two augmented views of each sample). The
    answer counts samples, the report says so, and the loop trains 2N rows, not 2(N+1)."""
    path = tmp_path / "two_views.py"
    path.write_text(
        "import torch\n\n\n"
        "def build_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(512, 256))\n\n\n"
        "def make_batch(batch_size):\n"
        "    return torch.randn(2 * batch_size, 256)  # two views of each sample\n"
    )
    result = run(str(path), "--device", "cpu", "--budget", "12MiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    best = data["max_batch_size"]
    assert any("make_batch(n) returns 2 rows per sample" in line for line in data["defaults"])

    def loop_fits(samples: int) -> bool:  # the default step, as its report line says
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
        )
        opt = torch.optim.AdamW(model.parameters())
        try:
            with memkit.simulate("12MiB", track=[model]):
                for _ in range(2):
                    out = model(torch.randn(2 * samples, 256))
                    loss = out.sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            return False
        return True

    assert loop_fits(best) and not loop_fits(best + 1)


def test_a_detection_batch_of_per_image_target_dicts_is_probed(tmp_path: Path):
    """torchvision-style detection: stacked images and a list of per-image dicts whose boxes
    differ in number. The CLI refused it ("first dimensions [1, 3]; expected 1 ... Does
    make_batch ignore its batch_size argument?"): the list has one item per sample, and the
    Python API probed it all along (sweep EE: 131 fits, 132 runs out)."""
    path = tmp_path / "detect.py"
    path.write_text(
        "import torch\n\n\n"
        "class Det(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 8))\n\n"
        "    def forward(self, images, targets):\n"
        "        out = self.net(images)\n"
        "        return sum((out[i, : len(t['labels'])] - t['labels']).pow(2).sum()\n"
        "                   for i, t in enumerate(targets))\n\n\n"
        "def build_model():\n"
        "    return Det()\n\n\n"
        "def make_batch(n):\n"
        "    targets = [{'labels': torch.ones(1 + i % 3)} for i in range(n)]\n"
        "    return torch.randn(n, 3, 4, 4), targets\n"
    )
    result = run(str(path), "--device", "cpu", "--budget", "4MiB", "--max-batch", "64", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["max_batch_size"] == 64
    # a list of n ids beside tensors that ignore n is no batch of n samples
    ignores = tmp_path / "ignores.py"
    ignores.write_text(
        "import torch\n\n\n"
        "def build_model():\n"
        "    return torch.nn.Linear(10, 2)\n\n\n"
        "def make_batch(n):\n"
        "    return {'input': torch.randn(32, 10), 'ids': list(range(n))}\n"
    )
    refused = run(str(ignores), "--device", "cpu", "--budget", "4MiB")
    assert refused.exit_code == 2 and "ignore its batch_size" in refused.stderr


def test_train_and_infer_in_one_run():
    args = [str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "12MiB"]
    both = run(*args, "--mode", "train,infer", "--json")
    assert both.exit_code == 0, both.output
    data = json.loads(both.stdout)["modes"]
    assert set(data) == {"train", "infer"}
    train = json.loads(run(*args, "--mode", "train", "--json").stdout)
    assert data["train"]["max_batch_size"] == train["max_batch_size"]
    # evaluation fits more (no activations kept for a backward, no gradients); inside training
    # it runs next to AdamW's state, which an evaluation-only script (--mode infer) has not
    alone = json.loads(run(*args, "--mode", "infer", "--json").stdout)["max_batch_size"]
    inside = data["infer"]["max_batch_size"]
    assert data["train"]["max_batch_size"] < inside < alone

    def evaluates(batch_size: int) -> bool:  # an eval loop in the middle of training
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)
        )
        opt = torch.optim.AdamW(model.parameters())
        opt.zero_grad()  # pytorch/examples' order: the last step's gradients live on
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        try:
            with memkit.simulate("12MiB", track=(model, opt)), torch.no_grad():
                for _ in range(2):
                    out = model(torch.randn(batch_size, 128))  # noqa: F841
        except torch.OutOfMemoryError:
            return False
        return True

    assert evaluates(inside) and not evaluates(inside + 1)
    # the text of the same run is test_golden's probe_train_infer
    assert run(*args, "--mode", "train,eval").exit_code == 2


def test_a_model_without_parameters_is_the_model_files_problem_not_memkits(tmp_path: Path):
    """The default AdamW of a parameterless model raised ValueError inside memkit: reported as
    "internal error ... please report it", exit 3. It is the model file's: exit 2, one line."""
    path = tmp_path / "no_params.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.ReLU()\n"
        "def make_batch(n):\n    return torch.randn(n, 8)\n"
    )
    result = CliRunner().invoke(cli, ["probe", str(path), "--device", "cpu", "--budget", "1MiB"])
    assert result.exit_code == 2, result.output
    assert "returned a ReLU with no parameters" in result.output
    assert "internal error" not in result.output and "Traceback" not in result.output


def test_a_train_step_that_never_steps_the_optimizer_is_warned_about():
    """A train_step without optimizer.step() trains nothing: the answer stands for what the
    step does, with a warning that a loop that steps (its update, its optimizer state) may fit
    far less. The default step, which steps, gets no such warning."""
    forgot = run(str(FILES / "no_optimizer_step.py"), "--device", "cpu", "--budget", "16MiB")
    assert forgot.exit_code == 0, forgot.output
    assert "left the parameters unchanged" in forgot.output
    fine = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "16MiB")
    assert fine.exit_code == 0 and "unchanged" not in fine.output


@pytest.mark.parametrize("update", [
    "opt = torch.optim.AdamW(model.parameters(), fused=True)\n    opt.step()",  # Trainer's default
    "for p in model.parameters():\n        p.data.add_(p.grad, alpha=-0.1)",  # word_language_model
])  # fmt: skip
def test_updates_that_leave_version_counters_alone_are_no_untrained_step(tmp_path, update):
    """A fused AdamW and writes through ``.data`` change the parameters without moving their
    version counters, and the probe warned that the step "left the parameters unchanged" (a
    new user's Trainer and word_language_model files). The values say they changed. Where the
    step never stepped the optimizer passed to it, its line says so."""
    path = tmp_path / "own_update.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 2))\n"
        "def make_batch(n):\n    return torch.randn(n, 32), torch.randint(0, 2, (n,))\n"
        "def train_step(model, batch, optimizer):\n"
        "    torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()\n"
        f"    {update}\n"
        "    model.zero_grad(set_to_none=True)\n"
    )  # fmt: skip
    result = run(str(path), "--device", "cpu", "--budget", "16MiB")
    assert result.exit_code == 0, result.output
    assert "unchanged" not in result.output
    assert "optimizer: AdamW (default): passed to the step, which never stepped it" in result.output


def test_an_optimizer_that_steps_a_base_optimizer_is_no_unstepped_one():
    """SAM's second_step() steps the base optimizer it wraps: the SAM the probe built stepped
    (review: "passed to the step, which never stepped it")."""
    result = run(str(FILES / "sam_step.py"), "--device", "cpu", "--budget", "16MiB")
    assert result.exit_code == 0, result.output
    assert "optimizer: SAM (build_optimizer)\n" in result.output


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_causal_lm_that_returns_its_keys_in_training_is_said_to(tmp_path, use_cache):
    """transformers' Trainer turns ``use_cache`` off; a model file built from a config keeps it
    on, and each training forward then returns every layer's keys and values, which the probe
    holds with the output (a new user's Trainer file: 24 where the Trainer fits 25). The
    report says so where they were returned, and not where the config turns them off."""
    pytest.importorskip("transformers")
    path = tmp_path / "tiny_lm.py"
    path.write_text(
        "import torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "def build_model():\n"
        "    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,\n"
        f"                     use_cache={use_cache})\n"
        "    return GPT2LMHeadModel(cfg)\n"
        "def make_batch(n):\n"
        "    ids = torch.randint(0, 64, (n, 16))\n"
        "    return {'input_ids': ids, 'labels': ids}\n"
    )
    result = run(str(path), "--device", "cpu", "--budget", "8MiB")
    assert result.exit_code == 0, result.output
    assert ("use_cache: each training forward also returned" in result.output) is use_cache
    if not use_cache:  # an RL rollout's generate() (no_grad, train mode) is no training forward
        text = path.read_text().replace(
            "def make_batch",
            "def train_step(model, batch, optimizer):\n"
            "    with torch.no_grad():\n"
            "        model.generate(batch['input_ids'][:, :4], max_new_tokens=2, do_sample=False,\n"
            "                       pad_token_id=0, use_cache=True)\n"
            "    model(**batch).loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad(set_to_none=True)\n"
            "def make_batch",
        )
        path.write_text(text)
        rollout = run(str(path), "--device", "cpu", "--budget", "8MiB")
        assert rollout.exit_code == 0 and "use_cache" not in rollout.output, rollout.output


def test_a_list_batch_for_a_one_input_model_says_how_the_default_step_calls_it():
    """A DataLoader-style ``[inputs, labels]`` list goes in as ``model(*batch)`` (a list may be
    the model's one input): the TypeError that follows is the step's (exit 3) and says what to
    return instead."""
    result = run(str(FILES / "list_batch.py"), "--device", "cpu", "--budget", "16MiB")
    assert result.exit_code == 3, result.output
    assert "forward() takes 2 positional arguments but 3 were given" in result.stderr
    assert "return a tuple (inputs, labels) from make_batch" in result.stderr


# -- a model file that calls sys.exit (sweep L) ---------------------------------------------------
EXITING = {
    "load": "import sys, torch\nsys.exit('no GPU found, aborting')\n"
    "def build_model(): return torch.nn.Linear(16, 2)\n"
    "def make_batch(batch_size): return torch.randn(batch_size, 16)\n",
    "build_model": "import sys, torch\ndef build_model(): sys.exit('no GPU found')\n"
    "def make_batch(batch_size): return torch.randn(batch_size, 16)\n",
    "make_batch": "import torch\ndef build_model(): return torch.nn.Linear(16, 2)\n"
    "def make_batch(batch_size):\n    if batch_size > 8: raise SystemExit(0)\n"
    "    return torch.randn(batch_size, 16)\n",
    "train_step": "import sys, torch\ndef build_model(): return torch.nn.Linear(16, 2)\n"
    "def make_batch(batch_size): return torch.randn(batch_size, 16)\n"
    "def train_step(model, batch, optimizer):\n    loss = model(batch).sum()\n"
    "    if batch.shape[0] > 8: sys.exit(0)  # early stopping\n"
    "    loss.backward(); optimizer.step(); optimizer.zero_grad()\n",
    "forward": "import sys, torch\nclass Net(torch.nn.Linear):\n"
    "    def forward(self, x):\n        if x.shape[0] > 8: sys.exit(1)\n"
    "        return super().forward(x)\n"
    "def build_model(): return Net(16, 2)\n"
    "def make_batch(batch_size): return torch.randn(batch_size, 16)\n",
}


@pytest.mark.parametrize(
    ("where", "code", "fragment"),
    [
        ("load", 2, "model.py called sys.exit('no GPU found, aborting')"),
        ("build_model", 2, "build_model() in"),
        ("make_batch", 2, "make_batch() in"),
        ("train_step", 3, "train_step() in"),
        ("forward", 3, "the model file's code called sys.exit(1) while memkit ran it"),
    ],
)
def test_a_model_file_calling_sys_exit_is_an_error_not_the_end(tmp_path, where, code, fragment):
    """Sweep L: sys.exit in a model file ended the probe with the file's code and no report:
    exit 1 (memkit's "does not fit") from build_model, exit 0 with nothing printed from the
    step or make_batch, even with --json. Now: an error of the place it was called from (a
    model-file error while loading or making the model or a batch, exit 2; the step's, 3)."""
    path = tmp_path / "model.py"
    path.write_text(EXITING[where])
    result = run(str(path), "--device", "cpu", "--budget", "8MiB", "--max-batch", "64", "--json")
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("memkit: error: ") and "sys.exit(" in result.stderr
    assert fragment in result.stderr, result.stderr


def test_a_model_file_parsing_argv_at_import_does_not_see_memkits(tmp_path):
    """Sweep L: argparse at import saw `probe model.py --device cpu ...` and exited 2."""
    import sys

    path = tmp_path / "model.py"
    path.write_text(
        "import argparse, sys, torch\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--hidden', type=int, default=4)\nargs = parser.parse_args()\n"
        "SEEN = sys.argv[:]\n"
        "def build_model(): return torch.nn.Linear(16, args.hidden)\n"
        "def make_batch(batch_size): return torch.randn(batch_size, 16)\n"
    )
    argv = sys.argv[:]
    result = run(str(path), "--device", "cpu", "--budget", "8MiB", "--max-batch", "4")
    assert result.exit_code == 0, result.output
    assert sys.argv == argv  # restored
    from memkit.modelfile import load_model_file

    seen = sys.modules[load_model_file(path).build_model.__module__].SEEN
    assert seen == [str(path.resolve())]


def test_memkits_own_ceiling_is_no_answer_but_a_bound(tmp_path: Path, monkeypatch):
    """A model that never runs out (Linear(2, 1) on 256 MiB) reached memkit's search ceiling
    (2**20 samples): the report said "Largest batch ... 1048576; recommended 1048576 (leaves
    5% free)" with 94% free and ``hit_max_batch`` false. It is a bound, and says so."""
    monkeypatch.setattr("memkit.probing.options.MAX_BATCH_CEILING", 4096)
    path = tmp_path / "tiny.py"
    path.write_text(
        "import torch\n\n\ndef build_model():\n    return torch.nn.Linear(2, 1)\n\n\n"
        "def make_batch(batch_size):\n    return torch.randn(batch_size, 2)\n"
    )
    result = run(str(path), "--device", "cpu", "--budget", "64MiB")
    assert result.exit_code == 0, result.output
    headline = result.stdout.splitlines()[0]
    assert "at least 4096 (memkit's search ceiling, not a memory limit: it leaves" in headline
    assert "--max-batch to search higher" in headline and "recommended" not in headline
    data = json.loads(run(str(path), "--device", "cpu", "--budget", "64MiB", "--json").stdout)
    assert data["max_batch_size"] == 4096 and data["hit_max_batch"]
    estimate = CliRunner().invoke(cli, ["estimate", str(path), "--device-memory", "8GiB"])
    assert estimate.exit_code == 0, estimate.output
    assert "at least 4096 (memkit's search ceiling" in estimate.stdout.splitlines()[0]


def test_a_step_error_shows_the_users_frames_and_what_the_default_step_did(tmp_path: Path):
    """A dict batch whose keys forward does not take: exit 3 with 25 lines of memkit's and
    torch's call plumbing (trials.py, step.py, Module._call_impl) and no word of model(**batch).
    """
    path = tmp_path / "wrong_keys.py"
    path.write_text(
        "import torch\n\n\nclass M(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(64, 10)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n\n\n"
        "def build_model():\n    return M()\n\n\n"
        "def make_batch(n):\n"
        "    return {'input_ids': torch.randn(n, 64), 'labels': torch.randint(0, 10, (n,))}\n"
    )
    result = run(str(path), "--device", "cpu", "--budget", "64MiB")
    assert result.exit_code == 3, result.output
    assert "got an unexpected keyword argument 'input_ids'" in result.stderr
    assert "calls model(**batch) for a dict batch" in result.stderr
    assert "memkit/probing" not in result.stderr and "_call_impl" not in result.stderr


# -- sweep W: what the command line says, and what it refuses ----------------------------------
SEQ_LEN_FILE = """import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16))
def make_batch(batch_size, seq_len):
    return torch.randint(0, 16, (batch_size, seq_len))
"""


def test_a_make_batch_that_needs_a_seq_len_is_told_how_to_give_one(tmp_path):
    """Sweep W: it said "define make_batch(batch_size) or make_batch(batch_size, seq_len)
    (then pass seq_len=)" to a make_batch(batch_size, seq_len) on the command line."""
    path = tmp_path / "seq.py"
    path.write_text(SEQ_LEN_FILE)
    for command in (["probe", str(path), "--device", "cpu", "--budget", "8MiB"],
                    ["estimate", str(path), "--device-memory", "1GiB"]):  # fmt: skip
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.splitlines()
        assert "needs a sequence length" in line and "give one with --seq-len N" in line
        assert "seq_len=" not in line and "define make_batch" not in line
    with pytest.raises(memkit.errors.ModelFileError, match="give one with seq_len=N"):
        memkit.probe_file(str(path), device="cpu", budget="8MiB")


@pytest.mark.parametrize("option", [["--target-batch", "64"], ["--accumulate", "4"]])
def test_training_options_are_refused_for_inference_alone(option):
    result = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "8MiB",
                 "--mode", "infer", *option)  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"memkit: error: {' '.join(option)} with --mode infer: it applies to ")
    assert "give --mode train" not in line and "--mode train,infer" in line


def test_with_train_and_infer_the_evaluation_report_says_they_went_to_training():
    result = run(str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "8MiB", "--max-batch",
                 "2", "--steps", "1", "--mode", "train,infer", "--target-batch", "8",
                 "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    modes = json.loads(result.stdout)["modes"]
    line = "--target-batch 8: applied to the train probe only"
    assert any(d.startswith(line) for d in modes["infer"]["defaults"])
    assert not any(d.startswith(line) for d in modes["train"]["defaults"])


def test_a_sequence_length_given_twice_is_refused():
    result = run(str(FILES / "ok_mlp.py"), "--seq-len", "16,8,16")
    assert result.exit_code == 2
    assert "each length once, found '16,8,16' (16 more than once): give 16,8" in result.stderr


def test_a_device_this_machine_lacks_lists_only_what_probe_takes(monkeypatch):
    monkeypatch.setattr("memkit.devices.backends.current_accelerator", lambda: None)
    result = run(str(FILES / "ok_mlp.py"), "--device", "mps")
    assert result.exit_code == 2
    assert "device mps is not available here; this machine has 'cpu' (simulated)\n" in (
        result.stderr
    )


# -- the evaluation step: its errors, eval_step, and train,infer that fails half-way -------------
EVAL_STEP = """
def eval_step(model, x):
    assert not torch.is_grad_enabled() and not model.training
    t = torch.randint(0, 10, (x.shape[0],), device=x.device)
    return model(x, t)
"""


def test_an_evaluation_error_names_the_evaluation_step_and_says_to_write_eval_step():
    """A forward(x, t) model whose file has a train_step: --mode infer calls model(batch) (it
    never runs train_step), and the TypeError was reported as "the training step raised", with
    no word of what --mode infer calls."""
    result = run(str(FILES / "timestep_model.py"), "--device", "cpu", "--budget", "16MiB",
                 "--mode", "infer")  # fmt: skip
    assert result.exit_code == 3, result.output
    assert "memkit: error: the evaluation step raised TypeError at batch size 1" in result.stderr
    assert "forward() missing 1 required positional argument: 't'" in result.stderr
    assert "--mode infer runs no train_step (that is training's)" in result.stderr
    assert "or write an eval_step(model, batch)" in result.stderr
    assert "training step" not in result.stderr


def test_train_then_a_failing_infer_keeps_the_train_answer_and_exits_with_the_error():
    """--mode train,infer whose evaluation step fails: the train probe's answer was thrown away
    (exit 3, nothing on stdout); it is the run's result now, and the error follows on stderr."""
    args = [str(FILES / "timestep_model.py"), "--device", "cpu", "--budget", "16MiB",
            "--max-batch", "8", "--mode", "train,infer"]  # fmt: skip
    text = run(*args)
    assert text.exit_code == 3, text.output
    assert text.stdout.startswith("Largest batch per mode: train 8\n")
    assert "Largest batch that fits (train)" in text.stdout and "(infer)" not in text.stdout
    assert "memkit: --mode train finished, its report is on stdout; --mode infer stopped:\n" \
        "memkit: error: the evaluation step raised TypeError" in text.stderr  # fmt: skip
    as_json = run(*args, "--json")
    assert as_json.exit_code == 3, as_json.output
    modes = json.loads(as_json.stdout)["modes"]
    assert list(modes) == ["train"] and modes["train"]["max_batch_size"] == 8


def test_eval_step_is_the_evaluation_step(tmp_path: Path):
    """eval_step(model, batch) runs under torch.no_grad() with the model in eval mode (it
    asserts both) in --mode infer, and the report says so; --keep loss, which changes only the
    default step, is refused with it, as with a train_step."""
    path = tmp_path / "denoiser.py"
    path.write_text((FILES / "timestep_model.py").read_text() + EVAL_STEP)
    args = [str(path), "--device", "cpu", "--budget", "16MiB", "--max-batch", "8"]
    result = run(*args, "--mode", "train,infer", "--json")
    assert result.exit_code == 0, result.output
    infer = json.loads(result.stdout)["modes"]["infer"]
    assert infer["max_batch_size"] == 8
    assert any(d.startswith("step: eval_step(model, batch) under torch.no_grad()")
               for d in infer["defaults"])  # fmt: skip
    refused = run(*args, "--mode", "infer", "--keep", "loss")
    assert refused.exit_code == 2, refused.output
    assert "runs the model file's eval_step" in refused.stderr


def test_a_model_without_forward_is_told_to_write_its_steps():
    """cleanRL's Agent has get_value and get_action_and_value, no forward: torch's "missing the
    required forward" came with no word of what to do."""
    model = str(FILES / "no_forward_agent.py")
    train = run(model, "--device", "cpu", "--budget", "16MiB")
    assert train.exit_code == 3, train.output
    assert 'is missing the required "forward" function' in train.stderr
    assert "write a train_step(model, batch, optimizer) that calls its methods" in train.stderr
    infer = run(model, "--device", "cpu", "--budget", "16MiB", "--mode", "infer")
    assert infer.exit_code == 3, infer.output
    assert "the evaluation step raised NotImplementedError" in infer.stderr
    assert "write an eval_step(model, batch)" in infer.stderr
    assert "train_step" not in infer.stderr  # (this file has none to mention)


@pytest.mark.filterwarnings(r"ignore:std\(\)")
def test_a_nan_from_a_statistic_over_a_batch_of_one_says_to_start_at_2():
    """A PPO step normalising its advantages: their std at batch 1 is NaN, and the next step's
    Categorical raises a ValueError on NaN logits, which had no hint; from --min-batch 2 it
    runs."""
    model = str(FILES / "normalised_advantages.py")
    result = run(model, "--device", "cpu", "--budget", "16MiB")
    assert result.exit_code == 3, result.output
    assert "the training step raised ValueError at batch size 1" in result.stderr
    assert "its std or var is NaN" in result.stderr and "probe from --min-batch 2" in result.stderr
    started = run(model, "--device", "cpu", "--budget", "16MiB", "--min-batch", "2",
                  "--max-batch", "4")  # fmt: skip
    assert started.exit_code == 0, started.output


REPLAY_MODEL = """
import collections, random, torch

observations = torch.zeros(600, 1024)  # a replay buffer kept as the model file's globals
transitions = collections.deque(
    ((torch.zeros(1024), torch.zeros(1024)) for _ in range(300)), maxlen=300
)


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_batch(n):
    return observations[torch.randint(0, 600, (n,))]
"""


def test_a_replay_buffer_held_outside_the_model_is_named_with_its_bytes(tmp_path):
    """Sweep CD: a DQN model file's replay buffer as globals (a tensor, or a deque of
    transitions) was counted nowhere and no line said so: the answer 1863 where its loop,
    the buffer on the device, fits 1563."""
    path = tmp_path / "dqn.py"
    path.write_text(REPLAY_MODEL)
    result = run(str(path), "--device", "cpu", "--budget", "8MiB", "--max-batch", "64", "--json")
    assert result.exit_code == 0, result.output
    said = [d for d in json.loads(result.stdout)["defaults"] if d.startswith("held outside")]
    assert len(said) == 1
    assert "`observations` (2.34 MiB)" in said[0] and "`transitions` (2.34 MiB)" in said[0]


EMA_MODEL = """
import copy, os, torch

model_ema = None


def build_model():
    global model_ema
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    if os.environ.get("MEMKIT_TEST_EMA"):
        model_ema = copy.deepcopy(model).requires_grad_(False)  # timm's ModelEmaV2, a global
    return model


def make_batch(n):
    return torch.randn(n, 256)
"""


def test_an_ema_copy_held_outside_the_model_is_counted_in_evaluation(tmp_path, monkeypatch):
    """Sweep CG: a ViT model file kept its EMA copy (3.13 MiB) as a global: `--mode infer`
    answered 130 where the script's validation, the copy on the device, fits 122 (no line
    said so: a module was taken for a function). A module held beside the model is counted
    in every trial now: the answer with the copy is that of a card smaller by its bytes."""
    path = tmp_path / "ema_model.py"
    path.write_text(EMA_MODEL)
    size = 4 * (2 * 256 * 1024 + 1024 + 256)  # the copy's weights and biases, float32
    args = ("--device", "cpu", "--mode", "infer", "--max-batch", "4096", "--json")
    plain = run(str(path), "--budget", f"{8 * 2**20 - size}B", *args)
    monkeypatch.setenv("MEMKIT_TEST_EMA", "1")
    held = run(str(path), "--budget", "8MiB", *args)
    assert plain.exit_code == held.exit_code == 0, (plain.output, held.output)
    answer = json.loads(held.stdout)
    said = [d for d in answer["defaults"] if d.startswith("held outside")]
    assert len(said) == 1 and "`model_ema`" in said[0] and "counted in every trial" in said[0]
    assert abs(answer["max_batch_size"] - json.loads(plain.stdout)["max_batch_size"]) <= 1
