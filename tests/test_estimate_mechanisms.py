"""The GPU mechanisms issue #26 added to the estimate, each on a tiny meta step: cuBLAS and
cuBLASLt workspaces per thread, cross_entropy under autocast, composite ops' temporaries in
inference, CUDA's fused dropout."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memkit.estimation import estimate
from memkit.estimation.autocast import AutocastPolicy
from memkit.estimation.meta_step import TargetMode
from memkit.estimation.workspaces import CUBLASLT_WORKSPACE_BYTES, KernelWorkspaces, uses_cublaslt

MIB = 1 << 20
META = torch.device("meta")


def test_workspaces_are_per_thread_and_cublaslt_only_for_a_bias():
    made: dict[object, int] = {}
    linear = torch.nn.Linear(64, 32, device=META)
    plain = torch.nn.Linear(32, 16, bias=False, device=META)
    x = torch.randn(8, 64, device=META)
    with KernelWorkspaces(made.__setitem__, 32 * MIB) as ws:
        plain(linear(x)).sum().backward()
    # forward: addmm with a bias (cuBLASLt) and mm; backward: mm on autograd's thread only
    assert sorted(made) == [
        ("workspace", "cublas", "backward"),
        ("workspace", "cublas", "forward"),
        ("workspace", "cublaslt", "forward"),
    ]
    assert made[("workspace", "cublaslt", "forward")] == CUBLASLT_WORKSPACE_BYTES
    assert ws.allocated == 2 * 32 * MIB + MIB
    bias, mat1, mat2 = torch.randn(4), torch.randn(2, 3), torch.randn(3, 4)
    assert uses_cublaslt("addmm", (bias, mat1, mat2), {})
    assert not uses_cublaslt("addmm", (bias, mat1, mat2), {"beta": 0.5})
    assert not uses_cublaslt("addmm", (torch.randn(2, 4), mat1, mat2), {})  # a 2-D "bias"
    assert not uses_cublaslt("mm", (mat1, mat2), {})


def test_no_workspace_when_the_size_is_zero():
    made: dict[object, int] = {}
    with KernelWorkspaces(made.__setitem__, 0):
        torch.nn.Linear(4, 4, device=META)(torch.randn(2, 4, device=META))
    assert made == {}


def test_cross_entropy_under_autocast_keeps_bf16_log_probabilities():
    """PyTorch's cross_entropy_loss passes the input's dtype to log_softmax, which autocast
    then leaves alone; nll_loss casts to fp32. Backward saves both."""
    logits = torch.randn(16, 100, device=META, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 100, (16,), device=META)
    with TargetMode(AutocastPolicy(torch.bfloat16), "auto", 90):
        loss = F.cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    nll = loss.grad_fn
    assert type(nll).__name__.startswith("NllLoss")
    to_fp32 = nll.next_functions[0][0]
    log_softmax = to_fp32.next_functions[0][0]
    assert type(to_fp32).__name__ == "ToCopyBackward0"
    assert type(log_softmax).__name__ == "LogSoftmaxBackward0"
    assert log_softmax._saved_result.dtype == torch.bfloat16
    # label smoothing and soft targets run as one fp32 op, as before
    with TargetMode(AutocastPolicy(torch.bfloat16), "auto", 90):
        smooth = F.cross_entropy(logits, target, label_smoothing=0.1)
    assert smooth.dtype == torch.float32


def test_dropout_in_training_saves_a_bool_mask_as_on_cuda():
    x = torch.randn(8, 64, device=META, requires_grad=True)
    with TargetMode(None, "auto", 90):
        y = F.dropout(x, 0.1, training=True)
    assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
    with TargetMode(None, "cpu-flash", 90):  # the CPU target: the noise tensor, as on CPU
        z = F.dropout(x, 0.1, training=True)
    assert type(z.grad_fn).__name__ != "NativeDropoutBackward0"


LOSS_IN_FORWARD = """
    import torch
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(64, 4096, bias=False)
        def forward(self, x, labels):
            logits = self.head(x)
            return {"logits": logits,
                    "loss": torch.nn.functional.cross_entropy(logits, labels)}
    def build_model():
        return Net()
    def make_batch(batch_size):
        return {"x": torch.randn(batch_size, 64),
                "labels": torch.randint(0, 4096, (batch_size,))}
"""


@pytest.fixture
def loss_model(tmp_path: Path) -> str:
    path = tmp_path / "loss_model.py"
    path.write_text(textwrap.dedent(LOSS_IN_FORWARD))
    return str(path)


def test_inference_counts_the_temporaries_inside_composite_ops(loss_model: str):
    """cross_entropy's log-probabilities (as large as the logits) exist on a GPU under
    inference_mode; the estimate counts them (it used to miss them)."""
    batch = 256
    logits = batch * 4096 * 4  # 4 MiB
    est = estimate(loss_model, device_memory="80GiB", mode="infer", min_batch=batch,
                   max_batch=batch, workspace=0)  # fmt: skip
    trial = est.trial(batch)
    assert trial is not None
    params = 64 * 4096 * 4
    # the previous output's logits, the new logits and the log-probabilities at once
    assert trial.counted_peak >= params + 3 * logits
    dropped = estimate(loss_model, device_memory="80GiB", mode="infer", min_batch=batch,
                       max_batch=batch, workspace=0, keep_output=False)  # fmt: skip
    trial2 = dropped.trial(batch)
    assert trial2 is not None
    assert trial.counted_peak - trial2.counted_peak >= logits  # no previous output held


class _Block(torch.nn.Module):
    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32, device=device)
        self.fc2 = torch.nn.Linear(32, 16, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc2(F.gelu(self.fc1(x))), 0.1, self.training)


class _RecomputeLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The forward ops (linear's addmm, gelu, dropout) that run inside backward: a checkpoint's
    recompute, as (op, dtype, shape) of their first output."""

    FORWARD_OPS = ("addmm", "gelu", "native_dropout", "bernoulli")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if torch._C._current_autograd_node() is not None and name in self.FORWARD_OPS:
            first = out[0] if isinstance(out, tuple) else out
            self.seen.append((name, first.dtype, tuple(first.shape)))
        return out


def _checkpointed_step(block: _Block, device: str, reentrant: bool) -> _RecomputeLog:
    x = torch.randn(8, 16, device=device, requires_grad=True)
    with _RecomputeLog() as log:
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        out.float().sum().backward()
    return log


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_recompute_runs_dropout_as_the_forward_did(reentrant: bool):
    """Non-reentrant checkpointing compares what the recompute saves with what the forward
    saved: the fused dropout's bool mask must be made again (it crashed with CheckpointError
    when the recompute ran without the mode and took the noise-tensor path)."""
    block = _Block(META)
    with TargetMode(None, "auto", 90):
        log = _checkpointed_step(block, "meta", reentrant)
    assert ("native_dropout", torch.float32, (8, 16)) in log.seen
    assert not any(op == "bernoulli" for op, _, _ in log.seen)
    assert block.fc1.weight.grad is not None and block.fc1.weight.grad.shape == (32, 16)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_recompute_runs_under_the_autocast_policy(reentrant: bool):
    """torch.utils.checkpoint restores the forward's autocast state for the recompute, so its
    activations are low precision. Counted by hand for this block: fc1's output bf16 [8, 32]
    (512 B), gelu's bf16 [8, 32] (512 B), fc2's bf16 [8, 16] (256 B); and checked against real
    autocast on CPU, whose recompute torch runs under the same restored state. Non-reentrant
    checkpointing stops recomputing once every saved tensor is back (fc2's output is not)."""
    block = _Block(META).eval()  # no dropout: the op list is the same on CPU
    with TargetMode(AutocastPolicy(torch.bfloat16), "auto", 90):
        log = _checkpointed_step(block, "meta", reentrant)
    expected = [
        ("addmm", torch.bfloat16, (8, 32)),
        ("gelu", torch.bfloat16, (8, 32)),
        ("addmm", torch.bfloat16, (8, 16)),
    ][: 3 if reentrant else 2]
    assert log.seen == expected
    nbytes = sum(torch.finfo(dtype).bits // 8 * 8 * shape[1] for _, dtype, shape in log.seen)
    assert nbytes == (1280 if reentrant else 1024)
    cpu_block = _Block("cpu").eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = _checkpointed_step(cpu_block, "cpu", reentrant)
    assert real.seen == expected
    # outside a recompute, backward stays out of the autocast region
    x = torch.randn(8, 16, device=META, requires_grad=True)
    with TargetMode(AutocastPolicy(torch.bfloat16), "auto", 90) as mode:
        block(x).float().sum().backward()
        assert mode.policy is not None and not mode.policy.enabled
        assert block(x).dtype == torch.float32  # after backward: no policy (as before)


def test_backward_keeps_pytorchs_own_errors_and_arguments():
    x = torch.randn(4, 3, device=META, requires_grad=True)
    with TargetMode(None, "auto", 90):
        with pytest.raises(RuntimeError, match="only for scalar outputs"):
            (x * 2).backward()
        (x * 2).sum().backward(inputs=[x])  # left as PyTorch runs it
        torch.autograd.backward([(x * 3).sum()], retain_graph=False)
    assert x.grad is not None


def test_a_recompute_keeps_no_weight_cast_after_its_backward():
    """A recompute's bf16 weight casts live while autograd holds them (on a GPU the
    recompute's own autocast region drops its cache when it ends): after backward only the
    parameters, their gradients and the input's gradient are left."""
    from memkit.simulated.accountant import MemoryAccountant

    blocks = torch.nn.Sequential(_Block(META), _Block(META)).eval()
    x = torch.randn(8, 16, device=META, requires_grad=True)
    params = sum(p.numel() * 4 for p in blocks.parameters())
    with MemoryAccountant(META) as accountant:
        accountant.track(blocks, x)
        with TargetMode(AutocastPolicy(torch.bfloat16), "auto", 90):
            h = x
            for block in blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            h.float().sum().backward()
            del h
            left = accountant.current
    assert left == 2 * params + 2 * x.numel() * 4


@pytest.mark.parametrize(
    ("call", "low"),
    [
        (lambda x, w: F.linear(x, w), torch.float64),
        (lambda x, w: torch.mm(x, w.t()), torch.float64),
        (lambda x, w: x @ w.t(), torch.bfloat16),
        (
            lambda x, w: torch.addmm(torch.zeros(4, device=x.device), x.to(w.dtype), w.t()),
            torch.bfloat16,
        ),
        (lambda x, w: torch.bmm(x[None], w.t()[None]), torch.float16),
        (lambda x, w: F.conv1d(x[None], w[:, :, None]), torch.float64),
    ],
)
def test_mixed_floating_dtypes_are_refused_as_cuda_kernels_refuse_them(call, low):  # type: ignore[no-untyped-def]
    """Meta kernels accept a float32 input with a float64 (or bf16) weight; CUDA's refuse it
    (as CPU's do: checked below), so the estimate must not report a peak for such a step."""
    x = torch.randn(8, 3)
    w = torch.randn(4, 3, dtype=low)
    with pytest.raises(RuntimeError):
        call(x, w)  # the real kernels on CPU
    with TargetMode(None, "auto", 90), pytest.raises(RuntimeError, match=str(low)):
        call(x.to(META), w.to(META))


def test_autocast_casts_before_the_dtype_check_but_not_float64():
    x = torch.randn(8, 3, device=META)
    with TargetMode(AutocastPolicy(torch.bfloat16), "auto", 90):
        assert (
            F.linear(x, torch.randn(4, 3, device=META, dtype=torch.float16)).dtype == torch.bfloat16
        )
        with pytest.raises(RuntimeError, match="autocast does not cast float64"):
            F.linear(x, torch.randn(4, 3, device=META, dtype=torch.float64))
