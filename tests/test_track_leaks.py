"""Leak findings in loops shaped like real scripts (pytorch/examples' actor-critic and
word_language_model, imagenet's AverageMeter): level noise is no leak, a graph the scans
found stays named, and the variable and line named are the ones that grow."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memkit
from memkit.tracking import TrackReport, track
from memkit.tracking.run import run_script
from memkit.units import format_size

MiB = 1 << 20


def actor_critic(episodes: tuple[int, ...], kept: list[torch.Tensor] | None) -> TrackReport:
    """actor_critic.py: each timestep's log-probability (with its graph) is saved; the
    optimizer steps inside ``finish_episode`` while the episode's lists are alive; ``kept``:
    each episode's loss appended with its graph (the leak), else nothing kept."""
    torch.manual_seed(0)
    policy = nn.Linear(4, 2)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    saved: list[torch.Tensor] = []

    def finish_episode() -> None:
        loss = -torch.stack(saved).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if kept is not None:
            kept.append(loss)
        del saved[:]

    with track(policy, opt, device="cpu", budget="16MiB") as tracker:
        for length in episodes:
            for _ in range(length):
                saved.append(policy(torch.randn(4)).log_softmax(-1)[0])
            finish_episode()
    return tracker.report()


def test_longer_episodes_in_a_row_are_no_leak():
    """The level at ``optimizer.step()`` holds the episode's per-timestep tensors: episodes
    that grow longer (an agent learning) raise it step after step, but the next episode's
    forward begins with them freed. It said "memory grows by 186 B per step"."""
    report = actor_critic((2, 3, 4, 6, 8, 10, 12, 14), None)
    assert report.leaks == []
    assert not {"memory-growth", "graph-retained"} & {a.code for a in report.advice}


def test_losses_kept_with_their_graphs_are_still_a_leak_among_longer_episodes():
    kept: list[torch.Tensor] = []
    report = actor_critic((2, 3, 4, 6, 8, 10, 12, 14, 16, 18), kept)
    (leak,) = report.leaks
    assert leak.suspects[0].name == "kept" and leak.suspects[0].growing
    assert "graph-retained" in {a.code for a in report.advice}


def word_language_model(epochs: int) -> TrackReport:
    """word_language_model's main.py with ``total_loss += loss`` (the leak: a graph in host
    memory, device memory flat): no optimizer (SGD by hand, steps counted at the next training
    forward, after ``model.zero_grad()``), a shorter last bptt batch, an evaluation under
    ``no_grad`` after each epoch."""
    torch.manual_seed(0)
    bptt, ntokens = 4, 20
    model = nn.Sequential(nn.Embedding(ntokens, 8), nn.Linear(8, ntokens))
    data = torch.randint(0, ntokens, (6 * bptt + 3,))

    def evaluate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(0, len(data) - 1, bptt):
                x, y = data[i : i + bptt], data[i + 1 : i + 1 + bptt]
                total += F.cross_entropy(model(x[: len(y)]), y).item()
        return total

    def train() -> None:
        model.train()
        total_loss = 0.0
        for i in range(0, len(data) - 1, bptt):
            x, y = data[i : i + bptt], data[i + 1 : i + 1 + bptt]
            model.zero_grad()
            loss = F.cross_entropy(model(x[: len(y)]), y)
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            total_loss += loss  # keeps every step's graph

    with track(model, device="cpu", budget="16MiB") as tracker:
        for _ in range(epochs):
            train()
            evaluate()
    return tracker.report()


def test_an_evaluations_drop_and_the_rise_back_do_not_replace_a_graph_leak():
    """The levels each step leaves are the same every epoch: the drop after evaluation and
    the rise back, with a few bytes more for the shorter last batch, made "memory grows by
    ... every 7 steps", which replaced the graph-retained finding (`total_loss`) the graph
    scans had made, and called it the step's own."""
    report = word_language_model(3)
    (leak,) = report.leaks
    assert leak.growth_per_step == 0 and leak.graph_growth > 0
    assert leak.suspects[0].name == "total_loss" and leak.suspects[0].code == (
        "total_loss += loss  # keeps every step's graph"
    )
    codes = {a.code for a in report.advice}
    assert "graph-retained" in codes and "memory-growth" not in codes


def test_a_graph_leak_outlives_growth_that_stops():
    """The graph scans name `total` (a graph growing in host memory, device memory flat);
    then a cache fills for a few steps and stops (a plateau: no leak). The growth finding
    that replaced the graph's was dropped when it stopped, and with it the real leak."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache: list[torch.Tensor] = []
    total = torch.zeros(())
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for step in range(16):
            out = model(torch.randn(4, 8))
            if 5 <= step < 9:
                cache.append(out.detach().repeat(16, 1))  # fills, then stays
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = total + loss  # the leak: every step's graph
            if step == 10:
                during = tracker.report()
    (grew,) = during.leaks  # while the cache grew: its growth, the graph's rate kept
    assert grew.growth_per_step > 0 and grew.graph_growth > 0
    (leak,) = tracker.report().leaks
    assert leak.growth_per_step == 0 and leak.graph_growth > 0
    assert leak.suspects[0].name == "total"


class AverageMeter:
    """imagenet's main.py: computes and stores the average and current value."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reset()

    def reset(self) -> None:
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val: torch.Tensor, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def test_a_graph_kept_in_an_attribute_of_the_scripts_own_object_is_named():
    """imagenet's ``losses.update(loss, n)`` fed the loss tensor: ``self.sum += val * n``
    keeps every step's graph in ``losses.sum`` (device memory flat). The graph scans never
    looked into the script's own objects: nothing was reported."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(steps: int) -> None:
        losses = AverageMeter("Loss")
        for _ in range(steps):
            x = torch.randn(8, 16)
            loss = model(x).square().mean()
            losses.update(loss, x.size(0))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        train(8)
    (leak,) = tracker.report().leaks
    top = leak.suspects[0]
    assert (top.name, top.function, top.code) == (
        "losses.sum", "AverageMeter.update", "self.sum += val * n"
    )  # fmt: skip
    assert leak.graph_growth > 0 and top.growing


class Stats:
    """A script's class used as a namespace: its class attributes are its running totals."""

    total: object = 0
    count = 0


def test_a_graph_kept_in_a_class_attribute_of_the_scripts_own_class_is_named():
    """``Stats.total += loss`` (a class used as a namespace): the scans looked into the
    script's own objects, never its classes: nothing was reported (sweep X)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = Stats  # the loop's frame sees the class, as a script's globals do

    def train(steps: int) -> None:
        for _ in range(steps):
            loss = model(torch.randn(8, 16)).square().mean()
            stats.total += loss
            stats.count += 1
            opt.zero_grad()
            loss.backward()
            opt.step()

    try:
        with track(model, opt, device="cpu", budget="16MiB") as tracker:
            train(8)
    finally:
        Stats.total, Stats.count = 0, 0
    (leak,) = tracker.report().leaks
    assert leak.suspects[0].name.endswith(".total") and leak.graph_growth > 0


LIST_LEAK = """\
import sys, torch
from torch import nn
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
all_losses = []
INSIDE = sys.argv[1:] == ["inside"]


def finish(loss):
    opt.zero_grad()
    loss.backward()
    opt.step()
    if INSIDE:
        all_losses.append(loss)


for step in range(8):
    loss = model(torch.randn(4, 8)).square().mean()
    finish(loss)
    if not INSIDE:
        all_losses.append(loss)
"""


@pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer (coverage) is set: not traced")
@pytest.mark.parametrize(("args", "function", "after"), [
    ((), "<module>", "    if not INSIDE:"), (("inside",), "finish", "    if INSIDE:"),
])  # fmt: skip
def test_a_global_list_is_named_at_the_line_that_appends_to_it(tmp_path, args, function, after):
    """A script's global list has two lines that append to it, in branches of which one
    runs: it named the first in the file (inside ``finish``, which never ran) and called its
    function ``<module>``; now the line that ran, in its function."""
    script = tmp_path / "list_leak.py"
    script.write_text(LIST_LEAK)
    line = LIST_LEAK.splitlines().index(after) + 2
    (leak,) = run_script(script, args, device="cpu", budget="16MiB").report.leaks
    top = leak.suspects[0]
    assert (top.name, top.where) == ("all_losses", f"list_leak.py:{function}():{line}")
    assert sys.gettrace() is None  # the trace is gone


EPOCH_OUTPUTS = """\
import gc, sys, weakref, torch
from torch import nn

def main(out_file):
    model = nn.Linear(64, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    outputs = []
    for epoch in range(3):
        probe = weakref.ref(outputs[0]) if outputs else None
        outputs = []  # the epoch's metric is done: last epoch's outputs are garbage
        for step in range(8):
            logits = model(torch.randn(32, 64))
            if step == 0 and probe is not None:  # memkit measures the forward: by then
                gc.collect()
                seen.append("alive" if probe() is not None else "freed")
            loss = logits.square().mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if step % 2:
                outputs.append(logits.detach())
            else:
                outputs.append(logits.detach())
    open(out_file, "w").write(" ".join(seen))

main(sys.argv[1])
"""


@pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer (coverage) is set: not traced")
def test_a_loop_the_line_trace_ran_in_frees_what_it_replaces(tmp_path):
    """An epoch's outputs kept for a metric, appended on two lines alike, the list replaced at
    the epoch's end (sweep QQ): the line trace that tells the two lines apart left the loop's
    frame a copy of its locals (Python before 3.13), and last epoch's list stayed alive for
    the whole next epoch under memkit: the peak 2.5 MiB higher than without it."""
    script, seen = tmp_path / "epoch_outputs.py", tmp_path / "seen.txt"
    script.write_text(EPOCH_OUTPUTS)
    run_script(script, (str(seen),), device="cpu", budget="64MiB")
    assert seen.read_text().split() == ["freed", "freed"]
    assert sys.gettrace() is None


EPOCH_GRAPHS = """\
import torch
from torch import nn
model = nn.Linear(64, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(3):
    outputs = []  # for an epoch-level metric: emptied each epoch, so no lasting growth
    for step in range(8):
        logits = model(torch.randn(32, 64))
        loss = logits.square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        outputs.append(logits)
"""


def test_a_list_of_batch_outputs_with_their_graphs_is_not_told_to_keep_item(tmp_path):
    """Batch outputs kept with their graph, the list emptied each epoch (sweep QQ): the
    graph scans found it, and the advice said ``outputs.append(logits.item())``, which
    raises for a tensor of more than one element; and that device memory 'stayed flat'."""
    script = tmp_path / "epoch_graphs.py"
    script.write_text(EPOCH_GRAPHS)
    report = run_script(script, (), device="cpu", budget="64MiB").report
    (advice,) = [a for a in report.advice if a.code == "graph-retained"]
    assert "outputs.append(logits.detach().cpu())" in advice.action
    assert ".item()" not in advice.action and "stayed flat" not in advice.evidence


OUTPUTS_AND_TARGETS = """\
import torch
from torch import nn
model = nn.Linear(64, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
outputs, targets = [], []
for step in range(24):
    x, y = torch.randn(32, 64), torch.randint(0, 256, (32,))
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    opt.zero_grad(); loss.backward(); opt.step()
    outputs.append(logits)
    targets.append(y)
"""


def test_of_two_lists_growing_the_one_holding_the_growth_is_named_first(tmp_path):
    """Outputs (32 KiB a step, with their graphs) and targets (256 B a step) kept for a
    metric (sweep QQ): the targets were named first, as the smallest graph (none), and the
    advice promised 18 KiB; now the list that holds the bytes the device grew by."""
    script = tmp_path / "outputs_and_targets.py"
    script.write_text(OUTPUTS_AND_TARGETS)
    (leak,) = run_script(script, (), device="cpu", budget="64MiB").report.leaks
    assert [s.name for s in leak.suspects[:2]] == ["outputs", "targets"]
    assert leak.suspects[0].bytes_per_step == 32 * 256 * 4


LOCALS_KEPT = """\
import sys, torch
from torch import nn

def main(out_file, lr=0.01, batch=32):
    cfg = locals()  # a function's locals() kept: before 3.13 the frame's own cached dict
    model = nn.Linear(64, 256)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    outputs, lost = [], []
    for step in range(40):
        logits = model(torch.randn(32, 64))
        opt.zero_grad(); logits.square().mean().backward(); opt.step()
        if step % 2:
            outputs.append(logits.detach())
        else:
            outputs.append(logits.detach())
        if "lr" not in cfg:
            lost.append(step)
    open(out_file, "w").write(repr(lost))

main(sys.argv[1])
"""


@pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer (coverage) is set: not traced")
def test_a_functions_own_locals_dict_keeps_its_keys_under_the_scans_and_the_trace(tmp_path):
    """``cfg = locals()`` in a function is the frame's cached dict before Python 3.13, which
    memkit empties after reading a frame (the graph scans, the line trace) so that it keeps
    no step's tensors: that emptied the script's ``cfg`` (a review)."""
    script, out = tmp_path / "locals_kept.py", tmp_path / "lost.txt"
    script.write_text(LOCALS_KEPT)
    run_script(script, (str(out),), device="cpu", budget="64MiB")
    assert out.read_text() == "[]"


SOME_EPOCHS = """\
import torch
from torch import nn
model = nn.Linear(64, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
losses = []
for epoch in range(5):
    for step in range(10):
        loss = model(torch.randn(16, 64)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if epoch in (2, 3):  # a debug flag left on for two epochs
            losses.append(loss)
        else:
            losses.append(loss.item())
"""


def test_graphs_kept_in_some_epochs_only_are_still_a_leak_when_the_growth_stops(tmp_path):
    """A loss kept with its graph in epochs 2 and 3 only (sweep QQ): the growth stopped in
    epoch 4, and "growth that stops is not a leak" dropped the finding, while the 20 graphs
    stayed alive to the end. A list that kept graphs is reported."""
    script = tmp_path / "some_epochs.py"
    script.write_text(SOME_EPOCHS)
    report = run_script(script, (), device="cpu", budget="64MiB").report
    (leak,) = report.leaks
    assert leak.suspects[0].name == "losses" and leak.suspects[0].graph
    assert "graph-retained" in [a.code for a in report.advice]


EVAL_LEAK = """\
import sys, torch
from torch import nn
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
xv = torch.randn(64, 8)
val_losses = []
for step in range(1, 21):
    loss = model(torch.randn(4, 8)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 4 == 0:
        if sys.argv[1:] == ["good"]:
            with torch.no_grad():
                tot = model(xv).square().mean().item()
            val_losses.append(tot / 3)
        else:
            vloss = model(xv).square().mean()
            val_losses.append(vloss)
"""


def test_a_line_the_trace_did_not_see_run_is_the_one_appending_a_graph(tmp_path):
    """An evaluation every 4 steps keeps its loss with its graph; the line trace (2 steps)
    sees neither append run. It named the first in the file, ``val_losses.append(tot / 3)``
    in the branch that never runs; now the line appending a variable that holds a graph."""
    script = tmp_path / "eval_leak.py"
    script.write_text(EVAL_LEAK)
    (leak,) = run_script(script, (), device="cpu", budget="16MiB").report.leaks
    top = leak.suspects[0]
    line = EVAL_LEAK.splitlines().index("            val_losses.append(vloss)") + 1
    assert (top.name, top.line, top.code) == ("val_losses", line, "val_losses.append(vloss)")
    assert leak.period == 4


def test_a_batch_where_a_dead_output_was_is_no_state_fed_back() -> None:
    """The allocator reuses a freed output's address for the next batch: taken for a state
    fed back (its shape left out of the step's batches), the evaluation's rise in the test
    above showed at a step that moved with the addresses (period 5 or 3 in CI, not 4)."""
    import weakref

    from memkit.tracking.phases import _fed_back

    out = torch.ones(16)
    mems = out.detach()  # Transformer-XL: the state fed back shares the output's storage
    outputs = {out.data_ptr(): weakref.ref(out.untyped_storage())}
    del out
    assert _fed_back(mems.data_ptr(), outputs)
    ptr = mems.data_ptr()
    del mems  # the storage is freed: whatever lands at its address next is new
    assert not _fed_back(ptr, outputs)
    assert not _fed_back(ptr + 64, outputs)


def test_the_line_trace_stays_off_once_torch_compile_made_graphs(monkeypatch) -> None:
    """memkit must cause no recompilation: a trace function set while compiled code runs
    could change what Dynamo does, so the line trace does not start after torch.compile."""
    import sys

    from torch._dynamo.utils import counters

    from memkit.tracking.line_trace import LineTrace

    code = test_the_line_trace_stays_off_once_torch_compile_made_graphs.__code__
    monkeypatch.setitem(counters["stats"], "unique_graphs", 1)
    trace = LineTrace({code: frozenset({1})})
    assert not trace.start(sys._getframe()) and sys.gettrace() is None
    monkeypatch.setitem(counters["stats"], "unique_graphs", 0)
    assert trace.start(sys._getframe()) and sys.gettrace() is not None
    trace.stop()
    assert sys.gettrace() is None


def test_a_process_forked_while_the_line_trace_is_on_is_not_traced(monkeypatch) -> None:
    """A DataLoader's workers forked during the two traced steps ran all their Python under
    the tracer, which no step boundary of theirs would stop."""
    import os
    import sys

    from torch._dynamo.utils import counters

    from memkit.tracking.line_trace import LineTrace

    monkeypatch.setitem(counters["stats"], "unique_graphs", 0)
    code = test_a_process_forked_while_the_line_trace_is_on_is_not_traced.__code__
    trace = LineTrace({code: frozenset({1})})
    assert trace.start(sys._getframe())
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 if untraced
            os._exit(0 if sys.gettrace() is None else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sys.gettrace() is not None  # the parent's trace goes on
    finally:
        trace.stop()


def test_sorted_sequence_lengths_are_no_leak_while_the_loop_keeps_its_logits() -> None:
    """Length buckets, shortest first: ``logits = model(ids)`` lives into the next step's
    forward, so every level the detector read held the last step's logits, which grow with
    the length: 'memory grows by 20.75 KiB per step' (sweep X; no leak). The levels leave the
    last training forward's largest output out, as they leave out its batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 16), nn.Linear(16, 500))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for length in range(4, 4 + 2 * 30, 2):  # sorted: one more token pair every step
            ids = torch.randint(0, 500, (8, length))
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 500), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert tracker.report().leaks == []


def _gpt2_buckets(kept: list[Any] | None) -> TrackReport:
    """A tiny transformers GPT-2 trained on length buckets, shortest first (``out`` lives into
    the next step's forward); ``kept``: a list the loop appends each step's cache to."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for step in range(24):
            ids = torch.randint(0, 128, (2, 8 + 4 * step))
            out = model(input_ids=ids, labels=ids)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            if kept is not None:
                kept.append(out.past_key_values)
    return tracker.report()


def test_a_key_value_cache_growing_with_sorted_lengths_is_the_steps_own_not_a_leak() -> None:
    """GPT-2 returns its key-value cache (``use_cache`` is on in training too), a
    ``DynamicCache`` whose layers hold the keys and values: 'memory grows by 16.00 KiB per
    step' on length buckets, the last step's cache alive in ``out`` (2 layers x k, v x 4
    tokens more a step). The levels leave out the step's own tensors inside its output's
    objects too; a loop that keeps every step's cache still leaks."""
    assert _gpt2_buckets(None).leaks == []
    kept: list[Any] = []
    (leak,) = _gpt2_buckets(kept).leaks
    assert leak.growth_per_step > 0 and leak.suspects[0].name == "kept"


class Encoder(nn.Module):
    """The seq2seq tutorial's EncoderRNN, tiny: it returns its outputs and hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(self.embedding(ids))


class Decoder(nn.Module):
    """The tutorial's DecoderRNN, tiny (teacher forcing): it reads the encoder's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, 50)

    def forward(
        self, encoder_outputs: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        output, _ = self.gru(self.embedding(target), hidden)
        return F.log_softmax(self.out(output + encoder_outputs), -1)


def seq2seq(kept: list[torch.Tensor] | None) -> TrackReport:
    """Length buckets, shortest first (4 steps each), an encoder and a decoder with an optimizer
    each: the loop's `encoder_outputs`, alive into the next step's forward, grows with the
    bucket's length; ``kept``: each step's appended with its graph (the leak)."""
    torch.manual_seed(0)
    encoder, decoder = Encoder(), Decoder()
    encoder_opt = torch.optim.Adam(encoder.parameters())
    decoder_opt = torch.optim.Adam(decoder.parameters())
    with track(None, device="cpu", budget="16MiB") as tracker:
        for length in sorted([4, 8, 12, 16] * 4):
            source, target = torch.randint(0, 50, (8, length)), torch.randint(0, 50, (8, length))
            encoder_opt.zero_grad()
            decoder_opt.zero_grad()
            encoder_outputs, hidden = encoder(source)
            if kept is not None:
                kept.append(encoder_outputs)
            out = decoder(encoder_outputs, hidden, target)
            F.nll_loss(out.reshape(-1, 50), target.reshape(-1)).backward()
            encoder_opt.step()
            decoder_opt.step()
    return tracker.report()


def test_an_encoders_outputs_that_grow_with_sorted_lengths_are_no_leak() -> None:
    """The levels left out the last training forward's first input and largest output only:
    the encoder's outputs, alive where the next step's forward began, read as "grows by 128 KiB
    every 6 steps" (sweep GG). Every input and output of the step's training forwards is the
    step's own while it lives."""
    report = seq2seq(None)
    assert report.leaks == [] and "memory-growth" not in {a.code for a in report.advice}


def test_encoder_outputs_kept_with_their_graph_are_still_a_leak_among_sorted_lengths() -> None:
    kept: list[torch.Tensor] = []
    (leak,) = seq2seq(kept).leaks
    assert leak.suspects[0].name == "kept" and leak.suspects[0].growing


def test_a_models_second_input_that_grows_with_sorted_lengths_is_no_leak() -> None:
    """One model, ``model(source, target)``: the target, the forward's second input, grew with
    the bucket's length at each level: "2 input tensors ... still alive ... batches a script
    keeps (a list built before training)", where the script keeps none (sweep GG)."""

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = Encoder(), Decoder()

        def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self.decoder(*self.encoder(source), target)

    torch.manual_seed(0)
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for length in sorted([4, 8, 12, 16] * 4):
            source, target = torch.randint(0, 50, (8, length)), torch.randint(0, 50, (8, length))
            opt.zero_grad()
            out = model(source, target)
            F.nll_loss(out.reshape(-1, 50), target.reshape(-1)).backward()
            opt.step()
    assert tracker.report().leaks == []


class Memory(nn.Module):
    """Transformer-XL's shape: ``model(x, mems) -> (out, new_mems)``, the memory concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, mems: torch.Tensor | None = None) -> Any:
        h = self.lin(x)
        ctx = h if mems is None else torch.cat([mems, h], 0)
        return h + ctx.mean(0, keepdim=True), ctx


@pytest.mark.parametrize("fed_back", ["memory never cut"])
def test_a_state_fed_back_that_grows_under_a_steady_batch_is_a_leak(fed_back: str) -> None:
    """Review: with every input and output of the step left out of the levels, a memory the
    loop feeds back and never cuts (Transformer-XL's mems; a bank, `bank = cat([bank,
    out.detach()])`, passed in) grew 8 KiB a step unseen; the batch keeps its size."""
    torch.manual_seed(0)
    model = Memory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mems, bank = None, torch.zeros(0, 32)
    with track(model, opt, device="cpu", budget="64MiB") as tracker:
        for _ in range(12):
            x = torch.randn(64, 32)
            if fed_back == "memory never cut":
                out, mems = model(x, mems)
                mems = mems.detach()
            else:
                out, _ = model(x, bank)
                bank = torch.cat([bank, out.detach()])
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
    (leak,) = tracker.report().leaks
    assert leak.growth_per_step == 64 * 32 * 4


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 32), nn.Linear(32, 50)

    def forward(self, flag: Any, ids: torch.Tensor | None = None) -> torch.Tensor:
        ids = flag if ids is None else ids
        return self.out(self.emb(ids))


def test_sorted_lengths_behind_a_first_argument_that_is_not_a_tensor_are_no_leak() -> None:
    """Review: `model(None, ids)` in sorted buckets: the batch's size was read from the first
    argument alone (0 bytes, never changing), so the growing `ids` read as a leak."""
    torch.manual_seed(0)
    model = Tokens()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for length in sorted([8, 16, 24, 32] * 4):
            ids = torch.randint(0, 50, (16, length))
            opt.zero_grad()
            logits = model(None, ids)
            F.cross_entropy(logits.reshape(-1, 50), ids.reshape(-1)).backward()
            opt.step()
    assert tracker.report().leaks == []


def test_a_leak_under_two_forwards_a_step_one_of_varying_length_is_found() -> None:
    """Review: a fixed-length forward, then one of random length (a dual encoder's queries and
    padded passages), and a 6400 B copy kept each step: the batch taken from the first
    forward alone kept a stale discount, and the second's varying outputs hid the leak."""
    torch.manual_seed(0)
    model = Tokens()
    opt = torch.optim.Adam(model.parameters())
    kept = []
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for length in torch.randint(4, 40, (24,)).tolist():
            queries, passages = torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (8, length))
            out, out2 = model(queries), model(passages)
            out = out + 0 * out2.mean()
            loss = F.cross_entropy(out.reshape(-1, 50), queries.reshape(-1))
            kept.append(model.out.weight.detach() * 1)  # inside the step: device memory
            opt.zero_grad()
            loss.backward()
            opt.step()
    (leak,) = tracker.report().leaks
    assert leak.growth_per_step == 50 * 32 * 4


@pytest.mark.parametrize("given", ["dict", "list"])
def test_a_batch_given_as_one_dict_that_grows_with_sorted_lengths_is_no_leak(given: str) -> None:
    """Review: `model({"ids": ..., "mask": ...})` in sorted length buckets read as growth
    (the step's inputs were taken at the top level only)."""

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(50, 32), nn.Linear(32, 50)

        def forward(self, batch: Any) -> torch.Tensor:
            ids, mask = (batch["ids"], batch["mask"]) if isinstance(batch, dict) else batch
            return self.out(self.emb(ids) * mask.unsqueeze(-1))

    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.Adam(model.parameters())
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for length in sorted([8, 16, 24, 32] * 4):
            ids, mask = torch.randint(0, 50, (16, length)), torch.ones(16, length)
            batch = {"ids": ids, "mask": mask} if given == "dict" else [ids, mask]
            opt.zero_grad()
            logits = model(batch)
            F.cross_entropy(logits.reshape(-1, 50), ids.reshape(-1)).backward()
            opt.step()
    assert tracker.report().leaks == []


class CarriedState(nn.Module):
    """word_language_model's RNNModel, tiny: a recurrent layer and a decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(8, 16)
        self.decoder = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output, hidden = self.rnn(x, hidden)
        return self.decoder(output), hidden


def hidden_never_detached(steps: int, detach: bool = False) -> TrackReport:
    """word_language_model's loop: no optimizer (``model.zero_grad()`` at the step's start,
    SGD by hand; steps counted at the next training forward); without ``detach`` the hidden
    state is never detached (``retain_graph=True`` silences the error): every step's graph
    stays alive, built on the last."""
    torch.manual_seed(0)
    model = CarriedState()
    hidden = torch.zeros(1, 4, 16)
    with track(model, device="cpu", budget="16MiB") as tracker:
        for _ in range(steps):
            if detach:
                hidden = hidden.detach()
            model.zero_grad()
            output, hidden = model(torch.randn(12, 4, 8), hidden)
            loss = output.square().mean()
            loss.backward(retain_graph=not detach)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.01)
    return tracker.report()


def test_the_last_steps_gradients_are_not_parameters_made_trainable() -> None:
    """The level of each step is read where the next forward begins, after ``zero_grad()``;
    the bytes of parameters and gradients it is compared with were measured at the next step
    boundary, which for the last step is the block's end, with its gradients alive: "memory
    rose by 511.95 KiB at step(s) 38, all of it ... (parameters made trainable mid-run ...):
    not a leak", always at the second-to-last step, and the rate was low by as much
    (sweep Z)."""
    report = hidden_never_detached(12)
    (leak,) = report.leaks
    ends = [s.end_allocated for s in report.devices[0].steps]
    assert leak.growth_per_step == ends[6] - ends[5] > 0
    assert (leak.first_step, leak.steps) == (2, 8)  # steps 2..10: the last level read
    assert not [n for n in report.notes if "made trainable" in n]


def running_loss_with_its_graph(steps: int, leak: bool) -> TrackReport:
    """``running_loss += loss`` with ``retain_graph=True``: every step's graph, with the
    tensors it saved, stays alive (``leak``); else ``loss.item()`` is added."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    running_loss = torch.zeros(())
    with track(model, opt, device="cpu", budget="16MiB") as tracker:
        for _ in range(steps):
            loss = model(torch.randn(16, 32)).square().mean()
            opt.zero_grad()
            loss.backward(retain_graph=leak)
            opt.step()
            running_loss = running_loss + (loss if leak else loss.item())
    return tracker.report()


def test_a_leaks_saving_is_what_the_fix_frees_by_the_end_not_a_steps_growth() -> None:
    """Sweep Z's word_language_model with ``hidden`` never detached said "saving: ~1.18 MiB",
    the growth of one step, where detaching took the peak from 49.38 MiB to 2.50 MiB after 40
    steps. The same here with a ``running_loss += loss`` kept with its graph over 40 steps:
    the saving is the growth measured over the climb (the steps before it and the last one,
    whose level no step reads, leak too: at least, within 10% at 40 steps)."""
    report = running_loss_with_its_graph(40, leak=True)
    fixed = running_loss_with_its_graph(40, leak=False)
    (advice,) = [a for a in report.advice if a.code == "graph-retained"]
    saved = report.devices[0].peak_allocated - fixed.devices[0].peak_allocated
    assert advice.saving_bytes is not None and 0.9 * saved <= advice.saving_bytes <= saved
    (leak,) = report.leaks
    assert f"{format_size(leak.growth_per_step)} per step" in advice.evidence
    assert f"{format_size(advice.saving_bytes)} in all from step 2 to step 38" in advice.evidence


def test_of_two_lists_growing_the_faster_is_named_and_its_share_is_the_saving():
    """Two lists keep detached outputs, 256 KiB and 768 KiB a step: the advice named the
    slower one, and promised the whole 6 MiB of growth as the least its fix saves. The
    fastest graphless grower comes first, and the saving is its share of the growth."""
    import memkit

    def run(keep_big: bool, tracked: bool) -> TrackReport | int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        small, big = [], []
        block = (
            track(model, opt, device="cpu", budget="512MiB")
            if tracked
            else memkit.simulate("512MiB", device="cpu", track=(model, opt))
        )
        with block as t:
            for _ in range(10):
                out = model(torch.randn(32, 64))
                small.append(out.detach().repeat(1, 2048))
                if keep_big:
                    big.append(out.detach().repeat(1, 3 * 2048))
                opt.zero_grad()
                out.pow(2).mean().backward()
                opt.step()
        return t.report() if tracked else t.peak

    report = run(True, tracked=True)
    assert isinstance(report, TrackReport)
    (adv,) = [a for a in report.advice if a.code == "tensors-kept"]
    assert "`big`" in adv.title and adv.saving_bytes is not None
    freed = run(True, tracked=False) - run(False, tracked=False)
    assert 0.5 * freed <= adv.saving_bytes <= freed
    assert "fixing it saves about" in adv.evidence and "the least that" not in adv.evidence


PACKED_SAVED = pytest.mark.skipif(
    not hasattr(torch._C._autograd.SavedTensor, "data"),
    reason="torch < 2.10 reads saved tensors only by unpacking them: oom-retry-holds is off",
)


def _retrying_loop(free_in_except: bool) -> tuple[TrackReport, int]:
    """A time-limited script's loop (sweep ZZ): the step written inline, an OOM caught,
    the batch halved and the step retried. ``free_in_except``: ``out = loss = None`` there.
    Returns the report and the batch size that trained."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trained, batch = 0, 1024
    with track(model, optimizer, device="cpu", budget="36MiB", postmortem=None) as tracker:
        while trained < 2 and batch >= 256:
            x, y = torch.randn(batch, 1024), torch.randint(0, 10, (batch,))
            try:
                optimizer.zero_grad()
                out = model(x)
                loss = nn.functional.cross_entropy(out, y)
                loss.backward()
                optimizer.step()
                trained += 1
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                if free_in_except:
                    out = loss = None
                batch //= 2
    return tracker.report(), batch


@PACKED_SAVED
def test_a_retry_after_a_caught_oom_that_carries_the_failed_graph_is_named():
    """Sweep ZZ: the step written inline in the loop, the OOM caught in backward: ``out`` and
    ``loss`` outlive the ``except`` block, and the retry at half the batch ran out again with
    the failed attempt's 12 MiB graph beside it; the report said only that OOMs were caught.
    Now ``oom-retry-holds`` names them; applied (``out = loss = None`` in the ``except``
    block), the retry at 512 trains, where it ran out again and 256 was the next to train."""
    report, trained = _retrying_loop(free_in_except=False)
    (advice,) = [a for a in report.advice if a.code == "oom-retry-holds"]
    assert "`out` (_retrying_loop():" in advice.evidence and "`loss`" in advice.evidence
    # what the failed attempt's graph saves: the batch and two ReLU outputs, 4 MiB each (the
    # weights the Linears save are the model's, no saving: counted, they made it 20 MiB)
    assert report.retry_held is not None and report.retry_held[1] == 12 << 20
    fixed, trained_fixed = _retrying_loop(free_in_except=True)
    assert "oom-retry-holds" not in [a.code for a in fixed.advice]
    assert (trained, trained_fixed) == (256, 512)


SKIPPING_SCRIPT = """
import torch
from torch import nn
from torch.nn import functional as F
from memkit import track
from memkit.devices.cuda_standin import cuda_standin

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(80, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = self.proj(x)
        return self.out((h @ h.transpose(1, 2)).softmax(-1) @ h).mean(1)

torch.manual_seed(0)
with cuda_standin("64MiB"):
    model = Attention().to("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with track(model, optimizer, device="cuda", postmortem=None) as tracker:
        for b, length in ((8, 128), (2, 2048), (32, 256), (32, 256)):  # the 2nd runs out
            x = torch.randn(b, length, 80).to("cuda")
            y = torch.randint(0, 10, (b,)).to("cuda")
            try:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
            except torch.OutOfMemoryError:
                continue
    report = tracker.report()
"""


def test_a_skipped_batch_after_a_finished_step_is_no_carried_graph(tmp_path):
    """Review: a script that skips the batch an OOM hit (fairseq, ESPnet) still has the last
    finished step's ``loss``, whose graph that step's backward freed, and the next batch is
    larger in bytes (more samples, a shorter sequence): it was told the retry "carried" the
    failed attempt (1.25 MiB). A graph that saves nothing any more is no holder."""
    import runpy

    script = tmp_path / "skipping.py"
    script.write_text(SKIPPING_SCRIPT)
    report = runpy.run_path(str(script))["report"]
    assert any("ran out of memory once" in n for n in report.notes), report.notes
    assert report.retry_held is None and "oom-retry-holds" not in [a.code for a in report.advice]


@PACKED_SAVED
def test_the_graphs_a_retry_carries_are_read_without_running_saved_tensor_hooks():
    """Review: reading a node's saved tensors unpacks them, and a non-reentrant checkpoint's
    unpack reruns the block's forward (16 forwards, 0.5 s, rows changed) right after an
    OOM. They are read packed: a checkpointed graph's hooked tensors are left out, a plain
    graph's are counted, the weights it saves are not (they are the model's)."""
    import sys

    from torch.utils.checkpoint import checkpoint

    from memkit.tracking.leaks import graph_holders

    calls = [0]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return torch.relu(self.l(x))

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(2))
    weights = frozenset(p.untyped_storage().data_ptr() for p in blocks.parameters())
    x = torch.randn(64, 256, requires_grad=True)
    out = x
    for block in blocks:
        out = checkpoint(block, out, use_reentrant=False)
    before = calls[0]
    holders, held = graph_holders(sys._getframe(), weights)
    assert calls[0] == before and held == 0, (holders, held)
    plain = blocks[1](blocks[0](x))
    holders, held = graph_holders(sys._getframe(), weights)
    assert ("plain", sys._getframe().f_code.co_name) == holders[0][:2]
    # the input and two ReLU outputs (a retry's failed batch, reassigned, lives in the graph
    # alone; an input still referenced elsewhere is counted all the same)
    assert held == 3 * 64 * 256 * 4 and plain.grad_fn is not None


def test_an_inference_loop_is_told_how_to_have_its_leaks_looked_for():
    """Sweep BC: an embedding loop (grad on, every output kept in a list: each keeps its
    graph) has no training step, so no step boundary, and the leak search never ran, silently.
    The report now says so and how: with tracker.step() per batch, the graph is found."""

    def embed(steps: bool) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)).eval()
        embeddings = []
        with track(model, device="cpu", budget="64MiB") as tracker:
            for _ in range(12):
                embeddings.append(model(torch.randn(64, 64)))
                if steps:
                    tracker.step()
        return tracker.report()

    silent = embed(steps=False)
    assert any("no training step ran (inference alone)" in n for n in silent.notes)
    assert not silent.leaks
    stepped = embed(steps=True)
    assert not any("inference alone" in n for n in stepped.notes)
    (found,) = [a for a in stepped.advice if a.code == "graph-retained"]
    assert "embeddings" in found.evidence


def test_kept_items_of_several_tensors_are_described_by_their_largest():
    """Sweep BC: a chat history of ``(tokens, scores)`` per turn was described by the last
    item's first tensor, the 1 KiB tokens, beside 250 KiB of scores."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1000)).eval()
    history = []
    with track(model, device="cpu", budget="64MiB") as tracker:
        for _ in range(12):
            with torch.no_grad():
                scores = model(torch.randn(4, 16, 64))
            history.append((scores.argmax(-1), scores))
            tracker.step()
    (kept,) = [a for a in tracker.report().advice if a.code == "tensors-kept"]
    assert "the last's largest a (4, 16, 1000) tensor" in kept.evidence


def test_the_line_named_is_code_not_a_docstring_or_comment_that_quotes_it():
    """Sweep BG: a script whose docstring quoted ``running_loss += loss`` had its docstring
    named as the line that grows the graph."""
    from memkit.tracking.leaks import _ASSIGN, _best_lines

    lines = [
        '"""running_loss += loss keeps every graph."""\n',
        "import torch\n",
        "# running_loss += loss, as the tutorial wrote it\n",
        "running_loss = torch.zeros(())\n",
        "opt.step()  # not running_loss += loss\n",  # (review: in a line's comment or string)
        'log("... running_loss += loss")\n',
        "for step in range(3):\n",
        "    running_loss += loss\n",
    ]
    found = _best_lines(lines, 1, _ASSIGN.format(name="running_loss"), "running_loss")
    assert found is not None and found[1] == [8]


def test_the_line_named_is_of_the_frames_own_function_not_a_nested_one():
    """Sweep CE: a nanoGPT main() whose nested `estimate_loss()` assigns its own `loss`
    under no_grad had main()'s `loss` named at that line (81, of the nested function), not
    at main()'s own (104)."""
    import inspect

    from memkit.tracking.leaks import _first_line

    def main() -> None:
        @torch.no_grad()
        def estimate_loss() -> None:
            loss = torch.zeros(())  # (a name of its own scope)
            del loss

        for _ in range(2):
            estimate_loss()
            loss = torch.ones((), requires_grad=True) * 2
            loss.backward()

    own = inspect.getsourcelines(main)[1] + 8
    assert _first_line(main.__code__, 0, "loss")[0] == own

    def deeper() -> None:  # (review: two levels down, and a closure's cell)
        def evaluate() -> None:
            def one_batch() -> None:
                loss = torch.zeros(())
                del loss

            loss = torch.zeros(())
            print((lambda: loss)())
            one_batch()

        evaluate()
        loss = torch.ones((), requires_grad=True) * 2
        loss.backward()

    own = inspect.getsourcelines(deeper)[1] + 11
    assert _first_line(deeper.__code__, 0, "loss")[0] == own


def test_optimizers_are_found_in_the_dict_a_script_keeps_them_in():
    """Sweep BH: one optimizer per parameter in a dict (the optimizer step fused into
    backward); an OOM before any stepped found none, and its advice left out their state."""
    from memkit.tracking.leaks import optimizers_in_frames

    model = torch.nn.Linear(4, 4)
    optimizer_dict = {p: torch.optim.Adam([p]) for p in model.parameters()}
    found = optimizers_in_frames(sys._getframe())
    assert {id(o) for o in found} == {id(o) for o in optimizer_dict.values()}


class _WrappedOptimizer(torch.optim.Optimizer):
    """accelerate's AcceleratedOptimizer's shape: an Optimizer holding the real one."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # (no super: as a wrapper)
        self.optimizer = inner


class _Trainer:
    """A framework's trainer that holds the optimizer as ``self.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def train(self) -> list:
        from memkit.tracking.leaks import optimizers_in_frames

        return optimizers_in_frames(sys._getframe())


def test_optimizers_are_found_unwrapped_and_in_a_frameworks_own_frame():
    """Sweep BX: under memkit run, a transformers Trainer's step-0 OOM found the optimizer as
    accelerate's wrapper, whose state it could not price, and the batch cut it advised ran out;
    run as ``Trainer(...).train()``, no user frame holds the optimizer at all."""
    from memkit.tracking.leaks import framework_optimizers, optimizers_in_frames

    inner = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    wrapped = _WrappedOptimizer(inner)
    assert optimizers_in_frames(sys._getframe()) == [inner]
    del wrapped
    assert framework_optimizers(sys._getframe()) == []
    assert _Trainer(_WrappedOptimizer(inner)).train() == [inner]


@pytest.mark.parametrize("keep", ["graph", "item"])
def test_a_gan_ending_in_its_generator_step_reads_no_partial_step_as_growth(keep):
    """Sweep BY: DCGAN's loop, steps counted at the discriminator's ``optimizer.step()``; the
    last iteration's generator step (the fake batch's graph alive) was read as the last step's
    level at the block's end: a 4 B-a-step list of losses became 1.15 MiB a step."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 512), nn.Tanh())
    disc = nn.Sequential(nn.Linear(512, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
    opt_d = torch.optim.Adam(disc.parameters(), 2e-4)
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4)
    bce = F.binary_cross_entropy_with_logits
    history: list[Any] = []
    with track(device="cpu", budget="32MiB", postmortem=None) as tracker:
        for _ in range(6):
            disc.zero_grad()
            real, ones, zeros = torch.randn(64, 512), torch.ones(64, 1), torch.zeros(64, 1)
            err_real = bce(disc(real), ones)
            err_real.backward()
            fake = gen(torch.randn(64, 16))
            err_fake = bce(disc(fake.detach()), zeros)
            err_fake.backward()
            err_d = err_real + err_fake
            opt_d.step()
            gen.zero_grad()
            bce(disc(fake), ones).backward()
            opt_g.step()
            history.append(err_d if keep == "graph" else err_d.item())
    leak = tracker.report().devices[0].leak
    if keep == "item":
        assert leak is None
    else:  # a 0-d loss a step, its graph's nodes in host memory
        assert leak is not None and leak.growth_per_step <= 4 and leak.grown_bytes <= 64


@pytest.mark.parametrize("how", ["undetached", "detached", "twice through one graph"])
def test_a_graph_kept_with_retain_graph_that_no_backward_uses_is_named(how):
    """Sweep BY: a DCGAN's discriminator loss on an undetached ``fake``, backwarded with
    ``retain_graph=True`` to let the generator's step go through it, kept its saved tensors
    into the next step ('other', 4 MiB) and no advice named it. A loss backwarded twice on
    purpose (the second backward frees what the first kept) is no such graph."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 1024), nn.Tanh())
    disc = nn.Sequential(nn.Linear(1024, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1))
    opt_d = torch.optim.SGD(disc.parameters(), 1e-3)
    opt_g = torch.optim.SGD(gen.parameters(), 1e-3)
    bce = F.binary_cross_entropy_with_logits
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(3):
            disc.zero_grad()
            fake = gen(torch.randn(256, 16))
            d_in = fake if how == "undetached" else fake.detach()
            err_fake = bce(disc(d_in), torch.zeros(256, 1))
            err_fake.backward(retain_graph=how != "detached")
            if how == "twice through one graph":
                err_fake.backward()
            opt_d.step()
            gen.zero_grad()
            bce(disc(fake), torch.ones(256, 1)).backward()
            opt_g.step()
    report = tracker.report()
    advice = [a for a in report.advice if a.code == "retain-graph-held"]
    if how != "undetached":
        assert advice == [] and report.retained_held is None
        return
    (adv,) = advice
    step, held, names = report.retained_held
    assert step == 1  # the first generator step (the discriminator's optimizer ended step 0)
    # the discriminator's saved activations on the fake batch: its input (the fake batch's
    # own storage is G's output, kept by G's graph too), the hidden layer's output and the
    # LeakyReLU's: 256 x 1024 floats each, and the logits' small tensors
    assert 2 * 256 * 1024 * 4 <= held <= 3 * 256 * 1024 * 4 + 4096
    assert names[0].startswith("`err_fake`") and adv.saving_bytes == held


def test_a_loop_updating_by_hand_that_runs_out_keeps_its_steps_and_its_leak():
    """Review 3: a loop that updates its weights by hand (``p -= lr * p.grad; p.grad = None``)
    beside an optimizer it never steps, keeping each step's output, ran out at step 20; the
    end-of-block fold meant for a first optimizer step's micro-batches or retries made it
    step 0 and dropped the leak."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # held, never stepped
    keep = []
    with (
        pytest.raises(torch.OutOfMemoryError),
        track(device="cpu", budget="8MiB", postmortem=None) as tracker,
    ):
        for _ in range(100):
            out = model(torch.randn(64, 256))
            out.pow(2).mean().backward()
            keep.append(out)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    report = tracker.report()
    assert opt.state == {} and report.step_rule == "backward"
    assert report.oom is not None and report.oom.step > 5 and len(report.devices[0].steps) > 5
    assert report.devices[0].leak is not None


def test_a_last_logging_forward_after_the_loop_still_reads_the_last_step():
    """Review 3: a plain loop ending in one training-mode forward for a final logged loss
    leaves a part step; its floor is read as before (only another optimizer's step past the
    boundary, a GAN's, makes a part step unlike the others)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    keep = []
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        for _ in range(6):
            out = model(torch.randn(64, 256))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            keep.append(out.detach())  # 64 KiB a step
        model(torch.randn(64, 256)).pow(2).mean().item()
    leak = tracker.report().devices[0].leak
    assert leak is not None and leak.growth_per_step == 64 * 256 * 4


REPLAY_MEMORY = """\
import random, torch
from torch import nn


class ReplayMemory:  # the PyTorch DQN tutorial's (tensors on the device)
    def __init__(self, capacity):
        self.capacity, self.memory, self.position = capacity, [], 0

    def push(self, state, reward):
        if len(self.memory) < self.capacity:
            self.memory.append(None)
        self.memory[self.position] = (state, reward)
        self.position = (self.position + 1) % self.capacity


torch.manual_seed(0)
random.seed(0)
policy = nn.Linear(256, 4)
opt = torch.optim.SGD(policy.parameters(), lr=0.01)
memory = ReplayMemory(10_000)
for step in range(12):
    state = torch.randn(1, 256)
    memory.push(state, policy(state).max().detach())
    batch = torch.cat([s for s, _ in random.sample(memory.memory, 1)])
    policy(batch).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_replay_memorys_placeholder_append_is_not_the_line_named(tmp_path):
    """Sweep CB: the DQN tutorial's ``push`` appends ``None`` as a placeholder, then stores
    the transition at its position; the placeholder's line was named, and the fix read
    ``memory.memory.append(None.detach().cpu())``."""
    script = tmp_path / "dqn.py"
    script.write_text(REPLAY_MEMORY)
    line = REPLAY_MEMORY.splitlines().index("        self.memory[self.position] = (state, reward)")
    report = run_script(script, (), device="cpu", budget="16MiB").report
    (leak,) = report.leaks
    assert leak.suspects[0].where == f"dqn.py:ReplayMemory.push():{line + 1}"
    assert not any("None." in a.action for a in report.advice)


def test_a_rollout_buffer_the_steps_index_is_named_with_its_bytes():
    """Sweep CB: CleanRL's PPO fills a rollout buffer between updates and indexes a minibatch
    out of it for every optimizer step; the simulated device left its 8 MiB out (on a GPU it
    is there) and only a generic note said so. The note names it, with its bytes: the peak
    plus them is what the whole loop holds under a plain simulate."""

    def ppo(track_it: bool) -> tuple[int, list[str]]:
        torch.manual_seed(0)
        agent = nn.Sequential(nn.Linear(1024, 64), nn.Tanh(), nn.Linear(64, 4))
        opt = torch.optim.Adam(agent.parameters(), lr=3e-4)
        block = track(device="cpu", budget="64MiB", postmortem=None) if track_it else None
        sim = memkit.simulate("64MiB") if not track_it else None
        with block or sim as watch:  # type: ignore[union-attr]
            obs = torch.zeros(128, 16, 1024)  # num_steps x num_envs x obs_dim: 8 MiB
            for _ in range(2):
                with torch.no_grad():
                    for step in range(128):
                        obs[step] = torch.randn(16, 1024)
                flat = obs.reshape(-1, 1024)
                for mb in torch.randperm(2048).split(512):
                    agent(flat[mb]).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
        if track_it:
            report = watch.report()
            return report.devices[0].peak_allocated, list(report.notes)
        return watch.peak, []

    peak, notes = ppo(True)
    (note,) = [n for n in notes if "the script holds tensors it did not count" in n]
    assert "`obs` (8.00 MiB)" in note
    whole, _ = ppo(False)
    assert peak + 8 * MiB == pytest.approx(whole, abs=64 * 1024)


def test_a_replay_deque_of_small_transitions_is_named_too():
    """Sweep CD: a DQN's replay buffer as a deque of (obs, next_obs) tensors, each far under
    1 MiB, was not named by the uncounted-tensor note (5.84 MiB reported, 9.20 held)."""
    import collections

    torch.manual_seed(0)
    qnet = nn.Sequential(nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(qnet.parameters())
    with track(device="cpu", budget="64MiB", postmortem=None) as tracker:
        replay = collections.deque(maxlen=1000)
        for _ in range(300):
            replay.append((torch.randn(1024), torch.randn(1024)))
        for _ in range(4):
            obs = torch.stack([o for o, _ in list(replay)[:64]])
            qnet(obs).square().mean().backward()
            opt.step()
            opt.zero_grad()
    (note,) = [n for n in tracker.report().notes if "did not count" in n]
    assert f"`replay` ({format_size(300 * 2 * 1024 * 4)})" in note
