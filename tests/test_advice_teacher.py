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
    evaluation a smaller batch. There is no evaluation between steps to shrink."""
    report = distil(tmp_path, teacher_after=teacher_after, views=2, checkpointed=True)
    dev = report.devices[0]
    training = max(dev.phase_peaks[p] or 0 for p in ("forward", "backward", "optimizer"))
    assert (dev.phase_peaks["eval"] or 0) > 1.1 * training  # (as eval-peak's own test)
    assert advice_of(report, "eval-peak") is None, advice_of(report, "eval-peak")
