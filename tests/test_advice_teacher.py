"""Advice on knowledge distillation run as people write it (``memkit run``): a frozen teacher
(``eval()``, ``requires_grad_(False)``, called under ``no_grad``) inside each training step,
a student of a few blocks trained with AdamW.

Session 29's sweep: with the teacher's forward after the student's, checkpointing the student
said nothing where it lowered the peak by a third (the teacher's pass, booked in the eval
column, holds the student's activations and falls with them); with the teacher fed the
batch and an augmented copy of it (twice the rows), ``eval-peak`` told the user to give
evaluation a smaller batch. Each claim is checked against the script run with the advice
applied.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memkit.advice.form import Advice
from memkit.tracking.report import TrackReport
from memkit.tracking.run import run_script
from memkit.units import format_size

SCRIPT = '''"""Knowledge distillation: a frozen teacher, a student trained with AdamW."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH, ROWS, CLASSES = 128, {rows}, 10


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth, width, checkpointed=False):
        super().__init__()
        self.embed = nn.Linear(WIDTH, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def soft_targets(teacher, x, T):
    with torch.no_grad():
        views = torch.cat([x] + [x + 0.1 * torch.randn_like(x) for _ in range({views} - 1)])
        return F.softmax(teacher(views)[: len(x)] / T, dim=-1)


def train(student, teacher, opt, epochs=1, steps=4, T=2.0):
    student.train()
    for _ in range(epochs):
        for _ in range(steps):
            x, y = torch.randn(ROWS, WIDTH), torch.randint(0, CLASSES, (ROWS,))
            if not {teacher_after}:
                soft = soft_targets(teacher, x, T)
            logits = student(x)
            if {teacher_after}:
                soft = soft_targets(teacher, x, T)
            kd = F.kl_div(F.log_softmax(logits / T, dim=-1), soft, reduction="batchmean") * T * T
            loss = kd + F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def main():
    torch.manual_seed(0)
    teacher = Net(6, 256)
    teacher.eval()
    teacher.requires_grad_(False)
    student = Net(4, WIDTH, checkpointed={checkpointed})
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    train(student, teacher, opt)


if __name__ == "__main__":
    main()
'''


def distil(
    tmp_path: Path,
    *,
    teacher_after: bool,
    views: int = 1,
    checkpointed: bool = False,
    rows: int = 1024,
    budget: str = "64MiB",
) -> TrackReport:
    """``memkit run --device cpu`` of the distillation script: the teacher's forward before
    or after the student's, on ``views`` times the student's rows, the student's blocks
    checkpointed or not."""
    script = tmp_path / f"distil_{teacher_after}_{views}_{checkpointed}.py"
    script.write_text(
        SCRIPT.format(
            rows=rows, views=views, teacher_after=teacher_after, checkpointed=checkpointed
        )
    )
    outcome = run_script(script, device="cpu", budget=budget)
    assert outcome.exit_code == 0, outcome.traceback
    return outcome.report


def advice_of(report: TrackReport, code: str) -> Advice | None:
    """The report's advice of ``code``, if it fired."""
    return next((a for a in report.advice if a.code == code), None)


def test_checkpointing_the_student_is_priced_where_the_teacher_runs_after_its_forward(
    tmp_path: Path,
) -> None:
    """The teacher's pass after the student's forward holds the student's activations: it is
    the device's peak, and it falls with them. The advice said nothing (the eval column was
    taken as a floor no checkpointing lowers) where checkpointing saved a third of the peak;
    its claim now matches the saving measured with it applied."""
    report = distil(tmp_path, teacher_after=True)
    dev = report.devices[0]
    assert dev.eval_in_step == dev.phase_peaks["eval"] == dev.peak_allocated
    advice = advice_of(report, "activation-checkpointing")
    assert advice is not None, [a.code for a in report.advice]
    applied = distil(tmp_path, teacher_after=True, checkpointed=True)
    saved = dev.peak_allocated - applied.devices[0].peak_allocated
    claim = advice.saving_bytes or 0
    assert saved > 0 and 0.9 * saved <= claim <= 1.1 * saved, (
        f"claimed {format_size(claim)}, checkpointing saved {format_size(saved)}"
    )
    assert "after the training forward" in advice.evidence


def test_checkpointing_claims_no_more_than_the_teacher_before_the_forward_leaves(
    tmp_path: Path,
) -> None:
    """The teacher's pass before the student's forward (on twice the rows) holds none of the
    student's activations: it stays where it is, and the claim is the peak's fall to it."""
    report = distil(tmp_path, teacher_after=False, views=2)
    applied = distil(tmp_path, teacher_after=False, views=2, checkpointed=True)
    saved = report.devices[0].peak_allocated - applied.devices[0].peak_allocated
    advice = advice_of(report, "activation-checkpointing")
    claim = 0 if advice is None else advice.saving_bytes or 0
    assert claim <= 1.1 * saved, (
        f"claimed {format_size(claim)}, checkpointing saved {format_size(saved)}"
    )


@pytest.mark.parametrize("teacher_after", [False, True], ids=["teacher-first", "teacher-after"])
def test_a_teacher_on_twice_the_rows_is_not_an_evaluation_that_peaks(
    tmp_path: Path, teacher_after: bool
) -> None:
    """A teacher fed the batch and an augmented copy of it runs in every step: the tracker
    books its forwards as evaluation (another batch size than the student's), which peaked
    above training once the student was checkpointed, and ``eval-peak`` told the user to give
    evaluation a smaller batch. Inside the step (after the student's forward) it is the
    step's memory: nothing. Before the student's forward the report cannot tell it from an
    averaged copy validated every step (review CL): both readings, the teacher's remedy
    first (its forward in chunks under no_grad)."""
    report = distil(tmp_path, teacher_after=teacher_after, views=2, checkpointed=True)
    dev = report.devices[0]
    training = max(dev.phase_peaks[p] or 0 for p in ("forward", "backward", "optimizer"))
    assert (dev.phase_peaks["eval"] or 0) > 1.1 * training  # (as eval-peak's own test)
    found = advice_of(report, "eval-peak")
    if teacher_after:
        assert found is None, found
    else:
        assert found is not None and "in chunks of the batch" in found.action
        assert "in most steps" in found.title
        assert "Give evaluation its own" not in found.action


VALIDATES = """
import copy
import torch
import torch.nn.functional as F
from torch import nn


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 10))
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xv = torch.randn(4096, 128)  # the validation batch: 16x the training batch
    for i in range(8):
        x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))
        (F.cross_entropy(model(x), y) / 2).backward()
        if KIND == "between" and i % 2 == 0:  # validated between backward and the step
            model.eval()
            with torch.no_grad():
                model(xv).argmax(-1)
            model.train()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.mul_(0.99).add_(p, alpha=0.01)
                if KIND == "ema":
                    ema(xv).argmax(-1)


main()
"""


@pytest.mark.parametrize("kind", ["between", "ema"])
def test_a_validation_in_or_after_every_step_still_gets_eval_peak(
    tmp_path: Path, kind: str
) -> None:
    """Review CL: the teacher rules silenced ``eval-peak`` for real validations, the trained
    model's between backward and the optimizer step (gradient accumulation; booked inside
    the step) and an EMA copy's after every step (a model no optimizer trains, run in every
    step, as a teacher is). The first is evaluation; the second is said both ways."""
    script = tmp_path / f"validates_{kind}.py"
    script.write_text(f"KIND = {kind!r}\n" + VALIDATES)
    result = run_script(str(script), [], device="cpu", budget="256MiB")
    assert result.exit_code == 0, result.traceback
    found = advice_of(result.report, "eval-peak")
    assert found is not None and found.saving_bytes
    if kind == "between":
        assert "Give evaluation its own, smaller batch size" in found.action
    else:
        assert "validated every step" in found.action


PSEUDO_LABELS = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                      nn.Linear(512, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(6):
    x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))
    unlabeled = torch.randn(256 * 7, 128)
    supervised = F.cross_entropy(model(x), y)
    with torch.no_grad():  # pseudo-labels, after the labelled forward: its graph is alive
        confidence, pseudo = model(unlabeled).softmax(-1).max(-1)
    strong = unlabeled[:256] + 0.1 * torch.randn(256, 128)
    kept = (confidence[:256] > 0.95).float()
    unsupervised = (F.cross_entropy(model(strong), pseudo[:256], reduction="none") * kept).mean()
    (supervised + unsupervised).backward()
    opt.step()
    opt.zero_grad()
"""


def test_pseudo_labels_inside_the_step_are_no_evaluation(tmp_path: Path) -> None:
    """Review CM: FixMatch's trained model labels 7x the rows under no_grad between its
    labelled forward and the step's backward: training's work, with the step's graph alive.
    It was told to give evaluation its own, smaller batch (3.98 MiB claimed), where there is
    no evaluation; a validation between backward and the optimizer step keeps the advice
    (test_a_validation_in_or_after_every_step_still_gets_eval_peak)."""
    script = tmp_path / "fixmatch.py"
    script.write_text(PSEUDO_LABELS)
    result = run_script(str(script), [], device="cpu", budget="1GiB")
    assert result.exit_code == 0, result.traceback
    dev = result.report.devices[0]
    training = max(dev.phase_peaks[p] or 0 for p in ("forward", "backward", "optimizer"))
    assert (dev.phase_peaks["eval"] or 0) > 1.1 * training  # (as eval-peak's own test)
    assert dev.eval_in_forward == dev.eval_in_step == dev.phase_peaks["eval"]
    assert advice_of(result.report, "eval-peak") is None
