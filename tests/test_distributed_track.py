"""memkit run / memkit.track across 2 real gloo ranks on CPU, and the DDP advice rules.

A DDP script whose ranks hold different batch sizes and one unused module, tracked by
``memkit.track`` in the 2-rank launch the suite shares (tests/rank_processes.py): rank 0's
report must carry the per-rank table, the imbalance, the tightest rank and
``ddp-unused-parameters``. Two torchrun launches of ``memkit run``: in one, rank 1 runs out of
memory and torchrun stops rank 0 with SIGTERM: rank 0 must still write and print its report,
marked as interrupted; in the other, DDP itself fails on an unused module and each rank's report
must say why. (What ``memkit run`` prints on each rank when the ranks are gathered is checked
under torchrun in tests/test_distributed_fsdp.py.) The launches are bounded: a hang fails the
test and kills the process group it started."""

from __future__ import annotations

import json
import re
import signal
import textwrap
from pathlib import Path

import pytest
from conftest import torchrun
from rank_processes import rank_scenario

from memkit.advice.distributed import ContextReading, ddp_gpu0_context, ddp_unused_parameters
from memkit.tracking.rank_gather import SENT_AFTER_ERROR, RanksReport, RankSummary, rank_advice

NET = textwrap.dedent(
    """
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU())
            self.head = torch.nn.Linear(128, 8)
            self.aux_head = torch.nn.Linear(128, 8)  # never used in forward
            self.branch = torch.nn.Linear(128, 128)  # used on some steps only

        def forward(self, x, use_branch=False):
            h = self.body(x)
            return self.head(self.branch(h) if use_branch else h)

    def build(rank, find_unused_parameters):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            Net(), find_unused_parameters=find_unused_parameters
        )
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model, opt, rank):
        batch = 64 if rank == 0 else 512  # rank 1 holds far more activations
        for step in range(3):
            model(torch.randn(batch, 64), use_branch=step == 1).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    """
)

TRACKED = textwrap.dedent(
    """
    import memkit
    from ddp_net import build, train

    def run(rank, args):
        model, opt = build(rank, find_unused_parameters=True)
        with memkit.track(model, opt, device="cpu", budget="256MiB") as tracker:
            train(model, opt, rank)
        return {"report": tracker.report().to_dict(), "text": str(tracker.report())}
    """
)

rank_scenario("ddp-gather", TRACKED, files={"ddp_net.py": NET})

CAUGHT = textwrap.dedent(
    """
    import time
    import torch, torch.distributed as dist
    import memkit

    def block(rank, raising_rank, seconds=0.0, gather_timeout=60):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker = memkit.track(model, opt, device="cpu", budget="64MiB",
                               gather_timeout=gather_timeout)
        try:
            with tracker:
                for step in range(3):
                    if rank == raising_rank and step == 1:
                        raise ValueError("corrupt batch")
                    with model.no_sync():  # no collective inside the block
                        model(torch.randn(8, 32)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                time.sleep(seconds)
        except ValueError:
            pass
        t0 = time.monotonic()
        dist.barrier()  # the script's own collective, after the block, on every rank
        report = tracker.report()
        return {"barrier_s": time.monotonic() - t0, "notes": report.notes,
                "ranks": None if report.ranks is None else report.ranks.to_dict(),
                "text": str(report)}

    def validate(model):  # `if rank == 0: validate()`: a tracked block rank 0 alone runs
        t0 = time.monotonic()
        with memkit.track(model, device="cpu", budget="64MiB", gather_timeout=60) as tracker:
            with torch.no_grad():
                model(torch.randn(8, 32))
        return {"seconds": time.monotonic() - t0, "notes": tracker.report().notes,
                "ranks": tracker.report().ranks.to_dict(), "text": str(tracker.report())}

    def run(rank, args):
        only0 = validate(torch.nn.Linear(32, 32)) if rank == 0 else None
        return {
            "rank0_alone": only0,
            "after_rank0_alone": block(rank, None),
            "rank1_raises": block(rank, raising_rank=1),
            "rank0_raises": block(rank, raising_rank=0),
            # rank 1 ends its block after rank 0 stopped waiting for it
            "rank1_late": block(rank, None, seconds=2.0 if rank == 1 else 0.0, gather_timeout=0.3),
        }
    """
)

rank_scenario("ddp-caught-error", CAUGHT)

UNUSED_STOPS_DDP = textwrap.dedent(
    """
    import datetime
    import torch.distributed as dist
    from ddp_net import build, train

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    train(*build(rank, find_unused_parameters=False), rank)
    dist.destroy_process_group()
    """
)


RANK1_RUNS_OUT = textwrap.dedent(
    """
    import datetime, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.barrier()
    step = 0
    while True:  # rank 0 never stops by itself: torchrun stops it when rank 1 fails
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if rank == 1 and step == 3:
            model(torch.randn(600_000, 32))  # 2 x 73 MiB on a 64 MiB device: out of memory
        time.sleep(0.01)
    """
)


def _torchrun(tmp_path: Path, script: str, *args: str, limit: float = 90.0) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node 2`` of ``memkit run ARGS train.py`` in
    ``tmp_path``: its exit code and stderr."""
    (tmp_path / "train.py").write_text(script)
    done = torchrun(tmp_path, ["memkit", "run", *args, "train.py"], limit=limit)
    return done.returncode, done.stderr


def test_ddp_ranks_are_gathered_to_rank0_with_imbalance_and_unused_parameters(
    gloo_ranks,
) -> None:
    r0, r1 = gloo_ranks("ddp-gather").results
    assert "ranks" not in r1["report"]  # only rank 0 holds the gathered table
    ranks = r0["report"]["ranks"]
    assert ranks["world_size"] == 2 and [r["rank"] for r in ranks["ranks"]] == [0, 1]
    assert [r["steps"] for r in ranks["ranks"]] == [3, 3]
    peaks = [r["peak_reserved"] for r in ranks["ranks"]]
    assert peaks[1] > peaks[0] and ranks["tightest_rank"] == 1
    assert ranks["imbalance"] == pytest.approx((peaks[1] - peaks[0]) / peaks[1])
    assert all(r["peak_phase"] in ("forward", "backward", "optimizer") for r in ranks["ranks"])
    codes = {a["code"]: a for a in ranks["advice"]}
    unused = codes["ddp-unused-parameters"]
    assert (
        "aux_head" in unused["evidence"]
        and "find_unused_parameters=True is on" in unused["evidence"]
    )
    assert unused["saving_bytes"] == 2 * (128 * 8 + 8) * 4  # aux_head and its bucket slots
    # `branch` had no gradient at step 0 and one at step 1: needed, not unused
    assert "branch" not in unused["evidence"] and "1 parameter(s)" not in unused["title"]
    assert [r["unused_parameters"] for r in ranks["ranks"]] == [["module.aux_head.bias",
            "module.aux_head.weight"]] * 2  # fmt: skip
    assert "ddp-gpu0-context" not in codes  # no CUDA here
    assert "2 ranks; imbalance between ranks" in r0["text"] and "tightest" in r0["text"]
    assert "memkit track rank 0/2: 3 step(s)" in r0["text"]


def test_a_rank_whose_block_raised_and_went_on_sends_its_summary_without_a_hang(
    gloo_ranks,
) -> None:
    """A script catches an error one rank's block raised and goes on to `dist.barrier()`:
    the summaries travel through the store, so no collective of memkit's meets the barrier
    (before: rank 0's gather all-reduce met it, and both waited for the group's timeout)."""
    r0, r1 = gloo_ranks("ddp-caught-error").checked().results
    raised = r0["rank1_raises"]["ranks"]
    assert [r["rank"] for r in raised["ranks"]] == [0, 1] and raised["missing"] == []
    assert [r["error"] for r in raised["ranks"]] == [None, "ValueError: corrupt batch"]
    assert [r["steps"] for r in raised["ranks"]] == [3, 1]
    assert "raised ValueError" in r0["rank1_raises"]["text"]
    assert any(n.startswith(SENT_AFTER_ERROR) for n in r1["rank1_raises"]["notes"])
    # rank 0 raised: it does not wait (its exception goes on), rank 1 sends and goes on
    assert r0["rank0_raises"]["ranks"] is None and r1["rank0_raises"]["ranks"] is None
    not_gathered = "ranks not gathered: this rank's block ended with an exception"
    assert not_gathered in r0["rank0_raises"]["notes"]
    assert "this rank's summary was sent to rank 0's report" in r1["rank0_raises"]["notes"]
    # a rank that sends nothing within the timeout is missing, not a hang
    late = r0["rank1_late"]["ranks"]
    assert [r["rank"] for r in late["ranks"]] == [0] and late["missing"] == [1]
    assert late["world_size"] == 2 and late["timeout"] == 0.3
    assert "rank(s) 1 sent no summary within 0.3 s" in r0["rank1_late"]["text"]
    for r in (r0, r1):
        assert all(r[case]["barrier_s"] < 5 for case in r if case != "rank0_alone"), r
    # a block rank 0 alone runs (a validation) waits for no one, and the next block both
    # ranks run still pairs up (the exchanges are named by call site)
    alone = r0["rank0_alone"]
    assert alone["seconds"] < 5 and alone["ranks"]["missing"] == [1]
    assert any(n.startswith("rank(s) 1 did not enter this block") for n in alone["notes"])
    assert not any("sent no summary" in n for n in alone["notes"])
    # nor does the headline say rank 0 waited (sweep BW: "within 300 s" for 0.52 s)
    headline = next(line for line in alone["text"].splitlines() if "imbalance between" in line)
    assert "rank(s) 1 did not run this block" in headline and "within" not in headline
    assert alone["ranks"]["absent"] == [1]
    after = r0["after_rank0_alone"]["ranks"]
    assert [r["rank"] for r in after["ranks"]] == [0, 1] and after["missing"] == []


def test_a_sigterm_outside_the_scripts_run_makes_rank0_stop_waiting_for_the_ranks() -> None:
    """memkit run gathers at the block's end, after the script's run: a SIGTERM there (torchrun
    stopping the job as a rank died) is held, and rank 0 must not wait the gather's timeout for
    the dead rank, past torchrun's grace period (its SIGKILL would lose the report)."""
    from memkit.distributed import _GIVE_UP
    from memkit.tracking.run import SignalGuard

    with SignalGuard() as guard:
        assert not _GIVE_UP.is_set()
        guard._handle(signal.SIGTERM, None)  # not armed: held
        assert guard.pending == signal.SIGTERM and _GIVE_UP.is_set()
    assert not _GIVE_UP.is_set()


def test_rank_stopped_by_torchrun_still_writes_its_report(tmp_path: Path) -> None:
    code, err = _torchrun(
        tmp_path, RANK1_RUNS_OUT, "--device", "cpu", "--budget", "64MiB", "--json", "r.json"
    )
    assert code != 0 and "closing signal SIGTERM" in err, err[-4000:]
    r1 = json.loads((tmp_path / "r.rank1.json").read_text())
    assert r1["oom"]["step"] == 3 and r1["steps"] == 3
    r0 = json.loads((tmp_path / "r.rank0.json").read_text())  # written although terminated
    note = next(n for n in r0["notes"] if n.startswith("interrupted by SIGTERM"))
    match = re.match(r"interrupted by SIGTERM at step (\d+) \(train.py line \d+", note)
    assert match and int(match.group(1)) == r0["steps"], note
    assert r0["oom"] is None
    # rank 0 printed its full report, marked as interrupted, with the conventional exit code
    assert f"[rank 0] memkit track rank 0/2: {r0['steps']} step(s)" in err
    assert "[rank 0] memkit: interrupted by SIGTERM at step" in err and "(exit 143)" in err
    rank1 = [line for line in err.splitlines() if line.startswith("[rank 1] memkit: ")]
    assert rank1 and "out of memory at step 3" in rank1[0], err[-4000:]


@pytest.mark.slow
def test_unused_parameters_that_stop_ddp_are_advised_on_each_failed_rank(tmp_path: Path) -> None:
    """Without find_unused_parameters, the unused module makes DDP fail at the next step
    ('Expected to have finished reduction'): the ranks end with that error; rank 0 does not
    wait for the others (rank 1 sends its summary all the same), so each rank's own report
    must say why, and rank 1's line must not promise rank 0's report."""
    (tmp_path / "ddp_net.py").write_text(NET)
    code, err = _torchrun(tmp_path, UNUSED_STOPS_DDP, "--device", "cpu", "--budget", "256MiB",
                          "--json", "r.json")  # fmt: skip
    assert code != 0 and "Expected to have finished reduction" in err, err[-4000:]
    for rank in (0, 1):
        data = json.loads((tmp_path / f"r.rank{rank}.json").read_text())
        advice = {a["code"]: a for a in data["advice"]}
        assert "aux_head" in advice["ddp-unused-parameters"]["evidence"], data["advice"]
        start = "ranks not gathered" if rank == 0 else SENT_AFTER_ERROR
        assert any(n.startswith(start) for n in data["notes"]), data["notes"]
    rank1 = [line for line in err.splitlines() if line.startswith("[rank 1] memkit: ")]
    sent = "summary sent to rank 0 (in its report if rank 0 ended normally)"
    assert rank1 and sent in rank1[0], err[-4000:]


def _summary(rank: int, peak: int, capacity: int | None = 1000, **kw) -> RankSummary:
    return RankSummary(rank, rank, "n", "cpu", peak, peak, capacity, "backward", 1, 3, **kw)


def test_ranks_report_imbalance_tightest_and_text() -> None:
    report = RanksReport((_summary(0, 500), _summary(1, 800, capacity=900)))
    assert report.imbalance == pytest.approx(300 / 800) and report.tightest_rank == 1
    text = str(report)
    assert "2 ranks" in text and "tightest" in text and "backward" in text
    assert report.to_dict()["tightest_rank"] == 1 and "tightest" in report._repr_html_()
    # without capacities: the largest peak
    assert RanksReport((_summary(0, 900, None), _summary(1, 800, None))).tightest_rank == 0


def test_ddp_unused_parameters_fires_and_names_modules() -> None:
    advice = ddp_unused_parameters(
        {0: ["module.aux.weight", "module.aux.bias"], 1: ["module.aux.weight"]},
        unused_bytes=4096,
        find_unused_parameters=False,
    )
    assert advice is not None and advice.code == "ddp-unused-parameters"
    assert "aux" in advice.evidence and "Expected to have finished reduction" in advice.evidence
    assert "find_unused_parameters=True" in advice.evidence and advice.saving_bytes == 4096
    # the parameters are half of it, the other half their bucket slots (sweep BW: 100.78 KiB
    # of parameters were said where aux_head is 50.39 KiB)
    assert "2 trainable parameter(s) (2.00 KiB) had no gradient" in advice.evidence
    assert "buckets, 4.00 KiB" in advice.action and "half of that" in advice.action


def test_ddp_unused_parameters_silent_when_every_parameter_has_a_gradient() -> None:
    assert ddp_unused_parameters({0: [], 1: []}, find_unused_parameters=True) is None
    assert not [a for a in rank_advice((_summary(0, 1), _summary(1, 1))) if "unused" in a.code]


def test_ddp_gpu0_context_fires_when_ranks_share_gpu0() -> None:
    readings = [
        ContextReading(0, 0, True, 0, "node-a"),
        ContextReading(1, 1, True, 0, "node-a"),  # forgot set_device(1)
        ContextReading(2, 2, True, 0, "node-a"),  # and so did rank 2
    ]
    advice = ddp_gpu0_context(readings)
    assert advice is not None and advice.code == "ddp-gpu0-context"
    assert "Rank(s) 1, 2" in advice.evidence and "set_device(local_rank)" in advice.action
    via_summaries = rank_advice(
        (
            _summary(0, 1, cuda_initialized=True, current_device=0),
            _summary(1, 1, cuda_initialized=True, current_device=0),
        )
    )
    assert [a.code for a in via_summaries] == ["ddp-gpu0-context"]


def test_ddp_gpu0_context_silent_when_each_rank_has_its_gpu() -> None:
    good = [ContextReading(0, 0, True, 0), ContextReading(1, 1, True, 1)]
    assert ddp_gpu0_context(good) is None
    # local rank 0 on two different nodes both use their own GPU 0: fine
    nodes = [ContextReading(0, 0, True, 0, "a"), ContextReading(1, 0, True, 0, "b")]
    assert ddp_gpu0_context(nodes) is None
    # CPU-only ranks never initialised CUDA
    assert (
        ddp_gpu0_context([ContextReading(0, 0, False, None), ContextReading(1, 1, False, None)])
        is None
    )


# DDP wrapped inside the block, as a script under memkit run wraps it: its Reducer's buckets
DDP_BUCKETS = textwrap.dedent(
    """
    import torch, memkit
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

    def train(wrap, steps):
        with memkit.track(device="cpu", budget="64MiB") as tracker:
            model = DDP(net()) if wrap else net()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _ in range(steps):
                x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return tracker.report().to_dict()["devices"][0]["breakdown"]

    def run(rank, args):
        grads = sum(p.numel() * p.element_size() for p in net().parameters())
        return {"grads": grads, "plain": [train(False, s) for s in (1, 2)],
                "ddp": [train(True, s) for s in (1, 2)]}
    """
)

rank_scenario("ddp-buckets", DDP_BUCKETS)


def test_ddp_gradient_buckets_have_their_own_category(gloo_ranks) -> None:
    # they were 'other' with the peak in step 1 (on the device when the forward began) and
    # 'activations' with it in step 0 (the simulated device found them in backward)
    for rank in gloo_ranks("ddp-buckets").results:
        assert "traceback" not in rank, rank.get("traceback")
        for plain, ddp in zip(rank["plain"], rank["ddp"], strict=True):
            assert ddp["gradient_buckets"] == rank["grads"]  # one copy of the gradients
            assert plain["gradient_buckets"] == 0
            # the rest as without DDP: the buckets are all it adds at the peak (and, timing,
            # a few scalars of gloo's: 4 and 20 B seen, about 1 run in 10)
            for part in ("parameters", "gradients", "optimizer_state"):
                assert ddp[part] == plain[part], (part, plain, ddp)
            for part in ("activations", "other"):
                assert abs(ddp[part] - plain[part]) <= 64, (part, plain, ddp)
            assert abs(ddp["total"] - plain["total"] - rank["grads"]) <= 64


def test_a_rank_whose_peak_is_an_evaluation_says_eval_not_the_training_peaks_phase() -> None:
    """Sweep BW: the per-rank table said "phase backward" for a 4.81 MiB peak that was the
    evaluation's; backward's own peak was 446 KiB (the breakdown is training's peak)."""
    import torch

    from memkit import track
    from memkit.tracking.rank_gather import summarize

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(2):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(torch.randn(4096, 64))
    report = tracker.report()
    peaks = report.devices[0].phase_peaks
    assert peaks["eval"] > peaks["backward"] and report.devices[0].breakdown.phase != "eval"
    assert summarize(report, {}).peak_phase == "eval"


def test_a_rank_that_caught_an_oom_is_marked_in_rank_0s_table() -> None:
    """Sweep BW: rank 1 caught an OOM and went on; its own report said so, rank 0's table (the
    "full report") showed it at 1% used with no mark."""
    import contextlib

    import torch

    from memkit import track
    from memkit.render.track import rank_rows

    model = torch.nn.Linear(256, 256)
    with track(model, device="cpu", budget="4MiB") as tracker:
        with contextlib.suppress(torch.OutOfMemoryError):  # a handler that skips the batch
            model(torch.randn(8192, 256)).sum().backward()  # 8 MiB of output: runs out
        model(torch.randn(8, 256)).sum().backward()
    assert tracker.caught_ooms == 1
    report = RanksReport((_summary(0, 500), _summary(1, 100, ooms_caught=tracker.caught_ooms)))
    rows = {row[0]: row[-1] for row in rank_rows(report)}
    assert rows[1] == "caught 1 OOM(s)" and "caught" not in str(rows[0])
