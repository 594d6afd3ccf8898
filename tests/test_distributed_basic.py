"""memkit.distributed without a process group, and microbatch under a real 2-rank gloo DDP.

The 2-rank test runs in the launch the suite's 2-rank tests share (tests/rank_processes.py),
each rank with its own ``memkit.simulate`` budget, last (its rank 1 leaves the group); every
wait is bounded, so a hang fails the test.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from rank_processes import rank_scenario

import memkit
from memkit import distributed
from memkit.microbatching import split_batch

pytestmark = pytest.mark.slow

SCENARIO = textwrap.dedent(
    """
    import time
    import torch, torch.nn.functional as F
    import memkit
    from memkit import distributed
    from memkit.microbatching import microbatch

    def run(rank, args):
        budgets, n = args  # n: each rank's batch
        budget = budgets[rank]
        result = {"rank": rank, "world": distributed.world_size(),
                  "is": distributed.is_distributed()}
        result["any"] = [distributed.any_true(rank == 1), distributed.any_true(False)]
        result["max"] = distributed.all_max([10 * rank + 3])[0]
        got = distributed.gather_to_rank0({"r": rank}, "test-basic", timeout=30)
        result["gathered"] = None if got is None else [got.objects, list(got.missing)]
        if rank == 0:  # rank 1 never sends under this key: missing after the timeout
            alone = distributed.gather_to_rank0("r0", "test-basic-alone", timeout=0.2)
            result["alone"] = [alone.objects, list(alone.missing), alone.gave_up]
            distributed.give_up_waiting()  # the job is being stopped: no wait at all
            t0 = time.monotonic()
            stopped = distributed.gather_to_rank0("r0", "test-basic-stopped", timeout=30)
            result["stopped"] = [list(stopped.missing), stopped.gave_up, time.monotonic() - t0]
            distributed.give_up_waiting(False)

        torch.manual_seed(0)
        L, R = torch.nn.Linear, torch.nn.ReLU
        model = torch.nn.Sequential(L(64, 128), R(), L(128, 128), R(), L(128, 10))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        steps = [0]
        opt.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
        calls = [0]
        broken = [False]

        def train(batch):
            calls[0] += 1
            if broken[0] and rank == 1:
                raise ValueError("rank 1 broke")
            x, y = batch
            return F.cross_entropy(ddp(x), y)

        ddp(torch.zeros(2, 64)).sum().backward()  # an ordinary synced step first
        ddp.zero_grad(set_to_none=True)
        flags = [ddp.require_forward_param_sync]
        step = microbatch(train, model=ddp, optimizer=opt, timeout=15)
        gen = torch.Generator().manual_seed(1)
        infos = []
        with memkit.simulate(budget, track=(model, opt)):
            for _ in range(3):
                x = torch.randn(2 * n, 64, generator=gen)
                y = torch.randint(0, 10, (2 * n,), generator=gen)
                mine = (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
                step(mine)
                infos.append([step.last.chunks, step.last.attempts, step.last.ooms])
        flags.append(ddp.require_forward_param_sync)  # put back for the user's next forward
        result.update(infos=infos, steps=steps[0], step_steps=step.steps, flags=flags)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   f"rank{rank}.pt")

        # a non-OOM error on rank 1: rank 1 re-raises it, rank 0 gets a DistributedError
        broken[0] = True
        try:
            step(mine)
        except Exception as exc:
            result["error"] = type(exc).__name__
        result["steps_after_error"] = steps[0]

        # a dead rank: rank 1 leaves, rank 0 times out instead of hanging (a hang would run
        # into the launcher's limit and fail the test)
        if rank == 0:
            try:
                distributed.any_true(False, timeout=2.0)
            except Exception as exc:
                result["dead"] = type(exc).__name__
        return result
    """
)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )  # fmt: skip


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


PER_RANK = 1024
"""Each rank's batch; large, so that the peaks of 1 and 2 micro-batches are far apart."""


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches both ranks draw (each takes its half)."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2 * PER_RANK, 64, generator=gen),
         torch.randint(0, 10, (2 * PER_RANK,), generator=gen))
        for _ in range(3)
    ]  # fmt: skip


def _rank_peak(chunks: int, gradient_bytes: int) -> int:
    """Rank 0's peak on its device for the first batch in ``chunks`` micro-batches, counted as
    the scenario counts it: the whole global batch (drawn in the block) and DDP's gradient
    bucket (a copy of the gradients, made at the first forward in the block) included."""
    model = _mlp()
    x, y = _batches()[0]
    with memkit.simulate(None, track=(model, x, y)) as acct:
        for part in split_batch((x[:PER_RANK], y[:PER_RANK]), chunks):
            _loss(model, part).backward()
        return acct.peak + gradient_bytes


def _budgets() -> list[int | None]:
    """Rank 0's device: its batch does not fit, half of it does; rank 1: no budget.

    Half way, and more than twice the gradients' bytes from either peak: after a step, a gloo
    worker thread may still hold a gradient or two it all-reduced (it lets go of its work only
    after marking it done), so the next batch may start with them still counted."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in _mlp().parameters())
    fits, does_not = _rank_peak(2, gradient_bytes), _rank_peak(1, gradient_bytes)
    budget = (fits + does_not) // 2
    assert budget - fits > 2 * gradient_bytes, (fits, does_not, gradient_bytes)
    return [budget, None]


rank_scenario("ddp-microbatch", SCENARIO, args=lambda: [_budgets(), PER_RANK], last=True)


def test_without_a_process_group_everything_is_local(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (0, 0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (3, 1, 4)
    assert distributed.any_true(True) and not distributed.any_true(False, timeout=1)
    assert distributed.all_max([7]) == [7] and distributed.all_max([1, -2]) == [1, -2]
    assert distributed.gather_to_rank0("x", "k", timeout=1) == distributed.Gathered({0: "x"})
    t = torch.ones(2)
    distributed.all_reduce_sum_([t])
    distributed.broadcast_([t])
    assert t.tolist() == [1.0, 1.0]


def test_ddp_oom_on_one_rank_recovers_on_both_and_matches_the_reference(gloo_ranks):
    """One 2-rank gloo run: collectives, OOM recovery, a non-OOM error, a dead rank."""
    ranks = gloo_ranks("ddp-microbatch")
    r0, r1 = ranks.results
    batches = _batches()
    assert r0["world"] == 2 and r0["is"] is True
    assert r0["any"] == r1["any"] == [True, False]
    assert r0["max"] == r1["max"] == 13
    assert r0["gathered"] == [{"0": {"r": 0}, "1": {"r": 1}}, []] and r1["gathered"] is None
    assert r0["alone"] == [{"0": "r0"}, [1], False]
    assert r0["stopped"][:2] == [[1], True] and r0["stopped"][2] < 5
    # one optimizer step per batch on each rank; the split agreed and then reused
    assert r0["steps"] == r1["steps"] == 3 == r0["step_steps"]
    assert r0["flags"] == r1["flags"] == [True, True]  # DDP's buffer-broadcast flag put back
    # [micro-batches, attempts, OOMs]: only rank 0 ran out, both ranks used the agreed split,
    # then reused it
    assert r0["infos"] == [[2, 2, 1], [2, 1, 0], [2, 1, 0]]
    assert r1["infos"] == [[2, 2, 0], [2, 1, 0], [2, 1, 0]]
    # a non-OOM error on rank 1 ends both ranks (no hang, no step); a dead rank times out
    assert r1["error"] == "ValueError" and r0["error"] == "DistributedError"
    assert r0["steps_after_error"] == r1["steps_after_error"] == 3
    assert r0["dead"] == "DistributedError"
    p0 = torch.load(ranks.folder / "rank0.pt")
    p1 = torch.load(ranks.folder / "rank1.pt")
    # reference: one process, full global batch of 512, same SGD
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for batch in batches:
        opt.zero_grad()
        _loss(ref, batch).backward()
        opt.step()
    for name, value in ref.state_dict().items():
        assert torch.equal(p0[name], p1[name]), name  # identical on both ranks
        torch.testing.assert_close(p0[name], value, rtol=1e-5, atol=1e-6, msg=name)
