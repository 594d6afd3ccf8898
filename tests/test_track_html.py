"""The track report's HTML loads in a real headless browser, offline.

Needs Debian's ``chromium`` package (``apt-get install -y chromium``); skipped without it.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from torch import nn

from memkit.tracking import track

BROWSER = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)


def report_page(path) -> None:
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="32MiB") as tracker:
        for _ in range(3):
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    tracker.report().to_html(path)


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no headless browser: apt-get install -y chromium")
def test_html_report_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "track.html"
    report_page(page)
    profile = tmp_path / "profile"
    common = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={profile}",
    ]  # fmt: skip
    dom = subprocess.run(
        [*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "memkit track" in html and "Memory over time" in html
    assert "<polyline" in html and "Modules (largest activations first)" in html
    shot = tmp_path / "track.png"
    proc = subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and shot.stat().st_size > 10_000
