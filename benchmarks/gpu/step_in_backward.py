"""PyTorch's "optimizer step in backward" recipe on a real GPU, under ``memkit run``: one Adam
per parameter, stepped by a post-accumulate-grad hook, so no gradient outlives its own step.

    python -m memkit run --device cuda --json $OUT/sib.json benchmarks/gpu/step_in_backward.py

``SIB`` lines are the independent count: the steps taken and ``max_memory_allocated()`` after
them, to set beside the report's steps, phases and peak.
"""

import torch
from torch import nn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048))
                        for _ in range(4)]).to(DEV)  # fmt: skip
optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}


def step_hook(param: torch.Tensor) -> None:
    optimizers[param].step()
    optimizers[param].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(step_hook)

steps = 0
for _ in range(8):
    x = torch.randn(512, 2048, device=DEV)
    loss = model(x).square().mean()
    loss.backward()
    steps += 1
if DEV == "cuda":
    torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"SIB steps {steps} parameters {params} max_memory_allocated "
          f"{torch.cuda.max_memory_allocated()}")  # fmt: skip
