"""InvertibleOptimizer behaviour: refusals, records, validation, schedulers, transactions."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import ds_swift.undo.numerics as numerics
from ds_swift.undo import InvertibleOptimizer, NotInvertibleError, StepRecord, UndoError


def _params(n: int = 2, size: int = 10, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(size, generator=g)) for _ in range(n)]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.1


# ---- refusals ---------------------------------------------------------------------------


def test_amsgrad_refused_with_reason_and_strategy() -> None:
    with pytest.raises(NotInvertibleError) as exc:
        InvertibleOptimizer(torch.optim.Adam(_params(), amsgrad=True))
    msg = str(exc.value)
    assert "amsgrad" in msg and "checkpoint" in msg
    assert isinstance(exc.value, ValueError)


def test_amsgrad_switched_on_later_refused_at_step() -> None:
    params = _params()
    opt = InvertibleOptimizer(torch.optim.AdamW(params))
    opt.param_groups[0]["amsgrad"] = True
    _grads(params, 0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(NotInvertibleError, match="amsgrad"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), "refused step must not run"


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adamax(ps), lambda ps: torch.optim.NAdam(ps)])
def test_unknown_optimizer_refused(make: Any) -> None:
    with pytest.raises(NotInvertibleError, match="checkpoint"):
        InvertibleOptimizer(make(_params()))


def test_subclass_overriding_step_refused_plain_subclass_accepted() -> None:
    class Tweaked(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return super().step(closure)

    class Renamed(torch.optim.SGD):
        pass

    with pytest.raises(NotInvertibleError, match="overrides SGD.step"):
        InvertibleOptimizer(Tweaked(_params(), lr=0.1))
    InvertibleOptimizer(Renamed(_params(), lr=0.1))


def test_differentiable_refused() -> None:
    with pytest.raises(NotInvertibleError, match="differentiable"):
        InvertibleOptimizer(torch.optim.SGD(_params(), lr=0.1, differentiable=True))


def test_apex_fused_lamb_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class FusedLAMB(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 1e-3})

    mod = types.ModuleType("apex.optimizers")
    mod.FusedLAMB = FusedLAMB  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "apex.optimizers", mod)
    with pytest.raises(NotInvertibleError, match="overwrites each .grad"):
        InvertibleOptimizer(FusedLAMB(_params()))


def test_sparse_gradient_refused_before_stepping() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = InvertibleOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(NotInvertibleError, match="sparse"):
        opt.step()


# ---- records and numbering ----------------------------------------------------------------


def test_record_contents_and_iteration_numbering() -> None:
    params = _params(3)
    opt = InvertibleOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert opt.last_record is None and opt.last_stepped_iteration is None
    for it in range(3):
        _grads(params[:2], it)  # the third parameter never gets a gradient
        opt.step()
    rec = opt.last_record
    assert isinstance(rec, StepRecord)
    assert rec.iteration == 2 and opt.last_stepped_iteration == 2 and rec.prev_iteration == 1
    assert rec.complete and not rec.skipped
    assert [id(t) for t in rec.touched] == [id(params[0]), id(params[1])]
    assert rec.groups[0].hyper["lr"] == 0.1 and rec.groups[0].hyper["momentum"] == 0.9
    assert rec.summary()["groups"][0]["params"] == 2
    opt.undo()
    assert opt.last_stepped_iteration == 1 and opt.last_record is None
    opt.step(iteration=7)
    assert opt.last_stepped_iteration == 7


def test_wrapped_step_is_bitwise_the_plain_step_with_closure() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    twin = torch.nn.Linear(6, 3)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 6)
    opt = InvertibleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1))
    ref = torch.optim.Adam(twin.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):

        def closure(m: torch.nn.Module = model) -> torch.Tensor:
            m.zero_grad()
            loss = m(x).pow(2).sum()
            loss.backward()
            return loss

        def closure_ref(m: torch.nn.Module = twin) -> torch.Tensor:
            m.zero_grad()
            loss = m(x).pow(2).sum()
            loss.backward()
            return loss

        assert torch.equal(opt.step(closure), ref.step(closure_ref))
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b)


def test_state_dict_after_first_step_undo_equals_fresh() -> None:
    params = _params()
    inner = torch.optim.AdamW(params, lr=1e-2)
    fresh = inner.state_dict()
    opt = InvertibleOptimizer(inner)
    _grads(params, 0)
    opt.step()
    assert len(inner.state) == 2
    opt.undo()
    assert inner.state_dict() == fresh and len(inner.state) == 0


# ---- validation ----------------------------------------------------------------------------


def test_nothing_to_undo_and_double_undo() -> None:
    params = _params()
    opt = InvertibleOptimizer(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(UndoError, match="nothing to undo"):
        opt.undo()
    _grads(params, 0)
    opt.step()
    opt.undo()
    with pytest.raises(UndoError, match="nothing to undo"):
        opt.undo()


@pytest.mark.parametrize("how", ["set_to_none", "zero_in_place", "new_backward", "wrapper_zero_grad"])
def test_overwritten_gradient_detected(how: str) -> None:
    model = torch.nn.Linear(4, 2)
    opt = InvertibleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    if how == "set_to_none":
        model.zero_grad(set_to_none=True)
    elif how == "zero_in_place":
        model.zero_grad(set_to_none=False)
    elif how == "new_backward":
        model(torch.randn(3, 4)).sum().backward()  # accumulates into .grad in place
    else:
        opt.zero_grad()
    assert not opt.can_undo
    with pytest.raises(UndoError, match="gradient"):
        opt.undo()


def test_parameter_modified_after_step_detected() -> None:
    params = _params()
    opt = InvertibleOptimizer(torch.optim.SGD(params, lr=0.1))
    _grads(params, 0)
    opt.step()
    with torch.no_grad():
        params[0].add_(1.0)
    with pytest.raises(UndoError, match="parameter was modified"):
        opt.undo()


def test_failed_validation_changes_nothing() -> None:
    params = _params()
    opt = InvertibleOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    opt.step()
    params[1].grad = None
    snap = [p.detach().clone() for p in params]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in params]
    with pytest.raises(UndoError):
        opt.undo()
    assert all(torch.equal(p, s) for p, s in zip(params, snap, strict=True))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(params, bufs, strict=True))


# ---- LR schedulers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),  # cycles betas too
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    ],
)
def test_lr_scheduler_and_group_hyperparameters_restored(make_sched: Any) -> None:
    params = _params()
    inner = torch.optim.AdamW(params, lr=0.05)
    sched = make_sched(inner)
    opt = InvertibleOptimizer(inner, lr_scheduler=sched)
    for it in range(3):
        _grads(params, it)
        if it == 2:
            groups_before = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
            sched_before = sched.state_dict()
        opt.step()
        sched.step()
    opt.undo()
    assert sched.state_dict() == sched_before
    assert [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups] == groups_before
    # Redoing the step follows the same schedule as the original run did.
    sched.step()
    assert sched.state_dict()["last_epoch"] == sched_before["last_epoch"] + 1


# ---- transactions (DeepSpeed ZeRO steps one param group at a time) ---------------------------


def test_transaction_groups_per_group_steps_like_zero() -> None:
    params = _params(4)
    groups: list[dict[str, Any]] = [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}]
    inner = torch.optim.Adam(groups, lr=0.1)
    opt = InvertibleOptimizer(inner, retain_grads=True)
    _grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    grads = [p.grad for p in params]
    all_groups = inner.param_groups
    with opt.transaction(iteration=1) as rec:
        for group in all_groups:
            inner.param_groups = [group]  # what DeepSpeedZeroOptimizer._optimizer_step does
            opt.step()
            for p in group["params"]:
                p.grad = None  # DeepSpeed frees the fp32 gradient right after the step
        inner.param_groups = all_groups
    assert len(rec.groups) == 2 and rec.complete
    del grads
    opt.undo()
    for p, b in zip(params, before, strict=True):
        assert numerics.ulp_error(p.detach(), b) <= 1.0


def test_empty_transaction_is_a_skipped_step() -> None:
    params = _params()
    opt = InvertibleOptimizer(torch.optim.SGD(params, lr=0.1))
    with opt.transaction(iteration=5) as rec:
        pass  # fp16 overflow: DeepSpeed never calls the inner step
    assert rec.skipped and opt.last_stepped_iteration == 5
    assert opt.undo() is rec and opt.last_stepped_iteration is None


def test_transaction_that_raises_records_what_was_applied() -> None:
    params = _params(2)
    inner = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    opt = InvertibleOptimizer(inner)
    _grads(params, 0)
    before = [p.detach().clone() for p in params]
    groups = inner.param_groups
    with pytest.raises(RuntimeError, match="peer died"), opt.transaction(iteration=0):
        inner.param_groups = [groups[0]]
        opt.step()
        inner.param_groups = groups
        raise RuntimeError("peer died")  # e.g. the all-gather after the first group's update
    rec = opt.last_record
    assert rec is not None and not rec.complete and len(rec.groups) == 1
    opt.undo()
    assert torch.equal(params[1].detach(), before[1])
    assert numerics.ulp_error(params[0].detach(), before[0]) <= 1.0


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_chunked_undo_matches_unchunked(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Slices of 7 elements against whole tensors (the fast path packs the two then)."""
    from ds_swift.undo import apply

    results = []
    for chunk in (7, 1 << 21):
        monkeypatch.setattr(apply, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(apply, "FAST_CHUNK_CPU", chunk)
        params = _params(2, size=50, seed=1)
        inner = torch.optim.RMSprop(params, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.01)
        opt = InvertibleOptimizer(inner, undo_path=path)  # type: ignore[arg-type]
        for it in range(3):
            _grads(params, it)
            opt.step()
        opt.undo()
        results.append([p.detach().clone() for p in params] + [opt.state[p]["square_avg"].clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_passthrough_attributes() -> None:
    params = _params()
    inner = torch.optim.SGD(params, lr=0.1)
    opt = InvertibleOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults and opt.state_dict() == inner.state_dict()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(inner.param_groups) == 2
    with pytest.raises(ValueError, match="already"):
        InvertibleOptimizer(opt)
