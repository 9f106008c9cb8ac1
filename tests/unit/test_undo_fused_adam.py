"""The deepspeed.ops.adam.FusedAdam rule, against a torch stand-in of its CUDA kernel."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer
from ds_swift.undo.numerics import f32, ulp_error


class _FakeFusedAdam(torch.optim.Optimizer):
    """FusedAdam's step bookkeeping (ops/adam/fused_adam.py: only the last parameter's
    ``state['step']`` of each dtype list is incremented and used) and the arithmetic of
    csrc/adam/multi_tensor_adam.cu, in float32 torch ops."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0, adam_w_mode: bool = True) -> None:
        defaults = dict(lr=lr, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            # The kernel takes its hyperparameters as C floats.
            b1, b2 = (f32(b) for b in group["betas"])
            lr, wd, eps = f32(group["lr"]), f32(group["weight_decay"]), f32(group["eps"])
            todo = []
            state: dict[str, Any] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = group.get("step", 0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                todo.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
            if not todo:
                continue
            state["step"] += 1
            t = state["step"]
            bc1, bc2 = f32(1 - b1**t), f32(1 - b2**t)
            for p, g, m, v in todo:
                if self.adam_w_mode == 0:
                    g = g + wd * p
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode == 1:
                    update = update + wd * p
                p.sub_(lr * update)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_deepspeed_fused_adam_rule(monkeypatch: pytest.MonkeyPatch, adam_w_mode: bool) -> None:
    mod = types.ModuleType("deepspeed.ops.adam.fused_adam")
    mod.FusedAdam = _FakeFusedAdam  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam.fused_adam", mod)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in (50, 7, 20)]
    inner = _FakeFusedAdam(params, lr=1e-2, weight_decay=0.01, adam_w_mode=adam_w_mode)
    opt = InvertibleOptimizer(inner)
    assert opt.rule.name == "FusedAdam"
    for it in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 0.1
        if it == 2:
            before = [p.detach().clone() for p in params]
            state = copy.deepcopy({i: dict(inner.state[p]) for i, p in enumerate(params)})
        opt.step()
    opt.undo()
    for i, p in enumerate(params):
        assert ulp_error(p.detach(), before[i]) <= 2.0
        assert inner.state[p]["step"] == state[i]["step"], "only the last parameter carries the count"
        for key in ("exp_avg", "exp_avg_sq"):
            assert ulp_error(inner.state[p][key], state[i][key]) <= 2.0, key
    # First step undone: every lazily created entry goes.
    opt2 = InvertibleOptimizer(_FakeFusedAdam([torch.nn.Parameter(torch.ones(3))]))
    opt2.param_groups[0]["params"][0].grad = torch.ones(3)
    opt2.step()
    opt2.undo()
    assert len(opt2.state) == 0
