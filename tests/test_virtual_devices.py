"""Virtual devices (memkit.simulate(devices=N)) and the DataParallel stand-in on them.

Placement errors carry PyTorch's wording; DataParallel's per-device peaks are checked against
arithmetic written from torch.nn.DataParallel's algorithm (scatter, replicate through one flat
bucket, gather, reduce-add onto device_ids[0]).
"""

from __future__ import annotations

import pytest
import torch

import memkit
from memkit.advice import check_data_parallel
from memkit.simulated.parallel import DataParallel, bucket_sizes, ddp_replicas
from memkit.simulated.virtual_devices import HOST, to_virtual

F = 4  # bytes per float32


def test_ops_follow_their_inputs_and_mixing_devices_fails_like_cuda() -> None:
    before = torch.randn(100)  # made before the block: a host tensor
    with memkit.simulate(None, devices=2) as vd:
        a = torch.randn(1000)  # no tensor input: the current device, cuda:0
        b = to_virtual(a, 1)
        assert (vd.where(a), vd.where(b), vd.where(a * 2), vd.where(b * 2)) == (0, 1, 0, 1)
        assert vd.peaks == [2 * 1000 * F, 2 * 1000 * F]
        with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, "
                           r"but found at least two devices, cuda:0 and cuda:1!"):  # fmt: skip
            a + b
        with pytest.raises(RuntimeError, match="found at least two devices, cpu and cuda:0!"):
            before + torch.randn(100)
        assert vd.where(a * torch.tensor(2.0)) == 0  # a 0-d cpu tensor may join, as on CUDA
        # transformers' cache starts from torch.tensor([], device=key.device): the host here,
        # the gpu on a gpu; empty, it holds nothing to place (examples/gpt2.py --strategies)
        empty = before[:0]
        assert vd.where(torch.cat([empty, a])) == 0
        assert vd.where(before * 2) == HOST and vd.current_of(0) == 1000 * F  # a alone
        with vd.on(1):
            assert vd.where(torch.zeros(3)) == 1


def test_a_model_split_over_two_devices_trains_both_halves() -> None:
    """Sweep FF: the tutorial's model parallel (net1 on cuda:0, net2 on cuda:1, the
    activation moved between them) got no gradient for net1: `acct.to` copied the activation
    detached, where `.to("cuda:1")` keeps the graph and copies the gradient back."""
    with memkit.simulate(None, devices=2) as vd:
        net1 = to_virtual(torch.nn.Linear(100, 200), 0)
        net2 = to_virtual(torch.nn.Linear(200, 5), 1)
        x = to_virtual(torch.randn(8, 100), 0)
        h = torch.relu(net1(x))
        moved = to_virtual(h, 1)
        assert vd.where(moved) == 1 and moved.grad_fn is not None
        net2(moved).sum().backward()
        assert net1.weight.grad is not None and vd.where(net1.weight.grad) == 0
        assert moved.grad is None  # not a leaf: no gradient of its own kept on cuda:1
        # cuda:0: net1 and its gradients, x, h (saved by relu's backward) and the gradient
        # copied back to it; cuda:1 holds net2's, the moved copy and what backward made there
        assert vd.peak_of(0) >= 2 * (200 * 100 + 200) * F + 8 * 100 * F + 2 * 8 * 200 * F
        # a gradient penalty differentiates the gradient through the copy again (review)
        xg = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad(to_virtual(xg, 1).pow(2).sum(), xg, create_graph=True)
        assert vd.where(grad) == 0 and grad.requires_grad
        (again,) = torch.autograd.grad(grad.sum(), xg)
        assert torch.equal(again, torch.full_like(xg, 2.0))


def test_each_device_has_its_own_budget() -> None:
    with memkit.simulate(["1MiB", "64KiB"]) as vd:
        torch.empty(200_000, dtype=torch.uint8)  # fits on cuda:0
        with vd.on(1), pytest.raises(torch.OutOfMemoryError, match="cuda:1"):
            torch.empty(100_000, dtype=torch.uint8)
    assert vd.budgets == [1024**2, 64 * 1024]


def _mlp(d: int = 256, h: int = 512, c: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(d, h, bias=False), torch.nn.ReLU(), torch.nn.Linear(h, c, bias=False)
    )


def test_model_not_on_device_ids_0_fails_with_pytorchs_message() -> None:
    model = _mlp()
    with memkit.simulate(None, devices=2) as vd:
        vd.to(model, 1)
        with pytest.raises(RuntimeError, match=r"module must have its parameters and buffers on "
                           r"device cuda:0 \(device_ids\[0\]\) but found one of them on device: "
                           r"cuda:1"):  # fmt: skip
            DataParallel(model)(torch.randn(4, 256))
        vd.to(model, HOST)
        dp = DataParallel(model)
        with pytest.raises(RuntimeError, match="found one of them on device: cpu"):
            dp(torch.randn(4, 256))
        assert [a.code for a in check_data_parallel(dp)] == ["dp-device-mismatch"]
        vd.to(model, 0)
        assert check_data_parallel(dp) == []


def test_labels_not_on_output_device_fail_like_cuda() -> None:
    model = _mlp()
    with memkit.simulate(None, devices=2) as vd:
        vd.to(model, 0)
        dp = DataParallel(model, device_ids=[0, 1], output_device=1)
        out = dp(torch.randn(8, 256))
        assert vd.where(out) == 1
        labels = torch.randint(0, 64, (8,))  # on cuda:0 (the current device)
        with pytest.raises(RuntimeError, match="found at least two devices, cuda:1 and cuda:0!"):
            torch.nn.functional.cross_entropy(out, labels)
        torch.nn.functional.cross_entropy(out, vd.to(labels, 1)).backward()


def test_a_batch_smaller_than_the_devices_leaves_some_idle() -> None:
    model = _mlp()
    with memkit.simulate(None, devices=4) as vd:
        vd.to(model, 0)
        dp = DataParallel(model)
        dp(torch.randn(2, 256)).sum().backward()  # chunk(4) of 2 rows: 2 chunks, 2 replicas
        assert vd.peak_of(1) > 0 and vd.peaks[2:] == [0, 0]
        assert [a.code for a in check_data_parallel(dp, batch_size=2)] == ["dp-batch-too-small"]
        bn = torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.BatchNorm1d(8))
        vd.to(bn, 0)
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            DataParallel(bn)(torch.randn(3, 256))  # chunks 1, 1, 1: batch norm refuses


def test_gradients_equal_a_single_device_step() -> None:
    model, x = _mlp(), torch.randn(10, 256)  # chunks of 3, 3, 3, 1
    with memkit.simulate(None, devices=4) as vd:
        vd.to(model, 0)
        DataParallel(model)(x).sum().backward()
        assert all(vd.where(p.grad) == 0 for p in model.parameters())
    dp_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, p in zip(dp_grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-5)


def _dp_step(model: torch.nn.Module, n: int, x: torch.Tensor) -> tuple[list[int], list[int]]:
    with memkit.simulate(None, devices=n) as vd:
        vd.to(model, 0)
        x = vd.to(x, 0)  # the script's x.cuda(): the full batch on cuda:0
        vd.reset_peak()
        out = DataParallel(model)(x)
        forward = vd.peaks
        out.sum().backward()
        return forward, vd.peaks


@pytest.mark.parametrize("n", [2, 4])
def test_dp_peaks_per_device_match_dataparallels_algorithm(n: int) -> None:
    d, h, c, b = 256, 512, 64, 32
    forward, peaks = _dp_step(_mlp(d, h, c), n, torch.randn(n * b, d))
    w1, w2 = d * h * F, h * c * F
    p = w1 + w2  # the weights; replicas get them as one flat bucket (< 10 MiB)
    x, hid, o = b * d * F, b * h * F, b * c * F  # per chunk: input, hidden, output
    # forward, cuda:j (j > 0): its weights, its input chunk, linear and relu outputs together
    fwd_j = p + x + 2 * hid
    # cuda:0: the full input; replicate flattens the weights there (one transient copy); its
    # replica runs on the originals; gather allocates the full output while out_0 is alive
    fwd_0 = max(2 * p + n * x, p + n * x + 2 * hid, p + n * x + hid + o + n * o)
    assert forward == [fwd_0] + [fwd_j] * (n - 1)
    # backward, cuda:j: the output-gradient chunk, grad of relu's output and of W2 while the
    # flat weights live (W2 is saved); at the reduce-add, its gradients and their flat copy
    bwd_j = max(fwd_j, p + x + hid + o + hid + w2, p + x + 3 * hid + w2 - o, 2 * p)
    # cuda:0 at the reduce-add: the weights, the full input, the gathered output, the loss and
    # its gradient (two scalars), replica 0's gradients, their flat copy and the result buffer
    bwd_0 = 4 * p + n * x + n * o + 2 * F
    assert peaks == [bwd_0] + [bwd_j] * (n - 1)
    # device 0's excess: 2 weights' worth of gradient buffers, plus the full input and output
    assert peaks[0] - peaks[1] == 2 * p + n * (x + o) + 2 * F


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip


def _single_device(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """A replica's own work on one plain simulated device: (forward peak, step peak)."""
    with memkit.simulate(None, track=model) as acct:
        out = model(x)
        forward = acct.peak
        out.sum().backward()
        return forward, acct.peak


def test_dp_cnn_replicas_peak_like_the_module_alone_and_cuda0_adds_dps_share() -> None:
    n, b = 4, 8
    x = torch.randn(n * b, 3, 16, 16)
    forward, peaks = _dp_step(_cnn(), n, x)
    alone_fwd, alone_step = _single_device(_cnn(), x[:b].clone())
    params = sum(p.numel() * F for p in _cnn().parameters())
    buffers = sum(t.numel() * t.element_size() for t in _cnn().buffers())
    # cuda:j runs the module on its chunk with a copy of the weights and buffers: the module
    # alone, exactly, in forward; in backward, less the replica's buffers (dropped after
    # forward) and within 0.1% (when the flat weight copy dies depends on the saved tensors)
    assert forward[1:] == [alone_fwd] * (n - 1)
    assert all(abs(v - (alone_step - buffers)) <= 1e-3 * v for v in peaks[1:])
    # cuda:0 at its forward peak also holds the other chunks of the full input
    chunk = b * 3 * 16 * 16 * F
    assert forward[0] >= alone_fwd + (n - 1) * chunk
    # cuda:0 in backward: replica 0's own step (the module alone on chunk 0) plus the other
    # chunks of the full input and of the gathered output; or, at the reduce-add: weights,
    # full input, gathered output, two scalars, replica 0's gradients, their flat copy, the
    # result buffer and its buffers (the originals), whichever is larger
    o = b * 10 * F
    in_backward = alone_step + (n - 1) * (chunk + o)
    at_reduce = 4 * params + n * chunk + n * o + 2 * F + buffers
    assert peaks[0] == max(in_backward, at_reduce)


def test_dp_device0_excess_grows_with_the_number_of_devices() -> None:
    b = 32
    excess = {}
    for n in (2, 3, 4):
        _, peaks = _dp_step(_mlp(), n, torch.randn(n * b, 256))
        excess[n] = peaks[0] - max(peaks[1:])
    per_device = b * (256 + 64) * F  # one more chunk of input and of gathered output
    assert excess[3] - excess[2] == per_device and excess[4] - excess[3] == per_device


def test_ddp_replicas_hold_a_model_optimizer_and_buckets_each() -> None:
    model = _mlp()
    p = sum(t.numel() * F for t in model.parameters())
    with memkit.simulate(None, devices=3) as vd:
        reps = ddp_replicas(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        assert [r.device for r in reps] == [0, 1, 2]
        # the replica, one bucket copy of its gradients, an int32 used flag per parameter
        n = len(list(model.parameters()))
        assert vd.peaks == [2 * p + 4 * n] * 3
        assert sum(bucket_sizes(list(model.parameters()))) * F == p
        # gradient_as_bucket_view: the buckets are there too (the gradients become views)
        views = ddp_replicas(model, None, [0], gradient_as_bucket_view=True)
        assert views[0].bucket_bytes == p
