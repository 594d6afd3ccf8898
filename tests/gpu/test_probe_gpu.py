"""probe on a real CUDA device: real OOMs, recovery to the baseline, state restored, exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memkit
from memkit.devices import get_backend
from memkit.oom import is_oom, recover

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    hidden = model(batch)  # held by the traceback after an OOM, until recover()
    loss = hidden.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_twenty_real_ooms_leave_allocated_memory_at_the_baseline():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt, torch.randn(8, 1024, device="cuda"))  # state and cuBLAS workspaces
    torch.cuda.synchronize()
    backend = get_backend("cuda:0", "1GiB")
    with backend.activate():
        baseline = backend.allocated()
        for trial in range(20):
            failed = None
            try:
                _train_step(model, opt, torch.randn(200_000 + 1000 * trial, 1024, device="cuda"))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failed = exc
            assert failed is not None, "a 1 GiB cap should make every trial fail"
            recover(backend, failed)
            del failed
            assert backend.allocated() == baseline
        _train_step(model, opt, torch.randn(64, 1024, device="cuda"))  # still trains
        assert backend.allocated() == baseline


def test_probe_is_exact_and_restores_the_model_and_optimizer():
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt, torch.randn(8, 1024, device="cuda"))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    before = torch.cuda.memory_allocated()

    result = memkit.probe(
        model, lambda b: torch.randn(b, 1024, device="cuda"), optimizer=opt, budget="1GiB"
    )

    best = result.max_batch_size
    assert best is not None and best > 64
    outcomes = {t.batch_size: t.fits for t in result.trials}
    assert outcomes[best] is True and outcomes[best + 1] is False  # exact, both run
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    for state, moment in zip(opt.state.values(), moments, strict=True):
        assert torch.equal(state["exp_avg"], moment)
    assert torch.cuda.memory_allocated() == before
