"""memkit.probe across 2 real gloo ranks on CPU, each with its own simulated device and budget.

The two ranks run every scenario in sequence, in the launch the suite's 2-rank tests share
(tests/rank_processes.py: process start-up dominates on a small machine): DDP probes where only
rank 1 runs out of memory, in forward, in backward and in the optimizer step; a plain probe
with different budgets per rank; a non-OOM error on one rank; the CLI in a process whose group
exists. Every wait is bounded: a hang fails the test, and the workers are killed.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from rank_processes import rank_scenario

from memkit.distributed import RankStatus
from memkit.probing.ranks import agreed_outcome
from memkit.probing.result import ProbeResult, ProbeTrial

pytestmark = pytest.mark.slow

MODEL_FILE = textwrap.dedent(
    """
    import torch

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 8))

    def make_batch(batch_size):
        return torch.randn(batch_size, 32)
    """
)

# Both ranks run it in the shared launch: the group exists (made from torchrun's environment
# as the CLI makes it), the working directory holds model.py.
SCENARIO = textwrap.dedent(
    """
    import contextlib, gc, io
    import torch
    import memkit
    from memkit.cli import main
    from memkit.errors import MemkitError

    BALLAST = 64 * 1024  # bytes per sample, allocated by rank 1 in the phase under test


    def run(rank, args):
        ooms = {"forward": 0, "backward": 0, "optimizer": 0}

        def ballast(phase, batch):
            try:
                return torch.empty(BALLAST * batch, dtype=torch.uint8)
            except torch.OutOfMemoryError:
                ooms[phase] += 1
                raise

        def hit(phase, batch):
            ballast(phase, batch)  # allocated and dropped: a transient in that phase

        def build(phase):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 8))
            opt = torch.optim.AdamW(model.parameters())
            if rank == 1 and phase == "forward":
                model[1].register_forward_hook(lambda m, i, o: hit("forward", o.shape[0]))
            if rank == 1 and phase == "backward":
                def keep(m, i, o):  # fires late in backward, after the last layer's gradients
                    n = o.shape[0]
                    o.register_hook(lambda g: hit("backward", n))
                model[0].register_forward_hook(keep)
            if rank == 1 and phase == "optimizer":
                sizes = []
                model[0].register_forward_hook(lambda m, i, o: sizes.append(o.shape[0]))
                opt.register_step_post_hook(lambda *a: hit("optimizer", sizes[-1]))
            return model, opt

        results = {}
        for phase in ("forward", "backward", "optimizer"):
            model, opt = build(phase)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            budget = "64MiB" if rank == 0 else "1MiB"
            with memkit.simulate(None, track=(model, opt)) as outer:
                level = outer.current
                res = memkit.probe(model, lambda n: torch.randn(n, 32), optimizer=opt,
                                   device="cpu", budget=budget, max_batch=64, ddp=True,
                                   timeout=20)
                uncollected = outer.current - level
                # what the process holds: garbage in reference cycles is the interpreter's to
                # free (2048 B once in about 40 full-suite runs, never reproduced alone)
                gc.collect()
                after = outer.current
            same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            hooks = len(opt._optimizer_step_pre_hooks)
            results[phase] = {"result": res.to_dict(), "text": str(res), "leak": after - level,
                              "uncollected": uncollected, "restored": same,
                              "ooms": ooms[phase], "hooks": hooks}

        # no DDP, different capacities: rank 0 a small device, rank 1 a large one
        model, opt = build("none")
        res = memkit.probe(model, lambda n: torch.randn(n, 32), optimizer=opt, device="cpu",
                           budget=["300KiB", "2MiB"][rank], max_batch=512, timeout=20)
        results["budgets"] = {"result": res.to_dict(), "text": str(res)}

        # a non-OOM error in rank 1's step: rank 1 gets UserCodeError, rank 0
        # DistributedError, no hang
        def loss(output, batch):
            if rank == 1 and output.shape[0] > 4:
                raise KeyError("no such column")
            return output.sum()
        try:
            memkit.probe(model, lambda n: torch.randn(n, 32), optimizer=opt, loss_fn=loss,
                         device="cpu", budget="64MiB", max_batch=64, ddp=True, timeout=20)
        except MemkitError as exc:
            results["error"] = [type(exc).__name__, exc.exit_code]

        # the CLI in this process: the group exists, so it is used as it is
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            try:
                main(["probe", "model.py", "--device", "cpu", "--budget", "64MiB,200KiB",
                      "--ddp", "--max-batch", "256", "--json", "--timeout", "30"])
            except SystemExit as exc:
                results["cli_exit"] = exc.code
        results["cli_stdout"] = stdout.getvalue()
        return results
    """
)

rank_scenario("probe", SCENARIO, files={"model.py": MODEL_FILE})


@pytest.fixture(scope="module")
def two_ranks(gloo_ranks) -> list[dict]:
    return gloo_ranks("probe").results


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_ddp_probe_when_only_rank1_runs_out_in(two_ranks: list[dict], phase: str) -> None:
    r0, r1 = two_ranks[0][phase], two_ranks[1][phase]
    a, b = r0["result"], r1["result"]
    assert r1["ooms"] >= 1 and r0["ooms"] == 0  # the OOM happened where intended, on rank 1
    # the same answer on both ranks, from the same walk of sizes
    assert a["max_batch_size"] == b["max_batch_size"] is not None
    assert [t["batch_size"] for t in a["trials"]] == [t["batch_size"] for t in b["trials"]]
    assert [t["fits"] for t in a["trials"]] == [t["fits"] for t in b["trials"]]
    best = a["max_batch_size"]
    assert 1 < best < 64  # rank 1's ballast, not --max-batch, set the limit
    trials = {t["batch_size"]: t for t in a["trials"]}
    assert trials[best]["fits"] and not trials[best + 1]["fits"]
    assert "rank(s) 1" in trials[best + 1]["error"]
    assert a["world_size"] == 2 and a["ddp"] is True and a["tightest_rank"] == 1
    assert len(a["per_rank_peaks"]) == 2 and all(p for p in a["per_rank_peaks"])
    # memory recovered and the model put back, on both ranks; the pre-step hook removed
    for r in (r0, r1):
        assert r["leak"] == 0 and r["restored"] and r["hooks"] == 0
    assert "per rank at batch" in r0["text"] and "tightest" in r0["text"]


def test_ddp_bucket_memory_is_in_the_peak(two_ranks: list[dict]) -> None:
    # rank 0 (64 MiB, no ballast) ran the same sizes: its peak at the answer includes DDP's
    # buckets (a flat copy of the gradients) besides params, grads and AdamW's two moments.
    a = two_ranks[0]["forward"]["result"]
    params = (32 * 64 + 64 + 64 * 8 + 8) * 4
    assert a["per_rank_peaks"][0] >= 5 * params


def test_probe_with_a_budget_per_rank_aims_at_the_smallest(two_ranks: list[dict]) -> None:
    a, b = two_ranks[0]["budgets"]["result"], two_ranks[1]["budgets"]["result"]
    assert a["max_batch_size"] == b["max_batch_size"] is not None
    assert a["per_rank_capacities"] == [300 * 1024, 2 * 1024 * 1024]
    assert a["capacity_bytes"] == 300 * 1024 and a["tightest_rank"] == 0
    trials = {t["batch_size"]: t for t in a["trials"]}
    best = a["max_batch_size"]
    assert trials[best + 1]["error"].startswith("does not fit on rank(s) 0")
    assert a["ddp"] is False


def test_a_non_oom_error_on_one_rank_ends_both(two_ranks: list[dict]) -> None:
    assert two_ranks[1]["error"] == ["UserCodeError", 3]
    assert two_ranks[0]["error"] == ["DistributedError", 4]


def test_agreed_outcome_shifts_peaks_to_the_smallest_capacity() -> None:
    OK, OOM = RankStatus.OK, RankStatus.OOM
    # rank 0: 100 capacity, peak 90 (room 10); rank 1: 80 capacity, peak 75 (room 5)
    o = agreed_outcome([[OK, 1, 90, 90, None], [OK, 1, 75, 75, None]], [100, 80])
    assert o.fits and o.peak_bytes == 80 - 5 and o.rank_peaks == (90, 75)
    o = agreed_outcome([[OK, 1, 50, 50, None], [OOM, 0, None, None, 95]], [100, 80])
    assert not o.fits and o.peak_bytes == 95 and o.failed_ranks == (1,)
    o = agreed_outcome([[OK, 1, 50, 50, None], [OOM, 0, None, None, None]], [None, 80])
    assert not o.fits and o.peak_bytes is None


def test_result_renders_per_rank_table() -> None:
    trial = ProbeTrial(8, True, 900, 0.1, 900, None, rank_peaks=(900, 700))
    res = ProbeResult(
        8, 7, (trial,), "cpu", "simulated cpu", "x", 1000, "train", 2, 0.05, 1, None,
        world_size=2, per_rank_peaks=(900, 700), per_rank_capacities=(1000, 750), ddp=True,
    )  # fmt: skip
    assert res.tightest_rank == 1
    text = str(res)
    assert "2 ranks (DDP)" in text and "tightest" in text
    d = res.to_dict()
    assert d["trials"][0]["rank_peaks"] == [900, 700] and d["tightest_rank"] == 1
    assert "tightest" in res._repr_html_()


def test_cli_under_a_process_group_ddp_budget_per_rank_json_from_rank0(
    two_ranks: list[dict],
) -> None:
    assert two_ranks[0]["cli_exit"] in (None, 0) and two_ranks[1]["cli_exit"] in (None, 0)
    assert two_ranks[1]["cli_stdout"] == ""  # only rank 0 prints
    data = json.loads(two_ranks[0]["cli_stdout"])  # one JSON object
    assert data["world_size"] == 2 and data["ddp"] is True
    assert data["per_rank_capacities"] == [64 * 1024**2, 200 * 1024]
    assert data["tightest_rank"] == 1 and data["max_batch_size"] < 256
    best = data["max_batch_size"]
    after = [t for t in data["trials"] if t["batch_size"] == best + 1]
    assert after and "rank(s) 1" in after[0]["error"]


def test_cli_budget_count_must_match_the_world(tmp_path: Path, monkeypatch) -> None:
    from click.testing import CliRunner

    from memkit.cli import cli

    (tmp_path / "model.py").write_text(MODEL_FILE)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    args = ["probe", str(tmp_path / "model.py"), "--device", "cpu", "--budget", "1MiB,2MiB,3MiB"]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 2
    assert "--budget has 3 sizes" in done.output and "2 rank(s)" in done.output
