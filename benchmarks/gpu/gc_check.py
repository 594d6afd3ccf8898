import gc, sys, time
def t(label, fn):
    s = time.perf_counter(); r = fn(); print(f"GC {label}: {1000*(time.perf_counter()-s):.2f} ms -> {r}", flush=True)
print(sys.version, "callbacks", gc.callbacks, "threshold", gc.get_threshold())
import torch
t("after import torch", gc.collect)
sys.path.insert(0, "benchmarks/gpu")
import probe_nanogpt as mf
import memkit
t("after import memkit", gc.collect)
m = mf.build_model().cuda()
t("after model on cuda", gc.collect)
print("objects", len(gc.get_objects()), "callbacks", gc.callbacks)
gc.freeze()
t("frozen", gc.collect)
t("frozen gen1", lambda: gc.collect(1))
opt = mf.build_optimizer(m.parameters())
for i in range(2):
    mf.train_step(m, tuple(x.cuda() for x in mf.make_batch(8)), opt)
torch.cuda.synchronize()
t("frozen after steps", gc.collect)
gc.set_debug(gc.DEBUG_STATS)
mf.train_step(m, tuple(x.cuda() for x in mf.make_batch(8)), opt); torch.cuda.synchronize()
t("frozen after a step, stats", gc.collect)
gc.set_debug(0)
gc.unfreeze()
t("unfrozen", gc.collect)
print("callbacks at end", gc.callbacks)
