"""GPU 0's DataParallel imbalance for a small CNN on 4 virtual GPUs, and DDP beside it.

    python examples/dp_vs_ddp.py

No GPU needed: memkit.simulate(devices=4) stands for four 64 MiB GPUs; memkit.simulated.parallel's
DataParallel runs torch.nn.DataParallel's scatter / replicate / gather / reduce-add on them,
and ddp_replicas puts a full replica, its gradient buckets and its optimizer on each.
The same comparison from the command line:

    memkit probe examples/cnn.py --device cpu --gpus 4 --budget 64MiB --strategies dp,ddp
"""

import torch
from cnn import SmallCNN, train_step

import memkit
from memkit.simulated.parallel import DataParallel, ddp_replicas

GPUS, BATCH = 4, 64  # global batch: 16 per GPU


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))


torch.manual_seed(0)
model = SmallCNN()
with memkit.simulate("64MiB", devices=GPUS) as dp_devices:
    dp_devices.to(model, 0)  # model.to("cuda:0")
    opt = sgd(model)
    for _ in range(2):  # the second step has the momentum buffers
        train_step(DataParallel(model), batch(BATCH), opt)  # the batch is made on cuda:0

with memkit.simulate("64MiB", devices=GPUS) as ddp_devices:
    for rank in ddp_replicas(SmallCNN(), sgd):
        with ddp_devices.on(rank.device):
            for _ in range(2):
                train_step(rank.model, batch(BATCH // GPUS), rank.optimizer)

print(f"small CNN, global batch {BATCH} on {GPUS} virtual GPUs: peak per GPU (MiB)")
print("strategy " + "".join(f"  cuda:{i}" for i in range(GPUS)))
for name, vd in (("dp", dp_devices), ("ddp", ddp_devices)):
    print(f"{name:<8} " + "".join(f"{p / 2**20:8.2f}" for p in vd.peaks))
dp_peaks = dp_devices.peaks
excess = dp_peaks[0] - sum(dp_peaks[1:]) / (GPUS - 1)
print(f"DataParallel: cuda:0 holds {excess / 2**20:.2f} MiB more than the mean of the others")
