"""Parallel recovery without processes: shares, layouts, the swapped topology, and exact vs fast combination."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.recovery.parallel import (
    GradCapture,
    ParallelReplayLayout,
    assign_micro_batches,
    combine_exact,
    combine_fast,
    helper_topology,
)


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
    outs = model(torch.randn(3, h, generator=g))
    grads = [torch.randn(o.shape, generator=g) * 1e-3 for o in outs]
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
