"""What tracking costs and leaves alone: module detail on sampled steps with exact steps and
phases, compiled models left uncompiled-around, the user's peak counters (docs/track.md,
"What it costs")."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import memkit
from memkit.devices import SimulatedBackend
from memkit.devices.peaks import SMALL_REQUEST, plan_pieces
from memkit.errors import ConfigError

MiB = 1 << 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
        nn.Linear(256, 10),
    )  # fmt: skip


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, on_step=None) -> None:
    for i in range(steps):
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(i)


def test_module_rows_come_from_sampled_steps_and_steps_stay_exact():
    reports = {}
    for every in (1, 3):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters())
        with memkit.track(model, opt, device="cpu", budget="64MiB", module_every=every) as t:
            train(model, opt, 7)
        reports[every] = t.report()
    exact, sampled = reports[1].devices[0], reports[3].devices[0]
    # steps and phases: measured on every step either way, byte for byte the same
    assert [s.peak_allocated for s in sampled.steps] == [s.peak_allocated for s in exact.steps]
    assert [s.phase_peaks for s in sampled.steps] == [s.phase_peaks for s in exact.steps]
    calls = {m.path: m.calls for m in sampled.modules}
    assert calls["Sequential"] == 7  # the model's own hooks stay on
    assert calls["0"] == calls["2.0"] == 4  # steps 0, 1, 3 and 6
    by_path = {m.path: m for m in exact.modules}
    for m in sampled.modules:  # what a sampled step measures is what every step measures
        assert m.activation_bytes == by_path[m.path].activation_bytes
    assert "4 sampled step(s)" in reports[3].mode and reports[1].mode == "per-module"


def test_module_hooks_are_gone_between_sampled_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = []

    def look(step: int) -> None:  # after step ``step``: the hooks of step + 1
        hooked.append(bool(model[0]._forward_pre_hooks) and bool(model[0]._forward_hooks))

    with memkit.track(model, opt, device="cpu", budget="64MiB", module_every=4):
        train(model, opt, 9, look)
    # steps 1..9 begin after steps 0..8: detail on steps 1, 4, 8 only
    assert hooked == [True, False, False, True, False, False, False, True, False]
    assert not model[0]._forward_pre_hooks and not model._forward_pre_hooks  # all removed


@pytest.mark.parametrize("per_module", [True, False])
def test_a_step_between_sampled_ones_reads_the_counters_at_its_phase_boundaries_only(per_module):
    """On a GPU every counter read is a C call that builds CUDA's statistics (about 18 us on
    an H200). A step between sampled ones reads them where a phase begins (forward, backward,
    the rest, optimizer) and at the step's end: 5 reads. The model's own forward hook read
    them too (6), only to feed the model's row, which is sampled like the other rows (in
    steps-only mode, where it is the only row, as well)."""
    from memkit.devices.cuda_standin import cuda_standin

    with cuda_standin("1GiB") as gpu:
        model = mlp().to("cuda")
        opt = torch.optim.AdamW(model.parameters())
        reads = []
        with memkit.track(model, opt, device="cuda", per_module=per_module, module_every=5) as t:
            for _ in range(12):
                reads.append(gpu.stat_reads)
                model(torch.randn(32, 64).to("cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
    steady = {b - a for a, b in itertools.pairwise(reads[6:10])}  # steps 6-8: not sampled
    assert steady == {5}
    rows = {m.path: m.calls for m in t.report().devices[0].modules}
    assert rows["Sequential"] == 4  # steps 0, 1, 5 and 10
    assert ("0" in rows) == per_module


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_module_every_must_be_a_positive_whole_number(bad):
    with pytest.raises(ConfigError, match=r"module_every: expected a whole number of steps >= 1"):
        memkit.track(mlp(), module_every=bad)


@contextlib.contextmanager
def counters_constant() -> Iterator[None]:
    """The simulated device's dispatch mode makes TorchDynamo skip frames: without it the
    tracker's hooks run around a really compiled model (its counters then stay constant)."""
    original = SimulatedBackend.activate
    SimulatedBackend.activate = lambda self: contextlib.nullcontext()  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimulatedBackend.activate = original  # type: ignore[method-assign]


def compiled_run(how: str) -> tuple[dict[str, int], memkit.tracking.report.TrackReport | None]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    if how.endswith("in place"):  # model.compile(): Dynamo traces the module's own hooks
        model.compile(backend="eager")
        compiled = model
    else:
        compiled = torch.compile(model, backend="eager")
    ctx: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if how.startswith("model"):
        ctx = memkit.track(compiled, opt, device="cpu", module_every=2)
    elif how.startswith("global"):  # memkit run: no model given, global hooks until it is seen
        ctx = memkit.track(device="cpu", module_every=2)
    with counters_constant(), ctx as tracker:
        for _ in range(5):
            compiled(torch.randn(16, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    seen = {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
    }
    torch._dynamo.reset()  # graphs made in this process turn the leak search's line trace off
    counters.clear()
    return seen, None if tracker is None else tracker.report()  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["model", "global", "model compiled in place"])
def test_a_compiled_model_is_tracked_without_graph_breaks_or_recompiles(how):
    """``torch.compile(model)`` and ``model.compile()`` (in place: the sweep saw the model's
    hooks traced into the graph, where they do nothing, and every forward peak missing)."""
    plain, _ = compiled_run("plain in place" if how.endswith("in place") else "plain")
    tracked, report = compiled_run(how)
    assert tracked == plain and plain["breaks"] == 0
    # (model.compile() compiles the module's _call_impl, a frame Dynamo may skip itself)
    assert plain["graphs"] == 1 or how.endswith("in place")
    assert report is not None and report.steps == 5
    assert "torch.compile: no module hooks" in report.mode
    assert [m.path for m in report.devices[0].modules] == ["Sequential"]  # named plainly
    assert all(s.phase_peaks["forward"] is not None for s in report.devices[0].steps)


def test_memkit_run_finds_a_model_compiled_in_place_after_its_first_step():
    """Sweep BR: under ``memkit run`` (global hooks, no model given) a model compiled in place
    ran its hooks inside the compiled call, traced as no-ops: no step had a forward peak, the
    model was never found and nothing said so. It is found at the first step's end and
    tracked around its compiled call from then on (one recompilation: the global hooks of
    module detail go)."""
    plain, _ = compiled_run("plain in place")
    tracked, report = compiled_run("global in place")
    assert tracked["breaks"] == plain["breaks"] == 0
    assert tracked["recompiles"] <= plain["recompiles"] + 1
    assert report is not None and report.steps == 5
    steps = report.devices[0].steps
    assert steps[0].phase_peaks["forward"] is None
    assert all(s.phase_peaks["forward"] is not None for s in steps[1:])
    assert "torch.compile: no module hooks" in report.mode
    assert any("compiled in place (`model.compile()`)" in n for n in report.notes)


def test_memkit_run_does_not_take_a_compiled_teacher_for_the_model():
    """Review: a frozen teacher compiled in place, beside a student trained inside a compiled
    train step, was wrapped as the model and said to be tracked from the next step, which
    never saw a forward. Only a module the optimizers train is taken; otherwise the report
    says the forward ran where the hooks could not see it."""
    torch._dynamo.reset()
    student, teacher = mlp(), mlp().requires_grad_(False)
    teacher.compile(backend="eager")
    opt = torch.optim.AdamW(student.parameters())

    @torch.compile(backend="eager")
    def train_step(x: torch.Tensor) -> None:
        (student(x) - teacher(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    with counters_constant(), memkit.track(device="cpu") as tracker:
        for _ in range(3):
            train_step(torch.randn(16, 64))
    torch._dynamo.reset()
    notes = " ".join(tracker.report().notes)
    assert "compiled in place" not in notes
    assert "a backward ran without a model forward memkit's hooks saw" in notes


def compiled_steps(compiled: str, tracked: bool) -> tuple[dict[str, int], object]:
    """Five steps of a model whose optimizer step (``"optimizer"``: PyTorch's "compiling the
    optimizer" recipe) or whole train step (``"train step"``: a ``@torch.compile`` function
    that runs forward, backward and the step) is compiled, with or without ``memkit.track``
    given the plain model: TorchDynamo's counters, and the report."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())

    def train_step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step = torch.compile(opt.step, backend="eager") if compiled == "optimizer" else None
    whole = torch.compile(train_step, backend="eager")
    ctx = memkit.track(model, opt, device="cpu") if tracked else contextlib.nullcontext()
    with counters_constant(), ctx as tracker:
        for _ in range(5):
            if step is None:
                whole(torch.randn(16, 64))
            else:
                model(torch.randn(16, 64)).sum().backward()
                step()
                opt.zero_grad()
    seen = {
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
    }
    torch._dynamo.reset()
    counters.clear()
    return seen, None if tracker is None else tracker.report()  # type: ignore[union-attr]


@pytest.mark.parametrize("compiled", ["optimizer", "train step"])
def test_a_compiled_optimizer_step_or_train_step_traces_none_of_memkit(compiled):
    """Sweep BR: with ``torch.compile(opt.step)`` TorchDynamo traced memkit's optimizer hooks
    (1 graph became 9, a recompilation per parameter up to the limit), and with a compiled
    train step also its backward wrapper. memkit's hooks and wrappers now run as they are
    where compiled code calls them: the same graphs as without memkit, no recompilation, and
    every step still counted at its optimizer step. A compiled train step's optimizer step
    is a graph of its own then (a graph break at each of memkit's optimizer hooks, which run
    eagerly): one graph more, the ``zero_grad`` after it."""
    plain, _ = compiled_steps(compiled, tracked=False)
    tracked, report = compiled_steps(compiled, tracked=True)
    assert tracked["recompiles"] == plain["recompiles"] == 0
    more = 0 if compiled == "optimizer" else 1
    assert tracked["graphs"] == plain["graphs"] + more
    assert report is not None and report.steps == 5
    assert report.step_rule == "optimizer"


def test_pieces_come_from_free_blocks_of_the_right_pool():
    blocks = [(20 * MiB, False), (4 * MiB, False), (2 * MiB, True), (512 * 1024, True)]
    pieces = plan_pieces(blocks, 23 * MiB)
    assert sum(pieces) >= 23 * MiB
    assert pieces[0] == 20 * MiB and all(p > SMALL_REQUEST for p in pieces[:2])
    # a remainder under 1 MiB is served by a small block, not a new segment
    assert plan_pieces(blocks, 20 * MiB + 4096) == [20 * MiB, 4096]
    assert plan_pieces([(4 * MiB, False)], 2 * MiB + 100) == [2 * MiB + 100]
    # nothing small left: a little more of a large block (at least the target, never short)
    assert plan_pieces([(4 * MiB, False), (4 * MiB, False)], 4 * MiB + 1000) == [
        4 * MiB, SMALL_REQUEST + 512,
    ]  # fmt: skip
    assert plan_pieces(blocks, 64 * MiB) == []  # the cache cannot serve it


def test_the_passes_of_one_closure_step_do_not_add_up():
    """LBFGS runs its closure (forward and backward) up to max_iter times inside one step():
    each pass frees its activations in its own backward, so a module keeps one pass's bytes
    per step, not max_iter times as much (they are no micro-batches)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1)).double()
    x, y = torch.randn(128, 64, dtype=torch.float64), torch.randn(128, 1, dtype=torch.float64)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)
    plain = torch.optim.SGD(model.parameters(), lr=0.0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with memkit.track(model, opt, device="cpu", budget="64MiB") as t:
        for _ in range(2):
            opt.step(closure)
    with memkit.track(model, plain, device="cpu", budget="64MiB") as once:
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            plain.step()
            plain.zero_grad()
    lbfgs = {m.path: m for m in t.report().devices[0].modules}["1"]  # Tanh keeps its output
    single = {m.path: m for m in once.report().devices[0].modules}["1"]
    assert lbfgs.calls >= 6  # several passes ran inside each step
    assert lbfgs.activation_bytes_per_step == single.activation_bytes_per_step > 0


def test_a_failing_hook_stops_tracking_not_training(monkeypatch):
    """A failure of memkit's own inside a hook (here at the step boundary, inside
    optimizer.step(), with the error a DTensor parameter once raised in the persistent-bytes
    count there) must not reach the training loop: tracking stops with a note, training goes
    on, and the report keeps what was measured before."""
    from memkit.tracking import phases

    calls = {"n": 0}
    original = phases.close_step

    def failing(dev, step, *args):
        if step >= 2:  # fail from step 2 on: steps 0 and 1 were measured
            calls["n"] += 1
            raise RuntimeError("Attempted to access the data pointer on an invalid python storage")
        return original(dev, step, *args)

    monkeypatch.setattr(phases, "close_step", failing)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with memkit.track(model, opt, device="cpu", budget="64MiB", postmortem=None) as t:
        train(model, opt, 5)
    report = t.report()
    assert calls["n"] == 1  # the failure happened, once: tracking stopped there
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert any("memkit stopped tracking" in n and "invalid python storage" in n
               for n in report.notes)  # fmt: skip
    assert report.steps == 2 and report.devices[0].peak_allocated > 0


def test_an_out_of_memory_error_inside_a_hook_is_still_the_users():
    """The simulated device runs out inside a forward: the hook shield lets the OOM through."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(torch.OutOfMemoryError),
        memkit.track(model, opt, device="cpu", budget="2MiB", postmortem=None),
    ):
        model(torch.randn(4096, 64)).sum().backward()


@pytest.mark.parametrize("zero_grad", ["start", "between", "end"])
def test_the_walk_of_parameters_and_state_is_not_a_per_step_cost(monkeypatch, zero_grad):
    """The leak detector compares a rise with the bytes of parameters, gradients and optimizer
    state, a walk over every tensor: measured at the first steps and at rises only. Reading a
    step's level where the next forward begins made it walk at every step of a loop whose
    ``zero_grad`` runs at the step's start (review), then of one that reuses its batch."""
    from memkit.tracking.evidence import Evidence

    walks = [0]
    original = Evidence.persistent

    def counted(self, *args, **kwargs):
        walks[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Evidence, "persistent", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 64)  # one batch, fed every step
    with memkit.track(model, opt, device="cpu", budget="64MiB"):
        for _ in range(40):
            if zero_grad == "start":
                opt.zero_grad(set_to_none=True)
            out = model(x).sum()
            if zero_grad == "between":
                opt.zero_grad(set_to_none=True)
            out.backward()
            opt.step()
            if zero_grad == "end":
                opt.zero_grad(set_to_none=True)
    assert walks[0] <= 8, walks[0]


def test_an_output_cache_is_walked_when_the_own_bytes_are_measured_not_every_step(monkeypatch):
    """A key-value cache in a training output (transformers' DynamicCache: a layer object per
    layer) is the step's own; walking it at every step cost a pass over every layer (48
    layers: 2194 memkit lines a step instead of 718, review). It is walked when the step's
    own bytes are measured: when the batches' shapes change, not while they stay the same."""
    from memkit.tracking import phases

    walks = [0]
    original = phases.tensors_within

    def counted(*args, **kwargs):
        walks[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(phases, "tensors_within", counted)

    class Layer:
        def __init__(self, keys: torch.Tensor) -> None:
            self.keys, self.values = keys, keys * 2

    class Cache:
        def __init__(self, layers: list[Layer]) -> None:
            self.layers = layers

    class CachingLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

        def forward(self, x: torch.Tensor) -> dict[str, object]:
            layers = []
            for block in self.blocks:
                x = block(x)
                layers.append(Layer(x.detach()))
            return {"loss": x.square().mean(), "cache": Cache(layers)}

    torch.manual_seed(0)
    model = CachingLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memkit.track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(30):
            out = model(torch.randn(8, 16))
            out["loss"].backward()
            opt.step()
            opt.zero_grad()
    assert tracker.report().steps == 30
    assert 0 < walks[0] <= 6, walks[0]  # the first measures (both levels), not 30 steps


def test_ddp_gradients_as_bucket_views_cost_no_walk_a_step(monkeypatch, one_rank):
    """With ``gradient_as_bucket_view=True`` the gradients are the buckets' views and count 0
    bytes: the boundary took 'no gradients remembered yet' for a reason to walk every
    parameter and state tensor at every step (20 walks in 20 steps, about 9 ms each on 150
    layers: review). Remembered once, with the gradients allocated."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memkit.tracking.device_set import DeviceSet

    walks = [0]
    original = DeviceSet.persistent

    def counted(self, *args, **kwargs):
        walks[0] += 1
        return original(self, *args, **kwargs)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
                gradient_as_bucket_view=True)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters())
    with memkit.track(model, opt, device="cpu", budget="64MiB") as tracker:
        for step in range(30):
            if step == 10:
                monkeypatch.setattr(DeviceSet, "persistent", counted)
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert walks[0] <= 2, walks[0]
    bd = tracker.report().devices[0].breakdown
    assert bd is not None and bd.gradient_buckets == (32 * 64 + 64 + 64 * 10 + 10) * 4


def test_ddp_bucket_view_gradients_are_no_gradients_zero_grad_would_free(one_rank):
    """With ``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=False)`` the advice
    said "21.54 KiB of gradients stay allocated through the forward" where the breakdown said
    0 and ``set_to_none`` frees nothing (the gradients are the buckets' views: review)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
                gradient_as_bucket_view=True)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memkit.track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(6):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    report = tracker.report()
    assert report.devices[0].breakdown is not None
    assert report.devices[0].breakdown.gradients == 0
    assert "zero-grad-keeps-grads" not in {a.code for a in report.advice}


def test_a_tracked_model_that_ddp_wraps_counts_its_buckets(one_rank):
    """``memkit.track(inner)`` around ``DDP(inner)`` (as Lightning's callback tracks its
    ``pl_module`` and the transformers one its model): the buckets were 'other' (review); the
    DDP model whose forward runs the tracked one is found when it first runs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memkit.track(inner, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(3):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    bd = tracker.report().devices[0].breakdown
    assert bd is not None and bd.gradient_buckets == (32 * 64 + 64 + 64 * 10 + 10) * 4


def test_a_compiled_model_first_run_on_the_simulated_device_compiles_afterwards():
    """TorchDynamo compiles no frame under a dispatch mode and skips that code for good: a
    compiled model first called inside ``memkit.simulate``/``track`` (or a probe) never
    compiled again in the process, silently slower (sweep NN). The accountant runs compiled
    code eagerly with ``set_stance("force_eager")``, which skips nothing for later."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        model = torch.compile(mlp(), backend="eager")
        with memkit.simulate("64MiB"):
            model(torch.randn(4, 64)).sum().backward()
        assert counters["frames"]["ok"] == 0  # eager inside, as before
        model(torch.randn(4, 64)).sum().backward()
        assert counters["frames"]["ok"] >= 1 and counters["stats"]["unique_graphs"] >= 1
    finally:  # graphs made in this process turn the leak search's line trace off
        torch._dynamo.reset()
        counters.clear()


@pytest.mark.parametrize("compiled", ["train step", "optimizer step"])
def test_a_compiled_function_that_ran_eagerly_on_the_simulated_device_is_said(compiled):
    """Sweep BR: a compiled train step or ``opt.step`` ran eagerly on the simulated device and
    no note said so (a compiled model's did); its numbers are eager PyTorch's."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x: torch.Tensor) -> None:
        model(x).sum().backward()

    step = step_fn
    if compiled == "train step":
        step = torch.compile(step_fn, backend="eager")
    else:
        opt.step = torch.compile(opt.step, backend="eager")  # type: ignore[method-assign]
    with memkit.track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(2):
            step(torch.randn(4, 64))
            opt.step()
            opt.zero_grad()
    notes = [n for n in tracker.report().notes if n.startswith("torch.compile")]
    name = "step" if compiled == "train step" else "SGD.step"
    assert len(notes) == 1 and "ran eagerly" in notes[0] and f"(found: `{name}`)" in notes[0]
    del step
    opt.step = type(opt).step.__get__(opt)  # type: ignore[method-assign]

    @torch.compiler.disable
    def log_metrics() -> None:  # (carries Dynamo's attribute too, and is no compiled code)
        pass

    with memkit.track(device="cpu", budget="64MiB", postmortem=None) as plain:
        train(model, opt, 2)
        log_metrics()
    assert not any(n.startswith("torch.compile") for n in plain.report().notes)


def test_the_loss_is_looked_at_in_the_first_backward_passes_only(monkeypatch):
    """The walk for a loss CUDA's autocast refuses (nn.BCELoss) ran at every backward: it
    counted the backward passes of the step, not of the run (the hook-cost benchmark's
    steady step grew from 878 to 1165 lines of memkit code)."""
    from memkit.tracking import hooks

    calls = []
    real = hooks.autocast_unsafe_loss
    monkeypatch.setattr(hooks, "autocast_unsafe_loss", lambda roots: calls.append(1) or real(roots))
    model = mlp()
    with memkit.track(device="cpu", budget="64MiB", postmortem=None):
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), 8)
    assert len(calls) == 3
