"""memkit.track on the simulated device: models and tensors beside the tracked model are device
memory (a distillation teacher, an EMA copy), a model called with keyword tensors, and tensors
counted past the budget. Each number is checked against bytes summed here from ``nbytes``."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memkit.tracking import TrackReport, track
from memkit.units import format_size

B, D, H, C = 32, 64, 1024, 10  # batch, features, the teacher's width, classes


def nbytes(*objects: nn.Module | torch.Tensor) -> int:
    """Bytes of the parameters and buffers (or tensors) given, each storage once."""
    seen: dict[int, int] = {}
    for obj in objects:
        tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module) else [obj]
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def distill(
    student_model: bool, teacher_first: bool, budget: int | None = None
) -> tuple[TrackReport, int, int, int, str | None]:
    """A knowledge-distillation loop: a frozen teacher under ``no_grad`` on the training batch,
    a student trained on the KL to its outputs. ``student_model``: ``track(student, opt)``,
    else ``track(optimizer=opt)`` (as ``memkit run`` tracks). Returns the report, the
    student's, the teacher's and one batch's bytes, and the OOM message if it ran out."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C)).eval()
    teacher.requires_grad_(False)
    student = nn.Linear(D, C)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        if teacher_first:
            with torch.no_grad():
                t_logits = teacher(x)
            s_logits = student(x)
        else:
            s_logits = student(x)
            with torch.no_grad():
                t_logits = teacher(x)
        soft = F.kl_div(F.log_softmax(s_logits, 1), F.softmax(t_logits, 1), reduction="batchmean")
        loss = 0.9 * soft + 0.1 * F.cross_entropy(s_logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    model = student if student_model else None
    oom = None
    try:
        with track(model, opt, device="cpu", budget=budget, postmortem=None) as tracker:
            for _ in range(3):
                train_step(torch.randn(B, D), torch.randint(0, C, (B,)))
    except torch.OutOfMemoryError as exc:
        oom = str(exc)
    return tracker.report(), nbytes(student), nbytes(teacher), B * D * 4, oom


@pytest.mark.parametrize("teacher_first", [True, False])
def test_a_distillation_teacher_beside_the_tracked_student_is_device_memory(
    teacher_first: bool,
) -> None:
    """``track(student, opt)`` with a teacher run under ``no_grad``: on a GPU the teacher is on
    the device. Its weights and its forward were never counted (a peak of 3.10 MiB for a script
    whose teacher alone is 7.11 MiB, so ``--budget 6MiB`` passed). The peak is the teacher's
    forward: both models, the batch, and the first layer's output beside its ReLU's; a student
    that ran first keeps its logits through it. The phases are a GPU's: the teacher's forward
    is in the phase it runs in (before the student's forward: "other"), no module row."""
    report, student, teacher, batch, oom = distill(True, teacher_first)
    assert oom is None
    kept = 0 if teacher_first else B * C * 4
    dev = report.devices[0]
    assert dev.peak_allocated == student + teacher + batch + 2 * B * H * 4 + kept
    assert dev.phase_peaks["other" if teacher_first else "forward"] == dev.peak_allocated
    assert report.eval_forwards == 0 and {m.path for m in dev.modules} == {"Linear"}
    # what memkit run (every model found) counts
    found, *_ = distill(False, teacher_first)
    assert found.devices[0].peak_allocated == report.devices[0].peak_allocated


@pytest.mark.parametrize("student_model", [True, False])
def test_a_teacher_counted_past_the_budget_says_why_in_use_exceeds_it(student_model: bool) -> None:
    """A teacher larger than the budget: counting a model found running never raises (it
    existed before), the next allocation does. The OOM message and the report say why in use
    is above the capacity (on a GPU, ``teacher.to(device)`` would have failed: "7.88 MiB in use
    ... capacity 6.00 MiB" said nothing); the excess is the student, the teacher and the batch
    less the budget."""
    _, student, teacher, batch, _ = distill(student_model, teacher_first=True)
    budget = student + teacher // 2
    report, *_, oom = distill(student_model, teacher_first=True, budget=budget)
    assert oom is not None and "counted past it when first used" in oom, oom
    assert report.oom is not None and report.devices[0].peak_allocated > budget
    excess = format_size(student + teacher + batch - budget)
    assert any(f"took it {excess} past its" in note for note in report.notes), report.notes
    # within the budget nothing is said
    fits, *_, oom = distill(student_model, teacher_first=True, budget=2 * (student + teacher))
    assert oom is None and not any("past its" in note for note in fits.notes)


class ModelEmaV2(nn.Module):
    """timm's ModelEmaV2, as timm writes it: a deep copy updated under ``no_grad`` after each
    optimizer step by ``ema_v.copy_(decay * ema_v + (1 - decay) * model_v)``."""

    def __init__(self, model: nn.Module, decay: float = 0.99) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay

    def _update(self, model: nn.Module, update_fn: Callable[..., torch.Tensor]) -> None:
        with torch.no_grad():
            for ema_v, model_v in zip(
                self.module.state_dict().values(), model.state_dict().values(), strict=True
            ):
                ema_v.copy_(update_fn(ema_v, model_v))

    def update(self, model: nn.Module) -> None:
        self._update(model, update_fn=lambda e, m: self.decay * e + (1.0 - self.decay) * m)


def update_v3(ema: ModelEmaV2, model: nn.Module, lerp: bool = True) -> None:
    """timm's ModelEmaV3 ``foreach`` update: floating tensors lerped as lists, others copied;
    ``lerp=False``: its fallback, ``_foreach_mul_`` then ``_foreach_add_``."""
    with torch.no_grad():
        ema_lerp, model_lerp = [], []
        for ema_v, model_v in zip(
            ema.module.state_dict().values(), model.state_dict().values(), strict=True
        ):
            if ema_v.is_floating_point():
                ema_lerp.append(ema_v)
                model_lerp.append(model_v)
            else:
                ema_v.copy_(model_v)
        if lerp:
            torch._foreach_lerp_(ema_lerp, model_lerp, weight=1.0 - ema.decay)
        else:
            torch._foreach_mul_(ema_lerp, ema.decay)
            torch._foreach_add_(ema_lerp, model_lerp, alpha=1.0 - ema.decay)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),  # buffers: running statistics and an int64 batch counter
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )


def ema_run(
    update: str | None, given: bool = True, steps: int = 3, every: int = 3
) -> tuple[TrackReport, int]:
    """Train a small CNN with an EMA copy updated after each step (``update``: ``"v2"``,
    ``"v3"``, ``"v3-mul-add"``, ``"made-inside"``: a V2 made inside the block; ``None``: no
    EMA) and evaluated with a small batch every ``every`` steps. ``given``: ``track(model,
    opt)``, else ``track(optimizer=opt)``. Returns the report and the EMA's bytes."""
    torch.manual_seed(0)
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = ModelEmaV2(model) if update not in (None, "made-inside") else None
    with track(model if given else None, opt, device="cpu", postmortem=None) as tracker:
        if update == "made-inside":
            ema = ModelEmaV2(model)
        for step in range(steps):
            x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ema is not None:
                if update in ("v2", "made-inside"):
                    ema.update(model)
                else:
                    update_v3(ema, model, lerp=update == "v3")
                if (step + 1) % every == 0:
                    with torch.no_grad():
                        ema.module(torch.randn(2, 3, 16, 16))
    return tracker.report(), 0 if ema is None else nbytes(ema.module)


@pytest.mark.parametrize("update", ["v2", "v3", "v3-mul-add", "made-inside"])
def test_an_ema_updated_as_timm_writes_it_is_device_memory_from_its_first_update(
    update: str,
) -> None:
    """On a GPU an EMA copy lives on the device. Updated between steps by ``copy_`` of new
    tensors (timm's ModelEmaV2), no op wrote from a counted tensor, so the copy was counted at
    its first forward only (a peak 2,181,944 B low, all of the EMA). Tensors computed between
    steps from counted ones are device-derived: a write from them is device work. The peak
    with the EMA is the peak without it plus the EMA's parameters and buffers, also for
    timm's ModelEmaV3 list updates and a copy made inside the block."""
    without, _ = ema_run(None)
    with_ema, ema_bytes = ema_run(update)
    assert ema_bytes > 0
    assert with_ema.devices[0].peak_allocated - without.devices[0].peak_allocated == ema_bytes


def test_an_ema_found_at_its_first_evaluation_is_no_growth_of_the_training_state() -> None:
    """``memkit run`` (models found running) on a script that evaluates its EMA every few
    steps: the EMA was counted at its first evaluation, and the report explained the rise as
    "parameters made trainable mid-run". It is counted from its first update: every step from
    the second on has the same peak, no note, and the peak is the EMA's bytes above the run
    without one."""
    without, _ = ema_run(None, given=False, steps=8)
    report, ema_bytes = ema_run("v2", given=False, steps=8, every=4)
    assert not any("made trainable" in note for note in report.notes), report.notes
    peaks = {s.peak_allocated for s in report.devices[0].steps[1:]}
    assert len(peaks) == 1, peaks
    assert report.devices[0].peak_allocated - without.devices[0].peak_allocated == ema_bytes


class TwoViews(nn.Module):
    """MoCo's shape: a query encoder trained, a key encoder under ``no_grad``, each on its own
    view, given as keyword arguments (``model(im_q=..., im_k=...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            k = F.normalize(self.encoder_k(im_k), dim=1)
        return (q * k).sum(1)


@pytest.mark.parametrize("given", [False, True])
def test_a_model_called_with_keyword_tensors_gets_them_as_its_batch(given: bool) -> None:
    """Found by torch's global pre-hook (``memkit run``), which is given no keyword arguments,
    a model called as ``model(im_q=..., im_k=...)`` had its batch counted inside its first
    layers: the query encoder's first conv kept 2.75 MiB for its 2.00 MiB output. Its keyword
    tensors are its inputs, as for the model given to track() and for a call by position: each
    layer keeps its output's bytes, and the module rows are the same."""

    def rows(by_keyword: bool) -> dict[str, tuple[int, int]]:
        torch.manual_seed(0)
        model = TwoViews()
        opt = torch.optim.SGD(model.encoder_q.parameters(), lr=0.1)
        with track(model if given else None, opt, device="cpu", postmortem=None) as tracker:
            for _ in range(2):
                x = torch.randn(16, 3, 16, 16)
                im_q, im_k = x + 0.1 * torch.randn_like(x), x.flip(3)
                out = model(im_q=im_q, im_k=im_k) if by_keyword else model(im_q, im_k)
                out.mean().backward()
                opt.step()
                opt.zero_grad()
        found = tracker.report().devices[0].modules
        return {m.path: (m.activation_bytes, m.self_activation_bytes) for m in found}

    by_keyword = rows(by_keyword=True)
    conv_output = 16 * 8 * 16 * 16 * 4
    # the conv's output dies in the ReLU, which keeps its own: a batch counted in the conv
    # would show here
    assert by_keyword["encoder_q.0"] == (0, 0)
    assert by_keyword["encoder_q.1"] == (conv_output, conv_output)  # ReLU: its own output
    assert by_keyword == rows(by_keyword=False)
