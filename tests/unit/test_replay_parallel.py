"""Parallel recovery without processes: shares, layouts, the swapped topology, and exact vs fast combination."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.recovery.replay.parallel import (
    GradCapture,
    ParallelReplayLayout,
    assign_micro_batches,
    combine_exact,
    combine_fast,
    helper_topology,
)
from ds_swift.recovery.replay.parallel_combine import combine_exact_hp


@given(st.integers(1, 64), st.integers(1, 8))
def test_shares_partition_the_micro_batches_round_robin(m: int, d: int) -> None:
    shares = assign_micro_batches(m, d)
    assert len(shares) == d
    assert sorted(x for s in shares for x in s) == list(range(m))
    for r, s in enumerate(shares):
        assert all(x % d == r for x in s) and list(s) == sorted(s)


def test_layout_roles_peers_and_checks() -> None:
    lay = ParallelReplayLayout(stages=(2, 3), replacements=(6, 7), helpers=(0, 1), micro_batches=4)
    assert lay.shares == ((0, 2), (1, 3))
    assert [lay.role(r) for r in (6, 7, 0, 1, 3)] == [(0, 0), (0, 1), (1, 0), (1, 1), None]
    assert [lay.peer(r) for r in (6, 7, 0, 1)] == [0, 1, 6, 7]
    assert lay.sub_pipeline(1) == {0, 1}
    with pytest.raises(ValueError, match="contiguous"):
        ParallelReplayLayout((1, 3), (6, 7), (0, 1), 4)
    with pytest.raises(ValueError, match="distinct"):
        ParallelReplayLayout((2, 3), (6, 7), (7, 1), 4)
    with pytest.raises(ValueError, match="one entry per failed stage"):
        ParallelReplayLayout((2, 3), (6,), (0, 1), 4)
    with pytest.raises(ValueError, match="two micro-batches"):
        ParallelReplayLayout((2, 3), (6, 7), (0, 1), 1)


def test_swapped_topology_gives_helpers_the_failed_stages() -> None:
    topo = PipeDataParallelTopology(num_pp=4, num_dp=2)  # 'pipe' outer: stage s, replica d -> rank 2s + d
    lay = ParallelReplayLayout(stages=(2, 3), replacements=(4, 6), helpers=(0, 2), micro_batches=4)
    new = helper_topology(topo, lay)
    for rank in range(8):
        old, now = topo.get_coord(rank), None
        for j in range(2):
            if rank == lay.helpers[j]:
                now = topo.get_coord(lay.replacements[j])
            if rank == lay.replacements[j]:
                now = topo.get_coord(lay.helpers[j])
        assert new.get_coord(rank) == (now or old)
    assert sorted(new.mapping.values()) == list(range(8))
    with pytest.raises(ValueError, match="does not host stage"):
        helper_topology(topo, ParallelReplayLayout((2, 3), (5, 4), (0, 2), 4))


class TupleStage(nn.Module):
    """A stage whose output is a tuple: DeepSpeed backpropagates it with one backward call per tensor."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.a(x))
        return self.b(y) * y, y * 0.3


def run_micro_batch(model: TupleStage, m: int, seed: int, h: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + m)
    dtype = model.a.weight.dtype
    outs = model(torch.randn(3, h, generator=g).to(dtype))
    grads = [(torch.randn(o.shape, generator=g) * 1e-3).to(dtype) for o in outs]
    for i, (o, gr) in enumerate(zip(outs, grads)):
        o.backward(gr, retain_graph=i < len(outs) - 1)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 9), st.integers(1, 4), st.integers(2, 12), st.integers(0, 10**6))
def test_exact_combination_is_bitwise_sequential_accumulation(m: int, workers: int, h: int, seed: int) -> None:
    torch.manual_seed(seed)
    ref = TupleStage(h)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    for mb in range(m):  # the sequential run: autograd accumulates into .grad
        run_micro_batch(ref, mb, seed, h)

    contributions = {}
    partials = []
    for share in assign_micro_batches(m, workers):  # each worker: its own copy, its own share
        copy = TupleStage(h)
        copy.load_state_dict(state)
        params = list(copy.parameters())
        capture = GradCapture(params)
        for mb in share:
            with capture.micro_batch(mb):
                run_micro_batch(copy, mb, seed, h)
        contributions.update(capture.take())
        capture.remove()
        partials.append([p.grad for p in params])

    exact = combine_exact(contributions, len(list(ref.parameters())))
    fast = combine_fast(partials)
    for p, e, f in zip(ref.parameters(), exact, fast):
        assert p.grad is not None and e is not None and f is not None
        assert torch.equal(e.view(torch.int32), p.grad.view(torch.int32))  # bit for bit
        assert torch.allclose(f, p.grad, rtol=1e-5, atol=1e-9)


def test_fast_combination_can_differ_in_the_last_bits() -> None:
    # (a + b) + (c + d) is not ((a + b) + c) + d in floating point: why exact mode exists
    vals = [torch.tensor([1.0]), torch.tensor([4e-8]), torch.tensor([4e-8]), torch.tensor([4e-8])]
    exact = combine_exact({i: [[v]] for i, v in enumerate(vals)}, 1)[0]
    fast = combine_fast([[vals[0] + vals[2]], [vals[1] + vals[3]]])[0]
    assert exact is not None and fast is not None
    assert exact.item() == 1.0 and fast.item() != exact.item()


def test_capture_refuses_gradients_outside_a_micro_batch() -> None:
    lin = nn.Linear(2, 2)
    capture = GradCapture(list(lin.parameters()))
    with pytest.raises(RuntimeError, match="outside a captured micro-batch"):
        lin(torch.ones(1, 2)).sum().backward()
    capture.remove()
    lin(torch.ones(1, 2)).sum().backward()  # removed: no longer watched


def bf16_optimizer_run(model: TupleStage, share: list[int], seed: int, h: int, per_call: bool) -> list[torch.Tensor]:
    """What BF16_Optimizer's fp32 gradient buffers hold after ``share`` (DeepSpeed 0.19.8's pipeline
    path): per micro-batch, ``clear_lp_grads`` zeroes the bf16 ``.grad``, the backward calls add
    to it, ``update_hp_grads`` adds it cast to fp32; with ``immediate_grad_update`` a
    post-accumulate hook adds each call's gradient and drops ``.grad``."""
    params = list(model.parameters())
    hp = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    handles = []
    if per_call:

        def adder(i: int):  # noqa: ANN202 - a hook factory
            def hook(p: torch.Tensor) -> None:
                hp[i].add_(p.grad.to(torch.float32))
                p.grad = None

            return hook

        handles = [p.register_post_accumulate_grad_hook(adder(i)) for i, p in enumerate(params)]
    for mb in share:
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        run_micro_batch(model, mb, seed, h)
        if not per_call:
            for i, p in enumerate(params):
                hp[i].add_(p.grad.to(torch.float32))
    for handle in handles:
        handle.remove()
    return hp


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 7), st.integers(2, 10), st.integers(0, 10**6), st.booleans())
def test_exact_hp_combination_is_bitwise_bf16_optimizer_accumulation(m: int, h: int, seed: int, per_call: bool) -> None:
    """bf16 + ZeRO-1 (BF16_Optimizer): two copies, each a share of the micro-batches, combine into
    the fp32 buffers of the sequential run, bit for bit (per micro-batch, and immediate_grad_update)."""
    torch.manual_seed(seed)
    ref = TupleStage(h).to(torch.bfloat16)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    expected = bf16_optimizer_run(ref, list(range(m)), seed, h, per_call)
    contributions = {}
    for share in assign_micro_batches(m, 2):
        copy = TupleStage(h).to(torch.bfloat16)
        copy.load_state_dict(state)
        capture = GradCapture(list(copy.parameters()))
        for mb in share:
            with capture.micro_batch(mb):
                run_micro_batch(copy, mb, seed, h)
        contributions.update(capture.take())
        capture.remove()
    got = combine_exact_hp(contributions, len(expected), per_call)
    for e, g in zip(expected, got):
        assert g is not None and g.dtype == torch.float32
        assert torch.equal(e.view(torch.int32), g.view(torch.int32))  # bit for bit


def test_parallel_helps_only_with_compute_of_its_own() -> None:
    from ds_swift.recovery.replay.parallel import parallel_helps

    lay = ParallelReplayLayout(stages=(2, 3), replacements=(2, 3), helpers=(0, 1), micro_batches=4)
    one_host = {r: {"host": "h", "cores": 2, "threads": 1, "accelerator": False} for r in range(4)}
    why = parallel_helps(lay, one_host)
    assert why is not None and "host h's 2 CPU core(s) with 4 thread(s)" in why
    assert parallel_helps(lay, {r: {**c, "cores": 4} for r, c in one_host.items()}) is None
    assert parallel_helps(lay, {r: {**c, "accelerator": True} for r, c in one_host.items()}) is None
    two_hosts = {r: {**c, "host": f"h{r // 2}"} for r, c in one_host.items()}  # 2 replayers per 2-core host
    assert parallel_helps(lay, two_hosts) is None
