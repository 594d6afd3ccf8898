"""The simulated device: counting, peaks, budgets, rounding, meta tensors, nesting."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

import memkit
from memkit.oom import is_oom
from memkit.simulated import simulate
from memkit.simulated.accountant import MemoryAccountant, cuda_rounded, tensors_of


def nbytes(*objs) -> int:
    seen = {}
    for t in tensors_of(objs):
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def test_counts_new_storages_once_and_views_share_them():
    with simulate(None) as acct:
        x = torch.zeros(1000)  # 4000 bytes
        assert acct.current == 4000
        view = x[10:20].view(2, 5)
        assert acct.current == 4000  # a view shares its storage
        y = x * 2
        assert acct.current == 8000
        del y
        assert acct.current == 4000  # freed storages leave the count
        del x
        assert acct.current == 4000  # the view keeps the storage alive
        del view
        assert acct.current == 0
    assert acct.peak == 8000


def test_tracks_existing_model_and_optimizer(mlp):
    opt = torch.optim.AdamW(mlp.parameters())
    loss = mlp(torch.randn(4, 64)).sum()
    loss.backward()
    opt.step()
    expected = nbytes(mlp, opt)
    with simulate(None, track=(mlp, opt)) as acct:
        assert acct.current == expected
    # parameters + gradients + 2 Adam moments (+ step counters) at least
    params = sum(p.numel() * 4 for p in mlp.parameters())
    assert expected >= 4 * params


def test_training_step_peak_and_steady_state(mlp):
    opt = torch.optim.AdamW(mlp.parameters())
    x = torch.randn(256, 64)
    with simulate(None, track=(mlp, opt)) as acct:
        currents = []
        for _ in range(3):
            loss = mlp(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            currents.append(acct.current)
    # optimizer state appears on step 1, then memory returns to the same level each step
    assert currents[1] == currents[2] == currents[0]
    params = sum(p.numel() * 4 for p in mlp.parameters())
    assert acct.current == 3 * params + x.numel() * 4 + 2 * 4 + 2 * 4  # + step counters
    assert acct.peak > acct.current


def test_reset_peak():
    with simulate(None) as acct:
        a = torch.ones(100)
        b = torch.ones(100)
        del b
        assert acct.peak == 800
        acct.reset_peak()
        assert acct.peak == 400
        del a


def test_budget_raises_torch_oom_from_the_op_that_crossed_it():
    with simulate("1MiB") as acct:
        small = torch.ones(1024)  # 4 KiB fits
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(1024, 1024)  # 4 MiB does not
        message = str(info.value)
        assert "Tried to allocate 4.00 MiB" in message
        assert "1.00 MiB budget" in message
        assert "CUDA out of memory." in message  # third-party OOM handlers key on this
        assert is_oom(info.value)
        assert acct.num_ooms == 1
        assert acct.peak == 4096  # the failed allocation never counted
        del info
        gc.collect()
        assert acct.current == small.numel() * 4


def test_oom_in_backward_is_a_torch_oom(mlp):
    x = torch.randn(512, 64)
    params = nbytes(mlp)
    with simulate(params + 300_000, track=mlp), pytest.raises(torch.OutOfMemoryError):
        mlp(x).sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rounding(dtype):
    assert cuda_rounded(0) == 0
    assert cuda_rounded(1) == 512
    assert cuda_rounded(512) == 512
    assert cuda_rounded(513) == 1024
    with simulate(None, rounding="cuda") as acct:
        t = torch.ones(3, dtype=dtype)
        assert acct.current == 512
        empty = torch.ones(0)
        assert acct.current == 512
        del t, empty


def test_meta_tensors_count_without_compute():
    with simulate(None, device="meta") as acct:
        layer = torch.nn.Linear(8192, 8192, device="meta")  # 256 MiB of weights, no RAM used
        acct.track(layer)
        assert acct.current == nbytes(layer)
        out = layer(torch.empty(16, 8192, device="meta"))
        out.sum().backward()
        assert layer.weight.grad is not None
        weights = nbytes(layer) - layer.weight.grad.nbytes - layer.bias.grad.nbytes
        cpu_tensor = torch.ones(10)  # other devices are not counted
        # parameters + their gradients + the output kept alive by `out`
        assert acct.current == 2 * weights + out.nbytes
        del out, cpu_tensor


def test_inputs_created_before_the_block_are_adopted_once():
    x = torch.randn(100)
    with simulate(None) as acct:
        y = x + 1
        assert acct.current == 800
        z = x.view(10, 10)  # a view of an adopted storage adds nothing
        assert acct.current == 800
        del y, z


def test_in_place_growth_is_counted_at_the_new_size():
    with simulate(None) as acct:
        out = torch.empty(0)
        torch.add(torch.ones(8), 1, out=out)  # out= resizes a counted storage: 0 -> 32 B
        assert acct.current == 32
        assert acct.peak == 64  # the temporary ones(8) was alive beside out's 32 B
        out.resize_(100)
        assert acct.current == acct.peak == 400
        del out
        assert acct.current == 0


def test_only_tensors_on_the_device_count():
    class Tagged(torch.Tensor):
        """A subclass without a dispatch of its own: its storage counts like any other."""

    with simulate(None) as acct:
        on_meta = torch.empty(1000, device="meta")
        assert acct.current == 0
        dense = torch.ones(4, 4) @ torch.ones(4, 2)  # 32 B result (the ones were temporary)
        assert acct.current == 32
        tagged = torch.ones(10).as_subclass(Tagged) * 2  # 40 B
        assert type(tagged) is Tagged
        assert acct.current == 32 + 40
        del on_meta, dense, tagged
        assert acct.current == 0


_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
}


def sparse_bytes(tensor: torch.Tensor) -> int:
    """The independent count: the storages of a sparse tensor's parts, each once (a CSR's
    column indices view the 2 x nnz index buffer the conversion made, which stays allocated),
    read with no dispatch mode seeing it (reading a part inside the block would show it to
    the accountant)."""
    with _disable_current_modes():
        parts = [getattr(tensor, name)() for name in _PARTS[tensor.layout]]
        return sum({id(s): s.nbytes() for p in parts for s in [p.untyped_storage()]}.values())


def test_sparse_results_count_their_indices_and_values_until_they_die():
    dense = torch.randn(300, 200)
    earlier = torch.eye(50).to_sparse()  # made before the block: its parts count when tracked
    with simulate(None, track=dense) as acct:
        start = acct.current
        coo = dense.to_sparse()  # one kernel: its indices and values are no output of their own
        assert acct.current - start == sparse_bytes(coo) == dense.numel() * (2 * 8 + 4)
        csr = dense.to_sparse_csr()
        assert acct.current - start == sparse_bytes(coo) + sparse_bytes(csr)
        csc = dense.to_sparse_csc()
        assert acct.current - start == sparse_bytes(coo) + sparse_bytes(csr) + sparse_bytes(csc)
        del coo, csr, csc
        gc.collect()
        assert acct.current == start  # a sparse tensor's parts are freed when it dies
        acct.track(earlier)
        assert acct.current - start == sparse_bytes(earlier) == 50 * (2 * 8 + 4)
        del earlier
        assert acct.current == start
        emb = torch.nn.Embedding(1000, 16, sparse=True)
        idx = torch.randint(0, 1000, (64,))
        acct.track(emb, idx)
        before = acct.current
        emb(idx).sum().backward()  # the sparse gradient: one kernel too
        grad = emb.weight.grad
        assert grad.layout == torch.sparse_coo
        assert acct.current - before == sparse_bytes(grad) == 64 * (8 + 16 * 4)
        emb.weight.grad = None
        del grad
        assert acct.current == before


def test_without_adopting_views_of_host_tensors_are_not_counted():
    host = torch.randn(100)
    with simulate(None) as acct:
        acct.adopting = False
        view = host[:10]
        flat = host.view(10, 10).t()
        assert acct.current == 0  # views of a storage the op read: not new memory
        made = host * 2
        assert acct.current == 400  # a new storage counts; the host one it read does not
        del view, flat, made


def test_nested_accountants_both_count():
    with simulate(None) as outer:
        a = torch.ones(100)
        with simulate(None) as inner:
            b = torch.ones(50)
        assert inner.current == 200
        assert outer.current == 600
        del a, b


def test_dispatch_mode_is_thread_local():
    acct = MemoryAccountant("cpu")
    holder = {}

    def other_thread():
        holder["t"] = torch.ones(1000)

    with acct:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        mine = torch.ones(10)
    assert acct.current == 40  # the other thread's tensor was not seen
    del mine


def test_public_face():
    with memkit.simulate("512MiB", device="cpu") as acct:
        t = torch.ones(256)
    assert acct.peak == 1024
    assert "budget 512.00 MiB" in repr(acct)
    del t


def test_between_steps_ops_on_counted_tensors_are_device_work_and_on_host_views_host_work():
    """With counting off and ``device_work`` on (a tracker between steps): a tensor computed
    from counted ones is counted, as it is device memory on a GPU (``copy.deepcopy(model)``,
    generate()'s tokens; sweep BC: 12 turns of kept scores were never counted); a write from it
    into an uncounted tensor adopts that tensor (``ema.copy_(d * ema + (1 - d) * p)``, timm's
    ModelEmaV2); a write from host tensors alone adopts nothing; what is made from a host
    view (``.cpu()`` between steps, here :meth:`host_view`) is host work."""
    param = torch.randn(256, 256)  # 256 KiB, counted
    ema = param.clone()  # the copy, not counted
    host = torch.randn(256, 256)
    acct = MemoryAccountant("cpu")
    acct.track(param)
    acct.counting = acct.adopting = False
    acct.device_work = True
    with acct:
        host.mul_(2).add_(torch.ones(256, 256))  # host work
        assert acct.current == param.nbytes
        mixed = 0.9 * ema + 0.1 * param  # from a counted tensor: device memory
        assert acct.current == param.nbytes + mixed.nbytes
        ema.copy_(mixed)
        assert acct.current == param.nbytes + mixed.nbytes + ema.nbytes
        del mixed
        assert acct.current == param.nbytes + ema.nbytes
        host.copy_(host * 0.5)
        view = acct.host_view(param)  # {k: v.cpu().clone()}: the view, then a host clone
        snapshot = view.clone().float()
        assert acct.current == param.nbytes + ema.nbytes and snapshot.dtype == torch.float32
        assert view.data_ptr() == param.data_ptr()  # (no copy: in place, as without memkit)
        assert acct.host_view(host) is host  # host data: .cpu() is the tensor itself
    assert acct.current == param.nbytes + ema.nbytes


def test_a_tensor_only_a_reference_cycle_holds_is_counted_freed_by_a_collection_mid_count():
    """Sweep FF: a garbage collection run inside the accountant's locked section (any
    allocation there can start one) freed a tensor only a cycle held (`ctx.out = out` in an
    autograd.Function); its storage's callback took the same lock: the thread hung."""
    import gc
    import threading

    class Holder:
        pass

    result: list[int] = []

    def work() -> None:
        threshold = gc.get_threshold()
        gc.set_threshold(1)  # a collection at nearly every allocation, inside the lock too
        try:
            with memkit.simulate("1GiB") as acct:
                for _ in range(300):
                    holder = Holder()
                    holder.me = holder
                    holder.t = torch.ones(16) * 2
                del holder
                gc.collect()
                result.append(acct.current)
        finally:
            gc.set_threshold(*threshold)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert result == [0], "the count hung or kept freed tensors"


def test_an_observer_attached_while_a_collection_frees_a_counted_tensor():
    """Review: `observe` listed the live storages item by item; a collection started by one
    of those allocations freed a tensor only a cycle held, whose callback (the lock is
    reentrant) changed the table mid-iteration: RuntimeError."""
    import gc

    from memkit.simulated.accountant import StorageObserver

    class Quiet(StorageObserver):
        def already_counted(self, storages):
            self.counted = len(storages)

        def allocated(self, *args):
            pass

        def freed(self, *args):
            pass

        def out_of_memory(self, *args):
            pass

    class Node:
        pass

    with memkit.simulate("1GiB") as acct:
        keep = [torch.zeros(1) for _ in range(3000)]
        gc.collect()
        node = Node()
        node.me = node
        node.t = torch.zeros(10)
        del node  # garbage a collection inside observe() frees
        observer = Quiet()
        acct.observe(observer)
        acct.stop_observing()
    assert observer.counted in (3000, 3001) and len(keep) == 3000


def test_what_simulate_cannot_count_is_a_config_error_not_silently_nothing():
    """``track='model'``, ``track=[model, 5]`` and a NumPy array counted nothing, silently
    (sweep KK); objects that hold tensors (a model's output) are still taken."""
    import numpy as np

    from memkit.errors import ConfigError

    model = torch.nn.Linear(4, 4)
    for bad, found in (("model", r"'model' \(str\)"), ([model, 5], r"5 \(int\)"),
                       ((np.zeros(3),), r"array\(.*\(ndarray\)")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"track: expected a model.* found {found}"):
            simulate("1MiB", track=bad)

    class Output:
        def __init__(self) -> None:
            self.logits = torch.zeros(256)

    output = Output()
    with simulate("1MiB", track=[model, output, None]) as acct:  # (an optional optimizer)
        assert acct.current == (16 + 4) * 4 + 256 * 4
    with simulate("1MiB", track=model.parameters()) as acct:  # a generator (review)
        assert acct.current == (16 + 4) * 4


def test_a_storage_grown_in_place_past_the_budget_is_refused_with_its_growth_uncounted():
    """Sweep CC: FSDP2's unshard grows each parameter's storage in place (alloc_storage,
    seen through storage_resizes): past the budget the error said 'Tried to allocate 0 B'
    and the growth was already counted past the budget. The growth is the request."""
    with memkit.simulate("1MiB") as acct:
        t = torch.empty(1024)
        before = acct.current
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 MiB"):
            t.resize_(1024 + 512 * 1024)
        assert acct.current == before and acct.peak == before
        t.fill_(0)  # the op ran (the tensor is grown): counted now, not refused at every use
        del t
        u = torch.empty(1024)
        u.resize_(2048)  # within the budget: counted
        assert acct.current == 2 * 1024 * 4
        # a storage grown outside any op, seen by one op's several views: once (review)
        w = torch.empty(4, 1024)
        w.untyped_storage().resize_(64 * 1024)
        parts = w.unbind(0)
        assert acct.current == 2 * 1024 * 4 + 64 * 1024
        del parts, w
        assert acct.current == 2 * 1024 * 4
