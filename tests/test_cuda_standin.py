"""The CUDA stand-in (memkit/devices/cuda_standin.py): torch.cuda's memory API answered by the
simulated device, checked against hand counts of the caching allocator's rules, and memkit's
own CUDA paths (CudaBackend, the hooks' fast counters, the fraction cap, CUDA OOM parsing, the
probe, the tracker, snapshot, ``memkit run`` and the Lightning callback) run through it.

Independent counts come from the allocator's rules worked by hand (512-byte blocks, 2 MiB
small-pool segments, 20 MiB or 2 MiB-rounded large ones) and from a :class:`Witness` attached
to the stand-in's accountant, which sums the 512-rounded bytes of what is live without reading
any of the stand-in's counters.

Not run through the stand-in (see the module's docstring): the allocator's trace
(``memory_history=`` on CUDA), NVML readings, factories given ``device="cuda"``,
``tensor.device``/``is_cuda`` (still cpu), several GPUs, other threads.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memkit
from memkit import devices
from memkit.devices.cuda_standin import cuda_standin
from memkit.oom import is_oom, parse_oom_message
from memkit.simulated.accountant import cuda_rounded

MIB = 1 << 20
CUDA0 = torch.device("cuda", 0)


class Witness:
    """A storage observer: the 512-rounded bytes live, and their peak since :meth:`mark`."""

    def __init__(self) -> None:
        self.current = self.peak = 0
        self.peaks: list[int] = []

    def already_counted(self, storages: list[tuple[int, int, int]]) -> None:
        self.current = self.peak = sum(cuda_rounded(r) for _, _, r in storages)

    def allocated(self, key: int, counted: int, requested: int, existed: str | None) -> None:
        self.current += cuda_rounded(requested)
        self.peak = max(self.peak, self.current)

    def freed(self, key: int, counted: int) -> None:
        self.current -= counted

    def out_of_memory(self, tried: int, free: int) -> None:
        pass

    def mark(self) -> None:
        """End a window: keep its peak, start the next at the current bytes."""
        self.peaks.append(self.peak)
        self.peak = self.current


def on_gpu(n_floats: int) -> torch.Tensor:
    return torch.ones(n_floats).to("cuda")


# -- the stand-in itself -------------------------------------------------------------------------


def test_allocated_counts_blocks_and_reserved_moves_in_segments():
    """Hand count of the caching allocator: 512-byte blocks; a 2 MiB small-pool segment; a
    20 MiB segment for a 1-10 MiB request, split and reused by best fit; a 2 MiB-rounded
    segment of its own for a larger one; empty_cache frees only segments without live blocks."""
    with cuda_standin("1GiB") as gpu:
        a = on_gpu(1000)  # 4000 B -> 4096
        b = on_gpu(1)  # 4 B -> 512, same 2 MiB segment
        assert torch.cuda.memory_allocated() == 4096 + 512
        assert torch.cuda.memory_reserved() == 2 * MIB
        c = on_gpu(300_000)  # 1_200_000 B -> 1_200_128: large pool, a 20 MiB segment
        d = on_gpu(3_000_000)  # 12_000_000 B -> 12_000_256: fits what is left of c's segment
        assert torch.cuda.memory_reserved() == 22 * MIB
        e = on_gpu(7_500_000)  # 30_000_000 B -> 30_000_128: its own segment, 15 x 2 MiB
        blocks = 4096 + 512 + 1_200_128 + 12_000_256 + 30_000_128
        assert torch.cuda.memory_allocated() == blocks == gpu.accountant.current
        assert torch.cuda.memory_reserved() == 22 * MIB + 15 * 2 * MIB
        stats = torch.cuda.memory_stats()
        assert stats["segment.all.current"] == 3
        assert stats["segment.small_pool.current"] == 1
        assert stats["allocated_bytes.small_pool.current"] == 4096 + 512
        assert stats["allocation.all.current"] == 5
        requested = 4 * (1000 + 1 + 300_000 + 3_000_000 + 7_500_000)
        assert stats["requested_bytes.all.current"] == requested
        del d, e
        assert torch.cuda.memory_allocated() == 4096 + 512 + 1_200_128
        assert torch.cuda.memory_reserved() == 22 * MIB + 30 * MIB  # cached, not released
        assert torch.cuda.max_memory_allocated() == blocks
        stats = torch.cuda.memory_stats()  # free parts of segments still in use: a's and c's
        assert stats["inactive_split.all.current"] == 2
        assert stats["inactive_split_bytes.all.current"] == 22 * MIB - 4608 - 1_200_128
        assert "Non-releasable memory" in torch.cuda.memory_summary()  # torch's own table
        torch.cuda.empty_cache()  # e's segment is free; c's still holds c
        assert torch.cuda.memory_reserved() == 22 * MIB
        assert torch.cuda.max_memory_reserved() == 52 * MIB
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
        assert torch.cuda.max_memory_reserved() == 22 * MIB
        nested = torch.cuda.memory_stats_as_nested_dict()
        assert set(nested["allocated_bytes"]) == {"all", "small_pool", "large_pool"}
        assert set(nested["reserved_bytes"]["all"]) == {"current", "peak", "allocated", "freed"}
        assert nested["reserved_bytes"]["all"]["freed"] == 30 * MIB
        assert gpu.peak_resets == 1 and gpu.stat_reads > 10
        del a, b, c
        assert torch.cuda.memory_allocated() == 0


def test_an_unsplit_large_block_counts_whole():
    """A large block whose remainder is at most 1 MiB is not split: memory_allocated counts the
    whole block, as CUDA's allocator does, while the request (and the accountant's 512-byte
    count) is smaller."""
    with cuda_standin("1GiB") as gpu:
        x = on_gpu(5_111_808)  # 19.5 MiB: a 20 MiB segment, 0.5 MiB left is not split off
        assert torch.cuda.memory_allocated() == 20 * MIB == torch.cuda.memory_reserved()
        assert torch.cuda.memory_stats()["requested_bytes.all.current"] == 39 * MIB // 2
        assert gpu.accountant.current == 39 * MIB // 2
        del x


def test_host_and_device_tensors_follow_cudas_rules():
    """``.to("cuda")`` copies onto the device, ops on device tensors make device tensors,
    host-only work stays on the host, ``.cpu()`` copies back; a device tensor moved to cuda
    again is itself, as on CUDA."""
    with cuda_standin("64MiB") as gpu:
        host = torch.randn(256)  # made on the host: not device memory
        assert torch.cuda.memory_allocated() == 0 and not gpu.holds(host)
        x = host.to("cuda")
        assert gpu.holds(x) and torch.equal(x, host)
        assert x.to("cuda") is x and x.cuda() is x
        assert devices.tensor_device(x) == CUDA0 and devices.tensor_device(host).type == "cpu"
        y = (x * 2).sum()  # device inputs: device outputs (x * 2 is freed at once)
        assert torch.cuda.memory_allocated() == 1024 + 512
        back = x.cpu()
        assert not gpu.holds(back) and torch.equal(back, host)
        half = x.to("cpu", torch.float16)  # converted on the way back: a host tensor
        assert not gpu.holds(half) and torch.cuda.memory_allocated() == 1024 + 512
        del x, y
        assert torch.cuda.memory_allocated() == 0
        model = nn.Linear(100, 10)
        model.to("cuda")
        assert torch.cuda.memory_allocated() == cuda_rounded(4000) + cuda_rounded(40)
        assert all(gpu.holds(p) for p in model.parameters())
        model.cpu()
        assert torch.cuda.memory_allocated() == 0
        with pytest.raises(AssertionError, match="not compiled with CUDA"):
            torch.zeros(3, device="cuda")  # factories cannot make CUDA tensors here
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            host.to("cuda:1")


def test_fraction_cap_raises_cudas_oom_that_memkit_reads():
    """``set_per_process_memory_fraction`` caps reserved: the 20 MiB segment a 1-10 MiB
    request needs does not fit a 16 MiB cap, and the error has CUDA's wording and numbers."""
    with cuda_standin("64MiB") as gpu:
        big = torch.empty(10 * MIB, dtype=torch.uint8).to("cuda")  # its own 10 MiB segment
        torch.cuda.set_per_process_memory_fraction(0.25)
        assert torch.cuda.get_per_process_memory_fraction() == 0.25
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(8 * MIB, dtype=torch.uint8).to("cuda")
        message = str(info.value)
        assert message == (
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
            "64.00 MiB of which 54.00 MiB is free. Including non-PyTorch memory, this process "
            "has 10.00 MiB memory in use. 16.00 MiB allowed; Of the allocated memory 10.00 MiB "
            "is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
        assert is_oom(info.value)
        d = parse_oom_message(info.value)
        assert (d.tried_to_allocate, d.capacity, d.free) == (20 * MIB, 64 * MIB, 54 * MIB)
        assert (d.allocated_by_pytorch, d.reserved_unallocated) == (10 * MIB, 0)
        assert (d.process_in_use, d.allowed, d.device_index) == (10 * MIB, 16 * MIB, 0)
        # the failed request left nothing behind
        assert torch.cuda.memory_reserved() == 10 * MIB == torch.cuda.max_memory_reserved()
        assert torch.cuda.memory_stats()["num_ooms"] == 1 == gpu.num_ooms
        del big


def test_cached_segments_are_released_before_running_out():
    """Without a cap the capacity is the limit, and the allocator frees its cached segments
    before it gives up (release_cached_blocks), as CUDA's does."""
    with cuda_standin("32MiB"):
        a = torch.empty(12 * MIB, dtype=torch.uint8).to("cuda")
        del a  # its 12 MiB segment stays cached
        b = torch.empty(24 * MIB, dtype=torch.uint8).to("cuda")  # 12 + 24 > 32: cache freed
        assert torch.cuda.memory_reserved() == 24 * MIB
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 20\.00 MiB") as info:
            on_gpu(1 << 20)  # 4 MiB: a 20 MiB segment, 8 MiB left
        assert "allowed" not in str(info.value)
        assert parse_oom_message(info.value).free == 8 * MIB
        del b


def test_every_patched_attribute_is_restored_even_after_an_error():
    owners = {
        "torch.cuda": torch.cuda,
        "torch.cuda.memory": torch.cuda.memory,
        "torch._C": torch._C,
        "torch.Tensor": torch.Tensor,
        "memkit.devices": devices,
    }
    before = {name: dict(vars(owner)) for name, owner in owners.items()}
    # a CPU build says "Torch not compiled with CUDA enabled"; whatever it says, it says it again
    with pytest.raises((AssertionError, RuntimeError, NotImplementedError)) as outside:
        torch.zeros(1, device="cuda")
    with pytest.raises(ValueError, match="boom"), cuda_standin("8MiB") as gpu:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert hasattr(torch._C, "_cuda_memoryStats") and "to" in vars(torch.Tensor)
        x = on_gpu(10)
        raise ValueError("boom")
    for name, owner in owners.items():
        now = vars(owner)
        assert now.keys() == before[name].keys(), name
        changed = [k for k in now if now[k] is not before[name][k]]
        assert changed == [], (name, changed)
    assert not torch.cuda.is_available() and gpu.allocated == cuda_rounded(40)  # x lives on
    del x
    assert gpu.allocated == 0  # the accountant still hears of frees; torch is unpatched
    with pytest.raises(type(outside.value)):  # torch's own CUDA state was never initialised
        torch.zeros(1, device="cuda")
    with pytest.raises(RuntimeError, match="do not nest"), cuda_standin(), cuda_standin():
        pass
    assert not torch.cuda.is_available()


# -- memkit's CUDA code through it -------------------------------------------------------------


def test_cuda_backend_and_fast_counters_read_the_standin():
    """CudaBackend and counter_reader unchanged: the fast path reads _cuda_memoryStats once per
    call; a budget caps the allocator with set_per_process_memory_fraction for the block."""
    with cuda_standin("64MiB", name="Stand-in A100") as gpu:
        backend = devices.get_backend("cuda")
        assert isinstance(backend, devices.CudaBackend) and backend.name() == "Stand-in A100"
        x = on_gpu(1 << 18)  # 1 MiB: small pool
        read, reset = devices.counter_reader(backend)
        reads = gpu.stat_reads
        assert read() == (MIB, 2 * MIB, MIB, 2 * MIB)
        assert gpu.stat_reads == reads + 1
        del x
        reset()
        assert read() == (0, 2 * MIB, 0, 2 * MIB) and gpu.peak_resets == 1
        cap = backend.capacity()
        assert (cap.total, cap.free, cap.source) == (64 * MIB, 64 * MIB, "cudaMemGetInfo")
        capped = devices.get_backend("cuda", "16MiB")
        assert capped.capacity().total == 16 * MIB
        with capped.activate():
            assert torch.cuda.get_per_process_memory_fraction() == 0.25
            on_gpu(3 << 20)  # 12 MiB: a 12 MiB segment, 14 MiB reserved in all
            with pytest.raises(torch.OutOfMemoryError, match=r"16\.00 MiB allowed"):
                on_gpu(5 << 20)  # 20 MiB: over the cap even with the cache freed
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
        assert devices.visible_devices() == [CUDA0]


def test_take_reads_once_and_resets_only_a_peak_above_its_current_value():
    """A segment's end (``take``): the peaks read are the segment's, the reset starts the next
    one, and where the peaks already sit at the current bytes no reset call is made (one
    counter call saved on a GPU). The user's peak counter keeps the segment's peak."""
    with cuda_standin("64MiB") as gpu:
        backend = devices.get_backend("cuda")
        peaks = devices.UserPeaks(0, devices.counter_reader(backend)[0])
        read, reset = devices.counter_reader(backend, peaks)
        take = devices.peak_taker(read, reset)
        x = on_gpu(1 << 18)  # 1 MiB in a 2 MiB segment
        reads, resets = gpu.stat_reads, gpu.peak_resets
        assert take() == (MIB, 2 * MIB, MIB, 2 * MIB)
        assert (gpu.stat_reads, gpu.peak_resets) == (reads + 1, resets)  # peaks are current
        y = on_gpu(1 << 18)
        del y
        assert take() == (MIB, 2 * MIB, 2 * MIB, 2 * MIB)  # the freed tensor's peak
        assert gpu.peak_resets == resets + 1 and read()[2] == MIB  # the next segment's
        assert peaks.allocated >= 2 * MIB  # what the user's max_memory_allocated keeps
        del x
    sim = devices.SimulatedBackend("cpu", 64 * MIB)
    take = devices.peak_taker(*devices.counter_reader(sim))
    with sim.activate():
        z = torch.empty(1 << 18)
        del z
    assert take()[2] == MIB and take()[2] == 0  # the freed tensor's peak, then none


def test_the_accounting_names_the_cublas_workspaces_of_the_card(monkeypatch):
    """On the H200 a breakdown's "other" held 64 MiB that no tensor owns: PyTorch's cuBLAS
    workspaces (32 MiB on sm90 for each thread and stream that ran a matmul). The accounting
    line says so, with the size PyTorch chooses for the card or CUBLAS_WORKSPACE_CONFIG."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with cuda_standin("64MiB"):
        text = devices.get_backend("cuda").accounting
        assert "cuBLAS workspaces, 32.00 MiB for each thread and stream" in text
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # PyTorch's pre-Hopper
        assert "8.12 MiB for each" in devices.get_backend("cuda").accounting


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 1))


def _step(model: nn.Module, batch: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _batch(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


def test_probe_on_cuda_finds_the_exact_boundary():
    """The probe's answer fits and one more runs out when the step runs plainly under the same
    cap. Here the limit is CUDA's pool switch: at 129 samples the 2048-wide activation passes
    1 MiB, leaves the small pool and needs a 20 MiB segment, over the 12 MiB budget."""
    with cuda_standin("64MiB") as gpu:
        model = _mlp().to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        # SGD keeps no state: one step per trial shows the step's peak
        result = memkit.probe(
            model, _batch, optimizer=opt, train_step=_step, device="cuda", budget="12MiB",
            margin=0, steps=1, min_batch=80, max_batch=200,
        )  # fmt: skip
        n = result.max_batch_size
        assert n == 128 and result.trial(n + 1).fits is False
        assert "CUDA out of memory" in (result.trial(n + 1).error or "")
        assert torch.cuda.get_per_process_memory_fraction() == 1.0  # the cap was lifted
        outcomes = {}
        for size in (n, n + 1):
            torch.cuda.empty_cache()
            with devices.get_backend("cuda", "12MiB").activate():
                try:
                    _step(model, _batch(size).to("cuda"), opt)
                    outcomes[size] = "fits"
                except torch.OutOfMemoryError:
                    outcomes[size] = "OOM"
        assert outcomes == {n: "fits", n + 1: "OOM"}
        assert gpu.stat_reads > 0 and gpu.num_ooms >= 2


def test_track_on_cuda_gives_the_standins_step_peaks():
    """memkit.track(device="cuda") reads the CUDA counters; each step's peak and end bytes
    match a witness that sums live 512-byte blocks (every tensor here is in the small pool,
    where a block is exactly its rounded request)."""
    with cuda_standin("64MiB") as gpu:
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10)).to("cuda")
        opt = torch.optim.Adam(model.parameters())
        witness = Witness()
        gpu.accountant.observe(witness)
        ends = []
        with memkit.track(model, opt, device="cuda", postmortem=None) as tracker:
            witness.mark()
            for _ in range(3):
                batch = torch.randn(16, 32).to("cuda")
                model(batch).sum().backward()
                opt.step()
                witness.mark()
                ends.append(witness.current)
                opt.zero_grad(set_to_none=True)
                del batch
        report = tracker.report()
        dev = report.devices[0]
        assert (dev.device, dev.name, report.steps) == ("cuda:0", "Stand-in H200", 3)
        assert dev.accounting.startswith("cuda caching allocator counters")
        assert [s.peak_allocated for s in dev.steps] == witness.peaks[1:]
        assert [s.end_allocated for s in dev.steps] == ends
        assert all(s.peak_reserved == 2 * MIB for s in dev.steps)
        p = sum(cuda_rounded(t.nbytes) for t in model.parameters())
        bd = dev.breakdown
        assert bd is not None and bd.parameters == bd.gradients == sum(
            t.nbytes for t in model.parameters()
        )
        # Adam's step counters are host tensors on CUDA (not capturable): not device memory
        assert bd.optimizer_state == 2 * bd.parameters
        assert dev.peak_allocated >= 4 * p
        assert gpu.stat_reads > 0 and gpu.peak_resets > 0


def test_a_kept_tensor_in_an_unsplit_block_is_not_growth():
    """A loop keeps each step's 9.5 MiB output until the next one is made. The new output is
    cut from the 20 MiB segment's 10.5 MiB left, not split for 1 MiB (allocated counts 10.5
    MiB), then fits the hole the old one left exactly (9.5 MiB): allocated after each step
    moves by 1 MiB with nothing kept growing. On the H200 such slack kept nanoGPT's trials
    stepping to the 16-step limit; the probe compares the tensors' requested bytes."""
    kept: list[torch.Tensor] = []
    model = nn.Linear(8, 8)

    def step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        kept[:] = [torch.empty(19 * MIB // 2, dtype=torch.uint8).to("cuda")]

    with cuda_standin("256MiB"):
        model.to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        allocated = []
        for _ in range(3):
            step(model, torch.randn(4, 8).to("cuda"), opt)
            allocated.append(torch.cuda.memory_allocated())
        assert allocated[1] - allocated[0] == MIB == allocated[1] - allocated[2]
        kept.clear()
        result = memkit.probe(
            model, lambda n: torch.randn(n, 8), optimizer=opt, train_step=step, device="cuda",
            budget="128MiB", min_batch=4, max_batch=4,
        )  # fmt: skip
    assert [t.steps_run for t in result.trials] == [2]


def test_each_trial_starts_without_cublas_workspaces(monkeypatch):
    """A fresh process has no cuBLAS workspaces until its first matmuls: the probe gives them
    back before every trial (and before it weighs what a failed trial left, which its own
    matmuls made again), so each trial places them where the script's own loop would."""
    calls: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append(1),
                        raising=False)  # fmt: skip
    with cuda_standin("64MiB"):
        model = _mlp().to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        result = memkit.probe(
            model, _batch, optimizer=opt, train_step=_step, device="cuda", budget="12MiB",
            margin=0, steps=2, min_batch=80, max_batch=200,
        )  # fmt: skip
        ooms = sum(not t.fits for t in result.trials)
        assert ooms > 0 and len(calls) == len(result.trials) + ooms
        calls.clear()  # a one-step trial stands for a loop's later steps: it keeps them
        memkit.probe(model, _batch, optimizer=opt, train_step=_step, device="cuda",
                     budget="12MiB", margin=0, steps=1, min_batch=80, max_batch=90)  # fmt: skip
    assert calls == []


def test_snapshot_reads_cuda0_from_the_standin():
    with cuda_standin("128MiB") as gpu:
        x = on_gpu(1 << 20)  # 4 MiB: 20 MiB segment
        snap = memkit.snapshot(nvidia_smi=False)
        (row,) = [r for r in snap.devices if r.device == "cuda:0"]
        assert (row.name, row.kind, row.total) == ("Stand-in H200", "cuda", 128 * MIB)
        assert (row.allocated, row.reserved, row.used) == (4 * MIB, 20 * MIB, 20 * MIB)
        assert row.peak_allocated == 4 * MIB
        explicit = memkit.snapshot(device="cuda", nvidia_smi=False)
        assert explicit.devices[0].reserved == 20 * MIB == gpu.reserved
        del x


SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
model.to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(8, 32).to("cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
torch.empty({extra} << 20, dtype=torch.uint8).to("cuda")
"""


def run_under_standin(tmp_path, extra_mib: int, *options: str):
    """`memkit run --device cuda OPTIONS train.py` in process (the stand-in must be active in
    the same process): the click result, the JSON report and the witness."""
    from memkit.cli import cli

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(extra=extra_mib))
    out = tmp_path / "report.json"
    with cuda_standin("64MiB") as gpu:
        witness = Witness()
        gpu.accountant.observe(witness)
        args = ["run", "--device", "cuda", *options, "--json", str(out), str(script)]
        result = CliRunner().invoke(cli, args)
    assert gpu.stat_reads > 0
    return result, json.loads(out.read_text()), witness


def test_memkit_run_device_cuda(tmp_path):
    result, report, witness = run_under_standin(tmp_path, 4, "--budget", "32MiB")
    assert result.exit_code == 0, result.output
    (dev,) = report["devices"]
    assert (dev["device"], dev["name"], report["steps"]) == ("cuda:0", "Stand-in H200", 3)
    assert dev["capacity"] == 32 * MIB
    assert dev["peak_allocated"] == witness.peak > 4 * MIB  # the last tensor on the model's
    assert witness.current == 0  # the script's globals are gone with it


def test_memkit_run_cuda_oom_exits_1_with_the_postmortem(tmp_path):
    """The script's CUDA OOM (80 MiB on a 64 MiB device) leaves it: exit 1, the CUDA error
    and memkit's post-mortem on stderr, the report still written."""
    result, report, _ = run_under_standin(tmp_path, 80)
    assert result.exit_code == 1, result.output
    assert "CUDA out of memory. Tried to allocate 80.00 MiB" in result.stderr
    assert "out of memory on cuda:0" in result.stderr
    assert report["steps"] == 3


def test_memkit_run_budget_caps_cuda(tmp_path):
    """--budget caps a GPU for the script (set_per_process_memory_fraction), as probe does: a
    40 MiB tensor under a 32 MiB cap is a real CUDA out-of-memory error."""
    result, _, _ = run_under_standin(tmp_path, 40, "--budget", "32MiB")
    assert result.exit_code == 1, result.output
    assert "32.00 MiB allowed" in result.stderr


def test_the_users_peak_counters_survive_tracking():
    """memkit resets the peak counters at every phase; what the user reads is still the true
    peak, inside the block (torch.cuda.max_memory_allocated, memory_stats) and after it (the
    real counter raised back from cached blocks), and the user's own reset keeps its meaning."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    with cuda_standin("1GiB") as gpu:
        model.to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(512, 256).to("cuda")
        torch.cuda.reset_peak_memory_stats()

        def step() -> None:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        step()
        witness = gpu.peak_allocated  # the stand-in's own peak, no memkit: one step's
        torch.cuda.reset_peak_memory_stats()
        seen_inside = []
        with memkit.track(model, opt, device="cuda", module_every=1):
            for _ in range(3):
                step()
                seen_inside.append(torch.cuda.max_memory_allocated())
            resets = gpu.peak_resets
        after = torch.cuda.max_memory_allocated()
        stats_after = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
        torch.cuda.reset_peak_memory_stats()
        fresh = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
    assert resets > 10  # memkit did reset the counters, many times
    assert seen_inside == [witness] * 3  # yet each read inside the block is the true peak
    assert after == stats_after == witness  # and after it, from the real counter
    assert fresh == current  # the user's reset is a reset


@pytest.mark.filterwarnings("ignore:GPU available but not used")  # the stand-in, rightly
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning")
def test_lightning_callback_on_cuda():
    """MemkitCallback(device="cuda") with Lightning's accelerator left 'cpu': the module puts
    its network on the stand-in GPU itself when the fit starts (Lightning's own model_to_device
    would move it to the cpu accelerator). The callback's numbers come from the CUDA counters."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from memkit.integrations.lightning import MemkitCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

        def on_fit_start(self) -> None:
            self.net.to("cuda")

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,)))
            return DataLoader(data, batch_size=16)

    with cuda_standin("256MiB") as gpu:
        torch.manual_seed(0)
        module = Net()
        cb = MemkitCallback(device="cuda", postmortem=None)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
        )  # fmt: skip
        trainer.fit(module)
    report = cb.report
    assert report is not None and report.steps == 4
    dev = report.devices[0]
    assert (dev.device, dev.name) == ("cuda:0", "Stand-in H200")
    p = sum(t.nbytes for t in module.parameters())
    bd = dev.breakdown
    assert bd is not None and bd.parameters == bd.gradients == p
    assert bd.optimizer_state == 2 * p  # Adam's step counters stay on the host, as on CUDA
    logged = float(trainer.callback_metrics["memkit/peak_mib"])
    assert logged == pytest.approx(dev.steps[-1].peak_allocated / MIB, rel=1e-6)
    assert gpu.stat_reads > 0 and gpu.peak_resets > 0
    assert torch.cuda.is_available() is False


def test_a_budget_binds_even_when_the_cache_holds_more():
    """set_per_process_memory_fraction caps new segments only: a step served from cached
    segments would never feel a smaller budget. track(budget=) gives the cached free segments
    back first, so 40 MiB under a 32 MiB budget runs out as on a 32 MiB card."""
    with cuda_standin("1GiB"):
        big = torch.empty(100 << 20, dtype=torch.uint8).to("cuda")
        del big  # 100 MiB cached, free
        assert torch.cuda.memory_reserved() >= 100 << 20
        with (
            pytest.raises(torch.OutOfMemoryError, match=r"32\.00 MiB allowed"),
            memkit.track(device="cuda", budget="32MiB", postmortem=None),
        ):
            torch.empty(40 << 20, dtype=torch.uint8).to("cuda")


def test_a_budget_below_segments_that_live_tensors_keep_raises_no_false_oom():
    """A large tensor freed, then parameters placed in its cached segment: empty_cache()
    cannot give that segment back. A cap at the budget would then fail every new segment, even
    a step that needs a third of the budget (it did on the H200, in tests/gpu). The block runs,
    says why the budget is not an exact cap, and says when its peak went past the budget."""
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    with cuda_standin("2GiB"):
        big = torch.empty(600 << 20, dtype=torch.uint8).to("cuda")
        del big
        model.to("cuda")  # in the freed 600 MiB segment, which it now keeps
        opt = torch.optim.Adam(model.parameters())

        def step(batch: int) -> None:
            model(torch.randn(batch, 1024).to("cuda")).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(64)
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() > 600 * MIB > 200 * MIB
        reports = []
        for batch in (64, 2048):
            with (
                pytest.warns(UserWarning, match=r"not an exact cap here") as said,
                memkit.track(model, opt, device="cuda", budget="200MiB") as tracker,
            ):
                step(batch)
            assert said[0].filename == __file__  # the user's with line, not memkit's
            reports.append(tracker.report())
        with (
            pytest.warns(UserWarning, match=r"not an exact cap here"),
            pytest.raises(torch.OutOfMemoryError, match="allowed"),  # the raised cap's message
            memkit.track(model, opt, device="cuda", budget="200MiB", postmortem=None) as failed,
        ):
            step(16384)
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
    pm = failed.report().oom  # states the budget, not the raised cap
    assert pm is not None and pm.capacity == 200 * MIB and pm.free == 0
    small, large = (r.devices[0].peak_allocated for r in reports)
    assert small < 200 * MIB < large
    notes = [" ".join(r.notes) for r in reports]
    assert all("600.00 MiB" not in n and "stayed reserved when the block began" in n
               for n in notes)  # fmt: skip
    assert "above the budget" not in notes[0]
    assert "allocated peak" in notes[1] and "above the budget (200.00 MiB)" in notes[1]


def test_a_probe_under_a_budget_below_kept_segments_says_why_it_cannot_answer():
    """The probe's trials would all fail their first new segment (batch 1 "does not fit" for a
    step that needs a tenth of the budget): the probe stops before them and says why."""
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))  # 16 MiB
    with cuda_standin("2GiB"):
        big = torch.empty(600 << 20, dtype=torch.uint8).to("cuda")
        del big
        model.to("cuda")  # cut from the freed 600 MiB segment, which it now keeps
        with pytest.raises(memkit.ConfigError, match=r"602\.00 MiB stays reserved.*fresh process"):
            memkit.probe(model, lambda n: torch.randn(n, 1024), device="cuda", budget="200MiB")
        del model
        torch.cuda.empty_cache()  # the segment is given back: the same budget probes
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to("cuda")
        result = memkit.probe(
            model, lambda n: torch.randn(n, 1024), device="cuda", budget="200MiB", max_batch=64
        )
    assert result.max_batch_size == 64
    # a budget just above weights whose own 20 MiB segment is above it: a fresh process holds
    # the same segment, so this is the plain answer (nothing fits), not kept segments (review)
    with cuda_standin("2GiB"):
        small = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10)).to("cuda")
        assert torch.cuda.memory_allocated() < 12 * MIB < torch.cuda.memory_reserved()
        plain = memkit.probe(
            small, lambda n: torch.randn(n, 1024), device="cuda", budget="12MiB", max_batch=64
        )
    assert plain.max_batch_size is None


def test_a_backward_through_autograd_grad_is_found_between_sampled_steps():
    """Between the sampled steps the model carries no gradient hook: a backward that skips
    torch.autograd.backward (here torch.autograd.grad, imported before the block) is found at
    the autograd engine's entry, so steps 2 and 3 (no module detail) have the backward phase
    and the same phase peaks as the sampled step 1."""
    from torch.autograd import grad

    with cuda_standin("64MiB"):
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10)).to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(16, 32).to("cuda")
        params = list(model.parameters())
        with memkit.track(model, opt, device="cuda", postmortem=None) as tracker:
            for _ in range(4):
                loss = model(batch).pow(2).mean()
                for p, g in zip(params, grad(loss, params), strict=True):
                    p.grad = g
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
        report = tracker.report()
    assert report.mode.startswith("per-module on 2 sampled step(s)")
    steps = report.devices[0].steps
    assert [s.backward_passes for s in steps] == [1, 1, 1, 1]
    assert all(s.phase_peaks["backward"] is not None for s in steps)
    assert steps[2].phase_peaks == steps[3].phase_peaks == steps[1].phase_peaks


def test_a_failed_autograd_grad_that_the_script_catches_leaves_the_next_steps_counted():
    """torch.autograd.grad raising between sampled steps (a tensor the output does not depend
    on; scripts catch such errors and train on): the backward it began ends there, so the next
    steps' backward passes are counted as before."""
    with cuda_standin("64MiB"):
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10)).to("cuda")
        unused = torch.zeros(3, requires_grad=True).to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(16, 32).to("cuda")
        with memkit.track(model, opt, device="cuda", postmortem=None) as tracker:
            for step in range(5):
                loss = model(batch).pow(2).mean()
                if step == 2:
                    with pytest.raises(RuntimeError):
                        torch.autograd.grad(loss, [unused])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        report = tracker.report()
    steps = report.devices[0].steps
    assert [s.backward_passes for s in steps[3:]] == [1, 1], [s.backward_passes for s in steps]


GP_STEPS = 4


def _wgan_gp_critic_steps(device: str) -> memkit.TrackReport:
    """A WGAN-GP critic's steps (the gradient penalty: torch.autograd.grad with
    create_graph=True inside the step, then one loss.backward) under memkit.track."""
    critic = nn.Sequential(nn.Linear(64, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1)).to(device)
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    with memkit.track(critic, opt, device=device, postmortem=None) as tracker:
        for _ in range(GP_STEPS):
            real, fake = torch.randn(32, 64).to(device), torch.randn(32, 64).to(device)
            alpha = torch.rand(32, 1).to(device)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            (grads,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
            penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
            loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return tracker.report()


@pytest.mark.parametrize("where", ["simulated cpu, module hooks every step", "cuda, sampled"])
def test_a_gradient_penalty_is_part_of_the_forward_not_a_second_backward(where):
    """torch.autograd.grad(..., create_graph=True) builds graph for the loss: each step has
    one backward pass (it was read as two: "gradient accumulation, 2 micro-batches"), on module
    detail's steps (the gradient hooks) and between them (the engine's entry)."""
    if where.startswith("cuda"):
        with cuda_standin("256MiB"):
            report = _wgan_gp_critic_steps("cuda")
    else:
        report = _wgan_gp_critic_steps("cpu")
    steps = report.devices[0].steps
    assert len(steps) == GP_STEPS
    assert [s.backward_passes for s in steps] == [1] * GP_STEPS
    assert all(s.phase_peaks["backward"] is not None for s in steps)
    assert "gradient accumulation" not in str(report)


def test_snapshot_files_the_standins_tensors_under_cuda_in_allocator_blocks():
    """memkit.snapshot() under the stand-in filed the model's tensors under "cpu" (their
    storage's device) with unrounded bytes and no "other": the snapshot's CUDA categorisation
    never ran in a test. On cuda:0 each category counts 512-byte blocks, and with "other" they
    add up to memory_allocated()."""
    with cuda_standin("1GiB"):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(256, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 10)
        )
        model.to("cuda")
        opt = torch.optim.Adam(model.parameters())
        batch = torch.randn(64, 256).to("cuda")
        nn.functional.cross_entropy(model(batch), torch.randint(0, 10, (64,)).to("cuda")).backward()
        opt.step()
        rows = {row.device: row for row in memkit.snapshot(model, opt).categories}
        allocated = torch.cuda.memory_allocated()

    def blocks(tensors) -> int:
        return sum(cuda_rounded(t.untyped_storage().nbytes()) for t in tensors)

    gpu = rows["cuda:0"]
    assert gpu.parameters == blocks(model.parameters())
    assert gpu.buffers == blocks(model.buffers())
    assert gpu.gradients == blocks(p.grad for p in model.parameters())
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert gpu.optimizer_state == blocks(moments)  # Adam's `step` scalars stay on the host
    categorised = gpu.parameters + gpu.buffers + gpu.gradients + gpu.optimizer_state
    assert gpu.other is not None and categorised + gpu.other == allocated


@pytest.mark.parametrize("case", ["budget", "budget-oom", "user-cap-oom", "user-empty-cache"])
def test_the_users_peak_survives_a_block_that_emptied_the_cache(case):
    """A budget's cap empties the cache when the block begins, an OOM empties it (CUDA's own
    retry), and so may the user: no cached blocks are left to raise the allocated peak back
    from. It is raised back anyway (a fresh allocation, given back), past the user's own cap
    if they set one below their earlier peak; the reserved peak, which cannot be raised back
    without holding memory, is named in the report's notes."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10))
    with cuda_standin("256MiB"):
        model.to("cuda")
        opt = torch.optim.Adam(model.parameters())

        def step(batch: int) -> None:
            x = torch.randn(batch, 256).to("cuda")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(2048)
        users_peak = torch.cuda.max_memory_allocated()
        users_reserved_peak = torch.cuda.max_memory_reserved()
        step(64)
        budget = "24MiB" if case.startswith("budget") else None
        if case == "user-cap-oom":
            torch.cuda.set_per_process_memory_fraction(24 / 256)
        tracker = memkit.track(model, opt, device="cuda", budget=budget, postmortem=None)
        try:
            with tracker:
                step(1 << 14 if case.endswith("oom") else 64)
                if case == "user-empty-cache":
                    torch.cuda.empty_cache()
        except torch.OutOfMemoryError:
            assert case.endswith("oom")
        cap_after = torch.cuda.get_per_process_memory_fraction()
        after = torch.cuda.max_memory_allocated()
        reserved_after = torch.cuda.max_memory_reserved()
        torch.cuda.set_per_process_memory_fraction(1.0)
        report = tracker.report()
        notes = " ".join(report.notes)
    if case.endswith("oom"):  # the post-mortem states the cap, not the whole card
        assert report.oom is not None
        assert report.oom.capacity == 24 * MIB
        assert report.oom.free is not None and report.oom.free < 24 * MIB
    assert users_peak > 20 * MIB  # above the 24 MiB cap's reach from the cache
    assert after >= users_peak  # as without memkit: the true peak, not what is allocated now
    assert after < users_peak + 2 * MIB  # and not inflated
    assert cap_after == pytest.approx(24 / 256 if case == "user-cap-oom" else 1.0)
    assert ("max_memory_reserved() reads" in notes) == (reserved_after < users_reserved_peak)


def test_nested_blocks_on_one_gpu_keep_each_others_peaks():
    """Two blocks on one device (a callback's block inside the user's own) reset the same peak
    counters: each reset is carried into the other's readings, so both report the phase peaks
    a block alone reports, and the inner block's end does not disturb the outer's readings."""

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(128, 256).to("cuda")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def phases(tracker: memkit.Tracker) -> dict[str, int | None]:
        return dict(tracker.report().devices[0].phase_peaks)

    with cuda_standin("256MiB"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to("cuda")
        opt = torch.optim.Adam(model.parameters())
        train(model, opt, 1)  # Adam's state exists: every step alike
        with memkit.track(model, opt, device="cuda") as alone:
            train(model, opt, 3)
        with memkit.track(model, opt, device="cuda") as outer:
            train(model, opt, 1)
            with memkit.track(model, opt, device="cuda") as inner:
                train(model, opt, 2)
        single, outer_phases, inner_phases = phases(alone), phases(outer), phases(inner)
    assert single["optimizer"] is not None and single["optimizer"] > single["forward"]
    assert inner_phases == single
    assert outer_phases == single


def test_blocks_ending_out_of_order_on_one_gpu_put_counters_and_torch_back():
    """Blocks in two threads may end in any order. The first-started block ending first hands
    its view of the user's peak to the block still running, which puts the real counter back
    when it ends; and torch's counter functions are torch's own again afterwards."""
    originals = (torch.cuda.memory_stats_as_nested_dict, torch.cuda.reset_peak_memory_stats)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10))
    with cuda_standin("256MiB"):
        model.to("cuda")
        opt = torch.optim.Adam(model.parameters())

        def step(batch: int) -> None:
            model(torch.randn(batch, 256).to("cuda")).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(2048)
        users_peak = torch.cuda.max_memory_allocated()
        step(64)
        first = memkit.track(model, opt, device="cuda")
        second = memkit.track(model, opt, device="cuda")
        first.__enter__()
        step(64)
        second.__enter__()
        step(64)
        first.__exit__(None, None, None)
        step(64)
        second.__exit__(None, None, None)
        real_peak = torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"]
        patched = (torch.cuda.memory_stats_as_nested_dict, torch.cuda.reset_peak_memory_stats)
    assert real_peak >= users_peak
    assert patched == originals


def test_a_report_asked_after_the_block_shows_the_capacity_the_block_ran_under():
    """The report's capacity and device name are read as the block ends, under its cap: a
    report asked later (after the stand-in, or the cap, is gone) neither fails nor shows the
    whole card."""
    with cuda_standin("1GiB"):
        model = nn.Linear(64, 64).to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with memkit.track(model, opt, device="cuda", budget="256MiB") as tracker:
            for _ in range(2):
                model(torch.randn(8, 64).to("cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
    dev = tracker.report().devices[0]
    assert dev.capacity == 256 * 2**20
    assert dev.name.startswith("Stand-in")
