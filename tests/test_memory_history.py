"""Memory history: the simulated device writes PyTorch's snapshot format, torch's memory_viz
reads it, and ``memkit inspect`` reads it back (and CUDA-style snapshots) with exact numbers.

Expected numbers come from an independent count: the sizes of the tensors a test makes, the
accountant's own counters, the tracked objects' storages, or the blocks of a hand-built
snapshot."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.cuda import _memory_viz as viz

import memkit
from memkit.cli import cli
from memkit.inspection import categorize, inspect_snapshot
from memkit.simulated.accountant import MemoryAccountant, tensors_of
from memkit.simulated.history import (
    PICKLE_PROTOCOL,
    SimulatedHistory,
    without_memkit_frames,
    write_snapshot,
)

MIB = 1024**2
GIB = 1024**3
SIZES = (1000, 3000, 5000)  # bytes of three uint8 tensors; the second is freed

# The opcodes memory_viz's JavaScript unpickler (torch/utils/viz/MemoryViz.js) decodes; any
# other opcode makes it throw "UNKNOWN OPCODE", and it accepts protocols 2 to 4 only.
MEMORY_VIZ_OPCODES = {
    "PROTO", "FRAME", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "MARK", "SETITEM", "SETITEMS", "APPEND",
    "APPENDS", "DICT", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BININT", "BININT1",
    "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "NEWTRUE", "NEWFALSE",
    "NONE", "STOP",
}  # fmt: skip

BROWSER = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def known_events(path: Path) -> dict[str, int]:
    """Allocate three tensors of known sizes, free the second; write the history. Returns the
    accountant's counters when it was written and the lines that made ``a`` and ``c``."""
    with memkit.simulate(None) as acct:
        history = SimulatedHistory(acct).start()
        a, line_a = torch.empty(SIZES[0], dtype=torch.uint8), sys._getframe().f_lineno
        b = torch.empty(SIZES[1], dtype=torch.uint8)
        c, line_c = torch.empty(SIZES[2], dtype=torch.uint8), sys._getframe().f_lineno
        del b
        history.dump(path)
        history.stop()
        counted = {"current": acct.current, "peak": acct.peak}
    assert a.numel() + c.numel() == SIZES[0] + SIZES[2]
    return {**counted, "a": line_a, "c": line_c}


def replay(snapshot: dict) -> None:
    """What memory_viz's segment view needs, checked event by event: every live block lies in
    a live segment, and replaying the trace from what existed before it (segments never
    allocated in it) ends in the snapshot's segments and blocks."""
    trace = snapshot["device_traces"][0]
    made = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    before = [s for s in snapshot["segments"] if s["address"] not in made]
    segments = {s["address"]: s["total_size"] for s in before}
    blocks = {b["address"]: b["requested_size"] for s in before for b in s["blocks"]}
    for i, e in enumerate(trace):
        action = e["action"]
        assert set(e) >= {"action", "size", "stream", "frames"}, e
        if action == "segment_alloc":
            assert e["addr"] not in segments
            segments[e["addr"]] = e["size"]
        elif action == "segment_free":
            assert segments.pop(e["addr"]) == e["size"]
        elif action == "alloc":
            blocks[e["addr"]] = e["size"]
        elif action == "free_completed":
            assert blocks.pop(e["addr"]) == e["size"]
        for addr, size in blocks.items():
            assert any(s <= addr and addr + size <= s + n for s, n in segments.items()), i
    final = {s["address"]: s["total_size"] for s in snapshot["segments"]}
    live = {
        b["address"]: b["requested_size"]
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    assert segments == final and blocks == live


def embedded_snapshot(page: str) -> bytes:
    """The pickle memory_viz's HTML carries (base64 in a JSON list)."""
    files = json.loads(re.search(r"const local_files = (\[.*\])", page).group(1))
    assert files[0]["name"] == "snapshot.pickle"
    return base64.b64decode(files[0]["base64"])


# -- the simulated device's history --------------------------------------------------------------


def test_known_events_round_trip_through_inspect(tmp_path):
    path = tmp_path / "mem.pickle"
    lines = known_events(path)
    assert path.read_bytes()[:2] == bytes([0x80, PICKLE_PROTOCOL])
    data = pickle.loads(path.read_bytes())
    trace = data["device_traces"][0]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc"] * 3 + [
        "free_requested", "free_completed", "segment_free",
    ]  # fmt: skip
    assert [e["size"] for e in trace if e["action"] == "alloc"] == list(SIZES)
    replay(data)

    view = inspect_snapshot(path)
    dev = view.device(0)
    end = SIZES[0] + SIZES[2]
    assert lines["current"] == end and lines["peak"] == sum(SIZES)  # the accountant agrees
    assert (dev.reserved, dev.allocated, dev.requested, dev.inactive) == (end, end, end, 0)
    assert dev.peak_allocated == sum(SIZES) and dev.peak_reserved == sum(SIZES)
    assert (dev.allocs, dev.frees, dev.unpaired_frees, dev.segments) == (3, 1, 0, 2)
    assert [a.size for a in dev.largest] == [SIZES[2], SIZES[0]]
    assert [a.size for a in dev.peak_largest] == sorted(SIZES, reverse=True)
    here = Path(__file__).name
    assert dev.largest[0].where == f"{here}:{lines['c']}:known_events"
    assert dev.largest[1].where == f"{here}:{lines['a']}:known_events"
    assert dict(dev.categories) == {"other": end}  # made by the test's own code

    result = invoke("inspect", str(path), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["devices"][0]["allocated"] == end
    assert out["devices"][0]["peak_allocated"] == sum(SIZES)
    assert out["protocol"] == PICKLE_PROTOCOL and out["simulated"] is True
    text = invoke("inspect", str(path)).stdout
    assert "reserved 5.86 KiB, allocated 5.86 KiB" in text  # 6000 bytes
    assert f"{here}:{lines['c']}:known_events" in text


def test_written_file_opens_in_torch_memory_viz(tmp_path):
    path = tmp_path / "mem.pickle"
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memkit.simulate("64MiB") as acct:
        history = SimulatedHistory(acct).start()
        acct.track(model, opt)  # the parameters enter the trace, as parameters
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
        history.dump(path)
        history.stop()
    raw = path.read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert ops <= MEMORY_VIZ_OPCODES, ops - MEMORY_VIZ_OPCODES
    data = pickle.loads(raw)
    replay(data)
    blocks = [b for s in data["segments"] for b in s["blocks"]]
    assert sum(b["size"] for b in blocks) == acct.current

    # torch's own readers: the statistics (which check their own sums), the trace, the
    # flamegraph input (its counts cover every reserved byte)
    stats = viz.segsum(data)
    assert f"total_reserved: {viz.Bytes(acct.current)}" in stats
    assert f"total_allocated: {viz.Bytes(acct.current)}" in stats
    frees = sum(1 for e in data["device_traces"][0] if e["action"] == "free_requested")
    assert viz.trace(data).count("\ndel ") == frees > 0
    lines = viz.memory(data, format_flamegraph=lambda text: text).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == acct.current
    assert any("_engine_run_backward" in line for line in lines)  # the gradients' stacks
    assert inspect_snapshot(data).device(0).category("parameters") == sum(
        p.untyped_storage().nbytes() for p in model.parameters()
    )

    # the HTML plots carry the same snapshot
    for page in (viz.trace_plot(data), viz.segment_plot(data)):
        assert "add_local_files" in page
        assert pickle.loads(embedded_snapshot(page)) == data


def test_the_accountant_is_observed_only_while_a_history_records():
    acct = MemoryAccountant("cpu")
    assert not acct.observed
    model = nn.Linear(4, 4)
    with memkit.track(model, device="cpu", budget="8MiB") as tracker:
        model(torch.randn(2, 4)).sum().backward()
    assert not tracker.backend.accountant.observed  # tracking alone records nothing
    history = SimulatedHistory(acct).start()
    assert acct.observed
    with pytest.raises(RuntimeError, match="another observer"):
        SimulatedHistory(acct).start()
    with acct:
        torch.empty(64, dtype=torch.uint8)
    history.stop()
    assert not acct.observed
    with acct:
        torch.empty(32, dtype=torch.uint8)  # after stop(): not recorded
    trace = history.snapshot()["device_traces"][0]
    assert [e["size"] for e in trace] == [64] * 5  # made and freed at once


def test_history_ring_keeps_the_latest_events(tmp_path):
    with memkit.simulate(None) as acct:
        history = SimulatedHistory(acct, max_entries=4).start()
        for n in range(1, 6):
            torch.empty(n * 512, dtype=torch.uint8)  # freed at once: five events each
        history.stop()
    snap = history.snapshot()
    trace = snap["device_traces"][0]
    assert len(trace) == 4 and snap["memkit"]["events_dropped"] == 5 * 5 - 4
    assert [e["action"] for e in trace] == ["alloc", "free_requested", "free_completed",
                                            "segment_free"]  # fmt: skip
    assert {e["size"] for e in trace} == {5 * 512}


def test_cuda_rounding_gives_rounded_blocks_and_exact_requests():
    with memkit.simulate(None, rounding="cuda") as acct:
        before = torch.empty(700, dtype=torch.uint8)  # counted before recording starts
        history = SimulatedHistory(acct).start()
        x = torch.empty(1000, dtype=torch.uint8)
        snap = history.snapshot()
        history.stop()
        counted = acct.current
    assert before.numel() + x.numel() == 1700
    blocks = sorted((b["size"], b["requested_size"]) for s in snap["segments"] for b in s["blocks"])
    assert blocks == [(1024, 700), (1024, 1000)] and counted == 2048  # 512-byte blocks
    assert [e["size"] for e in snap["device_traces"][0]] == [1024, 1000]  # segment, request
    dev = inspect_snapshot(snap).device(0)
    assert (dev.allocated, dev.requested, dev.reserved) == (2048, 1700, 2048)
    rounding = (1024 - 700) + (1024 - 1000)  # torch counts it as internal free memory
    assert f"total_free: {viz.Bytes(rounding)} (100.0% internal)" in viz.segsum(snap)


# -- track and run ---------------------------------------------------------------------------------


def test_track_writes_a_history_whose_categories_match_the_objects(tmp_path):
    path = tmp_path / "train.pickle"
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())
    with memkit.track(model, opt, device="cpu", budget="64MiB", memory_history=path) as tracker:
        for _ in range(2):
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()  # no zero_grad: the gradients are alive at the end
    report = tracker.report()
    assert tracker.history_file == path and any(str(path) in n for n in report.notes)

    def nbytes(tensors):
        return sum(t.untyped_storage().nbytes() for t in tensors)

    params = nbytes(model.parameters())
    grads = nbytes(p.grad for p in model.parameters())
    state = nbytes(tensors_of(list(opt.state.values())))
    dev = inspect_snapshot(path).device(0)
    assert dev.category("parameters") == params
    assert dev.category("gradients") == grads
    assert dev.category("optimizer state") == state
    assert dev.allocated == params + grads + state == report.devices[0].final_allocated
    assert dev.peak_allocated == report.devices[0].peak_allocated
    assert dev.category("activations", at_peak=True) + dev.category("gradients", at_peak=True) > 0


def test_track_writes_the_history_when_it_runs_out(tmp_path):
    path = tmp_path / "oom.pickle"
    batch, wide = 64, 8192  # the last layer's output (2 MiB) does not fit after its 8 MiB
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, wide))
    with (
        pytest.raises(torch.OutOfMemoryError),
        memkit.track(
            model, device="cpu", budget="10MiB", memory_history=path, postmortem=None
        ) as tracker,  # fmt: skip
    ):
        model(torch.randn(batch, 256))
    pm = tracker.report().oom
    assert pm is not None and tracker.history_file == path
    view = inspect_snapshot(path)
    (oom,) = view.device(0).ooms
    assert oom.size == batch * wide * 4 == pm.tried_to_allocate
    assert oom.allocated == pm.allocated and oom.device_free + oom.allocated == 10 * MIB
    assert "OOM at event" in str(view)


RUN_SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters())
for step in range(2):
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print("trained")
"""


def test_memkit_run_memory_history(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT)
    out = tmp_path / "mem.pickle"
    result = invoke("run", "--device", "cpu", "--budget", "64MiB", "--memory-history", str(out),
                    str(script))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "trained" in result.stdout and f"memory history: {out}" in result.stderr
    view = inspect_snapshot(out)
    with open(out, "rb") as f:
        stacks = [e["frames"] for e in pickle.load(f)["device_traces"][0] if e["frames"]]
    # as `python train.py` would record them: the script's frames down to its <module>, no
    # memkit frame (its backward wrappers, hooks, command line) and nothing below the script
    memkit_dir = os.path.dirname(memkit.__file__)
    assert stacks and {(s[-1]["filename"], s[-1]["name"]) for s in stacks} == {
        (str(script), "<module>")
    }
    assert not [f for s in stacks for f in s if f["filename"].startswith(memkit_dir)]
    backward = [s for s in stacks if s[0]["name"] == "_engine_run_backward"]
    assert backward and all("external_utils" not in f["filename"] for s in backward for f in s)
    model_bytes = (32 * 64 + 64 + 64 * 4 + 4) * 4
    assert view.device(0).category("parameters") == model_bytes  # read by forward first
    assert view.device(0).category("optimizer state") >= 2 * model_bytes  # Adam's two moments
    # every rank writes its own file; the folder is checked before the script runs
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = invoke("run", "--device", "cpu", "--budget", "64MiB", "--memory-history", str(out),
                    str(script))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "mem.rank1.pickle").is_file() and "mem.rank1.pickle" in result.stderr
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w')\n")
    missing = invoke("run", "--device", "cpu", "--memory-history", str(tmp_path / "no" / "m.p"),
                     str(script))  # fmt: skip
    assert missing.exit_code == 2 and "--memory-history" in missing.stderr
    assert not marker.exists()


def test_recorded_cuda_stacks_lose_memkits_frames_and_keep_the_users():
    """A CUDA snapshot records every Python frame: under `memkit run`, memkit's wrappers of
    backward (each inside torch._dynamo.disable's wrapper), its hooks and the launcher below
    the script. They go; a `torch._dynamo.disable` of the user's own stays."""
    package = os.path.dirname(memkit.__file__)
    torch_dir = "/env/torch"
    stack = frames(
        (f"{torch_dir}/autograd/graph.py", "_engine_run_backward"),
        (f"{package}/tracking/wrappers.py", "run_backward"),
        (f"{torch_dir}/_dynamo/external_utils.py", "nonrecursive_disable_wrapper"),
        (f"{torch_dir}/autograd/__init__.py", "backward"),
        ("/home/u/train.py", "step"),
        (f"{torch_dir}/_dynamo/external_utils.py", "nonrecursive_disable_wrapper"),
        ("/home/u/train.py", "<module>"),
        (f"{package}/tracking/run.py", "_exec_as_main"),
        (f"{package}/tracking/run.py", "run_script"),
        ("/env/click/core.py", "invoke"),
        ("<frozen runpy>", "_run_module_as_main"),
    )
    shared = list(stack)
    snapshot = {
        "segments": [{"frames": shared, "blocks": [{"frames": shared, "size": 512}]}],
        "device_traces": [[{"action": "alloc", "frames": shared}, {"action": "free_requested",
                                                                   "frames": []}]],
    }  # fmt: skip
    # `memkit run -m pkg.train` (review CL): runpy's frames between the module and memkit's
    as_module = [*stack[:6], {"filename": "/home/u/pkg/train.py", "line": 3, "name": "<module>"},
                 {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
                 {"filename": "<frozen runpy>", "line": 226, "name": "run_module"},
                 {"filename": f"{package}/tracking/run.py", "line": 569,
                  "name": "_run_module_as_main"}, *stack[8:]]  # fmt: skip
    module = without_memkit_frames({"device_traces": [[{"frames": as_module}]]})
    assert module["device_traces"][0][0]["frames"][-1]["name"] == "<module>"
    assert len(module["device_traces"][0][0]["frames"]) == 5
    cleaned = without_memkit_frames(snapshot)
    kept = [(f["filename"].split("/")[-1], f["name"]) for f in cleaned["segments"][0]["frames"]]
    assert kept == [
        ("graph.py", "_engine_run_backward"),
        ("__init__.py", "backward"),
        ("train.py", "step"),
        ("external_utils.py", "nonrecursive_disable_wrapper"),  # the user's own
        ("train.py", "<module>"),
    ]
    block, event = cleaned["segments"][0]["blocks"][0], cleaned["device_traces"][0][0]
    assert block["frames"] is event["frames"] is cleaned["segments"][0]["frames"]  # shared
    assert cleaned["device_traces"][0][1]["frames"] == []


# -- inspecting CUDA snapshots -------------------------------------------------------------------


def frames(*names: tuple[str, str]) -> list[dict]:
    return [{"filename": f, "line": 10 + i, "name": n} for i, (f, n) in enumerate(names)]


FORWARD = frames(("/env/torch/nn/modules/linear.py", "forward"), ("/home/u/train.py", "train"))
ADAM = frames(("/env/torch/optim/adam.py", "_init_group"), ("/home/u/train.py", "train"))


def cuda_snapshot(expandable: bool = False, free_segment: int = 400 * MIB) -> dict:
    """A CUDA-style snapshot dumped at an OOM: a large segment split into live and free blocks,
    a free segment, a small segment with one live block; the trace ends in an OOM of 600 MiB,
    which no free block can hold (with the default ``free_segment``)."""

    def block(size, state, requested=None, frames_=None):
        b = {"size": size, "state": state}
        if state != "inactive":
            b |= {"requested_size": requested or size, "frames": frames_ or []}
        return b

    layout = [
        [block(GIB, "active_allocated", frames_=FORWARD), block(300 * MIB, "inactive"),
         block(500 * MIB, "active_allocated", frames_=ADAM), block(200 * MIB, "inactive")],
        [block(free_segment, "inactive")],
        [block(512, "active_allocated", requested=500), block(2 * MIB - 512, "inactive")],
    ]  # fmt: skip
    segments, address = [], 0x7F0000000000
    for blocks in layout:
        total = sum(b["size"] for b in blocks)
        used = sum(b["size"] for b in blocks if b["state"] != "inactive")
        segments.append({"device": 0, "address": address, "total_size": total, "stream": 0,
                         "segment_type": "large" if total > MIB else "small",
                         "allocated_size": used, "blocks": blocks})  # fmt: skip
        address += total + 64 * MIB
    oom = {"action": "oom", "device_free": 100 * MIB, "size": 600 * MIB, "stream": 0,
           "frames": FORWARD, "time_us": 1}  # fmt: skip
    return {
        "segments": segments,
        "device_traces": [[oom]],
        "allocator_settings": {"expandable_segments": expandable},
    }


def test_synthetic_cuda_snapshot_gives_the_fragmentation(tmp_path):
    snap = cuda_snapshot()
    viz.segsum(snap)  # torch's own reader accepts the hand-built layout
    path = write_snapshot(snap, tmp_path / "cuda.pickle")
    view = inspect_snapshot(path)
    dev = view.device(0)
    blocks = [(s, b) for s in snap["segments"] for b in s["blocks"]]
    active = [b for _, b in blocks if b["state"] != "inactive"]
    free = [b["size"] for _, b in blocks if b["state"] == "inactive"]
    in_used = [
        b["size"] for s, b in blocks if b["state"] == "inactive" and len(s["blocks"]) > 1
    ]  # every segment with more than one block here holds a live one
    assert dev.reserved == sum(s["total_size"] for s in snap["segments"])
    assert dev.allocated == sum(b["size"] for b in active)
    assert dev.requested == sum(b["requested_size"] for b in active)
    assert dev.inactive == sum(free) == dev.reserved - dev.allocated
    assert (dev.inactive_split, dev.inactive_split_blocks) == (sum(in_used), len(in_used))
    assert dev.empty_segments == snap["segments"][1]["total_size"]
    assert dev.largest_free_block == max(free)
    # fragmentation: the free memory that cannot serve the failed 600 MiB request (every split
    # block here), as a share of all free memory; the empty 400 MiB segment is cache, not that
    assert dev.reference_request == 600 * MIB and "failed" in dev.reference_request_how
    assert dev.unusable_free == sum(in_used)
    assert dev.fragmentation == pytest.approx(sum(in_used) / sum(free))
    assert dev.category("activations") == GIB and dev.category("optimizer state") == 500 * MIB
    assert dev.category("unknown") == 512
    (oom,) = dev.ooms
    assert (oom.size, oom.device_free, oom.reserved) == (600 * MIB, 100 * MIB, dev.reserved)
    assert oom.allocated == dev.requested  # nothing happened between the OOM and the dump
    (frag,) = view.advice
    assert frag.code == "fragmentation" and frag.saving_bytes == dev.reserved - dev.requested
    assert "expandable_segments" in frag.action and frag.severity == "critical"
    assert [a.where for a in dev.largest[:2]] == [
        "train.py:11:train > linear.py:10:forward",
        "train.py:11:train > adam.py:10:_init_group",
    ]
    assert oom.final  # dumped at the failure
    # the fix already on: no advice, a note instead
    on = inspect_snapshot(cuda_snapshot(expandable=True))
    assert not on.advice and any("expandable_segments is on" in n for n in on.notes)
    # a free block that could hold the request: the OOM is not fragmentation
    roomy = inspect_snapshot(cuda_snapshot(free_segment=GIB))
    assert not roomy.advice and any("is not fragmentation" in n for n in roomy.notes)


def test_cached_empty_segments_are_not_fragmentation():
    """1.5 GiB of whole empty segments (what empty_cache() returns) next to a used segment with a
    small free tail: reported as cache, and fragmentation is the tail only, measured against
    the workload's typical large request."""
    live = {"size": 64 * MIB, "state": "active_allocated", "requested_size": 64 * MIB,
            "frames": FORWARD}  # fmt: skip
    used = {"device": 0, "address": 0, "total_size": 84 * MIB, "stream": 0,
            "segment_type": "large",
            "blocks": [live, {"size": 20 * MIB, "state": "inactive"}]}  # fmt: skip
    empty = [{"device": 0, "address": (i + 1) * GIB, "total_size": 512 * MIB, "stream": 0,
              "segment_type": "large", "blocks": [{"size": 512 * MIB, "state": "inactive"}]}
             for i in range(3)]  # fmt: skip
    trace = [{"action": "alloc", "addr": 0, "size": 64 * MIB, "frames": FORWARD}] + [
        {"action": "alloc", "addr": GIB + i, "size": MIB, "frames": FORWARD} for i in range(8)
    ]
    dev = inspect_snapshot({"segments": [used, *empty], "device_traces": [trace]}).device(0)
    assert dev.empty_segments == 1536 * MIB and dev.inactive == 1556 * MIB
    assert dev.reference_request == 64 * MIB and "typical" in dev.reference_request_how
    assert dev.unusable_free == 20 * MIB  # the 20 MiB tail cannot hold a 64 MiB request
    assert dev.fragmentation == pytest.approx(20 / 1556)
    assert 1 - dev.largest_free_block / dev.inactive > 0.6  # the old measure: 67%
    text = str(inspect_snapshot({"segments": [used, *empty], "device_traces": [trace]}))
    assert "cached in empty segments 1.50 GiB (empty_cache() returns them)" in text
    assert "fragmentation 1%" in text


def test_fragmentation_advice_leaves_out_cached_empty_segments():
    """No trace, 2 GiB of whole empty segments and a used one with a 512 MiB free tail: the
    advice's unusable bytes are the tail (the fragmentation line's), not reserved - allocated,
    and it says the end state is all that is known."""
    live = {"size": GIB, "state": "active_allocated", "requested_size": GIB, "frames": FORWARD}
    used = {"device": 0, "address": 0, "total_size": 1536 * MIB, "stream": 0,
            "segment_type": "large",
            "blocks": [live, {"size": 512 * MIB, "state": "inactive"}]}  # fmt: skip
    empty = [{"device": 0, "address": (i + 2) * 2 * GIB, "total_size": GIB, "stream": 0,
              "segment_type": "large", "blocks": [{"size": GIB, "state": "inactive"}]}
             for i in range(2)]  # fmt: skip
    view = inspect_snapshot({"segments": [used, *empty], "device_traces": [[]]})
    dev = view.device(0)
    assert dev.unusable_free == 512 * MIB and dev.empty_segments == 2 * GIB
    (frag,) = view.advice
    assert frag.saving_bytes == dev.unusable_free  # was reserved - allocated: 2.50 GiB
    assert "512.00 MiB reserved but unusable" in frag.title
    assert "the peak is unknown" in frag.evidence and "most ever" not in frag.evidence
    # without the empty segments' share the free tail is too small a part to advise on
    roomy = {**used, "total_size": 9 * GIB + 512 * MIB,
             "blocks": [{**live, "size": 9 * GIB, "requested_size": 9 * GIB},
                       {"size": 512 * MIB, "state": "inactive"}]}  # fmt: skip
    assert not inspect_snapshot({"segments": [roomy, *empty], "device_traces": [[]]}).advice


def test_gradients_at_the_peak_are_bounded_by_the_parameters():
    """Backward's allocations are gradients only as far as parameters of their size exist:
    a 4 KiB parameter's gradient, not backward's three 64 KiB temporaries."""
    backward = frames(("/env/torch/autograd/graph.py", "_engine_run_backward"),
                      ("/u/train.py", "train"))  # fmt: skip
    build = frames(("/env/torch/nn/modules/module.py", "_apply"), ("/u/train.py", "main"))
    blocks = [("p", 4 * 1024, build), ("g", 4 * 1024, backward)] + [
        (f"t{i}", 64 * 1024, backward) for i in range(3)
    ]
    segment_blocks, trace, address = [], [], 0
    for _, size, stack in blocks:
        segment_blocks.append({"size": size, "state": "active_allocated", "requested_size": size,
                               "frames": stack, "address": address})  # fmt: skip
        trace.append({"action": "alloc", "addr": address, "size": size, "frames": stack})
        address += size
    total = address
    segment_blocks.append({"size": 2 * MIB - total, "state": "inactive", "address": total})
    seg = {"device": 0, "address": 0, "total_size": 2 * MIB, "stream": 0,
           "segment_type": "small", "blocks": segment_blocks}  # fmt: skip
    view = inspect_snapshot({"segments": [seg], "device_traces": [trace]})
    dev = view.device(0)
    for at_peak in (False, True):
        assert dev.category("parameters", at_peak=at_peak) == 4 * 1024
        assert dev.category("gradients", at_peak=at_peak) == 4 * 1024
        assert dev.category("backward temporaries", at_peak=at_peak) == 3 * 64 * 1024
    assert any("categories are guesses" in n for n in view.notes)
    # no parameter recorded: nothing bounds them, and the category says so
    unsorted = inspect_snapshot({"segments": [seg | {"blocks": segment_blocks[1:]}],
                                 "device_traces": [trace[1:]]}).device(0)  # fmt: skip
    assert unsorted.category("gradients") == 0
    assert unsorted.category("backward, unsorted") == 4 * 1024 + 3 * 64 * 1024


def test_at_the_peak_blocks_freed_inside_backward_or_the_step_are_its_temporaries(tmp_path):
    """Sweep BU: with two frozen layers, backward's 4 MiB temporaries (the size of the frozen
    weights) were counted as 12 MiB of gradients where 0 B were alive; Adam's temporaries were
    optimizer state (20.10 MiB where the state is 12.09). How the trace says each block live
    at the peak was freed now tells them apart, checked against the tensors themselves."""
    path = tmp_path / "frozen.pickle"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256))  # fmt: skip
    for layer in (model[2], model[4]):
        layer.requires_grad_(False)
    opt = torch.optim.Adam(p for p in model.parameters() if p.requires_grad)
    with memkit.track(model, opt, device="cpu", budget="64MiB", memory_history=path):
        for _ in range(2):
            model(torch.randn(256, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = sum(t.untyped_storage().nbytes() for t in tensors_of(list(opt.state.values())))
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    dev = inspect_snapshot(path).device(0)
    at_peak = {
        name: dev.category(name, at_peak=True)
        for name in (
            "gradients",
            "optimizer state",
            "optimizer temporaries",
            "backward temporaries",
        )
    }
    # the peak is in step 1's backward, before the one trained layer (the first) has its
    # gradient: the old reading took the frozen layers' 256 x 256 temporaries for gradients
    assert at_peak["gradients"] <= trainable and at_peak["gradients"] != 2 * trainable
    assert at_peak["optimizer state"] == state  # Adam's, whole, and nothing else
    assert at_peak["backward temporaries"] >= 256 * 256 * 4


def test_inspect_html_and_json_agree(tmp_path):
    page = tmp_path / "view.html"
    result = invoke("inspect", str(write_snapshot(cuda_snapshot(), tmp_path / "c.pickle")),
                    "--html", str(page), "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    html = page.read_text()
    assert data["devices"][0]["inactive_split"] == 500 * MIB + 2 * MIB - 512
    assert "<script" not in html and "fragmentation" in html and "linear.py:10:forward" in html
    assert "Largest allocations at the end" in html


def test_categories_from_frames():
    assert categorize([]) == "unknown"
    assert categorize(FORWARD) == "activations" and categorize(ADAM) == "optimizer state"
    backward = frames(("/env/torch/autograd/graph.py", "_engine_run_backward"),
                      ("/env/torch/_tensor.py", "backward"), ("/u/train.py", "train"))  # fmt: skip
    assert categorize(backward) == "gradients"
    moved = frames(("/env/torch/nn/modules/module.py", "convert"),
                   ("/env/torch/nn/modules/module.py", "_apply"), ("/u/t.py", "main"))  # fmt: skip
    assert categorize(moved) == "parameters"
    assert categorize(frames(("/home/u/data.py", "collate"))) == "other"
    # the innermost rule wins: a forward run by the optimizer's closure is an activation
    closure = frames(("/env/torch/nn/modules/linear.py", "forward"),
                     ("/env/torch/optim/lbfgs.py", "step"))  # fmt: skip
    assert categorize(closure) == "activations"


# -- bad input ------------------------------------------------------------------------------------


class Opens:
    """Unpickling this would create a file (it stands for any code a pickle can run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    good = pickle.dumps(cuda_snapshot(), protocol=4)
    odd_event, odd_segment = cuda_snapshot(), cuda_snapshot()
    odd_event["device_traces"][0][0]["addr"] = [1]
    odd_segment["segments"][0]["device"] = -1
    negative, odd_state = cuda_snapshot(), cuda_snapshot()
    negative["segments"][0]["blocks"][0]["size"] = -512
    odd_state["segments"][0]["blocks"][0]["state"] = "weird"
    marker = tmp_path / "code-ran"
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data.pkl", good)
    cases = {
        "text.pickle": (b"not a pickle at all\n", "is not a pickle"),
        "list.pickle": (pickle.dumps([1, 2, 3]), "holds a list of 3 item(s)"),
        "dict.pickle": (pickle.dumps({"a": 1}), "holds a dict with keys ['a']"),
        "code.pickle": (pickle.dumps(Opens(str(marker))), "memkit loads nothing else"),
        "cut.pickle": (good[: len(good) // 2], "truncated"),
        "future.pickle": (b"\x80\x09" + good[2:], "pickle protocol 9"),
        "model.pt": (archive.getvalue(), "zip archive"),
        "empty.pickle": (b"", "is empty"),
        "addr.pickle": (pickle.dumps(odd_event), "'addr' is not a non-negative integer"),
        "device.pickle": (pickle.dumps(odd_segment), "segment 0's 'device' is not"),
        # sweep C: accepted before, and shown as "allocated -512 B" / an unknown state as free
        "negative.pickle": (pickle.dumps(negative), "a block whose 'size' is not a non-negative"),
        "state.pickle": (pickle.dumps(odd_state), "in state 'weird', not one of PyTorch's"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_bytes(content)
        result = invoke("inspect", str(tmp_path / name))
        assert result.exit_code == 2, (name, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("memkit: error: "), (name, lines)
        assert expected in lines[0], (name, lines[0])
    assert not marker.exists()  # the class was refused, never called
    missing = invoke("inspect", str(tmp_path / "nope.pickle"))
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    nowhere = invoke("inspect", str(tmp_path / "c.pickle"), "--html", str(tmp_path / "x" / "v"))
    assert nowhere.exit_code == 2 and "--html" in nowhere.stderr
    # sweep W: `--html -` wrote a file named '-' (memkit run refuses it)
    dash = invoke("inspect", str(tmp_path / "c.pickle"), "--html", "-")
    assert dash.exit_code == 2 and dash.stderr.startswith("memkit: error: --html '-': expected ")


def test_protocol_5_is_read_and_told_apart_without_torch(tmp_path):
    path = tmp_path / "p5.pickle"
    path.write_bytes(pickle.dumps(cuda_snapshot(), protocol=5))
    result = invoke("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert "pickle protocol 5" in result.stdout and "reads protocols 2 to 4" in result.stdout
    code = (
        "import sys; from memkit.cli import main\n"
        "try:\n    main(['inspect', sys.argv[1], '--json'])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("False")  # memkit inspect never imports torch


# -- a browser -----------------------------------------------------------------------------------

# Stands in for MemoryViz.js, which the plot page imports from a CDN (no network here): it
# receives the page's embedded data exactly as MemoryViz.js would, and writes what it decoded.
STUB_VIEWER = """
export function add_local_files(files, view) {
  const bytes = atob(files[0].base64);
  let sum = 0;
  for (let i = 0; i < bytes.length; i++) sum = (sum + bytes.charCodeAt(i)) % 1000000007;
  const out = document.createElement("pre");
  out.id = "decoded";
  out.textContent = JSON.stringify({name: files[0].name, view: view, length: bytes.length,
                                    proto: bytes.charCodeAt(1), sum: sum});
  document.body.appendChild(out);
}
"""


def _chromium(tmp_path: Path, page: Path) -> tuple[str, list[str]]:
    """The DOM after the page's scripts ran, and the console's messages."""
    proc = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--allow-file-access-from-files", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no headless browser: apt-get install -y chromium")
def test_plot_pages_and_inspect_page_render_in_chromium(tmp_path):
    path = tmp_path / "mem.pickle"
    known_events(path)
    data = pickle.loads(path.read_bytes())
    (tmp_path / "viewer.js").write_text(STUB_VIEWER)
    for kind, page_text in (("Active Memory Timeline", viz.trace_plot(data)),
                            ("Allocator State History", viz.segment_plot(data))):  # fmt: skip
        cdn = re.search(r'from "(https://[^"]+MemoryViz\.js)"', page_text)
        assert cdn is not None  # the one thing the page loads
        page = tmp_path / "plot.html"
        page.write_text(page_text.replace(cdn.group(1), "./viewer.js"))
        dom, console = _chromium(tmp_path, page)
        assert console == [], console  # no script error
        found = re.search(r'<pre id="decoded">(.*?)</pre>', dom)
        assert found is not None, dom[-2000:]
        decoded = json.loads(found.group(1).replace("&quot;", '"'))
        raw = embedded_snapshot(page_text)
        assert decoded == {"name": "snapshot.pickle", "view": kind, "length": len(raw),
                           "proto": raw[1], "sum": sum(raw) % 1000000007}  # fmt: skip
        assert raw[1] <= 4 and pickle.loads(raw) == data
    page = tmp_path / "inspect.html"
    inspect_snapshot(path).to_html(page)
    dom, console = _chromium(tmp_path, page)
    assert console == [] and "Largest allocations at the peak" in dom
    assert memkit.format_size(SIZES[2]) in dom
