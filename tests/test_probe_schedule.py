"""memkit.probe on a step whose work varies from call to call (a schedule): a GAN's generator
stepped every n-th call. Every trial covers the cycle and the step after it, and an answer
measured before the variation was seen is run again."""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path

import torch

import memkit
from memkit.modelfile import load_model_file
from memkit.probing.runner import probe, probe_file
from memkit.probing.schedule import StepWatch, StepWork, WorkLog

GAN_FILE = str(Path(__file__).parent / "modelfiles" / "gan_every_third.py")


def _gan_file() -> dict:
    """The model file's globals (its networks and its loop's iteration)."""
    spec = load_model_file(GAN_FILE)
    assert spec.train_step is not None
    return inspect.unwrap(spec.train_step).__globals__


def _loop_fits(budget: str, batch_size: int, iteration, calls: int = 7) -> bool:
    """The script's own loop, fresh, for ``calls`` iterations under the simulated device."""
    gan = _gan_file()
    torch.manual_seed(0)
    model = gan["GAN"]()
    opt_d = torch.optim.Adam(model.D.parameters())
    opt_g = torch.optim.Adam(model.G.parameters())
    try:
        with memkit.simulate(budget, track=(model, opt_d, opt_g)):
            for i in range(calls):
                iteration(model.G, model.D, torch.randn(batch_size, gan["IMG"]), opt_d, opt_g, i)
    except torch.OutOfMemoryError:
        return False
    return True


def test_a_generator_stepped_every_third_call_is_in_every_trial():
    """The sweep's WGAN-GP (n_critic=5): its train_step steps the generator's optimizer, made
    in the file's globals, every 5th call; a trial of 2 steps measured whichever calls it ran,
    and the answer (394) came from one without a generator step, where the script's loop fits
    362. Here every 3rd call: memkit answered 256 where the loop fits 143. The probe now sees
    the generator's optimizer step at steps 1 and 4 of its first trial, and every trial runs
    the 3-step cycle and the step after it."""
    budget = "3800KiB"
    result = probe_file(GAN_FILE, device="cpu", budget=budget)
    best = result.max_batch_size
    assert best is not None and not result.hit_max_batch
    iteration = _gan_file()["iteration"]
    assert _loop_fits(budget, best, iteration) and not _loop_fits(budget, best + 1, iteration)
    assert {t.steps_run for t in result.trials if t.fits} == {4}
    (said,) = [d for d in result.defaults if d.startswith("the step varies")]
    assert "another Adam (168,768 parameters) stepped at steps 1 and 4" in said
    assert "a 3-step cycle, so every trial runs 4 steps" in said
    steps = "steps: 4 per trial (steps=2, more to cover the step's cycle: below)"
    assert any(d.startswith(steps) for d in result.defaults)


def test_a_step_that_does_the_same_work_every_call_runs_no_extra_step():
    """The watch costs an ordinary step nothing: every trial runs the steps asked, and the
    report says nothing of a schedule."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    result = probe(model, lambda n: torch.randn(n, 64), device="cpu", budget="2MiB")
    assert result.max_batch_size is not None
    assert {t.steps_run for t in result.trials if t.fits} == {2}
    assert not any(d.startswith("the step varies") for d in result.defaults)
    assert not any(t.superseded for t in result.trials)


def test_an_answer_that_fit_before_the_schedule_was_seen_is_run_again():
    """A generator first stepped at call 8, then every 3rd call: the trials at 1, 2, 4 and 256
    ran calls 0-7 and fit; the generator's step first ran in a trial that ran out, and so did
    every trial above 256. The old probe answered 256 (the script's loop fits 171). The fits
    measured before are marked, the trial after the news steps on until the work repeats, and
    256 is run again (it runs out): the answer is one measured over the cycle."""
    budget = "4000KiB"
    gan = _gan_file()
    latent = gan["LATENT"]

    def iteration(G, D, real, opt_d, opt_g, i):  # the file's, with its generator step moved
        opt_d.zero_grad()
        fake = G(torch.randn(real.shape[0], latent))  # not detached, as WGAN-GP's
        (-D(real).mean() + D(fake).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()  # the generator's gradients lived into this critic step
        if i >= 8 and (i - 8) % 3 == 0:
            (-D(G(torch.randn(real.shape[0], latent))).mean()).backward()
            opt_g.step()

    torch.manual_seed(0)
    model = gan["GAN"]()
    opt_d = torch.optim.Adam(model.D.parameters())
    opt_g = torch.optim.Adam(model.G.parameters())
    calls = itertools.count()

    def step(model, batch, optimizer):
        iteration(model.G, model.D, batch, optimizer, opt_g, next(calls))

    result = probe(model, lambda n: torch.randn(n, gan["IMG"]), optimizer=opt_d,
                   train_step=step, device="cpu", budget=budget)  # fmt: skip
    best = result.max_batch_size
    assert best is not None
    assert _loop_fits(budget, best, iteration, 15) and not _loop_fits(
        budget, best + 1, iteration, 15
    )
    early = [t.batch_size for t in result.trials if t.superseded]
    assert early == [1, 2, 4, 256]
    assert [t.fits for t in result.trials if t.batch_size == 256] == [True, False]
    assert result.trial(best).fits and not result.trial(best).superseded
    (said,) = [d for d in result.defaults if d.startswith("the step varies")]
    assert "do not count (batch 1, 2, 4, 256)" in said


def test_a_step_that_steps_its_optimizer_every_fourth_call_gets_no_untrained_warning():
    """Accumulation written in the step (accelerate's ``sync_gradients`` every 4th call,
    sweep PP): the first trial's 2 calls step no optimizer, and the report warned that the
    step "left the parameters unchanged" though the trials over the cycle stepped it."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    calls = itertools.count()

    def step(model, batch, optimizer):
        (model(batch).square().mean() / 4).backward()
        if next(calls) % 4 == 3:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    result = probe(model, lambda n: torch.randn(n, 64), train_step=step, device="cpu",
                   budget="2MiB")  # fmt: skip
    assert any(d.startswith("the step varies") for d in result.defaults)
    assert not any("left the parameters unchanged" in d for d in result.defaults)


def test_the_work_log_settles_a_start_up_and_a_hunt_that_sees_nothing_more():
    """Two ways the work varies without a cycle. A gradient scaler that skips the optimizer's
    first 2 steps of every trial: the first trial runs 16 steps, no cycle, and every trial
    then runs 3 (to the step after the last change), never stepping on for it again. A work
    seen once in a trial that ran out: the next trial hunts for 16 steps, sees only the usual
    work, and the report says so; the fit before the news does not count."""
    watch = StepWatch(torch.nn.Linear(2, 2), None)
    skipped, stepped = StepWork((), 1), StepWork(((0, 1),), 1)
    log = WorkLog(watch, 16)
    start_up = [skipped, skipped] + [stepped] * 14
    assert log.keeps_stepping(start_up[:15]) and log.cycle_in(start_up) is None
    log.note(start_up, 1, 0, completed=True, steps=2)
    assert log.settled and log.cycle_steps == 3 and log.valid_from == 0
    assert log.schedule is not None and "no cycle within 16 steps" in log.schedule.describe()
    assert not log.keeps_stepping([skipped, stepped])

    log = WorkLog(watch, 16)
    extra = StepWork(((0, 1), (1, 1)), 2)
    log.note([stepped, stepped], 1, 0, completed=True, steps=2)
    log.note([extra], 64, 1, completed=False, steps=2)  # it ran out at its second step
    assert log.hunting and log.valid_from == 2 and log.keeps_stepping([stepped] * 15)
    log.note([stepped] * 16, 32, 2, completed=True, steps=2)
    assert log.settled and not log.hunting and log.valid_from == 2
    assert log.schedule is not None
    said = log.schedule.describe()
    assert "at batch 64, in the 1 step it completed before it ran out" in said
    assert "the next trial ran 16 steps alike" in said


def test_a_step_that_steps_every_other_call_runs_its_cycle_and_no_more():
    """Two level steps end a trial once the kept memory grew after step 1 (LBFGS), but only
    for a step whose work does not vary: here the optimizer steps every second call, and
    comparing across the cycle took Adam's state, made once, for a growing history (review:
    trials of 5, 3, 5 ... steps, and a steps line that said the memory grew)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model.calls = 0
    optimizer = torch.optim.AdamW(model.parameters())

    def step(m, batch, opt):
        torch.nn.functional.cross_entropy(m(batch[0]), batch[1]).backward()
        m.calls += 1
        if m.calls % 2 == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)

    result = probe(model, lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))),
                   optimizer=optimizer, train_step=step, device="cpu", budget="4MiB")  # fmt: skip
    runs = {t.steps_run for t in result.trials if t.fits}
    assert len(runs) == 1, [(t.batch_size, t.steps_run) for t in result.trials]
    (line,) = [d for d in result.defaults if d.startswith("steps:")]
    assert "grew" not in line, line
