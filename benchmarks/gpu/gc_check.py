"""On a GPU machine: what one gc.collect() costs before and after CUDA steps, frozen or not
(the probe freezes the heap; the first CUDA step of nanoGPT's model creates objects lazily)."""

import gc
import sys
import time

import torch

sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf


def timed(label, fn):
    started = time.perf_counter()
    found = fn()
    print(f"GC {label}: {1000 * (time.perf_counter() - started):.2f} ms -> {found}", flush=True)


def step(model, opt):
    mf.train_step(model, tuple(x.cuda() for x in mf.make_batch(8)), opt)
    torch.cuda.synchronize()


print(sys.version, "callbacks", gc.callbacks, "threshold", gc.get_threshold())
timed("after imports", gc.collect)
model = mf.build_model().cuda()
timed("after the model moved to cuda", gc.collect)
gc.freeze()
timed("frozen", gc.collect)
opt = mf.build_optimizer(model.parameters())
step(model, opt)
step(model, opt)
timed("frozen, after two steps", gc.collect)
gc.set_debug(gc.DEBUG_STATS)
step(model, opt)
timed("frozen, after a third step (stats)", gc.collect)
gc.set_debug(0)
gc.freeze()
step(model, opt)
timed("refrozen, after a fourth step", gc.collect)
gc.unfreeze()
timed("unfrozen", gc.collect)
