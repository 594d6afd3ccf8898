"""cProfile of probe trials on a warm GPU: where the time inside a trial goes (one-size probes of
probe_nanogpt.py's model at batch 32 under a 3 GiB cap, after one warm-up probe)."""

import cProfile
import pstats
import sys

sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf

from memkit.probing.runner import probe

model = mf.build_model().cuda()
opt = mf.build_optimizer(model.parameters())


def once():
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
    return r.trials[0].seconds


print("warm-up trial s", round(once(), 3))
prof = cProfile.Profile()
prof.enable()
secs = [once() for _ in range(3)]
prof.disable()
print("profiled trial s", [round(s, 3) for s in secs])
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(45)
