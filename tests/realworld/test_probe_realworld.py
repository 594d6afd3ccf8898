"""`memkit probe` on training scripts written the way real projects write them
(tests/realworld/scripts/): the probe's answer B is checked against the script's own loop run
at B and at B + 1 on a fresh simulated device of the same size (an independent count: the
loop is the script's, not the probe's step). The points refer to the issue "memkit probe: an
answer that holds for how the script trains, in fewer and cheaper trials".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import memkit
from memkit.probing import trials as trials_module
from memkit.probing.result import ProbeResult
from memkit.probing.runner import probe_file

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def scripts() -> Iterator[None]:
    sys.path.insert(0, str(SCRIPTS))
    yield
    sys.path.remove(str(SCRIPTS))


def runs(loop: Callable[[], None], budget: str, track: tuple) -> bool:
    """Whether ``loop`` runs to the end on a fresh simulated device of ``budget``."""
    try:
        with memkit.simulate(budget, track=track):
            loop()
    except torch.OutOfMemoryError:
        return False
    return True


def sizes(result: ProbeResult) -> str:
    return " ".join(f"{t.batch_size}{'' if t.fits else 'x'}" for t in result.trials)


def probe(script: str, budget: str, **options) -> ProbeResult:
    result = probe_file(str(SCRIPTS / script), device="cpu", budget=budget, **options)
    assert isinstance(result, ProbeResult)
    return result


# -- state that keeps growing after the probe's steps --------------------------------------


def test_lbfgs_history_is_measured_until_it_stops_growing(scripts, monkeypatch):
    """time_sequence_prediction: LBFGS adds direction pairs to optimizer.state every step
    until history_size. The probe steps on until what it keeps between steps stops growing,
    so its answer holds for the script's whole run; measured for 2 steps only (the old
    probe), the answer is larger and the script runs out at its third step."""
    import time_sequence_lbfgs as script

    budget = "4.6MiB"

    def loop(batch: int, steps: int) -> bool:
        seq = script.build_model()
        optimizer = script.build_optimizer(seq.parameters())
        return runs(lambda: script.train(seq, optimizer, batch, steps), budget, (seq,))

    result = probe("time_sequence_lbfgs.py", budget)
    best = result.max_batch_size
    assert best is not None and not result.trial(best + 1).fits, sizes(result)
    at_best = result.trial(best)
    assert at_best.steps_run == 5 and not at_best.still_growing  # 2 steps, 1 more, 2 stable
    assert at_best.optimizer_growth_bytes == at_best.kept_growth_bytes > 0
    assert any(d.startswith("steps: up to 5 per trial") for d in result.defaults)
    assert loop(best, 6) and not loop(best + 1, 6)

    monkeypatch.setattr(trials_module, "MAX_STEPS", 2)  # what the probe measured before
    two_steps = probe("time_sequence_lbfgs.py", budget).max_batch_size
    assert two_steps is not None and two_steps > best
    assert loop(two_steps, 2) and not loop(two_steps, 6)


def test_state_still_growing_at_the_last_step_is_said_plainly(scripts, monkeypatch):
    """When the memory kept between steps still grows at the last step the probe runs, the
    answer holds for that many steps: the report says so, and what grows."""
    monkeypatch.setattr(trials_module, "MAX_STEPS", 3)  # LBFGS here fills its history at 3
    result = probe("time_sequence_lbfgs.py", "4.6MiB")
    at_best = result.trial(result.max_batch_size)
    assert at_best.steps_run == 3 and at_best.still_growing
    (advice,) = [a for a in result.advice if a.code == "probe-state-grows"]
    assert "measured for 3 steps" in advice.title
    assert "optimizer's state" in advice.evidence and advice.severity == "warning"


# -- gradient accumulation -----------------------------------------------------------------


def test_an_accumulating_script_trains_at_the_probes_answer_and_not_above(scripts):
    """run_clm_no_trainer with Accelerate's accumulate(): the gradients of the first
    micro-batch live through the forwards of the next ones. With --target-batch the probe
    advises accumulation and answers for the accumulating step; the step that frees gradients
    before every forward fits one more, at which the script runs out. The script is the one
    memkit run checks too; its model file is the same model with an 8192-token vocabulary
    (about 9 MiB a sample, gradients about 10 MB)."""
    import accelerate_clm as script

    budget = "80MiB"

    def loop(batch: int, accumulation: int) -> bool:
        model = script.build_model()
        optimizer = torch.optim.AdamW(script.grouped(model), lr=5e-5)
        # host data: made outside
        rows = script.RandomTokens(batch * accumulation * 2, script.BLOCK_SIZE, script.VOCAB)
        return runs(
            lambda: script.train(model, optimizer, rows, batch, accumulation, 2), budget, (model,)
        )

    result = probe("accelerate_clm.py", budget, target_batch=64)
    best = result.max_batch_size
    (note,) = [d for d in result.defaults if d.startswith("without accumulation:")]
    plain = int(note.split()[2])
    assert best is not None and plain == best + 1, (note, sizes(result))
    (advice,) = [a for a in result.advice if a.code == "accumulate"]
    assert "Accumulate gradients over" in advice.title
    assert loop(best, 4) and not loop(best + 1, 4)
    assert loop(plain, 1)  # without accumulation the larger size trains

    explicit = probe("accelerate_clm.py", budget, accumulation=4)
    assert explicit.max_batch_size == best and not explicit.trial(best + 1).fits
    (step,) = [d for d in explicit.defaults if d.startswith("step:")]
    assert "the later ones' meet those accumulated so far" in step  # not "no forward meets"


# -- a large cost per sample, a fit close to the limit -------------------------------------


def test_a_fit_close_to_the_limit_costs_one_oom_trial(scripts):
    """x-transformers' copy task: about 7.6 MiB a sample here (the model file's encoder-decoder
    on 64 tokens, its decoder's on 129), next to a fixed 3 MiB. A size that fits with less than
    a sample's memory free (12, with 1.4 MiB) is followed by the next size, not by a jump past
    it."""
    import x_transformers_copy as script

    budget = "96MiB"
    result = probe("x_transformers_copy.py", budget)
    best = result.max_batch_size
    failed = [t.batch_size for t in result.trials if not t.fits]
    assert best is not None and failed == [best + 1], sizes(result)

    def loop(batch: int) -> bool:
        model = script.build_model()
        optimizer = script.build_optimizer(model.parameters())
        batches = script.cycle(batch, script.ENC_SEQ_LEN, script.NUM_TOKENS)
        return runs(lambda: script.train(model, optimizer, batches, 3), budget, (model,))

    assert loop(best) and not loop(best + 1)
