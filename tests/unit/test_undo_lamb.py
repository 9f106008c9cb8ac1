"""LAMB: ds_swift.undo.Lamb (FusedLamb arithmetic, trust ratios kept) and the FusedLamb rule."""

from __future__ import annotations

import copy
import math
import sys
import types
from typing import Any

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer, Lamb
from ds_swift.undo.numerics import f32, ulp_error


def test_lamb_matches_reference_formula_and_keeps_trust_ratios() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, dtype=torch.float64))
    opt = Lamb([p], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), max_coeff=10.0, min_coeff=0.01)
    x, m, v = p.detach().clone(), torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for t in range(1, 4):
        g = torch.randn(64, dtype=torch.float64) * 0.1
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        step_size = 1e-2 * math.sqrt(1 - 0.99**t) / (1 - 0.9**t)
        u = m / (v.sqrt() + 1e-8) + 0.1 * x
        trust = min(max(float(x.norm() / u.norm()), 0.01), 10.0)
        x = x - step_size * trust * u
        assert torch.allclose(p.detach(), x, rtol=1e-12, atol=1e-14)
        assert len(opt.lamb_coeffs) == 1 and math.isclose(float(opt.lamb_coeffs[0]), trust, rel_tol=1e-12)


def test_lamb_trust_ratio_recorded_per_tensor() -> None:
    params = [torch.nn.Parameter(torch.randn(s)) for s in (10, 20, 30)]
    opt = InvertibleOptimizer(Lamb(params, lr=1e-3, weight_decay=0.01))
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    opt.step()
    rec = opt.last_record
    assert rec is not None
    ratios = [pr.extra["trust_ratio"] for g in rec.groups for pr in g.params]
    assert len(ratios) == 2 and all(r.dim() == 0 for r in ratios)


def test_lamb_zero_param_uses_unit_trust_ratio() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    opt = InvertibleOptimizer(Lamb([p], lr=1e-2))
    p.grad = torch.ones(8)
    opt.step()
    assert float(opt.optimizer.lamb_coeffs[0]) == 1.0
    opt.undo()
    assert torch.equal(p.detach(), torch.zeros(8))


class _FakeFusedLamb(torch.optim.Optimizer):
    """Stand-in for deepspeed.ops.lamb.FusedLamb (CUDA-only): same interface, and the
    arithmetic of csrc/lamb/fused_lamb_cuda_kernel.cu written with torch ops."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(
        self,
        closure: Any = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float = 1.0,
        grad_norms: Any = None,
    ) -> Any:  # type: ignore[override]
        del self.lamb_coeffs[:]
        grad_norms = grad_norms or [None] * len(self.param_groups)
        for group, norm_group in zip(self.param_groups, grad_norms, strict=True):
            norm_group = norm_group if isinstance(norm_group, list) else [norm_group] * len(group["params"])
            for p, grad_norm in zip(group["params"], norm_group, strict=True):
                combined = scale
                if group["max_grad_norm"] > 0:
                    clip = ((grad_norm / scale) + 1e-6) / group["max_grad_norm"]
                    if clip > 1:
                        combined = clip * scale
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                b1, b2 = (f32(b) for b in group["betas"])  # the kernel takes C floats
                state["step"] += 1
                g = p.grad / combined
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                t = state["step"]
                lr, eps, wd = f32(group["lr"]), f32(group["eps"]), f32(group["weight_decay"])
                step_size = f32(lr * math.sqrt(f32(1 - b2**t)) / f32(1 - b1**t))
                v = state["exp_avg_sq"]
                denom = (v + eps).sqrt() if self.eps_mode == 0 else v.sqrt() + eps
                update = state["exp_avg"] / denom + wd * p
                w, u = p.norm(), update.norm()
                coeff = (w / u).clamp(group["min_coeff"], group["max_coeff"]) if w > 0 and u > 0 else torch.tensor(1.0)
                p.sub_(step_size * coeff * update)
                self.lamb_coeffs.append(coeff.reshape(1))


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_deepspeed_fused_lamb_rule(monkeypatch: pytest.MonkeyPatch, eps_inside_sqrt: bool) -> None:
    mod = types.ModuleType("deepspeed.ops.lamb.fused_lamb")
    mod.FusedLamb = _FakeFusedLamb  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.ops.lamb.fused_lamb", mod)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in (40, 13)]
    inner = _FakeFusedLamb(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, eps_inside_sqrt=eps_inside_sqrt)
    opt = InvertibleOptimizer(inner)
    assert opt.rule.name == "FusedLamb"
    for it in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 8.0  # scaled by a loss scale of 4, norm above max_grad_norm
        norms = [[float(torch.linalg.vector_norm(p.grad)) for p in params if p.grad is not None]]
        if it == 2:
            before = [p.detach().clone() for p in params]
            state = copy.deepcopy({i: dict(inner.state[p]) for i, p in enumerate(params)})
        opt.step(scale=4.0, grad_norms=norms)
    rec = opt.last_record
    assert rec is not None and all(pr.extra["grad_scale"] > 4.0 for g in rec.groups for pr in g.params)
    opt.undo()
    for i, p in enumerate(params):
        assert ulp_error(p.detach(), before[i]) <= 2.0
        assert inner.state[p]["step"] == state[i]["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert ulp_error(inner.state[p][key], state[i][key]) <= 2.0, key
