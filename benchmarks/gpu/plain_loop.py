"""A plain loop of probe_nanogpt.py's step (no memkit) under the same cap, in this fresh process:
does batch SIZE fit STEPS steps? Prints `PLAIN size N: fits|OOM at step K` with the peaks, the
independent check of a probe's answer (run it for the answer and the answer + 1).

`--before B`: first 2 steps at batch B, then `empty_cache()`, as a probe's earlier trial leaves
the process (the model file keeps the last logits, as train.py keeps `logits`).

`--part-hooks`: the same loop with the probe's own part hooks installed (memkit's `PartPeaks`:
a counter read and peak reset at every outer module's forward start and end, at each module
output's gradient and around the optimizer step), to test whether they are what makes a probe
trial run out a sample or two before a fresh process does (issue 24: 116 against 118)."""

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf

parser = argparse.ArgumentParser()
parser.add_argument("size", type=int)
parser.add_argument("steps", type=int, nargs="?", default=30)
parser.add_argument("--cap-gib", type=float, default=3.0)
parser.add_argument("--before", type=int, default=None)
parser.add_argument("--part-hooks", action="store_true")
args = parser.parse_args()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
model = mf.build_model().cuda()
opt = mf.build_optimizer(model.parameters())


def train(size, steps):
    for step in range(steps):
        x, y = mf.make_batch(size)
        try:
            mf.train_step(model, (x.cuda(), y.cuda()), opt)
        except torch.OutOfMemoryError as exc:
            return f"OOM at step {step}: {str(exc).splitlines()[0][:160]}"
    torch.cuda.synchronize()
    return "fits"


label = ""
if args.before is not None:
    train(args.before, 2)
    opt.state.clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    label = f" after 2 steps at {args.before}"
split = None
if args.part_hooks:
    from memkit.devices import counter_reader, get_backend
    from memkit.probing.trials import PartPeaks

    split = PartPeaks(counter_reader(get_backend("cuda")), model, opt)
    label += " with the probe's part hooks"
result = train(args.size, args.steps)
peak_reserved, peak_allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
if split is not None:  # the hooks reset the peaks at every cut: theirs is the whole run's
    peak_reserved, peak_allocated, _ = split.finish()
    split.close()
mib = 2**20
print(
    f"PLAIN size {args.size}{label}: {result}; peak allocated {peak_allocated / mib:.1f} MiB, "
    f"reserved {peak_reserved / mib:.1f} MiB"
)
