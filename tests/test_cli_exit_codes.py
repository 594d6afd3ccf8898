"""Exit codes a script can trust: Ctrl-C is 130, memkit's own failures 3 (never 1, "does not
fit"), --json is one JSON object whatever the model file prints, budgets the machine cannot back
are refused, and the default simulated cpu device is modest."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import warm

import memkit
from memkit import cli as cli_module
from memkit import devices
from memkit.cli import cli
from memkit.errors import ConfigError

FILES = Path(__file__).parent / "modelfiles"
ROOT = Path(__file__).parent.parent


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def _small_host(monkeypatch, available: int) -> None:
    """A host with ``available`` bytes free, for the CLI's checks (they read it through the
    package) and for the default budget (read in its own module)."""
    small = lambda: devices.HostMemory(1 << 20, available, 2 * available)  # noqa: E731
    monkeypatch.setattr(devices, "host_memory", small)
    monkeypatch.setattr(devices.host, "host_memory", small)


# -- Ctrl-C: 130 -------------------------------------------------------------------------------
def test_ctrl_c_in_probe_exits_130_with_one_line():
    result = invoke("probe", str(FILES / "interrupt_step.py"), "--device", "cpu",
                    "--budget", "64MiB")  # fmt: skip
    assert result.exit_code == 130, result.output
    assert result.stderr.rstrip().endswith("memkit: interrupted")
    assert "Traceback" not in result.stderr and "Aborted" not in result.output


def test_a_ctrl_c_python_drops_still_stops_the_probe_with_130():
    """A Ctrl-C landing in a weakref callback or ``__del__`` is dropped by Python ("Exception
    ignored"): the probe ran on with a free the simulated device never counted and answered a
    wrong size with exit 0 (sweep P). It is sent again, or raised when the command ends."""
    result = invoke("probe", str(FILES / "interrupt_dropped.py"), "--device", "cpu",
                    "--budget", "64MiB")  # fmt: skip
    assert result.exit_code == 130, result.output
    assert result.stderr.rstrip().endswith("memkit: interrupted")
    assert "Largest batch" not in result.output


def test_a_dropped_ctrl_c_stops_the_answer_even_before_it_is_sent_again(monkeypatch):
    """A probe that ends before the dropped Ctrl-C is sent again printed its answer, then
    'memkit: interrupted' (the search got fast enough to end within 0.2 s of it)."""
    monkeypatch.setattr("memkit.cli.exits.RESEND_SECONDS", 30.0)
    result = invoke("probe", str(FILES / "interrupt_dropped.py"), "--device", "cpu",
                    "--budget", "64MiB")  # fmt: skip
    assert result.exit_code == 130, result.output
    assert "Largest batch" not in result.output


def test_ctrl_c_in_probe_restores_the_model():
    from memkit.modelfile import load_model_file

    spec = load_model_file(FILES / "interrupt_step.py")
    model = spec.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(KeyboardInterrupt):
        memkit.probe(model, spec.make_batch, optimizer=optimizer, train_step=spec.train_step,
                     device="cpu", budget="64MiB")  # fmt: skip
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # batch 1 stepped: put back
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_ctrl_c_in_estimate_exits_130():
    result = invoke("estimate", str(FILES / "interrupt_step.py"), "--device-memory", "1GiB")
    assert result.exit_code == 130, result.output
    assert result.stderr.rstrip().endswith("memkit: interrupted")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [[], ["--watch", "0", "--count", "3"]])
def test_ctrl_c_in_snapshot_exits_130(monkeypatch, args):
    import memkit.snapshots

    real, calls = memkit.snapshots.snapshot, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == (2 if args else 1):
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(memkit.snapshots, "snapshot", interrupted)
    result = invoke("snapshot", *args)
    assert result.exit_code == 130, result.output
    assert result.stderr.rstrip().endswith("memkit: interrupted")


# -- memkit's own failures: 3, one line; --device meta refused -----------------------------------
def test_device_meta_is_refused_by_probe_with_exit_2():
    result = invoke("probe", str(FILES / "ok_mlp.py"), "--device", "meta")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memkit: error: --device meta: probe runs real steps")
    assert "memkit estimate" in result.stderr and "Traceback" not in result.stderr


def test_device_meta_is_refused_by_run_before_the_script_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    result = invoke("run", "--device", "meta", str(script))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memkit: error: --device meta: memkit run counts")
    assert "--device cpu" in result.stderr and "the script ran" not in result.output


@pytest.mark.parametrize("command", ["probe", "run"])
def test_an_unknown_device_names_the_forms_the_command_takes(tmp_path, command):
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    target = str(FILES / "ok_mlp.py") if command == "probe" else str(script)
    result = invoke(command, "--device", "gpu", target)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memkit: error: --device 'gpu': expected a device such as")
    assert "meta" not in result.stderr and "the script ran" not in result.output


def test_an_unexpected_exception_in_memkit_exits_3_naming_it(monkeypatch):
    import memkit.probing.runner

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'peak'")

    monkeypatch.setattr(memkit.probing.runner, "probe_file", broken)
    result = invoke("probe", str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", "8MiB")
    assert result.exit_code == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memkit: internal error: AttributeError: ")
    assert "no attribute 'peak'" in lines[0]


# -- --json: one JSON object on stdout ---------------------------------------------------------
def test_probe_json_stays_json_when_the_model_file_prints():
    result = invoke("probe", str(FILES / "chatty.py"), "--device", "cpu", "--budget", "16MiB",
                    "--max-batch", "64", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["max_batch_size"] == 64
    assert "number of parameters:" in result.stderr and "loading chatty.py" in result.stderr


def test_estimate_json_stays_json_when_the_model_file_prints():
    result = invoke("estimate", str(FILES / "chatty.py"), "--device-memory", "2GiB",
                    "--max-batch", "64", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["max_batch_size"] == 64
    assert "number of parameters:" in result.stderr


def test_probe_json_piped_to_json_tool():
    probe = warm([sys.executable, "-m", "memkit", "probe", str(FILES / "chatty.py"), "--device",
                  "cpu", "--budget", "16MiB", "--max-batch", "8", "--json"])  # fmt: skip
    command = f"{shlex.join(probe)} | {sys.executable} -m json.tool"
    done = subprocess.run(  # a fixed pipeline, as a person would type it
        ["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_batch_size"] == 8
    assert "number of parameters:" in done.stderr
    assert "native: written to fd 1" in done.stderr  # below Python's sys.stdout, too


# -- budgets the machine cannot back -----------------------------------------------------------
@pytest.mark.parametrize("command", ["probe", "run"])
def test_a_budget_beyond_the_ram_is_refused_with_what_the_machine_has(command, monkeypatch):
    target = str(FILES / "ok_mlp.py")
    args = ["--device", "cpu", "--budget", "1e99GiB"]
    result = invoke(command, *([*args, target] if command == "run" else [target, *args]))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memkit: error: --budget '1e99GiB'")
    assert "available" in result.stderr and "at most" in result.stderr
    _small_host(monkeypatch, 256 * 1024**2)
    result = invoke("probe", target, "--device", "cpu", "--budget", "512MiB")
    assert result.exit_code == 2, result.output
    assert "256.00 MiB" in result.stderr


@pytest.mark.parametrize(
    ("budget", "rank", "refused"),
    [("600MiB", 0, True), ("256MiB,256MiB,1GiB,1GiB", 0, False),
     ("256MiB,256MiB,1GiB,1GiB", 3, True)],
)  # fmt: skip
def test_ranks_on_one_machine_are_checked_against_its_ram_together(
    monkeypatch, budget, rank, refused
):
    """torchrun --nproc-per-node 2 on each of two 1 GiB machines: every rank's simulated
    device holds real tensors in the same RAM, so the ranks of one machine must fit together
    (each alone would)."""
    _small_host(monkeypatch, 1024**3)
    for name, value in {"WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2, "RANK": rank,
                        "LOCAL_RANK": rank % 2}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    on_host = cli_module._host_budgets(budget, 4, rank)
    assert len(on_host) == 2
    if not refused:
        cli_module._check_host_backs(on_host)  # 512 MiB on this machine: fine
        return
    result = invoke("probe", str(FILES / "ok_mlp.py"), "--device", "cpu", "--budget", budget)
    assert result.exit_code == 2, result.output
    assert "the 2 ranks on this machine simulate" in result.stderr
    assert "available: 1.00 GiB" in result.stderr


@pytest.mark.parametrize("command", ["probe", "run"])
def test_a_budget_without_a_unit_is_refused_naming_the_budget(command):
    """``--budget 16`` is 16 bytes: the error names --budget (it named --device: sweep BN)."""
    target = str(FILES / "ok_mlp.py")
    args = ["--device", "cpu", "--budget", "16"]
    result = invoke(command, *([*args, target] if command == "run" else [target, *args]))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memkit: error: --budget '16': 16 is 16 bytes")
    assert "'16MiB'" in result.stderr


def test_a_zero_budget_in_the_python_api_is_a_config_error():
    with pytest.raises(ConfigError, match="positive"):
        devices.get_backend("cpu", 0)


def test_host_allocator_failure_is_not_taken_for_the_simulated_limit():
    result = invoke("probe", str(FILES / "host_oom_step.py"), "--device", "cpu",
                    "--budget", "64MiB")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "ran out of RAM at batch size" in result.stderr
    assert "not the simulated device's" in result.stderr
    assert "Largest batch" not in result.stdout  # never reported as "batch 4 fits, 5 does not"


# -- the default simulated cpu device ----------------------------------------------------------
def test_default_cpu_budget_is_a_modest_device(monkeypatch):
    assert devices.default_cpu_budget() <= 1024**3
    _small_host(monkeypatch, 1024**3)
    assert devices.default_cpu_budget() == 512 * 1024**2
    _small_host(monkeypatch, 64 * 1024**3)
    assert devices.default_cpu_budget() == 1024**3


def test_probe_without_budget_says_the_default(monkeypatch):
    _small_host(monkeypatch, 64 * 1024**3)
    result = invoke("probe", str(FILES / "ok_mlp.py"), "--device", "cpu", "--max-batch", "4")
    assert result.exit_code == 0, result.output
    assert "simulated device: 1.00 GiB (default; --budget to change)" in result.stdout


EXIT_PRINTS = """import atexit, os, weakref
import torch
atexit.register(lambda: print("atexit: bye from the model file"))
atexit.register(os.write, 1, b"native at exit\\n")  # below Python's sys.stdout
class Cache:
    pass
CACHE = Cache()
weakref.finalize(CACHE, print, "finalize: flushed")
def build_model(): return torch.nn.Linear(16, 2)
def make_batch(batch_size): return torch.randn(batch_size, 16)
"""


@pytest.mark.parametrize(
    "command",
    [["probe", "--device", "cpu", "--budget", "8MiB"], ["estimate", "--device-memory", "1GiB"]],
)
def test_json_stays_json_when_the_model_file_prints_at_interpreter_exit(tmp_path, command):
    """Sweep L: what a model file prints at exit (atexit, weakref.finalize) came after
    the JSON on stdout (json.tool: "Extra data"): stdout was given back before shutdown."""
    model = tmp_path / "model.py"
    model.write_text(EXIT_PRINTS)
    done = subprocess.run(
        warm([sys.executable, "-m", "memkit", command[0], str(model), *command[1:],
              "--max-batch", "8", "--json"]),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_batch_size"] == 8  # one object, nothing after it
    for printed in ("atexit: bye", "native at exit", "finalize: flushed"):
        assert printed in done.stderr, done.stderr


def test_a_dropped_ctrl_c_is_not_lost_when_the_command_exits_first():
    """A command that ends with ``sys.exit`` (probe's "nothing fits", exit 1) within the resend
    delay still ends as interrupted; and nothing is sent after the block (review finding)."""
    from memkit.cli.exits import RESEND_SECONDS, interrupts_kept

    class FreedDuringCtrlC:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), interrupts_kept():
        FreedDuringCtrlC()  # dropped by Python: "Exception ignored"
        sys.exit(1)
    time.sleep(2 * RESEND_SECONDS)  # a SIGINT sent now would interrupt this test


@pytest.mark.parametrize("option", ["--dtype", "--precision"])
def test_estimate_names_amp_for_a_dtype_option_people_try(option):
    """Sweep BJ: `memkit estimate ... --dtype bf16` answered "Did you mean '--mode'?"."""
    result = invoke("estimate", str(FILES / "ok_mlp.py"), "--device-memory", "1GiB", option, "bf16")
    assert result.exit_code == 2
    assert "has no --dtype or --precision: mixed precision is --amp bf16" in result.stderr
