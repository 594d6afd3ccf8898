"""memkit.track on virtual devices: the per-device table of memkit's DataParallel stand-in, and
the dp-to-ddp rule against what DDP measures on the same devices."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from torch import nn

import memkit
from memkit.simulated.parallel import DataParallel, ddp_replicas

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from cnn import SmallCNN, train_step

GPUS = 4


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _track_dp(model: nn.Module, batch, gpus: int = GPUS, optimizer=_sgd, step=train_step):
    """Two tracked DataParallel steps; the report and the accountant's own peaks."""
    with memkit.simulate("64MiB", devices=gpus) as vd:
        vd.to(model, 0)
        opt = optimizer(model)
        dp = DataParallel(model)
        with memkit.track(dp, opt) as tracker:
            for _ in range(2):
                step(dp, batch(), opt)
        return tracker.report(), vd.peaks, [vd.current_of(i) for i in range(gpus)]


def _ddp_peak(model: nn.Module, batch, gpus: int = GPUS, optimizer=_sgd, step=train_step) -> int:
    """DDP's per-device peak on the same devices (memkit.simulated.parallel.ddp_replicas)."""
    with memkit.simulate(None, devices=gpus) as vd:
        for rank in ddp_replicas(model, optimizer):
            with vd.on(rank.device):
                for _ in range(2):
                    step(rank.model, batch(), rank.optimizer)
        assert len(set(vd.peaks)) == 1
        return vd.peaks[0]


def _cnn_batch(n: int):
    return lambda: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))


def test_a_dataparallel_report_made_after_the_model_is_gone_keeps_its_advice() -> None:
    """A notebook cell's DataParallel model goes out of scope; the tracker, kept for its
    report, holds it weakly: the report still knows its devices and keeps dp-to-ddp."""

    def cell():
        torch.manual_seed(0)
        with memkit.simulate("64MiB", devices=GPUS) as vd:
            model = SmallCNN()
            vd.to(model, 0)
            opt = _sgd(model)
            dp = DataParallel(model)
            with memkit.track(dp, opt) as tracker:
                for _ in range(2):
                    train_step(dp, _cnn_batch(32)(), opt)
            return tracker, tracker.report()

    tracker, inside = cell()
    gc.collect()
    after = tracker.report()
    assert "dp-to-ddp" in [a.code for a in inside.advice]
    assert after.to_json() == inside.to_json() and after.dp_output_device == "cuda:0"


def test_track_gives_each_virtual_device_its_peak_and_dp_to_ddp_says_ddp_costs_more() -> None:
    torch.manual_seed(0)
    report, peaks, current = _track_dp(SmallCNN(), _cnn_batch(32))
    rows = {d.device: d for d in report.devices}
    assert list(rows) == [f"cuda:{i}" for i in range(GPUS)]
    assert [rows[f"cuda:{i}"].peak_allocated for i in range(GPUS)] == peaks
    assert [rows[f"cuda:{i}"].final_allocated for i in range(GPUS)] == current
    p = sum(t.numel() * 4 for t in SmallCNN().parameters())
    bufs = sum(b.numel() * b.element_size() for b in SmallCNN().buffers())
    # after the steps cuda:0 keeps the weights, the BatchNorm buffers and the momentum; the
    # others nothing (the replicas are gone, gradients set to None)
    assert current == [2 * p + bufs, 0, 0, 0]
    bd = rows["cuda:0"].breakdown
    assert bd is not None and bd.gradients == p and bd.optimizer_state == p
    dp_advice = [a for a in report.advice if a.code == "dp-to-ddp"]
    assert len(dp_advice) == 1
    adv = dp_advice[0]
    # the estimate: a replica's peak + DDP's bucket copy + momentum; DDP measured on the
    # same devices agrees within 2%, and it is above cuda:0's peak: no switch promised
    mean = sum(peaks[1:]) // (GPUS - 1)
    estimate = mean + p + p
    ddp = _ddp_peak(SmallCNN(), _cnn_batch(32 // GPUS))
    assert abs(estimate - ddp) <= 0.02 * ddp and ddp > peaks[0]
    assert adv.severity == "info" and adv.saving_bytes is None
    assert "would not save memory" in adv.title and "DistributedSampler" not in adv.action
    payload = json.loads(report.to_json())
    assert [d["peak_allocated"] for d in payload["devices"]] == peaks
    assert any(a["code"] == "dp-to-ddp" for a in payload["advice"])
    html = report._repr_html_()
    assert "cuda:3" in html and "dp-to-ddp" in html
    assert "cuda:3" in str(report) and "would not save memory" in str(report)


class Wide(nn.Module):
    """Small weights, wide outputs: DataParallel gathers them (and their gradient) on cuda:0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _wide_batch(n: int):
    return lambda: (torch.randn(n, 64), torch.randint(0, 4096, (n,)))


def test_dp_to_ddp_advises_ddp_where_it_saves_memory_and_is_silent_on_one_device() -> None:
    torch.manual_seed(0)
    report, peaks, _ = _track_dp(Wide(), _wide_batch(512))
    adv = next(a for a in report.advice if a.code == "dp-to-ddp")
    ddp = _ddp_peak(Wide(), _wide_batch(512 // GPUS))
    p = sum(t.numel() * 4 for t in Wide().parameters())
    # a replica's peak + the bucket copy + momentum + the loss on the rank's share of the
    # outputs (the share and its gradient: 2 x 512 x 4096 x 4 / 4 bytes); up to the weights
    # more (DataParallel frees a replica's weights during backward, DDP keeps them)
    estimate = sum(peaks[1:]) // (GPUS - 1) + 2 * p + 2 * 512 * 4096 * 4 // GPUS
    assert abs(estimate - ddp) <= 0.02 * ddp and ddp < peaks[0]
    assert adv.severity == "warning" and adv.saving_bytes == peaks[0] - (estimate + p)
    assert "DDP would peak near 9.08 MiB to 10.09 MiB" in adv.title
    assert "torchrun --nproc_per_node 4" in adv.action
    # the same model on one device (DataParallel over one device, then no wrapper): silent
    single, one_peaks, _ = _track_dp(Wide(), _wide_batch(512), gpus=1)
    assert [d.peak_allocated for d in single.devices] == one_peaks
    assert not any(a.code == "dp-to-ddp" for a in single.advice)
    with memkit.simulate("64MiB", devices=2) as vd:
        model = vd.to(Wide(), 0)
        opt = _sgd(model)
        with memkit.track(model, opt) as tracker:
            for _ in range(2):
                train_step(model, _wide_batch(512)(), opt)
    plain = tracker.report()
    assert [d.device for d in plain.devices] == ["cuda:0"]
    assert plain.devices[0].peak_allocated == vd.peak_of(0) and vd.peak_of(1) == 0
    assert not any(a.code == "dp-to-ddp" for a in plain.advice)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters())


def _mse_step(model: nn.Module, batch, optimizer: torch.optim.Optimizer) -> None:
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64))


def test_dp_to_ddp_counts_the_weights_a_replica_frees_and_a_ddp_rank_keeps() -> None:
    """A replica's first Linear saves no weight (its input needs no gradient): DataParallel
    frees the replica's weight copy during backward, where a DDP rank keeps its weights and
    peaks later, one weight copy above "replica + buckets + state + loss". On 2 GPUs at global
    batch 256 that DDP rank peaks above cuda:0 (measured on the same devices by ddp_replicas,
    4,048,148 B as a real gloo rank at per-rank batch 128): the rule must not advise DDP."""
    p = sum(t.numel() * 4 for t in _mlp().parameters())
    for gpus, batch, saves in ((2, 256, False), (4, 1024, True)):
        report, peaks, _ = _track_dp(_mlp(), lambda n=batch: (torch.randn(n, 64),
                                     torch.randn(n, 64)), gpus, _adamw, _mse_step)  # fmt: skip
        adv = next(a for a in report.advice if a.code == "dp-to-ddp")
        n = batch // gpus
        ddp = _ddp_peak(_mlp(), lambda n=n: (torch.randn(n, 64), torch.randn(n, 64)), gpus,
                        _adamw, _mse_step)  # fmt: skip
        assert (ddp < peaks[0]) is saves, (gpus, ddp, peaks)
        # the estimate's range: a replica's peak + buckets + AdamW's state + the loss on the
        # rank's share of the outputs, and up to one copy of the weights more; DDP within it
        low = sum(peaks[1:]) // (gpus - 1) + p + 2 * p + 2 * batch * 64 * 4 // gpus
        assert low < ddp <= (low + p) * 1.0001, (gpus, low, ddp)  # the loss heuristic: +-4 B
        if saves:
            assert adv.severity == "warning" and "Use DistributedDataParallel" in adv.action
            assert adv.saving_bytes == peaks[0] - (low + p)
        else:  # the range straddles cuda:0's peak: no switch promised
            assert adv.severity == "info" and adv.saving_bytes is None
            assert "DDP may not save memory here" in adv.title and low < peaks[0] <= low + p
            assert "--strategies dp,ddp" in adv.action and "torchrun" not in adv.action
    assert ddp == 5_719_316  # as a real gloo rank at per-rank batch 256 (docs/distributed.md)


def test_a_peak_categorised_after_main_returned_keeps_the_gradients() -> None:
    """On a device that counts everything (a GPU, a virtual device), a new peak in "other"
    after the last step is categorised when the block ends: in `memkit run`, after the
    script's main() returned and its model is gone. The gradients it held are still named."""
    params = (64 * 256 + 256 + 256 * 10 + 10) * 4

    def main() -> None:
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(32, 64)).sum().backward()
            opt.step()
        big = torch.zeros(params)  # after the last step (4x the parameters), gradients alive
        del big

    with memkit.simulate("64MiB", devices=1), memkit.track() as tracker:
        main()
    bd = tracker.report().devices[0].breakdown
    assert bd is not None and bd.phase == "other" and bd.step == 3
    assert bd.parameters == params and bd.gradients == params


def test_a_validation_batch_between_backward_and_the_step_returns_to_the_step() -> None:
    """An evaluation pass after backward and before optimizer.step() is inside the step: what
    follows it (gradient clipping's temporaries) is the step's, not evaluation's."""
    with memkit.simulate("64MiB", devices=1):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with memkit.track(model, opt) as tracker:  # the optimizer is known from step 0
            for _ in range(3):
                model.train()
                model(torch.randn(32, 64)).sum().backward()
                model.eval()
                with torch.no_grad():
                    model(torch.randn(8, 64))
                model.train()
                scratch = torch.zeros(4 * 1024 * 1024)  # 16 MiB in the gap, as a clipping buffer
                del scratch
                opt.step()
                opt.zero_grad()
    report = tracker.report()
    dev = report.devices[0]
    assert dev.phase_peaks["other"] >= 16 * 1024 * 1024 > dev.phase_peaks["eval"]
    assert "eval-peak" not in {a.code for a in report.advice}


def test_new_models_and_a_teacher_do_not_fool_the_gradient_check() -> None:
    """The parameter that tells whether gradients are alive: a fold's new model replaces the
    last one's (no false zero-grad-keeps-grads), and a distillation teacher seen first (its
    parameters require grad but never get one) does not hide the student's gradients."""
    with memkit.simulate("64MiB", devices=1), memkit.track() as tracker:
        for _ in range(2):  # two folds, each with its own model, zero_grad before backward
            model = nn.Linear(8, 8)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
            del model, opt
    folds = tracker.report()
    assert folds.steps_with_grads_at_forward == 0
    assert "zero-grad-keeps-grads" not in {a.code for a in folds.advice}

    with memkit.simulate("64MiB", devices=1), memkit.track() as tracker:
        teacher = nn.Linear(64, 10).eval()
        student = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
        opt = torch.optim.Adam(student.parameters())
        for _ in range(3):
            x = torch.randn(32, 64)
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = nn.functional.cross_entropy(student(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    bd = tracker.report().devices[0].breakdown
    assert bd is not None
    assert bd.gradients == sum(p.numel() * 4 for p in student.parameters())
