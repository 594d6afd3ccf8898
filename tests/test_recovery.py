"""After forced OOMs on the simulated device, recover() returns memory to its baseline exactly."""

from __future__ import annotations

import torch

from memkit.devices import get_backend
from memkit.oom import is_oom, recover


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    hidden = model(batch)  # locals like this are held by the traceback after an OOM
    loss = hidden.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_twenty_forced_ooms_leave_memory_at_the_baseline_exactly():
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt, torch.randn(2, 256))  # create optimizer state first
    backend = get_backend("cpu", "16MiB")
    backend.track(model, opt)
    with backend.activate():
        baseline = backend.allocated()
        for trial in range(20):
            failed = None
            try:
                _train_step(model, opt, torch.randn(2048 + trial, 256))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failed = exc
            assert failed is not None, "the budget should make every trial fail"
            assert backend.allocated() > baseline  # the traceback still holds the trial's tensors
            recover(backend, failed)
            del failed
            assert backend.allocated() == baseline
            assert backend.peak_allocated() == baseline  # peak reset for the next trial
        # and a step that fits still works afterwards
        _train_step(model, opt, torch.randn(8, 256))
        assert backend.allocated() == baseline
