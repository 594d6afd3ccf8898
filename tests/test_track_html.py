"""The track report's HTML: charts with readable axes, module types, sizes formatted; and the
page loads in a real headless browser, offline.

The browser test needs Debian's ``chromium`` package (``apt-get install -y chromium``); it is
skipped without it.
"""

from __future__ import annotations

import html as htmllib
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

from memkit.render.html import axis_ticks, line_plot
from memkit.tracking import track
from memkit.tracking.report import DeviceReport, ModuleRecord, TrackReport
from memkit.units import format_size, parse_size

BROWSER = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)


def tracked_report(steps: int = 3) -> TrackReport:
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="32MiB") as tracker:
        for _ in range(steps):
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    return tracker.report()


def report_page(path) -> None:
    tracked_report().to_html(path)


def ticks(svg: str, axis: str) -> list[str]:
    return [htmllib.unescape(t) for t in re.findall(rf'class="tick-{axis}"[^>]*>([^<]*)<', svg)]


def test_line_plot_has_round_ticks_on_both_axes():
    mib = 1024**2
    svg = line_plot(
        [("allocated", [(0.0, 0.0), (1.2, 3.5 * mib), (2.4, 5.9 * mib)])],
        x_label="seconds", y_bytes=True,
    )  # fmt: skip
    assert ticks(svg, "y") == ["0 B", "2.00 MiB", "4.00 MiB", "6.00 MiB"]  # up to above 5.9
    xs = ticks(svg, "x")
    assert xs == ["0.0", "0.5", "1.0", "1.5", "2.0"], xs
    assert ">seconds</text>" in svg and "<script" not in svg
    steps = line_plot([("peak", [(s, float(100 + s)) for s in range(8)])], x_integer=True)
    assert ticks(steps, "x") == ["0", "2", "4", "6"] and ticks(steps, "y")[0] == "0"
    one = line_plot([("peak", [(0, 10.0)])], x_integer=True)  # a single step: one tick, 0
    assert ticks(one, "x") == ["0"]


def test_axis_ticks_are_round_and_inside_the_range():
    assert axis_ticks(0, 9.5) == [0, 2, 4, 6, 8]
    assert axis_ticks(0.3, 1.0) == pytest.approx([0.4, 0.6, 0.8, 1.0])
    assert axis_ticks(0, 3, integer=True) == [0, 1, 2, 3]
    gib = axis_ticks(0, 70 * 1024**3, binary=True)  # round numbers of GiB, not of bytes
    assert [format_size(t) for t in gib] == ["0 B", "20.00 GiB", "40.00 GiB", "60.00 GiB"]


def test_report_charts_have_size_and_time_ticks():
    report = tracked_report(steps=5)
    page = report.to_html()
    svgs = re.findall(r"<svg.*?</svg>", page)
    # the reported peak is on the memory chart (its readings, at hooks, may stay below it:
    # an optimizer's temporaries come and go between them), and the y axis reaches it
    peak = report.devices[0].peak_allocated
    (level,) = re.findall(r'<text class="level"[^>]*>([^<]*)<', svgs[0])
    assert level.startswith(f"peak allocated {format_size(peak)}"), level
    assert parse_size(ticks(svgs[0], "y")[-1].replace(" ", "")) >= peak
    assert len(svgs) == 2  # memory over time, peak per step
    for svg in svgs:
        ys, xs = ticks(svg, "y"), ticks(svg, "x")
        assert len(ys) >= 3 and len(xs) >= 2, (ys, xs)
        assert ys[0] == "0 B" and all(re.fullmatch(r"\d+(\.\d\d)? (B|KiB|MiB)", y) for y in ys)
        sizes = [parse_size(y.replace(" ", "")) for y in ys]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
        values = [float(x) for x in xs]
        assert values == sorted(values)
    assert all(x.isdigit() for x in ticks(svgs[1], "x"))  # steps are whole numbers
    assert "seconds since the start" in svgs[0] and ">step</text>" in svgs[1]
    assert "<script" not in page


def test_capacity_far_above_the_peak_is_a_note_not_a_flat_line():
    report = tracked_report()  # peak of a few hundred KiB on a 32 MiB device
    page = report.to_html()
    assert "<title>capacity</title>" not in page
    assert "capacity 32.00 MiB is above this chart: the peak, " in page


def _module(path: str, type_name: str | None, kept: int) -> ModuleRecord:
    return ModuleRecord(path, "cpu", 1, kept, kept, kept, 2 * kept, kept, True,
                        type_name=type_name)  # fmt: skip


def test_module_rows_show_the_layer_type_beside_the_path():
    modules = (
        _module("0", "Linear", 4096),
        _module("encoder.attn", "MultiheadAttention", 2048),
        _module("2", None, 1024),  # no type recorded: the path alone
        _module("Sequential", "Sequential", 0),  # the model itself: named by its class once
    )
    dev = DeviceReport("cpu", "simulated cpu", "counted", 1 << 20, 0, 0, 8192, 8192,
                       {"forward": 8192}, modules=modules)  # fmt: skip
    report = TrackReport(devices=(dev,), steps=1, mode="per-module", duration_s=0.1)
    for text in (str(report), report.html_body()):
        assert "0 (Linear)" in text and "encoder.attn (MultiheadAttention)" in text
        assert "2 (None)" not in text and "2 ()" not in text
        assert "Sequential (Sequential)" not in text and "Sequential" in text
    assert "<td>2</td>" in report.html_body()
    assert report.to_dict()["devices"][0]["modules"][0]["type_name"] == "Linear"


def test_report_text_and_html_show_sizes_not_raw_byte_counts():
    report = tracked_report()
    raw = re.compile(r"(?<![\w.])\d{4,}(?![\w.])")  # a bare integer of 4+ digits
    assert not raw.findall(str(report)), str(report)
    visible = re.sub(r"<[^>]*>", " ", report.to_html())  # text, not SVG coordinates
    assert not raw.findall(visible)


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


def test_a_long_timeline_keeps_each_steps_swing_when_thinned():
    """Sweep HH: past MAX_PLOT_POINTS the chart kept each bucket's highest reading only, so a
    5000-step run whose every step swings between 3.2 and 5.85 KiB drew a flat line."""
    from memkit.render.track import MAX_PLOT_POINTS, _downsample
    from memkit.tracking.report import TimelinePoint

    points = [
        TimelinePoint(
            t=i * 0.01,
            step=i // 3,
            phase="forward",
            module=None,
            allocated=5990 if i % 3 == 1 else 3277,
            reserved=0,
        )
        for i in range(15000)
    ]
    kept = _downsample(points, MAX_PLOT_POINTS)
    assert len(kept) <= MAX_PLOT_POINTS
    assert [p.t for p in kept] == sorted(p.t for p in kept)
    assert {p.allocated for p in kept} == {3277, 5990}
    assert sum(p.allocated == 5990 for p in kept) >= len(kept) // 3


def test_a_small_share_of_the_capacity_is_not_written_as_zero_percent():
    """Sweep HH: 'the peak, 222.43 KiB, is 0% of it' for a 0.3% share."""
    report = tracked_report(steps=1)
    dev = report.devices[0]
    assert dev.capacity and dev.peak_allocated / dev.capacity < 0.05
    page = report.to_html()
    assert " is 0% of it" not in page
    assert re.search(r"is (\d\.\d%|under 0\.1%) of it", page), page[:2000]
