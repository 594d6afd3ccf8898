"""A plain training loop around ``model = torch.compile(model)``.

Imitates: the PyTorch 2.x "torch.compile" tutorial and the many scripts that add
``model = torch.compile(model)`` right after building the model, then train as before.

memkit pitfalls it exercises:

* the compiled model is an ``OptimizedModule`` wrapping the original (``_orig_mod``): module
  names gain a prefix, and with the inductor backend the submodules' forwards are traced away
  (their hooks do not fire per call, or force graph breaks if a hook is installed after
  compilation); forward hooks registered on the wrapper still fire;
* the first step compiles (slow, with its own temporary allocations), later steps do not;
* inductor runs generated C++ kernels on CPU (``gcc`` needed); ``--backend aot_eager`` runs the
  traced graph without code generation, ``--backend eager`` only traces with dynamo.

Run: ``python compiled_model.py`` (a few seconds: compilation dominates), or
``memkit run --device cpu --budget 128MiB compiled_model.py --backend aot_eager``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.act(self.fc1(x)))
        x = x + self.act(self.fc2(x))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--backend", default="inductor", help="inductor, aot_eager or eager")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP(64, args.hidden, 10)
    model = torch.compile(model, backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    w = torch.randn(64, 10)

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(args.batch_size, 64)
        y = (x @ w).argmax(1)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        dt = time.perf_counter() - t0
        if step == 1 or step % args.log_every == 0:
            print(f"step {step}: loss {loss.item():.4f} ({dt * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
