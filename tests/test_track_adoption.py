"""memkit.track on the simulated device: a model called with keyword tensors. Each number is
checked against bytes computed here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memkit.tracking import track


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
    assert by_keyword["encoder_q.0"] == (conv_output, conv_output)
    assert by_keyword["encoder_q.1"] == (conv_output, conv_output)  # ReLU: its own output
    assert by_keyword == rows(by_keyword=False)
