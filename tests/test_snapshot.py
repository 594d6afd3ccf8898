"""Snapshots on a machine without a GPU: rows, reasons, categories, diffs, renderings, CLI."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import sys
from html import escape as html_escape

import pytest
import torch
from click.testing import CliRunner

import memkit
from memkit import devices
from memkit.cli import cli
from memkit.errors import ConfigError
from memkit.render import plot
from memkit.snapshots import (
    DeviceSnapshot,
    Snapshot,
    snapshot,
)
from memkit.units import format_size

snapshot_module = importlib.import_module("memkit.snapshots")

needs_no_gpu = pytest.mark.skipif(
    devices.accelerator_available(), reason="checks the no-accelerator rendering"
)


class TiedLM(torch.nn.Module):
    """An embedding tied to the output projection, plus a buffer and a shared-storage view."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 100, bias=False)
        self.out.weight = self.embed.weight  # tied
        # a buffer that views a parameter's storage: must not be counted twice
        self.register_buffer("alias", self.hidden.weight.detach()[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.hidden(self.embed(ids))))


@pytest.fixture
def no_smi(monkeypatch):
    """No subprocess in unit tests: nvidia-smi reports nothing."""
    monkeypatch.setattr(devices, "gpu_stats", lambda: ([], "nvidia-smi is not installed"))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.randint(0, 100, (8,))
    model(ids).sum().backward()
    opt.step()


# -- rows and reasons -------------------------------------------------------------------------
@needs_no_gpu
def test_no_gpu_snapshot_has_a_reasoned_row_and_host(no_smi):
    snap = snapshot()
    assert len(snap.devices) == 1
    row = snap.devices[0]
    assert row.kind == "none"
    assert row.allocated is None and row.total is None
    assert "torch sees no CUDA/XPU/MPS device" in (row.why("allocated") or "")
    assert snap.host.process_rss and snap.host.available and snap.host.total
    text = str(snap)
    assert "no accelerator visible" in text and "torch sees no CUDA/XPU/MPS device" in text
    html = snap._repr_html_()
    assert "memkit-snapshot" in html and "no accelerator visible" in html
    assert json.loads(snap.to_json())["devices"][0]["missing"]["allocated"]


@needs_no_gpu
def test_gputil_failure_is_a_reason_not_a_crash(monkeypatch):
    calls = []

    def broken():
        calls.append(1)
        return [], "GPUtil is not importable (ModuleNotFoundError: No module named 'distutils')"

    monkeypatch.setattr(devices.readings, "nvml_stats", lambda: ([], "NVML is unavailable"))
    monkeypatch.setattr(devices.readings, "nvidia_smi_stats", broken)
    snap = snapshot()
    assert calls == [1]
    assert snap.devices[0].kind == "none"


def test_gputil_raising_inside_is_a_reason(monkeypatch):
    """devices.nvidia_smi_stats turns GPUtil's own errors into a reason."""

    class Broken:
        @staticmethod
        def getGPUs():
            raise ValueError("could not convert string to float: '[N/A]'")

    monkeypatch.setitem(sys.modules, "GPUtil", Broken)
    stats, reason = devices.nvidia_smi_stats()
    assert stats == [] and "N/A" in (reason or "")


def test_gpus_only_nvidia_smi_sees_get_device_wide_rows(monkeypatch):
    gpu = devices.GpuStats(None, "GPU-abc", "NVIDIA A100", 12.0, 40.0, 2 * 2**30, 40 * 2**30)
    monkeypatch.setattr(devices, "gpu_stats", lambda: ([gpu], None))
    monkeypatch.setattr(devices, "visible_devices", list)
    snap = snapshot()
    row = snap.devices[0]
    assert row.kind == "nvidia-smi" and row.name == "NVIDIA A100"
    assert row.used == 2 * 2**30 and row.total == 40 * 2**30 and row.utilization == 12.0
    assert "cannot see this GPU" in (row.why("allocated") or "")
    assert "nvidia-smi:0" in str(snap)


def test_simulated_device_row_reports_its_counters(no_smi):
    model = torch.nn.Linear(32, 32)
    with memkit.simulate("1MiB", track=model) as acct:
        y = model(torch.randn(4, 32))
        snap = snapshot(model, device=acct)
    row = snap.devices[0]
    assert row.kind == "simulated" and row.device == "cpu"
    assert row.total == 2**20
    assert row.allocated == acct.current == row.reserved
    assert row.peak_allocated == acct.peak
    assert row.why("utilization")
    cats = snap.categories[0]
    # exact: everything the accountant counts is either the model's or "other"
    assert cats.categorised + (cats.other or 0) == acct.current
    assert cats.other == y.untyped_storage().nbytes() + 4 * 32 * 4  # output + input batch
    assert "other tensors" in snap._repr_html_()
    # sweep CO: its explanation spoke of torch.cuda.memory_allocated, nvidia-smi and CUDA
    # contexts, and its legend had a "CUDA context" slice
    text, html = str(snap), snap.to_html()
    assert "torch.cuda" not in text and "nvidia-smi" not in text
    assert "reserved: equal to allocated: the simulated device keeps no cache" in text
    assert "CUDA context + other processes" not in html
    assert snap.to_dict()["explain"]["allocated"].startswith("the live tensor storages")


def test_simulated_backend_and_cpu_string(no_smi):
    model = torch.nn.Linear(10, 10)
    backend = devices.get_backend("cpu", "1MiB")
    backend.track(model)
    snap = snapshot(model, device=backend)
    assert snap.devices[0].allocated == 440
    fresh = snapshot(model, device="cpu")
    assert fresh.devices[0].allocated == 440
    assert any("fresh simulated device" in n for n in fresh.notes)


def test_untracked_model_on_a_simulated_device_is_noted(no_smi):
    model = torch.nn.Linear(10, 10)
    acct = memkit.simulate("1MiB")
    snap = snapshot(model, device=acct)
    assert any("not counted by the simulated device" in n for n in snap.notes)


def test_bad_device_argument_is_a_config_error(no_smi):
    with pytest.raises(ConfigError, match="device="):
        snapshot(device=3.5)  # type: ignore[arg-type]


def test_an_object_snapshot_cannot_read_is_a_config_error(no_smi):
    """A string (a label meant as ``label=``) or a number was silently ignored: the snapshot
    said nothing about it. Inside a dict or a list, other values are still skipped."""
    with pytest.raises(ConfigError, match=r"objects\[0\]: .* found 'before' \(str\); to name "
                       r"this moment, pass label='before'"):  # fmt: skip
        memkit.snapshot("before", device="cpu")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"objects\[1\]: expected a model, .* found 123 \(int\)"):
        memkit.snapshot(model, 123, device="cpu")
    snap = memkit.snapshot({"step": 3, "model": model}, device="cpu")
    assert {t.name for t in snap.tensors} == {"model.weight", "model.bias"}


# -- categorising -----------------------------------------------------------------------------
def test_tied_and_shared_storages_are_counted_once(no_smi):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt)
    snap = snapshot(model, opt)
    (cats,) = snap.categories
    assert cats.device == "cpu"
    unique = {id(p): p for p in model.parameters()}  # parameters() already dedups the tie
    params = sum(p.untyped_storage().nbytes() for p in unique.values())
    assert cats.parameters == params == (100 * 16 + 16 * 16 + 16 + 16 + 16) * 4
    # BatchNorm's running stats (2 x 16 floats) and num_batches_tracked (int64); the alias
    # buffer shares hidden.weight's storage and counts as a parameter only
    assert cats.buffers == 2 * 16 * 4 + 8
    assert cats.gradients == params
    exp = sum(
        v.untyped_storage().nbytes()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    assert cats.optimizer_state == exp
    assert cats.other is None and "scan_gc" in cats.other_how


def test_largest_tensors_are_named_by_parameter(no_smi):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt)
    snap = snapshot(model, opt, top=4)
    assert len(snap.tensors) == 4
    names = {t.name: t for t in snap.tensors}
    emb = names["embed.weight"]
    assert emb.kind == "parameter" and emb.shape == (100, 16) and emb.dtype == "float32"
    assert emb.nbytes == 100 * 16 * 4
    assert emb.aliases == ("out.weight",)
    assert "embed.weight (= out.weight)" in str(snap)
    assert {"embed.weight.grad", "embed.weight:exp_avg", "embed.weight:exp_avg_sq"} <= set(names)


def test_a_sparse_gradient_is_its_indices_and_values(no_smi):
    emb = torch.nn.Embedding(5000, 32, sparse=True)
    emb(torch.randint(0, 5000, (300,))).sum().backward()
    grad = emb.weight.grad
    assert grad.layout == torch.sparse_coo
    snap = snapshot(emb, top=3)
    (cats,) = snap.categories
    assert cats.gradients == grad._indices().nbytes + grad._values().nbytes == 300 * (8 + 32 * 4)
    names = {t.name: t for t in snap.tensors}
    assert names["weight.grad.values"].shape == (300, 32)
    assert names["weight.grad.indices"].nbytes == 300 * 8


def test_dict_keys_name_tensors_and_gc_scan_finds_the_rest(no_smi):
    batch = torch.zeros(1000)
    hidden = torch.zeros(3000)  # noqa: F841 - found by the gc scan only
    snap = snapshot({"batch": batch}, top=50)
    assert any(t.name == "batch" and t.kind == "tensor" for t in snap.tensors)
    assert all(t.nbytes != 12000 for t in snap.tensors)
    scanned = snapshot({"batch": batch}, scan_gc=True, top=50)
    assert any(t.name is None and t.nbytes == 12000 for t in scanned.tensors)
    assert any(t.name == "batch" for t in scanned.tensors)
    cats = scanned.categories[0]
    assert cats.other is not None and cats.other >= 16000
    assert "gc scan" in cats.other_how


def test_optimizer_without_model_names_param_groups(no_smi):
    w = torch.nn.Parameter(torch.randn(64))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.sum().backward()
    opt.step()
    snap = snapshot(opt)
    names = {t.name for t in snap.tensors}
    assert {"param_groups[0][0]", "param_groups[0][0].grad"} <= names
    assert "param_groups[0][0]:momentum_buffer" in names


def test_snapshot_is_frozen_and_json_round_trips(no_smi):
    snap = snapshot(torch.nn.Linear(4, 4), label="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.label = "y"  # type: ignore[misc]
    data = json.loads(snap.to_json())
    assert data["schema"] == "memkit.snapshot/1" and data["label"] == "x"
    assert data["categories"][0]["parameters"] == 80
    assert set(data["explain"]) == {"allocated", "reserved", "used"}


# -- diffs ------------------------------------------------------------------------------------
def _fake(**changes: object) -> DeviceSnapshot:
    base = DeviceSnapshot(
        "cuda:0", "NVIDIA H100", "cuda", "cuda caching allocator", total=80 * 2**30,
        used=10 * 2**30, used_source="nvidia-smi", allocated=2**30, reserved=2 * 2**30,
        peak_allocated=2**30, peak_reserved=2 * 2**30, utilization=50.0, temperature=40.0,
        uuid="GPU-1",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _snap(dev: DeviceSnapshot, at: float = 0.0) -> Snapshot:
    return Snapshot(at, (dev,), snapshot_module.HostSnapshot(100, 1000, 2000))


def test_diff_shows_only_what_changed():
    before = _snap(_fake())
    after = _snap(_fake(allocated=2**30 + 512 * 2**20, peak_allocated=2**30 + 512 * 2**20), 2.5)
    diff = after - before
    assert [(c.where, c.what) for c in diff.changes] == [
        ("cuda:0", "allocated"),
        ("cuda:0", "peak allocated"),
    ]
    assert diff.changes[0].delta == 512 * 2**20
    text = str(diff)
    assert "+512.00 MiB" in text and "reserved" not in text and "+2.5 s" in text
    html = diff._repr_html_()
    assert "memkit-diff" in html and "+512.00 MiB" in html
    assert json.loads(diff.to_json())["changes"][0]["delta"] == 512 * 2**20
    same = before - before
    assert not same and "no changes" in str(same) and "no changes" in same._repr_html_()


def test_diff_matches_devices_by_uuid_and_reports_added_and_gone():
    before = Snapshot(0, (_fake(),), snapshot_module.HostSnapshot(1, 1, 1))
    renumbered = _fake(device="cuda:1")  # same GPU, another index (CUDA_VISIBLE_DEVICES)
    other = _fake(device="cuda:0", uuid="GPU-2", name="NVIDIA A100")
    after = Snapshot(1, (other, renumbered), snapshot_module.HostSnapshot(1, 1, 1))
    changes = [(c.where, c.what, c.format_delta()) for c in (after - before).changes]
    assert changes == [("cuda:0", "device", "new")]
    gone = [(c.where, c.what, c.format_delta()) for c in (before - after).changes]
    assert gone == [("cuda:0", "device", "gone")]


def test_diff_notes_when_the_sides_read_different_devices():
    def simulated(budget: int) -> DeviceSnapshot:
        return _fake(device="cpu", name=f"simulated cpu ({budget >> 20} MiB)", kind="simulated",
                     uuid=None, total=budget)  # fmt: skip

    small, large = _snap(simulated(8 * 2**20)), _snap(simulated(16 * 2**20))
    (note,) = (large - small).notes
    assert "cpu is not one device over time" in note and "8.00 MiB" in note
    assert note in str(large - small) and "note:" not in str(small - small)
    host = _snap(_fake(device="none", name="no accelerator visible", kind="none", uuid=None))
    (kinds,) = (large - host).notes
    assert "different kinds of device" in kinds and "no accelerator visible" in kinds
    assert not (small - small).notes and json.loads((large - host).to_json())["notes"] == [kinds]
    assert "different kinds of device" in (large - host)._repr_html_()
    # one GPU whose total came from nvidia-smi before CUDA was used, from cudaMemGetInfo
    # after (or was unknown before): the same device, no note
    smi = _snap(_fake(total=81559 * 2**20, reserved=0, allocated=0))
    used = _snap(_fake(total=85_029_158_912, used_source="cudaMemGetInfo"), 3.0)
    assert not (used - smi).notes and not (used - _snap(_fake(total=None))).notes


def test_diff_of_real_snapshots_across_a_train_step(no_smi):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters())
    s1 = snapshot(model, opt)
    _train_step(model, opt)
    s2 = snapshot(model, opt)
    diff = s2 - s1
    whats = {(c.where, c.what): c for c in diff.changes}
    grads = whats[("cpu holds", "gradients")]
    assert grads.before == 0 and grads.after == s2.categories[0].gradients > 0
    assert ("cpu holds", "parameters") not in whats  # unchanged: not shown
    assert whats[("tensor", "embed.weight:exp_avg")].format_delta() == "new"
    assert s2.diff(s1) == diff


def test_a_diff_backward_in_time_or_without_the_optimizer_says_so(no_smi):
    """Sweep BU: ``s1 - s2`` (earlier minus later) showed a gradient made between them as
    "still alive, not in the later snapshot", and a later snapshot not given the optimizer
    showed its state as freed; neither said why."""
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters())
    with memkit.simulate("64MiB", track=(model, opt)) as device:
        _train_step(model, opt)
        s1 = snapshot(model, opt, device=device)
        s2 = snapshot(model, device=device)  # the optimizer left out: 'other' here
    notes = " ".join((s2 - s1).notes)
    state = s1.categories[0].optimizer_state
    assert state > 0 and f"optimizer state went from {format_size(state)} to 0" in notes
    assert "not freed" in notes and "backward in time" not in notes
    assert "runs backward in time" in " ".join((s1 - s2).notes)
    # taken in the next cell, after the block: the device's numbers stopped (sweep BU)
    assert not any("counts nothing now" in n for n in s1.notes)
    after = snapshot(model, opt, device=device)
    assert any("block has ended" in n for n in after.notes)


def test_subtracting_something_else_is_a_type_error():
    with pytest.raises(TypeError):
        _ = _snap(_fake()) - 3  # type: ignore[operator]


def test_html_has_a_stacked_bar_per_device_and_explains_the_gaps():
    snap = _snap(_fake())
    html = snap._repr_html_()
    assert html.count('class="bar"') == 1
    for label in snapshot_module.BAR_LABELS:
        assert html_escape(label) in html
    for name, _line in snapshot_module.EXPLAIN:
        assert f"<b>{name}</b>" in html
    dev = snap.devices[0]
    assert dev.cached == 2**30 and dev.outside == 8 * 2**30 and dev.free == 70 * 2**30
    text = str(snap)
    assert "10.00 GiB / 80.00 GiB" in text and "50%" in text and "40 °C" in text


# -- plotting ---------------------------------------------------------------------------------
def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ConfigError, match=r"pip install 'memkit\[plot\]'"):
        _snap(_fake()).plot()


def test_plot_draws_a_bar_per_device():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = _snap(_fake()).plot()
    assert ax.get_xlabel() == "memory (GiB)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cuda:0"]
    ax2 = plot.timeline(
        [("allocated", [(0.0, 0.0), (1.0, 3 * 2**20)])],
        spans=[(0.0, 0.5, "forward"), (0.5, 1.0, "backward")],
        limit=4 * 2**20,
    )
    assert ax2.get_ylabel() == "memory (MiB)"
    import matplotlib.pyplot as plt

    plt.close("all")


# -- CLI --------------------------------------------------------------------------------------
def test_cli_snapshot_prints_the_table(no_smi):
    result = CliRunner().invoke(cli, ["snapshot"])
    assert result.exit_code == 0, result.output
    assert "memkit snapshot" in result.output and "host: process RSS" in result.output


def test_cli_snapshot_json(no_smi):
    result = CliRunner().invoke(cli, ["snapshot", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["schema"] == "memkit.snapshot/1" and data["host"]["total"] > 0


def test_cli_watch_prints_one_line_per_device_per_tick_off_a_tty(no_smi):
    result = CliRunner().invoke(cli, ["snapshot", "--watch", "0.1", "--count", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    rows = len(snapshot().devices) + 1  # devices + host
    assert len(lines) == 2 * rows
    assert "\x1b[" not in result.output
    assert sum(" host " in line for line in lines) == 2


def test_cli_watch_json_lines(no_smi):
    result = CliRunner().invoke(cli, ["snapshot", "--json", "--watch", "0", "--count", "3"])
    assert result.exit_code == 0, result.output
    objs = [json.loads(line) for line in result.output.splitlines()]
    assert len(objs) == 3 and all(o["schema"] == "memkit.snapshot/1" for o in objs)


def test_cli_watch_refreshes_in_place_on_a_tty(no_smi, monkeypatch):
    import memkit.cli.snapshot

    monkeypatch.setattr(memkit.cli.snapshot, "_stdout_is_tty", lambda: True)
    result = CliRunner().invoke(cli, ["snapshot", "--watch", "0", "--count", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.count("\x1b[H") == 2 and result.output.count("\x1b[2J") == 1
    assert result.output.count("memkit snapshot") == 2


def test_cli_bad_watch_is_a_usage_error():
    result = CliRunner().invoke(cli, ["snapshot", "--watch", "-1"])
    assert result.exit_code == 2


# -- CUDA rows, with the hardware faked (tests/gpu/ checks the real numbers) -------------------
class FakeCuda(devices.CudaBackend):
    """A CudaBackend whose counters are set by the test; device_wide() records its calls."""

    def __init__(self, index: int, allocated: int, reserved: int) -> None:
        super().__init__(torch.device("cuda", index))
        self._a, self._r = allocated, reserved
        self.wide_calls = 0

    def name(self) -> str:
        return "Fake GPU"

    def allocated(self) -> int:
        return self._a

    def reserved(self) -> int:
        return self._r

    def peak_allocated(self) -> int:
        return self._a

    def peak_reserved(self) -> int:
        return self._r

    def device_wide(self) -> tuple[int, int] | None:
        self.wide_calls += 1
        return (30 * 2**30, 40 * 2**30)


def test_cuda_rows_in_index_order_without_creating_contexts(monkeypatch):
    backends = {0: FakeCuda(0, 2**30, 2 * 2**30), 1: FakeCuda(1, 0, 0)}
    stats = [  # nvidia-smi lists them in PCI order; CUDA order comes from the UUID map
        devices.GpuStats(1, "GPU-b", "NVIDIA B", 5.0, 35.0, 3 * 2**30, 40 * 2**30),
        devices.GpuStats(0, "GPU-a", "NVIDIA A", 90.0, 70.0, 11 * 2**30, 40 * 2**30),
    ]
    monkeypatch.setattr(devices, "gpu_stats", lambda: (stats, None))
    monkeypatch.setattr(
        devices, "visible_devices", lambda: [torch.device("cuda", 0), torch.device("cuda", 1)]
    )
    monkeypatch.setattr(devices, "get_backend", lambda dev, *a, **k: backends[dev.index])
    snap = snapshot()
    d0, d1 = snap.devices
    assert (d0.device, d0.name, d0.uuid, d0.utilization) == ("cuda:0", "NVIDIA A", "GPU-a", 90.0)
    # cuda:0 holds memory, so cudaMemGetInfo is safe; cuda:1 does not: nvidia-smi's numbers
    assert (d0.used, d0.used_source) == (10 * 2**30, "cudaMemGetInfo")
    assert backends[0].wide_calls == 1 and backends[1].wide_calls == 0
    assert (d1.used, d1.used_source, d1.temperature) == (3 * 2**30, "nvidia-smi", 35.0)
    assert d0.cached == 2**30 and d0.outside == 8 * 2**30
    assert 'class="bar"' in snap._repr_html_()


def test_cuda_row_without_nvidia_smi_says_why_used_is_missing(monkeypatch):
    idle = FakeCuda(0, 0, 0)
    monkeypatch.setattr(devices, "gpu_stats", lambda: ([], "GPUtil is not importable"))
    monkeypatch.setattr(devices, "visible_devices", lambda: [torch.device("cuda", 0)])
    monkeypatch.setattr(devices, "get_backend", lambda dev, *a, **k: idle)
    row = snapshot().devices[0]
    assert row.used is None and idle.wide_calls == 0
    assert "would create a CUDA context" in (row.why("used") or "")
    assert "GPUtil is not importable" in (row.why("utilization") or "")
    assert row.allocated == 0 and row.name == "Fake GPU"
    explicit = snapshot(device=idle).devices[0]  # named explicitly: read it anyway
    assert explicit.used == 10 * 2**30 and idle.wide_calls == 1


# -- diffs of the largest tensors: matched by storage, then by name ---------------------------
BIG = 100_000  # a top that lists every tensor, so that the rows must add up to the categories


def _tensor_rows(diff) -> dict[str, object]:
    return {c.what: c for c in diff.changes if c.where == "tensor"}


def _category_delta(diff, device: str = "cpu") -> int:
    return sum(c.delta or 0 for c in diff.changes if c.where == f"{device} holds")


def _row_delta(diff) -> int:
    """Bytes the tensor rows add up to: new rows count their after, gone rows their before."""
    rows = [c for c in diff.changes if c.where == "tensor"]
    return sum((c.after or 0) - (c.before or 0) for c in rows if not c.note.startswith("still"))


def test_diff_after_del_keeps_live_storages_and_says_they_lost_their_names(no_smi):
    """The sweep's finding: `del model` while something else holds it. The weights are not
    gone (their storages live on); the gc scan finds them unnamed, and the diff says so."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = {id(p.untyped_storage()): p.untyped_storage().nbytes() for p in model.parameters()}
    state = {
        id(v.untyped_storage()): v.untyped_storage().nbytes()
        for st in opt.state.values()
        for v in st.values()
    }
    mine = sum(params.values()) + sum(state.values())  # 2 x 2 moments + 2 steps
    gc.collect()
    s2 = snapshot(model, opt, label="trained", scan_gc=True, top=BIG)
    keep = [model, opt]  # noqa: F841 - what still holds the model after `del`
    del model, opt
    gc.collect()
    s3 = snapshot(label="deleted", scan_gc=True, top=BIG)
    diff = s3 - s2
    whats = {(c.where, c.what): c for c in diff.changes}
    assert whats[("cpu holds", "parameters")].delta == -sum(params.values())
    assert whats[("cpu holds", "optimizer state")].delta == -sum(state.values())
    assert whats[("cpu holds", "other")].delta == mine
    rows = _tensor_rows(diff)
    named = {"weight", "bias", *(f"{p}:{k}" for p in ("weight", "bias")
                                   for k in ("exp_avg", "exp_avg_sq", "step"))}  # fmt: skip
    assert {w for w, c in rows.items() if c.note == "now unnamed"} == named
    assert all(rows[w].before == rows[w].after for w in named)
    assert sum(rows[w].before for w in named) == mine
    assert not [c for c in rows.values() if c.format_delta() in ("new", "gone")]
    assert _row_delta(diff) == _category_delta(diff) == 0
    text, html = str(diff), diff._repr_html_()
    assert "now unnamed" in text and "now unnamed" in html and " gone" not in text
    data = json.loads(diff.to_json())
    assert {c["what"] for c in data["changes"] if c["note"] == "now unnamed"} == named


def test_unnamed_tensors_of_one_shape_are_one_row_with_their_count(no_smi):
    anchor = {"anchor": torch.zeros(1)}  # tensors are compared when both snapshots list some
    gc.collect()
    s1 = snapshot(anchor, scan_gc=True, top=BIG)
    made = [torch.zeros(48, 48) for _ in range(3)]
    s2 = snapshot(anchor, scan_gc=True, top=BIG)
    diff = s2 - s1
    row = _tensor_rows(diff)["float32[48, 48]@cpu"]
    assert (row.before, row.count, row.format_delta()) == (None, 3, "new")
    assert row.after == sum(t.untyped_storage().nbytes() for t in made) == 3 * 48 * 48 * 4
    assert _row_delta(diff) == _category_delta(diff)
    assert "float32[48, 48]@cpu (3 tensors)" in str(diff)
    assert "float32[48, 48]@cpu (3 tensors)" in diff._repr_html_()
    (data,) = [c for c in json.loads(diff.to_json())["changes"] if c["what"] == row.what]
    assert (data["count"], data["after"]) == (3, 3 * 48 * 48 * 4)


def test_a_freed_tensor_is_gone_and_one_still_alive_elsewhere_is_not(no_smi):
    kept, freed = torch.zeros(300), torch.zeros(200)
    s1 = snapshot({"kept": kept, "freed": freed}, top=BIG)
    del freed
    s2 = snapshot({"other": torch.zeros(10)}, top=BIG)  # looks at neither
    rows = _tensor_rows(s2 - s1)
    assert (rows["freed"].before, rows["freed"].after, rows["freed"].format_delta()) == (
        800, None, "gone",
    )  # fmt: skip
    assert rows["kept"].format_delta() == "still alive, not in the later snapshot"
    assert (rows["other"].before, rows["other"].after) == (None, 40)
    assert kept.untyped_storage().nbytes() == rows["kept"].before == 1200


def test_a_new_storage_at_a_freed_ones_address_is_not_the_same_tensor(no_smi):
    """Same data pointer, same size, another storage: `a` went and `b` came, not a rename."""
    buffer = bytearray(4096)
    a = torch.frombuffer(buffer, dtype=torch.float32)
    address = a.data_ptr()
    s1 = snapshot({"a": a}, top=BIG)
    del a
    gc.collect()
    b = torch.frombuffer(buffer, dtype=torch.float32)
    assert b.data_ptr() == address and b.untyped_storage().nbytes() == 4096
    s2 = snapshot({"b": b}, top=BIG)
    assert s2.tensors[0].storage_id != s1.tensors[0].storage_id
    rows = _tensor_rows(s2 - s1)
    assert {w: c.format_delta() for w, c in rows.items()} == {"a": "gone", "b": "new"}
    # the same storage under another key is a rename, not a new tensor
    s3 = snapshot({"c": b}, top=BIG)
    assert [(c.what, c.format_delta()) for c in (s3 - s2).changes if c.where == "tensor"] == [
        ("b", "renamed to c")
    ]


def test_without_storage_identities_tensors_are_matched_by_name_and_shape():
    """Another process's snapshot (or records built by hand): names and shapes are all there is;
    tensors of one shape are counted, not merged into one."""
    info = snapshot_module.TensorInfo

    def snap(*tensors: object) -> Snapshot:
        return Snapshot(0, (_fake(),), snapshot_module.HostSnapshot(1, 1, 1), tensors=tensors)

    x = info(None, "tensor", (8,), "float32", "cpu", 32)
    w = info("w", "parameter", (8,), "float32", "cpu", 32)
    before = snap(w, x)
    after = snap(dataclasses.replace(w, nbytes=64), x, x, x)
    rows = [(c.what, c.before, c.after, c.count) for c in (after - before).changes]
    assert rows == [("w", 32, 64, 1), ("float32[8]@cpu", None, 64, 2)]


def test_a_storage_keeps_its_number_while_only_a_view_holds_it(no_smi):
    """What storage_id rests on: torch keeps a storage's Python object while the storage lives,
    so dropping every Python reference but a view's does not make it another storage."""
    a = torch.zeros(100)
    s1 = snapshot({"a": a})
    view = a[10:]
    del a
    gc.collect()
    s2 = snapshot({"view": view})
    assert s1.tensors[0].storage_id == s2.tensors[0].storage_id is not None
    assert [(c.what, c.before, c.after, c.note) for c in (s2 - s1).changes
            if c.where == "tensor"] == [("a", 400, 400, "renamed to view")]  # fmt: skip


def test_options_of_the_wrong_kind_are_config_errors_naming_the_option(no_smi):
    """``top='5'`` raised a raw TypeError from inside the sort, ``top=5.5`` one from a slice,
    ``scan_gc='yes'`` was taken as true (sweep KK); a forward output's ``.grad`` read warned."""
    import warnings

    model = torch.nn.Linear(4, 4)
    for options, message in (
        ({"top": "5"}, r"top: expected a whole number .* found '5' \(str\)"),
        ({"top": 5.5}, r"top: expected a whole number .* found 5.5 \(float\)"),
        ({"scan_gc": "yes"}, r"scan_gc: expected True or False, found 'yes' \(str\)"),
    ):
        with pytest.raises(ConfigError, match=message):
            snapshot(model, device="cpu", **options)
    out = model(torch.randn(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snap = snapshot({"out": out}, device="cpu")
    assert [t.name for t in snap.tensors] == ["out"]


def test_a_parameter_named_with_its_models_prefix_in_one_snapshot_is_no_rename(no_smi):
    """Sweep JJ: ``snapshot(model, opt)`` then ``snapshot(model, opt, ema)`` named the same
    weight ``0.weight`` and ``Sequential[0].0.weight`` (several models get a prefix): the diff
    listed every unchanged parameter as 'renamed to ...'."""
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    ema = copy.deepcopy(model)
    before = snapshot(model, device="cpu")
    after = snapshot(model, ema, device="cpu")
    assert "Sequential[0].0.weight" in [t.name for t in after.tensors]
    notes = [c.note for c in (after - before).changes if c.where == "tensor"]
    assert not any("renamed" in n for n in notes), notes


def test_a_diff_from_a_snapshot_without_objects_lists_no_empty_categories(no_smi):
    """Sweep CO: a diff between an object-less snapshot and one given a dict of tensors had
    rows "cpu holds parameters n/a -> 0 B new" for buffers, gradients and optimizer state too."""
    with memkit.simulate("64MiB") as gpu:
        before = snapshot(device=gpu)
        a = torch.randn(100, 100)
        after = snapshot({"a": a}, device=gpu)
    held = [c for c in (after - before).changes if c.where == "cpu holds"]
    assert [c.what for c in held] == ["other"] and held[0].after == a.untyped_storage().nbytes()
