"""Is the heap frozen while a probe cleans up between trials (gc.get_freeze_count), and what
does each of its collections cost? One-size probes of probe_nanogpt.py's model."""

import gc
import sys
import time

print("FREEZE at start", gc.get_freeze_count())

print("FREEZE after torch", gc.get_freeze_count())
sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf  # noqa: E402

import memkit.probing.trials as trials  # noqa: E402
from memkit.probing.runner import probe  # noqa: E402

print("FREEZE after memkit", gc.get_freeze_count())
real_collect = gc.collect


def collect(*args):
    started = time.perf_counter()
    found = real_collect(*args)
    print(
        f"COLLECT frozen={gc.get_freeze_count()} {1000 * (time.perf_counter() - started):.1f} ms"
        f" found {found}",
        flush=True,
    )
    return found


trials.gc.collect = collect
model = mf.build_model().cuda()
opt = mf.build_optimizer(model.parameters())
for _ in range(3):
    r = probe(
        model,
        mf.make_batch,
        optimizer=opt,
        train_step=mf.train_step,
        device="cuda",
        budget="3GiB",
        min_batch=32,
        max_batch=32,
    )
    print("TRIAL s", round(r.trials[0].seconds, 3), "freeze now", gc.get_freeze_count(), flush=True)
