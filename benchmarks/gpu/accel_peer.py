"""Accelerate's find_executable_batch_size on the same step and cap as memkit probe."""

import sys
import time

import torch
from accelerate.utils import find_executable_batch_size

sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf

total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(3 * 2**30 / total)
model = mf.build_model().cuda()
trials = []
t0 = time.perf_counter()


@find_executable_batch_size(starting_batch_size=1024)
def run(batch_size):
    trials.append(batch_size)
    opt = mf.build_optimizer(model.parameters())
    for _ in range(2):
        x, y = mf.make_batch(batch_size)
        mf.train_step(model, (x.cuda(), y.cuda()), opt)
    torch.cuda.synchronize()
    return batch_size


ans = run()
print(f"PEER accelerate wall {time.perf_counter() - t0:.2f}s answer {ans} trials {len(trials)}")
