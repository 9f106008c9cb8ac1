"""An undo whose gradients were overwritten since the step (the next backward pass reuses the
buffers) is refused; given the step's gradients back (InvertibleOptimizer.restore_gradients, from
strategy tranlogs' update record) it undoes the step again, within 2 ulp."""

from __future__ import annotations

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer
from ds_swift.undo.numerics import ulp_error
from ds_swift.undo.records import UndoError


def test_gradients_given_back_make_an_overwritten_step_undoable() -> None:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in (1000, 7)]
    opt = InvertibleOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1), retain_grads=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        before = [p.detach().clone() for p in params]
        opt.step()
    after = [p.detach().clone() for p in params]
    used = [p.grad.clone() for p in params if p.grad is not None]
    for p in params:  # the next iteration's backward pass accumulates into the same buffers
        assert p.grad is not None
        p.grad.add_(torch.randn(p.shape, generator=g))
    assert not opt.can_undo and opt.undoable_but_for_gradients
    with pytest.raises(UndoError, match="modified in place"):
        opt.undo()
    assert opt.restore_gradients([(params[0], used[0])]) == 1
    assert not opt.can_undo  # one parameter's gradient is still the overwritten one
    assert opt.restore_gradients(zip(params, used, strict=True)) == 2 and opt.can_undo
    opt.undo()
    for p, b, a in zip(params, before, after, strict=True):
        assert ulp_error(p.detach(), b, a) <= 2.0


def test_a_step_whose_parameters_changed_since_cannot_be_undone_with_gradients_given_back() -> None:
    p = torch.nn.Parameter(torch.ones(8))
    opt = InvertibleOptimizer(torch.optim.AdamW([p], lr=1e-3), retain_grads=True)
    p.grad = torch.full((8,), 1e-3)
    opt.step()
    assert opt.undoable_but_for_gradients
    with torch.no_grad():
        p.add_(1.0)  # a load, or another step, after it
    assert not opt.undoable_but_for_gradients
