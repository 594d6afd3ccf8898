"""memkit.microbatch on the simulated device: split on OOM, same gradient, one step per batch.

Gradients are compared through the parameters after one ``SGD(lr=1)`` step (``p - grad``), with
float32 tolerance ``rtol=1e-5, atol=1e-6``: micro-batching changes only the summation order.
"""

from __future__ import annotations

import copy
import json
from collections import UserDict
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

import memkit
from memkit.devices import get_backend
from memkit.errors import ConfigError, DoesNotFitError
from memkit.microbatching import (
    MicroBatchStep,
    SplitPolicy,
    batch_size_of,
    chunk_sizes,
    microbatch,
    oom_size_bound,
    split_batch,
)
from memkit.oom import OomDetails, find_oom

RTOL, ATOL = 1e-5, 1e-6

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def make_mlp() -> torch.nn.Module:
    """Activations dominate (as in real training): micro-batching lowers the peak."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )  # fmt: skip


def mlp_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp_batch(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


def accumulation_peak(model: torch.nn.Module, loss_fn: LossFn, batch: Any, chunks: int) -> int:
    """Peak bytes of forward+backward over ``chunks`` micro-batches (no budget), on a copy."""
    clone = copy.deepcopy(model)
    with memkit.simulate(None, track=clone) as acct:
        for part in split_batch(batch, chunks):
            loss_fn(clone, part).backward()
        return acct.peak


def budget_between(
    model: torch.nn.Module, loss_fn: LossFn, batch: Any, fails: int, fits: int
) -> int:
    """A budget where ``fails`` chunks run out of memory and ``fits`` chunks do not."""
    high = accumulation_peak(model, loss_fn, batch, fails)
    low = accumulation_peak(model, loss_fn, batch, fits)
    assert high - low > 16 * 1024, (high, low)  # a margin the step's scalars cannot cross
    return (high + low) // 2


def reference_step(model: torch.nn.Module, loss_fn: LossFn, batch: Any, lr: float = 1.0) -> dict:
    """Parameters after one full-batch SGD step without any budget."""
    clone = copy.deepcopy(model)
    loss_fn(clone, batch).backward()
    with torch.no_grad():
        for p in clone.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return {k: v.detach().clone() for k, v in clone.state_dict().items()}


def assert_params_close(model: torch.nn.Module, expected: dict) -> None:
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL, msg=name)


def count_steps(opt: torch.optim.Optimizer) -> list[int]:
    calls = [0]
    opt.register_step_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def simulated(budget: int, *objects: Any):
    backend = get_backend("cpu", budget)
    backend.track(*objects)
    return backend


# --------------------------------------------------------------------------------------------


def test_full_batch_that_ooms_trains_with_the_full_batch_gradient():
    model, batch = make_mlp(), mlp_batch(256)
    budget = budget_between(model, mlp_loss, batch, fails=1, fits=2)
    expected = reference_step(model, mlp_loss, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    backend = simulated(budget, model, opt)
    with backend.activate(), pytest.raises(torch.OutOfMemoryError):
        mlp_loss(model, batch).backward()  # the plain step does not fit
    memkit.recover(backend)
    model.zero_grad(set_to_none=True)
    steps = count_steps(opt)

    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt, backend=backend)
    loss = step(batch)

    assert steps[0] == 1 and step.steps == 1
    assert step.last is not None and step.last.ooms >= 1 and step.last.chunks >= 2
    assert step.micro_batch_size is not None and step.micro_batch_size <= 128
    info = json.loads(json.dumps(step.last.to_dict()))  # a JSON-ready record
    assert info["batch_size"] == 256 and info["chunk_sizes"] == list(step.last.chunk_sizes)
    assert info["micro_batch_size"] == step.last.micro_batch_size
    assert all(p.grad is None for p in model.parameters())
    assert_params_close(model, expected)
    full_loss = mlp_loss(copy.deepcopy(model), batch)  # sanity: a finite mean loss came back
    assert loss.dim() == 0 and torch.isfinite(loss) and torch.isfinite(full_loss)


def test_memory_returns_to_baseline_and_the_split_is_reused():
    model = make_mlp()
    budget = budget_between(model, mlp_loss, mlp_batch(), fails=2, fits=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backend = simulated(budget, model, opt)
    steps = count_steps(opt)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt, backend=backend)
    infos = []
    with backend.activate():
        empty = backend.allocated()
        for _ in range(3):
            batch = mlp_batch()  # made inside the device: counted from now on
            before = backend.allocated()
            loss = step(batch)
            del loss
            assert backend.allocated() == before  # nothing of the step survives it
            del batch
            assert backend.allocated() == empty
            infos.append(step.last)
    assert steps[0] == 3
    first, *rest = infos
    assert first.ooms >= 1 and first.attempts == first.ooms + 1
    for info in rest:  # the remembered split: no OOM, first attempt, same chunks
        assert info.ooms == 0 and info.attempts == 1
        assert info.chunk_sizes == first.chunk_sizes


def test_adam_state_is_the_only_memory_a_step_leaves_behind():
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    step.policy.micro_size = 64  # 4 micro-batches
    levels = []
    with memkit.simulate(None, track=(model, opt)) as acct:
        empty = acct.current
        for _ in range(3):
            step(mlp_batch())
            levels.append(acct.current)
    # exp_avg and exp_avg_sq per parameter, plus a 4-byte float32 `step` tensor each
    state = sum(2 * p.nbytes + 4 for p in params)
    assert levels == [empty + state] * 3


def test_outer_simulate_without_backend_on_a_cpu_model():
    model, batch = make_mlp(), mlp_batch(256)
    budget = budget_between(model, mlp_loss, batch, fails=1, fits=2)
    expected = reference_step(model, mlp_loss, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    assert step.backend is None  # cpu model: no implicit simulated device
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)
    assert step.steps == 1 and step.last is not None and step.last.ooms >= 1
    assert_params_close(model, expected)


def test_a_retry_draws_the_random_numbers_a_split_from_the_start_draws():
    """Dropout: the failed attempt's forward drew masks; the retry draws from where the batch
    started, so the split run equals a run split from the start, and the random stream after
    the step does not depend on free memory (sweep BS: it did, and the gradient with it)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(128, 10)
    )
    batch = mlp_batch(256)
    budget = budget_between(model, mlp_loss, batch, fails=1, fits=2)
    torch.manual_seed(7)
    ref = copy.deepcopy(model)  # the independent count: a hand 2-way split, same seed
    for part in split_batch(batch, 2):
        (mlp_loss(ref, part) * 0.5).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    after_ref = torch.rand(3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    torch.manual_seed(7)
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)
    assert step.last is not None and step.last.chunks == 2 and step.last.ooms == 1
    assert_params_close(model, ref.state_dict())
    assert torch.equal(torch.rand(3), after_ref)


def test_decorator_form_and_repr():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @microbatch(model=model, optimizer=opt)
    def train(batch):
        """My step."""
        return mlp_loss(model, batch)

    assert isinstance(train, MicroBatchStep) and train.__doc__ == "My step."
    train(mlp_batch(8))
    assert train.steps == 1 and "train" in repr(train)


# --- BatchNorm, transformers --------------------------------------------------------------


def make_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 5),
    )  # fmt: skip


def cnn_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]), batch["label"])


def test_cnn_with_batchnorm_in_train_mode_sees_micro_batches(caplog):
    """The split is exact for the micro-batched model, and its warning says the gradient is
    not the full batch's (it said only 'retrying ...': sweep JJ measured 38% off)."""
    model = make_cnn()
    batch = {"image": torch.randn(32, 3, 16, 16), "label": torch.randint(0, 5, (32,))}
    budget = budget_between(model, cnn_loss, batch, fails=1, fits=2)
    # Reference with the same micro-batches, accumulated by hand without a budget: what
    # BatchNorm in training mode computes under micro-batching (not the full-batch gradient).
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: cnn_loss(model, b), model=model, optimizer=opt)
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)
    assert step.last is not None and step.last.chunks >= 2
    assert "2 BatchNorm2d layer(s) using batch statistics" in caplog.text
    assert "not the full batch's" in caplog.text
    sizes = step.last.chunk_sizes
    for part, size in zip(split_batch(batch, len(sizes)), sizes, strict=True):
        (cnn_loss(ref, part) * (size / 32)).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    assert_params_close(model, ref.state_dict())  # running_mean/var too: failed tries undone


def test_the_split_warning_says_once_what_splitting_does_to_a_loss_that_is_no_mean(caplog):
    """A sum-reduced loss comes out divided by the number of micro-batches (checked against
    the full batch's gradient); the split warning said only BatchNorm (sweep BS). It says it
    once per step object, not on every OOM."""
    model, batch = make_mlp(), mlp_batch(256)

    def sum_loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1], reduction="sum")

    budget = budget_between(model, sum_loss, batch, fails=2, fits=4)
    full = copy.deepcopy(model)
    sum_loss(full, batch).backward()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = copy.deepcopy(model.state_dict())
    step = microbatch(lambda b: sum_loss(model, b), model=model, optimizer=opt)
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)
    assert step.last is not None and step.last.chunks == 4 and step.last.ooms == 2
    for name, p in full.named_parameters():  # p - grad / chunks, not p - grad
        torch.testing.assert_close(model.state_dict()[name], before[name] - p.grad / 4)
    assert caplog.text.count("out of memory at micro-batch size") == 2
    assert caplog.text.count("said once") == 1
    for said in ("a sum (reduction='sum') comes out divided by the number of micro-batches",
                 "class-weighted cross-entropy", "in-batch negatives",
                 "drops by about ln(micro-batches)"):  # fmt: skip
        assert said in caplog.text
    # sweep CQ: with weight= given the caveat spoke as if it were not
    caplog.clear()
    model.load_state_dict(before)
    weighted = microbatch(lambda b: sum_loss(model, b), model=model, optimizer=opt,
                          weight=lambda b: len(b[1]))  # fmt: skip
    with memkit.simulate(budget, track=(model, opt)):
        weighted(batch)
    assert caplog.text.count("said once") == 1
    assert "weighted by weight=" in caplog.text and "only for a loss" not in caplog.text


def test_class_weighted_cross_entropy_is_exact_with_the_documented_weight():
    """docs/microbatch.md, Exactness: class-weighted CE is a mean weighted by the targets'
    class weights; weight=lambda b: cw[b[1]].sum() makes the split exact (sweep BS)."""
    torch.manual_seed(0)
    model, (x, y) = make_mlp(), mlp_batch(255)
    y[:128] = 0  # the first micro-batch is mostly the down-weighted class
    cw = torch.tensor([0.1] + [1.0] * 9)

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1], weight=cw)

    budget = budget_between(model, loss, (x, y), fails=1, fits=2)
    expected = reference_step(model, loss, (x, y))
    for weight in (None, lambda b: cw[b[1]].sum()):
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=1.0)
        step = microbatch(lambda b, m=trained: loss(m, b), model=trained, optimizer=opt,
                          weight=weight)  # fmt: skip
        with memkit.simulate(budget, track=(trained, opt)):
            step((x, y))
        assert step.last is not None and step.last.chunks == 2
        if weight is None:
            assert not torch.allclose(trained.state_dict()["4.bias"], expected["4.bias"])
        else:
            assert_params_close(trained, expected)


def test_cnn_with_batchnorm_in_eval_mode_matches_the_full_batch(caplog):
    model = make_cnn().eval()  # BatchNorm uses running statistics: exact again
    batch = {"image": torch.randn(32, 3, 16, 16), "label": torch.randint(0, 5, (32,))}
    budget = budget_between(model, cnn_loss, batch, fails=1, fits=2)
    expected = reference_step(model, cnn_loss, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: cnn_loss(model, b), model=model, optimizer=opt)
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)
    assert step.last is not None and step.last.chunks >= 2
    assert_params_close(model, expected)
    assert "BatchNorm" not in caplog.text  # exact: nothing to warn of


def test_batchnorm_train_mode_differs_from_the_full_batch_gradient():
    model = make_cnn()
    batch = {"image": torch.randn(16, 3, 8, 8), "label": torch.randint(0, 5, (16,))}
    expected = reference_step(model, cnn_loss, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: cnn_loss(model, b), model=model, optimizer=opt)
    step.policy.micro_size = 4  # force 4 micro-batches
    step(batch)
    weight = "0.weight"
    assert not torch.allclose(model.state_dict()[weight], expected[weight], rtol=RTOL, atol=ATOL)


def test_batchnorm_that_needs_micro_batches_of_one_does_not_fit_clearly():
    """Where micro-batch size 2 runs out of memory, size 1 cannot train BatchNorm: a
    DoesNotFitError that says so, with BatchNorm's error as its cause, and the running
    statistics as they were (not BatchNorm's bare ValueError)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 8192), torch.nn.BatchNorm1d(8192), torch.nn.ReLU(),
        torch.nn.Linear(8192, 10),
    )  # fmt: skip
    batch = (torch.randn(64, 32), torch.randint(0, 10, (64,)))
    budget = accumulation_peak(model, mlp_loss, batch, 32) - 1024  # micro-batches of 2 fail
    stats = [b.clone() for b in model.buffers()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    with memkit.simulate(budget, track=(model, opt)), pytest.raises(DoesNotFitError) as info:
        step(batch)
    assert "cannot be split further: the model's BatchNorm fails on a micro-batch of 1" in str(
        info.value
    )
    assert isinstance(info.value.__cause__, ValueError)
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    # an odd batch whose split leaves one sample alone: a ConfigError that says why
    step.policy.micro_size = 2
    with pytest.raises(ConfigError, match="leaves one of 1 sample") as info:
        step((torch.randn(5, 32), torch.randint(0, 10, (5,))))
    assert isinstance(info.value.__cause__, ValueError)
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    # docs/microbatch.md's example: balanced chunks, so 65 at size 32 leaves no sample alone
    step.policy.micro_size = 32
    step((torch.randn(65, 32), torch.randint(0, 10, (65,))))
    assert step.last is not None and step.last.chunk_sizes == (22, 22, 21)


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def gpt2_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def counted_tokens(batch: Any) -> torch.Tensor:
    """Tokens GPT-2's shifted loss averages over: labels[:, 1:] that are not -100."""
    return (batch["labels"][:, 1:] != -100).sum()


def test_gpt2_dict_batch_with_equal_lengths_is_exact(gpt2):
    model = copy.deepcopy(gpt2)
    ids = torch.randint(0, 256, (16, 32))
    batch = {"input_ids": ids, "labels": ids.clone()}
    budget = budget_between(model, gpt2_loss, batch, fails=1, fits=2)
    expected = reference_step(model, gpt2_loss, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: gpt2_loss(model, b), model=model, optimizer=opt)
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)
    assert step.last is not None and step.last.chunks >= 2 and step.steps == 1
    assert_params_close(model, expected)


def test_gpt2_padded_tokens_need_a_token_weight(gpt2):
    ids = torch.randint(0, 256, (10, 24))
    labels = ids.clone()
    for row in range(10):  # ragged: row r has 4 + 2r counted positions
        labels[row, 5 + 2 * row :] = -100
    batch = {"input_ids": ids, "labels": labels}
    expected = reference_step(gpt2, gpt2_loss, batch)
    results = {}
    for name, weight in (("tokens", counted_tokens), ("samples", None)):
        model = copy.deepcopy(gpt2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        step = microbatch(lambda b, m=model: gpt2_loss(m, b), model=model, optimizer=opt,
                          weight=weight)  # fmt: skip
        step.policy.micro_size = 3  # 4 ragged micro-batches: 3, 3, 2, 2
        step(batch)
        assert step.last is not None and step.last.chunk_sizes == (3, 3, 2, 2)
        results[name] = model
    assert_params_close(results["tokens"], expected)  # exact with the token weight
    w = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.allclose(results["samples"].state_dict()[w], expected[w], rtol=RTOL, atol=ATOL)


def tiny_lm() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 50),
    )  # fmt: skip


def token_mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def test_padded_labels_warn_at_the_split_with_the_weight_to_pass(caplog):
    """A token-mean loss over labels padded with -100 gets a wrong gradient from sample
    weights (sweep BS: 127% off on a GPT-2, silently): the split says so, by how much, and
    which weight= to pass; with that weight it is exact and quiet."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (16, 32))
    labels = ids.clone()
    labels[8:, 4:] = -100  # the second half holds 4 counted tokens a row, the first 32
    batch = {"input_ids": ids, "labels": labels}
    model = tiny_lm()
    budget = budget_between(model, token_mean_loss, batch, fails=1, fits=2)
    expected = reference_step(model, token_mean_loss, batch)
    weight = "weight=lambda b: (b['labels'] != -100).sum()"
    for given in (None, lambda b: (b["labels"] != -100).sum()):
        caplog.clear()
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=1.0)
        step = microbatch(lambda b, m=trained: token_mean_loss(m, b), model=trained,
                          optimizer=opt, weight=given)  # fmt: skip
        with memkit.simulate(budget, track=(trained, opt)):
            for _ in range(2):  # the second, split from the start, is not warned of again
                step(batch)
                trained.load_state_dict(model.state_dict())
            assert step.last is not None and step.last.chunk_sizes == (8, 8)
            step(batch)
        if given is None:
            w = "3.weight"
            assert not torch.allclose(trained.state_dict()[w], expected[w], rtol=1e-3)
            # sample shares 1/2 each, counted-token shares 256/288 and 32/288
            assert caplog.text.count("'labels' hold -100") == 1
            assert "weighted 0.56x to 4.50x what the full batch gives them" in caplog.text
            assert weight in caplog.text
            assert "weight=lambda b: (b['labels'][:, 1:] != -100).sum()" in caplog.text
        else:
            assert_params_close(trained, expected)
            assert "'labels' hold" not in caplog.text


def test_labels_without_padding_or_split_evenly_are_not_warned_of(caplog):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (16, 32))
    model = tiny_lm()
    labels = ids.clone()
    labels[:, 28:] = -100  # padded, but every row alike: sample weights are exact
    for batch in ({"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": labels}):
        budget = budget_between(model, token_mean_loss, batch, fails=1, fits=2)
        expected = reference_step(model, token_mean_loss, batch)
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=1.0)
        step = microbatch(lambda b, m=trained: token_mean_loss(m, b), model=trained, optimizer=opt)
        with memkit.simulate(budget, track=(trained, opt)):
            step(batch)
        assert step.last is not None and step.last.chunks == 2
        assert_params_close(trained, expected)
    assert "'labels' hold" not in caplog.text


def test_a_batch_with_num_items_in_batch_sums_its_micro_batches_losses(gpt2):
    """transformers' Trainer convention: ``num_items_in_batch`` (the whole batch's token
    count) is passed to the model, whose loss is a token sum divided by it. Every micro-batch
    gets the whole batch's count, so their losses add up to the full batch's: weighting them
    too made the gradient 4x too small with 4 micro-batches."""
    ids = torch.randint(0, 256, (8, 16))
    labels = ids.clone()
    for row in range(8):  # ragged: a sample weight would be wrong as well
        labels[row, 4 + row :] = -100
    batch = {"input_ids": ids, "labels": labels, "num_items_in_batch": counted_tokens(
        {"labels": labels})}  # fmt: skip
    expected = reference_step(gpt2, gpt2_loss, batch)
    full = gpt2_loss(copy.deepcopy(gpt2), batch).item()
    model = copy.deepcopy(gpt2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: gpt2_loss(model, b), model=model, optimizer=opt)
    step.policy.micro_size = 2
    loss = step(batch)
    assert step.last is not None and step.last.chunk_sizes == (2, 2, 2, 2)
    assert loss.item() == pytest.approx(full, rel=1e-5)
    assert_params_close(model, expected)
    # num_items_in_batch=None: transformers' models take the mean, and so the micro-batches
    # are weighted as usual (summing doubled the gradient; review)
    none = {"input_ids": ids, "labels": ids.clone(), "num_items_in_batch": None}  # not ragged
    expected = reference_step(gpt2, gpt2_loss, none)
    model = copy.deepcopy(gpt2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: gpt2_loss(model, b), model=model, optimizer=opt)
    step.policy.micro_size = 4
    step(none)
    assert_params_close(model, expected)


def test_a_micro_batch_with_no_counted_token_adds_nothing_and_no_nan(gpt2):
    """Samples whose labels are all ignored (-100) make a micro-batch whose token-mean loss is
    NaN (a mean over nothing): with the token weight it adds nothing, and the step's loss is
    the full batch's, not NaN."""
    ids = torch.randint(0, 256, (4, 16))
    labels = ids.clone()
    labels[2:] = -100
    batch = {"input_ids": ids, "labels": labels}
    expected = reference_step(gpt2, gpt2_loss, batch)
    full = gpt2_loss(copy.deepcopy(gpt2), batch).item()
    opt = torch.optim.SGD(gpt2.parameters(), lr=1.0)
    step = microbatch(lambda b: gpt2_loss(gpt2, b), model=gpt2, optimizer=opt,
                      weight=counted_tokens)  # fmt: skip
    step.policy.micro_size = 2
    loss = step(batch)
    assert step.last is not None and step.last.chunk_sizes == (2, 2)
    assert loss.item() == pytest.approx(full, rel=1e-5)
    assert_params_close(gpt2, expected)


def test_the_default_weight_returns_no_nan_for_a_micro_batch_with_every_label_ignored():
    """Sorted or packed data puts all-ignored rows together: with the default (sample) weight
    that micro-batch's cross-entropy is NaN and its gradient zero. The loss returned is the
    others' mean, not NaN; NaN everywhere is still NaN."""
    torch.manual_seed(0)
    model = make_mlp()
    x, y = mlp_batch(64)
    y[:16] = -100  # the first micro-batch of four counts nothing
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    step.policy.micro_size = 16
    with torch.no_grad():
        per_part = [mlp_loss(model, part).item() for part in split_batch((x, y), 4)]
    loss = step((x, y))
    assert step.last is not None and step.last.chunks == 4
    assert loss.item() == pytest.approx(sum(per_part[1:]) / 3, rel=1e-6)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isnan(step((x, torch.full_like(y, -100))))
    x[20, 0] = float("nan")  # corrupt data: NaN gradients, the step diverged, and says so
    assert torch.isnan(step((x, y)))


def test_under_track_a_failed_attempts_backward_is_no_micro_batch():
    """A split that runs out of memory after its first micro-batch's backward is retried
    smaller: the tracker counts the micro-batches of the split that trained, not the
    abandoned backward."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    backwards = [0]
    model[0].weight.register_hook(lambda g: backwards.__setitem__(0, backwards[0] + 1))
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    batches = [mlp_batch(512) for _ in range(3)]
    with memkit.track(model, opt, device="cpu", budget="1600KiB", postmortem=None) as tracker:
        for batch in batches:
            step(batch)
    assert step.last is not None
    chunks = step.last.chunks
    assert backwards[0] > 3 * chunks  # the precondition: an attempt ran a backward and failed
    report = tracker.report()
    assert [s.backward_passes for s in report.devices[0].steps] == [chunks] * 3
    assert report.micro_batches == chunks


def test_a_hand_written_masked_mean_over_nothing_leaves_no_nan_in_the_weights():
    """``(per * m).sum() / m.sum()`` over a micro-batch with no counted sample is 0/0: its
    backward would put NaN in every gradient. Such a micro-batch is skipped; a batch with
    nothing counted at all trains nothing and returns NaN, as its full-batch mean would."""
    torch.manual_seed(0)
    x, y, mask = torch.randn(8, 8), torch.randn(8), torch.ones(8)
    mask[4:] = 0

    def masked_mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, m = batch
        return (((model(x).squeeze(-1) - y) ** 2) * m).sum() / m.sum()

    model = torch.nn.Linear(8, 1)
    expected = reference_step(model, masked_mse, (x, y, mask), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = microbatch(lambda b: masked_mse(model, b), model=model, optimizer=opt,
                      weight=lambda b: b[2].sum())  # fmt: skip
    step.policy.micro_size = 4
    loss = step((x, y, mask))
    assert torch.isfinite(loss) and step.last is not None and step.last.chunks == 2
    assert_params_close(model, expected)
    before = copy.deepcopy(model.state_dict())
    assert torch.isnan(step((x, y, torch.zeros(8))))
    assert_params_close(model, before)


def test_sequence_first_batches_are_split_along_the_batch_not_time():
    """pytorch/examples' word_language_model: an ``nn.LSTM`` without ``batch_first`` takes
    ``(seq, batch)`` tokens. Split along dim 0 the micro-batches would be spans of time and the
    gradient silently wrong: memkit asks which dim is the batch, and with ``batch_dim=1``
    the gradient is the full batch's (a 1-d per-sample tensor is split along its dim 0)."""
    torch.manual_seed(0)

    class LanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.rnn = torch.nn.Embedding(50, 16), torch.nn.LSTM(16, 32)
            self.out = torch.nn.Linear(32, 50)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(self.emb(tokens))[0])

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        data, targets, sample_weight = batch  # (seq, B), (seq, B), (B,): one per sample
        per_token = F.cross_entropy(model(data).flatten(0, 1), targets.flatten(), reduction="none")
        return (per_token.view(targets.shape) * sample_weight).mean()

    model = LanguageModel()
    batch = (torch.randint(0, 50, (35, 8)), torch.randint(0, 50, (35, 8)), torch.rand(8))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ConfigError, match="batch_dim=1"):
        microbatch(lambda b: loss_fn(model, b), model=model, optimizer=opt)
    expected = reference_step(model, loss_fn, batch)
    step = microbatch(lambda b: loss_fn(model, b), model=model, optimizer=opt, batch_dim=1)
    step.policy.micro_size = 4
    step(batch)
    assert step.last is not None and step.last.chunk_sizes == (4, 4)
    assert_params_close(model, expected)


# --- errors -------------------------------------------------------------------------------


def test_a_non_oom_error_propagates_at_once():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def broken(batch):
        calls.append(1)
        raise ValueError("bad label")

    step = microbatch(broken, model=model, optimizer=opt)
    with pytest.raises(ValueError, match="bad label"):
        step(mlp_batch(8))
    assert len(calls) == 1 and step.steps == 0 and step.ooms == 0


def test_a_loss_that_is_not_a_scalar_tensor_is_a_config_error():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = microbatch(lambda b: model(b[0]), model=model, optimizer=opt)
    with pytest.raises(ConfigError, match="one-element tensor"):
        step(mlp_batch(8))


@pytest.mark.parametrize("own", ["backward", "backward_detach", "full_step"])
def test_a_train_step_that_runs_backward_itself_is_told_what_memkit_does(own):
    """torch's bare 'backward through the graph a second time' / 'element 0 of tensors does
    not require grad' (sweep BS) become a ConfigError that says memkit runs backward and the
    optimizer step, with torch's error as the cause; at once, never taken for an OOM."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def train(batch):
        calls.append(1)
        loss = mlp_loss(model, batch)
        if own == "full_step":
            opt.zero_grad()
        loss.backward()
        if own == "full_step":
            opt.step()
        return loss if own == "backward" else loss.detach()

    step = microbatch(train, model=model, optimizer=opt)
    with pytest.raises(ConfigError, match="train_step must return the loss") as info:
        step(mlp_batch(8))
    assert "Remove loss.backward(), optimizer.step()" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert calls == [1] and step.ooms == 0 and step.steps == 0


def test_a_grad_scaler_trains_as_a_plain_amp_loop_and_skips_inf_batches():
    """scaler=: each micro-batch's loss is scaled, the gradients unscaled once before
    before_step (clipping), scaler.step skips a batch with inf gradients and scaler.update
    runs once per batch. Checked against a plain GradScaler loop without memkit, batch by
    batch (sweep BS: the documented before_step unscaling left NaN parameters)."""
    torch.manual_seed(0)
    model = make_mlp()
    x, y = mlp_batch(256)
    bad = x.clone()
    bad[3, 5] = float("inf")  # what a float16 overflow gives
    batches = [(x, y), (bad, y), (x, y)]
    budget = budget_between(model, mlp_loss, batches[0], fails=1, fits=2)

    def clip(m: torch.nn.Module) -> Callable[[], Any]:
        return lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    expected = []
    for batch in batches:
        ref_opt.zero_grad()
        ref_scaler.scale(mlp_loss(ref, batch)).backward()
        ref_scaler.unscale_(ref_opt)
        clip(ref)()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        expected.append((copy.deepcopy(ref.state_dict()), ref_scaler.get_scale()))

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    steps = count_steps(opt)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt,
                      scaler=scaler, before_step=clip(model))  # fmt: skip
    for batch, (params, scale) in zip(batches, expected, strict=True):
        with memkit.simulate(budget, track=(model, opt)):
            loss = step(batch)
        assert step.last is not None and step.last.chunks == 2
        assert_params_close(model, params)
        assert scaler.get_scale() == scale  # 1024, 512 (inf skipped), 512
        assert torch.isfinite(loss) == (batch is not batches[1])
    assert steps[0] == 2  # the inf batch did not step
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_grad_scaler_used_behind_memkits_back_is_refused():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(ConfigError, match=r"pass it as microbatch\(..., scaler=scaler\)"):
        microbatch(lambda b: scaler.scale(mlp_loss(model, b)), model=model, optimizer=opt)
    with pytest.raises(ConfigError, match="scaler=scaler"):
        microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt,
                   before_step=lambda: scaler.unscale_(opt))  # fmt: skip
    twice = microbatch(lambda b: scaler.scale(mlp_loss(model, b)), model=model, optimizer=opt,
                       scaler=scaler)  # fmt: skip
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=r"returned scaler.scale\(loss\)"):
        twice(mlp_batch(8))
    assert_params_close(model, before)


def test_micro_batch_one_that_does_not_fit_raises_with_the_numbers():
    model, batch = make_mlp(), mlp_batch(16)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    params = sum(p.nbytes for p in model.parameters())
    backend = simulated(params + sum(t.nbytes for t in batch) + 4096, model, opt)
    calls = []

    def train(b):
        calls.append(batch_size_of(b))
        return mlp_loss(model, b)

    step = microbatch(train, model=model, optimizer=opt, backend=backend)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with backend.activate():
        baseline = backend.allocated()
        with pytest.raises(DoesNotFitError, match="micro-batch size 1") as info:
            step(batch)
        assert backend.allocated() == baseline + sum(t.nbytes for t in batch)
    err = info.value
    assert err.capacity_bytes == backend.budget
    assert err.needed_bytes is not None and err.needed_bytes > backend.budget
    assert calls[0] == 16 and calls[-1] == 1 and step.steps == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # raised from the last OOM, without its traceback: memkit run exits 1 ("does not fit")
    # and a tracked block writes its post-mortem (sweep BS: exit 3, an error the script raised)
    cause = err.__cause__
    assert isinstance(cause, torch.OutOfMemoryError) and cause.__traceback__ is None
    assert find_oom(err) is cause


def test_a_batch_that_does_not_fit_at_one_sample_ends_a_tracked_block_as_an_oom():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    budget = sum(p.nbytes for p in model.parameters()) + 4096
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    with pytest.raises(DoesNotFitError), memkit.track(model, opt, device="cpu", budget=budget,
                                                      postmortem=None) as tracker:  # fmt: skip
        step(mlp_batch(16))
    pm = tracker.report().oom
    assert pm is not None and pm.capacity == budget


def test_retries_of_a_first_step_that_never_fit_are_no_steps_and_no_growth():
    """Sweep BS: under ``memkit run`` (no optimizer given to the tracker) a first step split
    down to one sample was reported as 7 steps counted from backward passes, with memory
    'growing' across the retries: they were attempts of one optimizer step that ran out."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = microbatch(lambda b: F.cross_entropy(model(b[0]), b[1]), model=model, optimizer=opt)
    batch = (torch.randn(512, 64), torch.randint(0, 10, (512,)))
    with pytest.raises(DoesNotFitError), memkit.track(device="cpu", budget="1MiB",
                                                      postmortem=None) as tracker:  # fmt: skip
        for _ in range(3):
            step(batch)
    report = tracker.report()
    (dev,) = report.devices
    assert report.oom is not None and report.oom.step == 0
    assert dev.steps == () and dev.leak is None
    assert report.step_rule == "optimizer"


def test_batch_size_one_that_ooms_does_not_fit():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    budget = sum(p.nbytes for p in model.parameters()) + 1027  # not a round number of KiB
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt)
    with memkit.simulate(budget, track=(model, opt)), pytest.raises(DoesNotFitError) as info:
        step(mlp_batch(1))
    assert step.last is None
    # no backend given: the outer simulate block's exact budget (sweep BS: it was read from
    # the OOM message, which rounds); the needed bytes are read from the message
    assert info.value.capacity_bytes == budget
    assert info.value.needed_bytes is not None and info.value.needed_bytes > budget


def test_an_optimizer_step_that_ooms_is_not_retried():
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.Adam(model.parameters())
    params = sum(p.nbytes for p in model.parameters())
    step = microbatch(lambda b: model(b).square().mean(), model=model, optimizer=opt)
    budget = int(params * 2.6)  # forward/backward fit, Adam's two states do not
    with (
        memkit.simulate(budget, track=(model, opt)),
        pytest.raises(DoesNotFitError, match="optimizer step") as info,
    ):
        step(torch.randn(4, 512))
    assert step.steps == 0
    assert isinstance(find_oom(info.value), torch.OutOfMemoryError)  # (review: memkit run exit 1)


# --- splitting ------------------------------------------------------------------------------


class Pair(NamedTuple):
    x: torch.Tensor
    tag: str


def test_non_splittable_items_are_given_to_every_micro_batch():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[dict] = []
    class_weight = torch.ones(10)  # dim 0 (10) is not the batch size (12)
    scale = torch.tensor(2.0)

    def train(batch):
        seen.append(batch)
        loss = F.cross_entropy(model(batch["x"]), batch["y"], weight=batch["class_weight"])
        return loss * batch["scale"] * batch["k"]

    batch = {"x": torch.randn(12, 64), "y": torch.randint(0, 10, (12,)), "k": 3, "scale": scale,
             "class_weight": class_weight, "name": "run-1", "none": None}  # fmt: skip
    step = microbatch(train, model=model, optimizer=opt)
    step.policy.micro_size = 5  # 3 micro-batches: 4, 4, 4
    step(batch)
    assert [len(b["x"]) for b in seen] == [4, 4, 4]
    for b in seen:
        assert b["k"] == 3 and b["scale"] is scale and b["class_weight"] is class_weight
        assert b["name"] == "run-1" and b["none"] is None


def test_split_batch_containers():
    x = torch.arange(10)
    parts = split_batch((x, [x * 2, 7], Pair(x, "t"), UserDict({"a": x})), 3)
    assert [p[0].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert parts[1][1][0].tolist() == [8, 10, 12] and parts[1][1][1] == 7
    assert isinstance(parts[2][2], Pair) and parts[2][2].tag == "t"
    assert isinstance(parts[0][3], UserDict) and parts[0][3]["a"].tolist() == [0, 1, 2, 3]
    assert parts[0][0].data_ptr() == x.data_ptr()  # views, not copies
    assert split_batch(x, 1)[0] is x
    assert batch_size_of((3, torch.tensor(1.0), {"a": torch.zeros(5, 2)})) == 5
    assert chunk_sizes(7, 7) == [1] * 7
    with pytest.raises(ConfigError):
        chunk_sizes(4, 5)


def test_a_batch_without_a_batch_dimension_runs_whole():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = microbatch(lambda b: model(torch.ones(3) * b).sum(), model=model, optimizer=opt)
    step(2.0)
    assert step.last is not None and step.last.batch_size == 1 and step.last.chunks == 1


# --- the policy -----------------------------------------------------------------------------


def test_policy_halves_remembers_and_grows_back():
    policy = SplitPolicy(grow_after=2)
    assert policy.chunks_for(64) == 1
    assert policy.on_oom(64) == 32 and policy.chunks_for(64) == 2
    assert policy.on_oom(32) == 16 and policy.chunks_for(64) == 4
    policy.on_success(16)
    assert policy.chunks_for(64) == 4
    policy.on_success(16)  # patience reached: try half way (in chunks) to the failing size
    assert policy.trial_chunks(64) == 3 and policy.chunks_for(64) == 3  # up to 22 samples
    assert policy.on_oom(22) == 16  # the trial failed: back to 16, patience doubles
    assert policy.patience == 4 and policy.oom_size == 22 and policy.chunks_for(64) == 4
    for _ in range(4):
        policy.on_success(16)
    assert policy.chunks_for(38) == 2  # a batch of 38: 3 chunks of 13, trial 2 of 19
    policy.on_success(19)
    assert policy.micro_size == 19 and policy.clean_steps == 0
    assert policy.on_oom(1) is None
    assert SplitPolicy(grow_after=None).patience is None
    with pytest.raises(ConfigError):
        SplitPolicy(grow_after=0)


def test_policy_jumps_with_a_bound_from_the_oom_message():
    # affine peak c + k*m: baseline 100, c = 20, k = 10 per sample, budget 300 -> m* = 18
    baseline, c, k, budget = 100, 20, 10, 300
    tried = 64
    in_use = baseline + c + k * 40  # failed part-way, with 40 samples' worth allocated
    details = OomDetails(tried_to_allocate=k * 10, allocated_by_pytorch=in_use,
                         free=budget - in_use, capacity=budget)  # fmt: skip
    bound = oom_size_bound(tried, details, baseline)
    assert bound is not None and 18 <= bound < 32
    policy = SplitPolicy()
    assert policy.on_oom(tried, bound) == bound
    # no shortfall shown (fragmentation): no bound, plain halving
    assert (
        oom_size_bound(8, OomDetails(tried_to_allocate=1, allocated_by_pytorch=1, free=10), 0)
        is None
    )
    assert oom_size_bound(8, details, None) is None


def test_growth_trial_that_ooms_retries_the_same_batch_at_the_remembered_size():
    model, batch = make_mlp(), mlp_batch(256)
    budget = budget_between(model, mlp_loss, batch, fails=1, fits=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = count_steps(opt)
    step = microbatch(lambda b: mlp_loss(model, b), model=model, optimizer=opt, grow_after=1)
    with memkit.simulate(budget, track=(model, opt)):
        step(batch)  # OOM at 256, works at 128: one clean step, patience 1 reached
        assert step.micro_batch_size == 128
        step(batch)  # the trial (size 256) fails, the same batch is retried at 128
        trial = step.last
        step(batch)  # patience doubled to 2: no trial yet
        after = step.last
    assert trial is not None and trial.ooms == 1 and trial.attempts == 2 and trial.chunks == 2
    assert after is not None and after.ooms == 0 and after.attempts == 1 and after.chunks == 2
    assert step.policy.patience == 2 and step.micro_batch_size == 128
    assert steps[0] == 3 == step.steps


def test_a_detection_batch_splits_its_list_of_per_image_targets_with_the_images():
    """torchvision's detection batches are ``(images, targets)`` with ``targets`` a list of one
    dict per image. The list used to reach every micro-batch whole, so ``zip(preds, targets)``
    paired each micro-batch's images with the first images' targets: a silently wrong loss
    and gradient. Split, both are the full batch's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 4),
    )  # fmt: skip
    images = torch.randn(256, 3, 32, 32)
    targets = [{"boxes": torch.rand(1 + i % 3, 4)} for i in range(256)]

    def step_fn(batch):
        imgs, tgts = batch
        preds = net(imgs)
        pairs = zip(preds, tgts, strict=True)
        return torch.stack(
            [F.smooth_l1_loss(p.expand_as(t["boxes"]), t["boxes"]) for p, t in pairs]
        ).mean()

    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    full_loss = step_fn((images, targets))
    full_loss.backward()
    full = [p.grad.clone() for p in net.parameters()]
    opt.zero_grad(set_to_none=True)
    seen: dict[str, list[torch.Tensor]] = {}

    def before_step() -> None:
        seen["g"] = [p.grad.clone() for p in net.parameters()]

    step = memkit.microbatch(step_fn, model=net, optimizer=opt, before_step=before_step)
    with memkit.simulate("8MiB", track=(net, opt)):
        loss = step((images, targets))
    assert step.micro_batch_size < 256
    assert loss.item() == pytest.approx(full_loss.item(), rel=1e-6)
    pairs = zip(full, seen["g"], strict=True)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs)


def test_the_batch_size_is_the_per_sample_data_not_a_shared_tensor_of_another_length():
    batch = {"pos": torch.arange(16), "x": torch.zeros(2000, 64), "mask": torch.ones(2000)}
    assert batch_size_of(batch) == 2000
    parts = split_batch(batch, 2)
    assert [p["x"].shape[0] for p in parts] == [1000, 1000]
    assert all(p["pos"] is batch["pos"] for p in parts)  # shared, given whole
    assert split_batch([torch.zeros(2, 3), torch.zeros(2, 5)], 2)[1][1].shape == (1, 5)
    # per-image targets where one image has as many boxes as the batch has images
    images = torch.zeros(4, 3, 8, 8)
    targets = [{"boxes": torch.zeros(n, 4)} for n in (2, 2, 1, 4)]
    first, second = split_batch((images, targets), 2)
    assert [len(t["boxes"]) for t in first[1]] == [2, 2]
    assert [len(t["boxes"]) for t in second[1]] == [1, 4]


def graph_batch(graphs: int = 6, nodes: int = 4) -> dict[str, torch.Tensor]:
    """PyG-like: node features of every graph stacked, a sorted graph id per node."""
    x = torch.randn(graphs * nodes, 3)
    edge_index = torch.randint(0, nodes, (2, 3 * graphs)) + torch.arange(graphs).repeat(3) * nodes
    edge_index[0, 0] = graphs * nodes - 1
    batch = torch.arange(graphs).repeat_interleave(nodes)
    return {"x": x, "edge_index": edge_index, "batch": batch, "y": torch.randint(0, 2, (graphs,))}


def test_a_graph_batch_is_refused_not_split_along_its_nodes():
    """Split along the nodes, ``edge_index`` (given whole) indexed rows a micro-batch lacks
    (IndexError), or, pooled to ``num_graphs``, gave a silently wrong gradient."""
    batch = graph_batch()
    with pytest.raises(ConfigError, match=r"'edge_index'\] holds indices into the 24 rows"):
        split_batch(batch, 2)
    # ordinary batches are no graphs: sorted labels beside a class count, a whole 0/1 mask
    # with a batch of 2 (review: both were refused)
    labels = {"x": torch.randn(12, 4), "y": torch.arange(12) // 4, "num_classes": 3}
    halves = [p["y"].tolist() for p in split_batch(labels, 2)]
    assert halves == [[0, 0, 0, 0, 1, 1], [1, 1, 2, 2, 2, 2]]
    causal = {"ids": torch.randint(0, 9, (2, 6)), "mask": torch.ones(6, 6, dtype=torch.uint8)}
    assert [p["ids"].shape[0] for p in split_batch(causal, 2)] == [1, 1]
    # the way out the error names: one dict per graph, split per graph
    graphs = [{"x": torch.randn(4, 3), "edge_index": torch.randint(0, 4, (2, 5)),
               "y": torch.tensor([i % 2])} for i in range(6)]  # fmt: skip
    assert batch_size_of(graphs) == 6
    parts = split_batch(graphs, 2)
    assert [len(p) for p in parts] == [3, 3] and parts[1][0] is graphs[3]
    # batched dicts (default_collate of samples that are pairs of dicts) stay columns
    pair = [{"ids": torch.zeros(8, 5)}, {"ids": torch.zeros(8, 7)}]
    assert batch_size_of(pair) == 8 and split_batch(pair, 2)[0][1]["ids"].shape == (4, 7)
    # a labelled and an unlabelled batch of two sizes (Lightning's CombinedLoader): no records
    mixed = [{"x": torch.zeros(4, 8), "y": torch.zeros(4)}, {"x": torch.zeros(12, 8)}]
    assert batch_size_of(mixed) == 12
    # two images' target dicts (one length inside each, the same keys) are records (review)
    targets = [{"boxes": torch.zeros(k, 4), "labels": torch.zeros(k)} for k in (3, 5)]
    parts = split_batch(([torch.zeros(3, 8, 8)] * 2, targets), 2)
    assert [p[1][0]["boxes"].shape[0] for p in parts] == [3, 5]


def test_a_list_of_images_is_split_per_image_or_refused():
    """torchvision detection takes a list of (3, H, W) images: their dim 0 (channels) was
    taken for the batch and every image was split along its channels."""
    images = [torch.randn(3, 8, 8) for _ in range(6)]
    targets = [{"boxes": torch.rand(1 + i % 3, 4), "labels": torch.ones(1 + i % 3)}
               for i in range(6)]  # fmt: skip
    assert batch_size_of((images, targets)) == 6
    first, _ = split_batch((images, targets), 2)
    assert first[0] == images[:3] and first[1] == targets[:3]
    with pytest.raises(ConfigError, match="list of 6 tensors"):
        split_batch((images, torch.zeros(6, dtype=torch.long)), 2)


def test_a_sequence_first_batch_splits_a_batch_first_mask_along_its_batch():
    x, mask, y = torch.randn(30, 10, 4), torch.ones(10, 30), torch.zeros(30, 10)
    parts = split_batch((x, mask, y), 2, dim=1)
    assert [tuple(t.shape) for t in parts[1]] == [(30, 5, 4), (5, 30), (30, 5)]
