"""A plain loop of probe_nanogpt.py's step (no memkit) under the same cap, in this fresh process:
does batch SIZE fit STEPS steps? Prints `PLAIN size N: fits|OOM at step K` with the peaks, the
independent check of a probe's answer (run it for the answer and the answer + 1)."""
import sys

import torch

sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf

size, steps = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 30
cap = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
model = mf.build_model().cuda()
opt = mf.build_optimizer(model.parameters())
try:
    for step in range(steps):  # noqa: B007 (reported below)
        x, y = mf.make_batch(size)
        mf.train_step(model, (x.cuda(), y.cuda()), opt)
    torch.cuda.synchronize()
    result = "fits"
except torch.OutOfMemoryError as exc:
    result = f"OOM at step {step}: {str(exc).splitlines()[0][:160]}"
mib = 2**20
print(f"PLAIN size {size}: {result}; peak allocated {torch.cuda.max_memory_allocated() / mib:.1f}"
      f" MiB, reserved {torch.cuda.max_memory_reserved() / mib:.1f} MiB")
