"""On a real GPU: the user's peak counters inside and after a tracked block, and a budget on
track() (a cap binds new segments only: memkit gives cached free ones back first)."""

import torch
from torch import nn

import memkit

model = nn.Sequential(nn.Linear(4096, 8192), nn.ReLU(), nn.Linear(8192, 4096)).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(2048, 4096, device="cuda")


def step() -> None:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
step()
torch.cuda.synchronize()
witness = torch.cuda.max_memory_allocated()
torch.cuda.reset_peak_memory_stats()
inside = []
with memkit.track(model, opt, device="cuda", module_every=1) as t:
    for _ in range(3):
        step()
        inside.append(torch.cuda.max_memory_allocated())
after = torch.cuda.max_memory_allocated()
ok = all(v >= witness for v in inside) and after >= witness
print(f"PEAKS witness {witness} inside {inside} after {after} ok={ok}")
print("report peak", t.report().devices[0].peak_allocated)
try:
    with memkit.track(model, opt, device="cuda", budget="1GiB", postmortem=None):
        step()
    print("BUDGET not capped (no OOM under 1GiB)")
except torch.OutOfMemoryError as e:
    print("BUDGET capped: OOM under 1GiB:", str(e).splitlines()[0][:120])
